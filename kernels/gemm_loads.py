"""How a GEMM launch loads its operands, and over how many programs its tiles are spread.

Every GEMM kernel of fusedpar runs one main loop (:func:`~fusedpar.kernels.gemm_core.gemm_mainloop`)
with two load paths, a constexpr ``TMA`` chosen here per launch:

* **TMA** (Hopper's tensor memory accelerator): device-side tensor descriptors
  (``tl.make_tensor_descriptor``) copy each operand tile into shared memory, zero-filled past the
  tensor's edges, and the wgmma reads it there. A launch takes it on sm_90 and later (and under
  the interpreter, which emulates descriptors) when every operand it loads so is a plain 2-D view
  (one row stride: not a two-level ``[batch, seq-chunk]`` row view) contiguous along K or along
  its other dim, whose base address and other stride are multiples of 16 bytes, that stride at
  least the contiguous extent (no expanded view's 0, no overlapping rows), with 1- or
  2-byte elements (fp32 operands run FMA or TF32 dots from registers; the interpreter takes fp32
  too). e4m3 operands need both operands contiguous along K (fp8 wgmma reads only K-major tiles).
  A gated weight contiguous along N needs its up half's first column on a 16-byte boundary
  (:func:`up_half_aligned`). The grouped GEMM's experts' weights are one 2-D stack, or 3-D
  descriptors with the expert stride (``grouped_gemm._weight_tma``'s rule). The persistent TP
  GEMM takes TMA only without flag waits, over its chunks as one stack
  (``persistent_config.tma_weight_major``).
* **Pointer loads** for everything else (sm_80, strides that are not multiples of 16 bytes, an
  unaligned base, split row views): the pre-Hopper path, ``cp.async`` where loads vectorise.

The flash backward (:func:`~.flash_attention_bwd.backward_loads`) takes the same switch and
capability test for its streamed tiles. It is not persistent, so its scratch grows with its grid:
1 KB per program (eight descriptor slots), 8-16 MB at 16k tokens x 32 heads.

TMA launches are *persistent*: :func:`num_programs` programs (one per SM; under the interpreter
:data:`INTERPRETER_PROGRAMS`, so its tests run tile loops that wrap) walk the output tiles in
grouped order; pointer launches keep one program per tile (a tile loop around their main loop
costs registers: 224 B of spills at 256 x 128 with an accumulated split-row output on sm_90), but
for the persistent TP GEMM's, persistent on both paths (its own fixed grid, :mod:`.persistent_gemm`).

Device-side descriptors need a per-launch global scratch (128 bytes per descriptor and program,
written by the kernel): Triton's launcher asks ``triton.set_allocator``'s allocator for it on
every launch, a launch plan's (:mod:`.launch`) included. :func:`ensure_scratch_allocator` installs
one in the calling context when none is set (Triton's allocator is a context variable: autograd's
worker threads start without it), which allocates on the launching (current) device and keeps one
buffer per device and stream, reused by the launches that follow; a user's own allocator is left
in place. Host-side descriptors (``TensorDescriptor``) would cost a Python object per operand per
call plus Triton's per-launch encoding of each, and a plan could no longer pass tensors in its
slots; a reused scratch buffer costs a dict lookup per launch (docs/PERF.md).
"""
from __future__ import annotations

import contextlib

import torch
import triton
from triton.runtime import _allocation

from .checks import check_choice
from .runtime import clear_tuning_caches, device_capability, interpreting, multiprocessor_count

__all__ = ["INTERPRETER_PROGRAMS", "LOAD_PATHS", "ensure_scratch_allocator", "last_launch", "load_path",
           "load_path_set", "note_launch", "num_programs", "scratch_device", "set_load_path", "tma_capable", "tma_layout",
           "up_half_aligned"]

