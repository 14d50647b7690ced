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
from .fp8 import store_e4m3_tiles, to_fp32
from .gemm_core import gemm_epilogue, gemm_mainloop, grouped_tile
from .gemm_fp8_epilogue import (FP8_OUT_CONFIGS, FP8_OUT_INTERPRETER_CONFIG, check_fp8_output, fp8_output_args,
                                fp8_output_configs, quantize_output)
from .launch import PlanCache, build_plan, describe
from .runtime import (ACTIVATIONS, SUPPORTED_DTYPES, RowView, acc_budget_for, activation_reference, aligned,
                      autotuned, cdiv, device_capability, input_precision, interpreting,
                      needs_upcast, on_device, pipelined, prune_tile_configs, row_offsets, shared_memory_limit,
                      tile_smem_bytes, uses_wgmma)

__all__ = [
    "INTERPRETER_CONFIG", "LinearOperands", "gpu_configs", "linear_operands", "EPILOGUE_ACC_BUDGET",
    "SYNC_TIGHT_ACC_BUDGET", "matmul", "matmul_checked", "matmul_reference", "matmul_tn",
    "smem_estimate", "tile_rule",
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
    EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= 16, "tl.dot needs BLOCK_K >= 16")
    tl.static_assert(ACT >= 0 and ACT <= 4, "unknown activation code")

    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N

    a_rows = row_offsets(rm, a_m_inner, s_am0, s_am1, A_M_SPLIT)
    b_cols = rn.to(tl.int64) * s_bn
    b_cols_up = (rn + glu_offset).to(tl.int64) * s_bn
    acc, acc_up = gemm_mainloop(
        a_ptr, b_ptr, a_rows, b_cols, b_cols_up, m_mask, n_mask, K,
        a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1,
        A_K_SPLIT, B_K_SPLIT, GLU, UPCAST, EVEN_K, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )

    # ---- epilogue: bias, activation (gated or not), residual / accumulate, store ----
    out_mask = m_mask[:, None] & n_mask[None, :]
    aux_off = rm.to(tl.int64)[:, None] * s_xm + rn.to(tl.int64)[None, :] * s_xn
    acc = gemm_epilogue(acc, acc_up, rn, n_mask, out_mask, bias_ptr, aux_ptr, aux_off, glu_offset, s_xn,
                        HAS_BIAS, STORE_AUX, ACT, GLU, EMULATE)
    if HAS_RES:
        r_off = row_offsets(rm, r_m_inner, s_rm0, s_rm1, R_M_SPLIT)[:, None] + rn.to(tl.int64)[None, :] * s_rn
        acc += tl.load(r_ptr + r_off, mask=out_mask, other=0.0).to(tl.float32)
    c_off = row_offsets(rm, c_m_inner, s_cm0, s_cm1, C_M_SPLIT)[:, None] + rn.to(tl.int64)[None, :] * s_cn
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + c_off, c, mask=out_mask)
    if FP8_OUT:  # C per 1x128 tile as stored, widened again (what quantize_e4m3 of C loads) into q, s
        store_e4m3_tiles(tl.where(out_mask, to_fp32(c, EMULATE), 0.0),
                         q_ptr + row_offsets(rm, q_m_inner, s_qm0, s_qm1, Q_M_SPLIT),
                         s_ptr + row_offsets(rm, sc_m_inner, s_sm0, s_sm1, S_M_SPLIT), rn, out_mask, m_mask,
                         pid_n * (BLOCK_N // 128), n_tiles, EMULATE, BLOCK_M, BLOCK_N)


# --------------------------------------------------------------------------------------------
# Configurations: a fixed small one under the interpreter, an autotuned pruned list on GPU
# --------------------------------------------------------------------------------------------
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)


def gpu_configs():
    """Candidate tile shapes for Hopper/Ampere (tutorial 03 style), pruned per problem below."""
    configs = []
    for bm, bn, bk, stages, warps in [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 4, 4),
        (128, 256, 32, 4, 8),
        (64, 256, 32, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 8),  # 8 warps: a gated / fused epilogue's accumulators fit in registers
        (64, 128, 64, 4, 8),
        (128, 32, 64, 4, 4),
        (64, 64, 32, 3, 8),  # BLOCK_K 32: problems whose loads do not vectorise (unaligned strides or K)
        (64, 64, 32, 4, 4),
        (32, 64, 32, 4, 4),
        (64, 64, 64, 4, 4),
        (32, 64, 64, 5, 2),
    ]:
        configs.append(
            triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_stages=stages, num_warps=warps)
        )
    return configs


#: fp32 accumulator elements per thread the GEMM epilogues can hold without spilling (sm_90 and
#: sm_80, ``python -m benchmarks compile``): 128 with a plain epilogue (bias, residual, accumulate);
#: 64 with a fused one (activation, gated pair, pre-activation store, residual on split rows),
#: whose activation terms and int64 pointer tiles are live next to the accumulators, and with a
#: residual / accumulate tile wider than the operands (an fp32 ``out`` accumulated from bf16/fp16
#: products: 128 spilled 48-180 B on sm_90, 116-252 B on sm_80).
EPILOGUE_ACC_BUDGET = {"plain": 128, "fused": 64}
#: the same for dots lowered to mma.sync (sm_80, and tiles under 64 rows on sm_90), whose operand
#: fragments are held in registers next to the accumulators: an activation followed by a residual
#: add, or a fused epilogue whose loads do not vectorise (:func:`~fusedpar.kernels.runtime.aligned`),
#: fits 32 (64 spills 4-136 B on sm_80); so does a gated e4m3-output epilogue over unaligned K on
#: any dot (sm_90, 64 x 128 x 32 w8: 88-112 B spilled)
SYNC_TIGHT_ACC_BUDGET = 32


def tile_rule(named_args: dict, **kwargs) -> dict:
    """The prune rule's parameters (:func:`~fusedpar.kernels.runtime.tile_config_problem`) of a
    GEMM launch with ``named_args`` / constexpr ``kwargs`` (``_gemm_kernel`` and the persistent one)."""
    def get(k, default=False):
        return kwargs.get(k, named_args.get(k, default))

    a, glu, precision = named_args["a_ptr"], bool(get("GLU")), get("INPUT_PRECISION", "ieee")
    act = glu or get("ACT", 0) != 0
    fused = act or get("STORE_AUX") or get("FP8_OUT") or (get("HAS_RES") and get("R_M_SPLIT"))
    extents = [named_args.get(k, 16) for k in ("K", "s_am0", "s_am1", "s_ak0", "s_ak1", "s_ak", "s_bk0", "s_bk1", "s_bk",
                                                "s_bn")]
    extents = [e for e in extents if e != 1]
    # a masked contiguous dim counts too: A contiguous along M (matmul_tn), B along N ("kn")
    extents += [named_args[d] for d, s in (("M", "s_am1"), ("N", "s_bn")) if d in named_args and named_args.get(s) == 1]
    unaligned = named_args.get("K", 64) % 64 != 0 or not aligned(a.element_size(), *extents)
    res = named_args.get("r_ptr")
    wide_res = bool(get("HAS_RES")) and isinstance(res, torch.Tensor) and res.element_size() > a.element_size()
    budget = EPILOGUE_ACC_BUDGET["fused" if fused or wide_res else "plain"]
    budget = SYNC_TIGHT_ACC_BUDGET if get("FP8_OUT") and glu and unaligned else budget
    sync = SYNC_TIGHT_ACC_BUDGET if fused and (unaligned or (act and get("HAS_RES"))) else budget
    cap = dict(elem_size=a.element_size(), precision=precision, acc_tiles=2 if glu else 1,
               reads_out_tile=bool(get("HAS_RES")))
    return dict(elem_size=a.element_size(), b_tiles=2 if glu else 1, acc_tiles=2 if glu else 1,
                acc_budget=acc_budget_for(budget, **cap), sync_acc_budget=acc_budget_for(sync, **cap, sync=True),
                capability=device_capability(a.device.index or 0), precision=precision, unaligned=unaligned,
                pipelined=pipelined(a.element_size(), *extents))


