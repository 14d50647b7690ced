"""Triton's CPU interpreter made fit for fusedpar's kernels (installed when ``fusedpar.kernels``
is imported with the interpreter on): whether the installed Triton and NumPy can run them, a
``tl.dot`` whose result does not depend on the BLAS, and helper calls that do not patch the
language again."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreting, release


def interpreter_incompatibility(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels with these versions, or None.

    Triton 3.6's interpreter turns a scalar into a Python int with ``int()`` of a one-element
    1-D array (a loop ``range(start, ...)`` whose start comes from ``tl.program_id``), which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton
    3.7 and later squeeze first. Compiled kernels are unaffected."""
    if release(triton_version) < (3, 7) and release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) does not run with NumPy "
                f"{numpy_version}: it needs numpy<2.4 or triton>=3.7 (pip install 'numpy<2.4')")
    return None


def interpreter_problem() -> str | None:
    """:func:`interpreter_incompatibility` of the installed Triton and NumPy (whether or not the
    interpreter is on: test worlds ask it before starting interpreted workers)."""
    import numpy

    return interpreter_incompatibility(triton.__version__, numpy.__version__)


def check_interpreter() -> None:
    """Raise ``RuntimeError`` when the interpreter is on and cannot run the kernels (see
    :func:`interpreter_incompatibility`), give its ``tl.dot`` a result that does not depend on
    the BLAS (:func:`install_interpreter_dot`) and make its helper calls, dtype map and integer
    arithmetic cheap (:func:`install_interpreter_device_calls`, :func:`install_interpreter_np_dtypes`,
    :func:`install_interpreter_overflow_checks`); called when ``fusedpar.kernels`` is imported."""
    problem = interpreter_problem() if interpreting() else None
    if problem:
        raise RuntimeError(problem)
    if interpreting():
        install_interpreter_dot()
        install_interpreter_device_calls()
        install_interpreter_np_dtypes()
        install_interpreter_overflow_checks()


def _float8_values(torch_dtype):
    """The float64 value of each of the 256 bit patterns of an fp8 dtype (exact)."""
    return torch.arange(256, dtype=torch.uint8).view(torch_dtype).double().numpy()


