"""Mixture-of-experts modules: :class:`TopKRouter` and :class:`MoE` (dropless or capacity, EP)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from ..kernels.checks import check_choice, check_divisible, check_int
from ..kernels.runtime import ACTIVATIONS
from ..ops import comm
from .groups import check_divides, group_arg
from .placement import Placement
from ..ops.moe import moe_mlp
from ..ops.tensor_parallel import gather_features, scatter_features
from ..ops.transport import get_transport

__all__ = ["TopKRouter", "RouterOutput", "MoE", "SharedExpertGate", "hf_load_balancing_loss"]

_SCORES = ("softmax", "sigmoid")


class RouterOutput(NamedTuple):
    weights: torch.Tensor  # [T, k] fp32 combine weights
    expert_ids: torch.Tensor  # [T, k] int64, best first; ties -> lowest expert id
    capacity: int | None  # slots per expert kept (None: dropless)
    aux_loss: torch.Tensor  # aux_loss_coef * load-balancing loss (scalar, fp32)
    z_loss: torch.Tensor  # z_loss_coef * router z-loss (scalar, fp32)


class TopKRouter(nn.Module):
    """Linear gate + top-k selection with the two standard auxiliary losses.

    ``score="softmax"``: probabilities ``softmax(logits)``; the combine weights are the top-k
    probabilities (renormalised to sum to 1 when ``normalize=True``; default False).
    ``score="sigmoid"``: scores ``sigmoid(logits)``, top-k of them, renormalised by default.

    Losses (computed in fp32 over this call's tokens; both already multiplied by their
    coefficient and stored as ``self.aux_loss`` / ``self.z_loss`` and in the returned tuple, so a
    training loop adds them to its loss):

    * load balancing (Switch / GShard): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
      ``T*k`` routed slots that chose expert ``e`` (before any capacity drop; no gradient) and
      ``P_e`` the mean over tokens of the expert's probability (sigmoid: the scores normalised
      per token). ``f`` and ``P`` each sum to 1 over experts, so uniform routing gives 1.
    * z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``.

    ``self.balance_stats`` keeps ``(counts [E], prob_sum [E], T)`` of the last call (top-k
    assignments per expert, no gradient; the sum over tokens of the probabilities) for losses
    pooled over several layers, e.g. Hugging Face's :func:`hf_load_balancing_loss`.

    Ties in the scores are broken deterministically towards the lowest expert id (stable sort).
    ``capacity_factor`` ``c`` gives ``capacity = ceil(c * T * k / E)`` slots per expert.
    ``sequence_sharded``: the tokens it routes are this rank's sequence shard of its tensor-parallel
    group's (as in a :class:`~fusedpar.nn.Transformer`; its weight's gradient is then partial over
    tp), or all of them (``False``: a replicated-token layer).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 aux_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3, capacity_factor: float | None = None,
                 normalize: bool | None = None, sequence_sharded: bool = True, device=None, dtype=None):
        super().__init__()
        check_int("hidden_size", hidden_size, min_value=1)
        check_int("num_experts", num_experts, min_value=1)
        check_int("top_k", top_k, min_value=1)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts ({num_experts}), got {top_k}")
        check_choice("score", score, _SCORES)
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be None or a number > 0, got {capacity_factor!r}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.score = score
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.capacity_factor = capacity_factor
        self.normalize = (score == "sigmoid") if normalize is None else bool(normalize)
        self.sequence_sharded = bool(sequence_sharded)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.aux_loss = None
        self.z_loss = None
        self.balance_stats = None
        self.reset_parameters()

    def placements(self) -> dict[str, Placement]:
        return {"weight": Placement.replicated(sequence_sharded=self.sequence_sharded)}

    def reset_parameters(self):
        bound = 1.0 / math.sqrt(self.hidden_size)
        nn.init.uniform_(self.weight, -bound, bound)

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return int(math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., hidden_size={self.hidden_size}], got {getattr(x, 'shape', x)}")
        x2d = x.reshape(-1, self.hidden_size)
        T, E, k = x2d.shape[0], self.num_experts, self.top_k
        logits = x2d.float() @ self.weight.float().t()
        if self.score == "softmax":
            probs = torch.softmax(logits, dim=-1)
            scores = probs
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        # stable descending sort: among equal scores the lower expert id comes first
        top, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
        weights, ids = top[:, :k], ids[:, :k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if T:
            counts = torch.zeros(E, device=x.device, dtype=torch.float32).index_add_(
                0, ids.reshape(-1), torch.ones(T * k, device=x.device, dtype=torch.float32))
            f = counts / (T * k)
            aux = E * (f * probs.mean(dim=0)).sum()
            z = torch.logsumexp(logits, dim=-1).pow(2).mean()
            self.balance_stats = (counts, probs.sum(dim=0), T)
        else:  # no tokens: zero losses that still belong to the graph
            aux = z = logits.sum() * 0.0
            self.balance_stats = (torch.zeros(E, device=x.device), probs.sum(dim=0), 0)
        self.aux_loss = self.aux_loss_coef * aux
        self.z_loss = self.z_loss_coef * z
        return RouterOutput(weights, ids, self.capacity(T), self.aux_loss, self.z_loss)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score={self.score!r}, capacity_factor={self.capacity_factor}")


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


class SharedExpertGate(nn.Module):
    """``sigmoid(x @ weight^T)`` ``[..., 1]``: the gate of Qwen2-MoE's shared expert (``weight``
    ``[1, hidden_size]``, replicated)."""

    def __init__(self, hidden_size: int, *, device=None, dtype=None):
        super().__init__()
        check_int("hidden_size", hidden_size, min_value=1)
        self.weight = nn.Parameter(torch.empty(1, hidden_size, device=device, dtype=dtype))
        nn.init.uniform_(self.weight, -1.0 / math.sqrt(hidden_size), 1.0 / math.sqrt(hidden_size))

    def placements(self) -> dict[str, Placement]:
        """Replicated; it gates the block's sequence-sharded tokens, so its gradient is partial."""
        return {"weight": Placement.replicated(sequence_sharded=True)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.weight.t())


class MoE(nn.Module):
    """Routed expert MLP: ``y[t] = sum_j w[t, j] * W2_e act(W1_e x[t])`` over the top-k experts.

    Dropless by default. With ``capacity_factor`` each expert keeps at most
    ``ceil(capacity_factor * T * k / E)`` of this rank's ``T`` tokens' slots, the earliest in
    token order; a dropped slot contributes zero (its token keeps its other slots).

    Expert parallelism: the experts are split over ``ep_group`` (rank ``r`` holds experts
    ``r * E/ep .. (r+1) * E/ep - 1``); tokens travel by all-to-all-v, the dispatch pipelined over
    ``num_chunks`` chunks (:func:`fusedpar.ops.moe_mlp`). ``transport``: a
    :class:`fusedpar.ops.transport.Transport` instead of ``ep_group`` (not both), e.g. an
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

    After ``forward``, ``self.aux_loss`` holds the router's coefficient-weighted load-balancing
    plus z-loss (scalar) and ``self.router_output`` the routing decision.
    Weights: ``w1 [E_local, 2F, H]`` (gate rows, then up rows, for gated activations; ``[E_local,
    F, H]`` otherwise) and ``w2 [E_local, H, F]``; the router's ``weight [E, H]`` is replicated.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *, ep_group=None,
                 transport=None, capacity_factor: float | None = None, activation: str = "swiglu",
                 score: str = "softmax", aux_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3,
                 normalize: bool | None = None, num_chunks: int = 2, replicated_group=None, device=None,
                 dtype=None):
        super().__init__()
        check_int("ffn_hidden_size", ffn_hidden_size, min_value=1)
        check_int("num_chunks", num_chunks, min_value=1)
        if activation not in ACTIVATIONS or activation == "none":
            raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATIONS if a != 'none')}, "
                             f"got {activation!r}")
        self.router = TopKRouter(hidden_size, num_experts, top_k, score=score, aux_loss_coef=aux_loss_coef,
                                 z_loss_coef=z_loss_coef, capacity_factor=capacity_factor, normalize=normalize,
                                 sequence_sharded=replicated_group is None, device=device, dtype=dtype)
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
        self.replicated_group = replicated_group
        self.aux_loss = None
        self.router_output = None
        self.reset_parameters(router=False)

    def placements(self) -> dict[str, Placement]:
        """Experts over the ep group (the router declares its own weight)."""
        experts = Placement.ep(self.ep_group)
        return {"w1": experts, "w2": experts}

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.experts_per_rank

    @torch.no_grad()
    def reset_parameters(self, router: bool = True):
        if router:
            self.router.reset_parameters()
        base = int(torch.randint(0, 2**62, (1,)).item())
        for i in range(self.experts_per_rank):
            g = torch.Generator().manual_seed(base + 2 * (self.first_expert + i))
            b1 = 1.0 / math.sqrt(self.hidden_size)
            self.w1[i].copy_(torch.empty(self.w1.shape[1:]).uniform_(-b1, b1, generator=g))
            g = torch.Generator().manual_seed(base + 2 * (self.first_expert + i) + 1)
            b2 = 1.0 / math.sqrt(self.ffn_hidden_size)
            self.w2[i].copy_(torch.empty(self.w2.shape[1:]).uniform_(-b2, b2, generator=g))

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
                       num_chunks=self.num_chunks)

    def _forward_replicated(self, x):
        """Every rank routes all (replicated) tokens; the ``T * k`` routed slots are split over
        ``replicated_group``, each rank runs its share through the experts unweighted, the slot
        outputs are all-gathered and combined with the routing weights on every rank. Backward:
        the share of the replicated slot gradient (experts see each slot once), the input gradient
        of the slots all-gathered; router and combine gradients are whole on every rank."""
        if self.router.capacity_factor is not None:
            raise ValueError("MoE: replicated_group does not support capacity_factor (dropless only)")
        x2d = x.reshape(-1, self.hidden_size)
        r = self.router(x2d)
        self.router_output = r
        self.aux_loss = r.aux_loss + r.z_loss
        T, k = r.expert_ids.shape
        n = comm.group_size(self.replicated_group)
        check_divisible("MoE: number of routed slots (tokens * top_k)", T * k, n, "the size of replicated_group")
        slots = scatter_features(x2d.repeat_interleave(k, dim=0).t().contiguous(), self.replicated_group).t()
        ids = r.expert_ids.reshape(-1, 1).chunk(n)[comm.group_rank(self.replicated_group)]
        ones = torch.ones(ids.shape, device=x.device, dtype=torch.float32)
        y = moe_mlp(slots.contiguous(), ids.contiguous(), ones, self.w1, self.w2, num_experts=self.num_experts,
                    transport=self.transport, capacity=None, activation=self.activation, num_chunks=self.num_chunks)
        y = gather_features(y.t().contiguous(), self.replicated_group).t().reshape(T, k, self.hidden_size)
        return (r.weights.unsqueeze(-1) * y.float()).sum(dim=1).to(x.dtype).reshape(x.shape)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, ep={self.ep_size} ({self.transport.name}), "
                f"activation={self.activation!r}, experts_per_rank={self.experts_per_rank}")
