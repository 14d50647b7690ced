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

from .checks import (check_buffer, check_choice, check_out_dtype, check_same, check_shape, check_supported_dtype,
                     check_tensor, output_buffer)
from .fp8 import (FP8_BLOCK, check_fp8_device, dequantize_e4m3, group_tiles, rne_for_store, round_to_bf16,
                  store_e4m3_tiles, to_fp32)
from .gemm import EPILOGUE_ACC_BUDGET
from .gemm_core import gemm_epilogue
from .gemm_fp8_epilogue import check_fp8_output, fp8_output_args, fp8_output_configs, quantize_output
from .launch import launch_kernel
from .runtime import (ACTIVATIONS, RowView, activation_reference, apply_up, autotuned, cdiv, device_capability, interpreting,
                      on_device, pipelined, prune_tile_configs, row_offsets, shared_memory_limit, tile_smem_bytes)

__all__ = ["FP8_GROUPED_INTERPRETER_CONFIGS", "FP8_INTERPRETER_CONFIG", "FP8_INTERPRETER_CONFIG_FP8_OUT", "FP8_PROMOTE_K",
           "FP8_RECIPES", "GROUPED_FP8_ACC_BUDGET", "SCALINGS", "UNALIGNED_FP8_GROUPED_TILE", "UNALIGNED_FP8_TILE",
           "epilogue_fits", "fp8_configs_of_kind", "fp8_gpu_configs", "fp8_grouped_configs", "fp8_matmul",
           "fp8_matmul_reference", "fp8_smem_estimate", "fp8_tile_rule", "grouped_fp8_flags", "grouped_fp8_scales"]

