"""gpt-oss's expert MLP: the clamped SwiGLU ``swiglu_oai`` (forward and backward, in the dense and
grouped GEMM epilogues) against float64 references, with values straddling the clamp at +-7; the
grouped GEMM's per-expert bias and its gradient.

The formula (transformers' ``GptOssExperts._apply_gate``, alpha 1.702, limit 7):
``g = min(gate, 7); u = clamp(up, -7, 7); out = (u + 1) * g * sigmoid(1.702 g)``.
"""
import pytest
import torch

from _utils import DEVICE, DTYPES, assert_close, poison, randn
from fusedpar.kernels import matmul
from fusedpar.kernels.grouped_gemm import (grouped_bias_grad, grouped_matmul, grouped_matmul_dact,
                                           grouped_matmul_reference)
from fusedpar.kernels.runtime import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, activation_reference
from fusedpar.ops.tensor_parallel_schedules import activation_backward


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _hf_gate(gate, up, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts._apply_gate on split halves (its own formula, written out)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _straddling(*shape, generator, scale=6.0):
    """Values around +-7 and beyond (std ``scale``), the exact limits included."""
    t = torch.randn(*shape, dtype=torch.float64, generator=generator) * scale
    t.view(-1)[:4] = torch.tensor([7.0, -7.0, 7.5, -7.5], dtype=torch.float64)
    return t


def test_constants_and_reference():
    assert (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) == (1.702, 7.0)
    g = torch.Generator().manual_seed(0)
    pre = _straddling(64, 2 * 10, generator=g).requires_grad_()
    gy = torch.randn(64, 10, dtype=torch.float64, generator=g)
    ours = activation_reference(pre, "swiglu_oai")
    theirs = _hf_gate(*pre.chunk(2, dim=-1))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # the closed-form backward (ops' activation_backward, fp32) against autograd, clamp gradients included
    (grad,) = torch.autograd.grad(theirs, pre, gy)
    assert_close(activation_backward(pre.detach(), gy, "swiglu_oai"), grad, torch.float32, msg="activation_backward")
    assert (grad[:, :10] == 0).any() and (grad[:, 10:] == 0).any()  # some values were clamped


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_dense_matmul_swiglu_oai(dtype):
    g = torch.Generator().manual_seed(1)
    M, K, Fd = 37, 32, 24
    a = randn(M, K, dtype=dtype, generator=g)
    w = randn(2 * Fd, K, dtype=dtype, generator=g, scale=4 * K ** -0.5)  # pre-activations of std ~4
    bias = randn(2 * Fd, dtype=dtype, generator=g, scale=3.0)
    pre = poison((M, 2 * Fd), dtype)
    out = matmul(a, w, bias, activation="swiglu_oai", preact_out=pre)
    pre_ref = a.double().cpu() @ w.double().cpu().t() + bias.double().cpu()
    assert (pre_ref.abs() > 7).any()
    assert_close(pre, pre_ref, dtype, msg="preact")
    assert_close(out, activation_reference(pre_ref, "swiglu_oai"), dtype, msg=f"dense swiglu_oai {_name(dtype)}")


OFFS = [0, 5, 0, 18, 1, 0, 3]  # sizes: 5, 0 (empty), 18, 1, 0 (empty), 3 over 3 experts
OFFS = [sum(OFFS[:i + 1]) for i in range(len(OFFS))]
M = OFFS[-1] + 3  # zero tail


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_grouped_forward_swiglu_oai(dtype):
    g = torch.Generator().manual_seed(2)
    E, H, Fd = 3, 32, 20
    x = randn(M, H, dtype=dtype, generator=g)
    w = randn(E, 2 * Fd, H, dtype=dtype, generator=g, scale=5 * H ** -0.5)
    pre = poison((M, 2 * Fd), dtype)
    out = grouped_matmul(x, w, OFFS, activation="swiglu_oai", preact_out=pre, out=poison((M, Fd), dtype))
    pre_ref = grouped_matmul_reference(x, w, OFFS)
    assert (pre_ref.abs() > 7).any()
    assert_close(pre, pre_ref, dtype, msg="preact")
    assert_close(out, grouped_matmul_reference(x, w, OFFS, activation="swiglu_oai"), dtype,
                 msg=f"grouped swiglu_oai {_name(dtype)}")
    assert (out[OFFS[-1]:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_grouped_dact_swiglu_oai(dtype):
    g = torch.Generator().manual_seed(3)
    E, H, Fd = 3, 20, 24
    pre = _straddling(M, 2 * Fd, generator=g).to(device=DEVICE, dtype=dtype)
    w2 = randn(E, H, Fd, dtype=dtype, generator=g, scale=Fd ** -0.5)
    gy = randn(M, H, dtype=dtype, generator=g)
    got = grouped_matmul_dact(gy, w2, OFFS, pre, activation="swiglu_oai")
    pre_d = pre.double().cpu().requires_grad_()
    dh = grouped_matmul_reference(gy, w2, OFFS, weight_layout="kn")
    (activation_reference(pre_d, "swiglu_oai") * dh).sum().backward()
    ref = pre_d.grad.clone()
    ref[OFFS[-1]:] = 0
    assert_close(got, ref, dtype, msg=f"grouped swiglu_oai backward {_name(dtype)}")


@pytest.mark.parametrize("activation", ["swiglu_oai", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_grouped_bias(dtype, activation):
    """bias[g % E] added before the activation (gate and up halves), empty groups, a zero tail."""
    g = torch.Generator().manual_seed(4)
    E, H, Fd = 3, 32, 20
    n_w = 2 * Fd if activation == "swiglu_oai" else Fd
    x = randn(M, H, dtype=dtype, generator=g)
    w = randn(E, n_w, H, dtype=dtype, generator=g, scale=3 * H ** -0.5)
    bias = randn(E, n_w, dtype=dtype, generator=g, scale=4.0)
    pre = poison((M, n_w), dtype)
    out = grouped_matmul(x, w, OFFS, activation=activation, bias=bias, preact_out=pre, out=poison((M, Fd), dtype))
    assert_close(pre, grouped_matmul_reference(x, w, OFFS, bias=bias), dtype, msg="preact with bias")
    ref = grouped_matmul_reference(x, w, OFFS, activation=activation, bias=bias)
    assert_close(out, ref, dtype, msg=f"grouped {activation} with bias {_name(dtype)}")
    assert (out[OFFS[-1]:] == 0).all()


@pytest.mark.parametrize("num_experts", [3, 4], ids=lambda e: f"E{e}")
def test_grouped_bias_grad(num_experts):
    """Per expert, the sum of the rows of every group mapped to it (tail rows ignored); empty
    experts get zeros; accumulate adds into an fp32 buffer."""
    g = torch.Generator().manual_seed(5)
    dpre = randn(M, 24, dtype=torch.float16, generator=g)
    ref = torch.zeros(num_experts, 24, dtype=torch.float64)
    for grp in range(len(OFFS) - 1):
        ref[grp % num_experts] += dpre[OFFS[grp]:OFFS[grp + 1]].double().cpu().sum(0)
    got = grouped_bias_grad(dpre, torch.tensor(OFFS, device=DEVICE), num_experts)
    assert got.dtype == torch.float32
    assert_close(got, ref, torch.float32, msg="bias grad")
    init = randn(num_experts, 24, generator=g)
    expected = ref + init.double().cpu()
    grouped_bias_grad(dpre, OFFS, num_experts, out=init, accumulate=True)
    assert_close(init, expected, torch.float32, msg="bias grad accumulate")
