"""Losses of a parallel model, the functional API.

* :func:`vocab_parallel_cross_entropy(logits, target, group)` -- ``logits`` are this rank's block
  of the vocabulary; ``logsumexp(z) - z[target]`` per token without gathering the logits (the row
  max all-gathered, the sum of exponentials and the target logit all-reduced in fp32).
* :func:`linear_cross_entropy(hidden, weight, targets, group)` -- the same loss of
  ``hidden @ weight.T`` computed in GEMM epilogues: the logits never exist in memory.
* :func:`global_loss` -- a loss over the data ranks (sum or mean over every rank's tokens);
  :func:`reduce_token_losses` its one-process form.
* :func:`attach_aux_loss` -- carries a router loss into the backward through the hidden states."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import (
    check_bool,
    check_choice,
    check_int,
    check_same,
    check_shape,
    check_softcap,
    check_tensor,
)
from fusedpar.kernels.runtime import SUPPORTED_DTYPES
from fusedpar.ops import comm
from fusedpar.ops.comm.agreement import agreed_arguments
from fusedpar.ops.comm.keys import transport_size, transport_id_of
from fusedpar.ops.common import checked_api
from fusedpar.ops.loss.bodies import check_target_range, default_chunk_tokens
from fusedpar.ops.loss.custom_ops import (
    attach_aux_loss_op,
    global_loss_op,
    linear_cross_entropy_op,
    vocab_parallel_cross_entropy_op,
)

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
    data_transport_id = data_group_transport_id(data_group)
    fields = dict(logits=logits, target=target, reduction=reduction, ignore_index=ignore_index)
    with agreed_arguments("vocab_parallel_cross_entropy", None, group, fields):  # a rank failing alone stops all
        target, valid = _checked_targets(logits, target, group, reduction, ignore_index)
    loss = vocab_parallel_cross_entropy_op(logits.reshape(-1, logits.shape[-1]), target, transport_id_of(None, group),
                                           ignore_index, torch.compiler.is_compiling())[0]
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return reduce_token_losses(loss, valid, reduction, data_transport_id, logits.shape[:-1])


def data_group_transport_id(data_group) -> str:
    """The ``;``-joined transport ids of ``data_group``: ``None`` (no data ranks: empty), a
    process group, or a sequence of them (``None`` inside a sequence: the default group)."""
    if data_group is None:
        return ""
    groups = tuple(data_group) if isinstance(data_group, (tuple, list)) else (data_group,)
    return ";".join(transport_id_of(None, g) for g in groups)


def reduce_token_losses(loss: torch.Tensor, valid: torch.Tensor, reduction: str, data_transport_id: str, shape):
    """The reduction of per-token fp32 losses ``loss`` (0 where not ``valid``): ``"none"`` (viewed
    as ``shape``), ``"sum"``, ``"mean"`` over the counted tokens. With data ranks (``data_token``
    from :func:`data_group_token` of a ``data_group``: the sequence-parallel group(s), plus the
    data-parallel group for a mean over the global batch) ``"sum"`` and ``"mean"`` cover every
    data rank's tokens (:func:`global_loss`)."""
    if reduction == "none":
        return loss.view(shape)
    if data_transport_id:
        return global_loss_op(loss.sum(), valid.sum(), data_transport_id, reduction == "mean")[0]
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
    return global_loss_op(total, count, data_group_transport_id(data_group), reduction == "mean")[0]


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


