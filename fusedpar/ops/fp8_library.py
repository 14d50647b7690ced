"""The fp8 custom ops: :func:`fusedpar.ops.fp8.fp8_linear` and the fp8 tensor-parallel GEMMs
(``fp8=`` of :mod:`fusedpar.ops.tensor_parallel`); see :mod:`fusedpar.ops.library`.

* ``fusedpar::fp8_linear(x, weight, bias, recipe, grad_high_precision) -> y``
  (:data:`fp8_linear_op`, body :func:`fp8_linear_fwd`): quantise ``x`` per token (rowwise) or per
  1x128 tile (blockwise) and ``weight`` per output row or per 128x128 block, then the scaled fp8
  GEMM; ``y`` in ``x``'s dtype.
* ``fusedpar::fp8_linear_backward(grad_y, x, weight, recipe, grad_high_precision, need_dx,
  need_dw) -> (dx, dw)`` (:data:`fp8_linear_backward_op`, body :func:`fp8_linear_bwd`): each
  gradient GEMM quantises its operands along its own contraction axis (the transposed scalings of
  the module :mod:`fusedpar.kernels.fp8` writes from a transposed view); ``dw`` in the weight's
  dtype. The bias gradient is a torch sum in the registered backward.

The backward re-quantises the saved high-precision ``x`` and ``weight`` (the weight's 128x128
blocks of the blockwise recipe come out bit-identical to the forward's, transposed): master
weights and what autograd saves stay in their dtype.

The tensor-parallel ops in fp8 (the schedules of :mod:`fusedpar.ops.tensor_parallel_schedules`
with quantised operands, :class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Rows` /
:class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Weight`), each with the quantisation groups of
this rank's shards: activations and gradients per token along this rank's features, the weight per
output row / 128x128 blocks of this rank's block, a weight gradient summed over chunks of tokens,
each chunk's operands quantised along its own tokens:

* ``fusedpar::all_gather_matmul_fp8(x, weight, bias, token, dim, activation, partial_dtype, recipe,
  grad_high_precision, keep_preact, keep_gathered, x_q=None, x_scale=None) -> (out, preact,
  gathered)``: this rank's shard is quantised once (or its quantisation ``(x_q, x_scale)``, made by
  the kernel that produced ``x``, is copied) into a packed byte buffer
  (:class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Pack`: e4m3 + fp32 scales) that the ring
  gathers; with ``keep_gathered`` a second ring in the same steps gathers the weight-gradient
  operand (from ``x``), ``gathered`` its ``[P, bytes]`` packs kept for the backward (half of a kept
  bf16 input). Its backward op
  ``all_gather_matmul_fp8_backward`` runs the reduce-scatter ring of fp8 dgrad GEMMs with the
  chunks' fp8 wgrads between its steps (re-gathering the packed operand when not kept).
* ``fusedpar::matmul_reduce_scatter_fp8(x, weight, bias, token, dim, partial_dtype, recipe,
  grad_high_precision) -> out`` and its backward op (the output gradient gathered as packs).
* ``fusedpar::matmul_all_reduce_fp8(...)``: its backward is local, :data:`fp8_linear_backward_op`.
* ``fusedpar::copy_to_tp_matmul_fp8(...) -> (out, preact)`` and its backward op (the input
  gradient's fp8 partials all-reduced in row chunks).

On a transport with in-kernel waits (symmetric memory) the forward of ``all_gather_matmul_fp8``
without a kept input is the persistent fp8 GEMM of
:func:`~fusedpar.ops.symmetric.all_gather_matmul_symmetric` (the e4m3 shard and its scales in one
slot per peer, the activation and the pre-activation fused in its epilogue); every other fp8
schedule, its backward and a forward that keeps the gathered input included, runs its ring over
the transport's transfers, with the activation as an elementwise pass after the GEMM (the
epilogue of :func:`~fusedpar.kernels.fp8_matmul` fuses none).
"""
from __future__ import annotations

import torch

from fusedpar.kernels import fp8_matmul, matmul_tn, quantize_e4m3
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.runtime import ACTIVATIONS
from fusedpar.ops import symmetric
from fusedpar.ops.library import absent, custom_op, hold, input_grads, present, token_size
from fusedpar.ops.tensor_parallel_library import TPOptions, tp_transport
from fusedpar.ops.tensor_parallel_schedules import (
    Fp8Pack,
    Fp8Rows,
    Fp8Weight,
    Fp8WeightGrad,
    activation_backward,
    activation_forward,
    chunked_matmul_all_reduce,
    ring_gather,
    ring_reduce_scatter,
    sum_tokens,
    token_scaled,
)

__all__ = ["FP8_RECIPES", "fp8_linear_backward_op", "fp8_linear_bwd", "fp8_linear_fwd", "fp8_linear_op",
           "all_gather_matmul_fp8_fwd", "all_gather_matmul_fp8_bwd", "matmul_reduce_scatter_fp8_fwd",
           "matmul_reduce_scatter_fp8_bwd", "matmul_all_reduce_fp8_fwd", "copy_to_tp_matmul_fp8_fwd",
           "copy_to_tp_matmul_fp8_bwd", "all_gather_matmul_fp8_op", "all_gather_matmul_fp8_backward_op",
           "matmul_reduce_scatter_fp8_op", "matmul_reduce_scatter_fp8_backward_op", "matmul_all_reduce_fp8_op",
           "copy_to_tp_matmul_fp8_op", "copy_to_tp_matmul_fp8_backward_op"]

Tensor = torch.Tensor


def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
                   grad_high_precision: bool) -> torch.Tensor:
    """``y = (q(x) * sx) @ (q(W) * sw)^T + bias`` in ``x``'s dtype (``grad_high_precision`` is
    the backward's option)."""
    act, wgt = FP8_RECIPES[recipe]
    N, K = weight.shape
    xq, xs = quantize_e4m3(x.reshape(-1, K), act)
    wq, ws = quantize_e4m3(weight, wgt)
    y = fp8_matmul(xq, xs, wq, ws, bias, scaling=recipe, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], N)


fp8_linear_op = custom_op("fp8_linear")(fp8_linear_fwd)


