"""The custom ops of the losses of :mod:`fusedpar.ops.loss` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::vocab_parallel_cross_entropy(logits, target, token, ignore_index, check_targets)
  -> (loss, lse, idx, inside)`` (:data:`vocab_parallel_cross_entropy_op`, body
  :func:`vocab_parallel_cross_entropy_fwd`: the math and the collectives over the group the
  token names) and ``fusedpar::vocab_parallel_cross_entropy_backward``
  (:data:`vocab_parallel_cross_entropy_backward_op`, body :func:`vocab_parallel_cross_entropy_bwd`).
* ``fusedpar::attach_aux_loss(x, aux_loss, scale, residual)`` (:data:`attach_aux_loss_op`, body
  :func:`attach_aux_loss_fwd`): a copy of ``x`` (a custom op's output cannot alias its input),
  or ``x + residual``; its registered backward sends gradient ``scale`` into ``aux_loss`` in
  closed form (no backward op).
* ``fusedpar::global_loss(total, count, tokens, mean) -> (loss, global_count)``
  (:data:`global_loss_op`, body :func:`global_loss_fwd`): a loss summed (and its counted tokens
  counted) over the data ranks; its registered backward, in closed form, scales the gradient of
  ``total`` by the number of data ranks (no backward op).
"""
from __future__ import annotations

import math

import torch

from . import comm
from .library import custom_op, hold, input_grads, token_group, token_size
from .transport import token_transport

__all__ = [
    "attach_aux_loss_fwd", "data_tokens", "global_loss_fwd", "global_loss_op", "attach_aux_loss_op", "check_target_range", "vocab_parallel_cross_entropy_backward_op",
    "vocab_parallel_cross_entropy_bwd", "vocab_parallel_cross_entropy_fwd", "vocab_parallel_cross_entropy_op",
]


def vocab_parallel_cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Per-token loss ``[T]`` (fp32) of ``logits`` ``[T, V/tp]`` against global ids ``target``
    ``[T]`` (int64), and what the backward needs besides ``logits``: ``(loss, lse, idx, inside)``
    with ``lse`` the fp32 log-sum-exp of the full row (the softmax is recomputed from it: a
    vocabulary-sized fp32 block is not kept between forward and backward), ``idx`` the target's
    column in this block and ``inside`` whether the target falls in it. A collective over ``group``."""
    T, V = logits.shape
    P, r = comm.group_size(group), comm.group_rank(group)
    z = logits.float()
    local_max = z.max(dim=-1).values if V else torch.full((T,), -math.inf, device=z.device)
    if P > 1:
        maxes = torch.empty(P * T, device=z.device, dtype=torch.float32)
        comm.all_gather_into(maxes, local_max.contiguous(), group).wait()
        row_max = maxes.view(P, T).max(dim=0).values
    else:
        row_max = local_max
    z = z - row_max[:, None]
    exp = z.exp()
    lo = r * V
    inside = (target >= lo) & (target < lo + V)
    idx = torch.where(inside, target - lo, torch.zeros_like(target))
    picked = z.gather(1, idx[:, None]).squeeze(1) * inside
    stats = torch.stack([exp.sum(dim=-1), picked])  # [2, T]
    if P > 1:
        comm.all_reduce(stats, group).wait()
    sum_exp, target_logit = stats[0], stats[1]
    log_sum = sum_exp.log()
    return log_sum - target_logit, row_max + log_sum, idx, inside


def vocab_parallel_cross_entropy_bwd(grad_loss: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                                     idx: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """Gradient of the logits block, ``(softmax - onehot(target)) * grad_loss`` in ``logits.dtype``,
    the softmax recomputed as ``exp(logits - lse)`` into one fp32 buffer. Local: the forward's
    collectives already made ``lse`` the full row's."""
    g = grad_loss.float()
    grad = torch.sub(logits, lse[:, None]).exp_().mul_(g[:, None])  # fp32 (lse's dtype wins)
    grad.scatter_add_(1, idx[:, None], -(inside.to(grad.dtype) * g)[:, None])
    return grad.to(logits.dtype)


