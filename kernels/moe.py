"""Mixture-of-experts kernels: routing metadata, permute / combine, grouped GEMM (fwd + bwd).

Layout. ``T`` tokens each pick ``k`` experts (``expert_ids [T, k]``); the flat index
``s = t * k + j`` of a (token, choice) pair is its *slot*. Routing metadata sorts the slots by a
group id (an expert, or a (chunk, expert) pair for the expert-parallel pipeline) with a stable
counting sort, so that each group's slots are contiguous and in token order:

* ``counts [G]``      kept slots per group (``min(count, capacity)``),
* ``offsets [G + 1]`` exclusive prefix sum of ``counts`` (int32),
* ``slot_pos [T*k]``  position of each slot in the permuted buffer, ``-1`` when dropped,
* ``sorted_slot [T*k]`` the inverse: the slot at each position, ``-1`` for the unused tail rows
  (positions ``offsets[G] ..``) left by dropped slots.

Everything is computed on the device from device tensors: no host synchronisation. The one
unavoidable sync of an MoE layer is outside this file: ``torch.distributed.all_to_all_single``
takes its split sizes as Python ints (fusedpar.ops.moe).

Grouped GEMM rows ``offsets[g] .. offsets[g+1]`` of ``x`` are multiplied by ``weight[g % E_w]``
(one base pointer plus per-group offsets, never a pointer array: DESIGN.md §3). Each program
derives its (group, row-block) tile from the offsets itself: it loads the ``G`` offsets, forms
``tiles_g = cdiv(count_g, BLOCK_M)`` and their cumulative sum, and finds its group by counting.
The grid is a worst-case bound, ``M // BLOCK_M + min(G, M) + 1`` row tiles (``_row_tiles``), so
launching needs no host sync and the schedule follows whatever ``BLOCK_M`` the autotuner picks.
The last programs of the grid write zeros into the tail rows ``offsets[G] .. M`` (capacity drops
leave such rows); the programs in between exit at once.

Layers: ``@triton.jit`` kernels -> launchers (validate, allocate, launch) below -> references
(plain fp64 torch, the tests' oracle) at the end of the file.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .checks import check_buffer, check_device_usable, check_supported_dtype
from .runtime import interpreting, needs_upcast, prune_tile_configs, shared_memory_limit
from .gemm import ACTIVATIONS, activation_reference

_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_ROWS = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _route_count_kernel(ids_ptr, n, counts_ptr, G, BLOCK: tl.constexpr, G_PAD: tl.constexpr):
    """counts[pid, g] = number of slots of block ``pid`` whose group id is ``g``."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
    g = tl.arange(0, G_PAD)
    onehot = (ids[:, None] == g[None, :]).to(tl.int32)
    cnt = tl.sum(onehot, axis=0)
    tl.store(counts_ptr + pid.to(tl.int64) * G + g, cnt, mask=g < G)


