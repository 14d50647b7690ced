"""Tensor-parallel GEMMs with the communication overlapped chunk by chunk, forward and backward.

Four functional ops (each a ``torch.autograd.Function`` over ``fusedpar.kernels.matmul``) and
the feature-dim gather / scatter of the tensor-parallel layers:

* :func:`all_gather_matmul` -- ``act(all_gather(x, gather_dim) @ W^T + b)`` (column parallel with
  sequence parallelism). Ring schedule: the local chunk is multiplied first while chunk ``i+1``
  travels; every chunk is written by the GEMM in place into its rows of the output.
* :func:`matmul_reduce_scatter` -- ``reduce_scatter(x @ W^T, scatter_dim) + b`` (row parallel with
  sequence parallelism). Ring schedule: at each step the GEMM adds the partial received from the
  left neighbour in its epilogue (fp32 accumulation) and the sum travels on to the right.
* :func:`matmul_all_reduce` -- ``all_reduce(x @ W^T) + b`` (row parallel without sequence
  parallelism): rows in chunks, chunk ``i`` is all-reduced while chunk ``i + 1`` is multiplied.
* :func:`copy_to_tp_matmul` -- column parallel on a replicated input; the input gradient is
  all-reduced like :func:`matmul_all_reduce`.
* :func:`gather_features` / :func:`scatter_features` -- all-gather / keep this rank's slice of
  the last dim (``gather_output`` / ``input_is_parallel=False``; not on the hot path).

Per op, the forward and the backward are named functions (``all_gather_matmul_fwd`` /
``all_gather_matmul_bwd``, ...) that the thin autograd Function calls; the static options travel
in one :class:`TPOptions`. Backward passes are overlapped the same way: the data gradient of an
all-gather GEMM is a reduce-scatter GEMM (``weight_layout="kn"``, no transposed weight copy) and
vice versa; weight gradients are accumulated per chunk with ``matmul_tn`` in fp32 straight from
strided chunk views.

Every transfer goes through a :class:`~fusedpar.ops.transport.Transport` (the schedules of
:mod:`fusedpar.ops.tp_schedules`); on a transport with in-kernel waits (symmetric memory) the
GEMMs are the persistent ones of :mod:`fusedpar.ops.symmetric`. Every input check runs before the
first transfer, so bad input raises the same error on every rank instead of leaving peers waiting.

On an :class:`~fusedpar.ops.transport.EmulatedTransport` of size ``P`` (every peer mirrors this
rank) the ops compute: ``all_gather_matmul`` -- the op over ``P`` copies of ``x``, gradients as
autograd of that; ``matmul_reduce_scatter`` -- ``sum over chunks c of x_c @ W^T + b``, backward
from ``P`` copies of the output gradient (``dx_c = g @ W``, ``dW = sum_c g^T x_c``, ``db = P *
sum(g)``); ``matmul_all_reduce`` -- ``P * (x @ W^T + b [rank 0 only])``, local backward;
``copy_to_tp_matmul`` -- local forward, ``dx`` ``P`` times the local one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.kernels import chunk_view, matmul
from fusedpar.kernels.checks import (
    check_bool,
    check_choice,
    check_divisible,
    check_dtype,
    check_int,
    check_same,
    check_shape,
    check_tensor,
)
from fusedpar.kernels.runtime import ACTIVATIONS
from fusedpar.ops import symmetric
from fusedpar.ops.agreement import agreed_arguments
from fusedpar.ops.tp_schedules import (
    check_linear_args,
    WeightGrad,
    activation_backward,
    chunked_matmul_all_reduce,
    ring_gather,
    ring_reduce_scatter,
    sum_tokens,
)
from fusedpar.ops.transport import Transport, get_transport

__all__ = [
    "TPOptions", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "copy_to_tp_matmul",
    "all_gather_matmul_fwd", "all_gather_matmul_bwd", "matmul_reduce_scatter_fwd", "matmul_reduce_scatter_bwd",
    "matmul_all_reduce_fwd", "matmul_all_reduce_bwd", "copy_to_tp_matmul_fwd", "copy_to_tp_matmul_bwd",
    "gather_features", "scatter_features",
]


@dataclass(frozen=True)
class TPOptions:
    """The static options of one tensor-parallel GEMM call (everything but the tensors).

    transport: the resolved :class:`Transport`. dim: the (normalised) gather / scatter token dim.
    partial_dtype: what travels in reductions (the reduce-scatter partials; the all-reduce dtype).
    num_chunks: row chunks of the all-reduce ops. save_gathered_input / return_gathered: see
    :func:`all_gather_matmul`.
    """

    transport: Transport
    dim: int = 1
    activation: str = "none"
    partial_dtype: torch.dtype = torch.float32
    num_chunks: int = 1
    save_gathered_input: bool = True
    return_gathered: bool = False


# ----------------------------------------------------------------------------------------------
# validation (local only: runs before any communication)
# ----------------------------------------------------------------------------------------------
def _token_dim(op, name, dim, x):
    """Normalise a gather/scatter dim: one of x's token dims (not the feature dim)."""
    check_int(f"{op}: {name}", dim)
    nd = x.dim()
    d = dim + nd if dim < 0 else dim
    if not 0 <= d < nd - 1:
        raise ValueError(f"{op}: {name} must be a token dim of x (0..{nd - 2} for shape {tuple(x.shape)}), "
                         f"got {dim}")
    return d


