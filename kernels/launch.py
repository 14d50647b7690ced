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

Falls back (returns False from :meth:`LaunchPlan.launch`, the caller takes Triton's path): under
the interpreter (no plans are built), while a Triton launch hook or a pre-run hook is set, when
another device is current than the one the plan was built on. Plans are forgotten with the
autotuners' choices (:func:`~fusedpar.kernels.runtime.clear_tuning_caches`).
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner

__all__ = ["LaunchPlan", "PlanCache", "build_plan", "clear_plans", "describe", "launch_kernel"]

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
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16


#: a plan key's entry for a tensor argument that is not a tensor (no plan is built with it)
_NOT_A_TENSOR = object()


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (a ``HookChain`` with calls in Triton >= 3.5, else any
    value but None)."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


class LaunchPlan:
    """One key's launch: the compiled kernel, its grid and its arguments in parameter order, with
    ``slots`` the positions the tensors of each call go to. The call itself is a function made
    for the plan (:func:`_launcher`): the constant arguments are literals or closure cells in it,
    so a launch builds no list and copies nothing."""

    __slots__ = ("call", "device", "jit", "active", "args", "slots", "extra")  # active: the driver it was built on

    def __init__(self, jit, compiled: CompiledKernel, grid: tuple, args: list, slots: tuple, device: int):
        self.jit, self.device, self.args, self.slots = jit, device, args, slots
        self.active = driver.active
        self.call = _launcher(compiled, (tuple(grid) + (1, 1))[:3], args, slots)
        self.extra = None  # what the launcher keeps beside the launch (an output's shape and dtype)

    def launch(self, tensors) -> bool:
        """Launch with ``tensors`` (one per slot, in order) on the current stream; False, having
        launched nothing, where the plan does not apply now."""
        rt = knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or self.jit.pre_run_hooks:
            return False
        active = self.active
        device = active.get_current_device()
        if device != self.device:
            return False
        self.call(tensors, active.get_current_stream(device))
        return True


#: argument types written into a plan's launch function as literals
_LITERALS = (bool, int, str, type(None))


def _launcher(compiled: CompiledKernel, grid: tuple, args: list, slots: tuple):
    """``call(tensors, stream)``: the compiled launcher called with the grid, ``stream`` and every
    argument, the slots taken from ``tensors`` in order (what ``JITFunction.run`` passes, without
    launch metadata or hooks: :meth:`LaunchPlan.launch` only runs while none is set)."""
    env = {"_run": compiled.run, "_function": compiled.function, "_metadata": compiled.packed_metadata}
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
    src = (f"def call(t, stream):\n    _run({g}, stream, _function, _metadata, None, None, None, "
           f"{', '.join(parts)})\n")
    exec(compile(src, f"<launch plan of {compiled.name if hasattr(compiled, 'name') else 'a kernel'}>", "exec"), env)
    return env["call"]


def build_plan(jit, compiled, args: tuple, constexprs: dict, grid: tuple) -> LaunchPlan | None:
    """The plan of a launch that just ran ``jit[grid](*args, **constexprs)`` (``constexprs``: the
    launcher's flags and the config's block sizes) and returned ``compiled``; None where it cannot
    be replayed: not a ``CompiledKernel`` (the interpreter, the compile check's capture), hooks
    set, a parameter neither positional nor in ``constexprs``, a kernel with global scratch."""
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
    """``{plan key: LaunchPlan}`` of one launcher, emptied by :func:`clear_plans` and when it holds
    ``limit`` plans (shapes that never repeat cannot grow it without bound)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit
        _CACHES.append(self)

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
                self.clear()
            self[key] = plan
        return plan


def clear_plans() -> None:
    """Forget every plan (the next launch of each key takes Triton's path and plans again)."""
    for cache in _CACHES:
        cache.clear()
    _SEEN.clear()


# --------------------------------------------------------------------------------------------
# Kernel-level plans: any launch site, keyed on the launch's own arguments
# --------------------------------------------------------------------------------------------
class KernelPlan:
    """The compiled kernel of one :func:`launch_kernel` key: the arguments are passed as given, then the
    constexprs (flags and config) the kernel's signature has after them, in parameter order."""

    __slots__ = ("run", "function", "metadata", "tail", "grid", "meta", "device", "jit", "active")

    def __init__(self, jit, compiled, tail: tuple, grid, meta, device: int):
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.tail, self.grid, self.meta, self.device, self.jit = tail, grid, meta, device, jit
        self.active = driver.active

    def launch(self, args, grid) -> bool:
        rt = knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or self.jit.pre_run_hooks:
            return False
        active = self.active
        device = active.get_current_device()
        if device != self.device:
            return False
        g = self.grid if self.grid is not None else grid(self.meta)
        g1, g2 = (g[1] if len(g) > 1 else 1), (g[2] if len(g) > 2 else 1)
        self.run(g[0], g1, g2, active.get_current_stream(device), self.function, self.metadata, None, None, None,
                 *args, *self.tail)
        return True


#: kernel-level plans, and the keys seen once (a plan is built the second time a key launches, so
#: that arguments that change every call, an epoch, never build plans that are not reused)
_KERNEL_PLANS = PlanCache()
_SEEN: set = set()


def _arg_key(args, unspecialised: tuple) -> tuple:
    """The launch arguments' part of a kernel-level key: a tensor by dtype and address modulo 16
    (what Triton specialises a pointer on), anything else by its value (finer than Triton, which
    keys an int by its divisibility by 16, being 1, and its width), except the parameters at
    ``unspecialised`` (``do_not_specialize``: an epoch, a chunk index), keyed by their type and
    width as Triton keys them, so that their value can change call after call."""
    key = [(a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args]
    for i in unspecialised:
        if i < len(key):
            v = args[i]
            key[i] = (type(v), -2 ** 31 <= v < 2 ** 31, v >= 2 ** 63) if type(v) is int else type(v)
    return tuple(key)


#: ``{kernel: positions of its do_not_specialize parameters}``
_UNSPECIALISED: dict = {}


def _unspecialised(kernel) -> tuple:
    found = _UNSPECIALISED.get(kernel)
    if found is None:
        jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
        found = _UNSPECIALISED[kernel] = tuple(i for i, p in enumerate(getattr(jit, "params", ()))
                                               if getattr(p, "do_not_specialize", False))
    return found


def launch_kernel(kernel, grid, args: tuple, flags: dict):
    """``kernel[grid](*args, **flags)`` (a ``JITFunction`` or an autotuner over one), through a
    :class:`KernelPlan` from the second compiled launch of a key on: the kernel, a fixed grid
    (a callable grid is evaluated on the config each call), the flags, :func:`_arg_key`. The
    interpreter and anything :func:`build_plan` refuses take Triton's path every time."""
    try:
        key = (kernel, grid if type(grid) is tuple else None, tuple(flags.items()),
               _arg_key(args, _unspecialised(kernel)))
        plan = _KERNEL_PLANS.get(key)
    except TypeError:  # an argument that cannot be hashed (a tensor descriptor): no plan
        key = plan = None
    if plan is not None and plan.launch(args, grid):
        return None
    compiled = kernel[grid](*args, **flags)
    if key is None or not isinstance(compiled, CompiledKernel):
        return compiled
    if key not in _SEEN:
        if len(_SEEN) >= _KERNEL_PLANS.limit:
            _SEEN.clear()
        _SEEN.add(key)
        return compiled
    _KERNEL_PLANS.keep(key, _kernel_plan(kernel, compiled, grid, args, flags))
    return compiled


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
        except KeyError:
            return None
    else:
        fixed = tuple(grid)
    return KernelPlan(jit, compiled, tail, fixed, meta, driver.active.get_current_device())
