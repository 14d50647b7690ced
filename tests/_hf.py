"""Tiny Hugging Face models (random weights, no download) and their fp32 references for the
tests of :mod:`fusedpar.hf`."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from _utils import DEVICE
from fusedpar.nn import parameter_placements
from fusedpar.hf import from_hf

# fp32 on both sides, the same math in another order (fused norms, flash attention with an online
# softmax, chunked and grouped GEMMs, ring/all-to-all reductions): the differences seen are ~1e-7
# of the tensors' scale; 1e-4 (the brief's bound) still fails a wrong shard, a missing reduction
# or a double count by orders of magnitude.
TOL = 1e-4

FAMILIES = ("llama", "llama31", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmo2",
            "gemma", "gemma2", "gemma3", "gpt_oss")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "gpt_oss")
# DeepSeek-V3 (its tests are tests/test_hf_deepseek.py and its cases in test_hf_world.py, route B's too):
# MLA (q latent, YaRN with mscale_all_dim, interleaved rope, v head dim 6 != 4 + 4), a dense block
# then a MoE block (sigmoid router over 2 groups, 1 searched, score bias), an ungated shared expert
DEEPSEEK_V3 = dict(
    vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
    qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
    topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=64, rope_interleave=True, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
VOCAB, HIDDEN, LAYERS = 32, 16, 2


def hf_model(family: str, seed: int = 0, *, device=DEVICE, **extra):
    """A 2-layer fp32 model of ``family`` with random weights (norm scales and biases randomised
    too, so a missing or misplaced one shows), eager attention, router logits returned; drawn on
    the CPU (the same weights on any device), then moved to ``device`` (the tests' device: the
    reference runs where fusedpar's model does)."""
    import transformers as T

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=24, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6)
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 4}
    configs = {
        "llama": lambda: T.LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "llama31": lambda: T.LlamaConfig(**kw, rope_parameters=llama3, tie_word_embeddings=True),
        # an active window shorter than the tests' sequences (HF's W: query i sees keys i - W < j <= i)
        "mistral": lambda: T.MistralConfig(**kw, sliding_window=5),
        "qwen2": lambda: T.Qwen2Config(**kw, tie_word_embeddings=True),
        "qwen3": lambda: T.Qwen3Config(**kw),
        "mixtral": lambda: T.MixtralConfig(**kw, **moe, num_local_experts=4),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**kw, **moe, num_experts=4, moe_intermediate_size=8,
                                              shared_expert_intermediate_size=12, norm_topk_prob=False),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**kw, **moe, num_experts=4, moe_intermediate_size=8,
                                              norm_topk_prob=True),
        # GLM-4.5: partial rotary (4 of 8 features), q/k/v biases, qk-norm, layer 0 dense, 2 of 3
        # groups searched, an ungated shared expert, sigmoid scores with the correction bias
        "glm4_moe": lambda: T.Glm4MoeConfig(**dict(kw, head_dim=8), num_experts_per_tok=2, n_routed_experts=6,
                                            moe_intermediate_size=8, n_shared_experts=1, n_group=3, topk_group=2,
                                            routed_scaling_factor=1.5, first_k_dense_replace=1, norm_topk_prob=True,
                                            attention_bias=True, use_qk_norm=True),
        "deepseek_v3": lambda: T.DeepseekV3Config(**{k: dict(v) if isinstance(v, dict) else v
                                                     for k, v in DEEPSEEK_V3.items()}),
        # post-norm blocks, q / k norms over the whole projection; pad_token_id=1: no embedding gradient there
        "olmo2": lambda: T.Olmo2Config(**kw, pad_token_id=1),
        # (1 + w) norms, sqrt(hidden) embedding scale, tanh GeGLU, tied head, pad_token_id=0
        "gemma": lambda: T.GemmaConfig(**kw, hidden_act="gelu_pytorch_tanh"),
        # + sandwich norms, query_pre_attn_scalar, final and attention logit softcaps, a sliding and a full layer
        "gemma2": lambda: T.Gemma2Config(**kw, query_pre_attn_scalar=6, sliding_window=5, final_logit_softcapping=3.0,
                                         attn_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"]),
        # + per-head (1 + w) q / k norms, a RoPE base per layer type (sliding layers: local base)
        "gemma3": lambda: T.Gemma3TextConfig(**kw, query_pre_attn_scalar=6, sliding_window=5,
                                             layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 100.0},
                                                              "full_attention": {"rope_type": "default",
                                                                                 "rope_theta": 10000.0}}),
        # gpt-oss: sinks, q / k / v and o_proj biases, a sliding layer (window 5) then a full one, YaRN
        # (untruncated), every block a MoE: biased router, softmax over the top-k logits, experts
        # with biases and the clamped SwiGLU (HF's gate / up columns interleaved)
        "gpt_oss": lambda: T.GptOssConfig(**dict(kw, head_dim=8), **moe, num_local_experts=4, sliding_window=5,
                                          layer_types=["sliding_attention", "full_attention"],
                                          max_position_embeddings=16, rope_parameters=GPT_OSS_YARN),
    }
    config = configs[family]()
    for k, v in extra.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = {"llama": T.LlamaForCausalLM, "llama31": T.LlamaForCausalLM, "mistral": T.MistralForCausalLM,
           "qwen2": T.Qwen2ForCausalLM, "qwen3": T.Qwen3ForCausalLM, "mixtral": T.MixtralForCausalLM,
           "qwen2_moe": T.Qwen2MoeForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM,
           "glm4_moe": T.Glm4MoeForCausalLM, "deepseek_v3": T.DeepseekV3ForCausalLM, "olmo2": T.Olmo2ForCausalLM,
           "gemma": T.GemmaForCausalLM, "gemma2": T.Gemma2ForCausalLM, "gemma3": T.Gemma3ForCausalLM,
           "gpt_oss": T.GptOssForCausalLM}[family]
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # gpt-oss's sink logits: of the scores' size
                p.normal_(0, 1.0)
            elif name.endswith("experts.gate_up_proj") and family == "gpt_oss":  # pre-activations of std ~4:
                p.normal_(0, 1.0)  # the SwiGLU's clamps at +-7 are hit
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():  # GLM-4.5's / DeepSeek-V3's router correction bias steers the selection
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return model.to(device)


