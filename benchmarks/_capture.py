"""Compile the shipped launchers' kernels for an NVIDIA target without a GPU.

:class:`Capture` is a context manager under which a launcher call runs its real host code
(checks, allocation on ``meta`` tensors, flags, grid, autotuner pruning) but every
``kernel[grid](...)`` *records* the variant it would launch instead of running it: the bound
signature with Triton's argument specialisation for the target, the constexprs, ``num_warps`` /
``num_stages`` and the grid. An autotuned launch records every config of the tuner with the
decision of its prune rule (kept configs are the ones the tuner can pick). :func:`compile_variant`
then compiles one recorded variant with ``triton.compile`` for a ``GPUTarget`` and reads
registers and spills from ``ptxas -v``, shared memory from Triton's metadata, the MMA
instruction kind from the PTX, and the load path and MMA counts from the SASS of the cubin
(:mod:`benchmarks._sass`, disassembled in batches by :class:`SassBatch`). Results are cached on
disk by Triton's source hash, the target and the options; a cached result without every field
of :data:`RESULT_FIELDS` (written before a field existed) is compiled again.

``TRITON_INTERPRET`` must be unset in this process: the launchers take their compiled path.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import sys
import types
from dataclasses import dataclass, field

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

from ._sass import FIELDS as SASS_FIELDS
from ._sass import disassemble, summarize_functions

#: per architecture: compute capability, shared memory one program may use (bytes, the
#: ``max_shared_mem`` torch/Triton report on H100 / A100), SM count of the flagship part
ARCHS = {
    "sm_90": dict(cc=90, smem=232448, sms=132),
    "sm_80": dict(cc=80, smem=166912, sms=108),
}
CUDA_GRID_LIMITS = (2 ** 31 - 1, 65535, 65535)


@dataclass
class Variant:
    """One launch the launchers would make: what to compile and where it came from."""

    kernel: str
    module: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    grid: tuple
    config: dict
    decision: str  # "fixed" (no tuner), "kept" / "pruned" (autotuner prune rule)
    cases: list = field(default_factory=list)
    estimate: int | None = None
    source: str = ""  # Triton's hash of the kernel's source and of the jit functions it calls

    def key(self, cc: int) -> str:
        blob = json.dumps([self.module, self.kernel, self.source, triton.__version__, sorted((str(k), str(v)) for k, v in self.signature.items()),
                           sorted((str(k), repr(v)) for k, v in self.constexprs.items()),
                           sorted((str(k), repr(v)) for k, v in self.attrs.items()),
                           sorted((k, repr(v)) for k, v in self.options.items()), cc])
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


class _NoDevice:
    """Stand-in for ``torch.cuda.device``: the launchers enter it around their launches."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Capture:
    """Record the launches of the launchers called inside ``with Capture("sm_90") as cap:``.

    Operands are ``meta`` tensors (no memory); the launchers see the architecture's shared
    memory limit and SM count. ``cap.case(name, dtype)`` labels the launches that follow;
    ``estimates`` maps a kernel name to ``f(config, named_args, **kwargs) -> bytes``, the prune
    rule's shared-memory estimate, recorded next to each autotuned config. ``sample=True``
    records, per autotuned launch, only the kept config with the largest estimate (the CI subset: where
    the shared-memory and register limits bite; every kept config is in the full subset's tables)."""

    def __init__(self, arch: str, estimates: dict | None = None, sample: bool = False):
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise RuntimeError("compiling for a GPU target needs TRITON_INTERPRET unset (it is set)")
        spec = ARCHS[arch]
        self.arch, self.cc, self.smem, self.sms = arch, spec["cc"], spec["smem"], spec["sms"]
        self.target = GPUTarget("cuda", self.cc, 32)
        self.backend = make_backend(self.target)
        self.estimates = estimates or {}
        self.sample = sample
        self.variants: dict[str, Variant] = {}
        #: cases whose launcher refused this architecture (fp8 below 8.9): case -> its error
        self.unsupported: dict[str, str] = {}
        self.label = ("?", "?")
        self._binders: dict = {}
        self._undo: list = []
        self._tuning: dict | None = None

    @contextlib.contextmanager
    def case(self, name: str, dtype):
        self.label = (name, str(dtype).replace("torch.", ""))
        try:
            yield
        finally:
            self.label = ("?", "?")

    # -- patching ---------------------------------------------------------------------------
    def _patch(self, obj, name, value):
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        cap = self
        from fusedpar.kernels import checks, runtime

        self._patch(JITFunction, "run", lambda fn, *a, grid, warmup, **kw: cap.record(fn, a, grid, kw))
        self._patch(Autotuner, "run", lambda tuner, *a, **kw: cap.record_tuned(tuner, a, kw))
        self._patch(torch.cuda, "device", _NoDevice)
        props = types.SimpleNamespace(multi_processor_count=self.sms, name=f"capture-{self.arch}")
        self._patch(torch.cuda, "get_device_properties", lambda *a, **k: props)
        original_usable, original_limit = checks.check_device_usable, runtime.shared_memory_limit
        original_capability, original_sms = runtime.device_capability, runtime.multiprocessor_count
        runtime.clear_tuning_caches()  # a memoised choice would launch without the patched Autotuner.run

        def usable(name, t):
            if t.device.type != "meta":
                original_usable(name, t)

        for mod in [m for n, m in sys.modules.items() if n.startswith("fusedpar.kernels")]:
            for attr, value in list(vars(mod).items()):
                if value is original_limit:
                    self._patch(mod, attr, lambda index=0: cap.smem)
                elif value is original_capability:
                    self._patch(mod, attr, lambda index=0: (cap.cc // 10, cap.cc % 10))
                elif value is original_sms:  # cached per device index: the captured arch's count instead
                    self._patch(mod, attr, lambda index=0: cap.sms)
                elif value is original_usable:
                    self._patch(mod, attr, usable)
        return self

    def __exit__(self, *exc):
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)
        return False

    # -- recording --------------------------------------------------------------------------
    def record(self, fn: JITFunction, args, grid, kwargs):
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton >= 3.7 binds it too (3.6: absent)
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = self._binders.get(fn)
        if binder is None:
            binder = self._binders[fn] = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, spec, opts)
        grid = tuple(grid(bound) if callable(grid) else grid)
        config = {k: v for k, v in bound.items() if k.startswith(("BLOCK_", "GROUP_M"))}
        config.update(num_warps=options.num_warps, num_stages=options.num_stages)
        tuning = self._tuning or {}
        estimate = self.estimates.get(fn.fn.__name__)
        if not tuning and estimate is not None:  # a fixed config (persistent GEMM): same rule
            tuning = dict(decision="fixed", estimate=estimate(config, bound))
        v = Variant(kernel=fn.fn.__name__, module=fn.module, signature=signature, constexprs=constexprs,
                    attrs=attrs, options=dict(options.__dict__), grid=grid, config=config,
                    decision=tuning.get("decision", "fixed"), estimate=tuning.get("estimate"), source=fn.cache_key)
        key = v.key(self.cc)
        v = self.variants.setdefault(key, v)
        if tuning.get("decision") == "kept":
            v.decision = "kept"  # kept for one case is launchable, whatever other cases prune
        label = (*self.label, "x".join(str(g) for g in grid))
        if label not in v.cases:
            v.cases.append(label)
        return None

    def record_tuned(self, tuner: Autotuner, args, kwargs):
        tuner.nargs = dict(zip(tuner.arg_names, args))
        kept = tuner.prune_configs(kwargs)
        estimate = self.estimates.get(tuner.base_fn.__name__)
        configs = tuner.configs
        if self.sample:
            largest = max(kept, key=lambda c: estimate(c, tuner.nargs, **kwargs) if estimate else 0)
            configs = [c for c in configs if c is largest]
        try:
            for cfg in configs:
                est = estimate(cfg, tuner.nargs, **kwargs) if estimate else None
                self._tuning = dict(decision="kept" if cfg in kept else "pruned", estimate=est)
                tuner.fn.run(*args, **kwargs, **cfg.all_kwargs())
        finally:
            self._tuning = None
            tuner.nargs = None


# --------------------------------------------------------------------------------------------
# compiling one variant (runs in worker processes)
# --------------------------------------------------------------------------------------------
_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
#: what a cached result must hold (one without the SASS fields predates them: compiled again)
RESULT_FIELDS = ("regs", "spill_stores", "spill_loads", "stack", "shared", "mma") + SASS_FIELDS


def mma_kind(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "-"


def cache_path(cache_dir: str | None, key: str) -> str | None:
    return os.path.join(cache_dir, f"{key}.json") if cache_dir else None


def cached(path: str | None) -> dict | None:
    """The cached result at ``path`` if it holds every field of :data:`RESULT_FIELDS`."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        return None
    return res if all(k in res for k in RESULT_FIELDS) else None


def store(path: str | None, res: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, path)


class SassBatch:
    """Completes freshly compiled results (:func:`compile_variant`'s with a ``cubin``): every
    ``batch_bytes`` of cubins, one ``nvdisasm`` call (:func:`benchmarks._sass.disassemble`) adds
    their SASS fields in place, and they are cached. ``add`` returns the result it was given."""

    def __init__(self, cc: int, cache_dir: str | None, batch_bytes: int = 2 << 20):
        self.cc, self.cache_dir, self.batch_bytes = cc, cache_dir, batch_bytes
        self.pending: list = []
        self.size = 0

    def add(self, key: str, res: dict) -> dict:
        if "cubin" in res:
            self.pending.append((key, res))
            self.size += len(res["cubin"])
            if self.size >= self.batch_bytes:
                self.flush()
        return res

    def flush(self) -> None:
        cubins = [res.pop("cubin") for _, res in self.pending]
        for (key, res), funcs in zip(self.pending, disassemble(cubins, self.cc)):
            res.update(summarize_functions(funcs))
            store(cache_path(self.cache_dir, key), res)
        self.pending, self.size = [], 0


def compile_variant(job) -> dict:
    """``job = (key, module, kernel, signature, constexprs, attrs, options, cc, cache_dir)`` ->
    a cached result (``{"regs", "spill_stores", "spill_loads", "stack", "shared", "mma"}`` and the
    SASS fields, :data:`benchmarks._sass.FIELDS`), or a fresh one with its ``cubin`` instead of
    the SASS fields (:class:`SassBatch` completes and caches it), or ``{"error": ...}``."""
    key, module, kernel, signature, constexprs, attrs, options, cc, cache_dir = job
    res = cached(cache_path(cache_dir, key))
    if res is not None:
        return res
    fn = getattr(importlib.import_module(module), kernel)
    src = ASTSource(fn, signature, constexprs, attrs)
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # ptxas must run (and print its log) every time
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    except Exception as e:  # noqa: BLE001 - any compiler error is a reported failure
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
    log = buf.getvalue()
    m, r = _PTXAS.search(log), _REGS.search(log)
    res = dict(regs=int(r.group(1)) if r else None, stack=int(m.group(1)) if m else None,
               spill_stores=int(m.group(2)) if m else None, spill_loads=int(m.group(3)) if m else None,
               shared=int(compiled.metadata.shared), mma=mma_kind(compiled.asm["ptx"]))
    res["cubin"] = compiled.asm["cubin"]
    return res
