"""``python -m benchmarks attention_variants``: the flash kernel's attention variants (forward and
backward) against the baseline a user has for each:

* ``window``: a causal sliding window of ``W`` keys against torch SDPA with the same band as a
  boolean mask (SDPA cannot skip the masked tiles, fusedpar skips every tile outside the window);
* ``sinks``: one learnable logit per head (gpt-oss) against SDPA with one extra key of zeros and a
  float mask whose extra column is the sink (the same softmax, the extra key carrying no value);
* ``mla``: q/k head dim 192 with v head dim 128 (DeepSeek-V3) against SDPA, which takes v's own
  head dim (the efficient / math backends);
* ``softcap``: Gemma 2's ``c * tanh(s / c)``; SDPA cannot express it, so the baseline is fusedpar's
  own kernel without the cap (the ratio is the cap's cost) and the check is the float64 reference.

Every row is checked against its baseline's result (or the float64 reference) before it is timed.
"""
from __future__ import annotations

from ._common import check_close, parse_dtype, register, tflops

GPU_SEQ = 8192
GPU_HEADS = 16
CPU_SEQ = 40
CPU_HEADS = 2
VARIANTS = ("window", "sinks", "mla", "softcap")


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (GPU default {GPU_SEQ})")
    p.add_argument("--window", type=int, default=None, help="sliding window W (GPU default 4096; CPU 9)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")


def _variants(text):
    chosen = [v for v in text.split(",") if v]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad or not chosen:
        raise ValueError(f"--variants must be a comma-separated subset of {VARIANTS}, got {text!r}")
    return chosen


def _case(name, s, h, ctx, dtype, window):
    """``(q, k, v, do, kernel options, baseline forward, flops)`` of one variant."""
    import torch
    import torch.nn.functional as F

    if name == "mla":  # DeepSeek-V3's head dims; a smaller unequal pair in smoke mode
        dq, dv = (192, 128) if ctx.gpu else (24, 16)
    else:
        dq = dv = 128 if ctx.gpu else 16
    q, k = (torch.randn(1, s, h, dq, device=ctx.device, dtype=dtype) for _ in range(2))
    v, do = (torch.randn(1, s, h, dv, device=ctx.device, dtype=dtype) for _ in range(2))
    opts = dict(causal=True)
    pos = torch.arange(s, device=ctx.device)
    causal = pos[None, :] <= pos[:, None]
    visible = s * (s + 1) / 2
    if name == "window":
        opts["window"] = (window - 1, 0)
        band = causal & (pos[None, :] > pos[:, None] - window)
        visible = float(band.sum())

        def baseline(qt, kt, vt):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=band)
    elif name == "sinks":
        sinks = torch.randn(h, device=ctx.device, dtype=torch.float32)
        opts["sinks"] = sinks
        bias = torch.zeros(h, s, s + 1, device=ctx.device, dtype=dtype)
        bias[:, :, :s].masked_fill_(~causal, float("-inf"))
        bias[:, :, s] = sinks[:, None].to(dtype)

        def baseline(qt, kt, vt):
            zeros = lambda t: torch.zeros_like(t[:, :, :1])  # noqa: E731 - the sink's key and value
            return F.scaled_dot_product_attention(qt, torch.cat([kt, zeros(kt)], 2), torch.cat([vt, zeros(vt)], 2),
                                                  attn_mask=bias)
    elif name == "softcap":
        opts["softcap"] = 20.0
        baseline = None
    else:
        def baseline(qt, kt, vt):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    flops = 2.0 * h * visible * (dq + dv)
    return q, k, v, do, opts, baseline, flops


@register("attention_variants", "flash attention variants (window, sinks, MLA 192/128, softcap) vs SDPA",
          add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import attention_reference, flash_attention_backward, flash_attention_forward

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    s = args.seq or (GPU_SEQ if ctx.gpu else CPU_SEQ)
    h = GPU_HEADS if ctx.gpu else CPU_HEADS
    window = args.window or (4096 if ctx.gpu else 9)
    rows = []
    for name in _variants(args.variants):
        q, k, v, do, opts, baseline, flops = _case(name, s, h, ctx, dtype, window)
        out, lse = flash_attention_forward(q, k, v, **opts)
        grads = flash_attention_backward(do, q, k, v, out, lse, **opts)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if baseline is None:  # softcap: the float64 reference, and the uncapped kernel as the baseline
            ref, _ = attention_reference(*leaves, compute_dtype=torch.float64, **opts)
            plain = dict(causal=True)
        else:
            qt, kt, vt = (t.transpose(1, 2) for t in leaves)
            ref = baseline(qt, kt, vt).transpose(1, 2)
        err = check_close(out, ref)
        ref.backward(do.to(ref.dtype))
        err = max(err, *(check_close(g, leaf.grad) for g, leaf in zip(grads[:3], leaves)))

        t_fwd = ctx.time_ms(lambda: flash_attention_forward(q, k, v, **opts))
        t_bwd = ctx.time_ms(lambda: flash_attention_backward(do, q, k, v, out, lse, **opts))
        if baseline is None:
            base_out, base_lse = flash_attention_forward(q, k, v, **plain)
            b_fwd = ctx.time_ms(lambda: flash_attention_forward(q, k, v, **plain))
            b_bwd = ctx.time_ms(lambda: flash_attention_backward(do, q, k, v, base_out, base_lse, **plain))
            against = "fusedpar flash without softcap"
        else:
            qb, kb, vb = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            base = baseline(qb, kb, vb)

            def base_fwd():
                with torch.no_grad():
                    return baseline(qb, kb, vb)

            b_fwd = ctx.time_ms(base_fwd)
            b_bwd = ctx.time_ms(lambda: torch.autograd.grad(base, (qb, kb, vb), do.transpose(1, 2), retain_graph=True))
            against = "torch SDPA (mask)" if name in ("window", "sinks") else "torch SDPA"
        rows.append({
            "variant": name, "seq": s, "heads": h, "qk_head_dim": q.shape[-1], "v_head_dim": v.shape[-1],
            "window": window if name == "window" else None, "dtype": str(dtype).replace("torch.", ""),
            "baseline": against, "fwd_ms": t_fwd, "baseline_fwd_ms": b_fwd, "fwd_ratio_vs_baseline": b_fwd / t_fwd,
            "bwd_ms": t_bwd, "baseline_bwd_ms": b_bwd, "bwd_ratio_vs_baseline": b_bwd / t_bwd,
            "fwd_TFLOPs": tflops(flops, t_fwd), "max_rel_err": err,
        })
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    else:
        ctx.notes.append("FLOPs count the visible (unmasked) pairs only; SDPA with a mask runs its efficient or "
                         "math backend (its flash backend takes no mask).")
    return rows
