"""``python -m benchmarks moe``: MoE kernels and the routed MLP.

Rows (each with a correctness check against its baseline before timing):

* ``grouped_gemm``: fusedpar.kernels.grouped_matmul vs torch's grouped GEMM
  (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``) on the first expert projection
  ``[T*k, H] x [E, H, 2F]``, routed rows spread over the experts as a real router would;
* ``permute`` / ``unpermute``: token gather into expert order and the weighted combine back, in
  GB/s, against a device copy of the same number of bytes (``torch.Tensor.copy_``);
* ``layer_fwd_bwd``: the whole routed MLP (permute, grouped SwiGLU MLP, combine) forward +
  backward against a per-expert loop in plain torch (index, two matmuls, index_add);
* ``ep_layer_fwd_bwd``: the shipped expert-parallel schedule of ``fusedpar.ops.moe_mlp``
  (chunked all-to-all-v, expert GEMMs of a chunk while later chunks travel) as rank 0 of ``--ep``
  ranks emulated on this device (``EmulatedTransport``), against the same layer on one rank;
* ``deepseek_v3_layer_fwd_bwd``: DeepSeek-V3's routed layer, router included (``fusedpar.nn.MoE``:
  sigmoid scores, the selection-only correction bias, 8 groups of which the top 4 are searched,
  top-8 of 256 experts, renormalised weights times 2.5; hidden 7168, expert ffn 2048, ``--tokens``
  default 4096) forward + backward against the same router in plain torch (transformers'
  ``DeepseekV3TopkRouter`` formulas) and the per-expert loop. Its own shape (``--hidden``,
  ``--ffn``, ``--experts``, ``--top-k`` do not apply); off GPU 16 experts, top-4, hidden 32.

Default GPU shape: hidden 4096, 64 experts, top-8, 8192 tokens, ffn 1024 (bf16). Off GPU a tiny
smoke shape runs under the interpreter (its numbers are not performance).
"""
from __future__ import annotations

from types import SimpleNamespace

from ._common import check_close, gbps, parse_dtype, register, tflops


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="expert ffn width F (w1 has 2F rows: gate, up)")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--ep", type=int, default=None,
                   help="emulated expert-parallel ranks of the ep row (default: the smallest divisor > 1 of --experts)")
    p.add_argument("--chunks", type=int, default=2, help="dispatch chunks of the expert-parallel pipeline")


def _torch_grouped_mm():
    import torch
    import torch.nn.functional as F

    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _loop_mlp(x, ids, weights, w1, w2):
    """The baseline a user writes without grouped kernels: one gather + two matmuls per expert."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    flat = ids.reshape(-1)
    for e in range(w1.shape[0]):
        slots = (flat == e).nonzero(as_tuple=True)[0]
        if slots.numel() == 0:
            continue
        tok = slots // ids.shape[1]
        pre = x[tok] @ w1[e].t()
        gate, up = pre.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
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
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(T, H, generator=g)).to(dev, dtype)
    probs, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, dim=-1)
    w1 = (torch.randn(E, 2 * Fd, H, generator=g) * H ** -0.5).to(dev, dtype)
    w2 = (torch.randn(E, H, Fd, generator=g) * Fd ** -0.5).to(dev, dtype)
    go = torch.randn(T, H, generator=g).to(dev, dtype)
    shape = {"tokens": T, "hidden": H, "ffn": Fd, "experts": E, "top_k": k, "dtype": str(dtype).replace("torch.", "")}
    return SimpleNamespace(T=T, H=H, Fd=Fd, E=E, k=k, dtype=dtype, x=x, ids=ids.to(dev), weights=probs.to(dev),
                           w1=w1, w2=w2, go=go, shape=shape)


def _grouped_gemm_row(ctx, d, xp, offsets):
    from fusedpar.kernels import grouped_matmul

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
    return row


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


DEEPSEEK_V3 = dict(hidden=7168, ffn=2048, experts=256, top_k=8, n_group=8, topk_group=4, scale=2.5)
DEEPSEEK_V3_SMOKE = dict(DEEPSEEK_V3, hidden=32, ffn=16, experts=16, top_k=4)


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
    """The DeepSeek-V3 routed layer (router + experts) forward + backward vs plain torch. The two
    routers may order near-ties differently in the last bit: outputs are compared on the tokens
    whose chosen experts agree (all but a few; fewer than 99% raises)."""
    import torch

    from fusedpar.nn import MoE

    c = DEEPSEEK_V3 if ctx.gpu else DEEPSEEK_V3_SMOKE
    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    T = args.tokens or (4096 if ctx.gpu else 24)
    H, Fd, E, k = c["hidden"], c["ffn"], c["experts"], c["top_k"]
    g = torch.Generator(device="cpu").manual_seed(1)
    moe = MoE(H, Fd, E, k, score="sigmoid", normalize=True, n_group=c["n_group"], topk_group=c["topk_group"],
              routed_scaling_factor=c["scale"], score_bias=True, aux_loss_coef=0.0, z_loss_coef=0.0,
              device=ctx.device, dtype=dtype)
    with torch.no_grad():
        for p, std in ((moe.router.weight, H ** -0.5), (moe.w1, H ** -0.5), (moe.w2, Fd ** -0.5)):
            p.copy_(torch.randn(p.shape, generator=g) * std)
        moe.router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    x = torch.randn(T, H, generator=g).to(ctx.device, dtype).requires_grad_()
    go = torch.randn(T, H, generator=g).to(ctx.device, dtype)
    bias = moe.router.e_score_correction_bias
    base = [t_.detach().clone().requires_grad_() for t_ in (x, moe.router.weight, moe.w1, moe.w2)]

    def baseline(xb, wr, w1, w2):
        w, ids = _torch_deepseek_router(xb, wr, bias, c)
        return _loop_mlp(xb, ids, w, w1, w2), ids

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
             "groups": f"{c['topk_group']}/{c['n_group']}"}
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
    from fusedpar.ops.transport import EmulatedTransport

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


@register("moe", "MoE: grouped GEMM, permute/unpermute, routed MLP fwd+bwd (one rank, emulated EP), "
                 "DeepSeek-V3 layer",
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
    rows += _permute_rows(ctx, d, xp, slot_pos, sorted_slot)
    rows.append(_layer_row(ctx, d))
    rows.append(_ep_row(ctx, d, ep, args.chunks))
    rows.append(_deepseek_v3_row(ctx, args))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows
