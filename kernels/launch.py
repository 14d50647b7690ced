"""Launch plans: a repeated launch goes straight to the compiled kernel.

Triton's launch path rebuilds, on every call, what a training step repeats unchanged: the binder
walks every argument (dtype strings, 16-byte alignment of each pointer and each int, ints equal to
1), a cache key is hashed from that, the autotuner builds its own key, then the launcher's
arguments are gathered into a dict. For a GEMM of ~50 arguments that is ~10x the generated C
launcher's own time. A launcher here instead forms a *plan key* from what it was called with --
for each tensor its shape, strides, dtype, device and ``data_ptr() % 16``; every other argument
as given -- and keeps, per key, a :class:`LaunchPlan`: the ``CompiledKernel`` Triton picked, the
grid, and every launch argument in the kernel's parameter order, tensors left as slots. A hit
fills the slots with the call's tensors and calls the compiled launcher directly.

Why that is exact: everything Triton specialises on (dtypes, pointer and int divisibility by 16,
ints equal to 1, constexprs, the tuned config, the device) is a function of the plan key, because
the launcher derives every int argument and flag from shapes, strides and dtypes, and each
pointer's alignment is in the key. The launcher's checks are functions of the key too, so a key
that passed them once passes them again. A launcher builds no plan where a call does work that is
not a launch (a copied bias, an empty product); the plan is then built by a later call or never.

Falls back (the caller takes Triton's path): under the interpreter (no plans are built), while a
Triton launch hook or a pre-run hook is set, while Triton's global compile options (``debug``,
instrumentation, ...) differ from the plan's, when another device is current than the one the plan
was built on. A plan is built on the second launch of its key (a key that never repeats costs a set
insertion, not a plan). Plans are forgotten with the autotuners' choices
(:func:`~fusedpar.kernels.runtime.clear_tuning_caches`, ``tuner.cache.clear()``). Not seen by a
plan: a change of a module global a kernel reads (Triton's path raises for it).
"""
from __future__ import annotations

import operator
import re
import threading

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import _allocation, driver
from triton.runtime.autotuner import Autotuner

__all__ = ["LaunchPlan", "LaunchRecord", "PlanCache", "build_plan", "clear_plans", "describe", "exact_ints", "launch_kernel",
           "launch_planned", "plans_generation"]

#: every plan cache, so :func:`clear_plans` reaches them all
_CACHES: list["PlanCache"] = []


