"""The fp8 linear custom ops of :func:`fusedpar.ops.fp8.fp8_linear` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::fp8_linear(x, weight, bias, recipe, grad_high_precision) -> y``
  (:data:`fp8_linear_op`, body :func:`fp8_linear_fwd`): quantise ``x`` per token (rowwise) or per
  1x128 tile (blockwise) and ``weight`` per output row or per 128x128 block, then the scaled fp8
  GEMM; ``y`` in ``x``'s dtype.
* ``fusedpar::fp8_linear_backward(grad_y, x, weight, recipe, grad_high_precision, need_dx,
  need_dw) -> (dx, dw)`` (:data:`fp8_linear_backward_op`, body :func:`fp8_linear_bwd`): each
  gradient GEMM quantises its operands along its own contraction axis (the transposed scalings of
  the module :mod:`fusedpar.kernels.fp8` writes from a transposed view); ``dw`` in the weight's
  dtype. The bias gradient is a torch sum in the registered backward.

The backward re-quantises the saved high-precision ``x`` and ``weight`` (the weight's 128x128
blocks of the blockwise recipe come out bit-identical to the forward's, transposed): master
weights and what autograd saves stay in their dtype.
"""
from __future__ import annotations

import torch

from fusedpar.kernels import fp8_matmul, matmul_tn, quantize_e4m3
from fusedpar.ops.library import absent, custom_op, input_grads, present

__all__ = ["FP8_RECIPES", "fp8_linear_backward_op", "fp8_linear_bwd", "fp8_linear_fwd", "fp8_linear_op"]

#: recipe -> (granularity of activations and gradients, granularity of the weight)
FP8_RECIPES = {"rowwise": ("row", "row"), "blockwise": ("tile", "block")}


def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
                   grad_high_precision: bool) -> torch.Tensor:
    """``y = (q(x) * sx) @ (q(W) * sw)^T + bias`` in ``x``'s dtype (``grad_high_precision`` is
    the backward's option)."""
    act, wgt = FP8_RECIPES[recipe]
    N, K = weight.shape
    xq, xs = quantize_e4m3(x.reshape(-1, K), act)
    wq, ws = quantize_e4m3(weight, wgt)
    y = fp8_matmul(xq, xs, wq, ws, bias, scaling=recipe, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], N)


fp8_linear_op = custom_op("fp8_linear")(fp8_linear_fwd)


@fp8_linear_op.register_fake
def _(x, weight, bias, recipe, grad_high_precision):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def fp8_linear_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str,
                   grad_high_precision: bool, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` (each absent unless asked for): ``dx = q(dY) @ q(W)`` with ``dY`` scaled per
    token (1x128 tiles along N) and ``W`` per input column (its 128x128 blocks);
    ``dw = q(dY)^T @ q(x)`` with both scaled along the tokens (per feature, or 128-token tiles),
    or ``dY^T @ x`` in ``x``'s dtype with ``grad_high_precision``."""
    act, wgt = FP8_RECIPES[recipe]
    N, K = weight.shape
    g2 = grad_y.reshape(-1, N)
    x2 = x.reshape(-1, K)
    dx = dw = absent(x)
    if need_dx:
        gq, gs = quantize_e4m3(g2, act)
        wq, ws = quantize_e4m3(weight.t(), wgt)  # [K, N]: scaled along N, the contraction
        dx = fp8_matmul(gq, gs, wq, ws, scaling=recipe, out_dtype=x.dtype).view(x.shape)
    if need_dw:
        if grad_high_precision:
            dw = matmul_tn(g2, x2, out_dtype=weight.dtype)
        else:
            gq, gs = quantize_e4m3(g2.t(), act)  # [N, T]: scaled along the tokens
            xq, xs = quantize_e4m3(x2.t(), act)  # [K, T]
            dw = fp8_matmul(gq, gs, xq, xs, scaling=recipe, out_dtype=weight.dtype)
    return dx, dw


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
