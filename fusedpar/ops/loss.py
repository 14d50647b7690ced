"""Losses of a tensor-parallel model: the vocabulary-parallel cross entropy and the MoE router
loss carried by the backward.

``vocab_parallel_cross_entropy(logits, target, group)``: ``logits`` are this rank's block of the
vocabulary (rank ``r`` of ``group`` holds ids ``r*V/tp ..``); the loss is
``logsumexp(z) - z[target]`` per token without gathering the logits: the row max is
all-gathered, the sum of exponentials and the target logit are all-reduced (fp32). Every rank of
``group`` ends with the same loss; the gradient is this rank's block of ``softmax - onehot``.

Layers: :func:`vocab_parallel_cross_entropy_fwd` / :func:`vocab_parallel_cross_entropy_bwd`
(the math and the collectives) -> the ``torch.library`` ops ``fusedpar::vocab_parallel_cross_entropy`` /
``..._backward`` (the group as a transport token, see :mod:`fusedpar.ops.library`) ->
:func:`vocab_parallel_cross_entropy` (checks, flattening, reduction). The target ids are range-checked
on the host inside the ranks' agreement in eager mode; under ``torch.compile`` the op body checks them
(each rank alone: a compiled graph holds no agreement exchange).

``attach_aux_loss(x, aux_loss, scale)``: identity on ``x`` whose backward also sends gradient
``scale`` into ``aux_loss``, so router losses train the router even where the training loop never
sees them (inside a pipeline stage). The op ``fusedpar::attach_aux_loss`` returns a copy of ``x``
(a custom op's output cannot alias its input).
"""
from __future__ import annotations

import math

import torch

from fusedpar.kernels.checks import check_choice, check_shape, check_tensor

from . import comm
from .agreement import agreed_arguments
from .library import token_group, transport_token

REDUCTIONS = ("mean", "sum", "none")


def vocab_parallel_cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Per-token loss ``[T]`` (fp32) of ``logits`` ``[T, V/tp]`` against global ids ``target``
    ``[T]`` (int64), and what the backward needs: ``(loss, softmax, idx, inside)`` with
    ``softmax`` this rank's fp32 block of the full softmax, ``idx`` the target's column in this
    block and ``inside`` whether the target falls in it. A collective over ``group``."""
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
    loss = sum_exp.log() - target_logit
    return loss, exp.div_(sum_exp[:, None]), idx, inside


def vocab_parallel_cross_entropy_bwd(grad_loss: torch.Tensor, softmax: torch.Tensor, idx: torch.Tensor,
                                     inside: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the logits block: ``(softmax - onehot(target)) * grad_loss`` in ``dtype``
    (``softmax`` is left as it is). Local: the forward's collectives already made it exact."""
    g = grad_loss.float()
    grad = softmax * g[:, None]
    grad.scatter_add_(1, idx[:, None], -(inside.to(grad.dtype) * g)[:, None])
    return grad.to(dtype)


@torch.library.custom_op("fusedpar::vocab_parallel_cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, token: str, ignore_index: int,
                      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, softmax, idx, inside)`` of :func:`vocab_parallel_cross_entropy_fwd` for flat int64
    ``target`` (``ignore_index`` entries scored as class 0; the caller masks them). ``check_targets``:
    check the ids here (under torch.compile, where the functional API cannot read them)."""
    group = token_group(token)
    valid = target != ignore_index
    if check_targets:
        _check_target_range(target, valid, logits.shape[-1] * comm.group_size(group), ignore_index)
    safe = torch.where(valid, target, torch.zeros_like(target))
    return vocab_parallel_cross_entropy_fwd(logits, safe, group)


@_cross_entropy_op.register_fake
def _(logits, target, token, ignore_index, check_targets):
    T = logits.shape[0]
    return (logits.new_empty((T,), dtype=torch.float32), torch.empty_like(logits, dtype=torch.float32),
            torch.empty_like(target), target.new_empty((T,), dtype=torch.bool))


@torch.library.custom_op("fusedpar::vocab_parallel_cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(grad_loss: torch.Tensor, softmax: torch.Tensor, idx: torch.Tensor,
                               inside: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return vocab_parallel_cross_entropy_bwd(grad_loss, softmax, idx, inside, dtype)


@_cross_entropy_backward_op.register_fake
def _(grad_loss, softmax, idx, inside, dtype):
    return torch.empty_like(softmax, dtype=dtype)


def _cross_entropy_setup(ctx, inputs, output):
    ctx.dtype = inputs[0].dtype
    ctx.save_for_backward(*output[1:])


def _cross_entropy_backward(ctx, grad_loss, *unused):
    softmax, idx, inside = ctx.saved_tensors
    grad = torch.ops.fusedpar.vocab_parallel_cross_entropy_backward(grad_loss, softmax, idx, inside, ctx.dtype)
    return grad, None, None, None, None


_cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


def _check_target_range(target, valid, vocab, ignore_index):
    bad = valid & ((target < 0) | (target >= vocab))
    if target.numel() and bool(bad.any()):
        raise ValueError(f"target must hold ids in [0, {vocab}) or ignore_index={ignore_index}, got "
                         f"{target[bad][0].item()}")


def _checked_targets(logits, target, group, reduction, ignore_index):
    """The flat int64 targets and which of them count, after the argument checks."""
    check_tensor("logits", logits)
    check_tensor("target", target)
    check_shape("target", target, logits.shape[:-1])
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold integer class ids (torch.int64 or torch.int32), got dtype {target.dtype}")
    check_choice("reduction", reduction, REDUCTIONS)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    target = target.reshape(-1).long()
    valid = target != ignore_index
    if not torch.compiler.is_compiling():  # a host read: while compiling, the op checks the ids itself
        _check_target_range(target, valid, logits.shape[-1] * comm.group_size(group), ignore_index)
    return target, valid


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
    """Cross entropy of ``logits`` ``[..., V / tp]`` (this rank's vocabulary block, rank ``r`` holds
    ids ``r*V/tp ..``) against global ``target`` ids ``[...]``; ``reduction`` ``"mean"``, ``"sum"``
    or ``"none"``. Same result on every rank of ``group``; the gradient is this rank's block.

    Tokens whose target is ``ignore_index`` (default -100, as in ``torch.nn.functional.cross_entropy``
    and Hugging Face labels) contribute zero loss and zero gradient; ``"mean"`` averages over the
    other tokens (NaN when every token is ignored, as torch). Any other target outside
    ``[0, V)`` raises ``ValueError`` (this checks the targets on the host: one synchronisation)."""
    fields = dict(logits=logits, target=target, reduction=reduction, ignore_index=ignore_index)
    with agreed_arguments("vocab_parallel_cross_entropy", None, group, fields):  # a rank failing alone stops all
        target, valid = _checked_targets(logits, target, group, reduction, ignore_index)
    loss = torch.ops.fusedpar.vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target,
                                                           transport_token(None, group), ignore_index,
                                                           torch.compiler.is_compiling())[0]
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "mean":
        return loss.sum() / valid.sum()
    if reduction == "sum":
        return loss.sum()
    return loss.view(logits.shape[:-1])


@torch.library.custom_op("fusedpar::attach_aux_loss", mutates_args=())
def _attach_aux_loss_op(x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    return x.clone()  # a custom op's output cannot alias its input: one copy of x


@_attach_aux_loss_op.register_fake
def _(x, aux_loss, scale):
    return torch.empty_like(x)


def _attach_setup(ctx, inputs, output):
    _, aux_loss, ctx.scale = inputs
    ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype


def _attach_backward(ctx, grad):
    return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


_attach_aux_loss_op.register_autograd(_attach_backward, setup_context=_attach_setup)


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its backward adds ``scale * d(aux_loss)`` to the graph (``aux_loss`` gets
    gradient ``scale``), so a loss computed inside a layer trains it without being returned."""
    check_tensor("x", x)
    check_tensor("aux_loss", aux_loss)
    return torch.ops.fusedpar.attach_aux_loss(x, aux_loss, float(scale))