def describe(t: torch.Tensor | None):
    """A tensor argument's part of a plan key: everything about it that a launcher or Triton reads
    (the launcher's checks and int arguments: shape, strides, dtype, device; Triton's pointer
    specialisation: the address modulo 16). None stays None; anything else is left to the
    launcher's checks (a key that holds it finds no plan)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return _NOT_A_TENSOR
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


#: a plan key's entry for a tensor argument that is not a tensor (no plan is built with it)
_NOT_A_TENSOR = object()


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (a ``HookChain`` with calls in Triton >= 3.5, else any
    value but None)."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _state_reader():
    """``state()``: Triton's global options that enter its kernel cache key besides the arguments
    (those of them this Triton has), read as one tuple expression."""
    rt, comp = knobs.runtime, knobs.compilation
    reads = [f"{o}.{n}" for o, n in (("rt", "debug"), ("comp", "instrumentation_mode"),
                                      ("comp", "fpsan_homomorphic_casts"), ("rt", "add_stages_inspection_hook"))
             if hasattr(rt if o == "rt" else comp, n)]
    return eval(f"lambda: ({', '.join(reads)},)", {"rt": rt, "comp": comp})


_compile_state = _state_reader()
#: launch hooks are HookChains (Triton >= 3.5): a set hook is a non-empty ``calls``
_CHAINS = hasattr(knobs.runtime.launch_enter_hook, "calls") and hasattr(knobs.runtime.launch_exit_hook, "calls")


class _Applies:
    """What every plan checks before it launches: no hook, the compile options and the device of
    its build (``jit``, ``state``, ``device``, ``active``: the driver)."""

    __slots__ = ()

    def stream(self):
        """The current stream where the plan applies now, else None."""
        rt = knobs.runtime
        if ((rt.launch_enter_hook.calls or rt.launch_exit_hook.calls) if _CHAINS else
                (_hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook))):
            return None
        if self.jit.pre_run_hooks or _compile_state() != self.state:
            return None
        active = self.active
        device = active.get_current_device()
        return active.get_current_stream(device) if device == self.device else None


class LaunchPlan(_Applies):
    """One key's launch: the compiled kernel, its grid and its arguments in parameter order, with
    ``slots`` the positions the tensors of each call go to. The call itself is a function made
    for the plan (:func:`_launcher`): the constant arguments are literals or closure cells in it,
    so a launch builds no list and copies nothing."""

    __slots__ = ("call", "device", "jit", "active", "state", "args", "slots", "extra")

    def __init__(self, jit, compiled: CompiledKernel, grid: tuple, args: list, slots: tuple, device: int):
        self.jit, self.device, self.args, self.slots = jit, device, args, slots
        self.active, self.state = driver.active, _compile_state()
        self.call = _launcher(compiled, (tuple(grid) + (1, 1))[:3], args, slots)
        self.extra = None  # what the launcher keeps beside the launch (an output's shape and dtype)

    def launch(self, tensors) -> bool:
        """Launch with ``tensors`` (one per slot, in order) on the current stream; False, having
        launched nothing, where the plan does not apply now (:meth:`stream`)."""
        stream = self.stream()
        if stream is None:
            return False
        self.call(tensors, stream)
        if _RECORDS:
            stack = _RECORDS.get(threading.get_ident())
            if stack:
                stack[-1].append((self, tensors))
        return True


#: ``{thread id: its open LaunchRecord lists, the innermost last}``: a thread records its own launches
_RECORDS: dict = {}


class LaunchRecord(list):
    """``with LaunchRecord() as rec:`` -- ``rec`` holds ``(plan, tensors)`` for every
    :class:`LaunchPlan` that launched inside the block (not the launches that took Triton's path):
    what a caller needs to launch the same plans again with other tensors of the same key."""

    def __enter__(self):
        _RECORDS.setdefault(threading.get_ident(), []).append(self)
        return self

    def __exit__(self, *exc):
        ident = threading.get_ident()
        stack = _RECORDS[ident]
        # by identity (records compare as lists: two empty ones are equal)
        del stack[next(i for i in range(len(stack) - 1, -1, -1) if stack[i] is self)]
        if not stack:
            del _RECORDS[ident]
        return False

    def slots(self, named):
        """``(plan, pick)`` of the one plan launch recorded, ``pick(named)`` giving its tensors from
        a tuple ``named`` of another call (each found here by identity, its position kept); None
        where the block launched other than once through a plan or a tensor is not in ``named``."""
        if len(self) != 1:
            return None
        plan, tensors = self[0]
        slots = []
        for t in tensors:
            pos = next((i for i, n in enumerate(named) if n is t), None)
            if pos is None:
                return None
            slots.append(pos)
        pick = operator.itemgetter(*slots)
        return plan, (pick if len(slots) > 1 else lambda named: (pick(named),))


#: argument types written into a plan's launch function as literals
_LITERALS = (bool, int, str, type(None))


#: how the C launch function of Triton's CUDA launcher takes its arguments, per Triton release
#: whose launcher (``CudaLauncher.__call__``) was read for it: "flat" (3.6: grid, stream, function,
#: the two launch flags, both scratch pointers, then the launch metadata, the hooks and the
#: kernel's arguments), "tuple" (3.9: the metadata and hooks before the scratch pointers, then the
#: argument annotations, the kernel signature and the kernel's arguments as one tuple). Another
#: release calls the launcher object itself.
_C_LAUNCH_LAYOUTS = {(3, 6): "flat", (3, 9): "tuple"}
_C_LAUNCH = _C_LAUNCH_LAYOUTS.get(tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]))


def _c_launch_layout(run) -> str | None:
    """The layout (:data:`_C_LAUNCH_LAYOUTS`) in which a plan may call ``run``'s C launch function
    itself, or None: not this release's CUDA launcher, profile scratch (instrumentation), the
    global-sanitizer build (its per-launch state)."""
    if _C_LAUNCH is None or type(run).__name__ != "CudaLauncher" or not callable(getattr(run, "launch", None)):
        return None
    if getattr(run, "profile_scratch_size", 1) or getattr(run, "gsan_enabled", False):
        return None
    if hasattr(run, "arg_annotations") != (_C_LAUNCH == "tuple"):  # (the layout's own mark)
        return None
    return _C_LAUNCH


def _launcher(compiled: CompiledKernel, grid: tuple, args: list, slots: tuple):
    """``call(tensors, stream)``: the compiled kernel launched with the grid, ``stream`` and every
    argument, the slots taken from ``tensors`` in order (what ``JITFunction.run`` passes, without
    launch metadata or hooks: :meth:`LaunchPlan.launch` only runs while none is set). Where the
    release's launcher is known (:func:`_c_launch_layout`) the call goes to its C launch function
    with what ``CudaLauncher.__call__`` would pass it (the global scratch from Triton's allocator,
    sized for the grid), skipping the launcher's Python; else to the launcher."""
    run = compiled.run
    env = {"_run": run, "_function": compiled.function, "_metadata": compiled.packed_metadata}
    slot_of = {pos: i for i, pos in enumerate(slots)}
    parts = []
    for pos, v in enumerate(args):
        if pos in slot_of:
            parts.append(f"t[{slot_of[pos]}]")
        elif type(v) in _LITERALS:
            parts.append(repr(v))
        else:  # a float, a dtype: a cell of its own
            env[f"_c{pos}"] = v
            parts.append(f"_c{pos}")
    g = ", ".join(str(int(x)) for x in grid)
    kernel_args = ", ".join(parts)
    layout = _c_launch_layout(run)
    if layout is None:
        body = f"_run({g}, stream, _function, _metadata, None, None, None, {kernel_args})"
    else:
        env.update(_launch=run.launch, _alloc=_allocation._allocator)
        scratch = "None"
        if run.global_scratch_size > 0:
            size = int(grid[0]) * int(grid[1]) * int(grid[2]) * run.num_ctas * run.global_scratch_size
            scratch = f"_alloc.get()({size}, {int(run.global_scratch_align)}, stream)"
        env.update(_coop=run.launch_cooperative_grid, _pdl=run.launch_pdl)
        flags = "_coop, _pdl"
        if layout == "flat":
            body = f"_launch({g}, stream, _function, {flags}, {scratch}, None, _metadata, None, None, None, {kernel_args})"
        else:
            env.update(_annotations=run.arg_annotations, _signature=run.kernel_signature)
            body = (f"_launch({g}, stream, _function, {flags}, _metadata, None, None, None, {scratch}, None, "
                    f"_annotations, _signature, ({kernel_args}{',' if parts else ''}))")
    src = f"def call(t, stream):\n    {body}\n"
    exec(compile(src, f"<launch plan of {compiled.name if hasattr(compiled, 'name') else 'a kernel'}>", "exec"), env)
    return env["call"]


def build_plan(jit, compiled, args: tuple, constexprs: dict, grid: tuple) -> LaunchPlan | None:
    """The plan of a launch that just ran ``jit[grid](*args, **constexprs)`` (``constexprs``: the
    launcher's flags and the config's block sizes) and returned ``compiled``; None where it cannot
    be replayed: not a ``CompiledKernel`` (the interpreter, the compile check's capture), hooks
    set, a parameter neither positional nor in ``constexprs``. (A kernel's global scratch is
    allocated per call by the launcher a plan calls, as on Triton's path.)"""
    if not isinstance(compiled, CompiledKernel) or jit.pre_run_hooks:
        return None
    rt = knobs.runtime
    if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
        return None
    names = jit.arg_names
    if len(args) > len(names) or any(n not in constexprs for n in names[len(args):]):
        return None
    values = list(args) + [constexprs[n] for n in names[len(args):]]
    slots = tuple(i for i, v in enumerate(values) if isinstance(v, torch.Tensor))
    for i in slots:
        values[i] = None
    return LaunchPlan(jit, compiled, grid, values, slots, driver.active.get_current_device())


class PlanCache(dict):
    """``{plan key: LaunchPlan}`` of one launcher and the keys launched once (``seen``), emptied by
    :func:`clear_plans` and each when it holds ``limit`` entries (shapes that never repeat cannot
    grow it without bound)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit
        self.seen: set = set()
        _CACHES.append(self)

    def clear(self):
        super().clear()
        self.seen.clear()

    def second_launch(self, key) -> bool:
        """Whether ``key`` (without a plan) has launched before; remembers it if not."""
        if key in self.seen:
            return True
        if len(self.seen) >= self.limit:
            self.seen.clear()
        self.seen.add(key)
        return False

    def find(self, key) -> LaunchPlan | None:
        """The plan of ``key``; None also for a key that cannot be hashed (an argument of a type the
        launcher's checks will reject)."""
        try:
            return self.get(key)
        except TypeError:
            return None

    def keep(self, key, plan: LaunchPlan | None) -> LaunchPlan | None:
        if plan is not None:
            if len(self) >= self.limit:
                dict.clear(self)
            self[key] = plan
            self.seen.discard(key)
        return plan


def clear_plans() -> None:
    """Forget every plan (the next launch of each key takes Triton's path and plans again)."""
    global _generation
    for cache in _CACHES:
        cache.clear()
    _generation += 1


#: how many times :func:`clear_plans` ran: what a caller that keeps plans outside a
#: :class:`PlanCache` (a recording of :meth:`LaunchRecord.slots`) compares before it launches one
_generation = 0


def plans_generation() -> int:
    """The count of :func:`clear_plans` calls so far (a plan kept under an older count is forgotten)."""
    return _generation


# --------------------------------------------------------------------------------------------
# Kernel-level plans: any launch site, keyed on the launch's own arguments
# --------------------------------------------------------------------------------------------
class KernelPlan(_Applies):
    """The compiled kernel of one :func:`launch_kernel` key: the arguments are passed as given,
    then the constexprs (flags and config) the kernel's signature has after them, in parameter
    order."""

    __slots__ = ("run", "function", "metadata", "tail", "grid", "meta", "device", "jit", "active", "state", "kernel")

    def __init__(self, jit, compiled, tail: tuple, grid, meta, device: int, kernel=None):
        self.kernel = kernel  # what was launched: the JITFunction or its autotuner
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.tail, self.grid, self.meta, self.device, self.jit = tail, grid, meta, device, jit
        self.active, self.state = driver.active, _compile_state()

    def launch(self, args, grid) -> bool:
        stream = self.stream()
        if stream is None:
            return False
        g = self.grid if self.grid is not None else grid(self.meta)
        g1, g2 = (g[1] if len(g) > 1 else 1), (g[2] if len(g) > 2 else 1)
        self.run(g[0], g1, g2, stream, self.function, self.metadata, None, None, None, *args, *self.tail)
        return True


#: the kernel-level plans (a plan is built the second time a key launches, so that arguments that
#: change every call never build plans that are not reused)
_KERNEL_PLANS = PlanCache()


def _arg_key(args, unspecialised: tuple) -> tuple:
    """The launch arguments' part of a kernel-level key: a tensor by dtype and address modulo 16
    (what Triton specialises a pointer on) and device (a ``meta`` tensor of the compile check's
    capture never meets a CUDA launch's plan), anything else by its value (finer than Triton, which
    keys an int by its divisibility by 16, being 1, and its width), except the parameters at
    ``unspecialised`` (``do_not_specialize``: an epoch, a chunk index), keyed by their type and
    width as Triton keys them, so that their value can change call after call."""
    key = [a if type(a) is int else (a.dtype, a.data_ptr() % 16, a.device) if isinstance(a, torch.Tensor)
           else (type(a), a) for a in args]  # (True, 1 and 1.0 are equal; Triton types them u1, constexpr and fp32)
    for i in unspecialised:
        if i < len(key) and type(args[i]) is int:
            v = args[i]
            key[i] = (int, -2 ** 31 <= v < 2 ** 31, v >= 2 ** 63)
    return tuple(key)


#: ``{id(kernel): (kernel, positions of its do_not_specialize parameters)}`` (kernels are keyed by
#: id: hashing a ``JITFunction`` hashes its source key; the kernel kept beside it proves the id)
_UNSPECIALISED: dict = {}


def _unspecialised(kernel) -> tuple:
    found = _UNSPECIALISED.get(id(kernel))
    if found is None or found[0] is not kernel:
        jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
        found = _UNSPECIALISED[id(kernel)] = (kernel, tuple(i for i, p in enumerate(getattr(jit, "params", ()))
                                                            if getattr(p, "do_not_specialize", False)))
    return found[1]


def launch_kernel(kernel, grid, args: tuple, flags: dict):
    """``kernel[grid](*args, **flags)`` (a ``JITFunction`` or an autotuner over one), through a
    :class:`KernelPlan` from the second compiled launch of a key on: the kernel, a fixed grid
    (a callable grid is evaluated on the config each call), the flags, :func:`_arg_key`. The
    interpreter and anything :func:`build_plan` refuses take Triton's path every time."""
    fixed = grid if type(grid) is tuple else None if callable(grid) else tuple(grid)
    try:
        key = (id(kernel), fixed, tuple(flags.items()), _arg_key(args, _unspecialised(kernel)))
        plan = _KERNEL_PLANS.get(key)
    except TypeError:  # an argument that cannot be hashed (a tensor descriptor): no plan
        key = plan = None
    if plan is not None and plan.kernel is kernel and plan.launch(args, grid):
        return None
    compiled = kernel[grid](*args, **flags)
    if (key is None or plan is not None or not isinstance(compiled, CompiledKernel)
            or not _KERNEL_PLANS.second_launch(key)):
        return compiled  # (a plan that did not apply now is kept: it applies again later)
    _KERNEL_PLANS.keep(key, _kernel_plan(kernel, compiled, grid, args, flags))
    return compiled


def launch_planned(plans: PlanCache, key, kernel, grid: tuple, args: tuple, flags: dict) -> LaunchPlan | None:
    """:func:`launch_kernel` for a launcher with plans of its own (keyed on its call, as the dense
    GEMM's): the second launch of ``key`` takes Triton's path and keeps its :class:`LaunchPlan` in
    ``plans`` (every tensor among ``args`` a slot, in order), which it returns. ``key`` None (the
    call builds no plan, or the launcher has one that does not apply now): :func:`launch_kernel`.
    ``kernel``: a ``JITFunction`` launched on a fixed ``grid``."""
    try:
        first = key is None or plans.find(key) is not None or not plans.second_launch(key)
    except TypeError:  # a key part that cannot be hashed: the launcher's checks have passed it, no plan
        first = True
    if first:
        launch_kernel(kernel, grid, args, flags)
        return None
    compiled = kernel[grid](*args, **flags)
    return plans.keep(key, build_plan(kernel, compiled, args, flags, grid))


def exact_ints(*values) -> bool:
    """Whether every value is None or an ``int`` that is not a ``bool`` (a launcher's checks take
    ``True`` for 1, Triton types the two apart: a plan key holding such a value builds no plan)."""
    return all(v is None or type(v) is int for v in values)


def _kernel_plan(kernel, compiled, grid, args, flags) -> KernelPlan | None:
    jit, constexprs = kernel, dict(flags)
    if isinstance(kernel, Autotuner):
        cfg = kernel.best_config
        if cfg is None or cfg.pre_hook is not None:
            return None
        jit = kernel.fn
        constexprs.update(cfg.kwargs)
    if jit.pre_run_hooks or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        return None
    names = jit.arg_names
    if len(args) > len(names) or any(n not in constexprs for n in names[len(args):]):
        return None
    tail = tuple(constexprs[n] for n in names[len(args):])
    meta = {n: constexprs[n] for n in names[len(args):]}
    fixed = None
    if callable(grid):  # evaluated on the constexprs alone each call: only if that is what Triton computes
        full = dict(zip(names, args), **meta)
        try:
            if tuple(grid(meta)) != tuple(grid(full)):
                return None
        except Exception:  # (reads an argument, or anything else): no plan, the launch stands
            return None
    else:
        fixed = tuple(grid)
    return KernelPlan(jit, compiled, tail, fixed, meta, driver.active.get_current_device(), kernel)
