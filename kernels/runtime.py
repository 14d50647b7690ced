"""What every kernel module shares: where kernels run (Triton's interpreter on CPU or a compiled
GPU backend), the ``tl.dot`` input precision, row addressing of 2-D / ``[batch, seq]`` views, the
fused activations (Triton and a float reference), and tile-config pruning.

Public names only: kernel modules import from here, never from each other's private helpers.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from .launch import clear_plans

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# name -> (constexpr code of the activation in the kernels, gated: the weight holds gate rows then
# up rows and the epilogue computes act(gate) * up; "swiglu_oai" computes act(gate) * (clamp(up) + 1))
ACTIVATIONS = {
    "none": (0, False),
    "relu": (1, False),
    "gelu": (2, False),  # tanh approximation, as in GPT-2 / Megatron's fast gelu
    "silu": (3, False),
    "swiglu": (3, True),
    "geglu": (2, True),
    # gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate), with its constants fixed:
    # g = min(gate, L); u = clamp(up, -L, L); out = (u + 1) * g * sigmoid(ALPHA * g)
    "swiglu_oai": (4, True),
}
#: the constants of "swiglu_oai" (gpt-oss's swiglu_alpha and swiglu_limit); the kernels write them
#: as literals (1.702, 7.0), tests check them against these
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


@triton.jit
def _decoration_probe():
    """Never launched: its type records how ``triton.jit`` decorated this package's kernels."""
    pass


#: Triton's choice for every kernel of this package, made when ``triton.jit`` decorated them (at
#: import): an interpreted function when ``TRITON_INTERPRET`` was set then, a compiled
#: ``JITFunction`` otherwise. The variable read later says nothing about the kernels: a process
#: that sets it after the import (an in-process ``fusedpar.demo --device cpu`` run on a GPU
#: machine) would otherwise send compiled kernels down the interpreter's path (fixed tile configs,
#: no autotuning, ``"ieee"`` dots, CPU tensors accepted and then refused by the launch).
_INTERPRETED = not isinstance(_decoration_probe, triton.runtime.JITFunction)


def interpreting() -> bool:
    """True when this package's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``
    was set when ``fusedpar.kernels`` was imported; tests/conftest.py sets it when no GPU is
    present). Fixed at import (see :data:`_INTERPRETED`): later changes of the variable do not
    switch the launchers' path.
    """
    return _INTERPRETED


def release(version: str) -> tuple:
    """A version's (major, minor): ``"3.6.0+git1a2b"`` -> ``(3, 6)``."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def needs_upcast(dtype: torch.dtype) -> bool:
    """Under the interpreter ``tl.dot`` on bf16 multiplies bit patterns (triton issue 11584),
    so kernels upcast bf16 operands to fp32 there. The compiled path never upcasts."""
    return interpreting() and dtype == torch.bfloat16


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints (``triton.cdiv`` is a constexpr function: a call from host code
    costs microseconds, which launchers pay per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``, a plain host
    function (the launchers call it per launch)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


#: the context of a launch on the current device (reused: entering it does nothing)
_CURRENT = contextlib.nullcontext()


def on_device(device: torch.device):
    """The context a launch on ``device`` runs in: ``torch.cuda.device(device)`` for a CUDA device
    other than the current one, else a no-op (what the launchers enter on every call)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _CURRENT
    return torch.cuda.device(device)


def multiprocessor_count(device_index: int | None) -> int:
    """SMs of a GPU (None: the current one; persistent launches size their grids by it)."""
    return _sm_count(torch.cuda.current_device() if device_index is None else device_index)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one program may use on this GPU (for pruning configs)."""
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


@functools.lru_cache(maxsize=None)
def device_capability(device_index: int) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of a GPU (for pruning configs)."""
    return tuple(torch.cuda.get_device_capability(device_index))


