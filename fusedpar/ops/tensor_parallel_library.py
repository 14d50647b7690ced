"""The custom ops of the tensor-parallel GEMMs of :mod:`fusedpar.ops.tensor_parallel` (see
:mod:`fusedpar.ops.library`).

Per op, a forward and a backward are named functions (``all_gather_matmul_fwd`` /
``all_gather_matmul_bwd``, ...) over the schedules of :mod:`fusedpar.ops.tensor_parallel_schedules`
(or the persistent GEMMs of :mod:`fusedpar.ops.symmetric` on a transport with in-kernel waits);
the static options travel in one :class:`TPOptions`. Each pair is the body of two custom ops
(bound to ``<op>_op`` / ``<op>_backward_op``, e.g. :data:`all_gather_matmul_op`; the op resolves
the transport token and the absent placeholders and calls the body) with fake (meta)
implementations, tied together by ``register_autograd``:

* ``fusedpar::all_gather_matmul(x, weight, bias, token, dim, activation, partial_dtype,
  keep_preact, keep_gathered, save_gathered) -> (out, preact, gathered)``: ``preact`` the
  chunk-major ``[P, *x.shape[:-1], weight.shape[0]]`` pre-activation (``keep_preact`` and an
  activation), ``gathered`` every rank's ``x`` by source rank, ``[P, *x.shape]``
  (``keep_gathered``; saved for the weight gradient when ``save_gathered``, else ``x`` is saved
  and re-gathered in the backward); absent outputs are :func:`~fusedpar.ops.library.absent`.
* ``fusedpar::matmul_reduce_scatter(x, weight, bias, token, dim, partial_dtype) -> out``.
* ``fusedpar::matmul_all_reduce(x, weight, bias, token, num_chunks, reduce_dtype) -> out``.
* ``fusedpar::copy_to_tp_matmul(x, weight, bias, token, activation, num_chunks, reduce_dtype,
  keep_preact) -> (out, preact)``.
* ``fusedpar::gather_features(t, token)`` / ``fusedpar::scatter_features(t, token)``: each the
  other's backward.
* ``fusedpar::all_gather_tokens(t, token, dim)``: every rank's ``t`` concatenated along the token
  dim ``dim``; its backward ``fusedpar::all_gather_tokens_backward`` reduce-scatters the gradient
  (summed in fp32), each rank's being its own (MLA's shared rotary key).

Backward ops (``fusedpar::<op>_backward``) take the ``need_dx`` / ``need_dw`` / ``need_db`` flags
of the registered backward (``ctx.needs_input_grad``) and return absent tensors for the rest.
``token`` names the transport (:func:`~fusedpar.ops.library.transport_token`); the op body
resolves it (a Transport instance, or a name over a process group: ``symmetric.resolve_transport``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.kernels import chunk_view, matmul
from fusedpar.kernels.gemm import linear_operands, matmul_checked
from fusedpar.kernels.runtime import activation_features
from fusedpar.ops import symmetric
from fusedpar.ops.library import absent, custom_op, hold, input_grads, resolve_token, token_size
from fusedpar.ops.tensor_parallel_schedules import (
    WeightGrad,
    activation_backward,
    chunked_matmul_all_reduce,
    ring_gather,
    ring_reduce_scatter,
    sum_tokens,
)
from fusedpar.ops.transport import Transport, token_transport

__all__ = [
    "TPOptions", "all_gather_matmul_fwd", "all_gather_matmul_bwd", "matmul_reduce_scatter_fwd",
    "matmul_reduce_scatter_bwd", "matmul_all_reduce_fwd", "matmul_all_reduce_bwd", "copy_to_tp_matmul_fwd",
    "copy_to_tp_matmul_bwd", "all_gather_last_dim", "tp_transport",
    "all_gather_matmul_op", "all_gather_matmul_backward_op", "matmul_reduce_scatter_op",
    "matmul_reduce_scatter_backward_op", "matmul_all_reduce_op", "matmul_all_reduce_backward_op",
    "copy_to_tp_matmul_op", "copy_to_tp_matmul_backward_op", "gather_features_op", "scatter_features_op",
    "all_gather_tokens_op", "all_gather_tokens_backward_op",
]

Tensor = torch.Tensor


@dataclass(frozen=True)
class TPOptions:
    """The static options of one tensor-parallel GEMM call (everything but the tensors).

    transport: the resolved :class:`Transport`. dim: the (normalised) gather / scatter token dim.
    partial_dtype: what travels in reductions (the reduce-scatter partials; the all-reduce dtype).
    num_chunks: row chunks of the all-reduce ops.
    """

    transport: Transport
    dim: int = 1
    activation: str = "none"
    partial_dtype: torch.dtype = torch.float32
    num_chunks: int = 1


def tp_transport(token: str, x: torch.Tensor):
    """The transport a tensor-parallel op runs on: the token's registered instance, or the named
    one over the token's group (``symmetric.resolve_transport``: symmetric where it can run)."""
    transport, group = resolve_token(token)
    return symmetric.resolve_transport(transport, x, group)


