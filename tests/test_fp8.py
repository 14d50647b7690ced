"""fp8 (e4m3) kernels: the cast, the quantisation (row, 1x128 tile, 128x128 block) and the scaled
fp8 GEMM (rowwise, blockwise).

* The cast and the quantisation equal torch's ``x.to(torch.float8_e4m3fn)`` of the same scaled fp32
  values **bit for bit** (the scales too): subnormals, the rounding carries into the exponent that
  Triton's interpreter loses on its own (1.99 -> 2), ties to even, saturation at +-448, -0.0. No
  tolerance: the interpreted kernels round to the grid themselves (kernels/fp8.py).
* The GEMM against the float64 product of the dequantised operands: only fp32 accumulation differs
  (rtol 1e-5 of the result's scale; bf16 outputs one bf16 rounding, 2^-8 relative; on a GPU
  :data:`ACC_RTOL`), and against
  the unquantised float64 product within the quantisation bound, computed per element: e4m3 keeps 3
  mantissa bits, so a normal value rounds within 2^-4 of itself and a subnormal one within 2^-10
  of its scale (half the grid step 2^-9): ``|x - q sx| <= (2^-4 + 2^-23) |x| + 2^-10 sx``
  (2^-23: the fp32 division before the cast), and the product's error is at most
  ``sum_k (dx |w| + |x| dw + dx dw)`` with those element bounds ``dx``, ``dw``.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from _utils import DEVICE, INTERPRETED, poison
from fusedpar.kernels import dequantize_e4m3, fp8_matmul, quantize_e4m3
from fusedpar.kernels.fp8 import E4M3_MAX, SCALE_FLOOR, fp8_support_problem, quantize_e4m3_reference, to_e4m3
from fusedpar.kernels.fp8_gemm import fp8_matmul_reference

pytestmark = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                                reason="fp8 needs compute capability >= 8.9")

#: the GEMM against the product of the dequantised operands, relative to the result's scale: fp32
#: accumulation under the interpreter (exact fp8 products); on a GPU Hopper's fp8 wgmma keeps about
#: 14 bits within each 128-deep step before the fp32 promotion (DeepSeek-V3; kernels/fp8_gemm.py)
ACC_RTOL = 1e-5 if INTERPRETED else 2.0 ** -12
#: the quantisation error bound of one element (module docstring): relative and in units of its scale
REL_BOUND = 2.0 ** -4 + 2.0 ** -23
SUBNORMAL_BOUND = 2.0 ** -10


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


@triton.jit
def _cast_kernel(x_ptr, q_ptr, n, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r, mask=r < n)
    tl.store(q_ptr + r, to_e4m3(x, EMULATE), mask=r < n)


# the hard cases of the cast: rounding carries into the exponent, ties (to even), subnormals and
# their ties, the largest values, saturation (torch maps >= 464 to NaN: its reference is clamped
# first, as the GPU's satfinite conversion does), negative zero and values that round to it, an
# fp32 subnormal
SPECIAL = [1.99, 1.9999, 15.9, 0.2490, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -11, 2.0 ** -9,
           2.0 ** -7, 1.5 * 2.0 ** -8, 15.5 * 2.0 ** -6, 0.3, 447.0, 448.0, 455.9, 460.0, 464.0, 1e6, -1e6, -0.0,
           -(2.0 ** -12), -1.99, 1e-40, 240.0, 232.0]


def test_cast_equals_torch_bit_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(SPECIAL), torch.randn(4000, generator=g) * 100,
                   torch.randn(1000, generator=g) * 2.0 ** -7]).to(DEVICE)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    _cast_kernel[(1,)](x, q, x.numel(), EMULATE=INTERPRETED, BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.cpu().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(bits(q), bits(expected)), (x.cpu()[bits(q) != bits(expected)][:8])
    nan = torch.tensor([float("nan"), 1.0], device=DEVICE)
    _cast_kernel[(1,)](nan, q, 2, EMULATE=INTERPRETED, BLOCK=2)
    assert torch.isnan(q[0].float()) and q[1].float() == 1.0


@pytest.mark.parametrize("granularity", ["row", "tile", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_equals_torch_bit_exactly(granularity, dtype):
    g = torch.Generator().manual_seed(1)
    R, C = (130, 200) if granularity == "block" else (37, 300)  # ragged last tiles / blocks
    x = torch.randn(R, C, generator=g) * 3
    x[1] = 0.0  # an all-zero row (and, for blocks, part of a block)
    x[2, 5] = 1e4  # one outlier
    x[3] = torch.randn(C, generator=g) * torch.finfo(dtype).tiny / 4  # subnormals of the input dtype
    if granularity == "block":
        x[128:, 128:] = 0.0  # an all-zero block (the ragged corner)
    x = x.to(DEVICE, dtype)
    for view in (x, x.t()):  # the transposed view: the columns' scaling, read in place
        q, s = quantize_e4m3(view, granularity)
        q_ref, s_ref = quantize_e4m3_reference(view.cpu(), granularity)
        assert q.is_contiguous() and q.shape == view.shape and q.dtype == torch.float8_e4m3fn
        assert torch.equal(s.cpu(), s_ref), "scales differ"
        assert torch.equal(bits(q), bits(q_ref)), "fp8 bits differ"
        assert torch.isfinite(s).all() and (s > 0).all() and torch.isfinite(q.float()).all()
        # the quantisation error bound of every element (module docstring)
        x64 = view.cpu().double()
        err = (x64 - dequantize_e4m3(q.cpu(), s.cpu(), granularity)).abs()
        sx = dequantize_e4m3(torch.ones_like(q.cpu()), s.cpu(), granularity)
        assert (err <= REL_BOUND * x64.abs() + SUBNORMAL_BOUND * sx).all()
    q, s = quantize_e4m3(x, granularity)
    q, s = q.cpu().float(), s.cpu()
    if granularity != "block":  # the zero row: the floor scale, zeros
        assert (s[1] == SCALE_FLOOR).all() and (q[1] == 0).all()
        # only the outlier saturates (in its row or its tile; the other tiles have their own amax)
        assert (q[2, :128].abs() == E4M3_MAX).sum() == 1 and q[2, 5] == E4M3_MAX
        assert (q[3] != 0).sum() > C // 2  # the subnormal row keeps its values
    else:
        assert s[1, 1] == SCALE_FLOOR and (q[128:, 128:] == 0).all()
        assert q[2, 5] == E4M3_MAX and (q[:128, :128].abs() == E4M3_MAX).sum() == 1


def test_quantize_empty_and_bad_input():
    q, s = quantize_e4m3(torch.empty(0, 5, device=DEVICE), "row")
    assert q.shape == (0, 5) and s.shape == (0,)
    with pytest.raises(ValueError, match="granularity must be one of"):
        quantize_e4m3(torch.randn(2, 3, device=DEVICE), "column")
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_e4m3(torch.randn(2, 3, 4, device=DEVICE))


def quantisation_bound(x, sx, w, sw):
    """Per output element, the bound of |(q(x) sx) @ (q(w) sw)^T - x @ w^T| (module docstring);
    ``sx`` / ``sw``: each element's scale."""
    dx = REL_BOUND * x.abs() + SUBNORMAL_BOUND * sx
    dw = REL_BOUND * w.abs() + SUBNORMAL_BOUND * sw
    return dx @ w.abs().t() + x.abs() @ dw.t() + dx @ dw.t()