#: ``"auto"``: TMA where a launch can take it (module docstring), ``"pointer"``: never
LOAD_PATHS = ("auto", "pointer")
_MODE = ["auto"]
#: programs of an interpreted GEMM launch: more tiles than programs, so every tile loop wraps
INTERPRETER_PROGRAMS = 3


def set_load_path(path: str) -> None:
    """Choose the load path (:data:`LOAD_PATHS`) of later GEMM and flash-backward launches:
    ``"pointer"`` compares the two (benchmarks, tests). Forgets the tuned configs and launch plans
    made under the other."""
    check_choice("path", path, LOAD_PATHS)
    if path != _MODE[0]:
        _MODE[0] = path
        clear_tuning_caches()


@contextlib.contextmanager
def load_path_set(path: str):
    """:func:`set_load_path` for the ``with`` block, the path before it restored after it (also
    when the block raises): a benchmark's rows on one path."""
    before = _MODE[0]
    set_load_path(path)
    try:
        yield
    finally:
        set_load_path(before)


def load_path() -> str:
    """The load path :func:`set_load_path` chose (``"auto"`` by default)."""
    return _MODE[0]


def tma_capable(device: torch.device, elem_size: int) -> bool:
    """Whether launches on ``device`` with ``elem_size``-byte operands may load them by TMA: the
    interpreter, or a GPU of compute capability 9.0 or later with 1- or 2-byte operands, unless
    :func:`set_load_path` chose pointer loads."""
    if _MODE[0] != "auto":
        return False
    if interpreting():
        return True
    return elem_size <= 2 and device_capability(device.index or 0)[0] >= 9


def _major(s_k: int, s_other: int, k: int, other: int, elem_size: int):
    """True (contiguous along K), False (along the other dim) or None (neither) for an operand of
    ``k`` x ``other`` elements with strides ``s_k``, ``s_other``: the stride between its rows
    must be a multiple of 16 bytes and at least the rows' extent (not 0, an expanded view, nor
    rows that overlap: a tensor descriptor holds neither)."""
    if s_k == 1 and s_other >= max(k, 1) and s_other * elem_size % 16 == 0:
        return True
    if s_other == 1 and s_k >= max(other, 1) and s_k * elem_size % 16 == 0:
        return False
    return None


def tma_layout(a: torch.Tensor, s_am: int, s_ak: int, b: torch.Tensor, s_bk: int, s_bn: int, extents: tuple, *,
               k_major: bool = False, up_offset: int = 0):
    """``(A_KMAJOR, B_KMAJOR)`` of a launch loading ``A`` (``a``'s storage, strides ``s_am``,
    ``s_ak``: a plain 2-D view) and ``B`` (strides ``s_bk``, ``s_bn``) by TMA, or None where it
    cannot (module docstring; the caller checked :func:`tma_capable` and that no view is split).
    ``extents``: ``(M, N, K)``, N every row of B (a gated weight's gate and up); ``k_major``:
    both must be contiguous along K (e4m3 operands); ``up_offset``: the gated up half's first
    row of B (:func:`up_half_aligned`)."""
    es, (m, n, k) = a.element_size(), extents
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return None
    a_major, b_major = _major(s_ak, s_am, k, m, es), _major(s_bk, s_bn, k, n, es)
    if a_major is None or b_major is None or (k_major and not (a_major and b_major)):
        return None
    if not up_half_aligned(b_major, up_offset, es):
        return None
    return a_major, b_major


def up_half_aligned(b_kmajor: bool, up_offset: int, elem_size: int) -> bool:
    """Whether a descriptor can load a gated weight's up half ``up_offset`` rows of B after its
    gate: a box's first column along the contiguous dim must sit on a 16-byte boundary, which
    holds for any row offset of weights contiguous along K, and for ``up_offset`` columns of
    weights contiguous along N only where ``up_offset * elem_size`` is a multiple of 16."""
    return b_kmajor or up_offset * elem_size % 16 == 0


