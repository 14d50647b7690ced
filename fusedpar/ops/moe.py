"""Mixture-of-experts dispatch, expert compute and combine, with expert parallelism (EP).

Stages (each an autograd-aware function, so a schedule can place them around other work):

* :func:`moe_plan` — routing metadata on the device (fusedpar.kernels.routing_metadata), then, with
  ``ep > 1``, the exchange of per-expert counts (one all-to-all of ints through the transport) and the
  one host sync of the layer (all-to-all-v split sizes are Python ints). At ``ep == 1`` no transfer.
* :func:`moe_dispatch` — permute tokens into expert-contiguous order (each repeated once per
  routed slot) and, with ``ep > 1``, send them to the ranks that own the experts (all-to-all-v).
* :func:`moe_expert_compute` / :func:`grouped_mlp` — the experts' MLP as two grouped GEMMs
  (first projection with the fused activation, then the down projection).
* :func:`moe_combine` — return the expert outputs (all-to-all-v) and form the weighted sum per
  token in fp32.

:func:`moe_mlp` runs all of them with the dispatch *pipelined*: the routed tokens are split into
``num_chunks`` chunks (by token index), every chunk's all-to-all is started up front, and the
expert GEMMs of chunk ``c`` run while later chunks are still in flight; each chunk's results are
sent back as soon as they are computed (:func:`moe_experts_fwd`). The backward runs the same
pipeline in reverse (:func:`moe_experts_bwd`: the gradients of the outputs travel like the
dispatch, the input gradients like the return), and the expert weight gradients accumulate in
fp32 across chunks while the input gradients travel.

Every exchange goes through a :class:`fusedpar.ops.transport.Transport` (``transport=``; by
default :class:`~fusedpar.ops.transport.PortableTransport` over ``ep_group``), so the same
schedule runs on ``torch.distributed`` and on :class:`~fusedpar.ops.transport.EmulatedTransport`.
Under emulation every peer mirrors this rank — its tokens, its routing and its expert weights —
so global expert ``e`` is served by this rank's local expert ``e % E_local``.

Layout of the expert side (what a rank's experts see): for each chunk, rows from source rank 0,
then 1, ...; within a source, expert-contiguous. The grouped GEMM takes these ``ep * E_local``
groups directly (group ``g`` uses expert ``g % E_local``), so no regrouping copy is needed.

Expert ids are checked to lie in ``[0, num_experts)`` on every path: with ``ep > 1`` each rank's
min / max ride on the count exchange (every rank raises the same error, none is left waiting);
with ``ep == 1`` on a GPU they are copied to the host behind the routing kernels and read once
the layer's kernels are queued. With ``ep > 1`` the ranks first agree (:mod:`fusedpar.ops.agreement`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.checks import (check_choice, check_divisible, check_int, check_positive_dims, check_same, check_shape,
                              check_tensor)
from ..kernels.grouped_gemm import as_group_offsets, grouped_matmul, grouped_matmul_dact, grouped_wgrad
from ..kernels.moe_permute import combine, combine_backward, permute
from ..kernels.moe_routing import routing_metadata
from ..kernels.runtime import ACTIVATIONS
from .agreement import agreed_arguments
from .transport import Transport, get_transport

__all__ = [
    "MoEPlan", "moe_plan", "moe_dispatch", "moe_expert_compute", "moe_combine", "moe_mlp", "grouped_mlp",
    "moe_permute_fwd", "moe_permute_bwd", "moe_unpermute_fwd", "moe_unpermute_bwd", "all_to_all_v_fwd",
    "all_to_all_v_bwd", "grouped_mlp_fwd", "grouped_mlp_bwd", "moe_experts_fwd", "moe_experts_bwd",
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
    transport: Transport
    num_chunks: int
    capacity: int | None
    slot_pos: torch.Tensor
    sorted_slot: torch.Tensor
    counts: torch.Tensor
    expert_offsets: list = field(default_factory=list)
    send_splits: list = field(default_factory=list)
    recv_splits: list = field(default_factory=list)

    @property
    def ep_size(self) -> int:
        return self.transport.size

    @property
    def ep_rank(self) -> int:
        return self.transport.rank

    @property
    def group(self):
        """The process group of a portable transport (None for other transports)."""
        return getattr(self.transport, "group", None)

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
            handles.append(self.transport.all_to_all(recv[r0:r0 + rn], send[s0:s0 + sn], self.recv_splits[c],
                                                     self.send_splits[c]))
        return handles

    def return_chunk(self, c: int, token_side: torch.Tensor, expert_side: torch.Tensor):
        """Post chunk ``c``'s all-to-all-v from ``expert_side`` rows back to ``token_side`` rows."""
        s0, sn = self.send_rows(c)
        r0, rn = self.recv_rows(c)
        return self.transport.all_to_all(token_side[s0:s0 + sn], expert_side[r0:r0 + rn], self.send_splits[c],
                                         self.recv_splits[c])

    @property
    def num_kept(self) -> int:
        """Token-side kept rows (a host int: only for ``ep > 1``, where it is known anyway)."""
        return sum(sum(s) for s in self.send_splits)

    @property
    def num_expert_rows(self) -> int:
        return sum(sum(s) for s in self.recv_splits)


