"""The bodies of the tensor-parallel ops: per op a forward and a backward named function
(``all_gather_matmul_fwd`` / ``all_gather_matmul_bwd``, ..., and ``<op>_fp8_fwd`` / ``_bwd``) over
the ring schedules of :mod:`.schedules` or, on a transport with in-kernel waits, the persistent
GEMMs of :mod:`.symmetric`; the static options travel in one :class:`TPOptions`. The fp8 forms
run the same schedules on the quantised operands of :mod:`fusedpar.ops.fp8.operands`, with the
activation and the e4m3 output in the GEMM epilogue."""
from __future__ import annotations

from typing import NamedTuple

import torch

from fusedpar.kernels import chunk_view, matmul
from fusedpar.kernels.gemm import linear_operands, matmul_checked
from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_empty, quantize_output
from fusedpar.kernels.runtime import activation_features
from fusedpar.ops.comm.keys import resolve_transport_id
from fusedpar.ops.comm.symmetric import resolve_transport
from fusedpar.ops.comm.transport import Transport, transport_from_id
from fusedpar.ops.common import absent, or_absent
from fusedpar.ops.fp8.bodies import fp8_linear_bwd
from fusedpar.ops.fp8.operands import Fp8Pack, Fp8Rows, Fp8Weight, Fp8WeightGrad, rows_of, token_scaled
from fusedpar.ops.tensor_parallel import symmetric
from fusedpar.ops.tensor_parallel.schedules import (
    ChunkGemms,
    WeightGrad,
    activation_backward,
    chunked_matmul_all_reduce,
    op_key,
    ring_gather,
    ring_reduce_scatter,
    sum_tokens,
)


class TPOptions(NamedTuple):
    """The static options of one tensor-parallel GEMM call (everything but the tensors; a named
    tuple: built on every call, ~0.3 us where a frozen dataclass took ~0.7).

    transport: the resolved :class:`Transport`. dim: the (normalised) gather / scatter token dim.
    partial_dtype: what travels in reductions (the reduce-scatter partials; the all-reduce dtype).
    num_chunks: row chunks of the all-reduce ops.
    """

    transport: Transport
    dim: int = 1
    activation: str = "none"
    partial_dtype: torch.dtype = torch.float32
    num_chunks: int = 1


#: the dtypes an options string names (:func:`tp_options`), by name and back
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_parsed: dict = {}


def tp_options(transport_id: str, dim: int, partial_dtype: torch.dtype, activation: str = "none",
               *flags: bool, recipe: str = "") -> str:
    """The one string argument that carries a tensor-parallel forward op's options in its schema:
    ``"dim|activation|dtype|recipe|flags|transport id"`` (``dim``: the gather / scatter dim, or the
    all-reduce ops' number of chunks; ``dtype`` the partials' or the reduction's; ``recipe`` the fp8
    ops' recipe, empty otherwise; flags as ``0`` / ``1``; the transport id last, so it may hold any
    character). One argument instead of up to ten: torch's custom-op autograd fills the defaults of
    every schema argument on every call that needs a gradient, at a cost quadratic in their number.
    Plain string formatting of constants (Dynamo folds it)."""
    bits = "".join("1" if f else "0" for f in flags)
    return f"{dim}|{activation}|{_DTYPE_NAMES[partial_dtype]}|{recipe}|{bits}|{transport_id}"


#: per op: the flags its options string holds, and whether its dim field is a token dim of x
#: (else the all-reduce ops' chunk count)
TP_OPTION_FIELDS = {"all_gather_matmul": (3, True), "matmul_reduce_scatter": (0, True), "matmul_all_reduce": (0, False),
                    "copy_to_tp_matmul": (1, False), "all_gather_matmul_fp8": (4, True),
                    "matmul_reduce_scatter_fp8": (1, True), "matmul_all_reduce_fp8": (1, False),
                    "copy_to_tp_matmul_fp8": (3, False)}


