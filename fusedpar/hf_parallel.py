"""Route B: parallelise an unmodified Hugging Face decoder in place.

:func:`parallelize` swaps, inside a ``transformers`` Llama / Mistral / Qwen2 / Qwen3 / Mixtral /
Qwen-MoE / GLM-4.5 MoE / DeepSeek-V3 / gpt-oss / OLMo 2 / Gemma / Gemma 2 / Gemma 3 (text) model,

* the q / k / v / o and gate / up / down linears for fusedpar's tensor-parallel linears
  (``tp_group``; activations replicated over it, as in the unmodified model), OLMo 2's q / k
  norms (over the whole projection) for a :class:`~fusedpar.nn.RMSNorm` over the tp-split
  features, gpt-oss's sinks for those of this rank's heads and, in DeepSeek-V3's multi-head
  latent attention, the up projections (``q_b_proj`` / ``q_proj``, ``kv_b_proj``) for column-parallel
  ones over the heads (the down projections and latent norms stay whole; the rotary key that
  every head shares gets its gradient summed over tp: :class:`SharedRotaryKeyProjection`),
* the sparse MoE blocks for :class:`HFMoEBlock` (experts over ``ep_group``; HF's router kept, so
  ``output_router_logits=True`` and HF's aux loss work; gpt-oss's transposed, interleaved experts
  rearranged into fusedpar's layout),
* attention for fusedpar's ring / Ulysses / hybrid attention (``sp_group``, or ``ulysses_group`` +
  ``ring_group``) through transformers' attention interface: the function registered as
  :data:`ATTN_IMPLEMENTATION` and set as the model's ``config._attn_implementation``.

With sequence parallelism every rank feeds its shard of the sequence (:func:`shard_batch`) and
gets the logits of that shard; :func:`sequence_parallel_loss` is the global mean cross entropy
(the same value on every sp rank), :func:`gather_sequence` un-shards (for evaluation), and
:func:`gradient_sync_plan` with :func:`fusedpar.parallel.sync_gradients` reduces the gradients.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusedpar.kernels.runtime import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from fusedpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fusedpar.nn.moe import MoE
from fusedpar.nn.norm import RMSNorm
from fusedpar.nn.placement import Placement
from fusedpar.nn.placement import gradient_sync_plan as placement_gradient_sync_plan
from fusedpar.ops import comm, global_loss, hybrid_attention, ring_attention, shard_positions, ulysses_attention
from fusedpar.ops.tensor_parallel.api import replicated_rows
from fusedpar.nn.config import MoEConfig

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "HFMoEBlock", "SequenceParallel",
           "SharedRotaryKeyProjection", "causal_lm_loss", "gather_sequence", "gpt_oss_experts_from_hf",
           "gpt_oss_experts_to_hf", "gradient_sync_plan", "parallelize", "sequence_parallel_attention",
           "sequence_parallel_loss", "shard_batch"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmo2",
                         "gemma", "gemma2", "gemma3_text", "deepseek_v3", "gpt_oss")
ATTN_IMPLEMENTATION = "fusedpar_sequence_parallel"  # the name registered in transformers.AttentionInterface


def config_field(cfg, name, default=None):
    """Field ``name`` of a Hugging Face config, given as a ``PretrainedConfig`` or as a mapping
    (config.json's dict), ``default`` where it has none."""
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


_REQUIRED = object()


def config_number(cfg, name: str, owner: str, kind=int, default=_REQUIRED):
    """Field ``name`` of a Hugging Face config (a ``PretrainedConfig`` or its dict) as ``kind``
    (``int`` / ``float``): a missing or null field without ``default``, or a value that is not a
    number, raises ``ValueError`` naming the field (never ``int(None)``'s ``TypeError``)."""
    value = config_field(cfg, name, None)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{owner}: the config must have {name} ({kind.__name__}), got none (missing or null)")
        return default
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: the config's {name} must be {'an int' if kind is int else 'a number'}, "
                         f"got {type(value).__name__} {value!r}") from None


# ----------------------------------------------------------------------------------------------
# sequence parallelism
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Where this rank's tokens sit: ``mode`` "ring" / "ulysses" over ``group``, or "hybrid"
    (Ulysses inside ``ulysses_group``, ring across ``ring_group``); ``layout`` of the ring."""

    mode: str
    layout: str
    group: object = None
    ulysses_group: object = None
    ring_group: object = None

    @property
    def ring(self):
        """``(ring rank, ring size, Ulysses rank, Ulysses size)``."""
        if self.mode == "ring":
            return comm.group_rank(self.group), comm.group_size(self.group), 0, 1
        if self.mode == "ulysses":
            return 0, 1, comm.group_rank(self.group), comm.group_size(self.group)
        return (comm.group_rank(self.ring_group), comm.group_size(self.ring_group),
                comm.group_rank(self.ulysses_group), comm.group_size(self.ulysses_group))

    @property
    def size(self) -> int:
        _, r, _, u = self.ring
        return r * u

    def groups(self) -> list:
        return [self.group] if self.mode != "hybrid" else [self.ring_group, self.ulysses_group]

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens (see :func:`fusedpar.ops.shard_positions`)."""
        rr, rs, ur, us = self.ring
        return shard_positions(local_len * rs * us, layout=self.layout if rs > 1 else "contiguous", ring_rank=rr,
                               ring_size=rs, ulysses_rank=ur, ulysses_size=us, device=device)

    def attend(self, q, k, v, *, causal: bool, softmax_scale, window=None, softcap=None, sinks=None):
        opts = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap, sinks=sinks)
        if self.mode == "ring":
            return ring_attention(q, k, v, group=self.group, layout=self.layout, **opts)
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, group=self.group, **opts)
        return hybrid_attention(q, k, v, ulysses_group=self.ulysses_group, ring_group=self.ring_group,
                                layout=self.layout, **opts)


def sequence_parallel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                sliding_window=None, **kwargs):
    """The attention function :func:`parallelize` registers with transformers: q ``[b, heads,
    s_local, d]``, k / v ``[b, kv_heads, s_local, d]`` of this rank's shard (HF's layout) ->
    ``([b, s_local, heads, d], None)``, through fusedpar's ring / Ulysses / hybrid attention with
    the settings :func:`parallelize` put on ``module.fusedpar_sp``."""
    sp = getattr(module, "fusedpar_sp", None)
    if not isinstance(sp, SequenceParallel):
        raise ValueError(f"attention implementation {ATTN_IMPLEMENTATION!r} needs a model prepared by "
                         "fusedpar.hf.parallelize(..., sp_group=...)")
    if attention_mask is not None:
        raise ValueError("sequence-parallel attention takes no attention_mask (full causal attention only), got one")
    if dropout:
        raise ValueError(f"sequence-parallel attention has no attention dropout, got dropout={dropout}")
    sinks = kwargs.get("s_aux")  # gpt-oss's sinks: this rank's heads (split with them under tp), fp32 in the ops
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    # HF's sliding window W: query i sees keys i - W < j <= i
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)
    out = sp.attend(q, k, v, causal=bool(getattr(module, "is_causal", True)), softmax_scale=scaling, window=window,
                    softcap=kwargs.get("softcap"),  # Gemma 2's attn_logit_softcapping
                    sinks=None if sinks is None else sinks.float())
    return out, None


def _sp_pre_hook(base_model, args, kwargs):
    """Before the HF base model's forward: refuse what sequence parallelism cannot do (padding
    masks, KV caches), fill in / check ``position_ids`` (the global positions of this rank's shard)."""
    sp = base_model.fusedpar_sp
    x = kwargs.get("input_ids", args[0] if args else None)
    x = kwargs.get("inputs_embeds") if x is None else x
    if x is None:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
        raise ValueError("sequence parallelism: attention_mask must be None or all ones (no padding, no custom "
                         f"masks), got a {mask.dim()}-d mask with zeros")
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or kwargs.get("use_cache"):
        raise ValueError("sequence parallelism: no KV cache (past_key_values / cache / use_cache=True)")
    kwargs["use_cache"] = False
    expect = sp.positions(x.shape[1], device=x.device)
    pos = kwargs.get("position_ids")
    if pos is None:
        kwargs["position_ids"] = expect.unsqueeze(0)
    elif pos.device.type == "cpu" and (pos.shape[-1] != expect.numel() or not bool((pos == expect).all())):
        raise ValueError(f"position_ids must be the global positions of this rank's shard ({expect.tolist()}, "
                         f"fusedpar.ops.shard_positions), got {pos.tolist()}")
    return args, kwargs


def _sp_of(hf_model) -> SequenceParallel:
    sp = getattr(hf_model.model, "fusedpar_sp", None)
    if sp is None:
        raise ValueError("the model has no sequence parallelism: call fusedpar.hf.parallelize(..., sp_group=...) first")
    return sp


def shard_batch(hf_model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, ignore_index: int = -100):
    """This rank's share of a full ``[batch, seq]`` batch for a model :func:`parallelize` made
    sequence-parallel: ``(input_ids, position_ids, targets)``. ``targets`` are the next-token
    targets of HF's ``labels`` convention (``labels`` shifted left by one, the last position
    ``ignore_index``; None without ``labels``), for :func:`sequence_parallel_loss` (do not pass
    them as ``labels=`` to the model: HF would shift them again inside the shard)."""
    sp = _sp_of(hf_model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    S = input_ids.shape[1]
    if S % sp.size:
        raise ValueError(f"seq_len={S} must be divisible by the sequence-parallel size {sp.size}")
    pos = sp.positions(S // sp.size, device=input_ids.device)
    targets = None
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        targets = torch.full_like(labels, ignore_index)
        targets[:, :-1] = labels[:, 1:]
        targets = targets[:, pos]
    return input_ids[:, pos], pos.unsqueeze(0), targets


def sequence_parallel_loss(hf_model, logits: torch.Tensor, targets: torch.Tensor, *,
                           ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy over the counted tokens of the whole sequence (all sequence-parallel
    ranks), the same value on every sp rank, whatever the number of ignored tokens per rank
    (:func:`fusedpar.ops.global_loss`: one all-reduce of the sum and the count). Its gradient is
    ``sp`` times this rank's share, so averaging the gradients over the sp ranks
    (:func:`fusedpar.parallel.sync_gradients`) gives the full-sequence gradients."""
    sp = _sp_of(hf_model)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return global_loss(total, (targets != ignore_index).sum(), tuple(sp.groups()))


def causal_lm_loss(hf_model, input_ids: torch.Tensor, targets: torch.Tensor, *, position_ids=None,
                   ignore_index: int = -100, chunk_tokens: int | None = None) -> torch.Tensor:
    """The training loss of a Hugging Face causal LM without its logits: the decoder's final
    hidden states go through :func:`fusedpar.ops.linear_cross_entropy` with the (replicated)
    ``lm_head`` weight, chunk by chunk, so no ``[tokens, vocab]`` tensor exists in the forward or
    the backward. ``targets`` are next-token targets (:func:`shard_batch`'s, or ``labels`` shifted
    left by one), not HF ``labels``. The value is the mean over the counted tokens of the whole
    sequence (all sequence-parallel ranks when the model is sequence-parallel), the family's
    ``final_logit_softcapping`` applied; with ``config.output_router_logits`` it adds
    ``router_aux_loss_coef`` times the family's load-balancing loss of this rank's tokens, as the
    model's own forward with ``labels=`` does (families without one, GLM-4.5 and DeepSeek-V3, add
    nothing)."""
    from fusedpar.ops import linear_cross_entropy
    from fusedpar.ops.comm.transport import EmulatedTransport

    config = hf_model.config
    head = hf_model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("causal_lm_loss: the output head must have no bias, got lm_head.bias")
    if targets.shape != input_ids.shape:
        raise ValueError(f"targets must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(targets.shape)}")
    family = sys.modules[type(hf_model).__module__]
    # the families whose CausalLM forward adds an aux loss (not GLM-4.5 / DeepSeek-V3, which have none)
    router = bool(getattr(config, "output_router_logits", False)) and hasattr(family, "load_balancing_loss_func")
    kwargs = dict(output_router_logits=True) if router else {}
    out = hf_model.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
    sp = getattr(hf_model.model, "fusedpar_sp", None)
    total = linear_cross_entropy(out.last_hidden_state, head.weight, targets, transport=EmulatedTransport(1),
                                 ignore_index=ignore_index, reduction="sum", chunk_tokens=chunk_tokens,
                                 softcap=getattr(config, "final_logit_softcapping", None))
    loss = global_loss(total, (targets != ignore_index).sum(), tuple(sp.groups()) if sp is not None else ())
    if router:
        aux = family.load_balancing_loss_func(out.router_logits, hf_model.num_experts, hf_model.num_experts_per_tok,
                                              None)
        loss = loss + hf_model.router_aux_loss_coef * aux
    return loss


@torch.no_grad()
def gather_sequence(hf_model, local: torch.Tensor) -> torch.Tensor:
    """The full ``[batch, seq, ...]`` tensor in the original token order on every rank, from
    this rank's ``[batch, seq / sp, ...]`` shard (e.g. the logits). A collective over the sp
    group(s); not differentiable (for evaluation and tests)."""
    sp = _sp_of(hf_model)
    x = local.contiguous()
    pos = sp.positions(x.shape[1], device=x.device)
    for g in reversed(sp.groups()):  # Ulysses pieces first, then the ring shards
        n = comm.group_size(g)
        if n > 1:
            xs, ps = [torch.empty_like(x) for _ in range(n)], [torch.empty_like(pos) for _ in range(n)]
            dist.all_gather(xs, x, group=g)
            dist.all_gather(ps, pos, group=g)
            x, pos = torch.cat(xs, dim=1), torch.cat(ps)
    out = torch.empty_like(x)
    out[:, pos] = x
    return out


# ----------------------------------------------------------------------------------------------
# tensor and expert parallelism
# ----------------------------------------------------------------------------------------------
class HFMoEBlock(nn.Module):
    """Drop-in for a Mixtral / Qwen-MoE / GLM-4.5 / DeepSeek-V3 / gpt-oss sparse MoE block: a
    fusedpar :class:`~fusedpar.nn.MoE` (experts over ``ep_group``, tokens replicated over
    ``tp_group``: ``replicated_group``; GLM-4.5's and DeepSeek-V3's sigmoid group-limited router
    sharing HF's ``e_score_correction_bias``; gpt-oss's biased router, biased experts and clamped
    SwiGLU) plus the shared expert (its linears tensor-parallel) with, for Qwen2-MoE, its sigmoid
    gate (GLM-4.5's and DeepSeek-V3's shared experts are ungated). ``[batch, seq, hidden]`` in and
    out, as the block it replaces; with ``returns_scores`` (gpt-oss, whose decoder layer unpacks
    ``hidden, router_scores``) ``(out, the routing weights [tokens, top_k])``.

    ``gate`` is HF's own router module, kept under its HF attribute name ``router_name``
    (``"gate"``; gpt-oss: ``"router"``); its weight (and bias) *is* the fusedpar router's (one
    parameter, named ``...mlp.gate.weight`` / ``...mlp.router.weight`` as in HF). It runs only when
    transformers has hooked it to record ``router_logits`` (``output_router_logits=True``), so HF's
    aux loss sees the same logits."""

    def __init__(self, moe: MoE, gate: nn.Module, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, *, router_name: str = "gate",
                 returns_scores: bool = False):
        super().__init__()
        if router_name not in ("gate", "router"):
            raise ValueError(f"HFMoEBlock: router_name must be 'gate' or 'router', got {router_name!r}")
        self.router_name, self.returns_scores = router_name, bool(returns_scores)
        setattr(self, router_name, gate)  # registered first: the shared parameters keep HF's names
        self.moe, self.shared_expert, self.shared_expert_gate = moe, shared_expert, shared_expert_gate
        moe.router.weight = gate.weight
        if moe.router.bias is not None:  # gpt-oss: the router's bias, one parameter
            moe.router.bias = gate.bias
        if moe.router.e_score_correction_bias is not None:  # GLM-4.5 / DeepSeek-V3: HF's buffer, one tensor
            moe.router.e_score_correction_bias = gate.e_score_correction_bias

    def forward(self, hidden_states: torch.Tensor):
        gate = getattr(self, self.router_name)
        if gate._forward_hooks:  # transformers records the router logits through a forward hook
            gate(hidden_states.reshape(-1, hidden_states.shape[-1]))
        y = self.moe(hidden_states)
        if self.shared_expert is not None and self.shared_expert_gate is None:  # GLM-4.5 / DeepSeek-V3: ungated
            y = y + self.shared_expert(hidden_states)
        elif self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return (y, self.moe.router_output.weights) if self.returns_scores else y


class SharedRotaryKeyProjection(nn.Module):
    """DeepSeek-V3's ``kv_a_proj_with_mqa`` (hidden -> ``[kv latent; rotary key]``) under tensor
    parallelism, holding the ``nn.Linear``'s own weight and bias (same names). The latent goes
    through the column-parallel ``kv_b_proj``, whose backward sums its input gradient over tp; the
    rotary key is shared by every head, and each rank's attention covers only its own heads, so
    its gradient is summed over ``tp_group`` here (:func:`fusedpar.ops.tensor_parallel.api.replicated_rows`
    over the output's feature rows ``kv_lora_rank:``). The projection's weight, its input
    gradient and everything before it are then whole on every rank, as in the unsplit model."""

    def __init__(self, linear: nn.Linear, kv_lora_rank: int, tp_group):
        super().__init__()
        if not 0 < kv_lora_rank < linear.out_features:
            raise ValueError(f"SharedRotaryKeyProjection: kv_lora_rank must be in (0, {linear.out_features}), "
                             f"got {kv_lora_rank}")
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features, self.kv_lora_rank = linear.in_features, linear.out_features, kv_lora_rank
        self.group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias).movedim(-1, 0)  # feature rows first
        return replicated_rows(y, self.kv_lora_rank, 0, 1, group=self.group).movedim(0, -1)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rotary key rows {self.kv_lora_rank}: summed over tp")


class _LatentColumnParallelLinear(ColumnParallelLinear):
    """:class:`~fusedpar.nn.ColumnParallelLinear` (not sequence-parallel) over an input of any
    rank: DeepSeek-V3's ``kv_b_proj`` takes the latent viewed as one head, ``[batch, 1, seq,
    kv_lora_rank]``; the leading dims are flattened around the 2-D GEMM."""

    def forward(self, x):
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def gpt_oss_experts_from_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's expert tensor ``t`` (HF's ``gate_up_proj [E, H, 2F]`` with the gate and up columns
    interleaved, ``gate_up_proj_bias [E, 2F]`` so, ``down_proj [E, F, H]``, ``down_proj_bias``) in
    fusedpar's :class:`~fusedpar.nn.MoE` layout (``w1 [E, 2F, H]`` gate rows first, ``b1``,
    ``w2 [E, H, F]``, ``b2``); ``name`` is HF's leaf name."""
    if name in ("gate_up_proj", "gate_up_proj_bias"):
        t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    if name in ("gate_up_proj", "down_proj"):
        t = t.transpose(1, 2)
    elif name not in ("gate_up_proj_bias", "down_proj_bias"):
        raise ValueError(f"gpt_oss_experts_from_hf: name must be one of gate_up_proj, gate_up_proj_bias, down_proj, "
                         f"down_proj_bias, got {name!r}")
    return t.contiguous()


def gpt_oss_experts_to_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`gpt_oss_experts_from_hf`: fusedpar's tensor in HF's layout of ``name``."""
    if name in ("gate_up_proj", "down_proj"):
        t = t.transpose(1, 2)
    elif name not in ("gate_up_proj_bias", "down_proj_bias"):
        raise ValueError(f"gpt_oss_experts_to_hf: name must be one of gate_up_proj, gate_up_proj_bias, down_proj, "
                         f"down_proj_bias, got {name!r}")
    if name in ("gate_up_proj", "gate_up_proj_bias"):
        gate, up = t.chunk(2, dim=-1)
        t = torch.stack([gate, up], dim=-1).flatten(-2)
    return t.contiguous()


def _tp_mlp(mlp: nn.Module, tp_group) -> None:
    """gate / up projections column-parallel, down projection row-parallel, in place."""
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, ColumnParallelLinear.from_linear(getattr(mlp, name), group=tp_group))
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group=tp_group)


def _head_norm_placements() -> dict[str, Placement]:
    return {"weight": Placement.replicated(sequence_sharded=True)}


def _declare_head_norms(attn: nn.Module) -> None:
    """HF's qk-norm scales (Qwen3, GLM-4.5) are shared by all heads; with the heads split over tp
    each rank's gradient covers only its own heads: declared "replicated", summed over tp by
    :func:`fusedpar.parallel.sync_gradients`."""
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if isinstance(norm, nn.Module):
            norm.placements = _head_norm_placements


def _tp_projection_norm(norm: nn.Module, tp_group) -> RMSNorm:
    """OLMo 2's q / k norm (an RMSNorm over the whole projection) for a column-parallel
    projection: this rank's slice of the scales, the statistics reduced over ``tp_group``."""
    weight = norm.weight.detach()
    out = RMSNorm(weight.shape[0], float(norm.variance_epsilon), feature_group=tp_group, device="meta")
    out.weight = nn.Parameter(out.placements()["weight"].local_from_full(weight))
    return out


def _moe_block(block: nn.Module, config, tp_group, ep_group) -> HFMoEBlock:
    model_type = config_field(config, "model_type")
    gpt_oss = model_type == "gpt_oss"
    gate, experts = (block.router if gpt_oss else block.gate), block.experts
    E, k = gate.weight.shape[0], config_number(config, "num_experts_per_tok", "parallelize")
    # HF's down_proj: [E, H, F] (gpt-oss: [E, F, H], stored transposed)
    H, F_ = experts.down_proj.shape[2 if gpt_oss else 1], experts.down_proj.shape[1 if gpt_oss else 2]
    norm = True if model_type == "mixtral" else bool(config_field(config, "norm_topk_prob", False))
    router = {}
    if model_type in ("glm4_moe", "deepseek_v3"):  # sigmoid group-limited routing with the correction bias
        router = dict(score="sigmoid", n_group=config_number(config, "n_group", "parallelize", default=1),
                      topk_group=config_number(config, "topk_group", "parallelize", default=None), score_bias=True,
                      routed_scaling_factor=config_number(config, "routed_scaling_factor", "parallelize", kind=float,
                                                          default=1.0))
    if gpt_oss:  # biased router, softmax over the top-k logits; biased experts with the clamped SwiGLU
        norm = False
        router = dict(score="softmax_topk", router_bias=True, expert_bias=True, activation="swiglu_oai")
    moe = MoE(MoEConfig(H, F_, E, k, normalize=norm, aux_loss_coef=0.0, z_loss_coef=0.0, **router),
              ep_group=ep_group, replicated_group=tp_group, device="meta")
    placements = moe.placements()  # this rank's experts
    hf_names = {"w1": "gate_up_proj", "w2": "down_proj"}
    if gpt_oss:
        hf_names.update(b1="gate_up_proj_bias", b2="down_proj_bias")
    with torch.no_grad():
        for name, hf_name in hf_names.items():
            t = getattr(experts, hf_name).detach()
            t = gpt_oss_experts_from_hf(hf_name, t) if gpt_oss else t
            setattr(moe, name, nn.Parameter(placements[name].local_from_full(t).clone()))
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)  # Qwen2-MoE / GLM, DSv3
    if shared is not None and tp_group is not None:
        _tp_mlp(shared, tp_group)
    return HFMoEBlock(moe, gate, shared, getattr(block, "shared_expert_gate", None),
                      router_name="router" if gpt_oss else "gate", returns_scores=gpt_oss)


