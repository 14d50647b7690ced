"""Sequence-parallel attention, the functional API: :func:`ring_attention`,
:func:`ulysses_attention`, :func:`hybrid_attention`, and the shard helpers of the layouts
(re-exported from :mod:`.layouts`).

Each function checks its arguments (shapes, dtypes, modes; what ``torch.compile`` traces) inside
the cross-rank agreement check, then calls its custom op of :mod:`.custom_ops` (hybrid attention is
the Ulysses op with a ring transport). Only ``out`` is differentiable (in q, k, v and ``sinks``).
The values of ``cu_seqlens`` are read inside the ops; in eager mode they are also checked before
the op."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_softcap, check_tensor
from fusedpar.kernels.flash_attention import check_sinks, check_window, resolve_softmax_scale
from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE, check_dq_mode
from fusedpar.ops.comm import collectives
from fusedpar.ops.comm.agreement import agreed_arguments
from fusedpar.ops.comm.keys import transport_size, transport_id_of
from fusedpar.ops.comm.transport import Transport, check_transport_name
from fusedpar.ops.common import checked_api
from fusedpar.ops.sequence_parallel.bodies import check_sp_args, ulysses_kv_heads
from fusedpar.ops.sequence_parallel.custom_ops import ring_attention_op, ulysses_attention_op
from fusedpar.ops.sequence_parallel.plans import document_bounds


# ----------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------
def _dimension(group_name, group, transport):
    """``(transport id, size)`` of one sequence-parallel dimension from its ``group`` / ``transport``
    arguments, without building a transport (traceable: both are constants of a graph)."""
    if group is not None and not isinstance(group, collectives.ProcessGroup):
        raise TypeError(f"{group_name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    check_transport_name(transport)
    return transport_id_of(transport, group), transport_size(transport, group)


def _name(transport) -> str:
    return transport.name if isinstance(transport, Transport) else "portable"


def _check_documents(cu_seqlens, q, total):
    """``cu_seqlens`` (None, or the global document boundaries of the ``total`` packed tokens)
    fits q: batch 1, an int32 1-D tensor on the CPU or on q's device; its values (see
    :func:`~fusedpar.ops.sequence_parallel.plans.document_bounds`) are checked here in eager mode and by the op
    when it runs under ``torch.compile`` (a traced graph reads no values)."""
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"q batch size must be 1 with cu_seqlens= (one packed row), got {q.shape[0]}")
    check_tensor("cu_seqlens", cu_seqlens, dims=(1,), dtypes=(torch.int32,))
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on the CPU or on the same device as q ({q.device}), "
                         f"got {cu_seqlens.device}")
    if not torch.compiler.is_compiling():
        document_bounds(cu_seqlens, total)


def _agreed(q, k, v, transport, causal, softmax_scale, scores, **modes):
    """What the ranks of a sequence-parallel group must agree on (see fusedpar.ops.comm.agreement):
    the tensors' shapes and dtypes, the modes, the score options (the sinks by shape and dtype)."""
    window, softcap, sinks = scores
    window = tuple(window) if isinstance(window, list) else window
    return dict(q=q, k=k, v=v, causal=causal, softmax_scale=softmax_scale, **modes, window=window, softcap=softcap,
                sinks=sinks, transport=transport)


def _check_scores(q, scores):
    """The local checks of ``window``, ``softcap`` and ``sinks`` (those of flash attention)."""
    window, softcap, sinks = scores
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, q)


def _score_args(scores) -> tuple:
    """``(window_left, window_right, softcap, sinks)`` of the ops' schemas."""
    window, softcap, sinks = scores
    left, right = check_window(window)
    return left, right, (check_softcap(softcap) or None), sinks


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


