"""The DeepSeek-V3 MoE layer: sigmoid scores with the selection-only correction bias, group-limited
top-k, ``routed_scaling_factor``, ungated shared experts (``n_shared_experts *
moe_intermediate_size``) and ``first_k_dense_replace`` dense blocks first.

* world 1: a block's feed-forward equals transformers' ``DeepseekV3MoE`` with the same weights
  (output and every gradient);
* world 4: a tiny one-block model with that layer trained 2 SGD steps at dp4 x ep1, dp4 x ep2 (two copies
  of each expert) and dp4 x ep4, each step's loss, every gradient and the auxiliary-loss-free
  bias after each update equal to the one-process model trained on the whole batch; the same for
  gpt-oss's layer (softmax over the chosen logits, router bias, expert biases, clamped SwiGLU).
"""
import pytest
import torch

from _compose import RTOL, batch, compare_grads, data_mean, local_batch, tiny_config
from _utils import DEVICE, assert_close
from _world import world_fixture
from fusedpar.nn import Transformer

world4 = world_fixture(4)

E, K, FFN_E, N_SHARED = 8, 2, 8, 2
DEEPSEEK = dict(num_layers=2, first_k_dense_replace=1, num_experts=E, top_k=K, moe_ffn_hidden_size=FFN_E,
                score_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                score_correction_bias=True, shared_expert_ffn_hidden_size=N_SHARED * FFN_E,
                shared_expert_gate=False)


def test_layout_from_the_config():
    model = Transformer(tiny_config(**dict(DEEPSEEK, num_layers=3)))
    dense, moe = model.layers["0"], model.layers["1"]
    assert not dense.is_moe and dense.mlp.fc1.weight.shape == (2 * 24, 16)  # ffn_hidden_size
    assert all(model.layers[i].is_moe for i in ("1", "2"))
    assert moe.shared_expert.fc1.weight.shape == (2 * N_SHARED * FFN_E, 16) and moe.shared_expert_gate is None
    assert moe.mlp.router.e_score_correction_bias is not None
    with pytest.raises(ValueError, match="first_k_dense_replace must be"):
        tiny_config(**dict(DEEPSEEK, first_k_dense_replace=-1))
    with pytest.raises(TypeError, match="shared_expert_gate must be a bool"):
        tiny_config(**dict(DEEPSEEK, shared_expert_gate="no"))


