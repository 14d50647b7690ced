"""Hugging Face configs -> :class:`~fusedpar.nn.TransformerConfig`: :func:`config_from_hf` and
the fields of each family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE,
GLM-4.5 MoE, OLMo 2, Gemma, Gemma 2, Gemma 3 text, DeepSeek-V3 / Kimi K2, gpt-oss). Any field value
fusedpar does not implement raises ``ValueError`` naming it. Re-exported by :mod:`fusedpar.hf`."""
from __future__ import annotations

from fusedpar.hf_parallel import SUPPORTED_MODEL_TYPES, config_field, config_number
from fusedpar.kernels.runtime import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from fusedpar.nn import TransformerConfig

__all__ = ["ROUTE_A_TYPES", "config_from_hf"]

_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
# model types whose config.json holds another family's fields for its layout: Kimi K2 (moonshotai/Kimi-K2-*)
# is DeepSeek-V3's DeepseekV3ForCausalLM (remote code) under its own model_type, read as transformers reads
# Kimi-K2.5's "kimi_k2" text config: as "deepseek_v3"
_ALIASES = {"kimi_k2": "deepseek_v3"}
# the model types route A reads: the families route B wraps, and their aliases
ROUTE_A_TYPES = SUPPORTED_MODEL_TYPES + tuple(_ALIASES)
_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate")
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
#: HF's MLP activation -> fusedpar's gated activation (gate_proj through it, times up_proj)
_GATED = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------
def _unsupported(model_type, name, value, why):
    raise ValueError(f"config_from_hf: {model_type} field {name}={value!r} is not supported ({why})")


