"""Fused RMSNorm with an optional residual add, forward and backward, fp32 statistics.

Forward (one row = one token, ``H`` features)::

    h   = x + residual          (only with a residual; stored, it is the next block's residual)
    y   = h * rstd * weight,    rstd = 1 / sqrt(mean(h^2) + eps)

Backward, with ``n = h * rstd``, ``dn = dy * weight`` and ``dh_in`` the gradient that reaches the
new residual stream from later layers::

    dh  = rstd * (dn - n * mean(dn * n)) + dh_in          (= dx = dresidual)
    dw  = sum over rows of dy * n

Every operand is addressed through two-level row indices (as in gemm.py), so a ``[batch, seq, H]``
view whose batch and sequence strides do not merge (a sequence chunk of a larger tensor) is read
and written in place; the feature stride is arbitrary too.

Layers: ``_rmsnorm_fwd_kernel`` / ``_rmsnorm_bwd_kernel`` (jit) -> ``rms_norm_fwd`` /
``rms_norm_bwd`` (validate, allocate, launch) -> ``rms_norm_reference`` (fp64 torch oracle). The
autograd Function and functional API live in ``fusedpar.ops.norm``; the module in ``fusedpar.nn``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_device_usable, check_supported_dtype
from .runtime import interpreting

# One program holds a full row in registers; past this many features a row would spill (the
# same bound Liger-Kernel uses), so larger hidden sizes are rejected with a clear error.
MAX_FUSED_SIZE = 65536


@triton.jit
def _row_offsets(rows, inner, s_outer, s_inner, SPLIT: tl.constexpr):
    """Memory offset (int64) of logical row ``rows`` of a 2-D view or a [batch, seq] pair."""
    rows = rows.to(tl.int64)
    if SPLIT:
        return (rows // inner) * s_outer + (rows % inner) * s_inner
    else:
        return rows * s_inner


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr,
    M, H, eps,
    x_inner, s_x0, s_x1, s_xh,
    r_inner, s_r0, s_r1, s_rh,
    y_inner, s_y0, s_y1, s_yh,
    h_inner, s_h0, s_h1, s_hh,
    X_SPLIT: tl.constexpr, R_SPLIT: tl.constexpr, Y_SPLIT: tl.constexpr, H_SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tl.static_assert(BLOCK_H >= 16, "BLOCK_H must be at least 16")
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = tl.arange(0, BLOCK_H)
    m_mask = rm < M
    h_mask = rh < H
    mask = m_mask[:, None] & h_mask[None, :]
    cols = rh.to(tl.int64)

    x_off = _row_offsets(rm, x_inner, s_x0, s_x1, X_SPLIT)[:, None] + cols[None, :] * s_xh
    h = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r_off = _row_offsets(rm, r_inner, s_r0, s_r1, R_SPLIT)[:, None] + cols[None, :] * s_rh
        h += tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        # the norm reads the stored (rounded) residual, exactly what the backward will reload
        h = h.to(h_ptr.dtype.element_ty)
        h_off = _row_offsets(rm, h_inner, s_h0, s_h1, H_SPLIT)[:, None] + cols[None, :] * s_hh
        tl.store(h_ptr + h_off, h, mask=mask)
        h = h.to(tl.float32)

    ms = tl.sum(h * h, axis=1) / H
    rstd = 1.0 / tl.sqrt(ms + eps)
    tl.store(rstd_ptr + rm, rstd, mask=m_mask)
    y = h * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + rh, mask=h_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    y_off = _row_offsets(rm, y_inner, s_y0, s_y1, Y_SPLIT)[:, None] + cols[None, :] * s_yh
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr, h_ptr, w_ptr, rstd_ptr, dhin_ptr, dx_ptr, dw_ptr,
    M, H, rows_per_program,
    dy_inner, s_dy0, s_dy1, s_dyh,
    h_inner, s_h0, s_h1, s_hh,
    g_inner, s_g0, s_g1, s_gh,
    dx_inner, s_dx0, s_dx1, s_dxh,
    DY_SPLIT: tl.constexpr, H_SPLIT: tl.constexpr, G_SPLIT: tl.constexpr, DX_SPLIT: tl.constexpr,
    HAS_DHIN: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Each program owns ``rows_per_program`` consecutive rows (a multiple of BLOCK_M), writes
    their dx, and one fp32 row of partial weight gradients ``dw_ptr[pid, :]``."""
    tl.static_assert(BLOCK_H >= 16, "BLOCK_H must be at least 16")
    pid = tl.program_id(0)
    rh = tl.arange(0, BLOCK_H)
    h_mask = rh < H
    cols = rh.to(tl.int64)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + rh, mask=h_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for m0 in range(row_start, row_start + rows_per_program, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        mask = m_mask[:, None] & h_mask[None, :]
        h = tl.load(h_ptr + _row_offsets(rm, h_inner, s_h0, s_h1, H_SPLIT)[:, None] + cols[None, :] * s_hh,
                    mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + _row_offsets(rm, dy_inner, s_dy0, s_dy1, DY_SPLIT)[:, None] + cols[None, :] * s_dyh,
                     mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rm, mask=m_mask, other=0.0)
        n = h * rstd[:, None]
        if HAS_WEIGHT:
            dn = dy * w[None, :]
            dw_acc += tl.sum(dy * n, axis=0)
        else:
            dn = dy
        c = tl.sum(dn * n, axis=1) / H
        dh = rstd[:, None] * (dn - n * c[:, None])
        if HAS_DHIN:
            dh += tl.load(dhin_ptr + _row_offsets(rm, g_inner, s_g0, s_g1, G_SPLIT)[:, None] + cols[None, :] * s_gh,
                          mask=mask, other=0.0).to(tl.float32)
        dx_off = _row_offsets(rm, dx_inner, s_dx0, s_dx1, DX_SPLIT)[:, None] + cols[None, :] * s_dxh
        tl.store(dx_ptr + dx_off, dh.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid.to(tl.int64) * H + rh, dw_acc, mask=h_mask)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor):
    """(inner, stride_outer, stride_inner, split) of the leading dims of a 2-D or 3-D tensor."""
    if t.dim() == 2:
        return (1, 0, t.stride(0)), False
    b, s = t.shape[0], t.shape[1]
    if b == 1 or s == 1 or t.stride(0) == s * t.stride(1):
        inner_stride = t.stride(1) if s > 1 else t.stride(0)
        return (1, 0, inner_stride), False
    return (s, t.stride(0), t.stride(1)), True


