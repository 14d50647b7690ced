"""The interpreter's ``tl.dot`` does not depend on the BLAS numpy runs (kernels/interpreter.py,
``interpreter_dot``): bit-equality claims between two kernels hold on every machine.

Triton's own interpreted dot is a float32 ``numpy.matmul``; OpenBLAS sums it in an order that
depends on its kernel (``OPENBLAS_CORETYPE``, which some machines' environments set) and on the
operand shapes, so two kernels doing the same products in other tiles agreed bit for bit only by
luck. fusedpar's dot sums in float64 (exact for e4m3 operands). Here:

* the e4m3 dot equals the exactly rounded sum (``math.fsum``) for every tile shape and row;
* the bit-equality tests between two kernels (fp8 epilogues, the persistent and symmetric fp8
  GEMMs, the flash backward's dq modes) run again in a subprocess under
  ``OPENBLAS_CORETYPE=Haswell``, the kernel that made them fail before;
* the bytes of fp8 GEMMs are the same under the environment's BLAS kernel and under Haswell.

The suite never sets ``OPENBLAS_*`` for itself: only these subprocesses do.
"""
from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

from _utils import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the interpreter's dot (compiled kernels use the GPU's)")

HERE = os.path.dirname(os.path.abspath(__file__))
#: bit-equality tests between two kernels with other tiles or K chunkings (all failed under
#: Haswell with Triton's float32 dot)
BIT_EQUALITY_TESTS = [
    "test_gemm_fp8_fused_epilogue.py::test_fused_epilogue",
    "test_gemm_fp8_fused_epilogue.py::test_sequence_chunk_views_residual_after_the_activation",
    "test_gemm_fp8_fused_epilogue.py::test_gated_epilogue_where_it_does_not_fit",
    "test_gemm_persistent.py::test_fp8_all_ready_matches_fp8_matmul",
    "test_gemm_persistent.py::test_fp8_late_flags_swiglu_preact",
    "test_tensor_parallel_symmetric.py::test_emulated_all_gather_matmul_fp8",
    "test_attention_flash.py::test_dq_modes_agree",
]
OTHER_KERNEL = "Haswell"


def _e4m3_patterns(shape, generator):
    """Random e4m3 bit patterns, NaN (0x7f / 0xff) excluded, subnormals and zero included."""
    bits = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32)
    bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)
    return bits.to(torch.uint8).numpy()


def test_dot_is_installed():
    import fusedpar.kernels  # noqa: F401  (installs the dot when the interpreter is on)
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpreterBuilder.create_dot, "_fusedpar", False)


def test_e4m3_dot_is_exactly_rounded_for_every_tile_shape():
    """Each element is the float32 rounding of the float64 sum acc + sum_k a b, which is exact
    (products of e4m3 values are multiples of 2^-18 below 2^18): the same in any order, so a
    row's result does not depend on the rows or columns computed beside it."""
    import triton.language as tl
    from fusedpar.kernels.interpreter import install_interpreter_dot, interpreter_dot

    install_interpreter_dot()
    g = torch.Generator().manual_seed(3)
    a, b = _e4m3_patterns((37, 160), g), _e4m3_patterns((160, 45), g)
    acc = torch.randn(37, 45, generator=g).numpy()
    got = interpreter_dot(a, b, acc, tl.float8e4nv, tl.float8e4nv)
    va = torch.from_numpy(a).view(torch.float8_e4m3fn).double().numpy()
    vb = torch.from_numpy(b).view(torch.float8_e4m3fn).double().numpy()
    for i, j in [(0, 0), (5, 44), (36, 17), (20, 30)]:
        exact = math.fsum([float(acc[i, j])] + list(va[i] * vb[:, j]))
        assert got[i, j] == np.float32(exact), (i, j)
    for rows, cols in [(slice(0, 16), slice(0, 32)), (slice(16, 37), slice(13, 45)), (slice(3, 4), slice(0, 45))]:
        part = interpreter_dot(a[rows], b[:, cols], acc[rows, cols], tl.float8e4nv, tl.float8e4nv)
        assert np.array_equal(part, got[rows, cols])


_DIGEST = r"""
import hashlib, os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fusedpar.kernels import fp8_matmul, quantize_e4m3
g = torch.Generator().manual_seed(11)
xq, xs = quantize_e4m3(torch.randn(37, 160, generator=g), "tile")
wq, ws = quantize_e4m3(torch.randn(144, 160, generator=g) * 0.2, "block")
h = hashlib.sha256()
for kw in ({}, {"activation": "swiglu"}):
    h.update(fp8_matmul(xq, xs, wq, ws, scaling="blockwise", out_dtype=torch.float32, **kw).numpy().tobytes())
print(h.hexdigest())
"""


def _run(args, coretype=None, timeout=300):
    env = dict(os.environ, TRITON_INTERPRET="1", FUSEDPAR_TEST_DEVICE="cpu")
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    return subprocess.run([sys.executable, *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS's Haswell kernel is x86-64's")
def test_fp8_bytes_are_the_same_under_another_blas_kernel():
    runs = {c: _run(["-c", _DIGEST], c) for c in (None, OTHER_KERNEL)}
    for c, r in runs.items():
        assert r.returncode == 0, f"OPENBLAS_CORETYPE={c}: {r.stderr[-2000:]}"
    digests = {c: r.stdout.split()[-1] for c, r in runs.items()}
    assert all(len(d) == 64 for d in digests.values()), runs[None].stdout
    assert digests[None] == digests[OTHER_KERNEL], "fp8 GEMM bytes depend on the BLAS kernel"


@pytest.mark.world
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS's Haswell kernel is x86-64's")
def test_bit_equality_tests_pass_under_another_blas_kernel():
    r = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-x", *BIT_EQUALITY_TESTS],
             OTHER_KERNEL)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, f"under OPENBLAS_CORETYPE={OTHER_KERNEL}:\n{tail}"
    assert " passed" in r.stdout and "deselected" not in r.stdout, tail
