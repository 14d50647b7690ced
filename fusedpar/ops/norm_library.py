"""The RMSNorm custom ops of :func:`fusedpar.ops.norm.rms_norm` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::rms_norm(x, weight, residual, eps) -> (y, h, rstd)`` (:data:`rms_norm_op`, body
  :func:`rms_norm_fwd`): ``h = x + residual`` the new residual stream (absent without a
  residual), ``rstd`` the fp32 row statistics the backward reads.
* ``fusedpar::rms_norm_backward(grad_y, grad_h, h, weight, rstd, need_weight_grad) -> (dh, dw)``
  (:data:`rms_norm_backward_op`, body :func:`rms_norm_bwd`): ``dh`` is the gradient of ``x`` and
  of the residual alike; ``dw`` absent unless asked for.
* ``fusedpar::rms_norm_fp8(x, weight, residual, eps, recipe) -> (y, h, rstd, q, scale)``
  (:data:`rms_norm_fp8_op`, body :func:`rms_norm_fp8_fwd`): ``rms_norm`` whose kernel also
  writes ``y`` quantised for an fp8 GEMM (``recipe`` ``"rowwise"``: e4m3 ``q`` and one fp32 scale
  per token; ``"blockwise"``: per 1x128 tile along the features), equal bit for bit to
  ``quantize_e4m3`` of ``y``. Its backward is ``rms_norm``'s (``rms_norm_backward``: the gradient
  reaches ``y`` and ``h``; ``q`` and ``scale`` are not differentiable).

The bodies call the launchers of :mod:`fusedpar.kernels.rmsnorm`.

* ``fusedpar::sharded_rms_norm(x, weight, eps, token) -> (y, rstd)``
  (:data:`sharded_rms_norm_op`, body :func:`sharded_rms_norm_fwd`) and its backward
  ``fusedpar::sharded_rms_norm_backward``: RMSNorm of rows whose features are split over the
  group the transport ``token`` names (OLMo 2's q / k norm over a whole projection under tensor
  parallelism). Each rank holds ``H / P`` features and the same slice of the weight; the row's
  sum of squares (forward) and ``sum(dn * n)`` (backward) are all-reduced over the group, one
  fp32 value per row each. The bodies are torch ops in fp32 (a ``[tokens, H / P]`` operand, the
  size of a q or k projection shard): the fused kernels above hold the row statistics inside one
  program and have no place for a reduction across ranks.
"""
from __future__ import annotations

import torch

from fusedpar.kernels import rmsnorm as launchers
from fusedpar.kernels.fp8 import scale_shape
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.ops.library import absent, custom_op, hold, input_grads, present
from fusedpar.ops.transport import token_transport

__all__ = ["rms_norm_backward_op", "rms_norm_bwd", "rms_norm_fp8_fwd", "rms_norm_fp8_op", "rms_norm_fwd", "rms_norm_op",
           "sharded_rms_norm_backward_op", "sharded_rms_norm_bwd", "sharded_rms_norm_fwd", "sharded_rms_norm_op"]


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd)``: the normalised rows, ``x + residual`` (absent without a residual) and the
    fp32 reciprocal RMS of every row."""
    y, h, rstd = launchers.rms_norm_fwd(x, weight, eps, residual=residual)
    return y, (h if residual is not None else absent(x)), rstd


rms_norm_op = custom_op("rms_norm")(rms_norm_fwd)


def _fake_outputs(x, residual):
    rows = x.shape[:-1].numel()  # the launcher allocates contiguous outputs, whatever x's strides
    h = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty((0,))
    return x.new_empty(x.shape), h, x.new_empty((rows,), dtype=torch.float32)


@rms_norm_op.register_fake
def _(x, weight, residual, eps):
    return _fake_outputs(x, residual)


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


# ----------------------------------------------------------------------------------------------
# with the output quantised for an fp8 GEMM
# ----------------------------------------------------------------------------------------------
def rms_norm_fp8_fwd(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
                     recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd, q, scale)``: :func:`rms_norm_fwd`'s outputs and ``y`` quantised per
    ``recipe`` (``q`` e4m3 of ``x``'s shape; ``scale`` fp32 ``x.shape[:-1]`` for ``"rowwise"``,
    ``x.shape[:-1] + (ceil(H / 128),)`` for ``"blockwise"``)."""
    y, h, rstd, q, scale = launchers.rms_norm_fp8_fwd(x, weight, eps, recipe=recipe, residual=residual)
    return y, (h if residual is not None else absent(x)), rstd, q, scale


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


# ----------------------------------------------------------------------------------------------
# features split over a group
# ----------------------------------------------------------------------------------------------
def _row_sum_over_group(t: torch.Tensor, token: str) -> torch.Tensor:
    """``t`` (fp32 per-row partial sums) summed over the group of ``token``, in place."""
    transport = token_transport(token)
    if transport.size > 1:
        transport.all_reduce(t).wait()
    return t


def sharded_rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                         token: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: ``y = x * rstd * weight`` in ``x.dtype`` with ``rstd = 1 / sqrt(mean(x^2) +
    eps)`` over the full row, whose ``H / P`` local features ``x`` ``[..., H / P]`` holds (one
    all-reduce of the fp32 row sums of squares over the group of ``token``)."""
    xf = x.float()
    sumsq = _row_sum_over_group(xf.square().sum(-1), token)
    rstd = torch.rsqrt(sumsq / (x.shape[-1] * token_transport(token).size) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


sharded_rms_norm_op = custom_op("sharded_rms_norm")(sharded_rms_norm_fwd)


@sharded_rms_norm_op.register_fake
def _(x, weight, eps, token):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def sharded_rms_norm_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                         token: str, need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``: ``dx = rstd * (dn - n * mean(dn * n))`` with ``n = x * rstd``, ``dn = dy *
    weight`` and the mean over the full row (one all-reduce of its fp32 row sums); ``dw`` (this
    rank's slice, absent unless ``need_weight_grad``) sums ``dy * n`` over the local rows."""
    n = x.float() * rstd.unsqueeze(-1)
    dy = grad_y.float()
    dn = dy * weight.float() if weight is not None else dy
    full = x.shape[-1] * token_transport(token).size
    c = _row_sum_over_group((dn * n).sum(-1), token) / full
    dx = (rstd.unsqueeze(-1) * (dn - n * c.unsqueeze(-1))).to(x.dtype)
    if weight is None or not need_weight_grad:
        return dx, absent(x)
    return dx, (dy * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)


sharded_rms_norm_backward_op = custom_op("sharded_rms_norm_backward")(sharded_rms_norm_bwd)


@sharded_rms_norm_backward_op.register_fake
def _(grad_y, x, weight, rstd, token, need_weight_grad):
    dw = torch.empty_like(weight) if weight is not None and need_weight_grad else x.new_empty((0,))
    return x.new_empty(x.shape), dw


def _sharded_setup(ctx, inputs, output):
    x, weight, _, ctx.token = inputs
    ctx.transports = hold(ctx.token)
    ctx.save_for_backward(x, weight, output[1])


def _sharded_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = sharded_rms_norm_backward_op(grad_y, x, weight, rstd, ctx.token, need_dw)
    return input_grads(sharded_rms_norm_op, x=dx, weight=present(dw))


sharded_rms_norm_op.register_autograd(_sharded_backward, setup_context=_sharded_setup)
