"""Facts about where kernels run: Triton's interpreter (CPU) or a compiled GPU backend."""
from __future__ import annotations

import functools
import os

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The variable must be set before ``triton`` is imported; tests/conftest.py does that when no
    GPU is present.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def needs_upcast(dtype: torch.dtype) -> bool:
    """Under the interpreter ``tl.dot`` on bf16 multiplies bit patterns (triton issue 11584),
    so kernels upcast bf16 operands to fp32 there. The compiled path never upcasts."""
    return interpreting() and dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one program may use on this GPU (for pruning configs)."""
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


def prune_tile_configs(configs, *, elem_size: int, b_tiles: int, smem_limit: int, dims: dict):
    """GEMM tile configs worth autotuning: the pipelined A and B tiles fit in shared memory,
    ``(BLOCK_M*BLOCK_K + b_tiles*BLOCK_K*BLOCK_N) * elem_size * num_stages <= smem_limit``
    (``b_tiles=2`` for gated epilogues, which stream gate and up columns), and no tile is more
    than twice the problem along a dim of ``dims`` (``{"BLOCK_M": M, ...}``; tiles of 32 or less
    always pass): a 256-wide tile on a 40-wide output only wastes work. Never empty: when nothing
    qualifies, the smallest tile is kept."""
    import triton

    kept = []
    for cfg in configs:
        bm, bn, bk = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"]
        if (bm * bk + b_tiles * bk * bn) * elem_size * cfg.num_stages > smem_limit:
            continue
        if any(cfg.kwargs[k] > 2 * triton.next_power_of_2(n) and cfg.kwargs[k] > 32 for k, n in dims.items()):
            continue
        kept.append(cfg)
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def check_buffer(name: str, t, shape, device: torch.device, dtype: torch.dtype | None = None):
    """An output or state buffer a launcher writes: a tensor of ``shape`` on ``device`` with a
    supported dtype (``dtype`` exactly, when given). Clear errors naming ``name`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    check_supported_dtype(name, t)


def check_supported_dtype(name: str, t: torch.Tensor):
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has unsupported dtype {t.dtype}; expected one of {names}")


def check_device_usable(name: str, t: torch.Tensor):
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{name} is on {t.device}; fusedpar kernels need CUDA tensors, or CPU tensors with "
        "TRITON_INTERPRET=1 set before triton is imported"
    )