def test_feed_forward_equals_transformers_deepseek_v3_moe():
    """The block's MoE + ungated shared expert against DeepseekV3MoE: output, the input's gradient
    and every weight's (router, experts, shared expert), fp32."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=FFN_E,
                           n_shared_experts=N_SHARED)
    hf = DeepseekV3MoE(cfg)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    block = Transformer(tiny_config(**DEEPSEEK), device=DEVICE).layers["1"]
    sh = hf.shared_experts
    with torch.no_grad():
        block.mlp.router.weight.copy_(hf.gate.weight)
        block.mlp.router.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        block.mlp.w1.copy_(hf.experts.gate_up_proj)
        block.mlp.w2.copy_(hf.experts.down_proj)
        block.shared_expert.fc1.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        block.shared_expert.fc2.weight.copy_(sh.down_proj.weight)
    x = torch.randn(2, 7, 16, generator=g)
    go = torch.randn(2, 7, 16, generator=g)
    xh, xo = x.clone().requires_grad_(), x.clone().to(DEVICE).requires_grad_()
    yh = hf(xh)
    yo = block.feed_forward(xo)
    (yh * go).sum().backward()
    (yo * go.to(DEVICE)).sum().backward()
    assert_close(yo, yh.detach().double(), torch.float32, msg="output vs DeepseekV3MoE")
    assert_close(xo.grad, xh.grad.double(), torch.float32, msg="grad x")
    pairs = {"mlp.router.weight": hf.gate.weight.grad, "mlp.w1": hf.experts.gate_up_proj.grad,
             "mlp.w2": hf.experts.down_proj.grad, "shared_expert.fc2.weight": sh.down_proj.weight.grad,
             "shared_expert.fc1.weight": torch.cat([sh.gate_proj.weight.grad, sh.up_proj.weight.grad])}
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    assert set(grads) == set(pairs), sorted(grads)
    for name, ref in pairs.items():
        assert_close(grads[name], ref.double(), torch.float32, msg=f"grad {name}")


# ----------------------------------------------------------------------------------------------
# trained end to end at ep1, ep2 and ep4 over dp4
# ----------------------------------------------------------------------------------------------
B, S, STEPS, LR = 4, 8, 2, 0.5
# one block, the MoE one (the dense first block is checked above and in the GLM-4.5 family tests);
# and gpt-oss's layer: softmax over the chosen logits, a router bias, expert biases, clamped SwiGLU
STYLES = {
    "deepseek_v3": dict(DEEPSEEK, num_layers=1, first_k_dense_replace=0, bias_update_rate=0.02, seq_aux_loss_coef=0.1),
    "gpt_oss": dict(num_layers=1, num_experts=E, top_k=K, moe_ffn_hidden_size=FFN_E, score_func="softmax_topk",
                    router_bias=True, expert_bias=True, activation="swiglu_oai"),
}


def _biases(model):
    return {i: b.mlp.router.e_score_correction_bias.clone() for i, b in model.layers.items()
            if b.is_moe and b.mlp.router.e_score_correction_bias is not None}


def _one_process(train):
    """Per step: the loss (cross entropy + sequence-wise balance loss, whole batch), the full
    gradients, and the correction biases after the update."""
    config = tiny_config(**train)
    model = Transformer(config, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        tokens, targets = batch(30 + step, B, S, config.vocab_size)
        loss = model.loss(model(tokens), targets) + model.aux_loss()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        loads = model.update_router_bias()
        out.append((loss.detach(), grads, _biases(model), {k: v.counts for k, v in loads.items()}))
    return out


def _train(rank, size, ref, train, eps):
    from fusedpar.parallel import build_parallel_state, sync_gradients

    config = tiny_config(**train)
    checked = {}
    for ep in eps:
        state = build_parallel_state(dp=size, ep=ep)
        model = Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                            seed=1)
        assert model.layers["0"].mlp.experts_per_rank == E // ep
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        n = 0
        for step, (ref_loss, ref_grads, ref_bias, ref_counts) in enumerate(ref):
            tag = f"dp{size} x ep{ep} step {step} rank {rank}"
            ids, tgt = local_batch(*batch(30 + step, B, S, config.vocab_size), state)
            loss = model.loss(model(ids), tgt) + model.aux_loss()
            loss.backward()
            sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
            assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, rtol=RTOL, msg=f"loss {tag}")
            n += compare_grads(model, ref_grads, tag)
            opt.step()
            opt.zero_grad()
            loads = model.update_router_bias(state.data_tp_group)
            assert all(torch.equal(loads[name].counts, counts) for name, counts in ref_counts.items()), tag
            for i, bias in _biases(model).items():
                assert torch.equal(bias, ref_bias[i]), f"correction bias of layer {i}, {tag}"
        checked[ep] = n
    return checked


#: the expert-parallel sizes each style trains at over dp4 (gpt-oss's ep2 is the same code path as
#: DeepSeek-V3's, with two experts a rank; its biased experts at ep2: tests/test_hf_world.py)
STYLE_EPS = {"deepseek_v3": (1, 2, 4), "gpt_oss": (1, 4)}


@pytest.mark.parametrize("style", list(STYLES))
def test_trained_at_ep1_ep2_ep4_over_dp4(world4, style):
    train, eps = STYLES[style], STYLE_EPS[style]
    ref = _one_process(train)
    if style == "deepseek_v3":
        assert any(c.any() for c in ref[0][2].values())  # the bias moved before the second step
    out = world4.run(_train, ref, train, eps)
    n_params = len(list(Transformer(tiny_config(**train)).parameters()))
    assert all(c == {ep: STEPS * n_params for ep in eps} for c in out), out
