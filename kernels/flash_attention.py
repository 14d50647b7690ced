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
* Packed documents: with a segment table (:class:`Segments`, the ``SEGMENTED`` flag) each
  program reads which query rows / key rows of one batch-1 sequence it owns and the shift of its
  causal mask (:func:`program_tile`); the varlen API (:mod:`.flash_varlen`) and ring attention
  over documents use it. The grid is one axis (:func:`attention_grid`), so batch x heads is not
  bound by CUDA's 65535 limit on axes 1 and 2.
* Accumulate modes for ring attention: the forward can continue from a previous normalised
  ``(out, lse)`` pair held in fp32 (``accumulate=True``), and the backward can add ``dq``/``dk``/
  ``dv`` into fp32 buffers, so every ring step reuses these kernels.

Layers: ``_attn_fwd_kernel`` (jit) -> :func:`flash_attention_forward` (validate, allocate,
launch); the backward kernels and :func:`~.flash_attention_bwd.flash_attention_backward` live
in :mod:`.flash_attention_bwd`; the differentiable ``flash_attention`` (a custom op,
``fusedpar.ops.flash_library``) is called through ``fusedpar.ops.flash``. :func:`attention_reference` is the plain fp64 torch oracle.
"""
from __future__ import annotations

import functools
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
    check_tensor,
    output_buffer,
)
from .runtime import autotuned, device_capability, input_precision, interpreting, needs_upcast, shared_memory_limit

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

__all__ = [
    "FP32_TILE", "MAX_GRID_X", "MAX_HEAD_DIM", "Segments", "attention_grid", "attention_reference", "check_offsets",
    "check_qkv", "check_segments", "flash_attention_forward", "gpu_configs", "kernel_flags", "launch_attention_kernel",
    "launch_smem_estimate", "program_tile", "register_estimate", "resolve_softmax_scale", "smem_estimate",
    "uses_wgmma",
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
def program_tile(seg_ptr, H, SQ, SK, q_offset, k_offset, ON_KEYS: tl.constexpr, SEGMENTED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """What this program computes: ``(b, h, start, SQ, SK, q_row0, k_row0, q_offset, k_offset)``.

    The grid is one axis of ``cdiv(rows, BLOCK) * batch * H`` programs (block index fastest;
    :func:`attention_grid`), ``rows`` being SQ (query-row kernels) or SK (``ON_KEYS``: dK/dV).
    Dense: batch ``b`` of the ``[b, s, h, d]`` operands, rows from 0. ``SEGMENTED``: ``b`` is a
    row of the segment table ``[n, 5]`` int32 ``(q_start, q_end, k_start, k_end, shift)`` and
    SQ/SK are only the maximal lengths: the segment's query rows ``[q_start, q_end)`` attend to
    keys ``[k_start, k_end)``, causal visibility ``j <= i + shift`` (segment-local ``i, j``), so
    q_offset = shift, k_offset = 0. A block past its segment's rows gets an empty range (the
    other length 0): its loops run no iteration and its masked stores write nothing."""
    pid = tl.program_id(0)
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
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seg_ptr,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_ob, s_os, s_oh, s_od,
    s_lb, s_lh, s_ls,
    H, GROUP, SQ, SK, q_offset, k_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
    ACCUM: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, SEGMENTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= 16, "tl.dot needs a contraction of at least 16")
    tl.static_assert(PAD_D == (BLOCK_D != HEAD_DIM), "PAD_D says whether BLOCK_D pads HEAD_DIM")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D pads HEAD_DIM")
    b, h, m0, SQ, SK, q_row0, k_row0, q_offset, k_offset = program_tile(
        seg_ptr, H, SQ, SK, q_offset, k_offset, False, SEGMENTED, BLOCK_M)
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    m_mask = rm < SQ
    d_mask = rd < HEAD_DIM
    md_mask = m_mask[:, None] & d_mask[None, :]

    q_base = q_ptr + b * s_qb + h * s_qh + q_row0 * s_qs
    k_base = k_ptr + b * s_kb + hk * s_kh + k_row0 * s_ks
    v_base = v_ptr + b * s_vb + hk * s_vh + k_row0 * s_vs
    o_base = o_ptr + b * s_ob + h * s_oh + q_row0 * s_os
    lse_base = lse_ptr + b * s_lb + h * s_lh + q_row0 * s_ls

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


#: per kernel kind: (BLOCK_M, BLOCK_N, num_stages, num_warps). Measured with ``python -m benchmarks
#: compile --family flash`` (ptxas, sm_90 and sm_80): these compile without register spills at
#: head_dim <= 128 in bf16/fp16. For dK/dV BLOCK_N is the resident key block (its dK and dV fp32
#: accumulators dominate the registers), BLOCK_M the streamed query block. The last entry,
#: ``FP32_TILE``, is the only one fp32 "ieee" launches keep (their dots run on FMA units).
FP32_TILE = (32, 16)
_GPU_CONFIGS = {
    "fwd": [(128, 64, 3, 8), (64, 128, 3, 8), (64, 64, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4), (32, 32, 3, 4),
            (*FP32_TILE, 2, 4)],
    "dq": [(64, 128, 3, 8), (64, 64, 3, 8), (64, 32, 4, 4), (32, 32, 3, 4), (*FP32_TILE, 2, 4)],
    "dkdv": [(32, 64, 3, 8), (32, 32, 3, 4), (*FP32_TILE, 2, 4)],
}
#: live fp32 score tiles ([BLOCK_M, BLOCK_N]) and the register budget (32-bit registers per
#: thread for the tiles of :func:`register_estimate`) each kind compiles within without spills
_SCORE_TILES = {"fwd": 2, "dq": 2, "dkdv": 4}
_REGISTER_BUDGET = {"fwd": 160, "dq": 160, "dkdv": 128}


def gpu_configs(kind: str):
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_stages=stages, num_warps=warps)
            for bm, bn, stages, warps in _GPU_CONFIGS[kind]]


def register_estimate(kind: str, block_m: int, block_n: int, block_d: int, num_warps: int, elem_size: int) -> int:
    """32-bit registers per thread of the live tiles of one program: the fp32 accumulators
    (O or dQ: one ``[rows, BLOCK_D]``; dK/dV: two), the resident operands (Q; Q and dO; K and V)
    and the fp32 score tiles. The prune rule keeps configs within ``_REGISTER_BUDGET``."""
    rows = block_n if kind == "dkdv" else block_m
    n_acc, n_res = (1, 1) if kind == "fwd" else (1, 2) if kind == "dq" else (2, 2)
    words = rows * block_d * (n_acc + n_res * elem_size / 4) + _SCORE_TILES[kind] * block_m * block_n
    return int(words // (32 * num_warps))


def uses_wgmma(kind: str, block_m: int, block_n: int, capability: tuple, precision: str) -> bool:
    """Whether Triton compiles the kernel's dots to Hopper wgmma (operands from shared memory):
    sm_90 with a 64-row MMA tile (the rows are BLOCK_N for dK/dV) and tensor-core precision."""
    rows = block_n if kind == "dkdv" else block_m
    return capability[0] == 9 and rows >= 64 and precision != "ieee_fp32"


def smem_estimate(kind: str, cfg, block_d: int, elem_size: int, capability: tuple, precision: str = "") -> int:
    """Shared memory (bytes) of one program as Triton 3.9 allocates it (checked against the
    compiler by ``python -m benchmarks compile``). wgmma: ``num_stages`` buffers of the streamed
    tile pair plus the resident tiles (Q; Q and dO; K and V). mma.sync and fp32 "ieee" FMA dots:
    ``num_stages - 1`` buffers plus the layout-conversion buffers of the resident and score tiles
    (fitted per kernel from the compiler's figures). dK/dV also pipelines lse and delta. ``precision``:
    "" (16-bit operands), "ieee_fp32" or "tf32" (fp32 operands, FMA or tensor-core dots)."""
    bm, bn, stages, e = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_stages, elem_size
    stream_rows, rows = (bm, bn) if kind == "dkdv" else (bn, bm)
    pair = stream_rows * block_d * 2 * e
    tile = rows * block_d * e  # one resident tile
    n_res = 1 if kind == "fwd" else 2
    lse = (stages - 1) * 2 * bm * 4 if kind == "dkdv" else 0
    if uses_wgmma(kind, bm, bn, capability, precision):
        # tf32: the fp32 resident operands of dQ / dK/dV stage one tile (fitted)
        return stages * pair + (1 if precision == "tf32" and kind != "fwd" else n_res) * tile + lse
    base = (stages - 1) * pair + lse
    if precision == "ieee_fp32":
        return base + n_res * tile + bm * bn * e
    if precision == "tf32" and kind != "fwd":  # mma.sync on fp32 operands (fitted)
        if kind == "dq":
            return base + (tile if bn <= bm else 0) + min(bm, bn) * 32 * e + bm * bn * e
        return base + (n_res * tile + bm * block_d * e if bn < bm else tile + (bm * bn * e // 2 if bn > bm else 0))
    if kind == "fwd":
        return base + tile + (bm * bn * e if bm < block_d else 0)
    if kind == "dq":
        return base + (tile if bn <= bm else 0) + min(bm, bn) * 32 * e
    return base + tile + bm * bn * e + (bm * block_d * e if bn > bm else 0)


def launch_smem_estimate(kind: str, cfg, named_args, **kwargs) -> int:
    """:func:`smem_estimate` of ``cfg`` for an autotuned launch with ``named_args`` (the prune
    rule's figure; the compile check compares it with the compiler's)."""
    q = named_args["q_ptr"]
    precision = ("" if q.element_size() != 4 else
                 "ieee_fp32" if kwargs.get("INPUT_PRECISION") == "ieee" else "tf32")
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    return smem_estimate(kind, cfg, bd, q.element_size(), device_capability(q.device.index or 0),
                         precision)


def _prune(kind):
    def prune(configs, named_args, **kwargs):
        """Drop configs whose tiles overflow shared memory or the register budget, or are far
        larger than the sequence (a 128-row tile on a 40-row problem only wastes work)."""
        q = named_args["q_ptr"]
        bd, elem = kwargs.get("BLOCK_D", named_args.get("BLOCK_D")), q.element_size()
        limit = shared_memory_limit(q.device.index or 0)
        sq, sk = named_args["SQ"], named_args["SK"]
        ieee_fp32 = kwargs.get("INPUT_PRECISION") == "ieee" and elem == 4
        kept = []
        for cfg in configs:
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            if launch_smem_estimate(kind, cfg, named_args, **kwargs) > limit:
                continue
            if register_estimate(kind, bm, bn, bd, cfg.num_warps, elem) > _REGISTER_BUDGET[kind]:
                continue
            if kind == "dq" and bd < 128 and bm > 32 and device_capability(q.device.index or 0)[0] < 9:
                continue  # measured: 64-row dQ tiles of a head_dim-64 spill with mma.sync (sm_80)
            if elem == 4 and not ieee_fp32 and (bn > 64 if kind == "dq" else kind == "dkdv" and bn > bm and
                                                 device_capability(q.device.index or 0)[0] < 9):
                continue  # measured, tf32: 128-wide dQ key blocks (sm_90) and wide dK/dV tiles (sm_80) spill
            if ieee_fp32 != ((bm, bn) == FP32_TILE):
                continue  # fp32 "ieee" dots run on FMA units: only FP32_TILE compiles (nearly) without spills
            if bm > 2 * triton.next_power_of_2(sq) and bm > 32:
                continue
            if bn > 2 * triton.next_power_of_2(sk) and bn > 32:
                continue
            kept.append(cfg)
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]

    return prune


@functools.lru_cache(maxsize=None)
def _tuned(kernel, kind: str):
    return autotuned(
        kernel, configs=gpu_configs(kind),
        key=["SQ", "SK", "HEAD_DIM", "CAUSAL", "GROUP", "SEGMENTED", "INPUT_PRECISION"],  # fp32 ieee prunes differently
        prune=_prune(kind), restore_value=_RESTORE[kind],
    )


#: CUDA's limit on grid axis 0 (axes 1 and 2 stop at 65535, so nothing goes there)
MAX_GRID_X = 2**31 - 1


def attention_grid(rows: int, n_bh: int, block: int) -> tuple:
    """The launch grid of an attention kernel: ``(cdiv(rows, block) * n_bh,)`` programs on axis 0
    (block index fastest, see ``program_tile``); ``n_bh`` counts (batch or segment) x heads.
    One axis keeps batch x heads beyond axis 1's 65535 launchable."""
    n = triton.cdiv(rows, block) * n_bh
    if n > MAX_GRID_X:
        raise ValueError(f"attention grid must have at most {MAX_GRID_X} programs (CUDA grid axis 0), "
                         f"got {n} ({triton.cdiv(rows, block)} blocks x {n_bh} batch-heads)")
    return (n,)


def launch_attention_kernel(kernel, kind: str, grid_rows: int, n_bh: int, args, flags) -> None:
    """Launch one attention kernel over :func:`attention_grid` programs: fixed small blocks under
    the interpreter, the autotuned configs on a GPU. ``kind`` is ``"fwd"``, ``"dq"`` (one program
    per block of query rows) or ``"dkdv"`` (one per block of key rows)."""
    if kind not in _RESTORE:
        raise ValueError(f"kind must be one of {tuple(_RESTORE)}, got {kind!r}")
    key = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    if interpreting():
        cfg = INTERPRETER_CONFIG
        kernel[attention_grid(grid_rows, n_bh, cfg[key])](*args, **flags, **cfg)
        return
    attention_grid(grid_rows, n_bh, min(c.kwargs[key] for c in gpu_configs(kind)))  # fail here, not in autotune
    grid = lambda meta: attention_grid(grid_rows, n_bh, meta[key])  # noqa: E731
    with torch.cuda.device(args[0].device):
        _tuned(kernel, kind)[grid](*args, **flags)


def kernel_flags(q: torch.Tensor, causal: bool, accumulate: bool, segmented: bool = False) -> dict:
    """The compile-time flags every attention kernel takes, for q ``[b, s, h, d]``."""
    d = q.shape[3]
    bd = max(16, triton.next_power_of_2(d))
    return dict(HEAD_DIM=d, BLOCK_D=bd, PAD_D=bd != d, CAUSAL=bool(causal), ACCUM=bool(accumulate),
                UPCAST=needs_upcast(q.dtype), INPUT_PRECISION=input_precision(q.dtype), SEGMENTED=bool(segmented))


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
    come from :func:`~.flash_varlen.varlen_segments` or the ring schedule; checking
    them would cost a device-to-host sync per launch)."""
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


# --------------------------------------------------------------------------------------------
# Host side: the forward launcher (ring attention calls it once per block pair)
# --------------------------------------------------------------------------------------------
def flash_attention_forward(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0,
                            out=None, lse=None, accumulate=False, segments=None):
    """One attention block: returns ``(out, lse)``.

    q ``[b, sq, hq, d]``, k/v ``[b, sk, hk, d]`` (any strides). ``out`` (same shape as q, any
    strides, any supported dtype) and ``lse`` (``[b, hq, sq]`` fp32, any strides) are written in
    place when given. ``accumulate=True`` continues from the normalised state already held in
    ``(out, lse)`` (use an fp32 ``out``; start from ``out = 0``, ``lse = -inf``): afterwards they
    hold the attention over the union of all key blocks seen so far, which is how ring steps merge.
    ``segments`` (a :class:`Segments`, batch 1): independent problems inside the sequence (packed
    documents); the offsets are then unused (the table's ``shift`` places each causal mask).
    """
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset)
    check_bool("causal", causal)
    check_bool("accumulate", accumulate)
    if segments is not None:
        check_segments(segments, q, k, q_offset, k_offset)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = resolve_softmax_scale(softmax_scale, d)
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate=True needs out= and lse= (the state to continue from)")
    out = output_buffer("out", out, q.shape, q.device, q.dtype)
    lse = output_buffer("lse", lse, (b, hq, sq), q.device, torch.float32, exact_dtype=True)
    if b * sq * hq == 0:
        return out, lse
    if sk == 0:
        if not accumulate:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    rows, n_b, sq_arg, sk_arg, table = sq, b, sq, sk, q  # dense: the table argument is never read
    if segments is not None:
        rows = sq_arg = segments.max_q
        n_b, sk_arg, table = segments.table.shape[0], segments.max_k, segments.table
        if n_b * rows == 0:
            return out, lse
    args = (q, k, v, out, lse, table, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
            hq, hq // hk, sq_arg, sk_arg, q_offset, k_offset, scale * LOG2E)
    flags = kernel_flags(q, causal, accumulate, segments is not None)
    launch_attention_kernel(_attn_fwd_kernel, "fwd", rows, n_b * hq, args, flags)
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
