"""MoE routing on one process: the routing kernel (fusedpar.kernels.moe_topk) against its float64
reference (selection, weights, d logits), ties, the router against transformers' DeepSeek-V3,
GLM-4.5 (Glm4Moe) and gpt-oss routers, the sequence-wise balance loss, the auxiliary-loss-free
bias update and the configuration errors."""
import math

import pytest
import torch

from _utils import DEVICE
from fusedpar.kernels.moe_topk import topk_route, topk_route_backward, topk_route_reference
from fusedpar.nn import MoE, TopKRouter, Transformer, TransformerConfig
from fusedpar.nn.moe import SharedExpertGate, max_violation
from fusedpar.ops import moe_route
from fusedpar.nn import MoEConfig

# (T, E, k, score, n_group, topk_group, normalize, scale, bias): awkward sizes (E not a power of
# two, groups of 3, a partial last token block)
CASES = {
    "softmax": (7, 6, 2, "softmax", 1, None, False, 1.0, False),
    "sigmoid-grouped": (13, 12, 3, "sigmoid", 4, 2, True, 2.5, True),
    "softmax_topk": (9, 10, 4, "softmax_topk", 1, None, False, 1.0, False),
    "sigmoid-bias": (6, 5, 2, "sigmoid", 1, None, True, 1.0, True),
    "softmax-grouped-k5": (11, 18, 5, "softmax", 6, 3, True, 1.5, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_float64_reference(case):
    T, E, k, score, ng, tg, norm, scale, has_bias = CASES[case]
    g = torch.Generator().manual_seed(list(CASES).index(case))
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.2).to(DEVICE) if has_bias else None
    kw = dict(score=score, n_group=ng, topk_group=tg, normalize=norm, scale=scale)
    w, ids = topk_route(logits, k, bias=bias, **kw)
    ref_logits = logits.cpu().double().requires_grad_()
    rw, rids = topk_route_reference(ref_logits, k, bias=None if bias is None else bias.cpu(), **kw)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(w.cpu().double(), rw.detach(), rtol=1e-6, atol=1e-6)
    gw = torch.randn(T, k, generator=g).to(DEVICE)
    dl = topk_route_backward(gw, logits, w, ids, score=score, n_group=ng, normalize=norm, scale=scale)
    rw.backward(gw.cpu().double())
    torch.testing.assert_close(dl.cpu().double(), ref_logits.grad, rtol=1e-5, atol=1e-6)
    # the op: same numbers, and autograd reaches the logits
    leaf = logits.clone().requires_grad_()
    w2, ids2 = moe_route(leaf, k, bias=bias, **kw)
    (w2 * gw).sum().backward()
    assert torch.equal(ids2, ids) and torch.equal(w2.detach(), w) and torch.equal(leaf.grad, dl)


def test_renormalised_top1_weight_is_exactly_the_scale_and_has_no_gradient():
    """Top-1 renormalised: ``w = p / (p + 1e-20) * scale`` is exactly ``scale`` and ``d logits``
    exactly 0, as in exact arithmetic. The kernels divide with IEEE rounding (tl.math.div_rn):
    Triton's fp32 ``/`` is div.full.f32 on a GPU (up to 2 ulp off), and on the first GPU run the
    ulp left in ``p / p`` leaked into the router gradient (test_moe_layer.py::
    test_sigmoid_correction_bias_edges[all-to-expert-2], 7e-3 relative off)."""
    g = torch.Generator().manual_seed(21)
    logits = (torch.randn(37, 12, generator=g) * 3).to(DEVICE)
    gw = torch.randn(37, 1, generator=g).to(DEVICE)
    for score, scale, groups in (("sigmoid", 1.0, {}), ("softmax", 2.5, {}), ("sigmoid", 2.5, dict(n_group=4))):
        w, ids = topk_route(logits, 1, score=score, normalize=True, scale=scale, **groups)
        assert torch.equal(w, torch.full_like(w, scale)), (score, scale, groups)
        dl = topk_route_backward(gw, logits, w, ids, score=score, normalize=True, scale=scale, **groups)
        assert torch.equal(dl, torch.zeros_like(dl)), (score, scale, groups)


def test_ties_go_to_the_lower_expert_and_group():
    # exact ties: equal logits; groups (of 2) 1 and 2 tie on their top-2 sums, group 1 must win
    logits = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    for score in ("softmax", "sigmoid", "softmax_topk"):
        _, ids = topk_route(logits, 3, score=score)
        assert ids.tolist() == [[2, 3, 4], [0, 1, 2]], score
        _, ids = topk_route(logits, 2, score=score, n_group=4, topk_group=1)
        assert ids.tolist() == [[2, 3], [0, 1]], score
    # the bias decides the selection but not the weights
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0], device=DEVICE)
    w, ids = topk_route(logits, 2, score="sigmoid", bias=bias)
    assert ids[:, 0].tolist() == [7, 7]
    torch.testing.assert_close(w[0, 0].cpu(), torch.sigmoid(torch.tensor(0.0)))


