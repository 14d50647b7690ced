"""The schedules of sequence-parallel attention: ring (zigzag or contiguous), Ulysses, and the 2-D
hybrid. Every rank holds a shard of the sequence (``[batch, s_local, heads, head_dim]``) and gets
back the attention output of its own shard; every transfer goes through a
:class:`~fusedpar.ops.comm.Transport`, so the same schedule runs on torch.distributed and on an
emulated transport.

* **Ring** (:func:`ring_attention_fwd` / :func:`ring_attention_bwd`): K/V blocks rotate around the
  ring while each step's flash launches (planned in :mod:`.plans`) run; partial outputs merge by
  their log-sum-exp; the backward sends dK/dV back to their owners.
* **Ulysses** (:func:`ulysses_attention_fwd` / :func:`ulysses_attention_bwd`): an all-to-all from
  sequence shards to head shards, full-sequence flash attention, and back; with a ring transport
  the inner attention is the ring (hybrid)."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_bool, check_choice
from fusedpar.kernels.flash_attention import check_qkv, check_window, flash_attention_forward
from fusedpar.kernels.flash_attention_bwd import (
    DEFAULT_DQ_MODE,
    attention_delta,
    check_dq_mode,
    flash_attention_backward,
    sink_grad,
)
from fusedpar.ops.comm.transport import Transport
from fusedpar.ops.sequence_parallel.layouts import LAYOUTS
from fusedpar.ops.sequence_parallel.plans import (
    document_plan,
    ring_rounds,
    ring_schedule,
    ring_step_plan,
    shard_chunks,
)


def _whole_sequence_segments(cu_seqlens, s, causal, device, window):
    """The documents of one whole local sequence (a ring of one, Ulysses' gathered sequence) as
    one segment table covering every visible row; None without documents (or tokens)."""
    if cu_seqlens is None:
        return None
    plan = document_plan(cu_seqlens, "contiguous", 0, 1, s, causal, device, window)
    return plan[0][0] if plan[0] else None


def _step_launches(plan, step, q_chunks, layout, src, size, s, causal, window):
    """The launches of one ring step as ``(q_slice, k_slice, q_offset, k_offset, masked,
    segments)``: the documents' segment tables over the whole shard, or the dense
    :func:`ring_step_plan` of chunk pairs."""
    if plan is not None:
        return [(slice(None), slice(None), 0, 0, True, seg) for seg in plan[step]]
    return [(*launch, None) for launch in ring_step_plan(q_chunks, shard_chunks(layout, src, size, s), causal, window)]


def _fold_sinks(out, lse, sinks):
    """Adds the sink logits (fp32 ``[heads]``) to a merged softmax state in place: ``out``
    ``[b, s, heads, d_v]`` (fp32) and ``lse`` ``[b, heads, s]`` over the keys only become the
    attention with the sinks in the denominator (``lse`` then includes them, as the flash
    kernels' do). Ring steps merge without the sinks, so they are counted once."""
    merged = torch.logaddexp(lse, sinks.float()[None, :, None])
    out.mul_(torch.exp(lse - merged).transpose(1, 2)[..., None])
    lse.copy_(merged)


def check_transport(name, transport):
    """``transport`` (the argument ``name``) is a :class:`~fusedpar.ops.Transport`."""
    if not isinstance(transport, Transport):
        raise TypeError(f"{name} must be a fusedpar.ops.Transport, got {type(transport).__name__}")


def check_sp_args(q, k, v, causal, layout, ring_shard=None, ring_size=1):
    """Local checks of every sequence-parallel op (before any transfer). ``ring_shard``: the
    length of the ring shard (``s_local * ulysses_size``), which zigzag cuts in two."""
    check_qkv(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"sequence-parallel attention needs k/v shards of q's length {q.shape[1]}, got {k.shape[1]}")
    check_bool("causal", causal)
    check_choice("layout", layout, LAYOUTS)
    ring_shard = q.shape[1] if ring_shard is None else ring_shard
    if layout == "zigzag" and ring_size > 1 and ring_shard % 2:
        raise ValueError(f"layout='zigzag' needs an even ring shard (two chunks: s_local * ulysses_size), "
                         f"got {ring_shard}")


def _mask(masked, causal, window):
    """The ``causal`` / ``window`` arguments of one launch (an unmasked launch takes neither)."""
    return (causal, None if window == (-1, -1) else window) if masked else (False, None)


def _rotate(blocks, transport: Transport, schedule):
    """Yields ``(step, held)`` for every ``step`` of ``schedule``
    (:func:`~fusedpar.ops.sequence_parallel.plans.ring_schedule`), ``held`` the K and V blocks it holds:
    this rank's ``blocks`` first, each later pair brought by one ``transport.ring_shift`` per tensor
    (in the step's direction) that runs while the previous pair is computed on. K and V travel as
    separate buffers, so their head dims may differ (MLA: 192 / 128) without a packed copy. Two
    receive buffers per tensor; ``blocks`` themselves are never written (autograd saves them), and
    they are sent again when the backward direction starts."""
    blocks = tuple(blocks)
    if len(schedule) == 1:
        yield schedule[0], blocks
        return
    pools = [(torch.empty_like(t), torch.empty_like(t)) for t in blocks]
    held = blocks
    for i, step in enumerate(schedule):
        handles, recvs = [], held
        if i + 1 < len(schedule):
            _, direction, hop = schedule[i + 1]
            recvs = tuple(p[1] if p[0] is h else p[0] for p, h in zip(pools, held))
            handles = [transport.ring_shift(b if hop == 1 else h, r, step=direction)
                       for b, h, r in zip(blocks, held, recvs)]
        yield step, held
        for handle in handles:
            handle.wait()  # the next pair has arrived and our sends of this one have left
        held = recvs


def ring_attention_fwd(q, k, v, transport: Transport, *, causal=False, layout="zigzag", softmax_scale=None,
                       cu_seqlens=None, window=None, softcap=None, sinks=None):
    """The forward of :func:`~fusedpar.ops.sequence_parallel.api.ring_attention` on ring rank ``transport.rank`` of
    ``transport.size``: returns ``(out, lse)``, out ``[b, s_local, heads, d_v]`` in q's dtype, lse
    ``[b, heads, s_local]`` fp32 (including the sinks).

    At step ``t`` this rank holds the K/V block of ring rank ``rank - t`` and the flash kernel
    merges it into an fp32 ``(out, lse)`` state while ``transport.ring_shift`` brings the next one.
    A ``window`` cuts the ring to the blocks some rank needs (:func:`~fusedpar.ops.sequence_parallel.plans.ring_rounds`, the same on
    every rank: fewer transfers, not only fewer launches; blocks from both neighbours' sides with
    a two-sided window or the zigzag layout). With ``cu_seqlens`` each step launches the segment
    tables of :func:`document_plan` (none when the block holds nothing visible). ``window``
    (global positions), ``softcap``: per launch; blocks outside every query's window launch
    nothing. ``sinks``: folded into the merged state once, after the last step
    (:func:`_fold_sinks`).
    """
    check_transport("transport", transport)
    check_sp_args(q, k, v, causal, layout, ring_size=transport.size)
    win = check_window(window)
    size, rank = transport.size, transport.rank
    if size == 1:
        segments = _whole_sequence_segments(cu_seqlens, q.shape[1], causal, q.device, win)
        return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, segments=segments,
                                       window=window, softcap=softcap, sinks=sinks)
    b, s, hq, d = q.shape
    plan = None if cu_seqlens is None else document_plan(cu_seqlens, layout, rank, size, s, causal, q.device, win)
    out = torch.zeros((b, s, hq, v.shape[3]), device=q.device, dtype=torch.float32)
    lse = torch.full((b, hq, s), float("-inf"), device=q.device, dtype=torch.float32)
    q_chunks = shard_chunks(layout, rank, size, s)
    schedule = ring_schedule(ring_rounds(layout, size, s, bool(causal), win), size)
    for (offset, _, _), (kb, vb) in _rotate((k.contiguous(), v.contiguous()), transport, schedule):
        src = (rank - offset) % size
        for qs, ks, qo, ko, masked, seg in _step_launches(plan, offset, q_chunks, layout, src, size, s, causal, win):
            c, w = _mask(masked, causal, win)
            flash_attention_forward(q[:, qs], kb[:, ks], vb[:, ks], causal=c, window=w,
                                    softcap=softcap, softmax_scale=softmax_scale, q_offset=qo, k_offset=ko,
                                    out=out[:, qs], lse=lse[:, :, qs], accumulate=True, segments=seg)
    if sinks is not None:
        _fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _owner_sums(finished):
    """The finished dK/dV sums of this rank's own block: the sum of each direction's chain
    (``(handle or None, sums, sent)``: waited on first), added into the first one's buffer."""
    total = None
    for handle, sums, _ in finished:
        if handle is not None:
            handle.wait()
        total = sums if total is None else total.add_(sums)
    return total


def ring_attention_bwd(dout, q, k, v, out, lse, transport: Transport, *, causal=False, layout="zigzag",
                       softmax_scale=None, grad_dtype=None, cu_seqlens=None, window=None, softcap=None, sinks=None,
                       dq_mode=DEFAULT_DQ_MODE):
    """The backward of :func:`~fusedpar.ops.sequence_parallel.api.ring_attention`: ``(dq, dk, dv)`` of this rank's shard in
    ``grad_dtype`` (default q's dtype), from the forward's ``out`` and ``lse``; with ``sinks``
    also ``dsinks`` (fp32 ``[heads]``: this rank's query rows' part of the sinks' gradient, from
    the final ``lse`` once; the kernels see the sinks through ``lse`` only). ``dq_mode``: the
    flash backward's (``"separate"`` or ``"atomic"``; dq is an fp32 sum over the steps either way).

    K/V travel as in the forward (the same :func:`~fusedpar.ops.sequence_parallel.plans.ring_rounds`); the fp32 dK/dV sums of the block
    in hand travel with it, one ``ring_shift`` behind, each direction's chain starting at the
    block's owner (forward: its own queries' part) or next neighbour (backward); the rank
    holding a chain's last hop sends the finished sums straight to the owner (on the full ring
    that is the next shift), who adds its two directions' sums.
    """
    check_transport("transport", transport)
    win = check_window(window)
    check_dq_mode(dq_mode)
    size, rank = transport.size, transport.rank
    grad_dtype = q.dtype if grad_dtype is None else grad_dtype
    if size == 1:
        grads = [torch.empty(t.shape, device=q.device, dtype=grad_dtype) for t in (q, k, v)]
        segments = _whole_sequence_segments(cu_seqlens, q.shape[1], causal, q.device, win)
        return flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                        dq=grads[0], dk=grads[1], dv=grads[2], segments=segments, window=window,
                                        softcap=softcap, sinks=sinks, dq_mode=dq_mode)
    s, d = q.shape[1], q.shape[3]
    plan = None if cu_seqlens is None else document_plan(cu_seqlens, layout, rank, size, s, causal, q.device, win)
    delta = attention_delta(out, dout).contiguous()
    lse = lse.contiguous()
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dkv_shape = (*k.shape[:3], d + v.shape[3])  # dK and dV sums travel as one fp32 buffer
    rounds = ring_rounds(layout, size, s, bool(causal), win)
    schedule = ring_schedule(rounds, size)
    free = []  # fp32 dK/dV buffers whose transfers have finished

    def buffer():
        return free.pop().zero_() if free else torch.zeros(dkv_shape, device=q.device, dtype=torch.float32)

    chain = None  # (handle, sent, incoming) of the partial sums in flight to the next hop of a chain
    finished = []  # (handle or None, sums, sent): each direction's finished sums of this rank's block
    q_chunks = shard_chunks(layout, rank, size, s)
    for (offset, direction, hop), (kb, vb) in _rotate((k.contiguous(), v.contiguous()), transport, schedule):
        src = (rank - offset) % size
        dkv = buffer()
        for qs, ks, qo, ko, masked, seg in _step_launches(plan, offset, q_chunks, layout, src, size, s, causal, win):
            c, w = _mask(masked, causal, win)
            flash_attention_backward(dout[:, qs], q[:, qs], kb[:, ks], vb[:, ks], None,
                                     lse[:, :, qs], delta=delta[:, :, qs], causal=c, window=w, softcap=softcap,
                                     softmax_scale=softmax_scale, q_offset=qo, k_offset=ko, dq=dq[:, qs],
                                     dk=dkv[:, ks, :, :d], dv=dkv[:, ks, :, d:], accumulate=True, segments=seg,
                                     dq_mode=dq_mode)
        if chain is not None:  # the previous hop's partial sums for this block
            handle, sent, incoming = chain
            handle.wait()
            dkv += incoming
            free += [sent, incoming]
            chain = None
        last = rounds[0] if direction == 1 else rounds[1]
        if hop < last:
            incoming = buffer()
            chain = (transport.ring_shift(dkv, incoming, step=direction), dkv, incoming)
        elif hop == 0:  # nothing travels forward: this rank's own queries' sums are complete
            finished.append((None, dkv, None))
        else:  # the chain's last hop: the finished sums go straight to the block's owner
            sums = buffer()
            handle = transport.send_recv(dkv, (rank - direction * hop) % size, sums, (rank + direction * hop) % size)
            finished.append((handle, sums, dkv))
    dkv = _owner_sums(finished)
    # views of one fp32 buffer, converted (copied): the gradients never share storage (custom-op outputs)
    grads = (dq.to(grad_dtype), dkv[..., :d].to(grad_dtype, copy=True), dkv[..., d:].to(grad_dtype, copy=True))
    return grads if sinks is None else (*grads, sink_grad(sinks, lse, delta))


