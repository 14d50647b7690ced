"""fusedpar.hf route A for gpt-oss (model_type "gpt_oss") against transformers'
GptOssForCausalLM at world 1, beyond the families' shared tests in test_hf.py (logits, loss with
HF's aux loss, every gradient, the strict state-dict round trip; a safetensors directory read and
written back, 3 AdamW steps with the aux loss): the config fields of a stock gpt-oss, and the
fields fusedpar does not implement (route A and route B's parallelize)."""
from __future__ import annotations

import pytest
import torch

from _utils import DEVICE
from _hf import hf_model, tokens_targets
from fusedpar.hf import config_from_hf, from_hf, parallelize

T = pytest.importorskip("transformers")


def test_gpt_oss_config_fields():
    """A stock gpt-oss config (gpt-oss-20b's sizes): every field mapped; a config.json without
    layer_types gets HF's default (even layers slide); attention_bias=False drops both biases."""
    c = config_from_hf(T.GptOssConfig(num_hidden_layers=4))
    assert (c.num_experts, c.top_k, c.moe_ffn_hidden_size, c.head_dim, c.num_kv_heads) == (128, 4, 2880, 64, 8)
    assert (c.activation, c.score_func, c.router_bias, c.expert_bias, c.norm_topk_prob) == \
        ("swiglu_oai", "softmax_topk", True, True, False)
    assert (c.attention_sinks, c.qkv_bias, c.attention_out_bias, c.sliding_window) == (True, True, True, 128)
    assert [c.attention_config(i).window for i in range(4)] == [(127, 0), None, (127, 0), None]
    assert c.rope_theta == 150000.0 and c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 32.0
    assert c.rope_scaling["truncate"] is False
    assert (c.aux_loss_style, c.aux_loss_coef, c.z_loss_coef, c.norm_eps) == ("hf", 1e-3, 0.0, 1e-5)
    raw = hf_model("gpt_oss").config.to_dict()
    raw.pop("layer_types")
    raw.update(num_hidden_layers=3, attention_bias=False)
    c = config_from_hf(raw)
    assert c.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (c.qkv_bias, c.attention_out_bias) == (False, False)
    assert config_from_hf(dict(raw, sliding_window=None)).layer_types is None


@pytest.mark.parametrize("field,value,match", [
    ("swiglu_limit", 5.0, "swiglu_limit=5.0 is not supported"),
    ("swiglu_alpha", 1.5, "swiglu_alpha=1.5 is not supported"),
    ("attention_dropout", 0.1, "attention_dropout=0.1 is not supported"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_type='dynamic'"),
    ("quantization_config", {"quant_method": "mxfp4"}, r"quantization_config.quant_method='mxfp4' .*dequantize"),
])
def test_gpt_oss_fields_not_implemented_raise(field, value, match):
    raw = hf_model("gpt_oss").config.to_dict()
    raw[field] = value
    with pytest.raises(ValueError, match=match):
        config_from_hf(raw)


@pytest.mark.parametrize("field,value", [("swiglu_limit", 5.0), ("swiglu_alpha", 1.5)])
def test_parallelize_refuses_a_clamped_swiglu_other_than_the_kernels(field, value):
    """Route B wraps gpt-oss (tests/test_hf_world.py), its experts running fusedpar's clamped
    SwiGLU, whose constants are fixed: other values raise naming the field, before any change."""
    hf = hf_model("gpt_oss", **{field: value})
    with pytest.raises(ValueError, match=f"parallelize: gpt_oss field {field} must be .*, got {value}"):
        parallelize(hf)
    assert type(hf.model.layers[0].mlp).__name__ == "GptOssMLP"


def test_gpt_oss_bf16_checkpoint_keeps_the_sinks_fp32(tmp_path):
    """gpt-oss checkpoints store the sinks in bf16 like the other weights: from_hf keeps the
    checkpoint's dtype but for the sinks, which the attention takes in fp32. Reference: the fp32
    HF model holding the bf16 checkpoint's values (an HF model cast to bf16 also rounds its RoPE
    frequencies). Tolerance 5e-2 of scale: bf16 activations on a residual stream of size ~40, whose
    bf16 spacing is 0.25 (transformers' own bf16 model is 1.4e-2 off); a wrong or missing weight is
    off by the scale itself."""
    hf = hf_model("gpt_oss").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = from_hf(str(tmp_path), device=DEVICE)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n for n, d in dtypes.items() if d != torch.bfloat16} == {"layers.0.attn.sinks", "layers.1.attn.sinks"}
    assert all(dtypes[f"layers.{i}.attn.sinks"] == torch.float32 for i in range(2))
    reference = hf_model("gpt_oss", seed=7)
    reference.load_state_dict(hf.state_dict())
    tokens, _ = tokens_targets(3, 1, 8)
    ref = reference(tokens).logits.detach()
    err = (model(tokens).float() - ref).abs().max().item()
    assert err <= 5e-2 * ref.abs().max().item(), f"bf16 logits off by {err:.3g}"
