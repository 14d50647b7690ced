"""Hugging Face models in and out of :class:`fusedpar.nn.Transformer`.

* :func:`config_from_hf`: a ``transformers`` config (Llama 2/3/3.1, Mistral, Qwen2, Qwen3,
  Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5 MoE ``glm4_moe``, OLMo 2, Gemma, Gemma 2, Gemma 3 text; DeepSeek-V3 /
  Kimi K2 here only, not in route B) ->
  :class:`~fusedpar.nn.TransformerConfig`; any field value the model does not implement raises
  ``ValueError`` naming it.
* :func:`from_hf`: a ``transformers`` model, or a checkpoint directory (``config.json`` +
  ``*.safetensors``, read file by file), -> a :class:`~fusedpar.nn.Transformer` at any tp / sp / ep
  layout. The model is built on the meta device and every rank materialises only its shards.
* :func:`to_hf_state_dict`: the full tensors under Hugging Face's names (a collective over the
  model's groups), for ``hf_model.load_state_dict(..., strict=True)``.
* :func:`load_full_state_dict`: full tensors (fusedpar names) into a sharded model.
* Route B (keep the HF model): :func:`parallelize` and its helpers, from
  :mod:`fusedpar.hf_parallel` (re-exported here).

``transformers`` is not a dependency of fusedpar: only reading a checkpoint directory's config
imports it.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import torch
from torch import nn

from fusedpar.checkpoint import full_state, placements_of
from fusedpar.hf_parallel import (
    SUPPORTED_MODEL_TYPES,
    HFMoEBlock,
    causal_lm_loss,
    config_number,
    gather_sequence,
    gradient_sync_plan,
    parallelize,
    sequence_parallel_loss,
    shard_batch,
)
from fusedpar.nn import Transformer, TransformerConfig, checkpoint_buffers

__all__ = ["SUPPORTED_MODEL_TYPES", "HFMoEBlock", "causal_lm_loss", "config_from_hf", "from_hf", "gather_sequence", "gradient_sync_plan",
           "load_full_state_dict", "parallelize", "sequence_parallel_loss", "shard_batch", "to_hf_state_dict"]

_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
# the model types route A reads: route B's and DeepSeek-V3 (parallelize does not wrap MLA yet)
_ROUTE_A_TYPES = SUPPORTED_MODEL_TYPES + ("deepseek_v3",)
_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate")
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
#: HF's MLP activation -> fusedpar's gated activation (gate_proj through it, times up_proj)
_GATED = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------
def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def _unsupported(model_type, name, value, why):
    raise ValueError(f"config_from_hf: {model_type} field {name}={value!r} is not supported ({why})")


def _rope(cfg, model_type, params=None):
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` from ``rope_parameters`` (transformers
    5) or ``rope_theta`` + ``rope_scaling`` (earlier versions); ``params``: one layer type's
    ``rope_parameters``."""
    params = dict(params or _get(cfg, "rope_parameters") or {})
    if not params:
        params = dict(_get(cfg, "rope_scaling") or {})
        params.setdefault("rope_theta", _get(cfg, "rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "yarn"):
        _unsupported(model_type, "rope_type", rope_type, "fusedpar implements 'default', 'llama3' and 'yarn'")
    partial = float(params.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", None) or 1.0))
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
    """fusedpar's gated activation of HF's ``hidden_act`` (Gemma 2/3: ``hidden_activation``)."""
    field = "hidden_activation" if model_type in ("gemma2", "gemma3_text") else "hidden_act"
    act = _get(cfg, field, "silu")
    if model_type == "gemma" and act == "gelu":  # Gemma 1's legacy value, meant as the tanh GELU (as HF reads it)
        act = "gelu_pytorch_tanh"
    if act not in _GATED:
        _unsupported(model_type, field, act, f"gated MLPs with one of {sorted(_GATED)}")
    return _GATED[act]


def _check_unsupported(cfg, model_type):
    if float(_get(cfg, "attention_dropout", 0.0) or 0.0):
        _unsupported(model_type, "attention_dropout", _get(cfg, "attention_dropout"), "no attention dropout")
    if model_type not in ("qwen2", "qwen2_moe", "glm4_moe") and _get(cfg, "attention_bias", False):
        _unsupported(model_type, "attention_bias", True, "no bias on the output projection")
    if _get(cfg, "use_bidirectional_attention", False):
        _unsupported(model_type, "use_bidirectional_attention", True, "causal attention only")
    if _get(cfg, "mlp_bias", False):
        _unsupported(model_type, "mlp_bias", True, "bias-free MLPs only")
    if float(_get(cfg, "router_jitter_noise", 0.0) or 0.0):
        _unsupported(model_type, "router_jitter_noise", _get(cfg, "router_jitter_noise"), "no router jitter")
    if int(_get(cfg, "pretraining_tp", 1) or 1) != 1:
        _unsupported(model_type, "pretraining_tp", _get(cfg, "pretraining_tp"), "must be 1")


def _sliding_window(cfg, model_type):
    """HF's active sliding window (None when off): the layers that ``layer_types`` marks
    ``"sliding_attention"`` (all of them without ``layer_types``) attend through it."""
    window = _get(cfg, "sliding_window")
    uses_window = _get(cfg, "use_sliding_window", model_type in ("mistral", "mixtral"))
    if model_type in ("gemma2", "gemma3_text"):  # windows on the sliding layers only (layer_types)
        uses_window = "sliding_attention" in (_get(cfg, "layer_types") or ())
    return int(window) if window and uses_window else None


def _glm4_moe_fields(cfg):
    """GLM-4.5: sigmoid group-limited routing with the correction bias, first_k_dense_replace dense
    blocks, ungated shared experts; no auxiliary loss (transformers computes none)."""
    num = lambda name, **kw: config_number(cfg, name, "config_from_hf", **kw)  # noqa: E731
    ffn = num("moe_intermediate_size")
    return dict(num_experts=num("n_routed_experts"), top_k=num("num_experts_per_tok"), moe_ffn_hidden_size=ffn,
                norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)), score_func="sigmoid",
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
        params = _get(cfg, "rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: RoPE parameters per layer type
            thetas = {}
            for kind in ("full_attention", "sliding_attention"):
                thetas[kind], scaling, _ = _rope(cfg, model_type, params.get(kind))
                if scaling is not None:
                    _unsupported(model_type, f"rope_parameters[{kind!r}]", params.get(kind),
                                 "one RoPE scaling for all layers: 'default' on the Gemma 3 layer types")
        else:  # older configs: rope_theta (global) and rope_local_base_freq; rope_scaling on global layers only
            if _get(cfg, "rope_scaling"):
                _unsupported(model_type, "rope_scaling", _get(cfg, "rope_scaling"),
                             "one RoPE scaling for all layers: none on Gemma 3, whose local layers have none")
            thetas = {"full_attention": float(_get(cfg, "rope_theta", 1e6)),
                      "sliding_attention": float(_get(cfg, "rope_local_base_freq", 1e4))}
        types = _get(cfg, "layer_types") or ["full_attention"] * num("num_hidden_layers")
        fields["layer_rope_theta"] = tuple(thetas.get(t, thetas["full_attention"]) for t in types)
        fields["rope_theta"] = thetas["full_attention"]
    return fields


def _pad_token(cfg, vocab: int):
    """HF's ``padding_idx`` (``pad_token_id``; a negative one counts from the end, as torch's)."""
    pad = _get(cfg, "pad_token_id", None)
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
                  norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)),
                  moe_every=int(_get(cfg, "decoder_sparse_step", 1) or 1),
                  dense_layers=tuple(_get(cfg, "mlp_only_layers", None) or ()))
    if model_type == "qwen2_moe":
        fields["shared_expert_ffn_hidden_size"] = int(_get(cfg, "shared_expert_intermediate_size") or 0)
    return fields


