"""Sequence-parallel attention as ``torch.library`` custom ops, and its functional API:
:func:`ring_attention`, :func:`ulysses_attention`, :func:`hybrid_attention` (the layouts and the
schedules are in :mod:`fusedpar.ops.attention`).

Ops (see :mod:`fusedpar.ops.library`; transports and groups travel as transport tokens):

* ``torch.ops.fusedpar.ring_attention(q, k, v, transport, causal, layout, softmax_scale,
  cu_seqlens) -> (out, lse)`` (:func:`~fusedpar.ops.attention.ring_attention_fwd`) and
  ``fusedpar::ring_attention_backward`` (:func:`~fusedpar.ops.attention.ring_attention_bwd`).
* ``torch.ops.fusedpar.ulysses_attention(q, k, v, transport, ring_transport, causal, layout,
  softmax_scale, cu_seqlens) -> (out, heads, out_heads, lse)``: Ulysses over ``transport``, then
  ring attention over ``ring_transport`` (None: local attention), i.e. Ulysses and the hybrid;
  ``heads`` / ``out_heads`` are the head-shard residuals of the backward (absent in a Ulysses
  group of one). ``fusedpar::ulysses_attention_backward``.

Only ``out`` is differentiable. The functional API checks its arguments (shapes, dtypes, modes;
what ``torch.compile`` traces) inside the cross-rank agreement check, then calls the op. The
values of ``cu_seqlens`` (host-built segment tables) are read inside the ops; in eager mode they
are also checked before the op, inside the agreement check.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_tensor
from fusedpar.kernels.flash_attention import resolve_softmax_scale
from fusedpar.ops import comm
from fusedpar.ops.agreement import agreed_arguments
from fusedpar.ops.attention import (
    check_sp_args,
    ring_attention_bwd,
    ring_attention_fwd,
    split_heads,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
    ulysses_kv_heads,
)
from fusedpar.ops.library import absent, hold, present, token_size, transport_size, transport_token
from fusedpar.ops.transport import Transport, token_transport
from fusedpar.ops.varlen import document_bounds

__all__ = ["hybrid_attention", "ring_attention", "ulysses_attention"]

Tensor = torch.Tensor


def _transport(token):
    """The Transport a token names (``None`` for no token: no ring in a plain Ulysses call)."""
    return None if token is None else token_transport(token)


# ----------------------------------------------------------------------------------------------
# fusedpar::ring_attention
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::ring_attention", mutates_args=())
def _ring_op(q: Tensor, k: Tensor, v: Tensor, transport: str, causal: bool, layout: str,
             softmax_scale: float | None, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    return ring_attention_fwd(q, k, v, _transport(transport), causal=causal, layout=layout,
                              softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


@_ring_op.register_fake
def _(q, k, v, transport, causal, layout, softmax_scale, cu_seqlens):
    b, s, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, s), dtype=torch.float32)


@torch.library.custom_op("fusedpar::ring_attention_backward", mutates_args=())
def _ring_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, transport: str,
                      causal: bool, layout: str, softmax_scale: float | None,
                      cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return ring_attention_bwd(dout, q, k, v, out, lse, _transport(transport), causal=causal, layout=layout,
                              softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


@_ring_backward_op.register_fake
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
        return (None,) * 8
    dq, dk, dv = torch.ops.fusedpar.ring_attention_backward(dout.to(q.dtype), q, k, v, out, lse, *ctx.args,
                                                            cu_seqlens)
    return dq, dk, dv, None, None, None, None, None


_ring_op.register_autograd(_ring_backward, setup_context=_ring_setup)


# ----------------------------------------------------------------------------------------------
# fusedpar::ulysses_attention (Ulysses and the hybrid)
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::ulysses_attention", mutates_args=())
def _ulysses_op(q: Tensor, k: Tensor, v: Tensor, transport: str, ring_transport: str | None, causal: bool,
                layout: str, softmax_scale: float | None,
                cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, (heads, out_heads, lse) = ulysses_attention_fwd(
        q, k, v, _transport(transport), ring_transport=_transport(ring_transport), causal=causal, layout=layout,
        softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    if heads is None:  # a group of one: the heads are q, k, v and out themselves
        return out, absent(q), absent(q), lse
    return out, heads, out_heads, lse


@_ulysses_op.register_fake
def _(q, k, v, transport, ring_transport, causal, layout, softmax_scale, cu_seqlens):
    size = token_size(transport)
    b, s, hq, d = q.shape
    lse = q.new_empty((b, hq // size, size * s), dtype=torch.float32)
    if size == 1:
        return q.new_empty(q.shape), absent(q), absent(q), lse
    _, hk_local = ulysses_kv_heads(hq, k.shape[2], size)
    heads = q.new_empty((b, size * s, hq // size + 2 * hk_local, d))
    return q.new_empty(q.shape), heads, q.new_empty((b, size * s, hq // size, d)), lse


@torch.library.custom_op("fusedpar::ulysses_attention_backward", mutates_args=())
def _ulysses_backward_op(dout: Tensor, q_heads: Tensor, k_heads: Tensor, v_heads: Tensor, out_heads: Tensor,
                         lse: Tensor, transport: str, ring_transport: str | None, kv_heads: int, causal: bool,
                         layout: str, softmax_scale: float | None,
                         cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return ulysses_attention_bwd(dout, q_heads, k_heads, v_heads, out_heads, lse, _transport(transport),
                                 kv_heads=kv_heads, ring_transport=_transport(ring_transport), causal=causal,
                                 layout=layout, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


@_ulysses_backward_op.register_fake
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
        return (None,) * 9
    if ctx.group_of_one:
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    else:
        heads, out, lse, cu_seqlens = ctx.saved_tensors
        q, k, v = split_heads(heads, ctx.widths)
    dq, dk, dv = torch.ops.fusedpar.ulysses_attention_backward(dout.to(q.dtype), q, k, v, out, lse, *ctx.args,
                                                               cu_seqlens)
    return dq, dk, dv, None, None, None, None, None, None


_ulysses_op.register_autograd(_ulysses_backward, setup_context=_ulysses_setup)


# ----------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------
def _dimension(group_name, group, transport):
    """``(token, size)`` of one sequence-parallel dimension from its ``group`` / ``transport``
    arguments, without building a transport (traceable: both are constants of a graph)."""
    if group is not None and not isinstance(group, comm.ProcessGroup):
        raise TypeError(f"{group_name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if transport is not None and not isinstance(transport, Transport) and transport != "portable":
        raise ValueError(f"transport must be None, 'portable' or a fusedpar.ops.transport.Transport, got {transport!r}")
    return transport_token(transport, group), transport_size(transport, group)


def _name(transport) -> str:
    return transport.name if isinstance(transport, Transport) else "portable"


def _check_documents(cu_seqlens, q, total):
    """``cu_seqlens`` (None, or the global document boundaries of the ``total`` packed tokens)
    fits q: batch 1, an int32 1-D tensor; its values (see
    :func:`~fusedpar.ops.varlen.document_bounds`) are checked here in eager mode and by the op
    when it runs under ``torch.compile`` (a traced graph reads no values)."""
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"q batch size must be 1 with cu_seqlens= (one packed row), got {q.shape[0]}")
    if torch.compiler.is_compiling():
        check_tensor("cu_seqlens", cu_seqlens, dims=(1,), dtypes=(torch.int32,))
    else:
        document_bounds(cu_seqlens, total)


def _agreed(q, k, v, transport, causal, softmax_scale, **modes):
    """What the ranks of a sequence-parallel group must agree on (see fusedpar.ops.agreement)."""
    return dict(q=q, k=k, v=v, causal=causal, softmax_scale=softmax_scale, **modes, transport=transport)


def _documents(cu_seqlens):
    """What the ranks must agree on of ``cu_seqlens``: its values when they are on the host (a
    device tensor is compared by shape and dtype: reading it would sync the stream; nothing is
    read while compiling, where the exchange is skipped)."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "cpu" and cu_seqlens.dim() == 1 \
            and not torch.compiler.is_compiling():
        return tuple(cu_seqlens.tolist())
    return cu_seqlens


