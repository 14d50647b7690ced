"""Sequence-parallel attention: ring (zigzag or contiguous), Ulysses, and the 2-D hybrid.

Every rank holds a shard of the sequence (``[batch, s_local, heads, head_dim]``) and gets back
the attention output of its own shard; gradients flow back to the shard inputs.

* **Ring** (``ring_attention``): K/V blocks travel around the ring group (``comm.ring_shift``,
  double-buffered) while the flash kernel computes on the block in hand, merging into an fp32
  ``(out, lse)`` state (the kernel's accumulate mode). The backward sends K/V around again,
  and passes the dK/dV accumulators along the ring in fp32 (one shift behind), so rounding does
  not grow with the ring size. Layouts: ``"contiguous"`` (rank ``r`` holds positions
  ``[r*s, (r+1)*s)``) and ``"zigzag"`` (the sequence cut in ``2P`` chunks, rank ``r`` holds chunks
  ``r`` and ``2P-1-r``: with causal masking every rank does the same work at every step). Block
  pairs that the causal mask hides completely are skipped; partially visible ones are split
  into half-blocks so that fully visible halves run unmasked.
* **Ulysses** (``ulysses_attention``): one all-to-all turns sequence shards with all heads into
  head shards with the full sequence, local flash attention runs, a second all-to-all turns the
  output back. Q, K and V travel in one packed all-to-all. K/V heads fewer than the group size
  are replicated (each rank gets the kv head its query heads read) and their gradients summed
  back in fp32.
* **Hybrid** (``hybrid_attention``): Ulysses inside ``ulysses_group`` then ring attention across
  ``ring_group`` on the head shards: 2-D sequence parallelism.

Layers: fusedpar.kernels.flash_attention launchers -> the schedules below ->
``_SequenceParallelAttention`` (autograd) -> ``ring_attention`` / ``ulysses_attention`` /
``hybrid_attention``; the shard helpers give each rank its piece of a full sequence and the
global positions of its tokens (for rotary embeddings).
"""
from __future__ import annotations

import torch

from fusedpar.ops import comm
from fusedpar.kernels.flash_attention import (
    _check_qkv,
    _scale,
    attention_delta,
    flash_attention_backward,
    flash_attention_forward,
)

LAYOUTS = ("zigzag", "contiguous")
_LOCAL = "local"  # marks a sequence-parallel dimension of size 1 (no group, no communication)


# ----------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------
def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_rank(name, rank, size):
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name}_size must be a positive int, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{name}_rank must be an int in [0, {size}), got {rank!r}")


def shard_positions(seq_len: int, *, layout: str = "zigzag", ring_rank: int = 0, ring_size: int = 1,
                    ulysses_rank: int = 0, ulysses_size: int = 1, device=None) -> torch.Tensor:
    """Global positions (``int64``, in local order) of the tokens one rank holds.

    The sequence is first split over the ring (``layout="contiguous"``: ``ring_size`` equal
    pieces; ``"zigzag"``: ``2 * ring_size`` chunks, ring rank ``r`` holding chunks ``r`` and
    ``2*ring_size-1-r`` in that order), then the ring shard is cut into ``ulysses_size``
    contiguous pieces. Plain ring attention uses ``ulysses_size=1``, plain Ulysses
    ``ring_size=1`` (then the layout does not matter).
    """
    _check_layout(layout)
    _check_rank("ring", ring_rank, ring_size)
    _check_rank("ulysses", ulysses_rank, ulysses_size)
    n_chunks = 2 * ring_size if layout == "zigzag" and ring_size > 1 else ring_size
    if seq_len % n_chunks or (seq_len // ring_size) % ulysses_size:
        raise ValueError(
            f"seq_len={seq_len} must split into {n_chunks} equal {layout} chunks, and each ring shard "
            f"(seq_len / {ring_size}) into ulysses_size={ulysses_size} equal pieces"
        )
    c = seq_len // n_chunks
    if n_chunks > ring_size:
        ring = torch.cat([torch.arange(ring_rank * c, (ring_rank + 1) * c),
                          torch.arange((n_chunks - 1 - ring_rank) * c, (n_chunks - ring_rank) * c)])
    else:
        ring = torch.arange(ring_rank * c, (ring_rank + 1) * c)
    piece = ring.numel() // ulysses_size
    return ring[ulysses_rank * piece:(ulysses_rank + 1) * piece].to(device)


def zigzag_positions(seq_len: int, rank: int, size: int, *, device=None) -> torch.Tensor:
    """Global positions of rank ``rank``'s zigzag shard (chunks ``rank`` and ``2*size-1-rank`` of
    ``2*size``): the position ids to use for rotary embeddings."""
    return shard_positions(seq_len, layout="zigzag", ring_rank=rank, ring_size=size, device=device)


def sequence_shard(x: torch.Tensor, *, layout: str = "zigzag", ring_rank: int = 0, ring_size: int = 1,
                   ulysses_rank: int = 0, ulysses_size: int = 1, dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (along ``dim``), see :func:`shard_positions`."""
    pos = shard_positions(x.shape[dim], layout=layout, ring_rank=ring_rank, ring_size=ring_size,
                          ulysses_rank=ulysses_rank, ulysses_size=ulysses_size, device=x.device)
    return x.index_select(dim, pos)


def zigzag_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x``: chunks ``rank`` and
    ``2*size-1-rank`` of ``2*size`` equal chunks along ``dim``, concatenated."""
    return sequence_shard(x, layout="zigzag", ring_rank=rank, ring_size=size, dim=dim)


def zigzag_unshard(x: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard` over all ranks: ``x`` is every rank's shard concatenated in
    rank order along ``dim`` (what an all-gather returns); the result is the full sequence."""
    n = x.shape[dim]
    pos = torch.cat([zigzag_positions(n, r, size) for r in range(size)]).to(x.device)
    out = torch.empty_like(x)
    out.index_copy_(dim, pos, x)
    return out


# ----------------------------------------------------------------------------------------------
# Ring schedule
# ----------------------------------------------------------------------------------------------
def _gsize(group):
    return 1 if group is _LOCAL else comm.group_size(group)


def _grank(group):
    return 0 if group is _LOCAL else comm.group_rank(group)


def _chunks(layout, rank, size, s_local):
    """``[(local_start, length, global_start)]`` of a rank's shard of the ring sequence."""
    if layout == "contiguous" or size == 1:
        return [(0, s_local, rank * s_local)]
    c = s_local // 2
    return [(0, c, rank * c), (c, c, (2 * size - 1 - rank) * c)]


def _plan(q_chunks, k_chunks, causal):
    """Kernel launches for one (query shard, key block) pair:
    ``[(q_slice, k_slice, q_offset, k_offset, causal)]``. Fully hidden chunk pairs are dropped;
    runs of fully visible chunks are merged into one unmasked launch."""
    sq = sum(c[1] for c in q_chunks)
    sk = sum(c[1] for c in k_chunks)
    if not causal:
        return [(slice(0, sq), slice(0, sk), 0, 0, False)]

    def kind(qc, kc):
        (_, ql, qg), (_, kl, kg) = qc, kc
        if kg > qg + ql - 1:
            return "hidden"
        if kg + kl - 1 <= qg:
            return "visible"
        return "causal"

    kinds = {(i, j): kind(qc, kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(k_chunks)}
    if all(t == "visible" for t in kinds.values()):
        return [(slice(0, sq), slice(0, sk), 0, 0, False)]
    launches, done = [], set()
    nq, nk = len(q_chunks), len(k_chunks)

    def sl(c):
        return slice(c[0], c[0] + c[1])

    if nq > 1:
        for j, kc in enumerate(k_chunks):
            if all(kinds[i, j] == "visible" for i in range(nq)):
                launches.append((slice(0, sq), sl(kc), 0, 0, False))
                done |= {(i, j) for i in range(nq)}
    if nk > 1:
        for i, qc in enumerate(q_chunks):
            if all(kinds[i, j] == "visible" and (i, j) not in done for j in range(nk)):
                launches.append((sl(qc), slice(0, sk), 0, 0, False))
                done |= {(i, j) for j in range(nk)}
    for (i, j), t in kinds.items():
        if (i, j) in done or t == "hidden":
            continue
        qc, kc = q_chunks[i], k_chunks[j]
        launches.append((sl(qc), sl(kc), qc[2], kc[2], t == "causal"))
    return launches


def _ring_forward(q, k, v, group, causal, layout, scale):
    """Returns ``(out, lse)``: out in q's dtype, lse ``[b, h, s_local]`` fp32."""
    size, rank = _gsize(group), _grank(group)
    if size == 1:
        return flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale)
    b, s, hq, d = q.shape
    out = torch.zeros((b, s, hq, d), device=q.device, dtype=torch.float32)
    lse = torch.full((b, hq, s), float("-inf"), device=q.device, dtype=torch.float32)
    kv = torch.stack((k, v))  # one contiguous block to pass around: [2, b, s, hk, d]
    nxt = torch.empty_like(kv)
    q_chunks = _chunks(layout, rank, size, s)
    for step in range(size):
        src = (rank - step) % size
        handle = comm.ring_shift(kv, nxt, group) if step < size - 1 else None
        for qs, ks, qo, ko, c in _plan(q_chunks, _chunks(layout, src, size, s), causal):
            flash_attention_forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], causal=c, softmax_scale=scale,
                                    q_offset=qo, k_offset=ko, out=out[:, qs], lse=lse[:, :, qs], accumulate=True)
        if handle is not None:
            handle.wait()  # the next block has arrived and our send of this one has left
            kv, nxt = nxt, kv
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, causal, layout, scale, grad_dtype):
    """Returns ``(dq, dk, dv)`` in ``grad_dtype``."""
    size, rank = _gsize(group), _grank(group)
    if size == 1:
        dq = torch.empty(q.shape, device=q.device, dtype=grad_dtype)
        dk = torch.empty(k.shape, device=q.device, dtype=grad_dtype)
        dv = torch.empty(v.shape, device=q.device, dtype=grad_dtype)
        return flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                        dq=dq, dk=dk, dv=dv)
    s = q.shape[1]
    delta = attention_delta(out, dout).contiguous()
    lse = lse.contiguous()
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kv = torch.stack((k, v))
    nxt = torch.empty_like(kv)
    # dK/dV of the block in hand travel with it (fp32), one shift behind the K/V themselves
    dkv_bufs = [torch.empty((2,) + tuple(k.shape), device=q.device, dtype=torch.float32) for _ in range(2)]
    dkv_in = torch.empty_like(dkv_bufs[0])
    dkv_handle = None
    q_chunks = _chunks(layout, rank, size, s)
    for step in range(size):
        src = (rank - step) % size
        handle = comm.ring_shift(kv, nxt, group) if step < size - 1 else None
        dkv = dkv_bufs[step % 2]  # its send two steps ago was waited on at the previous step
        dkv.zero_()
        for qs, ks, qo, ko, c in _plan(q_chunks, _chunks(layout, src, size, s), causal):
            flash_attention_backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], None, lse[:, :, qs],
                                     delta=delta[:, :, qs], causal=c, softmax_scale=scale, q_offset=qo,
                                     k_offset=ko, dq=dq[:, qs], dk=dkv[0][:, ks], dv=dkv[1][:, ks], accumulate=True)
        if dkv_handle is not None:
            dkv_handle.wait()  # the left neighbour's partial sums for block src
            dkv += dkv_in
        dkv_handle = comm.ring_shift(dkv, dkv_in, group)
        if handle is not None:
            handle.wait()
            kv, nxt = nxt, kv
    dkv_handle.wait()  # the finished sums for this rank's own block, from the left neighbour
    return dq.to(grad_dtype), dkv_in[0].to(grad_dtype), dkv_in[1].to(grad_dtype)


# ----------------------------------------------------------------------------------------------
# Ulysses all-to-alls
# ----------------------------------------------------------------------------------------------
def _ulysses_heads(hq, hk, size):
    """Per-rank kv head indices (``[size * hk_local]``), or a ValueError naming sizes that work."""

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


def _seq_to_heads(parts, group, size, s_local):
    """``parts``: ``[(tensor [b, s_local, size * n_i, d], n_i)]``. One all-to-all; returns views
    ``[b, size * s_local, n_i, d]`` of one packed full-sequence buffer."""
    b, d = parts[0][0].shape[0], parts[0][0].shape[3]
    widths = [n for _, n in parts]
    send = torch.empty((size, b, s_local, sum(widths), d), device=parts[0][0].device, dtype=parts[0][0].dtype)
    lo = 0
    for t, n in parts:
        send[:, :, :, lo:lo + n].copy_(t.unflatten(2, (size, n)).permute(2, 0, 1, 3, 4))
        lo += n
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group).wait()
    full = recv.permute(1, 0, 2, 3, 4).reshape(b, size * s_local, sum(widths), d)
    views, lo = [], 0
    for n in widths:
        views.append(full[:, :, lo:lo + n])
        lo += n
    return views


def _heads_to_seq(parts, group, size, dtype):
    """``parts``: ``[tensor [b, size * s_local, n_i, d]]`` (head shards, full sequence). One
    all-to-all; returns ``[b, s_local, size * n_i, d]`` per part (sequence shards, all heads)."""
    b, s_full, _, d = parts[0].shape
    s_local = s_full // size
    widths = [t.shape[2] for t in parts]
    send = torch.empty((size, b, s_local, sum(widths), d), device=parts[0].device, dtype=dtype)
    lo = 0
    for t in parts:
        n = t.shape[2]
        send[:, :, :, lo:lo + n].copy_(t.unflatten(1, (size, s_local)).permute(1, 0, 2, 3, 4))
        lo += n
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group).wait()
    outs, lo = [], 0
    for n in widths:
        outs.append(recv[:, :, :, lo:lo + n].permute(1, 2, 0, 3, 4).reshape(b, s_local, size * n, d))
        lo += n
    return outs


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------
class _SequenceParallelAttention(torch.autograd.Function):
    """Ulysses over ``ulysses_group`` (size 1: none), then ring attention over ``ring_group``."""

    @staticmethod
    def forward(ctx, q, k, v, ulysses_group, ring_group, causal, layout, scale):
        usize = _gsize(ulysses_group)
        hq, hk = q.shape[2], k.shape[2]
        if usize > 1:
            kv_idx, hk_l = _ulysses_heads(hq, hk, usize)
            idx = torch.tensor(kv_idx, device=q.device)
            ks, vs = (k, v) if len(kv_idx) == hk else (k.index_select(2, idx), v.index_select(2, idx))
            ql, kl, vl = _seq_to_heads([(q, hq // usize), (ks, hk_l), (vs, hk_l)], ulysses_group, usize, q.shape[1])
        else:
            kv_idx, ql, kl, vl = None, q, k, v
        out_l, lse = _ring_forward(ql, kl, vl, ring_group, causal, layout, scale)
        out = _heads_to_seq([out_l], ulysses_group, usize, q.dtype)[0] if usize > 1 else out_l
        ctx.save_for_backward(ql, kl, vl, out_l, lse)
        ctx.args = (ulysses_group, ring_group, causal, layout, scale, kv_idx, hk, q.shape[1])
        return out

    @staticmethod
    def backward(ctx, dout):
        ql, kl, vl, out_l, lse = ctx.saved_tensors
        ulysses_group, ring_group, causal, layout, scale, kv_idx, hk, s_local = ctx.args
        usize = _gsize(ulysses_group)
        dout = dout.to(ql.dtype)
        replicated = kv_idx is not None and len(kv_idx) != hk
        # replicated kv heads are summed over ranks after the all-to-all: keep those sums in fp32
        grad_dtype = torch.float32 if replicated else ql.dtype
        if usize > 1:
            hq_l = ql.shape[2]
            dout_l = _seq_to_heads([(dout, hq_l)], ulysses_group, usize, s_local)[0]
        else:
            dout_l = dout
        dq_l, dk_l, dv_l = _ring_backward(dout_l, ql, kl, vl, out_l, lse, ring_group, causal, layout, scale, grad_dtype)
        if usize == 1:
            return dq_l, dk_l, dv_l, None, None, None, None, None
        dq, dk_r, dv_r = _heads_to_seq([dq_l, dk_l, dv_l], ulysses_group, usize, grad_dtype)
        if replicated:
            idx = torch.tensor(kv_idx, device=dq.device)
            b, s, _, d = dk_r.shape
            dk = torch.zeros((b, s, hk, d), device=dq.device, dtype=torch.float32).index_add_(2, idx, dk_r)
            dv = torch.zeros((b, s, hk, d), device=dq.device, dtype=torch.float32).index_add_(2, idx, dv_r)
            dq, dk, dv = dq.to(ql.dtype), dk.to(kl.dtype), dv.to(vl.dtype)
        else:
            dk, dv = dk_r, dv_r
        return dq, dk, dv, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------
def _validate(q, k, v, causal, layout, softmax_scale):
    _check_qkv(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"sequence-parallel attention needs k/v shards of q's length {q.shape[1]}, got {k.shape[1]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_layout(layout)
    return _scale(softmax_scale, q.shape[3])


def _check_group(name, group):
    if group is not None and not isinstance(group, comm.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


def ring_attention(q, k, v, *, group=None, causal=False, layout="zigzag", softmax_scale=None):
    """Attention over the full sequence from this rank's shard; returns this rank's output shard.

    q ``[b, s_local, heads, d]``, k/v ``[b, s_local, kv_heads, d]`` (kv_heads divides heads),
    the shard of this rank of ``group`` in ``layout`` (see :func:`sequence_shard`:
    ``"contiguous"``: positions ``[r*s_local, (r+1)*s_local)``; ``"zigzag"``: chunks ``r`` and
    ``2P-1-r`` of ``2P``, so ``s_local`` must be even). Every rank must hold the same ``s_local``.
    """
    _check_group("group", group)
    scale = _validate(q, k, v, causal, layout, softmax_scale)
    size = comm.group_size(group)
    if layout == "zigzag" and size > 1 and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local sequence length (two chunks), got {q.shape[1]}")
    ring = _LOCAL if size == 1 else comm.resolve_group(group)
    return _SequenceParallelAttention.apply(q, k, v, _LOCAL, ring, causal, layout, scale)


def ulysses_attention(q, k, v, *, group=None, causal=False, softmax_scale=None):
    """Ulysses (all-to-all) sequence-parallel attention; returns this rank's output shard.

    q ``[b, s_local, heads, d]``, k/v ``[b, s_local, kv_heads, d]``: rank ``r`` holds positions
    ``[r*s_local, (r+1)*s_local)``. The group size must divide ``heads`` and divide (or be a
    multiple of) ``kv_heads``; otherwise a ValueError lists the sizes that work.
    """
    _check_group("group", group)
    scale = _validate(q, k, v, causal, "contiguous", softmax_scale)
    size = comm.group_size(group)
    _ulysses_heads(q.shape[2], k.shape[2], size)
    uly = _LOCAL if size == 1 else comm.resolve_group(group)
    return _SequenceParallelAttention.apply(q, k, v, uly, _LOCAL, causal, "contiguous", scale)


def hybrid_attention(q, k, v, *, ulysses_group, ring_group, causal=False, layout="zigzag", softmax_scale=None):
    """2-D sequence parallelism: Ulysses inside ``ulysses_group``, ring across ``ring_group``.

    The two groups must be orthogonal (each rank is in one of each; e.g. on 4 ranks
    ``ulysses_group`` {0,1} / {2,3} and ``ring_group`` {0,2} / {1,3}). Rank (ring rank ``r``,
    ulysses rank ``u``) holds piece ``u`` of ``ulysses_size`` contiguous pieces of ring shard
    ``r`` in ``layout``: ``sequence_shard(x, layout=layout, ring_rank=r, ring_size=R,
    ulysses_rank=u, ulysses_size=U)``; its positions are :func:`shard_positions`.
    """
    _check_group("ulysses_group", ulysses_group)
    _check_group("ring_group", ring_group)
    if ulysses_group is None or ring_group is None:
        raise ValueError("hybrid_attention needs both ulysses_group and ring_group (use ring_attention or "
                         "ulysses_attention for one-dimensional sequence parallelism)")
    scale = _validate(q, k, v, causal, layout, softmax_scale)
    usize, rsize = comm.group_size(ulysses_group), comm.group_size(ring_group)
    _ulysses_heads(q.shape[2], k.shape[2], usize)
    if layout == "zigzag" and rsize > 1 and (q.shape[1] * usize) % 2:
        raise ValueError(f"layout='zigzag' needs an even ring shard (s_local * ulysses_size), got {q.shape[1] * usize}")
    uly = _LOCAL if usize == 1 else ulysses_group
    ring = _LOCAL if rsize == 1 else ring_group
    return _SequenceParallelAttention.apply(q, k, v, uly, ring, causal, layout, scale)
