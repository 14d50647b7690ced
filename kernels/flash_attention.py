"""Flash attention for ``[batch, seq, heads, head_dim]`` tensors: the forward kernel and launcher,
the argument checks and launch helpers shared with the backward (:mod:`.flash_attention_bwd`),
and the plain torch oracle.

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

Layers: ``_attn_fwd_kernel`` (jit) -> :func:`flash_attention_forward` (validate, allocate,
launch); the backward kernels and :func:`~.flash_attention_bwd.flash_attention_backward` live
in :mod:`.flash_attention_bwd`; the differentiable ``flash_attention`` (autograd) lives in
``fusedpar.ops.flash``. :func:`attention_reference` is the plain fp64 torch oracle.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .checks import check_bool, check_buffer, check_float_tensor, check_int, check_positive_dims, check_same
from .runtime import input_precision, interpreting, needs_upcast, shared_memory_limit

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

__all__ = [
    "MAX_HEAD_DIM", "attention_reference", "check_offsets", "check_qkv", "flash_attention_forward",
    "kernel_flags", "launch_attention_kernel", "resolve_softmax_scale",
]


# --------------------------------------------------------------------------------------------
# Triton kernel
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


# --------------------------------------------------------------------------------------------
# Configurations: fixed small blocks under the interpreter, autotuned pruned configs on GPU
# --------------------------------------------------------------------------------------------
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)
#: which outputs a tuning run of each kernel kind writes (restored between configs: the
#: accumulate modes read them, so tuning runs must not compound them)
_RESTORE = {"fwd": ["o_ptr", "lse_ptr"], "dq": ["dq_ptr"], "dkdv": ["dk_ptr", "dv_ptr"]}


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
def _tuned(kernel, kind: str):
    return triton.autotune(
        configs=gpu_configs(kind),
        key=["SQ", "SK", "HEAD_DIM", "CAUSAL", "GROUP"],
        prune_configs_by={"early_config_prune": _prune(kind)},
        restore_value=_RESTORE[kind],
    )(kernel)


def launch_attention_kernel(kernel, kind: str, grid_rows: int, n_bh: int, args, flags) -> None:
    """Launch one attention kernel over ``(cdiv(grid_rows, block), n_bh)`` programs: fixed small
    blocks under the interpreter, the autotuned configs on a GPU. ``kind`` is ``"fwd"``, ``"dq"``
    (one program per block of query rows) or ``"dkdv"`` (one per block of key rows)."""
    if kind not in _RESTORE:
        raise ValueError(f"kind must be one of {tuple(_RESTORE)}, got {kind!r}")
    key = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    if interpreting():
        cfg = INTERPRETER_CONFIG
        kernel[(triton.cdiv(grid_rows, cfg[key]), n_bh)](*args, **flags, **cfg)
        return
    grid = lambda meta: (triton.cdiv(grid_rows, meta[key]), n_bh)  # noqa: E731
    with torch.cuda.device(args[0].device):
        _tuned(kernel, kind)[grid](*args, **flags)


def kernel_flags(q: torch.Tensor, causal: bool, accumulate: bool) -> dict:
    """The compile-time flags every attention kernel takes, for q ``[b, s, h, d]``."""
    d = q.shape[3]
    bd = max(16, triton.next_power_of_2(d))
    return dict(HEAD_DIM=d, BLOCK_D=bd, PAD_D=bd != d, CAUSAL=bool(causal), ACCUM=bool(accumulate),
                UPCAST=needs_upcast(q.dtype), INPUT_PRECISION=input_precision(q.dtype))


# --------------------------------------------------------------------------------------------
# Host side: validation
# --------------------------------------------------------------------------------------------
def check_qkv(q, k, v) -> None:
    """q ``[b, sq, hq, d]``, k/v ``[b, sk, hk, d]``: kernel operands of one dtype on one device,
    ``1 <= d <= MAX_HEAD_DIM`` and ``hk`` dividing ``hq`` (grouped-query attention)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t, dims=(4,))
        check_positive_dims(name, t, {2: "head"})
    for name, t in (("k", k), ("v", v)):
        check_same(name, t, "q", q)
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch size must equal q's ({q.shape[0]}), got {t.shape[0]}")
    check_same("v", v, "k", k, device=False, dtype=False, shape=True)
    d = q.shape[3]
    if k.shape[3] != d:
        raise ValueError(f"k head_dim must equal q's ({d}), got {k.shape[3]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be between 1 and {MAX_HEAD_DIM} (16, 32, 64, 128 are the tuned sizes), got {d}")
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


def check_offsets(q_offset, k_offset) -> None:
    """Global start positions of a query block and a key block: non-negative ints."""
    check_int("q_offset", q_offset, min_value=0)
    check_int("k_offset", k_offset, min_value=0)


# --------------------------------------------------------------------------------------------
# Host side: the forward launcher (ring attention calls it once per block pair)
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
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset)
    check_bool("causal", causal)
    check_bool("accumulate", accumulate)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = resolve_softmax_scale(softmax_scale, d)
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
    args = (q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
            hq, hq // hk, sq, sk, q_offset, k_offset, scale * LOG2E)
    launch_attention_kernel(_attn_fwd_kernel, "fwd", sq, b * hq, args, kernel_flags(q, causal, accumulate))
    return out, lse


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0,
                        compute_dtype=torch.float64):
    """Plain torch attention in ``compute_dtype``: ``(out, lse)`` with the same conventions as
    the flash kernels (fully masked rows: out 0, lse -inf). Differentiable."""
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
