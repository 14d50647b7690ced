"""fusedpar.hf route A for gpt-oss (model_type "gpt_oss") against transformers'
GptOssForCausalLM at world 1, beyond the families' shared test in test_hf.py (logits, loss with
HF's aux loss, every gradient, the strict state-dict round trip): a safetensors directory read
and written back, 3 AdamW steps with the aux loss, the config fields of a stock gpt-oss, and the
fields fusedpar does not implement."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _hf import TOL, VOCAB, hf_model, tokens_targets
from fusedpar.hf import config_from_hf, from_hf, parallelize, to_hf_state_dict

T = pytest.importorskip("transformers")


def _assert_close(actual, expected, msg):
    scale = expected.abs().max().item() + 1e-12
    err = (actual - expected).abs().max().item()
    assert err <= TOL * scale, f"{msg}: off by {err:.3g} (scale {scale:.3g})"


def test_gpt_oss_directory_round_trip_and_training_steps_match_transformers(tmp_path):
    """save_pretrained's directory (stacked expert tensors, gate / up interleaved) -> from_hf ->
    HF's logits; to_hf_state_dict gives every tensor back bit-equal (strict load); 3 AdamW steps
    on the loss with HF's aux loss (the head fused into the loss) move every weight as HF's do."""
    hf = hf_model("gpt_oss")
    hf.save_pretrained(tmp_path)
    model = from_hf(str(tmp_path))
    tokens, _ = tokens_targets(2, 2, 8)
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), "logits from a directory")
    exported = to_hf_state_dict(model)
    assert set(exported) == set(hf.state_dict())
    fresh = hf_model("gpt_oss", seed=7)
    fresh.load_state_dict(exported, strict=True)
    for (n, a), b in zip(hf.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = tokens_targets(10 + step, 2, 8)
        opt_hf.zero_grad()
        out = hf(tokens)
        (F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
         + hf.config.router_aux_loss_coef * out.aux_loss).backward()
        opt_hf.step()
        opt.zero_grad()
        loss = model.loss(model(tokens, return_hidden=True), targets)
        (loss + model.aux_loss()).backward()
        opt.step()
    trained = to_hf_state_dict(model)
    for name, p in hf.state_dict().items():  # lr 1e-2: every weight moved by ~3e-2
        _assert_close(trained[name], p, f"{name} after 3 AdamW steps")


def test_gpt_oss_config_fields():
    """A stock gpt-oss config (gpt-oss-20b's sizes): every field mapped; a config.json without
    layer_types gets HF's default (even layers slide); attention_bias=False drops both biases."""
    c = config_from_hf(T.GptOssConfig(num_hidden_layers=4))
    assert (c.num_experts, c.top_k, c.moe_ffn_hidden_size, c.head_dim, c.num_kv_heads) == (128, 4, 2880, 64, 8)
    assert (c.activation, c.score_func, c.router_bias, c.expert_bias, c.norm_topk_prob) == \
        ("swiglu_oai", "softmax_topk", True, True, False)
    assert (c.attention_sinks, c.qkv_bias, c.attention_out_bias, c.sliding_window) == (True, True, True, 128)
    assert [c.attention_options(i)["window"] for i in range(4)] == [(127, 0), None, (127, 0), None]
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


def test_gpt_oss_is_route_a_only():
    with pytest.raises(ValueError, match="parallelize: model_type must be one of .* got 'gpt_oss'"):
        parallelize(hf_model("gpt_oss"))


def test_gpt_oss_bf16_checkpoint_keeps_the_sinks_fp32(tmp_path):
    """gpt-oss checkpoints store the sinks in bf16 like the other weights: from_hf keeps the
    checkpoint's dtype but for the sinks, which the attention takes in fp32. Reference: the fp32
    HF model holding the bf16 checkpoint's values (an HF model cast to bf16 also rounds its RoPE
    frequencies). Tolerance 5e-2 of scale: bf16 activations on a residual stream of size ~40, whose
    bf16 spacing is 0.25 (transformers' own bf16 model is 1.4e-2 off); a wrong or missing weight is
    off by the scale itself."""
    hf = hf_model("gpt_oss").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = from_hf(str(tmp_path))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n for n, d in dtypes.items() if d != torch.bfloat16} == {"layers.0.attn.sinks", "layers.1.attn.sinks"}
    assert all(dtypes[f"layers.{i}.attn.sinks"] == torch.float32 for i in range(2))
    reference = hf_model("gpt_oss", seed=7)
    reference.load_state_dict(hf.state_dict())
    tokens, _ = tokens_targets(3, 1, 8)
    ref = reference(tokens).logits.detach()
    err = (model(tokens).float() - ref).abs().max().item()
    assert err <= 5e-2 * ref.abs().max().item(), f"bf16 logits off by {err:.3g}"
