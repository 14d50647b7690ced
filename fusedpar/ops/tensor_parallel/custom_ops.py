"""The custom ops of the tensor-parallel family (see :mod:`fusedpar.ops.common`): for each of
``all_gather_matmul``, ``matmul_reduce_scatter``, ``matmul_all_reduce``, ``copy_to_tp_matmul``
and their fp8 forms a forward op and a ``*_backward`` op (bound to ``<op>_op`` /
``<op>_backward_op``), fakes, and ``register_autograd``; ``gather_features`` /
``scatter_features`` (each other's backward), ``all_gather_tokens`` and ``replicated_rows``. The
ops resolve the transport id and the absent placeholders and call the bodies of :mod:`.bodies`."""
from __future__ import annotations

import torch
from torch import Tensor

from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_empty
from fusedpar.kernels.runtime import activation_features
from fusedpar.ops.comm.keys import hold, transport_id_size
from fusedpar.ops.comm.transport import transport_from_id
from fusedpar.ops.common import absent, custom_op, input_grads, or_absent, present
from fusedpar.ops.fp8.custom_ops import fp8_linear_backward_op
from fusedpar.ops.fp8.operands import Fp8Pack
from fusedpar.ops.tensor_parallel.bodies import (
    TPOptions, all_gather_last_dim, all_gather_matmul_bwd, all_gather_matmul_fp8_bwd, all_gather_matmul_fp8_fwd,
    all_gather_matmul_fwd, chunk_lead, copy_to_tp_matmul_bwd, copy_to_tp_matmul_fp8_bwd, copy_to_tp_matmul_fp8_fwd,
    copy_to_tp_matmul_fwd, grads_empty, grads_or_absent, matmul_all_reduce_bwd, matmul_all_reduce_fp8_fwd,
    matmul_all_reduce_fwd, matmul_reduce_scatter_bwd, matmul_reduce_scatter_fp8_bwd, matmul_reduce_scatter_fp8_fwd,
    matmul_reduce_scatter_fwd, parse_tp_options, replicated_rows_bwd, replicated_rows_fwd, tp_transport, wgrad_kind)
from fusedpar.ops.tensor_parallel.schedules import sum_tokens


def _input_grads(op, ctx, dx=None, dw=None, db=None):
    """What the registered backward of a GEMM op returns: ``(dx, dW, db)`` for ``x``, ``weight``
    and ``bias`` where the forward's inputs need them, ``None`` for every other argument."""
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    return input_grads(op, x=present(dx) if need_dx else None, weight=present(dw) if need_dw else None,
                       bias=present(db) if need_db else None)


@custom_op("all_gather_matmul")
def all_gather_matmul_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str) -> tuple[Tensor, Tensor, Tensor]:
    """``options``: :func:`tp_options` of (transport id, dim, partial dtype, activation; keep_preact,
    keep_gathered, save_gathered)."""
    transport_id, dim, partial_dtype, activation, _, keep_preact, keep_gathered, _ = \
        parse_tp_options(options, "all_gather_matmul", x)
    opts = TPOptions(tp_transport(transport_id, x), dim, activation, partial_dtype)
    out, preact, gathered = all_gather_matmul_fwd(x, weight, bias, opts, keep_preact=keep_preact,
                                                  keep_gathered=keep_gathered)
    return out, or_absent(preact, x), or_absent(gathered, x)


@all_gather_matmul_op.register_fake
def _(x, weight, bias, options):
    transport_id, dim, _, activation, _, keep_preact, keep_gathered, _ = \
        parse_tp_options(options, "all_gather_matmul", x)
    P, lead = transport_id_size(transport_id), list(x.shape[:-1])
    out_lead = list(lead)
    out_lead[dim] = out_lead[dim] * P
    out = x.new_empty(out_lead + [activation_features(weight.shape[0], activation)])
    preact = x.new_empty([P] + lead + [weight.shape[0]]) if keep_preact and activation != "none" else absent(x)
    return out, preact, (x.new_empty([P] + list(x.shape)) if keep_gathered else absent(x))