def _tp_mla(attn: nn.Module, config, tp_group) -> None:
    """DeepSeek-V3's multi-head latent attention over tp, in place: the up projections
    (``q_b_proj``, or ``q_proj`` without a query latent, and ``kv_b_proj``) column-parallel over
    the heads (HF reshapes with ``-1`` heads), ``o_proj`` row-parallel; the down projections and
    the latent norms stay whole (their inputs and outputs are replicated), ``kv_a_proj_with_mqa``
    summing the shared rotary key's gradient over tp (:class:`SharedRotaryKeyProjection`)."""
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        lin = getattr(attn, name, None)
        if lin is not None:
            setattr(attn, name, _LatentColumnParallelLinear.from_linear(lin, group=tp_group))
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group=tp_group)
    attn.kv_a_proj_with_mqa = SharedRotaryKeyProjection(
        attn.kv_a_proj_with_mqa, config_number(config, "kv_lora_rank", "parallelize"), tp_group)


def _tp_sinks(attn: nn.Module, tp_group) -> None:
    """gpt-oss's sinks (one logit per head) for this rank's heads, declared a tp block."""
    placement = Placement.tp(tp_group, 0)
    attn.sinks = nn.Parameter(placement.local_from_full(attn.sinks.detach()).clone())
    attn.placements = lambda: {"sinks": placement}


def _check_swiglu(config) -> None:
    """gpt-oss's clamped SwiGLU must have fusedpar's constants (those of the ``swiglu_oai`` kernels)."""
    for field, value in (("swiglu_alpha", SWIGLU_OAI_ALPHA), ("swiglu_limit", SWIGLU_OAI_LIMIT)):
        got = config_field(config, field, value)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or float(got) != value:
            raise ValueError(f"parallelize: gpt_oss field {field} must be {value} (the clamped SwiGLU of fusedpar's "
                             f"kernels), got {got!r}")


def _sequence_parallel(sp_group, sp_mode, layout, ulysses_group, ring_group) -> SequenceParallel | None:
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"parallelize: layout must be 'zigzag' or 'contiguous', got {layout!r}")
    if (ulysses_group is None) != (ring_group is None):
        raise ValueError("parallelize: hybrid sequence parallelism needs both ulysses_group and ring_group")
    if ulysses_group is not None:
        if sp_group is not None:
            raise ValueError("parallelize: pass sp_group or ulysses_group + ring_group, not both")
        return SequenceParallel("hybrid", layout, None, ulysses_group, ring_group)
    if sp_group is None or comm.group_size(sp_group) == 1:
        return None
    if sp_mode not in ("ring", "ulysses"):
        raise ValueError(f"parallelize: sp_mode must be 'ring' or 'ulysses', got {sp_mode!r}")
    return SequenceParallel(sp_mode, layout, sp_group)


