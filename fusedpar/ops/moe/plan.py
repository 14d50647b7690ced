"""The layout of a mixture-of-experts call: :class:`MoEPlan` (where every routed slot goes; built
by :func:`build_plan`, with ``ep > 1`` after the one count exchange and host read of the layer),
the plan's residuals for the backward (:func:`plan_residuals`, :func:`plan_from_residuals`) and
the argument checks of the MoE ops (:func:`check_routing`, :func:`check_expert_weights`, expert
ids in range, checked without a host sync where possible)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusedpar.kernels.checks import (
    check_choice,
    check_divisible,
    check_int,
    check_positive_dims,
    check_same,
    check_shape,
    check_tensor,
)
from fusedpar.kernels.moe_routing import routing_metadata
from fusedpar.kernels.runtime import ACTIVATIONS
from fusedpar.ops.comm.transport import Transport


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
