"""The custom ops of the fused linear + vocabulary-parallel cross entropy of
:mod:`fusedpar.ops.linear_cross_entropy` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::linear_cross_entropy(hidden, weight, targets, token, sequence_parallel, ignore_index,
  label_smoothing, z_loss, softcap, chunk_tokens, check_targets) -> (loss, lse, gathered)``
  (:data:`linear_cross_entropy_op`, body :func:`linear_cross_entropy_fwd`) and
  ``fusedpar::linear_cross_entropy_backward`` (:data:`linear_cross_entropy_backward_op`, body
  :func:`linear_cross_entropy_bwd`).

Tokens are processed ``chunk_tokens`` at a time; a chunk's logits ``[chunk, V/tp]`` live in one
fp32 buffer reused by every chunk, written by fusedpar's GEMM
(:func:`fusedpar.kernels.gemm.matmul`); each chunk leaves three fp32 numbers per token: this
shard's log-sum-exp, the target logit (from the shard that owns the target, zero elsewhere) and the
sum of logits (label smoothing). One all-gather of those ``3 * T`` floats over the tp group after
the chunks combines the shards (log-sum-exp of the log-sum-exps): every rank visits the chunks in
its own order under sequence parallelism (its own block first), so a per-chunk exchange would pair
different tokens; one exchange at the end also never stalls the chunk loop. The backward recomputes each chunk's logits, forms
``dlogits`` in the same buffer and, in the same pass, writes the chunk's rows of ``d_hidden``
(``dlogits @ W``) and accumulates ``d_weight += dlogits^T @ h`` in fp32 (:func:`matmul_tn`).

With ``sequence_parallel`` ``hidden`` is this rank's ``[b, s/tp, H]``; the tokens of the group are
gathered by the ring of :func:`~fusedpar.ops.tensor_parallel_schedules.ring_gather` (the next
rank's block in flight while the current one's chunks run) into ``gathered`` ``[tp, b, s/tp, H]``,
kept for the backward, which reduce-scatters ``d_hidden`` (fp32). Tokens are then in
*block order* (source rank, batch, position); the functional API permutes the targets and the
per-token losses (``T`` elements, no vocabulary dimension). Without it the tokens of ``hidden`` are
the same on every rank of the group and ``d_hidden`` is all-reduced (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.kernels import matmul, matmul_tn
from fusedpar.ops.library import absent, custom_op, hold, input_grads, present, token_size
from fusedpar.ops.loss_library import check_target_range
from fusedpar.ops.tensor_parallel_schedules import ring_gather
from fusedpar.ops.transport import Transport, token_transport

Tensor = torch.Tensor

__all__ = ["LCEOptions", "default_chunk_tokens", "linear_cross_entropy_backward_op", "linear_cross_entropy_bwd",
           "linear_cross_entropy_fwd", "linear_cross_entropy_op"]

#: default chunk buffer: ``chunk_tokens * V/tp`` fp32 elements of at most this many bytes
CHUNK_BYTES = 256 * 2 ** 20
#: a default chunk that holds more tokens than this holds a multiple of it: the chunk's tokens are
#: the rows of the logits and d_hidden GEMMs (whole 128-row tiles) and the contraction of the
#: weight-gradient GEMM ``dz^T h``, whose tile configs need K a multiple of 64 to load full,
#: vectorised, pipelined 64-deep K blocks (a 128k vocabulary fits 523 tokens in the buffer: K = 523
#: left that GEMM, the largest output of the op, four 32-deep tiles with masked, unpipelined loads)
CHUNK_ALIGN = 128


def default_chunk_tokens(tokens: int, local_vocab: int) -> int:
    """Tokens per chunk when the caller gives none: a fp32 logits buffer of at most
    :data:`CHUNK_BYTES` (512 tokens for a 128k vocabulary on one rank), rounded down to a multiple
    of :data:`CHUNK_ALIGN` tokens when it holds more; at least 1, at most ``tokens``."""
    fit = max(1, CHUNK_BYTES // (4 * max(local_vocab, 1)))
    if fit > CHUNK_ALIGN:
        fit -= fit % CHUNK_ALIGN
    return max(1, min(tokens, fit))


@dataclass
class LCEOptions:
    """What every chunk needs: the transport, the loss options, the chunk size and the full vocabulary."""

    transport: Transport
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float  # 0: none
    chunk: int
    vocab: int


def _options(token, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens):
    t = token_transport(token)
    return LCEOptions(t, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens, weight.shape[0] * t.size)


def _targets(targets, opts: LCEOptions, rank: int, n_local: int):
    """``(valid, idx, inside)``: counted tokens, the target's column in this shard, whether it owns it."""
    valid = targets != opts.ignore_index
    lo = rank * n_local
    inside = valid & (targets >= lo) & (targets < lo + n_local)
    idx = torch.where(inside, targets - lo, torch.zeros_like(targets))
    return valid, idx, inside