@custom_op("all_gather_matmul_backward")
def all_gather_matmul_backward_op(grad_out: Tensor, x: Tensor | None, gathered: Tensor | None, weight: Tensor,
                                  preact: Tensor | None, transport_id: str, dim: int, activation: str,
                                  partial_dtype: torch.dtype, need_dx: bool, need_dw: bool,
                                  need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    like = x if x is not None else gathered[0]
    opts = TPOptions(tp_transport(transport_id, like), dim, activation, partial_dtype)
    dx, dw, db = all_gather_matmul_bwd(grad_out, x, weight, preact, gathered, opts, need_dx=need_dx, need_dw=need_dw,
                                       need_db=need_db)
    return grads_or_absent(dx, dw, db, weight)


@all_gather_matmul_backward_op.register_fake
def _(grad_out, x, gathered, weight, preact, transport_id, dim, activation, partial_dtype, need_dx, need_dw, need_db):
    like = x if x is not None else gathered[0]
    return grads_empty(grad_out.new_empty(like.shape), weight, need_dx, need_dw, need_db)


def _ag_setup(ctx, inputs, output):
    x, weight, bias, options = inputs
    transport_id, dim, partial_dtype, activation, _, keep_preact, _, save_gathered = \
        parse_tp_options(options, "all_gather_matmul")
    _, preact, gathered = output
    ctx.args = (transport_id, dim, activation, partial_dtype)
    ctx.transports = hold(transport_id)
    ctx.has_preact = keep_preact and activation != "none"
    ctx.save_for_backward(None if save_gathered else x, gathered if save_gathered else None, weight,
                          preact if ctx.has_preact else None)


def _ag_backward(ctx, grad_out, grad_preact, grad_gathered):
    x, gathered, weight, preact = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_out is None or not (need_dx or need_dw or need_db):
        return input_grads(all_gather_matmul_op)
    dx, dw, db = all_gather_matmul_backward_op(grad_out, x, gathered, weight, preact, *ctx.args, need_dx, need_dw,
                                               need_db)
    return _input_grads(all_gather_matmul_op, ctx, dx, dw, db)


all_gather_matmul_op.register_autograd(_ag_backward, setup_context=_ag_setup)


@custom_op("matmul_reduce_scatter")
def matmul_reduce_scatter_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str) -> Tensor:
    """``options``: :func:`tp_options` of (transport id, dim, partial dtype)."""
    transport_id, dim, partial_dtype, _, _ = parse_tp_options(options, "matmul_reduce_scatter", x)
    return matmul_reduce_scatter_fwd(x, weight, bias, TPOptions(tp_transport(transport_id, x), dim,
                                                                partial_dtype=partial_dtype))


@matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, options):
    transport_id, dim, _, _, _ = parse_tp_options(options, "matmul_reduce_scatter", x)
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[dim] = shape[dim] // transport_id_size(transport_id)
    return x.new_empty(shape)


@custom_op("matmul_reduce_scatter_backward")
def matmul_reduce_scatter_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, transport_id: str, dim: int,
                                      partial_dtype: torch.dtype, need_dx: bool, need_dw: bool,
                                      need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(transport_id, x), dim, partial_dtype=partial_dtype)
    dx, dw, db = matmul_reduce_scatter_bwd(grad_out, x, weight, opts, need_dx=need_dx, need_dw=need_dw,
                                           need_db=need_db)
    return grads_or_absent(dx, dw, db, weight)


@matmul_reduce_scatter_backward_op.register_fake
def _(grad_out, x, weight, transport_id, dim, partial_dtype, need_dx, need_dw, need_db):
    return grads_empty(x, weight, need_dx, need_dw, need_db)


def _rs_setup(ctx, inputs, output):
    x, weight, _, options = inputs
    transport_id, dim, partial_dtype, _, _ = parse_tp_options(options, "matmul_reduce_scatter")
    ctx.args = (transport_id, dim, partial_dtype)
    ctx.transports = hold(transport_id)
    ctx.save_for_backward(x, weight)