# ----------------------------------------------------------------------------------------------
# Ulysses all-to-alls
# ----------------------------------------------------------------------------------------------
def ulysses_kv_heads(hq: int, hk: int, size: int):
    """``(kv_heads, kv_heads_per_rank)``: the kv head indices sent to the ranks of a Ulysses
    group of ``size`` (``[size * kv_heads_per_rank]``; kv heads are replicated when there are
    fewer than ranks), or a ValueError naming the group sizes that work."""

    def ok(u):
        return hq % u == 0 and (hk % u == 0 or u % hk == 0)

    if not ok(size):
        good = [u for u in range(1, hq + 1) if ok(u)]
        raise ValueError(
            f"Ulysses cannot split {hq} query heads / {hk} kv heads over a group of size {size}: the "
            f"group size must divide the query heads and divide or be a multiple of the kv heads; "
            f"sizes that work: {good}"
        )
    if hk % size == 0:
        return list(range(hk)), hk // size
    return [u * hk // size for u in range(size)], 1  # replicate: one kv head per rank


def sum_kv_replicas(grads: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradients ``[b, s, size, d]`` (fp32) of the replicated kv heads of a Ulysses group of
    ``size`` (one per rank, :func:`ulysses_kv_heads`) summed into ``[b, s, kv_heads, d]``.
    Replicas are consecutive (rank ``u`` holds kv head ``u * kv_heads // size``, so head ``u`` is
    replica ``u % r`` of kv head ``u // r``, ``r = size // kv_heads``) and are added one after
    the other in rank order: no atomics, the same bits on every run and device (the order of the
    former ``index_add_`` on the CPU), and no buffer beyond the result."""
    replicas = grads.unflatten(2, (kv_heads, grads.shape[2] // kv_heads))  # [b, s, kv_heads, r, d]
    total = replicas[:, :, :, 0] + replicas[:, :, :, 1]  # replicated: r >= 2
    for i in range(2, replicas.shape[3]):
        total += replicas[:, :, :, i]
    return total


def _seq_to_heads(parts, transport, s_local):
    """``parts``: ``[(tensor [b, s_local, size * n_i, d_i], n_i)]``. One all-to-all; returns the
    packed full-sequence head shards ``[b, size * s_local, sum(n_i * d_i)]`` (see :func:`split_heads`)."""
    size = transport.size
    b = parts[0][0].shape[0]
    widths = [n * t.shape[3] for t, n in parts]
    send = torch.empty((size, b, s_local, sum(widths)), device=parts[0][0].device, dtype=parts[0][0].dtype)
    lo = 0
    for (t, n), w in zip(parts, widths):
        send[:, :, :, lo:lo + w].copy_(t.unflatten(2, (size, n)).permute(2, 0, 1, 3, 4).flatten(3))
        lo += w
    recv = torch.empty_like(send)
    transport.all_to_all(recv, send).wait()
    return recv.permute(1, 0, 2, 3).reshape(b, size * s_local, sum(widths))


def split_heads(heads: torch.Tensor, widths) -> list:
    """Views ``[b, s, n, d]`` of consecutive head groups of ``widths`` (``(n, d)`` pairs) in the
    packed q/k/v head shards ``[b, s, sum(n * d)]`` of :func:`ulysses_attention_fwd`."""
    views, lo = [], 0
    for n, d in widths:
        views.append(heads[:, :, lo:lo + n * d].unflatten(2, (n, d)))
        lo += n * d
    return views


def _heads_to_seq(parts, transport, dtype):
    """``parts``: ``[tensor [b, size * s_local, n_i, d_i]]`` (head shards, full sequence). One
    all-to-all; returns ``[b, s_local, size * n_i, d_i]`` per part (sequence shards, all heads)."""
    size = transport.size
    b, s_full = parts[0].shape[:2]
    s_local = s_full // size
    widths = [t.shape[2] * t.shape[3] for t in parts]
    send = torch.empty((size, b, s_local, sum(widths)), device=parts[0].device, dtype=dtype)
    lo = 0
    for t, w in zip(parts, widths):
        send[:, :, :, lo:lo + w].copy_(t.unflatten(1, (size, s_local)).permute(1, 0, 2, 3, 4).flatten(3))
        lo += w
    recv = torch.empty_like(send)
    transport.all_to_all(recv, send).wait()
    outs, lo = [], 0
    for t, w in zip(parts, widths):
        n, d = t.shape[2:]
        part = recv[:, :, :, lo:lo + w].unflatten(3, (n, d))  # [size, b, s_local, n, d]
        outs.append(part.permute(1, 2, 0, 3, 4).contiguous().view(b, s_local, size * n, d))
        lo += w
    return outs


def head_widths(hq: int, hk: int, size: int, d: int, d_v: int) -> tuple:
    """The ``(heads, head_dim)`` of the q, k and v head shards one rank of a Ulysses group of
    ``size`` holds (:func:`split_heads` of the packed shards)."""
    hk_l = ulysses_kv_heads(hq, hk, size)[1]
    return (hq // size, d), (hk_l, d), (hk_l, d_v)


def _local_sinks(sinks, transport, heads):
    """This rank's slice of the sink logits: the ``heads`` query heads the all-to-all gave it."""
    return None if sinks is None else sinks[transport.rank * heads:(transport.rank + 1) * heads]


def ulysses_attention_fwd(q, k, v, transport: Transport, *, ring_transport: Transport | None = None, causal=False,
                          layout="contiguous", softmax_scale=None, cu_seqlens=None, window=None, softcap=None,
                          sinks=None):
    """The forward of :func:`~fusedpar.ops.sequence_parallel.api.ulysses_attention` (``ring_transport=None``)
    and of :func:`~fusedpar.ops.sequence_parallel.api.hybrid_attention` (ring attention over
    ``ring_transport`` on the head shards).

    Returns ``(out, saved)``: ``out`` this rank's output shard (``[b, s_local, heads, d_v]``, q's
    dtype) and ``saved = (heads, out_heads, lse)``: the q, k and v head shards packed along the
    last dim (``[b, size * s_local, sum(n * d)]`` over :func:`head_widths`, see
    :func:`split_heads`), the output's and the lse, what :func:`ulysses_attention_bwd` takes.
    In a group of one ``heads`` and ``out_heads`` are None (they are q, k, v and ``out``).
    ``window``, ``softcap`` as in the ring; ``sinks`` (``[heads]``): each rank applies the slice
    of its query heads.
    """
    check_transport("transport", transport)
    if ring_transport is not None:
        check_transport("ring_transport", ring_transport)
    size, rsize = transport.size, 1 if ring_transport is None else ring_transport.size
    check_sp_args(q, k, v, causal, layout, ring_shard=q.shape[1] * size, ring_size=rsize)
    hq, hk = q.shape[2], k.shape[2]
    kv_idx, hk_l = ulysses_kv_heads(hq, hk, size)
    if size > 1:
        idx = torch.tensor(kv_idx, device=q.device)
        ks, vs = (k, v) if len(kv_idx) == hk else (k.index_select(2, idx), v.index_select(2, idx))
        heads = _seq_to_heads([(q, hq // size), (ks, hk_l), (vs, hk_l)], transport, q.shape[1])
        ql, kl, vl = split_heads(heads, head_widths(hq, hk, size, q.shape[3], v.shape[3]))
    else:
        heads, (ql, kl, vl) = None, (q, k, v)
    scores = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                  sinks=_local_sinks(sinks, transport, hq // size))
    if ring_transport is None:
        segments = _whole_sequence_segments(cu_seqlens, ql.shape[1], causal, q.device, check_window(window))
        out_l, lse = flash_attention_forward(ql, kl, vl, segments=segments, **scores)
    else:
        out_l, lse = ring_attention_fwd(ql, kl, vl, ring_transport, layout=layout, cu_seqlens=cu_seqlens, **scores)
    if size == 1:
        return out_l, (None, None, lse)
    return _heads_to_seq([out_l], transport, q.dtype)[0], (heads, out_l, lse)


def ulysses_attention_bwd(dout, q_heads, k_heads, v_heads, out_heads, lse, transport: Transport, *, kv_heads: int,
                          ring_transport: Transport | None = None, causal=False, layout="contiguous",
                          softmax_scale=None, cu_seqlens=None, window=None, softcap=None, sinks=None,
                          dq_mode=DEFAULT_DQ_MODE):
    """The backward of :func:`ulysses_attention_fwd` from its ``saved`` tensors (the packed heads
    split, or q, k, v and out in a group of one): ``(dq, dk, dv)`` of this rank's sequence shard;
    ``kv_heads`` is the number of kv heads of the input k/v. With ``sinks`` also ``dsinks``
    (fp32 ``[heads]``): this rank's heads' slice over the whole sequence, zero elsewhere (the
    sum over the group is the sinks' gradient). ``dq_mode``: the flash backward's
    (``"separate"`` or ``"atomic"``)."""
    check_transport("transport", transport)
    size = transport.size
    dtype = q_heads.dtype
    hq_l = q_heads.shape[2]
    kv_idx, _ = ulysses_kv_heads(hq_l * size, kv_heads, size)
    replicated = len(kv_idx) != kv_heads
    # replicated kv heads are summed over ranks after the all-to-all: keep those sums in fp32
    grad_dtype = torch.float32 if replicated else dtype
    dout_l = _seq_to_heads([(dout, hq_l)], transport, dout.shape[1]).unflatten(2, (hq_l, -1)) if size > 1 else dout
    args = (dout_l, q_heads, k_heads, v_heads, out_heads, lse)
    scores = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                  sinks=_local_sinks(sinks, transport, hq_l), dq_mode=dq_mode)
    if ring_transport is None:
        grads = [torch.empty(t.shape, device=dout.device, dtype=grad_dtype) for t in (q_heads, k_heads, v_heads)]
        segments = _whole_sequence_segments(cu_seqlens, q_heads.shape[1], causal, dout.device, check_window(window))
        grads = flash_attention_backward(*args, dq=grads[0], dk=grads[1], dv=grads[2], segments=segments, **scores)
    else:
        grads = ring_attention_bwd(*args, ring_transport, layout=layout, grad_dtype=grad_dtype, cu_seqlens=cu_seqlens,
                                   **scores)
    dsinks = None
    if sinks is not None:
        dsinks = torch.zeros(sinks.shape, device=sinks.device, dtype=torch.float32)
        dsinks[transport.rank * hq_l:(transport.rank + 1) * hq_l] = grads[3]
    dq, dk, dv = grads[:3]
    if size > 1:
        dq, dk, dv = _heads_to_seq([dq, dk, dv], transport, grad_dtype)
    if replicated:
        dq, dk, dv = dq.to(dtype), sum_kv_replicas(dk, kv_heads).to(dtype), sum_kv_replicas(dv, kv_heads).to(dtype)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)
