"""The mixture-of-experts ops as ``torch.library`` custom ops (see :mod:`fusedpar.ops.library`).

* ``fusedpar::moe_mlp(x, expert_ids, weights, w1, w2, num_experts, token, ep, capacity,
  activation, num_chunks)`` — the whole routed MLP of :func:`fusedpar.ops.moe_mlp` in one op:
  routing, the count exchange and host read (``ep > 1``), permute, the experts (the pipelined
  schedule of :func:`~fusedpar.ops.moe_layout.moe_experts_fwd` at ``ep > 1``) and the weighted
  combine. Its residuals are the expert-side rows ``(recv, h, pre)``, the token-side expert
  outputs and the plan as tensors (:func:`~fusedpar.ops.moe_layout.plan_residuals`: slot maps and
  group offsets on the device, the host split sizes as a CPU tensor), so the backward op
  ``fusedpar::moe_mlp_backward`` rebuilds the plan without a device read and recomputes nothing.
  At ``ep > 1`` the number of expert-side rows depends on the other ranks' routing: the fake
  gives those residuals an unbacked size (``get_ctx().new_dynamic_size()``); they only flow
  into the backward op, so nothing downstream needs the value.
* ``fusedpar::grouped_mlp`` / ``grouped_mlp_backward`` — the expert MLP over given offsets.
* ``fusedpar::moe_permute`` / ``moe_unpermute`` / ``all_to_all_v`` (+ backward ops) — the pieces of
  the stage API (:func:`fusedpar.ops.moe_dispatch` ...), whose plan is built eagerly.
"""
from __future__ import annotations

import torch

from ..kernels.grouped_gemm import as_group_offsets
from ..kernels.moe_permute import combine, combine_backward, permute
from .library import absent, hold, present
from .moe_layout import (all_to_all_v_fwd, build_plan, grouped_mlp_bwd, grouped_mlp_fwd, moe_experts_bwd,
                         moe_experts_fwd, plan_from_residuals, plan_residuals)
from .transport import token_transport

__all__ = []  # registers the ops; the API is fusedpar.ops.moe

_T = torch.Tensor


def _needs(ctx, *idx) -> bool:
    return any(ctx.needs_input_grad[i] for i in idx)


# ----------------------------------------------------------------------------------------------
# grouped_mlp
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::grouped_mlp", mutates_args=())
def _grouped_mlp_op(x: _T, w1: _T, w2: _T, offsets: _T, activation: str, check_offsets: bool) -> tuple[_T, _T, _T]:
    if check_offsets:  # the value check reads the offsets on the host: inside the op, not in a trace
        as_group_offsets(offsets, x.shape[0], x.device)
    return grouped_mlp_fwd(x, w1, w2, offsets, activation)


@_grouped_mlp_op.register_fake
def _(x, w1, w2, offsets, activation, check_offsets):
    M = x.shape[0]
    return x.new_empty((M, w2.shape[1])), x.new_empty((M, w2.shape[2])), x.new_empty((M, w1.shape[1]))


@torch.library.custom_op("fusedpar::grouped_mlp_backward", mutates_args=())
def _grouped_mlp_backward_op(gy: _T, x: _T, h: _T, pre: _T, w1: _T, w2: _T, offsets: _T, activation: str,
                             need_input_grad: bool, need_weight_grad: bool) -> tuple[_T, _T, _T]:
    dx, dw1, dw2 = grouped_mlp_bwd(gy, x, h, pre, w1, w2, offsets, activation, need_input_grad=need_input_grad,
                                   need_weight_grad=need_weight_grad)
    return (dx if dx is not None else absent(x)), (dw1 if dw1 is not None else absent(w1)), \
        (dw2 if dw2 is not None else absent(w2))


@_grouped_mlp_backward_op.register_fake
def _(gy, x, h, pre, w1, w2, offsets, activation, need_input_grad, need_weight_grad):
    # the kernels allocate contiguous gradients, whatever the strides of x / w1 / w2
    dx = x.new_empty(x.shape) if need_input_grad else x.new_empty((0,))
    if not need_weight_grad:
        return dx, w1.new_empty((0,)), w2.new_empty((0,))
    return dx, w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def _grouped_mlp_setup(ctx, inputs, output):
    x, w1, w2, offsets, activation, _ = inputs
    _, h, pre = output
    ctx.activation = activation
    ctx.save_for_backward(x, h, pre, w1, w2, offsets)


def _grouped_mlp_backward(ctx, gy, grad_h, grad_pre):
    x, h, pre, w1, w2, offsets = ctx.saved_tensors
    need_w = _needs(ctx, 1, 2)
    dx, dw1, dw2 = torch.ops.fusedpar.grouped_mlp_backward(gy, x, h, pre, w1, w2, offsets, ctx.activation,
                                                           ctx.needs_input_grad[0], need_w)
    return present(dx), present(dw1), present(dw2), None, None, None


_grouped_mlp_op.register_autograd(_grouped_mlp_backward, setup_context=_grouped_mlp_setup)


# ----------------------------------------------------------------------------------------------
# moe_mlp: the whole routed MLP (ep == 1 and the pipelined ep > 1 schedule)
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::moe_mlp", mutates_args=())
def _moe_mlp_op(x: _T, expert_ids: _T, weights: _T, w1: _T, w2: _T, num_experts: int, token: str, ep: int,
                capacity: int | None, activation: str, num_chunks: int) -> tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T]:
    """``(out, recv, h, pre, y_perm, slot_pos, sorted_slot, offsets, splits)``; see the module docstring."""
    plan, pending = build_plan(x, expert_ids, num_experts, token_transport(token), capacity, num_chunks if ep > 1 else 1)
    k = plan.top_k
    x_perm = permute(x, plan.sorted_slot, k)
    if ep == 1:
        y_perm, h, pre = grouped_mlp_fwd(x_perm, w1, w2, plan.expert_offsets[0], activation)
        recv = x_perm
    else:
        y_perm, (recv, h, pre) = moe_experts_fwd(x_perm, w1, w2, plan, activation)
    out = combine(y_perm, plan.slot_pos, weights, k, out_dtype=y_perm.dtype)
    if pending is not None:
        pending.wait()
    offsets, splits = plan_residuals(plan)
    return out, recv, h, pre, y_perm, plan.slot_pos, plan.sorted_slot, offsets, splits


@_moe_mlp_op.register_fake
def _(x, expert_ids, weights, w1, w2, num_experts, token, ep, capacity, activation, num_chunks):
    (T, H), k = x.shape, expert_ids.shape[1]
    C = num_chunks if ep > 1 else 1
    # expert-side rows: T * k at ep == 1, else what the other ranks route here (known after the exchange)
    R = T * k if ep == 1 else torch.library.get_ctx().new_dynamic_size()
    index = x.new_empty((T * k,), dtype=torch.int32)
    return (x.new_empty((T, H)), x.new_empty((R, H)), x.new_empty((R, w2.shape[2])), x.new_empty((R, w1.shape[1])),
            x.new_empty((T * k, H)), index, torch.empty_like(index), x.new_empty((C, num_experts + 1), dtype=torch.int32),
            torch.empty((2, C, ep), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("fusedpar::moe_mlp_backward", mutates_args=())
def _moe_mlp_backward_op(grad: _T, weights: _T, w1: _T, w2: _T, recv: _T, h: _T, pre: _T, y_perm: _T, slot_pos: _T,
                         sorted_slot: _T, offsets: _T, splits: _T, num_experts: int, token: str, activation: str,
                         need_input_grad: bool, need_weight_grad: bool) -> tuple[_T, _T, _T, _T]:
    """``(grad_x, grad_weights, grad_w1, grad_w2)`` (absent where not needed) from the forward's residuals."""
    k = weights.shape[1]
    gy_perm, gw = combine_backward(grad.contiguous(), y_perm, weights, sorted_slot, k)
    transport = token_transport(token)
    if transport.size == 1:
        gx_perm, dw1, dw2 = grouped_mlp_bwd(gy_perm, recv, h, pre, w1, w2, offsets[0], activation,
                                            need_input_grad=need_input_grad, need_weight_grad=need_weight_grad)
    else:  # every rank returns its experts' input gradients, whatever it needs itself
        plan = plan_from_residuals(slot_pos, sorted_slot, offsets, splits, k, num_experts, transport)
        gx_perm, dw1, dw2 = moe_experts_bwd(gy_perm, (recv, h, pre), w1, w2, plan, activation,
                                            need_weight_grad=need_weight_grad)
    gx = combine(gx_perm, slot_pos, None, k) if need_input_grad else absent(grad)
    if not need_weight_grad:
        dw1, dw2 = absent(w1), absent(w2)
    return gx, gw.to(weights.dtype), dw1, dw2


@_moe_mlp_backward_op.register_fake
def _(grad, weights, w1, w2, recv, h, pre, y_perm, slot_pos, sorted_slot, offsets, splits, num_experts, token,
      activation, need_input_grad, need_weight_grad):
    # contiguous, as the kernels allocate them, whatever the strides of grad / weights / w1 / w2
    gx = grad.new_empty(grad.shape) if need_input_grad else grad.new_empty((0,))
    gw = weights.new_empty(weights.shape)
    if not need_weight_grad:
        return gx, gw, w1.new_empty((0,)), w2.new_empty((0,))
    return gx, gw, w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def _moe_mlp_setup(ctx, inputs, output):
    _, _, weights, w1, w2, num_experts, token, _, _, activation, _ = inputs
    ctx.num_experts, ctx.token, ctx.activation = num_experts, token, activation
    ctx.transports = hold(token)  # a Transport instance given inline lives until the backward
    ctx.save_for_backward(weights, w1, w2, *output[1:])


def _moe_mlp_backward(ctx, grad, *unused):
    saved = ctx.saved_tensors
    gx, gw, dw1, dw2 = torch.ops.fusedpar.moe_mlp_backward(grad, *saved, ctx.num_experts, ctx.token, ctx.activation,
                                                           ctx.needs_input_grad[0], _needs(ctx, 3, 4))
    return present(gx), None, (gw if ctx.needs_input_grad[2] else None), present(dw1), present(dw2), *([None] * 6)


_moe_mlp_op.register_autograd(_moe_mlp_backward, setup_context=_moe_mlp_setup)


# ----------------------------------------------------------------------------------------------
# the stage API's pieces: permute, unpermute (weighted combine), all-to-all-v
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::moe_permute", mutates_args=())
def _moe_permute_op(x: _T, sorted_slot: _T, slot_pos: _T, top_k: int) -> _T:
    return permute(x, sorted_slot, top_k)


@_moe_permute_op.register_fake
def _(x, sorted_slot, slot_pos, top_k):
    return x.new_empty((x.shape[0] * top_k, x.shape[1]))


@torch.library.custom_op("fusedpar::moe_permute_backward", mutates_args=())
def _moe_permute_backward_op(grad: _T, slot_pos: _T, top_k: int) -> _T:
    return combine(grad.contiguous(), slot_pos, None, top_k)


@_moe_permute_backward_op.register_fake
def _(grad, slot_pos, top_k):
    return grad.new_empty((slot_pos.shape[0] // top_k, grad.shape[1]))


def _moe_permute_setup(ctx, inputs, output):
    ctx.top_k = inputs[3]
    ctx.save_for_backward(inputs[2])


def _moe_permute_backward(ctx, grad):
    (slot_pos,) = ctx.saved_tensors
    return torch.ops.fusedpar.moe_permute_backward(grad, slot_pos, ctx.top_k), None, None, None


_moe_permute_op.register_autograd(_moe_permute_backward, setup_context=_moe_permute_setup)


@torch.library.custom_op("fusedpar::moe_unpermute", mutates_args=())
def _moe_unpermute_op(y: _T, weights: _T, slot_pos: _T, sorted_slot: _T, top_k: int) -> _T:
    return combine(y, slot_pos, weights, top_k, out_dtype=y.dtype)


@_moe_unpermute_op.register_fake
def _(y, weights, slot_pos, sorted_slot, top_k):
    return y.new_empty((weights.shape[0], y.shape[1]))


@torch.library.custom_op("fusedpar::moe_unpermute_backward", mutates_args=())
def _moe_unpermute_backward_op(grad: _T, y: _T, weights: _T, sorted_slot: _T, top_k: int) -> tuple[_T, _T]:
    gy, gw = combine_backward(grad.contiguous(), y, weights, sorted_slot[: y.shape[0]], top_k)
    return gy, gw.to(weights.dtype)


@_moe_unpermute_backward_op.register_fake
def _(grad, y, weights, sorted_slot, top_k):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _moe_unpermute_setup(ctx, inputs, output):
    y, weights, _, sorted_slot, top_k = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(y, weights, sorted_slot)


def _moe_unpermute_backward(ctx, grad):
    y, weights, sorted_slot = ctx.saved_tensors
    gy, gw = torch.ops.fusedpar.moe_unpermute_backward(grad, y, weights, sorted_slot, ctx.top_k)
    return gy, gw, None, None, None


_moe_unpermute_op.register_autograd(_moe_unpermute_backward, setup_context=_moe_unpermute_setup)


@torch.library.custom_op("fusedpar::all_to_all_v", mutates_args=())
def _all_to_all_v_op(inp: _T, out_rows: int, out_splits: list[int], in_splits: list[int], token: str) -> _T:
    """``in_splits[r]`` rows of ``inp`` to rank ``r``, ``out_splits[r]`` rows from it (``out_rows`` in all)."""
    return all_to_all_v_fwd(inp, out_rows, out_splits, in_splits, token_transport(token))


@_all_to_all_v_op.register_fake
def _(inp, out_rows, out_splits, in_splits, token):
    return inp.new_empty((out_rows,) + tuple(inp.shape[1:]))


def _all_to_all_v_setup(ctx, inputs, output):
    inp, _, out_splits, in_splits, token = inputs
    ctx.args = (inp.shape[0], in_splits, out_splits, token)
    ctx.transports = hold(token)  # a Transport instance given inline lives until the backward


def _all_to_all_v_backward(ctx, grad):  # the gradients go back the way the rows came
    return torch.ops.fusedpar.all_to_all_v(grad.contiguous(), *ctx.args), None, None, None, None


_all_to_all_v_op.register_autograd(_all_to_all_v_backward, setup_context=_all_to_all_v_setup)