def _deepseek_fields(cfg):
    """DeepSeek-V3 / Kimi K2: MLA attention, then ``first_k_dense_replace`` dense blocks and MoE
    blocks with the sigmoid, group-limited router and its ``e_score_correction_bias`` (no aux
    loss: transformers trains none)."""
    num = lambda name, **kw: config_number(cfg, name, "config_from_hf", **kw)  # noqa: E731
    shared = num("n_shared_experts", default=0) or 0
    heads = num("num_attention_heads")
    experts = num("n_routed_experts")
    dense = min(num("first_k_dense_replace", default=0) or 0, num("num_hidden_layers"))
    return dict(
        attention="mla", q_lora_rank=_get(cfg, "q_lora_rank"), kv_lora_rank=num("kv_lora_rank"),
        qk_nope_head_dim=num("qk_nope_head_dim"), qk_rope_head_dim=num("qk_rope_head_dim"),
        v_head_dim=num("v_head_dim"), rope_interleave=bool(_get(cfg, "rope_interleave", True)),
        head_dim=None, num_kv_heads=heads, qkv_bias=False, qk_norm=False,
        num_experts=experts, top_k=num("num_experts_per_tok"), moe_ffn_hidden_size=num("moe_intermediate_size"),
        dense_layers=tuple(range(dense)), score_func="sigmoid", score_correction_bias=True,
        shared_expert_ffn_hidden_size=num("moe_intermediate_size") * shared, shared_expert_gate=False,
        n_group=num("n_group", default=1) or 1, topk_group=_get(cfg, "topk_group"),
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
        routed_scaling_factor=num("routed_scaling_factor", kind=float, default=1.0),
        aux_loss_coef=0.0, z_loss_coef=0.0)


def config_from_hf(hf_config, **overrides) -> TransformerConfig:
    """The :class:`~fusedpar.nn.TransformerConfig` of a Hugging Face config (a ``PretrainedConfig``
    or its dict). ``overrides`` set layout fields (``sp_mode``, ``layout``, ``capacity_factor``...).
    Raises ``ValueError`` naming the field for a model type or field value fusedpar does not
    implement (e.g. another RoPE type, attention dropout). An active sliding window (stock Mistral:
    4096) is kept as ``sliding_window``, with HF's ``layer_types`` (which layers slide)."""
    model_type = _get(hf_config, "model_type")
    if model_type not in _ROUTE_A_TYPES:
        raise ValueError(f"config_from_hf: model_type must be one of {_ROUTE_A_TYPES}, got {model_type!r}")
    _check_unsupported(hf_config, model_type)
    params = _get(hf_config, "rope_parameters") or {}
    theta, scaling, partial = _rope(hf_config, model_type,
                                    params.get("full_attention") if "full_attention" in params else None)
    num = lambda name, **kw: config_number(hf_config, name, "config_from_hf", **kw)  # noqa: E731
    heads = num("num_attention_heads")
    fields = dict(
        vocab_size=num("vocab_size"), hidden_size=num("hidden_size"), num_layers=num("num_hidden_layers"),
        num_heads=heads, ffn_hidden_size=num("intermediate_size"),
        num_kv_heads=num("num_key_value_heads", default=None) or heads, activation=_activation(hf_config, model_type),
        norm_eps=num("rms_norm_eps", kind=float), causal=True, rope_theta=theta, rope_scaling=scaling,
        head_dim=_get(hf_config, "head_dim", None), qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        partial_rotary_factor=partial,
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(hf_config, model_type), pad_token_id=_pad_token(hf_config, num("vocab_size")))
    if fields["sliding_window"] is not None and _get(hf_config, "layer_types", None) is not None:
        fields["layer_types"] = list(_get(hf_config, "layer_types"))
    if model_type == "glm4_moe":
        fields.update(qkv_bias=bool(_get(hf_config, "attention_bias", False)),
                      qk_norm=bool(_get(hf_config, "use_qk_norm", False)))
    fields.update(_family_fields(hf_config, model_type, num))
    if model_type in _MOE_TYPES:
        fields.update(_moe_fields(hf_config, model_type))
    if model_type == "deepseek_v3":
        fields.update(_deepseek_fields(hf_config))
    fields.update(overrides)
    return TransformerConfig(**fields)


# ----------------------------------------------------------------------------------------------
# names: fusedpar parameter -> how to build it from Hugging Face tensors
# ----------------------------------------------------------------------------------------------
_ATTN = "model.layers.{i}.self_attn."