def _rs_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = matmul_reduce_scatter_backward_op(grad_out, x, weight, *ctx.args, need_dx, need_dw, need_db)
    return _input_grads(matmul_reduce_scatter_op, ctx, dx, dw, db)


matmul_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_rs_setup)


@custom_op("matmul_all_reduce")
def matmul_all_reduce_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str) -> Tensor:
    """``options``: :func:`tp_options` of (transport id, num_chunks, reduce dtype)."""
    transport_id, num_chunks, reduce_dtype, _, _ = parse_tp_options(options, "matmul_all_reduce")
    opts = TPOptions(tp_transport(transport_id, x), partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return matmul_all_reduce_fwd(x, weight, bias, opts)


@matmul_all_reduce_op.register_fake
def _(x, weight, bias, options):
    parse_tp_options(options, "matmul_all_reduce")
    return x.new_empty(list(x.shape[:-1]) + [weight.shape[0]])


@custom_op("matmul_all_reduce_backward")
def matmul_all_reduce_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, need_dx: bool, need_dw: bool,
                                  need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = matmul_all_reduce_bwd(grad_out, x, weight, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    return grads_or_absent(dx, dw, db, weight)


@matmul_all_reduce_backward_op.register_fake
def _(grad_out, x, weight, need_dx, need_dw, need_db):
    return grads_empty(grad_out.new_empty(list(grad_out.shape[:-1]) + [weight.shape[1]]), weight, need_dx, need_dw,
                       need_db)


def _ar_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _ar_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = matmul_all_reduce_backward_op(grad_out, x, weight, need_dx, need_dw, need_db)
    return _input_grads(matmul_all_reduce_op, ctx, dx, dw, db)


matmul_all_reduce_op.register_autograd(_ar_backward, setup_context=_ar_setup)


@custom_op("copy_to_tp_matmul")
def copy_to_tp_matmul_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str) -> tuple[Tensor, Tensor]:
    """``options``: :func:`tp_options` of (transport id, num_chunks, reduce dtype, activation;
    keep_preact). Local: the transport id, num_chunks and reduce dtype are the backward's."""
    _, _, _, activation, _, keep_preact = parse_tp_options(options, "copy_to_tp_matmul")
    opts = TPOptions(None, activation=activation)
    out, preact = copy_to_tp_matmul_fwd(x, weight, bias, opts, keep_preact=keep_preact)
    return out, or_absent(preact, x)


@copy_to_tp_matmul_op.register_fake
def _(x, weight, bias, options):
    _, _, _, activation, _, keep_preact = parse_tp_options(options, "copy_to_tp_matmul")
    lead = list(x.shape[:-1])
    out = x.new_empty(lead + [activation_features(weight.shape[0], activation)])
    rows = 1
    for s in lead:
        rows = rows * s
    return out, (x.new_empty([rows, weight.shape[0]]) if keep_preact and activation != "none" else absent(x))


@custom_op("copy_to_tp_matmul_backward")
def copy_to_tp_matmul_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, preact: Tensor | None, transport_id: str,
                                  activation: str, num_chunks: int, reduce_dtype: torch.dtype, need_dx: bool,
                                  need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(transport_id, x), activation=activation, partial_dtype=reduce_dtype,
                     num_chunks=num_chunks)
    dx, dw, db = copy_to_tp_matmul_bwd(grad_out, x, weight, preact, opts, need_dx=need_dx, need_dw=need_dw,
                                       need_db=need_db)
    return grads_or_absent(dx, dw, db, weight)


@copy_to_tp_matmul_backward_op.register_fake
def _(grad_out, x, weight, preact, transport_id, activation, num_chunks, reduce_dtype, need_dx, need_dw, need_db):
    return grads_empty(grad_out.new_empty(x.shape), weight, need_dx, need_dw, need_db)


