"""Host cost per call through Triton's real compiled-launch path, the driver stubbed
(:mod:`benchmarks._stub_driver`); run by ``python -m benchmarks launch --stub-driver`` in a process
of its own. Prints one JSON object: per entry the microseconds per call (main-thread CPU time, the
minimum over ``--windows`` windows: robust on a loaded machine), the kernel launches per call,
and ``x_floor``, the call over the floor measured in the same run: Triton's C launcher called
directly with the arguments the compiled GEMM was launched with."""
from __future__ import annotations

import argparse
import gc
import json
import time

from benchmarks._stub_driver import activate


def us_min(fn, calls: int, windows: int) -> float:
    """Microseconds per call of ``fn``: the fastest of ``windows`` windows of ``calls`` calls, in
    this thread's CPU time (time spent descheduled on a loaded machine is not counted)."""
    for _ in range(10):
        fn()
    best = float("inf")
    gc.disable()
    try:
        for _ in range(windows):
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            best = min(best, (time.thread_time() - t0) / calls * 1e6)
    finally:
        gc.enable()
    return best


def _entries():
    """``{name: call}``: the dense GEMM, a norm, an attention block, and one rank of tp 8 emulated
    (rings, one with a weight requiring grad, and the symmetric path's persistent GEMM)."""
    import torch

    from fusedpar.kernels import flash_attention_forward, matmul
    from fusedpar.kernels.rmsnorm import rms_norm_fwd
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter
    from fusedpar.ops.comm.transport import EmulatedTransport

    dt, tp, m, h = torch.bfloat16, 8, 16, 64
    a, w = torch.randn(64, 64, dtype=dt), torch.randn(64, 64, dtype=dt)
    w_grad = w.clone().requires_grad_()
    q = torch.randn(1, 64, 2, 64, dtype=dt)
    x_ag, x_rs = torch.randn(m, h, dtype=dt), torch.randn(m * tp, h // tp, dtype=dt)
    w_rs = torch.randn(h, h // tp, dtype=dt)
    ring, waits = EmulatedTransport(tp, 0), EmulatedTransport(tp, 0, in_kernel_waits=True)
    return {
        "matmul 64^3": lambda: matmul(a, w),
        "rms_norm_fwd 64x64": lambda: rms_norm_fwd(a, w[0]),
        "flash_attention_forward s64 h2 d64": lambda: flash_attention_forward(q, q, q, causal=True),
        "all_gather_matmul ring tp8": lambda: all_gather_matmul(x_ag, w, gather_dim=0, transport=ring),
        "matmul_reduce_scatter ring tp8":
            lambda: matmul_reduce_scatter(x_rs, w_rs, None, scatter_dim=0, transport=ring),
        "all_gather_matmul ring tp8, weight requires grad":
            lambda: all_gather_matmul(x_ag, w_grad, gather_dim=0, transport=ring),
        "all_gather_matmul persistent tp8": lambda: all_gather_matmul(x_ag, w, gather_dim=0, transport=waits),
        "matmul_reduce_scatter persistent tp8":
            lambda: matmul_reduce_scatter(x_rs, w_rs, None, scatter_dim=0, transport=waits),
    }


def _floor(calls: int, windows: int) -> float:
    """Microseconds of the bare C launcher called with what the GEMM's compiled launch passed it
    (no launch metadata, no hooks)."""
    import torch
    import triton

    from fusedpar.kernels import matmul
    from fusedpar.kernels.launch import clear_plans

    a = torch.randn(64, 64, dtype=torch.bfloat16)
    launcher_cls = triton.runtime.driver.active.launcher_cls
    seen = []
    call = launcher_cls.__call__
    launcher_cls.__call__ = lambda self, *xs: (seen.append((self, xs)), call(self, *xs))[1]
    try:
        clear_plans()
        matmul(a, a)
    finally:
        launcher_cls.__call__ = call
    launcher, xs = seen[-1]
    xs = xs[:6] + (None, None, None) + xs[9:]
    return us_min(lambda: launcher(*xs), calls, windows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=100, help="calls per window (the matmul rows: 4x)")
    p.add_argument("--windows", type=int, default=20)
    p.add_argument("--entries", default=None, help="comma-separated first words of the entries (default: all)")
    args = p.parse_args(argv)
    launches = activate()
    import triton

    entries = _entries()
    if args.entries:
        entries = {k: v for k, v in entries.items() if k.split()[0] in args.entries.split(",")}
    floor = _floor(args.calls * 4, args.windows)
    rows = []
    for name, fn in entries.items():
        for _ in range(3):
            fn()  # compile, tune, build the plans
        before = launches()
        fn()
        per_call = launches() - before
        us = us_min(fn, args.calls * (4 if name.startswith("matmul ") else 1), args.windows)
        rows.append({"entry": name, "host_us_per_call": round(us, 2), "launches": per_call,
                     "x_floor": round(us / floor, 1)})
    print(json.dumps({"triton": triton.__version__, "floor_us": round(floor, 2), "rows": rows}))


if __name__ == "__main__":
    main()