def _param_sources(name: str, config: TransformerConfig) -> list[str]:
    """The Hugging Face tensors (in-memory names of transformers 5) concatenated along dim 0 into
    the full fusedpar parameter ``name``."""
    fixed = {"embedding.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"],
             "head.weight": ["lm_head.weight"]}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if parts[0] != "layers":
        raise ValueError(f"no Hugging Face name for parameter {name!r}")
    i, rest = parts[1], ".".join(parts[2:])
    a, m = _ATTN.format(i=i), f"model.layers.{i}.mlp."
    if config.attention == "mla" and rest.startswith("attn."):  # MLAttention's modules carry HF's names
        return [a + rest[len("attn."):]]
    ln = "model.layers.{i}.{name}_layernorm.weight"
    table = {
        "norm1.weight": [ln.format(i=i, name="input")],
        "norm2.weight": [ln.format(i=i, name="pre_feedforward" if config.norm_layout == "sandwich"
                                   else "post_attention")],
        "post_attn_norm.weight": [ln.format(i=i, name="post_attention")],
        "post_mlp_norm.weight": [ln.format(i=i, name="post_feedforward")],
        "attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        "attn.qkv.bias": [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
        "attn.proj.weight": [a + "o_proj.weight"], "attn.q_norm.weight": [a + "q_norm.weight"],
        "attn.k_norm.weight": [a + "k_norm.weight"], "attn.sinks": [a + "sinks"],
        "mlp.fc1.weight": [m + "gate_proj.weight", m + "up_proj.weight"], "mlp.fc2.weight": [m + "down_proj.weight"],
        "mlp.router.weight": [m + "gate.weight"], "mlp.w1": [m + "experts.gate_up_proj"],
        "mlp.router.e_score_correction_bias": [m + "gate.e_score_correction_bias"],
        "mlp.w2": [m + "experts.down_proj"],
        "shared_expert.fc1.weight": [m + "{s}.gate_proj.weight", m + "{s}.up_proj.weight"],
        "shared_expert.fc2.weight": [m + "{s}.down_proj.weight"],
        "shared_expert_gate.weight": [m + "shared_expert_gate.weight"],
    }
    if rest not in table:
        raise ValueError(f"no Hugging Face name for parameter {name!r}")
    shared = "shared_expert" if config.shared_expert_gate else "shared_experts"  # Qwen2-MoE / DeepSeek, GLM
    return [s.format(i=i, s=shared) for s in table[rest]]


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
                         *, device=None, dtype=None, strict: bool = True) -> None:
    """Load full (unsharded) tensors, keyed by ``model``'s parameter names, into a model of any
    parallel layout: each rank keeps its shard (by the placements its modules declare). A model
    built on the meta device is materialised (on ``device``, default CPU). ``state_dict`` may be a
    callable ``name -> full tensor`` (read on demand). ``strict``: every parameter must be given."""
    placements = placements_of(model)
    for name, p in list(model.named_parameters()):
        if callable(state_dict):
            full = state_dict(name)
        elif name in state_dict:
            full = state_dict[name]
        elif strict:
            raise ValueError(f"load_full_state_dict: state_dict has no tensor for parameter {name!r}")
        else:
            continue
        placement = placements[name]
        local = placement.local_from_full(full)
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"load_full_state_dict: {name} must be {placement.full_shape(p.shape)} in full, "
                             f"got {tuple(full.shape)}")
        _set_param(model, name, p, local, device, dtype)


def _set_param(model: nn.Module, name: str, p: torch.Tensor, local: torch.Tensor, device, dtype) -> None:
    """Replace parameter ``name`` (currently ``p``, maybe on the meta device) by ``local``."""
    target = p.device if p.device.type != "meta" else torch.device(device or "cpu")
    new = local.to(device=target, dtype=dtype or (p.dtype if p.device.type != "meta" else local.dtype)).clone()
    mod_name, _, pname = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    setattr(mod, pname, nn.Parameter(new, requires_grad=p.requires_grad))