def _enable_sequence_parallel(hf_model, sp: SequenceParallel) -> None:
    from transformers import AttentionInterface  # only route B with sequence parallelism needs transformers

    AttentionInterface.register(ATTN_IMPLEMENTATION, sequence_parallel_attention)
    hf_model.config._attn_implementation = ATTN_IMPLEMENTATION
    base = hf_model.model
    base.fusedpar_sp = sp
    base.register_forward_pre_hook(_sp_pre_hook, with_kwargs=True)
    for layer in base.layers:
        layer.self_attn.fusedpar_sp = sp


def parallelize(hf_model: nn.Module, *, tp_group=None, ep_group=None, sp_group=None, sp_mode: str = "ring",
                layout: str = "zigzag", ulysses_group=None, ring_group=None) -> nn.Module:
    """Make a Hugging Face decoder (the families of :data:`SUPPORTED_MODEL_TYPES`) parallel in
    place and return it. A group left ``None`` turns its dimension off (unlike :func:`from_hf`).

    * ``tp_group``: q / k / v and gate / up projections become
      :class:`~fusedpar.nn.ColumnParallelLinear`, o / down projections
      :class:`~fusedpar.nn.RowParallelLinear` (activations replicated over ``tp_group``);
      gpt-oss's sinks keep this rank's heads; DeepSeek-V3's MLA splits its up projections
      (``q_b_proj`` / ``q_proj``, ``kv_b_proj``) over the heads and keeps its down projections and
      latent norms whole.
    * ``ep_group``: sparse MoE blocks become :class:`HFMoEBlock` with the experts split over
      ``ep_group`` (which may span the tp ranks: tokens replicated over ``tp_group`` reach each
      expert once). HF's router is kept: ``output_router_logits`` and the aux loss work.
    * ``sp_group`` (``sp_mode`` "ring" with ``layout`` "zigzag" / "contiguous", or "ulysses"), or
      ``ulysses_group`` + ``ring_group`` (hybrid): attention runs through
      :func:`sequence_parallel_attention` (registered with transformers as
      :data:`ATTN_IMPLEMENTATION`). Each rank then feeds its shard of the sequence
      (:func:`shard_batch`; ``position_ids`` default to the shard's, and are checked when given)
      and gets that shard's logits; no padding mask, no KV cache.

    Embedding, norms, router and head stay replicated. Gradients: whole on each rank over its
    tokens; reduce them with ``fusedpar.parallel.sync_gradients(model.named_parameters(), state,
    gradient_sync_plan(model))`` (a no-op without sp / dp)."""
    config = hf_model.config
    model_type = config_field(config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"parallelize: model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    sp = _sequence_parallel(sp_group, sp_mode, layout, ulysses_group, ring_group)
    tp = comm.group_size(tp_group) if tp_group is not None else 1
    heads = config_number(config, "num_attention_heads", "parallelize")
    kv = config_number(config, "num_key_value_heads", "parallelize", default=0)
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv or heads)):
        if n % tp:
            raise ValueError(f"parallelize: {what}={n} must be divisible by the tensor-parallel group size ({tp})")
    if model_type == "gpt_oss":
        _check_swiglu(config)
    tp_group = tp_group if tp > 1 else None
    for layer in hf_model.model.layers:
        attn = layer.self_attn
        if tp_group is not None and model_type == "deepseek_v3":
            _tp_mla(attn, config, tp_group)
        elif tp_group is not None:
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), group=tp_group))
            attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group=tp_group)
            _declare_head_norms(attn)
            if model_type == "olmo2":  # its q / k norms span the whole projection, now split over tp
                attn.q_norm, attn.k_norm = (_tp_projection_norm(n, tp_group) for n in (attn.q_norm, attn.k_norm))
            if isinstance(getattr(attn, "sinks", None), nn.Parameter):  # gpt-oss: one sink logit per head
                _tp_sinks(attn, tp_group)
        if hasattr(layer.mlp, "experts") and ep_group is not None:
            layer.mlp = _moe_block(layer.mlp, config, tp_group, ep_group)
        elif tp_group is not None and not hasattr(layer.mlp, "experts"):  # (no ep_group: HF's MoE block stays)
            _tp_mlp(layer.mlp, tp_group)
    if sp is not None:
        _enable_sequence_parallel(hf_model, sp)
    return hf_model


def gradient_sync_plan(hf_model: nn.Module) -> dict[str, str]:
    """Parameter name -> gradient kind for :func:`fusedpar.parallel.sync_gradients` of a model
    :func:`parallelize` made parallel, read from the placements of its fusedpar modules
    (``"expert"`` for the experts of :class:`HFMoEBlock`); Hugging Face's own modules are
    ``"dense"``: every rank of a tp group sees all of its tokens, so even the replicated
    embedding, norms and router hold whole gradients (nothing to sum over tp)."""
    return placement_gradient_sync_plan(hf_model, default=Placement.replicated(sequence_sharded=False))
