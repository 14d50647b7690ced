"""``python -m benchmarks attention``: the flash kernel against torch SDPA (forward, backward).
``python -m benchmarks ring_attention``: one GPU emulating one rank's zigzag ring schedule, the
K/V (and dK/dV) transfers done as device-to-device copies of the same bytes on a second stream.
"""
from __future__ import annotations

import argparse

from ._common import check_close, parse_dtype, register, tflops

GPU_SEQS = [1024, 2048, 4096, 8192, 16384]
GPU_HEAD_DIMS = [64, 128]
TOKENS = 16384  # batch * seq per measurement (batch = TOKENS // seq)
HIDDEN = 2048  # heads = HIDDEN // head_dim


def _ints(text):
    try:
        return [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--seqs", type=_ints, default=None, help="comma-separated sequence lengths")
    p.add_argument("--head-dims", type=_ints, default=None, help="comma-separated head dims")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")


def _attn_flops(b, h, sq, sk, d, causal):
    f = 4.0 * b * h * sq * sk * d
    return f / 2 if causal else f


@register("attention", "flash attention fwd/bwd vs torch SDPA", add_args=_add_args)
def run(args, ctx):
    import torch
    import torch.nn.functional as F

    from fusedpar.kernels import flash_attention_backward, flash_attention_forward

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    seqs = args.seqs or (GPU_SEQS if ctx.gpu else [33])
    dims = args.head_dims or (GPU_HEAD_DIMS if ctx.gpu else [16])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    sdpa_ctx = _sdpa_flash_context(ctx)
    rows = []
    for d in dims:
        for s in seqs:
            b = max(1, TOKENS // s) if ctx.gpu else 1
            h = max(1, HIDDEN // d) if ctx.gpu else 2
            for causal in causals:
                def make():
                    q, k, v, do = (torch.randn(b, s, h, d, device=ctx.device, dtype=dtype) for _ in range(4))
                    return q, k, v, do

                q, k, v, do = make()
                out, lse = flash_attention_forward(q, k, v, causal=causal)
                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                with sdpa_ctx():
                    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                err_f = check_close(out, ref.transpose(1, 2))
                dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse, causal=causal)
                with sdpa_ctx():
                    ref.backward(do.transpose(1, 2), retain_graph=True)
                err_b = max(check_close(dq, qt.grad.transpose(1, 2)), check_close(dk, kt.grad.transpose(1, 2)),
                            check_close(dv, vt.grad.transpose(1, 2)))

                t_fwd = ctx.time_ms(lambda: flash_attention_forward(q, k, v, causal=causal))
                t_bwd = ctx.time_ms(lambda: flash_attention_backward(do, q, k, v, out, lse, causal=causal))

                def sdpa_fwd():
                    with torch.no_grad(), sdpa_ctx():
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                def sdpa_bwd():
                    with sdpa_ctx():
                        torch.autograd.grad(ref, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)

                s_fwd = ctx.time_ms(sdpa_fwd)
                s_bwd = ctx.time_ms(sdpa_bwd)
                flops = _attn_flops(b, h, s, s, d, causal)
                rows.append({
                    "batch": b, "seq": s, "heads": h, "head_dim": d, "causal": causal,
                    "dtype": str(dtype).replace("torch.", ""),
                    "fwd_ms": t_fwd, "sdpa_fwd_ms": s_fwd, "fwd_ratio_vs_sdpa": s_fwd / t_fwd,
                    "bwd_ms": t_bwd, "sdpa_bwd_ms": s_bwd, "bwd_ratio_vs_sdpa": s_bwd / t_bwd,
                    "fwd_TFLOPs": tflops(flops, t_fwd), "bwd_TFLOPs": tflops(2.5 * flops, t_bwd),
                    "max_rel_err": max(err_f, err_b),
                })
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    else:
        ctx.notes.append("SDPA baseline pinned to the flash backend; bwd FLOPs counted as 2.5x fwd.")
    return rows


def _sdpa_flash_context(ctx):
    """SDPA's flash backend on GPU (the issue's baseline); the default choice on CPU."""
    import contextlib

    if not ctx.gpu:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])


# ----------------------------------------------------------------------------------------------
# ring attention: one rank's schedule on one GPU
# ----------------------------------------------------------------------------------------------
def _add_ring_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp32 (CPU default)")
    p.add_argument("--ranks", type=int, default=None, help="ring size P to emulate (GPU default 8)")
    p.add_argument("--tokens-per-rank", type=int, default=None, help="s_local (GPU default 8192)")
    p.add_argument("--head-dim", type=int, default=None, help="GPU default 128")
    p.add_argument("--heads", type=int, default=None, help="GPU default 16")
    p.add_argument("--rank", type=int, default=0, help="which rank's schedule to emulate")


