"""The flash-attention custom ops (see :mod:`fusedpar.ops.common`).

* ``fusedpar::flash_attention(q, k, v, causal, softmax_scale, q_offset=None, k_offset=None, window_left,
  window_right, softcap, sinks, dq_mode, return_fp8) -> (out, lse, out_q, out_scale)`` (offsets
  None: bottom-right aligned, resolved in the bodies)
  (:data:`flash_attention_op`, body :func:`~.bodies.flash_attention_fwd`) and
  ``fusedpar::flash_attention_backward`` (:data:`flash_attention_backward_op`, body
  :func:`~.bodies.flash_attention_bwd`, returning ``(dq, dk, dv, dsinks)``).
* ``fusedpar::flash_attention_varlen`` / ``..._backward`` for packed documents (``cu_seqlens_q``,
  ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``), bodies
  :func:`~.bodies.flash_attention_varlen_fwd` / :func:`~.bodies.flash_attention_varlen_bwd`."""
from __future__ import annotations

import torch

from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE
from fusedpar.ops.attention.bodies import (
    dsinks_like,
    flash_attention_bwd,
    flash_attention_fwd,
    flash_attention_varlen_bwd,
    flash_attention_varlen_fwd,
    fp8_output_buffers,
)
from fusedpar.ops.common import custom_op, input_grads, present

flash_attention_op = custom_op("flash_attention")(flash_attention_fwd)


@flash_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, q_offset=None, k_offset=None, window_left=-1, window_right=-1, softcap=None,
      sinks=None, dq_mode=DEFAULT_DQ_MODE, return_fp8=False):
    b, sq, hq, _ = q.shape
    return (q.new_empty((b, sq, hq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32),
            *fp8_output_buffers((b, sq, hq, v.shape[3]), q, return_fp8))


flash_attention_backward_op = custom_op("flash_attention_backward")(flash_attention_bwd)


@flash_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, q_offset=None, k_offset=None, window_left=-1, window_right=-1,
      softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks_like(sinks, q)


def _flash_setup(ctx, inputs, output):
    q, k, v, *args, sinks, dq_mode, _ = inputs
    out, lse, *fp8 = output
    ctx.mark_non_differentiable(lse, *fp8)
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.args = tuple(args)  # causal, softmax_scale, q_offset, k_offset, window_left, window_right, softcap
    ctx.dq_mode = dq_mode


def _flash_backward(ctx, dout, dlse, dout_q, dout_scale):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if dout is None:
        return input_grads(flash_attention_op)
    dq, dk, dv, dsinks = flash_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args, sinks,
                                                     ctx.dq_mode)
    return input_grads(flash_attention_op, q=dq, k=dk, v=dv, sinks=present(dsinks))


flash_attention_op.register_autograd(_flash_backward, setup_context=_flash_setup)


flash_attention_varlen_op = custom_op("flash_attention_varlen")(flash_attention_varlen_fwd)


@flash_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left=-1,
      window_right=-1, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE, return_fp8=False):
    return (q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            *fp8_output_buffers((*q.shape[:2], v.shape[2]), q, return_fp8))


flash_attention_varlen_backward_op = custom_op("flash_attention_varlen_backward")(flash_attention_varlen_bwd)


@flash_attention_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left=-1, window_right=-1, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks_like(sinks, q)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args, sinks, dq_mode, _ = inputs
    out, lse, *fp8 = output
    ctx.mark_non_differentiable(lse, *fp8)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.args = tuple(args)  # max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap
    ctx.dq_mode = dq_mode


def _varlen_backward(ctx, dout, dlse, dout_q, dout_scale):
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if dout is None:
        return input_grads(flash_attention_varlen_op)
    dq, dk, dv, dsinks = flash_attention_varlen_backward_op(dout.to(q.dtype), q, k, v, out, lse, cu_q, cu_k,
                                                            *ctx.args, sinks, ctx.dq_mode)
    return input_grads(flash_attention_varlen_op, q=dq, k=dk, v=dv, sinks=present(dsinks))


flash_attention_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)
