"""``python -m benchmarks ceilings``: the device's two measured ceilings that docs/PERF.md divides
by: device-to-device copy bandwidth (bytes read + written, ``torch.Tensor.copy_`` of a buffer far
larger than L2) and the dense bf16 rate of ``torch.matmul`` at 8192^3 on random data (cuBLAS).
Every kernel's floor is its FLOPs over the second or its bytes over the first, whichever is larger.
"""
from __future__ import annotations

from ._common import gbps, register, tflops


@register("ceilings", "device copy bandwidth and the bf16 matmul rate (the floors' denominators)")
def run(args, ctx):
    import torch

    rows = []
    n_bytes = (1 << 30) if ctx.gpu else (1 << 20)  # 1 GiB each way on a GPU: 20x an H100's L2
    src = torch.randn(n_bytes // 4, device=ctx.device)
    dst = torch.empty_like(src)
    t = ctx.time_ms(lambda: dst.copy_(src))
    rows.append({"ceiling": "copy", "size": f"{n_bytes >> 20} MiB", "ms": t, "GB_per_s": gbps(2 * n_bytes, t)})
    n = 8192 if ctx.gpu else 64
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    t = ctx.time_ms(lambda: torch.matmul(a, b))
    rows.append({"ceiling": "matmul", "size": f"{n}^3 {str(dtype).replace('torch.', '')}", "ms": t,
                 "TFLOPs": tflops(2.0 * n ** 3, t)})
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: CPU copy and matmul; these numbers are not the GPU's.")
    return rows
