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
from fusedpar.kernels.moe_topk import SCORE_FUNCS, check_routing_config
from fusedpar.kernels.runtime import ACTIVATIONS

from .attention import rope_inv_freq

__all__ = ["TransformerConfig", "check_token_ids"]


@dataclasses.dataclass
class TransformerConfig:
    """Sizes of the model (all full sizes: nothing here depends on the parallel layout).

    ``num_experts = 0`` gives dense MLPs; otherwise every ``moe_every``-th block (the last of each
    group of ``moe_every``) holds a :class:`MoE` with ``moe_ffn_hidden_size`` (default
    ``ffn_hidden_size``) per expert.
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
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before the rotary embedding
    tie_word_embeddings: bool = False  # the head is the embedding table (one parameter)
    norm_topk_prob: bool | None = None  # renormalise the top-k router weights (None: TopKRouter's default)
    aux_loss_style: str = "switch"  # "switch": per-layer coef * balance + z-loss; "hf": HF's pooled loss
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE: a shared expert MLP with a sigmoid gate
    dense_layers: tuple = ()  # HF mlp_only_layers: blocks that stay dense in a MoE model
    sliding_window: int | None = None  # HF's window: attention stays full causal, so forward refuses longer sequences
    # MoE routing (DeepSeek-V3, Kimi K2, GLM-4.5, gpt-oss; defaults keep softmax top-k)
    score_func: str = "softmax"  # "softmax", "sigmoid" or "softmax_topk" (gpt-oss: softmax over the chosen logits)
    routed_scaling_factor: float = 1.0  # multiplies the combine weights
    n_group: int = 1  # expert groups of group-limited routing (1: none)
    topk_group: int | None = None  # groups searched per token (None: n_group)
    score_correction_bias: bool = False  # e_score_correction_bias buffer for the selection (also with a rate > 0)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: Transformer.update_router_bias after opt.step()
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (added to the aux loss)
    router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2): attention="mla" and its sizes (HF's names)
    attention: str = "default"  # "default": ParallelAttention (q, k, v heads); "mla": MLAttention
    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = True  # HF's rope_interleave: the rotary features are interleaved pairs

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
                and layer not in self.dense_layers)

    def block_kwargs(self, layer: int) -> dict:
        """The :class:`TransformerBlock` keyword arguments of block ``layer`` (sizes and options)."""
        moe = self.is_moe(layer)
        hf_aux = self.aux_loss_style == "hf"  # pooled over layers by Transformer.aux_loss instead
        return dict(num_kv_heads=self.num_kv_heads, sp_mode=self.sp_mode, layout=self.layout, causal=self.causal,
                    activation=self.activation, eps=self.norm_eps, num_experts=self.num_experts if moe else 0,
                    top_k=self.top_k, capacity_factor=self.capacity_factor,
                    aux_loss_coef=0.0 if hf_aux else self.aux_loss_coef, z_loss_coef=0.0 if hf_aux else self.z_loss_coef,
                    rope_theta=float(self.rope_theta), rope_scaling=self.rope_scaling, head_dim=self.head_dim,
                    qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, norm_topk_prob=self.norm_topk_prob,
                    shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size if moe else 0,
                    router_options=self.router_options(), mla=self.mla_options())

    def mla_options(self) -> dict | None:
        """The :class:`MLAttention` sizes with ``attention="mla"``, else None."""
        if self.attention != "mla":
            return None
        return dict(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                    qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave)

    def router_options(self) -> dict:
        """The :class:`MoE` router keyword arguments of the routing fields."""
        return dict(score=self.score_func, routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
                    topk_group=self.topk_group, score_bias=self.score_correction_bias,
                    bias_update_rate=self.bias_update_rate, seq_aux_loss_coef=self.seq_aux_loss_coef,
                    router_bias=self.router_bias)


def check_config_values(cfg: "TransformerConfig") -> None:
    """The fields the size checks above do not cover: booleans are bools, modes from their set,
    optional sizes positive (a 0 is an error, never a silent fall-back to the default)."""
    for name in ("causal", "qkv_bias", "qk_norm", "tie_word_embeddings"):
        check_bool(f"TransformerConfig.{name}", getattr(cfg, name))
    if cfg.norm_topk_prob is not None:
        check_bool("TransformerConfig.norm_topk_prob", cfg.norm_topk_prob)
    check_choice("TransformerConfig.sp_mode", cfg.sp_mode, ("ring", "ulysses", "hybrid"))
    check_choice("TransformerConfig.activation", cfg.activation, sorted(a for a in ACTIVATIONS if a != "none"))
    for name in ("num_kv_heads", "moe_ffn_hidden_size", "head_dim", "sliding_window"):
        if getattr(cfg, name) is not None:
            check_int(f"TransformerConfig.{name}", getattr(cfg, name), min_value=1)
    if cfg.num_experts:
        check_int("TransformerConfig.top_k", cfg.top_k, min_value=1, max_value=cfg.num_experts)
    check_choice("TransformerConfig.score_func", cfg.score_func, tuple(SCORE_FUNCS))
    if cfg.num_experts:
        check_routing_config(cfg.num_experts, cfg.top_k, score=cfg.score_func, n_group=cfg.n_group,
                             topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor, prefix="TransformerConfig.",
                             score_name="score_func")
    for name in ("score_correction_bias", "router_bias"):
        check_bool(f"TransformerConfig.{name}", getattr(cfg, name))
    for name in ("bias_update_rate", "seq_aux_loss_coef"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"TransformerConfig.{name} must be a number >= 0, got {v!r}")
    if cfg.capacity_factor is not None:
        check_positive_number("TransformerConfig.capacity_factor", cfg.capacity_factor)
    check_mla_values(cfg)
    check_positive_number("TransformerConfig.norm_eps", cfg.norm_eps)


def check_mla_values(cfg: "TransformerConfig") -> None:
    """``attention`` is "default" or "mla"; "mla" needs its sizes and takes none of the fields
    of the default attention's projections (qkv_bias, qk_norm, head_dim)."""
    check_choice("TransformerConfig.attention", cfg.attention, ("default", "mla"))
    check_bool("TransformerConfig.rope_interleave", cfg.rope_interleave)
    sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if cfg.attention != "mla":
        for name in sizes + ("q_lora_rank",):
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
    for name in ("qkv_bias", "qk_norm"):
        if getattr(cfg, name):
            raise ValueError(f"TransformerConfig.{name} must be False with attention='mla' (MLA has its own "
                             f"projections), got True")
    if cfg.head_dim is not None:
        raise ValueError(f"TransformerConfig.head_dim must be None with attention='mla' (qk_nope_head_dim, "
                         f"qk_rope_head_dim and v_head_dim size the heads), got {cfg.head_dim!r}")


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids are an int32/int64 tensor in ``[0, vocab_size)``. The range is read on CPU tensors; on
    a GPU it would cost a host sync, so there the embedding's own device-side bounds check stands."""
    check_tensor(name, ids, dtypes=INDEX_DTYPES)
    if ids.device.type == "cpu" and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got values in [{lo}, {hi}]")
