"""The fp8 output of the GEMM epilogue (blockwise recipe): the stored output quantised per 1x128 tile.

``matmul(..., fp8_out=(q, scale))`` (:func:`~fusedpar.kernels.gemm.matmul`) stores ``C =
act(A @ B + bias) (+ R)`` in its 16-bit (or fp32) dtype as without it and, in the same epilogue,
its e4m3 quantisation for the next fp8 GEMM: one scale per 1x128 tile along the output features
(DeepSeek-V3's activations), ``q`` and ``scale`` equal to ``quantize_e4m3(C, "tile")`` bit for bit.
The values quantised are those stored (rounded to C's dtype and widened again), with
:mod:`.fp8`'s :func:`~fusedpar.kernels.fp8.group_scale` and :func:`~fusedpar.kernels.fp8.to_e4m3`
(``EMULATE``: the interpreter's exact casts), as in the fused RMSNorm's fp8 output.

A tile lies inside one program exactly when the program's ``BLOCK_N`` is a multiple of 128 (an
output of at most 128 features is one tile, masked): the launches with the fp8 output take only
such tiles (:func:`fp8_output_configs`, :data:`FP8_OUT_CONFIGS`, :data:`FP8_OUT_INTERPRETER_CONFIG`). The rowwise recipe
is not fused: its scale needs the amax of the whole row, across every column program (a
cross-program reduction, then a second pass over the tile, is no win over
``quantize_e4m3(C, "row")``'s one read of C).

The 16-bit output is still written: the down projection's weight gradient needs the activation
scaled along the tokens (or in high precision), which a feature-tiled ``q`` cannot give, and a
residual stream reads it.

Layers: :func:`~fusedpar.kernels.fp8.store_e4m3_tiles` (jit, called by ``_gemm_kernel``'s epilogue) ->
:func:`check_fp8_output` / :func:`fp8_output_args` (host: the buffers' checks, the kernel's
arguments; :func:`fp8_output_empty` allocates them).
"""
from __future__ import annotations

import torch
import triton

from .checks import check_same, check_shape, check_tensor
from .fp8 import FP8_BLOCK, check_fp8_device, quantize_e4m3
from .runtime import RowView, cdiv, interpreting

__all__ = ["FP8_OUT_CONFIGS", "FP8_OUT_INTERPRETER_CONFIG", "check_fp8_output", "fp8_output_args", "fp8_output_configs",
           "fp8_output_empty", "quantize_output"]

#: the interpreter's tile with the fp8 output: one 1x128 tile per program row (gemm's
#: INTERPRETER_CONFIG otherwise)
FP8_OUT_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=32, GROUP_M=4)


#: tiles only the fp8-output launches take (the GEMM's autotuner lists them after its shared
#: candidates, which hold no 128-wide tile of BLOCK_K 32 under 128 rows): those of gated, unaligned
#: (BLOCK_K 32) and fp32 FMA epilogues, whose budgets prune every 128-wide shared candidate
FP8_OUT_CONFIGS = tuple(triton.Config(dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=32, GROUP_M=8), num_stages=4, num_warps=8)
                        for bm in (64, 32))


def fp8_output_configs(configs, fp8_out: bool) -> list:
    """The GEMM tile configs a launch may take: with the fp8 output those whose ``BLOCK_N`` is a
    multiple of 128 (whole 1x128 tiles per program), without it all but :data:`FP8_OUT_CONFIGS`."""
    if fp8_out:
        return [c for c in configs if c.kwargs["BLOCK_N"] % FP8_BLOCK == 0]
    return [c for c in configs if not any(c is e for e in FP8_OUT_CONFIGS)]


def check_fp8_output(out: torch.Tensor, fp8_out) -> None:
    """Check ``fp8_out`` (None, or the ``(q, scale)`` of the output ``out``, ``[..., N]``):
    ``float8_e4m3fn`` of ``out``'s shape and fp32 ``out.shape[:-1] + (ceil(N / 128),)`` on its
    device, any row strides, each row contiguous; on a GPU with fp8 tensor cores."""
    if fp8_out is None:
        return
    if not isinstance(fp8_out, (tuple, list)) or len(fp8_out) != 2:
        raise TypeError(f"fp8_out must be a (q, scale) pair of tensors, got {type(fp8_out).__name__}")
    shapes = (tuple(out.shape), tuple(out.shape[:-1]) + (cdiv(out.shape[-1], FP8_BLOCK),))
    for name, t, shape, dt in zip(("fp8_out[0] (q)", "fp8_out[1] (scale)"), fp8_out, shapes,
                                  (torch.float8_e4m3fn, torch.float32)):
        check_tensor(name, t, dtypes=(dt,))
        check_shape(name, t, shape)
        check_same(name, t, "out", out, dtype=False)
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last stride 1), got strides {t.stride()}")
    check_fp8_device(out, option="matmul's fp8_out (the GEMM epilogue's e4m3 output)")


def fp8_output_empty(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous ``(q, scale)`` buffers for the fp8 output of ``out`` (``[..., N]``)."""
    n = out.shape[-1]
    return (torch.empty(out.shape, device=out.device, dtype=torch.float8_e4m3fn),
            torch.empty(tuple(out.shape[:-1]) + (cdiv(n, FP8_BLOCK),), device=out.device, dtype=torch.float32))


#: the kernel arguments of an absent fp8 output: (q, scale, q rows, scale rows, tiles) and flags
_NO_ROWS = RowView(1, 0, 0, False)
_NO_FLAGS = dict(FP8_OUT=False, Q_M_SPLIT=False, S_M_SPLIT=False, EMULATE=False)


def fp8_output_args(fp8_out, out: torch.Tensor) -> tuple[tuple, dict]:
    """``_gemm_kernel``'s fp8-output arguments (``q_ptr, s_ptr``, the row views of both, the
    tiles per row) and constexpr flags, for ``fp8_out = (q, scale)`` or None (``out`` stands in
    for the pointers)."""
    if fp8_out is None:
        return (out, out, *_NO_ROWS.args(), *_NO_ROWS.args(), 1), _NO_FLAGS
    q, scale = fp8_out
    q_rows, s_rows = RowView.rows(q), RowView.rows(scale)
    return ((q, scale, *q_rows.args(), *s_rows.args(), scale.shape[-1]),
            dict(FP8_OUT=True, Q_M_SPLIT=q_rows.split, S_M_SPLIT=s_rows.split, EMULATE=interpreting()))


def quantize_output(out: torch.Tensor, fp8_out) -> None:
    """``fp8_out = quantize_e4m3(out, "tile")`` of the rows of ``out`` (an epilogue that runs after
    its GEMM: an empty contraction, a launch that does not fuse it); contiguous buffers are written
    in place; nothing when ``fp8_out`` is None."""
    if fp8_out is None:
        return
    q, scale = fp8_out
    n = out.shape[-1]
    if q.is_contiguous() and scale.is_contiguous():
        quantize_e4m3(out.reshape(-1, n), "tile", out=(q.view(-1, n), scale.view(-1, scale.shape[-1])))
        return
    q2, s2 = quantize_e4m3(out.reshape(-1, n), "tile")
    q.copy_(q2.view(q.shape))
    scale.copy_(s2.view(scale.shape))
