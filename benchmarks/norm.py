"""``python -m benchmarks rmsnorm``: the fused RMSNorm (:func:`fusedpar.kernels.rms_norm_fwd`) against
``torch.nn.functional.rms_norm``, and the norm with its fused e4m3 output
(:func:`fusedpar.kernels.rms_norm_fp8_fwd`) against the norm followed by
:func:`fusedpar.kernels.quantize_e4m3` (what an fp8 projection would run without the fusion).

Rows per ``tokens x hidden`` shape (a residual added first, as in a block):

* ``rms_norm``: the forward (``y`` and the new residual stream ``h``) in GB/s of its compulsory
  bytes (x and the residual read, y and h written) against torch's ``rms_norm`` of ``x + residual``
  (``ratio_vs_baseline``: its time over ours), checked against it;
* ``rms_norm_fp8`` (one row per recipe, ``rowwise`` and ``blockwise``): the same plus the e4m3
  output and its scales, against ``rms_norm_fwd`` then ``quantize_e4m3`` on its ``y`` (the same
  bits: checked equal before timing).
"""
from __future__ import annotations

from ._common import check_close, gbps, parse_dtype, register

GPU_SHAPES = [(8192, 4096), (8192, 8192)]
SMOKE_SHAPES = [(37, 200)]


def _add_args(p):
    p.add_argument("--shapes", default=None, metavar="TxH[,TxH...]", help="tokens x hidden (GPU default "
                   "8192x4096,8192x8192; off GPU each size is capped at 64)")
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16 or fp32 (CPU default)")


def _shapes(args, ctx):
    if not args.shapes:
        return GPU_SHAPES if ctx.gpu else SMOKE_SHAPES
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes must be TxH[,TxH...] with positive sizes, got {args.shapes!r}")
    return [ctx.smoke_shape(s) for s in shapes]


@register("rmsnorm", "fused RMSNorm (+ residual) vs torch, and with its fused e4m3 output vs norm + quantise",
          add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import quantize_e4m3, rms_norm_fp8_fwd, rms_norm_fwd

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    rows = []
    for T, H in _shapes(args, ctx):
        x, r = (torch.randn(T, H, device=ctx.device, dtype=dtype) for _ in range(2))
        w = 1.0 + 0.1 * torch.randn(H, device=ctx.device, dtype=dtype)
        size = T * H * x.element_size()

        def ours():
            return rms_norm_fwd(x, w, 1e-6, residual=r)[:2]

        def torch_norm():
            h = x + r
            return torch.nn.functional.rms_norm(h, (H,), w, 1e-6), h

        err = max(check_close(a, b) for a, b in zip(ours(), torch_norm()))
        t, t_base = ctx.time_ms(ours), ctx.time_ms(torch_norm)
        shape = {"tokens": T, "hidden": H, "dtype": str(dtype).replace("torch.", "")}
        rows.append({"bench": "rms_norm", **shape, "fusedpar_ms": t, "baseline_ms": t_base,
                     "baseline": "torch rms_norm(x + residual)", "fusedpar_GBs": gbps(4 * size, t),
                     "ratio_vs_baseline": t_base / t, "max_rel_err": err})
        for recipe, granularity in (("rowwise", "row"), ("blockwise", "tile")):
            def fused(recipe=recipe):
                return rms_norm_fp8_fwd(x, w, 1e-6, residual=r, recipe=recipe)

            def unfused(granularity=granularity):
                y = rms_norm_fwd(x, w, 1e-6, residual=r)[0]
                return (y, *quantize_e4m3(y, granularity))

            (y1, _, _, q1, s1), (y0, q0, s0) = fused(), unfused()
            if not (torch.equal(y1, y0) and torch.equal(q1.view(torch.uint8), q0.view(torch.uint8))
                    and torch.equal(s1.reshape(s0.shape), s0)):
                raise AssertionError(f"rms_norm_fp8 ({recipe}) differs from rms_norm + quantize_e4m3")
            t8, t8_base = ctx.time_ms(fused), ctx.time_ms(unfused)
            rows.append({"bench": "rms_norm_fp8", **shape, "recipe": recipe, "fusedpar_ms": t8,
                         "baseline_ms": t8_base, "baseline": "rms_norm_fwd + quantize_e4m3",
                         "fusedpar_GBs": gbps(4 * size + T * H, t8), "ratio_vs_baseline": t8_base / t8,
                         "max_rel_err": 0.0})
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows
