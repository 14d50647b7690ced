"""``python -m benchmarks fp8_matmul``: the scaled e4m3 GEMM (:func:`fusedpar.kernels.fp8_matmul`)
against ``torch._scaled_mm`` (cuBLAS, rowwise scales) and against the bf16 GEMM of the same shape
(``torch.matmul``).

Rows per shape:

* ``rowwise``: per-row scales of A (tokens) and of B (weight output rows), the recipe both ours and
  ``torch._scaled_mm`` run; ``ratio_vs_scaled_mm`` = t(_scaled_mm) / t(ours), ``speedup_vs_bf16`` =
  t(bf16 matmul) / t(ours);
* ``blockwise``: DeepSeek-V3's 1x128 activation tiles and 128x128 weight blocks (the main loop
  rescales every 128 K steps); compared with the bf16 GEMM only.

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
    p.add_argument("--scalings", default="rowwise,blockwise", help="comma-separated subset of rowwise,blockwise")


@register("fp8_matmul", "scaled e4m3 GEMM (rowwise, blockwise) vs torch._scaled_mm and the bf16 GEMM",
          add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import fp8_matmul, quantize_e4m3
    from fusedpar.kernels.fp8_gemm import fp8_matmul_reference

    scalings = [s for s in args.scalings.split(",") if s]
    for s in scalings:
        if s not in ("rowwise", "blockwise"):
            raise SystemExit(f"--scalings: {s!r} is not one of rowwise, blockwise")
    shapes = [ctx.smoke_shape(s) for s in args.shapes] if args.shapes else (GPU_SHAPES if ctx.gpu else SMOKE_SHAPES)
    rows = []
    for M, N, K in shapes:
        a_hp = torch.randn(M, K, device=ctx.device, dtype=torch.bfloat16)
        b_hp = torch.randn(N, K, device=ctx.device, dtype=torch.bfloat16) * K ** -0.5
        t_bf16 = ctx.time_ms(lambda: torch.matmul(a_hp, b_hp.t()))
        flops = 2.0 * M * N * K
        for scaling in scalings:
            ga, gb = ("row", "row") if scaling == "rowwise" else ("tile", "block")
            a, sa = quantize_e4m3(a_hp, ga)
            b, sb = quantize_e4m3(b_hp, gb)

            def ours():
                return fp8_matmul(a, sa, b, sb, scaling=scaling, out_dtype=torch.bfloat16)

            row = {"M": M, "N": N, "K": K, "scaling": scaling}
            if scaling == "rowwise" and ctx.gpu and N % 16 == 0 and K % 16 == 0:
                def scaled_mm():
                    return torch._scaled_mm(a, b.t(), scale_a=sa.view(-1, 1), scale_b=sb.view(1, -1),
                                            out_dtype=torch.bfloat16)

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
            rows.append(row)
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows
