"""The bodies of the MoE ops (no autograd here): routing (:func:`moe_route_fwd` / ``_bwd``),
permute / unpermute, all-to-all-v, the grouped expert MLP (:func:`grouped_mlp_fwd` / ``_bwd``),
the pipelined expert-parallel schedule (:func:`moe_experts_fwd` / :func:`moe_experts_bwd`) and the
whole layer (:func:`moe_mlp_fwd` / :func:`moe_mlp_bwd`).

fp8 (:class:`Fp8Experts`): the expert-side rows of the input and of the output gradient travel as
e4m3 with their fp32 scales in one byte row each (:class:`TokenPack`), the grouped GEMMs run on
e4m3 operands; outputs and input gradients come back in the model's dtype."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fusedpar.kernels.fp8 import FP8_BLOCK, dequantize_e4m3, quantize_e4m3, quantize_e4m3_groups
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.grouped_bias import grouped_bias_grad
from fusedpar.kernels.grouped_gemm import grouped_matmul, grouped_matmul_dact, grouped_wgrad
from fusedpar.kernels.moe_permute import combine, combine_backward, permute
from fusedpar.kernels.moe_topk import topk_route, topk_route_backward
from fusedpar.ops.comm.transport import Transport, transport_from_id
from fusedpar.ops.common import absent, or_absent
from fusedpar.ops.moe.plan import MoEPlan, build_plan, plan_from_residuals, plan_residuals


def absent_where_none(grads, likes) -> tuple:
    """Each of ``grads``, or :func:`~fusedpar.ops.common.absent`'s placeholder for ``None``."""
    return tuple(or_absent(g, like) for g, like in zip(grads, likes))


# ----------------------------------------------------------------------------------------------
# moe_mlp: the whole routed MLP (ep == 1 and the pipelined ep > 1 schedule)
# ----------------------------------------------------------------------------------------------
def moe_mlp_fwd(x: Tensor, expert_ids: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor], b2: Optional[Tensor],
                num_experts: int, transport_id: str, ep: int, capacity: int | None, activation: str,
                num_chunks: int, fp8: Optional[str] = None,
                fp8_grad_high_precision: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, recv, h, pre, y_perm, slot_pos, sorted_slot, offsets, splits)``; see the module
    docstring. ``fp8``: the tokens quantised per token once, then permuted (and dispatched) as
    e4m3 + scales (:class:`~fusedpar.ops.moe.bodies.TokenPack`)."""
    plan, pending = build_plan(x, expert_ids, num_experts, transport_from_id(transport_id), capacity, num_chunks if ep > 1 else 1)
    k = plan.top_k
    f8 = None if fp8 is None else Fp8Experts.forward(fp8, w1, w2, x.dtype)
    x_perm = moe_permute_fwd(x if f8 is None else f8.pack.fill(x), plan.sorted_slot, k)
    if ep == 1:
        y_perm, h, pre = grouped_mlp_fwd(x_perm, w1, w2, plan.expert_offsets[0], activation, b1=b1, b2=b2, fp8=f8)
        recv = x_perm
    else:
        y_perm, (recv, h, pre) = moe_experts_fwd(x_perm, w1, w2, plan, activation, b1, b2, fp8=f8)
    out = moe_unpermute_fwd(y_perm, weights, plan.slot_pos, k)
    if pending is not None:
        pending.wait()
    offsets, splits = plan_residuals(plan)
    return out, recv, h, pre, y_perm, plan.slot_pos, plan.sorted_slot, offsets, splits


def moe_mlp_bwd(grad: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, recv: Tensor, h: Tensor, pre: Tensor, y_perm: Tensor, slot_pos: Tensor,
                sorted_slot: Tensor, offsets: Tensor, splits: Tensor, num_experts: int, transport_id: str, activation: str,
                need_input_grad: bool, need_weight_grad: bool, biases: bool, fp8: Optional[str] = None,
                fp8_grad_high_precision: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(grad_x, grad_weights, grad_w1, grad_w2, grad_b1, grad_b2)`` (absent where not needed)
    from the forward's residuals. ``fp8``: the output gradients quantised per routed row (and so
    dispatched), the input gradients returned in the model's dtype."""
    k = weights.shape[1]
    gy_perm, gw = moe_unpermute_bwd(grad, y_perm, weights, sorted_slot, k)
    transport = transport_from_id(transport_id)
    f8 = None if fp8 is None else Fp8Experts.backward(fp8, w1, w2, h.dtype, fp8_grad_high_precision)
    if transport.size == 1:
        gx_perm, dw1, dw2, db1, db2 = grouped_mlp_bwd(gy_perm if f8 is None else f8.pack.fill(gy_perm), recv, h, pre,
                                                      w1, w2, offsets[0], activation, need_input_grad=need_input_grad,
                                                      need_weight_grad=need_weight_grad, biases=biases, fp8=f8)
    else:  # every rank returns its experts' input gradients, whatever it needs itself
        plan = plan_from_residuals(slot_pos, sorted_slot, offsets, splits, k, num_experts, transport)
        gx_perm, dw1, dw2, db1, db2 = moe_experts_bwd(gy_perm, (recv, h, pre), w1, w2, plan, activation,
                                                      need_weight_grad=need_weight_grad, biases=biases, fp8=f8)
    gx = moe_permute_bwd(gx_perm, slot_pos, k) if need_input_grad else absent(grad)
    return (gx, gw) + absent_where_none((dw1, dw2, db1, db2), (w1, w2, w1, w2))


# ----------------------------------------------------------------------------------------------
# moe_route: the router's selection and combine weights
# ----------------------------------------------------------------------------------------------
def moe_route_fwd(logits: Tensor, bias: Optional[Tensor], top_k: int, score: str, n_group: int, topk_group: int,
                  normalize: bool, scale: float) -> tuple[Tensor, Tensor]:
    """:func:`~fusedpar.kernels.moe_topk.topk_route` of ``logits``."""
    return topk_route(logits, top_k, score=score, bias=bias, n_group=n_group, topk_group=topk_group,
                      normalize=normalize, scale=scale)


def moe_route_bwd(grad: Tensor, logits: Tensor, weights: Tensor, ids: Tensor, score: str, n_group: int, normalize: bool,
                  scale: float) -> Tensor:
    """:func:`~fusedpar.kernels.moe_topk.topk_route_backward`: ``d logits``."""
    return topk_route_backward(grad, logits, weights, ids, score=score, n_group=n_group, normalize=normalize,
                               scale=scale)


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
# forward / backward of each op (the bodies of the custom ops of custom_ops.py)
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
