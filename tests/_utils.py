"""Shared test helpers: NaN poisoning, per-dtype tolerances, reference comparison."""
from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("FUSEDPAR_TEST_DEVICE", "cpu"))
INTERPRETED = DEVICE.type == "cpu"

# dtypes exercised in kernel tests: bf16 tl.dot is wrong in Triton's interpreter (it multiplies
# bit patterns, triton issue 11584), so bf16 runs only compiled.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])

# Tolerances against an fp64 reference, relative to the scale of the result.
#   fp32: ieee fp32 accumulation, error ~ sqrt(K) * 2^-24 per term; 1e-5 leaves room for K ~ 1e3.
#   fp16: inputs are rounded to fp16 (2^-11 relative) before the product and the output is
#         rounded again; 2e-3 relative covers both roundings with fp32 accumulation.
#   bf16: 8-bit mantissa (2^-8 relative) on inputs and output -> 1.6e-2.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL_SCALE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


#: what ``torch.library.opcheck`` runs on a fusedpar ``*_backward`` op called directly: schema,
#: registration and fakes; its AOT dispatch is already traced by its forward op's
#: ``test_aot_dispatch_*`` (the registered autograd calls it)
BACKWARD_OPCHECK = ("test_schema", "test_autograd_registration", "test_faketensor")


def spy_launches(monkeypatch, module, name: str) -> list:
    """Replace the kernel ``module.<name>`` (launched as ``kernel[grid](*args, **flags)``) for the
    test by one that records ``(grid, flags)`` of every launch, then launches the kernel; returns
    the record list."""
    kernel, seen = getattr(module, name), []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **flags: (seen.append((grid, flags)), kernel[grid](*args, **flags))[1]

    monkeypatch.setattr(module, name, Spy())
    return seen


def poison(shape, dtype, device=DEVICE):
    """An output buffer full of NaN: any element the kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def randn(*shape, dtype=torch.float32, device=DEVICE, generator=None, scale=1.0):
    return (torch.randn(*shape, generator=generator, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def assert_close(actual, expected, dtype=None, *, scale=None, rtol=None, atol=None, msg=""):
    """Compare with a reference computed in higher precision, tolerances chosen by ``dtype``.

    ``atol`` defaults to ATOL_SCALE[dtype] times the reference's RMS, so that cancellation near
    zero in long sums does not make the relative test meaningless.
    """
    dtype = dtype or actual.dtype
    expected = expected.to(device=actual.device, dtype=torch.float64)
    actual64 = actual.to(torch.float64)
    assert not torch.isnan(actual64).any(), f"{msg}: result has NaN (an element was not written?)"
    if scale is None:
        scale = expected.pow(2).mean().sqrt().item() if expected.numel() else 1.0
        scale = max(scale, 1e-6)
    rtol = RTOL[dtype] if rtol is None else rtol
    atol = ATOL_SCALE[dtype] * scale if atol is None else atol
    torch.testing.assert_close(actual64, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}")


def assert_tile_quantised(out, q, scale, features=None, *, msg=""):
    """``(q, scale)`` equal ``quantize_e4m3`` of ``out``'s rows per 1x128 tile and torch's cast of
    the same values, bit for bit (``features``: the row length, default ``out``'s last dim; the
    flash output's rows are its ``heads * d_v`` features)."""
    from fusedpar.kernels import quantize_e4m3
    from fusedpar.kernels.fp8 import quantize_e4m3_reference

    n = features or out.shape[-1]
    flat = out.reshape(-1, n)
    q_k, s_k = quantize_e4m3(flat, "tile")
    q_t, s_t = quantize_e4m3_reference(flat.cpu(), "tile")
    q2, s2 = q.reshape(-1, n).view(torch.uint8), scale.reshape(s_k.shape)
    assert torch.equal(s2, s_k) and torch.equal(s2.cpu(), s_t), f"{msg}: scales differ from quantize_e4m3(out)"
    assert torch.equal(q2, q_k.view(torch.uint8)), f"{msg}: e4m3 values differ from quantize_e4m3(out)"
    assert torch.equal(q2.cpu(), q_t.view(torch.uint8)), f"{msg}: e4m3 values differ from torch's cast"
