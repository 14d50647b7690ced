"""Mixture-of-experts modules: :class:`TopKRouter` and :class:`MoE` (dropless or capacity, EP)."""
from __future__ import annotations

import contextlib
import math
import threading
from typing import NamedTuple

import torch
from torch import nn

from ..kernels.checks import check_bool, check_choice, check_divisible, check_int
from ..kernels.fp8_gemm import FP8_RECIPES
from ..kernels.moe_topk import SCORE_FUNCS, check_routing_config
from ..kernels.runtime import ACTIVATIONS
from ..ops import comm
from .config import MoEConfig, module_config
from .groups import check_divides, group_arg
from .linear import check_module_fp8_device
from .placement import Placement
from fusedpar.ops.moe.api import moe_mlp, moe_route
from fusedpar.ops.tensor_parallel.api import gather_features, scatter_features
from fusedpar.ops.comm.transport import get_transport

__all__ = ["TopKRouter", "RouterOutput", "RouterLoad", "MoE", "max_violation", "sum_over_groups", "SharedExpertGate",
           "hf_load_balancing_loss", "recomputation_contexts"]

_SCORES = tuple(SCORE_FUNCS)  # softmax, sigmoid, softmax_topk


class _Recomputing(threading.local):
    active = False


_RECOMPUTING = _Recomputing()


@contextlib.contextmanager
def _recomputing():
    previous, _RECOMPUTING.active = _RECOMPUTING.active, True
    try:
        yield
    finally:
        _RECOMPUTING.active = previous


