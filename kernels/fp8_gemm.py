"""Scaled fp8 GEMM: ``C = act((A_fp8 * sa) @ (B_fp8 * sb)^T (+ bias)) (+ R)``, fp32 accumulation,
bf16 / fp16 / fp32 output.

``A`` is ``[M, K]`` and ``B`` ``[N, K]`` (the ``nn.Linear`` layout: both contiguous along K, what
fp8 tensor cores want), both ``float8_e4m3fn`` as :func:`~fusedpar.kernels.fp8.quantize_e4m3`
writes them, with their fp32 scales:

* ``"rowwise"``: ``sa[M]``, ``sb[N]``; the main loop is a plain fp8 GEMM and the epilogue
  multiplies the fp32 accumulator by ``sa[m] * sb[n]``.
* ``"blockwise"`` (DeepSeek-V3): ``sa[M, ceil(K/128)]`` (1x128 tiles of A) and ``sb`` either
  ``[ceil(N/128), ceil(K/128)]`` (128x128 blocks: weights) or ``[N, ceil(K/128)]`` (1x128 tiles:
  the weight gradient's token-blocked operands). The main loop steps K one 128-wide scale block at
  a time (``BLOCK_K == 128``): each step's fp8 dot starts from zero and is added to the fp32
  accumulator times ``sa[m, k] * sb[n, k]``. A ragged last K block is masked (zeros).

The epilogue is the bf16 GEMM's (:func:`~fusedpar.kernels.gemm_core.gemm_epilogue`, in this order):
the accumulator times the scales, the bias, the optional store of the pre-activation
(``preact_out``, for the activation's backward), the activation (gated ones: B holds ``2F`` rows,
gate then up, whose up accumulator has its own rows' scales), the residual, the store, and the
optional e4m3 quantisation of the stored output per 1x128 tile (``fp8_out``,
:mod:`.gemm_fp8_epilogue`): the fp8 up projection hands its activation to the fp8 down projection
with no pass in between (compiled loads that do not vectorise: after the GEMM, :func:`epilogue_fits`).

Layers: ``_fp8_gemm_kernel`` (jit) -> :func:`fp8_matmul` (validate, allocate, launch; autotuned on a
GPU, one fixed tile under the interpreter) -> :func:`fp8_matmul_reference` (float64 product of the
dequantised operands, the tests' oracle). Needs fp8 tensor cores (compute capability >= 8.9).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .checks import (check_bool, check_buffer, check_choice, check_out_dtype, check_same, check_shape,
                     check_supported_dtype, check_tensor, output_buffer)
from .fp8 import FP8_BLOCK, check_fp8_device, dequantize_e4m3, rne_for_store, round_to_bf16, store_e4m3_tiles, to_fp32
from .fp8_gemm_configs import (FP8_GROUPED_INTERPRETER_CONFIGS, FP8_INTERPRETER_CONFIG, FP8_INTERPRETER_CONFIG_FP8_OUT,
                               FP8_PROMOTE_K, FP8_TUNING_KEY, GROUPED_FP8_ACC_BUDGET, SCALINGS,
                               UNALIGNED_FP8_GROUPED_TILE, UNALIGNED_FP8_TILE, fp8_configs_of_kind, fp8_gpu_configs,
                               fp8_grouped_configs, fp8_interpreter_config, fp8_smem_estimate, fp8_tile_rule,
                               fp8_tma_configs, grouped_fp8_flags, grouped_fp8_scales, prune_fp8_configs)
from .gemm_core import gemm_epilogue, gemm_mainloop, grouped_tile, operand_descriptors, split_columns
from .gemm_fp8_epilogue import check_fp8_output, fp8_output_args, quantize_output
from .gemm_loads import ensure_scratch_allocator, note_launch, num_programs, tma_capable, tma_layout
from .launch import launch_kernel
from .runtime import (ACTIVATIONS, RowView, activation_reference, apply_up, autotuned, cdiv, interpreting, on_device,
                      pipelined, row_offsets)

__all__ = [
    # the tiles, rules and grouped helpers, from .fp8_gemm_configs (the grouped and persistent GEMMs import them here)
    "FP8_GROUPED_INTERPRETER_CONFIGS", "FP8_INTERPRETER_CONFIG", "FP8_INTERPRETER_CONFIG_FP8_OUT", "FP8_PROMOTE_K",
    "GROUPED_FP8_ACC_BUDGET", "SCALINGS", "UNALIGNED_FP8_GROUPED_TILE", "UNALIGNED_FP8_TILE", "fp8_configs_of_kind",
    "fp8_gpu_configs", "fp8_grouped_configs", "fp8_smem_estimate", "fp8_tile_rule", "grouped_fp8_flags",
    "grouped_fp8_scales",
    "FP8_RECIPES", "epilogue_fits", "fp8_matmul", "fp8_matmul_reference",
]
_ACTIVATION_NAMES = tuple(sorted(ACTIVATIONS))  # the order the error messages list them in
#: the training recipes: scaling -> (granularity of activations and gradients, of weights) of
#: :func:`~fusedpar.kernels.fp8.quantize_e4m3` (a weight gradient's operands both take the first)
FP8_RECIPES = {"rowwise": ("row", "row"), "blockwise": ("tile", "block")}


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr, aux_up_ptr,
    M, N, K,
    a_inner, a_so, s_am, s_ak, s_bn, s_bk, c_inner, c_so, s_cm, s_cn, sa_inner, sa_so, s_sam, s_sak, s_sbn, s_sbk,
    r_inner, r_so, s_rm, s_rn, glu_offset, s_xm, s_xn,
    q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
    BLOCKWISE: tl.constexpr, B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr, EMULATE: tl.constexpr, PROMOTE_K: tl.constexpr, A_SPLIT: tl.constexpr,
    SA_SPLIT: tl.constexpr, C_SPLIT: tl.constexpr, R_SPLIT: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, STORE_AUX: tl.constexpr, FP8_OUT: tl.constexpr,
    Q_M_SPLIT: tl.constexpr, S_M_SPLIT: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr = 1,
):
    """As ``_gemm_kernel`` (:mod:`.gemm`): persistent over the tiles with TMA loads (both operands
    contiguous along K), one tile per program with pointer loads; the core's main loop with the
    scales (``BLOCKWISE``: a fresh dot per 128-deep step; rowwise: promoted every ``PROMOTE_K``,
    None: fast accumulation), then :func:`_fp8_store` per tile or column half."""
    tl.static_assert(BLOCK_K >= 32, "an fp8 dot needs BLOCK_K >= 32")
    tl.static_assert(not BLOCKWISE or BLOCK_K == 128, "blockwise scaling steps K one 128-wide scale block at a time")
    tl.static_assert(B_SCALE_ROWS == 1 or B_SCALE_ROWS == 128, "B's scales cover 1 or 128 rows")
    tl.static_assert(PROMOTE_K is None or PROMOTE_K <= BLOCK_K, "the fp32 promotion interval must be at most one K step")
    tl.static_assert(ACT >= 0 and ACT <= 4, "unknown activation code")
    tl.static_assert(not FP8_OUT or (BLOCK_N // EPILOGUE_SPLIT) % 128 == 0, "the fp8 output needs whole 1x128 tiles")
    tl.static_assert(not (TMA and A_SPLIT), "TMA loads plain 2-D views")
    pid = tl.program_id(0)
    if TMA:
        a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N + glu_offset, K, s_am, s_ak, s_bk, s_bn, True, True,
                                             BLOCK_M, BLOCK_N, BLOCK_K)
        programs = tl.num_programs(0)
        tile_c = pid - programs  # the epilogue's own tile counter (tutorial 09)
        for tile in tl.range(pid, tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), programs, flatten=True):
            tile_c += programs
            _fp8_tile(tile, tile_c, a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr,
                      aux_up_ptr, a_desc, b_desc, M, N, K, a_inner, a_so, s_am, s_ak, s_bn, s_bk, c_inner, c_so, s_cm,
                      s_cn, sa_inner, sa_so, s_sam, s_sak, s_sbn, s_sbk, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm,
                      s_xn, q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, BLOCKWISE,
                      B_SCALE_ROWS, HAS_BIAS, HAS_RESIDUAL, EVEN_K, EMULATE, PROMOTE_K, A_SPLIT, SA_SPLIT, C_SPLIT,
                      R_SPLIT, ACT, GLU, STORE_AUX, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, TMA, BLOCK_M, BLOCK_N, BLOCK_K,
                      GROUP_M, EPILOGUE_SPLIT)
    else:
        _fp8_tile(pid, pid, a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr,
                  aux_up_ptr, a_ptr, b_ptr, M, N, K, a_inner, a_so, s_am, s_ak, s_bn, s_bk, c_inner, c_so, s_cm,
                  s_cn, sa_inner, sa_so, s_sam, s_sak, s_sbn, s_sbk, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm,
                  s_xn, q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, BLOCKWISE,
                  B_SCALE_ROWS, HAS_BIAS, HAS_RESIDUAL, EVEN_K, EMULATE, PROMOTE_K, A_SPLIT, SA_SPLIT, C_SPLIT,
                  R_SPLIT, ACT, GLU, STORE_AUX, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, TMA, BLOCK_M, BLOCK_N, BLOCK_K,
                  GROUP_M, EPILOGUE_SPLIT)


@triton.jit
def _fp8_tile(
    tile, tile_c, a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr, aux_up_ptr, a_desc,
    b_desc, M, N, K, a_inner, a_so, s_am, s_ak, s_bn, s_bk, c_inner, c_so, s_cm, s_cn, sa_inner, sa_so, s_sam, s_sak,
    s_sbn, s_sbk, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm, s_xn,
    q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
    BLOCKWISE: tl.constexpr, B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr, EMULATE: tl.constexpr, PROMOTE_K: tl.constexpr, A_SPLIT: tl.constexpr,
    SA_SPLIT: tl.constexpr, C_SPLIT: tl.constexpr, R_SPLIT: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr,
    STORE_AUX: tl.constexpr, FP8_OUT: tl.constexpr, Q_M_SPLIT: tl.constexpr, S_M_SPLIT: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):
    """Output tile ``tile`` of ``_fp8_gemm_kernel`` (``tile_c``: the same, counted for the epilogue).
    A's rows, its scales' rows, the output's and the residual's are two-level row views (a strided
    ``[batch, seq-chunk]`` view of a larger tensor is read and written in place)."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    UP_BLOCKS: tl.constexpr = GLU and BLOCKWISE and B_SCALE_ROWS == 128
    if UP_BLOCKS:  # the tile's up rows lie in two 128-row scale blocks at most: two scales a step
        tl.static_assert(BLOCK_N <= 128, "a gated tile's up rows span at most two scale blocks")
        up_block = (pid_n * BLOCK_N + glu_offset) // 128
        sb_up = sb_ptr + up_block.to(tl.int64) * s_sbn
        up_first = rn + glu_offset < (up_block + 1) * 128
        up_second = (up_block + 1) * 128 - glu_offset < N  # the second block holds an output column
    else:
        sb_up = sb_ptr + ((rn + glu_offset) // B_SCALE_ROWS).to(tl.int64) * s_sbn
        up_first, up_second = rn < N, False
    acc, acc_up = gemm_mainloop(
        a_ptr, b_ptr, row_offsets(rm, a_inner, a_so, s_am, A_SPLIT), rn.to(tl.int64) * s_bn,
        (rn + glu_offset).to(tl.int64) * s_bn, rm < M, rn < N, K, 1, 0, s_ak, 1, 0, s_bk,
        False, False, GLU, False, EVEN_K, "ieee", BLOCK_M, BLOCK_N, BLOCK_K,
        a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, glu_offset, TMA, True, True,
        sa_ptr + row_offsets(rm, sa_inner, sa_so, s_sam, SA_SPLIT), sb_ptr + (rn // B_SCALE_ROWS).to(tl.int64) * s_sbn,
        sb_up, s_sak, s_sbk, 2 if BLOCKWISE else 1, PROMOTE_K, 0, up_first, up_second, s_sbn, UP_BLOCKS,
    )
    pid_m, pid_n = grouped_tile(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if EPILOGUE_SPLIT == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        acc0, acc1 = split_columns(acc, BLOCK_M, BLOCK_N)
        up0, up1 = acc0, acc1  # (no up half unless GLU)
        if GLU:
            up0, up1 = split_columns(acc_up, BLOCK_M, BLOCK_N)
        _fp8_store(acc0, up0, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr,
                   aux_up_ptr, c_inner, c_so, s_cm, s_cn, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm, s_xn, q_ptr,
                   s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, HAS_BIAS, HAS_RESIDUAL,
                   EMULATE, C_SPLIT, R_SPLIT, ACT, GLU, STORE_AUX, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, BLOCK_M, HALF)
        _fp8_store(acc1, up1, pid_m * BLOCK_M, pid_n * BLOCK_N + HALF, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr,
                   bias_up_ptr, aux_up_ptr, c_inner, c_so, s_cm, s_cn, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm,
                   s_xn, q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, HAS_BIAS,
                   HAS_RESIDUAL, EMULATE, C_SPLIT, R_SPLIT, ACT, GLU, STORE_AUX, FP8_OUT, Q_M_SPLIT, S_M_SPLIT,
                   BLOCK_M, HALF)
    else:
        _fp8_store(acc, acc_up, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr,
                   aux_up_ptr, c_inner, c_so, s_cm, s_cn, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm, s_xn, q_ptr,
                   s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, HAS_BIAS, HAS_RESIDUAL,
                   EMULATE, C_SPLIT, R_SPLIT, ACT, GLU, STORE_AUX, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _fp8_store(
    acc, acc_up, m_start, n_start, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr, bias_up_ptr, aux_up_ptr,
    c_inner, c_so, s_cm, s_cn, r_inner, r_so, s_rm, s_rn, glu_offset, s_xm, s_xn,
    q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE: tl.constexpr, C_SPLIT: tl.constexpr,
    R_SPLIT: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr, STORE_AUX: tl.constexpr, FP8_OUT: tl.constexpr,
    Q_M_SPLIT: tl.constexpr, S_M_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The epilogue of the scaled tile ``acc`` (``acc_up``: the up half) from row ``m_start``,
    column ``n_start``: bias, pre-activation, activation, residual, store, e4m3 output (module
    docstring). The gated up half's bias and pre-activation go through pointers of their own
    (``bias + glu_offset``, ``preact_out[:, N:]``: launch arguments whose alignment Triton
    specialises on; loads and stores at ``glu_offset`` = 72 columns spilled 28-96 B on sm_90)."""
    rm = m_start + tl.arange(0, BLOCK_M)
    rn = n_start + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    if HAS_BIAS:
        acc += to_fp32(tl.load(bias_ptr + rn, mask=n_mask, other=0.0), EMULATE)[None, :]
        if GLU:
            acc_up += to_fp32(tl.load(bias_up_ptr + rn, mask=n_mask, other=0.0), EMULATE)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    x_off = rm64[:, None] * s_xm + rn64[None, :] * s_xn
    if STORE_AUX and GLU:
        up = acc_up
        if EMULATE:
            up = rne_for_store(acc_up, aux_up_ptr)
        tl.store(aux_up_ptr + x_off, up.to(aux_up_ptr.dtype.element_ty), mask=mn_mask)
    # the GEMM epilogue (kernels/gemm_core.py): pre-activation store (the gate half), activation
    acc = gemm_epilogue(acc, acc_up, rn, n_mask, mn_mask, bias_ptr, aux_ptr, x_off, glu_offset, s_xn,
                        False, STORE_AUX, ACT, False, EMULATE)
    if GLU:
        if ACT == 4:
            acc = acc * apply_up(acc_up, ACT)
        else:
            acc = acc * acc_up
    if HAS_RESIDUAL:  # added in fp32 (a partial sum received from a peer, an accumulated gradient)
        r_off = row_offsets(rm, r_inner, r_so, s_rm, R_SPLIT)[:, None] + rn64[None, :] * s_rn
        acc += to_fp32(tl.load(r_ptr + r_off, mask=mn_mask, other=0.0), EMULATE)
    if EMULATE and c_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16(acc)  # the interpreter's bf16 cast truncates (kernels/fp8.py)
    c_off = row_offsets(rm, c_inner, c_so, s_cm, C_SPLIT)[:, None] + rn64[None, :] * s_cn
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + c_off, c, mask=mn_mask)
    if FP8_OUT:  # C per 1x128 tile as stored, widened again (what quantize_e4m3 of C loads) into q, s
        store_e4m3_tiles(tl.where(mn_mask, to_fp32(c, EMULATE), 0.0),
                         q_ptr + row_offsets(rm, q_m_inner, s_qm0, s_qm1, Q_M_SPLIT),
                         s_ptr + row_offsets(rm, sc_m_inner, s_sm0, s_sm1, S_M_SPLIT), rn, mn_mask, m_mask,
                         n_start // 128, n_tiles, EMULATE, BLOCK_M, BLOCK_N)


@functools.lru_cache(maxsize=None)
def _tuned_kernel():
    return autotuned(_fp8_gemm_kernel, configs=fp8_gpu_configs() + fp8_tma_configs(), key=FP8_TUNING_KEY,
                     prune=prune_fp8_configs,
                     restore_value=["c_ptr"])  # residual=out accumulates into C: tuning runs must not compound it


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def _check_operand(name: str, t, dims=(2, 3)) -> None:
    check_tensor(name, t, dims=dims, dtypes=(torch.float8_e4m3fn,), kernel_device=True)


def _b_scale_rows(b_scale: torch.Tensor, N: int, kb: int) -> int:
    """Rows of B one blockwise scale covers: 128 for ``[ceil(N/128), kb]`` (blocks), 1 for
    ``[N, kb]`` (tiles)."""
    if tuple(b_scale.shape) == (N, kb):
        return 1
    if tuple(b_scale.shape) == (cdiv(N, FP8_BLOCK), kb):
        return FP8_BLOCK
    raise ValueError(f"b_scale must have shape {(cdiv(N, FP8_BLOCK), kb)} (128x128 blocks) or {(N, kb)} "
                     f"(1x128 tiles) for blockwise scaling of b {(N, kb * FP8_BLOCK)}, got {tuple(b_scale.shape)}")


def _check_scales(a_scale, b_scale, *, lead: tuple, N: int, K: int, scaling: str, device) -> int:
    """Check the scales (``lead``: a's leading dims); returns the rows of B one scale covers
    (rowwise: 1)."""
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        check_tensor(name, s, dims=(1, 2, 3), dtypes=(torch.float32,))
        if s.device != device:
            raise ValueError(f"{name} must be on the same device as a ({device}), got {s.device}")
    if scaling == "rowwise":
        check_shape("a_scale", a_scale, lead)
        check_shape("b_scale", b_scale, (N,))
        return 1
    kb = cdiv(K, FP8_BLOCK)
    check_shape("a_scale", a_scale, lead + (kb,))
    check_tensor("b_scale", b_scale, dims=(2,))
    return _b_scale_rows(b_scale, N, kb)


def _rows(t: torch.Tensor) -> RowView:
    """The two-level row view of the leading dims of ``t`` (``[M, X]`` or ``[b, s, X]``)."""
    return RowView.rows(t)


def _operand_args(a, a_scale, b, b_scale, out, residual, scaling):
    """The kernel's pointer and stride arguments after ``M, N, K`` and the row-view flags."""
    av, cv = _rows(a), _rows(out)
    # a rowwise scale has a's leading dims only: one column more makes it a row view of them
    sv = _rows(a_scale if scaling == "blockwise" else a_scale.unsqueeze(-1))
    rv = _rows(residual) if residual is not None else cv
    strides = (av.inner, av.s_outer, av.s_inner, a.stride(-1), b.stride(0), b.stride(1),
               cv.inner, cv.s_outer, cv.s_inner, out.stride(-1), sv.inner, sv.s_outer, sv.s_inner,
               a_scale.stride(-1) if scaling == "blockwise" else 1, b_scale.stride(0), b_scale.stride(-1),
               rv.inner, rv.s_outer, rv.s_inner, residual.stride(-1) if residual is not None else 1)
    flags = dict(A_SPLIT=av.split, SA_SPLIT=sv.split, C_SPLIT=cv.split, R_SPLIT=rv.split)
    return strides, flags


def _activation(activation: str, b: torch.Tensor) -> tuple[int, bool, int]:
    """The activation's kernel code, whether it is gated, and the output features of weight ``b``
    (``[N_w, K]``; gated: ``N_w = 2F`` gate rows then up rows, ``F`` features)."""
    check_choice("activation", activation, _ACTIVATION_NAMES)
    act, glu = ACTIVATIONS[activation]
    n_w = b.shape[0]
    if glu and n_w % 2:
        raise ValueError(f"activation {activation!r} needs an even number of rows of b (gate rows, then up rows), "
                         f"got b of shape {tuple(b.shape)}")
    return act, glu, n_w // 2 if glu else n_w


def _outputs(a, n_w: int, N: int, *, bias, residual, out, out_dtype, preact_out, fp8_out):
    """Check ``bias`` (``[N_w]``), ``residual`` and ``out`` (allocated when None: ``a.shape[:-1] +
    (N,)``), ``preact_out`` (``[M, N_w]``) and ``fp8_out`` (for ``out``, once the device has fp8
    tensor cores); returns ``(bias, out)``, the bias unit-stride."""
    lead = tuple(a.shape[:-1])
    if bias is not None:
        check_tensor("bias", bias, dims=(1,))
        check_shape("bias", bias, (n_w,))
        check_same("bias", bias, "a", a, dtype=False)
        check_supported_dtype("bias", bias)
        bias = bias.contiguous()
    if residual is not None:
        check_buffer("residual", residual, lead + (N,), a.device)
    check_out_dtype("out_dtype", out_dtype)
    out = output_buffer("out", out, lead + (N,), a.device, out_dtype)
    if preact_out is not None:
        check_buffer("preact_out", preact_out, (math.prod(lead), n_w), a.device)
    check_fp8_device(a)
    check_fp8_output(out, fp8_out)
    return bias, out


def fp8_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scaling: str = "rowwise",
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str = "none",
    preact_out: torch.Tensor | None = None,
    fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``out[..., N] = act((a * a_scale) @ (b * b_scale)^T (+ bias)) (+ residual)`` with fp32
    accumulation, the epilogue of :func:`~fusedpar.kernels.gemm.matmul`.

    a:       ``[M, K]`` or ``[batch, seq, K]`` ``float8_e4m3fn`` (any strides: a strided
             ``[batch, seq-chunk]`` view is read in place; contiguous along K is what tensor cores want).
    b:       ``[N_w, K]`` ``float8_e4m3fn`` (the ``nn.Linear`` layout); for gated activations
             (``swiglu``, ``geglu``, ``swiglu_oai``) ``N_w = 2F`` rows, gate first then up, and the
             result has ``N = F`` features (else ``N = N_w``).
    a_scale, b_scale: fp32; ``scaling="rowwise"``: ``a.shape[:-1]`` and ``[N_w]``; ``"blockwise"``:
             ``a.shape[:-1] + (ceil(K/128),)`` and ``[ceil(N_w/128), ceil(K/128)]`` (128x128 blocks)
             or ``[N_w, ceil(K/128)]`` (1x128 tiles) (module docstring).
    bias:    ``[N_w]``, added in fp32 after the scales, before the activation.
    activation: a name of :data:`~fusedpar.kernels.runtime.ACTIVATIONS`, applied in fp32.
    preact_out: optional ``[M, N_w]`` tensor (any supported dtype and strides) that receives the
             pre-activation values (scaled product + bias), which the activation's backward needs.
    residual: ``a.shape[:-1] + (N,)`` in any supported dtype and strides, added in fp32 after the
             activation, before the store (a partial sum from a peer; ``residual=out`` accumulates
             into ``out``).
    out:     ``a.shape[:-1] + (N,)`` written in place if given (any strides, its dtype wins), else
             allocated with ``out_dtype`` (bf16, fp16 or fp32).
    fp8_out: optional ``(q, scale)`` that receive the stored ``out`` quantised per 1x128 tile for
             the next fp8 GEMM, equal to ``quantize_e4m3(out2d, "tile")`` bit for bit
             (:mod:`.gemm_fp8_epilogue`: shapes, tiles; ``out`` is still written).
    fast_accum: rowwise only: let Hopper's fp8 MMA accumulate the whole K in its own reduced
             precision (``torch._scaled_mm(use_fast_accum=True)``'s trade: faster, larger tiles,
             errors growing with K); by default the sum is promoted to fp32 every 128 K
             (:data:`FP8_PROMOTE_K`). Blockwise scaling promotes per 128-deep step by construction.
             Only compute capability 9.0 (wgmma) accumulates fp8 products in reduced precision:
             elsewhere (sm_89, the interpreter) the MMA sums in fp32 either way and the option
             changes no result (only which tiles the autotuner tries).
    """
    _check_operand("a", a)
    _check_operand("b", b, dims=(2,))
    check_same("b", b, "a", a)
    check_choice("scaling", scaling, SCALINGS)
    check_bool("fast_accum", fast_accum)
    if fast_accum and scaling != "rowwise":
        raise ValueError("fast_accum must be False with blockwise scaling (it promotes every 128-deep step), got True")
    act, glu, N = _activation(activation, b)
    lead, K = tuple(a.shape[:-1]), a.shape[-1]
    (n_w, K_b), M = b.shape, math.prod(lead)
    if K_b != K:
        raise ValueError(f"inner dimensions differ: a has K={K} (shape {tuple(a.shape)}) but b has K={K_b} "
                         f"(shape {tuple(b.shape)})")
    b_rows = _check_scales(a_scale, b_scale, lead=lead, N=n_w, K=K, scaling=scaling, device=a.device)
    bias, out = _outputs(a, n_w, N, bias=bias, residual=residual, out=out, out_dtype=out_dtype,
                         preact_out=preact_out, fp8_out=fp8_out)
    if M == 0 or N == 0:
        return out
    if K == 0:  # empty contraction: the product is zero, the epilogue still applies
        return _empty_contraction(out, bias, residual, preact_out, fp8_out, activation, (M, n_w))
    strides, views = _operand_args(a, a_scale, b, b_scale, out, residual, scaling)
    fused_fp8 = fp8_out
    if not epilogue_fits(K, strides[1], strides[2], b.stride(0)):
        if glu:  # the gated epilogue around a plain GEMM (module docstring)
            return _gated_unaligned(a, a_scale, b, b_scale, bias, scaling, out, residual, preact_out, fp8_out,
                                    activation)
        fused_fp8 = None  # quantised after the GEMM
    fp8_args, fp8_flags = fp8_output_args(fused_fp8, out)
    args = (a, b, out, a_scale, b_scale, bias if bias is not None else out, residual if residual is not None else out,
            preact_out if preact_out is not None else out, bias[N:] if glu and bias is not None else out,
            preact_out[:, N:] if glu and preact_out is not None else out, M, N, K, *strides, N if glu else 0,
            *(preact_out.stride() if preact_out is not None else (0, 0)), *fp8_args)
    flags = dict(BLOCKWISE=scaling == "blockwise", B_SCALE_ROWS=b_rows, HAS_BIAS=bias is not None,
                 HAS_RESIDUAL=residual is not None, EVEN_K=K % 128 == 0,
                 PROMOTE_K=None if fast_accum else FP8_PROMOTE_K, **views, ACT=act, GLU=glu,
                 STORE_AUX=preact_out is not None, **fp8_flags,
                 TMA=not (glu and fused_fp8 is not None) and _loads_by_tma(a, b, views, strides))
    flags["EMULATE"] = interpreting()
    _launch(args, flags, M, N, a.device)
    if fused_fp8 is None:
        quantize_output(out, fp8_out)
    return out


def epilogue_fits(K: int, a_outer: int, a_row: int, b_row: int) -> bool:
    """Whether a launch fuses a gated activation and the e4m3 output: not compiled with loads that
    do not vectorise (``K`` or a row stride not a multiple of 16 bytes), where a gated epilogue's
    two B tiles (sm_90, 37x72x200 at 64x64: 2172 B) and the e4m3 output's 128-wide tiles spill."""
    return interpreting() or pipelined(1, *(e for e in (K, a_outer, a_row, b_row) if e != 1))


def _gated_unaligned(a, a_scale, b, b_scale, bias, scaling, out, residual, preact_out, fp8_out, activation):
    """:func:`fp8_matmul`'s gated epilogue where it does not fit the kernel (:func:`epilogue_fits`):
    the plain fp8 GEMM's fp32 pre-activation, then the rest of the epilogue in torch."""
    pre = fp8_matmul(a, a_scale, b, b_scale, bias, scaling=scaling, out_dtype=torch.float32)
    pre2 = pre.reshape(-1, pre.shape[-1])
    if preact_out is not None:
        preact_out.copy_(pre2)
    y = activation_reference(pre2, activation)
    if residual is not None:
        y = y + residual.reshape(y.shape).float()
    out.copy_(y.view(out.shape))
    quantize_output(out, fp8_out)
    return out


def _empty_contraction(out, bias, residual, preact_out, fp8_out, activation, preact_shape):
    """:func:`fp8_matmul`'s epilogue on the host for ``K = 0``: the pre-activation is the bias (or zero)."""
    pre = torch.zeros(preact_shape, device=out.device, dtype=torch.float64)
    if bias is not None:
        pre += bias.double()
    if preact_out is not None:
        preact_out.copy_(pre)
    y = activation_reference(pre, activation).view(out.shape)
    out.copy_(y + residual if residual is not None else y)
    quantize_output(out, fp8_out)
    return out


def _loads_by_tma(a, b, views, strides) -> bool:
    """Whether the launch loads ``a`` and ``b`` by TMA (:mod:`.gemm_loads`: both contiguous along
    K, 16-byte aligned; ``a`` a plain 2-D view). Not asked for a gated epilogue with the e4m3
    output: its smallest 1x128-tile wgmma tile (64 x 128, four accumulator tiles) spilled 24-84 B
    beside the persistent loop (sm_90); it keeps pointer loads, one tile per program."""
    if views["A_SPLIT"] or not tma_capable(a.device, 1):
        return False
    extents = (math.prod(a.shape[:-1]), b.shape[0], a.shape[-1])
    return tma_layout(a, strides[2], strides[3], b, strides[5], strides[4], extents, k_major=True) is not None


def _launch(args, flags, M: int, N: int, device) -> None:
    """One fixed small tile under the interpreter (its epilogue in column halves on the TMA path),
    the autotuned kernel on a GPU; persistent over the SMs with TMA loads."""
    tma = flags["TMA"]
    grid = lambda meta: (num_programs(cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), device, tma),)  # noqa: E731
    if interpreting():
        cfg = fp8_interpreter_config(tma, flags["FP8_OUT"])
        _fp8_gemm_kernel[grid(cfg)](*args, **flags, **cfg)
        note_launch("fp8_matmul", None, cfg, tma)
    else:
        ensure_scratch_allocator()
        with on_device(device):
            launch_kernel(_tuned_kernel(), grid, args, flags)
        note_launch("fp8_matmul", _tuned_kernel(), None, tma)


def fp8_matmul_reference(a, a_scale, b, b_scale, bias=None, *, scaling="rowwise", activation="none",
                         compute_dtype=torch.float64):
    """What :func:`fp8_matmul` computes (without residual), in ``compute_dtype``: the product of the
    dequantised operands (float64: exact up to the final sum), the bias, the activation
    (:func:`~fusedpar.kernels.runtime.activation_reference`; gated: ``b`` holds gate then up rows)."""
    check_choice("scaling", scaling, SCALINGS)
    check_choice("activation", activation, _ACTIVATION_NAMES)
    if scaling == "rowwise":
        ga = gb = "row"
    else:
        ga, gb = "tile", "tile" if b_scale.shape[0] == b.shape[0] and b.shape[0] != 1 else "block"
    y = dequantize_e4m3(a, a_scale, ga, compute_dtype) @ dequantize_e4m3(b, b_scale, gb, compute_dtype).t()
    return activation_reference(y + bias.to(compute_dtype) if bias is not None else y, activation)
