"""The custom op of :func:`fusedpar.ops.replicas.replicated_rows` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::replicated_rows(t, token, start, block, blocks) -> copy of t`` (:data:`replicated_rows_op`,
  body :func:`replicated_rows_fwd`) and its backward ``fusedpar::replicated_rows_backward``
  (:data:`replicated_rows_backward_op`, body :func:`replicated_rows_bwd`): the gradient of rows
  ``start:`` of ``t``, which hold block ``block`` of ``blocks`` that several ranks of the group
  hold alike (kv heads replicated over tensor parallelism), summed over the ranks holding that
  block: every rank writes its rows' gradient into slot ``block`` of a zeroed fp32 ``[blocks,
  rows, ...]`` buffer, one all-reduce over the group sums each slot over its holders.
"""
from __future__ import annotations

import torch

from fusedpar.ops.library import custom_op, hold, input_grads
from fusedpar.ops.transport import token_transport

__all__ = ["replicated_rows_backward_op", "replicated_rows_bwd", "replicated_rows_fwd", "replicated_rows_op"]


def replicated_rows_fwd(t: torch.Tensor, token: str, start: int, block: int, blocks: int) -> torch.Tensor:
    """A copy of ``t`` (a custom op returns no view of its input)."""
    return t.clone()


replicated_rows_op = custom_op("replicated_rows")(replicated_rows_fwd)


@replicated_rows_op.register_fake
def _(t, token, start, block, blocks):
    return torch.empty_like(t)


def replicated_rows_bwd(grad: torch.Tensor, token: str, start: int, block: int, blocks: int) -> torch.Tensor:
    """``grad`` with rows ``start:`` summed (in fp32) over the ranks of the group of ``token``
    that hold the same ``block``."""
    buf = grad.new_zeros((blocks,) + tuple(grad[start:].shape), dtype=torch.float32)
    buf[block] = grad[start:]
    transport = token_transport(token)
    if transport.size > 1:
        transport.all_reduce(buf).wait()
    out = grad.clone()
    out[start:] = buf[block].to(grad.dtype)
    return out


replicated_rows_backward_op = custom_op("replicated_rows_backward")(replicated_rows_bwd)


@replicated_rows_backward_op.register_fake
def _(grad, token, start, block, blocks):
    return torch.empty_like(grad)


def _setup(ctx, inputs, output):
    _, ctx.token, ctx.start, ctx.block, ctx.blocks = inputs
    ctx.transports = hold(ctx.token)


def _backward(ctx, grad):
    return input_grads(replicated_rows_op,
                       t=replicated_rows_backward_op(grad.contiguous(), ctx.token, ctx.start, ctx.block, ctx.blocks))


replicated_rows_op.register_autograd(_backward, setup_context=_setup)