def _partial_dtype(op, name, dtype, x):
    if dtype is None:
        return x.dtype
    check_dtype(f"{op}: {name}", dtype, dict.fromkeys((torch.float32, x.dtype)))
    return dtype


def _n_out(weight, activation):
    return weight.shape[0] // 2 if ACTIVATIONS[activation][1] else weight.shape[0]


# ----------------------------------------------------------------------------------------------
# all_gather_matmul
# ----------------------------------------------------------------------------------------------
def all_gather_matmul_fwd(x, weight, bias, opts: TPOptions, *, keep_preact=False, keep_chunks=False):
    """Forward of :func:`all_gather_matmul`; returns ``(out, preact, chunks)``.

    ``preact``: chunk-major ``[P, *x.shape[:-1], weight.shape[0]]`` pre-activation (only with
    ``keep_preact`` and an activation; else None). ``chunks``: every rank's ``x`` by source rank
    (only with ``keep_chunks``; else None).
    """
    t, d = opts.transport, opts.dim
    P, n, n_w = t.size, x.shape[opts.dim], weight.shape[0]
    out_shape = list(x.shape[:-1]) + [_n_out(weight, opts.activation)]
    out_shape[d] *= P
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    preact = None
    if keep_preact and opts.activation != "none":
        # chunk-major: each chunk's slot is a plain 2-D [rows, n_w] block
        preact = torch.empty((P,) + tuple(x.shape[:-1]) + (n_w,), dtype=x.dtype, device=x.device)
    if t.in_kernel_waits:
        # one persistent GEMM waiting per chunk on copy-engine pulls from symmetric memory
        gathered = torch.empty((P,) + tuple(x.shape), dtype=x.dtype, device=x.device) if keep_chunks else None
        symmetric.all_gather_matmul_symmetric(x, weight, bias, transport=t, gather_dim=d,
                                              activation=opts.activation, out=out, preact_out=preact,
                                              gathered_out=gathered, agree=False)
        return out, preact, (list(gathered.unbind(0)) if keep_chunks else None)
    chunks = [None] * P if keep_chunks else None
    for src, chunk in ring_gather(x, t, keep=keep_chunks):
        matmul(chunk, weight, bias, activation=opts.activation, out=out.narrow(d, src * n, n),
               preact_out=None if preact is None else preact[src].view(-1, n_w))
        if keep_chunks:
            chunks[src] = chunk
    return out, preact, chunks


