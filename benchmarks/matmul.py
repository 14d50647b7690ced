"""``python -m benchmarks matmul``: the fused-epilogue GEMM against torch.matmul (cuBLAS).

``--fp8-out``: each row also times the GEMM with its fused e4m3 output (``matmul(fp8_out=)``, one
scale per 1x128 tile, what the blockwise recipe's next fp8 GEMM reads) against the same GEMM
followed by ``quantize_e4m3(y, "tile")`` (the same bits: checked equal before timing), as
``fp8_out_ms`` / ``unfused_fp8_ms`` / ``fp8_out_speedup``.

Each row records what ran (``fusedpar.kernels.gemm_loads.last_launch``): the tuned ``config``, the
``loads`` (``tma``: tensor descriptors, persistent over the SMs; ``pointer``) and ``persistent``.
``--loads pointer`` forces pointer loads (the pre-TMA path) for a same-run comparison.
"""
from __future__ import annotations

from ._common import check_close, parse_dtype, parse_shape, register, tflops

# (M, N, K): square, then tensor-parallel shapes (8192 tokens, hidden 8192, tp=8 column shards
# of an 8192 and a 28672 wide projection).
GPU_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 1024, 8192), (8192, 3584, 8192)]
SMOKE_SHAPES = [(33, 47, 29), (64, 64, 64)]


def _add_args(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None, metavar="MxNxK",
                   help="off GPU (smoke mode) each size is capped at 64")
    p.add_argument("--epilogue", choices=["none", "bias", "gelu", "swiglu"], default="none",
                   help="fused epilogue; the baseline runs the same epilogue as separate torch ops")
    p.add_argument("--loads", choices=["auto", "pointer"], default="auto",
                   help="the GEMM load path: auto (TMA where it applies) or pointer (kernels/gemm_loads.py)")
    p.add_argument("--fp8-out", action="store_true",
                   help="also time the fused e4m3 output against the GEMM + quantize_e4m3 (needs fp8 tensor cores "
                        "on a GPU)")


@register("matmul", "fused-epilogue GEMM vs torch.matmul", add_args=_add_args)
def run(args, ctx):
    import torch
    import torch.nn.functional as F

    from fusedpar.kernels import matmul, quantize_e4m3
    from fusedpar.kernels.gemm_loads import last_launch, load_path_set

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    shapes = [ctx.smoke_shape(s) for s in args.shapes] if args.shapes else (GPU_SHAPES if ctx.gpu else SMOKE_SHAPES)
    epi = args.epilogue
    rows = []
    with load_path_set(args.loads):  # the rows' load path, the one before after them
        for M, N, K in shapes:
            n_w = 2 * N if epi == "swiglu" else N

            def make():
                a = torch.randn(M, K, device=ctx.device, dtype=dtype)
                w = torch.randn(n_w, K, device=ctx.device, dtype=dtype) * K ** -0.5
                b = torch.randn(n_w, device=ctx.device, dtype=dtype) if epi == "bias" else None
                return a, w, b

            nbytes = (M * K + n_w * K + M * N) * torch.finfo(dtype).bits // 8
            nxt = ctx.rotating(make, nbytes)
            activation = {"gelu": "gelu", "swiglu": "swiglu"}.get(epi, "none")

            def ours(a, w, b):
                return matmul(a, w, b, activation=activation)

            def baseline(a, w, b):
                y = F.linear(a, w, b)
                if epi == "gelu":
                    y = F.gelu(y, approximate="tanh")
                elif epi == "swiglu":
                    g, u = y.chunk(2, dim=-1)
                    y = F.silu(g) * u
                return y

            # correctness guard before timing: a fast wrong kernel is not a result
            inputs = nxt()
            err = check_close(ours(*inputs), baseline(*inputs))
            t_ours = ctx.time_ms(lambda: ours(*nxt()))
            t_base = ctx.time_ms(lambda: baseline(*nxt()))
            flops = 2.0 * M * n_w * K
            rows.append({
                "M": M, "N": N, "K": K, "dtype": str(dtype).replace("torch.", ""), "epilogue": epi,
                "fusedpar_ms": t_ours, "torch_ms": t_base,
                "fusedpar_TFLOPs": tflops(flops, t_ours), "torch_TFLOPs": tflops(flops, t_base),
                "ratio_vs_torch": t_base / t_ours, "max_rel_err": err, **last_launch("matmul"),
            })
            if args.fp8_out:
                rows[-1].update(_fp8_out_columns(ctx, nxt, matmul, quantize_e4m3, activation))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows


def _fp8_out_columns(ctx, nxt, matmul, quantize_e4m3, activation) -> dict:
    """The GEMM with its fused 1x128-tile e4m3 output against the GEMM then ``quantize_e4m3``:
    the bits checked equal first, then both timed (each allocates its outputs)."""
    import torch

    from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_empty

    def fused(a, w, b):
        n = w.shape[0] // 2 if activation == "swiglu" else w.shape[0]
        y = torch.empty(a.shape[:-1] + (n,), device=a.device, dtype=a.dtype)
        q, s = fp8_output_empty(y)
        return matmul(a, w, b, activation=activation, out=y, fp8_out=(q, s)), q, s

    def unfused(a, w, b):
        y = matmul(a, w, b, activation=activation)
        return (y, *quantize_e4m3(y, "tile"))

    inputs = nxt()
    (y1, q1, s1), (y0, q0, s0) = fused(*inputs), unfused(*inputs)
    if not (torch.equal(y1, y0) and torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0)):
        raise AssertionError("matmul(fp8_out=) differs from matmul + quantize_e4m3(y, 'tile')")
    t_fused = ctx.time_ms(lambda: fused(*nxt()))
    t_unfused = ctx.time_ms(lambda: unfused(*nxt()))
    return {"fp8_out_ms": t_fused, "unfused_fp8_ms": t_unfused, "fp8_out_speedup": t_unfused / t_fused}