@fp8_linear_op.register_fake
def _(x, weight, bias, recipe, grad_high_precision):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def fp8_linear_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str,
                   grad_high_precision: bool, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` (each absent unless asked for): ``dx = q(dY) @ q(W)`` with ``dY`` scaled per
    token (1x128 tiles along N) and ``W`` per input column (its 128x128 blocks);
    ``dw = q(dY)^T @ q(x)`` with both scaled along the tokens (per feature, or 128-token tiles),
    or ``dY^T @ x`` in ``x``'s dtype with ``grad_high_precision``."""
    act, wgt = FP8_RECIPES[recipe]
    N, K = weight.shape
    g2 = grad_y.reshape(-1, N)
    x2 = x.reshape(-1, K)
    dx = dw = absent(x)
    if need_dx:
        gq, gs = quantize_e4m3(g2, act)
        wq, ws = quantize_e4m3(weight.t(), wgt)  # [K, N]: scaled along N, the contraction
        dx = fp8_matmul(gq, gs, wq, ws, scaling=recipe, out_dtype=x.dtype).view(x.shape)
    if need_dw:
        if grad_high_precision:
            dw = matmul_tn(g2, x2, out_dtype=weight.dtype)
        else:
            gq, gs = quantize_e4m3(g2.t(), act)  # [N, T]: scaled along the tokens
            xq, xs = quantize_e4m3(x2.t(), act)  # [K, T]
            dw = fp8_matmul(gq, gs, xq, xs, scaling=recipe, out_dtype=weight.dtype)
    return dx, dw


fp8_linear_backward_op = custom_op("fp8_linear_backward")(fp8_linear_bwd)


@fp8_linear_backward_op.register_fake
def _(grad_y, x, weight, recipe, grad_high_precision, need_dx, need_dw):
    return (x.new_empty(x.shape) if need_dx else x.new_empty((0,)),
            weight.new_empty(weight.shape) if need_dw else x.new_empty((0,)))


def _setup(ctx, inputs, output):
    x, weight, bias, recipe, grad_high_precision = inputs
    ctx.recipe, ctx.grad_high_precision = recipe, grad_high_precision
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    dx, dw = fp8_linear_backward_op(grad_y.contiguous(), x, weight, ctx.recipe, ctx.grad_high_precision,
                                    ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    db = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        db = grad_y.reshape(-1, weight.shape[0]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return input_grads(fp8_linear_op, x=present(dx), weight=present(dw), bias=db)


fp8_linear_op.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------------------------
# all_gather_matmul in fp8: the local shard quantised once, gathered as fp8 + scales
# ----------------------------------------------------------------------------------------------
def _wgrad_kind(grad_high_precision: bool) -> str:
    return "hp" if grad_high_precision else "fp8"


def _chunk_lead(shape, d: int, P: int) -> tuple:
    """The leading dims of one rank's chunk of a gathered ``shape`` (``[..., F]``, dim ``d``)."""
    lead = list(shape[:-1])
    lead[d] //= P
    return tuple(lead)


def all_gather_matmul_fp8_fwd(x, weight, bias, opts: TPOptions, recipe: str, grad_high_precision: bool, *,
                              keep_preact=False, keep_gathered=False, x_fp8=None):
    """``act(all_gather(x) @ W^T + b)`` with the GEMMs in fp8: this rank's ``x`` is quantised per
    token once, into the bytes that travel (:class:`Fp8Pack`: e4m3 + scales, about half of bf16's),
    the weight once per call, and each gathered chunk's fp8 GEMM writes its rows of the output
    while the next chunk travels. With ``keep_gathered`` a second ring, in the same steps, gathers
    the weight-gradient operand (``x^T`` scaled along the tokens, or ``x`` with
    ``grad_high_precision``), kept for the backward. Returns ``(out, preact, gathered)``:
    ``preact`` the chunk-major pre-activation (with ``keep_preact`` and an activation),
    ``gathered`` the kept ``[P, pack bytes]``. ``x_fp8``: ``x``'s per-token ``(q, scale)`` made
    already (by the norm that produced ``x``), packed instead of quantising ``x`` again, or on a
    group of one read in place (the weight-gradient operand, scaled along the tokens, still comes
    from ``x``). On a transport with in-kernel waits and without ``keep_gathered``: one persistent
    fp8 GEMM (:func:`_all_gather_matmul_fp8_symmetric`)."""
    t, d, act = opts.transport, opts.dim, opts.activation
    if t.in_kernel_waits and not keep_gathered:
        return _all_gather_matmul_fp8_symmetric(x, weight, bias, opts, recipe, keep_preact, x_fp8)
    P, lead, n_w, K = t.size, tuple(x.shape[:-1]), weight.shape[0], x.shape[-1]
    n = lead[d]
    pack = Fp8Pack.activation(lead, K, x.dtype, recipe, rows=True, wgrad=None)
    if x_fp8 is not None and P == 1:  # nothing travels: the GEMM reads the given pair in place
        chunks, rows = iter([(t.rank, None)]), (lambda _: Fp8Rows(*(v.contiguous() for v in x_fp8), x.dtype))
    else:
        chunks, rows = ring_gather(pack.fill(x.new_empty(pack.nbytes, dtype=torch.uint8), x, x_fp8), t), pack.rows
    gathered = None
    if keep_gathered:  # both rings post their next transfer before a chunk is computed on
        kept = Fp8Pack.activation(lead, K, x.dtype, recipe, rows=False, wgrad=_wgrad_kind(grad_high_precision))
        gathered = x.new_empty((P, kept.nbytes), dtype=torch.uint8)
        chunks = (a for a, _ in zip(chunks, ring_gather(kept.fill(gathered[t.rank], x), t, into=gathered)))
    w8 = Fp8Weight(weight, recipe)
    out_shape = list(lead) + [n_w // 2 if ACTIVATIONS[act][1] else n_w]
    out_shape[d] *= P
    out = x.new_empty(out_shape)
    preact = x.new_empty((P,) + lead + (n_w,)) if keep_preact and act != "none" else None
    for src, buf in chunks:
        dst = out.narrow(d, src * n, n)
        if act == "none":
            w8.gemm(rows(buf), dst, bias)
        else:  # the activation is not fused in the fp8 epilogue: one elementwise pass
            pre = w8.gemm(rows(buf), preact[src] if preact is not None else x.new_empty(lead + (n_w,)), bias)
            activation_forward(pre, act, dst)
    return out, preact, gathered


def _all_gather_matmul_fp8_symmetric(x, weight, bias, opts: TPOptions, recipe: str, keep_preact: bool, x_fp8):
    """:func:`all_gather_matmul_fp8_fwd` over symmetric memory: ``x`` quantised per token once (or
    the given ``x_fp8`` pair) and the weight as the rings do (:class:`Fp8Weight`), then
    :func:`~fusedpar.ops.symmetric.all_gather_matmul_symmetric` with the fp8 operands: each peer's
    e4m3 shard and scales pulled into its slot while the persistent fp8 GEMM computes the chunks
    that have arrived, the activation and the pre-activation written by its epilogue. The same
    chunk GEMMs as the ring's (under the interpreter the same pre-activation bits in fp32 / fp16);
    the activation is the epilogue's, from the fp32 accumulator. Returns ``(out, preact, None)``."""
    t, act = opts.transport, opts.activation
    rows = Fp8Rows.of(x, recipe) if x_fp8 is None else Fp8Rows(*x_fp8, x.dtype)
    w8 = Fp8Weight(weight, recipe)
    preact = None
    if keep_preact and act != "none":
        preact = x.new_empty((t.size,) + tuple(x.shape[:-1]) + (weight.shape[0],))
    out = symmetric.all_gather_matmul_symmetric(rows.q, w8.q, bias, transport=t, gather_dim=opts.dim, activation=act,
                                                preact_out=preact, x_scale=rows.scale, weight_scale=w8.scale,
                                                scaling=recipe, out_dtype=x.dtype, agree=False)
    return out, preact, None


def all_gather_matmul_fp8_bwd(grad_out, x, gathered, weight, preact, opts: TPOptions, recipe: str,
                              grad_high_precision: bool, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`all_gather_matmul_fp8_fwd`; ``(dx, dW, db)``. The data gradient is the
    reduce-scatter ring of fp8 GEMMs (``dpre`` quantised per token once, ``W^T`` per input
    column / its 128x128 blocks), fp32 or ``partial_dtype`` partials travelling; between its steps
    the weight gradient of each chunk, ``q(dpre_c^T) @ q(x_c^T)`` scaled along the chunk's tokens,
    from the kept pack or a re-gather of the packed operand (:class:`Fp8WeightGrad`)."""
    t, d, act = opts.transport, opts.dim, opts.activation
    P, lead = t.size, _chunk_lead(grad_out.shape, opts.dim, opts.transport.size)
    n, n_w = lead[d], weight.shape[0]
    if preact is not None:
        dpre = grad_out.new_empty((P,) + lead + (n_w,))
        for c in range(P):
            dpre[c] = activation_backward(preact[c], grad_out.narrow(d, c * n, n), act)
        g, chunk = dpre, (lambda c: dpre[c])
    else:
        g = grad_out.contiguous()
        chunk = lambda c: g.narrow(d, c * n, n)  # noqa: E731
    between = None
    if need_dw:
        pack = Fp8Pack.activation(lead, weight.shape[1], grad_out.dtype, recipe, rows=False,
                                  wgrad=_wgrad_kind(grad_high_precision))
        sources = (ring_gather(pack.fill(x.new_empty(pack.nbytes, dtype=torch.uint8), x), t) if gathered is None
                   else (((t.rank - j) % P, gathered[(t.rank - j) % P]) for j in range(P)))
        dw = Fp8WeightGrad(weight, recipe, grad_high_precision)

        def between(j):
            c, buf = next(sources)
            gc = chunk(c)
            dw.add(gc if grad_high_precision else token_scaled(gc, recipe), pack.wgrad(buf))
    dx = None
    if need_dx:
        gq = Fp8Rows.of(g, recipe)
        a_chunk = (lambda c: gq[c]) if preact is not None else (lambda c: gq.narrow(d, c * n, n))
        dx = grad_out.new_empty(lead + (weight.shape[1],))
        ring_reduce_scatter(a_chunk, Fp8Weight(weight, recipe, "kn"), "nk", None, dx, t, opts.partial_dtype, between)
    elif between is not None:
        for j in range(P):
            between(j)
    if need_dw:
        for _ in sources:  # exhausted already: closes the re-gather
            pass
    db = sum_tokens(g).to(weight.dtype) if need_db else None
    return dx, (dw.result() if need_dw else None), db


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter in fp8: fp8 operands, bf16 / fp32 partials travel
# ----------------------------------------------------------------------------------------------
def matmul_reduce_scatter_fp8_fwd(x, weight, bias, opts: TPOptions, recipe: str):
    """``reduce_scatter(x @ W^T) + b`` with the partial GEMMs in fp8: ``x`` quantised per token
    (along this rank's in-features) and ``W`` once; the partials (``partial_dtype``) travel and
    are added in the next GEMM's fp32 epilogue, as in the high-precision ring."""
    t, d = opts.transport, opts.dim
    n = x.shape[d] // t.size
    out_shape = list(x.shape[:-1]) + [weight.shape[0]]
    out_shape[d] = n
    out = x.new_empty(out_shape)
    xq = Fp8Rows.of(x, recipe)
    ring_reduce_scatter(lambda c: xq.narrow(d, c * n, n), Fp8Weight(weight, recipe), "nk", bias, out, t,
                        opts.partial_dtype)
    return out


def matmul_reduce_scatter_fp8_bwd(grad_out, x, weight, opts: TPOptions, recipe: str, grad_high_precision: bool, *,
                                  need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`matmul_reduce_scatter_fp8_fwd`; ``(dx, dW, db)``. Each rank packs its
    output gradient once (per-token e4m3 + scales for the data gradient, the token-scaled
    transpose or the tensor for the weight gradient, its fp32 bias-gradient sum) and the ring
    gathers the packs; per chunk the data-gradient fp8 GEMM writes its rows of ``dx`` and the
    weight gradient adds ``q(dY_c^T) @ q(x_c^T)``. ``db``: the gathered sums added in rank order."""
    t, d = opts.transport, opts.dim
    P, n, N = t.size, grad_out.shape[d], weight.shape[0]
    pack = Fp8Pack.activation(tuple(grad_out.shape[:-1]), N, grad_out.dtype, recipe, rows=need_dx,
                              wgrad=_wgrad_kind(grad_high_precision) if need_dw else None, bias_grad=need_db)
    local = pack.fill(grad_out.new_empty(pack.nbytes, dtype=torch.uint8), grad_out)
    dx = torch.empty_like(x) if need_dx else None
    w_t = Fp8Weight(weight, recipe, "kn") if need_dx else None
    dw = Fp8WeightGrad(weight, recipe, grad_high_precision) if need_dw else None
    db = [None] * P
    for src, buf in ring_gather(local, t):
        xc = x.narrow(d, src * n, n)
        if need_dx:
            w_t.gemm(pack.rows(buf), dx.narrow(d, src * n, n))
        if need_dw:
            dw.add(pack.wgrad(buf), xc if grad_high_precision else token_scaled(xc, recipe))
        if need_db:
            db[src] = pack.view(buf, "db").clone()
    db = torch.stack(db).sum(0).to(weight.dtype) if need_db else None
    return dx, (dw.result() if need_dw else None), db


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce and copy_to_tp_matmul in fp8
# ----------------------------------------------------------------------------------------------
def matmul_all_reduce_fp8_fwd(x, weight, bias, opts: TPOptions, recipe: str):
    """``all_reduce(x @ W^T) + b``: the row chunks' fp8 GEMMs (``x`` quantised per token once)
    write ``reduce_dtype`` partials that are all-reduced while the next chunk is multiplied."""
    return chunked_matmul_all_reduce(Fp8Rows.of(x, recipe), Fp8Weight(weight, recipe), "nk", bias, opts.transport,
                                     opts.num_chunks, opts.partial_dtype)


def copy_to_tp_matmul_fp8_fwd(x, weight, bias, recipe: str, activation: str, *, keep_preact=False):
    """``act(x @ W^T + b)`` locally in fp8; ``(out, preact)`` (``preact`` kept with
    ``keep_preact`` and an activation)."""
    pre = fp8_linear_fwd(x, weight, bias, recipe, False)
    if activation == "none":
        return pre, None
    n_out = weight.shape[0] // 2 if ACTIVATIONS[activation][1] else weight.shape[0]
    out = activation_forward(pre, activation, x.new_empty(tuple(x.shape[:-1]) + (n_out,)))
    return out, (pre if keep_preact else None)


def copy_to_tp_matmul_fp8_bwd(grad_out, x, weight, preact, opts: TPOptions, recipe: str, grad_high_precision: bool,
                              *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`copy_to_tp_matmul_fp8_fwd`; ``(dx, dW, db)``: the input gradient's
    partials (fp8 GEMMs of row chunks of ``dpre``) all-reduced chunk by chunk, the weight gradient
    local as :func:`fp8_linear_bwd`'s."""
    g = grad_out
    if preact is not None:
        g = activation_backward(preact, grad_out, opts.activation)
    dx = None
    if need_dx:
        dx = chunked_matmul_all_reduce(Fp8Rows.of(g, recipe), Fp8Weight(weight, recipe, "kn"), "nk", None,
                                       opts.transport, opts.num_chunks, opts.partial_dtype)
    dw = fp8_linear_bwd(g, x, weight, recipe, grad_high_precision, False, need_dw)[1] if need_dw else None
    db = sum_tokens(g).to(weight.dtype) if need_db else None
    return dx, dw, db


# ----------------------------------------------------------------------------------------------
# the custom ops of the fp8 tensor-parallel GEMMs
# ----------------------------------------------------------------------------------------------
def _grads(dx, dw, db, like):
    return tuple(absent(like) if t is None else t for t in (dx, dw, db))


def _grads_fake(dx_shape, like, weight, need_dx, need_dw, need_db):
    return (like.new_empty(dx_shape) if need_dx else absent(weight),
            weight.new_empty(weight.shape) if need_dw else absent(weight),
            weight.new_empty((weight.shape[0],)) if need_db else absent(weight))


def _tp_grads(op, ctx, dx, dw, db):
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    return input_grads(op, x=present(dx) if need_dx else None, weight=present(dw) if need_dw else None,
                       bias=present(db) if need_db else None)


@custom_op("all_gather_matmul_fp8")
def all_gather_matmul_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, dim: int, activation: str,
                             partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool, keep_preact: bool,
                             keep_gathered: bool, x_q: Tensor | None = None,
                             x_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), dim, activation, partial_dtype)
    out, preact, gathered = all_gather_matmul_fp8_fwd(x, weight, bias, opts, recipe, grad_high_precision,
                                                      keep_preact=keep_preact, keep_gathered=keep_gathered,
                                                      x_fp8=None if x_q is None else (x_q, x_scale))
    return out, absent(x) if preact is None else preact, absent(x) if gathered is None else gathered


@all_gather_matmul_fp8_op.register_fake
def _(x, weight, bias, token, dim, activation, partial_dtype, recipe, grad_high_precision, keep_preact, keep_gathered,
      x_q=None, x_scale=None):
    P, lead = token_size(token), tuple(x.shape[:-1])
    out_lead = list(lead)
    out_lead[dim] = out_lead[dim] * P
    out = x.new_empty(out_lead + [weight.shape[0] // 2 if ACTIVATIONS[activation][1] else weight.shape[0]])
    preact = x.new_empty((P,) + lead + (weight.shape[0],)) if keep_preact and activation != "none" else absent(x)
    if not keep_gathered:
        return out, preact, absent(x)
    kind = "hp" if grad_high_precision else "fp8"
    nbytes = Fp8Pack.activation(lead, x.shape[-1], x.dtype, recipe, rows=False, wgrad=kind).nbytes
    return out, preact, x.new_empty((P, nbytes), dtype=torch.uint8)


@custom_op("all_gather_matmul_fp8_backward")
def all_gather_matmul_fp8_backward_op(grad_out: Tensor, x: Tensor | None, gathered: Tensor | None, weight: Tensor,
                                      preact: Tensor | None, token: str, dim: int, activation: str,
                                      partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                      need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, grad_out), dim, activation, partial_dtype)
    return _grads(*all_gather_matmul_fp8_bwd(grad_out, x, gathered, weight, preact, opts, recipe, grad_high_precision,
                                             need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@all_gather_matmul_fp8_backward_op.register_fake
def _(grad_out, x, gathered, weight, preact, token, dim, activation, partial_dtype, recipe, grad_high_precision,
      need_dx, need_dw, need_db):
    lead = _chunk_lead(grad_out.shape, dim, token_size(token))
    return _grads_fake(lead + (weight.shape[1],), grad_out, weight, need_dx, need_dw, need_db)


def _ag_setup(ctx, inputs, output):
    x, weight, bias, token, dim, activation, partial_dtype, recipe, hp, keep_preact, keep_gathered = inputs[:11]
    ctx.args = (token, dim, activation, partial_dtype, recipe, hp)
    ctx.transports = hold(token)
    has_preact = keep_preact and activation != "none"
    ctx.save_for_backward(None if keep_gathered else x, output[2] if keep_gathered else None, weight,
                          output[1] if has_preact else None)


def _ag_backward(ctx, grad_out, grad_preact, grad_gathered):
    x, gathered, weight, preact = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_out is None or not any(need):
        return input_grads(all_gather_matmul_fp8_op)
    grads = all_gather_matmul_fp8_backward_op(grad_out.contiguous(), x, gathered, weight, preact, *ctx.args, *need)
    return _tp_grads(all_gather_matmul_fp8_op, ctx, *grads)


all_gather_matmul_fp8_op.register_autograd(_ag_backward, setup_context=_ag_setup)


@custom_op("matmul_reduce_scatter_fp8")
def matmul_reduce_scatter_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, dim: int,
                                 partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool) -> Tensor:
    return matmul_reduce_scatter_fp8_fwd(x, weight, bias, TPOptions(tp_transport(token, x), dim,
                                                                    partial_dtype=partial_dtype), recipe)


@matmul_reduce_scatter_fp8_op.register_fake
def _(x, weight, bias, token, dim, partial_dtype, recipe, grad_high_precision):
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[dim] = shape[dim] // token_size(token)
    return x.new_empty(shape)


@custom_op("matmul_reduce_scatter_fp8_backward")
def matmul_reduce_scatter_fp8_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, token: str, dim: int,
                                          partial_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                                          need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), dim, partial_dtype=partial_dtype)
    return _grads(*matmul_reduce_scatter_fp8_bwd(grad_out, x, weight, opts, recipe, grad_high_precision,
                                                 need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@matmul_reduce_scatter_fp8_backward_op.register_fake
def _(grad_out, x, weight, token, dim, partial_dtype, recipe, grad_high_precision, need_dx, need_dw, need_db):
    return _grads_fake(x.shape, x, weight, need_dx, need_dw, need_db)


def _rs_setup(ctx, inputs, output):
    x, weight, _, token, dim, partial_dtype, recipe, hp = inputs
    ctx.args = (token, dim, partial_dtype, recipe, hp)
    ctx.transports = hold(token)
    ctx.save_for_backward(x, weight)


def _rs_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grads = matmul_reduce_scatter_fp8_backward_op(grad_out.contiguous(), x, weight, *ctx.args,
                                                  *ctx.needs_input_grad[:3])
    return _tp_grads(matmul_reduce_scatter_fp8_op, ctx, *grads)


matmul_reduce_scatter_fp8_op.register_autograd(_rs_backward, setup_context=_rs_setup)


@custom_op("matmul_all_reduce_fp8")
def matmul_all_reduce_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, num_chunks: int,
                             reduce_dtype: torch.dtype, recipe: str, grad_high_precision: bool) -> Tensor:
    opts = TPOptions(tp_transport(token, x), partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return matmul_all_reduce_fp8_fwd(x, weight, bias, opts, recipe)


@matmul_all_reduce_fp8_op.register_fake
def _(x, weight, bias, token, num_chunks, reduce_dtype, recipe, grad_high_precision):
    return x.new_empty(list(x.shape[:-1]) + [weight.shape[0]])


def _ar_setup(ctx, inputs, output):
    x, weight, bias, _, _, _, recipe, hp = inputs
    ctx.recipe, ctx.hp = recipe, hp
    ctx.save_for_backward(x, weight)


def _ar_backward(ctx, grad_out):
    """The replicated output's gradient is whole on every rank: :func:`fp8_linear_bwd`'s local
    GEMMs, no communication (the bias gradient a torch sum, as :func:`fp8_linear`'s)."""
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw = fp8_linear_backward_op(grad_out.contiguous(), x, weight, ctx.recipe, ctx.hp, need_dx, need_dw)
    db = sum_tokens(grad_out).to(weight.dtype) if need_db else None
    return _tp_grads(matmul_all_reduce_fp8_op, ctx, dx, dw, db)


matmul_all_reduce_fp8_op.register_autograd(_ar_backward, setup_context=_ar_setup)


@custom_op("copy_to_tp_matmul_fp8")
def copy_to_tp_matmul_fp8_op(x: Tensor, weight: Tensor, bias: Tensor | None, token: str, activation: str,
                             num_chunks: int, reduce_dtype: torch.dtype, recipe: str, grad_high_precision: bool,
                             keep_preact: bool) -> tuple[Tensor, Tensor]:
    out, preact = copy_to_tp_matmul_fp8_fwd(x, weight, bias, recipe, activation, keep_preact=keep_preact)
    # an op's outputs must not alias: with no activation the output is the pre-activation
    return out, (absent(x) if preact is None else preact)


@copy_to_tp_matmul_fp8_op.register_fake
def _(x, weight, bias, token, activation, num_chunks, reduce_dtype, recipe, grad_high_precision, keep_preact):
    lead = list(x.shape[:-1])
    out = x.new_empty(lead + [weight.shape[0] // 2 if ACTIVATIONS[activation][1] else weight.shape[0]])
    return out, (x.new_empty(lead + [weight.shape[0]]) if keep_preact and activation != "none" else absent(x))


@custom_op("copy_to_tp_matmul_fp8_backward")
def copy_to_tp_matmul_fp8_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, preact: Tensor | None, token: str,
                                      activation: str, num_chunks: int, reduce_dtype: torch.dtype, recipe: str,
                                      grad_high_precision: bool, need_dx: bool, need_dw: bool,
                                      need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    opts = TPOptions(tp_transport(token, x), activation=activation, partial_dtype=reduce_dtype, num_chunks=num_chunks)
    return _grads(*copy_to_tp_matmul_fp8_bwd(grad_out, x, weight, preact, opts, recipe, grad_high_precision,
                                             need_dx=need_dx, need_dw=need_dw, need_db=need_db), weight)


@copy_to_tp_matmul_fp8_backward_op.register_fake
def _(grad_out, x, weight, preact, token, activation, num_chunks, reduce_dtype, recipe, grad_high_precision,
      need_dx, need_dw, need_db):
    return _grads_fake(x.shape, grad_out, weight, need_dx, need_dw, need_db)


def _cp_setup(ctx, inputs, output):
    x, weight, _, token, activation, num_chunks, reduce_dtype, recipe, hp, keep_preact = inputs
    ctx.args = (token, activation, num_chunks, reduce_dtype, recipe, hp)
    ctx.transports = hold(token)
    ctx.save_for_backward(x, weight, output[1] if keep_preact and activation != "none" else None)


def _cp_backward(ctx, grad_out, grad_preact):
    x, weight, preact = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_out is None or not any(need):
        return input_grads(copy_to_tp_matmul_fp8_op)
    grads = copy_to_tp_matmul_fp8_backward_op(grad_out.contiguous(), x, weight, preact, *ctx.args, *need)
    return _tp_grads(copy_to_tp_matmul_fp8_op, ctx, *grads)


copy_to_tp_matmul_fp8_op.register_autograd(_cp_backward, setup_context=_cp_setup)
