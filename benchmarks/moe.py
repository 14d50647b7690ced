"""``python -m benchmarks moe``: MoE kernels and the routed MLP.

Rows (each with a correctness check against its baseline before timing):

* ``grouped_gemm``: fusedpar.kernels.grouped_matmul vs torch's grouped GEMM
  (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``) on the first expert projection
  ``[T*k, H] x [E, H, 2F]``, routed rows spread over the experts as a real router would;
* ``grouped_gemm_fp8`` (one row per recipe, ``rowwise`` and ``blockwise``): the same projection
  with e4m3 operands (the activations quantised per token / 1x128 tile as the fp8 dispatch sends
  them, the weights per expert row / 128x128 block; fp32 accumulation promoted every 128, output
  in the run's dtype) against the 16-bit grouped GEMM of the ``grouped_gemm`` row
  (``ratio_vs_baseline``: its time over the fp8 one's), checked against the fp32 grouped GEMM of
  the dequantised operands; ``quantize_ms``: the per-token quantisation of the routed rows (both
  GEMM rows record what ran: ``config``, ``loads``, ``persistent``; ``gemm_loads.last_launch``);
* ``permute`` / ``unpermute``: token gather into expert order and the weighted combine back, in
  GB/s, against a device copy of the same number of bytes (``torch.Tensor.copy_``);
* ``layer_fwd_bwd``: the whole routed MLP (permute, grouped SwiGLU MLP, combine) forward +
  backward against a per-expert loop in plain torch (index, two matmuls, index_add);
* ``layer_fwd_bwd_fp8`` (one row per recipe): the same routed MLP with ``moe_mlp(fp8=recipe)``
  (tokens quantised per token / 1x128 tile before the permute, e4m3 expert GEMMs forward and
  backward, weights re-quantised each call from the high-precision ones) against the 16-bit
  ``moe_mlp`` of the ``layer_fwd_bwd`` row (``ratio_vs_baseline``: its time over the fp8 one's),
  checked against it within two e4m3 roundings (2^-3 of the output's scale);
* ``ep_layer_fwd_bwd``: the shipped expert-parallel schedule of ``fusedpar.ops.moe_mlp``
  (chunked all-to-all-v, expert GEMMs of a chunk while later chunks travel) as rank 0 of ``--ep``
  ranks emulated on this device (``EmulatedTransport``), against the same layer on one rank;
* ``deepseek_v3_layer_fwd_bwd``: DeepSeek-V3's routed layer, router included (``fusedpar.nn.MoE``:
  sigmoid scores, the selection-only correction bias, 8 groups of which the top 4 are searched,
  top-8 of 256 experts, renormalised weights times 2.5; hidden 7168, expert ffn 2048, ``--tokens``
  default 4096) forward + backward, as **one rank of ``--deepseek-ep`` (default 8) expert-parallel
  ranks** emulated on this device (``EmulatedTransport``: its 32 experts' weights, 2.8 GB in bf16
  instead of the layer's 22.5 GB, which with their gradients and the baseline's copies do not fit
  one 80 GB GPU). The emulation's mirror rule sends this rank every routed row (global expert
  ``e`` served by local expert ``e % 32``), so its grouped GEMMs do the whole layer's work in
  the layer's 256 groups. Baseline: the same router in plain torch (transformers'
  ``DeepseekV3TopkRouter`` formulas) and a per-expert loop over the 256 experts with those
  weights. Its own shape (``--hidden``, ``--ffn``, ``--experts``, ``--top-k`` do not apply):
  ``--deepseek-shape full`` (GPU default) or ``smoke`` (CPU default: 16 experts, top-4, hidden
  32, 2 emulated ranks; the tests pass it on a GPU too).

Default GPU shape of the other rows: hidden 4096, 64 experts, top-8, 8192 tokens, ffn 1024 (bf16).
Off GPU a tiny smoke shape runs under the interpreter (its numbers are not performance). Every
input is drawn on the device, from a seeded device generator.

Cost of the GPU default on one H100 (counted for sm_90 with ``benchmarks._capture``, no GPU): 100
kernel variants to compile (76 grouped GEMM: 38 per group-count bucket, the 64-group rows' and
the DeepSeek-V3 row's 256 groups, ``G_PAD`` being a constexpr; 10 weight-gradient; 14 routing,
permute, combine and top-k) and 118 autotuner benchmarks over 15 tuning keys. At the ~0.3 s per
compile and ~0.15 s per tuning benchmark the 2026-11-27 matmul round implies (16 compiles, 64
tuning benchmarks and 8 timings in 19 s), about 50 s, plus ~10 s of start-up and timed runs (the
per-expert loops: 64 and 256 iterations): ~60 s, an estimate (not yet measured on the GPU).
``--experts 256`` puts every row in one bucket (58 variants). The former default compiled and
tuned as much, but its DeepSeek-V3 row (one rank, all 256 experts) drew ~1.1e10 weights twice
on the CPU, serially (minutes: the round stopped the op at 254 s), and needed about 90 GB of GPU
memory (weights, the baseline's copies, both gradients); its other rows drew ~9e8 on the CPU.
The ``grouped_gemm_fp8`` rows (counted apart) add 14 grouped GEMM variants (the 7 fp8 tiles the
plain epilogue keeps, per recipe) with as many tuning benchmarks and 4 quantisation kernels: about
8 s by the same estimate, plus the fp32 reference GEMM of each check (2 GB of dequantised weights).
"""
from __future__ import annotations

