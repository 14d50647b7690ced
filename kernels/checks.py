"""Argument checks with one error style, shared by every layer of fusedpar.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value,
device or layout) with a message that names the argument, the expected and the actual value:
``"<name> must be <expected>, got <actual>"``. ``name`` may carry the op as a prefix
(``"all_gather_matmul: x"``). Checks are local (no communication); distributed ops run them on
every rank before the first transfer, so bad input raises on every rank alike.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from .runtime import SUPPORTED_DTYPES, interpreting

INDEX_DTYPES = (torch.int32, torch.int64)


def _dims_text(dims: Iterable[int]) -> str:
    return " or ".join(f"{d}-D" for d in dims)


def check_tensor(name: str, t, *, dims: Iterable[int] | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 kernel_device: bool = False) -> None:
    """``t`` is a tensor, with a dimensionality in ``dims`` and a dtype in ``dtypes`` (when given);
    ``kernel_device=True``: on a device the kernels run on (see :func:`check_device_usable`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None:
        dims = tuple(dims)
        if t.dim() not in dims:
            raise ValueError(f"{name} must be {_dims_text(dims)}, got shape {tuple(t.shape)} ({t.dim()}-D)")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if kernel_device:
        check_device_usable(name, t)


def check_float_tensor(name: str, t, *, dims: Iterable[int] | None = None) -> None:
    """A kernel operand: a tensor of a supported float dtype on a device the kernels run on."""
    check_tensor(name, t, dims=dims, dtypes=SUPPORTED_DTYPES, kernel_device=True)


def check_index_tensor(name: str, t, *, dims: Iterable[int] | None = None) -> None:
    """An index operand: an int32/int64 tensor on a device the kernels run on."""
    check_tensor(name, t, dims=dims, dtypes=INDEX_DTYPES, kernel_device=True)


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, *, device: bool = True,
               dtype: bool = True, shape: bool = False) -> None:
    """``t`` matches ``ref`` in device / dtype / shape (as asked)."""
    if device and t.device != ref.device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")
    if dtype and t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the same dtype as {ref_name} ({ref.dtype}), got {t.dtype}")
    if shape and t.shape != ref.shape:
        raise ValueError(f"{name} must have the same shape as {ref_name} ({tuple(ref.shape)}), got {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_buffer(name: str, t, shape, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """An output or state buffer a launcher writes: a tensor of ``shape`` on ``device`` with a
    supported dtype (``dtype`` exactly, when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_shape(name, t, shape)
    if t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    check_supported_dtype(name, t)


def output_buffer(name: str, out, shape, device: torch.device, dtype: torch.dtype, *,
                  exact_dtype: bool = False) -> torch.Tensor:
    """The buffer a launcher writes: ``out`` checked with :func:`check_buffer` (its dtype must be
    ``dtype`` only with ``exact_dtype``), or, when ``out`` is None, a new empty tensor of
    ``shape``, ``device`` and ``dtype``."""
    if out is None:
        return torch.empty(shape, device=device, dtype=dtype)
    check_buffer(name, out, shape, device, dtype if exact_dtype else None)
    return out


def check_supported_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} must have one of the dtypes {names}, got {t.dtype}")


#: whether a harness that replaces Triton's driver let CPU tensors take the compiled path
_CPU_LAUNCHES = [False]


def allow_cpu_launches() -> None:
    """Let CPU tensors take the compiled launch path, for a harness that replaces Triton's driver
    (the launch-plan tests: their data pointers are host addresses nothing dereferences)."""
    _CPU_LAUNCHES[0] = True


def cpu_launches() -> bool:
    """Whether kernels take CPU tensors: under the interpreter, or after :func:`allow_cpu_launches`."""
    return _CPU_LAUNCHES[0] or interpreting()


def check_device_usable(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if t.is_cuda or (t.is_cpu and cpu_launches()):
        return
    raise ValueError(
        f"{name} must be a CUDA tensor (or a CPU tensor with TRITON_INTERPRET=1 set before triton is "
        f"imported), got a tensor on {t.device}"
    )


def check_int(name: str, v, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """A Python int (``bool`` is not one) within ``[min_value, max_value]``; returns it."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ValueError(f"{name} must be <= {max_value}, got {v}")
    return v


def check_positive_number(name: str, v) -> float:
    """A real number (``bool`` is not one) greater than 0; returns it as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a positive number, got {type(v).__name__} {v!r}")
    if not v > 0:
        raise ValueError(f"{name} must be a positive number, got {v!r}")
    return float(v)


def check_softcap(softcap) -> float:
    """A logit softcap (attention, loss): ``None`` (off) or a positive finite number; returns it as
    a float (0.0: off)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a positive finite number or None, got {type(softcap).__name__} {softcap!r}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    return float(softcap)


def check_bool(name: str, v) -> bool:
    """A ``bool`` (a string such as ``"no"`` would otherwise read as True)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
    return v


def check_choice(name: str, v, choices) -> None:
    choices = tuple(choices)
    if v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")


def check_dtype(name: str, dtype, allowed) -> None:
    allowed = tuple(allowed)
    if dtype not in allowed:
        raise TypeError(f"{name} must be one of {', '.join(str(d) for d in allowed)}, got {dtype}")


def check_out_dtype(name: str, dtype) -> None:
    """An optional output dtype (``None``: the input's): one of the supported float dtypes (an
    integer dtype would truncate the result)."""
    if dtype is not None:
        check_dtype(name, dtype, SUPPORTED_DTYPES)


def check_positive_dims(name: str, t: torch.Tensor, dims: dict) -> None:
    """``t.shape[d] >= 1`` for every ``{d: what}`` in ``dims`` (``what`` names the size: "head")."""
    for d, what in dims.items():
        if t.shape[d] < 1:
            raise ValueError(f"{name} must have at least one {what} (dim {d}), got shape {tuple(t.shape)}")


def check_divisible(name: str, value: int, size: int, what: str = "the group size") -> None:
    """A dimension that must split evenly (over a group, into chunks, ...)."""
    if size <= 0 or value % size:
        raise ValueError(f"{name}={value} must be divisible by {what} ({size})")