def _as_rows(name: str, t: torch.Tensor, *, written: bool = False) -> torch.Tensor:
    """2-D and 3-D tensors are addressed in place; higher ranks are viewed as [rows, H] (inputs
    that cannot be viewed so are copied; an output must be viewable, or the result would be lost)."""
    if t.dim() in (2, 3):
        return t
    if t.dim() == 1:
        return t.unsqueeze(0)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        if written:
            raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
                             "[rows, hidden]; pass a 2-D/3-D view or a contiguous tensor") from None
        return t.reshape(-1, t.shape[-1])


def _config(H: int, M: int):
    block_h = max(16, triton.next_power_of_2(H))
    if interpreting():
        # numpy runs a whole block at once: fewer, larger programs are faster; 16 rows still leave
        # multi-program launches and row tails in the tests
        return dict(BLOCK_M=16, BLOCK_H=block_h), {}
    # about 8k fp32 elements of a tile per program keep registers in budget
    block_m = max(1, min(16, 8192 // block_h, triton.next_power_of_2(max(M, 1))))
    warps = 4 if block_h * block_m <= 4096 else 8
    return dict(BLOCK_M=block_m, BLOCK_H=block_h), dict(num_warps=warps)


def _check_tensor(name, t, like=None, shape=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_supported_dtype(name, t)
    check_device_usable(name, t)
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} must be on the same device as x ({like.device}), got {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Launch the forward. Returns ``(y, h, rstd)`` where ``h`` is the new residual
    ``x + residual`` (``x`` itself without a residual) and ``rstd`` the fp32 ``[rows]`` statistics.

    x:        ``[..., H]`` (2-D and 3-D views of any strides are read in place).
    weight:   ``[H]`` or ``None`` (no scale).
    residual: same shape as ``x``; ``h`` gets the residual's dtype (an fp32 residual stream under
              bf16 activations is fine).
    out / residual_out: optional destinations (same shape as x, any strides).
    """
    _check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden features), got a scalar")
    H = x.shape[-1]
    if H == 0:
        raise ValueError(f"x must have a non-empty hidden (last) dimension, got shape {tuple(x.shape)}")
    if H > MAX_FUSED_SIZE:
        raise ValueError(f"hidden size {H} exceeds the fused RMSNorm limit of {MAX_FUSED_SIZE} features")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if weight is not None:
        _check_tensor("weight", weight, like=x, shape=(H,))
        if weight.stride(0) != 1:
            weight = weight.contiguous()
    if residual is not None:
        _check_tensor("residual", residual, like=x, shape=x.shape)
    if out is None:
        out = torch.empty(x.shape, device=x.device, dtype=out_dtype or x.dtype)
    else:
        _check_tensor("out", out, like=x, shape=x.shape)
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype={out_dtype}")
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, device=x.device, dtype=residual.dtype)
        else:
            _check_tensor("residual_out", residual_out, like=x, shape=x.shape)
    elif residual_out is not None:
        raise ValueError("residual_out is only written when a residual is given")

    xr = _as_rows("x", x)
    rr = _as_rows("residual", residual) if residual is not None else None
    yr = _as_rows("out", out, written=True)
    hr = _as_rows("residual_out", residual_out, written=True) if residual is not None else None
    M = int(torch.Size(x.shape[:-1]).numel())
    rstd = torch.empty((M,), device=x.device, dtype=torch.float32)
    if M > 0:
        x_rows, x_split = _rows(xr)
        y_rows, y_split = _rows(yr)
        if residual is not None:
            r_rows, r_split = _rows(rr)
            h_rows, h_split = _rows(hr)
            s_rh, s_hh = rr.stride(-1), hr.stride(-1)
        else:
            (r_rows, r_split), (h_rows, h_split), s_rh, s_hh = ((1, 0, 0), False), ((1, 0, 0), False), 0, 0
        cfg, launch = _config(H, M)
        grid = (triton.cdiv(M, cfg["BLOCK_M"]),)
        with _device_ctx(x):
            _rmsnorm_fwd_kernel[grid](
                xr, rr if rr is not None else xr, weight if weight is not None else xr, yr,
                hr if hr is not None else yr, rstd,
                M, H, float(eps),
                *x_rows, xr.stride(-1), *r_rows, s_rh, *y_rows, yr.stride(-1), *h_rows, s_hh,
                X_SPLIT=x_split, R_SPLIT=r_split, Y_SPLIT=y_split, H_SPLIT=h_split,
                HAS_RES=residual is not None, HAS_WEIGHT=weight is not None,
                **cfg, **launch,
            )
    return out, (residual_out if residual is not None else x), rstd


def rms_norm_bwd(
    grad_out: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    grad_residual: torch.Tensor | None = None,
    dx_dtype: torch.dtype | None = None,
):
    """Launch the backward. Returns ``(dh, dweight)``: ``dh`` is the gradient w.r.t. ``h`` (hence
    w.r.t. both ``x`` and ``residual``), including ``grad_residual`` (the gradient reaching the
    new residual from later layers); ``dweight`` is ``None`` without a weight."""
    _check_tensor("grad_out", grad_out, like=h, shape=h.shape)
    if grad_residual is not None:
        _check_tensor("grad_residual", grad_residual, like=h, shape=h.shape)
    H = h.shape[-1]
    M = int(torch.Size(h.shape[:-1]).numel())
    if rstd.shape != (M,) or rstd.dtype != torch.float32:
        raise ValueError(f"rstd must be fp32 of shape ({M},), got {rstd.dtype} {tuple(rstd.shape)}")
    dx = torch.empty(h.shape, device=h.device, dtype=dx_dtype or h.dtype)
    cfg, launch = _config(H, M)
    if interpreting():
        programs = max(1, min(2, triton.cdiv(M, cfg["BLOCK_M"])))
    else:
        sms = torch.cuda.get_device_properties(h.device).multi_processor_count
        programs = max(1, min(sms, triton.cdiv(M, cfg["BLOCK_M"])))
    rows_per_program = triton.cdiv(triton.cdiv(max(M, 1), programs), cfg["BLOCK_M"]) * cfg["BLOCK_M"]
    programs = triton.cdiv(max(M, 1), rows_per_program)
    dw_partial = torch.zeros((programs, H), device=h.device, dtype=torch.float32) if weight is not None else None
    if M > 0:
        gr, hr, dxr = _as_rows("grad_out", grad_out), _as_rows("h", h), _as_rows("dx", dx, written=True)
        gin = _as_rows("grad_residual", grad_residual) if grad_residual is not None else None
        dy_rows, dy_split = _rows(gr)
        h_rows, h_split = _rows(hr)
        dx_rows, dx_split = _rows(dxr)
        g_rows, g_split = _rows(gin) if gin is not None else ((1, 0, 0), False)
        w = weight.contiguous() if weight is not None else None
        with _device_ctx(h):
            _rmsnorm_bwd_kernel[(programs,)](
                gr, hr, w if w is not None else hr, rstd, gin if gin is not None else gr, dxr,
                dw_partial if dw_partial is not None else rstd,
                M, H, rows_per_program,
                *dy_rows, gr.stride(-1), *h_rows, hr.stride(-1),
                *g_rows, gin.stride(-1) if gin is not None else 0, *dx_rows, dxr.stride(-1),
                DY_SPLIT=dy_split, H_SPLIT=h_split, G_SPLIT=g_split, DX_SPLIT=dx_split,
                HAS_DHIN=gin is not None, HAS_WEIGHT=weight is not None,
                **cfg, **launch,
            )
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return dx, dw


class _device_ctx:
    """``torch.cuda.device(t.device)`` on GPU, nothing under the interpreter."""

    def __init__(self, t):
        self._ctx = torch.cuda.device(t.device) if t.device.type == "cuda" else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            return self._ctx.__exit__(*exc)
        return False


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def rms_norm_reference(x, weight=None, eps=1e-6, *, residual=None, compute_dtype=torch.float64):
    """What the kernels compute, in ``compute_dtype``: ``y`` or ``(y, x + residual)``."""
    h = x.to(compute_dtype)
    if residual is not None:
        h = h + residual.to(compute_dtype)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute_dtype)
    return y if residual is None else (y, h)