def _scale(softmax_scale):
    return None if softmax_scale is None else float(softmax_scale)


def ring_attention(q, k, v, *, group=None, transport: Transport | None = None, causal=False, layout="zigzag",
                   softmax_scale=None, cu_seqlens=None):
    """Attention over the full sequence from this rank's shard; returns this rank's output shard.

    q ``[b, s_local, heads, d]``, k/v ``[b, s_local, kv_heads, d]`` (kv_heads divides heads),
    the shard of ring rank ``r`` of ``P`` in ``layout`` (see
    :func:`~fusedpar.ops.attention.sequence_shard`: ``"contiguous"``: positions
    ``[r*s_local, (r+1)*s_local)``; ``"zigzag"``: chunks ``r`` and ``2P-1-r`` of ``2P``, so
    ``s_local`` must be even). Every rank must hold the same ``s_local``. The ring is
    ``transport`` (a :class:`~fusedpar.ops.transport.Transport`) or, by default, a portable
    transport over ``group`` (None: the default group).

    ``cu_seqlens``: packed documents (batch 1): int32 ``[num_docs + 1]`` boundaries in global
    positions of the full ``s_local * P`` tokens, the same on every rank (CPU or device; a device
    tensor costs one host copy per call). Attention is then exact per document, documents of any
    length crossing any shard boundaries; ring steps with nothing visible launch no kernel.
    A ``torch.library`` op (``torch.ops.fusedpar.ring_attention``): traceable by ``torch.compile``.
    """
    token, size = _dimension("group", group, transport)
    with agreed_arguments("ring_attention", transport, group,
                          _agreed(q, k, v, _name(transport), causal, softmax_scale, layout=layout,
                                  cu_seqlens=_documents(cu_seqlens))):
        check_sp_args(q, k, v, causal, layout, ring_size=size)
        resolve_softmax_scale(softmax_scale, q.shape[3])
        _check_documents(cu_seqlens, q, q.shape[1] * size)
    return torch.ops.fusedpar.ring_attention(q, k, v, token, causal, layout, _scale(softmax_scale), cu_seqlens)[0]


