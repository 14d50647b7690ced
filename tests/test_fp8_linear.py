"""``fusedpar.ops.fp8_linear``: forward and backward of both recipes, with and without the
high-precision weight gradient, against

* float64 of the same dequantised quantities (the operands quantised by the bit-exact torch
  oracle ``quantize_e4m3_reference``, each GEMM's operands along its own contraction axis): only
  fp32 accumulation differs (rtol 1e-5 of the result's scale, ``test_fp8.ACC_RTOL``, plus on a GPU
  the fp8 tensor cores' accumulation bound per element, ``test_fp8.mma_error_bound``; fp16 / bf16
  outputs one rounding, 2^-11 / 2^-8);
* the unquantised float64 linear layer and its gradients, within the quantisation bound of every
  element (tests/test_fp8.py: e4m3 rounds within 2^-4 relative, 2^-10 of the scale for subnormals);

and the module ``FP8Linear``; ``torch.compile`` in tests/test_torch_compile_fp8.py.
"""
from __future__ import annotations

import pytest
import torch

from _utils import DEVICE, INTERPRETED
from fusedpar.kernels import dequantize_e4m3
from fusedpar.kernels.fp8 import quantize_e4m3_reference
from fusedpar.nn import FP8Linear
from fusedpar.ops import fp8_linear
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from test_fp8 import ACC_RTOL, assert_within, mma_error_bound, quantisation_bound

pytestmark = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                                reason="fp8 needs compute capability >= 8.9")

B, S, K, N = 2, 7, 200, 45  # K: a ragged last 128-block


def _dq(t, granularity):
    """float64 of ``t`` quantised by the oracle (the fp8 values) and each element's scale."""
    q, s = quantize_e4m3_reference(t.cpu(), granularity)
    return q.double(), dequantize_e4m3(torch.ones_like(q), s, granularity)


def _references(x, w, b, gy, recipe, hp):
    """``{name: (value of the dequantised quantities, unquantised value, quantisation bound, tensor
    cores' accumulation bound)}`` of y, dx, dw."""
    act, wgt = FP8_RECIPES[recipe]
    x2, g2, w64 = x.reshape(-1, K).cpu().double(), gy.reshape(-1, N).cpu().double(), w.cpu().double()
    out = {}
    for name, (lhs, lhs_g), (rhs, rhs_g) in (("y", (x2, act), (w64, wgt)), ("dx", (g2, act), (w64.t(), wgt)),
                                             ("dw", (g2.t(), act), (x2.t(), act))):
        (lq, ls), (rq, rs) = _dq(lhs, lhs_g), _dq(rhs, rhs_g)
        exact = lhs @ rhs.t()
        if name == "dw" and hp:  # the weight gradient in high precision: no quantisation
            zero = torch.zeros_like(exact)
            out[name] = (exact, exact, zero, zero)
        else:
            out[name] = ((lq * ls) @ (rq * rs).t(), exact, quantisation_bound(lhs, ls, rhs, rs),
                         mma_error_bound(lq, ls, rq, rs))
    out["y"] = tuple(t + b.cpu().double() if i < 2 else t for i, t in enumerate(out["y"]))
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("hp", [False, True], ids=["fp8_wgrad", "hp_wgrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_linear_forward_backward(recipe, hp, dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, S, K, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEVICE).requires_grad_()  # fp32 master weight
    b = torch.randn(N, generator=g).to(DEVICE).requires_grad_()
    y = fp8_linear(x, w, b, recipe=recipe, grad_high_precision=hp)
    assert y.shape == (B, S, N) and y.dtype == dtype
    gy = torch.randn(B, S, N, generator=g).to(DEVICE, dtype)
    y.backward(gy)
    assert x.grad.dtype == dtype and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    got = {"y": y.detach().reshape(-1, N), "dx": x.grad.reshape(-1, K), "dw": w.grad}
    # the operands in their dtype: what the kernels quantised
    refs = _references(x.detach().float(), w.detach(), b.detach(), gy.float(), recipe, hp)
    # fp32 accumulation (and, on a GPU, the fp8 tensor cores' bound); one output rounding of fp16 /
    # bf16 (the interpreter's bf16 store rounds to nearest even like the GPU's, kernels/fp8.py), also
    # in the high-precision weight gradient
    rtol = {torch.float32: ACC_RTOL, torch.float16: max(ACC_RTOL, 2.0 ** -11), torch.bfloat16: 2.0 ** -8}[dtype]
    for name, (dequantised, exact, bound, mma) in refs.items():
        actual = got[name].cpu().double()
        scale = exact.pow(2).mean().sqrt().item()
        assert_within(actual, dequantised, rtol * (dequantised.abs() + scale) + mma, name)
        err = (actual - exact).abs()
        assert (err <= bound * (1 + rtol) + rtol * (exact.abs() + 2 * scale) + mma).all(), (name, (err - bound).max())
    torch.testing.assert_close(b.grad.cpu().double(), gy.reshape(-1, N).cpu().double().sum(0), rtol=1e-5,
                               atol=1e-5)


def test_fp8_linear_only_asked_gradients_and_2d():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 130, generator=g).to(DEVICE)
    w = torch.randn(3, 130, generator=g).to(DEVICE).requires_grad_()
    y = fp8_linear(x, w, recipe="blockwise")
    y.sum().backward()
    assert x.grad is None and w.grad.shape == (3, 130)


def test_fp8_linear_bad_input():
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8_linear(x, w, recipe="tensorwise")
    with pytest.raises(TypeError, match="grad_high_precision must be a bool"):
        fp8_linear(x, w, grad_high_precision="no")
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fp8_linear(x, w[:, :5])
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        fp8_linear(x, w, torch.randn(4, device=DEVICE))


def test_fp8_linear_module():
    torch.manual_seed(4)
    layer = FP8Linear(130, 20, recipe="blockwise", grad_high_precision=True, device=DEVICE)
    ref = torch.nn.Linear(130, 20, device=DEVICE)
    assert layer.weight.dtype == torch.float32 and set(layer.placements()) == {"weight", "bias"}
    assert all(p.grad == "dense" and p.role is None for p in layer.placements().values())
    x = torch.randn(3, 130, device=DEVICE)
    torch.testing.assert_close(layer(x), fp8_linear(x, layer.weight, layer.bias, recipe="blockwise"), rtol=0, atol=0)
    with torch.no_grad():  # nn.Linear's initialisation range
        bound = 1 / 130 ** 0.5
        assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    assert (layer(x) - ref(x)).abs().max() <= 0.1 * ref(x).abs().max()  # fp8: a few percent
    assert "recipe='blockwise'" in repr(layer) and FP8Linear(4, 2, bias=False).bias is None
    with pytest.raises(ValueError, match="recipe must be one of"):
        FP8Linear(4, 2, recipe="tensorwise")
    with pytest.raises(ValueError, match="out_features must be >= 1"):
        FP8Linear(4, 0)
