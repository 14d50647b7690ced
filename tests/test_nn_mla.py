"""MLA (fusedpar.nn.MLAttention) and YaRN RoPE at world 1 against transformers: the rotary
embedding's frequencies and attention factor, DeepSeek-V3's softmax scale, and the attention
module's output and every gradient (fp32 in, float64-checked tolerance of the output's scale)."""
from __future__ import annotations

import math

import pytest
import torch

from _utils import DEVICE, assert_close
from fusedpar.hf import load_full_state_dict
from fusedpar.nn import MLAttention
from fusedpar.nn.rotary import rope_attention_factor, rope_inv_freq, rotary_cos_sin
from fusedpar.nn.mla import mla_softmax_scale
from fusedpar.nn import MLAConfig

T = pytest.importorskip("transformers")

# fp32 on both sides, the same math in another order (flash attention's online softmax, fused
# norms, fp64 rotary tables here vs fp32 there): ~1e-7 of the scale; 1e-4 is the brief's bound
TOL = 1e-4

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def _ds_config(rope, **kw):
    fields = dict(vocab_size=32, hidden_size=24, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=10,
                  qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=640,
                  rope_parameters=rope, rope_interleave=True, attention_bias=False)
    fields.update(kw)
    config = T.DeepseekV3Config(**fields)
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("rope", [
    dict(YARN),  # DeepSeek-V3: mscale == mscale_all_dim, attention factor 1
    dict(YARN, mscale=1.0, mscale_all_dim=0.5, truncate=False),
    {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
     "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
])
def test_yarn_rotary_matches_transformers(rope):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    config = _ds_config(dict(rope), qk_rope_head_dim=16)
    hf = DeepseekV3RotaryEmbedding(config)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    inv = rope_inv_freq(16, rope["rope_theta"], scaling)
    assert_close(inv.float(), hf.inv_freq, torch.float32, rtol=1e-6, atol=0, msg="inv_freq")
    assert rope_attention_factor(scaling) == pytest.approx(hf.attention_scaling, rel=1e-12)
    pos = torch.tensor([0, 1, 5, 17, 300, 639])
    cos, sin = rotary_cos_sin(pos, 16, rope["rope_theta"], scaling=scaling)
    hcos, hsin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    # fp32 position * frequency there: the angle (up to 639 rad) rounded to half an ulp, <= 639 * 2^-24,
    # plus the fp32 frequency's own rounding; fp64 here. A wrong frequency is off by O(1).
    atol = 2 * 639 * 2.0 ** -24
    assert_close(cos, hcos[0], torch.float32, rtol=0, atol=atol)
    assert_close(sin, hsin[0], torch.float32, rtol=0, atol=atol)


def test_softmax_scale_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for rope in (dict(YARN), dict(YARN, mscale_all_dim=0), {"rope_type": "default", "rope_theta": 10000.0}):
        attn = DeepseekV3Attention(_ds_config(rope), 0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        assert mla_softmax_scale(10, scaling) == pytest.approx(attn.scaling, rel=1e-12)
    assert mla_softmax_scale(10, dict(YARN)) > 10 ** -0.5  # the mscale correction is there


def _mla_from_hf(attn, config, rope):
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    mod = MLAttention(MLAConfig(config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, bias=config.attention_bias, rope_theta=rope["rope_theta"], rope_scaling=scaling, rope_interleave=config.rope_interleave), device="meta")
    load_full_state_dict(mod, {k: v.detach() for k, v in attn.named_parameters()}, device=DEVICE)
    return mod


@pytest.mark.parametrize("case", ["yarn-interleave-lora", "default-plain-q-bias"])
def test_mla_matches_transformers(case):
    """Output and every gradient of MLAttention equal DeepseekV3Attention's (random weights and
    norm scales, a ragged length, causal)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    if case == "yarn-interleave-lora":
        rope, kw = dict(YARN, mscale_all_dim=1.0), {}
    else:
        rope, kw = {"rope_type": "default", "rope_theta": 500.0}, dict(q_lora_rank=None, rope_interleave=False,
                                                                      attention_bias=True)
    config = _ds_config(rope, **kw)
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, 0).float()
    with torch.no_grad():  # drawn on the CPU, then both modules on the tests' device
        for name, p in attn.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(p) * 0.3)
    attn.to(DEVICE)
    mod = _mla_from_hf(attn, config, rope)
    assert all(p.device.type == DEVICE.type for p in mod.parameters())
    b, s = 2, 11
    x = torch.randn(b, s, config.hidden_size).to(DEVICE)
    dy = torch.randn(b, s, config.hidden_size).to(DEVICE)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None].to(DEVICE)
    pos = torch.arange(s, device=DEVICE)[None].expand(b, s)
    xr = x.clone().requires_grad_()
    yr, _ = attn(xr, DeepseekV3RotaryEmbedding(config).to(DEVICE)(xr, pos), mask)
    yr.backward(dy)
    xl = x.clone().requires_grad_()
    y = mod(xl)
    y.backward(dy)
    assert_close(y, yr.detach(), torch.float32, rtol=TOL, atol=TOL * yr.pow(2).mean().sqrt().item(), msg="out")
    assert_close(xl.grad, xr.grad, torch.float32, rtol=TOL, atol=TOL * xr.grad.pow(2).mean().sqrt().item(), msg="dx")
    hf_grads = dict(attn.named_parameters())
    names = [n for n, _ in mod.named_parameters()]
    assert set(names) == {n for n, p in hf_grads.items()}, (names, list(hf_grads))
    for name, p in mod.named_parameters():
        g = hf_grads[name].grad
        assert_close(p.grad, g, torch.float32, rtol=TOL, atol=TOL * g.pow(2).mean().sqrt().item(), msg=f"grad {name}")


def test_mla_rejects_bad_arguments():
    kw = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAttention(MLAConfig(16, 2, **dict(kw, qk_rope_head_dim=3)))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAttention(MLAConfig(16, 2, **dict(kw, kv_lora_rank=0)))
    with pytest.raises(ValueError, match="must have 'original_max_position_embeddings'"):
        MLAttention(MLAConfig(16, 2, **kw, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_local, 16\]"):
        MLAttention(MLAConfig(16, 2, **kw))(torch.randn(1, 4, 15))
    assert math.isclose(MLAttention(MLAConfig(16, 2, **kw)).softmax_scale, 8 ** -0.5)


def test_mla_packed_documents_equal_each_document_alone():
    """cu_seqlens: attention stays inside each document and the rotary positions restart at 0."""
    torch.manual_seed(1)
    mod = MLAttention(MLAConfig(16, 2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}), device=DEVICE)
    docs = [0, 3, 3, 8, 11]  # lengths 3, 0, 5, 3
    x = torch.randn(1, 11, 16).to(DEVICE)
    y = mod(x, cu_seqlens=torch.tensor(docs, dtype=torch.int32, device=DEVICE))
    ref = torch.cat([mod(x[:, a:e]) for a, e in zip(docs, docs[1:]) if e > a], dim=1)
    assert_close(y, ref.detach(), torch.float32, rtol=1e-5, msg="packed documents")


@pytest.mark.parametrize("fields,match", [
    (dict(attention="mla"), "kv_lora_rank must be set with attention='mla', got None"),
    (dict(kv_lora_rank=8), "kv_lora_rank is for attention='mla', got 8 with attention='default'"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, head_dim=8),
     "head_dim must be None with attention='mla'"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, qk_norm=True),
     "qk_norm must be False with attention='mla'"),
    (dict(attention="latent"), "attention must be one of"),
])
def test_config_rejects_bad_mla_fields(fields, match):
    from fusedpar.nn import TransformerConfig

    with pytest.raises(ValueError, match=match):
        TransformerConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8, **fields)
