"""fp8 (e4m3) quantisation: scales from the current amax and the cast, row by row or block by block.

Granularities (``scale = max(amax / 448, 2^-126)`` of each group, ``q = e4m3(x / scale)``):

* ``"row"``: one scale per row of a 2-D tensor (the rowwise recipe: activations and gradients per
  token, weights per output row);
* ``"tile"``: one scale per 1x128 tile along a row (DeepSeek-V3's activations and gradients);
* ``"block"``: one scale per 128x128 block (DeepSeek-V3's weights).

The last tile / block of a row or column may be ragged: its amax covers the elements it has.
:func:`quantize_e4m3` quantises the rows of a 2-D tensor of any strides (``x.t()`` quantises the
columns of ``x``, the transposed scaling a backward needs), or of each matrix of a 3-D one (expert
weights), into a ``[R, C]`` ``float8_e4m3fn`` tensor and an fp32 scale tensor (``[R]``,
``[R, ceil(C/128)]``, ``[ceil(R/128), ceil(C/128)]``), new or given (row views of a packed byte
buffer). :func:`quantize_e4m3_groups` quantises the columns of ``[M, F]`` rows along the rows
within each group of rows (a grouped weight gradient's operands: its contraction runs over a
group's rows), per group ("row") or per 128-row tile of a group ("tile"), into a transposed
``[F, P]`` layout whose groups start 16-byte aligned (:func:`group_columns`, :func:`group_tiles`).

The range is guarded: 448 is e4m3's largest finite value, so the group's amax maps to 448 and
nothing else saturates; an all-zero group gets the floor ``2^-126`` (the smallest normal fp32: the
scale stays normal, finite and positive, ``x / scale`` never divides by zero). Both divisions are
IEEE round-to-nearest (``tl.math.div_rn``), so the results equal torch's
``(x.float() / scale).to(torch.float8_e4m3fn)`` bit for bit (:func:`quantize_e4m3_reference`).

The cast (:func:`to_e4m3`): compiled, Triton lowers the fp32 -> e4m3 conversion to a
round-to-nearest-even conversion that saturates to +-448 and keeps NaN (``cvt.rn.satfinite``).
Triton's interpreter does not (upstream triton issue 8322): its conversion loses a rounding carry
into the exponent (1.99 -> 1.0), flushes subnormals and gives garbage above 448; its fp32 -> bf16
cast truncates, and its bf16 -> fp32 conversion gets bf16 subnormals wrong. Under the interpreter
the kernels therefore round to the e4m3 grid in fp32 and encode the byte themselves (Triton 3.6's
conversion also turns -0.0 into +0), round to the bf16 grid (:func:`round_to_bf16`) before that
cast, and widen bf16 through its bits (:func:`to_fp32`), behind the constexpr ``EMULATE`` that
only the interpreter sets.

fp8 tensor cores exist from compute capability 8.9 (Ada, Hopper): launches on an older GPU raise
:class:`FP8UnsupportedError` naming the device (:func:`check_fp8_device`).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .checks import check_choice, check_float_tensor, check_same, check_shape, check_tensor
from .launch import launch_kernel
from .moe_permute import as_group_offsets
from .runtime import cdiv, device_capability, interpreting, on_device

__all__ = ["DEFAULT_FP8_OPTION", "E4M3_MAX", "FP8_BLOCK", "FP8_MIN_CAPABILITY", "GRANULARITIES", "SCALE_FLOOR", "FP8UnsupportedError",
           "check_fp8_device", "dequantize_e4m3", "fp8_support_problem", "group_columns", "group_scale",
           "group_tiles", "quantize_e4m3",
           "quantize_e4m3_groups", "quantize_e4m3_groups_reference", "quantize_e4m3_reference", "rne_for_store",
           "round_to_bf16",
           "scale_shape", "store_e4m3_tiles", "to_e4m3", "to_fp32"]

#: e4m3's largest finite value: a group's amax maps to it
E4M3_MAX = 448.0
#: the smallest scale (the smallest normal fp32): the scale of an all-zero group
SCALE_FLOOR = 2.0 ** -126
#: the side of DeepSeek-V3's tiles (1 x 128) and blocks (128 x 128)
FP8_BLOCK = 128
GRANULARITIES = ("row", "tile", "block")
#: fp8 tensor cores: Ada (8.9) and Hopper (9.0) or later
FP8_MIN_CAPABILITY = (8, 9)


class FP8UnsupportedError(RuntimeError):
    """An fp8 kernel launched on a GPU without fp8 tensor cores (compute capability < 8.9)."""


#: what an fp8 error names when the caller does not say which option asked for fp8
DEFAULT_FP8_OPTION = "the fp8 option (fp8_linear / recipe=...)"


def fp8_support_problem(capability, device_name: str, option: str = DEFAULT_FP8_OPTION) -> str | None:
    """Why a GPU of ``capability`` cannot run the fp8 kernels (naming the device and ``option``,
    the setting that asked for fp8, e.g. ``"TransformerConfig.fp8='rowwise'"``), or None."""
    if tuple(capability) >= FP8_MIN_CAPABILITY:
        return None
    return (f"fp8 (e4m3) kernels need fp8 tensor cores (compute capability >= 8.9: Ada, Hopper or later); "
            f"{device_name} has compute capability {capability[0]}.{capability[1]}: leave {option} off "
            f"on this GPU")


def check_fp8_device(t: torch.Tensor, option: str = DEFAULT_FP8_OPTION) -> None:
    """Raise :class:`FP8UnsupportedError` naming the device and ``option`` when ``t`` lives on a
    GPU without fp8 tensor cores (CPU tensors run under the interpreter, which has no such limit).
    While Dynamo traces (a functional API or a module called in a compiled region) it checks
    nothing, since the device query is no graph op: the launchers inside the ops check when they run."""
    if t.device.type == "cpu" or torch.compiler.is_compiling():
        return
    index = t.device.index or 0
    problem = fp8_support_problem(device_capability(index), torch.cuda.get_device_name(index), option)
    if problem:
        raise FP8UnsupportedError(problem)


# --------------------------------------------------------------------------------------------
# jit helpers: the casts, exact under the interpreter too
# --------------------------------------------------------------------------------------------
@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 ``x`` to ``float8e4nv``: round to nearest even, saturate to +-448, NaN stays NaN.
    ``EMULATE`` (interpreter only): round to the e4m3 grid in fp32 and encode (module docstring)."""
    if EMULATE:
        nan = x != x  # before the clamp: the GPU's and Triton 3.9's minimum / maximum drop NaN (3.6's keep it)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        # the grid step of |x|: 2^(e - 3) for a normal exponent e >= -6, 2^-9 for subnormals
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e + 124) << 23).to(tl.float32, bitcast=True)
        # |x| / step < 16 is exact; adding and subtracting 1.5 * 2^23 rounds it to an integer,
        # ties to even; the sign bit is put back afterwards (-0.0 and negatives rounding to zero)
        mag = ((tl.abs(x) / step + 12582912.0) - 12582912.0) * step
        # on the grid, encoded here (Triton 3.6's interpreter cast drops the sign of a zero):
        # a normal's e4m3 mantissa is fp32's top 3 mantissa bits, a subnormal's is mag / 2^-9
        mag = tl.where(nan, 0.0, mag)  # (3.6: no NaN into the int cast below)
        m = mag.to(tl.int32, bitcast=True)
        e_mag = ((m >> 23) & 0xFF) - 127
        code = tl.where(e_mag >= -6, ((e_mag + 7) << 3) | ((m >> 20) & 7), (mag * 512.0).to(tl.int32))
        code = tl.where(nan, 0x7F, tl.where(bits < 0, code | 0x80, code))  # NaN: 0x7F, as the GPU's
        q = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        q = x.to(tl.float8e4nv)
    return q


