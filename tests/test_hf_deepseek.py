"""fusedpar.hf route A for DeepSeek-V3 (model_type "deepseek_v3", also Kimi K2) against
transformers' DeepseekV3ForCausalLM at world 1: MLA attention with YaRN, a dense first block
(first_k_dense_replace) and a MoE block with the sigmoid, group-limited, biased router; logits,
loss, every gradient, the state-dict round trip, a checkpoint directory, 3 AdamW steps, the fields
not implemented yet, and Kimi K2's config.json (model_type "kimi_k2") read as DeepSeek-V3's."""
from __future__ import annotations

import json

import pytest
import torch

from _utils import DEVICE
from _hf import TOL, compare_grads, hf_model, hf_reference, tokens_targets, train_like_transformers
from fusedpar.hf import config_from_hf, from_hf, to_hf_state_dict
from fusedpar.nn import MLAttention

T = pytest.importorskip("transformers")

def _config(**kw):
    config = hf_model("deepseek_v3").config
    for k, v in kw.items():
        setattr(config, k, v)
    return config


def _assert_close(actual, expected, msg):
    scale = expected.abs().max().item() + 1e-12
    err = (actual - expected).abs().max().item()
    assert err <= TOL * scale, f"{msg}: off by {err:.3g} (scale {scale:.3g})"


def test_deepseek_v3_logits_gradients_and_export_match_transformers(tmp_path):
    hf = hf_model("deepseek_v3")
    tokens, targets = tokens_targets(1, 2, 8)
    ref_logits, ref_loss, ref_grads = hf_reference(hf, tokens, targets, aux=False)
    model = from_hf(hf, device=DEVICE)
    config = model.config
    assert (config.attention, config.first_k_dense_replace, config.score_func, config.n_group) == ("mla", 1, "sigmoid", 2)
    assert isinstance(model.layers["0"].attn, MLAttention) and not model.layers["0"].is_moe and model.layers["1"].is_moe
    logits = model(tokens)
    _assert_close(logits.detach(), ref_logits, "logits")
    loss = model.loss(logits, targets)
    _assert_close(loss.detach(), ref_loss, "loss")
    loss.backward()
    compare_grads(model, ref_grads, "deepseek_v3")
    # export: every tensor of the HF model (the ungated shared expert included), strictly
    out = to_hf_state_dict(model)
    ref = hf.state_dict()
    assert set(out) == set(ref) and any(".shared_experts." in k for k in out)
    for k, v in out.items():
        assert torch.equal(v, ref[k]), k
    fresh = hf_model("deepseek_v3", seed=7)
    fresh.load_state_dict(out, strict=True)
    _assert_close(fresh(tokens).logits.detach(), ref_logits, "HF model loaded from the export")
    # a checkpoint directory (safetensors) loads the same model
    hf.save_pretrained(tmp_path)
    _assert_close(from_hf(str(tmp_path), device=DEVICE)(tokens).detach(), ref_logits, "from a checkpoint directory")


def test_deepseek_v3_training_steps_match_transformers():
    """3 AdamW steps (the head fused into the loss, no aux loss: transformers trains none) leave
    every weight as transformers' own steps do: MLA's latents and norms, the dense block, the routed
    and shared experts, the router; the correction bias is a buffer, untouched by both."""
    hf = hf_model("deepseek_v3")
    model = from_hf(hf, device=DEVICE)
    assert model.aux_loss() is None
    bias = {k: v.clone() for k, v in hf.state_dict().items() if k.endswith("e_score_correction_bias")}
    train_like_transformers(hf, model)
    trained, ref = to_hf_state_dict(model), hf.state_dict()
    assert set(trained) == set(ref)
    for name, p in ref.items():  # every weight after 3 steps (lr 1e-2: all moved by ~3e-2)
        _assert_close(trained[name], p, f"deepseek_v3 {name} after 3 AdamW steps")
    assert bias and all(torch.equal(trained[k], v) for k, v in bias.items())


