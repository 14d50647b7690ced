"""fusedpar.hf route A for DeepSeek-V3 (model_type "deepseek_v3", also Kimi K2) against
transformers' DeepseekV3ForCausalLM at world 1: MLA attention with YaRN, a dense first block
(first_k_dense_replace) and a MoE block with the sigmoid, group-limited, biased router; logits,
loss, every gradient, the state-dict round trip, a checkpoint directory, and the fields not
implemented yet."""
from __future__ import annotations

import pytest
import torch

from _utils import DEVICE
from _hf import TOL, compare_grads, hf_model, hf_reference, tokens_targets
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