def parse_tp_options(options: str, op: str, x=None) -> tuple:
    """``(transport_id, dim, partial_dtype, activation, recipe, *flags)`` of :func:`tp_options`
    (parsed once per string), checked for ``op`` (:data:`TP_OPTION_FIELDS`): its number of ``0`` /
    ``1`` flags, the dim a token dim of ``x`` (``0 <= dim < x.dim() - 1``; any ``dim >= 0``
    without ``x``) or a chunk count ``>= 1``, a dtype it names. A malformed string (an op called
    directly) raises ``ValueError`` naming ``options``, what it must hold and what it got; the
    fakes parse it too, so a compiled call raises the same."""
    found = _parsed.get(options)
    if found is None:
        found = _parse_tp_options(options, op)
    n_flags, token_dim = TP_OPTION_FIELDS[op]
    dim = found[1]
    if len(found) != 5 + n_flags or not (0 <= dim < x.dim() - 1 if token_dim and x is not None else
                                         dim >= (0 if token_dim else 1)):
        dims = (f"a token dim of x (0..{x.dim() - 2})" if x is not None else "a token dim of x") if token_dim else \
            "the number of chunks (>= 1)"
        raise ValueError(f"{op}: options must be 'dim|activation|dtype|recipe|flags|transport id' with dim {dims} and "
                         f"{n_flags} flags, got {options!r}")
    return found


def _parse_tp_options(options, op) -> tuple:
    """:func:`parse_tp_options`' parse of a string not seen before (kept once it parsed)."""
    fields = options.split("|", 5) if isinstance(options, str) else ()
    dim, dtype, bits = (fields[0], fields[2], fields[4]) if len(fields) == 6 else ("", "", "")
    if len(fields) != 6 or not dim.lstrip("-").isdigit() or dtype not in _DTYPES or set(bits) - {"0", "1"}:
        raise ValueError(f"{op}: options must be 'dim|activation|dtype|recipe|flags|transport id' (dim an int, dtype "
                         f"one of {sorted(_DTYPES)}, flags 0 / 1; made by tp_options), got {options!r}")
    if len(_parsed) >= 4096:
        _parsed.clear()
    found = _parsed[options] = (fields[5], int(dim), _DTYPES[dtype], fields[1], fields[3], *(b == "1" for b in bits))
    return found


def grads_empty(like_dx, weight, need_dx, need_dw, need_db, n_db=None):
    """Empty ``(dx, dW, db)`` as a backward op returns them (its fake): ``like_dx``'s shape and
    dtype, the weight's, ``[n_db]`` rows (default the weight's), absent where not needed."""
    dx = torch.empty_like(like_dx) if need_dx else absent(weight)
    dw = weight.new_empty(weight.shape) if need_dw else absent(weight)
    db = weight.new_empty((weight.shape[0] if n_db is None else n_db,)) if need_db else absent(weight)
    return dx, dw, db


def grads_or_absent(dx, dw, db, like):
    """A backward body's ``(dx, dW, db)`` as its op returns them (None: an absent placeholder)."""
    return or_absent(dx, like), or_absent(dw, like), or_absent(db, like)


def tp_transport(transport_id: str, x: torch.Tensor):
    """The transport a tensor-parallel op runs on: the registered instance the id names, or the named
    one over the id's group (``resolve_transport``: symmetric where it can run)."""
    transport, group = resolve_transport_id(transport_id)
    return resolve_transport(transport, x, group)