def tokens_targets(seed: int, batch: int, seq: int, device=DEVICE):
    """Token ids and targets drawn on the CPU, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    targets = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return tokens.to(device), targets.to(device)


def hf_reference(model, tokens, targets, *, aux: bool):
    """HF logits, loss (mean cross entropy against ``targets``, plus ``router_aux_loss_coef`` times
    HF's aux loss when ``aux``) and every parameter's gradient, as a fusedpar-named full dict."""
    model.zero_grad()
    out = model(tokens)
    loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
    if aux and getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return out.logits.detach(), loss.detach(), fusedpar_grads(model)


def hf_named_reference(model, tokens, targets=None, *, aux: bool):
    """HF logits, loss and gradients under HF's names. ``targets=None``: HF's own ``labels=tokens``
    loss (shifted inside, the last position not counted); else the mean cross entropy against
    ``targets`` of every position. ``aux``: plus ``router_aux_loss_coef`` times HF's aux loss."""
    model.zero_grad()
    if targets is None:
        out = model(tokens, labels=tokens)
        loss = out.loss if aux or getattr(out, "aux_loss", None) is None else \
            out.loss - model.config.router_aux_loss_coef * out.aux_loss
    else:
        out = model(tokens)
        loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
        if aux and getattr(out, "aux_loss", None) is not None:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    extra = {k: getattr(out, k) for k in ("aux_loss", "router_logits") if getattr(out, k, None) is not None}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), loss.detach(), grads, {k: _detach(v) for k, v in extra.items()}


def _detach(v):
    return tuple(t.detach() for t in v) if isinstance(v, tuple) else v.detach()


def fusedpar_grads(model) -> dict:
    """HF gradients under fusedpar's names and layout: a copy of the model holding the gradients
    as its weights, read by :func:`fusedpar.hf.from_hf` at world 1 (on the model's device)."""
    holder = copy.deepcopy(model)
    with torch.no_grad():
        grads = {n: p.grad for n, p in model.named_parameters()}
        for n, p in holder.named_parameters():
            p.copy_(grads[n] if grads[n] is not None else torch.zeros_like(p))
    import torch.distributed as dist

    group = dist.new_group([dist.get_rank()]) if dist.is_initialized() else None
    full = from_hf(holder, tp_group=group, sp_group=group, ep_group=group, device=next(model.parameters()).device)
    return {n: p.detach() for n, p in full.named_parameters()}


def compare_grads(model, ref_grads, msg, tol=TOL):
    """Every local gradient equals its shard of the HF gradient (``tol`` of the tensor's scale)."""
    placements = parameter_placements(model)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{msg}: {name} has no gradient"
        full = ref_grads[name]
        expect = placements[name].local_from_full(full).to(p.grad.device)
        scale = full.abs().max().item() + 1e-12
        err = (p.grad - expect).abs().max().item()
        assert err <= tol * scale, f"{msg}: grad of {name} off by {err:.3g} (scale {scale:.3g})"
    return len(placements)


def train_like_transformers(hf, model, steps: int = 3):
    """``steps`` AdamW steps (lr 1e-2) on the same batches: the HF model on the mean cross entropy
    of its logits plus ``router_aux_loss_coef`` times its aux loss where it returns one, ``model``
    on the fused loss (``model(ids, return_hidden=True)`` into ``model.loss``: the logits never
    exist) plus ``model.aux_loss()`` where it has one."""
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        tokens, targets = tokens_targets(10 + step, 2, 8, device=next(model.parameters()).device)
        opt_hf.zero_grad()
        out = hf(tokens)
        loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + hf.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt_hf.step()
        opt.zero_grad()
        loss, aux = model.loss(model(tokens, return_hidden=True), targets), model.aux_loss()
        (loss if aux is None else loss + aux).backward()
        opt.step()

