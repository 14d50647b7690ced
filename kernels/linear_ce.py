"""The logits GEMM ``z = hidden @ weight.T`` with cross-entropy epilogues: the fused linear + cross
entropy of :func:`fusedpar.ops.linear_cross_entropy` without a tokens x vocabulary tensor.

* :func:`linear_ce_stats` (forward): one launch over the ``[M, N]`` output tiles; each tile turns
  its fp32 accumulator into the (soft-capped) logits and leaves, per row, their max and the sum of
  ``exp(z - max)`` (and with ``smoothing`` the sum of ``z``) in a ``[N / BLOCK_N, M]`` fp32 buffer;
  the tile that holds a row's target writes its logit. A torch reduction over the tiles gives
  ``logsumexp_j z_ij``. Nothing ``[M, N]``-sized is stored.
* :func:`linear_ce_dlogits` (backward, one vocabulary block at a time): the same GEMM recomputed,
  with an epilogue that writes ``dz = (scale * exp(z - lse) - shift - target_coef * onehot) *
  (1 - tanh^2)`` straight into ``out`` (its dtype: the model's, for the two gradient GEMMs that
  follow it).

The soft cap ``c * tanh(z / c)`` is written with ``exp`` (no libdevice under the interpreter).
Tiles: the GEMM's main loop (:func:`~fusedpar.kernels.gemm_core.gemm_mainloop`); configs pruned by the
GEMM's rule for a fused epilogue (:func:`~fusedpar.kernels.gemm.tile_rule`). The statistics kernel
has one ``BLOCK_N`` (:func:`stats_block_n`), which fixes the shape of its per-tile buffer.

Layers: ``_ce_stats_kernel`` / ``_ce_dlogits_kernel`` (jit) -> :func:`linear_ce_stats` /
:func:`linear_ce_dlogits` (validate, allocate, launch) -> :func:`linear_ce_stats_reference` /
:func:`linear_ce_dlogits_reference` (float64 torch, the tests' oracle).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .checks import (check_float_tensor, check_index_tensor, check_out_dtype, check_same, check_shape, check_tensor,
                     output_buffer)
from .gemm_configs import INTERPRETER_CONFIG, gpu_configs, smem_estimate, tile_rule, tma_gpu_configs
from .gemm_core import gemm_mainloop, grouped_tile, operand_descriptors
from .gemm_loads import ensure_scratch_allocator, note_launch, num_programs, tma_capable, tma_layout
from .launch import launch_kernel
from .runtime import (autotuned, cdiv, input_precision, interpreting, needs_upcast, on_device, prune_tile_configs,
                      shared_memory_limit)

__all__ = ["STATS_BLOCK_N", "linear_ce_dlogits", "linear_ce_dlogits_reference", "linear_ce_stats",
           "linear_ce_stats_reference", "stats_block_n"]

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _tanh(t):
    """``tanh(t) = sign(t) (1 - e) / (1 + e)`` with ``e = exp(-2|t|) <= 1`` (no overflow)."""
    e = tl.exp2(tl.abs(t) * -2.8853900817779268)  # exp(-2|t|)
    return tl.where(t < 0, e - 1.0, 1.0 - e) / (1.0 + e)


@triton.jit
def _logits_tile(tile, a_ptr, b_ptr, a_desc, b_desc, M, N, K, s_am1, s_ak1, s_bn, s_bk1, UPCAST: tl.constexpr,
                 EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``tile``'s ``[BLOCK_M, BLOCK_N]`` of ``a @ b^T`` (fp32, the GEMM core's main loop: TMA
    loads through ``a_desc`` / ``b_desc``, or pointer loads), its row and column indices and its
    column-block index."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    b_cols = rn.to(tl.int64) * s_bn
    acc, _ = gemm_mainloop(
        a_ptr, b_ptr, rm.to(tl.int64) * s_am1, b_cols, b_cols, rm < M, rn < N, K,
        1, 0, s_ak1, 1, 0, s_bk1,
        False, False, False, UPCAST, EVEN_K, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, TMA, True, True,
    )
    return acc, rm, rn, pid_n


@triton.jit
def _ce_stats_kernel(
    a_ptr, b_ptr, idx_ptr, max_ptr, sum_ptr, zsum_ptr, picked_ptr,
    M, N, K, s_am1, s_ak1, s_bn, s_bk1, cap, inv_cap,
    SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` logits tile -> per row: max, sum of exp(z - max), (sum of z), and
    the target's logit where ``idx`` (the target's column, -1: none) falls in the tile. The
    statistics of tile column ``n`` go to row ``n`` of the ``[cdiv(N, BLOCK_N), M]`` buffers.
    ``TMA``: persistent over the tiles, loads through tensor descriptors (:mod:`.gemm_loads`)."""
    if TMA:
        a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, s_am1, s_ak1, s_bk1, s_bn, True, True,
                                             BLOCK_M, BLOCK_N, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), tl.num_programs(0),
                             flatten=True):
            _ce_stats_tile(tile, a_ptr, b_ptr, a_desc, b_desc, idx_ptr, max_ptr, sum_ptr, zsum_ptr, picked_ptr, M, N,
                           K, s_am1, s_ak1, s_bn, s_bk1, cap, inv_cap, SOFTCAP, SMOOTH, UPCAST, EVEN_K,
                           INPUT_PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _ce_stats_tile(tl.program_id(0), a_ptr, b_ptr, a_ptr, b_ptr, idx_ptr, max_ptr, sum_ptr, zsum_ptr, picked_ptr,
                       M, N, K, s_am1, s_ak1, s_bn, s_bk1, cap, inv_cap, SOFTCAP, SMOOTH, UPCAST, EVEN_K,
                       INPUT_PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _ce_stats_tile(
    tile, a_ptr, b_ptr, a_desc, b_desc, idx_ptr, max_ptr, sum_ptr, zsum_ptr, picked_ptr,
    M, N, K, s_am1, s_ak1, s_bn, s_bk1, cap, inv_cap,
    SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``_ce_stats_kernel``'s tile ``tile``."""
    acc, rm, rn, pid_n = _logits_tile(tile, a_ptr, b_ptr, a_desc, b_desc, M, N, K, s_am1, s_ak1, s_bn, s_bk1, UPCAST,
                                      EVEN_K, INPUT_PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    z = acc
    if SOFTCAP:  # c * tanh(z / c)
        z = _tanh(acc * inv_cap) * cap
    z = tl.where(n_mask[None, :], z, float("-inf"))
    row_max = tl.max(z, 1)
    row_sum = tl.sum(tl.exp2((z - row_max[:, None]) * 1.4426950408889634), 1)
    tgt = tl.load(idx_ptr + rm, mask=m_mask, other=-1)
    picked = tl.sum(tl.where(rn[None, :] == tgt[:, None], z, 0.0), 1)
    n0 = pid_n * BLOCK_N
    # tgt < N: a target past the last column (padded, -inf here) picks nothing, as a negative one
    tl.store(picked_ptr + rm, picked, mask=m_mask & (tgt >= n0) & (tgt < n0 + BLOCK_N) & (tgt < N))
    stat = pid_n.to(tl.int64) * M + rm
    tl.store(max_ptr + stat, row_max, mask=m_mask)
    tl.store(sum_ptr + stat, row_sum, mask=m_mask)
    if SMOOTH:
        tl.store(zsum_ptr + stat, tl.sum(tl.where(n_mask[None, :], z, 0.0), 1), mask=m_mask)


@triton.jit
def _ce_dlogits_kernel(
    a_ptr, b_ptr, c_ptr, idx_ptr, lse_ptr, scale_ptr, tcoef_ptr, shift_ptr,
    M, N, K, s_am1, s_ak1, s_bn, s_bk1, s_cm, s_cn, col_offset, cap, inv_cap,
    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One tile of ``dz = (scale * exp(z - lse) - shift - tcoef * [col_offset + j == idx]) *
    (1 - tanh^2)`` (the last factor with a soft cap) from the recomputed logits, stored in
    ``c``'s dtype. ``TMA``: persistent over the tiles, loads through tensor descriptors."""
    if TMA:
        a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, s_am1, s_ak1, s_bk1, s_bn, True, True,
                                             BLOCK_M, BLOCK_N, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), tl.num_programs(0),
                             flatten=True):
            _ce_dlogits_tile(tile, a_ptr, b_ptr, a_desc, b_desc, c_ptr, idx_ptr, lse_ptr, scale_ptr, tcoef_ptr,
                             shift_ptr, M, N, K, s_am1, s_ak1, s_bn, s_bk1, s_cm, s_cn, col_offset, cap, inv_cap,
                             SOFTCAP, UPCAST, EVEN_K, INPUT_PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _ce_dlogits_tile(tl.program_id(0), a_ptr, b_ptr, a_ptr, b_ptr, c_ptr, idx_ptr, lse_ptr, scale_ptr, tcoef_ptr,
                         shift_ptr, M, N, K, s_am1, s_ak1, s_bn, s_bk1, s_cm, s_cn, col_offset, cap, inv_cap,
                         SOFTCAP, UPCAST, EVEN_K, INPUT_PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _ce_dlogits_tile(
    tile, a_ptr, b_ptr, a_desc, b_desc, c_ptr, idx_ptr, lse_ptr, scale_ptr, tcoef_ptr, shift_ptr,
    M, N, K, s_am1, s_ak1, s_bn, s_bk1, s_cm, s_cn, col_offset, cap, inv_cap,
    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``_ce_dlogits_kernel``'s tile ``tile``."""
    acc, rm, rn, pid_n = _logits_tile(tile, a_ptr, b_ptr, a_desc, b_desc, M, N, K, s_am1, s_ak1, s_bn, s_bk1, UPCAST,
                                      EVEN_K, INPUT_PRECISION, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    z = acc
    if SOFTCAP:
        th = _tanh(acc * inv_cap)
        z = th * cap
    lse = tl.load(lse_ptr + rm, mask=m_mask, other=0.0)
    scale = tl.load(scale_ptr + rm, mask=m_mask, other=0.0)
    shift = tl.load(shift_ptr + rm, mask=m_mask, other=0.0)
    tcoef = tl.load(tcoef_ptr + rm, mask=m_mask, other=0.0)
    tgt = tl.load(idx_ptr + rm, mask=m_mask, other=-1) - col_offset
    dz = scale[:, None] * tl.exp2((z - lse[:, None]) * 1.4426950408889634) - shift[:, None]
    dz = tl.where(rn[None, :] == tgt[:, None], dz - tcoef[:, None], dz)
    if SOFTCAP:
        dz = dz * (1.0 - th * th)
    c_off = rm.to(tl.int64)[:, None] * s_cm + rn.to(tl.int64)[None, :] * s_cn
    tl.store(c_ptr + c_off, dz.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------
#: the statistics kernel's tile width on a GPU: its per-tile buffer is ``[cdiv(N, 128), M]`` fp32
#: (1/128 of the logits per statistic); 128 columns keep a fused epilogue's accumulators at 64 per
#: thread in the 128 x 128 tile of 8 warps
STATS_BLOCK_N = 128


def stats_block_n() -> int:
    """``BLOCK_N`` of :func:`linear_ce_stats`'s launches: :data:`STATS_BLOCK_N` compiled, the
    interpreter's fixed tile (32) under ``TRITON_INTERPRET=1``."""
    return INTERPRETER_CONFIG["BLOCK_N"] if interpreting() else STATS_BLOCK_N


def stats_configs():
    """The statistics kernel's candidates (``BLOCK_N`` fixed): 64-deep K blocks for aligned
    problems, 32-deep ones for unaligned loads and fp32 FMA dots (32 x 128 on 4 warps: 32
    accumulators per thread)."""
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=STATS_BLOCK_N, BLOCK_K=bk, GROUP_M=8), num_stages=s, num_warps=w)
            for bm, bk, s, w in [(128, 64, 4, 8), (128, 64, 3, 8), (64, 64, 4, 4), (64, 64, 3, 4), (64, 32, 4, 4),
                                 (32, 32, 4, 4)]] + _tma([c for c in tma_gpu_configs() if c.kwargs["BLOCK_N"] == 128])


def _tma(configs):
    """The GEMM's TMA tiles (:mod:`.gemm_configs`) with the whole-tile epilogue these kernels run
    (no ``EPILOGUE_SPLIT``), marked ``cfg.tma``."""
    out = []
    for c in configs:
        if c.kwargs.get("EPILOGUE_SPLIT", 1) == 1:
            cfg = triton.Config({k: v for k, v in c.kwargs.items() if k != "EPILOGUE_SPLIT"}, num_stages=c.num_stages,
                                num_warps=c.num_warps)
            cfg.tma = True
            out.append(cfg)
    return out


def _prune(configs, named_args, **kwargs):
    """The GEMM prune rule for a fused epilogue (its register budget: the exp / compare tiles are
    live next to the accumulator) over the launch's load path (TMA tiles with their epilogue's
    shared memory); a tile at most twice the problem along a dimension it tiles."""
    dims = {"BLOCK_M": named_args["M"]}
    if "c_ptr" in named_args:  # the dlogits kernel's BLOCK_N is free
        dims["BLOCK_N"] = named_args["N"]
    tma = bool(kwargs.get("TMA", False))
    configs = [c for c in configs if getattr(c, "tma", False) == tma]
    limit = shared_memory_limit(named_args["a_ptr"].device.index or 0)
    if tma:
        configs = [c for c in configs if smem_estimate(c, named_args, **kwargs) <= limit] or configs[-1:]
    return prune_tile_configs(configs, smem_limit=limit, dims=dims, **tile_rule(named_args, **kwargs, STORE_AUX=True))


#: the autotuners' keys: the problem size and every flag and stride the prune rule reads
_KEY = ["M", "N", "K", "SOFTCAP", "INPUT_PRECISION", "TMA", "s_am1", "s_ak1", "s_bn", "s_bk1"]


@functools.lru_cache(maxsize=None)
def _tuned_stats():
    return autotuned(_ce_stats_kernel, configs=stats_configs(), prune=_prune, key=_KEY + ["SMOOTH"])


@functools.lru_cache(maxsize=None)
def _tuned_dlogits():
    return autotuned(_ce_dlogits_kernel, configs=gpu_configs() + _tma(tma_gpu_configs()), prune=_prune, key=_KEY)


def _launch(kernel, tuned, args, flags, M, N, K, device):
    """One fixed small tile under the interpreter, the autotuned kernel on a GPU; persistent over
    the SMs where both operands load by TMA (:mod:`.gemm_loads`)."""
    a, b = args[0], args[1]
    tma = tma_capable(device, a.element_size()) and tma_layout(a, a.stride(0), a.stride(1), b, b.stride(1),
                                                               b.stride(0), (M, N, K), k_major=True) is not None
    flags = dict(flags, UPCAST=needs_upcast(a.dtype), INPUT_PRECISION=input_precision(a.dtype), TMA=tma)
    grid = lambda meta: (num_programs(cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), device, tma),)  # noqa: E731
    if interpreting():
        cfg = INTERPRETER_CONFIG
        kernel[grid(cfg)](*args, **flags, EVEN_K=K % cfg["BLOCK_K"] == 0, **cfg)
    else:
        ensure_scratch_allocator()
        with on_device(device):
            launch_kernel(tuned(), grid, args, dict(**flags, EVEN_K=K % 64 == 0))  # every BLOCK_K divides 64
    note_launch("linear_ce_dlogits" if tuned is _tuned_dlogits else "linear_ce_stats",
                None if interpreting() else tuned(), INTERPRETER_CONFIG, tma)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def _check_operands(hidden, weight, target_idx):
    check_float_tensor("hidden", hidden, dims=(2,))
    check_float_tensor("weight", weight, dims=(2,))
    check_same("weight", weight, "hidden", hidden)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must have shape [N, {hidden.shape[1]}] (hidden's features), got "
                         f"{tuple(weight.shape)}")
    check_index_tensor("target_idx", target_idx, dims=(1,))
    check_same("target_idx", target_idx, "hidden", hidden, dtype=False)
    check_shape("target_idx", target_idx, (hidden.shape[0],))
    if target_idx.stride(0) != 1 and target_idx.shape[0] > 1:
        raise ValueError(f"target_idx must be unit-stride, got stride {target_idx.stride(0)}")
    return hidden.shape[0], weight.shape[0], hidden.shape[1]


def _cap(softcap) -> tuple[float, float]:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise ValueError(f"softcap must be a number >= 0 (0: no cap), got {softcap!r}")
    return float(softcap), (1.0 / softcap if softcap else 0.0)


def linear_ce_stats(hidden: torch.Tensor, weight: torch.Tensor, target_idx: torch.Tensor, *, softcap: float = 0.0,
                    smoothing: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row statistics of the logits ``z = hidden @ weight.T`` (fp32 accumulation; with
    ``softcap`` > 0, ``z = c * tanh(z / c)``) without storing them: ``out[0] = logsumexp_j z``,
    ``out[1] = z[i, target_idx[i]]`` (0 where ``target_idx`` is negative), ``out[2] = sum_j z``
    with ``smoothing`` (else 0).

    hidden: ``[M, K]``; weight: ``[N, K]`` (the ``nn.Linear`` layout), any strides; target_idx:
    ``[M]`` int32/int64, unit-stride, a column in ``[0, N)`` or negative (no target here; the
    values are not checked: a read of them would wait for the GPU). out: ``[3, M]``
    fp32 (allocated when None; any strides). Extra memory: ``(2 or 3) x cdiv(N, BLOCK_N) x M``
    fp32 tile statistics (:func:`stats_block_n`)."""
    M, N, K = _check_operands(hidden, weight, target_idx)
    cap, inv_cap = _cap(softcap)
    out = output_buffer("out", out, (3, M), hidden.device, torch.float32, exact_dtype=True)
    if M == 0:
        return out
    if N == 0:
        out[0].fill_(float("-inf"))
        out[1:].zero_()
        return out
    if K == 0:  # an empty contraction: every logit is 0
        out[0].fill_(math.log(N))
        out[1:].zero_()
        return out
    bn = stats_block_n()
    part = torch.empty((3 if smoothing else 2, cdiv(N, bn), M), dtype=torch.float32, device=hidden.device)
    picked = torch.zeros(M, dtype=torch.float32, device=hidden.device)
    args = (hidden, weight, target_idx, part[0], part[1], part[2 if smoothing else 1], picked,
            M, N, K, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), cap, inv_cap)
    _launch(_ce_stats_kernel, _tuned_stats, args, dict(SOFTCAP=cap > 0, SMOOTH=smoothing), M, N, K, hidden.device)
    torch.logsumexp(part[0] + part[1].log(), dim=0, out=out[0])
    out[1].copy_(picked)
    if smoothing:
        torch.sum(part[2], dim=0, out=out[2])
    else:
        out[2].zero_()
    return out


def linear_ce_dlogits(hidden: torch.Tensor, weight: torch.Tensor, target_idx: torch.Tensor, lse: torch.Tensor,
                      scale: torch.Tensor, target_coef: torch.Tensor, shift: torch.Tensor, *, softcap: float = 0.0,
                      col_offset: int = 0, out: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The cross-entropy gradient of a block of logits ``z = hidden @ weight.T`` (recomputed, fp32
    accumulation, soft-capped with ``softcap`` > 0), written in ``out``'s dtype::

        out[i, j] = (scale[i] * exp(z[i, j] - lse[i]) - shift[i]
                     - target_coef[i] * [col_offset + j == target_idx[i]]) * (1 - (z[i, j] / c)^2)

    (the last factor with a soft cap: the derivative of ``c * tanh``). For the loss
    ``g ((1 - eps)(lse - z_t) + eps (lse - mean z) + z_loss lse^2)``: ``scale = g (1 + 2 z_loss
    lse)``, ``target_coef = (1 - eps) g``, ``shift = eps g / V``.

    hidden: ``[M, K]``; weight: ``[N, K]``, the block's rows (columns ``col_offset ..`` of the
    full logits); target_idx: ``[M]`` int, the target's column in the full logits, negative for
    none; lse, scale, target_coef, shift: ``[M]`` fp32; these five unit-stride. out: ``[M, N]``,
    any strides (a column block of a wider buffer), allocated in ``out_dtype`` (default hidden's)
    when None."""
    M, N, K = _check_operands(hidden, weight, target_idx)
    for name, t in (("lse", lse), ("scale", scale), ("target_coef", target_coef), ("shift", shift)):
        check_tensor(name, t, dims=(1,), dtypes=(torch.float32,))
        check_same(name, t, "hidden", hidden, dtype=False)
        check_shape(name, t, (M,))
        if t.stride(0) != 1 and M > 1:
            raise ValueError(f"{name} must be unit-stride, got stride {t.stride(0)}")
    if isinstance(col_offset, bool) or not isinstance(col_offset, int) or col_offset < 0:
        raise ValueError(f"col_offset must be an int >= 0, got {col_offset!r}")
    cap, inv_cap = _cap(softcap)
    check_out_dtype("out_dtype", out_dtype)
    out = output_buffer("out", out, (M, N), hidden.device, out_dtype or hidden.dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:  # every logit 0: the formula on a zero tile
        return out.copy_(linear_ce_dlogits_reference(hidden, weight, target_idx, lse, scale, target_coef, shift,
                                                     softcap=softcap, col_offset=col_offset))
    args = (hidden, weight, out, target_idx, lse, scale, target_coef, shift, M, N, K, hidden.stride(0),
            hidden.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1), col_offset, cap,
            inv_cap)
    _launch(_ce_dlogits_kernel, _tuned_dlogits, args, dict(SOFTCAP=cap > 0), M, N, K, hidden.device)
    return out


# --------------------------------------------------------------------------------------------
# References (the tests' oracle): float64 torch
# --------------------------------------------------------------------------------------------
def _reference_logits(hidden, weight, softcap):
    raw = hidden.double() @ weight.double().T
    return raw, (softcap * torch.tanh(raw / softcap) if softcap else raw)


def linear_ce_stats_reference(hidden, weight, target_idx, *, softcap=0.0, smoothing=False) -> torch.Tensor:
    """What :func:`linear_ce_stats` computes, from the whole logits in float64: ``[3, M]``."""
    _, z = _reference_logits(hidden, weight, softcap)
    inside = target_idx >= 0
    picked = z.gather(1, torch.where(inside, target_idx, 0).long()[:, None]).squeeze(1) * inside
    zsum = z.sum(-1) if smoothing else torch.zeros_like(picked)
    return torch.stack([torch.logsumexp(z, -1), picked, zsum])


def linear_ce_dlogits_reference(hidden, weight, target_idx, lse, scale, target_coef, shift, *, softcap=0.0,
                                col_offset=0) -> torch.Tensor:
    """What :func:`linear_ce_dlogits` computes, in float64: ``[M, N]``."""
    _, z = _reference_logits(hidden, weight, softcap)
    cols = torch.arange(col_offset, col_offset + z.shape[1], device=z.device)
    onehot = (cols[None, :] == target_idx.long()[:, None]).double()
    dz = (scale.double()[:, None] * torch.exp(z - lse.double()[:, None]) - shift.double()[:, None]
          - target_coef.double()[:, None] * onehot)
    if softcap:
        dz = dz * (1 - (z / softcap) ** 2)
    return dz
