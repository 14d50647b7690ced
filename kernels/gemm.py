"""GEMM with a fused epilogue: ``C = act(A @ B + bias) (+ R)``, fp32 accumulation.

Every operand is read or written through *two-level* indices so that the tensor-parallel ops can
point the kernel at a sequence chunk inside a ``[batch, seq, features]`` tensor without copies:
a logical row ``m`` of A (or C) lives at ``(m // inner) * stride_outer + (m % inner) * stride_inner``
(:class:`~fusedpar.kernels.runtime.RowView`; plain 2-D operands use one stride). The same holds
for the contraction index of A and B, which is what the weight-gradient GEMM ``dW = dY^T X``
needs when its token dimension is a strided ``[batch, seq-chunk]`` view.

Layers: :mod:`.gemm_core` (the jit main loop and epilogue, shared with the persistent, fp8 and
linear-CE kernels) -> ``_gemm_kernel`` (jit) -> :func:`linear_operands` (validation shared
with the persistent GEMM) -> :func:`matmul` / :func:`matmul_tn` (validate, allocate, launch) ->
:func:`matmul_reference` (plain fp32/fp64 torch, the oracle of the tests).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import (check_buffer, check_choice, check_float_tensor, check_out_dtype, check_same, check_supported_dtype,
                     cpu_launches, output_buffer)
from .gemm_configs import (EPILOGUE_ACC_BUDGET, INTERPRETER_CONFIG, SYNC_TIGHT_ACC_BUDGET, TUNING_KEY, gpu_configs,
                           interpreter_config, prune_gemm_configs, smem_estimate, tile_rule, tma_gpu_configs,
                           tma_tiles_fit)
from .gemm_core import gemm_mainloop, gemm_store, grouped_tile, operand_descriptors, split_columns
from .gemm_fp8_epilogue import FP8_OUT_CONFIGS, check_fp8_output, fp8_output_args, quantize_output
from .gemm_loads import ensure_scratch_allocator, note_launch, num_programs, tma_capable, tma_layout
from .launch import PlanCache, build_plan, describe
from .runtime import (ACTIVATIONS, SUPPORTED_DTYPES, RowView, activation_reference, autotuned, cdiv, input_precision,
                      interpreting, needs_upcast, on_device, row_offsets)

__all__ = [
    # the tile rules, from .gemm_configs (the persistent GEMM's configs import them here)
    "EPILOGUE_ACC_BUDGET", "INTERPRETER_CONFIG", "SYNC_TIGHT_ACC_BUDGET", "TUNING_KEY", "gpu_configs",
    "smem_estimate", "tile_rule",
    "LinearOperands", "linear_operands", "matmul", "matmul_checked", "matmul_reference", "matmul_tn",
]


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, r_ptr, aux_ptr,
    M, N, K,
    a_m_inner, s_am0, s_am1, a_k_inner, s_ak0, s_ak1,
    b_k_inner, s_bk0, s_bk1, s_bn, glu_offset,
    c_m_inner, s_cm0, s_cm1, s_cn,
    r_m_inner, s_rm0, s_rm1, s_rn,
    s_xm, s_xn,
    q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
    A_M_SPLIT: tl.constexpr, A_K_SPLIT: tl.constexpr, B_K_SPLIT: tl.constexpr,
    C_M_SPLIT: tl.constexpr, R_M_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STORE_AUX: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FP8_OUT: tl.constexpr, Q_M_SPLIT: tl.constexpr, S_M_SPLIT: tl.constexpr,
    EMULATE: tl.constexpr, TMA: tl.constexpr, A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr = 1,
):
    """With TMA loads a persistent program walks tiles ``pid, pid + programs, ...`` in grouped
    order (the loop flattened with the K loop, so the next tile's loads overlap this one's
    epilogue); with pointer loads a program computes tile ``pid``. Each tile: the core's main
    loop, then its epilogue, per column half of the tile with ``EPILOGUE_SPLIT`` 2."""
    tl.static_assert(BLOCK_K >= 16, "tl.dot needs BLOCK_K >= 16")
    tl.static_assert(ACT >= 0 and ACT <= 4, "unknown activation code")
    tl.static_assert(EPILOGUE_SPLIT == 1 or EPILOGUE_SPLIT == 2, "the epilogue runs on the tile or its halves")
    tl.static_assert(not FP8_OUT or (BLOCK_N // EPILOGUE_SPLIT) % 128 == 0, "the fp8 output needs whole 1x128 tiles")
    tl.static_assert(not TMA or not (A_M_SPLIT or A_K_SPLIT or B_K_SPLIT), "TMA loads plain 2-D views")
    pid = tl.program_id(0)
    if TMA:
        a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N + glu_offset, K, s_am1, s_ak1, s_bk1, s_bn,
                                             A_KMAJOR, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
        programs = tl.num_programs(0)
        # the epilogue's own tile counter (tutorial 09): its indices do not depend on the main loop's
        tile_c = pid - programs
        for tile in tl.range(pid, tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), programs, flatten=True):
            tile_c += programs
            _gemm_tile(tile, tile_c, a_ptr, b_ptr, c_ptr, bias_ptr, r_ptr, aux_ptr, a_desc, b_desc, M, N, K,
                       a_m_inner, s_am0, s_am1, a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1, s_bn, glu_offset,
                       c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn,
                       q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
                       A_M_SPLIT, A_K_SPLIT, B_K_SPLIT, C_M_SPLIT, R_M_SPLIT, HAS_BIAS, HAS_RES, STORE_AUX, ACT, GLU,
                       UPCAST, EVEN_K, INPUT_PRECISION, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, EMULATE, TMA, A_KMAJOR,
                       B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE_SPLIT)
    else:
        _gemm_tile(pid, pid, a_ptr, b_ptr, c_ptr, bias_ptr, r_ptr, aux_ptr, a_ptr, b_ptr, M, N, K,
                   a_m_inner, s_am0, s_am1, a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1, s_bn, glu_offset,
                   c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn,
                   q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
                   A_M_SPLIT, A_K_SPLIT, B_K_SPLIT, C_M_SPLIT, R_M_SPLIT, HAS_BIAS, HAS_RES, STORE_AUX, ACT, GLU,
                   UPCAST, EVEN_K, INPUT_PRECISION, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, EMULATE, TMA, A_KMAJOR,
                   B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE_SPLIT)


@triton.jit
def _gemm_tile(
    tile, tile_c, a_ptr, b_ptr, c_ptr, bias_ptr, r_ptr, aux_ptr, a_desc, b_desc, M, N, K,
    a_m_inner, s_am0, s_am1, a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1, s_bn, glu_offset,
    c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn,
    q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
    A_M_SPLIT: tl.constexpr, A_K_SPLIT: tl.constexpr, B_K_SPLIT: tl.constexpr, C_M_SPLIT: tl.constexpr,
    R_M_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STORE_AUX: tl.constexpr,
    ACT: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FP8_OUT: tl.constexpr, Q_M_SPLIT: tl.constexpr, S_M_SPLIT: tl.constexpr, EMULATE: tl.constexpr,
    TMA: tl.constexpr, A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
):
    """Output tile ``tile`` of ``_gemm_kernel`` (``tile_c``: the same index, counted apart for the
    epilogue)."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc, acc_up = gemm_mainloop(
        a_ptr, b_ptr, row_offsets(rm, a_m_inner, s_am0, s_am1, A_M_SPLIT), rn.to(tl.int64) * s_bn,
        (rn + glu_offset).to(tl.int64) * s_bn, rm < M, rn < N, K, a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1,
        A_K_SPLIT, B_K_SPLIT, GLU, UPCAST, EVEN_K, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, glu_offset, TMA, A_KMAJOR, B_KMAJOR,
    )
    pid_m, pid_n = grouped_tile(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if EPILOGUE_SPLIT == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        acc0, acc1 = split_columns(acc, BLOCK_M, BLOCK_N)
        up0, up1 = acc0, acc1  # (no up half unless GLU)
        if GLU:
            up0, up1 = split_columns(acc_up, BLOCK_M, BLOCK_N)
        gemm_store(acc0, up0, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr,
                   glu_offset, c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn, q_ptr,
                   s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, C_M_SPLIT, R_M_SPLIT,
                   HAS_BIAS, HAS_RES, STORE_AUX, ACT, GLU, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, EMULATE, BLOCK_M, HALF)
        gemm_store(acc1, up1, pid_m * BLOCK_M, pid_n * BLOCK_N + HALF, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr,
                   glu_offset, c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn, q_ptr,
                   s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, C_M_SPLIT, R_M_SPLIT,
                   HAS_BIAS, HAS_RES, STORE_AUX, ACT, GLU, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, EMULATE, BLOCK_M, HALF)
    else:
        gemm_store(acc, acc_up, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr,
                   glu_offset, c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn, q_ptr,
                   s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles, C_M_SPLIT, R_M_SPLIT,
                   HAS_BIAS, HAS_RES, STORE_AUX, ACT, GLU, FP8_OUT, Q_M_SPLIT, S_M_SPLIT, EMULATE, BLOCK_M, BLOCK_N)


@functools.lru_cache(maxsize=None)
def _tuned_kernel():
    return autotuned(
        _gemm_kernel, configs=gpu_configs() + list(FP8_OUT_CONFIGS) + tma_gpu_configs(), key=TUNING_KEY,
        prune=prune_gemm_configs,
        restore_value=["c_ptr"],  # accumulate mode reads C: tuning runs must not compound it
    )


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearOperands:
    """Validated operands of ``act(a @ W + bias)``: what :func:`matmul` and the persistent GEMM
    launch with. ``n`` output features (``n_w // 2`` for gated activations), contraction ``k``,
    the weight's strides along K and N, the bias made unit-stride, and the activation's name."""

    n_w: int
    n: int
    k: int
    act: int
    glu: bool
    s_bk: int
    s_bn: int
    bias: torch.Tensor | None
    activation: str = "none"
    #: the weight's, layout's, bias's and activation's part of :func:`matmul_checked`'s plan key
    plan_part: tuple = ()


#: the row addressing of an absent residual (what the kernel's unused residual arguments hold)
_NO_ROWS = RowView(1, 0, 0, False)
#: the activation names, in the order the error messages list them
_ACTIVATION_NAMES = tuple(sorted(ACTIVATIONS))
_WEIGHT_LAYOUTS = ("nk", "kn")


def linear_operands(a, weight, bias=None, *, activation="none", weight_layout="nk", a_name="a",
                    a_dims=(2, 3)) -> LinearOperands:
    """Check ``a`` (``a_dims``-D, K features last), ``weight`` (``[N, K]`` for ``"nk"``, the
    ``nn.Linear`` layout, or ``[K, N]`` for ``"kn"``; ``[2F, K]`` gate|up for gated activations)
    and ``bias`` (``[N]``) for one GEMM, with the error style of :mod:`.checks`."""
    if not (isinstance(a, torch.Tensor) and isinstance(weight, torch.Tensor) and a.dim() in a_dims
            and weight.dim() == 2 and a.dtype in SUPPORTED_DTYPES and weight.dtype == a.dtype
            and weight.device == a.device and (a.is_cuda or (a.is_cpu and cpu_launches()))
            and weight_layout in _WEIGHT_LAYOUTS and activation in _ACTIVATION_NAMES):
        # what the one condition above holds, checked one by one: the first that fails raises its error
        check_float_tensor(a_name, a, dims=a_dims)
        check_float_tensor("weight", weight, dims=(2,))
        check_same("weight", weight, a_name, a)
        check_choice("weight_layout", weight_layout, _WEIGHT_LAYOUTS)
        check_choice("activation", activation, _ACTIVATION_NAMES)
    act, glu = ACTIVATIONS[activation]
    k = a.shape[-1]
    if weight_layout == "nk":
        (n_w, k_w), s_bk, s_bn = weight.shape, weight.stride(1), weight.stride(0)
    else:
        (k_w, n_w), s_bk, s_bn = weight.shape, weight.stride(0), weight.stride(1)
    if k_w != k:
        raise ValueError(f"inner dimensions differ: {a_name} has K={k} (shape {tuple(a.shape)}) but weight "
                         f"({weight_layout}) has K={k_w} (shape {tuple(weight.shape)})")
    if glu and n_w % 2:
        raise ValueError(f"activation {activation!r} needs an even number of weight output features (gate, up), "
                         f"got {n_w}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dim() != 1 or bias.shape[0] != n_w:
            raise ValueError(f"bias must have shape ({n_w},), got {tuple(bias.shape)}")
        check_same("bias", bias, a_name, a, dtype=False)
        check_supported_dtype("bias", bias)
        if bias.stride(0) != 1:
            bias = bias.contiguous()
    return LinearOperands(n_w, n_w // 2 if glu else n_w, k, act, glu, s_bk, s_bn, bias, activation,
                          (describe(weight), weight_layout, describe(bias), activation))


def _launch(a, b, out, M, N, K, a_rows, a_k, b_k, s_bn, c_rows, s_cn, bias, residual, r_rows, s_rn, aux, act,
            glu, fp8_out=None, plan_key=None):
    """``_gemm_kernel``'s arguments (positional: this runs once per GEMM, per chunk of the chunked
    ops) and flags; ``*_rows`` / ``a_k`` / ``b_k`` are :class:`RowView` s (``r_rows`` of an absent
    residual: ``_NO_ROWS``); ``fp8_out``: None or the ``(q, scale)`` of :mod:`.gemm_fp8_epilogue`.
    A compiled launch keeps its plan under ``plan_key`` (:mod:`.launch`; its slots: :func:`_slots`)."""
    has_res = residual is not None
    has_aux = aux is not None
    fp8_args, fp8_flags = fp8_output_args(fp8_out, out)
    args = (
        a, b, out, bias if bias is not None else out, residual if has_res else out, aux if has_aux else out,
        M, N, K,
        a_rows.inner, a_rows.s_outer, a_rows.s_inner, a_k.inner, a_k.s_outer, a_k.s_inner,
        b_k.inner, b_k.s_outer, b_k.s_inner, s_bn, N if glu else 0,
        c_rows.inner, c_rows.s_outer, c_rows.s_inner, s_cn,
        r_rows.inner, r_rows.s_outer, r_rows.s_inner, s_rn,
        *(aux.stride() if has_aux else (0, 0)), *fp8_args,
    )
    flags = dict(
        A_M_SPLIT=a_rows.split, A_K_SPLIT=a_k.split, B_K_SPLIT=b_k.split, C_M_SPLIT=c_rows.split,
        R_M_SPLIT=r_rows.split, HAS_BIAS=bias is not None, HAS_RES=has_res, STORE_AUX=has_aux,
        ACT=act, GLU=glu, UPCAST=needs_upcast(a.dtype), INPUT_PRECISION=input_precision(a.dtype), **fp8_flags,
    )
    majors = _tma_majors(a, b, a_rows, a_k, b_k, s_bn, (M, 2 * N if glu else N, K), N if glu else 0, args, flags)
    flags.update(TMA=majors is not None, A_KMAJOR=bool(majors and majors[0]), B_KMAJOR=bool(majors and majors[1]))
    tiles = lambda meta: cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])  # noqa: E731
    grid = lambda meta: (num_programs(tiles(meta), a.device, majors is not None),)  # noqa: E731
    if interpreting():
        cfg = interpreter_config(majors is not None, fp8_out is not None)
        flags["EVEN_K"] = K % cfg["BLOCK_K"] == 0
        _gemm_kernel[grid(cfg)](*args, **flags, **cfg)
        note_launch("matmul", None, cfg, majors is not None)
        return out
    # EVEN_K must hold for every BLOCK_K the tuner may pick (all are <= 64 and divide 64)
    flags["EVEN_K"] = K % 64 == 0
    ensure_scratch_allocator()
    with on_device(a.device):
        tuner = _tuned_kernel()
        compiled = tuner[grid](*args, **flags)
        note_launch("matmul", tuner, None, majors is not None)
        cfg = tuner.best_config
        if (plan_key is not None and cfg is not None and cfg.pre_hook is None and plan_key not in _PLANS
                and _PLANS.second_launch(plan_key)):
            plan = build_plan(tuner.fn, compiled, args, {**flags, "EPILOGUE_SPLIT": 1, **cfg.kwargs},
                              grid(cfg.kwargs))
            _PLANS.keep(plan_key, plan)
            if plan is not None:
                plan.extra = (out.shape, out.dtype)
    return out


