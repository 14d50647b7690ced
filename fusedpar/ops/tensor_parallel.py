"""Tensor-parallel GEMMs with the communication overlapped chunk by chunk, forward and backward.

Three functional ops (each a ``torch.autograd.Function``) over ``fusedpar.kernels.matmul``:

* :func:`all_gather_matmul` -- ``act(all_gather(x, gather_dim) @ W^T + b)`` (column parallel with
  sequence parallelism). Ring schedule: the local chunk is multiplied first while chunk ``i+1``
  travels; every chunk is written by the GEMM in place into its rows of the output.
* :func:`matmul_reduce_scatter` -- ``reduce_scatter(x @ W^T, scatter_dim) + b`` (row parallel with
  sequence parallelism). Ring schedule: at each step the GEMM adds the partial received from the
  left neighbour in its epilogue (fp32 accumulation) and the sum travels on to the right.
* :func:`matmul_all_reduce` -- ``all_reduce(x @ W^T) + b`` (row parallel without sequence
  parallelism): rows in chunks, chunk ``i`` is all-reduced while chunk ``i+1`` is multiplied.

Backward passes are overlapped the same way: the data gradient of an all-gather GEMM is a
reduce-scatter GEMM (``weight_layout="kn"``, no transposed weight copy) and vice versa; weight
gradients are accumulated per chunk with ``matmul_tn`` in fp32 straight from strided chunk views.

All transfers go through :mod:`fusedpar.ops.comm`; a handle is waited on right before the chunk it
delivers is used. Every input check runs before the first transfer, so bad input raises the same
error on every rank instead of leaving peers waiting.
"""
from __future__ import annotations

import torch

from fusedpar import symm
from fusedpar.kernels.checks import check_divisible
from fusedpar.ops import comm
from fusedpar.kernels import ACTIVATIONS, chunk_view, matmul, matmul_tn
from fusedpar.kernels.gemm import activation_reference

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "copy_to_tp_matmul"]


