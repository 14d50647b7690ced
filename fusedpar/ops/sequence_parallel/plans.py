"""Plans of ring attention, from shapes alone (the same on every rank): the contiguous runs each
rank's shard holds in a layout (:func:`shard_chunks`), the kernel launches of one (query shard, key
block) pair under the causal mask and a window (:func:`ring_step_plan`), how far each K/V block
must travel (:func:`ring_rounds`) and the steps that follow (:func:`ring_schedule`); and packed
documents: ``cu_seqlens`` (global document boundaries, the same on every rank) turned into the
flash kernels' segment tables of every (local query chunk, key chunk) pair a rank meets on the
ring (:func:`document_plan`, :func:`ring_document_plan`), without communication."""
from __future__ import annotations

import bisect
import functools

import torch

from fusedpar.kernels.checks import check_int, check_tensor
from fusedpar.kernels.flash_attention import Segments
from fusedpar.kernels.flash_varlen import check_cu_seqlens_values
from fusedpar.ops.common import checked_api


# ----------------------------------------------------------------------------------------------
# Ring schedule
# ----------------------------------------------------------------------------------------------
def document_plan(cu_seqlens, layout: str, rank: int, size: int, s_local: int, causal: bool, device,
                  window=(-1, -1)) -> tuple:
    """Per ring step, the segment tables of packed documents (``cu_seqlens``: global boundaries
    of the ``s_local * size`` tokens) for ring rank ``rank``'s shard in ``layout``: see
    :mod:`fusedpar.ops.sequence_parallel.plans` (cached; empty at steps with nothing visible under the causal
    mask and the ``window``)."""
    bounds = document_bounds(cu_seqlens, s_local * size)
    q_chunks = tuple(shard_chunks(layout, rank, size, s_local))
    k_chunks = tuple(tuple(shard_chunks(layout, (rank - t) % size, size, s_local)) for t in range(size))
    return ring_document_plan(bounds, q_chunks, k_chunks, bool(causal), torch.device(device), tuple(window))


def shard_chunks(layout: str, rank: int, size: int, s_local: int) -> list:
    """``[(local_start, length, global_start)]``: the contiguous runs of ring rank ``rank``'s
    shard of ``s_local`` tokens (one run for ``"contiguous"``, two for ``"zigzag"``)."""
    if layout == "contiguous" or size == 1:
        return [(0, s_local, rank * s_local)]
    c = s_local // 2
    return [(0, c, rank * c), (c, c, (2 * size - 1 - rank) * c)]