@triton.jit
def to_fp32(x, EMULATE: tl.constexpr):
    """A loaded tile in fp32. ``EMULATE`` (interpreter only): bf16 through its bits, because the
    interpreter's bf16 -> fp32 conversion gets bf16 subnormals wrong (the GPU's is exact)."""
    if EMULATE and x.dtype == tl.bfloat16:
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the bf16 grid (nearest even), still fp32: the interpreter's fp32 ->
    bf16 cast truncates, the GPU's rounds; cast after this, both give the same bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def rne_for_store(x, ptr):
    """fp32 ``x`` rounded to the bf16 grid (:func:`round_to_bf16`) when ``ptr`` points to bf16,
    else unchanged: called under ``EMULATE`` before a store (the interpreter's cast truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = round_to_bf16(x)
    return x


@triton.jit
def group_scale(amax):
    """The fp32 scale of a group whose fp32 amax is ``amax`` (any tile shape): ``max(amax / 448,
    2^-126)``, the division IEEE round-to-nearest (module docstring). Every quantising kernel
    (the quantise passes, the fused RMSNorm's and GEMM epilogue's fp8 outputs) takes its scales from
    this one helper."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)  # SCALE_FLOOR


@triton.jit
def store_e4m3_tiles(y, q_rows, s_rows, rn, out_mask, m_mask, first_tile, n_tiles, EMULATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantise the fp32 tile ``y`` (the values stored, widened again, zero outside ``out_mask``)
    per 1x128 tile of its columns ``rn``: e4m3 values at ``q_rows[:, None] + rn`` (``q_rows``,
    ``s_rows``: pointers to the rows; unit column stride) and one fp32 scale per tile at
    ``s_rows[:, None] + tile``,
    tiles ``first_tile ..`` of the row's ``n_tiles`` (a ragged last tile takes the amax of the
    columns it has; a tile at or past ``n_tiles``, the second column half of an epilogue split in
    halves past the last column, is not stored: its scale would land in the next row)."""
    tl.static_assert(BLOCK_N % 128 == 0, "the fp8 output needs BLOCK_N a multiple of 128 (whole 1x128 tiles)")
    NB: tl.constexpr = BLOCK_N // 128
    if NB == 1:  # one tile per row: no reshape
        scale = group_scale(tl.max(tl.abs(y), axis=1))
        # (a where, not m_mask & (first_tile < n_tiles): the interpreter cannot store under that mask)
        tl.store(s_rows + first_tile, scale, mask=tl.where(first_tile < n_tiles, m_mask, False))
        q = to_e4m3(tl.math.div_rn(y, scale[:, None]), EMULATE)
    else:
        y3 = tl.reshape(y, (BLOCK_M, NB, 128))
        scale = group_scale(tl.max(tl.abs(y3), axis=2))
        tiles = first_tile + tl.arange(0, NB)
        tl.store(s_rows[:, None] + tiles[None, :], scale, mask=m_mask[:, None] & (tiles < n_tiles)[None, :])
        q = to_e4m3(tl.reshape(tl.math.div_rn(y3, scale[:, :, None]), (BLOCK_M, BLOCK_N)), EMULATE)
    tl.store(q_rows[:, None] + rn.to(tl.int64)[None, :], q, mask=out_mask)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, R, C, s_xb, s_xr, s_xc, s_qb, s_qr, s_sb, s_sr, EMULATE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One scale per row: the row's amax over every column (first loop), then the cast (second).
    Program axis 1: the matrix of a batch."""
    b = tl.program_id(1).to(tl.int64)
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rr < R
    rr64 = rr.to(tl.int64)
    x_rows = x_ptr + b * s_xb + rr64[:, None] * s_xr
    q_rows = q_ptr + b * s_qb + rr64[:, None] * s_qr
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, tl.cdiv(C, BLOCK_C)):
        cc = c0 * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = r_mask[:, None] & (cc < C)[None, :]
        x = to_fp32(tl.load(x_rows + cc.to(tl.int64)[None, :] * s_xc, mask=mask, other=0.0), EMULATE)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = group_scale(amax)
    tl.store(s_ptr + b * s_sb + rr64 * s_sr, scale, mask=r_mask)
    for c0 in range(0, tl.cdiv(C, BLOCK_C)):
        cc = c0 * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = r_mask[:, None] & (cc < C)[None, :]
        x = to_fp32(tl.load(x_rows + cc.to(tl.int64)[None, :] * s_xc, mask=mask, other=0.0), EMULATE)
        q = to_e4m3(tl.math.div_rn(x, scale[:, None]), EMULATE)
        tl.store(q_rows + cc[None, :], q, mask=mask)