def _cp_setup(ctx, inputs, output):
    x, weight, _, options = inputs
    transport_id, num_chunks, reduce_dtype, activation, _, keep_preact = parse_tp_options(options, "copy_to_tp_matmul")
    ctx.args = (transport_id, activation, num_chunks, reduce_dtype)
    ctx.transports = hold(transport_id)
    ctx.save_for_backward(x, weight, output[1] if keep_preact and activation != "none" else None)


def _cp_backward(ctx, grad_out, grad_preact):
    x, weight, preact = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_out is None or not (need_dx or need_dw or need_db):
        return input_grads(copy_to_tp_matmul_op)
    dx, dw, db = copy_to_tp_matmul_backward_op(grad_out, x, weight, preact, *ctx.args, need_dx, need_dw, need_db)
    return _input_grads(copy_to_tp_matmul_op, ctx, dx, dw, db)


copy_to_tp_matmul_op.register_autograd(_cp_backward, setup_context=_cp_setup)


@custom_op("gather_features")
def gather_features_op(t: Tensor, transport_id: str) -> Tensor:
    return all_gather_last_dim(t, transport_from_id(transport_id))


@gather_features_op.register_fake
def _(t, transport_id):
    return t.new_empty(list(t.shape[:-1]) + [t.shape[-1] * transport_id_size(transport_id)])


@custom_op("scatter_features")
def scatter_features_op(t: Tensor, transport_id: str) -> Tensor:
    tr = transport_from_id(transport_id)
    n = t.shape[-1] // tr.size
    return t.narrow(-1, tr.rank * n, n).clone(memory_format=torch.contiguous_format)


