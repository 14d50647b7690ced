"""``python -m benchmarks attention``: the flash kernel against torch SDPA (forward, backward in
both dq modes: ``bwd_ms`` the deterministic backward, one launch of dK/dV and dQ programs,
``bwd_atomic_ms`` the one-pass backward with dQ by fp32 atomics, ``dq_mode="atomic"``; the
path ``bwd_ms`` loaded by, ``bwd_loads``: tensor descriptors on Hopper; with ``--compare-loads``
the deterministic backward also on pointer loads, ``bwd_pointer_ms``).
``python -m benchmarks ring_attention``: the shipped ring attention (forward and backward) of one
rank of ``P`` on one GPU through :class:`fusedpar.ops.EmulatedTransport`: the K/V
(and dK/dV) transfers are device-to-device copies of the same bytes on a second stream.
``python -m benchmarks varlen_attention``: packed documents (varlen kernels) against a padded
batch of the same documents.
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
    p.add_argument("--compare-loads", action="store_true",
                   help="also time the backward on pointer loads (bwd_pointer_ms, bwd_tma_speedup)")


def _attn_flops(b, h, sq, sk, d, causal):
    f = 4.0 * b * h * sq * sk * d
    return f / 2 if causal else f


@register("attention", "flash attention fwd/bwd vs torch SDPA", add_args=_add_args)
def run(args, ctx):
    import torch

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    seqs = args.seqs or (GPU_SEQS if ctx.gpu else [33])
    dims = args.head_dims or (GPU_HEAD_DIMS if ctx.gpu else [16])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows = []
    for d in dims:
        for s in seqs:
            b = max(1, TOKENS // s) if ctx.gpu else 1
            h = max(1, HIDDEN // d) if ctx.gpu else 2
            for causal in causals:
                rows.append(_attention_row(ctx, b, s, h, d, causal, dtype, args.compare_loads))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    else:
        ctx.notes.append("SDPA baseline pinned to the flash backend; bwd FLOPs counted as 2.5x fwd. bwd_ms: "
                         "dq_mode='separate' (one launch of dK/dV and dQ programs, deterministic); bwd_atomic_ms: "
                         "dq_mode='atomic' (one pass, dQ by fp32 atomics, fp32 scratch cast to bf16 included); "
                         "bwd_atomic_speedup = bwd_ms / bwd_atomic_ms; bwd_loads: the load path of bwd_ms; "
                         "bwd_pointer_ms (--compare-loads): dq_mode='separate' on pointer loads "
                         "(set_load_path('pointer'); bwd_ms itself where bwd_loads is 'pointer'), "
                         "bwd_tma_speedup = bwd_pointer_ms / bwd_ms.")
    return rows


def _attention_row(ctx, b, s, h, d, causal, dtype, compare_loads=False):
    """One shape: both kernels (forward, both backward modes) checked against SDPA, then timed;
    ``compare_loads``: the deterministic backward on pointer loads too."""
    import torch
    import torch.nn.functional as F

    from fusedpar.kernels import flash_attention_backward, flash_attention_forward
    from fusedpar.kernels.flash_attention_bwd import backward_loads
    from fusedpar.kernels.gemm_loads import load_path_set

    sdpa_ctx = _sdpa_flash_context(ctx)
    q, k, v, do = (torch.randn(b, s, h, d, device=ctx.device, dtype=dtype) for _ in range(4))
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
    grads = flash_attention_backward(do, q, k, v, out, lse, causal=causal, dq_mode="atomic")
    err_b = max(err_b, *(check_close(g, r.grad.transpose(1, 2)) for g, r in zip(grads, (qt, kt, vt))))

    t_fwd = ctx.time_ms(lambda: flash_attention_forward(q, k, v, causal=causal))
    t_bwd = ctx.time_ms(lambda: flash_attention_backward(do, q, k, v, out, lse, causal=causal))
    t_bwd_a = ctx.time_ms(lambda: flash_attention_backward(do, q, k, v, out, lse, causal=causal, dq_mode="atomic"))
    loads = backward_loads(q, k, v, do)
    t_bwd_p = t_bwd
    if compare_loads and loads != "pointer":
        with load_path_set("pointer"):  # the same backward, its streamed tiles by pointer loads
            grads = flash_attention_backward(do, q, k, v, out, lse, causal=causal)
            err_b = max(err_b, *(check_close(g, r.grad.transpose(1, 2)) for g, r in zip(grads, (qt, kt, vt))))
            t_bwd_p = ctx.time_ms(lambda: flash_attention_backward(do, q, k, v, out, lse, causal=causal))

    def sdpa_fwd():
        with torch.no_grad(), sdpa_ctx():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def sdpa_bwd():
        with sdpa_ctx():
            torch.autograd.grad(ref, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)

    s_fwd = ctx.time_ms(sdpa_fwd)
    s_bwd = ctx.time_ms(sdpa_bwd)
    flops = _attn_flops(b, h, s, s, d, causal)
    return {
        "batch": b, "seq": s, "heads": h, "head_dim": d, "causal": causal,
        "dtype": str(dtype).replace("torch.", ""),
        "fwd_ms": t_fwd, "sdpa_fwd_ms": s_fwd, "fwd_ratio_vs_sdpa": s_fwd / t_fwd,
        "bwd_ms": t_bwd, "sdpa_bwd_ms": s_bwd, "bwd_ratio_vs_sdpa": s_bwd / t_bwd,
        "bwd_atomic_ms": t_bwd_a, "bwd_atomic_ratio_vs_sdpa": s_bwd / t_bwd_a,
        "bwd_atomic_speedup": t_bwd / t_bwd_a,
        "bwd_loads": loads,
        **({"bwd_pointer_ms": t_bwd_p, "bwd_tma_speedup": t_bwd_p / t_bwd} if compare_loads else {}),
        "fwd_TFLOPs": tflops(flops, t_fwd), "bwd_TFLOPs": tflops(2.5 * flops, t_bwd),
        "bwd_atomic_TFLOPs": tflops(2.5 * flops, t_bwd_a),
        "max_rel_err": max(err_f, err_b),
    }


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


def _runs(pos):
    """``[(local_start, length, global_start)]``: the contiguous runs of a shard's positions."""
    p = pos.tolist()
    runs, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            runs.append((start, i - start, p[start]))
            start = i
    return runs


def _blocking_transport(size, rank):
    """An EmulatedTransport whose transfers are waited on as soon as they start: the same ring
    without overlap (the sequential baseline)."""
    from fusedpar.ops.comm.transport import EmulatedTransport

    class Blocking(EmulatedTransport):
        def send_recv(self, send, dst, recv, src):
            handle = super().send_recv(send, dst, recv, src)
            handle.wait()
            return handle

    return Blocking(size, rank)


class _MirrorProblem:
    """One rank's ring problem under the mirror rule of the emulated transport: every peer holds
    what this rank holds, so the emulated global sequence has this rank's K/V at every rank's
    positions. ``plain_fwd`` / ``plain_bwd`` are single-GPU flash attention of this rank's
    queries over that full sequence (one launch per contiguous run of query positions)."""

    def __init__(self, ctx, dtype, P, s, h, d, rank, layout="zigzag"):
        import torch

        from fusedpar.ops import shard_positions

        self.S, self.rank, self.layout = P * s, rank, layout
        self.q, self.k, self.v, self.dout = (torch.randn(1, s, h, d, device=ctx.device, dtype=dtype) for _ in range(4))
        self.pos = [shard_positions(self.S, layout=layout, ring_rank=src, ring_size=P, device=ctx.device)
                    for src in range(P)]
        self.kv_full = torch.empty(2, 1, self.S, h, d, device=ctx.device, dtype=dtype)
        for p in self.pos:
            self.kv_full[0].index_copy_(1, p, self.k)
            self.kv_full[1].index_copy_(1, p, self.v)
        self.runs = _runs(self.pos[rank])

    def plain_fwd(self):
        import torch

        from fusedpar.kernels import flash_attention_forward

        q = self.q
        out = torch.empty_like(q)
        lse = torch.empty((1, q.shape[2], q.shape[1]), device=q.device, dtype=torch.float32)
        for ls, ln, g in self.runs:
            sl = slice(ls, ls + ln)
            flash_attention_forward(q[:, sl], self.kv_full[0], self.kv_full[1], causal=True, q_offset=g,
                                    k_offset=0, out=out[:, sl], lse=lse[:, :, sl])
        return out, lse

    def plain_bwd(self, out, lse):
        import torch

        from fusedpar.kernels import flash_attention_backward

        q = self.q
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # accumulate mode adds into it
        dkv = torch.zeros(self.kv_full.shape, device=q.device, dtype=torch.float32)
        for ls, ln, g in self.runs:
            sl = slice(ls, ls + ln)
            flash_attention_backward(self.dout[:, sl], q[:, sl], self.kv_full[0], self.kv_full[1], out[:, sl],
                                     lse[:, :, sl], causal=True, q_offset=g, k_offset=0, dq=dq[:, sl], dk=dkv[0],
                                     dv=dkv[1], accumulate=True)
        return dq, dkv

    def fold(self, dkv_full):
        """dK/dV of this rank's K/V: the sum over every position it stands at."""
        return sum(dkv_full.index_select(2, p) for p in self.pos)

    def ring_fwd(self, transport):
        from fusedpar.ops.sequence_parallel.bodies import ring_attention_fwd

        return ring_attention_fwd(self.q, self.k, self.v, transport, causal=True, layout=self.layout)

    def ring_bwd(self, transport, out, lse):
        from fusedpar.ops.sequence_parallel.bodies import ring_attention_bwd

        return ring_attention_bwd(self.dout, self.q, self.k, self.v, out, lse, transport, causal=True,
                                  layout=self.layout)

    def check(self, transport):
        """Max relative error of the ring's out, dq, dk, dv against the plain flash baseline."""
        out, lse = self.ring_fwd(transport)
        plain_out, plain_lse = self.plain_fwd()
        err = check_close(out, plain_out)
        dq, dk, dv = self.ring_bwd(transport, out, lse)
        pdq, pdkv = self.plain_bwd(plain_out, plain_lse)
        pdk, pdv = self.fold(pdkv)
        return max(err, check_close(dq, pdq), check_close(dk, pdk), check_close(dv, pdv))


@register("ring_attention", "the shipped ring attention, one rank of P on one GPU (EmulatedTransport)",
          add_args=_add_ring_args)
def run_ring(args, ctx):
    import torch

    from fusedpar.ops.comm.transport import EmulatedTransport

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
    prob = _MirrorProblem(ctx, dtype, P, s, h, d, r)
    overlapped, sequential = EmulatedTransport(P, r), _blocking_transport(P, r)
    err = prob.check(overlapped)
    out, lse = prob.ring_fwd(overlapped)
    plain_out, plain_lse = prob.plain_fwd()
    kv = torch.stack((prob.k, prob.v))
    bufs = [torch.empty_like(kv) for _ in range(2)]

    def transfers():  # the forward's P - 1 K/V shifts alone
        src = kv
        for step in range(P - 1):
            overlapped.ring_shift(src, bufs[step % 2]).wait()
            src = bufs[step % 2]

    t_plain = ctx.time_ms(prob.plain_fwd)
    t_comm = ctx.time_ms(transfers)
    t_seq = ctx.time_ms(lambda: prob.ring_fwd(sequential))
    t_ovl = ctx.time_ms(lambda: prob.ring_fwd(overlapped))
    t_plain_b = ctx.time_ms(lambda: prob.plain_bwd(plain_out, plain_lse))
    t_seq_b = ctx.time_ms(lambda: prob.ring_bwd(sequential, out, lse))
    t_ovl_b = ctx.time_ms(lambda: prob.ring_bwd(overlapped, out, lse))
    flops = 4.0 * h * s * prob.S * d / 2
    # overlap efficiency: the share of the shorter of compute and transfers that the overlapped
    # ring hides, with the compute time taken as the sequential ring's time less the transfers
    t_compute = max(t_seq - t_comm, 1e-9)
    overlap = (t_compute + t_comm - t_ovl) / max(min(t_compute, t_comm), 1e-9)
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the emulated transfers run inline; these numbers are not performance.")
    return [{
        "ranks": P, "rank": r, "tokens_per_rank": s, "heads": h, "head_dim": d,
        "dtype": str(dtype).replace("torch.", ""),
        "plain_kernel_ms": t_plain, "T_comm_ms": t_comm, "T_sequential_ms": t_seq, "T_overlapped_ms": t_ovl,
        "efficiency_vs_plain": t_plain / t_ovl, "overlap_efficiency": overlap,
        "bwd_plain_ms": t_plain_b, "bwd_sequential_ms": t_seq_b, "bwd_overlapped_ms": t_ovl_b,
        "bwd_efficiency_vs_plain": t_plain_b / t_ovl_b,
        "plain_TFLOPs": tflops(flops, t_plain), "max_rel_err": err,
    }]


