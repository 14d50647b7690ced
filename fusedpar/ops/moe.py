"""Mixture-of-experts dispatch, expert compute and combine, with expert parallelism (EP).

Stages (each an autograd-aware function, so a schedule can place them around other work):

* :func:`moe_plan` — routing metadata on the device (fusedpar.kernels.routing_metadata), then,
  with ``ep > 1``, the exchange of per-expert counts (one all-to-all of ints) and the one host
  sync of the layer: ``torch.distributed.all_to_all_single`` needs its split sizes as Python ints.
  With ``ep == 1`` nothing leaves the device and there is no sync at all.
* :func:`moe_dispatch` — permute tokens into expert-contiguous order (each repeated once per
  routed slot) and, with ``ep > 1``, send them to the ranks that own the experts (all-to-all-v).
* :func:`moe_expert_compute` / :func:`grouped_mlp` — the experts' MLP as two grouped GEMMs
  (first projection with the fused activation, then the down projection).
* :func:`moe_combine` — return the expert outputs (all-to-all-v) and form the weighted sum per
  token in fp32.

:func:`moe_mlp` runs all of them with the dispatch *pipelined*: the routed tokens are split into
``num_chunks`` chunks (by token index), every chunk's all-to-all is started up front, and the
expert GEMMs of chunk ``c`` run while later chunks are still in flight; each chunk's results are
sent back as soon as they are computed. The backward runs the same pipeline in reverse (the
gradients of the outputs travel like the dispatch, the input gradients like the return), and the
expert weight gradients accumulate in fp32 across chunks while the input gradients travel.

Layout of the expert side (what a rank's experts see): for each chunk, rows from source rank 0,
then 1, ...; within a source, expert-contiguous. The grouped GEMM takes these ``ep * E_local``
groups directly (group ``g`` uses expert ``g % E_local``), so no regrouping copy is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusedpar.ops import comm
from fusedpar.kernels.checks import check_divisible
from ..kernels import moe as K
from ..kernels.gemm import ACTIVATIONS

__all__ = [
    "MoEPlan", "moe_plan", "moe_dispatch", "moe_expert_compute", "moe_combine", "moe_mlp", "grouped_mlp",
]


# ----------------------------------------------------------------------------------------------
# the plan: where every routed slot goes
# ----------------------------------------------------------------------------------------------
@dataclass
class MoEPlan:
    """Routing and communication layout of one MoE call (see the module docstring).

    Token side: ``slot_pos [T*k]`` (row of each slot in the permuted buffer, -1 if dropped),
    ``sorted_slot [T*k]`` (slot of each permuted row, -1 on the zero tail), ``counts`` kept slots
    per (chunk, expert) group. Expert side: ``expert_offsets[c]`` device offsets of the
    ``ep * E_local`` groups of chunk ``c``. With ``ep > 1`` the host-side split sizes are in
    ``send_splits[c][r]`` / ``recv_splits[c][r]``.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    ep_size: int
    ep_rank: int
    group: object
    num_chunks: int
    capacity: int | None
    slot_pos: torch.Tensor
    sorted_slot: torch.Tensor
    counts: torch.Tensor
    expert_offsets: list = field(default_factory=list)
    send_splits: list = field(default_factory=list)
    recv_splits: list = field(default_factory=list)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_rows(self) -> int:
        """Rows of the token-side permuted buffer (``T * k``, the dropped tail included)."""
        return self.num_tokens * self.top_k

    def send_rows(self, c: int) -> tuple[int, int]:
        """(first row, rows) of chunk ``c`` in the token-side permuted buffer."""
        start = sum(sum(s) for s in self.send_splits[:c])
        return start, sum(self.send_splits[c])

    def recv_rows(self, c: int) -> tuple[int, int]:
        """(first row, rows) of chunk ``c`` in the expert-side buffer."""
        start = sum(sum(s) for s in self.recv_splits[:c])
        return start, sum(self.recv_splits[c])

    def dispatch_chunks(self, recv: torch.Tensor, send: torch.Tensor) -> list:
        """Post every chunk's all-to-all-v from token-side ``send`` to expert-side ``recv`` at once;
        returns one handle per chunk, to be waited on right before that chunk is computed."""
        handles = []
        for c in range(self.num_chunks):
            s0, sn = self.send_rows(c)
            r0, rn = self.recv_rows(c)
            handles.append(comm.all_to_all(recv[r0:r0 + rn], send[s0:s0 + sn], self.recv_splits[c],
                                           self.send_splits[c], self.group))
        return handles

    @property
    def num_kept(self) -> int:
        """Token-side kept rows (a host int: only for ``ep > 1``, where it is known anyway)."""
        return sum(sum(s) for s in self.send_splits)

    @property
    def num_expert_rows(self) -> int:
        return sum(sum(s) for s in self.recv_splits)