@pytest.mark.parametrize("field,value,match", [
    ("attention_bias", True, "attention_bias=True is not supported"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}, "rope_type='longrope'"),
])
def test_deepseek_v3_fields_not_implemented_raise(field, value, match):
    config = _config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        config_from_hf(config)


def test_deepseek_v3_config_fields():
    raw = _config(q_lora_rank=None, first_k_dense_replace=5).to_dict()  # a config.json's dict
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 16}
    c = config_from_hf(raw)
    assert c.q_lora_rank is None and not any(c.is_moe(i) for i in range(c.num_layers))  # every block dense
    assert c.rope_scaling["factor"] == 4.0  # transformers' rule: max_position_embeddings / original
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (8, 4, 4, 6)


# Kimi K2's config.json (moonshotai/Kimi-K2-Instruct, -Base) in small: model_type "kimi_k2", DeepSeek-V3's
# DeepseekV3ForCausalLM as remote code (auto_map), DeepSeek-V3's config.json fields (the pre-transformers-5
# rope_theta + rope_scaling "type") with Kimi's values: one dense block, one expert group, routed_scaling_factor
# 2.827, YaRN with beta_fast = beta_slow = 1 and mscale = mscale_all_dim = 1 over rope_theta 50000
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2",
    auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
              "AutoModel": "modeling_deepseek.DeepseekV3Model",
              "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=0, eos_token_id=1,
    first_k_dense_replace=1, hidden_act="silu", hidden_size=16, initializer_range=0.02, intermediate_size=24,
    kv_lora_rank=8, max_position_embeddings=64, moe_intermediate_size=8, moe_layer_freq=1, n_group=1,
    n_routed_experts=4, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=4, num_experts_per_tok=2,
    num_hidden_layers=2, num_key_value_heads=4, num_nextn_predict_layers=0, pretraining_tp=1, q_lora_rank=12,
    qk_nope_head_dim=4, qk_rope_head_dim=4, rms_norm_eps=1e-6, rope_theta=50000.0,
    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4, "type": "yarn"},
    routed_scaling_factor=2.827, scoring_func="sigmoid", seq_aux=True, tie_word_embeddings=False, topk_group=1,
    topk_method="noaux_tc", torch_dtype="bfloat16", use_cache=True, v_head_dim=6, vocab_size=32)


def test_kimi_k2_config_reads_as_deepseek_v3(tmp_path):
    """``kimi_k2`` is DeepSeek-V3's layout under another name: the same TransformerConfig as the same
    dict with ``deepseek_v3``; and a directory whose config.json says ``kimi_k2`` (which transformers'
    AutoConfig does not know) loads with the logits of transformers' DeepseekV3ForCausalLM."""
    yarn = {"rope_type": "yarn", **{k: v for k, v in KIMI_K2["rope_scaling"].items() if k != "type"}}
    c = config_from_hf(KIMI_K2)
    assert c == config_from_hf(dict(KIMI_K2, model_type="deepseek_v3"))
    assert (c.attention, c.first_k_dense_replace, c.n_group, c.topk_group, c.routed_scaling_factor,
            c.rope_theta, c.rope_scaling) == ("mla", 1, 1, 1, 2.827, 50000.0, yarn)
    with pytest.raises(ValueError, match="quantization_config"):  # the released block-fp8 weights: as DeepSeek-V3's
        config_from_hf(dict(KIMI_K2, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    hf = hf_model("deepseek_v3", n_group=1, topk_group=1, routed_scaling_factor=2.827,
                  rope_parameters=dict(yarn, rope_theta=50000.0))
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, model_type="kimi_k2")))
    tokens, _ = tokens_targets(3, 2, 8)
    model = from_hf(str(tmp_path), device=DEVICE)
    assert (model.config.n_group, model.config.rope_theta) == (1, 50000.0)
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), "kimi_k2 directory")