def recomputation_contexts():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: during
    the recomputation of a checkpointed region the routers do not count their tokens again (the
    step's loads, and the aux-free bias update read from them, would double)."""
    return contextlib.nullcontext(), _recomputing()


class RouterOutput(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32 combine weights
    expert_ids: torch.Tensor  # [T, k] int64, best first; ties -> lowest expert id
    capacity: int | None  # slots per expert kept (None: dropless)
    aux_loss: torch.Tensor  # aux_loss_coef * load-balancing loss + seq_aux_loss_coef * sequence-wise loss (fp32)
    z_loss: torch.Tensor  # z_loss_coef * router z-loss (scalar, fp32)


class RouterLoad(NamedTuple):
    """The routing load of one router over one training step (all its forwards since the last
    :meth:`TopKRouter.update_bias`), summed over the ranks given to the update."""
    counts: torch.Tensor  # [E] int64: routed slots per expert (before capacity drops)
    max_violation: float  # max_e counts_e / mean(counts) - 1 (0: perfectly balanced)


def _number(name: str, v, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if positive else v >= 0):
        raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def _cpu_uniform(shape, bound: float) -> torch.Tensor:
    """``U(-bound, bound)`` fp32 values drawn from torch's global CPU generator (the initial
    weights must not depend on the device: a parameter's own ``uniform_`` on a GPU would draw from
    the GPU's generator, which ``Transformer(seed=...)`` does not seed)."""
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound)


def max_violation(counts: torch.Tensor) -> float:
    """``max_e counts_e / mean_e counts_e - 1`` (DeepSeek-V3's MaxVio; 0 when nothing was routed)."""
    total = int(counts.sum())
    return 0.0 if total == 0 else float(counts.max()) * counts.numel() / total - 1.0


class TopKRouter(nn.Module):
    """Linear gate + top-k selection (the routing kernel, :func:`fusedpar.ops.moe_route`) with
    the standard auxiliary losses and DeepSeek-V3's auxiliary-loss-free load balancing.

    Scores (``score``): ``"softmax"`` (``softmax(logits)``), ``"sigmoid"`` (``sigmoid(logits)``;
    DeepSeek-V3, Kimi K2, GLM-4.5) or ``"softmax_topk"`` (gpt-oss: the top-k by logit, the
    weights a softmax over the chosen logits). The combine weights are the chosen experts' scores,
    renormalised to sum to 1 when ``normalize`` (default: False for softmax, True for sigmoid),
    times ``routed_scaling_factor``. ``router_bias``: a learned ``bias [E]`` added to the logits
    (gpt-oss).

    Selection: ``n_group`` groups of consecutive experts, ranked by the sum of their two best
    scores; only the ``topk_group`` best groups are searched (DeepSeek-V3's group-limited
    routing; ``n_group=1``: all experts). ``score_bias`` / ``bias_update_rate > 0``: a buffer
    ``e_score_correction_bias [E]`` (fp32, persistent, saved in checkpoints) is added to the scores
    for the selection only; :meth:`update_bias` moves it by ``bias_update_rate * sign(mean load -
    load)`` after each optimizer step. Ties go to the lowest expert (group) id.

    Losses (fp32, over this call's tokens; already multiplied by their coefficient and stored as
    ``self.aux_loss`` / ``self.z_loss`` and in the returned tuple):

    * load balancing (Switch / GShard): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
      ``T*k`` routed slots that chose expert ``e`` (no gradient) and ``P_e`` the mean over tokens of
      the expert's probability (sigmoid: the scores normalised per token);
    * sequence-wise balance (DeepSeek-V3, ``seq_aux_loss_coef``): the same ``E * sum_e f_e P_e``
      computed per sequence (``x [..., S, H]``: the rows of the last-but-one dimension; a 2-D ``x``
      is one sequence) and averaged over sequences; added to ``aux_loss``;
    * z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``.

    ``self.balance_stats`` keeps ``(counts [E], prob_sum [E], T)`` of the last call for losses
    pooled over layers (:func:`hf_load_balancing_loss`). ``self.tokens_per_expert`` (int64 ``[E]``)
    accumulates the routed slots of the training forwards (``self.training`` and gradients on)
    since the last :meth:`update_bias`. ``capacity_factor`` ``c`` gives ``capacity = ceil(c * T * k /
    E)`` slots per expert. ``sequence_sharded``: the tokens are this rank's sequence shard of its
    tensor-parallel group's (the weight's gradient is partial over tp), or all of them (``False``).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 aux_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3, capacity_factor: float | None = None,
                 normalize: bool | None = None, sequence_sharded: bool = True, routed_scaling_factor: float = 1.0,
                 n_group: int = 1, topk_group: int | None = None, score_bias: bool = False,
                 bias_update_rate: float = 0.0, seq_aux_loss_coef: float = 0.0, router_bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        check_int("hidden_size", hidden_size, min_value=1)
        check_int("num_experts", num_experts, min_value=1)
        check_int("top_k", top_k, min_value=1)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")
        check_choice("score", score, _SCORES)
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be None or a number > 0, got {capacity_factor!r}")
        self.topk_group = check_routing_config(num_experts, top_k, score=score, n_group=n_group,
                                               topk_group=topk_group, scale=routed_scaling_factor)
        self.bias_update_rate = _number("bias_update_rate", bias_update_rate)
        self.seq_aux_loss_coef = _number("seq_aux_loss_coef", seq_aux_loss_coef)
        for name, v in (("score_bias", score_bias), ("router_bias", router_bias)):
            check_bool(name, v)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.score, self.n_group, self.routed_scaling_factor = score, n_group, float(routed_scaling_factor)
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.capacity_factor = capacity_factor
        self.normalize = (score == "sigmoid") if normalize is None else bool(normalize)
        self.sequence_sharded = bool(sequence_sharded)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if router_bias else None
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device, dtype=torch.float32)
                             if score_bias or self.bias_update_rate > 0 else None)
        self.tokens_per_expert = None  # int64 [E] on the logits' device, made by the first training forward
        self.aux_loss = None
        self.z_loss = None
        self.balance_stats = None
        self.reset_parameters()

    def placements(self) -> dict[str, Placement]:
        p = Placement.replicated(sequence_sharded=self.sequence_sharded)
        return {"weight": p, "bias": p} if self.bias is not None else {"weight": p}

    def checkpoint_buffers(self) -> tuple[str, ...]:
        """Buffers that checkpoints save and restore (replicated: identical on every rank)."""
        return ("e_score_correction_bias",) if self.e_score_correction_bias is not None else ()

    @torch.no_grad()
    def reset_parameters(self):
        """``weight ~ U(-1/sqrt(H), 1/sqrt(H))`` drawn from torch's global *CPU* generator whatever
        the device, then copied (as every fusedpar layer): the same seed gives the same router on
        CPU and on a GPU, whose generator a seeded model build leaves alone. On ``meta`` nothing
        is drawn (no values exist there)."""
        if self.weight.device.type != "meta":
            self.weight.copy_(_cpu_uniform(self.weight.shape, 1.0 / math.sqrt(self.hidden_size)))
        if self.bias is not None:
            self.bias.zero_()

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return int(math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., hidden_size={self.hidden_size}], got {getattr(x, 'shape', x)}")
        x2d = x.reshape(-1, self.hidden_size)
        with torch.autocast(x2d.device.type, enabled=False):  # fp32 logits under autocast too
            logits = x2d.float() @ self.weight.float().t()
        if self.bias is not None:
            logits = logits + self.bias.float()
        weights, ids = moe_route(logits, self.top_k, score=self.score, bias=self.e_score_correction_bias,
                                 n_group=self.n_group, topk_group=self.topk_group, normalize=self.normalize,
                                 scale=self.routed_scaling_factor)
        aux, z = self._losses(logits, ids, x.shape[-2] if x.dim() > 2 else x2d.shape[0])
        self.aux_loss = self.aux_loss_coef * aux[0] + (self.seq_aux_loss_coef * aux[1] if self.seq_aux_loss_coef
                                                       else 0.0)
        self.z_loss = self.z_loss_coef * z
        return RouterOutput(weights, ids, self.capacity(x2d.shape[0]), self.aux_loss, self.z_loss)

    def _losses(self, logits, ids, seq_len: int):
        """``((balance loss, sequence-wise balance loss), z-loss)``, unscaled; keeps the counts."""
        T, E, k = logits.shape[0], self.num_experts, self.top_k
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(logits, dim=-1)
        counts = torch.zeros(E, device=logits.device, dtype=torch.float32).index_add_(
            0, ids.reshape(-1), torch.ones(T * k, device=logits.device, dtype=torch.float32))
        if self.training and torch.is_grad_enabled() and not _RECOMPUTING.active:
            self._count(counts)
        self.balance_stats = (counts, probs.sum(dim=0), T)
        if not T:  # no tokens: zero losses that still belong to the graph
            zero = logits.sum() * 0.0
            return (zero, zero), zero
        aux = E * (counts / (T * k) * probs.mean(dim=0)).sum()
        seq = aux * 0.0
        if self.seq_aux_loss_coef:
            S = seq_len if seq_len and T % seq_len == 0 else T
            per_seq = torch.zeros(T // S, E, device=logits.device, dtype=torch.float32).scatter_add_(
                1, ids.reshape(T // S, S * k), torch.ones(T // S, S * k, device=logits.device))
            seq = (E * (per_seq / (S * k) * probs.view(T // S, S, E).mean(dim=1)).sum(dim=-1)).mean()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return (aux, seq), z

    @torch.no_grad()
    def _count(self, counts: torch.Tensor) -> None:
        if self.tokens_per_expert is None or self.tokens_per_expert.device != counts.device:
            self.tokens_per_expert = torch.zeros(self.num_experts, device=counts.device, dtype=torch.int64)
        self.tokens_per_expert += counts.to(torch.int64)

    def step_counts(self) -> torch.Tensor:
        """``tokens_per_expert``: the routed slots per expert since the last update (int64 ``[E]``,
        zeros before the first training forward), on this rank."""
        if self.tokens_per_expert is None:
            device = self.weight.device if self.weight.device.type != "meta" else "cpu"
            self.tokens_per_expert = torch.zeros(self.num_experts, device=device, dtype=torch.int64)
        return self.tokens_per_expert

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor | None = None) -> RouterLoad:
        """Apply DeepSeek-V3's bias update from ``counts`` (``[E]``, the routed slots per expert over
        the step, summed over every rank that routes different tokens: default this router's own
        ``tokens_per_expert``): ``e_score_correction_bias += bias_update_rate * sign(mean(counts) -
        counts)`` (exact: ``sign(sum(counts) - E * counts)`` in integers, so identical counts give an
        identical bias on every rank); no change when ``bias_update_rate`` is 0. Resets
        ``tokens_per_expert``; returns the step's :class:`RouterLoad`."""
        counts = (self.step_counts() if counts is None else counts).to(torch.int64, copy=True)
        if self.bias_update_rate > 0:
            sign = torch.sign(counts.sum() - self.num_experts * counts).to(torch.float32)
            self.e_score_correction_bias += self.bias_update_rate * sign.to(self.e_score_correction_bias.device)
        self.step_counts().zero_()
        return RouterLoad(counts.detach().cpu(), max_violation(counts))

    def extra_repr(self):
        extra = "".join(f", {n}={v}" for n, v in (("n_group", self.n_group), ("topk_group", self.topk_group),
                                                   ("routed_scaling_factor", self.routed_scaling_factor),
                                                   ("bias_update_rate", self.bias_update_rate)) if v not in (1, 0.0))
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score={self.score!r}, capacity_factor={self.capacity_factor}{extra}")


