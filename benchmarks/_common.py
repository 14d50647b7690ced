"""The benchmark registry, timing, environment line and output (markdown table, JSON)."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

_GPU = None
# smoke mode (no GPU) caps every size given on the command line at this, so that a GPU command runs
# on a CPU machine in seconds: it checks the code path, not performance
SMOKE_MAX_DIM = 64


def select_backend() -> bool:
    """Decide compiled (CUDA) vs interpreter before triton is imported. Returns True on GPU."""
    global _GPU
    if _GPU is None:
        import torch

        _GPU = torch.cuda.is_available() and os.environ.get("FUSEDPAR_BENCH_DEVICE", "cuda") == "cuda"
        if not _GPU:
            os.environ["TRITON_INTERPRET"] = "1"
    return _GPU


@dataclass
class Op:
    name: str
    help: str
    run: Callable  # run(args, ctx) -> list[dict]
    add_args: Callable = lambda parser: None
    in_all: bool = True


REGISTRY: dict[str, Op] = {}


def register(name: str, help: str, *, add_args: Callable | None = None, in_all: bool = True):
    """Decorator: ``@register("matmul", "...", add_args=fn)`` on ``run(args, ctx)``."""

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} registered twice")
        REGISTRY[name] = Op(name, help, fn, add_args or (lambda p: None), in_all)
        return fn

    return deco


@dataclass
class Context:
    gpu: bool
    device: "torch.device"
    warmup_ms: int = 25
    rep_ms: int = 100
    notes: list = field(default_factory=list)

    @property
    def smoke(self) -> bool:
        return not self.gpu

    def smoke_shape(self, shape: tuple) -> tuple:
        """``shape`` as run: unchanged on a GPU; in smoke mode each size capped at
        :data:`SMOKE_MAX_DIM` (the interpreter would take hours on GPU shapes), with a note."""
        if not self.smoke or max(shape) <= SMOKE_MAX_DIM:
            return tuple(shape)
        capped = tuple(min(d, SMOKE_MAX_DIM) for d in shape)
        note = (f"CPU smoke mode: shapes capped at {SMOKE_MAX_DIM} per dimension "
                f"({'x'.join(map(str, shape))} ran as {'x'.join(map(str, capped))}).")
        if note not in self.notes:
            self.notes.append(note)
        return capped

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on GPU; under the interpreter
        (smoke mode) the wall-clock time of one run: it shows the timed path runs, and no repeat
        would make an interpreted time a performance number."""
        if self.gpu:
            import triton

            return float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def l2_bytes(self) -> int:
        if not self.gpu:
            return 0
        import torch

        return int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 << 20))

    def rotating(self, make: Callable[[], tuple], nbytes: int) -> Callable[[], tuple]:
        """Input sets cycled between calls so that a working set that fits in L2 is not timed hot."""
        n = 1 if self.smoke or nbytes <= 0 else max(1, min(8, math.ceil(2 * self.l2_bytes() / nbytes)))
        sets = [make() for _ in range(n)]
        state = {"i": 0}

        def nxt():
            state["i"] = (state["i"] + 1) % n
            return sets[state["i"]]

        return nxt


def parse_dtype(name: str):
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise argparse.ArgumentTypeError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def parse_shape(text: str) -> tuple:
    """``"MxNxK"`` -> ``(M, N, K)`` (the ``--shapes`` argument of the GEMM benchmarks)."""
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like MxNxK, got {text!r}") from None
    return m, n, k


def env_info(ctx: Context) -> dict:
    import torch
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "mode": "compiled (CUDA)" if ctx.gpu else "CPU smoke (Triton interpreter): numbers are NOT performance",
    }
    if ctx.gpu:
        props = torch.cuda.get_device_properties(ctx.device)
        info["device"] = props.name
        info["cuda"] = torch.version.cuda
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - the driver line is informative only
            info["driver"] = "unknown"
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()})"
    if os.environ.get("FUSEDPAR_TUNE_CONFIGS", "").strip():
        # the test-time limit on the autotuners: such figures are not the tuned kernels' (the
        # report leaves these runs out)
        info["tune_configs"] = os.environ["FUSEDPAR_TUNE_CONFIGS"].strip()
    return info


def fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or math.isnan(v):
            return f"{v}"
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def emit(op_name: str, rows: list[dict], ctx: Context, info: dict, json_path: str | None, results: dict):
    print(f"\n### {op_name}")
    print(markdown_table(rows))
    for n in ctx.notes:
        print(f"note: {n}")
    ctx.notes.clear()
    results[op_name] = rows
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": info, "results": results}, f, indent=2, default=str)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# Default tolerances of check_close: relative max error (max |ours - reference| over max |reference|)
# of a result against a baseline that computes the same thing in another order, per dtype.
#   fp32: ieee products, fp32 sums: ~sqrt(K) * 2^-24 of the scale for K-long reductions (< 1e-5 for
#         K ~ 1e5); 1e-4 leaves a margin for chunked / ring reductions and still fails a wrong
#         result by orders of magnitude.
#   tf32: fp32 operands rounded to 10 mantissa bits (2^-11 ~ 4.9e-4 relative each) before the dot
#         products, on both sides (ours and torch's) in different orders: ~1e-3; 5e-3 covers it.
#   fp16: inputs and outputs rounded to 10 mantissa bits (2^-11), fp32 accumulation; attention's
#         backward rounds P and dS once more: a few 1e-3; 1e-2.
#   bf16: 7 mantissa bits (2^-8 ~ 3.9e-3 relative per rounding), the same roundings: 5e-2.
FP32_TOLERANCE = 1e-4
TF32_TOLERANCE = 5e-3
TOLERANCES = {"float16": 1e-2, "bfloat16": 5e-2}


def tf32_enabled() -> bool:
    """Whether fp32 GEMMs run on TF32 here: the choice the kernels make
    (:func:`fusedpar.kernels.runtime.input_precision`), and torch.matmul's on the same flag."""
    import torch

    from fusedpar.kernels.runtime import input_precision

    return input_precision(torch.float32) == "tf32"


def default_tolerance(*dtypes, tf32: bool | None = None) -> float:
    """The check_close tolerance of a comparison between tensors of ``dtypes``: the coarsest of
    theirs (a bf16 result against an fp32 reference gets bf16's). ``tf32=None`` asks
    :func:`tf32_enabled`. Non-float dtypes compare exactly (0.0)."""
    tols = []
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        if name == "float32":
            if tf32 is None:
                tf32 = tf32_enabled()
            tols.append(TF32_TOLERANCE if tf32 else FP32_TOLERANCE)
        elif name == "float64":
            tols.append(FP32_TOLERANCE)
        else:
            tols.append(TOLERANCES.get(name, 0.0))
    return max(tols)


def check_close(ours, reference, tol: float | None = None) -> float:
    """Relative max error of ``ours`` against ``reference`` (in fp32); raises if above ``tol``
    (default: :func:`default_tolerance` of the two dtypes) so that a benchmark never reports the
    speed of a wrong result."""
    if tol is None:
        tol = default_tolerance(ours.dtype, reference.dtype)
    ours, reference = ours.float(), reference.float()
    err = ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    if not err <= tol:
        raise AssertionError(f"benchmark result differs from the baseline: relative max error {err:.3g} > {tol}")
    return err