def _check_routing(x2d, expert_ids, num_experts, group, *, weights=None, capacity=None, num_chunks=1):
    """Validate everything before any communication; returns (T, k, ep, ep_rank)."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(expert_ids, torch.Tensor):
        raise TypeError(f"expert_ids must be a torch.Tensor, got {type(expert_ids).__name__}")
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [tokens, top_k], got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_ids must have dtype torch.int32 or torch.int64, got {expert_ids.dtype}")
    T, k = expert_ids.shape
    if x2d.shape[0] != T:
        raise ValueError(f"expert_ids has {T} tokens but x has {x2d.shape[0]} (x.shape[:-1] flattened)")
    if expert_ids.device != x2d.device:
        raise ValueError(f"expert_ids must be on the device of x ({x2d.device}), got {expert_ids.device}")
    if k < 1 or k > num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {k}")
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
        if tuple(weights.shape) != (T, k):
            raise ValueError(f"weights must have shape {(T, k)} like expert_ids, got {tuple(weights.shape)}")
        if not weights.is_floating_point():
            raise TypeError(f"weights must be a floating tensor, got {weights.dtype}")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    ep, rank = comm.group_size(group), comm.group_rank(group)
    check_divisible("num_experts", num_experts, ep, "the expert-parallel group size")
    # Out-of-range ids would be dropped silently by the sort. Checking them costs a device sync,
    # which an EP call pays anyway (split sizes); on CPU it is free. A single-rank CUDA call
    # trusts its ids (TopKRouter only produces valid ones) to stay sync-free.
    if T * k and (ep > 1 or expert_ids.device.type == "cpu"):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")
    return T, k, ep, rank


def moe_plan(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, ep_group=None,
             capacity: int | None = None, num_chunks: int = 1) -> MoEPlan:
    """Routing metadata and (``ep > 1``) the count exchange. ``capacity``: at most this many slots
    per expert from this rank's tokens, the earliest in token order; the rest are dropped."""
    x2d = x.reshape(-1, x.shape[-1])
    _check_routing(x2d, expert_ids, num_experts, ep_group, capacity=capacity, num_chunks=num_chunks)
    return _build_plan(x2d, expert_ids, num_experts, ep_group, capacity, num_chunks)


