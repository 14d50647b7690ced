"""The host bodies of the fp8 custom ops (:mod:`fusedpar.ops.fp8_library`): :func:`fp8_linear_fwd`
/ :func:`fp8_linear_bwd`, and the tensor-parallel GEMMs in fp8, i.e. the schedules of
:mod:`fusedpar.ops.tensor_parallel_schedules` with quantised operands
(:class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Rows`,
:class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Weight`, the packs of
:class:`~fusedpar.ops.tensor_parallel_schedules.Fp8Pack`) and, on a transport with in-kernel waits,
the persistent GEMMs of :mod:`fusedpar.ops.symmetric` on fp8 operands.

The fused epilogue of :func:`~fusedpar.kernels.fp8_matmul` applies the activation of the column
GEMMs (all-gather, copy-to-tp) from the fp32 accumulator, stores the pre-activation the backward
needs, and with ``out_fp8`` quantises the output per 1x128 tile (blockwise: the down projection's
``x_fp8``); the row GEMMs (reduce-scatter, all-reduce) take such an ``x_fp8`` instead of
quantising ``x``.
"""
from __future__ import annotations

import torch

from fusedpar.kernels import fp8_matmul, matmul_tn, quantize_e4m3
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_empty, quantize_output
from fusedpar.kernels.runtime import activation_features
from fusedpar.ops import symmetric
from fusedpar.ops.library import absent
from fusedpar.ops.tensor_parallel_library import TPOptions
from fusedpar.ops.tensor_parallel_schedules import (
    Fp8Pack,
    Fp8Rows,
    Fp8Weight,
    Fp8WeightGrad,
    activation_backward,
    chunked_matmul_all_reduce,
    ring_gather,
    ring_reduce_scatter,
    sum_tokens,
    token_scaled,
)

__all__ = ["all_gather_matmul_fp8_bwd", "all_gather_matmul_fp8_fwd", "chunk_lead", "copy_to_tp_matmul_fp8_bwd",
           "copy_to_tp_matmul_fp8_fwd", "fp8_linear_bwd", "fp8_linear_fwd", "matmul_all_reduce_fp8_fwd",
           "matmul_reduce_scatter_fp8_bwd", "matmul_reduce_scatter_fp8_fwd", "wgrad_kind"]


def _rows(x: torch.Tensor, recipe: str, x_fp8) -> Fp8Rows:
    """``x`` quantised per token, or its given quantisation ``x_fp8 = (q, scale)``."""
    return Fp8Rows.of(x, recipe) if x_fp8 is None else Fp8Rows(*x_fp8, x.dtype)


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


# ----------------------------------------------------------------------------------------------
# all_gather_matmul in fp8: the local shard quantised once, gathered as fp8 + scales
# ----------------------------------------------------------------------------------------------
def wgrad_kind(grad_high_precision: bool) -> str:
    """The pack kind of a weight-gradient operand: ``"hp"`` (the tensor itself) or ``"fp8"``."""
    return "hp" if grad_high_precision else "fp8"


def chunk_lead(shape, d: int, P: int) -> tuple:
    """The leading dims of one rank's chunk of a gathered ``shape`` (``[..., F]``, dim ``d``)."""
    lead = list(shape[:-1])
    lead[d] //= P
    return tuple(lead)