def _check_routing(x2d, expert_ids, num_experts, ep, *, weights=None, capacity=None, num_chunks=1):
    """Validate everything that needs no device read before any communication; returns (T, k).
    The range of the ids is checked by :func:`_build_plan`."""
    check_int("num_experts", num_experts, min_value=1)
    check_tensor("expert_ids", expert_ids, dims=(2,), dtypes=(torch.int32, torch.int64))
    T, k = expert_ids.shape
    if x2d.shape[0] != T:
        raise ValueError(f"expert_ids has {T} tokens but x has {x2d.shape[0]} (x.shape[:-1] flattened)")
    check_same("expert_ids", expert_ids, "x", x2d, dtype=False)
    if k < 1 or k > num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {k}")
    if weights is not None:
        check_tensor("weights", weights, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
        check_shape("weights", weights, (T, k))
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0):
        raise ValueError(f"capacity must be None or an int >= 0, got {capacity!r}")
    check_int("num_chunks", num_chunks, min_value=1)
    check_divisible("num_experts", num_experts, ep, "the expert-parallel group size")
    return T, k


def _token_rows(x):  # x [..., hidden] as [tokens, hidden]
    check_tensor("x", x)
    if x.dim() < 2 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., hidden] with at least 2 dims and hidden >= 1, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1])


def _ep_fields(x, num_experts, num_chunks, **more):  # what EP ranks agree on (not tokens, not capacity)
    hidden = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else None
    return dict(hidden_size=hidden, dtype=getattr(x, "dtype", None), num_experts=num_experts, num_chunks=num_chunks,
                **more)


def _id_range(expert_ids) -> torch.Tensor:
    """``[min, max]`` of the ids as a device int64 tensor (``[0, 0]`` without ids); no sync."""
    if expert_ids.numel() == 0:
        return torch.zeros(2, device=expert_ids.device, dtype=torch.int64)
    lo, hi = torch.aminmax(expert_ids.reshape(-1))
    return torch.stack([lo, hi]).to(torch.int64)


def _check_id_range(lo: int, hi: int, num_experts: int, where: str = "") -> None:
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"expert_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]{where}")