# ----------------------------------------------------------------------------------------------
# transformers' routers
# ----------------------------------------------------------------------------------------------
def _hf_router(family):
    """(HF router module, our TopKRouter kwargs) for a tiny random config of ``family``."""
    if family == "gpt_oss":
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        cfg = GptOssConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=3)
        return GptOssTopKRouter(cfg), dict(score="softmax_topk", router_bias=True)
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config as C
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as R
    else:
        from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig as C
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as R
    cfg = C(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5)
    return R(cfg), dict(score="sigmoid", normalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        score_bias=True)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_router_equals_transformers(family):
    torch.manual_seed(11)
    hf, kw = _hf_router(family)
    E, k = hf.num_experts, hf.top_k
    ours = TopKRouter(16, E, k, aux_loss_coef=0.0, z_loss_coef=0.0, device=DEVICE, **kw)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, 16) * 0.5)
        if family == "gpt_oss":
            hf.bias.copy_(torch.randn(E) * 0.3)
        else:
            hf.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    hf.to(DEVICE)  # op for op on the same device as ours
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        if family == "gpt_oss":
            ours.bias.copy_(hf.bias)
        else:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(2, 9, 16).to(DEVICE)
    out = hf(x.reshape(-1, 16))  # gpt-oss's router takes [tokens, hidden]
    hw, hids = out[1], out[2].cpu()
    r = ours(x)
    # HF's topk(sorted=False) may list the chosen experts in another order: compare by expert id
    order, hf_order = r.expert_ids.cpu().argsort(-1), hids.argsort(-1)
    assert torch.equal(r.expert_ids.cpu().gather(1, order), hids.gather(1, hf_order))
    w, hw = r.weights.gather(1, order.to(DEVICE)), hw.gather(1, hf_order.to(DEVICE))
    torch.testing.assert_close(w.cpu(), hw.cpu(), rtol=1e-5, atol=1e-6)
    gw = torch.randn(w.shape).to(DEVICE)
    (hw * gw).sum().backward()
    (w * gw).sum().backward()
    torch.testing.assert_close(ours.weight.grad.cpu(), hf.weight.grad.cpu(), rtol=1e-5, atol=1e-6)
    if family == "gpt_oss":
        torch.testing.assert_close(ours.bias.grad.cpu(), hf.bias.grad.cpu(), rtol=1e-5, atol=1e-6)


