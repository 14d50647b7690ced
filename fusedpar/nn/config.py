"""The model's sizes and options, :class:`TransformerConfig` (full sizes: nothing depends on the
parallel layout), with the checks of its values and of the input token ids."""
from __future__ import annotations

import dataclasses

import torch

from fusedpar.kernels.checks import (
    INDEX_DTYPES,
    check_bool,
    check_choice,
    check_int,
    check_positive_number,
    check_tensor,
)
from fusedpar.kernels.flash_attention_bwd import DQ_MODES
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.moe_topk import SCORE_FUNCS, check_routing_config
from fusedpar.kernels.runtime import ACTIVATIONS

from .rotary import rope_inv_freq

__all__ = ["AttentionConfig", "BlockConfig", "MLAConfig", "MoEConfig", "NORM_LAYOUTS", "TransformerConfig",
           "check_token_ids", "module_config"]

#: where a block's norms sit: "pre" ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))`` (Llama);
#: "post" ``h = x + post_attn_norm(attn(x)); y = h + post_mlp_norm(mlp(h))`` (OLMo 2);
#: "sandwich" both, ``h = x + post_attn_norm(attn(norm1(x))); y = h + post_mlp_norm(mlp(norm2(h)))`` (Gemma 2/3)
NORM_LAYOUTS = ("pre", "post", "sandwich")



# ----------------------------------------------------------------------------------------------
# per-module configs: what one module is (sizes and options); the parallel layout (groups,
# transports), the device and the dtype are the module's keyword arguments
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class AttentionConfig:
    """One :class:`~fusedpar.nn.ParallelAttention` (and its :class:`~fusedpar.nn.AttentionReference`):
    ``num_kv_heads`` None: ``num_heads``; ``head_dim`` None: ``hidden_size // num_heads``;
    ``v_head_dim`` None: ``head_dim``; ``bias``: on the output projection, ``qkv_bias`` (None: ``bias``)
    on q, k, v; ``window`` ``(left, right)`` in positions; ``rotary_dim`` None: the whole head;
    ``sp_mode`` / ``layout``: how the sequence is split (the reference ignores them, and
    ``dq_mode``). The module checks the values, naming the field."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    causal: bool = True
    bias: bool = False
    qkv_bias: bool | None = None
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    qk_norm_scope: str = "head"
    norm_offset: float = 0.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int | None = None
    window: tuple | None = None
    softcap: float | None = None
    sinks: bool = False
    softmax_scale: float | None = None
    sp_mode: str = "ring"
    layout: str = "zigzag"
    dq_mode: str = "separate"


@dataclasses.dataclass
class MLAConfig:
    """One :class:`~fusedpar.nn.MLAttention` (Hugging Face's names; ``q_lora_rank`` None: a plain
    ``q_proj``; ``bias``: HF's ``attention_bias``; ``norm_eps``: the latent norms' epsilon)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    causal: bool = True
    bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    norm_eps: float = 1e-6
    sp_mode: str = "ring"
    layout: str = "zigzag"
    dq_mode: str = "separate"


@dataclasses.dataclass
class MoEConfig:
    """One :class:`~fusedpar.nn.MoE` and its router (:class:`~fusedpar.nn.TopKRouter`): sizes, the
    routing (``score``, ``normalize``, group-limited ``n_group`` / ``topk_group``, ``score_bias`` with
    ``bias_update_rate``, ``routed_scaling_factor``, ``router_bias``), the losses, ``capacity_factor``
    (None: dropless), ``expert_bias`` (the experts' ``b1`` / ``b2``), the dispatch's ``num_chunks`` and
    the experts' ``fp8`` recipe."""

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    activation: str = "swiglu"
    capacity_factor: float | None = None
    score: str = "softmax"
    normalize: bool | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int | None = None
    score_bias: bool = False
    bias_update_rate: float = 0.0
    seq_aux_loss_coef: float = 0.0
    router_bias: bool = False
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    expert_bias: bool = False
    num_chunks: int = 2
    fp8: str | None = None
    fp8_grad_high_precision: bool = False


