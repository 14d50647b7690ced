"""How each parameter of a parallel module sits in the full tensor, declared once by its module.

A :class:`Placement` says, for one parameter:

* its **role**: ``"tp"`` (a block of a tensor-parallel split over ``group``), ``"ep"`` (a block of
  the experts over the expert-parallel ``group``) or ``None`` (every rank holds the whole tensor);
* the split dimension ``dim`` and its **sections**: the full tensor's ``dim`` is a concatenation
  of sections (``[gate; up]`` rows of a gated weight, ``[q; k; v]`` rows of a fused attention
  projection; one section otherwise) and rank ``r`` holds block ``r`` of every section, in order;
* optional **replicas** per section (tensor parallelism only): ``replicas[c] = f`` means section
  ``c`` is split into ``P / f`` blocks and ``f`` consecutive ranks hold the same block (rank ``r``
  holds block ``r // f``): the k / v rows of an attention projection with fewer kv heads than tp
  ranks, each rank keeping the kv head its q heads use (Megatron / vLLM's kv replication). The
  full tensor has one copy (checkpoints, export); a module that holds replicated rows makes
  their gradient whole before it reaches ``p.grad`` (``ParallelAttention``), so the gradient kind
  stays "dense";
* its **gradient kind** for :func:`fusedpar.parallel.sync_gradients`: ``"dense"`` (each rank's
  gradient is whole for the tokens its tp group holds: tensor-parallel shards and copies that see
  all of those tokens), ``"replicated"`` (a copy whose gradient covers only this rank's sequence
  shard of the tp group's tokens: norms, embedding, router, replicated weights run on the token
  shard; summed over tp too) or ``"expert"`` (summed over the ranks holding the same experts).

Every parallel module declares its parameters in a ``placements()`` method returning
``{name relative to the module: Placement}`` (its own parameters, or a child's that the module
alone knows the context of: ``Transformer`` declares its embedding table).
:func:`parameter_placements` collects them for a whole model; checkpointing (save, load, reshard,
``full_state``), :func:`~fusedpar.nn.merge_shards`, ``from_linear``, the gradient sync plan and
``fusedpar.hf`` (load, export, parallelize) all read that, and nothing else, so a new parallel
module that declares its parameters gets all of them with no edit elsewhere.

The declaration is a fusedpar type rather than DTensor placements on the parameters: the
kernels and custom ops take local tensors (a DTensor parameter would need a sharding rule for
every custom op, or a ``to_local`` in every forward), sections of unequal sizes (``[q; k; v]``
with fewer kv heads) have no DTensor placement, and fusedpar's modules run on any process group,
not only a ``DeviceMesh`` dimension. Checkpoints still give DCP DTensors, built from the
placements at save / load time.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fusedpar.ops import comm

__all__ = ["GRAD_KINDS", "ROLES", "Placement", "checkpoint_buffers", "gradient_sync_plan", "parameter_placements"]

#: gradient kinds of :func:`fusedpar.parallel.sync_gradients`
GRAD_KINDS = ("dense", "replicated", "expert")
#: what a parameter is split over
ROLES = (None, "tp", "ep")


@dataclasses.dataclass(frozen=True)
class Placement:
    """One parameter's place in the full tensor (see the module docstring). ``group`` is the
    process group of the role (``None``: the default group; ignored when ``role`` is ``None``);
    ``sections`` the full sizes of the sections of ``dim``, or a count of equal ones."""

    role: str | None = None
    group: object = None
    dim: int = 0
    sections: tuple[int, ...] | int = 1
    grad: str = "dense"
    replicas: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Placement.role must be one of {ROLES}, got {self.role!r}")
        if self.grad not in GRAD_KINDS:
            raise ValueError(f"Placement.grad must be one of {GRAD_KINDS}, got {self.grad!r}")
        if (self.role == "ep") != (self.grad == "expert"):
            raise ValueError(f"Placement: role 'ep' goes with grad 'expert' and only with it, got role={self.role!r}, "
                             f"grad={self.grad!r}")
        if not isinstance(self.sections, int):
            object.__setattr__(self, "sections", tuple(int(s) for s in self.sections))
        if self.replicas is not None:
            reps = tuple(int(f) for f in self.replicas)
            if self.role != "tp" or self.dim != 0 or isinstance(self.sections, int) or len(reps) != len(self.sections) \
                    or min(reps) < 1:
                raise ValueError(f"Placement.replicas must be positive ints, one per section of a 'tp' placement of "
                                 f"dim 0 with explicit sections, got replicas={self.replicas!r}, "
                                 f"sections={self.sections!r}, role={self.role!r}, dim={self.dim}")
            object.__setattr__(self, "replicas", None if set(reps) == {1} else reps)

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def tp(cls, group, dim: int, sections: tuple[int, ...] | int = 1,
           replicas: tuple[int, ...] | None = None) -> "Placement":
        """A block of ``dim`` over the tensor-parallel ``group`` (gradient "dense"); ``replicas``:
        per section, how many consecutive ranks hold the same block (see the module docstring)."""
        return cls("tp", comm.resolve_group(group), dim, sections, "dense", replicas)

    @classmethod
    def ep(cls, group, dim: int = 0) -> "Placement":
        """A block of the experts (``dim``) over the expert-parallel ``group``."""
        return cls("ep", comm.resolve_group(group), dim, 1, "expert")

    @classmethod
    def replicated(cls, *, sequence_sharded: bool, sections: tuple[int, ...] | int = 1, dim: int = 0) -> "Placement":
        """A whole copy on every rank; ``sequence_sharded``: its gradient covers only this
        rank's sequence shard of its tp group's tokens (kind "replicated"), else "dense"."""
        return cls(None, None, dim, sections, "replicated" if sequence_sharded else "dense")

    # -- the split -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return 1 if self.role is None else comm.group_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.role is None else comm.group_rank(self.group)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def full_sections(self, n_full: int, size: int | None = None) -> list[int]:
        """The full sizes of the sections of a full ``dim`` of size ``n_full`` (each must split
        over ``size`` ranks, default the group's)."""
        size = self.size if size is None else size
        if isinstance(self.sections, int):
            if self.sections < 1 or n_full % self.sections:
                raise ValueError(f"dim {self.dim} of size {n_full} does not split into {self.sections} sections")
            secs = [n_full // self.sections] * self.sections
        else:
            secs = list(self.sections)
            if sum(secs) != n_full:
                raise ValueError(f"sections {secs} do not add up to dim {self.dim} of size {n_full}")
        for sec, f in zip(secs, self.section_replicas(len(secs), size)):
            # a replicated section still splits into `size` pieces: a checkpoint writes one per rank
            if size % f or sec % size:
                raise ValueError(f"section of size {sec} along dim {self.dim} does not split over {size} ranks"
                                 + (f" (its {size // f} blocks held by {f} ranks each)" if f > 1 else ""))
        return secs

    def section_replicas(self, n_sections: int, size: int | None = None) -> list[int]:
        """How many ranks hold each section's block (1 each without ``replicas``; a group of one
        rank holds every section whole)."""
        size = self.size if size is None else size
        if self.replicas is None or size == 1:
            return [1] * n_sections
        return list(self.replicas)

    def local_sections(self, n_local: int, size: int | None = None) -> list[int]:
        """The local sizes of the sections of a local ``dim`` of size ``n_local``."""
        size = self.size if size is None else size
        if self.replicas is not None and size > 1:  # explicit full sizes: each block is sec * f / P
            return [sec * f // size for sec, f in zip(self.full_sections(sum(self.sections), size), self.replicas)]
        return [sec // size for sec in self.full_sections(n_local * size, size)]

    def full_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.dim < len(shape):
            shape[self.dim] = sum(self.sections) if self.replicas is not None and self.size > 1 else \
                shape[self.dim] * self.size
        return tuple(shape)

    def local_from_full(self, full: torch.Tensor, rank: int | None = None, size: int | None = None) -> torch.Tensor:
        """Block ``rank`` of ``size`` (default: this rank's of the group's) of ``full`` (a copy)."""
        rank, P = self.rank if rank is None else rank, self.size if size is None else size
        if P == 1:
            return full.detach().clone()
        secs = self.full_sections(full.shape[self.dim], P)
        parts = full.split(secs, dim=self.dim)
        reps = self.section_replicas(len(secs), P)
        return torch.cat([p.chunk(P // f, dim=self.dim)[rank // f] for p, f in zip(parts, reps)], dim=self.dim).clone()

    def full_from_locals(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's block, in rank order (no communication: the number
        of blocks is the number of ranks); a replicated block is read from its first holder."""
        P = len(blocks)
        if P == 1:
            return blocks[0].detach().clone()
        secs = self.local_sections(blocks[0].shape[self.dim], P)
        parts = [t.split(secs, dim=self.dim) for t in blocks]  # parts[r][c]
        reps = self.section_replicas(len(secs), P)
        return torch.cat([parts[r][c] for c in range(len(secs)) for r in range(0, P, reps[c])], dim=self.dim)

    def dcp_pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``local``, one per section, each this rank's block of a ``P``-way split of the
        full section (what a checkpoint writes as a ``Shard(dim)`` DTensor): a section whose
        block ``f`` ranks hold contributes its ``rank % f``-th ``1 / f`` of the block, so every
        row is written once and the format does not depend on the replication."""
        pieces = self.local_pieces(local)
        reps = self.section_replicas(len(pieces))
        return [p if f == 1 else p.chunk(f, dim=self.dim)[self.rank % f] for p, f in zip(pieces, reps)]

    @torch.no_grad()
    def refill_replicas(self, local: torch.Tensor) -> None:
        """After a checkpoint filled only :meth:`dcp_pieces` of ``local`` in place: rebuild every
        replicated block from its holders' pieces (an all-gather over ``group``; a no-op without
        replicas)."""
        reps = self.section_replicas(len(self.local_pieces(local)))
        if max(reps) == 1:
            return
        P = self.size
        for piece, f, dcp in zip(self.local_pieces(local), reps, self.dcp_pieces(local)):
            if f == 1:
                continue
            buf = torch.empty((P,) + tuple(dcp.shape), dtype=dcp.dtype, device=dcp.device)
            comm.all_gather_into(buf.view(P * dcp.shape[0], *dcp.shape[1:]), dcp.contiguous(), self.group).wait()
            first = (self.rank // f) * f
            piece.copy_(torch.cat([buf[first + i] for i in range(f)], dim=self.dim))

    def full_from_local(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's block over ``group`` and reassemble the full tensor (a
        collective over the group; a copy when not sharded)."""
        P = self.size
        if P == 1:
            return local.detach().clone()
        buf = torch.empty((P,) + tuple(local.shape), dtype=local.dtype, device=local.device)
        comm.all_gather_into(buf.view(P * local.shape[0], *local.shape[1:]), local.detach().contiguous(),
                             self.group).wait()
        return self.full_from_locals(list(buf.unbind(0)))

    def block_range(self, n_local: int) -> tuple[int, int]:
        """``(lo, hi)``: the indices of the full ``dim`` that this rank's block covers, for a local
        ``dim`` of size ``n_local`` (one section only: e.g. this rank's experts, read from a
        checkpoint without reading the others)."""
        if self.local_sections(n_local) != [n_local]:
            raise ValueError(f"block_range: a block of sections {self.sections} is not one range of dim {self.dim}")
        return self.rank * n_local, (self.rank + 1) * n_local

    def local_pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``local``, one per section (this rank's block of each)."""
        return list(local.split(self.local_sections(local.shape[self.dim]), dim=self.dim))


def parameter_placements(model: nn.Module, *, default: Placement | None = None) -> dict[str, Placement]:
    """Parameter name -> :class:`Placement` for every parameter of ``model``, from the
    ``placements()`` declarations of its modules. A parameter nobody declares gets ``default``;
    without one it raises ``ValueError`` naming it (a guess would checkpoint or reduce it
    wrongly). A parameter declared twice, or a declared name that is no parameter, raises too."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, Placement] = {}
    for mname, mod in model.named_modules():
        declare = getattr(mod, "placements", None)
        if not callable(declare):
            continue
        prefix = f"{mname}." if mname else ""
        for rel, placement in declare().items():
            try:
                p = mod.get_parameter(rel)
            except AttributeError:
                raise ValueError(f"{type(mod).__name__} {mname or '(root)'!r} declares a placement for {rel!r}, "
                                 "which is not one of its parameters") from None
            name = canonical.get(id(p), prefix + rel)
            if name in out and out[name] != placement:
                raise ValueError(f"parameter {name!r} has two placements: {out[name]} and {placement} "
                                 f"(the second from {type(mod).__name__} {mname or '(root)'!r})")
            out[name] = placement
    for name, p in model.named_parameters():
        if name in out:
            continue
        if default is None:
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            raise ValueError(
                f"parameter {name!r} (in a {type(owner).__name__} module) has no placement: no module declares how it is "
                "sharded and how its gradient is reduced; declare it in its module's placements() "
                "(see fusedpar.nn.placement)")
        out[name] = default
    return out


def checkpoint_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffer name -> buffer for every buffer a module of ``model`` declares in a
    ``checkpoint_buffers()`` method (names relative to it): state that is not a parameter but
    must survive a resume (the router's ``e_score_correction_bias``). Such buffers are replicated
    (identical on every rank); checkpoints save and load them like replicated parameters."""
    out = {}
    for mname, mod in model.named_modules():
        declare = getattr(mod, "checkpoint_buffers", None)
        if not callable(declare):
            continue
        prefix = f"{mname}." if mname else ""
        for rel in declare():
            out[prefix + rel] = mod.get_buffer(rel)
    return out


def gradient_sync_plan(model: nn.Module, *, default: Placement | None = None) -> dict[str, str]:
    """Parameter name -> gradient kind (for :func:`fusedpar.parallel.sync_gradients`), read from
    :func:`parameter_placements` (same ``default``)."""
    return {name: pl.grad for name, pl in parameter_placements(model, default=default).items()}