# ----------------------------------------------------------------------------------------------
# validation (local only: runs before any communication)
# ----------------------------------------------------------------------------------------------
def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_linear_args(op, x, weight, bias, *, activation="none", weight_name="weight"):
    _check_tensor("x", x)
    _check_tensor(weight_name, weight)
    if x.dim() not in (2, 3):
        raise ValueError(f"{op}: x must be 2-D [tokens, in] or 3-D [batch, seq, in], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(
            f"{op}: {weight_name} must be 2-D [out, in] (nn.Linear layout), got shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{op}: {weight_name} must have shape [out, {x.shape[-1]}] to match x's last dim "
            f"(x shape {tuple(x.shape)}), got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"{op}: {weight_name} must be on x's device ({x.device}), got {weight.device}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: {weight_name} must have x's dtype ({x.dtype}), got {weight.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if ACTIVATIONS[activation][1] and weight.shape[0] % 2:
        raise ValueError(
            f"{op}: activation {activation!r} needs {weight_name} with an even number of rows "
            f"(gate rows then up rows), got {weight.shape[0]}"
        )
    if bias is not None:
        _check_tensor("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias must be on x's device ({x.device}), got {bias.device}")
        if bias.dtype != x.dtype:
            raise TypeError(f"{op}: bias must have x's dtype ({x.dtype}), got {bias.dtype}")


def _token_dim(op, name, dim, x):
    """Normalise a gather/scatter dim: one of x's token dims (not the feature dim)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: {name} must be an int, got {type(dim).__name__}")
    nd = x.dim()
    d = dim + nd if dim < 0 else dim
    if not 0 <= d < nd - 1:
        raise ValueError(
            f"{op}: {name} must be a token dim of x (0..{nd - 2} for shape {tuple(x.shape)}), got {dim}"
        )
    return d


def _check_partial_dtype(op, partial_dtype, x):
    if partial_dtype is None:
        return x.dtype
    if partial_dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{op}: partial_dtype must be torch.float32 or x's dtype ({x.dtype}), got {partial_dtype}")
    return partial_dtype


def _check_chunks(op, num_chunks):
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"{op}: num_chunks must be a positive int, got {num_chunks!r}")


# ----------------------------------------------------------------------------------------------
# schedules
# ----------------------------------------------------------------------------------------------
def _ring_gather(x, group, keep=False):
    """Yield ``(src_rank, chunk)`` for every rank's ``x``, the local one first.

    The transfer of the next chunk is posted before the current one is yielded (so it is in flight
    while the caller computes) and waited on only when the caller asks for it. Receive buffers are
    double-buffered, or with ``keep=True`` one slot per rank so that the caller may hold on to
    every chunk (the gathered input kept for the weight gradient).
    """
    P, r = comm.group_size(group), comm.group_rank(group)
    cur = x.contiguous()
    if P == 1:
        yield r, cur
        return
    if keep:
        slots = torch.empty((P - 1,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        bufs = [slots[i] for i in range(P - 1)]
    else:
        bufs = [torch.empty_like(cur) for _ in range(2)]
    for j in range(P):
        handle = None
        if j + 1 < P:
            nxt = bufs[j] if keep else bufs[(j + 1) % 2]
            handle = comm.ring_shift(cur, nxt, group)
        yield (r - j) % P, cur
        if handle is not None:
            handle.wait()  # the chunk the caller is about to use next
            cur = nxt


def _split_dim(t):
    return 1 if t.dim() == 3 else 0


def _halves(length):
    """Row ranges of the two sub-chunks of a reduce-scatter step (one when there is one row)."""
    if length < 2:
        return [(0, length)]
    return [(0, length // 2), (length // 2, length)]


def _ring_reduce_scatter(a_chunk, weight, weight_layout, bias, out, group, partial_dtype, between=None):
    """``out = sum over ranks q of (a_chunk_q(r) @ W_q) + bias`` where ``r`` is this rank.

    ``a_chunk(c)`` is this rank's operand for destination chunk ``c`` (leading dims = ``out``'s).
    Ring: at step ``j`` rank ``r`` computes the partial of chunk ``(r - j - 1) mod P``, adding in
    the GEMM epilogue the partial that the left neighbour computed for the same chunk at step
    ``j - 1``, and sends the sum to the right neighbour; at the last step the chunk is its own and
    the result (plus bias) is written into ``out``. Each step is split in two row halves, so that
    one half's partial travels while the other half's GEMM runs. ``between(j)`` (optional) runs
    after step ``j`` (independent work that also hides the transfers, e.g. a weight gradient).
    """
    P, r = comm.group_size(group), comm.group_rank(group)
    if P == 1:
        matmul(a_chunk(r), weight, bias, weight_layout=weight_layout, out=out)
        if between is not None:
            between(0)
        return out
    sd = _split_dim(out)
    parts = _halves(out.shape[sd])
    shapes = [out.narrow(sd, lo, hi - lo).shape for lo, hi in parts]
    send = [[torch.empty(s, dtype=partial_dtype, device=out.device) for s in shapes] for _ in range(2)]
    recv = [[torch.empty(s, dtype=partial_dtype, device=out.device) for s in shapes] for _ in range(2)]
    handles = [None] * len(parts)
    for j in range(P):
        a = a_chunk((r - j - 1) % P)
        for h, (lo, hi) in enumerate(parts):
            a_h = a.narrow(sd, lo, hi - lo)
            residual = None
            if j > 0:
                handles[h].wait()  # the neighbour's partial for this half
                residual = recv[(j - 1) % 2][h]
            if j < P - 1:
                dst = send[j % 2][h]
                matmul(a_h, weight, weight_layout=weight_layout, out=dst, residual=residual)
                handles[h] = comm.ring_shift(dst, recv[j % 2][h], group)
            else:
                matmul(a_h, weight, bias, weight_layout=weight_layout, out=out.narrow(sd, lo, hi - lo),
                       residual=residual)
        if between is not None:
            between(j)
    return out


def _matmul_all_reduce_rows(x, weight, weight_layout, bias, group, num_chunks, reduce_dtype):
    """``all_reduce(x @ W) (+ bias once)``; chunk ``i`` is reduced while chunk ``i + 1`` is computed.

    The bias is added by rank 0's GEMM epilogue only, so the sum holds it once. Partials are
    reduced in ``reduce_dtype`` (fp32 by default) and rounded to ``x.dtype`` at the end.
    """
    P, r = comm.group_size(group), comm.group_rank(group)
    n_out = weight.shape[0] if weight_layout == "nk" else weight.shape[1]
    lead = tuple(x.shape[:-1])
    M = int(torch.Size(lead).numel())
    x2 = x.reshape(M, x.shape[-1])
    if P == 1:
        return matmul(x2, weight, bias, weight_layout=weight_layout).view(lead + (n_out,))
    y = torch.empty((M, n_out), dtype=reduce_dtype, device=x.device)
    step = -(-M // num_chunks) if M else 1
    handles = []
    for lo in range(0, M, step):
        hi = min(lo + step, M)
        matmul(x2[lo:hi], weight, bias if r == 0 else None, weight_layout=weight_layout, out=y[lo:hi])
        handles.append(comm.all_reduce(y[lo:hi], group))
    for h in handles:
        h.wait()
    return y.to(x.dtype).view(lead + (n_out,))


def _activation_backward(preact, grad, activation):
    """d(act(preact))/d(preact) * grad, in fp32 (``preact`` is ``[..., 2F]`` gate|up when gated)."""
    with torch.enable_grad():
        p = preact.detach().float().requires_grad_(True)
        y = activation_reference(p, activation)
        (dp,) = torch.autograd.grad(y, p, grad.float())
    return dp.to(grad.dtype)


def _sum_tokens(t):
    return t.float().sum(dim=tuple(range(t.dim() - 1)))


# ----------------------------------------------------------------------------------------------
# all_gather_matmul
# ----------------------------------------------------------------------------------------------
class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, gather_dim, activation, save_gathered_input, return_gathered,
                partial_dtype, grad_enabled, symmetric=False):
        P = comm.group_size(group)
        n = x.shape[gather_dim]
        _, gated = ACTIVATIONS[activation]
        n_w = weight.shape[0]
        n_out = n_w // 2 if gated else n_w
        out_shape = list(x.shape[:-1]) + [n_out]
        out_shape[gather_dim] *= P
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        # nothing is kept for a backward that cannot happen (inference under no_grad)
        needs_dw = grad_enabled and ctx.needs_input_grad[1]
        need_grad = grad_enabled and any(ctx.needs_input_grad[:3])
        preact = None
        if activation != "none" and need_grad:
            # chunk-major [P, *chunk rows, n_w]: each chunk's slot is a plain 2-D [rows, n_w] block
            preact = torch.empty((P,) + tuple(x.shape[:-1]) + (n_w,), dtype=x.dtype, device=x.device)
        keep = return_gathered or (save_gathered_input and needs_dw)
        chunks = [None] * P
        if symmetric:
            # one persistent GEMM waiting per chunk on copy-engine pulls (fusedpar/symm.py)
            gathered = torch.empty((P,) + tuple(x.shape), dtype=x.dtype, device=x.device) if keep else None
            symm.all_gather_matmul_symmetric(x, weight, bias, group=group, gather_dim=gather_dim,
                                             activation=activation, out=out, preact_out=preact,
                                             gathered_out=gathered)
            if keep:
                chunks = list(gathered.unbind(0))
        else:
            for src, chunk in _ring_gather(x, group, keep=keep):
                matmul(chunk, weight, bias, activation=activation, out=out.narrow(gather_dim, src * n, n),
                       preact_out=None if preact is None else preact[src].view(-1, n_w))
                if keep:
                    chunks[src] = chunk
        ctx.symmetric = symmetric
        ctx.group, ctx.gather_dim, ctx.activation = group, gather_dim, activation
        ctx.partial_dtype, ctx.has_bias = partial_dtype, bias is not None
        ctx.kept = keep and needs_dw
        saved_chunks = chunks if ctx.kept else []
        ctx.save_for_backward(x if not ctx.kept else None, weight, preact, *saved_chunks)
        if return_gathered:
            gathered = torch.cat(chunks, dim=gather_dim)  # a copy made only on request
            ctx.mark_non_differentiable(gathered)
            return out, gathered
        return out

    @staticmethod
    def backward(ctx, grad_out, *unused):
        x, weight, preact, *chunks = ctx.saved_tensors
        group, gd, activation = ctx.group, ctx.gather_dim, ctx.activation
        P = comm.group_size(group)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        n_w = weight.shape[0]
        shard_lead = list(grad_out.shape[:-1])
        shard_lead[gd] //= P
        lead = tuple(shard_lead)
        n = lead[gd]

        if preact is not None:
            dpre = torch.empty((P,) + lead + (n_w,), dtype=grad_out.dtype, device=grad_out.device)
            for c in range(P):
                dpre[c] = _activation_backward(preact[c], grad_out.narrow(gd, c * n, n), activation)

            def a_chunk(c):
                return dpre[c]
        else:
            def a_chunk(c):
                return grad_out.narrow(gd, c * n, n)

        dW32 = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        state = {"first": True}

        def wgrad(c, xc):
            matmul_tn(a_chunk(c), xc, out=dW32, accumulate=not state["first"])
            state["first"] = False

        dx = None
        if need_dw and not ctx.kept:
            gather = _ring_gather(x, group)  # re-gather x, overlapped with the dgrad GEMMs
        else:
            gather = None

        def between(j):
            if not need_dw:
                return
            if gather is not None:
                src, xc = next(gather)
                wgrad(src, xc)
            else:
                c = (comm.group_rank(group) - j) % P
                wgrad(c, chunks[c])

        if need_dx and ctx.symmetric:
            # dgrad: the persistent reduce-scatter GEMM (weight.t() is a strided view, no copy);
            # the weight gradient follows, from the kept chunks or a ring re-gather
            dx = torch.empty(lead + (weight.shape[1],), dtype=grad_out.dtype, device=grad_out.device)
            a = dpre if preact is not None else chunk_view(grad_out, gd, P)
            symm.matmul_reduce_scatter_symmetric(a, weight.t(), group=group, partial_dtype=ctx.partial_dtype,
                                                 out=dx, chunked=True)
            for j in range(P):
                between(j)
        elif need_dx:
            dx = torch.empty(lead + (weight.shape[1],), dtype=grad_out.dtype, device=grad_out.device)
            _ring_reduce_scatter(a_chunk, weight, "kn", None, dx, group, ctx.partial_dtype, between)
        elif need_dw:
            for j in range(P):
                between(j)
        if gather is not None:
            for _ in gather:  # exhausted already; closes the generator
                pass
        dW = dW32.to(weight.dtype) if need_dw else None
        db = None
        if need_db and ctx.has_bias:
            if preact is not None:
                db = _sum_tokens(dpre).to(weight.dtype)
            else:
                db = _sum_tokens(grad_out).to(weight.dtype)
        return dx, dW, db, None, None, None, None, None, None, None, None


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
    transport: str | None = None,
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
    transport: ``"portable"`` (the ring above, any backend), ``"symmetric"`` (one persistent GEMM
              waiting per chunk on copy-engine pulls from symmetric memory; one NVLink domain,
              NCCL), ``"auto"`` (symmetric where it can run, the same choice on every rank), or
              ``None`` (``fusedpar.symm.DEFAULT_TRANSPORT``: ``FUSEDPAR_TRANSPORT``, else
              ``"portable"``). See fusedpar/symm.py; both give the same numbers.
    Returns ``[batch, seq, out_shard]`` (gather_dim 1), i.e. the gather dim grows ``tp`` times.
    """
    op = "all_gather_matmul"
    _check_linear_args(op, x, weight, bias, activation=activation)
    gather_dim = _token_dim(op, "gather_dim", gather_dim, x)
    partial_dtype = _check_partial_dtype(op, partial_dtype, x)
    group = comm.resolve_group(group)
    symmetric = symm.resolve_transport(transport, x, group) == "symmetric"
    return _AllGatherMatmul.apply(x, weight, bias, group, gather_dim, activation, bool(save_gathered_input),
                                  bool(return_gathered), partial_dtype, torch.is_grad_enabled(), symmetric)


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter
# ----------------------------------------------------------------------------------------------
class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, scatter_dim, partial_dtype, symmetric=False):
        P = comm.group_size(group)
        n = x.shape[scatter_dim] // P
        out_shape = list(x.shape[:-1]) + [weight.shape[0]]
        out_shape[scatter_dim] = n
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        if symmetric:
            symm.matmul_reduce_scatter_symmetric(x, weight, bias, group=group, scatter_dim=scatter_dim,
                                                 partial_dtype=partial_dtype, out=out)
        else:
            _ring_reduce_scatter(lambda c: x.narrow(scatter_dim, c * n, n), weight, "nk", bias, out, group,
                                 partial_dtype)
        ctx.symmetric = symmetric
        ctx.group, ctx.scatter_dim, ctx.has_bias = group, scatter_dim, bias is not None
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sd = ctx.group, ctx.scatter_dim
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_db = need_db and ctx.has_bias
        n = grad_out.shape[sd]
        dx = torch.empty_like(x) if need_dx else None
        dW32 = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        db32 = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_db else None
        first = True
        if ctx.symmetric and need_dx:
            # dgrad: the persistent all-gather GEMM (weight.t() is a strided view, no copy); the
            # gathered gradient it keeps feeds the weight and bias gradients
            P = comm.group_size(group)
            keep = need_dw or need_db
            gathered = torch.empty((P,) + tuple(grad_out.shape), dtype=grad_out.dtype, device=grad_out.device) \
                if keep else None
            symm.all_gather_matmul_symmetric(grad_out, weight.t(), group=group, gather_dim=sd, out=dx,
                                             gathered_out=gathered)
            chunks = enumerate(gathered.unbind(0)) if keep else iter(())
            dgrad_done = True
        else:
            # the incoming gradient is all-gathered chunk by chunk into the dgrad and wgrad GEMMs
            chunks = _ring_gather(grad_out, group)
            dgrad_done = False
        for src, g in chunks:
            if need_dx and not dgrad_done:
                matmul(g, weight, weight_layout="kn", out=dx.narrow(sd, src * n, n))
            if need_dw:
                matmul_tn(g, x.narrow(sd, src * n, n), out=dW32, accumulate=not first)
                first = False
            if need_db:
                db32 += _sum_tokens(g)  # every rank sums every chunk: the full bias gradient
        return (dx, dW32.to(weight.dtype) if need_dw else None, db32.to(weight.dtype) if need_db else None,
                None, None, None, None)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    scatter_dim: int = 1,
    partial_dtype: torch.dtype | None = torch.float32,
    transport: str | None = None,
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
    _check_linear_args(op, x, weight, bias)
    scatter_dim = _token_dim(op, "scatter_dim", scatter_dim, x)
    partial_dtype = _check_partial_dtype(op, partial_dtype, x)
    group = comm.resolve_group(group)
    check_divisible(f"{op}: x.shape[{scatter_dim}]", x.shape[scatter_dim], comm.group_size(group))
    symmetric = symm.resolve_transport(transport, x, group) == "symmetric"
    return _MatmulReduceScatter.apply(x, weight, bias, group, scatter_dim, partial_dtype, symmetric)


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce and its mirror for replicated inputs (Megatron "copy to TP region")
# ----------------------------------------------------------------------------------------------
class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, num_chunks, reduce_dtype):
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return _matmul_all_reduce_rows(x, weight, "nk", bias, group, num_chunks, reduce_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        # the output is replicated: its gradient is already the full one on every rank
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = matmul(grad_out, weight, weight_layout="kn") if need_dx else None
        dW = matmul_tn(grad_out, x, out_dtype=torch.float32).to(weight.dtype) if need_dw else None
        db = _sum_tokens(grad_out).to(weight.dtype) if need_db and ctx.has_bias else None
        return dx, dW, db, None, None, None


def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    num_chunks: int = 4,
    reduce_dtype: torch.dtype | None = torch.float32,
):
    """``all_reduce(x @ weight.T) + bias`` (row parallel without sequence parallelism).

    x: ``[..., in_shard]``, weight ``[out, in_shard]``, bias ``[out]`` (replicated; added once, by
    rank 0's epilogue). The token rows are split into ``num_chunks`` chunks: chunk ``i`` is
    all-reduced asynchronously while chunk ``i + 1`` is computed. ``reduce_dtype``: dtype of the
    reduction (fp32 default; ``None`` reduces in ``x.dtype``). Backward: no communication (the
    replicated output's gradient is the full one on every rank).
    """
    op = "matmul_all_reduce"
    _check_linear_args(op, x, weight, bias)
    _check_chunks(op, num_chunks)
    reduce_dtype = _check_partial_dtype(op, reduce_dtype, x)
    group = comm.resolve_group(group)
    return _MatmulAllReduce.apply(x, weight, bias, group, num_chunks, reduce_dtype)


class _CopyToTPMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, activation, num_chunks, reduce_dtype, grad_enabled):
        n_w = weight.shape[0]
        lead = tuple(x.shape[:-1])
        M = int(torch.Size(lead).numel())
        need_grad = grad_enabled and any(ctx.needs_input_grad[:3])
        preact = None
        if activation != "none" and need_grad:
            preact = torch.empty((M, n_w), dtype=x.dtype, device=x.device)
        out = matmul(x, weight, bias, activation=activation, preact_out=preact)
        ctx.group, ctx.activation, ctx.has_bias = group, activation, bias is not None
        ctx.num_chunks, ctx.reduce_dtype = num_chunks, reduce_dtype
        ctx.save_for_backward(x, weight, preact)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, preact = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        g = grad_out
        if preact is not None:
            g = _activation_backward(preact, grad_out.reshape(preact.shape[0], -1), ctx.activation)
            g = g.view(tuple(x.shape[:-1]) + (weight.shape[0],))
        # the input was replicated: its gradient is the sum of every rank's partial
        dx = (_matmul_all_reduce_rows(g, weight, "kn", None, ctx.group, ctx.num_chunks, ctx.reduce_dtype)
              if need_dx else None)
        dW = matmul_tn(g, x, out_dtype=torch.float32).to(weight.dtype) if need_dw else None
        db = _sum_tokens(g).to(weight.dtype) if need_db and ctx.has_bias else None
        return dx, dW, db, None, None, None, None, None


def copy_to_tp_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    activation: str = "none",
    num_chunks: int = 4,
    reduce_dtype: torch.dtype | None = torch.float32,
):
    """Column-parallel GEMM on a replicated input: ``act(x @ weight.T + bias)`` locally; in the
    backward the input gradient (a partial sum per rank) is all-reduced, chunked and overlapped
    like :func:`matmul_all_reduce` (Megatron's "copy to tensor-parallel region")."""
    op = "copy_to_tp_matmul"
    _check_linear_args(op, x, weight, bias, activation=activation)
    _check_chunks(op, num_chunks)
    reduce_dtype = _check_partial_dtype(op, reduce_dtype, x)
    group = comm.resolve_group(group)
    return _CopyToTPMatmul.apply(x, weight, bias, group, activation, num_chunks, reduce_dtype,
                                 torch.is_grad_enabled())