#: fp32 accumulator elements one thread may hold (all accumulators of a tile together) before
#: ptxas spills, measured with ``python -m benchmarks compile`` on sm_90 and sm_80: with a plain
#: epilogue 128; an epilogue that also keeps activation terms and int64 pointer tiles of a
#: residual / pre-activation store live needs more registers per element (the kernels pass
#: their own, smaller budgets).
ACC_BUDGET = 128
#: fp32 "ieee" dots, which Triton lowers to FMAs whose operand fragments are held in registers
#: next to the accumulators: accumulator elements per thread (all accumulators together) and the
#: largest contraction block that compile with at most a few hundred bytes of spills (sm_80 and
#: sm_90, ``python -m benchmarks compile``); larger tiles spill kilobytes
FMA_ACC_BUDGET = 32
FMA_MAX_BLOCK_K = 32


#: operand elements (A tile plus B tiles) one thread may load per K step when the loads cannot be
#: vectorised (a row stride or K not a multiple of 16 bytes) or are masked along K (K not a
#: multiple of 64): every element then carries its own address and mask, and tiles with BLOCK_K =
#: 64 spill on such problems (``python -m benchmarks compile``)
UNALIGNED_OPERAND_BUDGET = 64
UNALIGNED_MAX_BLOCK_K = 32


def aligned(elem_size: int, *extents) -> bool:
    """Whether every extent (K, row strides, in elements) is a multiple of 16 bytes, so that a
    tile's loads vectorise."""
    return all(int(e) * elem_size % 16 == 0 for e in extents)


def pipelined(elem_size: int, *extents) -> bool:
    """Whether Triton pipelines a GEMM main loop's loads (``cp.async`` / TMA, ``num_stages``
    buffers): they must vectorise to at least 4 bytes, which 16-bit operands do only when every
    extent their addresses and masks depend on (K, the row strides, a masked contiguous dim) is
    a multiple of 16 elements, the divisibility Triton specialises integer arguments on. Otherwise
    the loads are synchronous and shared memory holds one A and one B tile for the dot."""
    return elem_size >= 4 or all(int(e) % 16 == 0 for e in extents)