@checked_api
def ring_attention(q, k, v, *, group=None, transport: Transport | None = None, causal=False, layout="zigzag",
                   softmax_scale=None, cu_seqlens=None, window=None, softcap=None, sinks=None,
                   dq_mode=DEFAULT_DQ_MODE):
    """Attention over the full sequence from this rank's shard; returns this rank's output shard.

    q ``[b, s_local, heads, d]``, k ``[b, s_local, kv_heads, d]``, v ``[b, s_local, kv_heads,
    d_v]`` (kv_heads divides heads; out is ``[b, s_local, heads, d_v]``),
    the shard of ring rank ``r`` of ``P`` in ``layout`` (see
    :func:`sequence_shard`: ``"contiguous"``: positions
    ``[r*s_local, (r+1)*s_local)``; ``"zigzag"``: chunks ``r`` and ``2P-1-r`` of ``2P``, so
    ``s_local`` must be even). Every rank must hold the same ``s_local``. The ring is
    ``transport`` (a :class:`~fusedpar.ops.Transport`) or, by default, a portable
    transport over ``group`` (None: the default group).

    ``cu_seqlens``: packed documents (batch 1): int32 ``[num_docs + 1]`` boundaries in global
    positions of the full ``s_local * P`` tokens, the same on every rank (CPU or device; a device
    tensor costs one host copy per call). Attention is then exact per document, documents of any
    length crossing any shard boundaries; ring steps with nothing visible launch no kernel.

    ``window=(left, right)``, ``softcap``, ``sinks`` (fp32 ``[heads]``, differentiable): as in
    :func:`~fusedpar.ops.attention.api.flash_attention`, the window in global sequence positions (key
    blocks outside every query's window launch nothing, and the ring itself stops where no rank
    needs a block any more: with a causal window of ``w`` keys over the contiguous layout each
    K/V block travels ``ceil(w / s_local)`` hops instead of ``P - 1``; see
    :func:`~fusedpar.ops.sequence_parallel.plans.ring_rounds`). The sinks enter the merged
    softmax once; each rank's ``sinks`` gradient is its own query rows' part (sum it over the
    group, as for any parameter replicated over sequence parallelism). ``dq_mode``: the flash
    backward's, ``"separate"`` (default, deterministic) or ``"atomic"`` (one pass, dQ added with
    fp32 atomics: dq's bits vary between GPU runs); see
    :func:`~fusedpar.ops.attention.api.flash_attention`.
    The custom op ``fusedpar::ring_attention``: traceable by ``torch.compile``.
    """
    transport_id, size = _dimension("group", group, transport)
    scores = (window, softcap, sinks)
    with agreed_arguments("ring_attention", transport, group,
                          _agreed(q, k, v, _name(transport), causal, softmax_scale, scores, layout=layout,
                                  cu_seqlens=_documents(cu_seqlens), dq_mode=dq_mode)):
        check_sp_args(q, k, v, causal, layout, ring_size=size)
        resolve_softmax_scale(softmax_scale, q.shape[3])
        _check_scores(q, scores)
        _check_documents(cu_seqlens, q, q.shape[1] * size)
        check_dq_mode(dq_mode)
    return ring_attention_op(q, k, v, transport_id, causal, layout, _scale(softmax_scale), cu_seqlens, *_score_args(scores),
                             dq_mode)[0]


