"""The custom ops of sequence-parallel attention (see :mod:`fusedpar.ops.common`; transports travel
as transport ids): ``fusedpar::ring_attention`` -> ``(out, lse)`` and its backward -> ``(dq, dk,
dv, dsinks)`` (:data:`ring_attention_op`, bodies :func:`~.bodies.ring_attention_fwd` /
:func:`~.bodies.ring_attention_bwd`), ``fusedpar::ulysses_attention`` (with a ring transport: the
hybrid) and its backward (:data:`ulysses_attention_op`, bodies
:func:`~.bodies.ulysses_attention_fwd` / :func:`~.bodies.ulysses_attention_bwd`)."""
from __future__ import annotations

import torch
from torch import Tensor

from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE
from fusedpar.ops.attention.bodies import dsinks_like, window_of, with_dsinks
from fusedpar.ops.comm.keys import hold, transport_id_size
from fusedpar.ops.comm.transport import transport_from_id
from fusedpar.ops.common import absent, custom_op, input_grads, present
from fusedpar.ops.sequence_parallel.bodies import (
    head_widths,
    ring_attention_bwd,
    ring_attention_fwd,
    split_heads,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
)


def _transport(transport_id):
    """The Transport a transport id names (``None`` for none: no ring in a plain Ulysses call)."""
    return None if transport_id is None else transport_from_id(transport_id)


def _scores(window_left, window_right, softcap, sinks) -> dict:
    """The score options of the schema as the schedules' keyword arguments."""
    return dict(window=window_of(window_left, window_right), softcap=softcap, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# fusedpar::ring_attention
# ----------------------------------------------------------------------------------------------
@custom_op("ring_attention")
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, transport: str, causal: bool, layout: str,
                      softmax_scale: float | None, cu_seqlens: Tensor | None, window_left: int = -1,
                      window_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None,
                      dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor]:
    return ring_attention_fwd(q, k, v, _transport(transport), causal=causal, layout=layout,
                              softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                              **_scores(window_left, window_right, softcap, sinks))


@ring_attention_op.register_fake
def _(q, k, v, transport, causal, layout, softmax_scale, cu_seqlens, window_left=-1, window_right=-1, softcap=None,
      sinks=None, dq_mode=DEFAULT_DQ_MODE):
    b, s, hq, _ = q.shape
    return q.new_empty((b, s, hq, v.shape[3])), q.new_empty((b, hq, s), dtype=torch.float32)


@custom_op("ring_attention_backward")
def ring_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, transport: str,
                               causal: bool, layout: str, softmax_scale: float | None, cu_seqlens: Tensor | None,
                               window_left: int = -1, window_right: int = -1, softcap: float | None = None,
                               sinks: Tensor | None = None,
                               dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return with_dsinks(ring_attention_bwd(dout, q, k, v, out, lse, _transport(transport), causal=causal,
                                           layout=layout, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                           dq_mode=dq_mode, **_scores(window_left, window_right, softcap, sinks)), q)


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, transport, causal, layout, softmax_scale, cu_seqlens, window_left=-1, window_right=-1,
      softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks_like(sinks, q)


def _ring_setup(ctx, inputs, output):
    q, k, v, transport, causal, layout, softmax_scale, cu_seqlens, *scores, sinks, dq_mode = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks)
    ctx.args = (transport, causal, layout, softmax_scale)
    ctx.scores = tuple(scores)  # window_left, window_right, softcap
    ctx.dq_mode = dq_mode
    ctx.transports = hold(transport)


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
    if dout is None:
        return input_grads(ring_attention_op)
    dq, dk, dv, dsinks = ring_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args, cu_seqlens,
                                                    *ctx.scores, sinks, ctx.dq_mode)
    return input_grads(ring_attention_op, q=dq, k=dk, v=dv, sinks=present(dsinks))


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)