def _or_absent(t, like):
    return absent(like) if t is None else t


def _grads_fake(like_dx, weight, need_dx, need_dw, need_db, n_db=None):
    """Fake ``(dx, dW, db)``: ``like_dx``'s shape in its dtype, the weight's, ``[n_db]`` rows."""
    dx = torch.empty_like(like_dx) if need_dx else absent(weight)
    dw = weight.new_empty(weight.shape) if need_dw else absent(weight)
    db = weight.new_empty((weight.shape[0] if n_db is None else n_db,)) if need_db else absent(weight)
    return dx, dw, db


def _grads_out(dx, dw, db, like):
    return _or_absent(dx, like), _or_absent(dw, like), _or_absent(db, like)


def _input_grads(op, ctx, dx=None, dw=None, db=None):
    """What the registered backward of a GEMM op returns: ``(dx, dW, db)`` for ``x``, ``weight``
    and ``bias`` where the forward's inputs need them, ``None`` for every other argument."""
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    return input_grads(op, x=dx if need_dx else None, weight=dw if need_dw else None, bias=db if need_db else None)


# ----------------------------------------------------------------------------------------------
# all_gather_matmul
# ----------------------------------------------------------------------------------------------
def all_gather_matmul_fwd(x, weight, bias, opts: TPOptions, *, keep_preact=False, keep_gathered=False):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.all_gather_matmul`; returns ``(out,
    preact, gathered)``: ``preact`` the chunk-major ``[P, *x.shape[:-1], weight.shape[0]]``
    pre-activation (only with ``keep_preact`` and an activation; else None), ``gathered`` every
    rank's ``x`` by source rank, ``[P, *x.shape]`` (only with ``keep_gathered``; else None)."""
    t, d = opts.transport, opts.dim
    P, n, n_w = t.size, x.shape[opts.dim], weight.shape[0]
    out_shape = list(x.shape[:-1]) + [activation_features(weight.shape[0], opts.activation)]
    out_shape[d] *= P
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    preact = None
    if keep_preact and opts.activation != "none":
        # chunk-major: each chunk's slot is a plain 2-D [rows, n_w] block
        preact = torch.empty((P,) + tuple(x.shape[:-1]) + (n_w,), dtype=x.dtype, device=x.device)
    gathered = torch.empty((P,) + tuple(x.shape), dtype=x.dtype, device=x.device) if keep_gathered else None
    if t.in_kernel_waits:
        # one persistent GEMM waiting per chunk on copy-engine pulls from symmetric memory
        symmetric.all_gather_matmul_symmetric(x, weight, bias, transport=t, gather_dim=d,
                                              activation=opts.activation, out=out, preact_out=preact,
                                              gathered_out=gathered, agree=False)
        return out, preact, gathered
    ops = linear_operands(x, weight, bias, activation=opts.activation)  # every chunk: x's dtype, device and K
    for src, chunk in ring_gather(x, t, into=gathered):
        matmul_checked(chunk, weight, ops, out.narrow(d, src * n, n),
                       preact_out=None if preact is None else preact[src].view(-1, n_w))
    return out, preact, gathered


def all_gather_matmul_bwd(grad_out, x, weight, preact, gathered, opts: TPOptions, *, need_dx=True, need_dw=True,
                          need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.all_gather_matmul`; returns ``(dx, dW,
    db)`` (None where not needed).

    The data gradient is a reduce-scatter GEMM of the (activation-backward) output gradient; the
    weight gradient is accumulated per chunk between its steps, from ``gathered`` (the kept
    gathered input, ``[P, *x.shape]``) or, when it is None, from a ring re-gather of ``x``.
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
        sources = (ring_gather(x, t) if gathered is None else
                   (((t.rank - j) % P, gathered[(t.rank - j) % P]) for j in range(P)))

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


