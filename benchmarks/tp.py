"""``python -m benchmarks ag_matmul`` / ``matmul_rs``: one tensor-parallel rank of the shipped ops.

The shipped :func:`fusedpar.ops.all_gather_matmul` / :func:`fusedpar.ops.matmul_reduce_scatter`
run one rank of ``tp`` on one GPU through :class:`fusedpar.ops.EmulatedTransport`: its
transfers are device-to-device copies of the same bytes on a side stream, its GEMMs run on the
main stream and wait for the chunk they need, exactly as over a real group. Reported per shape:

* ``T_gemm``: the op's GEMMs alone (``fusedpar.kernels.matmul`` per chunk; the reduce-scatter's
  partials in fp32 with the previous one added in the epilogue, the op splitting each chunk's rows
  in two halves);
* ``T_comm``: the op's transfers alone through the same transport (the ``tp - 1`` ring shifts of
  a shard, or of an fp32 partial, each received before it is sent on);
* ``T_sequential``: no overlap: ``transport.all_gather_into`` then one GEMM over the gathered
  input, or one GEMM over all rows then ``transport.reduce_scatter_into`` of the fp32 partials;
* ``T_overlapped``: the shipped op;
* ``overlap_eff = (T_gemm + T_comm - T_overlapped) / min(T_gemm, T_comm)`` (1 = fully hidden) and
  ``overlapped_vs_max = T_overlapped / max(T_gemm, T_comm)`` (issue 3 target <= 1.15).

Before timing, the op's result is checked against a torch reference under the transport's mirror
rule (every peer sends what this rank sends): the all-gather gathers ``tp`` copies of ``x``; the
ring reduce-scatter's result is the sum over chunks ``c`` of ``x_c @ W^T`` plus the bias.

Off GPU a tiny smoke run exercises the same code path under the Triton interpreter with the
copies made at once (no streams): those numbers are not performance.
"""
from __future__ import annotations

from ._common import check_close, parse_dtype, register

SMOKE_NOTE = "CPU smoke mode: interpreter and copies made at once, no streams; these numbers are not performance."


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--tokens", type=int, default=None, help="M, all tokens of the gathered sequence (GPU default 8192)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (GPU default 8192)")
    p.add_argument("--ffn", type=int, default=None, help="the other feature size of the layer (default: hidden)")
    p.add_argument("--tp", type=int, default=None, help="emulated tensor-parallel degree (GPU default 8)")
    p.add_argument("--fp8", choices=["none", "rowwise", "blockwise"], default="rowwise",
                   help="also time the op with this fp8 recipe (the shard travels as e4m3 + scales; needs fp8 "
                        "tensor cores on a GPU): columns T_fp8_ms and fp8_speedup (none: skip)")


def _sizes(args, ctx):
    if ctx.gpu:
        M, H, tp = args.tokens or 8192, args.hidden or 8192, args.tp or 8
    else:
        M, H, tp = args.tokens or 24, args.hidden or 18, args.tp or 3
    F = args.ffn or H
    for name, v in (("tokens", M), ("ffn", F)):
        if v % tp:
            raise SystemExit(f"--{name}={v} must be divisible by --tp={tp}")
    return M, H, F, tp


def _row(kind, M, H, F, tp, dtype, t, err):
    t_gemm, t_comm, t_seq, t_ovl = t["gemm"], t["comm"], t["seq"], t["ovl"]
    return {
        "op": kind, "M": M, "hidden": H, "ffn": F, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
        "T_gemm_ms": t_gemm, "T_comm_ms": t_comm, "T_sequential_ms": t_seq, "T_overlapped_ms": t_ovl,
        "overlap_eff": (t_gemm + t_comm - t_ovl) / min(t_gemm, t_comm),
        "overlapped_vs_max": t_ovl / max(t_gemm, t_comm),
        "speedup_vs_sequential": t_seq / t_ovl,
        "max_rel_err": err,
    }


def _fp8_columns(args, ctx, row, op, reference):
    """With ``--fp8``: the op's fp8 form checked against the float64 ``reference`` within the
    recipe's quantisation error (two e4m3 operands: each element within 2^-4 of itself, so the
    product within about 2^-3 of the output's scale), timed, and its speed-up over the bf16 op."""
    if args.fp8 == "none":
        return row
    out = op(args.fp8)
    err = check_close(out, reference, tol=2 ** -3)
    t = ctx.time_ms(lambda: op(args.fp8))
    row.update({"fp8": args.fp8, "T_fp8_ms": t, "fp8_speedup": row["T_overlapped_ms"] / t, "fp8_rel_err": err})
    return row


def _ring_shifts(transport, bufs, first, steps):
    """``steps`` ring shifts through the transport, each received before it is sent on."""
    cur = first
    for j in range(steps):
        nxt = bufs[j % 2]
        transport.ring_shift(cur, nxt).wait()
        cur = nxt


