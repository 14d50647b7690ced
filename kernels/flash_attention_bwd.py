"""Flash attention backward for ``[batch, seq, heads, head_dim]`` tensors: one kernel and its
launcher (conventions as in :mod:`.flash_attention`: global offsets for the causal mask, rows that
see no key contribute nothing, grouped-query heads read in place, any strides, fp32 accumulate mode
for ring attention).

One launch, two kinds of programs (after FlexAttention's Triton backward): the first
``cdiv(seq_k, BLOCK_M) * batch * kv_heads`` programs each own BLOCK_M keys of a kv head and stream
BLOCK_N-row query blocks of every query head of its group (``S^T = K Q^T``, ``dV += P^T dO``,
``dP^T = V dO^T``, ``dK += dS^T Q``: the GQA sum without atomics); the others each own BLOCK_M
query rows of a query head and stream BLOCK_N-key blocks (``S = Q K^T``, ``dP = dO V^T``, ``dQ +=
dS K``). Every product has the program's own BLOCK_M (64 or 128) rows as its M dimension, so on
Hopper all of them compile to warpgroup MMA (wgmma), the streamed 32 or 64 rows being N or the
contraction. One launch rather than a dQ launch beside a dK/dV launch: the two kinds fill the GPU
together (no idle tail between two launches; on a causal mask a dK/dV program's work falls with
its key block while a dQ program's grows), one autotuned config and one launch plan; the price is
one register allocation for both kinds (the dK/dV program's, the larger: both its accumulators).
Each program visits only the blocks some row sees, masks only the blocks at the diagonal, window
edges and tails, and scales scores by ``softmax_scale * log2(e)`` in the multiply-add that feeds
``exp2`` (the forward's rounding; a pre-scaled K would round again in 16 bits).

Two ways to get dQ (``dq_mode``, :data:`DQ_MODES`): "separate" (default), the dQ programs above
(7 matrix products of ``s^2 d`` per head): deterministic. "atomic" is the one-pass backward of
flash-attention 2: dK/dV programs only (``DQ_ATOMIC``), each also forming its (query block, key
block) part ``dS K`` of dQ and adding it with fp32 atomics (5 products); the order of those
additions, and so dq's bits, vary between runs on a GPU.

Layers: ``_attn_bwd_kernel`` (jit; the inner loops ``_dkdv_inner`` / ``_dq_inner`` are shared by
every variant) -> :func:`flash_attention_backward` (validate, allocate, launch);
:func:`attention_delta` is the row term both kinds read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_buffer, check_same, check_shape, check_tensor, output_buffer
from .flash_attention import (
    LOG2E,
    check_qkv,
    check_segments,
    launch_attention_kernel,
    option_flags,
    program_tile,
    resolve_offsets,
    resolve_softmax_scale,
    score_args,
    score_options,
    window_keys,
)
from .gemm_loads import ensure_scratch_allocator, tma_capable

__all__ = ["DEFAULT_DQ_MODE", "DQ_MODES", "TMA_MAX_HEAD_DIM", "attention_delta", "backward_loads", "check_dq_mode",
           "flash_attention_backward", "sink_grad"]

#: how the backward computes dQ (:func:`flash_attention_backward`): "separate", programs of its
#: own (deterministic), or "atomic", the one-pass backward (fp32 atomics; the bits vary between runs)
DQ_MODES = ("separate", "atomic")
#: the default until a GPU round has timed both (``python -m benchmarks attention``: ``bwd_ms``
#: against ``bwd_atomic_ms``)
DEFAULT_DQ_MODE = "separate"


def check_dq_mode(dq_mode) -> str:
    """``dq_mode`` is one of :data:`DQ_MODES`."""
    if not isinstance(dq_mode, str):
        raise TypeError(f"dq_mode must be one of {DQ_MODES}, got {type(dq_mode).__name__}")
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    return dq_mode


# --------------------------------------------------------------------------------------------
# Triton kernel: one launch, the dK/dV programs first, then the dQ programs
# --------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo,
              lo, hi, SK, k_offset, qk_scale, cap_scale, cap2, MASKED: tl.constexpr, RIGHT: tl.constexpr,
              LEFT: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
              HEAD_DIM_V: tl.constexpr, PAD_DV: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              TMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of a program's query rows (the M dimension of every product) over the key blocks
    ``[lo, hi)``: ``S = Q K^T``, ``dP = dO V^T``, ``dQ += dS K``. ``MASKED=False`` only for key
    blocks every row sees whole (no tail, no window or causal cut): no mask is built there. With
    ``TMA`` the K and V blocks load through tensor descriptors of the rows at ``k_base`` /
    ``v_base`` (zero past ``SK`` and a padded head dim, as the masked pointer loads). Key
    ``j`` is visible to a row iff ``q_lo <= k_offset + j <= q_hi``. ``SOFTCAP``: ``s = cap *
    tanh(t)``, ``ds/dt = cap * (1 - tanh^2) = cap * 4e / (1 + e)^2`` with ``e = exp(-2|t|)``."""
    rn = tl.arange(0, BLOCK_N)
    d_ok = rd < HEAD_DIM
    dv_ok = rdv < HEAD_DIM_V
    k_ptrs = k_base + rd[None, :] * s_kd  # K and V rows [BLOCK_N, BLOCK_D(V)]; S and dP read them transposed
    v_ptrs = v_base + rdv[None, :] * s_vd
    if TMA:  # made per loop (its block size): nothing of them stays live between the loops
        k_desc = tl.make_tensor_descriptor(k_base, shape=[SK, HEAD_DIM], strides=[s_ks, 1],
                                           block_shape=[BLOCK_N, rd.shape[0]])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[SK, HEAD_DIM_V], strides=[s_vs, 1],
                                           block_shape=[BLOCK_N, rdv.shape[0]])
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + rn
        kv_rows = cols.to(tl.int64)
        if MASKED:
            n_mask = cols < SK
        if TMA:  # the descriptors zero-fill past the keys and a padded head dim
            k = k_desc.load([n0, 0])
            v = v_desc.load([n0, 0])
        elif MASKED:
            k = tl.load(k_ptrs + kv_rows[:, None] * s_ks, mask=n_mask[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs + kv_rows[:, None] * s_vs, mask=n_mask[:, None] & dv_ok[None, :], other=0.0)
        else:
            if PAD_D:
                k = tl.load(k_ptrs + kv_rows[:, None] * s_ks, mask=d_ok[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs + kv_rows[:, None] * s_ks)
            if PAD_DV:
                v = tl.load(v_ptrs + kv_rows[:, None] * s_vs, mask=dv_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs + kv_rows[:, None] * s_vs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if SOFTCAP:
            t = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * cap_scale
            e = tl.exp2(tl.abs(t) * -2.8853900817779268)
            s = tl.where(t < 0, e - 1.0, 1.0 - e) / (1.0 + e) * cap2
            sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
        else:
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            visible = n_mask[None, :]
            if RIGHT:
                visible = visible & ((k_offset + cols)[None, :] <= q_hi[:, None])
            if LEFT:
                visible = visible & ((k_offset + cols)[None, :] >= q_lo[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * sech2
        if UPCAST:
            dq = tl.dot(ds, k, dq, input_precision=INPUT_PRECISION)
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd, s_os, s_od, s_ls,
                s_gs, s_gd, rd, rdv, n_ok, k_lo, k_hi, lo, hi, SQ, q_offset, qk_scale, sm_scale, cap_scale, cap2,
                MASKED: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
                HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAD_DV: tl.constexpr,
                UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV of a program's BLOCK_M keys (the M dimension of every product) over the query blocks
    ``[lo, hi)``: ``S^T = K Q^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dK += dS^T Q``; with
    ``TMA`` the Q and dO blocks load through tensor descriptors (as in :func:`_dq_inner`). Key
    ``j`` is visible to query row ``i`` iff ``k_lo[j] <= q_offset + i <= k_hi[j]``. ``DQ_ATOMIC`` (the
    one-pass backward): also add this key block's part of dQ, ``dS K * scale``, to the fp32 rows
    at ``dq_base`` with atomics; ``n_ok`` (keys inside the launch) then masks the tail keys'
    scores too (their K rows are 0, but an overflowing ``P`` would give ``inf * 0``). Tail keys
    need no mask otherwise: each feeds only its own (unstored) dK and dV rows."""
    rm = tl.arange(0, BLOCK_N)
    d_ok = rd < HEAD_DIM
    dv_ok = rdv < HEAD_DIM_V
    q_ptrs = q_base + rd[None, :] * s_qd  # Q and dO rows [BLOCK_N, BLOCK_D(V)]; S^T and dP^T read them transposed
    do_ptrs = do_base + rdv[None, :] * s_od
    if TMA:  # made per loop (its block size): nothing of them stays live between the loops
        q_desc = tl.make_tensor_descriptor(q_base, shape=[SQ, HEAD_DIM], strides=[s_qs, 1],
                                           block_shape=[BLOCK_N, rd.shape[0]])
        do_desc = tl.make_tensor_descriptor(do_base, shape=[SQ, HEAD_DIM_V], strides=[s_os, 1],
                                            block_shape=[BLOCK_N, rdv.shape[0]])
    for m0 in range(lo, hi, BLOCK_N):
        rows_i = m0 + rm
        rows = rows_i.to(tl.int64)
        if TMA:
            q = q_desc.load([m0, 0])
            do = do_desc.load([m0, 0])
            if MASKED:
                m_mask = rows_i < SQ
                lse = tl.load(l_base + rows * s_ls, mask=m_mask, other=float("inf"))
            else:
                lse = tl.load(l_base + rows * s_ls)
        elif MASKED:
            m_mask = rows_i < SQ
            q = tl.load(q_ptrs + rows[:, None] * s_qs, mask=m_mask[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_ptrs + rows[:, None] * s_os, mask=m_mask[:, None] & dv_ok[None, :], other=0.0)
            lse = tl.load(l_base + rows * s_ls, mask=m_mask, other=float("inf"))
        else:
            if PAD_D:
                q = tl.load(q_ptrs + rows[:, None] * s_qs, mask=d_ok[None, :], other=0.0)
            else:
                q = tl.load(q_ptrs + rows[:, None] * s_qs)
            if PAD_DV:
                do = tl.load(do_ptrs + rows[:, None] * s_os, mask=dv_ok[None, :], other=0.0)
            else:
                do = tl.load(do_ptrs + rows[:, None] * s_os)
            lse = tl.load(l_base + rows * s_ls)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # rows that see no key (lse = -inf) and tail rows contribute nothing: +inf makes every p 0
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        if SOFTCAP:
            t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * cap_scale
            e = tl.exp2(tl.abs(t) * -2.8853900817779268)
            st = tl.where(t < 0, e - 1.0, 1.0 - e) / (1.0 + e) * cap2
            sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
        else:
            st = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        pt = tl.exp2(st - lse2[None, :])
        if MASKED:
            visible = m_mask[None, :]
            if DQ_ATOMIC:
                visible = visible & n_ok[:, None]
            if RIGHT:
                visible = visible & (k_lo[:, None] <= (q_offset + rows_i)[None, :])
            if LEFT:
                visible = visible & (k_hi[:, None] >= (q_offset + rows_i)[None, :])
            pt = tl.where(visible, pt, 0.0)
        if UPCAST:
            dv = tl.dot(pt, do, dv, input_precision=INPUT_PRECISION)
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        if MASKED:  # loaded late: one tile fewer live while S^T and P^T are (registers at 128 keys, d 128)
            delta = tl.load(d_base + rows * s_ls, mask=m_mask, other=0.0)
        else:
            delta = tl.load(d_base + rows * s_ls)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * sech2
        if not UPCAST:
            dst = dst.to(q.dtype)
        dk = tl.dot(dst, q, dk, input_precision=INPUT_PRECISION)
        if DQ_ATOMIC:  # fp32 adds whose order (and so rounding) varies on a GPU
            if BLOCK_M >= 64:  # (dS K)^T = K^T dS^T [BLOCK_D, BLOCK_N]: the head dim as M (wgmma at 64+)
                dq = tl.dot(tl.trans(k), dst, input_precision=INPUT_PRECISION) * sm_scale
                dq_ptrs = dq_base + rows[None, :] * s_gs + rd[:, None] * s_gd
                dq_ok = m_mask[None, :] & d_ok[:, None] if MASKED else d_ok[:, None]
            else:  # dS K [BLOCK_N, BLOCK_D]: the small tiles' registers (the fp32 FMA tile's) hold it
                dq = tl.dot(tl.trans(dst), k, input_precision=INPUT_PRECISION) * sm_scale
                dq_ptrs = dq_base + rows[:, None] * s_gs + rd[None, :] * s_gd
                dq_ok = m_mask[:, None] & d_ok[None, :] if MASKED else d_ok[None, :]
            if MASKED or PAD_D:
                tl.atomic_add(dq_ptrs, dq, mask=dq_ok, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seg_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_gb, s_gs, s_gh, s_gd,
    s_dkb, s_dks, s_dkh, s_dkd,
    s_dvb, s_dvs, s_dvh, s_dvd,
    s_lb, s_lh, s_ls,
    HQ, GROUP, KV_BH, SQ, SK, q_offset, k_offset, qk_scale, sm_scale, win_left, win_right, cap_scale, cap2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAD_DV: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SEGMENTED: tl.constexpr, DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The backward of one attention block in one launch. Programs ``[0, cdiv(SK, BLOCK_M) *
    KV_BH)`` are dK/dV programs, one per BLOCK_M keys of a (batch or segment, kv head): they stream
    BLOCK_N-row query blocks of every query head of the group (the GQA sum without atomics); the
    rest are dQ programs, one per BLOCK_M query rows of a (batch or segment, query head), streaming
    BLOCK_N-key blocks. Either way the program's own BLOCK_M rows are the M dimension of all its
    products (Hopper wgmma at 64+ rows). ``DQ_ATOMIC`` (``dq_mode="atomic"``): dK/dV programs
    only, each also adding its part of dQ to the fp32 buffer ``dq_ptr``. ``TMA``: the streamed
    tiles load through device-side tensor descriptors of one (batch or segment, head)'s rows, one
    per loop and block size (the host checked that strides and bases are multiples of 16 bytes and
    the head dim contiguous); the resident tiles and the lse / delta rows keep pointer loads.
    ``SINKS`` is unused: a sink enters through ``lse`` only."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(BLOCK_N >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    tl.static_assert(PAD_DV == (BLOCK_DV != HEAD_DIM_V), "PAD_DV says whether BLOCK_DV pads HEAD_DIM_V")
    # masked blocks (diagonal, window edges, tails) stream half blocks: less work wasted on masked
    # entries, and fewer registers where the masks are live
    MASK_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 32 else BLOCK_N
    pid = tl.program_id(0)
    kv_programs = tl.cdiv(SK, BLOCK_M) * KV_BH
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    if pid < kv_programs:
        b, hk, n0, sq, sk, q_row0, k_row0, qo, ko = program_tile(
            pid, seg_ptr, HQ // GROUP, SQ, SK, q_offset, k_offset, True, SEGMENTED, BLOCK_M)
        hk = hk.to(tl.int64)
        rn = n0 + tl.arange(0, BLOCK_M)
        n_mask = rn < sk
        nd_mask = n_mask[:, None] & (rd < HEAD_DIM)[None, :]
        ndv_mask = n_mask[:, None] & (rdv < HEAD_DIM_V)[None, :]
        cols = k_row0 + rn.to(tl.int64)
        k = tl.load(k_ptr + b * s_kb + hk * s_kh + cols[:, None] * s_ks + rd[None, :] * s_kd, mask=nd_mask, other=0.0)
        v = tl.load(v_ptr + b * s_vb + hk * s_vh + cols[:, None] * s_vs + rdv[None, :] * s_vd, mask=ndv_mask,
                    other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        # accumulate mode reads dV back before the loops and dK after dV's store: one tile beside
        # the accumulators at a time (registers at 128 keys)
        if ACCUM:
            dv = tl.load(dv_ptr + b * s_dvb + hk * s_dvh + cols[:, None] * s_dvs + rdv[None, :] * s_dvd, mask=ndv_mask,
                         other=0.0).to(tl.float32)
        else:
            dv = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        k_lo = ko + rn - win_right  # key j is seen by the query positions [k_lo, k_hi]
        k_hi = ko + rn + win_left
        lo, full_lo, full_hi, hi = _query_ranges(n0, sq, sk, qo, ko, win_left, win_right, RIGHT, LEFT, DQ_ATOMIC,
                                                 BLOCK_M, BLOCK_N, MASK_N)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            q_base = q_ptr + b * s_qb + h * s_qh + q_row0 * s_qs
            do_base = do_ptr + b * s_ob + h * s_oh + q_row0 * s_os
            l_base = lse_ptr + b * s_lb + h * s_lh + q_row0 * s_ls
            d_base = delta_ptr + b * s_lb + h * s_lh + q_row0 * s_ls
            dq_base = dq_ptr + b * s_gb + h * s_gh + q_row0 * s_gs
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd,
                                 s_os, s_od, s_ls, s_gs, s_gd, rd, rdv, n_mask, k_lo, k_hi, lo, full_lo, sq, qo,
                                 qk_scale, sm_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D,
                                 HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, DQ_ATOMIC, TMA, BLOCK_M, MASK_N)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd,
                                 s_os, s_od, s_ls, s_gs, s_gd, rd, rdv, n_mask, k_lo, k_hi, full_lo, full_hi, sq, qo,
                                 qk_scale, sm_scale, cap_scale, cap2, False, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D,
                                 HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, DQ_ATOMIC, TMA, BLOCK_M, BLOCK_N)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd,
                                 s_os, s_od, s_ls, s_gs, s_gd, rd, rdv, n_mask, k_lo, k_hi, full_hi, hi, sq, qo,
                                 qk_scale, sm_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D,
                                 HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, DQ_ATOMIC, TMA, BLOCK_M, MASK_N)
        # the stores' rows recomputed here, so that no [BLOCK_M, ...] offsets stay live through the loops
        rows_e = (k_row0 + n0) + tl.arange(0, BLOCK_M).to(tl.int64)
        ok_e = tl.arange(0, BLOCK_M) < sk - n0
        nd_mask = ok_e[:, None] & (rd < HEAD_DIM)[None, :]
        ndv_mask = ok_e[:, None] & (rdv < HEAD_DIM_V)[None, :]
        dv_off = dv_ptr + b * s_dvb + hk * s_dvh + rows_e[:, None] * s_dvs + rdv[None, :] * s_dvd
        tl.store(dv_off, dv.to(dv_ptr.dtype.element_ty), mask=ndv_mask)
        dk = dk * sm_scale
        dk_off = dk_ptr + b * s_dkb + hk * s_dkh + rows_e[:, None] * s_dks + rd[None, :] * s_dkd
        if ACCUM:
            dk += tl.load(dk_off, mask=nd_mask, other=0.0).to(tl.float32)
        tl.store(dk_off, dk.to(dk_ptr.dtype.element_ty), mask=nd_mask)
    elif not DQ_ATOMIC:
        # last query blocks first: under a causal mask they see the most keys (the longest programs
        # start early instead of ending the launch)
        q_blocks = tl.cdiv(SQ, BLOCK_M)
        pid2 = pid - kv_programs
        pid2 = pid2 + q_blocks - 1 - 2 * (pid2 % q_blocks)
        b2, h2, m0, sq2, sk2, q_row2, k_row2, qo2, ko2 = program_tile(
            pid2, seg_ptr, HQ, SQ, SK, q_offset, k_offset, False, SEGMENTED, BLOCK_M)
        hk2 = (h2 // GROUP).to(tl.int64)
        h2 = h2.to(tl.int64)
        rm = m0 + tl.arange(0, BLOCK_M)
        m_mask = rm < sq2
        md_mask = m_mask[:, None] & (rd < HEAD_DIM)[None, :]
        rows = q_row2 + rm.to(tl.int64)
        q = tl.load(q_ptr + b2 * s_qb + h2 * s_qh + rows[:, None] * s_qs + rd[None, :] * s_qd, mask=md_mask, other=0.0)
        do = tl.load(do_ptr + b2 * s_ob + h2 * s_oh + rows[:, None] * s_os + rdv[None, :] * s_od,
                     mask=m_mask[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(lse_ptr + b2 * s_lb + h2 * s_lh + rows * s_ls, mask=m_mask, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(delta_ptr + b2 * s_lb + h2 * s_lh + rows * s_ls, mask=m_mask, other=0.0)
        k_base = k_ptr + b2 * s_kb + hk2 * s_kh + k_row2 * s_ks
        v_base = v_ptr + b2 * s_vb + hk2 * s_vh + k_row2 * s_vs
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        q_hi = qo2 + rm + win_right  # row i sees keys at positions [q_lo, q_hi]
        q_lo = qo2 + rm - win_left
        if RIGHT:  # keys up to the last row's right edge (the last row of the query rows, not of the block)
            hi2 = tl.minimum(sk2, tl.maximum(qo2 + tl.minimum(m0 + BLOCK_M, sq2) + win_right - ko2, 0))
            full2 = tl.minimum(sk2, tl.maximum(qo2 + m0 + 1 + win_right - ko2, 0))
        else:
            hi2 = sk2
            full2 = sk2
        full2 = (full2 // BLOCK_N) * BLOCK_N
        full_lo2 = 0
        if LEFT:
            lo2, full_lo2, full2 = window_keys(m0, qo2, ko2, win_left, hi2, full2, BLOCK_M, BLOCK_N)
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv,
                           q_hi, q_lo, lo2, full_lo2, sk2, ko2, qk_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP,
                           HEAD_DIM, PAD_D, HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, TMA, MASK_N)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi,
                       q_lo, full_lo2, full2, sk2, ko2, qk_scale, cap_scale, cap2, False, RIGHT, LEFT, SOFTCAP,
                       HEAD_DIM, PAD_D, HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, TMA, BLOCK_N)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi,
                       q_lo, full2, hi2, sk2, ko2, qk_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM,
                       PAD_D, HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, TMA, MASK_N)
        dq = dq * sm_scale
        dq_off = dq_ptr + b2 * s_gb + h2 * s_gh + rows[:, None] * s_gs + rd[None, :] * s_gd
        if ACCUM:
            dq += tl.load(dq_off, mask=md_mask, other=0.0).to(tl.float32)
        tl.store(dq_off, dq.to(dq_ptr.dtype.element_ty), mask=md_mask)


@triton.jit
def _query_ranges(n0, SQ, SK, q_offset, k_offset, win_left, win_right, RIGHT: tl.constexpr, LEFT: tl.constexpr,
                  DQ_ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr):
    """The query blocks a dK/dV program over keys ``[n0, n0 + BLOCK_M)`` visits, ``(lo, full_lo,
    full_hi, hi)``: ``[lo, full_lo)`` see part of the keys (masked), ``[full_lo, full_hi)`` all of
    them and hold no tail row (unmasked, BLOCK_N-aligned), ``[full_hi, hi)`` part of them again
    (masked, in MASK_N-row steps like the first); the rest is skipped. With ``DQ_ATOMIC`` a key
    tail block is masked throughout (its dQ part is added)."""
    k_end = tl.minimum(n0 + BLOCK_M, SK)  # past the program's last key
    if RIGHT:
        first = tl.maximum(k_offset + n0 - win_right - q_offset, 0)  # the first query row that sees key n0
        lo = tl.minimum((first // MASK_N) * MASK_N, SQ)
        # from here on rows see every key of the block (its last key included)
        last = tl.maximum(k_offset + k_end - 1 - win_right - q_offset, 0)
        full_lo = tl.minimum(tl.maximum(((last + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), SQ)
    else:
        lo = tl.zeros((), dtype=tl.int32)
        full_lo = tl.zeros((), dtype=tl.int32)
    if DQ_ATOMIC:
        full_lo = tl.where(n0 + BLOCK_M > SK, SQ, full_lo)
    full_hi = tl.maximum((SQ // BLOCK_N) * BLOCK_N, full_lo)
    hi = SQ
    if LEFT:  # rows past the last key's window edge are skipped whole
        hi = tl.maximum(tl.minimum(SQ, k_offset + k_end + win_left - q_offset), lo)
        every = tl.maximum(k_offset + n0 + 1 + win_left - q_offset, 0)  # rows below see the whole block
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.maximum(tl.minimum(full_hi, (every // BLOCK_N) * BLOCK_N), full_lo)
    return lo, full_lo, full_hi, hi


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def attention_delta(out, dout):
    """``delta[b, h, i] = sum_d dout * out`` in fp32, the row term of the softmax backward."""
    return torch.einsum("bshd,bshd->bhs", dout.float(), out.float())


def sink_grad(sinks, lse, delta):
    """The gradient of the sink logits ``[heads]`` (fp32): ``d_sink[h] = -sum_{b,i} p_sink * delta``
    with ``p_sink = exp(sink[h] - lse[b, h, i])`` (``lse`` includes the sink) and ``delta`` the
    row term (:func:`attention_delta`); the sink takes probability mass but carries no value, so
    ``d out_i / d sink = -p_sink * out_i``. Rows with ``lse = -inf`` (never written) add nothing."""
    p = torch.exp(sinks.float()[None, :, None] - lse)
    return -torch.where(torch.isfinite(lse), p * delta, 0.0).sum(dim=(0, 2))


#: the widest q/k and v head dims whose backward loads its streamed tiles by TMA (measured with
#: ``python -m benchmarks compile``, sm_90: at head_dim 64 the descriptors free up to 55 registers
#: a thread; at 128 they cost registers, and with Triton 3.6 the 128-row tiles under a causal mask
#: spilled 4-84 B)
TMA_MAX_HEAD_DIM = 64


def backward_loads(q, k, v, dout, *, dkv: bool = True, dq: bool = True) -> str:
    """How :func:`flash_attention_backward` (``dq_mode="separate"``) loads its streamed tiles:
    ``"tma"`` (device-side tensor descriptors) where :func:`~.gemm_loads.tma_capable` allows it
    (sm_90+ with 16-bit operands, the interpreter; not after ``set_load_path("pointer")``), both
    head dims are at most :data:`TMA_MAX_HEAD_DIM`, and each tensor streamed has its head dim
    contiguous, a base address and batch, head and row strides that are multiples of 16 bytes,
    rows not overlapping; else ``"pointer"``. Streamed: q and dout by the dK/dV programs
    (``dkv``), k and v by the dQ programs (``dq``); a launch without one kind leaves its tensors
    unchecked."""
    d, dv, es = q.shape[3], v.shape[3], q.element_size()
    if max(d, dv) > TMA_MAX_HEAD_DIM or not tma_capable(q.device, es):
        return "pointer"
    streamed = (((q, d), (dout, dv)) if dkv else ()) + (((k, d), (v, dv)) if dq else ())
    for t, width in streamed:
        s_b, s_s, s_h, s_d = t.stride()
        # (es is a power of two: the OR of the strides is a multiple of 16 / es iff each is)
        if s_d != 1 or s_s < width or (t.data_ptr() | (s_b | s_s | s_h) * es) % 16:
            return "pointer"
    return "tma"


def _row_terms(dout, q, v, out, lse, delta):
    """Validated ``(lse, delta)`` of q's rows, computing delta from ``out`` when not given."""
    b, sq, hq, _ = q.shape
    o_shape = (b, sq, hq, v.shape[3])
    check_tensor("dout", dout)
    check_same("dout", dout, "q", q)
    check_shape("dout", dout, o_shape)
    check_buffer("lse", lse, (b, hq, sq), q.device, torch.float32)
    if delta is None:
        if out is None:
            raise ValueError("flash_attention_backward needs out= or delta=, got neither")
        check_buffer("out", out, o_shape, q.device)
        delta = attention_delta(out, dout)
    else:
        check_buffer("delta", delta, (b, hq, sq), q.device, torch.float32)
    if delta.stride() != lse.stride():
        lse, delta = lse.contiguous(), delta.contiguous()  # the kernels index both with one set of strides
    return lse, delta


def _grad_buffers(q, k, v, dq, dk, dv, accumulate):
    """``(dq, dk, dv, want_dq, want_dkv)``: given buffers checked, missing ones allocated;
    ``dq=False`` / ``dk=False`` skip a kernel."""
    if accumulate and (dq is None or dk is None or dv is None):
        raise ValueError("accumulate=True needs dq=, dk= and dv= (the buffers to add into)")
    want_dq, want_dkv = dq is not False, dk is not False
    bufs = []
    for name, buf, ref, want in (("dq", dq, q, want_dq), ("dk", dk, k, want_dkv), ("dv", dv, v, want_dkv)):
        bufs.append(output_buffer(name, buf, ref.shape, q.device, ref.dtype) if want else buf)
    return (*bufs, want_dq, want_dkv)


def flash_attention_backward(dout, q, k, v, out, lse, *, delta=None, causal=False, softmax_scale=None,
                             q_offset=None, k_offset=None, dq=None, dk=None, dv=None, accumulate=False,
                             segments=None, window=None, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    """Gradients of one attention block: returns ``(dq, dk, dv)``, and with ``sinks=`` also
    ``d_sinks`` (fp32 ``[heads]``, :func:`sink_grad`): ``(dq, dk, dv, dsinks)``.

    ``out``/``lse`` are the (merged, final) forward output and log-sum-exp of the query rows;
    ``delta`` (``[b, hq, sq]`` fp32, :func:`attention_delta`) is computed from them when omitted
    (``out`` may then be None if delta is given). ``dq``/``dk``/``dv`` are written in place when
    given (any strides; fp32 buffers keep ring sums exact); ``accumulate=True`` adds to them in
    fp32. ``q_offset`` / ``k_offset``: the forward's (None, None aligns the blocks bottom-right,
    :func:`~.flash_attention.resolve_offsets`). Pass ``dq=False`` to skip the dQ programs, or ``dk=False`` to skip the dK/dV programs
    (the skipped entries are returned as given). ``segments``, ``window``, ``softcap``: as in
    the forward (the rows and keys outside every segment are not written); the sinks enter the
    kernel through ``lse`` only.

    ``dq_mode`` (:data:`DQ_MODES`): ``"separate"`` (the default) computes dQ in programs of its
    own over query blocks, which recompute ``QK^T`` and ``dO V^T`` (7 matrix products of
    ``s^2 d`` per head in all): deterministic, the same bits on every run. ``"atomic"`` is the
    one-pass backward (as flash-attention 2): the dK/dV programs also add each key block's part
    of dQ with fp32 atomics (5 products), into ``dq`` itself when it is an fp32 buffer, else
    into an fp32 scratch that is then cast into ``dq``. The order of those fp32 additions varies
    between runs on a GPU, so **dq's bits change from run to run** (dk, dv and d_sinks do not);
    without ``accumulate``, ``dq`` is then written whole (rows outside every segment get 0).
    With ``dq=False`` or ``dk=False`` the modes are the same.
    """
    check_qkv(q, k, v)
    q_offset, k_offset = resolve_offsets(q_offset, k_offset, q.shape[1], k.shape[1], segmented=segments is not None)
    check_dq_mode(dq_mode)
    if segments is not None:
        check_segments(segments, q, k, q_offset, k_offset)
    opts = score_options(q, k, causal=causal, window=window, softcap=softcap, sinks=sinks, q_offset=q_offset,
                         k_offset=k_offset, segments=segments)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = resolve_softmax_scale(softmax_scale, d)
    lse, delta = _row_terms(dout, q, v, out, lse, delta)
    dq, dk, dv, want_dq, want_dkv = _grad_buffers(q, k, v, dq, dk, dv, accumulate)
    tail = (dq, dk, dv) if sinks is None else (dq, dk, dv, sink_grad(sinks, lse, delta))
    if b * hq * d == 0 or (sq == 0 and sk == 0):
        return tail
    if sq == 0 or sk == 0:  # nothing attends: gradients are zero
        if not accumulate:
            for t, want in ((dq, want_dq), (dk, want_dkv), (dv, want_dkv)):
                if want:
                    t.zero_()
        return tail
    rows_q, rows_k, n_b, table = sq, sk, b, q  # dense: the table argument is never read
    if segments is not None:
        rows_q, rows_k, n_b, table = segments.max_q, segments.max_k, segments.table.shape[0], segments.table
    one_pass = dq_mode == "atomic" and want_dq and want_dkv
    kv_bh = n_b * hk if want_dkv and rows_k else 0  # (batch or segment) x kv heads with dK/dV programs
    q_bh = n_b * hq if want_dq and not one_pass and rows_q else 0  # ... and query heads with dQ programs
    if kv_bh or q_bh or one_pass:  # one pass with no key programs: dq is still written (zeros)
        dq_arg = _atomic_dq_buffer(dq, accumulate) if one_pass else dq if want_dq else q  # q: never written
        dk_arg, dv_arg = (dk, dv) if want_dkv else (q, q)
        args = (q, k, v, dout, lse, delta, dq_arg, dk_arg, dv_arg, table, *q.stride(), *k.stride(), *v.stride(),
                *dout.stride(), *dq_arg.stride(), *dk_arg.stride(), *dv_arg.stride(), *lse.stride(), hq, hq // hk,
                kv_bh, rows_q, rows_k, q_offset, k_offset, scale * LOG2E, scale, *score_args(opts, scale))
        # the one-pass backward keeps pointer loads: descriptors gave its tiles no fewer registers
        tma = not one_pass and backward_loads(q, k, v, dout, dkv=kv_bh > 0, dq=q_bh > 0) == "tma"
        flags = dict(option_flags(q, v, opts, accumulate, segments is not None), DQ_ATOMIC=one_pass, TMA=tma)
        if kv_bh or q_bh:
            if tma:
                ensure_scratch_allocator()
            launch_attention_kernel(_attn_bwd_kernel, "bwd_atomic" if one_pass else "bwd", (rows_k, rows_q),
                                    (kv_bh, q_bh), args, flags)
        if one_pass and dq_arg is not dq:  # the fp32 sums into dq's dtype (accumulate: added in fp32)
            if accumulate:
                dq.add_(dq_arg)
            else:
                dq.copy_(dq_arg)
    return tail


def _atomic_dq_buffer(dq, accumulate):
    """The fp32 buffer the one-pass backward adds dQ into: ``dq`` itself when it is fp32 (zeroed
    first unless ``accumulate``), else a zeroed fp32 scratch of its shape."""
    if dq.dtype == torch.float32:
        return dq if accumulate else dq.zero_()
    return torch.zeros(dq.shape, device=dq.device, dtype=torch.float32)
