"""Grouped GEMM for mixture-of-experts: forward with a fused activation, the backward of the
activation fused into the data-gradient GEMM, and the per-expert weight gradient.

Rows ``offsets[g] .. offsets[g+1]`` of ``x`` are multiplied by ``weight[g % E_w]`` (one base
pointer plus per-group offsets, never a pointer array). Each program derives its (group,
row-block) tile from the offsets itself: it loads the ``G`` offsets, forms
``tiles_g = cdiv(count_g, BLOCK_M)`` and their cumulative sum, and finds its group by counting.
The grid is a worst-case bound, ``M // BLOCK_M + min(G, M) + 1`` row tiles (``_row_tiles``), so
launching needs no host sync and the schedule follows whatever ``BLOCK_M`` the autotuner picks.
The last programs of the grid write zeros into the tail rows ``offsets[G] .. M`` (capacity drops
leave such rows); the programs in between exit at once.

The kernels read the offsets unchecked: offsets that do not start at 0, decrease, or end past
``M`` would read and write out of bounds. :func:`as_group_offsets` checks them on every device
(a device tensor costs one host read); ``check_offsets=False`` skips that for offsets that are
correct by construction (those of :func:`fusedpar.kernels.moe_routing.routing_metadata` and of
an MoE plan).

fp8 (``float8_e4m3fn`` operands with fp32 scales, the constexpr ``FP8``): the forward and the
data gradient take x per row / 1x128 tile and the weights per expert row / 128x128 block, the
weight gradient operands quantised along the rows per group (``kernels/fp8.py``); the scales and
tiles of fp8 launches are checked and chosen in ``kernels/fp8_gemm.py``.

Layers: ``@triton.jit`` kernels -> tile rules -> launchers (validate, allocate, launch); the
float64 references are in :mod:`fusedpar.kernels.moe_routing`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .checks import (check_buffer, check_choice, check_float_tensor, check_out_dtype, check_same,
                     check_tensor, output_buffer)
from .launch import launch_kernel
from .fp8 import rne_for_store
from .fp8_gemm_configs import FP8_GROUPED_INTERPRETER_CONFIGS, grouped_fp8_flags, grouped_fp8_scales
from .gemm_core import gemm_mainloop
from .gemm_loads import ensure_scratch_allocator, note_launch, num_programs, tma_capable, up_half_aligned
from .grouped_gemm_configs import (INTERPRETER_GEMM_CONFIG, INTERPRETER_WGRAD_CONFIG, TUNING_KEY, WGRAD_TUNING_KEY,
                                   gemm_gpu_configs, prune_grouped, prune_grouped_wgrad, smem_estimate, tile_rule,
                                   wgrad_gpu_configs, wgrad_smem_estimate, wgrad_tile_rule)
from .moe_permute import as_group_offsets
from .moe_routing import MAX_ROWS
from .runtime import (ACTIVATIONS, SUPPORTED_DTYPES, autotuned, cdiv, input_precision, interpreting, needs_upcast,
                      next_power_of_2, on_device)

__all__ = [
    # the tile rules, from .grouped_gemm_configs (the compile check reads the estimates here)
    "TUNING_KEY", "WGRAD_TUNING_KEY", "smem_estimate", "tile_rule", "wgrad_smem_estimate", "wgrad_tile_rule",
    "OPERAND_DTYPES", "as_group_offsets", "grouped_matmul", "grouped_matmul_dact", "grouped_wgrad",
]

_LAYOUTS = ("nk", "kn")
OPERAND_DTYPES = SUPPORTED_DTYPES + (torch.float8_e4m3fn,)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, aux_ptr, offsets_ptr, bias_ptr, xs_ptr, ws_ptr,
    G, E_w, M, N, K,
    s_xm, s_xk, s_we, s_wn, s_wk, s_om, s_on, s_am, s_an, glu_offset, s_be, s_xsm, s_xsk, s_wse, s_wsn, s_wsk,
    ACT: tl.constexpr, GLU: tl.constexpr, STORE_AUX: tl.constexpr, DACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, G_PAD: tl.constexpr, FP8: tl.constexpr,
    BLOCKWISE: tl.constexpr, EMULATE: tl.constexpr, PROMOTE_K: tl.constexpr, TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr, W_STACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows of group g times weight[g % E_w] ([N, K] through strides, so a transposed view of the
    same tensor needs no copy). Epilogues: forward ``act`` (gated: act(gate) * up, pre-activation
    to ``aux``; ``HAS_BIAS``: ``bias[g % E_w]`` added first, gate and up halves), or backward
    ``DACT``: the product is the gradient of the activation output and ``aux`` holds the
    pre-activation; writes the gradient of the pre-activation. ``FP8``: scaled e4m3 operands (module
    docstring; ``BLOCKWISE``: a fresh dot per 128-deep step); ``EMULATE``: interpreted bf16 stores.
    ``TMA``: x and the experts' weights through tensor descriptors (``W_STACKED``: the experts'
    rows one stack ``[E_w * N_w, K]``; else 3-D, the expert an index of its own: ``W_KMAJOR``
    ``[E_w, N_w, K]``, else ``[E_w, K, N_w]``, expert stride ``s_we``), a persistent program
    walking tiles ``pid, pid + programs, ...`` of the row-tiles x column-tiles grid
    (:func:`_row_tiles`) row by row; else one tile per program of it."""
    tl.static_assert(BLOCK_K >= 16, "tl.dot needs BLOCK_K >= 16")
    tl.static_assert(not (DACT and STORE_AUX), "the backward epilogue reads aux, it does not store it")
    tl.static_assert(not (DACT and HAS_BIAS), "the bias is a forward epilogue")
    tl.static_assert(not (FP8 and BLOCKWISE) or BLOCK_K == 128, "blockwise scaling steps K one 128-block at a time")
    if TMA:
        n_w = N if DACT else N + glu_offset  # the weight rows of an expert (a gated forward: gate and up)
        row_tiles = M // BLOCK_M + tl.minimum(G, M) + 1  # (_row_tiles)
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[s_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
        if W_STACKED:  # the experts' rows as one stack (the host checked the product fits in 31 bits)
            stacked = (tl.cast(E_w, tl.int64) * n_w).to(tl.int32)
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[stacked, K], strides=[s_wn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        elif W_KMAJOR:  # [E_w, n_w, K], experts s_we apart (padded slices, e.g. a shard along n_w)
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E_w, n_w, K], strides=[tl.cast(s_we, tl.int64), s_wn, 1],
                                               block_shape=[1, BLOCK_N, BLOCK_K])
        else:  # [E_w, K, n_w]: a K step past an expert's K rows reads zeros, not the next expert's rows
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E_w, K, n_w], strides=[tl.cast(s_we, tl.int64), s_wk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])
        # row-major: tutorial 03's grouped order (gemm_core.grouped_tile) cost up to 52 more
        # registers here (sm_90, 64 x 64 over 4 warps gated: 187 -> 239)
        col_tiles = tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), row_tiles * col_tiles, tl.num_programs(0)):
            _grouped_tile(tile // col_tiles, tile % col_tiles, row_tiles, x_ptr, w_ptr, out_ptr, aux_ptr, offsets_ptr,
                          bias_ptr, xs_ptr, ws_ptr, x_desc, w_desc, G, E_w, M, N, K, s_xm, s_xk, s_we, s_wn, s_wk,
                          s_om, s_on, s_am, s_an, glu_offset, s_be, s_xsm, s_xsk, s_wse, s_wsn, s_wsk, ACT, GLU,
                          STORE_AUX, DACT, HAS_BIAS, UPCAST, INPUT_PRECISION, G_PAD, FP8, BLOCKWISE, EMULATE,
                          PROMOTE_K, TMA, W_KMAJOR, W_STACKED, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _grouped_tile(tl.program_id(0), tl.program_id(1), tl.num_programs(0), x_ptr, w_ptr, out_ptr, aux_ptr,
                      offsets_ptr, bias_ptr, xs_ptr, ws_ptr, x_ptr, w_ptr, G, E_w, M, N, K, s_xm, s_xk, s_we, s_wn,
                      s_wk, s_om, s_on, s_am, s_an, glu_offset, s_be, s_xsm, s_xsk, s_wse, s_wsn, s_wsk, ACT, GLU,
                      STORE_AUX, DACT, HAS_BIAS, UPCAST, INPUT_PRECISION, G_PAD, FP8, BLOCKWISE, EMULATE, PROMOTE_K,
                      TMA, W_KMAJOR, W_STACKED, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _grouped_tile(
    pid_m, pid_n, row_tiles, x_ptr, w_ptr, out_ptr, aux_ptr, offsets_ptr, bias_ptr, xs_ptr, ws_ptr, x_desc, w_desc,
    G, E_w, M, N, K,
    s_xm, s_xk, s_we, s_wn, s_wk, s_om, s_on, s_am, s_an, glu_offset, s_be, s_xsm, s_xsk, s_wse, s_wsn, s_wsk,
    ACT: tl.constexpr, GLU: tl.constexpr, STORE_AUX: tl.constexpr, DACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, G_PAD: tl.constexpr, FP8: tl.constexpr,
    BLOCKWISE: tl.constexpr, EMULATE: tl.constexpr, PROMOTE_K: tl.constexpr, TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr, W_STACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tile ``(pid_m, pid_n)`` of ``_grouped_gemm_kernel``'s ``row_tiles x cdiv(N, BLOCK_N)`` grid:
    a group's row block, a tail block of zeros, or nothing."""
    # This program's (group, row block) from the offsets: tiles_g = cdiv(count_g, BLOCK_M); the
    # group is the number of groups whose cumulative tile count is <= pid_m (G: past the last
    # group, a tail tile). Written with few reductions and no nested @triton.jit helpers: under
    # the interpreter each such call (tl.sum, tl.cdiv, tl.sigmoid ...) re-patches triton.language.
    gi = tl.arange(0, G_PAD)
    gm = gi < G
    starts = tl.load(offsets_ptr + gi, mask=gm, other=0).to(tl.int32)
    ends = tl.load(offsets_ptr + gi + 1, mask=gm, other=0).to(tl.int32)
    tiles = tl.where(gm, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, axis=0)
    group = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    # the gated up half's column offset, in int64: glu_offset * stride can pass 2^31 (tl.cast, not
    # .to: an argument equal to 1 arrives as a constexpr)
    glu_an = tl.cast(glu_offset, tl.int64) * s_an
    glu_on = tl.cast(glu_offset, tl.int64) * s_on
    if group < G:
        first_tile = tl.sum(tl.where(gi < group, tiles, 0), axis=0)
        row0 = tl.load(offsets_ptr + group).to(tl.int32) + (pid_m - first_tile) * BLOCK_M
        end = tl.load(offsets_ptr + group + 1).to(tl.int32)
        rm = row0 + tl.arange(0, BLOCK_M)
        m_mask = rm < end
        rm64 = rm.to(tl.int64)
        expert = (group % E_w).to(tl.int64)
        w_base = w_ptr + expert * s_we
        if FP8:  # the scales of x's rows and of the weight's rows (gate; up for a gated forward)
            xs_rows = xs_ptr + rm64 * s_xsm
            ws_rows = ws_ptr + expert * s_wse + (rn // (128 if BLOCKWISE else 1)).to(tl.int64) * s_wsn
            ws_up = ws_ptr + expert * s_wse + ((rn + glu_offset) // (128 if BLOCKWISE else 1)).to(tl.int64) * s_wsn
        else:
            xs_rows, ws_rows, ws_up = xs_ptr, ws_ptr, ws_ptr
        # TMA coordinates (int32, as the descriptors' extents): the expert's first weight row in
        # the stack, else the expert's index in the 3-D descriptor
        n_w = N if DACT else N + glu_offset
        w_row0 = (expert * n_w).to(tl.int32)
        acc, acc_up = gemm_mainloop(
            x_ptr, w_base, rm64 * s_xm, rn64 * s_wn, (rn64 + glu_offset) * s_wn, m_mask, n_mask, K,
            1, 0, s_xk, 1, 0, s_wk, False, False, GLU and not DACT, UPCAST, False, INPUT_PRECISION,
            BLOCK_M, BLOCK_N, BLOCK_K, x_desc, w_desc, row0, pid_n * BLOCK_N + (w_row0 if W_STACKED else 0),
            glu_offset, TMA, True, W_KMAJOR, xs_rows, ws_rows, ws_up, s_xsk, s_wsk,
            (2 if BLOCKWISE else 1) if FP8 else 0, PROMOTE_K, 0 if W_STACKED else expert.to(tl.int32),
            B_EXPERTS=not W_STACKED,
        )
        out_mask = m_mask[:, None] & n_mask[None, :]
        o_off = rm64[:, None] * s_om + rn64[None, :] * s_on
        if DACT:
            a_off = rm64[:, None] * s_am + rn64[None, :] * s_an
            pre = tl.load(aux_ptr + a_off, mask=out_mask, other=0.0).to(tl.float32)
            # act(pre) and act'(pre); gelu is the tanh form: x * sigmoid(c (x + 0.044715 x^3))
            if ACT == 1:
                a_val = tl.maximum(pre, 0.0)
                d_val = tl.where(pre > 0, 1.0, 0.0)
            elif ACT == 2:
                sg = 1.0 / (1.0 + tl.exp(-1.5957691216057308 * (pre + 0.044715 * pre * pre * pre)))
                a_val = pre * sg
                d_val = sg + pre * sg * (1.0 - sg) * 1.5957691216057308 * (1.0 + 0.134145 * pre * pre)
            elif ACT == 3:
                sg = 1.0 / (1.0 + tl.exp(-pre))
                a_val = pre * sg
                d_val = sg + pre * sg * (1.0 - sg)
            elif ACT == 4:
                # swiglu_oai's gate: g = min(pre, 7), g * sigmoid(1.702 g); no gradient above 7
                gc = tl.minimum(pre, 7.0)
                sg = 1.0 / (1.0 + tl.exp(-1.702 * gc))
                a_val = gc * sg
                d_val = tl.where(pre <= 7.0, sg + 1.702 * gc * sg * (1.0 - sg), 0.0)
            else:
                a_val = pre
                d_val = pre * 0.0 + 1.0
            if GLU:
                up = tl.load(aux_ptr + a_off + glu_an, mask=out_mask, other=0.0).to(tl.float32)
                if ACT == 4:
                    # up's factor clamp(up, -7, 7) + 1, whose gradient is zero outside the range
                    a_val = tl.where((up >= -7.0) & (up <= 7.0), a_val, 0.0)
                    up = tl.minimum(tl.maximum(up, -7.0), 7.0) + 1.0
                d_gate, d_up = acc * up * d_val, acc * a_val
                if EMULATE:
                    d_gate, d_up = rne_for_store(d_gate, out_ptr), rne_for_store(d_up, out_ptr)
                tl.store(out_ptr + o_off, d_gate.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(out_ptr + o_off + glu_on, d_up.to(out_ptr.dtype.element_ty), mask=out_mask)
            else:
                d_pre = rne_for_store(acc * d_val, out_ptr) if EMULATE else acc * d_val
                tl.store(out_ptr + o_off, d_pre.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            if HAS_BIAS:
                b_base = bias_ptr + expert * s_be
                acc += tl.load(b_base + rn64, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                if GLU:
                    acc_up += tl.load(b_base + rn64 + glu_offset, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if STORE_AUX:
                a_off = rm64[:, None] * s_am + rn64[None, :] * s_an
                pre = rne_for_store(acc, aux_ptr) if EMULATE else acc  # (interpreter: round as a GPU)
                tl.store(aux_ptr + a_off, pre.to(aux_ptr.dtype.element_ty), mask=out_mask)
                if GLU:
                    pre = rne_for_store(acc_up, aux_ptr) if EMULATE else acc_up
                    tl.store(aux_ptr + a_off + glu_an, pre.to(aux_ptr.dtype.element_ty), mask=out_mask)
            if ACT == 1:
                res = tl.maximum(acc, 0.0)
            elif ACT == 2:
                res = acc / (1.0 + tl.exp(-1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)))
            elif ACT == 3:
                res = acc / (1.0 + tl.exp(-acc))
            elif ACT == 4:
                res = tl.minimum(acc, 7.0)
                res = res / (1.0 + tl.exp(-1.702 * res))
            else:
                res = acc
            if GLU:
                if ACT == 4:
                    res = res * (tl.minimum(tl.maximum(acc_up, -7.0), 7.0) + 1.0)
                else:
                    res = res * acc_up
            res = rne_for_store(res, out_ptr) if EMULATE else res
            tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Tail rows after the last group get zeros, so nothing downstream reads unwritten memory.
        # Tail tiles are numbered from the end of the grid (no total tile count needed); the
        # programs between the group tiles and the tail tiles have nothing to do.
        tail0 = tl.load(offsets_ptr + G).to(tl.int32)
        t = row_tiles - 1 - pid_m
        if t * BLOCK_M < M - tail0:
            rm = tail0 + t * BLOCK_M + tl.arange(0, BLOCK_M)
            m_mask = rm < M
            rm64 = rm.to(tl.int64)
            out_mask = m_mask[:, None] & n_mask[None, :]
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            o_off = rm64[:, None] * s_om + rn64[None, :] * s_on
            tl.store(out_ptr + o_off, zero.to(out_ptr.dtype.element_ty), mask=out_mask)
            if GLU and DACT:
                tl.store(out_ptr + o_off + glu_on, zero.to(out_ptr.dtype.element_ty), mask=out_mask)
            if STORE_AUX:
                a_off = rm64[:, None] * s_am + rn64[None, :] * s_an
                tl.store(aux_ptr + a_off, zero.to(aux_ptr.dtype.element_ty), mask=out_mask)
                if GLU:
                    tl.store(aux_ptr + a_off + glu_an, zero.to(aux_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, offsets_ptr, ds_ptr, xs_ptr,
    G, E_w, N, K,
    s_dm, s_dn, s_xm, s_xk, s_we, s_wn, s_wk, s_dsn, s_dst, s_xsk, s_xst,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, FP8: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dw[e] (+)= sum over groups g with g % E_w == e of dy[rows_g]^T @ x[rows_g]; empty: zeros.
    ``FP8``: e4m3 operands quantised along the rows per group (``kernels/fp8.py``
    ``quantize_e4m3_groups``): a fresh dot per 128-row tile of a group, times the tile's scales."""
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs a contraction block >= 16")
    tl.static_assert(not FP8 or BLOCK_M == 128, "the fp8 scales cover 128-row tiles")
    e = tl.program_id(0)
    pid = tl.program_id(1)
    n_tiles_k = (K + BLOCK_K - 1) // BLOCK_K
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_mask = rk < K
    rn64 = rn.to(tl.int64)
    rk64 = rk.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for g in range(e, G, E_w):
        start = tl.load(offsets_ptr + g).to(tl.int32)
        end = tl.load(offsets_ptr + g + 1).to(tl.int32)
        for m0 in range(start, end, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            m_mask = rm < end
            if FP8:  # row r of group g at column c0 + r - start, zeros from its end to a multiple of 16
                c0 = 16 * (start // 16 + g)  # (kernels/fp8.py group_columns): 16-byte aligned, vectorised loads
                rm = tl.multiple_of(c0 + (m0 - start), 16) + tl.arange(0, BLOCK_M)
                m_mask = rm < tl.multiple_of(c0 + (end - start + 15) // 16 * 16, 16)
            rm64 = rm.to(tl.int64)
            dyt = tl.load(dy_ptr + rm64[None, :] * s_dm + rn64[:, None] * s_dn, mask=n_mask[:, None] & m_mask[None, :],
                          other=0.0)
            xv = tl.load(x_ptr + rm64[:, None] * s_xm + rk64[None, :] * s_xk, mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            if UPCAST:
                dyt = dyt.to(tl.float32)
                xv = xv.to(tl.float32)
            if FP8:  # the scale column of this 128-row tile (kernels/fp8.py group_tiles)
                t = tl.cast(start // 128 + g + (m0 - start) // 128, tl.int64)
                sd = tl.load(ds_ptr + rn64 * s_dsn + t * s_dst, mask=n_mask, other=0.0)
                acc += tl.dot(dyt, xv) * sd[:, None] * tl.load(xs_ptr + rk64 * s_xsk + t * s_xst, mask=k_mask,
                                                               other=0.0)[None, :]
            else:
                acc = tl.dot(dyt, xv, acc, input_precision=INPUT_PRECISION)
    out_mask = n_mask[:, None] & k_mask[None, :]
    w_off = e.to(tl.int64) * s_we + rn64[:, None] * s_wn + rk64[None, :] * s_wk
    if ACCUMULATE:
        acc += tl.load(dw_ptr + w_off, mask=out_mask, other=0.0).to(tl.float32)
    acc = rne_for_store(acc, dw_ptr) if EMULATE else acc
    tl.store(dw_ptr + w_off, acc.to(dw_ptr.dtype.element_ty), mask=out_mask)


@functools.lru_cache(maxsize=None)
def _tuned_gemm():
    return autotuned(_grouped_gemm_kernel, configs=gemm_gpu_configs(), key=TUNING_KEY, prune=prune_grouped)


@functools.lru_cache(maxsize=None)
def _tuned_wgrad():
    return autotuned(_grouped_wgrad_kernel, configs=wgrad_gpu_configs(), key=WGRAD_TUNING_KEY,
                     prune=prune_grouped_wgrad, restore_value=["dw_ptr"])


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
def _weight_strides(weight, layout):
    """(N, K, s_we, s_wn, s_wk) of a ``[E, N, K]`` ("nk") or ``[E, K, N]`` ("kn") weight."""
    check_choice("weight_layout", layout, _LAYOUTS)
    if layout == "nk":
        return weight.shape[1], weight.shape[2], weight.stride(0), weight.stride(1), weight.stride(2)
    return weight.shape[2], weight.shape[1], weight.stride(0), weight.stride(2), weight.stride(1)


def _gemm_operands(a_name, a, weight, layout, activation):
    """Common checks of the grouped GEMMs; returns (act code, gated, N, K, weight strides)."""
    for name, t, dims in ((a_name, a, (2,)), ("weight", weight, (3,))):  # 16/32-bit, or e4m3 with scales
        check_tensor(name, t, dims=dims, dtypes=OPERAND_DTYPES, kernel_device=True)
    check_same("weight", weight, a_name, a)
    check_choice("activation", activation, ACTIVATIONS)
    act, glu = ACTIVATIONS[activation]
    n_w, k_w, s_we, s_wn, s_wk = _weight_strides(weight, layout)
    M, K = a.shape
    if k_w != K:
        raise ValueError(f"inner dimensions differ: {a_name} has K={K} but weight ({layout}) has K={k_w} "
                         f"(shape {tuple(weight.shape)})")
    if M > MAX_ROWS:
        raise ValueError(f"{a_name} must have at most {MAX_ROWS} rows, got {M}")
    return act, glu, n_w, K, (s_we, s_wn, s_wk)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets, *, weight_layout: str = "nk",
                   activation: str = "none", preact_out: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   check_offsets: bool = True, bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                   weight_scale: torch.Tensor | None = None, scaling: str = "rowwise") -> torch.Tensor:
    """Grouped GEMM: ``out[rows_g] = act(x[rows_g] @ W_g + b_g)`` with ``rows_g = offsets[g] .. offsets[g+1]``
    and ``W_g = weight[g % E]`` (so groups laid out ``[source rank][expert]`` reuse the expert
    weights without a regrouping copy). fp32 accumulation; groups of any size, zero included;
    rows past ``offsets[-1]`` are written as zeros.

    x: ``[M, K]`` any strides; weight: ``[E, N, K]`` (``"nk"``, per-expert nn.Linear layout) or
    ``[E, K, N]`` (``"kn"``) any strides (a transposed view costs no copy); offsets ``[G+1]``
    (see :func:`as_group_offsets`; ``check_offsets=False`` trusts them).
    Gated activations (``swiglu``/``geglu``) take weights with ``2F`` output rows (gate then up)
    and produce ``F`` features; ``preact_out [M, 2F]`` (or ``[M, N]``) receives pre-activations.
    ``bias``: ``[E, N_w]`` (``b_g = bias[g % E]``, gate then up for gated activations), added
    before the activation (its gradient: :func:`~fusedpar.kernels.grouped_bias.grouped_bias_grad` of the
    pre-activation's).
    fp8: ``x``, ``weight`` e4m3 (K-contiguous on a GPU) with the fp32 scales of ``scaling``:
    "rowwise" ``x_scale [M]``, ``weight_scale [E, N_w]``; "blockwise" ``[M, ceil(K/128)]``,
    ``[E, ceil(N_w/128), ceil(K/128)]`` (:func:`~fusedpar.kernels.fp8_gemm.grouped_fp8_scales`);
    fp32 accumulation promoted every 128 K; ``out_dtype`` defaults to bf16.
    """
    act, glu, n_w, K, w_strides = _gemm_operands("x", x, weight, weight_layout, activation)
    fp8 = grouped_fp8_scales("x", x, x_scale, weight_scale, scaling, n_experts=weight.shape[0], n_w=n_w, K=K)
    check_out_dtype("out_dtype", out_dtype)
    if glu and n_w % 2:
        raise ValueError(f"activation {activation!r} needs an even number of weight output features, got {n_w}")
    M = x.shape[0]
    offsets = as_group_offsets(offsets, M, x.device, check=check_offsets)
    N = n_w // 2 if glu else n_w
    out = output_buffer("out", out, (M, N), x.device, out_dtype or (torch.bfloat16 if fp8 else x.dtype))
    if preact_out is not None:
        check_buffer("preact_out", preact_out, (M, n_w), x.device)
    if bias is not None:
        check_float_tensor("bias", bias, dims=(2,))
        check_same("bias", bias, "x", x, dtype=False)
        if tuple(bias.shape) != (weight.shape[0], n_w):
            raise ValueError(f"bias must have shape {(weight.shape[0], n_w)} ([experts, weight rows]), "
                             f"got {tuple(bias.shape)}")
        if bias.stride(1) != 1:
            bias = bias.contiguous()
    _launch_gemm(x, weight, out, preact_out, offsets, M=M, N=N, K=K, w_strides=w_strides, act=act, glu=glu,
                 dact=False, bias=bias, fp8=fp8)
    return out


def grouped_matmul_dact(grad: torch.Tensor, weight: torch.Tensor, offsets, preact: torch.Tensor, *,
                        weight_layout: str = "kn", activation: str = "swiglu", check_offsets: bool = True,
                        grad_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                        scaling: str = "rowwise") -> torch.Tensor:
    """Backward of ``act`` fused into a grouped GEMM: ``g = grad[rows_g] @ W_g`` is the gradient
    of the activation *output* (``[M, F]``); returns the gradient of the pre-activation
    (``[M, 2F]`` gated: ``(g * up * act'(gate), g * act(gate))``, else ``[M, F]``: ``g * act'(pre)``).
    With the default ``"kn"`` layout, ``weight`` is the forward ``[E, H, F]`` down-projection
    read transposed in place. fp8: e4m3 ``grad``, ``weight`` with ``grad_scale``, ``weight_scale`` as
    :func:`grouped_matmul`'s (weight rows: the ``F`` outputs); the result in ``preact``'s dtype."""
    act, glu, N, K, w_strides = _gemm_operands("grad", grad, weight, weight_layout, activation)
    fp8 = grouped_fp8_scales("grad", grad, grad_scale, weight_scale, scaling, n_experts=weight.shape[0], n_w=N, K=K)
    check_float_tensor("preact", preact, dims=(2,))
    check_same("preact", preact, "grad", grad, dtype=False)
    M = grad.shape[0]
    n_pre = 2 * N if glu else N
    if tuple(preact.shape) != (M, n_pre):
        raise ValueError(f"preact must have shape {(M, n_pre)}, got {tuple(preact.shape)}")
    offsets = as_group_offsets(offsets, M, grad.device, check=check_offsets)
    out = torch.empty((M, n_pre), device=grad.device, dtype=preact.dtype if fp8 else grad.dtype)
    _launch_gemm(grad, weight, out, preact, offsets, M=M, N=N, K=K, w_strides=w_strides, act=act, glu=glu,
                 dact=True, fp8=fp8)
    return out


def _row_tiles(M, G, block_m):
    """Worst-case row tiles of a grouped GEMM, known without reading the offsets: with ``c_g``
    rows per group (at most ``min(G, M)`` non-empty) and ``tail = M - sum c_g``,
    ``sum_g cdiv(c_g, BM) + cdiv(tail, BM) <= M / BM + min(G, M) + 1``."""
    return M // block_m + min(G, M) + 1


def _launch_gemm(x, weight, out, aux, offsets, *, M, N, K, w_strides, act, glu, dact, bias=None, fp8=None):
    if M == 0 or N == 0:
        return
    G = offsets.numel() - 1
    E_w = weight.shape[0]
    if K == 0 and bias is None:  # empty contraction: the product, every activation (and gradient) of it is zero
        out.zero_()
        if aux is not None and not dact:
            aux.zero_()
        return
    has_aux = aux is not None
    scales = fp8[:7] if fp8 else (out, out, 0, 0, 0, 0, 0)
    w_tma = _weight_tma(x, weight, w_strides, N if dact or not glu else 2 * N, K, N if glu and not dact else 0)
    if w_tma == "kn" and E_w == 1:  # one expert: its stride is never stepped, but a descriptor's must be aligned
        w_strides = (K * w_strides[2], *w_strides[1:])
    args = (x, weight, out, aux if has_aux else out, offsets, out if bias is None else bias, *scales[:2], G, E_w, M,
            N, K, x.stride(0), x.stride(1), *w_strides, out.stride(0), out.stride(1),
            aux.stride(0) if has_aux else 0, aux.stride(1) if has_aux else 0, N if glu else 0,
            0 if bias is None else bias.stride(0), *scales[2:])
    flags = dict(ACT=act, GLU=glu, STORE_AUX=has_aux and not dact, DACT=dact, HAS_BIAS=bias is not None,
                 UPCAST=needs_upcast(x.dtype), INPUT_PRECISION=input_precision(x.dtype),
                 G_PAD=max(2, next_power_of_2(G)), **grouped_fp8_flags(fp8, out, aux), TMA=w_tma is not None,
                 W_KMAJOR=w_tma != "kn", W_STACKED=w_tma is None or w_tma == "stack")

    def grid(meta):
        rows, cols = _row_tiles(M, G, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"])
        return (num_programs(rows * cols, x.device, True), 1) if w_tma is not None else (rows, cols)
    _launch(_grouped_gemm_kernel, _tuned_gemm, FP8_GROUPED_INTERPRETER_CONFIGS[0] if fp8 else INTERPRETER_GEMM_CONFIG,
            grid, args, flags, x.device)
    note_launch("grouped_matmul_dact" if dact else "grouped_matmul", None if interpreting() else _tuned_gemm(),
                FP8_GROUPED_INTERPRETER_CONFIGS[0] if fp8 else INTERPRETER_GEMM_CONFIG, w_tma is not None)


def _weight_tma(x, weight, w_strides, n_w, K, up_offset):
    """How a grouped launch loads ``x`` and the experts' weights (:mod:`.gemm_loads`): None where
    TMA cannot (pointer loads), else the weights' descriptor: ``"stack"`` (contiguous along K, the
    experts' rows one ``[E * n_w, K]`` stack), ``"nk"`` (contiguous along K, experts further apart:
    ``[E, n_w, K]``, e.g. a slice of each expert's rows) or ``"kn"`` (contiguous along n_w:
    ``[E, K, n_w]``, whose K edge stops each expert's steps). x contiguous along K; every base, row
    and expert stride a multiple of 16 bytes and at least its rows' or expert's extent (not an
    expanded view's 0, no overlapping rows or experts; one expert's stride is not read); e4m3
    weights contiguous along K; a gated forward's up half (``up_offset`` rows of the weight after
    its gate) at a 16-byte boundary (:func:`~.gemm_loads.up_half_aligned`); K > 0 (a descriptor
    of no columns: the pointer loads run the bias-only epilogue of an empty contraction)."""
    es, (s_we, s_wn, s_wk), E = x.element_size(), w_strides, weight.shape[0]
    if not (tma_capable(x.device, es) and K > 0 and x.stride(1) == 1 and x.stride(0) >= K
            and x.stride(0) * es % 16 == 0 and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and E * max(n_w, K) < 2 ** 31):
        return None
    if s_wk == 1 and s_wn >= K and s_wn * es % 16 == 0:
        if E == 1 or s_we == n_w * s_wn:
            return "stack"
        return "nk" if s_we >= n_w * s_wn and s_we * es % 16 == 0 else None
    if (s_wn == 1 and s_wk >= n_w and s_wk * es % 16 == 0 and es > 1 and up_half_aligned(False, up_offset, es)
            and (E == 1 or s_we >= K * s_wk and s_we * es % 16 == 0)):
        return "kn"
    return None


def _launch(kernel, tuned, interpreter_config, grid, args, flags, device) -> None:
    """One fixed small tile under the interpreter, the autotuned kernel on a GPU."""
    if interpreting():
        kernel[grid(interpreter_config)](*args, **flags, **interpreter_config)
    else:
        ensure_scratch_allocator()
        with on_device(device):
            launch_kernel(tuned(), grid, args, flags)


def _wgrad_operands(grad, x, num_experts, out, accumulate):
    for name, t in (("grad", grad), ("x", x)):
        check_tensor(name, t, dims=(2,), dtypes=OPERAND_DTYPES, kernel_device=True)
    check_same("x", x, "grad", grad)
    if x.shape[0] != grad.shape[0]:
        raise ValueError(f"grad and x must have the same rows, got {tuple(grad.shape)} and {tuple(x.shape)}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")


def grouped_wgrad(grad: torch.Tensor, x: torch.Tensor, offsets, num_experts: int, *,
                  out: torch.Tensor | None = None, accumulate: bool = False,
                  out_dtype: torch.dtype | None = None, check_offsets: bool = True,
                  grad_scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert weight gradient ``out[e] (+)= sum_{g % E == e} grad[rows_g]^T @ x[rows_g]``:
    ``[E, N, K]`` in the ``"nk"`` layout (zeros for experts without rows). grad ``[M, N]``,
    x ``[M, K]``, any strides. ``accumulate=True`` adds into ``out`` (sum in fp32).
    fp8: e4m3 ``grad``, ``x`` quantised along the rows per group of these offsets, in the layout of
    :func:`~fusedpar.kernels.fp8.quantize_e4m3_groups` (``q.t()``: each group from a 16-aligned row,
    zero to the next multiple of 16), with its ``grad_scale [N, T]``, ``x_scale [K, T]`` (128-row
    tiles); a fresh fp32-scaled dot per tile; ``out_dtype`` defaults to bf16."""
    _wgrad_operands(grad, x, num_experts, out, accumulate)
    check_out_dtype("out_dtype", out_dtype)
    M, N = grad.shape
    K = x.shape[1]
    if M > MAX_ROWS:
        raise ValueError(f"grad must have at most {MAX_ROWS} rows, got {M}")
    offsets = as_group_offsets(offsets, M, grad.device, check=check_offsets)
    G = offsets.numel() - 1
    fp8 = grouped_fp8_scales("grad", grad, grad_scale, x_scale, "blockwise", wgrad_of=(G, N, K))
    out = output_buffer("out", out, (num_experts, N, K), grad.device,
                        out_dtype or (torch.bfloat16 if fp8 else grad.dtype))
    if N == 0 or K == 0:
        return out
    scales = fp8[:6] if fp8 else (out, out, 0, 0, 0, 0)  # grad's [N, T], x's [K, T]
    args = (grad, x, out, offsets, *scales[:2], G, num_experts, N, K, grad.stride(0), grad.stride(1), x.stride(0),
            x.stride(1), out.stride(0), out.stride(1), out.stride(2), *scales[2:])
    flags = dict(ACCUMULATE=accumulate, UPCAST=needs_upcast(grad.dtype), INPUT_PRECISION=input_precision(grad.dtype),
                 FP8=fp8 is not None, EMULATE=interpreting() and fp8 is not None and out.dtype == torch.bfloat16)
    _launch(_grouped_wgrad_kernel, _tuned_wgrad, FP8_GROUPED_INTERPRETER_CONFIGS[1] if fp8 else INTERPRETER_WGRAD_CONFIG,
            lambda meta: (num_experts, cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"])), args, flags,
            grad.device)
    return out