def hf_load_balancing_loss(routers) -> torch.Tensor:
    """Hugging Face's Mixtral / Qwen-MoE load-balancing loss (``load_balancing_loss_func``, no
    attention mask, coefficient not applied) over the last calls of ``routers`` (TopKRouter), pooled
    over them: ``E * sum_e (n_e / T) * (P_e / T)`` with ``n_e`` the top-k assignments of expert ``e``
    and ``P_e`` its summed probability over all routers' ``T`` tokens. Over this rank's tokens."""
    stats = [r.balance_stats for r in routers if r.balance_stats is not None]
    if not stats:
        raise ValueError("hf_load_balancing_loss: no router has run a forward yet")
    E = routers[0].num_experts
    rows = sum(t for _, _, t in stats)
    counts = torch.stack([c for c, _, _ in stats]).sum(dim=0)
    probs = torch.stack([p for _, p, _ in stats]).sum(dim=0)
    return E * (counts / rows * probs / rows).sum()


def sum_over_groups(t: torch.Tensor, groups=None) -> torch.Tensor:
    """``t`` summed in place over each of ``groups`` in turn (one process group, a list of them,
    or ``None``: the default group; groups of one rank are skipped)."""
    for g in (groups if isinstance(groups, (list, tuple)) else [groups]):
        if comm.group_size(g) > 1:
            comm.all_reduce(t, g).wait()
    return t