def all_gather_matmul_fp8_fwd(x, weight, bias, opts: TPOptions, recipe: str, grad_high_precision: bool, *,
                              keep_preact=False, keep_gathered=False, x_fp8=None, out_fp8=False):
    """``act(all_gather(x) @ W^T + b)`` with the GEMMs in fp8: this rank's ``x`` is quantised per
    token once, into the bytes that travel (:class:`Fp8Pack`: e4m3 + scales, about half of bf16's),
    the weight once per call, and each gathered chunk's fp8 GEMM writes its rows of the output
    while the next chunk travels. With ``keep_gathered`` a second ring, in the same steps, gathers
    the weight-gradient operand (``x^T`` scaled along the tokens, or ``x`` with
    ``grad_high_precision``), kept for the backward. The activation is the chunk GEMMs' epilogue
    (from the fp32 accumulator). Returns ``(out, preact, gathered, out_fp8)``: ``preact`` the
    chunk-major pre-activation (with ``keep_preact`` and an activation), ``gathered`` the kept
    ``[P, pack bytes]``, ``out_fp8`` (with ``out_fp8``) ``out`` quantised per 1x128 tile by the
    chunk GEMMs' epilogues, ``(q, scale)`` (else None). ``x_fp8``: ``x``'s per-token ``(q, scale)`` made
    already (by the norm that produced ``x``), packed instead of quantising ``x`` again, or on a
    group of one read in place (the weight-gradient operand, scaled along the tokens, still comes
    from ``x``). On a transport with in-kernel waits and without ``keep_gathered``: one persistent
    fp8 GEMM (:func:`_all_gather_matmul_fp8_symmetric`)."""
    t, d, act = opts.transport, opts.dim, opts.activation
    if t.in_kernel_waits and not keep_gathered:
        out, preact = _all_gather_matmul_fp8_symmetric(x, weight, bias, opts, recipe, keep_preact, x_fp8)
        fp8 = fp8_output_empty(out) if out_fp8 else None
        quantize_output(out, fp8)  # the persistent GEMM fuses none: one pass after it
        return out, preact, None, fp8
    P, lead, n_w, K = t.size, tuple(x.shape[:-1]), weight.shape[0], x.shape[-1]
    n = lead[d]
    pack = Fp8Pack.activation(lead, K, x.dtype, recipe, rows=True, wgrad=None)
    if x_fp8 is not None and P == 1:  # nothing travels: the GEMM reads the given pair in place
        chunks, rows = iter([(t.rank, None)]), (lambda _: Fp8Rows(*(v.contiguous() for v in x_fp8), x.dtype))
    else:
        chunks, rows = ring_gather(pack.fill(x.new_empty(pack.nbytes, dtype=torch.uint8), x, x_fp8), t), pack.rows
    gathered = None
    if keep_gathered:  # both rings post their next transfer before a chunk is computed on
        kept = Fp8Pack.activation(lead, K, x.dtype, recipe, rows=False, wgrad=wgrad_kind(grad_high_precision))
        gathered = x.new_empty((P, kept.nbytes), dtype=torch.uint8)
        chunks = (a for a, _ in zip(chunks, ring_gather(kept.fill(gathered[t.rank], x), t, into=gathered)))
    w8 = Fp8Weight(weight, recipe)
    out_shape = list(lead) + [activation_features(n_w, act)]
    out_shape[d] *= P
    out = x.new_empty(out_shape)
    preact = x.new_empty((P,) + lead + (n_w,)) if keep_preact and act != "none" else None
    fp8 = fp8_output_empty(out) if out_fp8 else None
    for src, buf in chunks:
        w8.gemm(rows(buf), out.narrow(d, src * n, n), bias, activation=act,
                preact_out=None if preact is None else preact[src].view(-1, n_w),
                fp8_out=None if fp8 is None else tuple(f.narrow(d, src * n, n) for f in fp8))
    return out, preact, gathered, fp8


def _all_gather_matmul_fp8_symmetric(x, weight, bias, opts: TPOptions, recipe: str, keep_preact: bool, x_fp8):
    """:func:`all_gather_matmul_fp8_fwd` over symmetric memory: ``x`` quantised per token once (or
    the given ``x_fp8`` pair) and the weight as the rings do (:class:`Fp8Weight`), then
    :func:`~fusedpar.ops.symmetric.all_gather_matmul_symmetric` with the fp8 operands: each peer's
    e4m3 shard and scales pulled into its slot while the persistent fp8 GEMM computes the chunks
    that have arrived, the activation and the pre-activation written by its epilogue. The same
    chunk GEMMs as the ring's (under the interpreter the same pre-activation bits in fp32 / fp16);
    the activation is the epilogue's, from the fp32 accumulator. Returns ``(out, preact)``."""
    t, act = opts.transport, opts.activation
    rows, w8 = _rows(x, recipe, x_fp8), Fp8Weight(weight, recipe)
    preact = None
    if keep_preact and act != "none":
        preact = x.new_empty((t.size,) + tuple(x.shape[:-1]) + (weight.shape[0],))
    out = symmetric.all_gather_matmul_symmetric(rows.q, w8.q, bias, transport=t, gather_dim=opts.dim, activation=act,
                                                preact_out=preact, x_scale=rows.scale, weight_scale=w8.scale,
                                                scaling=recipe, out_dtype=x.dtype, agree=False)
    return out, preact