# rowwise; blockwise with a weight (128x128 blocks) and with a token-tiled B (1x128, the weight
# gradient's operands); ragged M / N, K not a multiple of 128 (a ragged last scale block)
CASES = [("rowwise", "row", "row"), ("blockwise", "tile", "block"), ("blockwise", "tile", "tile")]
SHAPES = [(37, 45, 200), (33, 130, 256)]


@pytest.mark.parametrize("scaling,ga,gb", CASES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_fp8_matmul(scaling, ga, gb, M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE)
    w[3] = 0.0  # a zero weight row
    bias = torch.randn(N, generator=g).to(DEVICE)
    xq, xs = quantize_e4m3(x, ga)
    wq, ws = quantize_e4m3(w, gb)
    xq = torch.empty(M, K + 16, dtype=xq.dtype, device=DEVICE)[:, :K].copy_(xq)  # a strided A
    ref = fp8_matmul_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), bias.cpu(), scaling=scaling)
    scale = ref.pow(2).mean().sqrt().item()
    # fp32 output into a NaN-poisoned strided view: fp32 accumulation only
    big = poison((M, N + 7), torch.float32)
    out = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out=big[:, 3:3 + N])
    assert out.data_ptr() == big[:, 3:].data_ptr()
    assert torch.isnan(big[:, :3]).all() and torch.isnan(big[:, 3 + N:]).all()  # nothing outside the view
    torch.testing.assert_close(out.cpu().double(), ref, rtol=ACC_RTOL, atol=ACC_RTOL * scale)
    # bf16 output: one bf16 rounding (the interpreter's cast made to round to nearest even)
    y = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.cpu().double(), ref, rtol=2.0 ** -8, atol=ACC_RTOL * scale)
    # against the unquantised product: within the quantisation bound of every element
    exact = x.cpu().double() @ w.cpu().double().t() + bias.cpu().double()
    sx = dequantize_e4m3(torch.ones_like(xq.cpu()), xs.cpu(), ga)
    sw = dequantize_e4m3(torch.ones_like(wq.cpu()), ws.cpu(), gb)
    bound = quantisation_bound(x.cpu().double(), sx, w.cpu().double(), sw)
    err = (out.cpu().double() - exact).abs()
    assert (err <= bound + ACC_RTOL * scale).all(), (err - bound).max()
    assert err.max() > 1e-4 * scale  # the quantisation is real: the test would see a missing scale


def test_fp8_matmul_empty():
    a = quantize_e4m3(torch.randn(3, 0, device=DEVICE))
    b = quantize_e4m3(torch.randn(2, 0, device=DEVICE))
    bias = torch.randn(2, device=DEVICE)
    out = fp8_matmul(*a, *b, bias, out=poison((3, 2), torch.float32))
    assert torch.equal(out.cpu(), bias.cpu().expand(3, 2))  # empty contraction: the bias alone
    assert fp8_matmul(*quantize_e4m3(torch.randn(0, 8, device=DEVICE)), *quantize_e4m3(
        torch.randn(2, 8, device=DEVICE))).shape == (0, 2)


def test_fp8_matmul_bad_input():
    a = quantize_e4m3(torch.randn(4, 256, device=DEVICE))
    with pytest.raises(TypeError, match="a must have dtype torch.float8_e4m3fn"):
        fp8_matmul(torch.randn(4, 256, device=DEVICE), a[1], *a)
    with pytest.raises(ValueError, match=r"b_scale must have shape \(4,\)"):
        fp8_matmul(*a, a[0], a[1][:3])
    with pytest.raises(ValueError, match="a_scale must have shape"):
        fp8_matmul(*a, *a, scaling="blockwise")
    t = quantize_e4m3(torch.randn(4, 256, device=DEVICE), "tile")
    with pytest.raises(ValueError, match=r"b_scale must have shape \(1, 2\) \(128x128 blocks\) or \(4, 2\)"):
        fp8_matmul(*t, t[0], t[1][:3], scaling="blockwise")
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8_matmul(*a, *a, scaling="tensorwise")


def test_device_without_fp8_tensor_cores_is_named():
    msg = fp8_support_problem((8, 0), "NVIDIA A100-SXM4-80GB")
    assert "NVIDIA A100-SXM4-80GB" in msg and "8.0" in msg and "8.9" in msg and "recipe" in msg
    assert fp8_support_problem((8, 9), "NVIDIA L4") is None and fp8_support_problem((9, 0), "NVIDIA H100") is None
