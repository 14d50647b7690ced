"""Fused RMSNorm with an optional residual add, forward and backward, fp32 statistics.

Forward (one row = one token, ``H`` features)::

    h   = x + residual          (only with a residual; stored, it is the next block's residual)
    y   = h * rstd * weight,    rstd = 1 / sqrt(mean(h^2) + eps)

Backward, with ``n = h * rstd``, ``dn = dy * weight`` and ``dh_in`` the gradient that reaches the
new residual stream from later layers::

    dh  = rstd * (dn - n * mean(dn * n)) + dh_in          (= dx = dresidual)
    dw  = sum over rows of dy * n

Every operand is addressed through two-level row indices (``runtime.RowView`` / ``row_offsets``,
as in the GEMMs), so a ``[batch, seq, H]`` view whose batch and sequence strides do not merge (a
sequence chunk of a larger tensor) is read and written in place; the feature stride is arbitrary
too.

fp8 output (:func:`rms_norm_fp8_fwd`, constexpr ``FP8``; ``TILES``: 1x128 tiles along ``H``): the
forward kernel also quantises the ``y`` it stores (rounded to its dtype) with :mod:`.fp8`'s
``group_scale`` and ``to_e4m3``, so ``(q, scale)`` equal ``quantize_e4m3(y)`` bit for bit; block
sizes and, compiled, the register layout (constexpr ``VEC``) are the plain launch's, so ``y`` and
``rstd`` are too (DESIGN §4.11). The looped kernels quantise in pass 2, or reload ``y`` in a pass 3.

Layers: ``_rmsnorm_fwd_kernel`` / ``_rmsnorm_bwd_kernel`` (jit) -> ``rms_norm_fwd`` /
``rms_norm_fp8_fwd`` / ``rms_norm_bwd`` (validate, allocate, launch); ``rms_norm_reference`` is
the torch oracle. The custom ops live in ``fusedpar.ops.norm.custom_ops``, the functional API in
``fusedpar.ops.norm``; the module in ``fusedpar.nn``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_choice, check_device_usable, check_same, check_shape, check_supported_dtype, check_tensor
from .fp8 import FP8_BLOCK, check_fp8_device, group_scale, scale_shape, store_e4m3_tiles, to_e4m3
from .fp8_gemm import FP8_RECIPES
from .launch import PlanCache, describe, launch_planned
from .rmsnorm_looped import input_with_residual, rmsnorm_bwd_looped_kernel, rmsnorm_fwd_looped_kernel, stored
from .runtime import RowView, cdiv, interpreting, multiprocessor_count, next_power_of_2, on_device, row_offsets

# The fused kernels hold whole rows (padded to a power of two) in registers; rows wider than
# this take the looped kernels, which stream a row in LOOP_CHUNK-wide pieces twice (statistics,
# then the output) instead of spilling (a 65536-wide row spilled 7-16 KB per program on sm_90).
ROW_BLOCK_LIMIT = 8192
LOOP_CHUNK = 4096


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, q_ptr, s_ptr,
    M, H, eps, s_sm,
    x_inner, s_x0, s_x1, s_xh,
    r_inner, s_r0, s_r1, s_rh,
    y_inner, s_y0, s_y1, s_yh,
    h_inner, s_h0, s_h1, s_hh,
    X_SPLIT: tl.constexpr, R_SPLIT: tl.constexpr, Y_SPLIT: tl.constexpr, H_SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr, FP8: tl.constexpr, TILES: tl.constexpr,
    EMULATE: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``FP8``: also the e4m3 quantisation of the stored ``y`` into ``q_ptr`` (``[M, H]``,
    contiguous) and ``s_ptr`` (row stride ``s_sm``): one scale per row, or (``TILES``) per 1x128
    tile of a row; ``EMULATE``: the interpreter's exact casts (:mod:`.fp8`). ``VEC``: the
    columns are claimed contiguous in runs of 16 bytes of the narrowest 16/32-bit operand, so
    the e4m3 store vectorises no wider than the plain kernel's accesses and the compiler keeps
    the plain kernel's register layout, hence its order of the row's sum of squares (its own
    16-element e4m3 stores gave another layout: ``rstd`` one ulp off the plain launch's)."""
    tl.static_assert(BLOCK_H >= 16, "BLOCK_H must be at least 16")
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = tl.arange(0, BLOCK_H)
    m_mask = rm < M
    h_mask = rh < H
    mask = m_mask[:, None] & h_mask[None, :]
    cols = rh.to(tl.int64)
    if FP8:
        cols = tl.max_contiguous(cols, VEC)

    x_off = row_offsets(rm, x_inner, s_x0, s_x1, X_SPLIT)[:, None] + cols[None, :] * s_xh
    r_off = row_offsets(rm, r_inner, s_r0, s_r1, R_SPLIT)[:, None] + cols[None, :] * s_rh
    h_off = row_offsets(rm, h_inner, s_h0, s_h1, H_SPLIT)[:, None] + cols[None, :] * s_hh
    h = input_with_residual(x_ptr + x_off, r_ptr + r_off, h_ptr + h_off, mask, HAS_RES)

    ms = tl.sum(h * h, axis=1) / H
    rstd = 1.0 / tl.sqrt(ms + eps)
    tl.store(rstd_ptr + rm, rstd, mask=m_mask)
    y = h * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + rh, mask=h_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    y_off = row_offsets(rm, y_inner, s_y0, s_y1, Y_SPLIT)[:, None] + cols[None, :] * s_yh
    if FP8:
        y = tl.where(mask, stored(y, y_ptr + y_off, mask, EMULATE), 0.0)
        if TILES and BLOCK_H >= 128:
            rm64 = rm.to(tl.int64)
            store_e4m3_tiles(y, q_ptr + rm64 * H, s_ptr + rm64 * s_sm, cols, mask, m_mask, 0, s_sm, EMULATE,
                             BLOCK_M, BLOCK_H)
        else:  # per row (a row of fewer than 128 features is one 1x128 tile)
            scale = group_scale(tl.max(tl.abs(y), axis=1))
            tl.store(s_ptr + rm.to(tl.int64) * s_sm, scale, mask=m_mask)
            q = to_e4m3(tl.math.div_rn(y, scale[:, None]), EMULATE)
            tl.store(q_ptr + rm.to(tl.int64)[:, None] * H + cols[None, :], q, mask=mask)
    else:
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
        h = tl.load(h_ptr + row_offsets(rm, h_inner, s_h0, s_h1, H_SPLIT)[:, None] + cols[None, :] * s_hh,
                    mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row_offsets(rm, dy_inner, s_dy0, s_dy1, DY_SPLIT)[:, None] + cols[None, :] * s_dyh,
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
            dh += tl.load(dhin_ptr + row_offsets(rm, g_inner, s_g0, s_g1, G_SPLIT)[:, None] + cols[None, :] * s_gh,
                          mask=mask, other=0.0).to(tl.float32)
        dx_off = row_offsets(rm, dx_inner, s_dx0, s_dx1, DX_SPLIT)[:, None] + cols[None, :] * s_dxh
        tl.store(dx_ptr + dx_off, dh.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid.to(tl.int64) * H + rh, dw_acc, mask=h_mask)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
NO_ROWS = RowView(1, 0, 0, False)  # the row view of an absent operand (its pointer is a dummy)


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


def _operand(t: torch.Tensor | None):
    """(rows view of ``t`` or a dummy, its RowView, its feature stride) of an optional operand."""
    if t is None:
        return None, NO_ROWS, 0
    return t, RowView.rows(t), t.stride(-1)


def _config(H: int, M: int):
    """(block sizes, launch options) of the fused kernels, or of the looped ones for rows wider
    than ROW_BLOCK_LIMIT (``{"BLOCK_C": ...}``, one row per program). The fp8 output launches the
    same (the row statistics are summed in the same order: ``y`` and ``rstd`` equal the plain
    launch's bit for bit)."""
    block_h = max(16, next_power_of_2(H))
    if block_h > ROW_BLOCK_LIMIT:
        return dict(BLOCK_C=min(LOOP_CHUNK, ROW_BLOCK_LIMIT)), ({} if interpreting() else dict(num_warps=8))
    if interpreting():
        # numpy runs a whole block at once: fewer, larger programs are faster; 16 rows still leave
        # multi-program launches and row tails in the tests
        return dict(BLOCK_M=16, BLOCK_H=block_h), {}
    # about 8k fp32 elements of a tile per program keep registers in budget
    block_m = max(1, min(16, 8192 // block_h, next_power_of_2(max(M, 1))))
    warps = 4 if block_h * block_m <= 4096 else 8
    return dict(BLOCK_M=block_m, BLOCK_H=block_h), dict(num_warps=warps)


def _check_operand(name: str, t, x: torch.Tensor | None = None, shape=None) -> None:
    """A kernel operand: a tensor of a supported dtype, of ``shape`` (when given), on a kernel
    device (``x``'s, when given). What the tensor is (type, dtype, shape) is checked before where
    it lives, as :func:`~.checks.check_tensor` does: a bad shape gets the same error on a GPU
    machine as under the interpreter, whatever device the tensor is on."""
    check_tensor(name, t)
    check_supported_dtype(name, t)
    if shape is not None:
        check_shape(name, t, shape)
    check_device_usable(name, t)
    if x is not None:
        check_same(name, t, "x", x, dtype=False)


def check_rms_norm_inputs(x, weight, eps, residual) -> int:
    """Validate the forward's inputs (metadata only: traceable by torch.compile); returns the hidden size."""
    check_tensor("x", x)
    check_supported_dtype("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden features), got a scalar")
    H = x.shape[-1]
    if H == 0:
        raise ValueError(f"x must have a non-empty hidden (last) dimension, got shape {tuple(x.shape)}")
    check_device_usable("x", x)  # after the shape, as _check_operand orders its checks
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if weight is not None:
        _check_operand("weight", weight, x, (H,))
    if residual is not None:
        _check_operand("residual", residual, x, x.shape)
    return H


def check_rms_norm_fp8_inputs(x, weight, eps, residual, recipe) -> int:
    """:func:`check_rms_norm_inputs` and the fp8 recipe (``"rowwise"`` / ``"blockwise"``), on a
    GPU with fp8 tensor cores; returns the hidden size."""
    H = check_rms_norm_inputs(x, weight, eps, residual)
    check_choice("recipe", recipe, tuple(FP8_RECIPES))
    check_fp8_device(x, option=f"the fused RMSNorm's fp8 output (recipe={recipe!r})")
    return H


def _fwd_outputs(x, residual, out, residual_out, out_dtype):
    """The forward's destinations: given ones checked, missing ones allocated."""
    if out is None:
        out = torch.empty(x.shape, device=x.device, dtype=out_dtype or x.dtype)
    else:
        _check_operand("out", out, x, x.shape)
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out must have dtype {out_dtype} (out_dtype), got {out.dtype}")
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out must be None without a residual (it is only written with one), "
                             "got a tensor")
    elif residual_out is None:
        residual_out = torch.empty(x.shape, device=x.device, dtype=residual.dtype)
    else:
        _check_operand("residual_out", residual_out, x, x.shape)
    return out, residual_out


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
    key = None if interpreting() else ("fwd", describe(x), describe(weight), eps, describe(residual), describe(out),
                                        describe(residual_out), out_dtype)
    done = _planned_fwd(key, x, weight, residual, out, residual_out, None)
    if done is not None:
        return done[:3]
    H = check_rms_norm_inputs(x, weight, eps, residual)
    return _launch_fwd(x, weight, eps, H, residual, out, residual_out, out_dtype, None, plan_key=key)[:3]


def rms_norm_fp8_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    recipe: str = "rowwise",
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """:func:`rms_norm_fwd` whose kernel also quantises ``y`` for an fp8 GEMM: returns ``(y, h,
    rstd, q, scale)``, ``q`` the contiguous ``float8_e4m3fn`` ``[..., H]`` and ``scale`` fp32 per
    token for ``recipe="rowwise"`` (shape ``x.shape[:-1]``) or per 1x128 tile along ``H`` for
    ``"blockwise"`` (``x.shape[:-1] + (ceil(H / 128),)``, the last tile ragged), the layout of
    ``Fp8Rows`` in :mod:`fusedpar.ops.tensor_parallel.schedules`. The quantised values are those of
    the stored ``y`` (rounded to its dtype), with :mod:`.fp8`'s scales, guards and cast, so
    ``(q, scale)`` equal ``quantize_e4m3(y.reshape(-1, H), "row" | "tile")`` bit for bit.
    ``fp8_out=(q, scale)``: contiguous buffers of those shapes and dtypes, written in place."""
    key = None
    if not interpreting():
        pair = tuple(map(describe, fp8_out)) if type(fp8_out) is tuple and len(fp8_out) == 2 else describe(fp8_out)
        key = ("fp8", recipe, describe(x), describe(weight), eps, describe(residual), describe(out),
               describe(residual_out), out_dtype, pair)
    done = _planned_fwd(key, x, weight, residual, out, residual_out, fp8_out)
    if done is not None:
        return done
    H = check_rms_norm_fp8_inputs(x, weight, eps, residual, recipe)
    return _launch_fwd(x, weight, eps, H, residual, out, residual_out, out_dtype, FP8_RECIPES[recipe][0], fp8_out,
                       plan_key=key)


def _fp8_outputs(x, H, granularity, fp8_out):
    """The fp8 output's ``(q, scale)``: ``fp8_out`` checked, or new contiguous buffers."""
    lead = tuple(x.shape[:-1])
    shapes = (tuple(x.shape), lead + scale_shape(int(torch.Size(lead).numel()), H, granularity)[1:])
    dtypes = (torch.float8_e4m3fn, torch.float32)
    if fp8_out is None:
        return tuple(torch.empty(shape, device=x.device, dtype=dt) for shape, dt in zip(shapes, dtypes))
    if not isinstance(fp8_out, (tuple, list)) or len(fp8_out) != 2:
        raise TypeError(f"fp8_out must be a (q, scale) pair of tensors, got {type(fp8_out).__name__}")
    for name, t, shape, dt in zip(("fp8_out[0] (q)", "fp8_out[1] (scale)"), fp8_out, shapes, dtypes):
        check_tensor(name, t, dtypes=(dt,))
        check_shape(name, t, shape)
        check_same(name, t, "x", x, dtype=False)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return tuple(fp8_out)


def _fwd_tensors(x, weight, residual, out, residual_out, rstd, q, scale):
    """The forward kernels' tensor arguments in order: the operands as rows (:func:`_as_rows`),
    ``x`` / ``out`` / ``rstd`` for absent ones, the weight unit-stride (a copy where it was not)."""
    xr, yr = _as_rows("x", x), _as_rows("out", out, written=True)
    has_res = residual is not None
    return (xr, _as_rows("residual", residual) if has_res else xr,
            xr if weight is None else weight if weight.stride(0) == 1 else weight.contiguous(), yr,
            _as_rows("residual_out", residual_out, written=True) if has_res else yr, rstd,
            yr if q is None else q, rstd if scale is None else scale)


def _launch_fwd(x, weight, eps, H, residual, out, residual_out, out_dtype, granularity, fp8_out=None, plan_key=None):
    """Allocate and launch the forward (``granularity``: None, or the fp8 output's "row" / "tile");
    ``(y, h, rstd, q, scale)``, ``q`` and ``scale`` None without fp8. A launch keeps its plan under
    ``plan_key`` (:data:`_PLANS`)."""
    out, residual_out = _fwd_outputs(x, residual, out, residual_out, out_dtype)
    q, scale = _fp8_outputs(x, H, granularity, fp8_out) if granularity is not None else (None, None)
    M = int(torch.Size(x.shape[:-1]).numel())
    rstd = torch.empty((M,), device=x.device, dtype=torch.float32)
    if M > 0:
        t = _fwd_tensors(x, weight, residual, out, residual_out, rstd, q, scale)
        has_res = residual is not None
        _, x_rows, s_xh = _operand(t[0])
        _, y_rows, s_yh = _operand(t[3])
        _, r_rows, s_rh = _operand(t[1] if has_res else None)
        _, h_rows, s_hh = _operand(t[4] if has_res else None)
        tiles = granularity == "tile"
        cfg, launch = _config(H, M)
        kernel = rmsnorm_fwd_looped_kernel if "BLOCK_C" in cfg else _rmsnorm_fwd_kernel
        args = (*t, M, H, float(eps), cdiv(H, FP8_BLOCK) if tiles else 1, *x_rows.args(), s_xh, *r_rows.args(), s_rh,
                *y_rows.args(), s_yh, *h_rows.args(), s_hh)
        flags = dict(X_SPLIT=x_rows.split, R_SPLIT=r_rows.split, Y_SPLIT=y_rows.split, H_SPLIT=h_rows.split,
                     HAS_RES=has_res, HAS_WEIGHT=weight is not None, FP8=granularity is not None, TILES=tiles,
                     EMULATE=interpreting() and granularity is not None,
                     VEC=16 // min(t.element_size() for t in (x, out, residual, residual_out) if t is not None), **cfg,
                     **launch)
        with on_device(x.device):
            plan = launch_planned(_PLANS, plan_key, kernel, (cdiv(M, cfg.get("BLOCK_M", 1)),), args, flags)
        if plan is not None:
            plan.extra = (out.dtype, None if q is None else (q.shape, scale.shape))
    return out, (residual_out if residual is not None else x), rstd, q, scale


#: the launch plans of the forward and backward launchers, keyed on their calls (:mod:`.launch`)
_PLANS = PlanCache()


def _planned_fwd(key, x, weight, residual, out, residual_out, fp8_out):
    """The forward through the plan of ``key`` (its checks passed when the plan was built): the
    outputs it does not get allocated as that launch had them; None, having launched nothing,
    where there is no plan for ``key`` or it does not apply now."""
    plan = None if key is None else _PLANS.find(key)
    if plan is None:
        return None
    y_dtype, fp8_shapes = plan.extra
    if out is None:
        out = torch.empty(x.shape, device=x.device, dtype=y_dtype)
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, device=x.device, dtype=residual.dtype)
    q = scale = None
    if fp8_shapes is not None:
        q, scale = fp8_out if fp8_out is not None else (
            torch.empty(fp8_shapes[0], device=x.device, dtype=torch.float8_e4m3fn),
            torch.empty(fp8_shapes[1], device=x.device, dtype=torch.float32))
    rstd = torch.empty(x.shape[:-1].numel(), device=x.device, dtype=torch.float32)
    if not plan.launch(_fwd_tensors(x, weight, residual, out, residual_out, rstd, q, scale)):
        return None
    return out, (residual_out if residual is not None else x), rstd, q, scale


def _bwd_programs(M: int, block_m: int, device: torch.device):
    """(programs, rows per program): one program per SM at most (each writes one fp32 row of
    partial weight gradients), rows per program a multiple of ``block_m``."""
    if interpreting():
        programs = max(1, min(2, cdiv(M, block_m)))
    else:
        sms = multiprocessor_count(device.index)
        programs = max(1, min(sms, cdiv(M, block_m)))
    rows_per_program = cdiv(cdiv(max(M, 1), programs), block_m) * block_m
    return cdiv(max(M, 1), rows_per_program), rows_per_program


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
    key = None if interpreting() else ("bwd", describe(grad_out), describe(h), describe(weight), describe(rstd),
                                        describe(grad_residual), dx_dtype)
    plan = None if key is None else _PLANS.find(key)
    if plan is not None:
        dx = torch.empty(h.shape, device=h.device, dtype=plan.extra[0])
        dw_partial = torch.zeros(plan.extra[1], device=h.device, dtype=torch.float32) if weight is not None else None
        if plan.launch(_bwd_tensors(grad_out, h, weight, rstd, grad_residual, dx, dw_partial)):
            return dx, (dw_partial.sum(0).to(weight.dtype) if weight is not None else None)
    _check_operand("grad_out", grad_out, h, h.shape)
    if grad_residual is not None:
        _check_operand("grad_residual", grad_residual, h, h.shape)
    H = h.shape[-1]
    M = int(torch.Size(h.shape[:-1]).numel())
    check_tensor("rstd", rstd, dtypes=(torch.float32,))
    check_shape("rstd", rstd, (M,))
    dx = torch.empty(h.shape, device=h.device, dtype=dx_dtype or h.dtype)
    cfg, launch = _config(H, M)
    programs, rows_per_program = _bwd_programs(M, cfg.get("BLOCK_M", 1), h.device)
    dw_partial = torch.zeros((programs, H), device=h.device, dtype=torch.float32) if weight is not None else None
    if M > 0:
        t = _bwd_tensors(grad_out, h, weight, rstd, grad_residual, dx, dw_partial)
        _, dy_rows, s_dyh = _operand(t[0])
        _, h_rows, s_hh = _operand(t[1])
        _, dx_rows, s_dxh = _operand(t[5])
        _, g_rows, s_gh = _operand(t[4] if grad_residual is not None else None)
        kernel = rmsnorm_bwd_looped_kernel if "BLOCK_C" in cfg else _rmsnorm_bwd_kernel
        args = (*t, M, H, rows_per_program, *dy_rows.args(), s_dyh, *h_rows.args(), s_hh, *g_rows.args(), s_gh,
                *dx_rows.args(), s_dxh)
        flags = dict(DY_SPLIT=dy_rows.split, H_SPLIT=h_rows.split, G_SPLIT=g_rows.split, DX_SPLIT=dx_rows.split,
                     HAS_DHIN=grad_residual is not None, HAS_WEIGHT=weight is not None, **cfg, **launch)
        with on_device(h.device):
            plan = launch_planned(_PLANS, key, kernel, (programs,), args, flags)
        if plan is not None:
            plan.extra = (dx.dtype, (programs, H))
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return dx, dw


def _bwd_tensors(grad_out, h, weight, rstd, grad_residual, dx, dw_partial):
    """The backward kernels' tensor arguments in order (rows views; ``grad_out`` / ``h`` / ``rstd``
    for absent ones, the weight contiguous: a copy where it was not)."""
    gr, hr = _as_rows("grad_out", grad_out), _as_rows("h", h)
    return (gr, hr, hr if weight is None else weight.contiguous(), rstd,
            gr if grad_residual is None else _as_rows("grad_residual", grad_residual), _as_rows("dx", dx, written=True),
            rstd if dw_partial is None else dw_partial)


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
