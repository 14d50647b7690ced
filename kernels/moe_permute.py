"""Mixture-of-experts token movement: permute tokens into group-contiguous order, combine the
expert outputs back per token (weighted, fp32 sum), and the backward of the combine.

The routing metadata (``slot_pos`` / ``sorted_slot``) comes from
:func:`fusedpar.kernels.moe_routing.routing_metadata`; a slot ``s = t * k + j`` is token ``t``'s
``j``-th choice. Rows of the permuted buffer whose ``sorted_slot`` is negative (the tail left by
dropped slots) are zero; slots whose ``slot_pos`` is negative (dropped) contribute nothing.

Index data. ``slot_pos`` / ``sorted_slot`` address memory (rows of ``x``, ``y``, ``weights`` and
of the outputs). Made by :func:`routing_metadata` they always lie in ``[-1, n)`` (``n``: the
slots, or the rows of ``y`` for ``slot_pos``). The kernels do not trust that: a value outside
the range is masked like ``-1`` (a zero row, a slot that adds nothing; nothing is read or
written out of bounds) and, compiled with ``TRITON_DEBUG=1``, fails a ``tl.device_assert``.
Checking them on the host would cost a sync per call, for values that are valid by construction.

Layers: ``@triton.jit`` kernels -> launchers (validate, allocate, launch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INDEX_DTYPES, check_float_tensor, check_index_tensor, check_same, check_tensor, output_buffer
from .launch import launch_kernel
from .moe_routing import MAX_ROWS
from .runtime import SUPPORTED_DTYPES, cdiv, interpreting, next_power_of_2


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _permute_kernel(x_ptr, out_ptr, sorted_slot_ptr, n_rows, H, k, s_xt, s_xh, s_or, s_oh,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[p] = x[sorted_slot[p] // k], zero where ``sorted_slot[p] < 0`` (the unused tail) or
    ``>= n_rows`` (out of range: masked, asserted under ``TRITON_DEBUG``)."""
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    r_mask = rows < n_rows
    h_mask = cols < H
    slot = tl.load(sorted_slot_ptr + rows, mask=r_mask, other=-1).to(tl.int64)
    tl.device_assert((slot >= -1) & (slot < n_rows), "permute: sorted_slot outside [-1, T * top_k)")
    ok = (slot >= 0) & (slot < n_rows)
    tok = tl.where(ok, slot // k, 0)
    src = x_ptr + tok[:, None] * s_xt + cols.to(tl.int64)[None, :] * s_xh
    vals = tl.load(src, mask=ok[:, None] & h_mask[None, :], other=0)
    dst = out_ptr + rows.to(tl.int64)[:, None] * s_or + cols.to(tl.int64)[None, :] * s_oh
    tl.store(dst, vals.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, slot_pos_ptr, out_ptr, T, R, H, k, s_yr, s_yh, s_ot, s_oh,
                    HAS_WEIGHT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[slot_pos[t, j]] in fp32 (dropped slots, pos < 0, add nothing;
    so does a pos >= R, the rows of y: out of range, masked, asserted under ``TRITON_DEBUG``)."""
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
        tl.device_assert((pos >= -1) & (pos < R), "combine: slot_pos outside [-1, rows of y)")
        ok = (pos >= 0) & (pos < R)
        vals = tl.load(y_ptr + tl.where(ok, pos, 0)[:, None] * s_yr + cols.to(tl.int64)[None, :] * s_yh,
                       mask=ok[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            wv = tl.load(w_ptr + slot, mask=t_mask & ok, other=0.0).to(tl.float32)
            vals = vals * wv[:, None]
        acc += vals
    dst = out_ptr + toks.to(tl.int64)[:, None] * s_ot + cols.to(tl.int64)[None, :] * s_oh
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_bwd_kernel(go_ptr, y_ptr, w_ptr, sorted_slot_ptr, gy_ptr, gw_ptr, n_rows, n_slots, H, k,
                        s_gt, s_gh, s_yr, s_yh, s_gyr, s_gyh,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Per permuted row p with slot s = sorted_slot[p], token t = s // k:
    grad_y[p] = w[s] * grad_out[t] (zero on the tail), grad_w[s] = <grad_out[t], y[p]> (fp32).
    A slot outside ``[0, n_slots)`` is the tail's -1 (masked; asserted under ``TRITON_DEBUG``)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rows < n_rows
    slot = tl.load(sorted_slot_ptr + rows, mask=r_mask, other=-1).to(tl.int64)
    tl.device_assert((slot >= -1) & (slot < n_slots), "combine_backward: sorted_slot outside [-1, T * top_k)")
    ok = (slot >= 0) & (slot < n_slots)
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


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
def as_group_offsets(offsets, rows: int, device: torch.device, *, check: bool = True) -> torch.Tensor:
    """Group offsets (an int32/int64 tensor on any device, or a sequence of ints) as a contiguous
    int tensor on ``device``. ``check=True`` (on every device): 1-D with ``G + 1 >= 2`` entries,
    ``offsets[0] == 0``, non-decreasing, ``offsets[-1] <= rows`` (rows past it are the zero
    tail). Checking a device tensor reads it on the host (one sync); ``check=False`` skips the
    value checks for offsets that are correct by construction."""
    if not isinstance(offsets, torch.Tensor):
        try:
            offsets = torch.tensor([int(v) for v in offsets], dtype=torch.int32)
        except (TypeError, ValueError):
            raise TypeError(f"offsets must be an int tensor or a sequence of ints, got {offsets!r}") from None
    if offsets.dtype not in INDEX_DTYPES:
        raise TypeError(f"offsets must have dtype torch.int32 or torch.int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(f"offsets must be 1-D with G + 1 >= 2 entries, got shape {tuple(offsets.shape)}")
    if check:
        o = offsets.tolist()
        if o[0] != 0 or any(b < a for a, b in zip(o, o[1:])) or o[-1] > rows:
            raise ValueError(f"offsets must start at 0, be non-decreasing and end at most at M={rows}, got {o}")
    return offsets.to(device=device).contiguous()


def _check_rows(name, n):
    if n > MAX_ROWS:
        raise ValueError(f"{name} must have at most {MAX_ROWS} rows (int32 positions), got {n}")


def _index_operand(name, t, n, ref_name, ref):
    """A 1-D routing index of ``n`` entries on the device of ``ref``, made contiguous."""
    check_index_tensor(name, t, dims=(1,))
    _check_rows(name, t.numel())
    if t.numel() != n:
        raise ValueError(f"{name} must have {n} elements, got {t.numel()}")
    check_same(name, t, ref_name, ref, dtype=False)
    return t.contiguous()


def _check_top_k(top_k):
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")


def _weights_operand(weights, T, top_k, y):
    """Combine weights ``[T, top_k]`` (or flat) as a contiguous 1-D tensor on y's device."""
    check_float_tensor("weights", weights, dims=(1, 2))
    if weights.numel() != T * top_k:
        raise ValueError(f"weights must have shape ({T}, {top_k}), got {tuple(weights.shape)}")
    check_same("weights", weights, "y", y, dtype=False)
    return weights.reshape(-1).contiguous()


def permute(x: torch.Tensor, sorted_slot: torch.Tensor, top_k: int, *, out: torch.Tensor | None = None):
    """``out[p] = x[sorted_slot[p] // top_k]``: every token repeated once per routed slot, in
    group-contiguous order; rows with ``sorted_slot < 0`` (dropped tail) are zero, and so are rows
    whose ``sorted_slot`` is ``>= T * top_k`` (out of range: masked, not read; module docstring).
    x: ``[T, H]`` (a float dtype, or uint8: rows of packed bytes such as e4m3 values with their
    scales, copied as they are); sorted_slot: ``[T * top_k]``; returns ``[T * top_k, H]``."""
    check_tensor("x", x, dims=(2,), dtypes=SUPPORTED_DTYPES + (torch.uint8,), kernel_device=True)
    _check_top_k(top_k)
    T, H = x.shape
    n = T * top_k
    sorted_slot = _index_operand("sorted_slot", sorted_slot, n, "x", x)
    out = output_buffer("out", out, (n, H), x.device, x.dtype)
    if n == 0 or H == 0:
        return out
    BR, BH = (16, 32) if interpreting() else (32, min(256, next_power_of_2(H)))
    grid = (cdiv(n, BR), cdiv(H, BH))
    launch_kernel(
        _permute_kernel, grid,
        (x, out, sorted_slot, n, H, top_k, x.stride(0), x.stride(1), out.stride(0), out.stride(1)),
        dict(BLOCK_R=BR, BLOCK_H=BH))
    return out


def combine(y: torch.Tensor, slot_pos: torch.Tensor, weights: torch.Tensor | None, top_k: int, *,
            out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """``out[t] = sum_j weights[t, j] * y[slot_pos[t * top_k + j]]`` (fp32 sum; slots with
    ``slot_pos < 0`` contribute zero, as do those with ``slot_pos >= R`` (out of range: masked, not
    read; module docstring); ``weights=None`` means 1, the backward of :func:`permute`).
    y: ``[R, H]`` permuted rows; slot_pos: ``[T * top_k]``; weights ``[T, top_k]``; returns ``[T, H]``."""
    check_float_tensor("y", y, dims=(2,))
    _check_top_k(top_k)
    if slot_pos.numel() % top_k:
        raise ValueError(f"slot_pos must have T * top_k elements (top_k={top_k}), got {slot_pos.numel()}")
    T = slot_pos.numel() // top_k
    slot_pos = _index_operand("slot_pos", slot_pos, T * top_k, "y", y)
    H = y.shape[1]
    if weights is not None:
        weights = _weights_operand(weights, T, top_k, y)
    out = output_buffer("out", out, (T, H), y.device, out_dtype or y.dtype)
    if T == 0 or H == 0:
        return out
    BT, BH = (16, 32) if interpreting() else (16, min(256, next_power_of_2(H)))
    grid = (cdiv(T, BT), cdiv(H, BH))
    launch_kernel(
        _combine_kernel, grid,
        (y, weights if weights is not None else y, slot_pos, out, T, y.shape[0], H, top_k, y.stride(0), y.stride(1),
         out.stride(0), out.stride(1)),
        dict(HAS_WEIGHT=weights is not None, BLOCK_T=BT, BLOCK_H=BH))
    return out


def combine_backward(grad_out: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, sorted_slot: torch.Tensor,
                     top_k: int):
    """Gradients of :func:`combine`: ``(grad_y [R, H], grad_weights [T, top_k] fp32)``.
    ``grad_y`` rows with ``sorted_slot < 0`` are zero (as those with ``sorted_slot >= T * top_k``:
    out of range, masked; module docstring); dropped slots get ``grad_weights == 0``."""
    check_float_tensor("grad_out", grad_out, dims=(2,))
    check_float_tensor("y", y, dims=(2,))
    _check_top_k(top_k)
    T, H = grad_out.shape
    if y.shape[1] != H:
        raise ValueError(f"y must have {H} columns like grad_out, got shape {tuple(y.shape)}")
    R = y.shape[0]
    sorted_slot = _index_operand("sorted_slot", sorted_slot, R, "y", y)
    weights = _weights_operand(weights, T, top_k, y)
    grad_y = torch.empty((R, H), device=y.device, dtype=y.dtype)
    grad_w = torch.zeros((T * top_k,), device=y.device, dtype=torch.float32)
    if R == 0:
        return grad_y, grad_w.view(T, top_k)
    BR, BH = (16, 32) if interpreting() else (32, min(128, next_power_of_2(max(H, 1))))
    launch_kernel(
        _combine_bwd_kernel, (cdiv(R, BR),),
        (grad_out, y, weights, sorted_slot, grad_y, grad_w, R, T * top_k, H, top_k, grad_out.stride(0),
         grad_out.stride(1), y.stride(0), y.stride(1), grad_y.stride(0), grad_y.stride(1)),
        dict(BLOCK_R=BR, BLOCK_H=BH))
    return grad_y, grad_w.view(T, top_k)