def smem_estimate(cfg, named_args, **kwargs) -> int:
    """The prune rule's shared-memory bytes of ``cfg`` for a launch with ``named_args``: the main
    loop's buffers or, for a wgmma tile whose output is wider than its operands (fp32 ``out`` from
    bf16/fp16: the linear cross entropy's ``d_hidden``) or quantised (``FP8_OUT``: 16384 B, not 12288,
    for 64 x 128 x 32 over unaligned K), the output tile Triton stages through shared memory to
    convert the accumulator's layout, whichever is larger (measured: a 128 x 256 x 32 tile of 4
    stages needs 131072 B, not the 98304 B of its buffers)."""
    r = tile_rule(named_args, **kwargs)
    smem = tile_smem_bytes(cfg, elem_size=r["elem_size"], b_tiles=r["b_tiles"], capability=r["capability"],
                           precision=r["precision"], pipelined=r["pipelined"])
    c = named_args.get("c_ptr")
    kw = cfg.kwargs if hasattr(cfg, "kwargs") else cfg
    wide = isinstance(c, torch.Tensor) and (c.element_size() > r["elem_size"] or kwargs.get("FP8_OUT", False))
    if wide and uses_wgmma(r["capability"], kw["BLOCK_M"], r["elem_size"], r["precision"]):
        smem = max(smem, kw["BLOCK_M"] * kw["BLOCK_N"] * c.element_size())
    return smem


def _prune_configs(configs, named_args, **kwargs):
    a = named_args["a_ptr"]
    configs = fp8_output_configs(configs, kwargs.get("FP8_OUT", named_args.get("FP8_OUT", False)))
    return prune_tile_configs(configs, smem_limit=shared_memory_limit(a.device.index or 0),
                              dims={"BLOCK_M": named_args["M"], "BLOCK_N": named_args["N"]},
                              **tile_rule(named_args, **kwargs))


#: the autotuner's key: the problem size, every flag :func:`tile_rule` reads and the strides it
#: reads (a launch whose rows lose 16-byte alignment is unpipelined), so that the config tuned for
#: one launch is never reused by a launch whose rule would prune it (a tf32 tile run as "ieee" FMA
#: dots, a plain epilogue's 128-accumulator tile with a fused epilogue, a pipelined tile unpipelined)
TUNING_KEY = ["M", "N", "K", "GLU", "A_K_SPLIT", "HAS_RES", "R_M_SPLIT", "ACT", "STORE_AUX", "INPUT_PRECISION",
              "FP8_OUT", "s_am0", "s_am1", "s_ak0", "s_ak1", "s_bk0", "s_bk1", "s_bn"]


@functools.lru_cache(maxsize=None)
def _tuned_kernel():
    return autotuned(
        _gemm_kernel, configs=gpu_configs() + list(FP8_OUT_CONFIGS), key=TUNING_KEY,
        prune=_prune_configs,
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
    if interpreting():
        cfg = INTERPRETER_CONFIG if fp8_out is None else FP8_OUT_INTERPRETER_CONFIG
        flags["EVEN_K"] = K % cfg["BLOCK_K"] == 0
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
        _gemm_kernel[grid](*args, **flags, **cfg)
    else:
        # EVEN_K must hold for every BLOCK_K the tuner may pick (all are <= 64 and divide 64)
        flags["EVEN_K"] = K % 64 == 0
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        with on_device(a.device):
            tuner = _tuned_kernel()
            compiled = tuner[grid](*args, **flags)
            cfg = tuner.best_config
            if (plan_key is not None and cfg is not None and cfg.pre_hook is None and plan_key not in _PLANS
                    and _PLANS.second_launch(plan_key)):
                plan = build_plan(tuner.fn, compiled, args, {**flags, **cfg.kwargs}, grid(cfg.kwargs))
                _PLANS.keep(plan_key, plan)
                if plan is not None:
                    plan.extra = (out.shape, out.dtype)
    return out


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
        if out is None and residual is None and preact_out is None and fp8_out is None and not accumulate:
            key = ("matmul", describe(a), describe(weight), describe(bias), weight_layout, activation, out_dtype,
                   _tf32_key(a))
        else:
            key = ("matmul+", describe(a), describe(weight), describe(bias), weight_layout, activation, out_dtype,
                   _tf32_key(a), describe(out), accumulate, describe(residual), describe(preact_out), _fp8_key(fp8_out))
        plan = _PLANS.find(key)
        stream = None if plan is None else plan.stream()
        if stream is not None:
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
