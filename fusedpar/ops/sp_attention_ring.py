"""The plan of a ring of sequence-parallel attention, from shapes alone (the same on every rank):
the contiguous runs each rank's shard holds in a layout (:func:`shard_chunks`), the kernel
launches of one (query shard, key block) pair under the causal mask and a window
(:func:`ring_step_plan`), how far each K/V block must travel so that every rank meets every block
some of its queries see (:func:`ring_rounds`) and the steps that follow from it
(:func:`ring_schedule`). The schedules that run it are in
:mod:`fusedpar.ops.sp_attention_schedules`.
"""
from __future__ import annotations

import functools

__all__ = ["ring_rounds", "ring_schedule", "ring_step_plan", "shard_chunks"]


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
