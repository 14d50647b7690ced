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

from fusedpar.kernels.checks import check_choice, check_same, check_shape, check_tensor

from . import comm
from .agreement import agreed_arguments
from .library import token_group, transport_token

REDUCTIONS = ("mean", "sum", "none")


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


@torch.library.custom_op("fusedpar::vocab_parallel_cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, token: str, ignore_index: int,
                      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, idx, inside)`` of :func:`vocab_parallel_cross_entropy_fwd` for flat int64
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
    return (logits.new_empty((T,), dtype=torch.float32), logits.new_empty((T,), dtype=torch.float32),
            torch.empty_like(target), target.new_empty((T,), dtype=torch.bool))


@torch.library.custom_op("fusedpar::vocab_parallel_cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(grad_loss: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor,
                               inside: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy_bwd(grad_loss, logits, lse, idx, inside)


@_cross_entropy_backward_op.register_fake
def _(grad_loss, logits, lse, idx, inside):
    return logits.new_empty(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], *output[1:])  # logits, lse, idx, inside


def _cross_entropy_backward(ctx, grad_loss, *unused):
    logits, lse, idx, inside = ctx.saved_tensors
    grad = torch.ops.fusedpar.vocab_parallel_cross_entropy_backward(grad_loss, logits, lse, idx, inside)
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
def _attach_aux_loss_op(x: torch.Tensor, aux_loss: torch.Tensor, scale: float,
                        residual: torch.Tensor | None) -> torch.Tensor:
    # a custom op's output cannot alias its input: x is copied, or (with a residual) the add that
    # follows anyway writes the new tensor
    out = torch.empty(x.shape, dtype=x.dtype if residual is None else torch.result_type(x, residual), device=x.device)
    return out.copy_(x) if residual is None else torch.add(x, residual, out=out)


@_attach_aux_loss_op.register_fake
def _(x, aux_loss, scale, residual):
    return x.new_empty(x.shape, dtype=x.dtype if residual is None else torch.result_type(x, residual))


def _attach_setup(ctx, inputs, output):
    x, aux_loss, ctx.scale, residual = inputs
    ctx.aux_shape, ctx.aux_dtype, ctx.x_dtype = aux_loss.shape, aux_loss.dtype, x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype


def _attach_backward(ctx, grad):
    d_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
    d_res = None if ctx.residual_dtype is None else grad.to(ctx.residual_dtype)
    return grad.to(ctx.x_dtype), d_aux, None, d_res


_attach_aux_loss_op.register_autograd(_attach_backward, setup_context=_attach_setup)


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, scale: float, *,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (a copy; ``x + residual`` with ``residual``, the add a block does next anyway, so the
    attachment costs no extra pass); its backward adds ``scale * d(aux_loss)`` to the graph
    (``aux_loss`` gets gradient ``scale``), so a loss computed inside a layer trains it without
    being returned."""
    check_tensor("x", x)
    check_tensor("aux_loss", aux_loss)
    if residual is not None:
        check_tensor("residual", residual)
        check_same("residual", residual, "x", x, dtype=False, shape=True)  # dtypes may differ (fp32 stream)
    return torch.ops.fusedpar.attach_aux_loss(x, aux_loss, float(scale), residual)
