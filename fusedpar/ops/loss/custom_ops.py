"""The custom ops of the loss family (see :mod:`fusedpar.ops.common`):
``fusedpar::vocab_parallel_cross_entropy`` / ``..._backward``, ``fusedpar::linear_cross_entropy``
/ ``..._backward``, ``fusedpar::global_loss`` / ``..._backward`` and
``fusedpar::attach_aux_loss`` (its backward closed-form: gradient ``scale`` into the aux loss),
each bound to ``<op>_op``, bodies in :mod:`.bodies`."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from fusedpar.ops import comm
from fusedpar.ops.comm.keys import hold, transport_id_group, transport_id_size
from fusedpar.ops.comm.transport import transport_from_id
from fusedpar.ops.common import absent, custom_op, input_grads, present
from fusedpar.ops.loss.bodies import (
    LCEOptions,
    attach_aux_loss_fwd,
    check_target_range,
    data_transport_ids,
    global_loss_fwd,
    linear_cross_entropy_bwd,
    linear_cross_entropy_fwd,
    vocab_parallel_cross_entropy_bwd,
    vocab_parallel_cross_entropy_fwd,
)


@custom_op("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, transport_id: str, ignore_index: int,
                      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, idx, inside)`` of :func:`vocab_parallel_cross_entropy_fwd` for flat int64
    ``target`` (``ignore_index`` entries scored as class 0; the caller masks them). ``check_targets``:
    check the ids here (under torch.compile, where the functional API cannot read them)."""
    group = transport_id_group(transport_id)
    valid = target != ignore_index
    if check_targets:
        check_target_range(target, valid, logits.shape[-1] * comm.group_size(group), ignore_index)
    safe = torch.where(valid, target, torch.zeros_like(target))
    return vocab_parallel_cross_entropy_fwd(logits, safe, group)


@vocab_parallel_cross_entropy_op.register_fake
def _(logits, target, transport_id, ignore_index, check_targets):
    T = logits.shape[0]
    return (logits.new_empty((T,), dtype=torch.float32), logits.new_empty((T,), dtype=torch.float32),
            torch.empty_like(target), target.new_empty((T,), dtype=torch.bool))


vocab_parallel_cross_entropy_backward_op = custom_op("vocab_parallel_cross_entropy_backward")(
    vocab_parallel_cross_entropy_bwd)


@vocab_parallel_cross_entropy_backward_op.register_fake
def _(grad_loss, logits, lse, idx, inside):
    return logits.new_empty(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], *output[1:])  # logits, lse, idx, inside


def _cross_entropy_backward(ctx, grad_loss, *unused):
    logits, lse, idx, inside = ctx.saved_tensors
    grad = vocab_parallel_cross_entropy_backward_op(grad_loss, logits, lse, idx, inside)
    return input_grads(vocab_parallel_cross_entropy_op, logits=grad)


vocab_parallel_cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


attach_aux_loss_op = custom_op("attach_aux_loss")(attach_aux_loss_fwd)


@attach_aux_loss_op.register_fake
def _(x, aux_loss, scale, residual):
    return x.new_empty(x.shape, dtype=x.dtype if residual is None else torch.result_type(x, residual))


def _attach_setup(ctx, inputs, output):
    x, aux_loss, ctx.scale, residual = inputs
    ctx.aux_shape, ctx.aux_dtype, ctx.x_dtype = aux_loss.shape, aux_loss.dtype, x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype


def _attach_backward(ctx, grad):
    d_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
    d_res = None if ctx.residual_dtype is None else grad.to(ctx.residual_dtype)
    return input_grads(attach_aux_loss_op, x=grad.to(ctx.x_dtype), aux_loss=d_aux, residual=d_res)


attach_aux_loss_op.register_autograd(_attach_backward, setup_context=_attach_setup)


global_loss_op = custom_op("global_loss")(global_loss_fwd)


