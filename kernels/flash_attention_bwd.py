"""Flash attention backward for ``[batch, seq, heads, head_dim]`` tensors: the dQ and dK/dV
kernels and their launcher (conventions as in :mod:`.flash_attention`: global offsets for the
causal mask, rows that see no key contribute nothing, grouped-query heads read in place, any
strides, fp32 accumulate mode for ring attention).

Two ways to get dQ (``dq_mode``, :data:`DQ_MODES`): "separate" (default) runs the dQ kernel over
query blocks beside the dK/dV kernel over key blocks, each recomputing ``QK^T`` and ``dO V^T``
(7 matrix products of ``s^2 d`` per head): deterministic. "atomic" is the one-pass backward of
flash-attention 2: the same dK/dV kernel with ``DQ_ATOMIC`` also forms each (query block, key
block) part ``dS^T K`` of dQ and adds it with fp32 atomics (5 products); the order of those
additions, and so dq's bits, vary between runs on a GPU.

Layers: ``_attn_bwd_dq_kernel`` / ``_attn_bwd_dkdv_kernel`` (jit; the inner loops
``_dq_inner`` / ``_dkdv_inner`` are shared by every variant) -> :func:`flash_attention_backward`
(validate, allocate, launch); :func:`attention_delta` is the row term both kernels read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_buffer, check_same, check_shape, check_tensor, output_buffer
from .flash_attention import (
    LOG2E,
    check_offsets,
    check_qkv,
    check_segments,
    launch_attention_kernel,
    option_flags,
    program_tile,
    resolve_softmax_scale,
    score_args,
    score_options,
    window_keys,
)

__all__ = ["DEFAULT_DQ_MODE", "DQ_MODES", "attention_delta", "check_dq_mode", "flash_attention_backward", "sink_grad"]

#: how the backward computes dQ (:func:`flash_attention_backward`): "separate", its own kernel
#: (deterministic), or "atomic", the one-pass backward (fp32 atomics; the bits vary between runs)
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
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, lo, hi, SK,
              k_offset, qk_scale, cap_scale, cap2, MASKED: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
              SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              PAD_DV: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.arange(0, BLOCK_N)
    d_ok = rd < HEAD_DIM
    dv_ok = rdv < HEAD_DIM_V
    k_ptrs = k_base + rd[:, None] * s_kd  # K and V are both read transposed: [BLOCK_D(V), BLOCK_N]
    v_ptrs = v_base + rdv[:, None] * s_vd
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + rn
        n_mask = cols < SK
        kv_rows = cols.to(tl.int64)
        if MASKED:
            kt = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=n_mask[None, :] & d_ok[:, None], other=0.0)
            vt = tl.load(v_ptrs + kv_rows[None, :] * s_vs, mask=n_mask[None, :] & dv_ok[:, None], other=0.0)
        else:
            if PAD_D:
                kt = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=d_ok[:, None], other=0.0)
            else:
                kt = tl.load(k_ptrs + kv_rows[None, :] * s_ks)
            if PAD_DV:
                vt = tl.load(v_ptrs + kv_rows[None, :] * s_vs, mask=dv_ok[:, None], other=0.0)
            else:
                vt = tl.load(v_ptrs + kv_rows[None, :] * s_vs)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        if SOFTCAP:  # s = cap * tanh(t), ds/dt = cap * (1 - tanh^2) = cap * 4e / (1 + e)^2, e = exp(-2|t|)
            t = tl.dot(q, kt, input_precision=INPUT_PRECISION) * cap_scale
            e = tl.exp2(tl.abs(t) * -2.8853900817779268)
            s = tl.where(t < 0, e - 1.0, 1.0 - e) / (1.0 + e) * cap2
            sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
        else:
            s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            visible = n_mask[None, :]
            if RIGHT:
                visible = visible & ((k_offset + cols)[None, :] <= q_hi[:, None])
            if LEFT:
                visible = visible & ((k_offset + cols)[None, :] >= q_lo[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vt, input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * sech2
        if UPCAST:
            dq = tl.dot(ds, tl.trans(kt), dq, input_precision=INPUT_PRECISION)
        else:
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, seg_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_gb, s_gs, s_gh, s_gd,
    s_lb, s_lh, s_ls,
    H, GROUP, SQ, SK, q_offset, k_offset, qk_scale, sm_scale, win_left, win_right, cap_scale, cap2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAD_DV: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ for one block of query rows: loop over the visible key blocks (the forward's ranges).
    ``SINKS`` is unused here: the sink enters through ``lse`` only."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    tl.static_assert(PAD_DV == (BLOCK_DV != HEAD_DIM_V), "PAD_DV says whether BLOCK_DV pads HEAD_DIM_V")
    b, h, m0, SQ, SK, q_row0, k_row0, q_offset, k_offset = program_tile(
        seg_ptr, H, SQ, SK, q_offset, k_offset, False, SEGMENTED, BLOCK_M)
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    m_mask = rm < SQ
    md_mask = m_mask[:, None] & (rd < HEAD_DIM)[None, :]
    rows = q_row0 + rm.to(tl.int64)

    q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + rd[None, :] * s_qd, mask=md_mask, other=0.0)
    do = tl.load(do_ptr + b * s_ob + h * s_oh + rows[:, None] * s_os + rdv[None, :] * s_od,
                 mask=m_mask[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + b * s_lb + h * s_lh + rows * s_ls, mask=m_mask, other=float("inf"))
    # fully masked rows (lse = -inf) and tail rows contribute nothing: +inf makes every p exactly 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + b * s_lb + h * s_lh + rows * s_ls, mask=m_mask, other=0.0)
    k_base = k_ptr + b * s_kb + hk * s_kh + k_row0 * s_ks
    v_base = v_ptr + b * s_vb + hk * s_vh + k_row0 * s_vs

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    q_hi = q_offset + rm + win_right
    q_lo = q_offset + rm - win_left
    if RIGHT:
        hi = tl.minimum(SK, tl.maximum(q_offset + m0 + BLOCK_M + win_right - k_offset, 0))
        full = tl.minimum(SK, tl.maximum(q_offset + m0 + 1 + win_right - k_offset, 0))
    else:
        hi = SK
        full = SK
    full = (full // BLOCK_N) * BLOCK_N
    full_lo = 0
    if LEFT:
        lo, full_lo, full = window_keys(m0, q_offset, k_offset, win_left, hi, full, BLOCK_M, BLOCK_N)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, lo,
                       full_lo, SK, k_offset, qk_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D,
                       HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, full_lo, full,
                   SK, k_offset, qk_scale, cap_scale, cap2, False, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D, HEAD_DIM_V,
                   PAD_DV, UPCAST, INPUT_PRECISION, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, full, hi,
                   SK, k_offset, qk_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D, HEAD_DIM_V,
                   PAD_DV, UPCAST, INPUT_PRECISION, BLOCK_N)
    dq = dq * sm_scale
    dq_off = dq_ptr + b * s_gb + h * s_gh + rows[:, None] * s_gs + rd[None, :] * s_gd
    if ACCUM:
        dq += tl.load(dq_off, mask=md_mask, other=0.0).to(tl.float32)
    tl.store(dq_off, dq.to(dq_ptr.dtype.element_ty), mask=md_mask)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd, s_os, s_od, s_ls, s_gs, s_gd, rd,
                rdv, n_ok, k_lo, k_hi, lo, hi, SQ, q_offset, qk_scale, sm_scale, cap_scale, cap2, MASKED: tl.constexpr,
                RIGHT: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr,
                PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAD_DV: tl.constexpr, UPCAST: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, DQ_ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr):
    """dK/dV over query blocks ``[lo, hi)``: key ``j`` is visible to query row ``i`` iff
    ``k_lo[j] <= q_offset + i <= k_hi[j]`` (``k_lo = k_pos - right``, ``k_hi = k_pos + left``).
    ``DQ_ATOMIC`` (the one-pass backward): also add this key block's part of dQ, ``dS^T K *
    scale``, to the fp32 rows at ``dq_base`` with atomics; ``n_ok`` (keys inside the launch) then
    masks the tail keys' scores too (their K rows are 0, but an overflowing ``P`` would give
    ``inf * 0``)."""
    rm = tl.arange(0, BLOCK_M)
    d_ok = rd < HEAD_DIM
    dv_ok = rdv < HEAD_DIM_V
    q_ptrs = q_base + rd[:, None] * s_qd  # Q is read transposed: [BLOCK_D, BLOCK_M]
    do_ptrs = do_base + rdv[None, :] * s_od
    for m0 in range(lo, hi, BLOCK_M):
        rows_i = m0 + rm
        m_mask = rows_i < SQ
        rows = rows_i.to(tl.int64)
        if MASKED:
            qt = tl.load(q_ptrs + rows[None, :] * s_qs, mask=m_mask[None, :] & d_ok[:, None], other=0.0)
            do = tl.load(do_ptrs + rows[:, None] * s_os, mask=m_mask[:, None] & dv_ok[None, :], other=0.0)
        else:
            if PAD_D:
                qt = tl.load(q_ptrs + rows[None, :] * s_qs, mask=d_ok[:, None], other=0.0)
            else:
                qt = tl.load(q_ptrs + rows[None, :] * s_qs)
            if PAD_DV:
                do = tl.load(do_ptrs + rows[:, None] * s_os, mask=dv_ok[None, :], other=0.0)
            else:
                do = tl.load(do_ptrs + rows[:, None] * s_os)
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        if MASKED:
            lse = tl.load(l_base + rows * s_ls, mask=m_mask, other=float("inf"))
            delta = tl.load(d_base + rows * s_ls, mask=m_mask, other=0.0)
        else:
            lse = tl.load(l_base + rows * s_ls)
            delta = tl.load(d_base + rows * s_ls)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        if SOFTCAP:
            t = tl.dot(k, qt, input_precision=INPUT_PRECISION) * cap_scale  # [BLOCK_N, BLOCK_M]
            e = tl.exp2(tl.abs(t) * -2.8853900817779268)
            st = tl.where(t < 0, e - 1.0, 1.0 - e) / (1.0 + e) * cap2
            sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
        else:
            st = tl.dot(k, qt, input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
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
        dpt = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * sech2
        if UPCAST:
            dk = tl.dot(dst, tl.trans(qt), dk, input_precision=INPUT_PRECISION)
        else:
            dst = dst.to(qt.dtype)
            dk = tl.dot(dst, tl.trans(qt), dk, input_precision=INPUT_PRECISION)
        if DQ_ATOMIC:  # [BLOCK_M, BLOCK_D]: fp32 adds whose order (and so rounding) varies on a GPU
            dq = tl.dot(tl.trans(dst), k, input_precision=INPUT_PRECISION) * sm_scale
            dq_ptrs = dq_base + rows[:, None] * s_gs + rd[None, :] * s_gd
            if MASKED:
                tl.atomic_add(dq_ptrs, dq, mask=m_mask[:, None] & d_ok[None, :], sem="relaxed")
            else:
                if PAD_D:
                    tl.atomic_add(dq_ptrs, dq, mask=d_ok[None, :], sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, seg_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_dkb, s_dks, s_dkh, s_dkd,
    s_dvb, s_dvs, s_dvh, s_dvd,
    s_gb, s_gs, s_gh, s_gd,
    s_lb, s_lh, s_ls,
    HK, GROUP, SQ, SK, q_offset, k_offset, qk_scale, sm_scale, win_left, win_right, cap_scale, cap2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAD_DV: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SEGMENTED: tl.constexpr, DQ_ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV for one block of keys of one kv head: loop over the group's query heads and the
    query blocks that see the keys (sums over the GQA group without atomics). ``DQ_ATOMIC``: the
    one-pass backward, which also adds each (query block, key block) part of dQ to the fp32
    buffer ``dq_ptr`` with atomics (``dq_mode="atomic"``); otherwise ``dq_ptr`` is not read."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    tl.static_assert(PAD_DV == (BLOCK_DV != HEAD_DIM_V), "PAD_DV says whether BLOCK_DV pads HEAD_DIM_V")
    b, hk, n0, SQ, SK, q_row0, k_row0, q_offset, k_offset = program_tile(
        seg_ptr, HK, SQ, SK, q_offset, k_offset, True, SEGMENTED, BLOCK_N)
    hk = hk.to(tl.int64)

    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    n_mask = rn < SK
    nd_mask = n_mask[:, None] & (rd < HEAD_DIM)[None, :]
    ndv_mask = n_mask[:, None] & (rdv < HEAD_DIM_V)[None, :]
    cols = k_row0 + rn.to(tl.int64)

    k = tl.load(k_ptr + b * s_kb + hk * s_kh + cols[:, None] * s_ks + rd[None, :] * s_kd, mask=nd_mask, other=0.0)
    v = tl.load(v_ptr + b * s_vb + hk * s_vh + cols[:, None] * s_vs + rdv[None, :] * s_vd, mask=ndv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    k_lo = k_offset + rn - win_right  # key j is seen by the query positions [k_lo, k_hi]
    k_hi = k_offset + rn + win_left

    # query blocks [lo, full_lo) see part of this key block (masked), [full_lo, full_hi) all of it
    # without tails (unmasked), [full_hi, hi) part of it again (masked); the rest is skipped
    if RIGHT:
        first = tl.maximum(k_offset + n0 - win_right - q_offset, 0)  # the first query row that sees key n0
        lo = tl.minimum((first // BLOCK_M) * BLOCK_M, SQ)
        # from here on rows see the whole block
        last = tl.maximum(k_offset + n0 + BLOCK_N - 1 - win_right - q_offset, 0)
        full_lo = tl.minimum(tl.maximum(((last + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo), SQ)
    else:
        lo = 0
        full_lo = 0
    full_lo = tl.where(n0 + BLOCK_N > SK, SQ, full_lo)  # a key tail block is masked throughout
    full_hi = tl.maximum((SQ // BLOCK_M) * BLOCK_M, full_lo)
    hi = SQ
    if LEFT:  # rows past the last key's window edge are skipped whole
        hi = tl.maximum(tl.minimum(SQ, k_offset + n0 + BLOCK_N + win_left - q_offset), lo)
        every = tl.maximum(k_offset + n0 + 1 + win_left - q_offset, 0)  # rows below see the whole block
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.maximum(tl.minimum(full_hi, (every // BLOCK_M) * BLOCK_M), full_lo)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = q_ptr + b * s_qb + h * s_qh + q_row0 * s_qs
        do_base = do_ptr + b * s_ob + h * s_oh + q_row0 * s_os
        l_base = lse_ptr + b * s_lb + h * s_lh + q_row0 * s_ls
        d_base = delta_ptr + b * s_lb + h * s_lh + q_row0 * s_ls
        dq_base = dq_ptr + b * s_gb + h * s_gh + q_row0 * s_gs
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd, s_os, s_od, s_ls,
                             s_gs, s_gd, rd, rdv, n_mask, k_lo, k_hi, lo, full_lo, SQ, q_offset, qk_scale, sm_scale,
                             cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D, HEAD_DIM_V, PAD_DV, UPCAST,
                             INPUT_PRECISION, DQ_ATOMIC, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd, s_os, s_od, s_ls,
                             s_gs, s_gd, rd, rdv, n_mask, k_lo, k_hi, full_lo, full_hi, SQ, q_offset, qk_scale,
                             sm_scale, cap_scale, cap2, False, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D, HEAD_DIM_V,
                             PAD_DV, UPCAST, INPUT_PRECISION, DQ_ATOMIC, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, dq_base, s_qs, s_qd, s_os, s_od, s_ls,
                             s_gs, s_gd, rd, rdv, n_mask, k_lo, k_hi, full_hi, hi, SQ, q_offset, qk_scale, sm_scale,
                             cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM, PAD_D, HEAD_DIM_V, PAD_DV, UPCAST,
                             INPUT_PRECISION, DQ_ATOMIC, BLOCK_M)
    dk = dk * sm_scale
    dk_off = dk_ptr + b * s_dkb + hk * s_dkh + cols[:, None] * s_dks + rd[None, :] * s_dkd
    dv_off = dv_ptr + b * s_dvb + hk * s_dvh + cols[:, None] * s_dvs + rdv[None, :] * s_dvd
    if ACCUM:
        dk += tl.load(dk_off, mask=nd_mask, other=0.0).to(tl.float32)
        dv += tl.load(dv_off, mask=ndv_mask, other=0.0).to(tl.float32)
    tl.store(dk_off, dk.to(dk_ptr.dtype.element_ty), mask=nd_mask)
    tl.store(dv_off, dv.to(dv_ptr.dtype.element_ty), mask=ndv_mask)


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
                             q_offset=0, k_offset=0, dq=None, dk=None, dv=None, accumulate=False, segments=None,
                             window=None, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    """Gradients of one attention block: returns ``(dq, dk, dv)``, and with ``sinks=`` also
    ``d_sinks`` (fp32 ``[heads]``, :func:`sink_grad`): ``(dq, dk, dv, dsinks)``.

    ``out``/``lse`` are the (merged, final) forward output and log-sum-exp of the query rows;
    ``delta`` (``[b, hq, sq]`` fp32, :func:`attention_delta`) is computed from them when omitted
    (``out`` may then be None if delta is given). ``dq``/``dk``/``dv`` are written in place when
    given (any strides; fp32 buffers keep ring sums exact); ``accumulate=True`` adds to them in
    fp32. Pass ``dq=False`` to skip the dQ kernel, or ``dk=False`` to skip the dK/dV kernel
    (the skipped entries are returned as given). ``segments``, ``window``, ``softcap``: as in
    the forward (the rows and keys outside every segment are not written); the sinks enter the
    kernels through ``lse`` only.

    ``dq_mode`` (:data:`DQ_MODES`): ``"separate"`` (the default) computes dQ in a kernel of its
    own over query blocks, which recomputes ``QK^T`` and ``dO V^T`` (7 matrix products of
    ``s^2 d`` per head in all): deterministic, the same bits on every run. ``"atomic"`` is the
    one-pass backward (as flash-attention 2): the dK/dV kernel also adds each key block's part
    of dQ with fp32 atomics (5 products), into ``dq`` itself when it is an fp32 buffer, else
    into an fp32 scratch that is then cast into ``dq``. The order of those fp32 additions varies
    between runs on a GPU, so **dq's bits change from run to run** (dk, dv and d_sinks do not);
    without ``accumulate``, ``dq`` is then written whole (rows outside every segment get 0).
    With ``dq=False`` or ``dk=False`` the modes are the same.
    """
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset)
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
    flags = option_flags(q, v, opts, accumulate, segments is not None)
    scalars = (hq // hk, rows_q, rows_k, q_offset, k_offset, scale * LOG2E, scale, *score_args(opts, scale))
    one_pass = dq_mode == "atomic" and want_dq and want_dkv
    if want_dq and not one_pass and n_b * rows_q:
        args = (q, k, v, dout, lse, delta, dq, table, *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
                *dq.stride(), *lse.stride(), hq, *scalars)
        launch_attention_kernel(_attn_bwd_dq_kernel, "dq", rows_q, n_b * hq, args, flags)
    dq_acc = _atomic_dq_buffer(dq, accumulate) if one_pass else dk  # dk: a placeholder the kernel does not read
    if want_dkv and n_b * rows_k:
        args = (q, k, v, dout, lse, delta, dk, dv, dq_acc, table, *q.stride(), *k.stride(), *v.stride(),
                *dout.stride(), *dk.stride(), *dv.stride(), *dq_acc.stride(), *lse.stride(), hk, *scalars)
        launch_attention_kernel(_attn_bwd_dkdv_kernel, "bwd" if one_pass else "dkdv", rows_k, n_b * hk, args,
                                dict(flags, DQ_ATOMIC=one_pass))
    if one_pass and dq_acc is not dq:  # the fp32 sums into dq's dtype (accumulate: added in fp32)
        if accumulate:
            dq.add_(dq_acc)
        else:
            dq.copy_(dq_acc)
    return tail


def _atomic_dq_buffer(dq, accumulate):
    """The fp32 buffer the one-pass backward adds dQ into: ``dq`` itself when it is fp32 (zeroed
    first unless ``accumulate``), else a zeroed fp32 scratch of its shape."""
    if dq.dtype == torch.float32:
        return dq if accumulate else dq.zero_()
    return torch.zeros(dq.shape, device=dq.device, dtype=torch.float32)
