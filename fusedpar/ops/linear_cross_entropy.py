"""Fused linear head + vocabulary-parallel cross entropy: the logits never exist in memory.

``linear_cross_entropy(hidden, weight, targets, group=...)`` is
``vocab_parallel_cross_entropy(hidden @ weight.T, targets, group)`` (with the options below)
computed in GEMM epilogues (:mod:`fusedpar.kernels.linear_ce`): the forward's logits GEMM leaves
per-row softmax statistics of each logits tile (no ``[T, V/tp]`` tensor); the backward runs over
blocks of the vocabulary shard, recomputing each block's logits with an epilogue that writes their
gradient ``[T, Vb]`` (the only vocabulary-sized memory, at most ``chunk_tokens`` rows of fp32
logits' bytes), then ``d_weight`` of the block (one GEMM over all tokens) and ``d_hidden`` (fp32
accumulation over the blocks).

Layers: :func:`~fusedpar.ops.linear_cross_entropy_library.linear_cross_entropy_fwd` /
:func:`~fusedpar.ops.linear_cross_entropy_library.linear_cross_entropy_bwd` (the block loops and the
collectives) -> the custom ops ``fusedpar::linear_cross_entropy`` / ``..._backward`` of
:mod:`fusedpar.ops.linear_cross_entropy_library` -> :func:`linear_cross_entropy` (checks, token
order, reduction through :func:`fusedpar.ops.loss.reduce_token_losses`).
"""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_bool, check_int, check_same, check_softcap, check_tensor
from fusedpar.kernels.runtime import SUPPORTED_DTYPES

from .agreement import agreed_arguments
from .library import checked_api, transport_size, transport_token
from .linear_cross_entropy_library import default_chunk_tokens, linear_cross_entropy_op
from .loss import check_target_args, data_group_token, reduce_token_losses
from .loss_library import check_target_range

__all__ = ["linear_cross_entropy"]


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
             global batch) every data rank's (:func:`fusedpar.ops.loss.reduce_token_losses`).
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
    token = transport_token(transport, group)
    chunk = chunk_tokens or default_chunk_tokens(flat.shape[0], weight.shape[0])
    loss = linear_cross_entropy_op(hidden, weight, flat, token, sequence_parallel, ignore_index,
                                   float(label_smoothing), float(z_loss), float(softcap or 0.0), chunk,
                                   torch.compiler.is_compiling())[0]
    valid = flat != ignore_index
    if sequence_parallel and reduction == "none":  # back to the targets' order
        loss = loss.view(P, shape[0], -1).transpose(0, 1)
        valid = valid.view(P, shape[0], -1).transpose(0, 1)
    return reduce_token_losses(loss.reshape(-1), valid.reshape(-1), reduction, data_group_token(data_group), shape)