@custom_op("all_gather_matmul")
def all_gather_matmul_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, dim: int, activation: str,
                         partial_dtype: torch.dtype, keep_preact: bool, keep_gathered: bool,
                         save_gathered: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), dim, activation, partial_dtype)
    out, preact, gathered = all_gather_matmul_fwd(x, weight, bias, opts, keep_preact=keep_preact,
                                                  keep_gathered=keep_gathered)
    return out, _or_absent(preact, x), _or_absent(gathered, x)


@all_gather_matmul_op.register_fake
def _(x, weight, bias, token, dim, activation, partial_dtype, keep_preact, keep_gathered, save_gathered):
    P, lead = token_size(token), list(x.shape[:-1])
    out_lead = list(lead)
    out_lead[dim] = out_lead[dim] * P
    out = x.new_empty(out_lead + [activation_features(weight.shape[0], activation)])
    preact = x.new_empty([P] + lead + [weight.shape[0]]) if keep_preact and activation != "none" else absent(x)
    return out, preact, (x.new_empty([P] + list(x.shape)) if keep_gathered else absent(x))


@custom_op("all_gather_matmul_backward")
def all_gather_matmul_backward_op(grad_out: Tensor, x: Tensor | None, gathered: Tensor | None, weight: Tensor,
                                  preact: Tensor | None, token: str, dim: int, activation: str,
                                  partial_dtype: torch.dtype, need_dx: bool, need_dw: bool,
                                  need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    like = x if x is not None else gathered[0]
    opts = TPOptions(tp_transport(token, like), dim, activation, partial_dtype)
    dx, dw, db = all_gather_matmul_bwd(grad_out, x, weight, preact, gathered, opts, need_dx=need_dx, need_dw=need_dw,
                                       need_db=need_db)
    return _grads_out(dx, dw, db, weight)


@all_gather_matmul_backward_op.register_fake
def _(grad_out, x, gathered, weight, preact, token, dim, activation, partial_dtype, need_dx, need_dw, need_db):
    like = x if x is not None else gathered[0]
    return _grads_fake(grad_out.new_empty(like.shape), weight, need_dx, need_dw, need_db)


def _ag_setup(ctx, inputs, output):
    x, weight, bias, token, dim, activation, partial_dtype, keep_preact, _, save_gathered = inputs
    _, preact, gathered = output
    ctx.args = (token, dim, activation, partial_dtype)
    ctx.transports = hold(token)
    ctx.has_preact = keep_preact and activation != "none"
    ctx.save_for_backward(None if save_gathered else x, gathered if save_gathered else None, weight,
                          preact if ctx.has_preact else None)


def _ag_backward(ctx, grad_out, grad_preact, grad_gathered):
    x, gathered, weight, preact = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_out is None or not (need_dx or need_dw or need_db):
        return input_grads(all_gather_matmul_op)
    dx, dw, db = all_gather_matmul_backward_op(grad_out, x, gathered, weight, preact, *ctx.args, need_dx, need_dw,
                                               need_db)
    return _input_grads(all_gather_matmul_op, ctx, dx, dw, db)


all_gather_matmul_op.register_autograd(_ag_backward, setup_context=_ag_setup)


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter
# ----------------------------------------------------------------------------------------------
def matmul_reduce_scatter_fwd(x, weight, bias, opts: TPOptions):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.matmul_reduce_scatter`: this rank's chunk
    of the reduced output."""
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
    """Backward of :func:`~fusedpar.ops.tensor_parallel.matmul_reduce_scatter`; returns ``(dx,
    dW, db)``. The output gradient is all-gathered chunk by chunk into the data-gradient GEMM (an
    all-gather GEMM) and the weight and bias gradients; every rank sums every chunk, so ``db`` is
    the full one."""
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
    ops = linear_operands(grad_out, weight, weight_layout="kn") if need_dx and not dgrad_done else None
    for src, g in chunks:
        if need_dx and not dgrad_done:
            matmul_checked(g, weight, ops, dx.narrow(d, src * n, n), weight_layout="kn")
        if need_dw:
            dw.add(g, x.narrow(d, src * n, n))
        if need_db:
            db32 += sum_tokens(g)
    return dx, (dw.result() if need_dw else None), (db32.to(weight.dtype) if need_db else None)


@custom_op("matmul_reduce_scatter")
def matmul_reduce_scatter_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, dim: int,
                             partial_dtype: torch.dtype) -> Tensor:
    return matmul_reduce_scatter_fwd(x, weight, bias, TPOptions(tp_transport(token, x), dim,
                                                                partial_dtype=partial_dtype))


@matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, token, dim, partial_dtype):
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[dim] = shape[dim] // token_size(token)
    return x.new_empty(shape)


@custom_op("matmul_reduce_scatter_backward")
def matmul_reduce_scatter_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, token: str, dim: int,
                                      partial_dtype: torch.dtype, need_dx: bool, need_dw: bool,
                                      need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), dim, partial_dtype=partial_dtype)
    dx, dw, db = matmul_reduce_scatter_bwd(grad_out, x, weight, opts, need_dx=need_dx, need_dw=need_dw,
                                           need_db=need_db)
    return _grads_out(dx, dw, db, weight)


@matmul_reduce_scatter_backward_op.register_fake
def _(grad_out, x, weight, token, dim, partial_dtype, need_dx, need_dw, need_db):
    return _grads_fake(x, weight, need_dx, need_dw, need_db)


def _rs_setup(ctx, inputs, output):
    x, weight, _, token, dim, partial_dtype = inputs
    ctx.args = (token, dim, partial_dtype)
    ctx.transports = hold(token)
    ctx.save_for_backward(x, weight)


def _rs_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = matmul_reduce_scatter_backward_op(grad_out, x, weight, *ctx.args, need_dx, need_dw, need_db)
    return _input_grads(matmul_reduce_scatter_op, ctx, dx, dw, db)


matmul_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_rs_setup)


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce and its mirror for replicated inputs (Megatron "copy to TP region")
# ----------------------------------------------------------------------------------------------
def matmul_all_reduce_fwd(x, weight, bias, opts: TPOptions):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.matmul_all_reduce` (the chunked,
    overlapped all-reduce)."""
    return chunked_matmul_all_reduce(x, weight, "nk", bias, opts.transport, opts.num_chunks, opts.partial_dtype)


def matmul_all_reduce_bwd(grad_out, x, weight, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.matmul_all_reduce`: no communication (the
    replicated output's gradient is already the full one on every rank); returns ``(dx, dW, db)``."""
    dx = matmul(grad_out, weight, weight_layout="kn") if need_dx else None
    dw = None
    if need_dw:
        dw = WeightGrad(weight)
        dw.add(grad_out, x)
        dw = dw.result()
    db = sum_tokens(grad_out).to(weight.dtype) if need_db else None
    return dx, dw, db


@custom_op("matmul_all_reduce")
def matmul_all_reduce_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, num_chunks: int,
                         reduce_dtype: torch.dtype) -> Tensor:
    opts = TPOptions(tp_transport(token, x), partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return matmul_all_reduce_fwd(x, weight, bias, opts)


@matmul_all_reduce_op.register_fake
def _(x, weight, bias, token, num_chunks, reduce_dtype):
    return x.new_empty(list(x.shape[:-1]) + [weight.shape[0]])


@custom_op("matmul_all_reduce_backward")
def matmul_all_reduce_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, need_dx: bool, need_dw: bool,
                                  need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = matmul_all_reduce_bwd(grad_out, x, weight, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    return _grads_out(dx, dw, db, weight)


@matmul_all_reduce_backward_op.register_fake
def _(grad_out, x, weight, need_dx, need_dw, need_db):
    return _grads_fake(grad_out.new_empty(list(grad_out.shape[:-1]) + [weight.shape[1]]), weight, need_dx, need_dw,
                       need_db)


def _ar_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _ar_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = matmul_all_reduce_backward_op(grad_out, x, weight, need_dx, need_dw, need_db)
    return _input_grads(matmul_all_reduce_op, ctx, dx, dw, db)


matmul_all_reduce_op.register_autograd(_ar_backward, setup_context=_ar_setup)


def copy_to_tp_matmul_fwd(x, weight, bias, opts: TPOptions, *, keep_preact=False):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.copy_to_tp_matmul` (local); returns ``(out,
    preact)``, ``preact`` the ``[tokens, weight.shape[0]]`` pre-activation with ``keep_preact``
    and an activation, else None."""
    preact = None
    if keep_preact and opts.activation != "none":
        M = int(torch.Size(x.shape[:-1]).numel())
        preact = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)
    return matmul(x, weight, bias, activation=opts.activation, preact_out=preact), preact


def copy_to_tp_matmul_bwd(grad_out, x, weight, preact, opts: TPOptions, *, need_dx=True, need_dw=True,
                          need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.copy_to_tp_matmul`; returns ``(dx, dW,
    db)``. The input was replicated: its gradient is the sum of every rank's partial (the
    chunked, overlapped all-reduce)."""
    g = grad_out
    if preact is not None:
        g = activation_backward(preact, grad_out.reshape(preact.shape[0], -1), opts.activation)
        g = g.view(tuple(x.shape[:-1]) + (weight.shape[0],))
    dx = None
    if need_dx:
        dx = chunked_matmul_all_reduce(g, weight, "kn", None, opts.transport, opts.num_chunks, opts.partial_dtype)
    _, dw, db = matmul_all_reduce_bwd(g, x, weight, need_dx=False, need_dw=need_dw, need_db=need_db)
    return dx, dw, db


@custom_op("copy_to_tp_matmul")
def copy_to_tp_matmul_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, activation: str, num_chunks: int,
                         reduce_dtype: torch.dtype, keep_preact: bool) -> tuple[Tensor, Tensor]:
    # local: the token, num_chunks and reduce_dtype are the backward's
    opts = TPOptions(None, activation=activation)
    out, preact = copy_to_tp_matmul_fwd(x, weight, bias, opts, keep_preact=keep_preact)
    return out, _or_absent(preact, x)


@copy_to_tp_matmul_op.register_fake
def _(x, weight, bias, token, activation, num_chunks, reduce_dtype, keep_preact):
    lead = list(x.shape[:-1])
    out = x.new_empty(lead + [activation_features(weight.shape[0], activation)])
    rows = 1
    for s in lead:
        rows = rows * s
    return out, (x.new_empty([rows, weight.shape[0]]) if keep_preact and activation != "none" else absent(x))


@custom_op("copy_to_tp_matmul_backward")
def copy_to_tp_matmul_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, preact: Tensor | None, token: str,
                                  activation: str, num_chunks: int, reduce_dtype: torch.dtype, need_dx: bool,
                                  need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), activation=activation, partial_dtype=reduce_dtype,
                     num_chunks=num_chunks)
    dx, dw, db = copy_to_tp_matmul_bwd(grad_out, x, weight, preact, opts, need_dx=need_dx, need_dw=need_dw,
                                       need_db=need_db)
    return _grads_out(dx, dw, db, weight)


@copy_to_tp_matmul_backward_op.register_fake
def _(grad_out, x, weight, preact, token, activation, num_chunks, reduce_dtype, need_dx, need_dw, need_db):
    return _grads_fake(grad_out.new_empty(x.shape), weight, need_dx, need_dw, need_db)


def _cp_setup(ctx, inputs, output):
    x, weight, _, token, activation, num_chunks, reduce_dtype, keep_preact = inputs
    ctx.args = (token, activation, num_chunks, reduce_dtype)
    ctx.transports = hold(token)
    ctx.save_for_backward(x, weight, output[1] if keep_preact and activation != "none" else None)


def _cp_backward(ctx, grad_out, grad_preact):
    x, weight, preact = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_out is None or not (need_dx or need_dw or need_db):
        return input_grads(copy_to_tp_matmul_op)
    dx, dw, db = copy_to_tp_matmul_backward_op(grad_out, x, weight, preact, *ctx.args, need_dx, need_dw, need_db)
    return _input_grads(copy_to_tp_matmul_op, ctx, dx, dw, db)


copy_to_tp_matmul_op.register_autograd(_cp_backward, setup_context=_cp_setup)


# ----------------------------------------------------------------------------------------------
# feature-dim gather / scatter (gather_output, input_is_parallel=False): each the other's backward
# ----------------------------------------------------------------------------------------------
def all_gather_last_dim(t: torch.Tensor, transport: Transport) -> torch.Tensor:
    """Every rank's ``t`` side by side in the last dim, in rank order (a new tensor)."""
    P = transport.size
    t = t.contiguous()
    flat = torch.empty((P * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    transport.all_gather_into(flat, t).wait()
    buf = flat.view((P,) + tuple(t.shape))
    return buf.movedim(0, -2).reshape(tuple(t.shape[:-1]) + (P * t.shape[-1],))


@custom_op("gather_features")
def gather_features_op(t: Tensor, token: str) -> Tensor:
    return all_gather_last_dim(t, token_transport(token))


@gather_features_op.register_fake
def _(t, token):
    return t.new_empty(list(t.shape[:-1]) + [t.shape[-1] * token_size(token)])


@custom_op("scatter_features")
def scatter_features_op(t: Tensor, token: str) -> Tensor:
    tr = token_transport(token)
    n = t.shape[-1] // tr.size
    return t.narrow(-1, tr.rank * n, n).clone(memory_format=torch.contiguous_format)


@scatter_features_op.register_fake
def _(t, token):
    return t.new_empty(list(t.shape[:-1]) + [t.shape[-1] // token_size(token)])


def _token_setup(ctx, inputs, output):
    ctx.token = inputs[1]
    ctx.transports = hold(inputs[1])


def _gather_backward(ctx, grad):
    return input_grads(gather_features_op, t=scatter_features_op(grad, ctx.token))


def _scatter_backward(ctx, grad):
    return input_grads(scatter_features_op, t=gather_features_op(grad, ctx.token))


gather_features_op.register_autograd(_gather_backward, setup_context=_token_setup)
scatter_features_op.register_autograd(_scatter_backward, setup_context=_token_setup)


# ----------------------------------------------------------------------------------------------
# token-dim all-gather with a reduce-scatter backward (a rank's gradient differs per rank)
# ----------------------------------------------------------------------------------------------
@custom_op("all_gather_tokens")
def all_gather_tokens_op(t: Tensor, token: str, dim: int) -> Tensor:
    tr = token_transport(token)
    src = t.movedim(dim, 0).contiguous()
    out = src.new_empty((tr.size * src.shape[0],) + tuple(src.shape[1:]))
    tr.all_gather_into(out, src).wait()
    return out.movedim(0, dim).contiguous()


@all_gather_tokens_op.register_fake
def _(t, token, dim):
    shape = list(t.shape)
    shape[dim] = shape[dim] * token_size(token)
    return t.new_empty(shape)


@custom_op("all_gather_tokens_backward")
def all_gather_tokens_backward_op(grad: Tensor, token: str, dim: int) -> Tensor:
    tr = token_transport(token)
    src = grad.movedim(dim, 0).to(torch.float32).contiguous()
    out = src.new_empty((src.shape[0] // tr.size,) + tuple(src.shape[1:]))
    tr.reduce_scatter_into(out, src).wait()
    return out.to(grad.dtype).movedim(0, dim).contiguous()


@all_gather_tokens_backward_op.register_fake
def _(grad, token, dim):
    shape = list(grad.shape)
    shape[dim] = shape[dim] // token_size(token)
    return grad.new_empty(shape)


def _gather_tokens_setup(ctx, inputs, output):
    ctx.token, ctx.dim = inputs[1], inputs[2]
    ctx.transports = hold(inputs[1])


def _gather_tokens_backward(ctx, grad):
    return input_grads(all_gather_tokens_op, t=all_gather_tokens_backward_op(grad, ctx.token, ctx.dim))


all_gather_tokens_op.register_autograd(_gather_tokens_backward, setup_context=_gather_tokens_setup)
