"""Flash attention for ``[batch, seq, heads, head_dim]`` tensors: the forward kernel and launcher,
the argument checks and launch helpers shared with the backward (:mod:`.flash_attention_bwd`),
and the plain torch oracle.

* Online softmax with fp32 statistics; the log-sum-exp ``lse`` (natural log, ``[batch, heads,
  seq_q]`` fp32) is returned so that callers (ring attention) can merge blocks.
* Causal masking at global positions: query ``i`` sits at ``q_offset + i``, key ``j`` at
  ``k_offset + j``, and sees it iff ``k_offset + j <= q_offset + i``; offsets left None align the
  blocks bottom-right as flash-attn (>= 2.1) does (:func:`resolve_offsets`), ``(0, 0)`` is top-left.
  Every backward block applies the same mask. Rows that see no key give ``out = 0``, ``lse = -inf``.
* Grouped-query attention: query head ``h`` reads kv head ``h // (heads_q // heads_kv)`` in place
  (no repeated K/V); dK/dV sum over the query heads of the group inside one program (no atomics).
* Any strides (a sequence chunk or a head slice of a bigger tensor is read in place), any
  sequence lengths (tails masked), ``seq_q != seq_k``, head_dim up to 256 (padded to a power of
  two >= 16 with masks).
* Packed documents: with a segment table (:class:`Segments`, the ``SEGMENTED`` flag) each
  program reads which query rows / key rows of one batch-1 sequence it owns and the shift of its
  causal mask (:func:`program_tile`); the varlen API (:mod:`.flash_varlen`) and ring attention
  over documents use it. The grid is one axis (:func:`attention_grid`), so batch x heads is not
  bound by CUDA's 65535 limit on axes 1 and 2.
* Score options, one code path behind constexpr flags (:func:`score_options`): a sliding
  ``window=(left, right)`` (key blocks outside it are skipped whole, :func:`window_keys`),
  ``softcap`` (``c * tanh(s / c)``, tanh from exp2), ``sinks`` (a logit per head in the
  denominator, included in ``lse``), and a v head dim of its own (``HEAD_DIM_V``).
* An fp8 output for o_proj (``fp8_out``, :mod:`.flash_fp8_out`): the stored ``out`` also quantised
  per 1x128 tile of its ``hq * d_v`` features in the epilogue (``FP8_OUT``; d_v 128 or 256).
* Accumulate modes for ring attention: the forward can continue from a previous normalised
  ``(out, lse)`` pair held in fp32 (``accumulate=True``), and the backward can add ``dq``/``dk``/
  ``dv`` into fp32 buffers, so every ring step reuses these kernels.

Layers: ``_attn_fwd_kernel`` (jit) -> :func:`flash_attention_forward` (validate, allocate,
launch); the backward kernels and :func:`~.flash_attention_bwd.flash_attention_backward` live
in :mod:`.flash_attention_bwd`; the differentiable ``flash_attention`` (a custom op,
``fusedpar.ops.attention.custom_ops``) is called through ``fusedpar.ops.attention``. :func:`attention_reference` is the plain fp64 torch oracle.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import (
    check_bool,
    check_float_tensor,
    check_int,
    check_positive_dims,
    check_same,
    check_softcap,
    check_tensor,
    cpu_launches,
    output_buffer,
)
from .flash_fp8_out import attention_fp8_args, check_attention_fp8_out, fill_empty_fp8_out
from .flash_tiles import (
    FP32_TILE,
    MAX_GRID_X,
    attention_grid,
    gpu_configs,
    kernel_flags,
    launch_attention_kernel,
    launch_smem_estimate,
    register_estimate,
    smem_estimate,
    uses_wgmma,
)
from .fp8 import rne_for_store, store_e4m3_tiles, to_fp32
from .runtime import SUPPORTED_DTYPES

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
#: window bounds of a segmented launch are clamped to this (more than any segment's positions span)
WINDOW_CLAMP = 2**30

__all__ = [
    "FP32_TILE", "MAX_GRID_X", "MAX_HEAD_DIM", "WINDOW_CLAMP", "ScoreOptions", "Segments", "attention_grid", "attention_reference",
    "check_offsets", "check_qkv", "check_segments", "check_sinks", "check_window",
    "flash_attention_forward", "gpu_configs", "kernel_flags", "launch_attention_kernel", "launch_smem_estimate",
    "option_flags", "program_tile", "register_estimate", "resolve_offsets", "resolve_softmax_scale", "score_args",
    "score_options",
    "smem_estimate", "uses_wgmma", "window_keys",
]


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, lo, hi, SK, k_offset,
               qk_scale, cap_scale, cap2, MASKED: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
               SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               PAD_DV: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax update over key blocks ``[lo, hi)``. ``MASKED=False`` only for blocks that
    every query row of the program sees completely (no tail, no window or causal cut). Key ``j``
    is visible to a row iff ``q_lo <= k_offset + j <= q_hi`` (``RIGHT`` / ``LEFT``: which bound
    applies). ``SOFTCAP``: scores ``cap * tanh(s * scale / cap)`` (``cap_scale = scale / cap``,
    ``cap2 = cap * log2 e``), tanh written with exp2 (no libdevice under the interpreter)."""
    # loads are written out per case (no nested helper: under the interpreter every nested jit
    # call re-patches triton.language); interior blocks of an unpadded head_dim load unmasked
    rn = tl.arange(0, BLOCK_N)
    d_ok = rd < HEAD_DIM
    dv_ok = rdv < HEAD_DIM_V
    k_ptrs = k_base + rd[:, None] * s_kd  # [BLOCK_D, 1]: K is read transposed
    v_ptrs = v_base + rdv[None, :] * s_vd
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + rn
        n_mask = cols < SK
        kv_rows = cols.to(tl.int64)
        if MASKED:
            k = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=n_mask[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + kv_rows[:, None] * s_vs, mask=n_mask[:, None] & dv_ok[None, :], other=0.0)
        else:
            if PAD_D:
                k = tl.load(k_ptrs + kv_rows[None, :] * s_ks, mask=d_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs + kv_rows[None, :] * s_ks)
            if PAD_DV:
                v = tl.load(v_ptrs + kv_rows[:, None] * s_vs, mask=dv_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs + kv_rows[:, None] * s_vs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if SOFTCAP:
            t = tl.dot(q, k, input_precision=INPUT_PRECISION) * cap_scale
            e = tl.exp2(tl.abs(t) * -2.8853900817779268)  # exp(-2|t|): no overflow
            s = tl.where(t < 0, e - 1.0, 1.0 - e) / (1.0 + e) * cap2
        else:
            s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
        if MASKED:
            visible = n_mask[None, :]
            if RIGHT:
                visible = visible & ((k_offset + cols)[None, :] <= q_hi[:, None])
            if LEFT:
                visible = visible & ((k_offset + cols)[None, :] >= q_lo[:, None])
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
def program_tile(pid, seg_ptr, H, SQ, SK, q_offset, k_offset, ON_KEYS: tl.constexpr, SEGMENTED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """What program ``pid`` computes: ``(b, h, start, SQ, SK, q_row0, k_row0, q_offset, k_offset)``.

    The grid is one axis of ``cdiv(rows, BLOCK) * batch * H`` programs (block index fastest;
    :func:`attention_grid`), ``rows`` being SQ (query-row programs) or SK (``ON_KEYS``: dK/dV);
    ``pid`` counts from the first program of its kind (the backward launches both kinds).
    Dense: batch ``b`` of the ``[b, s, h, d]`` operands, rows from 0. ``SEGMENTED``: ``b`` is a
    row of the segment table ``[n, 5]`` int32 ``(q_start, q_end, k_start, k_end, shift)`` and
    SQ/SK are only the maximal lengths: the segment's query rows ``[q_start, q_end)`` attend to
    keys ``[k_start, k_end)``, causal visibility ``j <= i + shift`` (segment-local ``i, j``), so
    q_offset = shift, k_offset = 0. A block past its segment's rows gets an empty range (the
    other length 0): its loops run no iteration and its masked stores write nothing."""
    if ON_KEYS:
        n_blocks = tl.cdiv(SK, BLOCK)
    else:
        n_blocks = tl.cdiv(SQ, BLOCK)
    start = (pid % n_blocks) * BLOCK
    pid_bh = pid // n_blocks
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    q_row0 = tl.zeros((), dtype=tl.int64)
    k_row0 = tl.zeros((), dtype=tl.int64)
    if SEGMENTED:
        row = seg_ptr + b * 5
        q_row0 = tl.load(row).to(tl.int64)
        SQ = tl.load(row + 1) - tl.load(row)
        k_row0 = tl.load(row + 2).to(tl.int64)
        SK = tl.load(row + 3) - tl.load(row + 2)
        q_offset = tl.load(row + 4)
        k_offset = 0
        b = tl.zeros((), dtype=tl.int64)  # segments index rows of one packed batch-1 sequence
        if ON_KEYS:
            SQ = tl.where(start < SK, SQ, 0)
        else:
            SK = tl.where(start < SQ, SK, 0)
    return b, h, start, SQ, SK, q_row0, k_row0, q_offset, k_offset


@triton.jit
def window_keys(m0, q_offset, k_offset, win_left, hi, full_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left edge of the window for the query rows ``[m0, m0 + BLOCK_M)`` (row ``i`` sees keys
    ``k_offset + j >= q_offset + i - win_left``): ``(lo, full_lo, full_hi)`` such that keys
    ``[lo, full_lo)`` need masks, ``[full_lo, full_hi)`` are seen by every row (block aligned, no
    masks) and ``[full_hi, hi)`` need masks again; keys before ``lo`` are skipped whole."""
    first = tl.maximum(q_offset + m0 - win_left - k_offset, 0)  # the first key row m0 sees
    lo = tl.minimum((first // BLOCK_N) * BLOCK_N, hi)
    every = tl.maximum(q_offset + m0 + BLOCK_M - 1 - win_left - k_offset, 0)  # the last row's first key
    full_lo = tl.minimum(tl.maximum(((every + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), hi)
    return lo, full_lo, tl.maximum(full_hi, full_lo)


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seg_ptr, sink_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_lb, s_lh, s_ls,
    H, GROUP, SQ, SK, q_offset, k_offset, qk_scale, win_left, win_right, cap_scale, cap2,
    q8_ptr, s8_ptr, s_8b, s_8s, s_8h, s_sb, s_ss,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAD_DV: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SEGMENTED: tl.constexpr, FP8_OUT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``FP8_OUT``: the stored out also quantised per 1x128 tile of the ``[.., H * HEAD_DIM_V]``
    features into ``q8`` / ``s8`` (:mod:`.flash_fp8_out`); ``EMULATE`` (interpreter only): a bf16
    out rounded to nearest even before its store, as the GPU's cast does."""
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    tl.static_assert(PAD_DV == (BLOCK_DV != HEAD_DIM_V), "PAD_DV says whether BLOCK_DV pads HEAD_DIM_V")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D pads HEAD_DIM")
    b, h, m0, SQ, SK, q_row0, k_row0, q_offset, k_offset = program_tile(
        tl.program_id(0), seg_ptr, H, SQ, SK, q_offset, k_offset, False, SEGMENTED, BLOCK_M)
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    m_mask = rm < SQ
    md_mask = m_mask[:, None] & (rd < HEAD_DIM)[None, :]
    mdv_mask = m_mask[:, None] & (rdv < HEAD_DIM_V)[None, :]

    q_base = q_ptr + b * s_qb + h * s_qh + q_row0 * s_qs
    k_base = k_ptr + b * s_kb + hk * s_kh + k_row0 * s_ks
    v_base = v_ptr + b * s_vb + hk * s_vh + k_row0 * s_vs
    o_base = o_ptr + b * s_ob + h * s_oh + q_row0 * s_os
    lse_base = lse_ptr + b * s_lb + h * s_lh + q_row0 * s_ls

    q = tl.load(q_base + rm.to(tl.int64)[:, None] * s_qs + rd[None, :] * s_qd, mask=md_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    o_off = rm.to(tl.int64)[:, None] * s_os + rdv[None, :] * s_od
    if ACCUM:
        # continue from the normalised state (out_prev, lse_prev): m = lse_prev, l = 1
        m_i = tl.load(lse_base + rm.to(tl.int64) * s_ls, mask=m_mask, other=float("-inf")) * 1.4426950408889634
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = tl.load(o_base + o_off, mask=mdv_mask, other=0.0).to(tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)

    q_hi = q_offset + rm + win_right  # row i sees keys at positions [q_lo, q_hi]
    q_lo = q_offset + rm - win_left
    if RIGHT:
        # keys up to the last row's right edge are visible to some row; keys up to the first
        # row's right edge to every row (those blocks run without masks, unless LEFT cuts them)
        hi = tl.minimum(SK, tl.maximum(q_offset + m0 + BLOCK_M + win_right - k_offset, 0))
        full = tl.minimum(SK, tl.maximum(q_offset + m0 + 1 + win_right - k_offset, 0))
    else:
        hi = SK
        full = SK
    full = (full // BLOCK_N) * BLOCK_N
    full_lo = 0
    if LEFT:  # key blocks left of the window are skipped whole; [lo, full_lo) is masked
        lo, full_lo, full = window_keys(m0, q_offset, k_offset, win_left, hi, full, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, lo,
                                   full_lo, SK, k_offset, qk_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP,
                                   HEAD_DIM, PAD_D, HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, full_lo,
                               full, SK, k_offset, qk_scale, cap_scale, cap2, False, RIGHT, LEFT, SOFTCAP, HEAD_DIM,
                               PAD_D, HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, s_ks, s_kd, s_vs, s_vd, rd, rdv, q_hi, q_lo, full,
                               hi, SK, k_offset, qk_scale, cap_scale, cap2, True, RIGHT, LEFT, SOFTCAP, HEAD_DIM,
                               PAD_D, HEAD_DIM_V, PAD_DV, UPCAST, INPUT_PRECISION, BLOCK_N)
    if SINKS:
        # one more logit per head in the denominator, with no value: the sink takes probability
        # mass; lse includes it (a row that sees no key then has lse = sink, out = 0)
        sink2 = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink2)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink2 - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if EMULATE:
        out = rne_for_store(out, o_ptr)
    o = out.to(o_ptr.dtype.element_ty)
    tl.store(o_base + o_off, o, mask=mdv_mask)
    tl.store(lse_base + rm.to(tl.int64) * s_ls, lse, mask=m_mask)
    if FP8_OUT:  # out per 1x128 tile as stored, widened again (what quantize_e4m3 of out loads)
        tl.static_assert(HEAD_DIM_V % 128 == 0 and not ACCUM, "fp8_out: whole 1x128 tiles per head, no accumulate")
        rows8 = q_row0 + rm.to(tl.int64)
        store_e4m3_tiles(tl.where(mdv_mask, to_fp32(o, EMULATE), 0.0), q8_ptr + b * s_8b + h * s_8h + rows8 * s_8s,
                         s8_ptr + b * s_sb + rows8 * s_ss, rdv, mdv_mask, m_mask, h * (HEAD_DIM_V // 128),
                         H * (HEAD_DIM_V // 128), EMULATE, BLOCK_M, BLOCK_DV)


# --------------------------------------------------------------------------------------------
# Host side: validation
# --------------------------------------------------------------------------------------------
def check_qkv(q, k, v) -> None:
    """q ``[b, sq, hq, d]``, k ``[b, sk, hk, d]``, v ``[b, sk, hk, d_v]``: kernel operands of one
    dtype on one device, ``1 <= d, d_v <= MAX_HEAD_DIM`` (v may have its own head dim, as in
    MLA) and ``hk`` dividing ``hq`` (grouped-query attention)."""
    if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.dtype in SUPPORTED_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and k.device == q.device and v.device == q.device
            and (q.is_cuda or (q.is_cpu and cpu_launches())) and q.shape[0] == k.shape[0]
            and v.shape[:3] == k.shape[:3] and k.shape[3] == q.shape[3] and q.shape[2] > 0 and k.shape[2] > 0
            and 1 <= q.shape[3] <= MAX_HEAD_DIM and 1 <= v.shape[3] <= MAX_HEAD_DIM and q.shape[2] % k.shape[2] == 0):
        return  # every check below passes (the common case, on every launch: one condition)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t, dims=(4,))
        check_positive_dims(name, t, {2: "head"})
    for name, t in (("k", k), ("v", v)):
        check_same(name, t, "q", q)
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch size must equal q's ({q.shape[0]}), got {t.shape[0]}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have k's batch, length and heads {tuple(k.shape[:3])} (its own head dim), "
                         f"got shape {tuple(v.shape)}")
    d = q.shape[3]
    if k.shape[3] != d:
        raise ValueError(f"k head_dim must equal q's ({d}), got {k.shape[3]}")
    for name, n in (("head_dim", d), ("v head_dim", v.shape[3])):
        if not 1 <= n <= MAX_HEAD_DIM:
            raise ValueError(
                f"{name} must be between 1 and {MAX_HEAD_DIM} (16, 32, 64, 128 are the tuned sizes), got {n}")
    hq, hk = q.shape[2], k.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads must be a multiple of k/v heads ({hk}) for grouped-query attention, got {hq}")


def resolve_softmax_scale(scale, head_dim: int) -> float:
    """The softmax scale to use: ``head_dim ** -0.5`` for ``None``, else ``scale`` (a positive
    finite number)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"softmax_scale must be a positive finite number or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def check_offsets(q_offset, k_offset, *, optional: bool = False) -> None:
    """Global start positions of a query block and a key block: ints >= 0 (``optional``: or None,
    as :func:`resolve_offsets` takes them)."""
    for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
        if optional and off is not None and (isinstance(off, bool) or not isinstance(off, int)):
            raise TypeError(f"{name} must be None or an int, got {type(off).__name__} {off!r}")
        if not (optional and off is None):
            check_int(name, off, min_value=0)


def resolve_offsets(q_offset, k_offset, seq_q: int, seq_k: int, *, segmented: bool = False) -> tuple[int, int]:
    """The checked global start positions ``(q_offset, k_offset)`` of ``seq_q`` queries and
    ``seq_k`` keys. Both None: bottom-right aligned as flash-attn (>= 2.1), the last query at the
    last key, ``(max(seq_k - seq_q, 0), max(seq_q - seq_k, 0))`` (``(0, 0)`` when ``segmented``:
    each segment's shift aligns it). Else ints >= 0, a None one read as 0 (``(0, 0)``: top-left)."""
    check_offsets(q_offset, k_offset, optional=True)
    if q_offset is None and k_offset is None:
        return (0, 0) if segmented else (max(seq_k - seq_q, 0), max(seq_q - seq_k, 0))
    return q_offset or 0, k_offset or 0


class Segments(NamedTuple):
    """Independent attention problems inside one packed batch-1 sequence (the kernels'
    ``segments=`` argument). ``table``: int32 ``[n, 5]`` on the operands' device, one row
    ``(q_start, q_end, k_start, k_end, shift)`` per segment: query rows ``[q_start, q_end)``
    attend to key rows ``[k_start, k_end)`` only, and with ``causal`` segment-local query ``i``
    sees key ``j`` iff ``j <= i + shift``. ``max_q`` / ``max_k``: upper bounds of the segments'
    query / key lengths (they size the grid: cost follows the segments, not the total length).
    The query ranges of one table must not overlap, nor its key ranges (one program owns each
    output row); rows outside every segment are not written."""
    table: torch.Tensor
    max_q: int
    max_k: int


def check_segments(segments, q, k, q_offset=0, k_offset=0) -> None:
    """``segments`` is a :class:`Segments` for q ``[1, total_q, h, d]`` / k ``[1, total_k, ...]``
    (the offsets must be 0: each segment's ``shift`` places its causal mask).
    Its values are range-checked when the table is on the CPU; on a GPU they are trusted (they
    come from :func:`~.flash_varlen.varlen_segments`, which bounds them, or the ring schedule;
    checking them would cost a device-to-host sync per launch)."""
    if not isinstance(segments, Segments):
        raise TypeError(f"segments must be a Segments or None, got {type(segments).__name__}")
    t = segments.table
    check_tensor("segments.table", t, dims=(2,), dtypes=(torch.int32,))
    if t.shape[1] != 5:
        raise ValueError(f"segments.table must have 5 columns (q_start, q_end, k_start, k_end, shift), "
                         f"got shape {tuple(t.shape)}")
    check_same("segments.table", t, "q", q, dtype=False)
    check_int("segments.max_q", segments.max_q, min_value=0)
    check_int("segments.max_k", segments.max_k, min_value=0)
    if q.shape[0] != 1:
        raise ValueError(f"q batch size must be 1 with segments= (one packed sequence), got {q.shape[0]}")
    if q_offset or k_offset:
        raise ValueError(f"q_offset and k_offset must be 0 with segments= (each segment's shift places its causal "
                         f"mask), got {q_offset} and {k_offset}")
    if t.device.type == "cpu" and t.shape[0]:
        lq, lk = t[:, 1] - t[:, 0], t[:, 3] - t[:, 2]
        if (t[:, 0] < 0).any() or (lq < 0).any() or (t[:, 1] > q.shape[1]).any() or (lq > segments.max_q).any():
            raise ValueError(f"segments.table query ranges must lie in [0, {q.shape[1]}] with lengths <= "
                             f"max_q={segments.max_q}")
        if (t[:, 2] < 0).any() or (lk < 0).any() or (t[:, 3] > k.shape[1]).any() or (lk > segments.max_k).any():
            raise ValueError(f"segments.table key ranges must lie in [0, {k.shape[1]}] with lengths <= "
                             f"max_k={segments.max_k}")


class ScoreOptions(NamedTuple):
    """The score options of one launch, checked (:func:`score_options`): ``left`` / ``right``
    the window (query ``i`` sees keys ``j`` with ``i - left <= j <= i + right`` in global
    positions; -1 unbounded; causal is ``right = 0``), ``softcap`` (0.0: off) and ``sinks``
    (fp32 ``[heads]`` or None)."""
    left: int
    right: int
    softcap: float
    sinks: torch.Tensor | None


def check_window(window) -> tuple:
    """``None`` (no window) or ``(left, right)``: ints in ``[-1, 2**31 - 1]``, -1 unbounded."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a (left, right) pair of ints, got {window!r}")
    return tuple(check_int(f"window[{i}] ({side})", w, min_value=-1, max_value=MAX_GRID_X)
                 for i, (side, w) in enumerate(zip(("left", "right"), window)))


def check_sinks(sinks, q) -> None:
    """``None`` or an fp32 ``[heads]`` tensor (one sink logit per query head) on q's device."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, dims=(1,), dtypes=(torch.float32,))
    check_same("sinks", sinks, "q", q, dtype=False)
    if sinks.shape[0] != q.shape[-2]:
        raise ValueError(f"sinks must have shape ({q.shape[-2]},) (one logit per query head), "
                         f"got {tuple(sinks.shape)}")


def score_options(q, k, *, causal=False, window=None, softcap=None, sinks=None, q_offset=0, k_offset=0,
                  segments=None) -> ScoreOptions:
    """Checked :class:`ScoreOptions` for q ``[b, sq, hq, d]`` / k ``[b, sk, ...]``. ``causal``
    sets ``right = 0`` (as flash-attn does). Dense, a bound that cuts no key of this launch
    becomes -1 (no mask, and the kernels never see a huge window); with ``segments`` the bounds
    are clamped to ``WINDOW_CLAMP`` (2**30: beyond any segment's reach)."""
    left, right = check_window(window)
    check_bool("causal", causal)
    cap = check_softcap(softcap)
    check_sinks(sinks, q)
    if causal:
        right = 0
    if segments is not None:
        # the shifts live in the table (reading them would sync a GPU): keep the bounds, clamped
        # so that position + bound stays inside int32 for any realistic shift
        return ScoreOptions(min(left, WINDOW_CLAMP), min(right, WINDOW_CLAMP), cap, sinks)
    if left >= max(q_offset + q.shape[1] - 1 - k_offset, 0):
        left = -1
    if not causal and right >= max(k_offset + k.shape[1] - 1 - q_offset, 0):
        right = -1
    return ScoreOptions(left, right, cap, sinks)


def score_args(opts: ScoreOptions, scale: float) -> tuple:
    """The kernels' runtime score arguments ``(win_left, win_right, cap_scale, cap2)``."""
    cap = opts.softcap
    return max(opts.left, 0), max(opts.right, 0), (scale / cap if cap else 0.0), cap * LOG2E


def option_flags(q, v, opts: ScoreOptions, accumulate: bool, segmented: bool) -> dict:
    """:func:`~.flash_tiles.kernel_flags` of a launch with ``opts``."""
    return kernel_flags(q, opts.right >= 0, accumulate, segmented, v=v, window=(opts.left, opts.right),
                        softcap=opts.softcap, sinks=opts.sinks is not None)


# --------------------------------------------------------------------------------------------
# Host side: the forward launcher (ring attention calls it once per block pair)
# --------------------------------------------------------------------------------------------
def flash_attention_forward(q, k, v, *, causal=False, softmax_scale=None, q_offset=None, k_offset=None,
                            out=None, lse=None, accumulate=False, segments=None, window=None, softcap=None,
                            sinks=None, fp8_out=None):
    """One attention block: returns ``(out, lse)``.

    q ``[b, sq, hq, d]``, k ``[b, sk, hk, d]``, v ``[b, sk, hk, d_v]`` (any strides; ``d_v`` may
    differ from ``d``). Query ``i`` sits at ``q_offset + i``, key ``j`` at ``k_offset + j``
    (:func:`resolve_offsets`: None, None aligns them bottom-right; ``causal`` masks keys after the
    query). ``out`` (``[b, sq, hq, d_v]``, any strides, any supported dtype) and
    ``lse`` (``[b, hq, sq]`` fp32, any strides) are written in place when given.
    ``accumulate=True`` continues from the normalised state already held in ``(out, lse)`` (use
    an fp32 ``out``; start from ``out = 0``, ``lse = -inf``): afterwards they hold the attention
    over the union of all key blocks seen so far, which is how ring steps merge.
    ``segments`` (a :class:`Segments`, batch 1): independent problems inside the sequence (packed
    documents); the offsets are then unused (the table's ``shift`` places each causal mask).
    ``window=(left, right)``: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right`` in
    global positions (``q_offset + i``, ``k_offset + j``; with segments, segment-local
    ``i + shift - left <= j <= i + shift + right``), -1 unbounded, ``causal`` sets ``right = 0``. ``softcap``: scores ``c * tanh(s / c)``
    before the softmax. ``sinks`` (fp32 ``[hq]``): one logit per head added to the softmax's
    denominator (no value); ``lse`` includes it, so a row that sees no key gets ``out = 0``,
    ``lse = sink`` (without sinks: ``lse = -inf``). With ``accumulate``, pass sinks to one step only.
    ``fp8_out=(q8, scale)`` (blockwise recipe, ``d_v`` a multiple of 128, not with ``accumulate``):
    ``out`` as stored also quantised per 1x128 tile of its features ``[b, sq, hq * d_v]`` into
    ``q8`` (``float8_e4m3fn`` ``[b, sq, hq, d_v]``) and ``scale`` (fp32 ``[b, sq, hq * d_v // 128]``),
    each with contiguous rows, equal to ``quantize_e4m3(out.reshape(b * sq, hq * d_v), "tile")``
    bit for bit (:mod:`.flash_fp8_out`; with segments, rows outside every segment are not written).
    """
    check_qkv(q, k, v)
    q_offset, k_offset = resolve_offsets(q_offset, k_offset, q.shape[1], k.shape[1], segmented=segments is not None)
    check_bool("accumulate", accumulate)
    if segments is not None:
        check_segments(segments, q, k, q_offset, k_offset)
    opts = score_options(q, k, causal=causal, window=window, softcap=softcap, sinks=sinks, q_offset=q_offset,
                         k_offset=k_offset, segments=segments)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = resolve_softmax_scale(softmax_scale, d)
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs out= and lse= (the state to continue from)")
    out = output_buffer("out", out, (b, sq, hq, v.shape[3]), q.device, q.dtype)
    lse = output_buffer("lse", lse, (b, hq, sq), q.device, torch.float32, exact_dtype=True)
    check_attention_fp8_out(fp8_out, out.shape, out.device, accumulate=accumulate)
    if b * sq * hq == 0:
        return out, lse
    if sk == 0:
        if not accumulate:
            out.zero_()
            fill_empty_fp8_out(fp8_out)
            if sinks is None:
                lse.fill_(float("-inf"))
            else:
                lse.copy_(sinks[None, :, None].expand(lse.shape))
        return out, lse
    rows, n_b, sq_arg, sk_arg, table = sq, b, sq, sk, q  # dense: the table argument is never read
    if segments is not None:
        rows = sq_arg = segments.max_q
        n_b, sk_arg, table = segments.table.shape[0], segments.max_k, segments.table
        if n_b * rows == 0:
            return out, lse
    args = (q, k, v, out, lse, table, q if sinks is None else sinks, *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), *lse.stride(), hq, hq // hk, sq_arg, sk_arg, q_offset, k_offset, scale * LOG2E,
            *score_args(opts, scale))
    fp8_args, fp8_flags = attention_fp8_args(fp8_out, out)
    flags = {**option_flags(q, v, opts, accumulate, segments is not None), **fp8_flags}
    launch_attention_kernel(_attn_fwd_kernel, "fwd", rows, n_b * hq, args + fp8_args, flags)
    return out, lse


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal=False, softmax_scale=None, q_offset=None, k_offset=None,
                        compute_dtype=torch.float64, window=None, softcap=None, sinks=None):
    """Plain torch attention in ``compute_dtype``: ``(out, lse)`` with the same conventions as
    the flash kernels (offsets, window, softcap, sinks as :func:`flash_attention_forward`; v may
    have its own head dim; fully masked rows: out 0, lse -inf, or lse = sink). Differentiable."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    q_offset, k_offset = resolve_offsets(q_offset, k_offset, sq, sk)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qf = q.to(compute_dtype).transpose(1, 2)
    kf = k.to(compute_dtype).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vf = v.to(compute_dtype).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    left, right = (-1, -1) if window is None else window
    right = 0 if causal else right
    qi = torch.arange(sq, device=q.device)[:, None] + q_offset
    kj = torch.arange(sk, device=q.device)[None, :] + k_offset
    if right >= 0:
        s = s.masked_fill(kj > qi + right, float("-inf"))
    if left >= 0:
        s = s.masked_fill(kj < qi - left, float("-inf"))
    if sinks is not None:  # one more column: the sink logit, with no value
        sink = sinks.to(compute_dtype)[None, :, None, None].expand(b, hq, sq, 1)
        s = torch.cat((s, sink), dim=-1)
        vf = torch.cat((vf, vf.new_zeros(b, hq, 1, vf.shape[-1])), dim=-2)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = (p @ vf).transpose(1, 2)
    return out, lse