# ----------------------------------------------------------------------------------------------
# fusedpar::ulysses_attention (Ulysses and the hybrid)
# ----------------------------------------------------------------------------------------------
@custom_op("ulysses_attention")
def ulysses_attention_op(q: Tensor, k: Tensor, v: Tensor, transport: str, ring_transport: str | None, causal: bool,
                         layout: str, softmax_scale: float | None, cu_seqlens: Tensor | None, window_left: int = -1,
                         window_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None,
                         dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, (heads, out_heads, lse) = ulysses_attention_fwd(
        q, k, v, _transport(transport), ring_transport=_transport(ring_transport), causal=causal, layout=layout,
        softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, **_scores(window_left, window_right, softcap, sinks))
    if heads is None:  # a group of one: the heads are q, k, v and out themselves
        return out, absent(q), absent(q), lse
    return out, heads, out_heads, lse


@ulysses_attention_op.register_fake
def _(q, k, v, transport, ring_transport, causal, layout, softmax_scale, cu_seqlens, window_left=-1, window_right=-1,
      softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    size = transport_id_size(transport)
    b, s, hq, d = q.shape
    lse = q.new_empty((b, hq // size, size * s), dtype=torch.float32)
    out = q.new_empty((b, s, hq, v.shape[3]))
    if size == 1:
        return out, absent(q), absent(q), lse
    widths = head_widths(hq, k.shape[2], size, d, v.shape[3])
    heads = q.new_empty((b, size * s, sum(n * w for n, w in widths)))
    return out, heads, q.new_empty((b, size * s, hq // size, v.shape[3])), lse


@custom_op("ulysses_attention_backward")
def ulysses_attention_backward_op(dout: Tensor, q_heads: Tensor, k_heads: Tensor, v_heads: Tensor, out_heads: Tensor,
                                  lse: Tensor, transport: str, ring_transport: str | None, kv_heads: int,
                                  causal: bool, layout: str, softmax_scale: float | None, cu_seqlens: Tensor | None,
                                  window_left: int = -1, window_right: int = -1, softcap: float | None = None,
                                  sinks: Tensor | None = None,
                                  dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return with_dsinks(ulysses_attention_bwd(
        dout, q_heads, k_heads, v_heads, out_heads, lse, _transport(transport), kv_heads=kv_heads,
        ring_transport=_transport(ring_transport), causal=causal, layout=layout, softmax_scale=softmax_scale,
        cu_seqlens=cu_seqlens, dq_mode=dq_mode, **_scores(window_left, window_right, softcap, sinks)), q_heads)


@ulysses_attention_backward_op.register_fake
def _(dout, q_heads, k_heads, v_heads, out_heads, lse, transport, ring_transport, kv_heads, causal, layout,
      softmax_scale, cu_seqlens, window_left=-1, window_right=-1, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    size = transport_id_size(transport)
    b, s_full, hq_local, d = q_heads.shape
    s = s_full // size
    return (q_heads.new_empty((b, s, hq_local * size, d)), q_heads.new_empty((b, s, kv_heads, d)),
            q_heads.new_empty((b, s, kv_heads, v_heads.shape[3])), dsinks_like(sinks, q_heads))


def _ulysses_setup(ctx, inputs, output):
    q, k, v, transport, ring_transport, causal, layout, softmax_scale, cu_seqlens, *scores, sinks, dq_mode = inputs
    out, heads, out_heads, lse = output
    ctx.mark_non_differentiable(heads, out_heads, lse)
    ctx.group_of_one = present(heads) is None
    if ctx.group_of_one:
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks)
    else:
        ctx.save_for_backward(heads, out_heads, lse, cu_seqlens, sinks)
        ctx.widths = head_widths(q.shape[2], k.shape[2], transport_id_size(transport), q.shape[3], v.shape[3])
    ctx.args = (transport, ring_transport, k.shape[2], causal, layout, softmax_scale)
    ctx.scores = tuple(scores)  # window_left, window_right, softcap
    ctx.dq_mode = dq_mode
    ctx.transports = hold(transport, ring_transport)


def _ulysses_backward(ctx, dout, dheads, dout_heads, dlse):
    if dout is None:
        return input_grads(ulysses_attention_op)
    if ctx.group_of_one:
        q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
    else:
        heads, out, lse, cu_seqlens, sinks = ctx.saved_tensors
        q, k, v = split_heads(heads, ctx.widths)
    dq, dk, dv, dsinks = ulysses_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args, cu_seqlens,
                                                       *ctx.scores, sinks, ctx.dq_mode)
    return input_grads(ulysses_attention_op, q=dq, k=dk, v=dv, sinks=present(dsinks))


ulysses_attention_op.register_autograd(_ulysses_backward, setup_context=_ulysses_setup)
