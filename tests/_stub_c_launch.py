"""Run as a script (no GPU, not under the interpreter): a launch plan that calls the C launch
function of Triton's CUDA launcher itself passes it exactly what ``CudaLauncher.__call__`` would.

Triton's real compiled-launch path against the stand-in driver of ``benchmarks._stub_driver``
(kernels compiled for sm_90, Triton's generated C launcher built for real). Every
``CudaLauncher``'s C launch function is wrapped to record its arguments. For each case, after
the plans are built: one call through the plan (the direct C launch), then the same plan's launch
rebuilt to go through the launcher object (``CudaLauncher.__call__``, as on a release without a
known layout), with the same tensors and stream; the two recorded argument lists must be equal
(tensors and the descriptor scratch by identity), and so must the two requests to Triton's
allocator (a recording one is set: the launchers keep an allocator set by someone else). Then
replay invariance: the dense GEMM and the TP ops (rings and the symmetric path, tp 8 emulated)
called twice launch the same kernels with the same scalar arguments. Prints a JSON report;
``tests/test_gemm_launch_plans.py`` reads it.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._stub_driver import activate  # noqa: E402

activate()

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.nvidia import driver as nvidia_driver  # noqa: E402

from fusedpar.kernels import launch, matmul  # noqa: E402
from fusedpar.kernels.gemm_loads import ensure_scratch_allocator  # noqa: E402
from fusedpar.kernels.rmsnorm import rms_norm_fwd  # noqa: E402

CALLS: list = []
SCRATCH: list = []  # (size, alignment, stream) of every request to Triton's allocator


def _recording_allocator(size, alignment, stream):
    SCRATCH.append((size, alignment, stream))
    return _scratch(size, alignment, stream)


ensure_scratch_allocator()
_scratch = triton.runtime._allocation._allocator.get()
triton.set_allocator(_recording_allocator)  # someone else's allocator: the launchers keep it
_init = nvidia_driver.CudaLauncher.__init__


def _recording_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    c_launch = self.launch
    self.launch = lambda *xs: (CALLS.append(xs), c_launch(*xs))[1]


nvidia_driver.CudaLauncher.__init__ = _recording_init
BUILT: list = []
_launcher = launch._launcher


def _recording_launcher(compiled, grid, args, slots):
    BUILT.append((compiled, grid, args, slots))
    return _launcher(compiled, grid, args, slots)


launch._launcher = _recording_launcher


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return x is y
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def _describe(xs):
    return [f"tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else
            (_describe(x) if isinstance(x, tuple) else repr(x)) for x in xs]


def check(name, call, report):
    for _ in range(3):
        call()  # compile, tune, build the plan
    BUILT.clear()
    launch.clear_plans()
    call()
    call()  # the second launch of the key builds the plan
    if not BUILT:
        report[name] = {"error": "no plan was built"}
        return
    compiled, grid, args, slots = BUILT[-1]
    direct = _launcher(compiled, grid, args, slots)
    saved, launch._C_LAUNCH = launch._C_LAUNCH, None
    try:
        through_launcher = _launcher(compiled, grid, args, slots)
    finally:
        launch._C_LAUNCH = saved
    tensors = tuple(torch.empty(4, dtype=torch.int8) for _ in slots)
    CALLS.clear()
    SCRATCH.clear()
    direct(tensors, 0)
    through_launcher(tensors, 0)
    report[name] = {"layout": launch._c_launch_layout(compiled.run), "calls": len(CALLS), "grid": list(grid),
                    "scratch": list(SCRATCH), "equal": len(CALLS) == 2 and _same(CALLS[0], CALLS[1]),
                    "args": [_describe(c) for c in CALLS]}


def _scalars(xs):
    """The non-tensor kernel arguments of one recorded C launch (what a CUDA graph would replay)."""
    kernel_args = xs[-1] if launch._C_LAUNCH == "tuple" else xs[13:]
    return tuple(a for a in kernel_args if not isinstance(a, torch.Tensor))


def replay(name, call, report):
    """Two identical calls after warm-up launch the same kernels with the same scalar arguments:
    no host state (an epoch, a counter) is baked into a launch that a graph replay would repeat."""
    for _ in range(3):
        call()
    seen = []
    for _ in range(2):
        CALLS.clear()
        call()
        seen.append([(xs[:3], xs[4], _scalars(xs)) for xs in CALLS])
    report[name] = {"launches": len(seen[0]), "invariant": seen[0] == seen[1]}


def main():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    odd = torch.randn(64, 66, generator=g).to(torch.bfloat16)[:, 1:61]  # rows not 16-byte aligned: pointer loads
    report = {}
    tall = torch.randn(512, 64, generator=g).to(torch.bfloat16)
    check("matmul_tma", lambda: matmul(a, w), report)
    check("matmul_tma_two_programs", lambda: matmul(tall, w), report)
    check("matmul_pointer_loads", lambda: matmul(odd, w[:, :60]), report)
    check("rms_norm_fwd", lambda: rms_norm_fwd(a, w[0]), report)
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter
    from fusedpar.ops.comm.transport import EmulatedTransport
    ring, waits = EmulatedTransport(8, 0), EmulatedTransport(8, 0, in_kernel_waits=True)
    x, x_rs, w_rs = a[:16], tall[:128, :8], w[:, :8]
    replays = {}
    replay("matmul", lambda: matmul(a, w), replays)
    replay("all_gather_matmul ring", lambda: all_gather_matmul(x, w, gather_dim=0, transport=ring), replays)
    replay("matmul_reduce_scatter ring", lambda: matmul_reduce_scatter(x_rs, w_rs, scatter_dim=0, transport=ring),
           replays)
    replay("all_gather_matmul persistent", lambda: all_gather_matmul(x, w, gather_dim=0, transport=waits), replays)
    replay("matmul_reduce_scatter persistent",
           lambda: matmul_reduce_scatter(x_rs, w_rs, scatter_dim=0, transport=waits), replays)
    print(json.dumps({"cases": report, "replays": replays, "layout_release": launch._C_LAUNCH}))


if __name__ == "__main__":
    main()