def test_moe_equals_deepseek_v3_routed_experts():
    """DeepseekV3MoE without its shared experts (not in this layer) against MoE: output and the
    gradients of the input and of the router weight."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(12)
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=1.5, moe_intermediate_size=8,
                           n_shared_experts=1)
    hf = DeepseekV3MoE(cfg)
    moe = MoE(MoEConfig(16, 8, 8, 2, score="sigmoid", normalize=True, n_group=4, topk_group=2, routed_scaling_factor=1.5, score_bias=True, aux_loss_coef=0.0, z_loss_coef=0.0), device=DEVICE)
    with torch.no_grad():
        for p in (hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj):
            p.copy_(torch.randn(p.shape) * 0.4)
        hf.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
        hf.to(DEVICE)  # op for op on the same device as ours
        moe.router.weight.copy_(hf.gate.weight)
        moe.router.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        moe.w1.copy_(hf.experts.gate_up_proj)
        moe.w2.copy_(hf.experts.down_proj)
    x = torch.randn(2, 5, 16).to(DEVICE)
    xh, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yh = hf(xh) - hf.shared_experts(xh)
    yo = moe(xo)
    torch.testing.assert_close(yo, yh, rtol=1e-5, atol=1e-5)
    go = torch.randn(yh.shape).to(DEVICE)
    (yh * go).sum().backward()
    (yo * go).sum().backward()
    torch.testing.assert_close(xo.grad, xh.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.router.weight.grad, hf.gate.weight.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# losses, the bias update, configuration errors
# ----------------------------------------------------------------------------------------------
def test_sequence_wise_balance_loss():
    torch.manual_seed(13)
    B, S, E, k = 3, 5, 6, 2
    r = TopKRouter(8, E, k, score="sigmoid", aux_loss_coef=0.0, z_loss_coef=0.0, seq_aux_loss_coef=0.5,
                   device=DEVICE)
    x = torch.randn(B, S, 8)
    out = r(x.to(DEVICE))
    s = torch.sigmoid(x.reshape(-1, 8).double() @ r.weight.detach().cpu().double().t()).view(B, S, E)
    p = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
    ids = out.expert_ids.cpu().view(B, S * k)
    f = torch.stack([torch.bincount(ids[b], minlength=E) for b in range(B)]).double() * E / (k * S)
    expected = 0.5 * (f * p).sum(-1).mean()
    torch.testing.assert_close(out.aux_loss.detach().cpu().double(), expected, rtol=1e-5, atol=1e-7)


def test_bias_update_balances_a_skewed_router():
    """DeepSeek-V3's rule: after each step ``b_e += rate * sign(mean load - load_e)``: overloaded
    experts go down, underloaded ones up; the selection moves towards balance while the combine
    weights keep the unbiased scores."""
    torch.manual_seed(14)
    E, k, rate = 8, 2, 0.02
    r = TopKRouter(16, E, k, score="sigmoid", bias_update_rate=rate, aux_loss_coef=0.0, z_loss_coef=0.0,
                   device=DEVICE)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, 16))
        r.weight[:2] += 1.0  # experts 0 and 1 are preferred
    x = torch.randn(64, 16).abs().to(DEVICE)
    violations = []
    for step in range(12):
        r(x)
        before = r.e_score_correction_bias.cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        load = r.update_bias()
        violations.append(load.max_violation)
        assert load.counts.sum() == 64 * k
        mean = load.counts.double().mean()
        expected = before + rate * torch.sign(mean - load.counts.double()).float()
        assert torch.equal(r.e_score_correction_bias.cpu(), expected), step
        assert max_violation(load.counts) == load.max_violation
    assert r.step_counts().sum() == 0  # reset by the update
    assert violations[-1] < 0.5 * violations[0], violations
    assert r.e_score_correction_bias[:2].max() < 0 < r.e_score_correction_bias[2:].max()
    with torch.no_grad():  # evaluation forwards are not counted
        r(x)
    assert r.step_counts().sum() == 0


def test_activation_checkpointing_counts_each_token_once():
    """A checkpointed block runs its router twice (forward, then the recomputation in backward):
    the step's loads count the forward only, so the bias update is the same as without
    checkpointing; the gradients are too."""
    config = TransformerConfig(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=8,
                               num_experts=4, top_k=2, score_func="sigmoid", score_correction_bias=True,
                               bias_update_rate=0.01)
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(5))
    loads, grads = [], []
    for checkpointed in (False, True):
        model = Transformer(config, seed=3, activation_checkpointing=checkpointed, device=DEVICE)
        model.loss(model(ids.to(DEVICE)), ids.to(DEVICE)).backward()
        loads.append({n: load.counts for n, load in model.update_router_bias().items()})
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert loads[0].keys() == loads[1].keys() and loads[0]
    for name, counts in loads[0].items():
        assert counts.sum() == 2 * 6 * 2, (name, counts)
        assert torch.equal(loads[1][name], counts), name
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


def test_initial_weights_come_from_the_cpu_generator_on_every_device(monkeypatch):
    """Router, shared-expert gate and expert weights are drawn from torch's global CPU generator
    whatever the device, so a seed gives the same module everywhere: a parameter's own uniform_
    on a GPU draws from the GPU's generator, which Transformer(seed=...) leaves alone (on the first
    GPU run two identically seeded models routed differently:
    test_activation_checkpointing_counts_each_token_once). Every random draw is recorded with the
    device of the tensor it fills: only CPU tensors, and none at all for a ``meta`` build (no
    values exist there; a DeepSeek-V3 layer would be 1.1e10 draws)."""
    draws = []
    for name in ("uniform_", "normal_"):
        original = getattr(torch.Tensor, name)

        def spy(t, *a, _original=original, **k):
            draws.append(t.device.type)
            return _original(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)

    def build(device):
        torch.random.default_generator.manual_seed(7)
        draws.clear()
        mods = (MoE(MoEConfig(8, 6, 4, 2, score="sigmoid", router_bias=True), device=device), SharedExpertGate(8, device=device))
        return mods, list(draws)

    ref, ref_draws = build("cpu")
    assert ref_draws and set(ref_draws) == {"cpu"}
    _, meta_draws = build("meta")
    assert meta_draws == [], f"a meta build drew values: {meta_draws}"
    if DEVICE.type != "cpu":
        torch.randn(64, device=DEVICE)  # move the device generator: it must not matter
    ours, our_draws = build(DEVICE)
    assert our_draws == ref_draws
    for a, b in zip(ours, ref):
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert p.device.type == DEVICE.type and torch.equal(p.detach().cpu(), q.detach()), name


def test_identically_seeded_models_are_identical():
    """Two Transformers built with one seed hold the same parameters on DEVICE, whatever was drawn
    from the device's generator in between."""
    config = TransformerConfig(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=8,
                               num_experts=4, top_k=2, score_func="sigmoid", score_correction_bias=True)
    a = Transformer(config, seed=3, device=DEVICE)
    torch.rand(16, device=DEVICE)
    b = Transformer(config, seed=3, device=DEVICE)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_configuration_errors_name_the_field():
    base = dict(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=8, num_experts=8, top_k=2)
    bad = {
        "TransformerConfig.topk_group must be <= 2": dict(n_group=2, topk_group=3),
        "TransformerConfig.num_experts must be divisible by TransformerConfig.n_group": dict(n_group=3),
        "TransformerConfig.top_k must be <= TransformerConfig.topk_group \\* experts per group": dict(
            n_group=4, topk_group=1, top_k=3),
        "TransformerConfig.bias_update_rate must be a number >= 0": dict(bias_update_rate=-0.1),
        "TransformerConfig.seq_aux_loss_coef must be a number >= 0": dict(seq_aux_loss_coef=-1.0),
        "TransformerConfig.routed_scaling_factor must be a number > 0": dict(routed_scaling_factor=0.0),
        "TransformerConfig.score_func must be one of": dict(score_func="tanh"),
        "TransformerConfig.n_group must leave at least 2 experts per group": dict(n_group=8),
    }
    for msg, kw in bad.items():
        with pytest.raises(ValueError, match=msg):
            TransformerConfig(**{**base, **kw})
    with pytest.raises(ValueError, match="^topk_group must be <= 2"):
        MoE(MoEConfig(8, 8, 4, 2, n_group=2, topk_group=3))
    with pytest.raises(ValueError, match="^bias_update_rate must be a number >= 0"):
        TopKRouter(8, 4, 2, bias_update_rate=-1)
    assert math.isclose(TopKRouter(8, 4, 2).routed_scaling_factor, 1.0)
