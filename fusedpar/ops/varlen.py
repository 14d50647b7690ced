"""Packed documents in sequence-parallel attention: ``cu_seqlens`` (int32 document boundaries in
global positions of the full packed sequence, the same tensor on every rank) turned into the
flash kernels' segment tables (:class:`fusedpar.kernels.flash_attention.Segments`).

Every rank knows every document boundary, so each rank computes, without communication, the
table of every (local query chunk, key chunk) pair it meets on the ring: for each document that
overlaps both chunks, one segment ``(q rows, k rows, shift)`` in local row indices, ``shift``
being the difference of the two parts' global start positions (so a causal segment sees key
``j`` from query ``i`` iff their global positions satisfy ``kpos <= qpos``, and a window
``(left, right)`` applies at global positions too). Parts that the causal mask or the window
hide completely and empty parts are dropped, so a ring step whose key block holds nothing
visible to the local queries launches no kernel. Documents may have any length and cross any number of shard
boundaries: only the existing divisibility of the total length by the layout holds.

The plans are cached (keyed by the boundaries, layout, rank, sizes, causal flag, window and
device), so the backward and every layer of a model reuse the forward's tables; reading the boundaries costs
one device-to-host copy per call when ``cu_seqlens`` lives on a GPU (pass a CPU tensor to avoid
the sync).
"""
from __future__ import annotations

import bisect
import functools

import torch

from fusedpar.kernels.checks import check_int, check_tensor
from fusedpar.kernels.flash_attention import Segments
from fusedpar.kernels.flash_varlen import check_cu_seqlens_values
from fusedpar.ops.library import checked_api

__all__ = ["chunk_pair_segments", "document_bounds", "document_positions", "ring_document_plan"]


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