SCALINGS = ("rowwise", "blockwise")
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
    Q_M_SPLIT: tl.constexpr, S_M_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= 32, "an fp8 dot needs BLOCK_K >= 32")
    tl.static_assert(not BLOCKWISE or BLOCK_K == 128, "blockwise scaling steps K one 128-wide scale block at a time")
    tl.static_assert(B_SCALE_ROWS == 1 or B_SCALE_ROWS == 128, "B's scales cover 1 or 128 rows")
    tl.static_assert(PROMOTE_K <= BLOCK_K, "the fp32 promotion interval must be at most one K step")
    tl.static_assert(ACT >= 0 and ACT <= 4, "unknown activation code")

    # grouped ordering of programs (tutorial 03): neighbouring programs share B column blocks
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size)
    pid_n = (pid % num_in_group) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    # A's rows, its scales' rows, the output's and the residual's: two-level row views (a strided
    # [batch, seq-chunk] view of a larger tensor is read and written in place; runtime.row_offsets
    # written out, since a nested jit call costs milliseconds under the interpreter)
    rm64 = rm.to(tl.int64)
    if A_SPLIT:
        a_rows = a_ptr + ((rm64 // a_inner) * a_so + (rm64 % a_inner) * s_am)[:, None]
    else:
        a_rows = a_ptr + (rm64 * s_am)[:, None]
    if SA_SPLIT:
        sa_rows = sa_ptr + (rm64 // sa_inner) * sa_so + (rm64 % sa_inner) * s_sam
    else:
        sa_rows = sa_ptr + rm64 * s_sam
    b_cols = b_ptr + rn64[None, :] * s_bn
    sb_rows = sb_ptr + (rn // B_SCALE_ROWS).to(tl.int64) * s_sbn
    if GLU:  # the up rows of B, glu_offset further, and their scales (per column: a 128x128 scale
        # block holds gate and up rows when the gate half is not a multiple of 128 rows)
        b_cols_up = b_ptr + (rn64 + glu_offset)[None, :] * s_bn
        sb_up = sb_ptr + ((rn + glu_offset) // B_SCALE_ROWS).to(tl.int64) * s_sbn
        if BLOCKWISE and B_SCALE_ROWS == 128:
            # the tile's up rows lie in two 128-row blocks at most: two scales a step, one chosen per
            # column (a pointer per column, live through the loop, spilled 64 B on sm_90 at F = 72)
            tl.static_assert(BLOCK_N <= 128, "a gated tile's up rows span at most two scale blocks")
            up_block = (pid_n * BLOCK_N + glu_offset) // 128
            sb_up0 = sb_ptr + up_block.to(tl.int64) * s_sbn
            up_first = rn + glu_offset < (up_block + 1) * 128
            up_second = (up_block + 1) * 128 - glu_offset < N  # the second block holds an output column

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dead code unless GLU
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        kk64 = (k0 * BLOCK_K + rk).to(tl.int64)
        if EVEN_K:
            a = tl.load(a_rows + (kk64 * s_ak)[None, :], mask=m_mask[:, None], other=0.0)
            b = tl.load(b_cols + (kk64 * s_bk)[:, None], mask=n_mask[None, :], other=0.0)
            if GLU:
                bu = tl.load(b_cols_up + (kk64 * s_bk)[:, None], mask=n_mask[None, :], other=0.0)
        else:
            k_mask = kk64 < K
            a = tl.load(a_rows + (kk64 * s_ak)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_cols + (kk64 * s_bk)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if GLU:
                bu = tl.load(b_cols_up + (kk64 * s_bk)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCKWISE:
            sa = tl.load(sa_rows + k0 * s_sak, mask=m_mask, other=0.0)
            sb = tl.load(sb_rows + k0 * s_sbk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]  # a fresh dot per step: promoted every BLOCK_K
            if GLU:
                if B_SCALE_ROWS == 128:
                    sb_u = tl.where(up_first, tl.load(sb_up0 + k0 * s_sbk),
                                    tl.load(sb_up0 + s_sbn + k0 * s_sbk, mask=up_second, other=0.0))
                else:
                    sb_u = tl.load(sb_up + k0 * s_sbk, mask=n_mask, other=0.0)
                acc_up += tl.dot(a, bu) * sa[:, None] * sb_u[None, :]
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
            if GLU:
                acc_up = tl.dot(a, bu, acc_up, max_num_imprecise_acc=PROMOTE_K)
    if not BLOCKWISE:
        sa = tl.load(sa_rows, mask=m_mask, other=0.0)
        sb = tl.load(sb_rows, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
        if GLU:
            acc_up = acc_up * sa[:, None] * tl.load(sb_up, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:  # the up half's from its own pointer (bias + glu_offset, a launch argument whose
        # alignment Triton specialises on: loads at glu_offset = 72 spilled 64-96 B on sm_90)
        acc += to_fp32(tl.load(bias_ptr + rn, mask=n_mask, other=0.0), EMULATE)[None, :]
        if GLU:
            acc_up += to_fp32(tl.load(bias_up_ptr + rn, mask=n_mask, other=0.0), EMULATE)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    x_off = rm64[:, None] * s_xm + rn64[None, :] * s_xn
    if STORE_AUX and GLU:  # the up half through its own pointer too: at F not a multiple of 16, the
        # stores at aux + glu_offset columns (per element, unvectorised) spilled 28 B on sm_90 (F = 72)
        up = acc_up
        if EMULATE:
            up = rne_for_store(acc_up, aux_up_ptr)
        tl.store(aux_up_ptr + x_off, up.to(aux_up_ptr.dtype.element_ty), mask=mn_mask)
    # the GEMM epilogue (kernels/gemm.py): pre-activation store (the gate half), activation
    acc = gemm_epilogue(acc, acc_up, rn, n_mask, mn_mask, bias_ptr, aux_ptr, x_off, glu_offset, s_xn,
                        False, STORE_AUX, ACT, False, EMULATE)
    if GLU:
        if ACT == 4:
            acc = acc * apply_up(acc_up, ACT)
        else:
            acc = acc * acc_up
    if HAS_RESIDUAL:  # added in fp32 (a partial sum received from a peer, an accumulated gradient)
        if R_SPLIT:
            r_rows = (rm64 // r_inner) * r_so + (rm64 % r_inner) * s_rm
        else:
            r_rows = rm64 * s_rm
        r_off = r_rows[:, None] + rn64[None, :] * s_rn
        acc += to_fp32(tl.load(r_ptr + r_off, mask=mn_mask, other=0.0), EMULATE)
    if EMULATE and c_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16(acc)  # the interpreter's bf16 cast truncates (kernels/fp8.py)
    if C_SPLIT:
        c_rows = (rm64 // c_inner) * c_so + (rm64 % c_inner) * s_cm
    else:
        c_rows = rm64 * s_cm
    c_off = c_rows[:, None] + rn64[None, :] * s_cn
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + c_off, c, mask=mn_mask)
    if FP8_OUT:  # C per 1x128 tile as stored, widened again (what quantize_e4m3 of C loads) into q, s
        store_e4m3_tiles(tl.where(mn_mask, to_fp32(c, EMULATE), 0.0),
                         q_ptr + row_offsets(rm, q_m_inner, s_qm0, s_qm1, Q_M_SPLIT),
                         s_ptr + row_offsets(rm, sc_m_inner, s_sm0, s_sm1, S_M_SPLIT), rn, mn_mask, m_mask,
                         pid_n * (BLOCK_N // 128), n_tiles, EMULATE, BLOCK_M, BLOCK_N)


# --------------------------------------------------------------------------------------------
# Configurations: a fixed small one under the interpreter, an autotuned pruned list on GPU
# --------------------------------------------------------------------------------------------
FP8_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, GROUP_M=4)
#: the interpreter's tile with the fp8 output: whole 1x128 tiles per program (kernels/gemm_fp8_epilogue.py)
FP8_INTERPRETER_CONFIG_FP8_OUT = dict(FP8_INTERPRETER_CONFIG, BLOCK_N=FP8_BLOCK)
#: Hopper's fp8 wgmma accumulates in less than fp32: each 32-deep instruction aligns its products
#: and the running sum to their largest exponent and truncates below 2^-13 of it (the model that
#: reproduces the first H100 run's errors, tests/test_fp8.py ``mma_error_bound``; DeepSeek-V3
#: reported about 14 bits), and Triton's default on sm_90 lets a dot accumulate its whole K that
#: way. Both recipes promote to the fp32 accumulator every 128 K elements (DeepSeek-V3's interval):
#: blockwise by its fresh dot per K step, rowwise by ``max_num_imprecise_acc=PROMOTE_K`` (a partial
#: fp32 tile added to the accumulator after each step: a second accumulator tile, counted by the
#: prune rule). So each 128-deep step errs by up to about 2^-13 of its largest partial sum, not of
#: the fp32 total (tests/test_fp8.py ``test_fp8_matmul_promotes_to_fp32_every_128``)
FP8_PROMOTE_K = 128


def fp8_gpu_configs():
    """Candidate tiles (sm_89 / sm_90): 128-deep K steps (128 bytes of fp8 per row, one scale
    block of the blockwise recipe), pruned per problem by :func:`_prune_configs`."""
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8), num_stages=stages, num_warps=warps)
            for bm, bn, stages, warps in [(128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 4, 8), (128, 128, 4, 4),
                                          (64, 128, 4, 8), (128, 64, 4, 8), (64, 128, 4, 4), (128, 64, 4, 4),
                                          (64, 64, 4, 4)]]


def fp8_grouped_configs(wgrad: bool = False):
    """Candidate tiles of the grouped GEMMs' fp8 launches (``kernels/grouped_gemm.py``), each
    marked ``cfg.fp8 = True`` (the grouped autotuners hold both lists; their prune rules keep the
    fp8 tiles for fp8 launches only): 128-deep contraction steps (one scale block), at least 64
    rows per dot (fp8 wgmma). Forward / data gradient ``BLOCK_K = 128``; weight gradient
    ``BLOCK_M = 128`` (its contraction, the rows)."""
    tiles = ([(128, 128, 64, 4, 8), (128, 64, 128, 4, 8), (128, 64, 64, 4, 8), (128, 64, 64, 4, 4)] if wgrad else
             [(128, 128, 128, 4, 8), (128, 64, 128, 4, 4), (128, 64, 128, 4, 8), (64, 128, 128, 4, 4),
              (64, 128, 128, 4, 8), (64, 64, 128, 4, 4), (64, 32, 128, 4, 8)])
    out = []
    for bm, bn, bk, stages, warps in tiles:
        cfg = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=stages, num_warps=warps)
        cfg.fp8 = True
        out.append(cfg)
    return out


#: the grouped GEMMs' interpreted fp8 tiles (forward / data gradient, weight gradient): 128-deep steps
FP8_GROUPED_INTERPRETER_CONFIGS = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128), dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=32))
#: output tile elements of a grouped fp8 launch whose loads do not vectorise (K or a row stride not a
#: multiple of 16 bytes): 64x32 over 8 warps compiles without spills on sm_90 with the gated
#: epilogue's two B tiles (64x64 spills 128-280 B, 64x32 over 4 warps 60 B; test shape 61x24x200)
UNALIGNED_FP8_GROUPED_TILE = 64 * 32
#: fp32 accumulator elements per thread of the grouped GEMMs' fp8 launches, all tiles together (each
#: accumulator counts twice: the step's dot and the running fp32 sum), by epilogue (``python -m
#: benchmarks compile``, sm_90: no spills; the weight gradient's 128x128x128 over 8 warps, 128, spills 56 B)
GROUPED_FP8_ACC_BUDGET = {"plain": 128, "fused": 128, "dact": 64, "wgrad": 64}


def grouped_fp8_scales(a_name: str, a, a_scale, b_scale, scaling: str, *, n_experts: int = 0, n_w: int = 0,
                       K: int = 0, wgrad_of: tuple | None = None):
    """The scales of a grouped GEMM launch (``kernels/grouped_gemm.py``) on operand ``a`` (named
    ``a_name``): None for 16/32-bit operands (no scale may be given); for e4m3 ones ``(scale
    pointers, their strides, blockwise)`` once ``scaling`` and the scales are checked (fp32, on
    ``a``'s device, of the shapes below; a ``ValueError`` names the one that is not).

    Forward / data gradient (``a [M, K]``, a weight of ``n_w`` rows per expert, the second scale
    ``weight_scale``): "rowwise" ``[M]`` per row and ``[E, n_w]`` per expert and weight row;
    "blockwise" ``[M, ceil(K/128)]`` (1x128 tiles) and ``[E, ceil(n_w/128), ceil(K/128)]``
    (128x128 blocks per expert). Weight gradient (``wgrad_of=(G, N, K)``, ``a`` the gradient
    ``[M, N]``, the second scale ``x_scale`` of ``x [M, K]``), both quantised along the rows per
    group (:func:`~fusedpar.kernels.fp8.quantize_e4m3_groups`): ``[N, T]`` and ``[K, T]``,
    ``T =`` :func:`~fusedpar.kernels.fp8.group_tiles` ``(M, G)`` (either recipe)."""
    if wgrad_of is None:
        M, kb = a.shape[0], cdiv(K, FP8_BLOCK)
        scales = {f"{a_name}_scale": (a_scale, (M,), (M, kb)),
                  "weight_scale": (b_scale, (n_experts, n_w), (n_experts, cdiv(n_w, FP8_BLOCK), kb))}
    else:
        (_, N, K), T = wgrad_of, group_tiles(a.shape[0], wgrad_of[0])
        scales = {f"{a_name}_scale": (a_scale, (N, T), (N, T)), "x_scale": (b_scale, (K, T), (K, T))}
    if a.dtype != torch.float8_e4m3fn:
        given = [name for name, (t, _, _) in scales.items() if t is not None]
        if given:
            raise ValueError(f"{given[0]} is for float8_e4m3fn operands, got {a_name} of dtype {a.dtype}")
        return None
    check_choice("scaling", scaling, SCALINGS)
    check_fp8_device(a)
    blockwise = scaling == "blockwise"
    for name, (t, row_shape, block_shape) in scales.items():
        check_tensor(name, t, dtypes=(torch.float32,))
        check_shape(name, t, block_shape if blockwise else row_shape)
        check_same(name, t, a_name, a, dtype=False)
    sa, sb = a_scale, b_scale
    return (sa, sb, sa.stride(0), sa.stride(1) if sa.dim() > 1 else 0, sb.stride(0), sb.stride(1),
            sb.stride(2) if sb.dim() > 2 else 0, blockwise)


def grouped_fp8_flags(fp8, *outputs) -> dict:
    """The fp8 constexprs of a grouped GEMM launch (``fp8``: :func:`grouped_fp8_scales`'s result;
    ``EMULATE``, the interpreter's bf16 rounding, only when one of ``outputs`` is bf16)."""
    bf16 = any(t is not None and t.dtype == torch.bfloat16 for t in outputs)
    return dict(FP8=fp8 is not None, BLOCKWISE=bool(fp8 and fp8[-1]), EMULATE=interpreting() and bf16 and fp8 is not None,
                PROMOTE_K=FP8_PROMOTE_K if fp8 is not None else None)


def fp8_configs_of_kind(configs, named_args, kwargs, fp8_tile_ok=True):
    """The configs of a grouped launch's kind (the prune rules' first step): the
    :func:`fp8_grouped_configs` tiles for fp8 launches (loads that do not vectorise: those within
    :data:`UNALIGNED_FP8_GROUPED_TILE` over 8 warps), the others for the rest."""
    fp8 = bool(kwargs.get("FP8", named_args.get("FP8", False)))
    kind = [c for c in configs if getattr(c, "fp8", False) == fp8]
    if fp8 and not fp8_tile_ok:  # every element its own address: small tiles over 8 warps
        kind = [c for c in kind if c.num_warps == 8 and c.kwargs["BLOCK_N"] * c.kwargs[
            "BLOCK_K" if "dy_ptr" in named_args else "BLOCK_M"] <= UNALIGNED_FP8_GROUPED_TILE] or kind
    return kind


#: fp32 accumulator elements per thread (both tiles) of a blockwise GEMM whose B scales are per row
#: (1x128 tiles: a vector of scales and its pointers live next to the accumulators in every K
#: step): 128 spills 16 B on sm_90 (128x128 w8 at the weight-gradient shape), 64 does not
TILED_B_ACC_BUDGET = 64
#: output tile elements of a GEMM whose loads do not vectorise (K or a row stride not a multiple of
#: 16 bytes: every element carries its own address and mask): 64x64 compiles without spills on
#: sm_90, every larger tile of the list spills 200-4100 B at the test shape 37x45x200
UNALIGNED_FP8_TILE = 64 * 64


def fp8_tile_rule(named_args: dict, **kwargs) -> dict:
    """The prune rule's parameters: 1-byte operands, two accumulator tiles per output tile (the
    running fp32 sum and the step's dot: blockwise's fresh dot, rowwise's partial accumulator;
    gated: gate and up, four tiles and two B tiles), the plain epilogue's register budget, fused
    epilogues too (sm_90: gated 64 x 128 / 128 x 64 over 8 warps 172-241 registers, gelu + e4m3
    output 128 x 128 over 8 warps 240-250, no spills)."""
    def get(k, default=False):
        return kwargs.get(k, named_args.get(k, default))

    a, glu = named_args["a_ptr"], bool(get("GLU"))
    tiled_b = bool(get("BLOCKWISE")) and get("B_SCALE_ROWS", 1) == 1
    extents = [e for e in (named_args["K"], named_args["s_am"], named_args["a_so"], named_args["s_bn"]) if e != 1]
    budget = TILED_B_ACC_BUDGET if tiled_b else EPILOGUE_ACC_BUDGET["plain"]
    return dict(elem_size=1, b_tiles=2 if glu else 1, acc_tiles=4 if glu else 2, acc_budget=budget,
                sync_acc_budget=budget, capability=device_capability(a.device.index or 0), precision="ieee",
                pipelined=pipelined(1, *extents))


def fp8_smem_estimate(cfg, named_args, **kwargs) -> int:
    """The prune rule's shared-memory bytes of ``cfg`` for a launch with ``named_args``."""
    r = fp8_tile_rule(named_args, **kwargs)
    return tile_smem_bytes(cfg, elem_size=1, b_tiles=r["b_tiles"], capability=r["capability"], precision="ieee",
                           pipelined=r["pipelined"])


def _prune_configs(configs, named_args, **kwargs):
    """:func:`~fusedpar.kernels.runtime.prune_tile_configs` with the fp8 rule (:func:`fp8_tile_rule`)
    over the tiles of the launch's kind (the fp8 output's: ``BLOCK_N`` a multiple of 128); loads
    that do not vectorise keep only tiles within :data:`UNALIGNED_FP8_TILE` (a compiled launch
    fuses no e4m3 output there, :func:`epilogue_fits`)."""
    a, rule = named_args["a_ptr"], fp8_tile_rule(named_args, **kwargs)
    configs = fp8_output_configs(configs, kwargs.get("FP8_OUT", named_args.get("FP8_OUT", False)))
    if not rule["pipelined"]:
        configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= UNALIGNED_FP8_TILE] or configs
    return prune_tile_configs(configs, smem_limit=shared_memory_limit(a.device.index or 0),
                              dims={"BLOCK_M": named_args["M"], "BLOCK_N": named_args["N"]}, **rule)


#: the autotuner's key: the problem size, the flags and strides :func:`fp8_tile_rule` and the tile
#: filter read, and the epilogue's (a tile tuned for the plain epilogue is not reused by a fused one,
#: nor an aligned launch's by one whose rows lose 16-byte alignment)
_TUNING_KEY = ["M", "N", "K", "BLOCKWISE", "B_SCALE_ROWS", "ACT", "GLU", "STORE_AUX", "FP8_OUT", "s_am", "a_so", "s_bn"]


@functools.lru_cache(maxsize=None)
def _tuned_kernel():
    return autotuned(_fp8_gemm_kernel, configs=fp8_gpu_configs(), key=_TUNING_KEY, prune=_prune_configs)


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
    """
    _check_operand("a", a)
    _check_operand("b", b, dims=(2,))
    check_same("b", b, "a", a)
    check_choice("scaling", scaling, SCALINGS)
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
                 HAS_RESIDUAL=residual is not None, EVEN_K=K % 128 == 0, PROMOTE_K=FP8_PROMOTE_K, **views,
                 ACT=act, GLU=glu, STORE_AUX=preact_out is not None, **fp8_flags)
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


def _launch(args, flags, M: int, N: int, device) -> None:
    if interpreting():
        cfg = FP8_INTERPRETER_CONFIG_FP8_OUT if flags["FP8_OUT"] else FP8_INTERPRETER_CONFIG
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
        _fp8_gemm_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        with on_device(device):
            launch_kernel(_tuned_kernel(), grid, args, flags)


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