def _logits(h, weight, buf, softcap):
    """The chunk's (soft-capped) fp32 logits, written into ``buf`` (``[rows, V/tp]``)."""
    z = matmul(h, weight, out=buf[: h.shape[0]])
    if softcap:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _chunk_stats(h, tgt, weight, buf, opts: LCEOptions, out):
    """This shard's ``(log-sum-exp, target logit or 0, sum of logits)`` of one chunk of rows, into
    ``out`` ``[3, rows]`` (fp32)."""
    z = _logits(h, weight, buf, opts.softcap)
    _, idx, inside = _targets(tgt, opts, opts.transport.rank, weight.shape[0])
    torch.logsumexp(z, dim=-1, out=out[0])
    torch.mul(z.gather(1, idx[:, None]).squeeze(1), inside, out=out[1])
    if opts.label_smoothing:
        torch.sum(z, dim=-1, out=out[2])


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


def _chunks(n: int, chunk: int):
    return ((lo, min(lo + chunk, n)) for lo in range(0, n, chunk))


def linear_cross_entropy_fwd(hidden, weight, targets, opts: LCEOptions, sequence_parallel: bool):
    """Forward of :func:`~fusedpar.ops.linear_cross_entropy.linear_cross_entropy`: ``(loss, lse,
    gathered)``, the per-token fp32 loss and log-sum-exp ``[T]`` (block order with
    ``sequence_parallel``; ignored tokens: loss 0) and the gathered input ``[tp, *hidden.shape]``
    (None without ``sequence_parallel``). ``targets``: flat int64 ids ``[T]`` of every token."""
    t, H = opts.transport, hidden.shape[-1]
    T = targets.shape[0]
    stats = torch.zeros((3, T), dtype=torch.float32, device=hidden.device)
    buf = torch.empty((min(opts.chunk, max(T, 1)), weight.shape[0]), dtype=torch.float32, device=hidden.device)
    gathered = None
    if sequence_parallel:
        gathered = torch.empty((t.size,) + tuple(hidden.shape), dtype=hidden.dtype, device=hidden.device)
        blocks = ring_gather(hidden, t, into=gathered)  # the next block in flight while this one's chunks run
    else:
        blocks = iter([(0, hidden)])
    for src, block in blocks:
        rows = block.reshape(-1, H)
        base = src * rows.shape[0]
        for lo, hi in _chunks(rows.shape[0], opts.chunk):
            _chunk_stats(rows[lo:hi], targets[base + lo:base + hi], weight, buf, opts, stats[:, base + lo:base + hi])
    loss, lse = _combine(stats, targets, opts)
    return loss, lse, gathered


def _chunk_dlogits(z, tgt, g, lse, opts: LCEOptions, n_local: int, rank: int):
    """``dloss/dlogits`` of one chunk, in place of its recomputed (capped) logits ``z``: ``g *
    (softmax * (1 + 2 z_loss lse) - (1 - eps) onehot - eps / V)``, times ``1 - tanh^2`` under a
    soft cap."""
    valid, idx, inside = _targets(tgt, opts, rank, n_local)
    g = torch.where(valid, g, torch.zeros_like(g))
    deriv = None
    if opts.softcap:
        deriv = torch.square(z / opts.softcap).neg_().add_(1)  # 1 - tanh^2(raw / c)
    z.sub_(lse[:, None]).exp_().mul_((g * (1 + 2 * opts.z_loss * lse))[:, None])
    eps = opts.label_smoothing
    if eps:
        z.sub_((g * (eps / opts.vocab))[:, None])
    z.scatter_add_(1, idx[:, None], (-(1 - eps) * g * inside)[:, None])
    if deriv is not None:
        z.mul_(deriv)
    return z