def all_gather_matmul_bwd(grad_out, x, weight, preact, chunks, opts: TPOptions, *, need_dx=True, need_dw=True,
                          need_db=False):
    """Backward of :func:`all_gather_matmul`; returns ``(dx, dW, db)`` (None where not needed).

    The data gradient is a reduce-scatter GEMM of the (activation-backward) output gradient; the
    weight gradient is accumulated per chunk between its steps, from ``chunks`` (the kept
    gathered input) or, when ``chunks`` is None, from a ring re-gather of ``x``.
    """
    t, d = opts.transport, opts.dim
    P = t.size
    lead = list(grad_out.shape[:-1])
    lead[d] //= P
    lead = tuple(lead)
    n = lead[d]
    dpre = None
    if preact is not None:
        dpre = torch.empty((P,) + lead + (weight.shape[0],), dtype=grad_out.dtype, device=grad_out.device)
        for c in range(P):
            dpre[c] = activation_backward(preact[c], grad_out.narrow(d, c * n, n), opts.activation)

    def a_chunk(c):
        return dpre[c] if dpre is not None else grad_out.narrow(d, c * n, n)

    dw = WeightGrad(weight) if need_dw else None
    sources = None
    if need_dw:  # the gathered input in the order the schedule visits it: own chunk first
        sources = (ring_gather(x, t) if chunks is None else
                   (((t.rank - j) % P, chunks[(t.rank - j) % P]) for j in range(P)))

    def between(j):
        if sources is not None:
            c, xc = next(sources)
            dw.add(a_chunk(c), xc)

    dx = None
    if need_dx:
        dx = torch.empty(lead + (weight.shape[1],), dtype=grad_out.dtype, device=grad_out.device)
    if need_dx and not t.in_kernel_waits:
        ring_reduce_scatter(a_chunk, weight, "kn", None, dx, t, opts.partial_dtype, between)
    else:
        if need_dx:  # the persistent reduce-scatter GEMM (weight.t() is a strided view, no copy)
            a = dpre if dpre is not None else chunk_view(grad_out, d, P)
            symmetric.matmul_reduce_scatter_symmetric(a, weight.t(), transport=t, partial_dtype=opts.partial_dtype,
                                                      out=dx, chunked=True, agree=False)
        for j in range(P):  # the weight gradient after it
            between(j)
    for _ in sources or ():  # exhausted already: closes the re-gather
        pass
    db = sum_tokens(dpre if dpre is not None else grad_out).to(weight.dtype) if need_db else None
    return dx, (dw.result() if need_dw else None), db


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts, grad_enabled):
        # nothing is kept for a backward that cannot happen (inference under no_grad)
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        need_grad = grad_enabled and any(ctx.needs_input_grad[:3])
        keep = opts.return_gathered or (opts.save_gathered_input and need_dw)
        out, preact, chunks = all_gather_matmul_fwd(x, weight, bias, opts, keep_preact=need_grad, keep_chunks=keep)
        ctx.opts, ctx.kept, ctx.has_bias = opts, keep and need_dw, bias is not None
        ctx.save_for_backward(None if ctx.kept else x, weight, preact, *(chunks if ctx.kept else []))
        if not opts.return_gathered:
            return out
        gathered = torch.cat(chunks, dim=opts.dim)  # a copy made only on request
        ctx.mark_non_differentiable(gathered)
        return out, gathered

    @staticmethod
    def backward(ctx, grad_out, *unused):
        x, weight, preact, *chunks = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = all_gather_matmul_bwd(grad_out, x, weight, preact, chunks if ctx.kept else None, ctx.opts,
                                           need_dx=need_dx, need_dw=need_dw, need_db=need_db and ctx.has_bias)
        return dx, dw, db, None, None


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    gather_dim: int = 1,
    activation: str = "none",
    save_gathered_input: bool = True,
    return_gathered: bool = False,
    partial_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
):
    """``act(all_gather(x, gather_dim) @ weight.T + bias)`` with the gather overlapped with the GEMM.

    x:        this rank's shard, ``[batch, seq/tp, in]`` (``gather_dim=1``) or ``[batch/tp, seq, in]``
              / ``[tokens/tp, in]`` (``gather_dim=0``). Every rank's shard has the same shape.
    weight:   this rank's ``[out_shard, in]`` rows (``[2F_shard, in]``, gate rows then up rows, for
              gated activations).
    activation: fused into the GEMM epilogue (``"swiglu"`` etc.); the pre-activation is kept for
              the backward only when a gradient is needed.
    save_gathered_input: keep the gathered input for the weight gradient (default). ``False``
              saves only the local shard and re-gathers it in the backward, overlapped with the
              data-gradient GEMMs (less memory, one more all-gather of ``x``).
    return_gathered: also return ``all_gather(x, gather_dim)`` (non-differentiable; assembled by a
              copy, only when asked).
    partial_dtype: dtype of the partial sums that travel in the backward reduce-scatter
              (fp32 by default; ``None`` or ``x.dtype`` halves the traffic, the sums still
              accumulate in fp32 inside each GEMM).
    transport: a :class:`Transport` instance (then ``group`` must be None), or a name:
              ``"portable"`` (the ring over torch.distributed, any backend), ``"symmetric"`` (one
              persistent GEMM waiting per chunk on copy-engine pulls from symmetric memory; one
              NVLink domain, NCCL), ``"auto"`` (symmetric where it can run, the same choice on
              every rank), or ``None`` (the default of :mod:`fusedpar.ops.symmetric`). All give
              the same numbers.
    Returns ``[batch, seq, out_shard]`` (gather_dim 1), i.e. the gather dim grows ``tp`` times.
    """
    op = "all_gather_matmul"
    with agreed_arguments(op, transport, group, dict(
            x=x, weight=weight, bias=bias, gather_dim=gather_dim, activation=activation, partial_dtype=partial_dtype,
            save_gathered_input=save_gathered_input, return_gathered=return_gathered, transport=transport)):
        check_linear_args(op, x, weight, bias, activation)
        dim = _token_dim(op, "gather_dim", gather_dim, x)
        partial_dtype = _partial_dtype(op, "partial_dtype", partial_dtype, x)
        check_bool(f"{op}: save_gathered_input", save_gathered_input)
        check_bool(f"{op}: return_gathered", return_gathered)
    t = symmetric.resolve_transport(transport, x, group)
    opts = TPOptions(t, dim, activation, partial_dtype, save_gathered_input=save_gathered_input,
                     return_gathered=return_gathered)
    return _AllGatherMatmul.apply(x, weight, bias, opts, torch.is_grad_enabled())


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter
# ----------------------------------------------------------------------------------------------
def matmul_reduce_scatter_fwd(x, weight, bias, opts: TPOptions):
    """Forward of :func:`matmul_reduce_scatter`: this rank's chunk of the reduced output."""
    t, d = opts.transport, opts.dim
    n = x.shape[d] // t.size
    out_shape = list(x.shape[:-1]) + [weight.shape[0]]
    out_shape[d] = n
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if t.in_kernel_waits:
        symmetric.matmul_reduce_scatter_symmetric(x, weight, bias, transport=t, scatter_dim=d,
                                                  partial_dtype=opts.partial_dtype, out=out, agree=False)
    else:
        ring_reduce_scatter(lambda c: x.narrow(d, c * n, n), weight, "nk", bias, out, t, opts.partial_dtype)
    return out