# ----------------------------------------------------------------------------------------------
# packed variable-length documents against a padded batch of the same documents
# ----------------------------------------------------------------------------------------------
def _add_varlen_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp32 (CPU default)")
    p.add_argument("--lengths", type=_ints, default=None,
                   help="comma-separated document lengths (GPU default: 64 seeded lengths, 32..4096 tokens)")
    p.add_argument("--head-dim", type=int, default=None, help="GPU default 128")
    p.add_argument("--heads", type=int, default=None, help="GPU default 16")


def _doc_lengths(ctx, lengths):
    import torch

    if lengths:
        if any(n <= 0 for n in lengths):
            raise ValueError(f"--lengths must be positive, got {lengths}")
        return lengths
    if not ctx.gpu:
        return [5, 1, 9]
    g = torch.Generator().manual_seed(0)  # long-tailed: many short documents, a few long ones
    return [int(n) for n in (2 ** (5 + 7 * torch.rand(64, generator=g))).long().clamp_(32, 4096)]


@register("varlen_attention", "packed varlen flash attention vs a padded batch of the same documents (causal)",
          add_args=_add_varlen_args)
def run_varlen(args, ctx):
    import torch

    from fusedpar.kernels import (
        flash_attention_backward,
        flash_attention_forward,
        flash_attention_varlen,
        flash_attention_varlen_backward,
    )

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    lengths = _doc_lengths(ctx, args.lengths)
    d = args.head_dim or (128 if ctx.gpu else 16)
    h = args.heads or (16 if ctx.gpu else 2)
    n, total, longest = len(lengths), sum(lengths), max(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=ctx.device)
    q, k, v, do = (torch.randn(total, h, d, device=ctx.device, dtype=dtype) for _ in range(4))
    # the padded batch: document i in row i, its tail padded (padding at the end is invisible to
    # the real rows under the causal mask, so the real rows are exact)
    rows = torch.cat([torch.arange(a, a + ln) for a, ln in zip(cu.tolist(), lengths)]).to(ctx.device)
    slots = torch.cat([torch.arange(i * longest, i * longest + ln) for i, ln in enumerate(lengths)]).to(ctx.device)

    def padded(t):
        p = torch.zeros(n * longest, *t.shape[1:], device=ctx.device, dtype=t.dtype)
        p[slots] = t[rows]
        return p.view(n, longest, *t.shape[1:])

    qp, kp, vp, dop = (padded(t) for t in (q, k, v, do))
    out, lse = flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
    out_p, lse_p = flash_attention_forward(qp, kp, vp, causal=True)
    err = check_close(out, out_p.reshape(n * longest, h, d)[slots])
    dq = flash_attention_varlen_backward(do, q, k, v, out, lse, cu, cu, longest, longest, causal=True)[0]
    dq_p = flash_attention_backward(dop, qp, kp, vp, out_p, lse_p, causal=True)[0]
    err = max(err, check_close(dq, dq_p.reshape(n * longest, h, d)[slots]))
    t_fwd = ctx.time_ms(lambda: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True))
    t_bwd = ctx.time_ms(lambda: flash_attention_varlen_backward(do, q, k, v, out, lse, cu, cu, longest, longest,
                                                                causal=True))
    t_fwd_p = ctx.time_ms(lambda: flash_attention_forward(qp, kp, vp, causal=True))
    t_bwd_p = ctx.time_ms(lambda: flash_attention_backward(dop, qp, kp, vp, out_p, lse_p, causal=True))
    flops = sum(4.0 * h * ln * ln * d / 2 for ln in lengths)  # useful work: causal, per document
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    else:
        ctx.notes.append("padded baseline: the same flash kernels on [docs, longest, heads, d]; "
                         "TFLOPs count useful (per-document causal) work only, bwd as 2.5x fwd.")
    return [{
        "docs": n, "tokens": total, "longest": longest, "padded_tokens": n * longest, "heads": h, "head_dim": d,
        "dtype": str(dtype).replace("torch.", ""),
        "varlen_fwd_ms": t_fwd, "padded_fwd_ms": t_fwd_p, "fwd_speedup": t_fwd_p / t_fwd,
        "varlen_bwd_ms": t_bwd, "padded_bwd_ms": t_bwd_p, "bwd_speedup": t_bwd_p / t_bwd,
        "varlen_fwd_TFLOPs": tflops(flops, t_fwd), "varlen_bwd_TFLOPs": tflops(2.5 * flops, t_bwd),
        "max_rel_err": err,
    }]