class _Transport:
    """Device-to-device copies on a second stream standing in for the ring's P2P transfers (GPU);
    plain copies on CPU. ``start`` returns a handle whose ``wait`` makes the compute stream wait."""

    def __init__(self, ctx):
        import torch

        self.gpu = ctx.gpu
        self.stream = torch.cuda.Stream(device=ctx.device) if ctx.gpu else None

    def start(self, dst, src):
        import torch

        if not self.gpu:
            dst.copy_(src)
            return lambda: None
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)  # the buffer we overwrite is no longer read by compute
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return lambda: cur.wait_event(ev)


def _emulated_ring_forward(q, blocks, rank, size, scale, transport, sequential=False):
    """Rank ``rank``'s zigzag causal ring forward; ``blocks[src]`` is what rank ``src`` holds.
    The block for the next step is copied (the transfer) while the kernel runs on the current one."""
    import torch

    from fusedpar.kernels import flash_attention_forward
    from fusedpar.ops.attention import _chunks, _plan

    b, s, hq, d = q.shape
    out = torch.zeros((b, s, hq, d), device=q.device, dtype=torch.float32)
    lse = torch.full((b, hq, s), float("-inf"), device=q.device, dtype=torch.float32)
    cur, nxt = torch.empty_like(blocks[0]), torch.empty_like(blocks[0])
    cur.copy_(blocks[rank])
    q_chunks = _chunks("zigzag", rank, size, s)
    for step in range(size):
        src = (rank - step) % size
        wait = transport.start(nxt, blocks[(rank - step - 1) % size]) if step < size - 1 else None
        if sequential and wait is not None:
            wait()
        for qs, ks, qo, ko, c in _plan(q_chunks, _chunks("zigzag", src, size, s), True):
            flash_attention_forward(q[:, qs], cur[0][:, ks], cur[1][:, ks], causal=c, softmax_scale=scale,
                                    q_offset=qo, k_offset=ko, out=out[:, qs], lse=lse[:, :, qs], accumulate=True)
        if wait is not None:
            wait()
            cur, nxt = nxt, cur
    return out, lse


def _emulated_ring_backward(dout, q, blocks, out, lse, rank, size, scale, transport, sequential=False):
    """Rank ``rank``'s zigzag causal ring backward: K/V rotate as in the forward, and this rank's
    fp32 dK/dV partial sums for the block in hand go to the right neighbour (copied) while the
    left neighbour's arrive (copied from a stand-in buffer of the same bytes)."""
    import torch

    from fusedpar.kernels import attention_delta, flash_attention_backward
    from fusedpar.ops.attention import _chunks, _plan

    s = q.shape[1]
    delta = attention_delta(out, dout).contiguous()
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    cur, nxt = torch.empty_like(blocks[0]), torch.empty_like(blocks[0])
    cur.copy_(blocks[rank])
    dkv_bufs = [torch.empty(blocks[0].shape, device=q.device, dtype=torch.float32) for _ in range(2)]
    dkv_in, neighbour = torch.empty_like(dkv_bufs[0]), torch.zeros_like(dkv_bufs[0])
    sent = torch.empty_like(dkv_bufs[0])
    q_chunks = _chunks("zigzag", rank, size, s)
    wait_dkv = None
    for step in range(size):
        src = (rank - step) % size
        wait = transport.start(nxt, blocks[(rank - step - 1) % size]) if step < size - 1 else None
        if sequential and wait is not None:
            wait()
        dkv = dkv_bufs[step % 2]
        dkv.zero_()
        for qs, ks, qo, ko, c in _plan(q_chunks, _chunks("zigzag", src, size, s), True):
            flash_attention_backward(dout[:, qs], q[:, qs], cur[0][:, ks], cur[1][:, ks], None, lse[:, :, qs],
                                     delta=delta[:, :, qs], causal=c, softmax_scale=scale, q_offset=qo, k_offset=ko,
                                     dq=dq[:, qs], dk=dkv[0][:, ks], dv=dkv[1][:, ks], accumulate=True)
        if wait_dkv is not None:
            wait_dkv()
            dkv += dkv_in
        # our partial sums leave to the right while the left neighbour's arrive
        send_done = transport.start(sent, dkv)
        wait_dkv = transport.start(dkv_in, neighbour)
        if sequential:
            send_done()
            wait_dkv()
        if wait is not None:
            wait()
            cur, nxt = nxt, cur
    wait_dkv()
    return dq


@register("ring_attention", "one rank's zigzag ring schedule on one GPU (copies on a second stream)",
          add_args=_add_ring_args)