def _tma_majors(a, b, a_rows, a_k, b_k, s_bn, extents, up_offset, args, flags):
    """``(A_KMAJOR, B_KMAJOR)`` of a launch that loads by TMA, else None: pointer loads for split
    row views and what a tensor descriptor cannot take (:mod:`.gemm_loads`), and, compiled, where
    no TMA tile passes the prune rule (:func:`~fusedpar.kernels.gemm_configs.tma_tiles_fit`).
    ``extents``: ``(M, N, K)``, N every row of B; ``up_offset``: a gated weight's up half (0:
    none); ``args``, ``flags``: the launch's (no load path yet)."""
    if a_rows.split or a_k.split or b_k.split or not tma_capable(a.device, a.element_size()):
        return None
    majors = tma_layout(a, a_rows.s_inner, a_k.s_inner, b, b_k.s_inner, s_bn, extents, up_offset=up_offset)
    if majors is None or interpreting() or tma_tiles_fit(dict(zip(_gemm_kernel.arg_names, args)), **flags):
        return majors
    return None


def _matmul_buffers(a, ops, *, out, accumulate, residual, preact_out, out_dtype, activation, fp8_out=None):
    """Check (or allocate) ``out``, ``residual``, ``preact_out`` and ``fp8_out`` of :func:`matmul`;
    returns ``(out, residual)`` with ``residual = out`` when accumulating."""
    out_shape = tuple(a.shape[:-1]) + (ops.n,)
    check_out_dtype("out_dtype", out_dtype)
    if accumulate:
        if out is None:
            raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")
        if residual is not None:
            raise ValueError("accumulate=True already adds out; pass either residual or accumulate, not both")
        if activation != "none":
            raise ValueError(f"accumulate=True needs activation='none', got {activation!r}")
    given = out is not None
    out = output_buffer("out", out, out_shape, a.device, out_dtype or a.dtype)
    if given and out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"out_dtype must be out's dtype ({out.dtype}) when out is given, got {out_dtype}")
    if accumulate:
        residual = out
    if residual is not None:
        check_buffer("residual", residual, out_shape, a.device)
    if preact_out is not None:
        check_buffer("preact_out", preact_out, (int(torch.Size(a.shape[:-1]).numel()), ops.n_w), a.device)
    check_fp8_output(out, fp8_out)
    return out, residual