@dataclasses.dataclass
class BlockConfig:
    """One :class:`~fusedpar.nn.TransformerBlock`: its attention (an :class:`AttentionConfig`, or an
    :class:`MLAConfig` for multi-head latent attention), its MLP (dense: ``ffn_hidden_size`` and
    ``activation``; routed: ``moe``, plus a shared expert of ``shared_expert_ffn_hidden_size``,
    gated unless ``shared_expert_gate=False``), the norms (``norm_layout`` of :data:`NORM_LAYOUTS`,
    ``norm_eps``, ``norm_offset``) and the fp8 recipe of its tensor-parallel projections and
    experts. :meth:`TransformerConfig.block_config` gives a model's."""

    attention: AttentionConfig | MLAConfig
    ffn_hidden_size: int
    activation: str = "swiglu"
    moe: MoEConfig | None = None
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = True
    norm_layout: str = "pre"
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    fp8: str | None = None
    fp8_grad_high_precision: bool = False

    @property
    def hidden_size(self) -> int:
        return self.attention.hidden_size


def module_config(module: str, config, kind):
    """``config`` if it is a ``kind`` (a config class above), else a ``TypeError`` naming both."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(config, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"{module}: config must be a {expected}, got {type(config).__name__}")
    return config

@dataclasses.dataclass
class TransformerConfig:
    """Sizes of the model (all full sizes: nothing here depends on the parallel layout).

    ``num_experts = 0`` gives dense MLPs; otherwise every ``moe_every``-th block (the last of each
    group of ``moe_every``) holds a :class:`MoE` with ``moe_ffn_hidden_size`` (default
    ``ffn_hidden_size``) per expert.

    ``fp8="rowwise"`` / ``"blockwise"`` runs every tensor-parallel projection of the blocks
    (attention q/k/v and output, MLA's head projections, the dense and shared-expert MLPs) with fp8
    GEMMs forward and backward (:func:`fusedpar.nn.linear.enable_fp8`) and the routed experts in
    fp8 (:meth:`fusedpar.nn.MoE.set_fp8`: tokens dispatched as e4m3 + scales, fp8 grouped GEMMs,
    outputs combined in the model's dtype); the embedding, the head, the routers and MLA's
    replicated down projections stay in the model's dtype.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    num_kv_heads: int | None = None
    activation: str = "swiglu"
    norm_eps: float = 1e-6
    causal: bool = True
    sp_mode: str = "ring"
    layout: str = "zigzag"
    num_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    moe_ffn_hidden_size: int | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    # fields with Hugging Face's meaning (defaults keep the earlier behaviour)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling / rope_parameters: None, "default", "llama3" or "yarn"
    head_dim: int | None = None  # default hidden_size // num_heads
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections (not on the output one)
    attention_out_bias: bool = False  # gpt-oss: a bias on the attention's output projection (o_proj)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before the rotary embedding
    tie_word_embeddings: bool = False  # the head is the embedding table (one parameter)
    norm_topk_prob: bool | None = None  # renormalise the top-k router weights (None: TopKRouter's default)
    aux_loss_style: str = "switch"  # "switch": per-layer coef * balance + z-loss; "hf": HF's pooled loss
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE: a shared expert MLP with a sigmoid gate
    dense_layers: tuple = ()  # HF mlp_only_layers: blocks that stay dense in a MoE model
    sliding_window: int | None = None  # HF's W: query i sees keys i - W < j <= i (window=(W - 1, 0))
    layer_types: list | None = None  # HF: "full_attention" / "sliding_attention" per layer (None: all slide if W is set)
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores c * tanh(s / c)
    attention_sinks: bool = False  # gpt-oss: a learnable logit per head in the softmax denominator
    v_head_dim: int | None = None  # the head dim of v and the attention output (default head_dim)
    attention_dq_mode: str = "separate"  # the attention backward: "separate" (deterministic) or "atomic" (one pass)
    # MoE routing (DeepSeek-V3, Kimi K2, GLM-4.5, gpt-oss; defaults keep softmax top-k)
    score_func: str = "softmax"  # "softmax", "sigmoid" or "softmax_topk" (gpt-oss: softmax over the chosen logits)
    routed_scaling_factor: float = 1.0  # multiplies the combine weights
    n_group: int = 1  # expert groups of group-limited routing (1: none)
    topk_group: int | None = None  # groups searched per token (None: n_group)
    score_correction_bias: bool = False  # e_score_correction_bias buffer for the selection (also with a rate > 0)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: Transformer.update_router_bias after opt.step()
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (added to the aux loss)
    router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    expert_bias: bool = False  # gpt-oss: each expert's two projections have biases (MoE's b1, b2)
    # DeepSeek-V3 / GLM-4.5 MoE layout (defaults keep the earlier behaviour)
    first_k_dense_replace: int = 0  # HF first_k_dense_replace: blocks 0..k-1 stay dense
    shared_expert_gate: bool = True  # False: the shared expert is added ungated (DeepSeek-V3 / GLM-4.5)
    partial_rotary_factor: float = 1.0  # GLM-4.5: rotary on the first int(head_dim * factor) features of a head
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2): attention="mla" and its sizes (HF's names)
    attention: str = "default"  # "default": ParallelAttention (q, k, v heads); "mla": MLAttention
    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    rope_interleave: bool = True  # HF's rope_interleave: the rotary features are interleaved pairs
    # block layouts, norms, embedding and head of other families (defaults keep the Llama model)
    norm_layout: str = "pre"  # "pre" | "post" (OLMo 2) | "sandwich" (Gemma 2/3), see NORM_LAYOUTS
    norm_offset: float = 0.0  # 1.0: Gemma's RMSNorm, scale (1 + weight) with weights initialised to zeros
    qk_norm_scope: str = "head"  # qk_norm over "head" (head_dim: Qwen3, Gemma 3) or "projection" (OLMo 2)
    softmax_scale: float | None = None  # attention scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    embed_scale: float = 1.0  # embeddings times this, rounded to the model's dtype (Gemma: sqrt(hidden_size))
    final_logit_softcap: float | None = None  # logits c * tanh(z / c) (Gemma 2/3 final_logit_softcapping)
    layer_rope_theta: tuple | None = None  # a RoPE base per layer (Gemma 3's local base on sliding layers)
    pad_token_id: int | None = None  # HF's padding_idx: that embedding row gets no gradient from the lookup
    # fp8 training (a compute format: master weights, optimizer state and checkpoints are unchanged)
    fp8: str | None = None  # None | "rowwise" | "blockwise": the blocks' tensor-parallel projections and experts in fp8
    fp8_grad_high_precision: bool = False  # their weight gradients in the activations' dtype

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "moe_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {v!r}")
        if self.num_experts < 0:
            raise ValueError(f"TransformerConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.layout not in ("zigzag", "contiguous"):
            raise ValueError(f"TransformerConfig.layout must be 'zigzag' or 'contiguous', got {self.layout!r}")
        if self.aux_loss_style not in ("switch", "hf"):
            raise ValueError(f"TransformerConfig.aux_loss_style must be 'switch' or 'hf', got {self.aux_loss_style!r}")
        check_positive_number("TransformerConfig.rope_theta", self.rope_theta)
        rope_inv_freq(2, float(self.rope_theta), self.rope_scaling)  # raises on an unsupported scaling
        s = self.shared_expert_ffn_hidden_size
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"TransformerConfig.shared_expert_ffn_hidden_size must be an int >= 0, got {s!r}")
        self.dense_layers = tuple(int(i) for i in self.dense_layers)
        check_config_values(self)

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer % self.moe_every == self.moe_every - 1
                and layer not in self.dense_layers and layer >= self.first_k_dense_replace)

    def block_config(self, layer: int) -> BlockConfig:
        """The :class:`BlockConfig` of block ``layer``."""
        moe = self.moe_config(layer)
        return BlockConfig(attention=self.attention_config(layer), ffn_hidden_size=self.ffn_hidden_size,
                           activation=self.activation, moe=moe,
                           shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size if moe else 0,
                           shared_expert_gate=self.shared_expert_gate, norm_layout=self.norm_layout,
                           norm_eps=self.norm_eps, norm_offset=self.norm_offset, fp8=self.fp8,
                           fp8_grad_high_precision=self.fp8_grad_high_precision)

    def attention_config(self, layer: int) -> AttentionConfig | MLAConfig:
        """The attention of block ``layer``: an :class:`MLAConfig` with ``attention="mla"``, else an
        :class:`AttentionConfig` from the Hugging Face fields: a sliding window of ``sliding_window``
        ``W`` (query ``i`` sees keys ``i - W < j <= i``, so ``window=(W - 1, 0)``) where ``layer_types``
        says ``"sliding_attention"`` (every layer when ``layer_types`` is None), the softcap, the sinks,
        ``v_head_dim``, ``softmax_scale`` (Gemma: ``query_pre_attn_scalar ** -0.5``), the layer's RoPE base."""
        theta = float(self.rope_theta if self.layer_rope_theta is None else self.layer_rope_theta[layer])
        common = dict(hidden_size=self.hidden_size, num_heads=self.num_heads, causal=self.causal, rope_theta=theta,
                      rope_scaling=self.rope_scaling, sp_mode=self.sp_mode, layout=self.layout,
                      dq_mode=self.attention_dq_mode)
        if self.attention == "mla":  # (its latent norms keep transformers' eps 1e-6)
            return MLAConfig(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                             qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                             v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave, **common)
        slides = self.sliding_window is not None and (
            self.layer_types is None or self.layer_types[layer] == "sliding_attention")
        return AttentionConfig(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim,
                               bias=self.attention_out_bias, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                               qk_norm_eps=self.norm_eps, qk_norm_scope=self.qk_norm_scope,
                               norm_offset=self.norm_offset, rotary_dim=self.rotary_dim(),
                               window=(self.sliding_window - 1, 0) if slides else None,
                               softcap=self.attn_logit_softcapping, sinks=self.attention_sinks,
                               softmax_scale=self.softmax_scale, **common)

    def moe_config(self, layer: int) -> MoEConfig | None:
        """The routed MLP of block ``layer`` (None for a dense block). With ``aux_loss_style="hf"``
        the per-layer losses are off (:meth:`Transformer.aux_loss` pools them instead)."""
        if not self.is_moe(layer):
            return None
        hf_aux = self.aux_loss_style == "hf"
        return MoEConfig(hidden_size=self.hidden_size, ffn_hidden_size=self.moe_ffn_hidden_size or self.ffn_hidden_size,
                         num_experts=self.num_experts, top_k=self.top_k, activation=self.activation,
                         capacity_factor=self.capacity_factor, score=self.score_func, normalize=self.norm_topk_prob,
                         routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
                         topk_group=self.topk_group, score_bias=self.score_correction_bias,
                         bias_update_rate=self.bias_update_rate, seq_aux_loss_coef=self.seq_aux_loss_coef,
                         router_bias=self.router_bias, aux_loss_coef=0.0 if hf_aux else self.aux_loss_coef,
                         z_loss_coef=0.0 if hf_aux else self.z_loss_coef, expert_bias=self.expert_bias)

    def rotary_dim(self) -> int | None:
        """The rotated features per head (HF: ``int(head_dim * partial_rotary_factor)``); None: all."""
        if self.partial_rotary_factor == 1.0:
            return None
        return int((self.head_dim or self.hidden_size // self.num_heads) * self.partial_rotary_factor)


def check_config_values(cfg: "TransformerConfig") -> None:
    """The fields the size checks above do not cover: booleans are bools, modes from their set,
    optional sizes positive (a 0 is an error, never a silent fall-back to the default)."""
    for name in ("causal", "qkv_bias", "attention_out_bias", "qk_norm", "tie_word_embeddings", "attention_sinks",
                 "expert_bias"):
        check_bool(f"TransformerConfig.{name}", getattr(cfg, name))
    if cfg.norm_topk_prob is not None:
        check_bool("TransformerConfig.norm_topk_prob", cfg.norm_topk_prob)
    check_choice("TransformerConfig.sp_mode", cfg.sp_mode, ("ring", "ulysses", "hybrid"))
    check_choice("TransformerConfig.activation", cfg.activation, sorted(a for a in ACTIVATIONS if a != "none"))
    check_choice("TransformerConfig.attention_dq_mode", cfg.attention_dq_mode, DQ_MODES)
    for name in ("num_kv_heads", "moe_ffn_hidden_size", "head_dim", "sliding_window", "v_head_dim"):
        if getattr(cfg, name) is not None:
            check_int(f"TransformerConfig.{name}", getattr(cfg, name), min_value=1)
    if cfg.attn_logit_softcapping is not None:
        check_positive_number("TransformerConfig.attn_logit_softcapping", cfg.attn_logit_softcapping)
    check_layer_types(cfg)
    if cfg.num_experts:
        check_int("TransformerConfig.top_k", cfg.top_k, min_value=1, max_value=cfg.num_experts)
    elif cfg.expert_bias:
        raise ValueError("TransformerConfig.expert_bias=True needs experts (num_experts > 0), got num_experts=0")
    check_choice("TransformerConfig.score_func", cfg.score_func, tuple(SCORE_FUNCS))
    if cfg.num_experts:
        check_routing_config(cfg.num_experts, cfg.top_k, score=cfg.score_func, n_group=cfg.n_group,
                             topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor, prefix="TransformerConfig.",
                             score_name="score_func")
    check_int("TransformerConfig.first_k_dense_replace", cfg.first_k_dense_replace, min_value=0)
    for name in ("score_correction_bias", "router_bias", "shared_expert_gate"):
        check_bool(f"TransformerConfig.{name}", getattr(cfg, name))
    for name in ("bias_update_rate", "seq_aux_loss_coef"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"TransformerConfig.{name} must be a number >= 0, got {v!r}")
    if cfg.capacity_factor is not None:
        check_positive_number("TransformerConfig.capacity_factor", cfg.capacity_factor)
    check_mla_values(cfg)
    check_choice("TransformerConfig.fp8", cfg.fp8, (None,) + tuple(FP8_RECIPES))
    check_bool("TransformerConfig.fp8_grad_high_precision", cfg.fp8_grad_high_precision)
    check_positive_number("TransformerConfig.norm_eps", cfg.norm_eps)
    f = cfg.partial_rotary_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ValueError(f"TransformerConfig.partial_rotary_factor must be a number in (0, 1], got {f!r}")
    r = cfg.rotary_dim()
    if r is not None and (r < 2 or r % 2):
        raise ValueError(f"TransformerConfig.partial_rotary_factor={f} must give an even rotary dim >= 2 "
                         f"(int(head_dim * factor)), got {r}")

    check_family_values(cfg)


LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(cfg: "TransformerConfig") -> None:
    """``layer_types``: None or one of :data:`LAYER_TYPES` per layer; a sliding layer needs
    ``sliding_window``."""
    types = cfg.layer_types
    if types is None:
        return
    if not isinstance(types, (list, tuple)) or len(types) != cfg.num_layers:
        raise ValueError(f"TransformerConfig.layer_types must be None or a list of num_layers={cfg.num_layers} "
                         f"entries, got {types!r}")
    for i, t in enumerate(types):
        check_choice(f"TransformerConfig.layer_types[{i}]", t, LAYER_TYPES)
    if "sliding_attention" in types and cfg.sliding_window is None:
        raise ValueError("TransformerConfig.layer_types has 'sliding_attention' layers but sliding_window is None")
    cfg.layer_types = list(types)


def check_mla_values(cfg: "TransformerConfig") -> None:
    """``attention`` is "default" or "mla"; "mla" needs its sizes and takes none of the fields
    of the default attention's projections (qkv_bias, qk_norm, head_dim)."""
    check_choice("TransformerConfig.attention", cfg.attention, ("default", "mla"))
    check_bool("TransformerConfig.rope_interleave", cfg.rope_interleave)
    sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if cfg.attention != "mla":  # (v_head_dim is the default attention's too)
        for name in sizes[:3] + ("q_lora_rank",):
            if getattr(cfg, name) is not None:
                raise ValueError(f"TransformerConfig.{name} is for attention='mla', got {getattr(cfg, name)!r} "
                                 f"with attention={cfg.attention!r}")
        return
    for name in sizes:
        if getattr(cfg, name) is None:
            raise ValueError(f"TransformerConfig.{name} must be set with attention='mla', got None")
        check_int(f"TransformerConfig.{name}", getattr(cfg, name), min_value=0 if name == "qk_nope_head_dim" else 1)
    if cfg.q_lora_rank is not None:
        check_int("TransformerConfig.q_lora_rank", cfg.q_lora_rank, min_value=1)
    for name in ("qkv_bias", "qk_norm", "attention_out_bias"):
        if getattr(cfg, name):
            raise ValueError(f"TransformerConfig.{name} must be False with attention='mla' (MLA has its own "
                             f"projections), got True")
    for name, off in (("sliding_window", None), ("attn_logit_softcapping", None), ("attention_sinks", False),
                      ("softmax_scale", None), ("partial_rotary_factor", 1.0), ("norm_layout", "pre"),
                      ("norm_offset", 0.0), ("qk_norm_scope", "head")):
        if getattr(cfg, name) != off:
            raise ValueError(f"TransformerConfig.{name} is not supported with attention='mla' (MLAttention has no "
                             f"such option), got {getattr(cfg, name)!r}")
    if cfg.head_dim is not None:
        raise ValueError(f"TransformerConfig.head_dim must be None with attention='mla' (qk_nope_head_dim, "
                         f"qk_rope_head_dim and v_head_dim size the heads), got {cfg.head_dim!r}")


def check_family_values(cfg: "TransformerConfig") -> None:
    """The fields of the block layouts, norms, embedding and head of other families."""
    check_choice("TransformerConfig.norm_layout", cfg.norm_layout, NORM_LAYOUTS)
    check_choice("TransformerConfig.qk_norm_scope", cfg.qk_norm_scope, ("head", "projection"))
    if isinstance(cfg.norm_offset, bool) or cfg.norm_offset not in (0, 1):
        raise ValueError(f"TransformerConfig.norm_offset must be 0.0 or 1.0 (Gemma), got {cfg.norm_offset!r}")
    check_positive_number("TransformerConfig.embed_scale", cfg.embed_scale)
    for name in ("softmax_scale", "final_logit_softcap"):
        if getattr(cfg, name) is not None:
            check_positive_number(f"TransformerConfig.{name}", getattr(cfg, name))
    if cfg.layer_rope_theta is not None:
        thetas = tuple(cfg.layer_rope_theta)
        if len(thetas) != cfg.num_layers:
            raise ValueError(f"TransformerConfig.layer_rope_theta must have num_layers={cfg.num_layers} entries, "
                             f"got {len(thetas)}")
        for theta in thetas:
            check_positive_number("TransformerConfig.layer_rope_theta[i]", theta)
        cfg.layer_rope_theta = tuple(float(t) for t in thetas)
    if cfg.pad_token_id is not None:
        check_int("TransformerConfig.pad_token_id", cfg.pad_token_id, min_value=0, max_value=cfg.vocab_size - 1)


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids are an int32/int64 tensor in ``[0, vocab_size)``. The range is read on CPU tensors; on
    a GPU it would cost a host sync, so there the embedding's own device-side bounds check stands."""
    check_tensor(name, ids, dtypes=INDEX_DTYPES)
    if ids.device.type == "cpu" and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got values in [{lo}, {hi}]")
