"""``python -m benchmarks ag_matmul`` / ``matmul_rs``: one tensor-parallel rank's overlapped schedule.

On one GPU (DESIGN.md §5) the transfers of a tp rank are emulated as device-to-device copies of
the same bytes on a second CUDA stream, and the rank's GEMMs run on the main stream exactly as in
``fusedpar.ops.tensor_parallel`` (same chunking, in-place chunk outputs, reduce-scatter partials
accumulated in the GEMM epilogue, two halves per reduce-scatter step, double-buffered receives,
compute waiting on the event of the chunk it needs). Reported per shape:

* ``T_gemm``: the rank's GEMMs alone; ``T_comm``: its transfers alone (copies on the side stream);
* ``T_sequential``: transfers then GEMMs with no overlap (all-gather-then-GEMM, or each partial
  waited for before the next GEMM);
* ``T_overlapped``: the overlapped schedule;
* ``overlap_eff = (T_gemm + T_comm - T_overlapped) / min(T_gemm, T_comm)`` (1 = fully hidden) and
  ``overlapped_vs_max = T_overlapped / max(T_gemm, T_comm)`` (issue 3 target <= 1.15).

Off GPU a tiny smoke run exercises the same code path under the Triton interpreter with plain
copies (no streams): those numbers are not performance.
"""
from __future__ import annotations

from ._common import check_close, parse_dtype, register


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--tokens", type=int, default=None, help="M, all tokens of the gathered sequence (GPU default 8192)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (GPU default 8192)")
    p.add_argument("--ffn", type=int, default=None, help="the other feature size of the layer (default: hidden)")
    p.add_argument("--tp", type=int, default=None, help="emulated tensor-parallel degree (GPU default 8)")


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


class _Streams:
    """The second stream and events on GPU; plain sequential no-ops on CPU."""

    def __init__(self, gpu):
        import torch

        self.gpu = gpu
        self.side = torch.cuda.Stream() if gpu else None

    def event(self):
        import torch

        return torch.cuda.Event() if self.gpu else None

    def on_side(self, fn, wait_for=None):
        """Run ``fn`` (a copy) on the side stream after ``wait_for``; return its done event."""
        import torch

        if not self.gpu:
            fn()
            return None
        if wait_for is not None:
            self.side.wait_event(wait_for)
        with torch.cuda.stream(self.side):
            fn()
            ev = torch.cuda.Event()
            ev.record(self.side)
        return ev

    def record_main(self):
        import torch

        if not self.gpu:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return ev

    def wait(self, ev):
        import torch

        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def join(self):
        import torch

        if self.gpu:
            torch.cuda.current_stream().wait_stream(self.side)


def _row(kind, M, H, F, tp, dtype, t):
    t_gemm, t_comm, t_seq, t_ovl = t["gemm"], t["comm"], t["seq"], t["ovl"]
    return {
        "op": kind, "M": M, "hidden": H, "ffn": F, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
        "T_gemm_ms": t_gemm, "T_comm_ms": t_comm, "T_sequential_ms": t_seq, "T_overlapped_ms": t_ovl,
        "overlap_eff": (t_gemm + t_comm - t_ovl) / min(t_gemm, t_comm),
        "overlapped_vs_max": t_ovl / max(t_gemm, t_comm),
        "speedup_vs_sequential": t_seq / t_ovl,
    }


