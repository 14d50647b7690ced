"""The RMSNorm custom ops (see :mod:`fusedpar.ops.common`): ``fusedpar::rms_norm`` -> ``(y, h,
rstd)`` and ``fusedpar::rms_norm_backward`` -> ``(dh, dw)``, ``fusedpar::rms_norm_fp8`` -> ``(y, h,
rstd, q, scale)`` (backward: ``rms_norm_backward``), ``fusedpar::sharded_rms_norm`` and its
backward; each bound to ``<op>_op``, bodies in :mod:`.bodies`."""
from __future__ import annotations

import torch

from fusedpar.kernels.fp8 import scale_shape
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.ops.comm.keys import hold
from fusedpar.ops.common import custom_op, input_grads, present
from fusedpar.ops.norm.bodies import (
    rms_norm_bwd,
    rms_norm_fp8_fwd,
    rms_norm_fwd,
    sharded_rms_norm_bwd,
    sharded_rms_norm_fwd,
)

rms_norm_op = custom_op("rms_norm")(rms_norm_fwd)


def _weight_grad_fake(weight, need_weight_grad, like):
    """The fake of a norm backward's ``dw``: the weight's shape, or the absent placeholder."""
    return torch.empty_like(weight) if weight is not None and need_weight_grad else like.new_empty((0,))


def _fake_outputs(x, residual):
    rows = x.shape[:-1].numel()  # the launcher allocates contiguous outputs, whatever x's strides
    h = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty((0,))
    return x.new_empty(x.shape), h, x.new_empty((rows,), dtype=torch.float32)


@rms_norm_op.register_fake
def _(x, weight, residual, eps):
    return _fake_outputs(x, residual)


rms_norm_backward_op = custom_op("rms_norm_backward")(rms_norm_bwd)


@rms_norm_backward_op.register_fake
def _(grad_y, grad_h, h, weight, rstd, need_weight_grad):
    return h.new_empty(h.shape), _weight_grad_fake(weight, need_weight_grad, h)


def _setup(ctx, inputs, output):
    x, weight, residual, eps = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _input_grads(op, ctx, grad_y, grad_h):
    h, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(h)
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dh, dw = rms_norm_backward_op(grad_y, grad_h if ctx.has_residual else None, h, weight, rstd, need_dw)
    # dh (in h's dtype) is the gradient of x and of the residual alike
    dx = dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)
    return input_grads(op, x=dx, weight=present(dw), residual=dh if ctx.has_residual else None)


def _backward(ctx, grad_y, grad_h, grad_rstd):
    return _input_grads(rms_norm_op, ctx, grad_y, grad_h)


rms_norm_op.register_autograd(_backward, setup_context=_setup)


rms_norm_fp8_op = custom_op("rms_norm_fp8")(rms_norm_fp8_fwd)


@rms_norm_fp8_op.register_fake
def _(x, weight, residual, eps, recipe):
    per_token = scale_shape(x.shape[:-1].numel(), x.shape[-1], FP8_RECIPES[recipe][0])[1:]  # () or (tiles,)
    return (*_fake_outputs(x, residual), x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(tuple(x.shape[:-1]) + per_token, dtype=torch.float32))


def _fp8_setup(ctx, inputs, output):
    _setup(ctx, inputs[:4], output[:3])
    ctx.mark_non_differentiable(*output[2:])  # rstd, q, scale


def _fp8_backward(ctx, grad_y, grad_h, grad_rstd, grad_q, grad_scale):
    """The backward of ``rms_norm``: the quantised copy of ``y`` passes no gradient."""
    return _input_grads(rms_norm_fp8_op, ctx, grad_y, grad_h)


rms_norm_fp8_op.register_autograd(_fp8_backward, setup_context=_fp8_setup)


sharded_rms_norm_op = custom_op("sharded_rms_norm")(sharded_rms_norm_fwd)


@sharded_rms_norm_op.register_fake
def _(x, weight, eps, transport_id):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


sharded_rms_norm_backward_op = custom_op("sharded_rms_norm_backward")(sharded_rms_norm_bwd)


@sharded_rms_norm_backward_op.register_fake
def _(grad_y, x, weight, rstd, transport_id, need_weight_grad):
    return x.new_empty(x.shape), _weight_grad_fake(weight, need_weight_grad, x)


def _sharded_setup(ctx, inputs, output):
    x, weight, _, ctx.transport_id = inputs
    ctx.transports = hold(ctx.transport_id)
    ctx.save_for_backward(x, weight, output[1])


def _sharded_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = sharded_rms_norm_backward_op(grad_y, x, weight, rstd, ctx.transport_id, need_dw)
    return input_grads(sharded_rms_norm_op, x=dx, weight=present(dw))


sharded_rms_norm_op.register_autograd(_sharded_backward, setup_context=_sharded_setup)