# ----------------------------------------------------------------------------------------------
# all_gather_matmul
# ----------------------------------------------------------------------------------------------
def all_gather_matmul_fwd(x, weight, bias, opts: TPOptions, *, keep_preact=False, keep_gathered=False):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.api.all_gather_matmul`; returns ``(out,
    preact, gathered)``: ``preact`` the chunk-major ``[P, *x.shape[:-1], weight.shape[0]]``
    pre-activation (only with ``keep_preact`` and an activation; else None), ``gathered`` every
    rank's ``x`` by source rank, ``[P, *x.shape]`` (only with ``keep_gathered``; else None)."""
    t, d = opts.transport, opts.dim
    P, n, n_w = t.size, x.shape[opts.dim], weight.shape[0]
    preact = None
    if keep_preact and opts.activation != "none":
        # chunk-major: each chunk's slot is a plain 2-D [rows, n_w] block
        preact = torch.empty((P,) + tuple(x.shape[:-1]) + (n_w,), dtype=x.dtype, device=x.device)
    gathered = torch.empty((P,) + tuple(x.shape), dtype=x.dtype, device=x.device) if keep_gathered else None
    if t.in_kernel_waits:
        # one persistent GEMM waiting per chunk on copy-engine pulls from symmetric memory (it
        # allocates the output: x's shape, gather dim P times longer, the activation's features)
        out = symmetric.all_gather_matmul_symmetric(x, weight, bias, transport=t, gather_dim=d,
                                                    activation=opts.activation, preact_out=preact,
                                                    gathered_out=gathered, agree=False)
        return out, preact, gathered
    out_shape = list(x.shape[:-1]) + [activation_features(weight.shape[0], opts.activation)]
    out_shape[d] *= P
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    ops = linear_operands(x, weight, bias, activation=opts.activation)  # every chunk: x's dtype, device and K
    outs = out.split_with_sizes([n] * P, d)
    preacts = None if preact is None else preact.view(P, -1, n_w).unbind(0)
    gemms = ChunkGemms(weight)
    gemms.plan(op_key(t, "ag", ops, x, extra=(d, preact is not None, gathered is not None)))
    with t.transfers(x.device):
        for src, chunk in ring_gather(x, t, into=gathered):
            gemms(chunk, outs[src], ops=ops, preact_out=None if preacts is None else preacts[src])
    gemms.finish()
    return out, preact, gathered


def all_gather_matmul_bwd(grad_out, x, weight, preact, gathered, opts: TPOptions, *, need_dx=True, need_dw=True,
                          need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.api.all_gather_matmul`; returns ``(dx, dW,
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
    with t.transfers(grad_out.device):  # (the re-gather's transfers too)
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


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter
# ----------------------------------------------------------------------------------------------
def matmul_reduce_scatter_fwd(x, weight, bias, opts: TPOptions):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.api.matmul_reduce_scatter`: this rank's chunk
    of the reduced output."""
    t, d = opts.transport, opts.dim
    if t.in_kernel_waits:  # (the schedule allocates the output: x's shape, the scatter dim P times shorter)
        return symmetric.matmul_reduce_scatter_symmetric(x, weight, bias, transport=t, scatter_dim=d,
                                                         partial_dtype=opts.partial_dtype, agree=False)
    n = x.shape[d] // t.size
    out_shape = list(x.shape[:-1]) + [weight.shape[0]]
    out_shape[d] = n
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if d == (1 if out.dim() == 3 else 0):  # chunks along out's row dim: the schedule splits x once
        ring_reduce_scatter(x, weight, "nk", bias, out, t, opts.partial_dtype)
    else:
        chunks = x.split_with_sizes([n] * t.size, d)
        ring_reduce_scatter(chunks.__getitem__, weight, "nk", bias, out, t, opts.partial_dtype)
    return out


def matmul_reduce_scatter_bwd(grad_out, x, weight, opts: TPOptions, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.api.matmul_reduce_scatter`; returns ``(dx,
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
    with t.transfers(grad_out.device):
        for src, g in chunks:
            if need_dx and not dgrad_done:
                matmul_checked(g, weight, ops, dx.narrow(d, src * n, n), weight_layout="kn")
            if need_dw:
                dw.add(g, x.narrow(d, src * n, n))
            if need_db:
                db32 += sum_tokens(g)
    return dx, (dw.result() if need_dw else None), (db32.to(weight.dtype) if need_db else None)


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce and its mirror for replicated inputs (Megatron "copy to TP region")
# ----------------------------------------------------------------------------------------------
def matmul_all_reduce_fwd(x, weight, bias, opts: TPOptions):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.api.matmul_all_reduce` (the chunked,
    overlapped all-reduce)."""
    return chunked_matmul_all_reduce(x, weight, "nk", bias, opts.transport, opts.num_chunks, opts.partial_dtype)


def matmul_all_reduce_bwd(grad_out, x, weight, *, need_dx=True, need_dw=True, need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.api.matmul_all_reduce`: no communication (the
    replicated output's gradient is already the full one on every rank); returns ``(dx, dW, db)``."""
    dx = matmul(grad_out, weight, weight_layout="kn") if need_dx else None
    dw = None
    if need_dw:
        dw = WeightGrad(weight)
        dw.add(grad_out, x)
        dw = dw.result()
    db = sum_tokens(grad_out).to(weight.dtype) if need_db else None
    return dx, dw, db


def copy_to_tp_matmul_fwd(x, weight, bias, opts: TPOptions, *, keep_preact=False):
    """Forward of :func:`~fusedpar.ops.tensor_parallel.api.copy_to_tp_matmul` (local); returns ``(out,
    preact)``, ``preact`` the ``[tokens, weight.shape[0]]`` pre-activation with ``keep_preact``
    and an activation, else None."""
    preact = None
    if keep_preact and opts.activation != "none":
        M = int(torch.Size(x.shape[:-1]).numel())
        preact = torch.empty((M, weight.shape[0]), dtype=x.dtype, device=x.device)
    return matmul(x, weight, bias, activation=opts.activation, preact_out=preact), preact


def copy_to_tp_matmul_bwd(grad_out, x, weight, preact, opts: TPOptions, *, need_dx=True, need_dw=True,
                          need_db=False):
    """Backward of :func:`~fusedpar.ops.tensor_parallel.api.copy_to_tp_matmul`; returns ``(dx, dW,
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


def replicated_rows_fwd(t: torch.Tensor, transport_id: str, start: int, block: int, blocks: int) -> torch.Tensor:
    """A copy of ``t`` (a custom op returns no view of its input)."""
    return t.clone()


def replicated_rows_bwd(grad: torch.Tensor, transport_id: str, start: int, block: int, blocks: int) -> torch.Tensor:
    """``grad`` with rows ``start:`` summed (in fp32) over the ranks of the group of ``token``
    that hold the same ``block``."""
    buf = grad.new_zeros((blocks,) + tuple(grad[start:].shape), dtype=torch.float32)
    buf[block] = grad[start:]
    transport = transport_from_id(transport_id)
    if transport.size > 1:
        transport.all_reduce(buf).wait()
    out = grad.clone()
    out[start:] = buf[block].to(grad.dtype)
    return out


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
    :func:`~fusedpar.ops.tensor_parallel.symmetric.all_gather_matmul_symmetric` with the fp8 operands: each peer's
    e4m3 shard and scales pulled into its slot while the persistent fp8 GEMM computes the chunks
    that have arrived, the activation and the pre-activation written by its epilogue. The same
    chunk GEMMs as the ring's (under the interpreter the same pre-activation bits in fp32 / fp16);
    the activation is the epilogue's, from the fp32 accumulator. Returns ``(out, preact)``."""
    t, act = opts.transport, opts.activation
    rows, w8 = rows_of(x, recipe, x_fp8), Fp8Weight(weight, recipe)
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
    in-kernel waits: :func:`~fusedpar.ops.tensor_parallel.symmetric.matmul_reduce_scatter_symmetric` with the same
    fp8 operands (one persistent fp8 GEMM writing every chunk's partial, summed in fp32 by the
    reduction as each peer's partial completes). ``x_fp8``: ``x``'s per-token ``(q, scale)`` made
    already (by the epilogue that produced ``x``), read instead of quantising ``x``."""
    t, d = opts.transport, opts.dim
    xq, w8 = rows_of(x, recipe, x_fp8), Fp8Weight(weight, recipe)
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
    return chunked_matmul_all_reduce(rows_of(x, recipe, x_fp8), Fp8Weight(weight, recipe), "nk", bias, opts.transport,
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
