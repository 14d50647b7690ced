"""The flash-attention custom ops of :func:`fusedpar.ops.flash.flash_attention` and
:func:`fusedpar.ops.flash.flash_attention_varlen` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::flash_attention(q, k, v, causal, softmax_scale, q_offset, k_offset) -> (out, lse)``
  (:data:`flash_attention_op`, body :func:`flash_attention_fwd`) and
  ``fusedpar::flash_attention_backward`` (:data:`flash_attention_backward_op`, body
  :func:`flash_attention_bwd`).
* ``fusedpar::flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale) -> (out, lse)`` (:data:`flash_attention_varlen_op`, body
  :func:`flash_attention_varlen_fwd`) and ``fusedpar::flash_attention_varlen_backward``
  (:data:`flash_attention_varlen_backward_op`, body :func:`flash_attention_varlen_bwd`).

``lse`` is not differentiable. The bodies call the launchers of
:mod:`fusedpar.kernels.flash_attention`, :mod:`fusedpar.kernels.flash_attention_bwd` and
:mod:`fusedpar.kernels.flash_varlen`; the values of ``cu_seqlens`` are checked there (on CPU
tensors), where they are read.
"""
from __future__ import annotations

import torch

from fusedpar.kernels import flash_varlen
from fusedpar.kernels.flash_attention import flash_attention_forward
from fusedpar.kernels.flash_attention_bwd import flash_attention_backward
from fusedpar.ops.library import custom_op, input_grads

__all__ = [
    "flash_attention_backward_op", "flash_attention_bwd", "flash_attention_fwd", "flash_attention_op",
    "flash_attention_varlen_backward_op", "flash_attention_varlen_bwd", "flash_attention_varlen_fwd",
    "flash_attention_varlen_op",
]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention
# ----------------------------------------------------------------------------------------------
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None, q_offset: int,
                        k_offset: int) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the flash forward kernel."""
    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset,
                                   k_offset=k_offset)


flash_attention_op = custom_op("flash_attention")(flash_attention_fwd)


@flash_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, q_offset, k_offset):
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


def flash_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                        softmax_scale: float | None, q_offset: int, k_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the flash backward kernels."""
    return flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                    q_offset=q_offset, k_offset=k_offset)


flash_attention_backward_op = custom_op("flash_attention_backward")(flash_attention_bwd)


@flash_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, q_offset, k_offset):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_setup(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)  # causal, softmax_scale, q_offset, k_offset


def _flash_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        return input_grads(flash_attention_op)
    dq, dk, dv = flash_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args)
    return input_grads(flash_attention_op, q=dq, k=dk, v=dv)


flash_attention_op.register_autograd(_flash_backward, setup_context=_flash_setup)


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention_varlen
# ----------------------------------------------------------------------------------------------
def flash_attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                               softmax_scale: float | None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the varlen launcher (which checks the ``cu_seqlens`` values)."""
    return flash_varlen.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal=causal, softmax_scale=softmax_scale)


flash_attention_varlen_op = custom_op("flash_attention_varlen")(flash_attention_varlen_fwd)


@flash_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def flash_attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               causal: bool, softmax_scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the varlen backward launcher."""
    return flash_varlen.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                        max_seqlen_q, max_seqlen_k, causal=causal,
                                                        softmax_scale=softmax_scale)


flash_attention_varlen_backward_op = custom_op("flash_attention_varlen_backward")(flash_attention_varlen_bwd)


@flash_attention_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = tuple(args)  # max_seqlen_q, max_seqlen_k, causal, softmax_scale


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        return input_grads(flash_attention_varlen_op)
    dq, dk, dv = flash_attention_varlen_backward_op(dout.to(q.dtype), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return input_grads(flash_attention_varlen_op, q=dq, k=dk, v=dv)


flash_attention_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)
