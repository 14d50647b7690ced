"""Losses of a tensor-parallel model: the vocabulary-parallel cross entropy and the MoE router
loss carried by the backward.

``vocab_parallel_cross_entropy(logits, target, group)``: ``logits`` are this rank's block of the
vocabulary (rank ``r`` of ``group`` holds ids ``r*V/tp ..``); the loss is
``logsumexp(z) - z[target]`` per token without gathering the logits: the row max is
all-gathered, the sum of exponentials and the target logit are all-reduced (fp32). Every rank of
``group`` ends with the same loss; the gradient is this rank's block of ``softmax - onehot``.

Layers: :func:`~fusedpar.ops.loss_library.vocab_parallel_cross_entropy_fwd` /
:func:`~fusedpar.ops.loss_library.vocab_parallel_cross_entropy_bwd` (the math and the collectives)
-> the custom ops ``fusedpar::vocab_parallel_cross_entropy`` / ``..._backward`` of
:mod:`fusedpar.ops.loss_library` (the group as a transport token, see :mod:`fusedpar.ops.library`) ->
:func:`vocab_parallel_cross_entropy` (checks, flattening, reduction). The target ids are range-checked
on the host inside the ranks' agreement in eager mode; under ``torch.compile`` the op body checks them
(each rank alone: a compiled graph holds no agreement exchange).

``global_loss(total, count, data_group, reduction)``: a loss over the tokens of every data rank
(the sequence-parallel and data-parallel ranks that hold different tokens): ``"mean"`` is the sum
over all of them divided by the number of counted tokens of all of them, the same value on every
rank; its gradient is scaled by the number of data ranks, which
:func:`fusedpar.parallel.sync_gradients` divides by (it averages gradients over the data ranks),
so the synced gradients are the one-process ones however unevenly ``ignore_index`` tokens fall.

``attach_aux_loss(x, aux_loss, scale)``: identity on ``x`` whose backward also sends gradient
``scale`` into ``aux_loss``, so router losses train the router even where the training loop never
sees them (inside a pipeline stage). The op ``fusedpar::attach_aux_loss``
(:data:`~fusedpar.ops.loss_library.attach_aux_loss_op`) returns a copy of ``x`` (a custom op's
output cannot alias its input).
"""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_choice, check_int, check_same, check_shape, check_tensor

from . import comm
from .agreement import agreed_arguments
from .library import checked_api, transport_token
from .loss_library import attach_aux_loss_op, check_target_range, global_loss_op, vocab_parallel_cross_entropy_op

__all__ = ["REDUCTIONS", "attach_aux_loss", "check_target_args", "data_group_token", "global_loss", "reduce_token_losses",
           "vocab_parallel_cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def check_target_args(name: str, target: torch.Tensor, reduction: str, ignore_index: int) -> None:
    """What every cross entropy checks of its targets: integer class ids, a known ``reduction``,
    an int ``ignore_index``."""
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer class ids (torch.int64 or torch.int32), got dtype {target.dtype}")
    check_choice("reduction", reduction, REDUCTIONS)
    check_int("ignore_index", ignore_index)


def _checked_targets(logits, target, group, reduction, ignore_index):
    """The flat int64 targets and which of them count, after the argument checks."""
    check_tensor("logits", logits)
    check_tensor("target", target)
    check_shape("target", target, logits.shape[:-1])
    check_target_args("target", target, reduction, ignore_index)
    target = target.reshape(-1).long()
    valid = target != ignore_index
    if not torch.compiler.is_compiling():  # a host read: while compiling, the op checks the ids itself
        check_target_range(target, valid, logits.shape[-1] * comm.group_size(group), ignore_index)
    return target, valid


@checked_api
def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 reduction: str = "mean", ignore_index: int = -100, *,
                                 data_group=None) -> torch.Tensor:
    """Cross entropy of ``logits`` ``[..., V / tp]`` (this rank's vocabulary block, rank ``r`` holds
    ids ``r*V/tp ..``) against global ``target`` ids ``[...]``; ``reduction`` ``"mean"``, ``"sum"``
    or ``"none"``. Same result on every rank of ``group``; the gradient is this rank's block.

    Tokens whose target is ``ignore_index`` (default -100, as in ``torch.nn.functional.cross_entropy``
    and Hugging Face labels) contribute zero loss and zero gradient; ``"mean"`` averages over the
    other tokens (NaN when every token is ignored, as torch). Any other target outside
    ``[0, V)`` raises ``ValueError`` (this checks the targets on the host: one synchronisation).
    ``data_group``: see :func:`reduce_token_losses`."""
    data_token = data_group_token(data_group)
    fields = dict(logits=logits, target=target, reduction=reduction, ignore_index=ignore_index)
    with agreed_arguments("vocab_parallel_cross_entropy", None, group, fields):  # a rank failing alone stops all
        target, valid = _checked_targets(logits, target, group, reduction, ignore_index)
    loss = vocab_parallel_cross_entropy_op(logits.reshape(-1, logits.shape[-1]), target, transport_token(None, group),
                                           ignore_index, torch.compiler.is_compiling())[0]
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return reduce_token_losses(loss, valid, reduction, data_token, logits.shape[:-1])


def data_group_token(data_group) -> str:
    """The ``;``-joined transport tokens of ``data_group``: ``None`` (no data ranks: empty), a
    process group, or a sequence of them (``None`` inside a sequence: the default group)."""
    if data_group is None:
        return ""
    groups = tuple(data_group) if isinstance(data_group, (tuple, list)) else (data_group,)
    return ";".join(transport_token(None, g) for g in groups)


def reduce_token_losses(loss: torch.Tensor, valid: torch.Tensor, reduction: str, data_token: str, shape):
    """The reduction of per-token fp32 losses ``loss`` (0 where not ``valid``): ``"none"`` (viewed
    as ``shape``), ``"sum"``, ``"mean"`` over the counted tokens. With data ranks (``data_token``
    from :func:`data_group_token` of a ``data_group``: the sequence-parallel group(s), plus the
    data-parallel group for a mean over the global batch) ``"sum"`` and ``"mean"`` cover every
    data rank's tokens (:func:`global_loss`)."""
    if reduction == "none":
        return loss.view(shape)
    if data_token:
        return global_loss_op(loss.sum(), valid.sum(), data_token, reduction == "mean")[0]
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()


@checked_api
def global_loss(total: torch.Tensor, count: torch.Tensor, data_group, reduction: str = "mean") -> torch.Tensor:
    """``total`` (this rank's summed loss) and ``count`` (its counted tokens) summed over
    ``data_group`` (a group or a sequence of groups): the sum over the data ranks, divided by their
    count for ``"mean"``; the same fp32 scalar on every rank. Its gradient into ``total`` is ``n /
    count`` (``n`` for ``"sum"``) with ``n`` the number of data ranks, so that gradients averaged
    over them (:func:`fusedpar.parallel.sync_gradients`) are those of the global loss."""
    check_tensor("total", total)
    check_tensor("count", count)
    check_choice("reduction", reduction, ("mean", "sum"))
    return global_loss_op(total, count, data_group_token(data_group), reduction == "mean")[0]


@checked_api
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
    return attach_aux_loss_op(x, aux_loss, float(scale), residual)
