"""``python -m benchmarks fp8_matmul``: the scaled e4m3 GEMM (:func:`fusedpar.kernels.fp8_matmul`)
against ``torch._scaled_mm`` (cuBLAS, rowwise scales) and against the bf16 GEMM of the same shape
(``torch.matmul``).

Rows per shape:

* ``rowwise``: per-row scales of A (tokens) and of B (weight output rows), the recipe both ours and
  ``torch._scaled_mm`` run; ``ratio_vs_scaled_mm`` = t(_scaled_mm) / t(ours), ``speedup_vs_bf16`` =
  t(bf16 matmul) / t(ours);
* ``rowwise fast``: the same with fast accumulation (``fp8_matmul(fast_accum=True)``: no fp32
  promotion every 128 K) against ``torch._scaled_mm(use_fast_accum=True)``;
* ``blockwise``: DeepSeek-V3's 1x128 activation tiles and 128x128 weight blocks (the main loop
  rescales every 128 K steps); compared with the bf16 GEMM only.

Each row records what ran (``gemm_loads.last_launch``: ``config``, ``loads``, ``persistent``);
``--loads pointer`` forces pointer loads.

``--epilogue swiglu`` adds one row per shape and recipe (``epilogue`` column ``swiglu+fp8_out``):
the fp8 up projection with its fused epilogue, ``fp8_matmul(..., activation="swiglu",
preact_out=, fp8_out=)`` (``B`` of ``2N`` rows; the blockwise tiles of the activated output for
the down projection; rowwise: no tiles), against the unfused sequence it replaces: ``fp8_matmul``
writing the pre-activation, SwiGLU in torch, then ``quantize_e4m3(y, "tile")``; checked against
each other (bf16 tolerance: the fused activation starts from the fp32 accumulator) and timed,
``fused_speedup`` = t(unfused) / t(fused).

The operands are quantised once, outside the timed region (:func:`fusedpar.kernels.quantize_e4m3`):
these rows time the GEMM. Before timing, ours is checked against ``torch._scaled_mm`` on the same
fp8 operands (rowwise) or against the float64 product of the dequantised operands (blockwise; and
rowwise off GPU, where ``_scaled_mm`` has no kernel, and where N or K is not a multiple of 16, which
cuBLASLt's fp8 GEMM requires: those rows have no ``scaled_mm_ms``).
"""
from __future__ import annotations

from ._common import check_close, parse_shape, register, tflops

GPU_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 1024, 8192), (8192, 3584, 8192)]
SMOKE_SHAPES = [(33, 47, 160), (64, 64, 64)]
# bf16 output of an fp32-accumulated product: one bf16 rounding (2^-8 relative) of the output, plus
# the two GEMMs' different fp32 summation orders (far smaller at these K)
BF16_OUT_TOL = 2 ** -7


def _add_args(p):
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None, metavar="MxNxK",
                   help="off GPU (smoke mode) each size is capped at 64")
    p.add_argument("--scalings", default="rowwise,rowwise fast,blockwise",
                   help="comma-separated subset of rowwise, 'rowwise fast' (fast accumulation), blockwise")
    p.add_argument("--loads", choices=["auto", "pointer"], default="auto",
                   help="the GEMM load path: auto (TMA where it applies) or pointer (kernels/gemm_loads.py)")
    p.add_argument("--epilogue", choices=["none", "swiglu"], default="none",
                   help="swiglu: also time the fused up-projection epilogue against fp8_matmul + SwiGLU + quantise")


