"""The bodies of the loss ops: the vocabulary-parallel cross entropy's math and collectives
(:func:`vocab_parallel_cross_entropy_fwd` / :func:`vocab_parallel_cross_entropy_bwd`), the global
loss over data ranks, :func:`attach_aux_loss_fwd`, and the fused linear + cross entropy
(:func:`linear_cross_entropy_fwd` / :func:`linear_cross_entropy_bwd`): per-row softmax statistics
from the logits GEMM's epilogue (``fusedpar.kernels.linear_ce``), then a backward over blocks of
the vocabulary shard that recomputes each block's logits (at most ``chunk_tokens`` rows of
vocabulary-sized memory), ``d_weight`` per block and ``d_hidden`` in fp32."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedpar.kernels import linear_ce_dlogits, linear_ce_stats, matmul, matmul_tn
from fusedpar.ops import comm
from fusedpar.ops.comm.transport import Transport, transport_from_id
from fusedpar.ops.tensor_parallel.schedules import ring_gather


def vocab_parallel_cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Per-token loss ``[T]`` (fp32) of ``logits`` ``[T, V/tp]`` against global ids ``target``
    ``[T]`` (int64), and what the backward needs besides ``logits``: ``(loss, lse, idx, inside)``
    with ``lse`` the fp32 log-sum-exp of the full row (the softmax is recomputed from it: a
    vocabulary-sized fp32 block is not kept between forward and backward), ``idx`` the target's
    column in this block and ``inside`` whether the target falls in it. A collective over ``group``."""
    T, V = logits.shape
    P, r = comm.group_size(group), comm.group_rank(group)
    z = logits.float()
    local_max = z.max(dim=-1).values if V else torch.full((T,), -math.inf, device=z.device)
    if P > 1:
        maxes = torch.empty(P * T, device=z.device, dtype=torch.float32)
        comm.all_gather_into(maxes, local_max.contiguous(), group).wait()
        row_max = maxes.view(P, T).max(dim=0).values
    else:
        row_max = local_max
    z = z - row_max[:, None]
    exp = z.exp()
    lo = r * V
    inside = (target >= lo) & (target < lo + V)
    idx = torch.where(inside, target - lo, torch.zeros_like(target))
    picked = z.gather(1, idx[:, None]).squeeze(1) * inside
    stats = torch.stack([exp.sum(dim=-1), picked])  # [2, T]
    if P > 1:
        comm.all_reduce(stats, group).wait()
    sum_exp, target_logit = stats[0], stats[1]
    log_sum = sum_exp.log()
    return log_sum - target_logit, row_max + log_sum, idx, inside


def vocab_parallel_cross_entropy_bwd(grad_loss: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                                     idx: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """Gradient of the logits block, ``(softmax - onehot(target)) * grad_loss`` in ``logits.dtype``,
    the softmax recomputed as ``exp(logits - lse)`` into one fp32 buffer. Local: the forward's
    collectives already made ``lse`` the full row's."""
    g = grad_loss.float()
    grad = torch.sub(logits, lse[:, None]).exp_().mul_(g[:, None])  # fp32 (lse's dtype wins)
    grad.scatter_add_(1, idx[:, None], -(inside.to(grad.dtype) * g)[:, None])
    return grad.to(logits.dtype)


def check_target_range(target, valid, vocab, ignore_index):
    """Every counted (``valid``) target id lies in ``[0, vocab)`` (a host read of the ids)."""
    bad = valid & ((target < 0) | (target >= vocab))
    if target.numel() and bool(bad.any()):
        raise ValueError(f"target must hold ids in [0, {vocab}) or ignore_index={ignore_index}, got "
                         f"{target[bad][0].item()}")


def attach_aux_loss_fwd(x: torch.Tensor, aux_loss: torch.Tensor, scale: float,
                        residual: torch.Tensor | None) -> torch.Tensor:
    """``x`` copied, or ``x + residual`` (``aux_loss`` and ``scale`` are the backward's)."""
    # a custom op's output cannot alias its input: x is copied, or (with a residual) the add that
    # follows anyway writes the new tensor
    out = torch.empty(x.shape, dtype=x.dtype if residual is None else torch.result_type(x, residual), device=x.device)
    return out.copy_(x) if residual is None else torch.add(x, residual, out=out)


# ----------------------------------------------------------------------------------------------
# the loss over the data ranks
# ----------------------------------------------------------------------------------------------
def data_transport_ids(transport_ids: str) -> list[str]:
    """The transport ids in ``global_loss``'s ``transport_ids`` argument (``;``-separated; a schema
    holds no list of strings)."""
    return [t for t in transport_ids.split(";") if t]


def global_loss_fwd(total: torch.Tensor, count: torch.Tensor, transport_ids: str,
                    mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, global_count)``: ``total`` (a scalar loss sum) and ``count`` (counted tokens)
    summed in fp64 over every group ``transport_ids`` names (one all-reduce of two numbers per group of
    more than one rank), then ``sum / count`` if ``mean`` else ``sum``; fp32 scalars."""
    pair = torch.stack([total.detach().double().reshape(()), count.detach().double().reshape(())])
    for transport_id in data_transport_ids(transport_ids):
        t = transport_from_id(transport_id)
        if t.size > 1:
            t.all_reduce(pair).wait()
    loss = pair[0] / pair[1] if mean else pair[0]
    return loss.float(), pair[1].float()





#: the default working memory of the backward: the bytes of ``chunk_tokens`` rows of fp32 logits,
#: at most this many
CHUNK_BYTES = 256 * 2 ** 20


#: a default chunk that holds more tokens than this holds a multiple of it (kept from the
#: token-chunked version, whose chunks were GEMM rows: the default budget is unchanged)
CHUNK_ALIGN = 128


#: a vocabulary block wider than this is a multiple of it: whole 256-column tiles for the dz GEMM,
#: 64-deep K blocks (vectorised, pipelined loads) for the d_hidden GEMM that contracts over it
VOCAB_ALIGN = 256


def default_chunk_tokens(tokens: int, local_vocab: int) -> int:
    """``chunk_tokens`` when the caller gives none: the tokens whose fp32 logits fill at most
    :data:`CHUNK_BYTES` (512 for a 128k vocabulary on one rank), rounded down to a multiple of
    :data:`CHUNK_ALIGN` tokens when more; at least 1, at most ``tokens``."""
    fit = max(1, CHUNK_BYTES // (4 * max(local_vocab, 1)))
    if fit > CHUNK_ALIGN:
        fit -= fit % CHUNK_ALIGN
    return max(1, min(tokens, fit))


def vocab_block(tokens: int, local_vocab: int, chunk_tokens: int, elem_size: int) -> int:
    """Rows of the shard per backward block: ``dz_b`` (``tokens x Vb`` elements of ``elem_size``
    bytes) within the bytes of ``chunk_tokens`` rows of fp32 logits (``4 chunk_tokens
    local_vocab``); a multiple of :data:`VOCAB_ALIGN` when wider, the blocks as even as that
    allows; at least 1, at most ``local_vocab``."""
    if tokens <= 0 or local_vocab <= 0:
        return max(local_vocab, 1)
    cap = max(1, min(local_vocab, (4 * chunk_tokens * local_vocab) // (elem_size * tokens)))
    if cap >= local_vocab:
        return local_vocab
    align = VOCAB_ALIGN if cap >= VOCAB_ALIGN else 1
    cap -= cap % align
    n_blocks = -(-local_vocab // cap)
    even = -(-local_vocab // n_blocks)
    return -(-even // align) * align  # <= cap: cap is a multiple of align and even <= cap


@dataclass
class LCEOptions:
    """What every block needs: the transport, the loss options, the chunk size and the full vocabulary."""

    transport: Transport
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float  # 0: none
    chunk: int
    vocab: int


def _target_columns(targets, opts: LCEOptions, n_local: int):
    """``(valid, idx)``: counted tokens, the target's column in this shard (-1: another shard's or ignored)."""
    valid = targets != opts.ignore_index
    lo = opts.transport.rank * n_local
    inside = valid & (targets >= lo) & (targets < lo + n_local)
    return valid, torch.where(inside, targets - lo, torch.full_like(targets, -1))


def _combine(stats, targets, opts: LCEOptions):
    """Per-token ``(loss, lse)`` from every shard's statistics ``[3, T]``: one all-gather over the
    group (3 floats per token)."""
    t = opts.transport
    if t.size > 1:
        every = torch.empty((t.size,) + tuple(stats.shape), dtype=stats.dtype, device=stats.device)
        t.all_gather_into(every.view(-1), stats.view(-1)).wait()
        lse, picked, zsum = every[:, 0].logsumexp(dim=0), every[:, 1].sum(dim=0), every[:, 2].sum(dim=0)
    else:
        lse, picked, zsum = stats[0], stats[1], stats[2]
    eps = opts.label_smoothing
    loss = (1 - eps) * (lse - picked)
    if eps:
        loss = loss + eps * (lse - zsum / opts.vocab)
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    valid = targets != opts.ignore_index
    return torch.where(valid, loss, torch.zeros_like(loss)), lse


def linear_cross_entropy_fwd(hidden, weight, targets, opts: LCEOptions, sequence_parallel: bool):
    """Forward of :func:`~fusedpar.ops.loss.linear_cross_entropy`: ``(loss, lse,
    gathered)``, the per-token fp32 loss and log-sum-exp ``[T]`` (block order with
    ``sequence_parallel``; ignored tokens: loss 0) and the gathered input ``[tp, *hidden.shape]``
    (None without ``sequence_parallel``). ``targets``: flat int64 ids ``[T]`` of every token."""
    t, H = opts.transport, hidden.shape[-1]
    T = targets.shape[0]
    stats = torch.empty((3, T), dtype=torch.float32, device=hidden.device)
    _, idx = _target_columns(targets, opts, weight.shape[0])
    gathered = None
    if sequence_parallel:
        gathered = torch.empty((t.size,) + tuple(hidden.shape), dtype=hidden.dtype, device=hidden.device)
        blocks = ring_gather(hidden, t, into=gathered)  # the next block in flight while this one's GEMM runs
    else:
        blocks = iter([(0, hidden)])
    for src, block in blocks:
        rows = block.reshape(-1, H)
        lo, hi = src * rows.shape[0], (src + 1) * rows.shape[0]
        linear_ce_stats(rows, weight, idx[lo:hi], softcap=opts.softcap, smoothing=bool(opts.label_smoothing),
                        out=stats[:, lo:hi])
    loss, lse = _combine(stats, targets, opts)
    return loss, lse, gathered


def _row_terms(grad_loss, lse, valid, opts: LCEOptions):
    """The per-token factors of ``dloss/dz = scale softmax - shift - target_coef onehot``:
    ``scale = g (1 + 2 z_loss lse)``, ``target_coef = (1 - eps) g``, ``shift = eps g / V``
    (``g`` the loss gradient, 0 for ignored tokens); fp32 ``[T]`` each."""
    g = torch.where(valid, grad_loss.float(), torch.zeros((), dtype=torch.float32, device=lse.device))
    scale = g * (1 + 2 * opts.z_loss * lse) if opts.z_loss else g
    eps = opts.label_smoothing
    return scale.contiguous(), (g * (1 - eps)).contiguous(), (g * (eps / opts.vocab)).contiguous()


def _reduce_d_hidden(dx32, hidden, t, sequence_parallel):
    """The fp32 ``d_hidden`` of every token summed over the group (reduce-scattered to this rank's
    block with ``sequence_parallel``, all-reduced otherwise), in hidden's dtype."""
    if t.size > 1 and sequence_parallel:
        out = torch.empty(hidden.numel(), dtype=torch.float32, device=hidden.device)
        t.reduce_scatter_into(out, dx32.view(-1)).wait()
        dx32 = out
    elif t.size > 1:
        t.all_reduce(dx32).wait()
    return dx32.view(hidden.shape).to(hidden.dtype)


def linear_cross_entropy_bwd(grad_loss, hidden, weight, targets, lse, gathered, opts: LCEOptions,
                             sequence_parallel: bool, *, need_dx=True, need_dw=True):
    """Backward of :func:`linear_cross_entropy_fwd`: ``(d_hidden, d_weight)`` (None where not
    needed), vocabulary blocks outer: per block the recomputed logits' gradient ``dz_b`` (one GEMM
    with the gradient epilogue), ``d_weight[b] = dz_b^T h`` (one GEMM over all tokens, written once
    in the weight's dtype) and ``d_hidden += dz_b W_b`` (fp32); ``d_hidden`` summed over the group
    in fp32 (reduce-scattered with ``sequence_parallel``, all-reduced otherwise)."""
    t, H, V = opts.transport, hidden.shape[-1], weight.shape[0]
    rows = (gathered if sequence_parallel else hidden).reshape(-1, H)
    T = rows.shape[0]
    valid, idx = _target_columns(targets, opts, V)
    lse = lse.contiguous()
    scale, target_coef, shift = _row_terms(grad_loss, lse, valid, opts)
    vb = vocab_block(T, V, opts.chunk, weight.element_size())
    dz = torch.empty((T, vb), dtype=weight.dtype, device=weight.device)
    dx32 = torch.empty((T, H), dtype=torch.float32, device=hidden.device) if need_dx else None
    if need_dx and V == 0:
        dx32.zero_()
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_dw else None
    for lo in range(0, V, vb):
        hi = min(lo + vb, V)
        w_b, dz_b = weight[lo:hi], dz[:, :hi - lo]
        linear_ce_dlogits(rows, w_b, idx, lse, scale, target_coef, shift, softcap=opts.softcap, col_offset=lo,
                          out=dz_b)
        if need_dw:
            matmul_tn(dz_b, rows, out=dw[lo:hi])  # fp32 accumulation over all tokens, one rounding
        if need_dx:
            matmul(dz_b, w_b, weight_layout="kn", out=dx32, accumulate=lo > 0)  # fp32 sum over the blocks
    del dz
    dx = _reduce_d_hidden(dx32, hidden, t, sequence_parallel) if need_dx else None
    return dx, dw
