"""Flash attention (forward and backward) for ``[batch, seq, heads, head_dim]`` tensors.

* Online softmax with fp32 statistics; the log-sum-exp ``lse`` (natural log, ``[batch, heads,
  seq_q]`` fp32) is returned so that callers (ring attention) can merge blocks.
* Causal masking between blocks at different global positions: query ``i`` of this call sits at
  global position ``q_offset + i``, key ``j`` at ``k_offset + j``; the query sees the key iff
  ``k_offset + j <= q_offset + i``. The same mask is applied in every backward block (the public
  tutorial kernel masks only its diagonal block and assumes ``BLOCK_M == BLOCK_N``).
* Rows that see no key (causal with ``k_offset > q_offset + i``) give ``out = 0`` and
  ``lse = -inf``; the backward treats them as contributing nothing.
* Grouped-query attention: query head ``h`` reads kv head ``h // (heads_q // heads_kv)`` in place
  (no repeated K/V); dK/dV sum over the query heads of the group inside one program (no atomics).
* Any strides (a sequence chunk or a head slice of a bigger tensor is read in place), any
  sequence lengths (tails masked), ``seq_q != seq_k``, head_dim up to 256 (padded to a power of
  two >= 16 with masks).
* Accumulate modes for ring attention: the forward can continue from a previous normalised
  ``(out, lse)`` pair held in fp32 (``accumulate=True``), and the backward can add ``dq``/``dk``/
  ``dv`` into fp32 buffers, so every ring step reuses these kernels.

Layers: ``_attn_fwd_kernel`` / ``_attn_bwd_dq_kernel`` / ``_attn_bwd_dkdv_kernel`` (jit) ->
``flash_attention_forward`` / ``flash_attention_backward`` (validate, allocate, launch) ->
``FlashAttentionFunction`` (autograd) -> ``flash_attention`` (functional API);
``attention_reference`` is the plain fp64 torch oracle.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .checks import check_buffer, check_device_usable, check_supported_dtype
from .runtime import interpreting, needs_upcast, shared_memory_limit

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, q_pos, lo, hi, SK, k_offset,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
               UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax update over key blocks ``[lo, hi)``. ``MASKED=False`` only for blocks that
    every query row of the program sees completely (no tail, no causal cut)."""
    # loads are written out per case (no nested helper: under the interpreter every nested jit
    # call re-patches triton.language); interior blocks of an unpadded head_dim load unmasked
    rn = tl.arange(0, BLOCK_N)
    d_ok = rd < HEAD_DIM
    k_ptrs = k_base + rd[:, None] * s_kd  # [BLOCK_D, 1]: K is read transposed
    v_ptrs = v_base + rd[None, :] * s_vd
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + rn
        n_mask = cols < SK
        kv_rows = cols.to(tl.int64)
        if MASKED:
            k = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=n_mask[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + kv_rows[:, None] * s_vs, mask=n_mask[:, None] & d_ok[None, :], other=0.0)
        elif PAD_D:
            k = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + kv_rows[:, None] * s_vs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs + kv_rows[None, :] * s_ks)
            v = tl.load(v_ptrs + kv_rows[:, None] * s_vs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
        if MASKED:
            visible = n_mask[None, :]
            if CAUSAL:
                visible = visible & ((k_offset + cols)[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no visible key yet keep m = -inf; subtract 0 there to avoid nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if UPCAST:
            acc = tl.dot(p, v, acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_lb, s_lh, s_ls,
    H, GROUP, SQ, SK, q_offset, k_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D pads HEAD_DIM")
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    m0 = pid_m * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    m_mask = rm < SQ
    d_mask = rd < HEAD_DIM
    md_mask = m_mask[:, None] & d_mask[None, :]

    q_base = q_ptr + b * s_qb + h * s_qh
    k_base = k_ptr + b * s_kb + hk * s_kh
    v_base = v_ptr + b * s_vb + hk * s_vh
    o_base = o_ptr + b * s_ob + h * s_oh
    lse_base = lse_ptr + b * s_lb + h * s_lh

    q = tl.load(q_base + rm.to(tl.int64)[:, None] * s_qs + rd[None, :] * s_qd, mask=md_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    o_off = rm.to(tl.int64)[:, None] * s_os + rd[None, :] * s_od
    if ACCUM:
        # continue from the normalised state (out_prev, lse_prev): m = lse_prev, l = 1
        m_i = tl.load(lse_base + rm.to(tl.int64) * s_ls, mask=m_mask, other=float("-inf")) * 1.4426950408889634
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = tl.load(o_base + o_off, mask=md_mask, other=0.0).to(tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    q_pos = q_offset + rm
    if CAUSAL:
        # keys up to the last row's position are visible to some row; keys up to the first
        # row's position to every row (those blocks run without masks)
        hi = tl.minimum(SK, tl.maximum(q_offset + m0 + BLOCK_M - k_offset, 0))
        full = tl.minimum(SK, tl.maximum(q_offset + m0 + 1 - k_offset, 0))
    else:
        hi = SK
        full = SK
    full = (full // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, q_pos, 0, full, SK,
                               k_offset, qk_scale, False, CAUSAL, HEAD_DIM, PAD_D, UPCAST, INPUT_PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, q_pos, full, hi, SK,
                               k_offset, qk_scale, True, CAUSAL, HEAD_DIM, PAD_D, UPCAST, INPUT_PRECISION, BLOCK_N)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(o_base + o_off, out.to(o_ptr.dtype.element_ty), mask=md_mask)
    tl.store(lse_base + rm.to(tl.int64) * s_ls, lse, mask=m_mask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, q_pos, lo, hi, SK, k_offset,
              qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
              UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.arange(0, BLOCK_N)
    d_ok = rd < HEAD_DIM
    k_ptrs = k_base + rd[:, None] * s_kd  # K and V are both read transposed: [BLOCK_D, BLOCK_N]
    v_ptrs = v_base + rd[:, None] * s_vd
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + rn
        n_mask = cols < SK
        kv_rows = cols.to(tl.int64)
        if MASKED:
            kt = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=n_mask[None, :] & d_ok[:, None], other=0.0)
            vt = tl.load(v_ptrs + kv_rows[None, :] * s_vs, mask=n_mask[None, :] & d_ok[:, None], other=0.0)
        elif PAD_D:
            kt = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=d_ok[:, None], other=0.0)
            vt = tl.load(v_ptrs + kv_rows[None, :] * s_vs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs + kv_rows[None, :] * s_ks)
            vt = tl.load(v_ptrs + kv_rows[None, :] * s_vs)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            visible = n_mask[None, :]
            if CAUSAL:
                visible = visible & ((k_offset + cols)[None, :] <= q_pos[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vt, input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if UPCAST:
            dq = tl.dot(ds, tl.trans(kt), dq, input_precision=INPUT_PRECISION)
        else:
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_gb, s_gs, s_gh, s_gd,
    s_lb, s_lh, s_ls,
    H, GROUP, SQ, SK, q_offset, k_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ for one block of query rows: loop over the visible key blocks."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    m0 = pid_m * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    m_mask = rm < SQ
    d_mask = rd < HEAD_DIM
    md_mask = m_mask[:, None] & d_mask[None, :]
    rows = rm.to(tl.int64)

    q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + rd[None, :] * s_qd, mask=md_mask, other=0.0)
    do = tl.load(do_ptr + b * s_ob + h * s_oh + rows[:, None] * s_os + rd[None, :] * s_od, mask=md_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + b * s_lb + h * s_lh + rows * s_ls, mask=m_mask, other=float("inf"))
    # fully masked rows (lse = -inf) and tail rows contribute nothing: +inf makes every p exactly 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + b * s_lb + h * s_lh + rows * s_ls, mask=m_mask, other=0.0)
    k_base = k_ptr + b * s_kb + hk * s_kh
    v_base = v_ptr + b * s_vb + hk * s_vh

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    q_pos = q_offset + rm
    if CAUSAL:
        hi = tl.minimum(SK, tl.maximum(q_offset + m0 + BLOCK_M - k_offset, 0))
        full = tl.minimum(SK, tl.maximum(q_offset + m0 + 1 - k_offset, 0))
    else:
        hi = SK
        full = SK
    full = (full // BLOCK_N) * BLOCK_N
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, q_pos, 0, full, SK,
                   k_offset, qk_scale, False, CAUSAL, HEAD_DIM, PAD_D, UPCAST, INPUT_PRECISION, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, q_pos, full, hi, SK,
                   k_offset, qk_scale, True, CAUSAL, HEAD_DIM, PAD_D, UPCAST, INPUT_PRECISION, BLOCK_N)
    dq = dq * sm_scale
    dq_off = dq_ptr + b * s_gb + h * s_gh + rows[:, None] * s_gs + rd[None, :] * s_gd
    if ACCUM:
        dq += tl.load(dq_off, mask=md_mask, other=0.0).to(tl.float32)
    tl.store(dq_off, dq.to(dq_ptr.dtype.element_ty), mask=md_mask)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, s_qs, s_qd, s_os, s_od, s_ls, rd, k_pos, lo, hi,
                SQ, q_offset, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                PAD_D: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    d_ok = rd < HEAD_DIM
    q_ptrs = q_base + rd[:, None] * s_qd  # Q is read transposed: [BLOCK_D, BLOCK_M]
    do_ptrs = do_base + rd[None, :] * s_od
    for m0 in range(lo, hi, BLOCK_M):
        rows_i = m0 + rm
        m_mask = rows_i < SQ
        rows = rows_i.to(tl.int64)
        if MASKED:
            qt = tl.load(q_ptrs + rows[None, :] * s_qs, mask=m_mask[None, :] & d_ok[:, None], other=0.0)
            do = tl.load(do_ptrs + rows[:, None] * s_os, mask=m_mask[:, None] & d_ok[None, :], other=0.0)
        elif PAD_D:
            qt = tl.load(q_ptrs + rows[None, :] * s_qs, mask=d_ok[:, None], other=0.0)
            do = tl.load(do_ptrs + rows[:, None] * s_os, mask=d_ok[None, :], other=0.0)
        else:
            qt = tl.load(q_ptrs + rows[None, :] * s_qs)
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
        st = tl.dot(k, qt, input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        pt = tl.exp2(st - lse2[None, :])
        if MASKED:
            visible = m_mask[None, :]
            if CAUSAL:
                visible = visible & (k_pos[:, None] <= (q_offset + rows_i)[None, :])
            pt = tl.where(visible, pt, 0.0)
        if UPCAST:
            dv = tl.dot(pt, do, dv, input_precision=INPUT_PRECISION)
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dst = pt * (dpt - delta[None, :])
        if UPCAST:
            dk = tl.dot(dst, tl.trans(qt), dk, input_precision=INPUT_PRECISION)
        else:
            dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_dkb, s_dks, s_dkh, s_dkd,
    s_dvb, s_dvs, s_dvh, s_dvd,
    s_lb, s_lh, s_ls,
    HK, GROUP, SQ, SK, q_offset, k_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV for one block of keys of one kv head: loop over the group's query heads and the
    query blocks that see the keys (sums over the GQA group without atomics)."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = (pid_bh % HK).to(tl.int64)

    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    n_mask = rn < SK
    d_mask = rd < HEAD_DIM
    nd_mask = n_mask[:, None] & d_mask[None, :]
    cols = rn.to(tl.int64)

    k = tl.load(k_ptr + b * s_kb + hk * s_kh + cols[:, None] * s_ks + rd[None, :] * s_kd, mask=nd_mask, other=0.0)
    v = tl.load(v_ptr + b * s_vb + hk * s_vh + cols[:, None] * s_vs + rd[None, :] * s_vd, mask=nd_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    k_pos = k_offset + rn

    # query blocks [lo, full_lo) see part of this key block (masked), [full_lo, full_hi) all of it
    # without tails (unmasked), [full_hi, SQ) is the query tail (masked)
    if CAUSAL:
        first = tl.maximum(k_offset + n0 - q_offset, 0)  # the first query row that sees key n0
        lo = tl.minimum((first // BLOCK_M) * BLOCK_M, SQ)
        last = tl.maximum(k_offset + n0 + BLOCK_N - 1 - q_offset, 0)  # from here on rows see the whole block
        full_lo = tl.minimum(tl.maximum(((last + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo), SQ)
    else:
        lo = 0
        full_lo = 0
    full_lo = tl.where(n0 + BLOCK_N > SK, SQ, full_lo)  # a key tail block is masked throughout
    full_hi = tl.maximum((SQ // BLOCK_M) * BLOCK_M, full_lo)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = q_ptr + b * s_qb + h * s_qh
        do_base = do_ptr + b * s_ob + h * s_oh
        l_base = lse_ptr + b * s_lb + h * s_lh
        d_base = delta_ptr + b * s_lb + h * s_lh
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, s_qs, s_qd, s_os, s_od, s_ls, rd, k_pos,
                             lo, full_lo, SQ, q_offset, qk_scale, True, CAUSAL, HEAD_DIM, PAD_D, UPCAST,
                             INPUT_PRECISION, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, s_qs, s_qd, s_os, s_od, s_ls, rd, k_pos,
                             full_lo, full_hi, SQ, q_offset, qk_scale, False, CAUSAL, HEAD_DIM, PAD_D, UPCAST,
                             INPUT_PRECISION, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, s_qs, s_qd, s_os, s_od, s_ls, rd, k_pos,
                             full_hi, SQ, SQ, q_offset, qk_scale, True, CAUSAL, HEAD_DIM, PAD_D, UPCAST,
                             INPUT_PRECISION, BLOCK_M)
    dk = dk * sm_scale
    dk_off = dk_ptr + b * s_dkb + hk * s_dkh + cols[:, None] * s_dks + rd[None, :] * s_dkd
    dv_off = dv_ptr + b * s_dvb + hk * s_dvh + cols[:, None] * s_dvs + rd[None, :] * s_dvd
    if ACCUM:
        dk += tl.load(dk_off, mask=nd_mask, other=0.0).to(tl.float32)
        dv += tl.load(dv_off, mask=nd_mask, other=0.0).to(tl.float32)
    tl.store(dk_off, dk.to(dk_ptr.dtype.element_ty), mask=nd_mask)
    tl.store(dv_off, dv.to(dv_ptr.dtype.element_ty), mask=nd_mask)


# --------------------------------------------------------------------------------------------
# Configurations: fixed small blocks under the interpreter, autotuned pruned configs on GPU
# --------------------------------------------------------------------------------------------
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)


def gpu_configs(kind: str):
    configs = []
    for bm, bn, stages, warps in [
        (128, 128, 3, 8), (128, 64, 3, 4), (128, 64, 4, 8), (64, 128, 3, 4),
        (64, 64, 4, 4), (64, 64, 3, 4), (128, 32, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4), (32, 32, 3, 4),
    ]:
        configs.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_stages=stages, num_warps=warps))
    return configs


def _prune(kind):
    def prune(configs, named_args, **kwargs):
        """Drop configs whose resident tiles overflow shared memory or are far larger than the
        sequence (a 128-row tile on a 40-row problem only wastes work)."""
        q = named_args["q_ptr"]
        bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        elem = q.element_size()
        limit = shared_memory_limit(q.device.index or 0)
        sq, sk = named_args["SQ"], named_args["SK"]
        kept = []
        for cfg in configs:
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            stream = (bn if kind != "dkdv" else bm) * bd * 2 * elem * cfg.num_stages
            resident = (bm if kind != "dkdv" else bn) * bd * 2 * elem
            if stream + resident > limit:
                continue
            if bd >= 256 and bm * bn > 64 * 64:
                continue  # register pressure: the fp32 accumulators alone exceed the register file
            if bm > 2 * triton.next_power_of_2(sq) and bm > 32:
                continue
            if bn > 2 * triton.next_power_of_2(sk) and bn > 32:
                continue
            kept.append(cfg)
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]

    return prune


@functools.lru_cache(maxsize=None)
def _tuned(kind: str):
    kernel = {"fwd": _attn_fwd_kernel, "dq": _attn_bwd_dq_kernel, "dkdv": _attn_bwd_dkdv_kernel}[kind]
    restore = {"fwd": ["o_ptr", "lse_ptr"], "dq": ["dq_ptr"], "dkdv": ["dk_ptr", "dv_ptr"]}[kind]
    return triton.autotune(
        configs=gpu_configs(kind),
        key=["SQ", "SK", "HEAD_DIM", "CAUSAL", "GROUP"],
        prune_configs_by={"early_config_prune": _prune(kind)},
        restore_value=restore,  # accumulate modes read their outputs: tuning runs must not compound them
    )(kernel)


def _launch(kind, grid_rows, n_bh, args, flags):
    if interpreting():
        cfg = INTERPRETER_CONFIG
        rows_block = cfg["BLOCK_N"] if kind == "dkdv" else cfg["BLOCK_M"]
        kernel = {"fwd": _attn_fwd_kernel, "dq": _attn_bwd_dq_kernel, "dkdv": _attn_bwd_dkdv_kernel}[kind]
        kernel[(triton.cdiv(grid_rows, rows_block), n_bh)](*args, **flags, **cfg)
        return
    key = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    grid = lambda meta: (triton.cdiv(grid_rows, meta[key]), n_bh)  # noqa: E731
    with torch.cuda.device(args[0].device):
        _tuned(kind)[grid](*args, **flags)


# --------------------------------------------------------------------------------------------
# Host side: validation
# --------------------------------------------------------------------------------------------
def _input_precision(dtype):
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)} ({t.dim()}-D)")
        check_supported_dtype(name, t)
        check_device_usable(name, t)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch size must equal q's ({q.shape[0]}), got {t.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    d = q.shape[3]
    if k.shape[3] != d:
        raise ValueError(f"k head_dim must equal q's ({d}), got {k.shape[3]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be between 1 and {MAX_HEAD_DIM} (16, 32, 64, 128 are the tuned sizes), got {d}")
    hq, hk = q.shape[2], k.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hk}) for grouped-query attention")


def _scale(softmax_scale, d):
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _check_offsets(q_offset, k_offset):
    for name, o in (("q_offset", q_offset), ("k_offset", k_offset)):
        if isinstance(o, bool) or not isinstance(o, int) or o < 0:
            raise ValueError(f"{name} must be a non-negative int, got {o!r}")


def _strides4(t):
    return tuple(t.stride())


# --------------------------------------------------------------------------------------------
# Host side: launchers (the ring uses these directly)
# --------------------------------------------------------------------------------------------
def flash_attention_forward(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0,
                            out=None, lse=None, accumulate=False):
    """One attention block: returns ``(out, lse)``.

    q ``[b, sq, hq, d]``, k/v ``[b, sk, hk, d]`` (any strides). ``out`` (same shape as q, any
    strides, any supported dtype) and ``lse`` (``[b, hq, sq]`` fp32, any strides) are written in
    place when given. ``accumulate=True`` continues from the normalised state already held in
    ``(out, lse)`` (use an fp32 ``out``; start from ``out = 0``, ``lse = -inf``): afterwards they
    hold the attention over the union of all key blocks seen so far, which is how ring steps merge.
    """
    _check_qkv(q, k, v)
    _check_offsets(q_offset, k_offset)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = _scale(softmax_scale, d)
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs out= and lse= (the state to continue from)")
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    else:
        check_buffer("out", out, q.shape, q.device)
    if lse is None:
        lse = torch.empty((b, hq, sq), device=q.device, dtype=torch.float32)
    else:
        check_buffer("lse", lse, (b, hq, sq), q.device, torch.float32)
    if b * sq * hq == 0:
        return out, lse
    if sk == 0:
        if not accumulate:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    bd = max(16, triton.next_power_of_2(d))
    args = (q, k, v, out, lse, *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out), *lse.stride(),
            hq, hq // hk, sq, sk, q_offset, k_offset, scale * LOG2E)
    flags = dict(HEAD_DIM=d, BLOCK_D=bd, PAD_D=bd != d, CAUSAL=bool(causal), ACCUM=bool(accumulate),
                 UPCAST=needs_upcast(q.dtype), INPUT_PRECISION=_input_precision(q.dtype))
    _launch("fwd", sq, b * hq, args, flags)
    return out, lse


def attention_delta(out, dout):
    """``delta[b, h, i] = sum_d dout * out`` in fp32, the row term of the softmax backward."""
    return torch.einsum("bshd,bshd->bhs", dout.float(), out.float())


def flash_attention_backward(dout, q, k, v, out, lse, *, delta=None, causal=False, softmax_scale=None,
                             q_offset=0, k_offset=0, dq=None, dk=None, dv=None, accumulate=False):
    """Gradients of one attention block: returns ``(dq, dk, dv)``.

    ``out``/``lse`` are the (merged, final) forward output and log-sum-exp of the query rows;
    ``delta`` (``[b, hq, sq]`` fp32, :func:`attention_delta`) is computed from them when omitted
    (``out`` may then be None if delta is given). ``dq``/``dk``/``dv`` are written in place when
    given (any strides; fp32 buffers keep ring sums exact); ``accumulate=True`` adds to them in
    fp32. Pass ``dq=False`` to skip the dQ kernel, or ``dk=False`` to skip the dK/dV kernel
    (the skipped entries are returned as given).
    """
    _check_qkv(q, k, v)
    _check_offsets(q_offset, k_offset)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = _scale(softmax_scale, d)
    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"dout must be a tensor of q's shape {tuple(q.shape)}, got "
                         f"{tuple(dout.shape) if isinstance(dout, torch.Tensor) else type(dout).__name__}")
    if dout.device != q.device:
        raise ValueError(f"dout must be on device {q.device}, got {dout.device}")
    if dout.dtype != q.dtype:
        raise TypeError(f"dout must have the same dtype as q ({q.dtype}), got {dout.dtype}")
    check_buffer("lse", lse, (b, hq, sq), q.device, torch.float32)
    if delta is None:
        if out is None:
            raise ValueError("flash_attention_backward needs out= or delta=")
        check_buffer("out", out, q.shape, q.device)
        delta = attention_delta(out, dout)
    else:
        check_buffer("delta", delta, (b, hq, sq), q.device, torch.float32)
    if accumulate and (dq is None or dk is None or dv is None):
        raise ValueError("accumulate=True needs dq=, dk= and dv= (the buffers to add into)")
    want_dq, want_dkv = dq is not False, dk is not False
    if dq is None:
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    elif want_dq:
        check_buffer("dq", dq, q.shape, q.device)
    if dk is None:
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    elif want_dkv:
        check_buffer("dk", dk, k.shape, q.device)
    if dv is None:
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    elif want_dkv:
        check_buffer("dv", dv, v.shape, q.device)
    if b * hq * d == 0 or (sq == 0 and sk == 0):
        return dq, dk, dv
    if sq == 0 or sk == 0:  # nothing attends: gradients are zero
        if not accumulate:
            for t, want in ((dq, want_dq), (dk, want_dkv), (dv, want_dkv)):
                if want:
                    t.zero_()
        return dq, dk, dv
    if delta.stride() != lse.stride():
        lse, delta = lse.contiguous(), delta.contiguous()  # the kernels index both with one set of strides
    bd = max(16, triton.next_power_of_2(d))
    common = dict(HEAD_DIM=d, BLOCK_D=bd, PAD_D=bd != d, CAUSAL=bool(causal), ACCUM=bool(accumulate),
                  UPCAST=needs_upcast(q.dtype), INPUT_PRECISION=_input_precision(q.dtype))
    if want_dq:
        args = (q, k, v, dout, lse, delta, dq, *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout),
                *_strides4(dq), *lse.stride(), hq, hq // hk, sq, sk, q_offset, k_offset, scale * LOG2E, scale)
        _launch("dq", sq, b * hq, args, common)
    if want_dkv:
        args = (q, k, v, dout, lse, delta, dk, dv, *_strides4(q), *_strides4(k), *_strides4(v),
                *_strides4(dout), *_strides4(dk), *_strides4(dv), *lse.stride(),
                hk, hq // hk, sq, sk, q_offset, k_offset, scale * LOG2E, scale)
        _launch("dkdv", sk, b * hk, args, common)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Autograd and functional API
# --------------------------------------------------------------------------------------------
class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, q_offset, k_offset):
        out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                           q_offset=q_offset, k_offset=k_offset)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, softmax_scale, q_offset, k_offset)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, q_offset, k_offset = ctx.args
        if dout is None:
            return None, None, None, None, None, None, None
        dq, dk, dv = flash_attention_backward(dout.to(q.dtype), q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                              q_offset=q_offset, k_offset=k_offset)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0):
    """Scaled dot-product attention with a flash kernel; returns ``(out, lse)``.

    q ``[batch, seq_q, heads, head_dim]``, k/v ``[batch, seq_k, kv_heads, head_dim]`` (kv_heads
    divides heads: grouped-query attention), any strides. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``. With ``causal=True`` query ``i`` sees key ``j`` iff
    ``k_offset + j <= q_offset + i`` (global positions of two blocks of one sequence); rows that
    see no key give ``out = 0`` and ``lse = -inf``. ``lse`` (``[batch, heads, seq_q]``, fp32,
    natural log) is not differentiable (it is marked so; gradients flow through ``out``).
    """
    return FlashAttentionFunction.apply(q, k, v, causal, softmax_scale, q_offset, k_offset)


def attention_reference(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0,
                        compute_dtype=torch.float64):
    """Plain torch attention in ``compute_dtype``: ``(out, lse)`` with the same conventions as
    :func:`flash_attention` (fully masked rows: out 0, lse -inf). Differentiable."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qf = q.to(compute_dtype).transpose(1, 2)
    kf = k.to(compute_dtype).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vf = v.to(compute_dtype).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        qi = torch.arange(sq, device=q.device)[:, None] + q_offset
        kj = torch.arange(sk, device=q.device)[None, :] + k_offset
        s = s.masked_fill(kj > qi, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = (p @ vf).transpose(1, 2)
    return out, lse