class _PendingIdCheck:
    """The range check of one rank's expert ids (``ep == 1``). A CPU tensor is read at once; on a
    GPU ``[min, max]`` is copied to pinned host memory behind the routing kernels and
    :meth:`wait`, called once the layer's kernels are queued, reads it. While a CUDA graph is
    being captured nothing can be read on the host: the check is skipped there."""

    def __init__(self, expert_ids, num_experts):
        self.num_experts = num_experts
        self._event = self._host = None
        if expert_ids.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        rng = _id_range(expert_ids)
        if rng.device.type == "cuda":
            self._host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            self._host.copy_(rng, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = rng
            self.wait()

    def wait(self) -> None:
        if self._host is None:
            return
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        lo, hi = self._host.tolist()
        _check_id_range(lo, hi, self.num_experts)


def moe_plan(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, ep_group=None, transport=None,
             capacity: int | None = None, num_chunks: int = 1) -> MoEPlan:
    """Routing metadata and (``ep > 1``) the count exchange. ``capacity``: at most this many slots per
    expert from this rank's tokens, the earliest in token order; the rest are dropped. ``transport``: a
    Transport (then ``ep_group`` must be None), default portable over ``ep_group``. Reads the expert
    ids' range on the host before it returns (a sync on a GPU, also at ``ep == 1``)."""
    transport = get_transport(transport, ep_group)
    with agreed_arguments("moe_plan", transport, None, _ep_fields(x, num_experts, num_chunks)):
        x2d = _token_rows(x)
        _check_routing(x2d, expert_ids, num_experts, transport.size, capacity=capacity, num_chunks=num_chunks)
    plan, pending = _build_plan(x2d, expert_ids, num_experts, transport, capacity, num_chunks)
    if pending is not None:
        pending.wait()
    return plan


def _build_plan(x, expert_ids, num_experts, transport, capacity, num_chunks):
    """``(plan, pending id check or None)``; with ``ep > 1`` the ids are checked here."""
    T, k = expert_ids.shape
    E, ep = num_experts, transport.size
    ids = expert_ids.to(torch.int32)
    if ep == 1:
        pending = _PendingIdCheck(expert_ids, E)
        counts, offsets, slot_pos, sorted_slot = routing_metadata(ids, E, capacity=capacity, check_ids=False)
        return MoEPlan(T, k, E, transport, 1, capacity, slot_pos, sorted_slot, counts,
                       expert_offsets=[offsets]), pending
    C = num_chunks
    if capacity is not None:  # drop first (over the whole batch), then sort the kept slots by chunk
        _, _, pos0, _ = routing_metadata(ids, E, capacity=capacity, check_ids=False)
        ids = torch.where(pos0 >= 0, ids.reshape(-1), -1).reshape(T, k)
    chunk_len = max(1, -(-T // C))
    chunk = (torch.arange(T, device=ids.device, dtype=torch.int32) // chunk_len)[:, None]
    gids = torch.where(ids >= 0, ids + E * chunk, -1)
    counts, _, slot_pos, sorted_slot = routing_metadata(gids, C * E, check_ids=False)
    send_l, recv_l, ranges = _exchange_counts(counts, _id_range(expert_ids), transport, C, E // ep)
    for r, (lo, hi) in enumerate(ranges):
        _check_id_range(lo, hi, E, f" on expert-parallel rank {r}")
    send_splits = [[sum(send_l[r][c]) for r in range(ep)] for c in range(C)]
    recv_splits = [[sum(recv_l[s][c]) for s in range(ep)] for c in range(C)]
    expert_offsets = []
    for c in range(C):
        offs = [0]
        for s in range(ep):
            for n in recv_l[s][c]:
                offs.append(offs[-1] + n)
        expert_offsets.append(torch.tensor(offs, dtype=torch.int32).to(x.device, non_blocking=True))
    return MoEPlan(T, k, E, transport, C, capacity, slot_pos, sorted_slot, counts, expert_offsets=expert_offsets,
                   send_splits=send_splits, recv_splits=recv_splits), None


def _exchange_counts(counts, id_range, transport, C, E_loc):
    """One all-to-all of ints: to each rank, this rank's kept slots per (chunk, its local expert)
    and this rank's ``[min, max]`` expert id. Then the one host read of the layer (split sizes
    are Python ints). Returns ``send[r][c][e]``, ``recv[s][c][e]`` and every rank's ``(min, max)``."""
    ep = transport.size
    per_dest = counts.view(C, ep, E_loc).transpose(0, 1).reshape(ep, C * E_loc).to(torch.int64)
    send = torch.cat([per_dest, id_range.view(1, 2).expand(ep, 2)], dim=1).contiguous()
    recv = torch.empty_like(send)
    transport.all_to_all(recv, send).wait()
    host = torch.cat([send, recv]).tolist()

    def grid(row):
        return [row[c * E_loc:(c + 1) * E_loc] for c in range(C)]

    send_l = [grid(host[r]) for r in range(ep)]
    recv_l = [grid(host[ep + s]) for s in range(ep)]
    return send_l, recv_l, [tuple(host[ep + s][-2:]) for s in range(ep)]


# ----------------------------------------------------------------------------------------------
# forward / backward of each op (what the autograd Functions call)
# ----------------------------------------------------------------------------------------------
def moe_permute_fwd(x2d: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """x ``[T, H]`` -> ``[T*k, H]`` expert-contiguous (zero tail)."""
    return permute(x2d, plan.sorted_slot, plan.top_k)


def moe_permute_bwd(grad: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """The sum of each token's ``k`` slot gradients."""
    return combine(grad.contiguous(), plan.slot_pos, None, plan.top_k)


def moe_unpermute_fwd(y: torch.Tensor, weights: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
    """y ``[R, H]`` token-side permuted rows, weights ``[T, k]`` -> ``[T, H] = sum_j w * y[pos]`` (fp32)."""
    return combine(y, plan.slot_pos, weights, plan.top_k, out_dtype=y.dtype)


def moe_unpermute_bwd(grad: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, plan: MoEPlan):
    """``(grad_y, grad_weights)`` in the dtypes of ``y`` and ``weights``."""
    gy, gw = combine_backward(grad.contiguous(), y, weights, plan.sorted_slot[: y.shape[0]], plan.top_k)
    return gy, gw.to(weights.dtype)


def all_to_all_v_fwd(inp: torch.Tensor, out_rows: int, out_splits, in_splits, transport: Transport) -> torch.Tensor:
    """All-to-all-v along rows: ``in_splits[r]`` rows of ``inp`` to rank ``r``, ``out_splits[r]``
    rows from it; returns the ``[out_rows, ...]`` received rows."""
    out = inp.new_empty((out_rows,) + tuple(inp.shape[1:]))
    transport.all_to_all(out, inp.contiguous(), out_splits, in_splits).wait()
    return out


def all_to_all_v_bwd(grad: torch.Tensor, in_rows: int, out_splits, in_splits, transport: Transport) -> torch.Tensor:
    """The gradients go back the way the rows came: the forward exchange with the splits swapped."""
    return all_to_all_v_fwd(grad, in_rows, in_splits, out_splits, transport)


def grouped_mlp_fwd(x, w1, w2, offsets, activation, *, h_out=None, pre_out=None, y_out=None):
    """``(y, h, pre)``: ``pre = x W1^T`` per group, ``h = act(pre)``, ``y = h W2^T``."""
    pre = pre_out if pre_out is not None else x.new_empty((x.shape[0], w1.shape[1]))
    h = grouped_matmul(x, w1, offsets, activation=activation, preact_out=pre, out=h_out, check_offsets=False)
    y = grouped_matmul(h, w2, offsets, out=y_out, check_offsets=False)
    return y, h, pre


def _mlp_dgrad(gy, pre, w1, w2, offsets, activation, *, need_dx=True, dx_out=None):
    """dpre = (gy @ W2) * act'(pre) (fused into the GEMM, W2 read transposed in place) and
    dx = dpre @ W1 (transposed view, no copy)."""
    dpre = grouped_matmul_dact(gy, w2, offsets, pre, weight_layout="kn", activation=activation, check_offsets=False)
    dx = None
    if need_dx:
        dx = grouped_matmul(dpre, w1, offsets, weight_layout="kn", out=dx_out, check_offsets=False)
    return dx, dpre


def _mlp_wgrad(gy, x, h, dpre, offsets, num_experts, *, dw1=None, dw2=None, accumulate=False):
    """dW2 = gy^T h and dW1 = dpre^T x per expert (into fp32 buffers when accumulating)."""
    dw2 = grouped_wgrad(gy, h, offsets, num_experts, out=dw2, accumulate=accumulate, check_offsets=False)
    dw1 = grouped_wgrad(dpre, x, offsets, num_experts, out=dw1, accumulate=accumulate, check_offsets=False)
    return dw1, dw2


def grouped_mlp_bwd(gy, x, h, pre, w1, w2, offsets, activation, *, need_input_grad=True, need_weight_grad=True):
    """``(dx, dw1, dw2)`` of :func:`grouped_mlp_fwd` (None where not needed)."""
    gy = gy.contiguous()
    dx, dpre = _mlp_dgrad(gy, pre, w1, w2, offsets, activation, need_dx=need_input_grad)
    dw1 = dw2 = None
    if need_weight_grad:
        dw1, dw2 = _mlp_wgrad(gy, x, h, dpre, offsets, w1.shape[0])
    return dx, dw1, dw2


def moe_experts_fwd(x_perm, w1, w2, plan: MoEPlan, activation: str):
    """Token-side permuted rows -> dispatch (chunked all-to-all-v) -> expert MLP per chunk as its
    chunk arrives -> return all-to-all-v per chunk. Returns the token-side expert outputs
    ``[T*k, H]`` (zero tail) and what the backward needs: ``(y_perm, (recv, h, pre))``."""
    H, R = x_perm.shape[1], plan.num_expert_rows
    recv = x_perm.new_empty((R, H))
    handles = plan.dispatch_chunks(recv, x_perm)  # all in flight; compute waits on each in turn
    y_perm = x_perm.new_empty((plan.num_rows, H))
    y_perm[plan.num_kept:].zero_()
    y_exp = x_perm.new_empty((R, H))
    pre = x_perm.new_empty((R, w1.shape[1]))
    h = x_perm.new_empty((R, w2.shape[2]))
    back = []
    for c in range(plan.num_chunks):
        r0, rn = plan.recv_rows(c)
        handles[c].wait()
        sl = slice(r0, r0 + rn)
        grouped_mlp_fwd(recv[sl], w1, w2, plan.expert_offsets[c], activation, h_out=h[sl], pre_out=pre[sl],
                        y_out=y_exp[sl])
        back.append(plan.return_chunk(c, y_perm, y_exp))
    for hd in back:
        hd.wait()
    return y_perm, (recv, h, pre)


def moe_experts_bwd(gy_perm, saved, w1, w2, plan: MoEPlan, activation: str, *, need_weight_grad: bool = True):
    """Backward of :func:`moe_experts_fwd` (``saved`` is its second result): the output
    gradients travel like the dispatch, the input gradients like the return; the weight
    gradients of a chunk accumulate in fp32 while its input gradients travel.
    Returns ``(gx_perm, dw1, dw2)`` (weight gradients None unless ``need_weight_grad``)."""
    recv, h, pre = saved
    gy_perm = gy_perm.contiguous()
    H, R = gy_perm.shape[1], recv.shape[0]
    g_recv = gy_perm.new_empty((R, H))
    handles = plan.dispatch_chunks(g_recv, gy_perm)
    dw1 = torch.zeros(w1.shape, device=w1.device, dtype=torch.float32) if need_weight_grad else None
    dw2 = torch.zeros(w2.shape, device=w2.device, dtype=torch.float32) if need_weight_grad else None
    gx_perm = gy_perm.new_empty((plan.num_rows, H))
    gx_perm[plan.num_kept:].zero_()
    dx_exp = gy_perm.new_empty((R, H))
    back = []
    for c in range(plan.num_chunks):
        r0, rn = plan.recv_rows(c)
        handles[c].wait()
        sl = slice(r0, r0 + rn)
        _, dpre = _mlp_dgrad(g_recv[sl], pre[sl], w1, w2, plan.expert_offsets[c], activation, dx_out=dx_exp[sl])
        back.append(plan.return_chunk(c, gx_perm, dx_exp))
        if need_weight_grad:  # weight gradients of this chunk while its input gradients travel
            _mlp_wgrad(g_recv[sl], recv[sl], h[sl], dpre, plan.expert_offsets[c], w1.shape[0], dw1=dw1, dw2=dw2,
                       accumulate=True)
    for hd in back:
        hd.wait()
    if need_weight_grad:
        dw1, dw2 = dw1.to(w1.dtype), dw2.to(w2.dtype)
    return gx_perm, dw1, dw2


# ----------------------------------------------------------------------------------------------
# autograd Functions (thin: they call the named forward / backward functions above)
# ----------------------------------------------------------------------------------------------
class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return moe_permute_fwd(x, plan)

    @staticmethod
    def backward(ctx, grad):
        return moe_permute_bwd(grad, ctx.plan), None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, plan):
        ctx.plan = plan
        ctx.save_for_backward(y, weights)
        return moe_unpermute_fwd(y, weights, plan)

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        gy, gw = moe_unpermute_bwd(grad, y, weights, ctx.plan)
        return gy, gw, None


class _AllToAllVFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, out_rows, out_splits, in_splits, transport):
        ctx.args = (inp.shape[0], out_splits, in_splits, transport)
        return all_to_all_v_fwd(inp, out_rows, out_splits, in_splits, transport)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_v_bwd(grad, *ctx.args), None, None, None, None


class _GroupedMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, offsets, activation):
        y, h, pre = grouped_mlp_fwd(x, w1, w2, offsets, activation)
        ctx.activation = activation
        ctx.save_for_backward(x, h, pre, w1, w2, offsets)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, h, pre, w1, w2, offsets = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx, dw1, dw2 = grouped_mlp_bwd(gy, x, h, pre, w1, w2, offsets, ctx.activation,
                                       need_input_grad=ctx.needs_input_grad[0], need_weight_grad=need_w)
        return dx, dw1, dw2, None, None


class _EPExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_perm, w1, w2, plan, activation):
        y_perm, saved = moe_experts_fwd(x_perm, w1, w2, plan, activation)
        ctx.plan, ctx.activation = plan, activation
        ctx.save_for_backward(*saved, w1, w2)
        return y_perm

    @staticmethod
    def backward(ctx, gy_perm):
        recv, h, pre, w1, w2 = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        gx_perm, dw1, dw2 = moe_experts_bwd(gy_perm, (recv, h, pre), w1, w2, ctx.plan, ctx.activation,
                                            need_weight_grad=need_w)
        return gx_perm, dw1, dw2, None, None


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def _check_expert_weights(x2d, w1, w2, activation, experts_per_rank):
    check_choice("activation", activation, ACTIVATIONS)
    for name, w in (("w1", w1), ("w2", w2)):
        check_tensor(name, w, dims=(3,))
        check_same(name, w, "x", x2d)
        check_positive_dims(name, w, {0: "expert", 1: "row", 2: "column"})
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
    ``[E, F, H]``); w2 ``[E, H, F]``; offsets ``[G+1]`` int tensor (on any device; a device
    tensor is checked with one host read) or a sequence of ints. Differentiable in x, w1, w2;
    rows past ``offsets[-1]`` give zeros."""
    check_tensor("x", x, dims=(2,))
    _check_expert_weights(x, w1, w2, activation, None)
    offsets = as_group_offsets(offsets, x.shape[0], x.device)
    return _GroupedMLPFn.apply(x, w1, w2, offsets, activation)


def moe_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, ep_group=None, transport=None,
                 capacity: int | None = None):
    """Stage 1: ``(tokens, plan)``. ``tokens`` are this rank's experts' inputs, ``[R, H]``
    expert-contiguous per source rank (group offsets in ``plan.expert_offsets[0]``).
    Synchronous; :func:`moe_mlp` is the pipelined composition of the three stages."""
    transport = get_transport(transport, ep_group)
    with agreed_arguments("moe_dispatch", transport, None, _ep_fields(x, num_experts, 1)):
        x2d = _token_rows(x)
        _check_routing(x2d, expert_ids, num_experts, transport.size, capacity=capacity)
    plan, pending = _build_plan(x2d, expert_ids, num_experts, transport, capacity, 1)
    x_perm = _PermuteFn.apply(x2d, plan)
    if pending is not None:
        pending.wait()
    if plan.ep_size == 1:
        return x_perm, plan
    kept = x_perm[: plan.num_kept]
    return _AllToAllVFn.apply(kept, plan.num_expert_rows, plan.recv_splits[0], plan.send_splits[0],
                              plan.transport), plan


def moe_expert_compute(tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, plan: MoEPlan, *,
                       activation: str = "swiglu") -> torch.Tensor:
    """Stage 2: this rank's experts (``w1 [E_local, 2F, H]``, ``w2 [E_local, H, F]``) on the
    dispatched tokens (the first result of :func:`moe_dispatch` with this ``plan``)."""
    _check_expert_weights(tokens, w1, w2, activation, plan.experts_per_rank)
    rows = plan.num_rows if plan.ep_size == 1 else plan.num_expert_rows
    if tokens.shape[0] != rows:  # the plan's offsets address exactly these rows
        raise ValueError(f"tokens must have the {rows} rows the plan dispatched, got shape {tuple(tokens.shape)}")
    return _GroupedMLPFn.apply(tokens, w1, w2, plan.expert_offsets[0], activation)


def moe_combine(expert_out: torch.Tensor, plan: MoEPlan, weights: torch.Tensor) -> torch.Tensor:
    """Stage 3: send expert outputs back (``ep > 1``) and return ``[T, H]`` with
    ``out[t] = sum_j weights[t, j] * expert_out_of_slot(t, j)`` (fp32 sum; dropped slots add 0)."""
    check_tensor("weights", weights)
    check_shape("weights", weights, (plan.num_tokens, plan.top_k))
    y = expert_out
    if plan.ep_size > 1:
        y = _AllToAllVFn.apply(expert_out, plan.num_kept, plan.send_splits[0], plan.recv_splits[0], plan.transport)
    return _UnpermuteFn.apply(y, weights, plan)


def moe_mlp(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            *, num_experts: int, ep_group=None, transport=None, capacity: int | None = None,
            activation: str = "swiglu", num_chunks: int = 2) -> torch.Tensor:
    """The whole routed MLP: ``out[t] = sum_j weights[t, j] * MLP_{expert_ids[t, j]}(x[t])``.

    x ``[..., H]``; expert_ids / weights ``[T, k]`` (T = tokens of x); w1 / w2 this rank's experts
    (``num_experts / ep`` of them, global expert ``e`` lives on rank ``e // E_local``). With
    ``ep > 1`` the dispatch is pipelined over ``num_chunks`` token chunks (see module docstring).
    ``transport``: a Transport (then ``ep_group`` must be None), default portable over ``ep_group``.
    Returns x's shape and dtype. Slots over ``capacity`` are dropped (earliest tokens kept)."""
    transport = get_transport(transport, ep_group)
    ep = transport.size
    with agreed_arguments("moe_mlp", transport, None, _ep_fields(x, num_experts, num_chunks, activation=activation,
                                                                 w1=w1, w2=w2)):
        x2d = _token_rows(x)
        _check_routing(x2d, expert_ids, num_experts, ep, weights=weights, capacity=capacity, num_chunks=num_chunks)
        _check_expert_weights(x2d, w1, w2, activation, num_experts // ep)
    plan, pending = _build_plan(x2d, expert_ids, num_experts, transport, capacity, num_chunks if ep > 1 else 1)
    x_perm = _PermuteFn.apply(x2d, plan)
    if ep == 1:
        y_perm = _GroupedMLPFn.apply(x_perm, w1, w2, plan.expert_offsets[0], activation)
    else:
        y_perm = _EPExpertsFn.apply(x_perm, w1, w2, plan, activation)
    out = _UnpermuteFn.apply(y_perm, weights, plan).view(x.shape)
    if pending is not None:
        pending.wait()
    return out
