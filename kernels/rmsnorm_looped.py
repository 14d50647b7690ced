"""RMSNorm over rows wider than :data:`~fusedpar.kernels.rmsnorm.ROW_BLOCK_LIMIT` features: the
looped forward and backward kernels, which stream a row in ``BLOCK_C``-wide pieces (one row per
program) instead of holding it in registers, and the jit helpers every RMSNorm kernel shares (the
residual add, the rounded store). Launched by :mod:`.rmsnorm`'s launchers, whose docstring has
the formulas and the fp8 output."""
from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import group_scale, store_e4m3_tiles, to_e4m3, to_fp32
from .runtime import row_offsets

__all__ = ["input_with_residual", "rmsnorm_bwd_looped_kernel", "rmsnorm_fwd_looped_kernel", "stored"]


@triton.jit
def input_with_residual(x_ptrs, r_ptrs, h_ptrs, mask, HAS_RES: tl.constexpr):
    """The norm's input in fp32: ``x``, or ``h = x + r`` rounded to h's dtype and stored (the norm
    reads the stored, rounded residual, exactly what the backward will reload). Any tile shape."""
    h = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(h_ptrs.dtype.element_ty)
        tl.store(h_ptrs, h, mask=mask)
        h = h.to(tl.float32)
    return h


@triton.jit
def stored(y, y_ptrs, mask, EMULATE: tl.constexpr):
    """Store fp32 ``y`` in the output's dtype; returns the stored values in fp32 (what a later
    quantisation pass would load back: the fp8 output quantises exactly these)."""
    y = y.to(y_ptrs.dtype.element_ty)
    tl.store(y_ptrs, y, mask=mask)
    return to_fp32(y, EMULATE)