def all_gather_matmul_fp8_bwd(grad_out, x, gathered, weight, preact, opts: TPOptions, recipe: str,
                              grad_high_precision: bool, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`all_gather_matmul_fp8_fwd`; ``(dx, dW, db)``. The data gradient is the
    reduce-scatter ring of fp8 GEMMs (``dpre`` quantised per token once, ``W^T`` per input
    column / its 128x128 blocks), fp32 or ``partial_dtype`` partials travelling; between its steps
    the weight gradient of each chunk, ``q(dpre_c^T) @ q(x_c^T)`` scaled along the chunk's tokens,
    from the kept pack or a re-gather of the packed operand (:class:`Fp8WeightGrad`)."""
    t, d, act = opts.transport, opts.dim, opts.activation
    P, lead = t.size, chunk_lead(grad_out.shape, opts.dim, opts.transport.size)
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
                                  wgrad=wgrad_kind(grad_high_precision))
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
def matmul_reduce_scatter_fp8_fwd(x, weight, bias, opts: TPOptions, recipe: str, x_fp8=None):
    """``reduce_scatter(x @ W^T) + b`` with the partial GEMMs in fp8: ``x`` quantised per token
    (along this rank's in-features) and ``W`` once; the partials (``partial_dtype``) travel and
    are added in the next GEMM's fp32 epilogue, as in the high-precision ring. On a transport with
    in-kernel waits: :func:`~fusedpar.ops.symmetric.matmul_reduce_scatter_symmetric` with the same
    fp8 operands (one persistent fp8 GEMM writing every chunk's partial, summed in fp32 by the
    reduction as each peer's partial completes). ``x_fp8``: ``x``'s per-token ``(q, scale)`` made
    already (by the epilogue that produced ``x``), read instead of quantising ``x``."""
    t, d = opts.transport, opts.dim
    xq, w8 = _rows(x, recipe, x_fp8), Fp8Weight(weight, recipe)
    if t.in_kernel_waits:
        return symmetric.matmul_reduce_scatter_symmetric(xq.q, w8.q, bias, transport=t, scatter_dim=d,
                                                         partial_dtype=opts.partial_dtype, x_scale=xq.scale,
                                                         weight_scale=w8.scale, scaling=recipe, out_dtype=x.dtype,
                                                         agree=False)
    n = x.shape[d] // t.size
    out_shape = list(x.shape[:-1]) + [weight.shape[0]]
    out_shape[d] = n
    out = x.new_empty(out_shape)
    ring_reduce_scatter(lambda c: xq.narrow(d, c * n, n), w8, "nk", bias, out, t, opts.partial_dtype)
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
                              wgrad=wgrad_kind(grad_high_precision) if need_dw else None, bias_grad=need_db)
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
def matmul_all_reduce_fp8_fwd(x, weight, bias, opts: TPOptions, recipe: str, x_fp8=None):
    """``all_reduce(x @ W^T) + b``: the row chunks' fp8 GEMMs (``x`` quantised per token once, or
    its given ``x_fp8``) write ``reduce_dtype`` partials that are all-reduced while the next chunk
    is multiplied."""
    return chunked_matmul_all_reduce(_rows(x, recipe, x_fp8), Fp8Weight(weight, recipe), "nk", bias, opts.transport,
                                     opts.num_chunks, opts.partial_dtype)


def copy_to_tp_matmul_fp8_fwd(x, weight, bias, recipe: str, activation: str, *, keep_preact=False, out_fp8=False):
    """``act(x @ W^T + b)`` locally, one fp8 GEMM with the activation in its epilogue;
    ``(out, preact, out_fp8)`` (``preact`` kept with ``keep_preact`` and an activation; ``out_fp8``
    the epilogue's 1x128-tile quantisation of ``out`` when asked, else None)."""
    lead, (n_w, K) = tuple(x.shape[:-1]), weight.shape
    out = x.new_empty(lead + (activation_features(n_w, activation),))
    preact = x.new_empty(lead + (n_w,)) if keep_preact and activation != "none" else None
    fp8 = fp8_output_empty(out) if out_fp8 else None
    Fp8Weight(weight, recipe).gemm(Fp8Rows.of(x.reshape(-1, K), recipe), out.view(-1, out.shape[-1]), bias,
                                   activation=activation, preact_out=None if preact is None else preact.view(-1, n_w),
                                   fp8_out=None if fp8 is None else tuple(f.view(-1, f.shape[-1]) for f in fp8))
    return out, preact, fp8


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


