"""The RMSNorm custom ops of :func:`fusedpar.ops.norm.rms_norm` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::rms_norm(x, weight, residual, eps) -> (y, h, rstd)`` (:data:`rms_norm_op`, body
  :func:`rms_norm_fwd`): ``h = x + residual`` the new residual stream (absent without a
  residual), ``rstd`` the fp32 row statistics the backward reads.
* ``fusedpar::rms_norm_backward(grad_y, grad_h, h, weight, rstd, need_weight_grad) -> (dh, dw)``
  (:data:`rms_norm_backward_op`, body :func:`rms_norm_bwd`): ``dh`` is the gradient of ``x`` and
  of the residual alike; ``dw`` absent unless asked for.

The bodies call the launchers of :mod:`fusedpar.kernels.rmsnorm`.
"""
from __future__ import annotations

import torch

from fusedpar.kernels import rmsnorm as launchers
from fusedpar.ops.library import absent, custom_op, input_grads, present

__all__ = ["rms_norm_backward_op", "rms_norm_bwd", "rms_norm_fwd", "rms_norm_op"]


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd)``: the normalised rows, ``x + residual`` (absent without a residual) and the
    fp32 reciprocal RMS of every row."""
    y, h, rstd = launchers.rms_norm_fwd(x, weight, eps, residual=residual)
    return y, (h if residual is not None else absent(x)), rstd


rms_norm_op = custom_op("rms_norm")(rms_norm_fwd)


@rms_norm_op.register_fake
def _(x, weight, residual, eps):
    rows = x.shape[:-1].numel()  # the launcher allocates contiguous outputs, whatever x's strides
    h = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty((0,))
    return x.new_empty(x.shape), h, x.new_empty((rows,), dtype=torch.float32)


def rms_norm_bwd(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor, need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, dw)``: the gradient of the normalised input ``h`` (with ``grad_h``, the gradient
    that reached ``h`` from later layers, folded in) and of the weight (absent unless
    ``need_weight_grad``)."""
    dh, dw = launchers.rms_norm_bwd(grad_y, h, weight, rstd, grad_residual=grad_h)
    return dh, (dw if dw is not None and need_weight_grad else absent(h))


rms_norm_backward_op = custom_op("rms_norm_backward")(rms_norm_bwd)


@rms_norm_backward_op.register_fake
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
    dh, dw = rms_norm_backward_op(grad_y, grad_h if ctx.has_residual else None, h, weight, rstd, need_dw)
    # dh (in h's dtype) is the gradient of x and of the residual alike
    dx = dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)
    return input_grads(rms_norm_op, x=dx, weight=present(dw), residual=dh if ctx.has_residual else None)


rms_norm_op.register_autograd(_backward, setup_context=_setup)
