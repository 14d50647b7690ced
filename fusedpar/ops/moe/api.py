"""Mixture-of-experts dispatch, expert compute and combine with expert parallelism, the functional
API.

Stages (each differentiable, so a schedule can place them around other work): :func:`moe_route`
(scores, top-k, weights), :func:`moe_plan` (routing metadata on the device and, with ``ep > 1``,
the one count exchange and host read of the layer), :func:`moe_dispatch` (permute to expert order
and all-to-all-v), :func:`moe_expert_compute` / :func:`grouped_mlp` (two grouped GEMMs, the first
with the fused activation), :func:`moe_combine` (return and weighted sum); :func:`moe_mlp` runs
them all in one op with the chunked, overlapped EP schedule."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_bool, check_choice, check_shape, check_tensor
from fusedpar.kernels.fp8 import check_fp8_device
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.grouped_gemm import as_group_offsets
from fusedpar.kernels.moe_topk import check_routing_config
from fusedpar.ops.comm.agreement import agreed_arguments
from fusedpar.ops.comm.keys import transport_size, transport_id_of
from fusedpar.ops.comm.transport import Transport, check_transport_name, get_transport
from fusedpar.ops.common import checked_api
from fusedpar.ops.moe.custom_ops import (
    all_to_all_v_op,
    grouped_mlp_op,
    moe_mlp_op,
    moe_permute_op,
    moe_route_op,
    moe_unpermute_op,
)
from fusedpar.ops.moe.plan import MoEPlan, build_plan, check_expert_weights, check_routing, ep_fields, token_rows


def _eager_only(op: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{op} builds a MoEPlan from host-side split sizes and cannot be traced by "
                           "torch.compile; call fusedpar.ops.moe_mlp (one traceable op) inside compiled code, or "
                           "run the stage API (moe_plan / moe_dispatch / moe_expert_compute / moe_combine) eagerly")


@checked_api
def moe_plan(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, ep_group=None, transport=None,
             capacity: int | None = None, num_chunks: int = 1) -> MoEPlan:
    """Routing metadata and (``ep > 1``) the count exchange. ``capacity``: at most this many slots per
    expert from this rank's tokens, the earliest in token order; the rest are dropped. ``transport``: a
    Transport (then ``ep_group`` must be None), default portable over ``ep_group``. Reads the expert
    ids' range on the host before it returns (a sync on a GPU, also at ``ep == 1``). Eager only."""
    _eager_only("moe_plan")
    transport = get_transport(transport, ep_group)
    with agreed_arguments("moe_plan", transport, None, ep_fields(x, num_experts, num_chunks)):
        x2d = token_rows(x)
        check_routing(x2d, expert_ids, num_experts, transport.size, capacity=capacity, num_chunks=num_chunks)
    plan, pending = build_plan(x2d, expert_ids, num_experts, transport, capacity, num_chunks)
    if pending is not None:
        pending.wait()
    return plan


@checked_api
def grouped_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets, *, activation: str = "swiglu",
                b1: torch.Tensor | None = None, b2: torch.Tensor | None = None):
    """Expert MLPs over group-contiguous rows: ``y[rows_g] = act(x W1_e^T + b1_e) W2_e^T + b2_e``,
    ``e = g % E`` (the expert biases ``b1 [E, 2F]`` / ``b2 [E, H]`` are optional).

    x ``[M, H]``; w1 ``[E, 2F, H]`` (gate rows then up rows for gated activations, else
    ``[E, F, H]``); w2 ``[E, H, F]``; offsets ``[G+1]`` int tensor (on any device; its values are
    checked with one host read, inside the op) or a sequence of ints. Differentiable in x, w1, w2
    (b1, b2); rows past ``offsets[-1]`` give zeros. The op ``fusedpar::grouped_mlp``."""
    check_tensor("x", x, dims=(2,))
    check_expert_weights(x, w1, w2, activation, None, b1, b2)
    offsets = as_group_offsets(offsets, x.shape[0], x.device, check=False)
    return grouped_mlp_op(x, w1, w2, b1, b2, offsets, activation, True)[0]


