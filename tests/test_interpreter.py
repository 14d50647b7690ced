"""fusedpar's changes to Triton's CPU interpreter (``kernels/interpreter.py``): each makes an
interpreted kernel cheaper or its bits independent of the BLAS, never other values."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import fusedpar.kernels  # noqa: F401  (importing it installs the changes under test)
from _utils import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="Triton's CPU interpreter")


@triton.jit
def _plus_one(x):
    return x + 1


@triton.jit
def _helper_calls_kernel(p, N: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(p + offs)
    for _ in range(5):
        v = _plus_one(v)
    tl.store(p + offs, v)


def test_interpreted_helper_calls_patch_the_language_once_per_launch(monkeypatch):
    """interpreter.install_interpreter_device_calls: a kernel's launch patches triton.language for the
    interpreter once; its helper calls (five per program here) do not patch it again (Triton's own
    call did, ~0.15 ms each: a third of an interpreted GEMM's time), and compute the same."""
    from triton.runtime import interpreter

    patched = []
    triton_patch = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: (patched.append(fn.__name__), triton_patch(fn))[1])
    t = torch.arange(8, dtype=torch.float32)
    _helper_calls_kernel[(2,)](t, N=8)
    assert torch.equal(t, torch.arange(8, dtype=torch.float32) + 10)  # two programs, five helper calls each
    assert patched == ["_helper_calls_kernel"], patched
    assert getattr(interpreter.InterpretedFunction.__call__, "_fusedpar", False)


def test_interpreter_dtype_map_is_memoised_and_unchanged():
    """interpreter.install_interpreter_np_dtypes: the same NumPy dtype as Triton's map for every
    scalar, block and pointer type, each asked of Triton's once."""
    from triton.runtime import interpreter as triton_interpreter

    ours = triton_interpreter._get_np_dtype
    assert getattr(ours, "_fusedpar", False)
    want = {tl.float32: np.float32, tl.bfloat16: np.uint16, tl.float16: np.float16, tl.int1: bool, tl.int64: np.int64,
            tl.float8e4nv: np.uint8, tl.uint32: np.uint32}
    for ty, np_ty in want.items():
        for t in (ty, tl.block_type(ty, [4, 8])):
            assert ours(t) == np.dtype(np_ty), (t, ours(t))
        for t in (tl.pointer_type(ty), tl.block_type(tl.pointer_type(ty), [2])):
            assert ours(t) == np.dtype(np.uint64), (t, ours(t))


@triton.jit
def _int_ops_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs, a + b)
    tl.store(out_ptr + N + offs, a - b)
    tl.store(out_ptr + 2 * N + offs, a * b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_interpreted_integer_ops_skip_the_dead_overflow_check_and_still_wrap(dtype, monkeypatch):
    """interpreter.install_interpreter_overflow_checks: the interpreter's builder has ``debug`` off
    (so ``device_assert``, and with it Triton's overflow check, does nothing) and the check off: no
    check reaches ``device_assert``; the integer operations give the two's-complement results a GPU
    gives, overflowing ones included."""
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow, options
    asserts = []
    triton_assert = TritonSemantic.device_assert
    monkeypatch.setattr(TritonSemantic, "device_assert",
                        lambda self, *args: (asserts.append(args[1]), triton_assert(self, *args))[1])
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(7)
    a = torch.randint(info.min, info.max, (64,), generator=g, dtype=torch.int64)
    b = torch.randint(info.min, info.max, (64,), generator=g, dtype=torch.int64)
    a[:3] = torch.tensor([info.max, info.min, info.max])  # overflows: max + max, min - max, max * max
    b[:3] = torch.tensor([info.max, info.max, info.max])
    out = torch.full((3 * 64,), 0x55, dtype=dtype)
    _int_ops_kernel[(1,)](a.to(dtype), b.to(dtype), out, N=64)
    bits = 8 * torch.tensor([], dtype=dtype).element_size()

    def wrap(v):
        return ((v - info.min) % (1 << bits) + info.min).to(dtype)

    want = torch.cat([wrap(a + b), wrap(a - b), wrap(a * b)])
    assert torch.equal(out, want), (out[:3], want[:3])
    assert asserts == [], asserts[:3]
