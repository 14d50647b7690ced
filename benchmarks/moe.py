"""``python -m benchmarks moe``: MoE kernels and the routed MLP.

Rows (each with a correctness check against its baseline before timing):

* ``grouped_gemm``: fusedpar.kernels.grouped_matmul vs torch's grouped GEMM
  (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``) on the first expert projection
  ``[T*k, H] x [E, H, 2F]``, routed rows spread over the experts as a real router would;
* ``permute`` / ``unpermute``: token gather into expert order and the weighted combine back, in
  GB/s, against a device copy of the same number of bytes (``torch.Tensor.copy_``);
* ``layer_fwd_bwd``: the whole routed MLP (permute, grouped SwiGLU MLP, combine) forward +
  backward against a per-expert loop in plain torch (index, two matmuls, index_add).

Default GPU shape: hidden 4096, 64 experts, top-8, 8192 tokens, ffn 1024 (bf16). Off GPU a tiny
smoke shape runs under the interpreter (its numbers are not performance).
"""
from __future__ import annotations

from ._common import check_close, gbps, parse_dtype, register, tflops


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="expert ffn width F (w1 has 2F rows: gate, up)")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)


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


@register("moe", "MoE: grouped GEMM, permute/unpermute, routed MLP fwd+bwd", add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import combine, grouped_matmul, permute, routing_metadata
    from fusedpar.ops import moe_mlp

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
    esize = torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(T, H, generator=g)).to(dev, dtype)
    logits = torch.randn(T, E, generator=g)
    probs, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    ids, weights = ids.to(dev), probs.to(dev)
    w1 = (torch.randn(E, 2 * Fd, H, generator=g) * H ** -0.5).to(dev, dtype)
    w2 = (torch.randn(E, H, Fd, generator=g) * Fd ** -0.5).to(dev, dtype)
    shape = {"tokens": T, "hidden": H, "ffn": Fd, "experts": E, "top_k": k, "dtype": str(dtype).replace("torch.", "")}
    rows = []

    counts, offsets, slot_pos, sorted_slot = routing_metadata(ids, E)
    xp = permute(x, sorted_slot, k)

    # ---- grouped GEMM vs torch grouped mm ----
    fn = _torch_grouped_mm()
    w1_kn = w1.transpose(1, 2)  # [E, H, 2F] view, no copy
    ends = offsets[1:].to(torch.int32)
    ours = lambda: grouped_matmul(xp, w1, offsets)  # noqa: E731
    flops = 2.0 * T * k * H * 2 * Fd
    row = {"bench": "grouped_gemm", **shape}
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
    rows.append(row)

    # ---- permute / unpermute vs a copy of the same bytes ----
    ref_p = x[sorted_slot.long().clamp_min(0) // k]
    n_perm = T * k * H  # elements read and written
    src = torch.empty(n_perm, device=dev, dtype=dtype)
    dst = torch.empty_like(src)
    t_copy = ctx.time_ms(lambda: dst.copy_(src))
    err = check_close(permute(x, sorted_slot, k), ref_p, tol=0.0)
    t = ctx.time_ms(lambda: permute(x, sorted_slot, k))
    nbytes = 2 * n_perm * esize
    rows.append({"bench": "permute", **shape, "fusedpar_ms": t, "baseline_ms": t_copy, "baseline": "copy_ same bytes",
                 "fusedpar_GBs": gbps(nbytes, t), "baseline_GBs": gbps(nbytes, t_copy),
                 "ratio_vs_baseline": t_copy / t, "max_rel_err": err})
    y = xp  # any expert-ordered rows
    ref_c = (y[slot_pos.long()].view(T, k, H).float() * weights[..., None]).sum(1)
    err = check_close(combine(y, slot_pos, weights, k), ref_c, tol=1e-2)
    n_comb = T * k * H + T * H  # read the k rows of every token, write one
    src2 = torch.empty(n_comb // 2, device=dev, dtype=dtype)
    dst2 = torch.empty_like(src2)
    t_copy2 = ctx.time_ms(lambda: dst2.copy_(src2))
    t = ctx.time_ms(lambda: combine(y, slot_pos, weights, k))
    nbytes = n_comb * esize
    rows.append({"bench": "unpermute", **shape, "fusedpar_ms": t, "baseline_ms": t_copy2,
                 "baseline": "copy_ same bytes", "fusedpar_GBs": gbps(nbytes, t), "baseline_GBs": gbps(nbytes, t_copy2),
                 "ratio_vs_baseline": t_copy2 / t, "max_rel_err": err})

    # ---- whole routed MLP, forward + backward ----
    go = torch.randn(T, H, generator=g).to(dev, dtype)
    leaves = [t_.clone().requires_grad_() for t_ in (x, weights, w1, w2)]

    def fused():
        for t_ in leaves:
            t_.grad = None
        out = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], num_experts=E)
        out.backward(go)
        return out

    def loop():
        for t_ in leaves:
            t_.grad = None
        out = _loop_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        out.backward(go)
        return out

    err = check_close(fused().detach(), loop().detach())
    t_ours, t_base = ctx.time_ms(fused), ctx.time_ms(loop)
    flops = 3 * 2.0 * T * k * (H * 2 * Fd + Fd * H)  # fwd + 2x for bwd
    rows.append({"bench": "layer_fwd_bwd", **shape, "fusedpar_ms": t_ours, "baseline_ms": t_base,
                 "baseline": "per-expert torch loop", "fusedpar_TFLOPs": tflops(flops, t_ours),
                 "baseline_TFLOPs": tflops(flops, t_base), "ratio_vs_baseline": t_base / t_ours, "max_rel_err": err})
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows
