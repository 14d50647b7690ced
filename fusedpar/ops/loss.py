"""Losses of a tensor-parallel model: the vocabulary-parallel cross entropy and the MoE router
loss carried by the backward.

``vocab_parallel_cross_entropy(logits, target, group)``: ``logits`` are this rank's block of the
vocabulary (rank ``r`` of ``group`` holds ids ``r*V/tp ..``); the loss is
``logsumexp(z) - z[target]`` per token without gathering the logits: the row max is
all-gathered, the sum of exponentials and the target logit are all-reduced (fp32). Every rank of
``group`` ends with the same loss; the gradient is this rank's block of ``softmax - onehot``.

Layers: :func:`vocab_parallel_cross_entropy_fwd` / :func:`vocab_parallel_cross_entropy_bwd`
(the math and the collectives) -> :class:`VocabParallelCrossEntropyFunction` (autograd) ->
:func:`vocab_parallel_cross_entropy` (checks, flattening, reduction).

``attach_aux_loss(x, aux_loss, scale)``: identity on ``x`` whose backward also sends gradient
``scale`` into ``aux_loss``, so router losses train the router even where the training loop never
sees them (inside a pipeline stage).
"""
from __future__ import annotations

import math

import torch

from fusedpar.kernels.checks import check_choice, check_shape, check_tensor

from . import comm
from .agreement import agreed_arguments

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
    (``softmax`` is overwritten). Local: the forward's collectives already made it exact."""
    grad = softmax
    grad.scatter_add_(1, idx[:, None], -inside.to(grad.dtype)[:, None])
    grad.mul_(grad_loss.float()[:, None])
    return grad.to(dtype)


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Autograd of the per-token loss: ``apply(logits [T, V/tp], target [T] int64, group)``."""

    @staticmethod
    def forward(ctx, logits, target, group):
        loss, softmax, idx, inside = vocab_parallel_cross_entropy_fwd(logits, target, group)
        ctx.save_for_backward(softmax, idx, inside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, inside = ctx.saved_tensors
        return vocab_parallel_cross_entropy_bwd(grad_loss, softmax, idx, inside, ctx.dtype), None, None


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
    vocab = logits.shape[-1] * comm.group_size(group)
    target = target.reshape(-1).long()
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    if target.numel() and bool(bad.any()):
        raise ValueError(f"target must hold ids in [0, {vocab}) or ignore_index={ignore_index}, got "
                         f"{target[bad][0].item()}")
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
    safe = torch.where(valid, target, torch.zeros_like(target))
    loss = VocabParallelCrossEntropyFunction.apply(logits.reshape(-1, logits.shape[-1]), safe, group)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "mean":
        return loss.sum() / valid.sum()
    if reduction == "sum":
        return loss.sum()
    return loss.view(logits.shape[:-1])


class AttachAuxLossFunction(torch.autograd.Function):
    """Identity on ``x``; the backward also sends gradient ``scale`` into ``aux_loss``."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its backward adds ``scale * d(aux_loss)`` to the graph (``aux_loss`` gets
    gradient ``scale``), so a loss computed inside a layer trains it without being returned."""
    check_tensor("x", x)
    check_tensor("aux_loss", aux_loss)
    return AttachAuxLossFunction.apply(x, aux_loss, float(scale))
