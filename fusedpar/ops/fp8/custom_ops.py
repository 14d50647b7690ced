"""The fp8 linear custom ops (see :mod:`fusedpar.ops.common`).

* ``fusedpar::fp8_linear(x, weight, bias, recipe, grad_high_precision) -> y``
  (:data:`fp8_linear_op`, body :func:`~.bodies.fp8_linear_fwd`);
* ``fusedpar::fp8_linear_backward(grad_y, x, weight, recipe, grad_high_precision, need_dx,
  need_dw) -> (dx, dw)`` (:data:`fp8_linear_backward_op`, body :func:`~.bodies.fp8_linear_bwd`).

The tensor-parallel GEMMs' fp8 forms are ops of :mod:`fusedpar.ops.tensor_parallel.custom_ops`."""
from __future__ import annotations

import torch

from fusedpar.ops.common import custom_op, input_grads, present
from fusedpar.ops.fp8.bodies import fp8_linear_bwd, fp8_linear_fwd

fp8_linear_op = custom_op("fp8_linear")(fp8_linear_fwd)


@fp8_linear_op.register_fake
def _(x, weight, bias, recipe, grad_high_precision):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


fp8_linear_backward_op = custom_op("fp8_linear_backward")(fp8_linear_bwd)


@fp8_linear_backward_op.register_fake
def _(grad_y, x, weight, recipe, grad_high_precision, need_dx, need_dw):
    return (x.new_empty(x.shape) if need_dx else x.new_empty((0,)),
            weight.new_empty(weight.shape) if need_dw else x.new_empty((0,)))


def _setup(ctx, inputs, output):
    x, weight, bias, recipe, grad_high_precision = inputs
    ctx.recipe, ctx.grad_high_precision = recipe, grad_high_precision
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    dx, dw = fp8_linear_backward_op(grad_y.contiguous(), x, weight, ctx.recipe, ctx.grad_high_precision,
                                    ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    db = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        db = grad_y.reshape(-1, weight.shape[0]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return input_grads(fp8_linear_op, x=present(dx), weight=present(dw), bias=db)


fp8_linear_op.register_autograd(_backward, setup_context=_setup)
