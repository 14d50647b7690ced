"""RMSNorm (+ fused residual add): the functional API :func:`rms_norm` over the custom ops of
:mod:`fusedpar.ops.norm_library`.

``rms_norm(x, weight, eps)`` returns ``y``; ``rms_norm(x, weight, eps, residual=r)`` returns
``(y, h)`` with ``h = x + r`` the new residual stream (pre-norm transformer blocks feed ``h`` to
the next block's add). Gradients flow to ``x``, ``residual`` and ``weight``; the gradient that
reaches ``h`` from later layers is folded into the fused backward kernel.

``sharded_rms_norm(x, weight, eps, group=...)`` normalises rows whose features are split over a
group (each rank holds ``H / P`` of them and the same slice of the weight): the row statistics
are all-reduced over the group (OLMo 2's q / k norm over a tensor-parallel projection).
"""
from __future__ import annotations

import torch

from fusedpar.kernels.rmsnorm import check_rms_norm_inputs
from fusedpar.ops.library import checked_api, transport_token
from fusedpar.ops.norm_library import rms_norm_op, sharded_rms_norm_op

__all__ = ["rms_norm", "sharded_rms_norm"]


@checked_api
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None):
    """Fused RMSNorm over the last dim, fp32 statistics.

    Returns ``y = x * rsqrt(mean(x^2) + eps) * weight`` in ``x.dtype``; with ``residual`` the
    sum ``h = x + residual`` (in the residual's dtype) is normalised instead and ``(y, h)`` is
    returned. ``x`` may be any ``[..., H]`` tensor; 2-D and 3-D strided views are read in place.
    The custom op :data:`~fusedpar.ops.norm_library.rms_norm_op` (``fusedpar::rms_norm``):
    traceable by ``torch.compile``.
    """
    check_rms_norm_inputs(x, weight, eps, residual)  # before the schema sees the arguments
    y, h, _ = rms_norm_op(x, weight, residual, float(eps))
    return y if residual is None else (y, h)


@checked_api
def sharded_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, group=None,
                     transport=None) -> torch.Tensor:
    """RMSNorm of rows whose features are split over ``group`` (default: the default group) or
    ``transport``: ``x`` ``[..., H / P]`` holds this rank's features of every row, ``weight``
    ``[H / P]`` the same slice of the scale. Returns ``x * rsqrt(mean(x_full^2) + eps) * weight``
    (the mean over all ``H`` features of the row: one fp32 all-reduce per row in the forward and
    one in the backward). Differentiable in ``x`` and ``weight``; the weight's gradient is this
    slice's, over this rank's rows. The custom op
    :data:`~fusedpar.ops.norm_library.sharded_rms_norm_op`."""
    check_rms_norm_inputs(x, weight, eps, None)
    y, _ = sharded_rms_norm_op(x, weight, float(eps), transport_token(transport, group))
    return y
