"""Flash attention backward for ``[batch, seq, heads, head_dim]`` tensors: the dQ and dK/dV
kernels and their launcher (conventions as in :mod:`.flash_attention`: global offsets for the
causal mask, rows that see no key contribute nothing, grouped-query heads read in place, any
strides, fp32 accumulate mode for ring attention).

Layers: ``_attn_bwd_dq_kernel`` / ``_attn_bwd_dkdv_kernel`` (jit) ->
:func:`flash_attention_backward` (validate, allocate, launch); :func:`attention_delta` is the
row term both kernels read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_buffer, check_same, check_tensor, output_buffer
from .flash_attention import (
    LOG2E,
    program_tile,
    check_offsets,
    check_qkv,
    check_segments,
    kernel_flags,
    launch_attention_kernel,
    resolve_softmax_scale,
)

__all__ = ["attention_delta", "flash_attention_backward"]


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
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
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, seg_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_gb, s_gs, s_gh, s_gd,
    s_lb, s_lh, s_ls,
    H, GROUP, SQ, SK, q_offset, k_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, SEGMENTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ for one block of query rows: loop over the visible key blocks."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    b, h, m0, SQ, SK, q_row0, k_row0, q_offset, k_offset = program_tile(
        seg_ptr, H, SQ, SK, q_offset, k_offset, False, SEGMENTED, BLOCK_M)
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    m_mask = rm < SQ
    d_mask = rd < HEAD_DIM
    md_mask = m_mask[:, None] & d_mask[None, :]
    rows = q_row0 + rm.to(tl.int64)

    q = tl.load(q_ptr + b * s_qb + h * s_qh + rows[:, None] * s_qs + rd[None, :] * s_qd, mask=md_mask, other=0.0)
    do = tl.load(do_ptr + b * s_ob + h * s_oh + rows[:, None] * s_os + rd[None, :] * s_od, mask=md_mask, other=0.0)
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
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, seg_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_dkb, s_dks, s_dkh, s_dkd,
    s_dvb, s_dvs, s_dvh, s_dvd,
    s_lb, s_lh, s_ls,
    HK, GROUP, SQ, SK, q_offset, k_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, SEGMENTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV for one block of keys of one kv head: loop over the group's query heads and the
    query blocks that see the keys (sums over the GQA group without atomics)."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    b, hk, n0, SQ, SK, q_row0, k_row0, q_offset, k_offset = program_tile(
        seg_ptr, HK, SQ, SK, q_offset, k_offset, True, SEGMENTED, BLOCK_N)
    hk = hk.to(tl.int64)

    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    n_mask = rn < SK
    d_mask = rd < HEAD_DIM
    nd_mask = n_mask[:, None] & d_mask[None, :]
    cols = k_row0 + rn.to(tl.int64)

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
        q_base = q_ptr + b * s_qb + h * s_qh + q_row0 * s_qs
        do_base = do_ptr + b * s_ob + h * s_oh + q_row0 * s_os
        l_base = lse_ptr + b * s_lb + h * s_lh + q_row0 * s_ls
        d_base = delta_ptr + b * s_lb + h * s_lh + q_row0 * s_ls
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
# Host side
# --------------------------------------------------------------------------------------------
def attention_delta(out, dout):
    """``delta[b, h, i] = sum_d dout * out`` in fp32, the row term of the softmax backward."""
    return torch.einsum("bshd,bshd->bhs", dout.float(), out.float())


def _row_terms(dout, q, out, lse, delta):
    """Validated ``(lse, delta)`` of q's rows, computing delta from ``out`` when not given."""
    b, sq, hq, _ = q.shape
    check_tensor("dout", dout)
    check_same("dout", dout, "q", q, shape=True)
    check_buffer("lse", lse, (b, hq, sq), q.device, torch.float32)
    if delta is None:
        if out is None:
            raise ValueError("flash_attention_backward needs out= or delta=, got neither")
        check_buffer("out", out, q.shape, q.device)
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
                             q_offset=0, k_offset=0, dq=None, dk=None, dv=None, accumulate=False, segments=None):
    """Gradients of one attention block: returns ``(dq, dk, dv)``.

    ``out``/``lse`` are the (merged, final) forward output and log-sum-exp of the query rows;
    ``delta`` (``[b, hq, sq]`` fp32, :func:`attention_delta`) is computed from them when omitted
    (``out`` may then be None if delta is given). ``dq``/``dk``/``dv`` are written in place when
    given (any strides; fp32 buffers keep ring sums exact); ``accumulate=True`` adds to them in
    fp32. Pass ``dq=False`` to skip the dQ kernel, or ``dk=False`` to skip the dK/dV kernel
    (the skipped entries are returned as given). ``segments``: as in the forward (the rows and
    keys outside every segment are not written).
    """
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset)
    if segments is not None:
        check_segments(segments, q, k, q_offset, k_offset)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = resolve_softmax_scale(softmax_scale, d)
    lse, delta = _row_terms(dout, q, out, lse, delta)
    dq, dk, dv, want_dq, want_dkv = _grad_buffers(q, k, v, dq, dk, dv, accumulate)
    if b * hq * d == 0 or (sq == 0 and sk == 0):
        return dq, dk, dv
    if sq == 0 or sk == 0:  # nothing attends: gradients are zero
        if not accumulate:
            for t, want in ((dq, want_dq), (dk, want_dkv), (dv, want_dkv)):
                if want:
                    t.zero_()
        return dq, dk, dv
    rows_q, rows_k, n_b, table = sq, sk, b, q  # dense: the table argument is never read
    if segments is not None:
        rows_q, rows_k, n_b, table = segments.max_q, segments.max_k, segments.table.shape[0], segments.table
    flags = kernel_flags(q, causal, accumulate, segments is not None)
    tail = (hq // hk, rows_q, rows_k, q_offset, k_offset, scale * LOG2E, scale)
    if want_dq and n_b * rows_q:
        args = (q, k, v, dout, lse, delta, dq, table, *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
                *dq.stride(), *lse.stride(), hq, *tail)
        launch_attention_kernel(_attn_bwd_dq_kernel, "dq", rows_q, n_b * hq, args, flags)
    if want_dkv and n_b * rows_k:
        args = (q, k, v, dout, lse, delta, dk, dv, table, *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
                *dk.stride(), *dv.stride(), *lse.stride(), hk, *tail)
        launch_attention_kernel(_attn_bwd_dkdv_kernel, "dkdv", rows_k, n_b * hk, args, flags)
    return dq, dk, dv
