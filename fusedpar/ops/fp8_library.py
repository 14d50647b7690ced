"""The fp8 custom ops: :func:`fusedpar.ops.fp8.fp8_linear` and the fp8 tensor-parallel GEMMs
(``fp8=`` of :mod:`fusedpar.ops.tensor_parallel`); see :mod:`fusedpar.ops.library`.

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

The tensor-parallel ops in fp8, whose bodies (:mod:`fusedpar.ops.fp8_schedules`) run the schedules
of :mod:`fusedpar.ops.tensor_parallel_schedules` with quantised operands, each with the
quantisation groups of this rank's shards: activations and gradients per token along this rank's
features, the weight per output row / 128x128 blocks of this rank's block, a weight gradient summed
over chunks of tokens, each chunk's operands quantised along its own tokens:

* ``fusedpar::all_gather_matmul_fp8(x, weight, bias, token, dim, activation, partial_dtype, recipe,
  grad_high_precision, keep_preact, keep_gathered, x_q=None, x_scale=None, out_fp8=False) -> (out,
  preact, gathered, out_q, out_scale)``: this rank's shard is quantised once (or its quantisation
  ``(x_q, x_scale)``, made by the kernel that produced ``x``, is copied) into a packed byte buffer
  (:class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Pack`: e4m3 + fp32 scales) that the ring
  gathers, each chunk's fp8 GEMM applying the activation in its epilogue; with ``keep_gathered`` a
  second ring in the same steps gathers the weight-gradient operand (from ``x``), ``gathered`` its
  ``[P, bytes]`` packs kept for the backward (half of a kept bf16 input); with ``out_fp8``
  (blockwise) the epilogues also write ``out`` per 1x128 tile, ``(out_q, out_scale)``, for the next
  fp8 GEMM (absent otherwise; not differentiable). Its backward op
  ``all_gather_matmul_fp8_backward`` runs the reduce-scatter ring of fp8 dgrad GEMMs with the
  chunks' fp8 wgrads between its steps (re-gathering the packed operand when not kept).
* ``fusedpar::matmul_reduce_scatter_fp8(x, weight, bias, token, dim, partial_dtype, recipe,
  grad_high_precision, x_q=None, x_scale=None) -> out`` and its backward op (the output gradient
  gathered as packs); ``(x_q, x_scale)``: ``x`` quantised already (the up projection's or the
  attention's fp8 output), read instead of quantising ``x``.
* ``fusedpar::matmul_all_reduce_fp8(..., x_q=None, x_scale=None)``: its backward is local,
  :data:`fp8_linear_backward_op`.
* ``fusedpar::copy_to_tp_matmul_fp8(..., keep_preact, out_fp8=False) -> (out, preact, out_q,
  out_scale)`` and its backward op (the input gradient's fp8 partials all-reduced in row chunks).

On a transport with in-kernel waits (symmetric memory) the forwards of ``all_gather_matmul_fp8``
(without a kept input) and ``matmul_reduce_scatter_fp8`` are the persistent fp8 GEMMs of
:mod:`fusedpar.ops.symmetric` (the e4m3 shard and its scales in one slot per peer; the partials of
``partial_dtype`` reduced as they complete); the persistent all-gather GEMM's ``out_fp8`` is one
quantisation pass after it. Every other fp8 schedule runs its ring over the transport's transfers.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_empty
from fusedpar.kernels.runtime import activation_features
from fusedpar.ops.fp8_schedules import (
    all_gather_matmul_fp8_bwd,
    all_gather_matmul_fp8_fwd,
    chunk_lead,
    copy_to_tp_matmul_fp8_bwd,
    copy_to_tp_matmul_fp8_fwd,
    fp8_linear_bwd,
    fp8_linear_fwd,
    matmul_all_reduce_fp8_fwd,
    matmul_reduce_scatter_fp8_bwd,
    matmul_reduce_scatter_fp8_fwd,
    wgrad_kind,
)
from fusedpar.ops.library import absent, custom_op, hold, input_grads, present, token_size
from fusedpar.ops.tensor_parallel_library import TPOptions, tp_transport
from fusedpar.ops.tensor_parallel_schedules import Fp8Pack, sum_tokens

__all__ = ["FP8_RECIPES", "fp8_linear_backward_op", "fp8_linear_op", "all_gather_matmul_fp8_op",
           "all_gather_matmul_fp8_backward_op", "matmul_reduce_scatter_fp8_op", "matmul_reduce_scatter_fp8_backward_op",
           "matmul_all_reduce_fp8_op", "copy_to_tp_matmul_fp8_op", "copy_to_tp_matmul_fp8_backward_op"]

Tensor = torch.Tensor


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


# ----------------------------------------------------------------------------------------------
# the custom ops of the fp8 tensor-parallel GEMMs
# ----------------------------------------------------------------------------------------------
def _grads(dx, dw, db, like):
    return tuple(absent(like) if t is None else t for t in (dx, dw, db))


def _grads_fake(dx_shape, like, weight, need_dx, need_dw, need_db):
    return (like.new_empty(dx_shape) if need_dx else absent(weight),
            weight.new_empty(weight.shape) if need_dw else absent(weight),
            weight.new_empty((weight.shape[0],)) if need_db else absent(weight))


def _tp_grads(op, ctx, dx, dw, db):
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    return input_grads(op, x=present(dx) if need_dx else None, weight=present(dw) if need_dw else None,
                       bias=present(db) if need_db else None)


@custom_op("all_gather_matmul_fp8")
def all_gather_matmul_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, dim: int, activation: str,
                             partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool, keep_preact: bool,
                             keep_gathered: bool, x_q: Tensor | None = None, x_scale: Tensor | None = None,
                             out_fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), dim, activation, partial_dtype)
    out, preact, gathered, fp8 = all_gather_matmul_fp8_fwd(x, weight, bias, opts, recipe, grad_high_precision,
                                                           keep_preact=keep_preact, keep_gathered=keep_gathered,
                                                           x_fp8=None if x_q is None else (x_q, x_scale),
                                                           out_fp8=out_fp8)
    return (out, absent(x) if preact is None else preact, absent(x) if gathered is None else gathered,
            *(fp8 or (absent(x), absent(x))))


def _fp8_fake(out: Tensor, out_fp8: bool) -> tuple[Tensor, Tensor]:
    """The fake ``(q, scale)`` of an fp8 output of ``out`` (1x128 tiles), or absent placeholders."""
    return fp8_output_empty(out) if out_fp8 else (absent(out), absent(out))


@all_gather_matmul_fp8_op.register_fake
def _(x, weight, bias, token, dim, activation, partial_dtype, recipe, grad_high_precision, keep_preact, keep_gathered,
      x_q=None, x_scale=None, out_fp8=False):
    P, lead = token_size(token), tuple(x.shape[:-1])
    out_lead = list(lead)
    out_lead[dim] = out_lead[dim] * P
    out = x.new_empty(out_lead + [activation_features(weight.shape[0], activation)])
    preact = x.new_empty((P,) + lead + (weight.shape[0],)) if keep_preact and activation != "none" else absent(x)
    gathered = absent(x)
    if keep_gathered:
        nbytes = Fp8Pack.activation(lead, x.shape[-1], x.dtype, recipe, rows=False,
                                    wgrad=wgrad_kind(grad_high_precision)).nbytes
        gathered = x.new_empty((P, nbytes), dtype=torch.uint8)
    return out, preact, gathered, *_fp8_fake(out, out_fp8)


@custom_op("all_gather_matmul_fp8_backward")
def all_gather_matmul_fp8_backward_op(grad_out: Tensor, x: Tensor | None, gathered: Tensor | None, weight: Tensor,
                                      preact: Tensor | None, token: str, dim: int, activation: str,
                                      partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                      need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, grad_out), dim, activation, partial_dtype)
    return _grads(*all_gather_matmul_fp8_bwd(grad_out, x, gathered, weight, preact, opts, recipe, grad_high_precision,
                                             need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@all_gather_matmul_fp8_backward_op.register_fake
def _(grad_out, x, gathered, weight, preact, token, dim, activation, partial_dtype, recipe, grad_high_precision,
      need_dx, need_dw, need_db):
    lead = chunk_lead(grad_out.shape, dim, token_size(token))
    return _grads_fake(lead + (weight.shape[1],), grad_out, weight, need_dx, need_dw, need_db)


def _ag_setup(ctx, inputs, output):
    x, weight, bias, token, dim, activation, partial_dtype, recipe, hp, keep_preact, keep_gathered = inputs[:11]
    ctx.args = (token, dim, activation, partial_dtype, recipe, hp)
    ctx.transports = hold(token)
    ctx.mark_non_differentiable(*output[3:])
    has_preact = keep_preact and activation != "none"
    ctx.save_for_backward(None if keep_gathered else x, output[2] if keep_gathered else None, weight,
                          output[1] if has_preact else None)


def _ag_backward(ctx, grad_out, grad_preact, grad_gathered, grad_q, grad_scale):
    x, gathered, weight, preact = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_out is None or not any(need):
        return input_grads(all_gather_matmul_fp8_op)
    grads = all_gather_matmul_fp8_backward_op(grad_out.contiguous(), x, gathered, weight, preact, *ctx.args, *need)
    return _tp_grads(all_gather_matmul_fp8_op, ctx, *grads)


all_gather_matmul_fp8_op.register_autograd(_ag_backward, setup_context=_ag_setup)


@custom_op("matmul_reduce_scatter_fp8")
def matmul_reduce_scatter_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, dim: int,
                                 partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                 x_q: Tensor | None = None, x_scale: Tensor | None = None) -> Tensor:
    return matmul_reduce_scatter_fp8_fwd(x, weight, bias, TPOptions(tp_transport(token, x), dim,
                                                                    partial_dtype=partial_dtype), recipe,
                                         x_fp8=None if x_q is None else (x_q, x_scale))


@matmul_reduce_scatter_fp8_op.register_fake
def _(x, weight, bias, token, dim, partial_dtype, recipe, grad_high_precision, x_q=None, x_scale=None):
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[dim] = shape[dim] // token_size(token)
    return x.new_empty(shape)


@custom_op("matmul_reduce_scatter_fp8_backward")
def matmul_reduce_scatter_fp8_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, token: str, dim: int,
                                          partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                          need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), dim, partial_dtype=partial_dtype)
    return _grads(*matmul_reduce_scatter_fp8_bwd(grad_out, x, weight, opts, recipe, grad_high_precision,
                                                 need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@matmul_reduce_scatter_fp8_backward_op.register_fake
def _(grad_out, x, weight, token, dim, partial_dtype, recipe, grad_high_precision, need_dx, need_dw, need_db):
    return _grads_fake(x.shape, x, weight, need_dx, need_dw, need_db)


def _rs_setup(ctx, inputs, output):
    x, weight, _, token, dim, partial_dtype, recipe, hp = inputs[:8]
    ctx.args = (token, dim, partial_dtype, recipe, hp)
    ctx.transports = hold(token)
    ctx.save_for_backward(x, weight)


def _rs_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grads = matmul_reduce_scatter_fp8_backward_op(grad_out.contiguous(), x, weight, *ctx.args,
                                                  *ctx.needs_input_grad[:3])
    return _tp_grads(matmul_reduce_scatter_fp8_op, ctx, *grads)


matmul_reduce_scatter_fp8_op.register_autograd(_rs_backward, setup_context=_rs_setup)


@custom_op("matmul_all_reduce_fp8")
def matmul_all_reduce_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, num_chunks: int,
                             reduce_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                             x_q: Tensor | None = None, x_scale: Tensor | None = None) -> Tensor:
    opts = TPOptions(tp_transport(token, x), partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return matmul_all_reduce_fp8_fwd(x, weight, bias, opts, recipe, x_fp8=None if x_q is None else (x_q, x_scale))


@matmul_all_reduce_fp8_op.register_fake
def _(x, weight, bias, token, num_chunks, reduce_dtype, recipe, grad_high_precision, x_q=None, x_scale=None):
    return x.new_empty(list(x.shape[:-1]) + [weight.shape[0]])


def _ar_setup(ctx, inputs, output):
    x, weight, bias, _, _, _, recipe, hp = inputs[:8]
    ctx.recipe, ctx.hp = recipe, hp
    ctx.save_for_backward(x, weight)


def _ar_backward(ctx, grad_out):
    """The replicated output's gradient is whole on every rank: :func:`fp8_linear_bwd`'s local
    GEMMs, no communication (the bias gradient a torch sum, as :func:`fp8_linear`'s)."""
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw = fp8_linear_backward_op(grad_out.contiguous(), x, weight, ctx.recipe, ctx.hp, need_dx, need_dw)
    db = sum_tokens(grad_out).to(weight.dtype) if need_db else None
    return _tp_grads(matmul_all_reduce_fp8_op, ctx, dx, dw, db)


matmul_all_reduce_fp8_op.register_autograd(_ar_backward, setup_context=_ar_setup)


@custom_op("copy_to_tp_matmul_fp8")
def copy_to_tp_matmul_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, activation: str,
                             num_chunks: int, reduce_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                             keep_preact: bool, out_fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, preact, fp8 = copy_to_tp_matmul_fp8_fwd(x, weight, bias, recipe, activation, keep_preact=keep_preact,
                                                 out_fp8=out_fp8)
    return out, (absent(x) if preact is None else preact), *(fp8 or (absent(x), absent(x)))


@copy_to_tp_matmul_fp8_op.register_fake
def _(x, weight, bias, token, activation, num_chunks, reduce_dtype, recipe, grad_high_precision, keep_preact,
      out_fp8=False):
    lead = list(x.shape[:-1])
    out = x.new_empty(lead + [activation_features(weight.shape[0], activation)])
    return (out, x.new_empty(lead + [weight.shape[0]]) if keep_preact and activation != "none" else absent(x),
            *_fp8_fake(out, out_fp8))


@custom_op("copy_to_tp_matmul_fp8_backward")
def copy_to_tp_matmul_fp8_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, preact: Tensor | None, token: str,
                                      activation: str, num_chunks: int, reduce_dtype: torch.dtype, recipe: str,
                                      grad_high_precision: bool, need_dx: bool, need_dw: bool,
                                      need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), activation=activation, partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return _grads(*copy_to_tp_matmul_fp8_bwd(grad_out, x, weight, preact, opts, recipe, grad_high_precision,
                                             need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@copy_to_tp_matmul_fp8_backward_op.register_fake
def _(grad_out, x, weight, preact, token, activation, num_chunks, reduce_dtype, recipe, grad_high_precision,
      need_dx, need_dw, need_db):
    return _grads_fake(x.shape, grad_out, weight, need_dx, need_dw, need_db)


def _cp_setup(ctx, inputs, output):
    x, weight, _, token, activation, num_chunks, reduce_dtype, recipe, hp, keep_preact = inputs[:10]
    ctx.args = (token, activation, num_chunks, reduce_dtype, recipe, hp)
    ctx.transports = hold(token)
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(x, weight, output[1] if keep_preact and activation != "none" else None)


def _cp_backward(ctx, grad_out, grad_preact, grad_q, grad_scale):
    x, weight, preact = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_out is None or not any(need):
        return input_grads(copy_to_tp_matmul_fp8_op)
    grads = copy_to_tp_matmul_fp8_backward_op(grad_out.contiguous(), x, weight, preact, *ctx.args, *need)
    return _tp_grads(copy_to_tp_matmul_fp8_op, ctx, *grads)


copy_to_tp_matmul_fp8_op.register_autograd(_cp_backward, setup_context=_cp_setup)