@register("ag_matmul", "the shipped all_gather_matmul, one tp rank emulated on one GPU", add_args=_add_args)
def run_ag(args, ctx):
    """Column-parallel layer: x shard [M/tp, H] gathered ring-wise into [M, H] @ W_shard^T [H, F/tp]."""
    import torch

    from fusedpar.kernels import matmul
    from fusedpar.ops import all_gather_matmul
    from fusedpar.ops.comm.transport import EmulatedTransport

    M, H, F, tp = _sizes(args, ctx)
    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    dev, m = ctx.device, M // tp
    transport = EmulatedTransport(tp, 0)
    x = torch.randn(m, H, device=dev, dtype=dtype)
    w = torch.randn(F // tp, H, device=dev, dtype=dtype) * H ** -0.5
    out = torch.empty(M, F // tp, device=dev, dtype=dtype)
    gathered = x.repeat(tp, 1)
    bufs = [torch.empty_like(x) for _ in range(2)]

    def overlapped():
        return all_gather_matmul(x, w, gather_dim=0, transport=transport)

    def gemms():  # one GEMM per gathered chunk, into its rows of the output
        for j in range(tp):
            matmul(gathered[j * m:(j + 1) * m], w, out=out[j * m:(j + 1) * m])

    def sequential():
        transport.all_gather_into(gathered, x).wait()
        matmul(gathered, w, out=out)

    # mirror rule: the gathered input is tp copies of x
    err = check_close(overlapped(), torch.nn.functional.linear(x.double().repeat(tp, 1), w.double()))
    t = {"gemm": ctx.time_ms(gemms), "comm": ctx.time_ms(lambda: _ring_shifts(transport, bufs, x, tp - 1)),
         "seq": ctx.time_ms(sequential), "ovl": ctx.time_ms(overlapped)}
    if ctx.smoke:
        ctx.notes.append(SMOKE_NOTE)
    ref = torch.nn.functional.linear(x.double().repeat(tp, 1), w.double())
    op = lambda recipe: all_gather_matmul(x, w, gather_dim=0, transport=transport, fp8=recipe)  # noqa: E731
    return [_fp8_columns(args, ctx, _row("ag_matmul", M, H, F, tp, dtype, t, err), op, ref)]


@register("matmul_rs", "the shipped matmul_reduce_scatter, one tp rank emulated on one GPU", add_args=_add_args)
def run_rs(args, ctx):
    """Row-parallel layer: x [M, F/tp] @ W_shard^T [F/tp, H] + b, ring reduce-scatter of the
    [M/tp, H] partials (fp32 on the wire, accumulated in the GEMM epilogue)."""
    import torch

    from fusedpar.kernels import matmul
    from fusedpar.ops import matmul_reduce_scatter
    from fusedpar.ops.comm.transport import EmulatedTransport

    M, H, F, tp = _sizes(args, ctx)
    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    dev, m = ctx.device, M // tp
    transport = EmulatedTransport(tp, 0)
    x = torch.randn(M, F // tp, device=dev, dtype=dtype)
    w = torch.randn(H, F // tp, device=dev, dtype=dtype) * (F // tp) ** -0.5
    b = torch.randn(H, device=dev, dtype=dtype)
    out = torch.empty(m, H, device=dev, dtype=dtype)
    partials = [torch.zeros(m, H, device=dev, dtype=torch.float32) for _ in range(3)]
    full = torch.empty(M, H, device=dev, dtype=torch.float32)

    def overlapped():
        return matmul_reduce_scatter(x, w, b, scatter_dim=0, transport=transport)

    def gemms():  # one partial per chunk adding the previous one in its epilogue; the last one is the output
        for c in range(tp):
            residual = partials[(c - 1) % 2] if c else None
            dst = partials[c % 2] if c < tp - 1 else out
            matmul(x[c * m:(c + 1) * m], w, b if c == tp - 1 else None, out=dst, residual=residual)

    def sequential():
        matmul(x, w, out=full)
        transport.reduce_scatter_into(partials[2], full).wait()
        torch.add(partials[2], b, out=out)

    # mirror rule: each ring step receives the partial this rank sent, so the result sums every chunk
    ref = sum(x[c * m:(c + 1) * m].double() @ w.double().t() for c in range(tp)) + b.double()
    err = check_close(overlapped(), ref)
    comm_only = lambda: _ring_shifts(transport, partials, partials[2], tp - 1)  # noqa: E731
    t = {"gemm": ctx.time_ms(gemms), "comm": ctx.time_ms(comm_only), "seq": ctx.time_ms(sequential),
         "ovl": ctx.time_ms(overlapped)}
    if ctx.smoke:
        ctx.notes.append(SMOKE_NOTE)
    op = lambda recipe: matmul_reduce_scatter(x, w, b, scatter_dim=0, transport=transport, fp8=recipe)  # noqa: E731
    return [_fp8_columns(args, ctx, _row("matmul_rs", M, H, F, tp, dtype, t, err), op, ref)]