def interpreter_dot(a, b, acc, a_type, b_type):
    """``acc + a @ b`` of the interpreter's numpy operands (``a_type`` / ``b_type`` their Triton
    element types; bf16 and fp8 arrive as their bit patterns), rounded once to ``acc``'s dtype.

    Triton's own interpreted ``tl.dot`` is a float32 ``numpy.matmul``, whose summation order is
    OpenBLAS's: it depends on the BLAS kernel the machine runs (``OPENBLAS_CORETYPE``) and on the
    operand shapes, so two kernels doing the same products in other tile shapes agreed bit for bit
    only by luck of the BLAS build. This dot sums in float64 instead, which makes the result a
    function of the operands alone:

    * e4m3 operands: every value is a multiple of 2^-9 below 2^9, so each product is an integer
      multiple of 2^-18 below 2^18 and any sum of up to 2^17 of them is exact in float64's 53
      bits, whatever the order: the result is exact, then rounded once to the accumulator's dtype
      (the accumulator added first, in float64). Bit equality of two kernels that do the same
      dots over the same K blocks holds by construction, whatever their M / N tiles.
    * e5m2, 16- and 32-bit operands: each product is exact in float64 (at most 48 significant
      bits); the sum's rounding error is at most ``K 2^-53 sum |a b|`` in any order, typically
      ``sqrt(K) 2^-53`` of the terms' size, about 2^-27 of the float32 result's unit at K = 64.
      Two summation orders give other float32 bits only when the exact value lies that close to
      a rounding boundary: about one element in 10^7 to 10^8, against the few 10^4 elements a
      test compares.

    The compiled kernels are untouched: a GPU's dot is its tensor cores', in their own order."""
    import numpy as np

    def values(data, ty):
        if ty.is_fp8():
            table = _FP8_TABLES.get(ty.name)
            if table is None:
                raise NotImplementedError(f"interpreter_dot: no table for {ty}")
            return table[data]
        if ty.is_bf16():
            return (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return data.astype(np.float64)

    out = np.matmul(values(a, a_type), values(b, b_type))
    out += acc
    return out.astype(acc.dtype)


#: fp8 value tables by Triton type name, filled by :func:`install_interpreter_dot`
_FP8_TABLES: dict = {}


def install_interpreter_dot() -> None:
    """Replace the interpreter's ``tl.dot`` on float accumulators (fp32 / fp16) with
    :func:`interpreter_dot` (idempotent; integer dots keep Triton's)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_fusedpar", False):
        return
    import numpy as np

    _FP8_TABLES.update({tl.float8e4nv.name: _float8_values(torch.float8_e4m3fn),
                        tl.float8e5.name: _float8_values(torch.float8_e5m2)})
    triton_dot = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        a_ty, b_ty = a.get_element_ty(), b.get_element_ty()
        exotic = any(t.is_fp8() and t.name not in _FP8_TABLES for t in (a_ty, b_ty))
        if d.data.dtype not in (np.float32, np.float16) or exotic or a_ty.is_int() or b_ty.is_int():
            return triton_dot(self, a, b, d, *args, **kwargs)
        return interpreter.TensorHandle(interpreter_dot(a.data, b.data, d.data, a_ty, b_ty), d.dtype.scalar)

    create_dot._fusedpar = True
    builder.create_dot = create_dot


def install_interpreter_device_calls() -> None:
    """Make the interpreter's calls of ``@triton.jit`` helpers from a kernel cheap (idempotent).
    Triton's interpreter patches ``triton.language`` for the interpreter (four
    ``inspect.getmembers`` sweeps, ~0.15 ms) at every such call, although the kernel's launch has
    patched it for the whole grid: a GEMM tile that calls helpers per tile and per K step spent a
    third of its interpreted time there. A helper call now patches only where a language module
    its globals hold (``triton.language``, ``triton.language.core``) is not patched yet (its
    ``load`` still Triton's builtin), as Triton's call would; otherwise it runs the helper as
    Triton's call does after patching (the same patched functions, the same error wrapping)."""
    from triton.runtime import interpreter

    cls = interpreter.InterpretedFunction
    if getattr(cls.__call__, "_fusedpar", False):
        return
    triton_call, langs = cls.__call__, {}

    def __call__(self, *args, **kwargs):
        mods = langs.get(self.fn)
        if mods is None:
            mods = langs[self.fn] = tuple(v for v in self.fn.__globals__.values() if v is tl or v is tl.core)
        if not mods or any(tl.core.is_builtin(m.load) for m in mods):
            return triton_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    __call__._fusedpar = True
    cls.__call__ = __call__


def install_interpreter_np_dtypes() -> None:
    """Memoise the interpreter's Triton-to-NumPy dtype map (idempotent). Triton's
    ``_get_np_dtype`` builds a dict of nineteen ``numpy.dtype`` objects on every call (~15 us),
    and the interpreter asks it for nearly every value an element-wise op makes: about 5% of an
    interpreted model step. The map is a function of the (element) type, so each is asked once."""
    from triton.runtime import interpreter

    if getattr(interpreter._get_np_dtype, "_fusedpar", False):
        return
    triton_map, known = interpreter._get_np_dtype, {}

    def _get_np_dtype(tt_dtype):
        ty = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return known[ty]
        except KeyError:
            found = known[ty] = triton_map(ty)
            return found
        except TypeError:  # (a type that cannot be hashed: Triton's own answer, every time)
            return triton_map(tt_dtype)

    _get_np_dtype._fusedpar = True
    interpreter._get_np_dtype = _get_np_dtype


def install_interpreter_overflow_checks() -> None:
    """Stop the interpreter from computing integer-overflow checks that it then drops (idempotent).
    Triton's ``+``, ``-`` and ``*`` on integers narrower than 64 bits build an overflow check (both
    operands cast to int64, the operation again, two comparisons, an ``and``) and hand it to
    ``device_assert``, which does nothing unless the builder's options have ``debug`` on. The
    interpreter's never have (its ``InterpreterOptions.debug`` is False and nothing sets it), so
    every integer operation of an interpreted kernel ran about eight more NumPy operations for
    nothing: a third of an interpreted model step. With ``debug`` off the check is now off too:
    the same values, the same (absent) asserts. A compiled kernel is untouched (its compiler
    removes the dead check; ``TRITON_DEBUG=1`` keeps it there)."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if builder.options.sanitize_overflow and not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
