"""Mixture-of-experts routing metadata: a stable counting sort of routed slots by group.

Layout. ``T`` tokens each pick ``k`` experts (``expert_ids [T, k]``); the flat index
``s = t * k + j`` of a (token, choice) pair is its *slot*. Routing metadata sorts the slots by a
group id (an expert, or a (chunk, expert) pair for the expert-parallel pipeline) with a stable
counting sort, so that each group's slots are contiguous and in token order:

* ``counts [G]``      kept slots per group (``min(count, capacity)``),
* ``offsets [G + 1]`` exclusive prefix sum of ``counts`` (int32),
* ``slot_pos [T*k]``  position of each slot in the permuted buffer, ``-1`` when dropped,
* ``sorted_slot [T*k]`` the inverse: the slot at each position, ``-1`` for the unused tail rows
  (positions ``offsets[G] ..``) left by dropped slots.

Everything is computed on the device from device tensors. A group id of ``-1`` means "not
routed" (a slot dropped before the sort). Any other id outside ``[0, G)`` is an error: the
counting kernel drops the slot (nothing is written out of bounds) and counts it in a device flag.
With ``check_ids=True`` (the default) :func:`routing_metadata` reads that flag before it returns
and raises ``ValueError``: on a GPU the flag is copied to pinned host memory right behind the
counting kernel and the host waits for it only after the scatter kernel is queued (one host
synchronisation per call, the GPU does not idle), so a call never returns metadata that silently
dropped ids, and an error always belongs to the call that made it. (An earlier design reported
the flag from a *later* call without waiting: the first results were used as if valid and the
error surfaced in unrelated code.) Nothing can be read on the host while a CUDA graph is being
captured: there ``check_ids=True`` is refused. ``check_ids=False`` reads nothing: out-of-range ids
are dropped, as documented, for callers whose ids are valid by construction or checked elsewhere
(the MoE ops range-check the expert ids themselves, with one wait per layer, and pass
``check_ids=False``).

Layers: ``@triton.jit`` kernels -> :func:`routing_metadata` (validate, allocate, launch) ->
references (plain Python / torch loops, the tests' oracle): :func:`routing_metadata_reference`,
the grouped GEMM's :func:`grouped_matmul_reference` and the whole routed MLP, :func:`moe_mlp_reference`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .checks import check_bool, check_index_tensor
from .launch import launch_kernel
from .runtime import ACTIVATIONS, activation_reference, cdiv, interpreting, next_power_of_2

#: most rows (slots) a routing, permute / combine or grouped-GEMM launch addresses: positions and
#: row indices are int32, and a program's last row block (``pid * BLOCK + arange(BLOCK)``, up to
#: ``rows + BLOCK - 1``) must not wrap either, hence the 2^16 headroom below 2^31
MAX_ROWS = 2**31 - 2**16


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _route_count_kernel(ids_ptr, n, counts_ptr, G, bad_ptr, BLOCK: tl.constexpr, G_PAD: tl.constexpr):
    """counts[pid, g] = number of slots of block ``pid`` whose group id is ``g``; ``bad[0]`` +=
    the slots whose id is neither ``-1`` nor in ``[0, G)`` (they are counted nowhere else)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    raw = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
    ids = tl.where((raw >= 0) & (raw < G), raw, -1).to(tl.int32)
    g = tl.arange(0, G_PAD)
    onehot = (ids[:, None] == g[None, :]).to(tl.int32)
    cnt = tl.sum(onehot, axis=0)
    tl.store(counts_ptr + pid.to(tl.int64) * G + g, cnt, mask=g < G)
    bad = tl.sum(((raw != -1) & ((raw < 0) | (raw >= G))).to(tl.int32), axis=0)
    if bad > 0:
        tl.atomic_add(bad_ptr, bad)


