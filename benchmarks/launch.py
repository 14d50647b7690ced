"""``python -m benchmarks launch``: host time per call of the shipped entry points on tiny shapes,
where the device work (a few microseconds) hides behind the host's: ``calls`` launches are issued
back to back without a synchronise, and the host clock over them (then one synchronise) divided by
``calls`` is what one call costs the CPU. A chunked op (tp 8 chunks) whose chunk GEMMs take less
device time than this is bound by the host, not by the GPU (docs/PERF.md).

Rows: ``torch.matmul`` (the floor of a framework launch), ``fusedpar.kernels.matmul`` (checks,
autotuner dispatch, the Triton launch), ``flash_attention_forward``, and the emulated
``all_gather_matmul`` / ``matmul_reduce_scatter`` of one tp rank of 8 (the custom-op dispatch,
eight chunk GEMMs and seven transfers with their events).

``--stub-kernels``: every Triton kernel launch is a no-op during the timed calls (after the
warm-up calls, which compile and tune on a GPU), so a row is the host path alone -- checks, the
autotuner's dispatch, allocations, the transfers and the op's own Python -- without Triton's
launch itself (a launch plan's call of the compiled launcher included), and on CPU without the
interpreter's execution of the kernel.

``--stub-driver``: the same entries (and the symmetric path's) through Triton's *real* compiled
launch path on any machine, GPU or not: kernels compiled for sm_90, Triton's C launcher, a stand-in
libcuda whose calls return at once (:mod:`benchmarks._stub_driver`, run in a process of its own).
Each row also gives ``x_floor``, its cost over the bare C launcher's in the same run: compare those,
not microseconds, across machines, and calibrate against a GPU's plain ``launch`` rows.
"""
from __future__ import annotations

import contextlib
import time

from ._common import register


def _add_args(p):
    p.add_argument("--calls", type=int, default=None, help="calls per row (GPU default 200, CPU 3; "
                   "with --stub-kernels 2000 and 200)")
    p.add_argument("--stub-kernels", action="store_true",
                   help="time the host path alone: Triton kernel launches are no-ops in the timed calls")
    p.add_argument("--stub-driver", action="store_true",
                   help="measure through Triton's real compiled-launch path against a stub driver (no GPU "
                        "needed): microseconds and multiples of the bare launcher's cost per call")
    p.add_argument("--entries", default=None, help="with --stub-driver: the entries to measure, comma-separated "
                   "first words (matmul, rms_norm_fwd, flash_attention_forward, all_gather_matmul, "
                   "matmul_reduce_scatter; default all)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile the calls of fusedpar.kernels.matmul (cProfile) and print the N "
                        "functions that take the most time of their own, per call")


@contextlib.contextmanager
def _stubbed_kernels():
    """Every Triton kernel launch a no-op: the ``run`` of the class of this package's kernels
    (compiled ``JITFunction`` or the interpreter's ``InterpretedFunction``), which ``kernel[grid](...)``
    and the autotuners call."""
    import triton

    from fusedpar.kernels.runtime import interpreting

    if interpreting():
        from triton.runtime.interpreter import InterpretedFunction as kernel_class
        launcher_cls = None
    else:
        kernel_class = triton.runtime.JITFunction
        launcher_cls = triton.runtime.driver.active.launcher_cls  # what launch plans call directly
    run = kernel_class.run
    kernel_class.run = lambda self, *args, **kwargs: None
    call = launcher_cls.__call__ if launcher_cls is not None else None
    if launcher_cls is not None:
        launcher_cls.__call__ = lambda self, *args: None
    try:
        yield
    finally:
        kernel_class.run = run
        if launcher_cls is not None:
            launcher_cls.__call__ = call


def _host_us(ctx, fn, calls: int, stub: bool = False) -> float:
    import torch

    # the warm-up compiles and tunes outside the clock; interpreted kernels have nothing to
    # compile or tune, so with stub there they are stubbed from the start
    with _stubbed_kernels() if stub and ctx.smoke else contextlib.nullcontext():
        for _ in range(3):
            fn()
    if ctx.gpu:
        torch.cuda.synchronize(ctx.device)
    with _stubbed_kernels() if stub else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if ctx.gpu:
            torch.cuda.synchronize(ctx.device)
        return (time.perf_counter() - t0) / calls * 1e6


def _profile_note(fn, calls: int, top: int) -> str:
    """The ``top`` functions by own time over ``calls`` calls of ``fn`` (cProfile), in microseconds
    per call of ``fn``: where a launch's host time goes, function by function."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, own, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"{own / calls * 1e6:8.2f} us own  {cum / calls * 1e6:8.2f} us cumulative  {n / calls:5.1f} calls  "
             f"{name} ({file.rsplit('/', 2)[-1] if '/' in file else file}:{line})"
             for (file, line, name), (n, _, own, cum, _) in rows]
    return "profile of fusedpar.kernels.matmul 64^3, per call:\n" + "\n".join(lines)


@register("launch", "host microseconds per call of the shipped entry points (tiny shapes)", add_args=_add_args)
def run(args, ctx):
    import torch

    from fusedpar.kernels import flash_attention_forward, matmul
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter
    from fusedpar.ops.comm.transport import EmulatedTransport

    if args.stub_driver:
        return _stub_driver_rows(args, ctx)
    calls = args.calls or ((2000 if ctx.gpu else 200) if args.stub_kernels else (200 if ctx.gpu else 3))
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
    rows = [{"entry": name, "calls": calls, "kernels": "stubbed" if args.stub_kernels else "launched",
             "host_us_per_call": _host_us(ctx, fn, calls, args.stub_kernels)} for name, fn in cases]
    if args.profile > 0:
        with _stubbed_kernels() if args.stub_kernels else contextlib.nullcontext():
            ctx.notes.append(_profile_note(cases[1][1], calls, args.profile))
    if args.stub_kernels:
        ctx.notes.append("--stub-kernels: kernel launches were no-ops; the host path alone (no Triton launch"
                         + (", no interpreted execution)." if ctx.smoke else ")."))
    elif ctx.smoke:
        ctx.notes.append("CPU smoke mode: interpreted kernels; these are not launch costs.")
    return rows


def _stub_driver_rows(args, ctx):
    """The rows of ``--stub-driver``: ``benchmarks._stub_launch`` in a process of its own (Triton
    must be imported there with the stub driver active and the interpreter off)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "benchmarks._stub_launch", "--calls", str(args.calls or 100),
           "--windows", "3" if args.calls and args.calls < 10 else "20"]
    cmd += ["--entries", args.entries] if args.entries else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the stub-driver measurement failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    ctx.notes.append(f"--stub-driver: Triton {report['triton']}'s compiled launch path, driver stubbed (no GPU work); "
                     f"floor (the C launcher alone) {report['floor_us']} us; x_floor = host_us_per_call / floor.")
    return [dict(row, kernels="stub driver") for row in report["rows"]]