def linear_cross_entropy_bwd(grad_loss, hidden, weight, targets, lse, gathered, opts: LCEOptions,
                             sequence_parallel: bool, *, need_dx=True, need_dw=True):
    """Backward of :func:`linear_cross_entropy_fwd`: ``(d_hidden, d_weight)`` (None where not
    needed) in one pass over the chunks, recomputing each chunk's logits; ``d_weight`` accumulated
    in fp32, ``d_hidden`` summed over the group in fp32 (reduce-scattered with
    ``sequence_parallel``, all-reduced otherwise)."""
    t, H = opts.transport, hidden.shape[-1]
    rows = (gathered if sequence_parallel else hidden).reshape(-1, H)
    T = rows.shape[0]
    buf = torch.empty((min(opts.chunk, max(T, 1)), weight.shape[0]), dtype=torch.float32, device=hidden.device)
    dx32 = torch.empty((T, H), dtype=torch.float32, device=hidden.device) if need_dx else None
    dw32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
    z = dz = None
    for lo, hi in _chunks(T, opts.chunk):
        h = rows[lo:hi]
        z = _logits(h, weight, buf, opts.softcap)
        dz = _chunk_dlogits(z, targets[lo:hi], grad_loss[lo:hi].float(), lse[lo:hi], opts, weight.shape[0], t.rank)
        dz = dz if dz.dtype == weight.dtype else dz.to(weight.dtype)  # a chunk-sized copy for bf16 / fp16 GEMMs
        if need_dx:
            matmul(dz, weight, weight_layout="kn", out=dx32[lo:hi])
        if need_dw:
            matmul_tn(dz, h, out=dw32, accumulate=True)
    # the chunk buffers and the fp32 d_hidden are dead before the fp32 -> weight dtype copy of
    # d_weight, the backward's peak (accumulator and copy together): free them first
    del buf, z, dz
    dx = None
    if need_dx:
        if t.size > 1 and sequence_parallel:
            out = torch.empty(hidden.numel(), dtype=torch.float32, device=hidden.device)
            t.reduce_scatter_into(out, dx32.view(-1)).wait()
            dx32, out = out, None
        elif t.size > 1:
            t.all_reduce(dx32).wait()
        dx = dx32.view(hidden.shape).to(hidden.dtype)
    del dx32
    return dx, (dw32.to(weight.dtype) if need_dw else None)


@custom_op("linear_cross_entropy")
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, targets: Tensor, token: str, sequence_parallel: bool,
                            ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
                            chunk_tokens: int, check_targets: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, lse, gathered)`` of :func:`linear_cross_entropy_fwd` (``gathered`` absent without
    ``sequence_parallel``); ``check_targets``: range-check the ids here (under torch.compile)."""
    opts = _options(token, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens)
    if check_targets:
        check_target_range(targets, targets != ignore_index, opts.vocab, ignore_index)
    loss, lse, gathered = linear_cross_entropy_fwd(hidden, weight, targets, opts, sequence_parallel)
    return loss, lse, (absent(hidden) if gathered is None else gathered)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, targets, token, sequence_parallel, ignore_index, label_smoothing, z_loss, softcap,
      chunk_tokens, check_targets):
    T = targets.shape[0]
    gathered = hidden.new_empty((token_size(token),) + tuple(hidden.shape)) if sequence_parallel else absent(hidden)
    return hidden.new_empty((T,), dtype=torch.float32), hidden.new_empty((T,), dtype=torch.float32), gathered


@custom_op("linear_cross_entropy_backward")
def linear_cross_entropy_backward_op(grad_loss: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor, lse: Tensor,
                                     gathered: Tensor, token: str, sequence_parallel: bool, ignore_index: int,
                                     label_smoothing: float, z_loss: float, softcap: float, chunk_tokens: int,
                                     need_dx: bool, need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(d_hidden, d_weight)`` of :func:`linear_cross_entropy_bwd` (absent where not needed)."""
    opts = _options(token, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens)
    dx, dw = linear_cross_entropy_bwd(grad_loss, hidden, weight, targets, lse, present(gathered), opts,
                                      sequence_parallel, need_dx=need_dx, need_dw=need_dw)
    return (absent(hidden) if dx is None else dx), (absent(weight) if dw is None else dw)


@linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, targets, lse, gathered, token, sequence_parallel, ignore_index, label_smoothing,
      z_loss, softcap, chunk_tokens, need_dx, need_dw):
    return (hidden.new_empty(hidden.shape) if need_dx else absent(hidden),
            weight.new_empty(weight.shape) if need_dw else absent(weight))


def _setup(ctx, inputs, output):
    hidden, weight, targets, token, sp, *options, _ = inputs
    ctx.args = (token, sp, *options)
    ctx.transports = hold(token)
    ctx.save_for_backward(hidden, weight, targets, output[1], output[2])


def _backward(ctx, grad_loss, *unused):
    hidden, weight, targets, lse, gathered = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = linear_cross_entropy_backward_op(grad_loss, hidden, weight, targets, lse, gathered, *ctx.args,
                                              need_dx, need_dw)
    return input_grads(linear_cross_entropy_op, hidden=dx if need_dx else None, weight=dw if need_dw else None)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)
