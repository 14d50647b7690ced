"""The layout of a mixture-of-experts call and the math of its stages (no autograd here).

:class:`MoEPlan` (where every routed slot goes; built by :func:`build_plan`, with ``ep > 1`` after
the one count exchange and host read of the layer), the argument checks of the MoE ops, and the
named forward / backward functions of each stage that the ``torch.library`` ops of
:mod:`fusedpar.ops.moe_library` run: permute / unpermute, all-to-all-v, the grouped expert MLP
and the pipelined expert-parallel schedule (:func:`moe_experts_fwd` / :func:`moe_experts_bwd`).
See :mod:`fusedpar.ops.moe` for the schedule and the layout of the expert side.

fp8 (:class:`Fp8Experts`): the expert-side rows of the input and of the output gradient are e4m3
with their fp32 scales in one byte row each (:class:`TokenPack`, what an fp8 dispatch sends), the
grouped GEMMs run on e4m3 operands; expert outputs and input gradients stay in the model's dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels.checks import (check_choice, check_divisible, check_int, check_positive_dims, check_same, check_shape,
                              check_tensor)
from ..kernels.fp8 import FP8_BLOCK, dequantize_e4m3, quantize_e4m3, quantize_e4m3_groups
from ..kernels.fp8_gemm import FP8_RECIPES
from ..kernels.grouped_bias import grouped_bias_grad
from ..kernels.grouped_gemm import grouped_matmul, grouped_matmul_dact, grouped_wgrad
from ..kernels.moe_permute import combine, combine_backward, permute
from ..kernels.moe_routing import routing_metadata
from ..kernels.runtime import ACTIVATIONS
from .transport import Transport

__all__ = [
    "MoEPlan", "build_plan", "check_routing", "check_expert_weights", "token_rows", "ep_fields", "plan_residuals",
    "plan_from_residuals", "moe_permute_fwd", "moe_permute_bwd", "moe_unpermute_fwd", "moe_unpermute_bwd",
    "all_to_all_v_fwd", "grouped_mlp_fwd", "grouped_mlp_bwd", "moe_experts_fwd",
    "moe_experts_bwd", "TokenPack", "Fp8Experts",
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


def check_routing(x2d, expert_ids, num_experts, ep, *, weights=None, capacity=None, num_chunks=1):
    """Validate everything that needs no device read before any communication; returns (T, k).
    The range of the ids is checked by :func:`build_plan`."""
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


def token_rows(x):  # x [..., hidden] as [tokens, hidden]
    check_tensor("x", x)
    if x.dim() < 2 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., hidden] with at least 2 dims and hidden >= 1, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1])


def ep_fields(x, num_experts, num_chunks, **more):  # what EP ranks agree on (not tokens, not capacity)
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
            self._host.copy_(rng, non_blocking=True)  # on the current stream of the ids' device
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(rng.device))
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


def build_plan(x, expert_ids, num_experts, transport, capacity, num_chunks):
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


def plan_residuals(plan: MoEPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """What a backward needs of ``plan`` besides ``slot_pos`` / ``sorted_slot``, as tensors:
    the expert-side group offsets of every chunk ``[C, G + 1]`` (int32, on the device) and the
    host split sizes ``[2, C, ep]`` (int64, on the CPU: ``send_splits``, ``recv_splits``; zeros
    at ``ep == 1``), so the backward rebuilds the plan without a device read."""
    offsets = torch.stack([o.to(torch.int32) for o in plan.expert_offsets])
    if plan.ep_size == 1:
        return offsets, torch.zeros((2, 1, 1), dtype=torch.int64)
    return offsets, torch.tensor([plan.send_splits, plan.recv_splits], dtype=torch.int64)


def plan_from_residuals(slot_pos, sorted_slot, offsets, splits, top_k: int, num_experts: int,
                        transport: Transport) -> MoEPlan:
    """The :class:`MoEPlan` of a forward from :func:`plan_residuals` (counts and capacity, which
    no backward reads, are not kept)."""
    send, recv = splits.tolist()
    plan = MoEPlan(slot_pos.numel() // top_k, top_k, num_experts, transport, offsets.shape[0], None, slot_pos,
                   sorted_slot, None, expert_offsets=list(offsets.unbind(0)))
    if transport.size > 1:
        plan.send_splits, plan.recv_splits = send, recv
    return plan


# ----------------------------------------------------------------------------------------------
# fp8: token rows packed with their scales, the quantised expert weights
# ----------------------------------------------------------------------------------------------
def _round16(n: int) -> int:
    return -(-n // 16) * 16


class TokenPack:
    """The bytes of ``[R, H]`` token rows in fp8 (``recipe``): each row its ``H`` e4m3 values, then
    its fp32 scales (one, or one per 1x128 tile for "blockwise"), each part padded to 16 bytes, in
    one ``uint8 [R, row_bytes]`` buffer: what an fp8 dispatch moves (``H + 16`` bytes a row
    rowwise, ``H + 4 ceil(H/128)`` rounded to 16 blockwise: about half of bf16's ``2 H``). The
    grouped GEMMs read the values and the scales in place (row-strided views)."""

    def __init__(self, hidden: int, recipe: str):
        self.hidden, self.recipe = hidden, recipe
        self.granularity = FP8_RECIPES[recipe][0]
        self.n_scales = 1 if self.granularity == "row" else math.ceil(hidden / FP8_BLOCK)
        self.q_bytes = _round16(hidden)
        self.row_bytes = self.q_bytes + _round16(4 * self.n_scales)

    def empty(self, rows: int, device) -> torch.Tensor:
        """A buffer of ``rows`` rows whose padding bytes are zero (every byte sent is defined)."""
        buf = torch.empty((rows, self.row_bytes), device=device, dtype=torch.uint8)
        buf[:, self.hidden:self.q_bytes].zero_()
        buf[:, self.q_bytes + 4 * self.n_scales:].zero_()
        return buf

    def q(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, :self.hidden].view(torch.float8_e4m3fn)

    def scale(self, buf: torch.Tensor) -> torch.Tensor:
        s = buf[:, self.q_bytes:self.q_bytes + 4 * self.n_scales].view(torch.float32)
        return s[:, 0] if self.granularity == "row" else s

    def fill(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, H]`` quantised per row (1x128 tiles) into a new buffer."""
        buf = self.empty(x.shape[0], x.device)
        quantize_e4m3(x, self.granularity, out=(self.q(buf), self.scale(buf)))
        return buf

    def dequantize(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_e4m3(self.q(buf), self.scale(buf), self.granularity, torch.float32).to(dtype)


@dataclass
class Fp8Experts:
    """One fp8 expert MLP call: the recipe, its :class:`TokenPack`, the model's dtype (of the
    outputs and the residuals), ``grad_high_precision`` (the weight gradients from the
    dequantised rows, in that dtype) and the expert weights as e4m3 ``(q, scale)``: for the
    forward ``w1 [E, 2F, H]`` / ``w2 [E, H, F]`` per row (128x128 blocks per expert), for the
    backward their transposes ``[E, F, H]`` / ``[E, H, 2F]``, quantised along the data gradients'
    contraction (:meth:`backward`)."""

    recipe: str
    pack: TokenPack
    dtype: torch.dtype
    grad_high_precision: bool
    w1: tuple = None
    w2: tuple = None

    @classmethod
    def forward(cls, recipe, w1, w2, dtype, grad_high_precision=False) -> "Fp8Experts":
        g = FP8_RECIPES[recipe][1]
        return cls(recipe, TokenPack(w1.shape[2], recipe), dtype, grad_high_precision, quantize_e4m3(w1, g),
                   quantize_e4m3(w2, g))

    @classmethod
    def backward(cls, recipe, w1, w2, dtype, grad_high_precision=False) -> "Fp8Experts":
        """``w1`` holds ``W2^T`` (the activation gradient's weight), ``w2`` ``W1^T`` (the input gradient's)."""
        g = FP8_RECIPES[recipe][1]
        return cls(recipe, TokenPack(w1.shape[2], recipe), dtype, grad_high_precision,
                   quantize_e4m3(w2.transpose(1, 2), g), quantize_e4m3(w1.transpose(1, 2), g))

    def gemm(self, a, weight, offsets, out=None, **kw):
        """A grouped GEMM of packed rows (``a``: a :class:`TokenPack` buffer) or of ``[M, K]`` rows
        in the model's dtype (quantised per row here) by ``weight`` (``self.w1`` / ``self.w2``)."""
        if a.dtype == torch.uint8:
            q, s = self.pack.q(a), self.pack.scale(a)
        else:
            q, s = quantize_e4m3(a, self.pack.granularity)
        return grouped_matmul(q, weight[0], offsets, out=out, out_dtype=self.dtype, check_offsets=False, x_scale=s,
                              weight_scale=weight[1], scaling=self.recipe, **kw)


def _wgrad_fp8(grad, x, offsets, num_experts, fp8: Fp8Experts, **kw):
    """:func:`grouped_wgrad` of two ``[M, *]`` operands (packed rows or the model's dtype),
    quantised along the rows within each group (the recipe's granularity)."""
    ops = []
    for t in (grad, x):
        q, s = (fp8.pack.q(t), fp8.pack.scale(t)) if t.dtype == torch.uint8 else (t, None)
        ops.append(quantize_e4m3_groups(q, offsets, fp8.pack.granularity, x_scale=s, check_offsets=False))
    return grouped_wgrad(ops[0][0].t(), ops[1][0].t(), offsets, num_experts, check_offsets=False,
                         grad_scale=ops[0][1], x_scale=ops[1][1], **kw)


# ----------------------------------------------------------------------------------------------
# forward / backward of each op (the bodies of the custom ops of moe_library.py)
# ----------------------------------------------------------------------------------------------
def moe_permute_fwd(x2d: torch.Tensor, sorted_slot: torch.Tensor, top_k: int) -> torch.Tensor:
    """x ``[T, H]`` -> ``[T*k, H]`` expert-contiguous (zero tail): the body of ``fusedpar::moe_permute``
    (``sorted_slot``: the plan's slot of every expert-side row)."""
    return permute(x2d, sorted_slot, top_k)


def moe_permute_bwd(grad: torch.Tensor, slot_pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """The sum of each token's ``k`` slot gradients: the body of ``fusedpar::moe_permute_backward``
    (``slot_pos``: the plan's row of every slot)."""
    return combine(grad.contiguous(), slot_pos, None, top_k)


def moe_unpermute_fwd(y: torch.Tensor, weights: torch.Tensor, slot_pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """y ``[R, H]`` token-side permuted rows, weights ``[T, k]`` -> ``[T, H] = sum_j w * y[pos]``
    (fp32 sum): the body of ``fusedpar::moe_unpermute``."""
    return combine(y, slot_pos, weights, top_k, out_dtype=y.dtype)


def moe_unpermute_bwd(grad: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, sorted_slot: torch.Tensor,
                      top_k: int):
    """``(grad_y, grad_weights)`` in the dtypes of ``y`` and ``weights``: the body of
    ``fusedpar::moe_unpermute_backward``."""
    gy, gw = combine_backward(grad.contiguous(), y, weights, sorted_slot[: y.shape[0]], top_k)
    return gy, gw.to(weights.dtype)


def all_to_all_v_fwd(inp: torch.Tensor, out_rows: int, out_splits, in_splits, transport: Transport) -> torch.Tensor:
    """All-to-all-v along rows: ``in_splits[r]`` rows of ``inp`` to rank ``r``, ``out_splits[r]``
    rows from it; returns the ``[out_rows, ...]`` received rows. The body of ``fusedpar::all_to_all_v``."""
    out = inp.new_empty((out_rows,) + tuple(inp.shape[1:]))
    transport.all_to_all(out, inp.contiguous(), out_splits, in_splits).wait()
    return out


def grouped_mlp_fwd(x, w1, w2, offsets, activation, *, b1=None, b2=None, h_out=None, pre_out=None, y_out=None,
                    fp8: Fp8Experts | None = None):
    """``(y, h, pre)``: ``pre = x W1^T + b1`` per group, ``h = act(pre)``, ``y = h W2^T + b2``
    (expert biases ``b1 [E, 2F]`` / ``b2 [E, H]`` optional, added in the GEMM epilogues). ``fp8``
    (:meth:`Fp8Experts.forward`): ``x`` a :class:`TokenPack` buffer, ``h`` quantised per row for
    the second GEMM; ``y``, ``h``, ``pre`` in the model's dtype."""
    if fp8 is None:
        pre = pre_out if pre_out is not None else x.new_empty((x.shape[0], w1.shape[1]))
        h = grouped_matmul(x, w1, offsets, activation=activation, preact_out=pre, out=h_out, check_offsets=False,
                           bias=b1)
        return grouped_matmul(h, w2, offsets, out=y_out, check_offsets=False, bias=b2), h, pre
    pre = pre_out if pre_out is not None else torch.empty((x.shape[0], w1.shape[1]), device=x.device, dtype=fp8.dtype)
    h = fp8.gemm(x, fp8.w1, offsets, out=h_out, activation=activation, preact_out=pre, bias=b1)
    return fp8.gemm(h, fp8.w2, offsets, out=y_out, bias=b2), h, pre


def _mlp_dgrad(gy, pre, w1, w2, offsets, activation, *, need_dx=True, dx_out=None, fp8=None):
    """dpre = (gy @ W2) * act'(pre) (fused into the GEMM, W2 read transposed in place) and
    dx = dpre @ W1 (transposed view, no copy). ``fp8`` (:meth:`Fp8Experts.backward`): ``gy`` a
    :class:`TokenPack` buffer, ``dpre`` quantised per row for the second GEMM."""
    if fp8 is None:
        dpre = grouped_matmul_dact(gy, w2, offsets, pre, weight_layout="kn", activation=activation, check_offsets=False)
    else:
        dpre = grouped_matmul_dact(fp8.pack.q(gy), fp8.w1[0], offsets, pre, weight_layout="nk", activation=activation,
                                   check_offsets=False, grad_scale=fp8.pack.scale(gy), weight_scale=fp8.w1[1],
                                   scaling=fp8.recipe)
    dx = None
    if need_dx and fp8 is None:
        dx = grouped_matmul(dpre, w1, offsets, weight_layout="kn", out=dx_out, check_offsets=False)
    elif need_dx:
        dx = fp8.gemm(dpre, fp8.w2, offsets, out=dx_out)
    return dx, dpre


def _mlp_wgrad(gy, x, h, dpre, offsets, num_experts, *, dw1=None, dw2=None, accumulate=False, db=None, fp8=None):
    """dW2 = gy^T h and dW1 = dpre^T x per expert (into fp32 buffers when accumulating); with
    ``db = [db1, db2]`` (fp32 buffers, or None to allocate) the expert-bias gradients too, the
    per-expert row sums of dpre and gy, stored back into ``db``. ``fp8``: ``gy`` and ``x``
    :class:`TokenPack` buffers; every operand quantised along the rows per group (or, with
    ``grad_high_precision``, the rows dequantised into the model's dtype), gradients in ``dtype``."""
    if fp8 is not None and (fp8.grad_high_precision or db is not None):
        gy_hp = fp8.pack.dequantize(gy, fp8.dtype)
    if fp8 is not None and not fp8.grad_high_precision:
        kw = dict(accumulate=accumulate, out_dtype=fp8.dtype)
        dw2 = _wgrad_fp8(gy, h, offsets, num_experts, fp8, out=dw2, **kw)
        dw1 = _wgrad_fp8(dpre, x, offsets, num_experts, fp8, out=dw1, **kw)
        gy = gy_hp if db is not None else None
    else:
        if fp8 is not None:
            gy, x = gy_hp, fp8.pack.dequantize(x, fp8.dtype)
        dw2 = grouped_wgrad(gy, h, offsets, num_experts, out=dw2, accumulate=accumulate, check_offsets=False)
        dw1 = grouped_wgrad(dpre, x, offsets, num_experts, out=dw1, accumulate=accumulate, check_offsets=False)
    if db is not None:
        db[0] = grouped_bias_grad(dpre, offsets, num_experts, out=db[0], accumulate=accumulate, check_offsets=False)
        db[1] = grouped_bias_grad(gy, offsets, num_experts, out=db[1], accumulate=accumulate, check_offsets=False)
    return dw1, dw2


def grouped_mlp_bwd(gy, x, h, pre, w1, w2, offsets, activation, *, need_input_grad=True, need_weight_grad=True,
                    biases=False, fp8=None):
    """``(dx, dw1, dw2, db1, db2)`` of :func:`grouped_mlp_fwd` (None where not needed; the bias
    gradients only with ``biases``, in w1's dtype). ``fp8``: ``gy`` and ``x`` :class:`TokenPack`
    buffers (:meth:`Fp8Experts.backward`)."""
    gy = gy.contiguous()
    dx, dpre = _mlp_dgrad(gy, pre, w1, w2, offsets, activation, need_dx=need_input_grad, fp8=fp8)
    dw1 = dw2 = None
    db = [None, None]
    if need_weight_grad:
        dw1, dw2 = _mlp_wgrad(gy, x, h, dpre, offsets, w1.shape[0], db=db if biases else None, fp8=fp8)
        dw1, dw2 = dw1.to(w1.dtype), dw2.to(w2.dtype)
    db1, db2 = (None, None) if db[0] is None else (db[0].to(w1.dtype), db[1].to(w2.dtype))
    return dx, dw1, dw2, db1, db2


def moe_experts_fwd(x_perm, w1, w2, plan: MoEPlan, activation: str, b1=None, b2=None, fp8: Fp8Experts | None = None):
    """Token-side permuted rows -> dispatch (chunked all-to-all-v) -> expert MLP per chunk as its
    chunk arrives -> return all-to-all-v per chunk. Returns the token-side expert outputs
    ``[T*k, H]`` (zero tail) and what the backward needs: ``(y_perm, (recv, h, pre))``. ``fp8``:
    ``x_perm`` (and so ``recv``) :class:`TokenPack` rows; the outputs return in the model's dtype."""
    R, H, dtype = plan.num_expert_rows, w1.shape[2], fp8.dtype if fp8 is not None else x_perm.dtype
    recv = x_perm.new_empty((R,) + tuple(x_perm.shape[1:]))
    handles = plan.dispatch_chunks(recv, x_perm)  # all in flight; compute waits on each in turn
    y_perm = x_perm.new_empty((plan.num_rows, H), dtype=dtype)
    y_perm[plan.num_kept:].zero_()
    y_exp = x_perm.new_empty((R, H), dtype=dtype)
    pre = x_perm.new_empty((R, w1.shape[1]), dtype=dtype)
    h = x_perm.new_empty((R, w2.shape[2]), dtype=dtype)
    back = []
    for c in range(plan.num_chunks):
        r0, rn = plan.recv_rows(c)
        handles[c].wait()
        sl = slice(r0, r0 + rn)
        grouped_mlp_fwd(recv[sl], w1, w2, plan.expert_offsets[c], activation, b1=b1, b2=b2, h_out=h[sl],
                        pre_out=pre[sl], y_out=y_exp[sl], fp8=fp8)
        back.append(plan.return_chunk(c, y_perm, y_exp))
    for hd in back:
        hd.wait()
    return y_perm, (recv, h, pre)


def moe_experts_bwd(gy_perm, saved, w1, w2, plan: MoEPlan, activation: str, *, need_weight_grad: bool = True,
                    biases: bool = False, fp8: Fp8Experts | None = None):
    """Backward of :func:`moe_experts_fwd` (``saved`` is its second result): the output
    gradients travel like the dispatch, the input gradients like the return; the weight
    gradients of a chunk accumulate in fp32 while its input gradients travel.
    Returns ``(gx_perm, dw1, dw2, db1, db2)`` (weight gradients None unless ``need_weight_grad``,
    bias gradients None unless ``biases`` too). ``fp8`` (:meth:`Fp8Experts.backward`): the output
    gradients travel as :class:`TokenPack` rows (quantised per row on the token side), the input
    gradients in the model's dtype."""
    recv, h, pre = saved
    H, R = w1.shape[2], recv.shape[0]
    send = gy_perm.contiguous() if fp8 is None else fp8.pack.fill(gy_perm)
    g_recv = send.new_empty((R,) + tuple(send.shape[1:]))
    handles = plan.dispatch_chunks(g_recv, send)
    dw1 = torch.zeros(w1.shape, device=w1.device, dtype=torch.float32) if need_weight_grad else None
    dw2 = torch.zeros(w2.shape, device=w2.device, dtype=torch.float32) if need_weight_grad else None
    db = [torch.zeros(w.shape[:2], device=w.device, dtype=torch.float32) for w in (w1, w2)] \
        if need_weight_grad and biases else None
    gx_perm = gy_perm.new_empty((plan.num_rows, H))
    gx_perm[plan.num_kept:].zero_()
    dx_exp = gy_perm.new_empty((R, H))
    back = []
    for c in range(plan.num_chunks):
        r0, rn = plan.recv_rows(c)
        handles[c].wait()
        sl = slice(r0, r0 + rn)
        _, dpre = _mlp_dgrad(g_recv[sl], pre[sl], w1, w2, plan.expert_offsets[c], activation, dx_out=dx_exp[sl],
                             fp8=fp8)
        back.append(plan.return_chunk(c, gx_perm, dx_exp))
        if need_weight_grad:  # weight gradients of this chunk while its input gradients travel
            _mlp_wgrad(g_recv[sl], recv[sl], h[sl], dpre, plan.expert_offsets[c], w1.shape[0], dw1=dw1, dw2=dw2,
                       accumulate=True, db=db, fp8=fp8)
    for hd in back:
        hd.wait()
    if need_weight_grad:
        dw1, dw2 = dw1.to(w1.dtype), dw2.to(w2.dtype)
    db1, db2 = (None, None) if db is None else (db[0].to(w1.dtype), db[1].to(w2.dtype))
    return gx_perm, dw1, dw2, db1, db2


def check_expert_weights(x2d, w1, w2, activation, experts_per_rank, b1=None, b2=None):
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
    for name, b, shape in (("b1", b1, (E, n1)), ("b2", b2, (E, H))):
        if b is not None:
            check_tensor(name, b, dims=(2,))
            check_same(name, b, "x", x2d)
            if tuple(b.shape) != shape:
                raise ValueError(f"{name} must have shape {shape} ([experts, {'2F' if name == 'b1' else 'hidden'}]), "
                                 f"got {tuple(b.shape)}")