def ulysses_attention(q, k, v, *, group=None, transport: Transport | None = None, causal=False, softmax_scale=None,
                      cu_seqlens=None):
    """Ulysses (all-to-all) sequence-parallel attention; returns this rank's output shard.

    q ``[b, s_local, heads, d]``, k/v ``[b, s_local, kv_heads, d]``: rank ``r`` holds positions
    ``[r*s_local, (r+1)*s_local)``. The group size must divide ``heads`` and divide (or be a
    multiple of) ``kv_heads``; otherwise a ValueError lists the sizes that work. The all-to-alls
    run on ``transport``, by default a portable transport over ``group``. ``cu_seqlens``: packed
    documents, as in :func:`ring_attention`. A ``torch.library`` op
    (``torch.ops.fusedpar.ulysses_attention``): traceable by ``torch.compile``.
    """
    token, size = _dimension("group", group, transport)
    with agreed_arguments("ulysses_attention", transport, group,
                          _agreed(q, k, v, _name(transport), causal, softmax_scale,
                                  cu_seqlens=_documents(cu_seqlens))):
        check_sp_args(q, k, v, causal, "contiguous")
        ulysses_kv_heads(q.shape[2], k.shape[2], size)
        resolve_softmax_scale(softmax_scale, q.shape[3])
        _check_documents(cu_seqlens, q, q.shape[1] * size)
    return torch.ops.fusedpar.ulysses_attention(q, k, v, token, None, causal, "contiguous", _scale(softmax_scale),
                                                cu_seqlens)[0]


def hybrid_attention(q, k, v, *, ulysses_group=None, ring_group=None, ulysses_transport: Transport | None = None,
                     ring_transport: Transport | None = None, causal=False, layout="zigzag", softmax_scale=None,
                     cu_seqlens=None):
    """2-D sequence parallelism: Ulysses inside ``ulysses_group``, ring across ``ring_group``
    (or the given transports of the two dimensions; one of group / transport each).

    The two groups must be orthogonal (each rank is in one of each; e.g. on 4 ranks
    ``ulysses_group`` {0,1} / {2,3} and ``ring_group`` {0,2} / {1,3}). Rank (ring rank ``r``,
    ulysses rank ``u``) holds piece ``u`` of ``ulysses_size`` contiguous pieces of ring shard
    ``r`` in ``layout``: ``sequence_shard(x, layout=layout, ring_rank=r, ring_size=R,
    ulysses_rank=u, ulysses_size=U)``; its positions are
    :func:`~fusedpar.ops.attention.shard_positions`. ``cu_seqlens``: packed documents, as in
    :func:`ring_attention`. The op ``torch.ops.fusedpar.ulysses_attention`` with a ring transport.
    """
    if (ulysses_group is None and ulysses_transport is None) or (ring_group is None and ring_transport is None):
        raise ValueError("hybrid_attention needs both a Ulysses and a ring dimension (ulysses_group or "
                         "ulysses_transport, and ring_group or ring_transport); use ring_attention or "
                         "ulysses_attention for one-dimensional sequence parallelism")
    uly, usize = _dimension("ulysses_group", ulysses_group, ulysses_transport)
    ring, rsize = _dimension("ring_group", ring_group, ring_transport)
    dims = {"ulysses": (ulysses_transport, ulysses_group), "ring": (ring_transport, ring_group)}
    with agreed_arguments("hybrid_attention", dims, None,
                          _agreed(q, k, v, f"{_name(ulysses_transport)} x {_name(ring_transport)}", causal,
                                  softmax_scale, layout=layout, cu_seqlens=_documents(cu_seqlens))):
        check_sp_args(q, k, v, causal, layout, ring_shard=q.shape[1] * usize, ring_size=rsize)
        ulysses_kv_heads(q.shape[2], k.shape[2], usize)
        resolve_softmax_scale(softmax_scale, q.shape[3])
        _check_documents(cu_seqlens, q, q.shape[1] * usize * rsize)
    return torch.ops.fusedpar.ulysses_attention(q, k, v, uly, ring, causal, layout, _scale(softmax_scale),
                                                cu_seqlens)[0]