class SharedExpertGate(nn.Module):
    """``sigmoid(x @ weight^T)`` ``[..., 1]``: the gate of Qwen2-MoE's shared expert (``weight``
    ``[1, hidden_size]``, replicated)."""

    def __init__(self, hidden_size: int, *, device=None, dtype=None):
        super().__init__()
        check_int("hidden_size", hidden_size, min_value=1)
        self.weight = nn.Parameter(torch.empty(1, hidden_size, device=device, dtype=dtype))
        if self.weight.device.type != "meta":  # drawn on the CPU generator, as TopKRouter.reset_parameters
            with torch.no_grad():
                self.weight.copy_(_cpu_uniform(self.weight.shape, 1.0 / math.sqrt(hidden_size)))

    def placements(self) -> dict[str, Placement]:
        """Replicated; it gates the block's sequence-sharded tokens, so its gradient is partial."""
        return {"weight": Placement.replicated(sequence_sharded=True)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.weight.t())


class MoE(nn.Module):
    """Routed expert MLP: ``y[t] = sum_j w[t, j] * W2_e act(W1_e x[t])`` over the top-k experts.

    ``config``: a :class:`~fusedpar.nn.config.MoEConfig` (the sizes and every option below but
    the groups, the transport, the device and the dtype, which are keyword arguments). Dropless
    by default. With ``capacity_factor`` each expert keeps at most ``ceil(capacity_factor * T * k
    / E)`` of this rank's ``T`` tokens' slots, the earliest in token order; a dropped slot contributes zero (its token keeps its other slots).

    Expert parallelism: the experts are split over ``ep_group`` (rank ``r`` holds experts
    ``r * E/ep .. (r+1) * E/ep - 1``); tokens travel by all-to-all-v, the dispatch pipelined over
    ``num_chunks`` chunks (:func:`fusedpar.ops.moe_mlp`). ``transport``: a
    :class:`fusedpar.ops.Transport` instead of ``ep_group`` (not both), e.g. an
    ``EmulatedTransport`` to run one rank of an EP layer in one process. The full expert weights
    do not depend on the EP degree: a base seed drawn from torch's global generator (identical on
    all ranks when they share a seed) and the global expert index seed each expert's generator.
    An omitted ``ep_group`` is the default (world) group, as everywhere in fusedpar (a group of one
    rank keeps every expert here); ``num_experts`` must divide its size, else one ``ValueError``
    names the group and its ranks. Whether the ep group stays inside one pipeline stage is the
    layout's to ensure (:func:`fusedpar.parallel.build_parallel_state` builds it so).

    ``replicated_group``: a group whose ranks hold the *same* tokens (e.g. a tensor-parallel group
    without sequence parallelism, as inside a Hugging Face model). Every rank routes all tokens,
    but only its ``1/n`` share of the ``T * k`` routed slots goes through the experts (unweighted;
    the count must divide) and the slot outputs are all-gathered and combined on every rank, so
    each slot reaches its expert once and the expert gradients are exact (without it they are ``n``
    times too large whenever the ep group spans those ranks). Router, input and combine gradients
    are whole and identical on every rank of the group (nothing to reduce); dropless only.

    Router options (:class:`TopKRouter`): ``score`` (``"softmax"``, ``"sigmoid"``,
    ``"softmax_topk"``), ``normalize``, ``routed_scaling_factor``, ``n_group`` / ``topk_group``,
    ``score_bias`` / ``bias_update_rate`` (auxiliary-loss-free balancing: call :meth:`update_bias`
    after each optimizer step), ``seq_aux_loss_coef``, ``router_bias``.

    After ``forward``, ``self.aux_loss`` holds the router's coefficient-weighted load-balancing
    plus z-loss (scalar) and ``self.router_output`` the routing decision.
    Weights: ``w1 [E_local, 2F, H]`` (gate rows, then up rows, for gated activations; ``[E_local,
    F, H]`` otherwise) and ``w2 [E_local, H, F]``; the router's ``weight [E, H]`` is replicated.
    ``expert_bias=True`` (gpt-oss) adds ``b1 [E_local, 2F]`` (gate then up) and ``b2 [E_local, H]``,
    split over ep like the weights, initialised to zeros: ``MLP_e(x) = act(x W1_e^T + b1_e) W2_e^T
    + b2_e``. gpt-oss itself: ``activation="swiglu_oai"``, ``score="softmax_topk"``,
    ``router_bias=True``; its ``gate_up_proj [E, H, 2F]`` interleaves gate and up columns, so
    ``w1 = cat(gate_up_proj[..., ::2], gate_up_proj[..., 1::2], -1).transpose(1, 2)``, ``b1`` the
    same split of ``gate_up_proj_bias``, ``w2 = down_proj.transpose(1, 2)``, ``b2 = down_proj_bias``.

    ``fp8="rowwise"`` / ``"blockwise"`` (or :meth:`set_fp8`): the experts in fp8
    (:func:`fusedpar.ops.moe_mlp`'s ``fp8``: tokens dispatched as e4m3 + scales, fp8 expert GEMMs,
    outputs combined in the model's dtype; ``fp8_grad_high_precision``: the expert weight
    gradients in that dtype). A compute format: parameters, placements and checkpoints are
    unchanged; the router stays in fp32.
    """

    def __init__(self, config: MoEConfig, *, ep_group=None, transport=None, replicated_group=None, device=None,
                 dtype=None):
        super().__init__()
        self.config = c = module_config("MoE", config, MoEConfig)
        hidden_size, ffn_hidden_size, num_experts, top_k = c.hidden_size, c.ffn_hidden_size, c.num_experts, c.top_k
        activation, num_chunks, expert_bias = c.activation, c.num_chunks, c.expert_bias
        check_int("ffn_hidden_size", ffn_hidden_size, min_value=1)
        check_int("num_chunks", num_chunks, min_value=1)
        if activation not in ACTIVATIONS or activation == "none":
            raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATIONS if a != 'none')}, "
                             f"got {activation!r}")
        self.router = TopKRouter(hidden_size, num_experts, top_k, score=c.score, aux_loss_coef=c.aux_loss_coef,
                                 z_loss_coef=c.z_loss_coef, capacity_factor=c.capacity_factor, normalize=c.normalize,
                                 sequence_sharded=replicated_group is None,
                                 routed_scaling_factor=c.routed_scaling_factor, n_group=c.n_group,
                                 topk_group=c.topk_group, score_bias=c.score_bias, bias_update_rate=c.bias_update_rate,
                                 seq_aux_loss_coef=c.seq_aux_loss_coef, router_bias=c.router_bias, device=device,
                                 dtype=dtype)
        self.ep_group = ep_group
        self.transport = get_transport(transport, ep_group)
        ep = self.transport.size
        ep_arg = group_arg("ep_group", transport=self.transport, omitted=ep_group is None and transport is None)
        check_divides("MoE", "num_experts", num_experts, ep_arg, "expert-parallel")
        self.ep_size, self.ep_rank = ep, self.transport.rank
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.experts_per_rank = num_experts // ep
        self.activation, self.num_chunks = activation, num_chunks
        n1 = 2 * ffn_hidden_size if ACTIVATIONS[activation][1] else ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(self.experts_per_rank, n1, hidden_size, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(self.experts_per_rank, hidden_size, ffn_hidden_size, device=device,
                                           dtype=dtype))
        check_bool("expert_bias", expert_bias)
        self.expert_bias = expert_bias
        self.b1 = self.b2 = None
        if expert_bias:
            self.b1 = nn.Parameter(torch.zeros(self.experts_per_rank, n1, device=device, dtype=dtype))
            self.b2 = nn.Parameter(torch.zeros(self.experts_per_rank, hidden_size, device=device, dtype=dtype))
        self.replicated_group = replicated_group
        self.aux_loss = None
        self.router_output = None
        self.fp8, self.fp8_grad_high_precision, self.fp8_option = None, False, "MoE: fp8"
        self.set_fp8(c.fp8, grad_high_precision=c.fp8_grad_high_precision)
        self.reset_parameters(router=False)

    def set_fp8(self, recipe: str | None, *, grad_high_precision: bool = False, option: str = "MoE: fp8") -> None:
        """Run the experts in fp8 (``recipe`` "rowwise" / "blockwise") or in the model's dtype
        (None). ``option`` names the setting in errors (a GPU without fp8 tensor cores: checked here
        for parameters on a GPU and again in every forward)."""
        check_choice("MoE: fp8", recipe, (None,) + tuple(FP8_RECIPES))
        check_bool("fp8_grad_high_precision", grad_high_precision)
        self.fp8, self.fp8_grad_high_precision, self.fp8_option = recipe, grad_high_precision, option
        check_module_fp8_device(self, self.w1)

    def placements(self) -> dict[str, Placement]:
        """Experts over the ep group (the router declares its own weight)."""
        experts = Placement.ep(self.ep_group)
        if self.expert_bias:
            return {"w1": experts, "w2": experts, "b1": experts, "b2": experts}
        return {"w1": experts, "w2": experts}

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.experts_per_rank

    @torch.no_grad()
    def reset_parameters(self, router: bool = True):
        """Expert ``e``'s ``w1`` / ``w2`` from CPU generators seeded with a base seed (one draw of
        torch's global CPU generator) and ``e``; biases zero. On ``meta`` nothing is drawn: a
        DeepSeek-V3 layer is 1.1e10 values, minutes of CPU time for a module whose weights are
        loaded afterwards (Hugging Face import, ``to_empty``)."""
        if router:
            self.router.reset_parameters()
        if self.w1.device.type == "meta":
            return
        base = int(torch.randint(0, 2**62, (1,)).item())
        for i in range(self.experts_per_rank):
            g = torch.Generator().manual_seed(base + 2 * (self.first_expert + i))
            b1 = 1.0 / math.sqrt(self.hidden_size)
            self.w1[i].copy_(torch.empty(self.w1.shape[1:]).uniform_(-b1, b1, generator=g))
            g = torch.Generator().manual_seed(base + 2 * (self.first_expert + i) + 1)
            b2 = 1.0 / math.sqrt(self.ffn_hidden_size)
            self.w2[i].copy_(torch.empty(self.w2.shape[1:]).uniform_(-b2, b2, generator=g))
        if self.expert_bias:
            self.b1.zero_()
            self.b2.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., hidden_size={self.hidden_size}] with at least 2 dims, "
                             f"got {getattr(x, 'shape', x)}")
        if self.replicated_group is not None and comm.group_size(self.replicated_group) > 1:
            return self._forward_replicated(x)
        return self._forward_tokens(x)

    def _forward_tokens(self, x):
        r = self.router(x)
        self.router_output = r
        self.aux_loss = r.aux_loss + r.z_loss
        return moe_mlp(x, r.expert_ids, r.weights, self.w1, self.w2, num_experts=self.num_experts,
                       transport=self.transport, capacity=r.capacity, activation=self.activation,
                       num_chunks=self.num_chunks, b1=self.b1, b2=self.b2, **self._fp8_kwargs(x))

    def _fp8_kwargs(self, x) -> dict:
        check_module_fp8_device(self, x)
        return dict(fp8=self.fp8, fp8_grad_high_precision=self.fp8_grad_high_precision)

    def _forward_replicated(self, x):
        """Every rank routes all (replicated) tokens; the ``T * k`` routed slots are split over
        ``replicated_group``, each rank runs its share through the experts unweighted, the slot
        outputs are all-gathered and combined with the routing weights on every rank. Backward:
        the share of the replicated slot gradient (experts see each slot once), the input gradient
        of the slots all-gathered; router and combine gradients are whole on every rank."""
        if self.router.capacity_factor is not None:
            raise ValueError("MoE: replicated_group does not support capacity_factor (dropless only)")
        x2d = x.reshape(-1, self.hidden_size)
        r = self.router(x)
        self.router_output = r
        self.aux_loss = r.aux_loss + r.z_loss
        T, k = r.expert_ids.shape
        n = comm.group_size(self.replicated_group)
        check_divisible("MoE: number of routed slots (tokens * top_k)", T * k, n, "the size of replicated_group")
        slots = scatter_features(x2d.repeat_interleave(k, dim=0).t().contiguous(), self.replicated_group).t()
        ids = r.expert_ids.reshape(-1, 1).chunk(n)[comm.group_rank(self.replicated_group)]
        ones = torch.ones(ids.shape, device=x.device, dtype=torch.float32)
        y = moe_mlp(slots.contiguous(), ids.contiguous(), ones, self.w1, self.w2, num_experts=self.num_experts,
                    transport=self.transport, capacity=None, activation=self.activation, num_chunks=self.num_chunks,
                    b1=self.b1, b2=self.b2, **self._fp8_kwargs(x))
        y = gather_features(y.t().contiguous(), self.replicated_group).t().reshape(T, k, self.hidden_size)
        return (r.weights.unsqueeze(-1) * y.float()).sum(dim=1).to(x.dtype).reshape(x.shape)

    def update_bias(self, groups=None) -> RouterLoad:
        """After an optimizer step: sum the router's per-expert counts of the step over ``groups``
        (a process group or a list of them, each summed in turn; ``None``: the default group; ``()``:
        this rank only), then :meth:`TopKRouter.update_bias`. Pass the groups whose ranks route
        *different* tokens (in a :class:`~fusedpar.nn.Transformer`, every rank of one pipeline stage:
        ``ParallelState.data_tp_group``); counting replicated tokens several times scales every count
        alike and changes neither the update (a sign) nor the violation (a ratio). Collective over
        ``groups``; every rank ends with the same bias. Returns the step's :class:`RouterLoad`."""
        counts = self.router.step_counts().clone()
        sum_over_groups(counts, groups)
        return self.router.update_bias(counts)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, ep={self.ep_size} ({self.transport.name}), "
                f"activation={self.activation!r}, experts_per_rank={self.experts_per_rank}"
                + (", expert_bias=True" if self.expert_bias else "")
                + ("" if self.fp8 is None else f", fp8={self.fp8!r}, fp8_grad_high_precision={self.fp8_grad_high_precision}"))
