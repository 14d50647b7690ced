"""The custom ops of sequence-parallel attention (:mod:`fusedpar.ops.sp_attention`; see
:mod:`fusedpar.ops.library`; transports and groups travel as transport tokens):

* ``fusedpar::ring_attention(q, k, v, transport, causal, layout, softmax_scale, cu_seqlens) ->
  (out, lse)`` (:data:`ring_attention_op`, body
  :func:`~fusedpar.ops.sp_attention_schedules.ring_attention_fwd`) and
  ``fusedpar::ring_attention_backward`` (:data:`ring_attention_backward_op`, body
  :func:`~fusedpar.ops.sp_attention_schedules.ring_attention_bwd`).
* ``fusedpar::ulysses_attention(q, k, v, transport, ring_transport, causal, layout,
  softmax_scale, cu_seqlens) -> (out, heads, out_heads, lse)`` (:data:`ulysses_attention_op`,
  body :func:`~fusedpar.ops.sp_attention_schedules.ulysses_attention_fwd`): Ulysses over
  ``transport``, then ring attention over ``ring_transport`` (None: local attention), i.e.
  Ulysses and the hybrid; ``heads`` / ``out_heads`` are the head-shard residuals of the backward
  (absent in a Ulysses group of one). ``fusedpar::ulysses_attention_backward``
  (:data:`ulysses_attention_backward_op`, body
  :func:`~fusedpar.ops.sp_attention_schedules.ulysses_attention_bwd`).

Each op resolves its transport tokens and calls its body; only ``out`` is differentiable. The
values of ``cu_seqlens`` (host-built segment tables) are read inside the bodies.
"""
from __future__ import annotations

import torch

from fusedpar.ops.library import absent, custom_op, hold, input_grads, present, token_size
from fusedpar.ops.sp_attention_schedules import (
    ring_attention_bwd,
    ring_attention_fwd,
    split_heads,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
    ulysses_kv_heads,
)
from fusedpar.ops.transport import token_transport

__all__ = ["ring_attention_backward_op", "ring_attention_op", "ulysses_attention_backward_op", "ulysses_attention_op"]

Tensor = torch.Tensor


def _transport(token):
    """The Transport a token names (``None`` for no token: no ring in a plain Ulysses call)."""
    return None if token is None else token_transport(token)


# ----------------------------------------------------------------------------------------------
# fusedpar::ring_attention
# ----------------------------------------------------------------------------------------------
@custom_op("ring_attention")
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, transport: str, causal: bool, layout: str,
             softmax_scale: float | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    return ring_attention_fwd(q, k, v, _transport(transport), causal=causal, layout=layout,
                              softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


@ring_attention_op.register_fake
def _(q, k, v, transport, causal, layout, softmax_scale, cu_seqlens):
    b, s, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, s), dtype=torch.float32)


@custom_op("ring_attention_backward")
def ring_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, transport: str,
                      causal: bool, layout: str, softmax_scale: float | None,
                      cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return ring_attention_bwd(dout, q, k, v, out, lse, _transport(transport), causal=causal, layout=layout,
                              softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, transport, causal, layout, softmax_scale, cu_seqlens):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup(ctx, inputs, output):
    q, k, v, transport, causal, layout, softmax_scale, cu_seqlens = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (transport, causal, layout, softmax_scale)
    ctx.transports = hold(transport)


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:
        return input_grads(ring_attention_op)
    dq, dk, dv = ring_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args, cu_seqlens)
    return input_grads(ring_attention_op, q=dq, k=dk, v=dv)


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)


# ----------------------------------------------------------------------------------------------
# fusedpar::ulysses_attention (Ulysses and the hybrid)
# ----------------------------------------------------------------------------------------------
@custom_op("ulysses_attention")
def ulysses_attention_op(q: Tensor, k: Tensor, v: Tensor, transport: str, ring_transport: str | None, causal: bool,
                layout: str, softmax_scale: float | None,
                cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, (heads, out_heads, lse) = ulysses_attention_fwd(
        q, k, v, _transport(transport), ring_transport=_transport(ring_transport), causal=causal, layout=layout,
        softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    if heads is None:  # a group of one: the heads are q, k, v and out themselves
        return out, absent(q), absent(q), lse
    return out, heads, out_heads, lse


@ulysses_attention_op.register_fake
def _(q, k, v, transport, ring_transport, causal, layout, softmax_scale, cu_seqlens):
    size = token_size(transport)
    b, s, hq, d = q.shape
    lse = q.new_empty((b, hq // size, size * s), dtype=torch.float32)
    if size == 1:
        return q.new_empty(q.shape), absent(q), absent(q), lse
    _, hk_local = ulysses_kv_heads(hq, k.shape[2], size)
    heads = q.new_empty((b, size * s, hq // size + 2 * hk_local, d))
    return q.new_empty(q.shape), heads, q.new_empty((b, size * s, hq // size, d)), lse


@custom_op("ulysses_attention_backward")
def ulysses_attention_backward_op(dout: Tensor, q_heads: Tensor, k_heads: Tensor, v_heads: Tensor, out_heads: Tensor,
                         lse: Tensor, transport: str, ring_transport: str | None, kv_heads: int, causal: bool,
                         layout: str, softmax_scale: float | None,
                         cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return ulysses_attention_bwd(dout, q_heads, k_heads, v_heads, out_heads, lse, _transport(transport),
                                 kv_heads=kv_heads, ring_transport=_transport(ring_transport), causal=causal,
                                 layout=layout, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


@ulysses_attention_backward_op.register_fake
def _(dout, q_heads, k_heads, v_heads, out_heads, lse, transport, ring_transport, kv_heads, causal, layout,
      softmax_scale, cu_seqlens):
    size = token_size(transport)
    b, s_full, hq_local, d = q_heads.shape
    kv = (b, s_full // size, kv_heads, d)
    return q_heads.new_empty((b, s_full // size, hq_local * size, d)), q_heads.new_empty(kv), q_heads.new_empty(kv)


def _ulysses_setup(ctx, inputs, output):
    q, k, v, transport, ring_transport, causal, layout, softmax_scale, cu_seqlens = inputs
    out, heads, out_heads, lse = output
    ctx.mark_non_differentiable(heads, out_heads, lse)
    ctx.group_of_one = present(heads) is None
    if ctx.group_of_one:
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    else:
        ctx.save_for_backward(heads, out_heads, lse, cu_seqlens)
        hk_local = (heads.shape[2] - out_heads.shape[2]) // 2
        ctx.widths = (out_heads.shape[2], hk_local, hk_local)
    ctx.args = (transport, ring_transport, k.shape[2], causal, layout, softmax_scale)
    ctx.transports = hold(transport, ring_transport)


def _ulysses_backward(ctx, dout, dheads, dout_heads, dlse):
    if dout is None:
        return input_grads(ulysses_attention_op)
    if ctx.group_of_one:
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    else:
        heads, out, lse, cu_seqlens = ctx.saved_tensors
        q, k, v = split_heads(heads, ctx.widths)
    dq, dk, dv = ulysses_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args, cu_seqlens)
    return input_grads(ulysses_attention_op, q=dq, k=dk, v=dv)


ulysses_attention_op.register_autograd(_ulysses_backward, setup_context=_ulysses_setup)