@scatter_features_op.register_fake
def _(t, transport_id):
    return t.new_empty(list(t.shape[:-1]) + [t.shape[-1] // transport_id_size(transport_id)])


def _features_setup(ctx, inputs, output):
    ctx.transport_id = inputs[1]
    ctx.transports = hold(inputs[1])


def _gather_backward(ctx, grad):
    return input_grads(gather_features_op, t=scatter_features_op(grad, ctx.transport_id))


def _scatter_backward(ctx, grad):
    return input_grads(scatter_features_op, t=gather_features_op(grad, ctx.transport_id))


gather_features_op.register_autograd(_gather_backward, setup_context=_features_setup)


scatter_features_op.register_autograd(_scatter_backward, setup_context=_features_setup)


# ----------------------------------------------------------------------------------------------
# token-dim all-gather with a reduce-scatter backward (a rank's gradient differs per rank)
# ----------------------------------------------------------------------------------------------
@custom_op("all_gather_tokens")
def all_gather_tokens_op(t: Tensor, transport_id: str, dim: int) -> Tensor:
    tr = transport_from_id(transport_id)
    src = t.movedim(dim, 0).contiguous()
    out = src.new_empty((tr.size * src.shape[0],) + tuple(src.shape[1:]))
    tr.all_gather_into(out, src).wait()
    return out.movedim(0, dim).contiguous()


@all_gather_tokens_op.register_fake
def _(t, transport_id, dim):
    shape = list(t.shape)
    shape[dim] = shape[dim] * transport_id_size(transport_id)
    return t.new_empty(shape)


@custom_op("all_gather_tokens_backward")
def all_gather_tokens_backward_op(grad: Tensor, transport_id: str, dim: int) -> Tensor:
    tr = transport_from_id(transport_id)
    src = grad.movedim(dim, 0).to(torch.float32).contiguous()
    out = src.new_empty((src.shape[0] // tr.size,) + tuple(src.shape[1:]))
    tr.reduce_scatter_into(out, src).wait()
    return out.to(grad.dtype).movedim(0, dim).contiguous()


@all_gather_tokens_backward_op.register_fake
def _(grad, transport_id, dim):
    shape = list(grad.shape)
    shape[dim] = shape[dim] // transport_id_size(transport_id)
    return grad.new_empty(shape)


def _gather_tokens_setup(ctx, inputs, output):
    ctx.transport_id, ctx.dim = inputs[1], inputs[2]
    ctx.transports = hold(inputs[1])


def _gather_tokens_backward(ctx, grad):
    return input_grads(all_gather_tokens_op, t=all_gather_tokens_backward_op(grad, ctx.transport_id, ctx.dim))


all_gather_tokens_op.register_autograd(_gather_tokens_backward, setup_context=_gather_tokens_setup)


replicated_rows_op = custom_op("replicated_rows")(replicated_rows_fwd)


@replicated_rows_op.register_fake
def _(t, transport_id, start, block, blocks):
    return torch.empty_like(t)


replicated_rows_backward_op = custom_op("replicated_rows_backward")(replicated_rows_bwd)


@replicated_rows_backward_op.register_fake
def _(grad, transport_id, start, block, blocks):
    return torch.empty_like(grad)


def _setup(ctx, inputs, output):
    _, ctx.transport_id, ctx.start, ctx.block, ctx.blocks = inputs
    ctx.transports = hold(ctx.transport_id)


def _backward(ctx, grad):
    return input_grads(replicated_rows_op,
                       t=replicated_rows_backward_op(grad.contiguous(), ctx.transport_id, ctx.start, ctx.block, ctx.blocks))


replicated_rows_op.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------------------------
# the custom ops of the fp8 tensor-parallel GEMMs
# ----------------------------------------------------------------------------------------------
@custom_op("all_gather_matmul_fp8")
def all_gather_matmul_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str, x_q: Tensor | None = None,
                             x_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``options``: :func:`tp_options` of (transport id, dim, partial dtype, activation, recipe;
    grad_high_precision, keep_preact, keep_gathered, out_fp8)."""
    transport_id, dim, partial_dtype, activation, recipe, grad_high_precision, keep_preact, keep_gathered, \
        out_fp8 = parse_tp_options(options, "all_gather_matmul_fp8", x)
    opts = TPOptions(tp_transport(transport_id, x), dim, activation, partial_dtype)
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
def _(x, weight, bias, options, x_q=None, x_scale=None):
    transport_id, dim, _, activation, recipe, grad_high_precision, keep_preact, keep_gathered, out_fp8 = \
        parse_tp_options(options, "all_gather_matmul_fp8", x)
    P, lead = transport_id_size(transport_id), tuple(x.shape[:-1])
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
                                      preact: Tensor | None, transport_id: str, dim: int, activation: str,
                                      partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                      need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(transport_id, grad_out), dim, activation, partial_dtype)
    return grads_or_absent(*all_gather_matmul_fp8_bwd(grad_out, x, gathered, weight, preact, opts, recipe, grad_high_precision,
                                             need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@all_gather_matmul_fp8_backward_op.register_fake
def _(grad_out, x, gathered, weight, preact, transport_id, dim, activation, partial_dtype, recipe, grad_high_precision,
      need_dx, need_dw, need_db):
    lead = chunk_lead(grad_out.shape, dim, transport_id_size(transport_id))
    return grads_empty(grad_out.new_empty(lead + (weight.shape[1],)), weight, need_dx, need_dw, need_db)


def _ag_fp8_setup(ctx, inputs, output):
    x, weight, _, options = inputs[:4]
    transport_id, dim, partial_dtype, activation, recipe, hp, keep_preact, keep_gathered, _ = \
        parse_tp_options(options, "all_gather_matmul_fp8")
    ctx.args = (transport_id, dim, activation, partial_dtype, recipe, hp)
    ctx.transports = hold(transport_id)
    ctx.mark_non_differentiable(*output[3:])
    has_preact = keep_preact and activation != "none"
    ctx.save_for_backward(None if keep_gathered else x, output[2] if keep_gathered else None, weight,
                          output[1] if has_preact else None)


def _ag_fp8_backward(ctx, grad_out, grad_preact, grad_gathered, grad_q, grad_scale):
    x, gathered, weight, preact = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_out is None or not any(need):
        return input_grads(all_gather_matmul_fp8_op)
    grads = all_gather_matmul_fp8_backward_op(grad_out.contiguous(), x, gathered, weight, preact, *ctx.args, *need)
    return _input_grads(all_gather_matmul_fp8_op, ctx, *grads)


all_gather_matmul_fp8_op.register_autograd(_ag_fp8_backward, setup_context=_ag_fp8_setup)


@custom_op("matmul_reduce_scatter_fp8")
def matmul_reduce_scatter_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str,
                                 x_q: Tensor | None = None, x_scale: Tensor | None = None) -> Tensor:
    """``options``: :func:`tp_options` of (transport id, dim, partial dtype, recipe; grad_high_precision)."""
    transport_id, dim, partial_dtype, _, recipe, _ = parse_tp_options(options, "matmul_reduce_scatter_fp8", x)
    return matmul_reduce_scatter_fp8_fwd(x, weight, bias, TPOptions(tp_transport(transport_id, x), dim,
                                                                    partial_dtype=partial_dtype), recipe,
                                         x_fp8=None if x_q is None else (x_q, x_scale))


@matmul_reduce_scatter_fp8_op.register_fake
def _(x, weight, bias, options, x_q=None, x_scale=None):
    transport_id, dim = parse_tp_options(options, "matmul_reduce_scatter_fp8", x)[:2]
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[dim] = shape[dim] // transport_id_size(transport_id)
    return x.new_empty(shape)


@custom_op("matmul_reduce_scatter_fp8_backward")
def matmul_reduce_scatter_fp8_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, transport_id: str, dim: int,
                                          partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                          need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(transport_id, x), dim, partial_dtype=partial_dtype)
    return grads_or_absent(*matmul_reduce_scatter_fp8_bwd(grad_out, x, weight, opts, recipe, grad_high_precision,
                                                 need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@matmul_reduce_scatter_fp8_backward_op.register_fake
def _(grad_out, x, weight, transport_id, dim, partial_dtype, recipe, grad_high_precision, need_dx, need_dw, need_db):
    return grads_empty(x.new_empty(x.shape), weight, need_dx, need_dw, need_db)


def _rs_fp8_setup(ctx, inputs, output):
    x, weight, _, options = inputs[:4]
    transport_id, dim, partial_dtype, _, recipe, hp = parse_tp_options(options, "matmul_reduce_scatter_fp8")
    ctx.args = (transport_id, dim, partial_dtype, recipe, hp)
    ctx.transports = hold(transport_id)
    ctx.save_for_backward(x, weight)


def _rs_fp8_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grads = matmul_reduce_scatter_fp8_backward_op(grad_out.contiguous(), x, weight, *ctx.args,
                                                  *ctx.needs_input_grad[:3])
    return _input_grads(matmul_reduce_scatter_fp8_op, ctx, *grads)


matmul_reduce_scatter_fp8_op.register_autograd(_rs_fp8_backward, setup_context=_rs_fp8_setup)


@custom_op("matmul_all_reduce_fp8")
def matmul_all_reduce_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, options: str,
                             x_q: Tensor | None = None, x_scale: Tensor | None = None) -> Tensor:
    """``options``: :func:`tp_options` of (transport id, num_chunks, reduce dtype, recipe;
    grad_high_precision)."""
    transport_id, num_chunks, reduce_dtype, _, recipe, _ = parse_tp_options(options, "matmul_all_reduce_fp8")
    opts = TPOptions(tp_transport(transport_id, x), partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return matmul_all_reduce_fp8_fwd(x, weight, bias, opts, recipe, x_fp8=None if x_q is None else (x_q, x_scale))


@matmul_all_reduce_fp8_op.register_fake
def _(x, weight, bias, options, x_q=None, x_scale=None):
    parse_tp_options(options, "matmul_all_reduce_fp8")
    return x.new_empty(list(x.shape[:-1]) + [weight.shape[0]])


def _ar_fp8_setup(ctx, inputs, output):
    x, weight, _, options = inputs[:4]
    ctx.recipe, ctx.hp = parse_tp_options(options, "matmul_all_reduce_fp8")[4:6]
    ctx.save_for_backward(x, weight)


def _ar_fp8_backward(ctx, grad_out):
    """The replicated output's gradient is whole on every rank: :func:`fp8_linear_bwd`'s local
    GEMMs, no communication (the bias gradient a torch sum, as :func:`fp8_linear`'s)."""
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw = fp8_linear_backward_op(grad_out.contiguous(), x, weight, ctx.recipe, ctx.hp, need_dx, need_dw)
    db = sum_tokens(grad_out).to(weight.dtype) if need_db else None
    return _input_grads(matmul_all_reduce_fp8_op, ctx, dx, dw, db)


matmul_all_reduce_fp8_op.register_autograd(_ar_fp8_backward, setup_context=_ar_fp8_setup)


@custom_op("copy_to_tp_matmul_fp8")
def copy_to_tp_matmul_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None,
                             options: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``options``: :func:`tp_options` of (transport id, num_chunks, reduce dtype, activation,
    recipe; grad_high_precision, keep_preact, out_fp8). Local: the transport id, num_chunks and
    reduce dtype are the backward's."""
    _, _, _, activation, recipe, _, keep_preact, out_fp8 = parse_tp_options(options, "copy_to_tp_matmul_fp8")
    out, preact, fp8 = copy_to_tp_matmul_fp8_fwd(x, weight, bias, recipe, activation, keep_preact=keep_preact,
                                                 out_fp8=out_fp8)
    return out, (absent(x) if preact is None else preact), *(fp8 or (absent(x), absent(x)))


@copy_to_tp_matmul_fp8_op.register_fake
def _(x, weight, bias, options):
    _, _, _, activation, _, _, keep_preact, out_fp8 = parse_tp_options(options, "copy_to_tp_matmul_fp8")
    lead = list(x.shape[:-1])
    out = x.new_empty(lead + [activation_features(weight.shape[0], activation)])
    return (out, x.new_empty(lead + [weight.shape[0]]) if keep_preact and activation != "none" else absent(x),
            *_fp8_fake(out, out_fp8))


@custom_op("copy_to_tp_matmul_fp8_backward")
def copy_to_tp_matmul_fp8_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, preact: Tensor | None, transport_id: str,
                                      activation: str, num_chunks: int, reduce_dtype: torch.dtype, recipe: str,
                                      grad_high_precision: bool, need_dx: bool, need_dw: bool,
                                      need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(transport_id, x), activation=activation, partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return grads_or_absent(*copy_to_tp_matmul_fp8_bwd(grad_out, x, weight, preact, opts, recipe, grad_high_precision,
                                             need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@copy_to_tp_matmul_fp8_backward_op.register_fake
def _(grad_out, x, weight, preact, transport_id, activation, num_chunks, reduce_dtype, recipe, grad_high_precision,
      need_dx, need_dw, need_db):
    return grads_empty(grad_out.new_empty(x.shape), weight, need_dx, need_dw, need_db)


def _cp_fp8_setup(ctx, inputs, output):
    x, weight, _, options = inputs
    transport_id, num_chunks, reduce_dtype, activation, recipe, hp, keep_preact, _ = \
        parse_tp_options(options, "copy_to_tp_matmul_fp8")
    ctx.args = (transport_id, activation, num_chunks, reduce_dtype, recipe, hp)
    ctx.transports = hold(transport_id)
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(x, weight, output[1] if keep_preact and activation != "none" else None)


def _cp_fp8_backward(ctx, grad_out, grad_preact, grad_q, grad_scale):
    x, weight, preact = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_out is None or not any(need):
        return input_grads(copy_to_tp_matmul_fp8_op)
    grads = copy_to_tp_matmul_fp8_backward_op(grad_out.contiguous(), x, weight, preact, *ctx.args, *need)
    return _input_grads(copy_to_tp_matmul_fp8_op, ctx, *grads)


copy_to_tp_matmul_fp8_op.register_autograd(_cp_fp8_backward, setup_context=_cp_fp8_setup)
