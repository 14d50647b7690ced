"""RMSNorm (+ fused residual add) as a ``torch.library`` custom op and a functional API.

``rms_norm(x, weight, eps)`` returns ``y``; ``rms_norm(x, weight, eps, residual=r)`` returns
``(y, h)`` with ``h = x + r`` the new residual stream (pre-norm transformer blocks feed ``h`` to
the next block's add). Gradients flow to ``x``, ``residual`` and ``weight``; the gradient that
reaches ``h`` from later layers is folded into the fused backward kernel.

Ops (see :mod:`fusedpar.ops.library`): ``torch.ops.fusedpar.rms_norm(x, weight, residual, eps) ->
(y, h, rstd)`` (``h`` absent without a residual) and ``torch.ops.fusedpar.rms_norm_backward``.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.rmsnorm import check_rms_norm_inputs, rms_norm_bwd, rms_norm_fwd
from fusedpar.ops.library import absent, present

__all__ = ["rms_norm"]


@torch.library.custom_op("fusedpar::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, rstd = rms_norm_fwd(x, weight, eps, residual=residual)
    return y, (h if residual is not None else absent(x)), rstd


@_rms_norm_op.register_fake
def _(x, weight, residual, eps):
    rows = x.shape[:-1].numel()  # the launcher allocates contiguous outputs, whatever x's strides
    h = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty((0,))
    return x.new_empty(x.shape), h, x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("fusedpar::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor,
                          weight: torch.Tensor | None, rstd: torch.Tensor,
                          need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dh, dw = rms_norm_bwd(grad_y, h, weight, rstd, grad_residual=grad_h)
    return dh, (dw if dw is not None and need_weight_grad else absent(h))


@_rms_norm_backward_op.register_fake
def _(grad_y, grad_h, h, weight, rstd, need_weight_grad):
    dw = torch.empty_like(weight) if weight is not None and need_weight_grad else h.new_empty((0,))
    return h.new_empty(h.shape), dw


def _setup(ctx, inputs, output):
    x, weight, residual, eps = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _backward(ctx, grad_y, grad_h, grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(h)
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dh, dw = torch.ops.fusedpar.rms_norm_backward(grad_y, grad_h if ctx.has_residual else None, h, weight, rstd,
                                                  need_dw)
    # dh (in h's dtype) is the gradient of x and of the residual alike
    dx = dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)
    return dx, present(dw), (dh if ctx.has_residual else None), None


_rms_norm_op.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None):
    """Fused RMSNorm over the last dim, fp32 statistics.

    Returns ``y = x * rsqrt(mean(x^2) + eps) * weight`` in ``x.dtype``; with ``residual`` the
    sum ``h = x + residual`` (in the residual's dtype) is normalised instead and ``(y, h)`` is
    returned. ``x`` may be any ``[..., H]`` tensor; 2-D and 3-D strided views are read in place.
    A ``torch.library`` op (``torch.ops.fusedpar.rms_norm``): traceable by ``torch.compile``.
    """
    check_rms_norm_inputs(x, weight, eps, residual)  # before the schema sees the arguments
    y, h, _ = torch.ops.fusedpar.rms_norm(x, weight, residual, float(eps))
    return y if residual is None else (y, h)
