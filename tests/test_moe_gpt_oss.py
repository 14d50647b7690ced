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
from fusedpar.kernels.grouped_bias import grouped_bias_grad, grouped_bias_grad_reference
from fusedpar.kernels.grouped_gemm import grouped_matmul, grouped_matmul_dact
from fusedpar.kernels.moe_routing import grouped_matmul_reference
from fusedpar.kernels.runtime import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, activation_reference
from fusedpar.ops.tensor_parallel.schedules import activation_backward
from fusedpar.nn import MoEConfig


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
    experts get zeros; accumulate adds into an fp32 buffer; a strided grad."""
    g = torch.Generator().manual_seed(5)
    dpre = randn(M, 24, dtype=torch.float16, generator=g)
    ref = torch.zeros(num_experts, 24, dtype=torch.float64)
    for grp in range(len(OFFS) - 1):
        ref[grp % num_experts] += dpre[OFFS[grp]:OFFS[grp + 1]].double().cpu().sum(0)
    torch.testing.assert_close(grouped_bias_grad_reference(dpre, OFFS, num_experts), ref, rtol=0, atol=0)
    got = grouped_bias_grad(dpre, torch.tensor(OFFS, device=DEVICE), num_experts,
                            out=poison((num_experts, 24), torch.float32))
    assert got.dtype == torch.float32
    assert_close(got, ref, torch.float32, msg="bias grad")
    init = randn(num_experts, 24, generator=g)
    expected = ref + init.double().cpu()
    grouped_bias_grad(dpre, OFFS, num_experts, out=init, accumulate=True)
    assert_close(init, expected, torch.float32, msg="bias grad accumulate")
    wide = randn(M, 48, dtype=torch.float32, generator=g)
    assert_close(grouped_bias_grad(wide[:, 1::2], OFFS, num_experts),
                 grouped_bias_grad_reference(wide[:, 1::2], OFFS, num_experts), torch.float32, msg="strided grad")


def test_grouped_bias_grad_is_deterministic():
    """Many rows per expert (several row tiles and column blocks, ragged ends): bit-identical over
    repeated runs, equal to the float64 sum. The summation order is fixed by the offsets and the
    block sizes (no atomics): on a GPU too, where index_add_ was not reproducible."""
    g = torch.Generator().manual_seed(7)
    sizes = [70, 0, 33, 101, 1, 45]
    offs = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    dpre = randn(offs[-1] + 5, 83, generator=g, scale=3.0)
    runs = [grouped_bias_grad(dpre, offs, 4) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert_close(runs[0], grouped_bias_grad_reference(dpre, offs, 4), torch.float32, msg="bias grad vs float64")
    with pytest.raises(ValueError, match="num_experts must be"):
        grouped_bias_grad(dpre, offs, 0)
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        grouped_bias_grad(dpre, offs, 4, accumulate=True)


# ----------------------------------------------------------------------------------------------
# the MoE with expert biases (gpt-oss)
# ----------------------------------------------------------------------------------------------
def _expert_inputs(T, k, E, H, Fd, g, ep=1):
    x = randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    wts = torch.rand(T, k, generator=g).to(DEVICE)
    E_loc = E // ep
    w1 = randn(E_loc, 2 * Fd, H, generator=g, scale=4 * H ** -0.5)  # pre-activations of std ~4: clamps hit
    w2 = randn(E_loc, H, Fd, generator=g, scale=Fd ** -0.5)
    b1 = randn(E_loc, 2 * Fd, generator=g, scale=2.0)
    b2 = randn(E_loc, H, generator=g)
    return x, ids, wts, w1, w2, b1, b2, randn(T, H, generator=g)


@pytest.mark.parametrize("ep,capacity", [(1, None), (1, 3), (2, None), (2, 2)], ids=lambda v: str(v))
def test_moe_mlp_expert_bias_swiglu_oai(ep, capacity):
    """moe_mlp with b1 / b2 and swiglu_oai (one rank, and the EP schedule on EmulatedTransport,
    whose peers mirror this rank: global expert e is local expert e % E_local) against the fp64
    loop, outputs and every gradient; capacity drops included."""
    from fusedpar.kernels.moe_routing import moe_mlp_reference
    from fusedpar.ops import moe_mlp
    from fusedpar.ops.comm.transport import EmulatedTransport

    g = torch.Generator().manual_seed(6 + ep)
    T, k, E, H, Fd = 13, 2, 4, 16, 12
    inputs = _expert_inputs(T, k, E, H, Fd, g, ep)
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs[:7]]
    x, ids, wts, w1, w2, b1, b2 = leaves
    transport = EmulatedTransport(ep, ep - 1) if ep > 1 else None
    y = moe_mlp(x, ids.detach(), wts, w1, w2, b1=b1, b2=b2, num_experts=E, capacity=capacity,
                activation="swiglu_oai", transport=transport)
    (y * inputs[7]).sum().backward()
    ref = [t.detach().cpu() if i == 1 else t.detach().double().cpu().requires_grad_() for i, t in enumerate(inputs[:7])]
    rep = [t.repeat(ep, *([1] * (t.dim() - 1))) for t in ref[3:]]
    yr = moe_mlp_reference(ref[0], ids, ref[2], rep[0], rep[1], b1=rep[2], b2=rep[3], activation="swiglu_oai",
                           capacity=capacity)
    yr = yr + 0.0 * sum(t.sum() for t in ref if t.dtype == torch.float64)
    (yr * inputs[7].double().cpu()).sum().backward()
    assert_close(y, yr, torch.float32, msg="output")
    for name, a, b in zip(("x", "weights", "w1", "w2", "b1", "b2"), leaves[:1] + leaves[2:], ref[:1] + ref[2:]):
        assert_close(a.grad, b.grad, torch.float32, msg=f"grad {name} (ep={ep}, capacity={capacity})")


def test_grouped_mlp_bias_without_weight_grads():
    """Only the biases (and x) need gradients: the bias gradients still come back."""
    from fusedpar.ops import grouped_mlp

    g = torch.Generator().manual_seed(9)
    x, _, _, w1, w2, b1, b2, _ = _expert_inputs(15, 1, 3, 16, 12, g)
    offs = [0, 4, 4, 11, 15]
    b1l, b2l = b1.clone().requires_grad_(), b2.clone().requires_grad_()
    y = grouped_mlp(x, w1, w2, offs, activation="swiglu_oai", b1=b1l, b2=b2l)
    y.sum().backward()
    bd = [b.double().requires_grad_() for b in (b1, b2)]
    ref = torch.zeros(15, 16, dtype=torch.float64)
    for grp in range(4):
        a, b = offs[grp], offs[grp + 1]
        e = grp % 3
        h = activation_reference(x[a:b].double() @ w1[e].double().t() + bd[0][e], "swiglu_oai")
        ref[a:b] = h @ w2[e].double().t() + bd[1][e]
    ref.sum().backward()
    assert_close(y, ref, torch.float32, msg="grouped_mlp with biases")
    assert_close(b1l.grad, bd[0].grad, torch.float32, msg="b1 grad")
    assert_close(b2l.grad, bd[1].grad, torch.float32, msg="b2 grad")


def test_moe_layer_expert_bias():
    from fusedpar.nn import MoE
    from fusedpar.nn.placement import parameter_placements

    torch.manual_seed(0)
    m = MoE(MoEConfig(16, 12, 4, 2, activation="swiglu_oai", score="softmax_topk", router_bias=True, expert_bias=True), device=DEVICE)
    assert m.b1.shape == (4, 24) and m.b2.shape == (4, 16) and not m.b1.any() and not m.b2.any()
    places = parameter_placements(m)
    assert places["b1"] == places["w1"] and places["b2"] == places["w2"] and places["b1"].role == "ep"
    with torch.no_grad():
        m.b1.normal_()
        m.b2.normal_()
    x = randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    y = m(x)
    y.square().sum().backward()
    assert m.b1.grad is not None and m.b2.grad is not None and m.b2.grad.abs().sum() > 0
    plain = MoE(MoEConfig(16, 12, 4, 2, activation="swiglu_oai"), device=DEVICE)
    assert plain.b1 is None and set(parameter_placements(plain)) == {"w1", "w2", "router.weight"}


def test_matches_transformers_gpt_oss_experts():
    """transformers' GptOssExperts (interleaved gate / up columns, biases, clamped SwiGLU) on a tiny
    random config against moe_mlp with the mapped weights: outputs and gradients, fp32."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    from fusedpar.ops import moe_mlp

    T, k, E, H, Fd = 11, 2, 4, 16, 12
    cfg = GptOssConfig(hidden_size=H, intermediate_size=Fd, num_local_experts=E, num_experts_per_tok=k,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       vocab_size=32)
    hf = modeling.GptOssExperts(cfg)
    # the clamp and the sigmoid gain the experts apply: fusedpar's constants (recent transformers, 5.24
    # here, reads them from the config's swiglu_limit / swiglu_alpha; 5.17 hard-codes them in the module)
    assert (hf.limit, hf.alpha) == (SWIGLU_OAI_LIMIT, SWIGLU_OAI_ALPHA)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(E, H, 2 * Fd, generator=g) * 4 * H ** -0.5)
        hf.gate_up_proj_bias.copy_(torch.randn(E, 2 * Fd, generator=g) * 2)
        hf.down_proj.copy_(torch.randn(E, Fd, H, generator=g) * Fd ** -0.5)
        hf.down_proj_bias.copy_(torch.randn(E, H, generator=g))
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    go = torch.randn(T, H, generator=g)
    xh, wh = x.clone().requires_grad_(), wts.clone().requires_grad_()
    (hf(xh, router_indices=ids, routing_weights=wh) * go).sum().backward()

    params = {n: p.detach().clone().to(DEVICE).requires_grad_() for n, p in hf.named_parameters()}
    gu, gub = params["gate_up_proj"], params["gate_up_proj_bias"]
    w1 = torch.cat([gu[..., ::2], gu[..., 1::2]], -1).transpose(1, 2)  # [E, 2F, H]: gate rows, then up rows
    b1 = torch.cat([gub[:, ::2], gub[:, 1::2]], -1)
    w2 = params["down_proj"].transpose(1, 2)  # [E, H, F]
    xo, wo = x.to(DEVICE).requires_grad_(), wts.to(DEVICE).requires_grad_()
    y = moe_mlp(xo, ids.to(DEVICE), wo, w1, w2, b1=b1, b2=params["down_proj_bias"], num_experts=E,
                activation="swiglu_oai")
    (y * go.to(DEVICE)).sum().backward()
    ref = hf(x, router_indices=ids, routing_weights=wts).detach()
    assert_close(y, ref.double(), torch.float32, msg="output vs GptOssExperts")
    assert_close(xo.grad, xh.grad.double(), torch.float32, msg="grad x")
    assert_close(wo.grad, wh.grad.double(), torch.float32, msg="grad routing weights")
    for name, p in hf.named_parameters():
        assert_close(params[name].grad, p.grad.double(), torch.float32, msg=f"grad {name}")