def _build_plan(x, expert_ids, num_experts, ep_group, capacity, num_chunks) -> MoEPlan:
    T, k = expert_ids.shape
    ep, rank = comm.group_size(ep_group), comm.group_rank(ep_group)
    E = num_experts
    ids = expert_ids.to(torch.int32)
    if ep == 1:
        counts, offsets, slot_pos, sorted_slot = K.routing_metadata(ids, E, capacity=capacity)
        return MoEPlan(T, k, E, 1, 0, comm.resolve_group(ep_group), 1, capacity, slot_pos, sorted_slot, counts,
                       expert_offsets=[offsets])
    C = num_chunks
    if capacity is not None:  # drop first (over the whole batch), then sort the kept slots by chunk
        _, _, pos0, _ = K.routing_metadata(ids, E, capacity=capacity)
        ids = torch.where(pos0 >= 0, ids.reshape(-1), -1).reshape(T, k)
    chunk_len = max(1, -(-T // C))
    chunk = (torch.arange(T, device=ids.device, dtype=torch.int32) // chunk_len)[:, None]
    gids = torch.where(ids >= 0, ids + E * chunk, -1)
    counts, _, slot_pos, sorted_slot = K.routing_metadata(gids, C * E)
    E_loc = E // ep
    # counts per (destination rank, chunk, local expert) -> each rank receives [source, chunk, expert]
    send = counts.view(C, ep, E_loc).transpose(0, 1).contiguous().view(-1)
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=ep_group).wait()
    # the host sync: all_to_all_single takes split sizes as Python ints
    send_l = counts.view(C, ep, E_loc).tolist()
    recv_l = recv.view(ep, C, E_loc).tolist()
    send_splits = [[sum(send_l[c][r]) for r in range(ep)] for c in range(C)]
    recv_splits = [[sum(recv_l[s][c]) for s in range(ep)] for c in range(C)]
    expert_offsets = []
    for c in range(C):
        offs = [0]
        for s in range(ep):
            for e in range(E_loc):
                offs.append(offs[-1] + recv_l[s][c][e])
        expert_offsets.append(torch.tensor(offs, dtype=torch.int32).to(x.device, non_blocking=True))
    return MoEPlan(T, k, E, ep, rank, comm.resolve_group(ep_group), C, capacity, slot_pos, sorted_slot, counts,
                   expert_offsets=expert_offsets, send_splits=send_splits, recv_splits=recv_splits)


# ----------------------------------------------------------------------------------------------
# autograd Functions
# ----------------------------------------------------------------------------------------------
class _PermuteFn(torch.autograd.Function):
    """x [T, H] -> [T*k, H] expert-contiguous (zero tail); backward: sum of the k slot gradients."""

    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return K.permute(x, plan.sorted_slot, plan.top_k)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        return K.combine(grad.contiguous(), plan.slot_pos, None, plan.top_k), None


class _CombineFn(torch.autograd.Function):
    """y [R, H] token-side permuted rows, weights [T, k] -> [T, H] = sum_j w * y[pos] (fp32)."""

    @staticmethod
    def forward(ctx, y, weights, plan):
        ctx.plan = plan
        ctx.save_for_backward(y, weights)
        return K.combine(y, plan.slot_pos, weights, plan.top_k, out_dtype=y.dtype)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        y, weights = ctx.saved_tensors
        gy, gw = K.combine_backward(grad.contiguous(), y, weights, plan.sorted_slot[: y.shape[0]], plan.top_k)
        return gy, gw.to(weights.dtype), None


class _AllToAllVFn(torch.autograd.Function):
    """All-to-all-v along rows; the backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, inp, out_rows, out_splits, in_splits, group):
        ctx.args = (inp.shape[0], out_splits, in_splits, group)
        out = inp.new_empty((out_rows,) + tuple(inp.shape[1:]))
        comm.all_to_all(out, inp.contiguous(), out_splits, in_splits, group).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        in_rows, out_splits, in_splits, group = ctx.args
        g = grad.new_empty((in_rows,) + tuple(grad.shape[1:]))
        comm.all_to_all(g, grad.contiguous(), in_splits, out_splits, group).wait()
        return g, None, None, None, None


def _mlp_forward(x, w1, w2, offsets, activation, *, h_out=None, pre_out=None, y_out=None):
    pre = pre_out if pre_out is not None else x.new_empty((x.shape[0], w1.shape[1]))
    h = K.grouped_matmul(x, w1, offsets, activation=activation, preact_out=pre, out=h_out)
    y = K.grouped_matmul(h, w2, offsets, out=y_out)
    return y, h, pre


def _mlp_dgrad(gy, pre, w1, w2, offsets, activation, *, need_dx=True, dx_out=None):
    """dpre = (gy @ W2) * act'(pre) (fused into the GEMM, W2 read transposed in place) and
    dx = dpre @ W1 (transposed view, no copy)."""
    dpre = K.grouped_matmul_dact(gy, w2, offsets, pre, weight_layout="kn", activation=activation)
    dx = K.grouped_matmul(dpre, w1, offsets, weight_layout="kn", out=dx_out) if need_dx else None
    return dx, dpre


def _mlp_wgrad(gy, x, h, dpre, offsets, num_experts, *, dw1=None, dw2=None, accumulate=False):
    """dW2 = gy^T h and dW1 = dpre^T x per expert (into fp32 buffers when accumulating)."""
    dw2 = K.grouped_wgrad(gy, h, offsets, num_experts, out=dw2, accumulate=accumulate)
    dw1 = K.grouped_wgrad(dpre, x, offsets, num_experts, out=dw1, accumulate=accumulate)
    return dw1, dw2


class _GroupedMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, offsets, activation):
        y, h, pre = _mlp_forward(x, w1, w2, offsets, activation)
        ctx.activation = activation
        ctx.save_for_backward(x, h, pre, w1, w2, offsets)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, h, pre, w1, w2, offsets = ctx.saved_tensors
        gy = gy.contiguous()
        dx, dpre = _mlp_dgrad(gy, pre, w1, w2, offsets, ctx.activation, need_dx=ctx.needs_input_grad[0])
        dw1 = dw2 = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw1, dw2 = _mlp_wgrad(gy, x, h, dpre, offsets, w1.shape[0])
        return dx, dw1, dw2, None, None


class _EPExpertsFn(torch.autograd.Function):
    """Token-side permuted rows -> dispatch (chunked all-to-all-v) -> expert MLP per chunk as its
    chunk arrives -> return all-to-all-v per chunk -> token-side expert outputs ``[T*k, H]``."""

    @staticmethod
    def forward(ctx, x_perm, w1, w2, plan, activation):
        C, grp = plan.num_chunks, plan.group
        H = x_perm.shape[1]
        R = plan.num_expert_rows
        recv = x_perm.new_empty((R, H))
        handles = plan.dispatch_chunks(recv, x_perm)  # all in flight; compute waits on each in turn
        y_perm = x_perm.new_empty((plan.num_rows, H))
        y_perm[plan.num_kept:].zero_()
        y_exp = x_perm.new_empty((R, H))
        pre = x_perm.new_empty((R, w1.shape[1]))
        h = x_perm.new_empty((R, w2.shape[2]))
        back = []
        for c in range(C):
            s0, sn = plan.send_rows(c)
            r0, rn = plan.recv_rows(c)
            handles[c].wait()
            sl = slice(r0, r0 + rn)
            _mlp_forward(recv[sl], w1, w2, plan.expert_offsets[c], activation, h_out=h[sl], pre_out=pre[sl],
                         y_out=y_exp[sl])
            back.append(comm.all_to_all(y_perm[s0:s0 + sn], y_exp[sl], plan.send_splits[c], plan.recv_splits[c], grp))
        for hd in back:
            hd.wait()
        ctx.plan, ctx.activation = plan, activation
        ctx.save_for_backward(recv, h, pre, w1, w2)
        return y_perm

    @staticmethod
    def backward(ctx, gy_perm):
        plan, grp = ctx.plan, ctx.plan.group
        recv, h, pre, w1, w2 = ctx.saved_tensors
        gy_perm = gy_perm.contiguous()
        C, H, R = plan.num_chunks, gy_perm.shape[1], recv.shape[0]
        g_recv = gy_perm.new_empty((R, H))
        handles = plan.dispatch_chunks(g_recv, gy_perm)  # output gradients travel like the dispatch
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dw1 = torch.zeros(w1.shape, device=w1.device, dtype=torch.float32) if need_w else None
        dw2 = torch.zeros(w2.shape, device=w2.device, dtype=torch.float32) if need_w else None
        gx_perm = gy_perm.new_empty((plan.num_rows, H))
        gx_perm[plan.num_kept:].zero_()
        dx_exp = gy_perm.new_empty((R, H))
        back = []
        for c in range(C):
            s0, sn = plan.send_rows(c)
            r0, rn = plan.recv_rows(c)
            handles[c].wait()
            sl = slice(r0, r0 + rn)
            _, dpre = _mlp_dgrad(g_recv[sl], pre[sl], w1, w2, plan.expert_offsets[c], ctx.activation,
                                 dx_out=dx_exp[sl])
            back.append(comm.all_to_all(gx_perm[s0:s0 + sn], dx_exp[sl], plan.send_splits[c], plan.recv_splits[c],
                                        grp))
            if need_w:  # weight gradients of this chunk while its input gradients travel
                _mlp_wgrad(g_recv[sl], recv[sl], h[sl], dpre, plan.expert_offsets[c], w1.shape[0], dw1=dw1, dw2=dw2,
                           accumulate=True)
        for hd in back:
            hd.wait()
        return (gx_perm, dw1.to(w1.dtype) if need_w else None, dw2.to(w2.dtype) if need_w else None, None, None)


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def _check_expert_weights(x2d, w1, w2, activation, experts_per_rank):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    for name, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D [experts, out, in], got shape {tuple(w.shape)}")
        if w.dtype != x2d.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x2d.dtype}), got {w.dtype}")
        if w.device != x2d.device:
            raise ValueError(f"{name} must be on the device of x ({x2d.device}), got {w.device}")
    H = x2d.shape[1]
    glu = ACTIVATIONS[activation][1]
    E, n1, h1 = w1.shape
    F = n1 // 2 if glu else n1
    if experts_per_rank is not None and E != experts_per_rank:
        raise ValueError(f"w1 must hold the {experts_per_rank} experts of this rank, got {E} (shape {tuple(w1.shape)})")
    if h1 != H:
        raise ValueError(f"w1 must be [E, {'2F' if glu else 'F'}, hidden={H}], got shape {tuple(w1.shape)}")
    if glu and n1 % 2:
        raise ValueError(f"activation {activation!r} needs w1 with 2F (gate, up) rows, got {n1}")
    if tuple(w2.shape) != (E, H, F):
        raise ValueError(f"w2 must have shape {(E, H, F)} ([experts, hidden, ffn]), got {tuple(w2.shape)}")


def grouped_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets, *, activation: str = "swiglu"):
    """Expert MLPs over group-contiguous rows: ``y[rows_g] = act(x W1_e^T) W2_e^T``, ``e = g % E``.

    x ``[M, H]``; w1 ``[E, 2F, H]`` (gate rows then up rows for gated activations, else
    ``[E, F, H]``); w2 ``[E, H, F]``; offsets ``[G+1]`` device int tensor (no host sync) or a
    sequence of ints. Differentiable in x, w1, w2; rows past ``offsets[-1]`` give zeros."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [rows, hidden] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    _check_expert_weights(x, w1, w2, activation, None)
    offsets = K._as_offsets(offsets, x)
    return _GroupedMLPFn.apply(x, w1, w2, offsets, activation)


def moe_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, ep_group=None,
                 capacity: int | None = None):
    """Stage 1: ``(tokens, plan)``. ``tokens`` are this rank's experts' inputs, ``[R, H]``
    expert-contiguous per source rank (group offsets in ``plan.expert_offsets[0]``).
    Synchronous; :func:`moe_mlp` is the pipelined composition of the three stages."""
    x2d = x.reshape(-1, x.shape[-1])
    plan = moe_plan(x2d, expert_ids, num_experts, ep_group=ep_group, capacity=capacity, num_chunks=1)
    x_perm = _PermuteFn.apply(x2d, plan)
    if plan.ep_size == 1:
        return x_perm, plan
    kept = x_perm[: plan.num_kept]
    return _AllToAllVFn.apply(kept, plan.num_expert_rows, plan.recv_splits[0], plan.send_splits[0], plan.group), plan


def moe_expert_compute(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, plan: MoEPlan, *,
                       activation: str = "swiglu") -> torch.Tensor:
    """Stage 2: this rank's experts (``w1 [E_local, 2F, H]``, ``w2 [E_local, H, F]``) on the
    dispatched tokens."""
    _check_expert_weights(tokens, w1, w2, activation, plan.experts_per_rank)
    return _GroupedMLPFn.apply(tokens, w1, w2, plan.expert_offsets[0], activation)


def moe_combine(expert_out: torch.Tensor, plan: MoEPlan, weights: torch.Tensor) -> torch.Tensor:
    """Stage 3: send expert outputs back (``ep > 1``) and return ``[T, H]`` with
    ``out[t] = sum_j weights[t, j] * expert_out_of_slot(t, j)`` (fp32 sum; dropped slots add 0)."""
    if tuple(weights.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(f"weights must have shape {(plan.num_tokens, plan.top_k)}, got {tuple(weights.shape)}")
    y = expert_out
    if plan.ep_size > 1:
        y = _AllToAllVFn.apply(expert_out, plan.num_kept, plan.send_splits[0], plan.recv_splits[0], plan.group)
    return _CombineFn.apply(y, weights, plan)


def moe_mlp(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            *, num_experts: int, ep_group=None, capacity: int | None = None, activation: str = "swiglu",
            num_chunks: int = 2) -> torch.Tensor:
    """The whole routed MLP: ``out[t] = sum_j weights[t, j] * MLP_{expert_ids[t, j]}(x[t])``.

    x ``[..., H]``; expert_ids / weights ``[T, k]`` (T = tokens of x); w1 / w2 this rank's experts
    (``num_experts / ep`` of them, global expert ``e`` lives on rank ``e // E_local``). With
    ``ep > 1`` the dispatch is pipelined over ``num_chunks`` token chunks (see module docstring).
    Returns x's shape and dtype. Slots over ``capacity`` are dropped (earliest tokens kept)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a [..., hidden] tensor with at least 2 dims, got {getattr(x, 'shape', x)}")
    x2d = x.reshape(-1, x.shape[-1])
    _check_routing(x2d, expert_ids, num_experts, ep_group, weights=weights, capacity=capacity, num_chunks=num_chunks)
    ep = comm.group_size(ep_group)
    _check_expert_weights(x2d, w1, w2, activation, num_experts // ep)
    plan = _build_plan(x2d, expert_ids, num_experts, ep_group, capacity, num_chunks if ep > 1 else 1)
    x_perm = _PermuteFn.apply(x2d, plan)
    if plan.ep_size == 1:
        y_perm = _GroupedMLPFn.apply(x_perm, w1, w2, plan.expert_offsets[0], activation)
    else:
        y_perm = _EPExpertsFn.apply(x_perm, w1, w2, plan, activation)
    return _CombineFn.apply(y_perm, weights, plan).view(x.shape)