@triton.jit
def rmsnorm_fwd_looped_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, q_ptr, s_ptr,
    M, H, eps, s_sm,
    x_inner, s_x0, s_x1, s_xh,
    r_inner, s_r0, s_r1, s_rh,
    y_inner, s_y0, s_y1, s_yh,
    h_inner, s_h0, s_h1, s_hh,
    X_SPLIT: tl.constexpr, R_SPLIT: tl.constexpr, Y_SPLIT: tl.constexpr, H_SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr, FP8: tl.constexpr, TILES: tl.constexpr,
    EMULATE: tl.constexpr, VEC: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One row per program, streamed in BLOCK_C pieces: pass 1 forms (and stores) ``h`` and the
    sum of squares, pass 2 reloads ``h`` (the stored, rounded residual) and writes ``y``. ``FP8``
    (into ``q_ptr`` ``[M, H]`` contiguous and ``s_ptr``, row stride ``s_sm``): with ``TILES``
    pass 2 quantises the 1x128 tiles of each piece as it goes, per row it takes the row's amax
    and pass 3 reloads ``y`` and quantises it (``VEC`` as in the fused kernel)."""
    row = tl.program_id(0)
    x_row = row_offsets(row, x_inner, s_x0, s_x1, X_SPLIT)
    r_row = row_offsets(row, r_inner, s_r0, s_r1, R_SPLIT)
    h_row = row_offsets(row, h_inner, s_h0, s_h1, H_SPLIT)
    y_row = row_offsets(row, y_inner, s_y0, s_y1, Y_SPLIT)
    rc = tl.arange(0, BLOCK_C)
    sq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + rc
        mask = cols < H
        c64 = cols.to(tl.int64)
        h = input_with_residual(x_ptr + x_row + c64 * s_xh, r_ptr + r_row + c64 * s_rh, h_ptr + h_row + c64 * s_hh,
                                 mask, HAS_RES)
        sq += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / H + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.debug_barrier()  # pass 2 reads h written by pass 1
    # pass 2 is elementwise, so its pieces may be wider than pass 1's: whole 1x128 fp8 tiles
    BLOCK_Q: tl.constexpr = 128 if TILES and BLOCK_C < 128 else BLOCK_C
    rq = tl.arange(0, BLOCK_Q)
    amax = tl.zeros((BLOCK_Q,), dtype=tl.float32)  # (FP8 per row) the row's |y|, elementwise over its pieces
    for c0 in range(0, H, BLOCK_Q):
        cols = c0 + rq
        mask = cols < H
        c64 = cols.to(tl.int64)
        if FP8:
            c64 = tl.max_contiguous(c64, VEC)
        if HAS_RES:
            h = tl.load(h_ptr + h_row + c64 * s_hh, mask=mask, other=0.0).to(tl.float32)
        else:
            h = tl.load(x_ptr + x_row + c64 * s_xh, mask=mask, other=0.0).to(tl.float32)
        y = h * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            y = tl.where(mask, stored(y, y_ptr + y_row + c64 * s_yh, mask, EMULATE), 0.0)
            if TILES:
                rm = row + tl.arange(0, 1)
                rm64 = rm.to(tl.int64)
                store_e4m3_tiles(y[None, :], q_ptr + rm64 * H, s_ptr + rm64 * s_sm, c64,
                                 (rm < M)[:, None] & mask[None, :], rm < M, c0 // 128, s_sm, EMULATE, 1, BLOCK_Q)
            else:
                amax = tl.maximum(amax, tl.abs(y))
        else:
            tl.store(y_ptr + y_row + c64 * s_yh, y.to(y_ptr.dtype.element_ty), mask=mask)
    if FP8 and not TILES:
        scale = group_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        tl.debug_barrier()  # pass 3 reads y written by pass 2
        q_row = q_ptr + row.to(tl.int64) * H
        for c0 in range(0, H, BLOCK_Q):
            cols = c0 + rq
            mask = cols < H
            c64 = tl.max_contiguous(cols.to(tl.int64), VEC)
            y = to_fp32(tl.load(y_ptr + y_row + c64 * s_yh, mask=mask, other=0.0), EMULATE)
            tl.store(q_row + c64, to_e4m3(tl.math.div_rn(y, scale), EMULATE), mask=mask)


@triton.jit
def rmsnorm_bwd_looped_kernel(
    dy_ptr, h_ptr, w_ptr, rstd_ptr, dhin_ptr, dx_ptr, dw_ptr,
    M, H, rows_per_program,
    dy_inner, s_dy0, s_dy1, s_dyh,
    h_inner, s_h0, s_h1, s_hh,
    g_inner, s_g0, s_g1, s_gh,
    dx_inner, s_dx0, s_dx1, s_dxh,
    DY_SPLIT: tl.constexpr, H_SPLIT: tl.constexpr, G_SPLIT: tl.constexpr, DX_SPLIT: tl.constexpr,
    HAS_DHIN: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The backward of wide rows: per row, pass 1 sums ``dn * n``, pass 2 writes ``dx`` and adds
    ``dy * n`` into this program's fp32 row of partial weight gradients ``dw_ptr[pid, :]``."""
    pid = tl.program_id(0)
    rc = tl.arange(0, BLOCK_C)
    row_start = pid * rows_per_program
    for r in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        row = pid * 0 + r  # a tensor under the interpreter too (row_offsets casts it)
        h_row = row_offsets(row, h_inner, s_h0, s_h1, H_SPLIT)
        dy_row = row_offsets(row, dy_inner, s_dy0, s_dy1, DY_SPLIT)
        rstd = tl.load(rstd_ptr + row)
        part = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for c0 in range(0, H, BLOCK_C):
            cols = c0 + rc
            mask = cols < H
            c64 = cols.to(tl.int64)
            n = tl.load(h_ptr + h_row + c64 * s_hh, mask=mask, other=0.0).to(tl.float32) * rstd
            dn = tl.load(dy_ptr + dy_row + c64 * s_dyh, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                dn = dn * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            part += dn * n
        c = tl.sum(part, axis=0) / H
        g_row = row_offsets(row, g_inner, s_g0, s_g1, G_SPLIT)
        dx_row = row_offsets(row, dx_inner, s_dx0, s_dx1, DX_SPLIT)
        for c0 in range(0, H, BLOCK_C):
            cols = c0 + rc
            mask = cols < H
            c64 = cols.to(tl.int64)
            n = tl.load(h_ptr + h_row + c64 * s_hh, mask=mask, other=0.0).to(tl.float32) * rstd
            dy = tl.load(dy_ptr + dy_row + c64 * s_dyh, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                dn = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                dw_off = pid.to(tl.int64) * H + c64
                tl.store(dw_ptr + dw_off, tl.load(dw_ptr + dw_off, mask=mask, other=0.0) + dy * n, mask=mask)
            else:
                dn = dy
            dh = rstd * (dn - n * c)
            if HAS_DHIN:
                dh += tl.load(dhin_ptr + g_row + c64 * s_gh, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + dx_row + c64 * s_dxh, dh.to(dx_ptr.dtype.element_ty), mask=mask)