class _SafetensorsDir:
    """Tensors of a checkpoint directory by name, each file opened once (``model.safetensors`` or
    ``model.safetensors.index.json``'s shards); tensors are read only when asked for."""

    def __init__(self, path: str):
        from safetensors import safe_open  # installed with transformers / huggingface_hub

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json(index, "from_hf").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"from_hf: {index!r} must hold a weight_map object, got {type(weight_map).__name__}")
            self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise ValueError(f"from_hf: {path!r} has neither model.safetensors nor model.safetensors.index.json")
            with _safetensors_errors(single):
                with safe_open(single, "pt") as f:
                    self.where = {k: single for k in f.keys()}
        self.open = lambda file: safe_open(file, "pt")
        self.files: dict[str, object] = {}

    def close(self):
        for f in self.files.values():
            f.__exit__(None, None, None)
        self.files.clear()

    def __contains__(self, name):
        return name in self.where

    def keys(self):
        return self.where.keys()

    def _file(self, name):
        file = self.where[name]
        if file not in self.files:
            with _safetensors_errors(file):
                self.files[file] = self.open(file).__enter__()
        return self.files[file]

    def __getitem__(self, name):
        f = self._file(name)
        with _safetensors_errors(self.where[name], name):
            return f.get_tensor(name)

    def rows(self, name, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (dim 0) of tensor ``name``, reading only those."""
        f = self._file(name)
        with _safetensors_errors(self.where[name], name):
            return f.get_slice(name)[lo:hi]


class _safetensors_errors:
    """Turn a safetensors / OS error on ``file`` (truncated, damaged, unreadable) into a
    ``ValueError`` naming the file (and the tensor being read)."""

    def __init__(self, file: str, tensor: str | None = None):
        self.file, self.tensor = file, tensor

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, ValueError) and "from_hf" in str(exc):
            return False
        what = f" (reading tensor {self.tensor!r})" if self.tensor else ""
        raise ValueError(f"from_hf: {self.file!r} must be a readable safetensors file{what}, got "
                         f"{type(exc).__name__}: {exc}") from exc


def read_json(path: str, owner: str) -> dict:
    """A JSON object from ``path``; a missing, unreadable or malformed file raises naming it."""
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{owner}: {path!r} must exist, got no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{owner}: {path!r} must be a readable JSON file, got {type(e).__name__}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{owner}: {path!r} must hold a JSON object, got {type(value).__name__}")
    return value


def _rows(source, name: str, lo: int, hi: int) -> torch.Tensor:
    return source.rows(name, lo, hi) if isinstance(source, _SafetensorsDir) else source[name][lo:hi]


def _hf_tensor(source, name: str, experts: tuple[int, int] | None = None) -> torch.Tensor:
    """A Hugging Face tensor by its transformers-5 name; stacks the per-expert tensors of
    checkpoints saved with one tensor per expert (Mixtral ``block_sparse_moe.experts.j.w1/w3/w2``,
    Qwen-MoE ``mlp.experts.j.gate_proj/up_proj/down_proj``). ``experts=(lo, hi)``: of a stacked
    expert tensor only experts ``lo..hi-1`` are read (rows of the fused tensor, or those experts'
    tensors)."""
    if name in source:
        return source[name] if experts is None else _rows(source, name, *experts)
    if ".mlp.experts." in name:
        layer = name.split(".mlp.")[0]
        fused_gate_up = name.endswith("gate_up_proj")
        for mlp, gate, up, down in ((".block_sparse_moe.experts.", "w1", "w3", "w2"),
                                    (".mlp.experts.", "gate_proj", "up_proj", "down_proj")):
            if f"{layer}{mlp}0.{gate}.weight" in source:
                out, j = [], 0 if experts is None else experts[0]
                while f"{layer}{mlp}{j}.{gate}.weight" in source and (experts is None or j < experts[1]):
                    e = f"{layer}{mlp}{j}."
                    out.append(torch.cat([source[e + gate + ".weight"], source[e + up + ".weight"]])
                               if fused_gate_up else source[e + down + ".weight"])
                    j += 1
                return torch.stack(out)
    if name.endswith(".mlp.gate.weight") and name.replace(".mlp.", ".block_sparse_moe.") in source:
        return source[name.replace(".mlp.", ".block_sparse_moe.")]
    raise ValueError(f"from_hf: the checkpoint must hold tensor {name!r}, got none; {_layers_held(source)}")


def _layers_held(source) -> str:
    """How many decoder layers a checkpoint's tensor names cover (for a missing-tensor message)."""
    layers = sorted({int(k.split(".")[2]) for k in source.keys()
                     if k.startswith("model.layers.") and k.split(".")[2].isdigit()})
    if not layers:
        return "it holds no model.layers.* tensors"
    gaps = sorted(set(range(layers[-1] + 1)) - set(layers))
    return (f"it holds {len(layers)} layers (model.layers.{layers[0]}..{layers[-1]}"
            + (f", without {gaps}" if gaps else "") + "): does config.json's num_hidden_layers match the checkpoint?")


def _full_param(source, name: str, config: TransformerConfig, dim: int) -> torch.Tensor:
    """The full parameter ``name``: its Hugging Face tensors (its sections) joined along ``dim``."""
    parts = [_hf_tensor(source, s) for s in _param_sources(name, config)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


@torch.no_grad()
def _load_from_source(model: Transformer, source, device, dtype) -> None:
    """Materialise every parameter of the meta-device ``model`` from ``source``: this rank's
    shard of each full tensor; expert weights (split over ep) read expert by expert, only this
    rank's experts (a checkpoint directory is never read whole on every rank)."""
    placements = placements_of(model)
    for name, p in list(model.named_parameters()):
        placement = placements[name]
        if placement.role == "ep":  # only this rank's experts are read
            (src,) = _param_sources(name, model.config)
            local = _hf_tensor(source, src, experts=placement.block_range(p.shape[placement.dim]))
        else:
            local = placement.local_from_full(_full_param(source, name, model.config, placement.dim))
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"from_hf: {name} must be {tuple(p.shape)} on this rank, got {tuple(local.shape)}")
        _set_param(model, name, p, local, device, dtype)
    for name, buf in checkpoint_buffers(model).items():  # replicated state (the routers' correction bias)
        (src,) = _param_sources(name, model.config)
        full = _hf_tensor(source, src)
        if tuple(full.shape) != tuple(buf.shape):
            raise ValueError(f"from_hf: {src} must be {tuple(buf.shape)}, got {tuple(full.shape)}")
        mod_name, _, bname = name.rpartition(".")
        target = buf.device if buf.device.type != "meta" else torch.device(device or "cpu")
        model.get_submodule(mod_name).register_buffer(bname, full.to(device=target, dtype=buf.dtype).clone())


def from_hf(hf_model_or_path, *, tp_group=None, sp_group=None, ep_group=None, ulysses_group=None,
            ring_group=None, device=None, dtype=None, **config_overrides) -> Transformer:
    """A :class:`~fusedpar.nn.Transformer` holding a Hugging Face model's weights, sharded over the
    given groups (``None`` = the default group of that dimension, i.e. the whole world when
    ``torch.distributed`` is initialised, else one process; pass the groups of a
    :class:`~fusedpar.parallel.ParallelState` or ``torch.distributed.new_group([rank])`` for a
    dimension of size 1). ``hf_model_or_path``: a ``transformers`` causal-LM model or a checkpoint
    directory. Built on the meta device; each rank materialises only its shards, on ``device``
    (default CPU) in ``dtype`` (default: the checkpoint's). ``config_overrides``: see
    :func:`config_from_hf` (e.g. ``sp_mode="ulysses"``)."""
    if isinstance(hf_model_or_path, (str, os.PathLike)):
        path = os.fspath(hf_model_or_path)
        raw = read_json(os.path.join(path, "config.json"), "from_hf")
        try:
            from transformers import AutoConfig  # normalises older config formats when installed
            hf_config = AutoConfig.from_pretrained(path)
        except ImportError:
            hf_config = raw
        except (ValueError, KeyError):  # a model type transformers does not know: config_from_hf names it
            hf_config = raw
        source = _SafetensorsDir(path)
    else:
        hf_config = hf_model_or_path.config
        source = dict(hf_model_or_path.state_dict())
    config = config_from_hf(hf_config, **config_overrides)
    model = Transformer(config, tp_group=tp_group, sp_group=sp_group, ep_group=ep_group,
                        ulysses_group=ulysses_group, ring_group=ring_group, device="meta")
    try:
        _load_from_source(model, source, device, dtype)
    finally:
        if isinstance(source, _SafetensorsDir):
            source.close()
    return model


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as a full tensor under its Hugging Face (transformers 5) name,
    e.g. for ``hf_model.load_state_dict(sd, strict=True)``. A collective over the model's tp / ep
    groups: call it on every rank. Tied embeddings appear under both names, as in Hugging Face."""
    if not isinstance(model, Transformer):
        raise TypeError(f"to_hf_state_dict needs a fusedpar.nn.Transformer, got {type(model).__name__}")
    full = full_state(model)
    placements = placements_of(model)
    out = {}
    for name, t in full.items():
        sources = _param_sources(name, model.config)
        pl = placements[name]  # a fused parameter's sections are the Hugging Face tensors
        for src, piece in zip(sources, torch.split(t, pl.full_sections(t.shape[pl.dim], 1), dim=pl.dim)):
            out[src] = piece.clone()
    for name, buf in checkpoint_buffers(model).items():  # replicated: identical on every rank
        (src,) = _param_sources(name, model.config)
        out[src] = buf.detach().clone()
    if model.config.tie_word_embeddings and "embedding.weight" in full:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