@checked_api
def moe_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, ep_group=None, transport=None,
                 capacity: int | None = None):
    """Stage 1: ``(tokens, plan)``. ``tokens`` are this rank's experts' inputs, ``[R, H]``
    expert-contiguous per source rank (group offsets in ``plan.expert_offsets[0]``).
    Synchronous; :func:`moe_mlp` is the pipelined composition of the three stages. Eager only."""
    _eager_only("moe_dispatch")
    transport = get_transport(transport, ep_group)
    with agreed_arguments("moe_dispatch", transport, None, ep_fields(x, num_experts, 1)):
        x2d = token_rows(x)
        check_routing(x2d, expert_ids, num_experts, transport.size, capacity=capacity)
    plan, pending = build_plan(x2d, expert_ids, num_experts, transport, capacity, 1)
    x_perm = moe_permute_op(x2d, plan.sorted_slot, plan.slot_pos, plan.top_k)
    if pending is not None:
        pending.wait()
    if plan.ep_size == 1:
        return x_perm, plan
    kept = x_perm[: plan.num_kept]
    return all_to_all_v_op(kept, plan.num_expert_rows, plan.recv_splits[0], plan.send_splits[0],
                           plan.transport.transport_id), plan


@checked_api
def moe_expert_compute(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, plan: MoEPlan, *,
                       activation: str = "swiglu", b1: torch.Tensor | None = None,
                       b2: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: this rank's experts (``w1 [E_local, 2F, H]``, ``w2 [E_local, H, F]``, optional
    biases ``b1 [E_local, 2F]``, ``b2 [E_local, H]``) on the dispatched tokens (the first result
    of :func:`moe_dispatch` with this ``plan``)."""
    check_expert_weights(tokens, w1, w2, activation, plan.experts_per_rank, b1, b2)
    rows = plan.num_rows if plan.ep_size == 1 else plan.num_expert_rows
    if tokens.shape[0] != rows:  # the plan's offsets address exactly these rows
        raise ValueError(f"tokens must have the {rows} rows the plan dispatched, got shape {tuple(tokens.shape)}")
    return grouped_mlp_op(tokens, w1, w2, b1, b2, plan.expert_offsets[0], activation, False)[0]


@checked_api
def moe_combine(expert_out: torch.Tensor, plan: MoEPlan, weights: torch.Tensor) -> torch.Tensor:
    """Stage 3: send expert outputs back (``ep > 1``) and return ``[T, H]`` with
    ``out[t] = sum_j weights[t, j] * expert_out_of_slot(t, j)`` (fp32 sum; dropped slots add 0)."""
    check_tensor("weights", weights)
    check_shape("weights", weights, (plan.num_tokens, plan.top_k))
    y = expert_out
    if plan.ep_size > 1:
        y = all_to_all_v_op(expert_out, plan.num_kept, plan.send_splits[0], plan.recv_splits[0], plan.transport.transport_id)
    return moe_unpermute_op(y, weights, plan.slot_pos, plan.sorted_slot, plan.top_k)


def _mlp_transport(transport, ep_group) -> tuple[Transport | None, str, int]:
    """``(Transport instance or None, transport id, ep)`` without building a transport (traceable)."""
    check_transport_name(transport)
    transport_id = transport_id_of(transport, ep_group)
    return (transport if isinstance(transport, Transport) else None), transport_id, transport_size(transport, ep_group)


@checked_api
def moe_mlp(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            *, num_experts: int, ep_group=None, transport=None, capacity: int | None = None,
            activation: str = "swiglu", num_chunks: int = 2, b1: torch.Tensor | None = None,
            b2: torch.Tensor | None = None, fp8: str | None = None,
            fp8_grad_high_precision: bool = False) -> torch.Tensor:
    """The whole routed MLP: ``out[t] = sum_j weights[t, j] * MLP_{expert_ids[t, j]}(x[t])``,
    ``MLP_e(x) = act(x W1_e^T + b1_e) W2_e^T + b2_e`` (expert biases optional, gpt-oss).

    x ``[..., H]``; expert_ids / weights ``[T, k]`` (T = tokens of x); w1 / w2 this rank's experts
    (``num_experts / ep`` of them, global expert ``e`` lives on rank ``e // E_local``). With
    ``ep > 1`` the dispatch is pipelined over ``num_chunks`` token chunks (see module docstring).
    ``transport``: a Transport (then ``ep_group`` must be None), default portable over ``ep_group``.
    Returns x's shape and dtype. Slots over ``capacity`` are dropped (earliest tokens kept).

    ``fp8="rowwise"`` / ``"blockwise"``: the experts in fp8 (DeepSeek-V3's convention): the tokens
    are quantised per token (1x128 tiles) before the permute and the all-to-all-v dispatch, which
    moves e4m3 values with their fp32 scales (about half of bf16's bytes); the expert GEMMs run on
    e4m3 operands (weights per output row / 128x128 blocks per expert, re-quantised each call from
    the high-precision ``w1`` / ``w2``); expert outputs return and combine in x's dtype. Backward
    likewise: the output gradients quantised per routed row before their dispatch, the input
    gradients returned in x's dtype, the weight gradients from operands quantised along each
    group's rows (``fp8_grad_high_precision``: from the dequantised rows, in x's dtype).
    The op ``fusedpar::moe_mlp``: traceable by ``torch.compile``."""
    instance, transport_id, ep = _mlp_transport(transport, ep_group)
    with agreed_arguments("moe_mlp", instance, ep_group, ep_fields(x, num_experts, num_chunks, activation=activation,
                                                                   w1=w1, w2=w2, b1=b1, b2=b2, fp8=fp8)):
        x2d = token_rows(x)
        check_routing(x2d, expert_ids, num_experts, ep, weights=weights, capacity=capacity, num_chunks=num_chunks)
        check_expert_weights(x2d, w1, w2, activation, num_experts // ep, b1, b2)
        check_choice("fp8", fp8, (None,) + tuple(FP8_RECIPES))
        check_bool("fp8_grad_high_precision", fp8_grad_high_precision)
        if fp8 is not None:
            check_fp8_device(x2d, option=f"fp8={fp8!r} (fusedpar.ops.moe_mlp / fusedpar.nn.MoE)")
    out = moe_mlp_op(x2d, expert_ids, weights, w1, w2, b1, b2, num_experts, transport_id, ep, capacity, activation,
                     num_chunks, fp8, bool(fp8_grad_high_precision))[0]
    return out.view(x.shape)


@checked_api
def moe_route(logits: torch.Tensor, top_k: int, *, score: str = "softmax", bias: torch.Tensor | None = None,
              n_group: int = 1, topk_group: int | None = None, normalize: bool = False,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k: ``(weights [T, k] fp32, expert_ids [T, k] int64)`` of fp32 router
    ``logits [T, E]`` (:func:`fusedpar.kernels.moe_topk.topk_route`: score function ``"softmax"``,
    ``"sigmoid"`` or ``"softmax_topk"``; ``bias`` for the selection only; group-limited with
    ``n_group`` / ``topk_group``; ``normalize``; ``scale``). Ties go to the lower expert id. The
    weights are differentiable w.r.t. ``logits`` (the selection is not). The op
    ``fusedpar::moe_route``: traceable by ``torch.compile``."""
    check_tensor("logits", logits, dims=(2,), dtypes=(torch.float32,))
    check_bool("normalize", normalize)
    topk_group = check_routing_config(logits.shape[1], top_k, score=score, n_group=n_group, topk_group=topk_group,
                                      scale=scale)
    if bias is not None:
        check_tensor("bias", bias, dims=(1,), dtypes=(torch.float32,))
        check_shape("bias", bias, (logits.shape[1],))
    return moe_route_op(logits.contiguous(), bias, top_k, score, n_group, topk_group, bool(normalize), float(scale))