@global_loss_op.register_fake
def _(total, count, transport_ids, mean):
    return total.new_empty((), dtype=torch.float32), total.new_empty((), dtype=torch.float32)


def _global_setup(ctx, inputs, output):
    total, _, transport_ids, ctx.mean = inputs
    ctx.n = math.prod(transport_id_size(t) for t in data_transport_ids(transport_ids))
    ctx.total_dtype = total.dtype
    ctx.transports = hold(*data_transport_ids(transport_ids))
    ctx.save_for_backward(output[1])


def _global_backward(ctx, grad, _unused):
    (count,) = ctx.saved_tensors
    scale = grad * ctx.n / count if ctx.mean else grad * ctx.n  # sync_gradients divides by the data ranks
    return input_grads(global_loss_op, total=scale.to(ctx.total_dtype))


global_loss_op.register_autograd(_global_backward, setup_context=_global_setup)


def _options(transport_id, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens):
    t = transport_from_id(transport_id)
    return LCEOptions(t, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens, weight.shape[0] * t.size)


@custom_op("linear_cross_entropy")
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, targets: Tensor, transport_id: str, sequence_parallel: bool,
                            ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
                            chunk_tokens: int, check_targets: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, lse, gathered)`` of :func:`linear_cross_entropy_fwd` (``gathered`` absent without
    ``sequence_parallel``); ``check_targets``: range-check the ids here (under torch.compile)."""
    opts = _options(transport_id, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens)
    if check_targets:
        check_target_range(targets, targets != ignore_index, opts.vocab, ignore_index)
    loss, lse, gathered = linear_cross_entropy_fwd(hidden, weight, targets, opts, sequence_parallel)
    return loss, lse, (absent(hidden) if gathered is None else gathered)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, targets, transport_id, sequence_parallel, ignore_index, label_smoothing, z_loss, softcap,
      chunk_tokens, check_targets):
    T = targets.shape[0]
    gathered = hidden.new_empty((transport_id_size(transport_id),) + tuple(hidden.shape)) if sequence_parallel else absent(hidden)
    return hidden.new_empty((T,), dtype=torch.float32), hidden.new_empty((T,), dtype=torch.float32), gathered


@custom_op("linear_cross_entropy_backward")
def linear_cross_entropy_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor, lse: Tensor,
                                     gathered: Tensor, transport_id: str, sequence_parallel: bool, ignore_index: int,
                                     label_smoothing: float, z_loss: float, softcap: float, chunk_tokens: int,
                                     need_dx: bool, need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(d_hidden, d_weight)`` of :func:`linear_cross_entropy_bwd` (absent where not needed)."""
    opts = _options(transport_id, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens)
    dx, dw = linear_cross_entropy_bwd(grad_loss, hidden, weight, targets, lse, present(gathered), opts,
                                      sequence_parallel, need_dx=need_dx, need_dw=need_dw)
    return (absent(hidden) if dx is None else dx), (absent(weight) if dw is None else dw)


@linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, targets, lse, gathered, transport_id, sequence_parallel, ignore_index, label_smoothing,
      z_loss, softcap, chunk_tokens, need_dx, need_dw):
    return (hidden.new_empty(hidden.shape) if need_dx else absent(hidden),
            weight.new_empty(weight.shape) if need_dw else absent(weight))


def _setup(ctx, inputs, output):
    hidden, weight, targets, transport_id, sp, *options, _ = inputs
    ctx.args = (transport_id, sp, *options)
    ctx.transports = hold(transport_id)
    ctx.save_for_backward(hidden, weight, targets, output[1], output[2])


def _backward(ctx, grad_loss, *unused):
    hidden, weight, targets, lse, gathered = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = linear_cross_entropy_backward_op(grad_loss, hidden, weight, targets, lse, gathered, *ctx.args,
                                              need_dx, need_dw)
    return input_grads(linear_cross_entropy_op, hidden=dx if need_dx else None, weight=dw if need_dw else None)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)
