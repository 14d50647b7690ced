"""RMSNorm (+ fused residual add) as an autograd Function and a functional API.

``rms_norm(x, weight, eps)`` returns ``y``; ``rms_norm(x, weight, eps, residual=r)`` returns
``(y, h)`` with ``h = x + r`` the new residual stream (pre-norm transformer blocks feed ``h`` to
the next block's add). Gradients flow to ``x``, ``residual`` and ``weight``; the gradient that
reaches ``h`` from later layers is folded into the fused backward kernel.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        y, h, rstd = rms_norm_fwd(x, weight, eps, residual=residual)
        ctx.has_residual = residual is not None
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(h, weight, rstd)
        if residual is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h=None):
        h, weight, rstd = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(h)
        dh, dw = rms_norm_bwd(grad_y, h, weight, rstd, grad_residual=grad_h if ctx.has_residual else None)
        dx = dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)
        dres = dh if ctx.has_residual else None
        if weight is None or not ctx.needs_input_grad[1]:
            dw = None
        return dx, dw, dres, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None):
    """Fused RMSNorm over the last dim, fp32 statistics.

    Returns ``y = x * rsqrt(mean(x^2) + eps) * weight`` in ``x.dtype``; with ``residual`` the
    sum ``h = x + residual`` (in the residual's dtype) is normalised instead and ``(y, h)`` is
    returned. ``x`` may be any ``[..., H]`` tensor; 2-D and 3-D strided views are read in place.
    """
    return RMSNormFunction.apply(x, weight, residual, eps)