@custom_op("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, token: str, ignore_index: int,
                      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, idx, inside)`` of :func:`vocab_parallel_cross_entropy_fwd` for flat int64
    ``target`` (``ignore_index`` entries scored as class 0; the caller masks them). ``check_targets``:
    check the ids here (under torch.compile, where the functional API cannot read them)."""
    group = token_group(token)
    valid = target != ignore_index
    if check_targets:
        check_target_range(target, valid, logits.shape[-1] * comm.group_size(group), ignore_index)
    safe = torch.where(valid, target, torch.zeros_like(target))
    return vocab_parallel_cross_entropy_fwd(logits, safe, group)


@vocab_parallel_cross_entropy_op.register_fake
def _(logits, target, token, ignore_index, check_targets):
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


def check_target_range(target, valid, vocab, ignore_index):
    """Every counted (``valid``) target id lies in ``[0, vocab)`` (a host read of the ids)."""
    bad = valid & ((target < 0) | (target >= vocab))
    if target.numel() and bool(bad.any()):
        raise ValueError(f"target must hold ids in [0, {vocab}) or ignore_index={ignore_index}, got "
                         f"{target[bad][0].item()}")


def attach_aux_loss_fwd(x: torch.Tensor, aux_loss: torch.Tensor, scale: float,
                        residual: torch.Tensor | None) -> torch.Tensor:
    """``x`` copied, or ``x + residual`` (``aux_loss`` and ``scale`` are the backward's)."""
    # a custom op's output cannot alias its input: x is copied, or (with a residual) the add that
    # follows anyway writes the new tensor
    out = torch.empty(x.shape, dtype=x.dtype if residual is None else torch.result_type(x, residual), device=x.device)
    return out.copy_(x) if residual is None else torch.add(x, residual, out=out)


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


# ----------------------------------------------------------------------------------------------
# the loss over the data ranks
# ----------------------------------------------------------------------------------------------
def data_tokens(tokens: str) -> list[str]:
    """The transport tokens of ``global_loss``'s ``tokens`` argument (``;``-separated; a schema
    holds no list of strings)."""
    return [t for t in tokens.split(";") if t]


def global_loss_fwd(total: torch.Tensor, count: torch.Tensor, tokens: str,
                    mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, global_count)``: ``total`` (a scalar loss sum) and ``count`` (counted tokens)
    summed in fp64 over every group ``tokens`` names (one all-reduce of two numbers per group of
    more than one rank), then ``sum / count`` if ``mean`` else ``sum``; fp32 scalars."""
    pair = torch.stack([total.detach().double().reshape(()), count.detach().double().reshape(())])
    for tok in data_tokens(tokens):
        t = token_transport(tok)
        if t.size > 1:
            t.all_reduce(pair).wait()
    loss = pair[0] / pair[1] if mean else pair[0]
    return loss.float(), pair[1].float()


global_loss_op = custom_op("global_loss")(global_loss_fwd)


@global_loss_op.register_fake
def _(total, count, tokens, mean):
    return total.new_empty((), dtype=torch.float32), total.new_empty((), dtype=torch.float32)


def _global_setup(ctx, inputs, output):
    total, _, tokens, ctx.mean = inputs
    ctx.n = math.prod(token_size(t) for t in data_tokens(tokens))
    ctx.total_dtype = total.dtype
    ctx.transports = hold(*data_tokens(tokens))
    ctx.save_for_backward(output[1])


def _global_backward(ctx, grad, _unused):
    (count,) = ctx.saved_tensors
    scale = grad * ctx.n / count if ctx.mean else grad * ctx.n  # sync_gradients divides by the data ranks
    return input_grads(global_loss_op, total=scale.to(ctx.total_dtype))


global_loss_op.register_autograd(_global_backward, setup_context=_global_setup)