def matmul(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_layout: str = "nk",
    activation: str = "none",
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    residual: torch.Tensor | None = None,
    preact_out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out = act(a @ W + bias) (+ residual)``, or ``out += a @ W`` with ``accumulate=True``.

    a:        ``[M, K]`` or ``[batch, seq, K]`` (any strides: a sequence chunk of a larger tensor
              is read in place).
    weight:   ``[N, K]`` (``weight_layout="nk"``, an ``nn.Linear`` weight, no transpose copy) or
              ``[K, N]`` (``"kn"``). For gated activations (``swiglu``, ``geglu``) the weight holds
              ``2F`` output features, gate first then up, and the result has ``F`` features.
    bias:     ``[N]`` (``[2F]`` for gated activations), added before the activation.
    out:      written in place if given: shape ``a.shape[:-1] + (N,)``, any strides, any supported
              dtype (fp32 output from bf16 inputs is fine). Allocated (dtype ``out_dtype`` or
              ``a.dtype``) otherwise.
    accumulate: ``out += a @ W (+ bias)`` with the sum formed in fp32; needs ``out`` and
              ``activation="none"``.
    residual: added after the activation (``C_in``); same shape as ``out``, any strides.
    preact_out: optional ``[M, N]`` (``[M, 2F]`` gated) tensor that receives the pre-activation
              values, which the backward of a fused activation needs.
    fp8_out:  optional ``(q, scale)`` that receive the stored ``out`` quantised for the next fp8
              GEMM (blockwise recipe): ``float8_e4m3fn`` of ``out``'s shape, fp32 ``out.shape[:-1]
              + (ceil(N / 128),)``, rows contiguous; equal to ``quantize_e4m3(out2d, "tile")`` bit
              for bit (:mod:`.gemm_fp8_epilogue`; ``out`` is still written).

    fp32 operands run ``tl.dot`` in TF32 on a GPU when torch.matmul would
    (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, which ``allow_tf32 = True`` sets too;
    :func:`~fusedpar.kernels.runtime.input_precision`).
    """
    key = False  # no plans under the interpreter
    if not interpreting():
        plain = out is None and residual is None and preact_out is None and fp8_out is None and not accumulate
        if plain:
            key = ("matmul", describe(a), describe(weight), None if bias is None else describe(bias), weight_layout,
                   activation, out_dtype, _tf32_key(a))
        else:
            key = ("matmul+", describe(a), describe(weight), describe(bias), weight_layout, activation, out_dtype,
                   _tf32_key(a), describe(out), accumulate, describe(residual), describe(preact_out), _fp8_key(fp8_out))
        plan = _PLANS.find(key)
        stream = None if plan is None else plan.stream()
        if stream is not None:
            ensure_scratch_allocator()
            if plain:  # (_slots' tuple, written out; no dtype argument to parse for a plain a's own)
                shape, dtype = plan.extra
                c = a.new_empty(shape) if dtype is a.dtype and type(a) is torch.Tensor else \
                    torch.empty(shape, dtype=dtype, device=a.device)  # (a subclass's new_empty: its type)
                plan.call((a, weight, c, c if bias is None else bias, c, c, c, c), stream)
                return c
            c = out if out is not None else torch.empty(plan.extra[0], dtype=plan.extra[1], device=a.device)
            plan.call(_slots(a, weight, c, bias, c if accumulate else residual, preact_out, fp8_out), stream)
            return c
    ops = linear_operands(a, weight, bias, activation=activation, weight_layout=weight_layout)
    out, residual = _matmul_buffers(a, ops, out=out, accumulate=accumulate, residual=residual, preact_out=preact_out,
                                    out_dtype=out_dtype, activation=activation, fp8_out=fp8_out)
    return matmul_checked(a, weight, ops, out, residual=residual, preact_out=preact_out, weight_layout=weight_layout,
                          fp8_out=fp8_out, plan_key=key if ops.bias is bias else False)


def matmul_checked(a: torch.Tensor, weight: torch.Tensor, ops: LinearOperands, out: torch.Tensor, *,
                   residual: torch.Tensor | None = None, preact_out: torch.Tensor | None = None,
                   weight_layout: str = "nk", fp8_out: tuple | None = None, plan_key=None) -> torch.Tensor:
    """:func:`matmul` (``out = act(a @ W + bias) (+ residual)``) without its checks: ``ops`` is
    what :func:`linear_operands` returned for ``weight`` (in ``weight_layout``), the bias and the
    activation with an operand of ``a``'s dtype, device and K, and ``out`` / ``residual`` /
    ``preact_out`` have :func:`matmul`'s shapes, a supported dtype and ``a``'s device. For the
    chunked ops, which check their operands once per call and then run one GEMM per chunk on
    views and buffers of their own (checking every chunk again would cost more host time than
    the launch). ``fp8_out``: ``(q, scale)`` as :func:`matmul` checks them, also written.
    ``plan_key``: :func:`matmul`'s key for the launch plan (False: none), else this call's own."""
    if plan_key is None and not interpreting():
        plan_key = ("checked", ops.plan_part or (describe(weight), describe(ops.bias), ops.activation), weight_layout,
                    describe(a), describe(out), describe(residual), describe(preact_out), _fp8_key(fp8_out),
                    _tf32_key(a))
        plan = _PLANS.find(plan_key)
        if plan is not None:
            ensure_scratch_allocator()
        if plan is not None and plan.launch(_slots(a, weight, out, ops.bias, residual, preact_out, fp8_out)):
            return out
    M, N, K = a.shape[:-1].numel(), ops.n, ops.k
    if M == 0 or N == 0:
        return out
    if K == 0:  # empty contraction: the product is zero, the epilogue still applies
        if preact_out is not None:
            preact_out.copy_(matmul_reference(a.reshape(M, 0), weight, ops.bias, weight_layout=weight_layout))
        out.copy_(matmul_reference(a, weight, ops.bias, weight_layout=weight_layout, activation=ops.activation,
                                   residual=residual))
        quantize_output(out, fp8_out)
        return out
    has_res = residual is not None
    return _launch(a, weight, out, M, N, K, RowView.rows(a), RowView(1, 0, a.stride(-1), False),
                   RowView(1, 0, ops.s_bk, False), ops.s_bn, RowView.rows(out), out.stride(-1), ops.bias, residual,
                   RowView.rows(residual) if has_res else _NO_ROWS, residual.stride(-1) if has_res else 0, preact_out,
                   ops.act, ops.glu, fp8_out, plan_key=plan_key or None)


#: the launch plans of :func:`matmul` and :func:`matmul_checked` (:mod:`.launch`)
_PLANS = PlanCache()


def _fp8_key(fp8_out):  # anything but a (q, scale) pair: a key that finds no plan (the checks reject it)
    if fp8_out is None:
        return None
    if type(fp8_out) in (tuple, list) and len(fp8_out) == 2:
        return type(fp8_out), describe(fp8_out[0]), describe(fp8_out[1])
    return object()


def _tf32_key(a):  # fp32 operands: whether tl.dot runs TF32 follows torch's setting at call time
    return input_precision(torch.float32) if getattr(a, "dtype", None) == torch.float32 else None


def _slots(a, weight, out, bias, residual, aux, fp8_out):
    """The tensors of ``_gemm_kernel``'s pointer arguments, in order (``out`` for an absent one, as
    :func:`_launch` passes them)."""
    q, s = (out, out) if fp8_out is None else fp8_out
    return (a, weight, out, out if bias is None else bias, out if residual is None else residual,
            out if aux is None else aux, q, s)


def matmul_tn(
    grad: torch.Tensor,
    x: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weight gradient ``out[N, K] = grad^T @ x`` summed over all tokens (``+=`` with accumulate).

    grad: ``[T, N]`` or ``[batch, seq, N]``; x: ``[T, K]`` or ``[batch, seq, K]`` with the same
    leading dims. Both may be strided views (a sequence chunk of a larger tensor); the token
    dimension is contracted in place without copies. ``out`` has the ``nn.Linear`` weight layout.
    """
    if not (isinstance(grad, torch.Tensor) and isinstance(x, torch.Tensor) and grad.dim() in (2, 3)
            and x.dim() in (2, 3) and grad.dtype in SUPPORTED_DTYPES and x.dtype == grad.dtype
            and x.device == grad.device and (grad.is_cuda or (grad.is_cpu and cpu_launches()))):
        # what the one condition above holds, checked one by one: the first that fails raises its error
        check_float_tensor("grad", grad, dims=(2, 3))
        check_float_tensor("x", x, dims=(2, 3))
        check_same("x", x, "grad", grad)
    if grad.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"grad and x must have the same leading (token) dims, got {tuple(grad.shape)} and {tuple(x.shape)}"
        )
    N, K = grad.shape[-1], x.shape[-1]
    T = int(torch.Size(grad.shape[:-1]).numel())
    check_out_dtype("out_dtype", out_dtype)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")
    out = output_buffer("out", out, (N, K), grad.device, out_dtype or grad.dtype)
    if N == 0 or K == 0:
        return out
    if T == 0:
        if not accumulate:
            out.zero_()
        return out
    return _launch(grad, x, out, N, K, T, RowView(1, 0, grad.stride(-1), False), RowView.rows(grad), RowView.rows(x),
                   x.stride(-1), RowView.rows(out), out.stride(-1), None, out if accumulate else None,
                   RowView.rows(out) if accumulate else _NO_ROWS, out.stride(-1), None, 0, False)


# --------------------------------------------------------------------------------------------
# Reference (the tests' oracle): plain torch in fp64 unless told otherwise
# --------------------------------------------------------------------------------------------
def matmul_reference(a, weight, bias=None, *, weight_layout="nk", activation="none", residual=None,
                     compute_dtype=torch.float64):
    """What :func:`matmul` computes, in ``compute_dtype`` (returned in that dtype)."""
    w = weight.to(compute_dtype)
    w = w.t() if weight_layout == "nk" else w
    y = a.to(compute_dtype) @ w
    if bias is not None:
        y = y + bias.to(compute_dtype)
    y = activation_reference(y, activation)
    if residual is not None:
        y = y + residual.to(compute_dtype)
    return y
