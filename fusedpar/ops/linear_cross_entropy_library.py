"""The custom ops of the fused linear + vocabulary-parallel cross entropy of
:mod:`fusedpar.ops.linear_cross_entropy` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::linear_cross_entropy(hidden, weight, targets, token, sequence_parallel, ignore_index,
  label_smoothing, z_loss, softcap, chunk_tokens, check_targets) -> (loss, lse, gathered)``
  (:data:`linear_cross_entropy_op`, body :func:`linear_cross_entropy_fwd`) and
  ``fusedpar::linear_cross_entropy_backward`` (:data:`linear_cross_entropy_backward_op`, body
  :func:`linear_cross_entropy_bwd`).

The per-element work lives in GEMM epilogues (:mod:`fusedpar.kernels.linear_ce`). Forward: one
launch of the logits GEMM per token block (all tokens; with sequence parallelism one block per
source rank) whose epilogue leaves per-row statistics of each ``[BLOCK_M, 128]`` logits tile (max,
sum of exponentials, target logit, sum of logits); a torch reduction over the tiles gives this
shard's log-sum-exp, so each token leaves three fp32 numbers. One all-gather of those ``3 * T``
floats over the tp group after the blocks combines the shards (log-sum-exp of the log-sum-exps):
every rank visits the blocks in its own order under sequence parallelism (its own block first), so
a per-block exchange would pair different tokens; one exchange at the end also never stalls.

Backward, vocabulary blocks outer: for each block of ``Vb`` rows of the shard the logits GEMM is
recomputed with an epilogue that writes ``dz_b`` ``[T, Vb]`` in the model's dtype
(:func:`~fusedpar.kernels.linear_ce.linear_ce_dlogits`); ``d_weight[b] = dz_b^T h`` is one GEMM
over all tokens (fp32 accumulation inside, written once in the weight's dtype) and ``d_hidden +=
dz_b W_b`` accumulates in an fp32 ``[T, H]`` (the GEMM's accumulate mode). ``chunk_tokens`` sets
the block: ``dz_b`` holds at most the bytes of ``chunk_tokens`` rows of fp32 logits
(:func:`vocab_block`). Nothing ``[T, V/tp]``-sized exists.

With ``sequence_parallel`` ``hidden`` is this rank's ``[b, s/tp, H]``; the tokens of the group are
gathered by the ring of :func:`~fusedpar.ops.tensor_parallel_schedules.ring_gather` (the next
rank's block in flight while the current one's GEMM runs) into ``gathered`` ``[tp, b, s/tp, H]``,
kept for the backward, which reduce-scatters ``d_hidden`` (fp32). Tokens are then in
*block order* (source rank, batch, position); the functional API permutes the targets and the
per-token losses (``T`` elements, no vocabulary dimension). Without it the tokens of ``hidden`` are
the same on every rank of the group and ``d_hidden`` is all-reduced (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.kernels import linear_ce_dlogits, linear_ce_stats, matmul, matmul_tn
from fusedpar.ops.library import absent, custom_op, hold, input_grads, present, token_size
from fusedpar.ops.loss_library import check_target_range
from fusedpar.ops.tensor_parallel_schedules import ring_gather
from fusedpar.ops.transport import Transport, token_transport

Tensor = torch.Tensor

__all__ = ["LCEOptions", "default_chunk_tokens", "linear_cross_entropy_backward_op", "linear_cross_entropy_bwd",
           "linear_cross_entropy_fwd", "linear_cross_entropy_op", "vocab_block"]

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


def _options(token, weight, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens):
    t = token_transport(token)
    return LCEOptions(t, ignore_index, label_smoothing, z_loss, softcap, chunk_tokens, weight.shape[0] * t.size)


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
    """Forward of :func:`~fusedpar.ops.linear_cross_entropy.linear_cross_entropy`: ``(loss, lse,
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