@register("ag_matmul", "all-gather + GEMM overlap, one tp rank emulated on one GPU", add_args=_add_args)
def run_ag(args, ctx):
    """Column-parallel layer: x shard [M/tp, H] gathered ring-wise into [M, H] @ W_shard^T [H, F/tp]."""
    import torch

    from fusedpar.kernels import matmul

    M, H, F, tp = _sizes(args, ctx)
    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    dev, m = ctx.device, M // tp
    st = _Streams(ctx.gpu)
    remote = torch.randn(tp, m, H, device=dev, dtype=dtype)  # every rank's shard; slot 0 is "ours"
    w = torch.randn(F // tp, H, device=dev, dtype=dtype) * H ** -0.5
    out = torch.empty(M, F // tp, device=dev, dtype=dtype)
    bufs = [torch.empty(m, H, device=dev, dtype=dtype) for _ in range(2)]
    gathered = torch.empty(M, H, device=dev, dtype=dtype)

    def gemms():
        for j in range(tp):
            matmul(remote[j], w, out=out[j * m:(j + 1) * m])

    def comm_only():
        for j in range(1, tp):
            st.on_side(lambda j=j: bufs[j % 2].copy_(remote[j]))
        st.join()

    def sequential():  # all-gather, then the GEMM over the gathered input
        for j in range(1, tp):
            st.on_side(lambda j=j: gathered[j * m:(j + 1) * m].copy_(remote[j]))
        gathered[:m].copy_(remote[0])
        st.join()
        matmul(gathered, w, out=out)

    def overlapped():
        free = [None, None]  # event: the GEMM reading a buffer is done (the copy into it may start)
        # bufs[1] may still be read by the previous call's GEMMs: the first copy waits for them
        ready = st.on_side(lambda: bufs[1].copy_(remote[1]), st.record_main()) if tp > 1 else None
        matmul(remote[0], w, out=out[:m])  # the local chunk first
        for j in range(1, tp):
            cur = bufs[j % 2]
            nxt_ready = None
            if j + 1 < tp:
                nxt_ready = st.on_side(lambda j=j: bufs[(j + 1) % 2].copy_(remote[j + 1]), free[(j + 1) % 2])
            st.wait(ready)
            matmul(cur, w, out=out[j * m:(j + 1) * m])
            free[j % 2] = st.record_main()
            ready = nxt_ready
        st.join()

    overlapped()
    err = check_close(out, torch.nn.functional.linear(remote.reshape(M, H), w))
    t = {"gemm": ctx.time_ms(gemms), "comm": ctx.time_ms(comm_only), "seq": ctx.time_ms(sequential),
         "ovl": ctx.time_ms(overlapped)}
    row = _row("ag_matmul", M, H, F, tp, dtype, t)
    row["max_rel_err"] = err
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: interpreter and plain copies, no streams; these numbers are not performance.")
    return [row]


@register("matmul_rs", "GEMM + reduce-scatter overlap, one tp rank emulated on one GPU", add_args=_add_args)
def run_rs(args, ctx):
    """Row-parallel layer: x [M, F/tp] @ W_shard^T [F/tp, H], ring reduce-scatter of [M/tp, H] partials
    (fp32 on the wire, accumulated in the GEMM epilogue), two halves per step."""
    import torch

    from fusedpar.kernels import matmul

    M, H, F, tp = _sizes(args, ctx)
    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    dev, m = ctx.device, M // tp
    st = _Streams(ctx.gpu)
    x = torch.randn(M, F // tp, device=dev, dtype=dtype)
    w = torch.randn(H, F // tp, device=dev, dtype=dtype) * (F // tp) ** -0.5
    out = torch.empty(m, H, device=dev, dtype=dtype)
    halves = [(0, m // 2), (m // 2, m)] if m >= 2 else [(0, m)]
    send = [[torch.empty(hi - lo, H, device=dev, dtype=torch.float32) for lo, hi in halves] for _ in range(2)]
    recv = [[torch.zeros(hi - lo, H, device=dev, dtype=torch.float32) for lo, hi in halves] for _ in range(2)]
    full = torch.empty(M, H, device=dev, dtype=torch.float32)
    # the emulated neighbour sends back what this rank sent (same bytes); the final chunk then holds
    # a sum over a chain of our own partials, checked against the same chain computed by torch
    chunk_order = [(tp - 1 - j) % tp for j in range(tp)]

    def step_gemm(j, h, residual):
        lo, hi = halves[h]
        rows = x[chunk_order[j] * m + lo:chunk_order[j] * m + hi]
        if j < tp - 1:
            matmul(rows, w, out=send[j % 2][h], residual=residual)
        else:
            matmul(rows, w, out=out[lo:hi], residual=residual)

    def gemms():  # the same GEMMs and epilogues, no waiting on transfers
        for j in range(tp):
            for h in range(len(halves)):
                step_gemm(j, h, recv[(j - 1) % 2][h] if j > 0 else None)

    def comm_only():
        for j in range(tp - 1):
            for h in range(len(halves)):
                st.on_side(lambda j=j, h=h: recv[j % 2][h].copy_(send[j % 2][h]))
        st.join()

    def sequential():  # GEMM over every chunk, then a reduce-scatter of the partials
        matmul(x, w, out=full)
        for j in range(tp - 1):
            st.on_side(lambda j=j: recv[j % 2][0].copy_(full[j * m:j * m + halves[0][1]]))
            if len(halves) > 1:
                st.on_side(lambda j=j: recv[j % 2][1].copy_(full[j * m + halves[1][0]:(j + 1) * m]))
        st.join()
        out.copy_(full[:m])  # the final sum in the reduce-scatter (copy stands in for the add)

    def overlapped():
        sent = [[None] * len(halves) for _ in range(2)]
        for j in range(tp):
            for h in range(len(halves)):
                residual = None
                if j > 0:
                    st.wait(sent[(j - 1) % 2][h])
                    residual = recv[(j - 1) % 2][h]
                step_gemm(j, h, residual)
                if j < tp - 1:
                    done = st.record_main()
                    sent[j % 2][h] = st.on_side(lambda j=j, h=h: recv[j % 2][h].copy_(send[j % 2][h]), done)
        st.join()

    overlapped()
    ref = None
    for j in range(tp):
        part = x[chunk_order[j] * m:(chunk_order[j] + 1) * m].float() @ w.float().t()
        ref = part if ref is None else ref + part
    err = check_close(out, ref)
    t = {"gemm": ctx.time_ms(gemms), "comm": ctx.time_ms(comm_only), "seq": ctx.time_ms(sequential),
         "ovl": ctx.time_ms(overlapped)}
    row = _row("matmul_rs", M, H, F, tp, dtype, t)
    row["max_rel_err"] = err
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: interpreter and plain copies, no streams; these numbers are not performance.")
    return [row]