@triton.jit
def _quant_blocks_kernel(x_ptr, q_ptr, s_ptr, R, C, s_xb, s_xr, s_xc, s_qb, s_qr, s_sb, s_sr, n_cblocks,
                         ONE_ROW: tl.constexpr, EMULATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One scale per 1 x BLOCK_C tile (``ONE_ROW``) or per BLOCK_R x BLOCK_C block of a
    BLOCK_R x BLOCK_C program tile. Program axis 2: the matrix of a batch."""
    tl.static_assert(BLOCK_C == 128, "fp8 tiles and blocks are 128 wide")
    tl.static_assert(ONE_ROW or BLOCK_R == 128, "a 128x128 block is one program tile")
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_mask = rr < R
    mask = r_mask[:, None] & (cc < C)[None, :]
    rr64 = rr.to(tl.int64)
    x = to_fp32(tl.load(x_ptr + b * s_xb + rr64[:, None] * s_xr + cc.to(tl.int64)[None, :] * s_xc, mask=mask,
                        other=0.0), EMULATE)
    s_ptr += b * s_sb
    if ONE_ROW:
        scale = group_scale(tl.max(tl.abs(x), axis=1))
        tl.store(s_ptr + rr64 * s_sr + pid_c, scale, mask=r_mask)
        q = to_e4m3(tl.math.div_rn(x, scale[:, None]), EMULATE)
    else:
        scale = group_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        tl.store(s_ptr + pid_r.to(tl.int64) * n_cblocks + pid_c, scale)
        q = to_e4m3(tl.math.div_rn(x, scale), EMULATE)
    tl.store(q_ptr + b * s_qb + rr64[:, None] * s_qr + cc[None, :], q, mask=mask)


@triton.jit
def _group_rows(x_ptr, xs_ptr, rr, r_mask, ff64, f_mask, s_xm, s_xf, s_xsm, s_xsf, DEQUANT: tl.constexpr,
                IN_TILES: tl.constexpr, EMULATE: tl.constexpr):
    """Rows ``rr`` of columns ``ff64`` of x in fp32 (``DEQUANT``: e4m3 times its per-row scales,
    ``IN_TILES``: 1x128 tiles along the columns)."""
    rr64 = rr.to(tl.int64)
    mask = r_mask[:, None] & f_mask[None, :]
    x = to_fp32(tl.load(x_ptr + rr64[:, None] * s_xm + ff64[None, :] * s_xf, mask=mask, other=0.0), EMULATE)
    if DEQUANT:
        if IN_TILES:
            x = x * tl.load(xs_ptr + rr64[:, None] * s_xsm + (ff64 // 128)[None, :] * s_xsf, mask=mask, other=0.0)
        else:
            x = x * tl.load(xs_ptr + rr64 * s_xsm, mask=r_mask, other=0.0)[:, None]
    return x


@triton.jit
def _quant_groups_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, offsets_ptr, F, s_xm, s_xf, s_xsm, s_xsf, s_qf, s_sf,
                         TILES: tl.constexpr, DEQUANT: tl.constexpr, IN_TILES: tl.constexpr, EMULATE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    """The columns of group ``g``'s rows ``offsets[g] .. offsets[g+1]`` of ``x [M, F]``, quantised
    along the rows into ``q^T``, row ``r`` of group ``g`` at column ``16 (offsets[g] // 16 + g) + r
    - offsets[g]`` (:func:`group_columns`: each group 16-byte aligned); one scale per (column,
    group), or (``TILES``) per (column, 128-row tile counted from the group's first row), stored
    per tile either way: tile ``t`` of group ``g`` at scale column ``offsets[g] // 128 + g + t``
    (:func:`group_tiles`)."""
    tl.static_assert(BLOCK_T == 128, "the weight-gradient tiles are 128 rows")
    g = tl.program_id(0)
    ff = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = ff < F
    ff64 = ff.to(tl.int64)
    start = tl.load(offsets_ptr + g).to(tl.int32)
    end = tl.load(offsets_ptr + g + 1).to(tl.int32)
    s_cols = s_ptr + ff64 * s_sf
    q_cols = q_ptr + ff64[None, :] * s_qf + (16 * (start // 16 + g) - start)  # row r -> its padded column
    if TILES:
        for t0 in range(start, end, BLOCK_T):
            rr = t0 + tl.arange(0, BLOCK_T)
            r_mask = rr < end
            x = _group_rows(x_ptr, xs_ptr, rr, r_mask, ff64, f_mask, s_xm, s_xf, s_xsm, s_xsf, DEQUANT, IN_TILES,
                            EMULATE)
            scale = group_scale(tl.max(tl.abs(x), axis=0))
            tl.store(s_cols + (start // BLOCK_T + g + (t0 - start) // BLOCK_T).to(tl.int64), scale, mask=f_mask)
            q = to_e4m3(tl.math.div_rn(x, scale[None, :]), EMULATE)
            tl.store(q_cols + rr.to(tl.int64)[:, None], q, mask=r_mask[:, None] & f_mask[None, :])
    else:
        amax = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            rr = t0 + tl.arange(0, BLOCK_T)
            x = _group_rows(x_ptr, xs_ptr, rr, rr < end, ff64, f_mask, s_xm, s_xf, s_xsm, s_xsf, DEQUANT, IN_TILES,
                            EMULATE)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        scale = group_scale(amax)
        for t0 in range(start, end, BLOCK_T):
            rr = t0 + tl.arange(0, BLOCK_T)
            r_mask = rr < end
            x = _group_rows(x_ptr, xs_ptr, rr, r_mask, ff64, f_mask, s_xm, s_xf, s_xsm, s_xsf, DEQUANT, IN_TILES,
                            EMULATE)
            tl.store(s_cols + (start // BLOCK_T + g + (t0 - start) // BLOCK_T).to(tl.int64), scale, mask=f_mask)
            q = to_e4m3(tl.math.div_rn(x, scale[None, :]), EMULATE)
            tl.store(q_cols + rr.to(tl.int64)[:, None], q, mask=r_mask[:, None] & f_mask[None, :])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def scale_shape(rows: int, cols: int, granularity: str) -> tuple:
    """The shape of the fp32 scales of a ``[rows, cols]`` tensor quantised at ``granularity``."""
    nb = cdiv(cols, FP8_BLOCK)
    return {"row": (rows,), "tile": (rows, nb), "block": (cdiv(rows, FP8_BLOCK), nb)}[granularity]


#: fixed launch shapes (memory-bound passes, no tuning), by mode: "interpreted" (few programs: the
#: interpreter's cost is per program and per nested call), "rows" (a row-major
#: input: the loads run along the rows) and "columns" (a transposed view, ``x.t()`` of a row-major
#: tensor: consecutive rows are adjacent in memory, so a program takes 64 of them to read 128 bytes
#: of bf16 at a time); the row kernel's (rows, column chunk, warps), the tile kernel's rows
_ROW_BLOCKS = {"interpreted": (64, 128, 4), "rows": (8, 512, 4), "columns": (64, 64, 4)}
_TILE_ROWS = {"interpreted": 64, "rows": 32, "columns": 64}


def quantize_e4m3(x: torch.Tensor, granularity: str = "row", *,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: the rows of the 2-D tensor ``x`` (any strides; fp32, fp16 or bf16), or of
    each matrix of a 3-D ``[B, R, C]`` one (expert weights: each quantised on its own), quantised
    to a contiguous ``float8_e4m3fn`` tensor of ``x``'s shape with fp32 scales per
    ``granularity`` ("row", "tile": 1x128, "block": 128x128; see the module docstring; shape
    ``x.shape[:-2] +`` :func:`scale_shape`), such that ``x ~ q * scale`` (:func:`dequantize_e4m3`).
    ``out=(q, scale)``: buffers of those shapes and dtypes written in place, e.g. views of a
    packed transfer buffer: rows of any stride, each contiguous (block scales contiguous)."""
    check_float_tensor("x", x, dims=(2, 3))
    check_choice("granularity", granularity, GRANULARITIES)
    check_fp8_device(x)
    lead, (R, C) = tuple(x.shape[:-2]), x.shape[-2:]
    q, scale = _quantize_buffers(out, tuple(x.shape), lead + scale_shape(R, C, granularity), x.device, granularity)
    if x.numel() == 0:
        return q, scale.fill_(1.0)
    x3, q3, s3 = (t if lead else t.unsqueeze(0) for t in (x, q, scale))
    emulate = interpreting()
    mode = "interpreted" if emulate else "columns" if x.stride(-2) == 1 and x.stride(-1) != 1 else "rows"
    strides = (x3.stride(0), x3.stride(1), x3.stride(2), q3.stride(0), q3.stride(1), s3.stride(0),
               s3.stride(1) if granularity != "block" else 0)
    with on_device(x.device):
        if granularity == "row":
            block_r, block_c, warps = _ROW_BLOCKS[mode]
            launch_kernel(
                _quant_rows_kernel, (cdiv(R, block_r), x3.shape[0]),
                (x3, q3, s3, R, C, *strides),
                dict(EMULATE=emulate, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps))
        else:
            one_row = granularity == "tile"
            block_r = _TILE_ROWS[mode] if one_row else FP8_BLOCK
            grid = (cdiv(R, block_r), cdiv(C, FP8_BLOCK), x3.shape[0])
            launch_kernel(
                _quant_blocks_kernel, grid,
                (x3, q3, s3, R, C, *strides, grid[1]),
                dict(ONE_ROW=one_row, EMULATE=emulate, BLOCK_R=block_r, BLOCK_C=FP8_BLOCK,
                     num_warps=4 if one_row else 8))
    return q, scale


def _quantize_buffers(out, q_shape, s_shape, device, granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` checked (``(q, scale)`` of the shapes on ``device``, each row contiguous; block
    scales contiguous), or new contiguous buffers."""
    if out is None:
        return (torch.empty(q_shape, device=device, dtype=torch.float8_e4m3fn),
                torch.empty(s_shape, device=device, dtype=torch.float32))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a (q, scale) pair of tensors, got {type(out).__name__}")
    for name, t, shape, dtype in (("out[0] (q)", out[0], q_shape, torch.float8_e4m3fn),
                                  ("out[1] (scale)", out[1], s_shape, torch.float32)):
        check_tensor(name, t, dtypes=(dtype,))
        check_shape(name, t, tuple(shape))
        rows_ok = t.stride(-1) == 1 or t.shape[-1] <= 1 or (name == "out[1] (scale)" and granularity == "row")
        if t.device != device or not rows_ok or (name == "out[1] (scale)" and granularity == "block"
                                                 and not t.is_contiguous()):
            raise ValueError(f"{name} must be a tensor on {device} with contiguous rows (block scales: contiguous), "
                             f"got strides {t.stride()} on {t.device}")
    return out[0], out[1]


def group_columns(rows: int, groups: int) -> int:
    """Columns of :func:`quantize_e4m3_groups`'s ``q``: group ``g``'s rows from column
    ``16 (offsets[g] // 16 + g)``, so that each group's first element is 16-byte aligned (the
    weight gradient's loads along the rows vectorise) whatever the group sizes."""
    return 16 * (rows // 16 + groups + 1)


def group_tiles(rows: int, groups: int) -> int:
    """Scale columns of :func:`quantize_e4m3_groups`'s "tile" granularity: group ``g``'s 128-row
    tiles start at column ``offsets[g] // 128 + g``, so ``rows // 128 + groups + 1`` bound them
    whatever the group sizes (the grouped GEMM's row-tile bound)."""
    return rows // FP8_BLOCK + groups + 1


def quantize_e4m3_groups(x: torch.Tensor, offsets: torch.Tensor, granularity: str = "row", *,
                         x_scale: torch.Tensor | None = None, check_offsets: bool = True):
    """``(q, scale)``: the columns of ``x [M, F]`` quantised along its rows within each group of
    rows ``offsets[g] .. offsets[g+1]`` (the operands of a grouped weight gradient, whose
    contraction runs over a group's rows). ``q [F, P]`` ``float8_e4m3fn``, ``P =``
    :func:`group_columns` ``(M, G)``: row ``r`` of group ``g`` at column ``16 (offsets[g] // 16 + g)
    + r - offsets[g]`` (each group 16-byte aligned; the other columns zero); fp32
    ``scale [F, group_tiles(P, G)]``, one per column and 128-row tile counted from each group's
    first row (:func:`group_tiles`; unused entries 1): "tile" each tile's own, "row" its group's
    (the amax over all the group's rows, in each of its tiles). ``grouped_wgrad`` takes ``q.t()``.
    ``x``: fp32 / fp16 / bf16, or e4m3 with ``x_scale`` (``[M]`` per row or ``[M, ceil(F/128)]``
    1x128 tiles), dequantised in fp32 first. ``offsets`` as :func:`~fusedpar.kernels.moe_permute.as_group_offsets`
    takes them (``check_offsets=False`` trusts them: no host read)."""
    check_choice("granularity", granularity, ("row", "tile"))
    fp8_in = isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn
    if fp8_in:
        check_tensor("x", x, dims=(2,), dtypes=(torch.float8_e4m3fn,), kernel_device=True)
    else:
        check_float_tensor("x", x, dims=(2,))
    check_fp8_device(x)
    M, F = x.shape
    if fp8_in or x_scale is not None:
        if not fp8_in:
            raise TypeError(f"x_scale is for an e4m3 x (dequantised first), got x of dtype {x.dtype}")
        check_tensor("x_scale", x_scale, dims=(1, 2), dtypes=(torch.float32,))
        check_shape("x_scale", x_scale, (M,) if x_scale.dim() == 1 else (M, cdiv(F, FP8_BLOCK)))
        check_same("x_scale", x_scale, "x", x, dtype=False)
    offsets = as_group_offsets(offsets, M, x.device, check=check_offsets)
    G = offsets.numel() - 1
    P = group_columns(M, G)
    q = torch.zeros((F, P), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.ones((F, group_tiles(P, G)), device=x.device, dtype=torch.float32)
    if M == 0 or F == 0:
        return q, scale
    xs = x_scale if x_scale is not None else x
    in_tiles = x_scale is not None and x_scale.dim() == 2
    block_f = 128 if interpreting() else 64  # (interpreted: fewer, larger programs)
    with on_device(x.device):
        launch_kernel(
            _quant_groups_kernel, (G, cdiv(F, block_f)),
            (x, xs, q, scale, offsets, F, x.stride(0), x.stride(1), xs.stride(0), xs.stride(-1) if in_tiles else 0,
             q.stride(0), scale.stride(0)),
            dict(TILES=granularity == "tile", DEQUANT=x_scale is not None, IN_TILES=in_tiles, EMULATE=interpreting(),
                 BLOCK_T=FP8_BLOCK, BLOCK_F=block_f, num_warps=8))
    return q, scale


def _expand(scale: torch.Tensor, rows: int, cols: int, granularity: str) -> torch.Tensor:
    """``scale`` broadcast to one value per element of a ``[rows, cols]`` tensor."""
    if granularity == "row":
        return scale[:, None].expand(rows, cols)
    s = scale.repeat_interleave(FP8_BLOCK, dim=1)[:, :cols]
    if granularity == "block":
        s = s.repeat_interleave(FP8_BLOCK, dim=0)[:rows]
    return s


def quantize_e4m3_reference(x: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantize_e4m3` computes, in plain torch (fp32 amax, scale and division, torch's
    e4m3 cast of the values clamped to +-448): the tests' bit-exact oracle, on any device. Every
    division is tensor by tensor: torch's CUDA division by a Python number multiplies by the
    number's rounded reciprocal, which is not ``amax / 448`` to the last bit."""
    check_choice("granularity", granularity, GRANULARITIES)
    xf = x.float()
    R, C = xf.shape
    a = xf.abs()
    if granularity == "row":
        amax = a.amax(dim=1) if C else a.new_zeros(R)
    else:
        nb, pad_r = cdiv(C, FP8_BLOCK), (-R) % FP8_BLOCK
        padded = torch.nn.functional.pad(a, (0, nb * FP8_BLOCK - C, 0, pad_r if granularity == "block" else 0))
        if granularity == "tile":
            amax = padded.view(R, nb, FP8_BLOCK).amax(dim=2)
        else:
            amax = padded.view(-1, FP8_BLOCK, nb, FP8_BLOCK).amax(dim=(1, 3))
    scale = torch.clamp(amax / amax.new_tensor(E4M3_MAX), min=SCALE_FLOOR)
    q = (xf / _expand(scale, R, C, granularity)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor, granularity: str = "row",
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (float64 by default: exact), ``granularity`` as quantised."""
    check_choice("granularity", granularity, GRANULARITIES)
    R, C = q.shape
    return q.to(dtype) * _expand(scale.to(dtype), R, C, granularity)


def quantize_e4m3_groups_reference(x: torch.Tensor, offsets, granularity: str = "row",
                                   x_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantize_e4m3_groups` computes, in plain torch: :func:`quantize_e4m3_reference`
    of each group's transposed rows (an e4m3 ``x`` dequantised in fp32 first), at the same columns."""
    offs = [int(v) for v in offsets]
    xf = x.float() if x_scale is None else dequantize_e4m3(x, x_scale, "row" if x_scale.dim() == 1 else "tile",
                                                           torch.float32)
    (M, F), G = xf.shape, len(offs) - 1
    P = group_columns(M, G)
    q = torch.zeros((F, P), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.ones((F, group_tiles(P, G)), device=x.device)
    for g in range(G):
        a, b = offs[g], offs[g + 1]
        if a == b:
            continue
        c = 16 * (a // 16 + g)
        q[:, c:c + b - a], sg = quantize_e4m3_reference(xf[a:b].t(), granularity)
        tiles = cdiv(b - a, FP8_BLOCK)
        scale[:, a // FP8_BLOCK + g:a // FP8_BLOCK + g + tiles] = sg[:, None] if granularity == "row" else sg
    return q, scale
