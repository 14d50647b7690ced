"""Rows that several ranks hold alike: :func:`replicated_rows`, over the custom op of
:mod:`fusedpar.ops.replicas_library`.

With more tensor-parallel ranks than kv heads, each rank keeps a copy of the kv head its q heads
use (:class:`~fusedpar.nn.ParallelAttention`): the k / v rows of its projection are block ``j =
rank // (tp / kv_heads)`` of ``kv_heads``, held by ``tp / kv_heads`` ranks. Each holder's gradient
of those rows covers only its own q heads; :func:`replicated_rows` on the weight makes it the
whole gradient (the sum over the holders) before it reaches ``weight.grad``, so the weight is an
ordinary tensor-parallel ("dense") parameter for gradient synchronisation, DDP and FSDP.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_int, check_tensor
from fusedpar.ops.library import checked_api, transport_token
from fusedpar.ops.replicas_library import replicated_rows_op

__all__ = ["replicated_rows"]


@checked_api
def replicated_rows(t: torch.Tensor, start: int, block: int, blocks: int, *, group=None,
                    transport=None) -> torch.Tensor:
    """``t`` (a copy, differentiable) whose rows ``start:`` hold block ``block`` of ``blocks``,
    the same rows on every rank of ``group`` (default: the default group) that holds that block:
    in the backward their gradient is summed over those ranks (one fp32 all-reduce over the group
    of a ``[blocks, rows, ...]`` buffer); rows ``:start`` keep this rank's gradient."""
    check_tensor("t", t)
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension (its rows), got a scalar")
    check_int("start", start, min_value=0, max_value=t.shape[0])
    check_int("blocks", blocks, min_value=1)
    check_int("block", block, min_value=0, max_value=blocks - 1)
    return replicated_rows_op(t, transport_token(transport, group), start, block, blocks)
