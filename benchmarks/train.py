"""``python -m benchmarks train``: single-GPU training throughput of the fusedpar Transformer.

One process, no parallel groups: every block runs the shipped kernels (fused-epilogue GEMMs,
flash attention, RMSNorm, and for the MoE variant the routing, permute and grouped GEMMs). A step
is forward, loss (+ the MoE router loss), backward and an AdamW step; the step time is the median
of ``--steps`` timed steps after ``--warmup`` untimed ones, each ended by a device synchronise.

Model FLOPs per step (the usual MFU convention: backward = 2x forward, recomputation not counted):
``6 * tokens * N_matmul`` for the projections (attention q/k/v/o, the MLP or the ``top_k`` active
experts and the router, the head; the embedding lookup counts nothing) plus
``3 * 4 * batch * seq^2 * heads * head_dim * layers`` for attention (halved when causal). MFU is
that over the step time and the device's dense bf16 peak (``--peak-tflops``; H100/H200 SXM: 989.4).
"""
from __future__ import annotations

import statistics
import time

from ._common import parse_dtype, register

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0}
# (name, overrides of the GPU default below)
GPU_VARIANTS = [("dense", {}), ("moe", {"num_experts": 8, "top_k": 2, "moe_ffn_hidden_size": 4096})]
GPU_DEFAULT = dict(vocab_size=32768, hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8,
                   ffn_hidden_size=14336)
SMOKE_DEFAULT = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)
SMOKE_VARIANTS = [("dense", {}), ("moe", {"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 24})]


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default) or fp32 (CPU default)")
    p.add_argument("--variant", choices=["dense", "moe", "all"], default="all")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (GPU default 4096)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (GPU default 3)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak of the device for this dtype (default: from the device name)")


def matmul_params(cfg) -> int:
    """Weights a token goes through in GEMMs: attention, active MLP/experts, router, head."""
    h, heads = cfg.hidden_size, cfg.num_heads
    d = cfg.head_dim or h // heads
    kv = cfg.num_kv_heads or heads
    total = cfg.hidden_size * cfg.vocab_size
    for layer in range(cfg.num_layers):
        total += 2 * h * heads * d + 2 * h * kv * d
        if cfg.is_moe(layer):
            total += cfg.top_k * 3 * h * (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) + h * cfg.num_experts
        else:
            total += 3 * h * cfg.ffn_hidden_size
    return total


def step_flops(cfg, batch: int, seq: int) -> float:
    d = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    attn = 3 * 4 * batch * seq * seq * cfg.num_heads * d * cfg.num_layers * (0.5 if cfg.causal else 1.0)
    return 6.0 * batch * seq * matmul_params(cfg) + attn


def peak_tflops(ctx, override):
    if override is not None:
        return override
    if not ctx.gpu:
        return float("nan")
    import torch

    name = torch.cuda.get_device_name(ctx.device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), float("nan"))


def _time_steps(ctx, step, warmup: int, steps: int) -> tuple[float, float]:
    import torch

    loss = float("nan")
    for _ in range(warmup):
        loss = step()
    times = []
    for _ in range(steps):
        if ctx.gpu:
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        loss = step()
        if ctx.gpu:
            torch.cuda.synchronize(ctx.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), float(loss)


def _one_variant(args, ctx, name, overrides, dtype):
    import torch

    from fusedpar.nn import Transformer, TransformerConfig

    base = dict(GPU_DEFAULT if ctx.gpu else SMOKE_DEFAULT)
    base.update({k: v for k, v in (("hidden_size", args.hidden), ("num_layers", args.layers)) if v is not None})
    cfg = TransformerConfig(**base, **overrides)
    seq = args.seq or (4096 if ctx.gpu else 16)
    model = Transformer(cfg, device=ctx.device, dtype=dtype, aux_loss_scale=1.0 if cfg.num_experts else 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(cfg.vocab_size, (args.batch, seq + 1), generator=g).to(ctx.device)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = model.loss(model(inp, return_hidden=True), tgt)  # the head fused into the loss
        aux = model.aux_loss()
        (loss if aux is None else loss + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    warmup = args.warmup if args.warmup is not None else (3 if ctx.gpu else 1)
    steps = args.steps if args.steps is not None else (10 if ctx.gpu else 2)
    ms, loss = _time_steps(ctx, step, warmup, steps)
    if not torch.isfinite(torch.tensor(loss)):
        raise RuntimeError(f"train benchmark {name}: the loss is {loss} (not finite)")
    flops = step_flops(cfg, args.batch, seq)
    peak = peak_tflops(ctx, args.peak_tflops)
    achieved = flops / (ms * 1e-3) / 1e12
    return {
        "variant": name, "dtype": str(dtype).replace("torch.", ""), "hidden": cfg.hidden_size,
        "layers": cfg.num_layers, "experts": cfg.num_experts, "batch": args.batch, "seq": seq,
        "matmul_params": matmul_params(cfg), "step_ms": ms, "tokens_per_s": args.batch * seq / (ms * 1e-3),
        "model_TFLOPs": achieved, "peak_TFLOPs": peak, "mfu": achieved / peak, "loss": loss,
    }


@register("train", "single-GPU training step of the Transformer (dense and MoE): tokens/s and MFU",
          add_args=_add_args, in_all=False)
def run(args, ctx):
    import torch

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    variants = GPU_VARIANTS if ctx.gpu else SMOKE_VARIANTS
    rows = [_one_variant(args, ctx, name, over, dtype) for name, over in variants
            if args.variant in ("all", name)]
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: a tiny model under the Triton interpreter; not performance.")
    return rows
