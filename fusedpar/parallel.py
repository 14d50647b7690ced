"""Parallel layout: a named ``DeviceMesh`` over dp x pp x tp x sp (+ ep for MoE) and its groups.

Layout (outermost to innermost, the last dimension varies fastest over global ranks)::

    mesh dims   ("pp", "dp", "sp", "tp")     rank = ((pp_i * dp + dp_i) * sp + sp_i) * tp + tp_i

Tensor parallelism is innermost so that its ranks are neighbours (one NVLink island on GPU),
pipeline stages are outermost (their traffic is the lightest).

Hybrid (2-D) sequence parallelism splits the sp dimension into ``sp_ulysses`` (Ulysses all-to-all,
the faster-varying part) x ``sp_ring = sp / sp_ulysses`` (ring attention):
``sp_rank = ring_rank * sp_ulysses + ulysses_rank``. ``ulysses_group`` / ``ring_group`` are the
two sub-groups of the sp group that :class:`~fusedpar.nn.ParallelAttention` takes with
``sp_mode="hybrid"``; this ``sp_rank`` order is the token order of
:func:`fusedpar.nn.shard_tokens` with ``ring_size=sp_ring``.

Expert parallelism does not add a mesh dimension: it *folds over* the ranks that hold different
tokens of one pipeline stage, i.e. the flattened ``(dp, sp, tp)`` ranks (tp fastest). ``ep`` must
divide ``dp * sp * tp``; the expert-parallel group is a block of ``ep`` consecutive ranks in that
order (``ep == tp`` gives the tensor-parallel group, ``ep == sp * tp`` the sp x tp group), and the
expert-data-parallel group ``edp`` joins the ranks that hold the *same* experts (size
``dp * sp * tp / ep``). This works because fusedpar blocks keep activations sequence-sharded over
tp between layers (Megatron sequence parallelism), so every rank of ``(dp, sp, tp)`` routes its own
tokens.

Gradient semantics (what :func:`sync_gradients` implements, and what DDP/FSDP2 reproduce on the
``dp`` dimension):

* the ranks of one tp group share one loss (the vocabulary-parallel loss covers the whole
  tp group's tokens); the ranks of ``data = dp x sp`` hold different tokens, and the global loss is
  the mean of their losses;
* ``"dense"`` parameters (tensor-parallel shards and anything whose gradient already covers the
  whole tp group's tokens) are summed over the data group and divided by its size;
* ``"replicated"`` parameters (norm weights, router, embedding table, MLA's down projections:
  copies on every tp rank that each see only that rank's sequence shard) are summed over data x tp
  (a row-parallel bias is "dense": the reduce-scatter's backward gives every rank the tp group's
  whole gradient);
* ``"expert"`` parameters are summed over the ``edp`` group.
All three are then divided by the number of loss-holding ranks ``dp * sp``. A DDP/FSDP2 wrapper
over ``dp`` only (sp > 1) leaves the sequence part of that rule: ``"dense"`` (and, with ep == tp,
``"expert"``) gradients summed over sp, ``"replicated"`` over sp x tp, then divided by ``sp``
(``sync_gradients(..., data_parallel_done="dp")``).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fusedpar.nn.placement import GRAD_KINDS
from fusedpar.ops import comm

MESH_DIMS = ("pp", "dp", "sp", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """Sizes, this rank's coordinates and the process groups of a parallel layout.

    ``mesh`` is the 4-D ``DeviceMesh`` with dims ``("pp", "dp", "sp", "tp")`` (sub-meshes by
    name: ``state.mesh["dp"]``, ``state.mesh["tp"]``, ...); ``data_mesh`` is the flattened
    ``dp x sp`` mesh (what FSDP2 shards over when sp > 1). Groups are ``None``-free: a size-1
    dimension still has its own (trivial) group.
    """

    mesh: DeviceMesh
    data_mesh: DeviceMesh
    world_size: int
    rank: int
    dp: int
    pp: int
    tp: int
    sp: int
    ep: int
    sp_ulysses: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    sp_rank: int
    ep_rank: int
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    sp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    data_tp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    device: torch.device

    @property
    def sp_ring(self) -> int:
        """Ring size of the sp dimension: ``sp / sp_ulysses``."""
        return self.sp // self.sp_ulysses

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.sp_ulysses

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.sp_ulysses

    @property
    def data_size(self) -> int:
        """Ranks holding different tokens *and* separate losses: ``dp * sp``."""
        return self.dp * self.sp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group(self, name: str) -> dist.ProcessGroup:
        """The group named ``name`` (``dp``, ``pp``, ``tp``, ``sp``, ``ep``, ``edp``, ``data``,
        ``data_tp``, ``ulysses``, ``ring``)."""
        attr = f"{name}_group"
        if not hasattr(self, attr):
            raise ValueError(f"unknown group name {name!r}; expected one of dp, pp, tp, sp, ep, edp, data, data_tp, "
                             "ulysses, ring")
        return getattr(self, attr)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: pp {self.pp_rank}/{self.pp}, dp {self.dp_rank}/{self.dp}, "
                f"sp {self.sp_rank}/{self.sp} (ulysses {self.sp_ulysses} x ring {self.sp_ring}), "
                f"tp {self.tp_rank}/{self.tp}, ep {self.ep_rank}/{self.ep}")


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def resolve_sizes(world_size: int, *, dp: int | None = None, pp: int = 1, tp: int = 1, sp: int = 1,
                  ep: int = 1, sp_ulysses: int = 1) -> dict:
    """Validate a layout against ``world_size`` (no communication); ``dp=None`` takes what is
    left. Returns ``{"dp", "pp", "tp", "sp", "ep", "sp_ulysses"}``."""
    world_size = _check_size("world_size", world_size)
    pp, tp, sp, ep, sp_ulysses = (_check_size(n, v) for n, v in (("pp", pp), ("tp", tp), ("sp", sp), ("ep", ep),
                                                                  ("sp_ulysses", sp_ulysses)))
    if sp % sp_ulysses:
        raise ValueError(f"sp_ulysses={sp_ulysses} must divide sp={sp} (hybrid sequence parallelism splits sp into "
                         "ulysses x ring)")
    inner = pp * tp * sp
    if dp is None:
        if world_size % inner:
            raise ValueError(
                f"world size {world_size} is not divisible by pp*tp*sp = {pp}*{tp}*{sp} = {inner}; "
                "choose sizes whose product divides the world size"
            )
        dp = world_size // inner
    dp = _check_size("dp", dp)
    if dp * inner != world_size:
        raise ValueError(
            f"dp*pp*tp*sp = {dp}*{pp}*{tp}*{sp} = {dp * inner} must equal the world size {world_size}"
        )
    tokens = dp * sp * tp
    if tokens % ep:
        raise ValueError(
            f"ep={ep} must divide dp*sp*tp = {dp}*{sp}*{tp} = {tokens} (expert parallelism folds over the "
            "ranks of one pipeline stage)"
        )
    return dict(dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, sp_ulysses=sp_ulysses)


_UNSET, _NOT_INT = -(1 << 62), -(1 << 62) + 1  # encodings of dp=None and of a value that is no int


def _encode_size(value) -> int:
    if value is None:
        return _UNSET
    if isinstance(value, bool) or not isinstance(value, int):
        return _NOT_INT
    return max(min(value, (1 << 62) - 1), -(1 << 62) + 2)


def _decode_size(code: int) -> str:
    return {_UNSET: "None", _NOT_INT: "a non-int"}.get(code, str(code))


def check_sizes_agree(sizes: Mapping[str, object], *, timeout_s: float = 300.0, group=None) -> None:
    """Every rank of ``group`` (default: the world) passed the same ``sizes`` (``{"dp": ...,
    "tp": ...}``; ``None`` and non-int values are compared as such): one all-gather of a fixed-size
    int64 vector, so the exchange itself cannot mismatch. Every rank then raises the same
    ``ValueError`` naming each size that differs and the ranks that passed each value; a rank that
    does not arrive within ``timeout_s`` makes the others raise ``TimeoutError``."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = tuple(sizes)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([_encode_size(sizes[n]) for n in names], dtype=torch.int64, device=device)
    table = torch.empty(world * len(names), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work = gather(table, mine, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"build_parallel_state: every rank of the world ({world} ranks) must call it to check "
                               f"the sizes {dict(sizes)}, got no answer from some rank within {timeout_s:g} s")
        time.sleep(0.002)
    work.wait()
    rows = table.view(world, len(names)).tolist()
    differ = []
    for j, name in enumerate(names):
        values = sorted({r[j] for r in rows})
        if len(values) > 1:
            by_value = [f"{name}={_decode_size(v)} on ranks {[i for i, r in enumerate(rows) if r[j] == v]}"
                        for v in values]
            differ.append(" and ".join(by_value))
    if differ:
        raise ValueError("build_parallel_state: the sizes must be the same on every rank, got " + "; ".join(differ))


def _agreed_sizes(world: int, sizes: dict, timeout_s: float) -> dict:
    """:func:`resolve_sizes` on every rank, after checking that the ranks agree: a rank compares
    its resolved sizes (``dp=None`` and an explicit equal ``dp`` agree) or, where they do not
    resolve, the sizes it passed; ranks that agree then raise the same validation error."""
    try:
        resolved, error = resolve_sizes(world, **sizes), None
    except (TypeError, ValueError) as e:
        resolved, error = sizes, e
    check_sizes_agree(resolved, timeout_s=timeout_s)
    if error is not None:
        raise error
    return resolved


def _new_groups(blocks: Iterable[list[int]], rank: int, backend) -> dist.ProcessGroup:
    """Create one group per rank list (every rank must call this with the same lists, in the
    same order) and return the one holding ``rank``."""
    mine = None
    for ranks in blocks:
        g = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = g
    if mine is None:
        raise RuntimeError(f"rank {rank} is in none of the groups {list(blocks)}")
    return mine


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(*, dp: int | None = None, pp: int = 1, tp: int = 1, sp: int = 1, ep: int = 1, sp_ulysses: int = 1,
                  backend: str | None = None, device: torch.device | str | None = None,
                  timeout_s: float = 300.0) -> ParallelState:
    """Build the parallel layout from the world.

    If ``torch.distributed`` is not initialised yet, it is initialised from the ``torchrun``
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or as a one-process
    world when none of those is set; under torchelastic through a store prefixed with the restart
    attempt (:func:`elastic_store`), so a restarted world never meets the previous attempt's peers.
    The backend defaults to NCCL when CUDA is available (each
    rank then uses GPU ``LOCAL_RANK``) and gloo otherwise. Sizes are compared across ranks once the world
    is joined and before any group is created (:func:`check_sizes_agree`: ranks passing different
    sizes all raise the same ``ValueError`` instead of hanging), then validated (sizes that do not
    fit the world raise the same error on every rank; in a world of one, before joining it);
    ``dp=None`` takes whatever the other sizes leave.

    The caller ends the world with ``torch.distributed.destroy_process_group()``; a group left up
    at interpreter exit can abort a rank there. No exit hook does it for the caller: it would also
    run on a rank that failed with collectives in flight, where NCCL's teardown is untested.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        world_env = int(os.environ.get("WORLD_SIZE", "1"))
        if world_env == 1:  # nothing to wait for: fail before joining
            resolve_sizes(world_env, dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, sp_ulysses=sp_ulysses)
        # with peers, join even with bad sizes: a rank that left now would leave the others
        # waiting at the rendezvous; build_parallel_state makes every rank raise the same error
        backend = backend or _default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = elastic_store(timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_env,
                                    timeout=timeout)
        elif "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        elif world_env == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            raise RuntimeError(
                f"WORLD_SIZE={world_env} but RANK/MASTER_ADDR are not set: launch with torchrun "
                "(python -m torch.distributed.run --nproc-per-node N ...)"
            )
    return build_parallel_state(dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, sp_ulysses=sp_ulysses, device=device,
                                timeout_s=timeout_s)


def elastic_store(timeout: datetime.timedelta):
    """Under torchelastic (``TORCHELASTIC_RESTART_COUNT`` set), the store to join the default
    process group through: torchrun's rendezvous store, prefixed with the restart attempt.
    torchrun shares one TCP store across restarts, so a restarted group that used it plainly
    would read the previous attempt's (dead) peer addresses and fail to connect. ``None``
    outside torchelastic."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store)
    return dist.PrefixStore(f"fusedpar.attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def build_parallel_state(*, dp: int | None = None, pp: int = 1, tp: int = 1, sp: int = 1, ep: int = 1,
                         sp_ulysses: int = 1, device: torch.device | str | None = None,
                         timeout_s: float = 300.0) -> ParallelState:
    """The layout over an already initialised default process group (every rank must call this,
    with the same sizes: it creates process groups). Before any group is created the ranks check
    that they passed the same sizes (:func:`check_sizes_agree`, one small all-gather on the
    default group, ``timeout_s`` for every rank to arrive): ranks that disagree all raise one
    ``ValueError`` naming the ranks and their sizes; sizes that do not fit the world raise the
    same error on every rank."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_parallel() or init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    s = _agreed_sizes(world, dict(dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, sp_ulysses=sp_ulysses), timeout_s)
    dp, pp, tp, sp, ep, uly = s["dp"], s["pp"], s["tp"], s["sp"], s["ep"], s["sp_ulysses"]
    backend = dist.get_backend()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)

    mesh = init_device_mesh(device.type, (pp, dp, sp, tp), mesh_dim_names=MESH_DIMS)
    data_mesh = mesh["dp", "sp"]._flatten("dp_sp")
    coord = mesh.get_coordinate()
    pp_rank, dp_rank, sp_rank, tp_rank = coord

    # ep / edp / data x tp groups: built explicitly (every rank creates every group, same order)
    stage = dp * sp * tp
    ep_blocks, edp_blocks, data_tp_blocks = [], [], []
    for p in range(pp):
        base = p * stage
        data_tp_blocks.append(list(range(base, base + stage)))
        for b in range(stage // ep):
            ep_blocks.append([base + b * ep + j for j in range(ep)])
        for j in range(ep):
            edp_blocks.append([base + b * ep + j for b in range(stage // ep)])
    ep_group = _new_groups(ep_blocks, rank, None)
    edp_group = _new_groups(edp_blocks, rank, None)
    data_tp_group = _new_groups(data_tp_blocks, rank, None)

    # hybrid sequence parallelism: sp rank s = ring_rank * uly + ulysses_rank inside each sp group
    sp_group = mesh["sp"].get_group()
    sp_blocks = [[((p * dp + d) * sp + s) * tp + t for s in range(sp)]
                 for p in range(pp) for d in range(dp) for t in range(tp)]
    if uly == 1 or uly == sp:  # one of the two is the sp group itself, the other a single rank
        single = dist.new_group([rank], use_local_synchronization=True)
        ulysses_group, ring_group = (single, sp_group) if uly == 1 else (sp_group, single)
    else:
        ulysses_group = _new_groups([b[r * uly:(r + 1) * uly] for b in sp_blocks for r in range(sp // uly)], rank,
                                    None)
        ring_group = _new_groups([b[u::uly] for b in sp_blocks for u in range(uly)], rank, None)

    return ParallelState(
        mesh=mesh, data_mesh=data_mesh, world_size=world, rank=rank,
        dp=dp, pp=pp, tp=tp, sp=sp, ep=ep, sp_ulysses=uly,
        dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, sp_rank=sp_rank, ep_rank=(rank % stage) % ep,
        dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(), tp_group=mesh["tp"].get_group(),
        sp_group=sp_group, ep_group=ep_group, edp_group=edp_group,
        data_group=data_mesh.get_group(), data_tp_group=data_tp_group, ulysses_group=ulysses_group,
        ring_group=ring_group, device=device,
    )


def sync_gradients(named_params: Iterable[tuple[str, torch.nn.Parameter]], state: ParallelState,
                   plan: Mapping[str, str] | None = None, *, data_parallel_done: bool | str = False,
                   bucket_numel: int = 1 << 22) -> None:
    """Reduce gradients in place by the rules in this module's docstring (a manual data-parallel
    step, or what is left of one after a DDP/FSDP2 wrapper). ``plan`` maps parameter names to
    ``"dense"``, ``"replicated"`` or ``"expert"``; a model's ``gradient_sync_plan()`` gives it.
    Without a plan every gradient is ``"dense"``; with one, a parameter it does not name raises
    (a guess would reduce it over the wrong ranks). Gradients are flattened into fp32 buckets per
    group, all-reduced, scaled by ``1 / (dp * sp)`` and copied back. Parameters without a
    gradient are skipped.

    ``data_parallel_done=True`` (or ``"data"``) is for models wrapped in DDP or FSDP2 over the
    data group ``dp x sp`` (which already averaged every gradient over it): only the
    ``"replicated"`` gradients are then summed over the tp group (FSDP2's sharded DTensor gradients
    are reduced shard by shard). ``data_parallel_done="dp"`` is for a wrapper over the ``dp``
    group only: the sequence-parallel rule is then applied here — ``"dense"`` and ``"expert"``
    gradients summed over sp, ``"replicated"`` over sp then tp, all divided by ``sp`` (with sp = 1
    it is the same as ``True``). Expert gradients are right after DDP/FSDP only when their copies
    are exactly the data group (``ep == tp``: the experts are split over the tp group); other
    layouts raise.
    """
    groups, scale = reduction_groups(state, data_parallel_done)
    by_kind = _grads_by_kind(named_params, plan)
    if data_parallel_done and by_kind["expert"] and state.tp != state.ep:
        raise ValueError(
            f"expert gradients after DDP/FSDP over the data group are only right when ep ({state.ep}) equals "
            f"tp ({state.tp}); use sync_gradients(..., data_parallel_done=False) without a DDP/FSDP wrapper"
        )
    for kind, grads in by_kind.items():
        kind_groups = [g for g in groups[kind] if comm.group_size(g) > 1]
        for bucket in _buckets(grads, bucket_numel):
            _reduce_bucket(bucket, kind_groups, scale)


def reduction_groups(state: ParallelState, data_parallel_done: bool | str = False):
    """``({kind: groups to sum over, in order}, scale)`` of :func:`sync_gradients`."""
    if data_parallel_done not in (False, True, "data", "dp"):
        raise ValueError(f"data_parallel_done must be False, True, 'data' or 'dp', got {data_parallel_done!r}")
    if data_parallel_done == "dp":
        sp = (state.sp_group,)
        return {"dense": sp, "replicated": sp + (state.tp_group,), "expert": sp}, 1.0 / state.sp
    if data_parallel_done:
        return {"dense": (), "replicated": (state.tp_group,), "expert": ()}, 1.0
    groups = {"dense": (state.data_group,), "replicated": (state.data_tp_group,), "expert": (state.edp_group,)}
    return groups, 1.0 / state.data_size


def _grads_by_kind(named_params, plan: Mapping[str, str] | None) -> dict[str, list[torch.Tensor]]:
    """The local gradients (DTensor gradients as their local shards) of every kind; every name is
    checked against the plan, with a gradient or not, so that every rank raises alike."""
    by_kind: dict[str, list[torch.Tensor]] = {k: [] for k in GRAD_KINDS}
    for name, p in named_params:
        if plan is None:
            kind = "dense"
        elif name not in plan:
            raise ValueError(f"parameter {name!r} is not in the gradient plan: name its kind, one of {GRAD_KINDS}")
        else:
            kind = plan[name]
        if kind not in by_kind:
            raise ValueError(f"gradient kind of {name!r} must be one of {GRAD_KINDS}, got {kind!r}")
        if p.grad is not None:
            g = p.grad
            by_kind[kind].append(g.to_local() if hasattr(g, "to_local") else g)
    return by_kind


def _reduce_bucket(bucket: list[torch.Tensor], groups: list, scale: float) -> None:
    """Sum ``bucket`` over each of ``groups`` in turn (one fp32 flat buffer), times ``scale``."""
    if not groups:
        if scale != 1.0:
            for g in bucket:
                g.mul_(scale)
        return
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in bucket])
    for group in groups:  # sp then tp: the sum over the sp x tp grid
        comm.all_reduce(flat, group).wait()
    flat.mul_(scale)
    off = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n


def _buckets(grads: list[torch.Tensor], bucket_numel: int):
    bucket, size = [], 0
    for g in grads:
        bucket.append(g)
        size += g.numel()
        if size >= bucket_numel:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