@triton.jit
def _route_scatter_kernel(ids_ptr, n, prefix_ptr, offsets_ptr, G, capacity, slot_pos_ptr, sorted_slot_ptr,
                          BLOCK: tl.constexpr, G_PAD: tl.constexpr):
    """Stable positions: rank of a slot inside its group = slots of that group in earlier blocks
    (``prefix``) + earlier slots of that group in this block (a cumulative sum of the one-hot)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < G)
    g = tl.arange(0, G_PAD)
    onehot = (ids[:, None] == g[None, :]).to(tl.int32)
    within = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    safe = tl.where(valid, ids, 0)
    rank = tl.load(prefix_ptr + pid.to(tl.int64) * G + safe, mask=valid, other=0) + within
    keep = valid & (rank < capacity)
    pos = tl.load(offsets_ptr + safe, mask=valid, other=0) + rank
    tl.store(slot_pos_ptr + offs, tl.where(keep, pos, -1).to(slot_pos_ptr.dtype.element_ty), mask=in_range)
    tl.store(sorted_slot_ptr + pos, offs.to(sorted_slot_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _permute_kernel(x_ptr, out_ptr, sorted_slot_ptr, n_rows, H, k, s_xt, s_xh, s_or, s_oh,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[p] = x[sorted_slot[p] // k], zero where ``sorted_slot[p] < 0`` (the unused tail)."""
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    r_mask = rows < n_rows
    h_mask = cols < H
    slot = tl.load(sorted_slot_ptr + rows, mask=r_mask, other=-1).to(tl.int64)
    tok = tl.where(slot >= 0, slot // k, 0)
    src = x_ptr + tok[:, None] * s_xt + cols.to(tl.int64)[None, :] * s_xh
    vals = tl.load(src, mask=(slot >= 0)[:, None] & h_mask[None, :], other=0.0)
    dst = out_ptr + rows.to(tl.int64)[:, None] * s_or + cols.to(tl.int64)[None, :] * s_oh
    tl.store(dst, vals.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, slot_pos_ptr, out_ptr, T, H, k, s_yr, s_yh, s_ot, s_oh,
                    HAS_WEIGHT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[slot_pos[t, j]] in fp32 (dropped slots, pos < 0, add nothing)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = toks < T
    h_mask = cols < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(0, k):
        slot = toks.to(tl.int64) * k + j
        pos = tl.load(slot_pos_ptr + slot, mask=t_mask, other=-1).to(tl.int64)
        ok = pos >= 0
        vals = tl.load(y_ptr + tl.where(ok, pos, 0)[:, None] * s_yr + cols.to(tl.int64)[None, :] * s_yh,
                       mask=ok[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            wv = tl.load(w_ptr + slot, mask=t_mask & ok, other=0.0).to(tl.float32)
            vals = vals * wv[:, None]
        acc += vals
    dst = out_ptr + toks.to(tl.int64)[:, None] * s_ot + cols.to(tl.int64)[None, :] * s_oh
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_bwd_kernel(go_ptr, y_ptr, w_ptr, sorted_slot_ptr, gy_ptr, gw_ptr, n_rows, H, k,
                        s_gt, s_gh, s_yr, s_yh, s_gyr, s_gyh,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Per permuted row p with slot s = sorted_slot[p], token t = s // k:
    grad_y[p] = w[s] * grad_out[t] (zero on the tail), grad_w[s] = <grad_out[t], y[p]> (fp32)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < n_rows
    slot = tl.load(sorted_slot_ptr + rows, mask=r_mask, other=-1).to(tl.int64)
    ok = slot >= 0
    tok = tl.where(ok, slot // k, 0)
    wv = tl.load(w_ptr + tl.where(ok, slot, 0), mask=ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    rows64 = rows.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        h_mask = cols < H
        cols64 = cols.to(tl.int64)
        g = tl.load(go_ptr + tok[:, None] * s_gt + cols64[None, :] * s_gh, mask=ok[:, None] & h_mask[None, :],
                    other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + rows64[:, None] * s_yr + cols64[None, :] * s_yh, mask=ok[:, None] & h_mask[None, :],
                     other=0.0).to(tl.float32)
        dot += tl.sum(g * yv, axis=1)
        tl.store(gy_ptr + rows64[:, None] * s_gyr + cols64[None, :] * s_gyh,
                 (g * wv[:, None]).to(gy_ptr.dtype.element_ty), mask=r_mask[:, None] & h_mask[None, :])
    tl.store(gw_ptr + tl.where(ok, slot, 0), dot, mask=ok)


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, aux_ptr, offsets_ptr,
    G, E_w, M, N, K,
    s_xm, s_xk, s_we, s_wn, s_wk, s_om, s_on, s_am, s_an, glu_offset,
    ACT: tl.constexpr, GLU: tl.constexpr, STORE_AUX: tl.constexpr, DACT: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows of group g times weight[g % E_w] ([N, K] through strides, so a transposed view of the
    same tensor needs no copy). Epilogues: forward ``act`` (gated: act(gate) * up, pre-activation
    to ``aux``), or backward ``DACT``: the product is the gradient of the activation output and
    ``aux`` holds the pre-activation; writes the gradient of the pre-activation."""
    tl.static_assert(BLOCK_K >= 16, "tl.dot needs BLOCK_K >= 16")
    tl.static_assert(not (DACT and STORE_AUX), "the backward epilogue reads aux, it does not store it")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    if group < G:
        first_tile = tl.sum(tl.where(gi < group, tiles, 0), axis=0)
        row0 = tl.load(offsets_ptr + group).to(tl.int32) + (pid_m - first_tile) * BLOCK_M
        end = tl.load(offsets_ptr + group + 1).to(tl.int32)
        rm = row0 + tl.arange(0, BLOCK_M)
        m_mask = rm < end
        rm64 = rm.to(tl.int64)
        expert = (group % E_w).to(tl.int64)
        w_base = w_ptr + expert * s_we
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GLU:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            kk = k0 * BLOCK_K + rk
            k_mask = kk < K
            kk64 = kk.to(tl.int64)
            a = tl.load(x_ptr + rm64[:, None] * s_xm + kk64[None, :] * s_xk, mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            b = tl.load(w_base + kk64[:, None] * s_wk + rn64[None, :] * s_wn, mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if GLU and not DACT:
                bu = tl.load(w_base + kk64[:, None] * s_wk + (rn64 + glu_offset)[None, :] * s_wn,
                             mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if UPCAST:
                    bu = bu.to(tl.float32)
                acc_up = tl.dot(a, bu, acc_up, input_precision=INPUT_PRECISION)
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
            else:
                a_val = pre
                d_val = pre * 0.0 + 1.0
            if GLU:
                up = tl.load(aux_ptr + a_off + glu_offset * s_an, mask=out_mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + o_off, (acc * up * d_val).to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(out_ptr + o_off + glu_offset * s_on, (acc * a_val).to(out_ptr.dtype.element_ty),
                         mask=out_mask)
            else:
                tl.store(out_ptr + o_off, (acc * d_val).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            if STORE_AUX:
                a_off = rm64[:, None] * s_am + rn64[None, :] * s_an
                tl.store(aux_ptr + a_off, acc.to(aux_ptr.dtype.element_ty), mask=out_mask)
                if GLU:
                    tl.store(aux_ptr + a_off + glu_offset * s_an, acc_up.to(aux_ptr.dtype.element_ty), mask=out_mask)
            if ACT == 1:
                res = tl.maximum(acc, 0.0)
            elif ACT == 2:
                res = acc / (1.0 + tl.exp(-1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)))
            elif ACT == 3:
                res = acc / (1.0 + tl.exp(-acc))
            else:
                res = acc
            if GLU:
                res = res * acc_up
            tl.store(out_ptr + o_off, res.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Tail rows after the last group get zeros, so nothing downstream reads unwritten memory.
        # Tail tiles are numbered from the end of the grid (no total tile count needed); the
        # programs between the group tiles and the tail tiles have nothing to do.
        tail0 = tl.load(offsets_ptr + G).to(tl.int32)
        t = tl.num_programs(0) - 1 - pid_m
        if t * BLOCK_M < M - tail0:
            rm = tail0 + t * BLOCK_M + tl.arange(0, BLOCK_M)
            m_mask = rm < M
            rm64 = rm.to(tl.int64)
            out_mask = m_mask[:, None] & n_mask[None, :]
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            o_off = rm64[:, None] * s_om + rn64[None, :] * s_on
            tl.store(out_ptr + o_off, zero.to(out_ptr.dtype.element_ty), mask=out_mask)
            if GLU and DACT:
                tl.store(out_ptr + o_off + glu_offset * s_on, zero.to(out_ptr.dtype.element_ty), mask=out_mask)
            if STORE_AUX:
                a_off = rm64[:, None] * s_am + rn64[None, :] * s_an
                tl.store(aux_ptr + a_off, zero.to(aux_ptr.dtype.element_ty), mask=out_mask)
                if GLU:
                    tl.store(aux_ptr + a_off + glu_offset * s_an, zero.to(aux_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, offsets_ptr,
    G, E_w, N, K,
    s_dm, s_dn, s_xm, s_xk, s_we, s_wn, s_wk,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dw[e] (+)= sum over groups g with g % E_w == e of dy[rows_g]^T @ x[rows_g]; empty: zeros."""
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs a contraction block >= 16")
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
            rm64 = rm.to(tl.int64)
            dyt = tl.load(dy_ptr + rm64[None, :] * s_dm + rn64[:, None] * s_dn, mask=n_mask[:, None] & m_mask[None, :],
                          other=0.0)
            xv = tl.load(x_ptr + rm64[:, None] * s_xm + rk64[None, :] * s_xk, mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            if UPCAST:
                dyt = dyt.to(tl.float32)
                xv = xv.to(tl.float32)
            acc = tl.dot(dyt, xv, acc, input_precision=INPUT_PRECISION)
    out_mask = n_mask[:, None] & k_mask[None, :]
    w_off = e.to(tl.int64) * s_we + rn64[:, None] * s_wn + rk64[None, :] * s_wk
    if ACCUMULATE:
        acc += tl.load(dw_ptr + w_off, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(dw_ptr + w_off, acc.to(dw_ptr.dtype.element_ty), mask=out_mask)


# --------------------------------------------------------------------------------------------
# configurations
# --------------------------------------------------------------------------------------------
INTERPRETER_GEMM_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
INTERPRETER_WGRAD_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)


def _gemm_gpu_configs():
    out = []
    for bm, bn, bk, stages, warps in [
        (128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
        (64, 64, 64, 4, 4), (64, 256, 32, 4, 4), (32, 64, 64, 5, 2), (16, 64, 64, 4, 4),
    ]:
        out.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=stages, num_warps=warps))
    return out


def _wgrad_gpu_configs():
    out = []
    for bm, bn, bk, stages, warps in [
        (64, 128, 128, 3, 8), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4),
    ]:
        out.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=stages, num_warps=warps))
    return out


def _prune(configs, named_args, **kwargs):
    x = named_args.get("x_ptr", named_args.get("dy_ptr"))
    glu = kwargs.get("GLU", named_args.get("GLU", False))
    return prune_tile_configs(
        configs, elem_size=x.element_size(), b_tiles=2 if glu else 1,
        smem_limit=shared_memory_limit(x.device.index or 0),
        dims={"BLOCK_N": named_args["N"], "BLOCK_K": named_args["K"]},
    )


@functools.lru_cache(maxsize=None)
def _tuned_gemm():
    return triton.autotune(
        configs=_gemm_gpu_configs(), key=["N", "K", "G", "ACT", "GLU", "DACT"],
        prune_configs_by={"early_config_prune": _prune},
    )(_grouped_gemm_kernel)


@functools.lru_cache(maxsize=None)
def _tuned_wgrad():
    return triton.autotune(
        configs=_wgrad_gpu_configs(), key=["N", "K", "G", "ACCUMULATE"],
        prune_configs_by={"early_config_prune": _prune}, restore_value=["dw_ptr"],
    )(_grouped_wgrad_kernel)


def _input_precision(dtype):
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


# --------------------------------------------------------------------------------------------
# host-side validation helpers
# --------------------------------------------------------------------------------------------
def _check_tensor(name, t, dims, *, float_dtype=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)} ({t.dim()}-D)")
    if float_dtype:
        check_supported_dtype(name, t)
    elif t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {t.dtype}")
    check_device_usable(name, t)


def _check_device(name, t, ref_name, ref):
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def _block_for_groups(G_PAD):
    """Slots per routing program: the one-hot tile is BLOCK x G_PAD, keep it <= 16K elements."""
    if interpreting():
        return 64
    return max(16, min(1024, 16384 // G_PAD))


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
def routing_metadata(group_ids: torch.Tensor, num_groups: int, *, capacity: int | None = None):
    """Stable counting sort of slots by group, on the device (no host sync).

    group_ids: ``[T, k]`` (or any shape; flattened in slot order) int32/int64 group of each slot;
    negative ids mean "not routed" (dropped before the sort). capacity: keep at most this many
    slots per group, the first ones in slot (= token) order; the rest are dropped.

    Returns ``(counts [G] int32, offsets [G+1] int32, slot_pos [n] int32, sorted_slot [n] int32)``
    with ``n = group_ids.numel()`` (see the module docstring).
    """
    _check_tensor("group_ids", group_ids, dims=tuple(range(1, 9)), float_dtype=False)
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    n = group_ids.numel()
    if n > _MAX_ROWS:
        raise ValueError(f"group_ids has {n} slots; at most {_MAX_ROWS} are supported (int32 positions)")
    dev = group_ids.device
    ids = group_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    G = num_groups
    G_PAD = max(2, triton.next_power_of_2(G))
    BLOCK = _block_for_groups(G_PAD)
    nb = max(1, triton.cdiv(n, BLOCK))
    block_counts = torch.empty((nb, G), device=dev, dtype=torch.int32)
    slot_pos = torch.empty((n,), device=dev, dtype=torch.int32)
    sorted_slot = torch.full((n,), -1, device=dev, dtype=torch.int32)
    if n == 0:
        counts = torch.zeros((G,), device=dev, dtype=torch.int32)
        return counts, torch.zeros((G + 1,), device=dev, dtype=torch.int32), slot_pos, sorted_slot
    _route_count_kernel[(nb,)](ids, n, block_counts, G, BLOCK=BLOCK, G_PAD=G_PAD)
    # the scan over blocks is a device cumsum (no sync): slots of each group in earlier blocks
    incl = torch.cumsum(block_counts, dim=0, dtype=torch.int32)
    prefix = incl - block_counts
    counts = incl[-1]
    cap = n if capacity is None else capacity
    if capacity is not None:
        counts = counts.clamp(max=capacity)
    offsets = torch.zeros((G + 1,), device=dev, dtype=torch.int32)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    _route_scatter_kernel[(nb,)](ids, n, prefix, offsets, G, cap, slot_pos, sorted_slot, BLOCK=BLOCK, G_PAD=G_PAD)
    return counts.to(torch.int32), offsets, slot_pos, sorted_slot


def _check_index(name, t, n, ref):
    _check_tensor(name, t, dims=(1,), float_dtype=False)
    if t.numel() != n:
        raise ValueError(f"{name} must have {n} elements, got {t.numel()}")
    _check_device(name, t, "x", ref)
    return t if t.is_contiguous() else t.contiguous()


def permute(x: torch.Tensor, sorted_slot: torch.Tensor, top_k: int, *, out: torch.Tensor | None = None):
    """``out[p] = x[sorted_slot[p] // top_k]``: every token repeated once per routed slot, in
    group-contiguous order; rows with ``sorted_slot < 0`` (dropped tail) are zero.
    x: ``[T, H]``; sorted_slot: ``[T * top_k]``; returns ``[T * top_k, H]``."""
    _check_tensor("x", x, dims=(2,))
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    T, H = x.shape
    n = T * top_k
    sorted_slot = _check_index("sorted_slot", sorted_slot, n, x)
    if out is None:
        out = torch.empty((n, H), device=x.device, dtype=x.dtype)
    else:
        check_buffer("out", out, (n, H), x.device)
    if n == 0 or H == 0:
        return out
    BR, BH = (16, 32) if interpreting() else (32, min(256, triton.next_power_of_2(H)))
    grid = (triton.cdiv(n, BR), triton.cdiv(H, BH))
    _permute_kernel[grid](x, out, sorted_slot, n, H, top_k, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                          BLOCK_R=BR, BLOCK_H=BH)
    return out


def combine(y: torch.Tensor, slot_pos: torch.Tensor, weights: torch.Tensor | None, top_k: int, *,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """``out[t] = sum_j weights[t, j] * y[slot_pos[t * top_k + j]]`` (fp32 sum; slots with
    ``slot_pos < 0`` contribute zero; ``weights=None`` means 1, the backward of :func:`permute`).
    y: ``[R, H]`` permuted rows; slot_pos: ``[T * top_k]``; weights ``[T, top_k]``; returns ``[T, H]``."""
    _check_tensor("y", y, dims=(2,))
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if slot_pos.numel() % top_k:
        raise ValueError(f"slot_pos must have T * top_k elements (top_k={top_k}), got {slot_pos.numel()}")
    T = slot_pos.numel() // top_k
    slot_pos = _check_index("slot_pos", slot_pos, T * top_k, y)
    H = y.shape[1]
    if weights is not None:
        _check_tensor("weights", weights, dims=(1, 2))
        if weights.numel() != T * top_k:
            raise ValueError(f"weights must have shape ({T}, {top_k}), got {tuple(weights.shape)}")
        _check_device("weights", weights, "y", y)
        weights = weights.reshape(-1).contiguous()
    if out is None:
        out = torch.empty((T, H), device=y.device, dtype=out_dtype or y.dtype)
    else:
        check_buffer("out", out, (T, H), y.device)
    if T == 0 or H == 0:
        return out
    BT, BH = (16, 32) if interpreting() else (16, min(256, triton.next_power_of_2(H)))
    grid = (triton.cdiv(T, BT), triton.cdiv(H, BH))
    _combine_kernel[grid](y, weights if weights is not None else y, slot_pos, out, T, H, top_k,
                          y.stride(0), y.stride(1), out.stride(0), out.stride(1),
                          HAS_WEIGHT=weights is not None, BLOCK_T=BT, BLOCK_H=BH)
    return out


def combine_backward(grad_out: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, sorted_slot: torch.Tensor,
                     top_k: int):
    """Gradients of :func:`combine`: ``(grad_y [R, H], grad_weights [T, top_k] fp32)``.
    ``grad_y`` rows with ``sorted_slot < 0`` are zero; dropped slots get ``grad_weights == 0``."""
    _check_tensor("grad_out", grad_out, dims=(2,))
    _check_tensor("y", y, dims=(2,))
    T, H = grad_out.shape
    if y.shape[1] != H:
        raise ValueError(f"y must have {H} columns like grad_out, got shape {tuple(y.shape)}")
    R = y.shape[0]
    sorted_slot = _check_index("sorted_slot", sorted_slot, R, y)
    if weights.numel() != T * top_k:
        raise ValueError(f"weights must have shape ({T}, {top_k}), got {tuple(weights.shape)}")
    weights = weights.reshape(-1).contiguous()
    grad_y = torch.empty((R, H), device=y.device, dtype=y.dtype)
    grad_w = torch.zeros((T * top_k,), device=y.device, dtype=torch.float32)
    if R == 0:
        return grad_y, grad_w.view(T, top_k)
    BR, BH = (16, 32) if interpreting() else (32, min(128, triton.next_power_of_2(max(H, 1))))
    _combine_bwd_kernel[(triton.cdiv(R, BR),)](
        grad_out, y, weights, sorted_slot, grad_y, grad_w, R, H, top_k,
        grad_out.stride(0), grad_out.stride(1), y.stride(0), y.stride(1), grad_y.stride(0), grad_y.stride(1),
        BLOCK_R=BR, BLOCK_H=BH)
    return grad_y, grad_w.view(T, top_k)


def _as_offsets(offsets, x):
    """Offsets as a device int tensor. A Python sequence or a CPU tensor is validated (cheap, no
    device sync); a CUDA tensor is trusted: non-decreasing, offsets[0] == 0, offsets[-1] <= M."""
    M = x.shape[0]
    if not isinstance(offsets, torch.Tensor):
        try:
            offsets = torch.tensor([int(v) for v in offsets], dtype=torch.int32)
        except (TypeError, ValueError):
            raise TypeError(f"offsets must be an int tensor or a sequence of ints, got {offsets!r}") from None
    if offsets.dtype not in _INDEX_DTYPES:
        raise TypeError(f"offsets must have dtype torch.int32 or torch.int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(f"offsets must be 1-D with G + 1 >= 2 entries, got shape {tuple(offsets.shape)}")
    if offsets.device.type == "cpu":
        o = offsets.tolist()
        if o[0] != 0 or any(b < a for a, b in zip(o, o[1:])) or o[-1] > M:
            raise ValueError(f"offsets must start at 0, be non-decreasing and end at most at M={M}, got {o}")
    return offsets.to(device=x.device).contiguous()


_LAYOUTS = ("nk", "kn")


def _weight_strides(weight, layout):
    if layout == "nk":
        return weight.shape[1], weight.shape[2], weight.stride(0), weight.stride(1), weight.stride(2)
    return weight.shape[2], weight.shape[1], weight.stride(0), weight.stride(2), weight.stride(1)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets, *, weight_layout: str = "nk",
                   activation: str = "none", preact_out: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Grouped GEMM: ``out[rows_g] = act(x[rows_g] @ W_g)`` with ``rows_g = offsets[g] .. offsets[g+1]``
    and ``W_g = weight[g % E]`` (so groups laid out ``[source rank][expert]`` reuse the expert
    weights without a regrouping copy). fp32 accumulation; groups of any size, zero included;
    rows past ``offsets[-1]`` are written as zeros.

    x: ``[M, K]`` any strides; weight: ``[E, N, K]`` (``"nk"``, per-expert nn.Linear layout) or
    ``[E, K, N]`` (``"kn"``) any strides (a transposed view costs no copy); offsets ``[G+1]``.
    Gated activations (``swiglu``/``geglu``) take weights with ``2F`` output rows (gate then up)
    and produce ``F`` features; ``preact_out [M, 2F]`` (or ``[M, N]``) receives pre-activations.
    """
    _check_tensor("x", x, dims=(2,))
    _check_tensor("weight", weight, dims=(3,))
    _check_device("weight", weight, "x", x)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have the same dtype as x ({x.dtype}), got {weight.dtype}")
    if weight_layout not in _LAYOUTS:
        raise ValueError(f"weight_layout must be 'nk' ([E, N, K]) or 'kn' ([E, K, N]), got {weight_layout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    act, glu = ACTIVATIONS[activation]
    n_w, k_w, s_we, s_wn, s_wk = _weight_strides(weight, weight_layout)
    M, K = x.shape
    if k_w != K:
        raise ValueError(f"inner dimensions differ: x has K={K} but weight ({weight_layout}) has K={k_w} "
                         f"(shape {tuple(weight.shape)})")
    if glu and n_w % 2:
        raise ValueError(f"activation {activation!r} needs an even number of weight output features, got {n_w}")
    if M > _MAX_ROWS:
        raise ValueError(f"x has {M} rows; at most {_MAX_ROWS} are supported")
    offsets = _as_offsets(offsets, x)
    N = n_w // 2 if glu else n_w
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=out_dtype or x.dtype)
    else:
        check_buffer("out", out, (M, N), x.device)
    if preact_out is not None:
        check_buffer("preact_out", preact_out, (M, n_w), x.device)
    _launch_gemm(x, weight, out, preact_out, offsets, M=M, N=N, K=K, s_we=s_we, s_wn=s_wn, s_wk=s_wk, act=act,
                 glu=glu, dact=False)
    return out


def grouped_matmul_dact(grad: torch.Tensor, weight: torch.Tensor, offsets, preact: torch.Tensor, *,
                        weight_layout: str = "kn", activation: str = "swiglu") -> torch.Tensor:
    """Backward of ``act`` fused into a grouped GEMM: ``g = grad[rows_g] @ W_g`` is the gradient
    of the activation *output* (``[M, F]``); returns the gradient of the pre-activation
    (``[M, 2F]`` gated: ``(g * up * act'(gate), g * act(gate))``, else ``[M, F]``: ``g * act'(pre)``).
    With the default ``"kn"`` layout, ``weight`` is the forward ``[E, H, F]`` down-projection
    read transposed in place."""
    _check_tensor("grad", grad, dims=(2,))
    _check_tensor("weight", weight, dims=(3,))
    _check_tensor("preact", preact, dims=(2,))
    _check_device("weight", weight, "grad", grad)
    _check_device("preact", preact, "grad", grad)
    if weight.dtype != grad.dtype:
        raise TypeError(f"weight must have the same dtype as grad ({grad.dtype}), got {weight.dtype}")
    if weight_layout not in _LAYOUTS:
        raise ValueError(f"weight_layout must be 'nk' or 'kn', got {weight_layout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    act, glu = ACTIVATIONS[activation]
    N, k_w, s_we, s_wn, s_wk = _weight_strides(weight, weight_layout)
    M, K = grad.shape
    if k_w != K:
        raise ValueError(f"inner dimensions differ: grad has K={K} but weight ({weight_layout}) has K={k_w}")
    n_pre = 2 * N if glu else N
    if tuple(preact.shape) != (M, n_pre):
        raise ValueError(f"preact must have shape {(M, n_pre)}, got {tuple(preact.shape)}")
    offsets = _as_offsets(offsets, grad)
    out = torch.empty((M, n_pre), device=grad.device, dtype=grad.dtype)
    _launch_gemm(grad, weight, out, preact, offsets, M=M, N=N, K=K, s_we=s_we, s_wn=s_wn, s_wk=s_wk, act=act,
                 glu=glu, dact=True)
    return out


def _row_tiles(M, G, block_m):
    """Worst-case row tiles of a grouped GEMM, known without reading the offsets: with ``c_g``
    rows per group (at most ``min(G, M)`` non-empty) and ``tail = M - sum c_g``,
    ``sum_g cdiv(c_g, BM) + cdiv(tail, BM) <= M / BM + min(G, M) + 1``."""
    return M // block_m + min(G, M) + 1


def _launch_gemm(x, weight, out, aux, offsets, *, M, N, K, s_we, s_wn, s_wk, act, glu, dact):
    if M == 0 or N == 0:
        return
    G = offsets.numel() - 1
    E_w = weight.shape[0]
    if K == 0:  # empty contraction: the product, and every activation (and gradient) of it, is zero
        out.zero_()
        if aux is not None and not dact:
            aux.zero_()
        return
    has_aux = aux is not None
    args = (x, weight, out, aux if has_aux else out, offsets, G, E_w, M, N, K,
            x.stride(0), x.stride(1), s_we, s_wn, s_wk, out.stride(0), out.stride(1),
            aux.stride(0) if has_aux else 0, aux.stride(1) if has_aux else 0, N if glu else 0)
    flags = dict(ACT=act, GLU=glu, STORE_AUX=has_aux and not dact, DACT=dact, UPCAST=needs_upcast(x.dtype),
                 INPUT_PRECISION=_input_precision(x.dtype), G_PAD=max(2, triton.next_power_of_2(G)))
    if interpreting():
        cfg = INTERPRETER_GEMM_CONFIG
        grid = (_row_tiles(M, G, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
        _grouped_gemm_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (_row_tiles(M, G, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
        with torch.cuda.device(x.device):
            _tuned_gemm()[grid](*args, **flags)


def grouped_wgrad(grad: torch.Tensor, x: torch.Tensor, offsets, num_experts: int, *,
                  out: torch.Tensor | None = None, accumulate: bool = False,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-expert weight gradient ``out[e] (+)= sum_{g % E == e} grad[rows_g]^T @ x[rows_g]``:
    ``[E, N, K]`` in the ``"nk"`` layout (zeros for experts without rows). grad ``[M, N]``,
    x ``[M, K]``, any strides. ``accumulate=True`` adds into ``out`` (sum in fp32)."""
    _check_tensor("grad", grad, dims=(2,))
    _check_tensor("x", x, dims=(2,))
    _check_device("x", x, "grad", grad)
    if x.dtype != grad.dtype:
        raise TypeError(f"x must have the same dtype as grad ({grad.dtype}), got {x.dtype}")
    if x.shape[0] != grad.shape[0]:
        raise ValueError(f"grad and x must have the same rows, got {tuple(grad.shape)} and {tuple(x.shape)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    M, N = grad.shape
    K = x.shape[1]
    offsets = _as_offsets(offsets, grad)
    G = offsets.numel() - 1
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")
    if out is None:
        out = torch.empty((num_experts, N, K), device=grad.device, dtype=out_dtype or grad.dtype)
    else:
        check_buffer("out", out, (num_experts, N, K), grad.device)
    if N == 0 or K == 0:
        return out
    args = (grad, x, out, offsets, G, num_experts, N, K, grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
            out.stride(0), out.stride(1), out.stride(2))
    flags = dict(ACCUMULATE=accumulate, UPCAST=needs_upcast(grad.dtype), INPUT_PRECISION=_input_precision(grad.dtype))
    if interpreting():
        cfg = INTERPRETER_WGRAD_CONFIG
        grid = (num_experts, triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(K, cfg["BLOCK_K"]))
        _grouped_wgrad_kernel[grid](*args, **flags, **cfg)
    else:
        def grid(meta):
            return (num_experts, triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(K, meta["BLOCK_K"]))

        with torch.cuda.device(grad.device):
            _tuned_wgrad()[grid](*args, **flags)
    return out


# --------------------------------------------------------------------------------------------
# references (plain torch; the tests' oracle)
# --------------------------------------------------------------------------------------------
def routing_metadata_reference(group_ids: torch.Tensor, num_groups: int, capacity: int | None = None):
    """Python loop version of :func:`routing_metadata` (CPU, int64)."""
    ids = group_ids.reshape(-1).tolist()
    seen = [0] * num_groups
    kept = []
    for s, g in enumerate(ids):
        if 0 <= g < num_groups:
            if capacity is None or seen[g] < capacity:
                kept.append((g, seen[g], s))
            seen[g] += 1
    counts = [0] * num_groups
    for g, _, _ in kept:
        counts[g] += 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    slot_pos = [-1] * len(ids)
    sorted_slot = [-1] * len(ids)
    for g, r, s in kept:
        slot_pos[s] = offsets[g] + r
        sorted_slot[offsets[g] + r] = s
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_t(counts), as_t(offsets), as_t(slot_pos), as_t(sorted_slot)


def grouped_matmul_reference(x, weight, offsets: Sequence[int], *, weight_layout="nk", activation="none",
                             compute_dtype=torch.float64):
    """Per-group loop: ``act(x[rows_g] @ W_{g % E})``; rows past the last group are zero."""
    offsets = [int(v) for v in offsets]
    E = weight.shape[0]
    w = weight.to(compute_dtype)
    if weight_layout == "nk":
        w = w.transpose(1, 2)
    _, glu = ACTIVATIONS[activation]
    n = w.shape[2] // 2 if glu else w.shape[2]
    out = torch.zeros((x.shape[0], n), dtype=compute_dtype)
    xs = x.to(compute_dtype).cpu()
    w = w.cpu()
    for g in range(len(offsets) - 1):
        a, b = offsets[g], offsets[g + 1]
        if b > a:
            out[a:b] = activation_reference(xs[a:b] @ w[g % E], activation)
    return out


def moe_mlp_reference(x, expert_ids, weights, w1, w2, *, activation="swiglu", capacity=None,
                      compute_dtype=torch.float64):
    """A plain per-expert loop: ``sum_j weights[t, j] * mlp_{e}(x[t])`` over the kept slots
    (slots of an expert beyond ``capacity``, in token order, are dropped)."""
    T, k = expert_ids.shape
    E = w1.shape[0]
    xs = x.to(compute_dtype).cpu()
    out = torch.zeros((T, x.shape[1]), dtype=compute_dtype)
    seen = [0] * E
    ids = expert_ids.cpu().tolist()
    wts = weights.to(compute_dtype).cpu()
    w1c, w2c = w1.to(compute_dtype).cpu(), w2.to(compute_dtype).cpu()
    for t in range(T):
        for j in range(k):
            e = ids[t][j]
            keep = capacity is None or seen[e] < capacity
            seen[e] += 1
            if keep:
                h = activation_reference(xs[t] @ w1c[e].t(), activation)
                out[t] += wts[t, j] * (h @ w2c[e].t())
    return out