def run_ring(args, ctx):
    import math

    import torch

    from fusedpar.kernels import flash_attention_backward, flash_attention_forward
    from fusedpar.ops.attention import _chunks

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    P = args.ranks or (8 if ctx.gpu else 2)
    s = args.tokens_per_rank or (8192 if ctx.gpu else 12)
    d = args.head_dim or (128 if ctx.gpu else 16)
    h = args.heads or (16 if ctx.gpu else 2)
    r = args.rank
    if s % 2:
        raise ValueError(f"--tokens-per-rank must be even for the zigzag layout, got {s}")
    if not 0 <= r < P:
        raise ValueError(f"--rank must be in [0, {P}), got {r}")
    scale = 1.0 / math.sqrt(d)
    S = P * s
    q_full = torch.randn(1, S, h, d, device=ctx.device, dtype=dtype)
    kv_full = torch.randn(2, 1, S, h, d, device=ctx.device, dtype=dtype)

    def zig(x, rank, dim):
        c = s // 2
        a = x.narrow(dim, rank * c, c)
        bb = x.narrow(dim, (2 * P - 1 - rank) * c, c)
        return torch.cat([a, bb], dim=dim)

    q = zig(q_full, r, 1)
    blocks = [zig(kv_full, src, 2).contiguous() for src in range(P)]
    transport = _Transport(ctx)

    def plain():
        # the same work as one kernel per query chunk over the full (contiguous) sequence
        out = torch.empty_like(q)
        lse = torch.empty((1, h, s), device=q.device, dtype=torch.float32)
        for ls, ln, g in _chunks("zigzag", r, P, s):
            flash_attention_forward(q[:, ls:ls + ln], kv_full[0], kv_full[1], causal=True, softmax_scale=scale,
                                    q_offset=g, k_offset=0, out=out[:, ls:ls + ln], lse=lse[:, :, ls:ls + ln])
        return out, lse

    ring_out, _ = _emulated_ring_forward(q, blocks, r, P, scale, transport)
    plain_out, plain_lse = plain()
    err = check_close(ring_out, plain_out.float())
    dout = torch.randn_like(q)

    def plain_bwd():
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # accumulate mode adds into it
        dkv = torch.zeros(kv_full.shape, device=q.device, dtype=torch.float32)
        for ls, ln, g in _chunks("zigzag", r, P, s):
            sl = slice(ls, ls + ln)
            flash_attention_backward(dout[:, sl], q[:, sl], kv_full[0], kv_full[1], plain_out[:, sl],
                                     plain_lse[:, :, sl], causal=True, softmax_scale=scale, q_offset=g,
                                     k_offset=0, dq=dq[:, sl], dk=dkv[0], dv=dkv[1], accumulate=True)
        return dq

    def ring_bwd(sequential=False):
        return _emulated_ring_backward(dout, q, blocks, plain_out, plain_lse, r, P, scale, transport, sequential)

    err = max(err, check_close(ring_bwd(), plain_bwd().float()))

    bufs = [torch.empty_like(blocks[0]) for _ in range(2)]

    def copies():
        for step in range(P - 1):
            transport.start(bufs[step % 2], blocks[(r - step - 1) % P])()

    t_plain = ctx.time_ms(plain)
    t_comm = ctx.time_ms(copies)
    t_seq = ctx.time_ms(lambda: _emulated_ring_forward(q, blocks, r, P, scale, transport, sequential=True))
    t_ovl = ctx.time_ms(lambda: _emulated_ring_forward(q, blocks, r, P, scale, transport))
    t_plain_b = ctx.time_ms(plain_bwd)
    t_seq_b = ctx.time_ms(lambda: ring_bwd(sequential=True))
    t_ovl_b = ctx.time_ms(ring_bwd)
    flops = 4.0 * h * s * S * d / 2
    # overlap efficiency as DESIGN.md §5 defines it, with T_gemm the ring's compute alone
    t_compute = max(t_seq - t_comm, 1e-9)
    overlap = (t_compute + t_comm - t_ovl) / max(min(t_compute, t_comm), 1e-9)
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: copies run inline on one stream; these numbers are not performance.")
    return [{
        "ranks": P, "rank": r, "tokens_per_rank": s, "heads": h, "head_dim": d,
        "dtype": str(dtype).replace("torch.", ""),
        "plain_kernel_ms": t_plain, "T_comm_ms": t_comm, "T_sequential_ms": t_seq, "T_overlapped_ms": t_ovl,
        "efficiency_vs_plain": t_plain / t_ovl, "overlap_efficiency": overlap,
        "bwd_plain_ms": t_plain_b, "bwd_sequential_ms": t_seq_b, "bwd_overlapped_ms": t_ovl_b,
        "bwd_efficiency_vs_plain": t_plain_b / t_ovl_b,
        "plain_TFLOPs": tflops(flops, t_plain), "max_rel_err": err,
    }]