def acc_budget_for(budget: int, *, elem_size: int, precision: str, acc_tiles: int = 1, sync: bool = False,
                   reads_out_tile: bool = False) -> int:
    """``budget`` (accumulator elements per thread of a kernel's epilogue, all ``acc_tiles``
    accumulators together), capped at :data:`FMA_ACC_BUDGET` for fp32 operands multiplied in
    "ieee" precision, and halved for fp32 operands multiplied in "tf32" when the dot lowers to
    mma.sync (``sync``: its fp32 operand fragments take twice the registers of 16-bit ones) or
    the epilogue loads a residual / accumulate tile of the fp32 output (``reads_out_tile``: as
    wide as the accumulator; measured: 128 spills 12-168 B with wgmma), never below 32 (the tight
    budgets of 32 stay: below them only the fallback tile is left, which spills more)."""
    if elem_size == 4 and precision == "ieee":
        return min(budget, FMA_ACC_BUDGET)
    if elem_size == 4 and precision == "tf32" and (sync or reads_out_tile):
        return max(budget // 2, min(budget, 32))
    return budget


def _tile(cfg):
    if isinstance(cfg, dict):
        return cfg, cfg.get("num_warps", 4), cfg.get("num_stages", 3)
    return cfg.kwargs, cfg.num_warps, cfg.num_stages


def uses_wgmma(capability, dot_m: int, elem_size: int, precision: str = "tf32") -> bool:
    """Whether Triton lowers a ``tl.dot`` with ``dot_m`` rows to Hopper's wgmma: sm_90, at
    least 64 rows, 8-bit (fp8) or 16-bit operands (or fp32 as tf32)."""
    return capability[0] == 9 and dot_m >= 64 and (elem_size in (1, 2) or precision == "tf32")


def tile_smem_bytes(cfg, *, elem_size: int, b_tiles: int, capability=(9, 0), dims=("BLOCK_M", "BLOCK_N", "BLOCK_K"),
                    precision: str = "tf32", pipelined: bool = True) -> int:
    """Shared memory of a pipelined GEMM main loop: the A tile (``M x K`` of ``dims``, the dot's
    rows, columns and contraction block) and ``b_tiles`` B tiles (``K x N``), buffered
    ``num_stages`` times for wgmma (sm_90) and ``num_stages - 1`` times for mma.sync / FMA dots
    (sm_80, or tiles under 64 rows), as Triton's pipeliner allocates them. Loads that are not
    ``pipelined`` (see :func:`pipelined`) stage one A and one B tile for the dot, on any GPU."""
    kw, _, stages = _tile(cfg)
    m, n, k = (kw[d] for d in dims)
    if not pipelined:
        return (m * k + k * n) * elem_size
    buffers = stages if uses_wgmma(capability, m, elem_size, precision) else max(stages - 1, 1)
    return (m * k + b_tiles * k * n) * elem_size * buffers


def acc_per_thread(cfg, acc_tiles: int = 1, dims=("BLOCK_M", "BLOCK_N")) -> int:
    """fp32 accumulator elements per thread: ``acc_tiles`` tiles of ``dims`` over the warps."""
    kw, warps, _ = _tile(cfg)
    return acc_tiles * kw[dims[0]] * kw[dims[1]] // (32 * warps)


def tile_config_problem(cfg, *, elem_size: int, b_tiles: int, smem_limit: int, capability=(9, 0),
                        acc_tiles: int = 1, acc_budget: int = ACC_BUDGET, dims=("BLOCK_M", "BLOCK_N", "BLOCK_K"),
                        precision: str = "tf32", unaligned: bool = False, sync_acc_budget: int | None = None,
                        pipelined: bool = True) -> str | None:
    """Why a GEMM tile config cannot run well (None if it can): its pipelined tiles overflow
    shared memory, its accumulators exceed ``acc_budget`` elements per thread (``sync_acc_budget``
    when the dot lowers to mma.sync or FMAs rather than wgmma: their operand fragments live in
    registers too), an fp32 "ieee" (FMA) dot's contraction block exceeds
    :data:`FMA_MAX_BLOCK_K`, or (``unaligned`` loads) its K block or operand tiles exceed the
    unaligned budgets; all but the first would spill."""
    kw, warps, _ = _tile(cfg)
    m, n, k = (kw[d] for d in dims)
    smem = tile_smem_bytes(cfg, elem_size=elem_size, b_tiles=b_tiles, capability=capability, dims=dims,
                           precision=precision, pipelined=pipelined)
    if smem > smem_limit:
        return f"needs {smem} B of shared memory > {smem_limit} B on this GPU"
    if sync_acc_budget is not None and not uses_wgmma(capability, m, elem_size, precision):
        acc_budget = sync_acc_budget
    acc = acc_per_thread(cfg, acc_tiles, dims[:2])
    if acc > acc_budget:
        return f"holds {acc} fp32 accumulator elements per thread > {acc_budget}: it would spill registers"
    if elem_size == 4 and precision == "ieee" and k > FMA_MAX_BLOCK_K:
        return (f"runs an fp32 FMA dot with a contraction block of {k} > {FMA_MAX_BLOCK_K}: its operand "
                f"fragments would spill registers")
    if unaligned:
        per_thread = (m * k + b_tiles * k * n) // (32 * warps)
        if k > UNALIGNED_MAX_BLOCK_K or per_thread > UNALIGNED_OPERAND_BUDGET:
            return (f"loads {per_thread} operand elements per thread (BLOCK_K {k}) without vectorisation "
                    f"(unaligned strides or K), over {UNALIGNED_OPERAND_BUDGET} / BLOCK_K "
                    f"{UNALIGNED_MAX_BLOCK_K}: it would spill registers")
    return None


def prune_tile_configs(configs, *, elem_size: int, b_tiles: int, smem_limit: int, dims: dict, capability=(9, 0),
                       acc_tiles: int = 1, acc_budget: int = ACC_BUDGET, tile_dims=("BLOCK_M", "BLOCK_N", "BLOCK_K"),
                       precision: str = "tf32", unaligned: bool = False, sync_acc_budget: int | None = None,
                       pipelined: bool = True):
    """GEMM tile configs worth autotuning: :func:`tile_config_problem` finds nothing (the
    pipelined tiles fit in shared memory, the accumulators in registers; ``b_tiles=2`` /
    ``acc_tiles=2`` for gated epilogues, which stream gate and up columns into two
    accumulators), and no tile is more than twice the problem along a dim of ``dims``
    (``{"BLOCK_M": M, ...}``; tiles of 32 or less always pass): a 256-wide tile on a 40-wide
    output only wastes work. Never empty: when nothing qualifies, the smallest tile is kept."""
    kept = []
    for cfg in configs:
        if tile_config_problem(cfg, elem_size=elem_size, b_tiles=b_tiles, smem_limit=smem_limit,
                               capability=capability, acc_tiles=acc_tiles, acc_budget=acc_budget, dims=tile_dims,
                               precision=precision, unaligned=unaligned, sync_acc_budget=sync_acc_budget,
                               pipelined=pipelined):
            continue
        if any(cfg.kwargs[k] > 2 * triton.next_power_of_2(n) and cfg.kwargs[k] > 32 for k, n in dims.items()):
            continue
        kept.append(cfg)
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


#: the autotuners :func:`autotuned` made, by kernel name (so a sweep can clear their choices)
_AUTOTUNERS: dict = {}
#: per autotuned kernel name, the most configs its prune rule kept at any tuning since the last
#: :func:`clear_tuning_caches`
_KEPT: dict = {}


def tuning_selection() -> tuple:
    """``FUSEDPAR_TUNE_CONFIGS``: which of the configs a prune rule keeps an autotuner tries.
    Unset or empty: all of them (users, benchmarks). ``N`` (an integer >= 1): the first N, in the
    config list's order; the compiled test suite sets 1 so that each kernel specialization
    compiles once. ``#K``: only the K-th (modulo their number), for a sweep that checks every kept
    config in turn (tests/test_tuning.py). Returns ``("all",)``, ``("first", N)`` or ``("index", K)``."""
    raw = os.environ.get("FUSEDPAR_TUNE_CONFIGS", "").strip()
    if not raw:
        return ("all",)
    try:
        value = int(raw[1:] if raw.startswith("#") else raw)
    except ValueError:
        value = -1
    if value < (0 if raw.startswith("#") else 1):
        raise ValueError(f"FUSEDPAR_TUNE_CONFIGS must be an integer >= 1 or '#K' with K >= 0, got {raw!r}")
    return ("index", value) if raw.startswith("#") else ("first", value)


def select_tuning_configs(name: str, kept: list) -> list:
    """The configs the autotuner of kernel ``name`` benchmarks, out of those its prune rule kept
    (see :func:`tuning_selection`); records how many were kept (:func:`kept_config_count`)."""
    _KEPT[name] = max(_KEPT.get(name, 0), len(kept))
    mode = tuning_selection()
    if mode[0] == "first":
        return kept[:mode[1]]
    if mode[0] == "index":
        return [kept[mode[1] % len(kept)]]
    return kept


def kept_config_count(name: str) -> int:
    """The most configs the prune rule of autotuned kernel ``name`` kept at one tuning (one key)
    since the last :func:`clear_tuning_caches`."""
    if name not in _KEPT:
        raise KeyError(f"kernel {name!r} has not been tuned yet; tuned so far: {sorted(_KEPT)}")
    return _KEPT[name]


#: argument types without a dtype (skipped by :class:`MemoAutotuner`'s key, as by Triton's)
_NUMBERS = frozenset((int, float, bool))


class MemoAutotuner(triton.runtime.autotuner.Autotuner):
    """``triton.autotune`` with a cheap path for a key already tuned: Triton's ``run`` rebuilds
    its key on every launch from a dict of all arguments filtered against the argument-name
    *list* (quadratic in the ~50 arguments of the GEMM kernels) plus ``str(dtype)`` of every
    tensor, about as much host time as the launch itself. This tuner looks the launch up first
    under a key of its own (the values of the key arguments, the dtype of every argument that is
    not a plain number, None for those without one, and the keyword names: it determines
    Triton's key, whose dtypes are those of the arguments that have one), and on a hit
    launches the config Triton chose for it directly; on a miss Triton's ``run`` tunes (or finds
    its own cached choice) and the choice is remembered. Forgetting Triton's choices
    (``cache.clear()``, :func:`clear_tuning_caches`) forgets these too.

    Where the prune rule keeps one config there is nothing to time: Triton 3.9 takes it untimed,
    Triton 3.6 (the GPU machines') timed it anyway, running the kernel a hundred-odd times
    (``do_bench``'s 25 ms warm-up and 100 ms of repeats) at every new key; here neither does."""

    def __init__(self, fn, arg_names, configs, key, restore_value, prune_configs_by):
        super().__init__(fn, arg_names, configs, key, reset_to_zero=None, restore_value=restore_value,
                         prune_configs_by=prune_configs_by)
        self.cache = _TunedChoices()
        # (name, position) of every key argument: read positionally when passed so, else by name
        self._key_slots = tuple((k, arg_names.index(k)) for k in key)
        self._one_kept = False  # whether the last prune kept a single config

    def prune_configs(self, kwargs):
        kept = super().prune_configs(kwargs)
        self._one_kept = len(kept) == 1
        return kept

    def _bench(self, *args, config, **meta):
        if self._one_kept:  # a lone config: no timing (quantiles' shape), it is chosen either way
            return [0.0, 0.0, 0.0]
        return super()._bench(*args, config=config, **meta)

    def run(self, *args, **kwargs):
        n = len(args)
        key = (tuple([args[i] if i < n else kwargs.get(k) for k, i in self._key_slots]),
               tuple([getattr(a, "dtype", None) for a in args if type(a) not in _NUMBERS]),
               tuple([getattr(v, "dtype", None) for v in kwargs.values() if type(v) not in _NUMBERS]), tuple(kwargs))
        launch = self.cache.memo.get(key)
        if launch is None:
            self.best_config = None
            ret = super().run(*args, **kwargs)
            chosen = self.best_config  # None when Triton's run is replaced (the compile check records launches)
            if chosen is not None and chosen.pre_hook is None:  # (a config's pre_hook runs before each launch)
                self.cache.memo[key] = (chosen, chosen.all_kwargs())
            return ret
        self.best_config = launch[0]
        return self.fn.run(*args, **kwargs, **launch[1])


class _TunedChoices(dict):
    """An autotuner's ``{Triton key: config}`` cache that also holds :class:`MemoAutotuner`'s
    ``memo`` (``{own key: (config, its launch kwargs)}``); clears it and every launch plan with itself."""

    def __init__(self):
        super().__init__()
        self.memo: dict = {}

    def clear(self):
        super().clear()
        self.memo.clear()
        clear_plans()


def autotuned(kernel, *, configs, key, prune, restore_value=None):
    """``triton.autotune`` over ``configs`` (a :class:`MemoAutotuner`) with the early prune rule
    ``prune(configs, named_args, **kwargs)`` followed by :func:`select_tuning_configs`;
    registered under the kernel's name."""
    name = kernel.fn.__name__  # kernel: a @triton.jit function

    def early_prune(cfgs, named_args, **kwargs):
        return select_tuning_configs(name, prune(cfgs, named_args, **kwargs))

    tuner = MemoAutotuner(kernel, kernel.arg_names, configs, key, restore_value, {"early_config_prune": early_prune})
    _AUTOTUNERS[name] = tuner
    return tuner


def clear_tuning_caches() -> None:
    """Forget every autotuner's per-key choice (and the kept counts), so the next launch prunes
    and tunes anew (after ``FUSEDPAR_TUNE_CONFIGS`` changed), and every launch plan (:mod:`.launch`)."""
    for tuner in _AUTOTUNERS.values():
        tuner.cache.clear()
    _KEPT.clear()
    clear_plans()


def _cuda_matmul_tf32() -> bool:
    """Whether torch.matmul runs fp32 on TF32 on CUDA: the cuBLAS matmul precision of torch's TF32
    API, ``torch.backends.cuda.matmul.fp32_precision == "tf32"``, which the legacy
    ``torch.backends.cuda.matmul.allow_tf32 = True``, ``torch.backends.fp32_precision = "tf32"``
    and ``torch.set_float32_matmul_precision("high")`` all set. (The legacy flag is not read: once
    a program has set TF32 through the new API, reading ``allow_tf32`` raises "mix of the legacy
    and new APIs".)"""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # a torch without the new API
        return bool(matmul.allow_tf32)
    return precision == "tf32"


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: "tf32" for fp32 operands on a GPU when torch.matmul would use
    TF32 (:func:`_cuda_matmul_tf32`), else "ieee"."""
    if dtype == torch.float32 and not interpreting() and _cuda_matmul_tf32():
        return "tf32"
    return "ieee"


class RowView:
    """The leading dims of a 2-D or 3-D tensor as one logical row index: row ``i`` lives at
    ``(i // inner) * s_outer + (i % inner) * s_inner`` (``split``) or ``i * s_inner``.
    A ``[batch, seq]`` pair whose strides merge is one plain stride; a strided seq chunk of a
    larger buffer (``x[:, lo:hi]``) keeps two levels, so kernels read it in place."""

    __slots__ = ("inner", "s_outer", "s_inner", "split")

    def __init__(self, inner: int, s_outer: int, s_inner: int, split: bool):
        self.inner, self.s_outer, self.s_inner, self.split = inner, s_outer, s_inner, split

    @staticmethod
    def rows(t: torch.Tensor) -> "RowView":
        if t.dim() == 2:
            return RowView(1, 0, t.stride(0), False)
        if t.dim() != 3:
            raise ValueError(f"RowView.rows needs a 2-D or 3-D tensor, got shape {tuple(t.shape)}")
        b, s = t.shape[0], t.shape[1]
        if b == 1 or t.stride(0) == s * t.stride(1):  # the two dims merge into one stride
            return RowView(1, 0, t.stride(1), False)
        return RowView(s, t.stride(0), t.stride(1), True)

    def args(self):
        return (self.inner, self.s_outer, self.s_inner)


@triton.jit
def row_offsets(idx, inner, s_outer, s_inner, SPLIT: tl.constexpr):
    """Memory offset (int64) of logical row ``idx`` of a :class:`RowView`."""
    idx = idx.to(tl.int64)
    if SPLIT:
        return (idx // inner) * s_outer + (idx % inner) * s_inner
    else:
        return idx * s_inner


@triton.jit
def apply_activation(x, ACT: tl.constexpr):
    """The activation of code ``ACT`` (see :data:`ACTIVATIONS`) on an fp32 tile."""
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        # gelu_tanh(x) = x * sigmoid(2 * sqrt(2 / pi) * (x + 0.044715 x^3))
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACT == 3:
        x = x * tl.sigmoid(x)
    elif ACT == 4:
        # the gate half of swiglu_oai: g = min(x, 7); g * sigmoid(1.702 g) (see apply_up)
        x = tl.minimum(x, 7.0)
        x = x / (1.0 + tl.exp(-1.702 * x))
    return x


@triton.jit
def apply_up(up, ACT: tl.constexpr):
    """The up half of a gated activation of code ``ACT`` on an fp32 tile: itself, or for
    ``swiglu_oai`` ``clamp(up, -7, 7) + 1``."""
    if ACT == 4:
        up = tl.minimum(tl.maximum(up, -7.0), 7.0) + 1.0
    return up


def activation_features(n_w: int, activation: str) -> int:
    """The output features of a GEMM with ``n_w`` weight rows under ``activation`` (gated: the
    rows are gate then up, half of them)."""
    return n_w // 2 if ACTIVATIONS[activation][1] else n_w


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Plain torch reference of the fused activations (``x`` is ``[..., 2F]`` gate|up when gated)."""
    act, glu = ACTIVATIONS[activation]
    gate, up = (x.chunk(2, dim=-1) if glu else (x, None))
    if act == 4:  # gpt-oss: the clamp's gradient is zero outside the range, as torch.clamp's
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1
        gate = gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate)
    elif act == 1:
        gate = torch.relu(gate)
    elif act == 2:
        gate = torch.nn.functional.gelu(gate, approximate="tanh")
    elif act == 3:
        gate = torch.nn.functional.silu(gate)
    return gate * up if glu else gate
