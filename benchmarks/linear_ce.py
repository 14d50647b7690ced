"""``python -m benchmarks linear_ce``: the fused linear + vocabulary-parallel cross entropy
(:func:`fusedpar.ops.linear_cross_entropy`) against the materialised path (the head GEMM, then
:func:`fusedpar.ops.vocab_parallel_cross_entropy` of the logits): time of forward + backward and
peak memory above the inputs (``torch.cuda.max_memory_allocated``), for the Llama-3 heads. Each
row also gives the matrix FLOPs of both (the fused path: the forward's logits GEMM and the
backward's three, ``8 T V H``; the materialised one: three, ``6 T V H``), their rates, and the
backward's vocabulary block (``Vb`` rows of the shard per block), and what the statistics and
logit-gradient GEMMs ran (``stats_*`` / ``dlogits_*``: config, loads, persistent;
``fusedpar.kernels.gemm_loads.last_launch``).

One GPU: ``--tp`` runs one rank's vocabulary shard (``V / tp`` rows) without the (small)
collectives. The baseline's GEMM is ``torch.nn.functional.linear`` (cuBLAS, differentiable)."""
from __future__ import annotations

import argparse

from ._common import check_close, parse_dtype, register

# (name, tokens per rank, hidden, vocabulary): Llama-3 8B / 70B heads, 8k tokens
GPU_SHAPES = [("llama3-8b", 8192, 4096, 128256), ("llama3-70b", 8192, 8192, 128256)]
SMOKE_SHAPES = [("smoke", 48, 40, 250)]
HEADS = {name: (name, T, H, V) for name, T, H, V in GPU_SHAPES + SMOKE_SHAPES}


def _heads(text):
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in HEADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--heads must be a comma-separated subset of {sorted(HEADS)}, got {text!r}")
    return [HEADS[n] for n in names]


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp32 (CPU default)")
    p.add_argument("--tp", type=int, default=1, help="vocabulary shards: time one rank's V/tp rows")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="the op's working memory in rows of fp32 logits: the backward's [T, Vb] gradient block "
                        "takes at most their bytes (default: the op's, 256 MiB; 16 in smoke mode)")
    p.add_argument("--heads", type=_heads, default=None, metavar="NAMES",
                   help=f"comma-separated heads of {sorted(HEADS)} (default: the Llama-3 heads on a GPU, "
                        "smoke off it; 'smoke' runs the tiny head on a GPU too)")


def _peak(ctx, fn, reset):
    """``(result, peak MiB above what was allocated before)`` on a GPU; ``(result, None)`` off it.
    ``fn`` runs once before the measured call (then ``reset`` drops the gradients it left): the
    first launch of each GEMM shape autotunes, and Triton's benchmark then holds its L2-flush
    buffer (256 MiB) and a copy of every output it restores (the fused path's fp32 weight-gradient
    accumulator: 2 GiB at hidden 4096), which is the tuner's, once per shape, not the op's."""
    import torch

    if not ctx.gpu:
        return fn(), None
    fn()
    reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _row(ctx, name, T, H, V, dtype, tp, chunk):
    import torch
    import torch.nn.functional as F

    from fusedpar.kernels.gemm_loads import last_launch
    from fusedpar.ops import linear_cross_entropy, vocab_parallel_cross_entropy
    from fusedpar.ops.loss.bodies import default_chunk_tokens, vocab_block

    g = torch.Generator(device="cpu").manual_seed(0)
    v = V // tp
    h = (torch.randn(T, H, generator=g) * 0.5).to(ctx.device, dtype).requires_grad_()
    w = (torch.randn(v, H, generator=g) * H ** -0.5).to(ctx.device, dtype).requires_grad_()
    t = torch.randint(0, v, (T,), generator=g).to(ctx.device)  # this shard's ids (one rank, no exchange)

    def fused():
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, t, chunk_tokens=chunk)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def materialised():
        h.grad = w.grad = None
        loss = vocab_parallel_cross_entropy(F.linear(h, w), t)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def reset():
        h.grad = w.grad = None

    (l1, dh1, dw1), peak_fused = _peak(ctx, fused, reset)
    (l0, dh0, dw0), peak_mat = _peak(ctx, materialised, reset)
    err = max(check_close(l1, l0), check_close(dh1, dh0), check_close(dw1, dw0))
    t_fused, t_mat = ctx.time_ms(fused), ctx.time_ms(materialised)
    gemm = 2.0 * T * v * H  # one logits-sized GEMM
    return {
        "head": name, "tokens": T, "hidden": H, "vocab": V, "tp": tp, "dtype": str(dtype).replace("torch.", ""),
        "chunk_tokens": chunk or "default",
        "vocab_block": vocab_block(T, v, chunk or default_chunk_tokens(T, v), h.element_size()),
        "fused_ms": t_fused, "materialised_ms": t_mat, "fused_flops": 4 * gemm, "materialised_flops": 3 * gemm,
        "fused_TFLOPs": 4 * gemm / t_fused / 1e9, "materialised_TFLOPs": 3 * gemm / t_mat / 1e9,
        "ratio_vs_materialised": t_mat / t_fused, "fused_peak_MiB": peak_fused, "materialised_peak_MiB": peak_mat,
        "peak_ratio_vs_materialised": None if peak_mat is None else peak_fused / peak_mat,
        "logits_MiB": T * v * torch.finfo(dtype).bits / 8 / 2 ** 20, "max_rel_err": err,
        **{f"stats_{k}": x for k, x in last_launch("linear_ce_stats").items()},
        **{f"dlogits_{k}": x for k, x in last_launch("linear_ce_dlogits").items()},
    }


@register("linear_ce", "fused linear + vocab-parallel cross entropy vs logits + loss (time, peak memory)",
          add_args=_add_args)
def run(args, ctx):
    import torch

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    chunk = args.chunk_tokens or (None if ctx.gpu else 16)
    heads = args.heads or (GPU_SHAPES if ctx.gpu else SMOKE_SHAPES)
    # a Llama head named off GPU runs capped (the interpreter would take hours on it)
    heads = [(name, *(shape if ctx.gpu or name == "smoke" else ctx.smoke_shape(shape))) for name, *shape in heads]
    rows = [_row(ctx, name, T, H, V, dtype, args.tp, chunk) for name, T, H, V in heads]
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: Llama-3 heads shrunk to 48 tokens x hidden 40 x vocab 250 (chunks of 16); "
                         "the Triton interpreter is timed and peak memory is not measured: not performance.")
    return rows