def ring_step_plan(q_chunks, k_chunks, causal: bool, window=(-1, -1)) -> list:
    """Kernel launches for one (query shard, key block) pair of a ring step, from the two
    shards' :func:`shard_chunks`:
    ``[(q_slice, k_slice, q_offset, k_offset, masked)]``. ``window``: ``(left, right)`` in global
    positions, -1 unbounded (``causal`` sets ``right = 0``). Chunk pairs that the mask hides
    completely are dropped; runs of fully visible chunks are merged into one unmasked launch;
    ``masked`` launches take the mask (causal, window) at the chunks' global offsets."""
    sq = sum(c[1] for c in q_chunks)
    sk = sum(c[1] for c in k_chunks)
    left, right = window[0], 0 if causal else window[1]
    if left < 0 and right < 0:
        return [(slice(0, sq), slice(0, sk), 0, 0, False)]

    def kind(qc, kc):
        (_, ql, qg), (_, kl, kg) = qc, kc
        if (right >= 0 and kg > qg + ql - 1 + right) or (left >= 0 and kg + kl - 1 < qg - left):
            return "hidden"
        if (right < 0 or kg + kl - 1 <= qg + right) and (left < 0 or kg >= qg + ql - 1 - left):
            return "visible"
        return "masked"

    kinds = {(i, j): kind(qc, kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(k_chunks)}
    if all(t == "visible" for t in kinds.values()):
        return [(slice(0, sq), slice(0, sk), 0, 0, False)]
    launches, done = [], set()
    nq, nk = len(q_chunks), len(k_chunks)

    def sl(c):
        return slice(c[0], c[0] + c[1])

    if nq > 1:
        for j, kc in enumerate(k_chunks):
            if all(kinds[i, j] == "visible" for i in range(nq)):
                launches.append((slice(0, sq), sl(kc), 0, 0, False))
                done |= {(i, j) for i in range(nq)}
    if nk > 1:
        for i, qc in enumerate(q_chunks):
            if all(kinds[i, j] == "visible" and (i, j) not in done for j in range(nk)):
                launches.append((sl(qc), slice(0, sk), 0, 0, False))
                done |= {(i, j) for j in range(nk)}
    for (i, j), t in kinds.items():
        if (i, j) in done or t == "hidden":
            continue
        qc, kc = q_chunks[i], k_chunks[j]
        launches.append((sl(qc), sl(kc), qc[2], kc[2], t == "masked"))
    return launches


@functools.lru_cache(maxsize=256)
def ring_rounds(layout: str, size: int, s_local: int, causal: bool, window=(-1, -1)) -> tuple:
    """``(forward, backward)``: how many hops each K/V block travels forward (to ``rank + 1``,
    ``rank + 2``, ...) and backward (to ``rank - 1``, ...) round a ring of ``size`` ranks holding
    ``s_local`` tokens each in ``layout``, so that every rank meets every key block some of its
    queries see under the causal mask and the ``window`` (global positions, -1 unbounded).

    The block of ring rank ``r`` held by rank ``r + t`` (``t`` the block's forward offset) is
    needed where :func:`ring_step_plan` launches something for that pair, for any ``r``; the
    rounds are the fewest ``forward + backward`` covering every needed offset with
    ``1..forward`` and ``size - backward..size - 1``. Without a window (or a window reaching over
    the ring) that is the full ring, ``(size - 1, 0)``. Shapes, layout and window only (no data,
    not even ``cu_seqlens``): every rank of the ring derives the same rounds, so every send has
    its receive. A causal ``window=(w, 0)`` over the contiguous layout gives
    ``(ceil(w / s_local), 0)``; over the zigzag layout, whose chunk ``2P-1-r`` neighbours rank
    ``r - 1``'s, ``(n, n)`` with ``n = ceil(w / (s_local / 2))`` (the full ring once ``2n``
    reaches ``size - 1``).
    """
    needed = set()
    for rank in range(size):
        q_chunks = shard_chunks(layout, rank, size, s_local)
        for offset in range(1, size):
            if ring_step_plan(q_chunks, shard_chunks(layout, (rank - offset) % size, size, s_local), causal, window):
                needed.add(offset)
    best = (size - 1, 0)
    for forward in range(size - 1):
        later = [t for t in needed if t > forward]
        backward = size - min(later) if later else 0
        if forward + backward < sum(best):
            best = (forward, backward)
    return best


def ring_schedule(rounds, size: int) -> list:
    """The steps of a ring of ``size`` with ``rounds`` (:func:`ring_rounds`) as ``(offset,
    direction, hop)``: this rank's own block (offset 0), then the blocks arriving from behind
    (direction 1, hop ``t``: ring rank ``rank - t``, offset ``t``), then those from ahead
    (direction -1, hop ``u``: ring rank ``rank + u``, offset ``size - u``)."""
    forward, backward = rounds
    return [(t, 1, t) for t in range(forward + 1)] + [(size - u, -1, u) for u in range(1, backward + 1)]


def document_bounds(cu_seqlens, total: int) -> tuple:
    """The boundaries of ``cu_seqlens`` as a tuple of ints after checking them: an int32 1-D
    tensor (any device) starting at 0, non-decreasing, ending at ``total``."""
    check_tensor("cu_seqlens", cu_seqlens, dims=(1,), dtypes=(torch.int32,))
    vals = tuple(cu_seqlens.tolist())
    check_cu_seqlens_values("cu_seqlens", vals, total, total_name="the full packed length")
    return vals


@checked_api
def document_positions(cu_seqlens, total: int | None = None) -> torch.Tensor:
    """Position of every token inside its document (int64 ``[total]``, restarting at 0 at each
    boundary): the default rotary positions of a packed row. ``total`` defaults to
    ``cu_seqlens[-1]``; given, the boundaries must end at it. The values (start at 0, non-decreasing,
    last = ``total``) are checked when ``cu_seqlens`` is on the CPU (eager; a device tensor is not read
    for it)."""
    check_tensor("cu_seqlens", cu_seqlens, dims=(1,), dtypes=(torch.int32, torch.int64))
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must have num_docs + 1 >= 1 entries, got 0")
    if total is not None:
        check_int("total", total, min_value=0)
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():  # values: read on the host only
        vals = cu_seqlens.tolist()
        check_cu_seqlens_values("cu_seqlens", vals, vals[-1] if total is None else total, total_name="total")
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1]) if total is None else total
    idx = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:], idx, right=True).clamp_max(cu.numel() - 1)
    return idx - cu[doc]


def chunk_pair_segments(bounds, q_chunk, k_chunk, causal: bool, window=(-1, -1)) -> list:
    """Segment rows ``[q_start, q_end, k_start, k_end, shift]`` (local indices) of the documents
    shared by a query chunk and a key chunk, each ``(local_start, length, global_start)``.
    Parts that the causal mask or ``window`` (``(left, right)`` in global positions, -1
    unbounded) hide completely are dropped."""
    (ql0, qlen, qg), (kl0, klen, kg) = q_chunk, k_chunk
    left, right = window[0], 0 if causal else window[1]
    rows = []
    first = bisect.bisect_right(bounds, qg) - 1  # the document holding position qg
    for d in range(max(first, 0), len(bounds) - 1):
        ds, de = bounds[d], bounds[d + 1]
        if ds >= qg + qlen:
            break
        qa, qb = max(ds, qg), min(de, qg + qlen)
        ka, kb = max(ds, kg), min(de, kg + klen)
        if qa >= qb or ka >= kb or (right >= 0 and ka > qb - 1 + right) or (left >= 0 and kb - 1 < qa - left):
            continue
        rows.append([ql0 + qa - qg, ql0 + qb - qg, kl0 + ka - kg, kl0 + kb - kg, qa - ka])
    return rows


@functools.lru_cache(maxsize=256)
def ring_document_plan(bounds: tuple, q_chunks: tuple, k_chunks_per_step: tuple, causal: bool, device,
                       window: tuple = (-1, -1)) -> tuple:
    """Per ring step, the :class:`Segments` to launch (one per chunk pair that shares a visible
    document part; none for a step with nothing visible). ``q_chunks``: this rank's chunks;
    ``k_chunks_per_step``: the chunks of the key block held at each step; ``window``: the
    attention window ``(left, right)`` in global positions (-1 unbounded)."""
    plan = []
    for k_chunks in k_chunks_per_step:
        step = []
        for qc in q_chunks:
            for kc in k_chunks:
                rows = chunk_pair_segments(bounds, qc, kc, causal, window)
                if rows:
                    table = torch.tensor(rows, dtype=torch.int32).to(device)
                    step.append(Segments(table, max(r[1] - r[0] for r in rows), max(r[3] - r[2] for r in rows)))
        plan.append(tuple(step))
    return tuple(plan)