def _check_number(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (value >= lo and (hi is None or value <= hi)):
        raise ValueError(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {value}")


def _check_args(hidden, weight, targets, P, sequence_parallel, reduction, ignore_index, label_smoothing, z_loss,
                softcap, chunk_tokens):
    """The local checks; returns the expected ``targets`` shape."""
    check_bool("sequence_parallel", sequence_parallel)
    check_tensor("hidden", hidden, dims=(3,) if sequence_parallel else None, dtypes=SUPPORTED_DTYPES)
    check_tensor("weight", weight, dims=(2,))
    check_same("weight", weight, "hidden", hidden)
    if hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V / tp, {hidden.shape[-1] if hidden.dim() else '?'}] (hidden's "
                         f"last dim), got {tuple(weight.shape)}")
    check_tensor("targets", targets)
    check_target_args("targets", targets, reduction, ignore_index)
    shape = (hidden.shape[0], hidden.shape[1] * P) if sequence_parallel else tuple(hidden.shape[:-1])
    if tuple(targets.shape) != shape:
        raise ValueError(f"targets must have shape {shape} ({'[b, s] of the whole group' if sequence_parallel else 'hidden.shape[:-1]'}), "
                         f"got {tuple(targets.shape)}")
    _check_number("label_smoothing", label_smoothing, 0.0, 1.0)
    _check_number("z_loss", z_loss, 0.0)
    check_softcap(softcap)
    if chunk_tokens is not None:
        check_int("chunk_tokens", chunk_tokens, min_value=1)
    return shape


@checked_api
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, group=None,
                         transport=None, sequence_parallel: bool = False, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float | None = None, chunk_tokens: int | None = None,
                         data_group=None) -> torch.Tensor:
    """Cross entropy of the logits ``hidden @ weight.T`` against ``targets`` without materialising
    them; differentiable in ``hidden`` and ``weight``.

    hidden:  ``[..., H]``, the same tokens on every rank of ``group``; with ``sequence_parallel``
             ``[b, s / tp, H]``, this rank's sequence shard (tokens gathered over ``group`` inside,
             the gradient reduce-scattered back).
    weight:  ``[V / tp, H]``, this rank's vocabulary rows (rank ``r`` holds ids ``r*V/tp ..``; the
             ``nn.Linear`` layout of a column-parallel head).
    targets: ``hidden.shape[:-1]`` global ids (``[b, s]``, the whole group's tokens in
             ``[rank-major]`` order with ``sequence_parallel``); ``ignore_index`` tokens count nothing.
    group / transport: the tensor-parallel (vocabulary) group, or a Transport instance.
    reduction: ``"none"`` (per-token fp32 losses, 0 where ignored), ``"sum"``, ``"mean"`` (over the
             counted tokens: NaN if none, ``"sum"`` gives 0, as torch). Without ``data_group`` they
             cover this group's tokens; with it (the sequence-parallel group(s), plus dp for the
             global batch) every data rank's (:func:`fusedpar.ops.loss.api.reduce_token_losses`).
    label_smoothing: as ``torch.nn.functional.cross_entropy``; ``z_loss``: adds ``z_loss * lse^2``
             per token (PaLM); ``softcap``: logits ``c * tanh(z / c)`` first (Gemma 2).
    chunk_tokens: the backward's working memory, in rows of fp32 logits: its vocabulary block's
             gradient ``[T, Vb]`` (in hidden's dtype) takes at most the bytes of ``chunk_tokens x
             V / tp`` fp32 elements (default: 256 MiB, 512 rows for a 128k vocabulary on one rank).
             Besides it: an fp32 ``[T, H]`` d_hidden accumulator, per-tile row statistics in the
             forward (``V / tp / 128`` fp32 numbers per token and statistic on a GPU), ``d_weight``
             itself, and the gathered tokens ``[b, s, H]`` with ``sequence_parallel``.
    """
    P = transport_size(transport, group)
    fields = dict(hidden=hidden, weight=weight, targets=targets, sequence_parallel=sequence_parallel,
                  ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                  softcap=softcap, chunk_tokens=chunk_tokens)
    with agreed_arguments("linear_cross_entropy", transport, group, fields):
        shape = _check_args(hidden, weight, targets, P, sequence_parallel, reduction, ignore_index, label_smoothing,
                            z_loss, softcap, chunk_tokens)
        flat = targets.long()
        if sequence_parallel:  # block order: (source rank, batch, position)
            flat = flat.view(shape[0], P, -1).transpose(0, 1)
        flat = flat.reshape(-1)
        if not torch.compiler.is_compiling():  # a host read: while compiling, the op checks the ids itself
            check_target_range(flat, flat != ignore_index, weight.shape[0] * P, ignore_index)
    transport_id = transport_id_of(transport, group)
    chunk = chunk_tokens or default_chunk_tokens(flat.shape[0], weight.shape[0])
    loss = linear_cross_entropy_op(hidden, weight, flat, transport_id, sequence_parallel, ignore_index,
                                   float(label_smoothing), float(z_loss), float(softcap or 0.0), chunk,
                                   torch.compiler.is_compiling())[0]
    valid = flat != ignore_index
    if sequence_parallel and reduction == "none":  # back to the targets' order
        loss = loss.view(P, shape[0], -1).transpose(0, 1)
        valid = valid.view(P, shape[0], -1).transpose(0, 1)
    return reduce_token_losses(loss.reshape(-1), valid.reshape(-1), reduction, data_group_transport_id(data_group), shape)