def num_programs(tiles: int, device: torch.device, persistent: bool) -> int:
    """Programs of a launch over ``tiles`` output tiles: one per SM for a ``persistent`` (TMA)
    launch (:data:`INTERPRETER_PROGRAMS` under the interpreter), else one per tile."""
    if persistent and interpreting():
        return max(1, min(tiles, INTERPRETER_PROGRAMS))
    if persistent:
        return max(1, min(tiles, multiprocessor_count(device.index)))
    return max(1, tiles)


def scratch_device() -> torch.device:
    """The device of the launch asking for descriptor scratch: the current CUDA device (a launcher
    enters its tensors' device, a launch plan runs only on its own), the CPU without CUDA."""
    if not torch.cuda.is_initialized():
        return _CPU
    index = torch.cuda.current_device()
    device = _CUDA_DEVICES.get(index)
    if device is None:  # (one object per index: no torch.device built per launch)
        device = _CUDA_DEVICES[index] = torch.device("cuda", index)
    return device


_CPU = torch.device("cpu")
_CUDA_DEVICES: dict = {}


class _Scratch:
    """Triton's allocator: the global scratch a kernel with device-side tensor descriptors asks
    for at each launch (it writes its descriptors there first), on the launching device
    (:func:`scratch_device`). One buffer per device and stream, reused: launches on one stream run
    one after another, as they do on the addresses torch's caching allocator hands out again;
    inside a CUDA-graph capture a fresh ``torch.empty`` (the graph keeps it, as with Triton's own
    allocator)."""

    __slots__ = ("buffers",)

    def __init__(self):
        self.buffers = {}  # (device, stream) -> (buffer, its bytes)

    def __call__(self, size: int, alignment: int, stream):
        device = scratch_device()
        key = (device, stream)
        kept = self.buffers.get(key)
        capturing = device is not _CPU and device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if kept is not None and kept[1] >= size and not capturing:
            return kept[0]
        n = max(size, 1 << 16)
        buf = torch.empty(n, dtype=torch.int8, device=device)
        if not capturing:
            if len(self.buffers) >= 64:
                self.buffers.clear()
            self.buffers[key] = (buf, n)
        return buf


_SCRATCH = _Scratch()


def ensure_scratch_allocator() -> None:
    """Make Triton's allocator of the calling context :class:`_Scratch` (one for every device),
    unless one set by someone else is in place (called before every compiled launch that may use
    TMA)."""
    current = _allocation._allocator.get()
    if current is not _SCRATCH and isinstance(current, (_allocation.NullAllocator, _Scratch)):
        triton.set_allocator(_SCRATCH)


#: per GEMM entry point, what its last launch through Triton's path ran (:func:`note_launch`)
_LAST: dict = {}


def note_launch(entry: str, tuner, config, tma: bool) -> None:
    """Remember the launch of ``entry`` (``"matmul"``, ``"fp8_matmul"``, ...) that just ran: the
    autotuner (its choice is read later) or, without one, the fixed ``config`` dict; whether it
    loaded by TMA (persistent). One dict store: launchers call it on Triton's path only."""
    _LAST[entry] = (tuner, config, tma)


def last_launch(entry: str) -> dict:
    """What the last launch of ``entry`` ran, for benchmark rows: ``config`` (``"BMxBNxBK wW sS"``,
    ``" split2"`` for an epilogue in column halves), ``loads`` (``"tma"`` or ``"pointer"``) and
    ``persistent``; empty before any launch."""
    if entry not in _LAST:
        return {}
    tuner, config, tma = _LAST[entry]
    cfg = getattr(tuner, "best_config", None) if tuner is not None else None
    kw = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages) if cfg is not None else dict(config or {})
    text = "x".join(str(kw.get(k, "?")) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    text += f" w{kw.get('num_warps', 4)} s{kw.get('num_stages', 3)}"
    if kw.get("EPILOGUE_SPLIT", 1) == 2:
        text += " split2"
    return {"config": text, "loads": "tma" if tma else "pointer", "persistent": tma}