from types import SimpleNamespace

from ._common import check_close, gbps, parse_dtype, register, tflops
from fusedpar.nn import MoEConfig


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="expert ffn width F (w1 has 2F rows: gate, up)")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--ep", type=int, default=None,
                   help="emulated expert-parallel ranks of the ep row (default: the smallest divisor > 1 of --experts)")
    p.add_argument("--chunks", type=int, default=2,
                   help="dispatch chunks of the expert-parallel pipeline (the ep and DeepSeek-V3 rows)")
    p.add_argument("--deepseek-shape", choices=["full", "smoke"], default=None,
                   help="the DeepSeek-V3 row: its real shape (GPU default) or the tiny smoke one (CPU default)")
    p.add_argument("--deepseek-ep", type=int, default=None,
                   help="emulated expert-parallel ranks of the DeepSeek-V3 row (default 8; smoke shape 2)")


def _torch_grouped_mm():
    import torch
    import torch.nn.functional as F

    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _loop_mlp(x, ids, weights, w1, w2, num_experts=None):
    """The baseline a user writes without grouped kernels: one gather + two matmuls per expert.
    ``num_experts`` (default: the weights' count) global experts, expert ``e`` computed with
    ``w1[e % len(w1)]`` (the weights one emulated expert-parallel rank holds)."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    flat = ids.reshape(-1)
    for e in range(num_experts or w1.shape[0]):
        slots = (flat == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tok = slots // ids.shape[1]
        local = e % w1.shape[0]
        pre = x[tok] @ w1[local].t()
        gate, up = pre.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[local].t()
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[slots, None].float())
    return out.to(x.dtype)


def _inputs(args, ctx):
    """The problem: tokens, router choices, expert weights and the shape columns of every row."""
    import torch

    gpu = ctx.gpu
    dtype = args.dtype or (torch.bfloat16 if gpu else torch.float32)
    T = args.tokens or (8192 if gpu else 24)
    H = args.hidden or (4096 if gpu else 32)
    Fd = args.ffn or (1024 if gpu else 24)
    E = args.experts or (64 if gpu else 4)
    k = args.top_k or (8 if gpu else 2)
    if not 1 <= k <= E:
        raise SystemExit(f"--top-k must be in [1, --experts={E}], got {k}")
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(0)  # drawn on the device: no host-side RNG over the weights
    x = torch.randn(T, H, generator=g, device=dev, dtype=dtype)
    probs, ids = torch.softmax(torch.randn(T, E, generator=g, device=dev), -1).topk(k, dim=-1)
    w1 = torch.empty(E, 2 * Fd, H, device=dev, dtype=dtype).normal_(0.0, H ** -0.5, generator=g)
    w2 = torch.empty(E, H, Fd, device=dev, dtype=dtype).normal_(0.0, Fd ** -0.5, generator=g)
    go = torch.randn(T, H, generator=g, device=dev, dtype=dtype)
    shape = {"tokens": T, "hidden": H, "ffn": Fd, "experts": E, "top_k": k, "dtype": str(dtype).replace("torch.", "")}
    return SimpleNamespace(T=T, H=H, Fd=Fd, E=E, k=k, dtype=dtype, x=x, ids=ids, weights=probs, w1=w1, w2=w2, go=go,
                           shape=shape)


def _grouped_gemm_row(ctx, d, xp, offsets):
    from fusedpar.kernels import grouped_matmul
    from fusedpar.kernels.gemm_loads import last_launch

    fn = _torch_grouped_mm()
    w1_kn = d.w1.transpose(1, 2)  # [E, H, 2F] view, no copy
    ends = offsets[1:]  # int32, as torch's grouped mm wants
    # offsets straight from routing_metadata are correct by construction: no host read per call
    ours = lambda: grouped_matmul(xp, d.w1, offsets, check_offsets=False)  # noqa: E731
    flops = 2.0 * d.T * d.k * d.H * 2 * d.Fd
    row = {"bench": "grouped_gemm", **d.shape}
    if fn is not None:
        theirs = lambda: fn(xp, w1_kn, offs=ends)  # noqa: E731
        row["max_rel_err"] = check_close(ours(), theirs())
        t_ours, t_base = ctx.time_ms(ours), ctx.time_ms(theirs)
        row.update(fusedpar_ms=t_ours, baseline_ms=t_base, fusedpar_TFLOPs=tflops(flops, t_ours),
                   baseline_TFLOPs=tflops(flops, t_base), ratio_vs_baseline=t_base / t_ours,
                   baseline="torch grouped_mm")
    else:
        ctx.notes.append("torch has no grouped_mm here: grouped GEMM row has no baseline")
        t_ours = ctx.time_ms(ours)
        row.update(fusedpar_ms=t_ours, fusedpar_TFLOPs=tflops(flops, t_ours), max_rel_err=0.0)
    ours()
    return {**row, **last_launch("grouped_matmul")}


def _grouped_gemm_fp8_rows(ctx, d, xp, offsets):
    """The fp8 grouped GEMM (each recipe) against the 16-bit one (module docstring)."""
    import torch

    from fusedpar.kernels import dequantize_e4m3, grouped_matmul, quantize_e4m3
    from fusedpar.kernels.fp8_gemm import FP8_RECIPES
    from fusedpar.kernels.gemm_loads import last_launch

    t_base = ctx.time_ms(lambda: grouped_matmul(xp, d.w1, offsets, check_offsets=False))
    flops = 2.0 * d.T * d.k * d.H * 2 * d.Fd
    rows = []
    for recipe, (ga, gw) in FP8_RECIPES.items():
        (xq, xs), (wq, ws) = quantize_e4m3(xp, ga), quantize_e4m3(d.w1, gw)

        def ours(xq=xq, xs=xs, wq=wq, ws=ws, recipe=recipe):
            return grouped_matmul(xq, wq, offsets, check_offsets=False, x_scale=xs, weight_scale=ws, scaling=recipe,
                                  out_dtype=d.dtype)

        # the reference: the fp32 grouped GEMM of the dequantised operands (exact up to the sums)
        wd = torch.stack([dequantize_e4m3(wq[e], ws[e], gw, torch.float32) for e in range(d.E)])
        err = check_close(ours(), grouped_matmul(dequantize_e4m3(xq, xs, ga, torch.float32), wd, offsets,
                                                 check_offsets=False))
        del wd
        t_ours, t_quant = ctx.time_ms(ours), ctx.time_ms(lambda ga=ga: quantize_e4m3(xp, ga))
        ours()
        rows.append({"bench": "grouped_gemm_fp8", **d.shape, "recipe": recipe, "fusedpar_ms": t_ours,
                     "baseline_ms": t_base, "baseline": f"fusedpar grouped_matmul ({d.shape['dtype']})",
                     "fusedpar_TFLOPs": tflops(flops, t_ours), "baseline_TFLOPs": tflops(flops, t_base),
                     "ratio_vs_baseline": t_base / t_ours, "quantize_ms": t_quant, "max_rel_err": err,
                     **last_launch("grouped_matmul")})
    return rows


def _copy_ms(ctx, n, dtype):
    """Milliseconds of a device copy of ``n`` elements (the bandwidth baseline)."""
    import torch

    src = torch.empty(n, device=ctx.device, dtype=dtype)
    dst = torch.empty_like(src)
    return ctx.time_ms(lambda: dst.copy_(src))


def _bandwidth_row(name, d, t, t_copy, nbytes, err):
    return {"bench": name, **d.shape, "fusedpar_ms": t, "baseline_ms": t_copy, "baseline": "copy_ same bytes",
            "fusedpar_GBs": gbps(nbytes, t), "baseline_GBs": gbps(nbytes, t_copy),
            "ratio_vs_baseline": t_copy / t, "max_rel_err": err}


def _permute_rows(ctx, d, xp, slot_pos, sorted_slot):
    from fusedpar.kernels import combine, permute

    T, k, H = d.T, d.k, d.H
    esize = d.x.element_size()
    ref_p = d.x[sorted_slot.long().clamp_min(0) // k]
    n_perm = T * k * H  # elements read and written
    t_copy = _copy_ms(ctx, n_perm, d.dtype)
    err = check_close(permute(d.x, sorted_slot, k), ref_p, tol=0.0)
    t = ctx.time_ms(lambda: permute(d.x, sorted_slot, k))
    rows = [_bandwidth_row("permute", d, t, t_copy, 2 * n_perm * esize, err)]
    y = xp  # any expert-ordered rows
    ref_c = (y[slot_pos.long()].view(T, k, H).float() * d.weights[..., None]).sum(1)
    err = check_close(combine(y, slot_pos, d.weights, k), ref_c, tol=1e-2)
    n_comb = T * k * H + T * H  # read the k rows of every token, write one
    t_copy = _copy_ms(ctx, n_comb // 2, d.dtype)
    t = ctx.time_ms(lambda: combine(y, slot_pos, d.weights, k))
    rows.append(_bandwidth_row("unpermute", d, t, t_copy, n_comb * esize, err))
    return rows


def _fwd_bwd(leaves, go, fn):
    """A timed step: clear the gradients, run ``fn(*leaves)`` forward and backward."""
    def step():
        for t_ in leaves:
            t_.grad = None
        out = fn(*leaves)
        out.backward(go)
        return out

    return step


def _layer_row(ctx, d):
    from fusedpar.ops import moe_mlp

    leaves = [t_.clone().requires_grad_() for t_ in (d.x, d.weights, d.w1, d.w2)]
    fused = _fwd_bwd(leaves, d.go, lambda x, w, w1, w2: moe_mlp(x, d.ids, w, w1, w2, num_experts=d.E))
    loop = _fwd_bwd(leaves, d.go, lambda x, w, w1, w2: _loop_mlp(x, d.ids, w, w1, w2))
    err = check_close(fused().detach(), loop().detach())
    t_ours, t_base = ctx.time_ms(fused), ctx.time_ms(loop)
    flops = 3 * 2.0 * d.T * d.k * (d.H * 2 * d.Fd + d.Fd * d.H)  # fwd + 2x for bwd
    return {"bench": "layer_fwd_bwd", **d.shape, "fusedpar_ms": t_ours, "baseline_ms": t_base,
            "baseline": "per-expert torch loop", "fusedpar_TFLOPs": tflops(flops, t_ours),
            "baseline_TFLOPs": tflops(flops, t_base), "ratio_vs_baseline": t_base / t_ours, "max_rel_err": err}


def _layer_fp8_rows(ctx, d):
    from fusedpar.kernels.fp8_gemm import FP8_RECIPES
    from fusedpar.ops import moe_mlp

    leaves = [t_.clone().requires_grad_() for t_ in (d.x, d.weights, d.w1, d.w2)]
    bf16 = _fwd_bwd(leaves, d.go, lambda x, w, w1, w2: moe_mlp(x, d.ids, w, w1, w2, num_experts=d.E))
    reference = bf16().detach()
    t_base = ctx.time_ms(bf16)
    flops = 3 * 2.0 * d.T * d.k * (d.H * 2 * d.Fd + d.Fd * d.H)
    rows = []
    for recipe in FP8_RECIPES:
        fp8 = _fwd_bwd(leaves, d.go, lambda x, w, w1, w2, r=recipe: moe_mlp(x, d.ids, w, w1, w2, num_experts=d.E,
                                                                             fp8=r))
        err = check_close(fp8().detach(), reference, tol=2 ** -3)
        t_ours = ctx.time_ms(fp8)
        rows.append({"bench": "layer_fwd_bwd_fp8", **d.shape, "recipe": recipe, "fusedpar_ms": t_ours,
                     "baseline_ms": t_base, "baseline": f"moe_mlp ({str(d.x.dtype).replace('torch.', '')})",
                     "fusedpar_TFLOPs": tflops(flops, t_ours), "baseline_TFLOPs": tflops(flops, t_base),
                     "ratio_vs_baseline": t_base / t_ours, "max_rel_err": err})
    return rows


DEEPSEEK_V3 = dict(hidden=7168, ffn=2048, experts=256, top_k=8, n_group=8, topk_group=4, scale=2.5, ep=8, tokens=4096)
DEEPSEEK_V3_SMOKE = dict(DEEPSEEK_V3, hidden=32, ffn=16, experts=16, top_k=4, ep=2, tokens=24)


def _torch_deepseek_router(x, weight, bias, c):
    """DeepSeek-V3's router in plain torch: sigmoid scores; groups ranked by the sum of their two
    best biased scores; the top-k of the best groups' biased scores; weights the unbiased scores
    of those, renormalised, times the scaling factor."""
    import torch

    scores = torch.sigmoid(x.float() @ weight.float().t())
    biased = scores + bias
    T, E = scores.shape
    group = biased.view(T, c["n_group"], E // c["n_group"]).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(c["topk_group"], dim=-1).indices, 1.0)
    mask = keep.repeat_interleave(E // c["n_group"], dim=1).bool()
    ids = biased.masked_fill(~mask, float("-inf")).topk(c["top_k"], dim=-1).indices
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * c["scale"], ids


def _deepseek_v3_row(ctx, args):
    """The DeepSeek-V3 routed layer (router + experts) forward + backward as one rank of ``ep``
    emulated expert-parallel ranks (module docstring) vs plain torch. The two routers may order
    near-ties differently in the last bit: outputs are compared on the tokens whose chosen experts
    agree (all but a few; fewer than 99% raises)."""
    import torch

    from fusedpar.nn import MoE
    from fusedpar.ops.comm.transport import EmulatedTransport

    c = DEEPSEEK_V3 if (args.deepseek_shape or ("full" if ctx.gpu else "smoke")) == "full" else DEEPSEEK_V3_SMOKE
    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    T = args.tokens or c["tokens"]
    H, Fd, E, k = c["hidden"], c["ffn"], c["experts"], c["top_k"]
    ep = args.deepseek_ep or c["ep"]
    if ep < 1 or E % ep:
        raise SystemExit(f"--deepseek-ep must be a positive divisor of {E} (DeepSeek-V3's experts), got {ep}")
    dev = ctx.device
    # built on meta (nothing drawn), then every value drawn on the device
    config = MoEConfig(H, Fd, E, k, score="sigmoid", normalize=True, n_group=c["n_group"],
                       topk_group=c["topk_group"], routed_scaling_factor=c["scale"], score_bias=True,
                       aux_loss_coef=0.0, z_loss_coef=0.0, num_chunks=args.chunks)
    moe = MoE(config, transport=EmulatedTransport(ep, 0) if ep > 1 else None, device="meta",
              dtype=dtype).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    with torch.no_grad():
        for p, std in ((moe.router.weight, H ** -0.5), (moe.w1, H ** -0.5), (moe.w2, Fd ** -0.5)):
            p.normal_(0.0, std, generator=g)
        moe.router.e_score_correction_bias.normal_(0.0, 0.05, generator=g)
    x = torch.randn(T, H, generator=g, device=dev, dtype=dtype).requires_grad_()
    go = torch.randn(T, H, generator=g, device=dev, dtype=dtype)
    bias = moe.router.e_score_correction_bias
    base = [t_.detach().clone().requires_grad_() for t_ in (x, moe.router.weight, moe.w1, moe.w2)]

    def baseline(xb, wr, w1, w2):  # global expert e with local weights e % (E / ep), as the emulated rank
        w, ids = _torch_deepseek_router(xb, wr, bias, c)
        return _loop_mlp(xb, ids, w, w1, w2, num_experts=E), ids

    leaves = [x, *moe.parameters()]
    fused = _fwd_bwd(leaves, go, lambda xx, *_: moe(xx))  # the parameters are the module's
    loop = _fwd_bwd(base, go, lambda *a: baseline(*a)[0])
    y = fused().detach()
    y_ref, ids = baseline(*base)
    agree = (moe.router_output.expert_ids.sort(-1).values == ids.sort(-1).values).all(-1)
    if agree.float().mean() < 0.99:
        raise AssertionError(f"DeepSeek-V3 routers agree on {agree.float().mean():.3f} of the tokens, expected >= 0.99")
    err = check_close(y[agree], y_ref.detach()[agree])
    t_ours, t_base = ctx.time_ms(fused), ctx.time_ms(loop)
    flops = 3 * 2.0 * T * k * (H * 2 * Fd + Fd * H) + 3 * 2.0 * T * H * E
    shape = {"tokens": T, "hidden": H, "ffn": Fd, "experts": E, "top_k": k, "dtype": str(dtype).replace("torch.", ""),
             "groups": f"{c['topk_group']}/{c['n_group']}", "ep": ep, "experts_per_rank": E // ep,
             "chunks": args.chunks if ep > 1 else 1}
    return {"bench": "deepseek_v3_layer_fwd_bwd", **shape, "fusedpar_ms": t_ours, "baseline_ms": t_base,
            "baseline": "torch router + per-expert loop", "fusedpar_TFLOPs": tflops(flops, t_ours),
            "baseline_TFLOPs": tflops(flops, t_base), "ratio_vs_baseline": t_base / t_ours, "max_rel_err": err,
            "routing_agreement": float(agree.float().mean())}


def _ep_size(requested, E):
    if requested is None:
        return next(p for p in range(2, E + 1) if E % p == 0) if E > 1 else 1
    if requested < 1 or E % requested:
        raise SystemExit(f"--ep must be a positive divisor of --experts={E}, got {requested}")
    return requested


def _ep_row(ctx, d, ep, chunks):
    """Rank 0 of ``ep`` emulated ranks. The emulation's mirror rule (every peer sends what this
    rank sends, i.e. every peer is this rank: same tokens, routing and expert weights) means
    global expert ``e`` is served by local expert ``e % E_local``: the reference is the layer on
    one rank with the local experts tiled ``ep`` times."""
    from fusedpar.ops import moe_mlp
    from fusedpar.ops.comm.transport import EmulatedTransport

    e_loc = d.E // ep
    transport = EmulatedTransport(ep, 0)
    w1, w2 = d.w1[:e_loc], d.w2[:e_loc]
    ep_leaves = [t_.clone().requires_grad_() for t_ in (d.x, d.weights, w1, w2)]
    one_leaves = [t_.clone().requires_grad_() for t_ in (d.x, d.weights, w1.repeat(ep, 1, 1), w2.repeat(ep, 1, 1))]
    fused = _fwd_bwd(ep_leaves, d.go, lambda x, w, a, b: moe_mlp(x, d.ids, w, a, b, num_experts=d.E,
                                                                 transport=transport, num_chunks=chunks))
    single = _fwd_bwd(one_leaves, d.go, lambda x, w, a, b: moe_mlp(x, d.ids, w, a, b, num_experts=d.E))
    err = check_close(fused().detach(), _loop_mlp(d.x, d.ids, d.weights, *one_leaves[2:]).detach())
    t_ours, t_base = ctx.time_ms(fused), ctx.time_ms(single)
    flops = 3 * 2.0 * d.T * d.k * (d.H * 2 * d.Fd + d.Fd * d.H)
    return {"bench": "ep_layer_fwd_bwd", **d.shape, "ep": ep, "chunks": chunks, "fusedpar_ms": t_ours,
            "baseline_ms": t_base, "baseline": "moe_mlp on one rank", "fusedpar_TFLOPs": tflops(flops, t_ours),
            "baseline_TFLOPs": tflops(flops, t_base), "ratio_vs_baseline": t_base / t_ours, "max_rel_err": err}


@register("moe", "MoE: grouped GEMM (16-bit and fp8), permute/unpermute, routed MLP fwd+bwd (one rank, "
                 "emulated EP), DeepSeek-V3 layer",
          add_args=_add_args)
def run(args, ctx):
    from fusedpar.kernels import permute, routing_metadata

    d = _inputs(args, ctx)
    ep = _ep_size(args.ep, d.E)
    if args.chunks < 1:
        raise SystemExit(f"--chunks must be >= 1, got {args.chunks}")
    _, offsets, slot_pos, sorted_slot = routing_metadata(d.ids, d.E)
    xp = permute(d.x, sorted_slot, d.k)
    rows = [_grouped_gemm_row(ctx, d, xp, offsets)]
    rows += _grouped_gemm_fp8_rows(ctx, d, xp, offsets)
    rows += _permute_rows(ctx, d, xp, slot_pos, sorted_slot)
    rows.append(_layer_row(ctx, d))
    rows += _layer_fp8_rows(ctx, d)
    rows.append(_ep_row(ctx, d, ep, args.chunks))
    rows.append(_deepseek_v3_row(ctx, args))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows
