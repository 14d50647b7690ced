"""Sharded parameters described once, and used three ways: slicing a full tensor into this
rank's shard, gathering shards into the full tensor, and saving / loading with
``torch.distributed.checkpoint`` (DCP) at *any* parallel layout.

A :class:`ShardSpec` says how a local tensor sits in the full one: the full tensor's dimension
``dim`` is cut into sections, and rank ``r`` of ``group`` holds block ``r`` of
each section (two equal sections for the ``[gate; up]`` rows of a gated column-parallel weight,
``[q; k; v]`` rows of unequal sizes for a fused attention projection, one otherwise).
:func:`shard_specs` derives the specs from the fusedpar modules in a model:

* ``ColumnParallelLinear``: weight and bias rows over its tp group (two sections when gated);
* ``RowParallelLinear``: weight columns over its tp group (the bias is replicated);
* ``ParallelAttention``: the fused QKV rows as three sections ``[q; k; v]`` (each rank holds its
  heads of each), the output projection as a row-parallel layer;
* ``MoE``: ``w1`` / ``w2`` experts (dim 0) over its ep group;
* everything else: replicated (no spec).

DCP checkpoints store every parameter as a DTensor over a one-dimensional mesh of its group with
placement ``Shard(dim)`` (one per section when there are several), so the files hold
full logical tensors: a model built at another tp or ep degree loads them by building its own
DTensors, and DCP reads each rank's slice. Replicated tensors are written once (DCP deduplicates
identical chunks). A tensor made of unequal sections (a fused ``[q; k; v]`` projection) is stored
as one DTensor per section.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fusedpar.ops import comm


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """``dim`` of the full tensor is cut into sections (``sections``: their full sizes, or a count
    of equal sections); rank ``r`` of ``group`` holds block ``r`` of every section, in order."""

    group: dist.ProcessGroup | None
    dim: int
    sections: tuple[int, ...] | int = 1

    @property
    def size(self) -> int:
        return comm.group_size(self.group)

    @property
    def rank(self) -> int:
        return comm.group_rank(self.group)

    def full_sections(self, n_full: int) -> list[int]:
        if isinstance(self.sections, int):
            if n_full % self.sections:
                raise ValueError(f"dim {self.dim} of size {n_full} does not split into {self.sections} sections")
            secs = [n_full // self.sections] * self.sections
        else:
            secs = list(self.sections)
            if sum(secs) != n_full:
                raise ValueError(f"sections {secs} do not add up to dim {self.dim} of size {n_full}")
        for sec in secs:
            if sec % self.size:
                raise ValueError(f"section of size {sec} along dim {self.dim} does not split over {self.size} ranks")
        return secs

    def local_sections(self, n_local: int) -> list[int]:
        return [sec // self.size for sec in self.full_sections(n_local * self.size)]

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (a copy)."""
        parts = full.split(self.full_sections(full.shape[self.dim]), dim=self.dim)
        return torch.cat([p.chunk(self.size, dim=self.dim)[self.rank] for p in parts], dim=self.dim).clone()

    def full_from_local(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's shard and reassemble the full tensor (collective over ``group``)."""
        P = self.size
        if P == 1:
            return local.detach().clone()
        buf = torch.empty((P,) + tuple(local.shape), dtype=local.dtype, device=local.device)
        comm.all_gather_into(buf.view(P * local.shape[0], *local.shape[1:]), local.detach().contiguous(),
                             self.group).wait()
        secs = self.local_sections(local.shape[self.dim])
        parts = [b.split(secs, dim=self.dim) for b in buf.unbind(0)]  # parts[r][c]
        return torch.cat([parts[r][c] for c in range(len(secs)) for r in range(P)], dim=self.dim)

    def local_pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``local``, one per section (each the rank's block of that section)."""
        return list(local.split(self.local_sections(local.shape[self.dim]), dim=self.dim))


def shard_specs(model: nn.Module) -> dict[str, ShardSpec | None]:
    """Parameter name -> :class:`ShardSpec` (``None``: replicated) for every parameter of ``model``."""
    from fusedpar.nn.attention import ParallelAttention
    from fusedpar.nn.linear import ColumnParallelLinear, RowParallelLinear
    from fusedpar.nn.moe import MoE

    specs: dict[str, ShardSpec | None] = {name: None for name, _ in model.named_parameters()}
    fused_qkv = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, ParallelAttention) and mod.tp_size > 1:
            # rank t's rows are [its q heads; its k heads; its v heads]: three sections of the
            # standard [q; k; v] fused weight (the tp-ordered full weight depends on the degree)
            d = mod.head_dim
            fused_qkv[f"{mname}.qkv" if mname else "qkv"] = (mod.num_heads * d, mod.num_kv_heads * d,
                                                             mod.num_kv_heads * d)
    for mname, mod in model.named_modules():
        prefix = f"{mname}." if mname else ""
        if mname in fused_qkv:
            spec = ShardSpec(mod.group, 0, fused_qkv[mname])
            specs[prefix + "weight"] = spec
            if mod.bias is not None:
                specs[prefix + "bias"] = spec
        elif isinstance(mod, ColumnParallelLinear) and mod.tp_size > 1:
            spec = ShardSpec(mod.group, 0, 2 if mod.gated else 1)  # gated: [gate rows; up rows]
            specs[prefix + "weight"] = spec
            if mod.bias is not None:
                specs[prefix + "bias"] = spec
        elif isinstance(mod, RowParallelLinear) and mod.tp_size > 1:
            specs[prefix + "weight"] = ShardSpec(mod.group, 1)
        elif isinstance(mod, MoE) and mod.ep_size > 1:
            specs[prefix + "w1"] = ShardSpec(mod.ep_group, 0)
            specs[prefix + "w2"] = ShardSpec(mod.ep_group, 0)
    return {k: v for k, v in specs.items() if k in dict(model.named_parameters())}


def full_state(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as the full tensor, gathered over its group; a
    collective: every rank of every group must call it (same model structure)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            raise ValueError(f"parameter {name!r} has no gradient")
        spec = shard_specs_cache(model)[name]
        out[name] = t.detach().clone() if spec is None else spec.full_from_local(t)
    return out


_SPECS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def shard_specs_cache(model: nn.Module) -> dict[str, ShardSpec | None]:
    """:func:`shard_specs`, computed once per model object."""
    if model not in _SPECS:
        _SPECS[model] = shard_specs(model)
    return _SPECS[model]


# ----------------------------------------------------------------------------------------------
# torch.distributed.checkpoint
# ----------------------------------------------------------------------------------------------
# group object -> {device type -> DeviceMesh}. Keyed by the group itself, weakly: an entry lives
# exactly as long as its group, so a new group can never be handed the mesh of a destroyed one
# (an id() key can: CPython reuses the address of a freed object for the next one).
_MESHES: "weakref.WeakKeyDictionary[object, dict[str, object]]" = weakref.WeakKeyDictionary()


def group_mesh(group, device_type: str):
    """The one-dimensional ``DeviceMesh`` over process group ``group`` (resolved: not ``None``)
    on ``device_type``, built once per group object."""
    from torch.distributed.device_mesh import DeviceMesh

    per_device = _MESHES.setdefault(group, {})
    if device_type not in per_device:
        per_device[device_type] = DeviceMesh.from_group(group, device_type)
    return per_device[device_type]


def dcp_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters as DTensors (sharded ones) or plain tensors (replicated ones), all *views* of
    the model's parameters: ``dcp.save`` writes them, ``dcp.load`` fills them in place."""
    from torch.distributed.tensor import DTensor, Shard

    sd = {}
    specs = shard_specs_cache(model)
    for name, p in model.named_parameters():
        spec = specs[name]
        local = p.data
        if spec is None:
            sd[name] = local
            continue
        mesh = group_mesh(comm.resolve_group(spec.group), local.device.type)
        pieces = spec.local_pieces(local)
        for c, piece in enumerate(pieces):
            key = name if len(pieces) == 1 else f"{name}.section{c}"
            sd[key] = DTensor.from_local(piece, mesh, [Shard(spec.dim)], run_check=False)
    return sd


def save(model: nn.Module, path: str, extra: Mapping[str, torch.Tensor] | None = None) -> None:
    """Save ``model`` (any parallel layout) with DCP into directory ``path``; collective."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": dcp_state_dict(model)}
    if extra:
        sd["extra"] = dict(extra)
    dcp.save(sd, checkpoint_id=path)


def load(model: nn.Module, path: str, extra: Mapping[str, torch.Tensor] | None = None) -> None:
    """Load a checkpoint written by :func:`save` at any layout into ``model`` in place; collective."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": dcp_state_dict(model)}
    if extra:
        sd["extra"] = dict(extra)
    dcp.load(sd, checkpoint_id=path)