def _rope(cfg, model_type, params=None):
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` from ``rope_parameters`` (transformers
    5) or ``rope_theta`` + ``rope_scaling`` (earlier versions); ``params``: one layer type's
    ``rope_parameters``."""
    params = dict(params or config_field(cfg, "rope_parameters") or {})
    if not params:
        params = dict(config_field(cfg, "rope_scaling") or {})
        params.setdefault("rope_theta", config_field(cfg, "rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", config_field(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "yarn"):
        _unsupported(model_type, "rope_type", rope_type, "fusedpar implements 'default', 'llama3' and 'yarn'")
    partial = float(params.get("partial_rotary_factor", config_field(cfg, "partial_rotary_factor", None) or 1.0))
    if partial != 1.0 and model_type != "glm4_moe":
        _unsupported(model_type, "partial_rotary_factor", partial, "full rotary except in glm4_moe")
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "yarn":
        if params.get("factor") is None and params.get("original_max_position_embeddings"):
            # transformers' rule: the context extension of max_position_embeddings over the original
            params["factor"] = config_number(cfg, "max_position_embeddings", "config_from_hf") / float(
                params["original_max_position_embeddings"])
        return theta, {"rope_type": "yarn", **{k: params[k] for k in _YARN_FIELDS if params.get(k) is not None}}, partial
    return theta, {k: params[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                         "original_max_position_embeddings") if k in params}, partial


def _activation(cfg, model_type) -> str:
    """fusedpar's gated activation of HF's ``hidden_act`` (Gemma 2/3: ``hidden_activation``);
    gpt-oss: the experts' clamped SwiGLU ``swiglu_oai`` (its ``hidden_act`` is unused by HF), whose
    ``swiglu_alpha`` and ``swiglu_limit`` must be fusedpar's constants."""
    if model_type == "gpt_oss":
        for field, value in (("swiglu_alpha", SWIGLU_OAI_ALPHA), ("swiglu_limit", SWIGLU_OAI_LIMIT)):
            got = config_field(cfg, field, value)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or float(got) != value:
                _unsupported(model_type, field, got, f"the clamped SwiGLU with {field} {value}")
        return "swiglu_oai"
    field = "hidden_activation" if model_type in ("gemma2", "gemma3_text") else "hidden_act"
    act = config_field(cfg, field, "silu")
    if model_type == "gemma" and act == "gelu":  # Gemma 1's legacy value, meant as the tanh GELU (as HF reads it)
        act = "gelu_pytorch_tanh"
    if act not in _GATED:
        _unsupported(model_type, field, act, f"gated MLPs with one of {sorted(_GATED)}")
    return _GATED[act]


def _check_unsupported(cfg, model_type):
    if float(config_field(cfg, "attention_dropout", 0.0) or 0.0):
        _unsupported(model_type, "attention_dropout", config_field(cfg, "attention_dropout"), "no attention dropout")
    if model_type not in ("qwen2", "qwen2_moe", "glm4_moe", "gpt_oss") and config_field(cfg, "attention_bias", False):
        _unsupported(model_type, "attention_bias", True, "no bias on the output projection")
    if config_field(cfg, "use_bidirectional_attention", False):
        _unsupported(model_type, "use_bidirectional_attention", True, "causal attention only")
    if config_field(cfg, "mlp_bias", False):
        _unsupported(model_type, "mlp_bias", True, "bias-free MLPs only")
    if float(config_field(cfg, "router_jitter_noise", 0.0) or 0.0):
        _unsupported(model_type, "router_jitter_noise", config_field(cfg, "router_jitter_noise"), "no router jitter")
    if int(config_field(cfg, "pretraining_tp", 1) or 1) != 1:
        _unsupported(model_type, "pretraining_tp", config_field(cfg, "pretraining_tp"), "must be 1")
    quant = config_field(cfg, "quantization_config")
    if quant:  # e.g. gpt-oss's released MXFP4 experts, DeepSeek-V3's fp8 blocks
        _unsupported(model_type, "quantization_config.quant_method", config_field(quant, "quant_method", quant),
                     "unquantized weights only: load the model dequantized (gpt-oss: transformers' "
                     "Mxfp4Config(dequantize=True)) and pass it or its save_pretrained directory")


def _layer_types(cfg, model_type):
    """HF's ``layer_types``, or the default transformers fills in when a config (e.g. an older
    ``config.json`` read as a dict) has none: Gemma 2 and gpt-oss alternate, sliding first; Gemma 3
    makes every ``sliding_window_pattern``-th layer (default 6) global. None for the other families
    (a window there covers every layer)."""
    types = config_field(cfg, "layer_types")
    if types is not None or model_type not in ("gemma2", "gemma3_text", "gpt_oss"):
        return None if types is None else list(types)
    layers = config_number(cfg, "num_hidden_layers", "config_from_hf")
    every = config_number(cfg, "sliding_window_pattern", "config_from_hf", default=6) \
        if model_type == "gemma3_text" else 2
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]


def _sliding_window(cfg, model_type):
    """HF's active sliding window (None when off): the layers that ``layer_types`` marks
    ``"sliding_attention"`` (all of them without ``layer_types``) attend through it."""
    window = config_field(cfg, "sliding_window")
    uses_window = config_field(cfg, "use_sliding_window", model_type in ("mistral", "mixtral"))
    if model_type in ("gemma2", "gemma3_text"):  # windows on the sliding layers only (layer_types)
        uses_window = "sliding_attention" in _layer_types(cfg, model_type)
    return int(window) if window and uses_window else None


def _glm4_moe_fields(cfg):
    """GLM-4.5: sigmoid group-limited routing with the correction bias, first_k_dense_replace dense
    blocks, ungated shared experts; no auxiliary loss (transformers computes none)."""
    num = lambda name, **kw: config_number(cfg, name, "config_from_hf", **kw)  # noqa: E731
    ffn = num("moe_intermediate_size")
    return dict(num_experts=num("n_routed_experts"), top_k=num("num_experts_per_tok"), moe_ffn_hidden_size=ffn,
                norm_topk_prob=bool(config_field(cfg, "norm_topk_prob", True)), score_func="sigmoid",
                n_group=num("n_group", default=1), topk_group=num("topk_group", default=None),
                routed_scaling_factor=num("routed_scaling_factor", kind=float, default=1.0),
                score_correction_bias=True, first_k_dense_replace=num("first_k_dense_replace", default=0),
                shared_expert_ffn_hidden_size=ffn * num("n_shared_experts", default=0), shared_expert_gate=False,
                aux_loss_coef=0.0, z_loss_coef=0.0)


def _family_fields(cfg, model_type, num) -> dict:
    """The TransformerConfig fields of OLMo 2 and the Gemma families (block layout, norms,
    embedding scale, attention scale, logit softcap, per-layer RoPE bases)."""
    if model_type == "olmo2":
        return dict(norm_layout="post", qk_norm=True, qk_norm_scope="projection")
    if model_type not in _GEMMA_TYPES:
        return {}
    fields = dict(norm_offset=1.0, embed_scale=float(num("hidden_size")) ** 0.5)
    if model_type == "gemma":
        return fields
    fields.update(norm_layout="sandwich", softmax_scale=num("query_pre_attn_scalar", kind=float) ** -0.5,
                  final_logit_softcap=num("final_logit_softcapping", kind=float, default=None),
                  attn_logit_softcapping=num("attn_logit_softcapping", kind=float, default=None))
    if model_type == "gemma3_text":
        fields["qk_norm"] = True
        params = config_field(cfg, "rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: RoPE parameters per layer type
            thetas = {}
            for kind in ("full_attention", "sliding_attention"):
                thetas[kind], scaling, _ = _rope(cfg, model_type, params.get(kind))
                if scaling is not None:
                    _unsupported(model_type, f"rope_parameters[{kind!r}]", params.get(kind),
                                 "one RoPE scaling for all layers: 'default' on the Gemma 3 layer types")
        else:  # older configs: rope_theta (global) and rope_local_base_freq; rope_scaling on global layers only
            if config_field(cfg, "rope_scaling"):
                _unsupported(model_type, "rope_scaling", config_field(cfg, "rope_scaling"),
                             "one RoPE scaling for all layers: none on Gemma 3, whose local layers have none")
            thetas = {"full_attention": float(config_field(cfg, "rope_theta", 1e6)),
                      "sliding_attention": float(config_field(cfg, "rope_local_base_freq", 1e4))}
        types = _layer_types(cfg, model_type)
        fields["layer_rope_theta"] = tuple(thetas.get(t, thetas["full_attention"]) for t in types)
        fields["rope_theta"] = thetas["full_attention"]
    return fields


def _pad_token(cfg, vocab: int):
    """HF's ``padding_idx`` (``pad_token_id``; a negative one counts from the end, as torch's)."""
    pad = config_field(cfg, "pad_token_id", None)
    if pad is None or isinstance(pad, bool) or not isinstance(pad, int):
        return None
    return pad + vocab if pad < 0 else pad


def _moe_fields(cfg, model_type):
    if model_type == "glm4_moe":
        return _glm4_moe_fields(cfg)
    coef = config_number(cfg, "router_aux_loss_coef", "config_from_hf", kind=float, default=1e-3)
    common = dict(top_k=config_number(cfg, "num_experts_per_tok", "config_from_hf"), aux_loss_style="hf", aux_loss_coef=coef,
                  z_loss_coef=0.0)
    if model_type == "mixtral":
        return dict(common, num_experts=config_number(cfg, "num_local_experts", "config_from_hf"),
                    norm_topk_prob=True)
    fields = dict(common, num_experts=config_number(cfg, "num_experts", "config_from_hf"),
                  moe_ffn_hidden_size=config_number(cfg, "moe_intermediate_size", "config_from_hf"),
                  norm_topk_prob=bool(config_field(cfg, "norm_topk_prob", False)),
                  moe_every=int(config_field(cfg, "decoder_sparse_step", 1) or 1),
                  dense_layers=tuple(config_field(cfg, "mlp_only_layers", None) or ()))
    if model_type == "qwen2_moe":
        fields["shared_expert_ffn_hidden_size"] = int(config_field(cfg, "shared_expert_intermediate_size") or 0)
    return fields


def _deepseek_fields(cfg):
    """DeepSeek-V3 / Kimi K2: MLA attention, then ``first_k_dense_replace`` dense blocks and MoE
    blocks with the sigmoid, group-limited router and its ``e_score_correction_bias`` (no aux
    loss: transformers trains none)."""
    num = lambda name, **kw: config_number(cfg, name, "config_from_hf", **kw)  # noqa: E731
    shared = num("n_shared_experts", default=0) or 0
    heads = num("num_attention_heads")
    experts = num("n_routed_experts")
    dense = num("first_k_dense_replace", default=0) or 0
    return dict(
        attention="mla", q_lora_rank=config_field(cfg, "q_lora_rank"), kv_lora_rank=num("kv_lora_rank"),
        qk_nope_head_dim=num("qk_nope_head_dim"), qk_rope_head_dim=num("qk_rope_head_dim"),
        v_head_dim=num("v_head_dim"), rope_interleave=bool(config_field(cfg, "rope_interleave", True)),
        head_dim=None, num_kv_heads=heads, qkv_bias=False, qk_norm=False,
        num_experts=experts, top_k=num("num_experts_per_tok"), moe_ffn_hidden_size=num("moe_intermediate_size"),
        first_k_dense_replace=dense, score_func="sigmoid", score_correction_bias=True,
        shared_expert_ffn_hidden_size=num("moe_intermediate_size") * shared, shared_expert_gate=False,
        n_group=num("n_group", default=1) or 1, topk_group=config_field(cfg, "topk_group"),
        norm_topk_prob=bool(config_field(cfg, "norm_topk_prob", True)),
        routed_scaling_factor=num("routed_scaling_factor", kind=float, default=1.0),
        aux_loss_coef=0.0, z_loss_coef=0.0)


def _gpt_oss_fields(cfg):
    """gpt-oss: attention sinks; ``attention_bias`` on q / k / v and on o_proj; the sliding layers
    of ``layer_types`` (HF's default without it: even layers slide, odd ones are full); every block
    a MoE whose router adds its bias and takes the softmax over the top-k logits, experts with
    biases; HF's load-balancing loss pooled over layers (as Mixtral's: ``router_aux_loss_coef``)."""
    num = lambda name, **kw: config_number(cfg, name, "config_from_hf", **kw)  # noqa: E731
    bias = bool(config_field(cfg, "attention_bias", True))
    fields = dict(attention_sinks=True, qkv_bias=bias, attention_out_bias=bias,
                  num_experts=num("num_local_experts"), top_k=num("num_experts_per_tok"),
                  moe_ffn_hidden_size=num("intermediate_size"), score_func="softmax_topk", router_bias=True,
                  expert_bias=True, norm_topk_prob=False, aux_loss_style="hf",
                  aux_loss_coef=num("router_aux_loss_coef", kind=float, default=1e-3), z_loss_coef=0.0,
                  sliding_window=None, layer_types=None)
    window = num("sliding_window", default=None)
    if window:
        fields.update(sliding_window=window, layer_types=_layer_types(cfg, "gpt_oss"))
    return fields


def config_from_hf(hf_config, **overrides) -> TransformerConfig:
    """The :class:`~fusedpar.nn.TransformerConfig` of a Hugging Face config (a ``PretrainedConfig``
    or its dict). ``overrides`` set layout fields (``sp_mode``, ``layout``, ``capacity_factor``...).
    Raises ``ValueError`` naming the field for a model type or field value fusedpar does not
    implement (e.g. another RoPE type, attention dropout). An active sliding window (stock Mistral:
    4096) is kept as ``sliding_window``, with HF's ``layer_types`` (which layers slide). Kimi K2's
    ``model_type`` ``"kimi_k2"`` reads as ``"deepseek_v3"`` (the same fields and layout)."""
    model_type = config_field(hf_config, "model_type")
    if model_type not in ROUTE_A_TYPES:
        raise ValueError(f"config_from_hf: model_type must be one of {ROUTE_A_TYPES}, got {model_type!r}")
    model_type = _ALIASES.get(model_type, model_type)
    _check_unsupported(hf_config, model_type)
    params = config_field(hf_config, "rope_parameters") or {}
    theta, scaling, partial = _rope(hf_config, model_type,
                                    params.get("full_attention") if "full_attention" in params else None)
    num = lambda name, **kw: config_number(hf_config, name, "config_from_hf", **kw)  # noqa: E731
    heads = num("num_attention_heads")
    fields = dict(
        vocab_size=num("vocab_size"), hidden_size=num("hidden_size"), num_layers=num("num_hidden_layers"),
        num_heads=heads, ffn_hidden_size=num("intermediate_size"),
        num_kv_heads=num("num_key_value_heads", default=None) or heads, activation=_activation(hf_config, model_type),
        norm_eps=num("rms_norm_eps", kind=float), causal=True, rope_theta=theta, rope_scaling=scaling,
        head_dim=config_field(hf_config, "head_dim", None), qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        partial_rotary_factor=partial,
        tie_word_embeddings=bool(config_field(hf_config, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(hf_config, model_type), pad_token_id=_pad_token(hf_config, num("vocab_size")))
    types = _layer_types(hf_config, model_type)
    if fields["sliding_window"] is not None and types is not None:
        fields["layer_types"] = types
    if model_type == "glm4_moe":
        fields.update(qkv_bias=bool(config_field(hf_config, "attention_bias", False)),
                      qk_norm=bool(config_field(hf_config, "use_qk_norm", False)))
    fields.update(_family_fields(hf_config, model_type, num))
    if model_type in _MOE_TYPES:
        fields.update(_moe_fields(hf_config, model_type))
    if model_type == "deepseek_v3":
        fields.update(_deepseek_fields(hf_config))
    if model_type == "gpt_oss":
        fields.update(_gpt_oss_fields(hf_config))
    fields.update(overrides)
    return TransformerConfig(**fields)