@triton.jit
def _route_scatter_kernel(ids_ptr, n, prefix_ptr, offsets_ptr, G, capacity, slot_pos_ptr, sorted_slot_ptr,
                          BLOCK: tl.constexpr, G_PAD: tl.constexpr):
    """Stable positions: rank of a slot inside its group = slots of that group in earlier blocks
    (``prefix``) + earlier slots of that group in this block (a cumulative sum of the one-hot)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    raw = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (raw >= 0) & (raw < G)
    ids = tl.where(valid, raw, -1).to(tl.int32)
    g = tl.arange(0, G_PAD)
    onehot = (ids[:, None] == g[None, :]).to(tl.int32)
    within = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    safe = tl.where(valid, ids, 0)
    rank = tl.load(prefix_ptr + pid.to(tl.int64) * G + safe, mask=valid, other=0) + within
    keep = valid & (rank < capacity)
    pos = tl.load(offsets_ptr + safe, mask=valid, other=0) + rank
    tl.store(slot_pos_ptr + offs, tl.where(keep, pos, -1).to(slot_pos_ptr.dtype.element_ty), mask=in_range)
    tl.store(sorted_slot_ptr + pos, offs.to(sorted_slot_ptr.dtype.element_ty), mask=keep)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
def _block_for_groups(G_PAD):
    """Slots per routing program: the one-hot tile is BLOCK x G_PAD, keep it <= 16K elements."""
    if interpreting():
        return 64
    return max(16, min(1024, 16384 // G_PAD))


def _check_routing_args(group_ids, num_groups, capacity, check_ids):
    check_index_tensor("group_ids", group_ids, dims=tuple(range(1, 9)))
    check_bool("check_ids", check_ids)
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    if group_ids.numel() > MAX_ROWS:
        raise ValueError(f"group_ids must have at most {MAX_ROWS} slots (int32 positions), got {group_ids.numel()}")


def _raise_for(bad: int, num_groups: int) -> None:
    if bad:
        raise ValueError(f"group_ids must lie in [0, {num_groups}) (or be -1: not routed), got {bad} id(s) "
                         "outside it (those slots were dropped)")


class _IdCheck:
    """The out-of-range flag of one :func:`routing_metadata` call on its way to the host: a CPU
    flag is read at once; a CUDA flag is copied to pinned memory behind the counting kernel and
    :meth:`wait` (called once the scatter kernel is queued) waits for that copy only."""

    def __init__(self, bad: torch.Tensor, num_groups: int):
        self.num_groups = num_groups
        self._host = self._event = None
        if bad.device.type == "meta":
            return  # a shape-only launch (the compile check): there are no ids to check
        if bad.device.type != "cuda":
            _raise_for(int(bad.item()), num_groups)
            return
        self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        self._host.copy_(bad, non_blocking=True)  # on the current stream of bad's device
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(bad.device))

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            _raise_for(int(self._host.item()), self.num_groups)


def routing_metadata(group_ids: torch.Tensor, num_groups: int, *, capacity: int | None = None,
                     check_ids: bool = True):
    """Stable counting sort of slots by group, on the device (no host sync unless ``check_ids``
    on a GPU: one wait for the out-of-range flag).

    group_ids: ``[T, k]`` (or any shape; flattened in slot order) int32/int64 group of each slot;
    ``-1`` means "not routed" (dropped before the sort). capacity: keep at most this many slots
    per group, the first ones in slot (= token) order; the rest are dropped. check_ids: ids
    outside ``[0, num_groups)`` other than ``-1`` raise ``ValueError`` from this call (on a GPU
    one host wait for a 4-byte flag, after both kernels are queued; refused while a CUDA graph is
    captured); ``False``: no host read, they are dropped silently (see the module docstring).

    Returns ``(counts [G] int32, offsets [G+1] int32, slot_pos [n] int32, sorted_slot [n] int32)``
    with ``n = group_ids.numel()`` (see the module docstring).
    """
    _check_routing_args(group_ids, num_groups, capacity, check_ids)
    if check_ids and group_ids.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError("routing_metadata: check_ids=True reads an out-of-range flag on the host, which cannot "
                         "happen while a CUDA graph is captured; pass check_ids=False (ids outside [0, num_groups) "
                         "other than -1 are then dropped) for ids that are valid by construction")
    n = group_ids.numel()
    dev = group_ids.device
    ids = group_ids.reshape(-1).contiguous()
    G = num_groups
    G_PAD = max(2, next_power_of_2(G))
    BLOCK = _block_for_groups(G_PAD)
    nb = max(1, cdiv(n, BLOCK))
    block_counts = torch.empty((nb, G), device=dev, dtype=torch.int32)
    slot_pos = torch.empty((n,), device=dev, dtype=torch.int32)
    sorted_slot = torch.full((n,), -1, device=dev, dtype=torch.int32)
    if n == 0:
        counts = torch.zeros((G,), device=dev, dtype=torch.int32)
        return counts, torch.zeros((G + 1,), device=dev, dtype=torch.int32), slot_pos, sorted_slot
    bad = torch.zeros((1,), device=dev, dtype=torch.int32)
    launch_kernel(_route_count_kernel, (nb,), (ids, n, block_counts, G, bad), dict(BLOCK=BLOCK, G_PAD=G_PAD))
    id_check = _IdCheck(bad, G) if check_ids else None
    # the scan over blocks is a device cumsum (no sync): slots of each group in earlier blocks
    incl = torch.cumsum(block_counts, dim=0, dtype=torch.int32)
    prefix = incl - block_counts
    counts = incl[-1]
    cap = n if capacity is None else capacity
    if capacity is not None:
        counts = counts.clamp(max=capacity)
    offsets = torch.zeros((G + 1,), device=dev, dtype=torch.int32)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    launch_kernel(
        _route_scatter_kernel, (nb,),
        (ids, n, prefix, offsets, G, cap, slot_pos, sorted_slot),
        dict(BLOCK=BLOCK, G_PAD=G_PAD))
    if id_check is not None:
        id_check.wait()  # the host waits here, with every kernel of the call queued
    return counts.to(torch.int32), offsets, slot_pos, sorted_slot


# --------------------------------------------------------------------------------------------
# references (plain torch; the tests' oracle)
# --------------------------------------------------------------------------------------------
def routing_metadata_reference(group_ids: torch.Tensor, num_groups: int, capacity: int | None = None):
    """Python loop version of :func:`routing_metadata` (CPU, int64)."""
    ids = group_ids.reshape(-1).tolist()
    seen = [0] * num_groups
    kept = []
    for s, g in enumerate(ids):
        if 0 <= g < num_groups:
            if capacity is None or seen[g] < capacity:
                kept.append((g, seen[g], s))
            seen[g] += 1
    counts = [0] * num_groups
    for g, _, _ in kept:
        counts[g] += 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    slot_pos = [-1] * len(ids)
    sorted_slot = [-1] * len(ids)
    for g, r, s in kept:
        slot_pos[s] = offsets[g] + r
        sorted_slot[offsets[g] + r] = s
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_t(counts), as_t(offsets), as_t(slot_pos), as_t(sorted_slot)


def moe_mlp_reference(x, expert_ids, weights, w1, w2, *, activation="swiglu", capacity=None,
                      compute_dtype=torch.float64, b1=None, b2=None):
    """A plain per-expert loop: ``sum_j weights[t, j] * mlp_{e}(x[t])`` over the kept slots
    (slots of an expert beyond ``capacity``, in token order, are dropped); ``mlp_e(x) =
    act(x W1_e^T + b1_e) W2_e^T + b2_e``, the expert biases optional."""
    T, k = expert_ids.shape
    E = w1.shape[0]
    xs = x.to(compute_dtype).cpu()
    out = torch.zeros((T, x.shape[1]), dtype=compute_dtype)
    seen = [0] * E
    ids = expert_ids.cpu().tolist()
    wts = weights.to(compute_dtype).cpu()
    w1c, w2c = w1.to(compute_dtype).cpu(), w2.to(compute_dtype).cpu()
    b1c, b2c = ((torch.zeros(w.shape[:2], dtype=compute_dtype) if b is None else b.to(compute_dtype).cpu())
                for b, w in ((b1, w1), (b2, w2)))
    for t in range(T):
        for j in range(k):
            e = ids[t][j]
            keep = capacity is None or seen[e] < capacity
            seen[e] += 1
            if keep:
                h = activation_reference(xs[t] @ w1c[e].t() + b1c[e], activation)
                out[t] += wts[t, j] * (h @ w2c[e].t() + b2c[e])
    return out


def grouped_matmul_reference(x, weight, offsets: Sequence[int], *, weight_layout="nk", activation="none",
                             compute_dtype=torch.float64, bias=None):
    """Per-group loop: ``act(x[rows_g] @ W_{g % E} + bias[g % E])``; rows past the last group are zero."""
    offsets = [int(v) for v in offsets]
    E = weight.shape[0]
    w = weight.to(compute_dtype)
    if weight_layout == "nk":
        w = w.transpose(1, 2)
    _, glu = ACTIVATIONS[activation]
    n = w.shape[2] // 2 if glu else w.shape[2]
    out = torch.zeros((x.shape[0], n), dtype=compute_dtype)
    xs = x.to(compute_dtype).cpu()
    w = w.cpu()
    for g in range(len(offsets) - 1):
        a, b = offsets[g], offsets[g + 1]
        if b > a:
            pre = xs[a:b] @ w[g % E]
            if bias is not None:
                pre = pre + bias[g % E].to(compute_dtype).cpu()
            out[a:b] = activation_reference(pre, activation)
    return out
