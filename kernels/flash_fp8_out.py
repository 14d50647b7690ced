"""The fp8 output of the flash-attention forward (blockwise recipe): the stored output quantised per 1x128 tile.

``flash_attention_forward(..., fp8_out=(q8, scale))`` (and ``flash_attention_varlen``) stores
``out [b, sq, hq, d_v]`` as without it and, in the same epilogue, its e4m3 quantisation for the
next fp8 GEMM (o_proj, which reads the flattened features ``[b * sq, hq * d_v]``): one scale per
1x128 tile of those features, ``q8`` (``float8_e4m3fn``, out's shape) and ``scale`` (fp32
``[b, sq, hq * d_v // 128]``) equal to ``quantize_e4m3(out.reshape(b * sq, hq * d_v), "tile")``
bit for bit. The values quantised are those stored (rounded to out's dtype and widened again), with
:func:`~fusedpar.kernels.fp8.store_e4m3_tiles` as the GEMM epilogue's fp8 output
(:mod:`.gemm_fp8_epilogue`) does; under the interpreter (``EMULATE``) the forward rounds a bf16
``out`` to nearest even before its store, as the GPU's cast does, with or without ``fp8_out``.

A forward program owns ``BLOCK_M`` query rows of one head, all its ``d_v`` columns: a 1x128 tile
lies inside one program exactly when ``d_v % 128 == 0`` (d_v 128 or 256: head ``h`` holds tiles
``h * d_v // 128 ..``); any other ``d_v`` is refused (:func:`check_attention_fp8_out`: quantise
``out`` with ``quantize_e4m3`` instead). The rowwise recipe is not fused (a row's amax spans every
head, i.e. every program), nor is ``accumulate=True`` (ring steps merge normalised fp32 states:
the final output is only known after the last step).

Layers: the forward kernel's ``FP8_OUT`` epilogue (:mod:`.flash_attention`) ->
:func:`check_attention_fp8_out` / :func:`attention_fp8_args` (host: the buffers' checks, the
kernel's arguments) and :func:`fill_empty_fp8_out` (attention over no key: ``out = 0``).
"""
from __future__ import annotations

import torch

from .checks import check_shape, check_tensor
from .fp8 import FP8_BLOCK, SCALE_FLOOR, check_fp8_device
from .runtime import interpreting

__all__ = ["attention_fp8_args", "check_attention_fp8_out", "check_fp8_head_dim", "fill_empty_fp8_out"]

#: what the fp8 errors name as the option that asked for fp8
_OPTION = "flash attention's fp8_out (the attention epilogue's e4m3 output)"


def check_fp8_head_dim(name: str, d_v: int) -> None:
    """The rule of the fused e4m3 output: ``d_v`` a multiple of 128 (each head whole 1x128 tiles of
    the ``[..., hq * d_v]`` features, inside one program); ``name`` is the option that asked."""
    if d_v % FP8_BLOCK:
        raise ValueError(f"{name} needs v's head dim d_v to be a multiple of {FP8_BLOCK} (whole 1x128 tiles per "
                         f"head), got d_v={d_v}: quantise out with quantize_e4m3(out.reshape(-1, hq * d_v), 'tile') "
                         "instead")


def check_attention_fp8_out(fp8_out, out_shape, device: torch.device, *, accumulate: bool = False) -> None:
    """Check ``fp8_out`` (None, or the ``(q8, scale)`` of an output of shape ``out_shape``,
    ``[..., hq, d_v]``): ``d_v`` a multiple of 128, no ``accumulate``; ``q8`` ``float8_e4m3fn`` of
    ``out_shape``, ``scale`` fp32 ``out_shape[:-2] + (hq * d_v // 128,)``, both on ``device`` with
    contiguous rows (last stride 1; other strides free); on a GPU with fp8 tensor cores."""
    if fp8_out is None:
        return
    *lead, hq, d_v = out_shape
    check_fp8_head_dim("fp8_out", d_v)
    if accumulate:
        raise ValueError("fp8_out is not supported with accumulate=True (ring steps merge normalised fp32 states): "
                         "quantise the final output with quantize_e4m3(out.reshape(-1, hq * d_v), 'tile')")
    if not isinstance(fp8_out, (tuple, list)) or len(fp8_out) != 2:
        raise TypeError(f"fp8_out must be a (q8, scale) pair of tensors, got {type(fp8_out).__name__}")
    shapes = (tuple(out_shape), (*lead, hq * d_v // FP8_BLOCK))
    for name, t, shape, dt in zip(("fp8_out[0] (q8)", "fp8_out[1] (scale)"), fp8_out, shapes,
                                  (torch.float8_e4m3fn, torch.float32)):
        check_tensor(name, t, dtypes=(dt,))
        check_shape(name, t, shape)
        if t.device != device:
            raise ValueError(f"{name} must be on out's device {device}, got {t.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last stride 1), got strides {t.stride()}")
    check_fp8_device(fp8_out[0], option=_OPTION)


def attention_fp8_args(fp8_out, out: torch.Tensor) -> tuple[tuple, dict]:
    """The forward kernel's fp8-output arguments (``q8_ptr, s8_ptr``, then q8's batch / row / head
    strides and scale's batch / row strides) and constexpr flags (``FP8_OUT``, ``EMULATE``: the
    interpreter's exact casts, set whenever interpreting), for ``fp8_out = (q8, scale)`` or None
    (``out`` stands in for the pointers)."""
    if fp8_out is None:
        return (out, out, 0, 0, 0, 0, 0), dict(FP8_OUT=False, EMULATE=interpreting())
    q8, scale = fp8_out
    return ((q8, scale, *q8.stride()[:3], *scale.stride()[:2]), dict(FP8_OUT=True, EMULATE=interpreting()))


def fill_empty_fp8_out(fp8_out) -> None:
    """``fp8_out`` of an all-zero output (attention over no key): q8 zeros, every scale the floor
    ``2^-126`` (what ``quantize_e4m3`` gives a zero tile); nothing when ``fp8_out`` is None."""
    if fp8_out is not None:
        fp8_out[0].zero_()
        fp8_out[1].fill_(SCALE_FLOOR)