@checked_api
def ulysses_attention(q, k, v, *, group=None, transport: Transport | None = None, causal=False, softmax_scale=None,
                      cu_seqlens=None, window=None, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    """Ulysses (all-to-all) sequence-parallel attention; returns this rank's output shard.

    q ``[b, s_local, heads, d]``, k ``[b, s_local, kv_heads, d]``, v ``[b, s_local, kv_heads,
    d_v]``: rank ``r`` holds positions
    ``[r*s_local, (r+1)*s_local)``. The group size must divide ``heads`` and divide (or be a
    multiple of) ``kv_heads``; otherwise a ValueError lists the sizes that work. The all-to-alls
    run on ``transport``, by default a portable transport over ``group``. ``cu_seqlens``: packed
    documents, as in :func:`ring_attention`. ``window``, ``softcap``, ``sinks``: as in
    :func:`ring_attention`; after the all-to-all each rank applies the sinks of the query heads
    it holds, and its ``sinks`` gradient is those heads' part (zero elsewhere; sum it over the
    group). ``dq_mode``: as in :func:`ring_attention`. The custom op
    ``fusedpar::ulysses_attention``: traceable by ``torch.compile``.
    """
    transport_id, size = _dimension("group", group, transport)
    scores = (window, softcap, sinks)
    with agreed_arguments("ulysses_attention", transport, group,
                          _agreed(q, k, v, _name(transport), causal, softmax_scale, scores,
                                  cu_seqlens=_documents(cu_seqlens), dq_mode=dq_mode)):
        check_sp_args(q, k, v, causal, "contiguous")
        ulysses_kv_heads(q.shape[2], k.shape[2], size)
        resolve_softmax_scale(softmax_scale, q.shape[3])
        _check_scores(q, scores)
        _check_documents(cu_seqlens, q, q.shape[1] * size)
        check_dq_mode(dq_mode)
    return ulysses_attention_op(q, k, v, transport_id, None, causal, "contiguous", _scale(softmax_scale), cu_seqlens,
                                *_score_args(scores), dq_mode)[0]


@checked_api
def hybrid_attention(q, k, v, *, ulysses_group=None, ring_group=None, ulysses_transport: Transport | None = None,
                     ring_transport: Transport | None = None, causal=False, layout="zigzag", softmax_scale=None,
                     cu_seqlens=None, window=None, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    """2-D sequence parallelism: Ulysses inside ``ulysses_group``, ring across ``ring_group``
    (or the given transports of the two dimensions; one of group / transport each).

    The two groups must be orthogonal (each rank is in one of each; e.g. on 4 ranks
    ``ulysses_group`` {0,1} / {2,3} and ``ring_group`` {0,2} / {1,3}). Rank (ring rank ``r``,
    ulysses rank ``u``) holds piece ``u`` of ``ulysses_size`` contiguous pieces of ring shard
    ``r`` in ``layout``: ``sequence_shard(x, layout=layout, ring_rank=r, ring_size=R,
    ulysses_rank=u, ulysses_size=U)``; its positions are
    :func:`shard_positions`. ``cu_seqlens``: packed documents, ``window``, ``softcap``,
    ``sinks``, ``dq_mode``: as in :func:`ring_attention` and :func:`ulysses_attention` (each
    rank's ``sinks`` gradient: its heads over its ring rows). The op ``fusedpar::ulysses_attention`` with a ring
    transport.
    """
    if (ulysses_group is None and ulysses_transport is None) or (ring_group is None and ring_transport is None):
        raise ValueError("hybrid_attention needs both a Ulysses and a ring dimension (ulysses_group or "
                         "ulysses_transport, and ring_group or ring_transport); use ring_attention or "
                         "ulysses_attention for one-dimensional sequence parallelism")
    uly, usize = _dimension("ulysses_group", ulysses_group, ulysses_transport)
    ring, rsize = _dimension("ring_group", ring_group, ring_transport)
    dims = {"ulysses": (ulysses_transport, ulysses_group), "ring": (ring_transport, ring_group)}
    scores = (window, softcap, sinks)
    with agreed_arguments("hybrid_attention", dims, None,
                          _agreed(q, k, v, f"{_name(ulysses_transport)} x {_name(ring_transport)}", causal,
                                  softmax_scale, scores, layout=layout, cu_seqlens=_documents(cu_seqlens),
                                  dq_mode=dq_mode)):
        check_sp_args(q, k, v, causal, layout, ring_shard=q.shape[1] * usize, ring_size=rsize)
        ulysses_kv_heads(q.shape[2], k.shape[2], usize)
        resolve_softmax_scale(softmax_scale, q.shape[3])
        _check_scores(q, scores)
        _check_documents(cu_seqlens, q, q.shape[1] * usize * rsize)
        check_dq_mode(dq_mode)
    return ulysses_attention_op(q, k, v, uly, ring, causal, layout, _scale(softmax_scale), cu_seqlens,
                                *_score_args(scores), dq_mode)[0]
