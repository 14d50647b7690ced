"""``python -m benchmarks launch``: host time per call of the shipped entry points on tiny shapes,
where the device work (a few microseconds) hides behind the host's: ``calls`` launches are issued
back to back without a synchronise, and the host clock over them (then one synchronise) divided by
``calls`` is what one call costs the CPU. A chunked op (tp 8 chunks) whose chunk GEMMs take less
device time than this is bound by the host, not by the GPU (docs/PERF.md).

Rows: ``torch.matmul`` (the floor of a framework launch), ``fusedpar.kernels.matmul`` (checks,
autotuner dispatch, the Triton launch), ``flash_attention_forward``, and the emulated
``all_gather_matmul`` / ``matmul_reduce_scatter`` of one tp rank of 8 (the custom-op dispatch,
eight chunk GEMMs and seven transfers with their events).
"""
from __future__ import annotations

import time

from ._common import register


def _add_args(p):
    p.add_argument("--calls", type=int, default=None, help="calls per row (GPU default 200, CPU 3)")


def _host_us(ctx, fn, calls: int) -> float:
    import torch

    for _ in range(3):  # compiles and tunes outside the clock
        fn()
    if ctx.gpu:
        torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if ctx.gpu:
        torch.cuda.synchronize(ctx.device)
    return (time.perf_counter() - t0) / calls * 1e6


@register("launch", "host microseconds per call of the shipped entry points (tiny shapes)", add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import flash_attention_forward, matmul
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter
    from fusedpar.ops.transport import EmulatedTransport

    calls = args.calls or (200 if ctx.gpu else 3)
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    dev, tp, m, h = ctx.device, 8, 16, 64
    a = torch.randn(64, 64, device=dev, dtype=dtype)
    w = torch.randn(64, 64, device=dev, dtype=dtype)
    q = torch.randn(1, 64, 2, 64, device=dev, dtype=dtype)
    x_ag = torch.randn(m, h, device=dev, dtype=dtype)
    x_rs = torch.randn(m * tp, h // tp, device=dev, dtype=dtype)
    w_rs = torch.randn(h, h // tp, device=dev, dtype=dtype)
    transport = EmulatedTransport(tp, 0)
    cases = [
        ("torch.matmul 64^3", lambda: torch.matmul(a, w)),
        ("fusedpar.kernels.matmul 64^3", lambda: matmul(a, w)),
        ("flash_attention_forward s64 h2 d64", lambda: flash_attention_forward(q, q, q, causal=True)),
        ("all_gather_matmul emulated tp8", lambda: all_gather_matmul(x_ag, w, gather_dim=0, transport=transport)),
        ("matmul_reduce_scatter emulated tp8",
         lambda: matmul_reduce_scatter(x_rs, w_rs, None, scatter_dim=0, transport=transport)),
    ]
    rows = [{"entry": name, "calls": calls, "host_us_per_call": _host_us(ctx, fn, calls)} for name, fn in cases]
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: interpreted kernels; these are not launch costs.")
    return rows