def matmul_reduce_scatter_bwd(grad_out, x, weight, opts: TPOptions, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`matmul_reduce_scatter`; returns ``(dx, dW, db)``.

    The output gradient is all-gathered chunk by chunk into the data-gradient GEMM (an all-gather
    GEMM) and the weight and bias gradients; every rank sums every chunk, so ``db`` is the full one.
    """
    t, d = opts.transport, opts.dim
    n = grad_out.shape[d]
    dx = torch.empty_like(x) if need_dx else None
    dw = WeightGrad(weight) if need_dw else None
    db32 = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_db else None
    dgrad_done = False
    if t.in_kernel_waits and need_dx:
        # the persistent all-gather GEMM (weight.t() is a strided view, no copy); the gathered
        # gradient it keeps feeds the weight and bias gradients
        keep = need_dw or need_db
        gathered = (torch.empty((t.size,) + tuple(grad_out.shape), dtype=grad_out.dtype, device=grad_out.device)
                    if keep else None)
        symmetric.all_gather_matmul_symmetric(grad_out, weight.t(), transport=t, gather_dim=d, out=dx,
                                              gathered_out=gathered, agree=False)
        chunks = enumerate(gathered.unbind(0)) if keep else iter(())
        dgrad_done = True
    else:
        chunks = ring_gather(grad_out, t)
    for src, g in chunks:
        if need_dx and not dgrad_done:
            matmul(g, weight, weight_layout="kn", out=dx.narrow(d, src * n, n))
        if need_dw:
            dw.add(g, x.narrow(d, src * n, n))
        if need_db:
            db32 += sum_tokens(g)
    return dx, (dw.result() if need_dw else None), (db32.to(weight.dtype) if need_db else None)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts):
        ctx.opts, ctx.has_bias = opts, bias is not None
        ctx.save_for_backward(x, weight)
        return matmul_reduce_scatter_fwd(x, weight, bias, opts)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = matmul_reduce_scatter_bwd(grad_out, x, weight, ctx.opts, need_dx=need_dx, need_dw=need_dw,
                                               need_db=need_db and ctx.has_bias)
        return dx, dw, db, None


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    scatter_dim: int = 1,
    partial_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
):
    """``reduce_scatter(x @ weight.T, scatter_dim) + bias`` with the reduction fused into the GEMMs.

    x:      ``[batch, seq, in_shard]`` (or ``[tokens, in_shard]`` with ``scatter_dim=0``); the
            scatter dim must be divisible by the group size.
    weight: this rank's ``[out, in_shard]`` columns; bias ``[out]`` (replicated, added once).
    partial_dtype: what travels between ranks. fp32 (default) keeps the sum as exact as a
            single-process fp32-accumulated GEMM; ``None``/``x.dtype`` halves the traffic for
            fp16/bf16 and rounds each partial once per hop (accumulation stays fp32 in the epilogue).
    transport: as in :func:`all_gather_matmul`; ``"symmetric"`` runs one persistent GEMM that
            releases per-chunk counters while a small reduction kernel pulls the peers' partials
            (of ``partial_dtype``) over NVLink and sums them in fp32.
    Returns ``[batch, seq/tp, out]``. The bias gradient is the full one on every rank.
    """
    op = "matmul_reduce_scatter"
    with agreed_arguments(op, transport, group, dict(x=x, weight=weight, bias=bias, scatter_dim=scatter_dim,
                                                     partial_dtype=partial_dtype, transport=transport)):
        check_linear_args(op, x, weight, bias)
        dim = _token_dim(op, "scatter_dim", scatter_dim, x)
        partial_dtype = _partial_dtype(op, "partial_dtype", partial_dtype, x)
    t = symmetric.resolve_transport(transport, x, group)
    check_divisible(f"{op}: x.shape[{dim}]", x.shape[dim], t.size)
    return _MatmulReduceScatter.apply(x, weight, bias, TPOptions(t, dim, partial_dtype=partial_dtype))


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce and its mirror for replicated inputs (Megatron "copy to TP region")
# ----------------------------------------------------------------------------------------------
def matmul_all_reduce_fwd(x, weight, bias, opts: TPOptions):
    """Forward of :func:`matmul_all_reduce` (the chunked, overlapped all-reduce)."""
    return chunked_matmul_all_reduce(x, weight, "nk", bias, opts.transport, opts.num_chunks, opts.partial_dtype)


def matmul_all_reduce_bwd(grad_out, x, weight, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`matmul_all_reduce`: no communication (the replicated output's gradient
    is already the full one on every rank); returns ``(dx, dW, db)``."""
    dx = matmul(grad_out, weight, weight_layout="kn") if need_dx else None
    dw = None
    if need_dw:
        dw = WeightGrad(weight)
        dw.add(grad_out, x)
        dw = dw.result()
    db = sum_tokens(grad_out).to(weight.dtype) if need_db else None
    return dx, dw, db


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts):
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return matmul_all_reduce_fwd(x, weight, bias, opts)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = matmul_all_reduce_bwd(grad_out, x, weight, need_dx=need_dx, need_dw=need_dw,
                                           need_db=need_db and ctx.has_bias)
        return dx, dw, db, None


def _reduce_options(op, x, weight, bias, activation, num_chunks, reduce_dtype, transport, group):
    """Checks and options of the two all-reduce ops."""
    with agreed_arguments(op, transport, group, dict(x=x, weight=weight, bias=bias, activation=activation,
                                                     num_chunks=num_chunks, reduce_dtype=reduce_dtype,
                                                     transport=transport)):
        check_linear_args(op, x, weight, bias, activation)
        check_int(f"{op}: num_chunks", num_chunks, min_value=1)
        reduce_dtype = _partial_dtype(op, "reduce_dtype", reduce_dtype, x)
    t = symmetric.resolve_transport(transport, x, group)
    return TPOptions(t, activation=activation, partial_dtype=reduce_dtype, num_chunks=num_chunks)


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    num_chunks: int = 4,
    reduce_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
):
    """``all_reduce(x @ weight.T) + bias`` (row parallel without sequence parallelism).

    x: ``[..., in_shard]``, weight ``[out, in_shard]``, bias ``[out]`` (replicated; added once, by
    rank 0's epilogue). The token rows are split into ``num_chunks`` chunks: chunk ``i`` is
    all-reduced asynchronously while chunk ``i + 1`` is computed. ``reduce_dtype``: dtype of the
    reduction (fp32 default; ``None`` reduces in ``x.dtype``). ``transport``/``group``: as in
    :func:`all_gather_matmul` (the all-reduce uses the transport's ``all_reduce``). Backward: no
    communication (the replicated output's gradient is the full one on every rank).
    """
    opts = _reduce_options("matmul_all_reduce", x, weight, bias, "none", num_chunks, reduce_dtype, transport, group)
    return _MatmulAllReduce.apply(x, weight, bias, opts)


def copy_to_tp_matmul_fwd(x, weight, bias, opts: TPOptions, *, keep_preact=False):
    """Forward of :func:`copy_to_tp_matmul` (local); returns ``(out, preact)``, ``preact`` the
    ``[tokens, weight.shape[0]]`` pre-activation with ``keep_preact`` and an activation, else None."""
    preact = None
    if keep_preact and opts.activation != "none":
        M = int(torch.Size(x.shape[:-1]).numel())
        preact = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)
    return matmul(x, weight, bias, activation=opts.activation, preact_out=preact), preact


def copy_to_tp_matmul_bwd(grad_out, x, weight, preact, opts: TPOptions, *, need_dx=True, need_dw=True,
                          need_db=False):
    """Backward of :func:`copy_to_tp_matmul`; returns ``(dx, dW, db)``. The input was replicated:
    its gradient is the sum of every rank's partial (the chunked, overlapped all-reduce)."""
    g = grad_out
    if preact is not None:
        g = activation_backward(preact, grad_out.reshape(preact.shape[0], -1), opts.activation)
        g = g.view(tuple(x.shape[:-1]) + (weight.shape[0],))
    dx = None
    if need_dx:
        dx = chunked_matmul_all_reduce(g, weight, "kn", None, opts.transport, opts.num_chunks, opts.partial_dtype)
    _, dw, db = matmul_all_reduce_bwd(g, x, weight, need_dx=False, need_dw=need_dw, need_db=need_db)
    return dx, dw, db


class _CopyToTPMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, opts, grad_enabled):
        keep = grad_enabled and any(ctx.needs_input_grad[:3])
        out, preact = copy_to_tp_matmul_fwd(x, weight, bias, opts, keep_preact=keep)
        ctx.opts, ctx.has_bias = opts, bias is not None
        ctx.save_for_backward(x, weight, preact)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, preact = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = copy_to_tp_matmul_bwd(grad_out, x, weight, preact, ctx.opts, need_dx=need_dx,
                                           need_dw=need_dw, need_db=need_db and ctx.has_bias)
        return dx, dw, db, None, None


def copy_to_tp_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    activation: str = "none",
    num_chunks: int = 4,
    reduce_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
):
    """Column-parallel GEMM on a replicated input: ``act(x @ weight.T + bias)`` locally; in the
    backward the input gradient (a partial sum per rank) is all-reduced, chunked and overlapped
    like :func:`matmul_all_reduce` (Megatron's "copy to tensor-parallel region")."""
    opts = _reduce_options("copy_to_tp_matmul", x, weight, bias, activation, num_chunks, reduce_dtype, transport,
                           group)
    return _CopyToTPMatmul.apply(x, weight, bias, opts, torch.is_grad_enabled())


# ----------------------------------------------------------------------------------------------
# feature-dim gather / scatter (gather_output, input_is_parallel=False): not on the hot path
# ----------------------------------------------------------------------------------------------
def _all_gather_last_dim(t, transport):
    P = transport.size
    t = t.contiguous()
    flat = torch.empty((P * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    transport.all_gather_into(flat, t).wait()
    buf = flat.view((P,) + tuple(t.shape))
    return buf.movedim(0, -2).reshape(tuple(t.shape[:-1]) + (P * t.shape[-1],))


class _GatherFeatures(torch.autograd.Function):
    """All-gather the last dim; backward keeps this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, t, transport):
        ctx.transport, ctx.n = transport, t.shape[-1]
        return _all_gather_last_dim(t, transport)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.transport.rank
        return grad.narrow(-1, r * ctx.n, ctx.n).contiguous(), None


class _ScatterFeatures(torch.autograd.Function):
    """Keep this rank's slice of the last dim of a replicated tensor; backward all-gathers."""

    @staticmethod
    def forward(ctx, t, transport):
        n = t.shape[-1] // transport.size
        ctx.transport = transport
        return t.narrow(-1, transport.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad, ctx.transport), None


def gather_features(t: torch.Tensor, group=None, *, transport: Transport | str | None = None) -> torch.Tensor:
    """All-gather the last (feature) dim over the group: ``[..., n]`` -> ``[..., P * n]`` in rank
    order. Backward: this rank's slice of the (replicated) gradient. A group of one returns ``t``."""
    with agreed_arguments("gather_features", transport, group, dict(t=t, transport=transport)):
        check_tensor("gather_features: t", t)
    tr = get_transport(transport, group)
    return t if tr.size == 1 else _GatherFeatures.apply(t, tr)


def scatter_features(t: torch.Tensor, group=None, *, transport: Transport | str | None = None) -> torch.Tensor:
    """This rank's slice of the last (feature) dim of a replicated ``t``: ``[..., P * n]`` ->
    ``[..., n]``. Backward: all-gathers the gradient. A group of one returns ``t``."""
    with agreed_arguments("scatter_features", transport, group, dict(t=t, transport=transport)):
        check_tensor("scatter_features: t", t)
    tr = get_transport(transport, group)
    if tr.size == 1:
        return t
    check_divisible("scatter_features: t.shape[-1]", t.shape[-1], tr.size)
    return _ScatterFeatures.apply(t, tr)
