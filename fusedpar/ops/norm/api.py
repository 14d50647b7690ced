"""RMSNorm (+ fused residual add), the functional API over the custom ops of :mod:`.custom_ops`.

``rms_norm(x, weight, eps)`` returns ``y``; with ``residual=r`` it returns ``(y, h)``, ``h = x +
r`` the new residual stream. ``rms_norm_fp8(x, weight, eps, recipe=...)`` also returns ``y``
quantised for an fp8 GEMM, written by the norm's kernel (bit for bit ``quantize_e4m3`` of ``y``).
``sharded_rms_norm(x, weight, eps, group=...)`` normalises rows whose features are split over a
group (one fp32 all-reduce of the row statistics each way)."""
from __future__ import annotations

import torch

from fusedpar.kernels.rmsnorm import check_rms_norm_fp8_inputs, check_rms_norm_inputs
from fusedpar.ops.comm.keys import transport_id_of
from fusedpar.ops.common import checked_api
from fusedpar.ops.norm.custom_ops import rms_norm_fp8_op, rms_norm_op, sharded_rms_norm_op


@checked_api
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None):
    """Fused RMSNorm over the last dim, fp32 statistics.

    Returns ``y = x * rsqrt(mean(x^2) + eps) * weight`` in ``x.dtype``; with ``residual`` the
    sum ``h = x + residual`` (in the residual's dtype) is normalised instead and ``(y, h)`` is
    returned. ``x`` may be any ``[..., H]`` tensor; 2-D and 3-D strided views are read in place.
    The custom op :data:`~fusedpar.ops.norm.custom_ops.rms_norm_op` (``fusedpar::rms_norm``):
    traceable by ``torch.compile``.
    """
    check_rms_norm_inputs(x, weight, eps, residual)  # before the schema sees the arguments
    y, h, _ = rms_norm_op(x, weight, residual, float(eps))
    return y if residual is None else (y, h)


@checked_api
def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                 residual: torch.Tensor | None = None, recipe: str = "rowwise"):
    """:func:`rms_norm` with ``y`` also quantised for an fp8 GEMM in the same kernel.

    Returns ``(y, q, scale)``, with ``residual`` ``(y, h, q, scale)``: ``rms_norm``'s outputs
    followed by ``q``, ``y`` in ``float8_e4m3fn`` (contiguous, ``x``'s shape), and its fp32
    scales: one per token for ``recipe="rowwise"`` (shape ``x.shape[:-1]``), one per 1x128 tile
    along the features for ``"blockwise"`` (``x.shape[:-1] + (ceil(H / 128),)``; the last tile
    ragged), so that ``y ~ q * scale``. The quantised values are those of the returned ``y`` (its
    dtype's rounding included), with the scales, zero-row floor and saturation of
    :func:`~fusedpar.kernels.quantize_e4m3`: ``(q, scale)`` equal ``quantize_e4m3(y.reshape(-1, H),
    "row" | "tile")`` bit for bit. Gradients flow through ``y`` (and ``h``) exactly as in
    :func:`rms_norm`; ``q`` and ``scale`` are not differentiable. The custom op
    :data:`~fusedpar.ops.norm.custom_ops.rms_norm_fp8_op` (``fusedpar::rms_norm_fp8``).
    """
    check_rms_norm_fp8_inputs(x, weight, eps, residual, recipe)
    y, h, _, q, scale = rms_norm_fp8_op(x, weight, residual, float(eps), recipe)
    return (y, q, scale) if residual is None else (y, h, q, scale)


@checked_api
def sharded_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, group=None,
                     transport=None) -> torch.Tensor:
    """RMSNorm of rows whose features are split over ``group`` (default: the default group) or
    ``transport``: ``x`` ``[..., H / P]`` holds this rank's features of every row, ``weight``
    ``[H / P]`` the same slice of the scale. Returns ``x * rsqrt(mean(x_full^2) + eps) * weight``
    (the mean over all ``H`` features of the row: one fp32 all-reduce per row in the forward and
    one in the backward). Differentiable in ``x`` and ``weight``; the weight's gradient is this
    slice's, over this rank's rows. The custom op
    :data:`~fusedpar.ops.norm.custom_ops.sharded_rms_norm_op`."""
    check_rms_norm_inputs(x, weight, eps, None)
    y, _ = sharded_rms_norm_op(x, weight, float(eps), transport_id_of(transport, group))
    return y