@register("fp8_matmul", "scaled e4m3 GEMM (rowwise, blockwise) vs torch._scaled_mm and the bf16 GEMM",
          add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import fp8_matmul, quantize_e4m3
    from fusedpar.kernels.fp8_gemm import fp8_matmul_reference
    from fusedpar.kernels.gemm_loads import last_launch, load_path_set

    scalings = [s.strip() for s in args.scalings.split(",") if s.strip()]
    for s in scalings:
        if s not in ("rowwise", "rowwise fast", "blockwise"):
            raise SystemExit(f"--scalings: {s!r} is not one of rowwise, 'rowwise fast', blockwise")
    shapes = [ctx.smoke_shape(s) for s in args.shapes] if args.shapes else (GPU_SHAPES if ctx.gpu else SMOKE_SHAPES)
    rows = []
    with load_path_set(args.loads):  # the rows' load path, the one before after them
        for M, N, K in shapes:
            a_hp = torch.randn(M, K, device=ctx.device, dtype=torch.bfloat16)
            b_hp = torch.randn(N, K, device=ctx.device, dtype=torch.bfloat16) * K ** -0.5
            t_bf16 = ctx.time_ms(lambda: torch.matmul(a_hp, b_hp.t()))
            flops = 2.0 * M * N * K
            for name in scalings:
                scaling, fast = name.split()[0], name.endswith("fast")
                ga, gb = ("row", "row") if scaling == "rowwise" else ("tile", "block")
                a, sa = quantize_e4m3(a_hp, ga)
                b, sb = quantize_e4m3(b_hp, gb)

                def ours():
                    return fp8_matmul(a, sa, b, sb, scaling=scaling, out_dtype=torch.bfloat16, fast_accum=fast)

                row = {"M": M, "N": N, "K": K, "scaling": name}
                if scaling == "rowwise" and ctx.gpu and N % 16 == 0 and K % 16 == 0:
                    def scaled_mm():
                        return torch._scaled_mm(a, b.t(), scale_a=sa.view(-1, 1), scale_b=sb.view(1, -1),
                                                out_dtype=torch.bfloat16, use_fast_accum=fast)

                    err = check_close(ours(), scaled_mm(), tol=BF16_OUT_TOL)
                    t_ours, t_ref = ctx.time_ms(ours), ctx.time_ms(scaled_mm)
                    row.update(fusedpar_ms=t_ours, scaled_mm_ms=t_ref, ratio_vs_scaled_mm=t_ref / t_ours)
                else:
                    ref = fp8_matmul_reference(a, sa, b, sb, scaling=scaling)
                    err = check_close(ours(), ref, tol=BF16_OUT_TOL)
                    t_ours = ctx.time_ms(ours)
                    row.update(fusedpar_ms=t_ours)
                row.update(bf16_ms=t_bf16, speedup_vs_bf16=t_bf16 / t_ours, fusedpar_TFLOPs=tflops(flops, t_ours),
                           max_rel_err=err)
                ours()
                row.update(last_launch("fp8_matmul"))
                rows.append(row)
                if args.epilogue == "swiglu" and not fast:
                    rows.append(_swiglu_row(ctx, M, N, K, scaling, a, sa, b_hp, gb))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows


def _swiglu_row(ctx, M, N, K, scaling, a, sa, b_hp, gb) -> dict:
    """The fused up-projection epilogue (SwiGLU, pre-activation, blockwise e4m3 tiles) against
    ``fp8_matmul`` + torch SwiGLU + ``quantize_e4m3`` (module docstring)."""
    import torch
    import torch.nn.functional as F

    from fusedpar.kernels import fp8_matmul, quantize_e4m3
    from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_empty

    b2, s2 = quantize_e4m3(torch.cat([b_hp, b_hp.flip(0)]), gb)  # [gate; up]: 2N rows
    tiles = scaling == "blockwise"

    def fused():
        y = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
        pre = torch.empty(M, 2 * N, device=a.device, dtype=torch.bfloat16)
        return fp8_matmul(a, sa, b2, s2, scaling=scaling, out=y, activation="swiglu", preact_out=pre,
                          fp8_out=fp8_output_empty(y) if tiles else None)

    def unfused():
        pre = fp8_matmul(a, sa, b2, s2, scaling=scaling, out_dtype=torch.bfloat16)
        g, u = pre.chunk(2, dim=-1)
        y = F.silu(g.float()).mul(u.float()).to(torch.bfloat16)
        return (y, quantize_e4m3(y, "tile")) if tiles else y

    got, want = fused(), unfused()
    err = check_close(got, want[0] if tiles else want, tol=BF16_OUT_TOL)
    t_fused, t_unfused = ctx.time_ms(fused), ctx.time_ms(unfused)
    return {"M": M, "N": N, "K": K, "scaling": scaling, "epilogue": "swiglu+fp8_out" if tiles else "swiglu",
            "fusedpar_ms": t_fused, "unfused_ms": t_unfused, "fused_speedup": t_unfused / t_fused,
            "fusedpar_TFLOPs": tflops(4.0 * M * N * K, t_fused), "max_rel_err": err}
