"""The custom ops of the mixture-of-experts family (see :mod:`fusedpar.ops.common`), each bound
to ``<op>_op`` / ``<op>_backward_op`` with bodies in :mod:`.bodies`: ``fusedpar::moe_route``,
``fusedpar::moe_mlp`` (routing, count exchange, permute, the pipelined experts, combine: the whole
routed MLP in one op), ``fusedpar::grouped_mlp``, ``fusedpar::moe_permute``,
``fusedpar::moe_unpermute`` and ``fusedpar::all_to_all_v`` (its own backward, splits swapped)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fusedpar.kernels.grouped_gemm import as_group_offsets
from fusedpar.ops.comm.keys import hold
from fusedpar.ops.comm.transport import transport_from_id
from fusedpar.ops.common import custom_op, input_grads, present
from fusedpar.ops.moe.bodies import (
    TokenPack,
    absent_where_none,
    all_to_all_v_fwd,
    grouped_mlp_bwd,
    grouped_mlp_fwd,
    moe_mlp_bwd,
    moe_mlp_fwd,
    moe_permute_bwd,
    moe_permute_fwd,
    moe_route_bwd,
    moe_route_fwd,
    moe_unpermute_bwd,
    moe_unpermute_fwd,
)


def _needs(ctx, *idx) -> bool:
    return any(ctx.needs_input_grad[i] for i in idx)


# ----------------------------------------------------------------------------------------------
# grouped_mlp
# ----------------------------------------------------------------------------------------------
@custom_op("grouped_mlp")
def grouped_mlp_op(x: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor], b2: Optional[Tensor], offsets: Tensor, activation: str,
                   check_offsets: bool) -> tuple[Tensor, Tensor, Tensor]:
    if check_offsets:  # the value check reads the offsets on the host: inside the op, not in a trace
        as_group_offsets(offsets, x.shape[0], x.device)
    return grouped_mlp_fwd(x, w1, w2, offsets, activation, b1=b1, b2=b2)


@grouped_mlp_op.register_fake
def _(x, w1, w2, b1, b2, offsets, activation, check_offsets):
    M = x.shape[0]
    return x.new_empty((M, w2.shape[1])), x.new_empty((M, w2.shape[2])), x.new_empty((M, w1.shape[1]))


def _bias_grad_shapes(w1, w2, need: bool):
    return (w1.new_empty(w1.shape[:2]), w2.new_empty(w2.shape[:2])) if need else (w1.new_empty((0,)),
                                                                                  w2.new_empty((0,)))


@custom_op("grouped_mlp_backward")
def grouped_mlp_backward_op(gy: Tensor, x: Tensor, h: Tensor, pre: Tensor, w1: Tensor, w2: Tensor, offsets: Tensor, activation: str,
                            need_input_grad: bool, need_weight_grad: bool,
                            biases: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = grouped_mlp_bwd(gy, x, h, pre, w1, w2, offsets, activation, need_input_grad=need_input_grad,
                            need_weight_grad=need_weight_grad, biases=biases)
    return absent_where_none(grads, (x, w1, w2, w1, w2))


@grouped_mlp_backward_op.register_fake
def _(gy, x, h, pre, w1, w2, offsets, activation, need_input_grad, need_weight_grad, biases):
    # the kernels allocate contiguous gradients, whatever the strides of x / w1 / w2
    dx = x.new_empty(x.shape) if need_input_grad else x.new_empty((0,))
    db = _bias_grad_shapes(w1, w2, need_weight_grad and biases)
    if not need_weight_grad:
        return (dx, w1.new_empty((0,)), w2.new_empty((0,))) + db
    return (dx, w1.new_empty(w1.shape), w2.new_empty(w2.shape)) + db


def _grouped_mlp_setup(ctx, inputs, output):
    x, w1, w2, b1, b2, offsets, activation, _ = inputs
    _, h, pre = output
    ctx.activation, ctx.biases = activation, b1 is not None or b2 is not None
    ctx.save_for_backward(x, h, pre, w1, w2, offsets)


def _grouped_mlp_backward(ctx, gy, grad_h, grad_pre):
    x, h, pre, w1, w2, offsets = ctx.saved_tensors
    need_w = _needs(ctx, 1, 2, 3, 4)
    dx, dw1, dw2, db1, db2 = grouped_mlp_backward_op(gy, x, h, pre, w1, w2, offsets, ctx.activation,
                                                     ctx.needs_input_grad[0], need_w, ctx.biases)
    return input_grads(grouped_mlp_op, x=present(dx), w1=present(dw1), w2=present(dw2),
                       b1=present(db1) if ctx.needs_input_grad[3] else None,
                       b2=present(db2) if ctx.needs_input_grad[4] else None)


grouped_mlp_op.register_autograd(_grouped_mlp_backward, setup_context=_grouped_mlp_setup)


moe_mlp_op = custom_op("moe_mlp")(moe_mlp_fwd)


@moe_mlp_op.register_fake
def _(x, expert_ids, weights, w1, w2, b1, b2, num_experts, transport_id, ep, capacity, activation, num_chunks, fp8=None,
      fp8_grad_high_precision=False):
    (T, H), k = x.shape, expert_ids.shape[1]
    C = num_chunks if ep > 1 else 1
    # expert-side rows: T * k at ep == 1, else what the other ranks route here (known after the exchange)
    R = T * k if ep == 1 else torch.library.get_ctx().new_dynamic_size()
    index = x.new_empty((T * k,), dtype=torch.int32)
    recv = x.new_empty((R, H)) if fp8 is None else x.new_empty((R, TokenPack(H, fp8).row_bytes), dtype=torch.uint8)
    return (x.new_empty((T, H)), recv, x.new_empty((R, w2.shape[2])), x.new_empty((R, w1.shape[1])),
            x.new_empty((T * k, H)), index, torch.empty_like(index), x.new_empty((C, num_experts + 1), dtype=torch.int32),
            torch.empty((2, C, ep), dtype=torch.int64, device="cpu"))


moe_mlp_backward_op = custom_op("moe_mlp_backward")(moe_mlp_bwd)


@moe_mlp_backward_op.register_fake
def _(grad, weights, w1, w2, recv, h, pre, y_perm, slot_pos, sorted_slot, offsets, splits, num_experts, transport_id,
      activation, need_input_grad, need_weight_grad, biases, fp8=None, fp8_grad_high_precision=False):
    # contiguous, as the kernels allocate them, whatever the strides of grad / weights / w1 / w2
    gx = grad.new_empty(grad.shape) if need_input_grad else grad.new_empty((0,))
    gw = weights.new_empty(weights.shape)
    db = _bias_grad_shapes(w1, w2, need_weight_grad and biases)
    if not need_weight_grad:
        return (gx, gw, w1.new_empty((0,)), w2.new_empty((0,))) + db
    return (gx, gw, w1.new_empty(w1.shape), w2.new_empty(w2.shape)) + db


def _moe_mlp_setup(ctx, inputs, output):
    _, _, weights, w1, w2, b1, b2, num_experts, transport_id, _, _, activation, _, *fp8 = inputs
    ctx.num_experts, ctx.transport_id, ctx.activation = num_experts, transport_id, activation
    ctx.fp8 = tuple(fp8) + (None, False)[len(fp8):]  # (recipe, grad_high_precision)
    ctx.biases = b1 is not None or b2 is not None
    ctx.transports = hold(transport_id)  # a Transport instance given inline lives until the backward
    ctx.save_for_backward(weights, w1, w2, *output[1:])


def _moe_mlp_backward(ctx, grad, *unused):
    saved = ctx.saved_tensors
    gx, gw, dw1, dw2, db1, db2 = moe_mlp_backward_op(grad, *saved, ctx.num_experts, ctx.transport_id, ctx.activation,
                                                     ctx.needs_input_grad[0], _needs(ctx, 3, 4, 5, 6), ctx.biases,
                                                     *ctx.fp8)
    return input_grads(moe_mlp_op, x=present(gx), weights=gw if ctx.needs_input_grad[2] else None, w1=present(dw1),
                       w2=present(dw2), b1=present(db1) if ctx.needs_input_grad[5] else None,
                       b2=present(db2) if ctx.needs_input_grad[6] else None)


moe_mlp_op.register_autograd(_moe_mlp_backward, setup_context=_moe_mlp_setup)


# ----------------------------------------------------------------------------------------------
# the stage API's pieces: permute, unpermute (weighted combine), all-to-all-v
# ----------------------------------------------------------------------------------------------
@custom_op("moe_permute")
def moe_permute_op(x: Tensor, sorted_slot: Tensor, slot_pos: Tensor, top_k: int) -> Tensor:
    """:func:`~fusedpar.ops.moe.bodies.moe_permute_fwd` (``slot_pos`` is kept for the backward)."""
    return moe_permute_fwd(x, sorted_slot, top_k)


@moe_permute_op.register_fake
def _(x, sorted_slot, slot_pos, top_k):
    return x.new_empty((x.shape[0] * top_k, x.shape[1]))


@custom_op("moe_permute_backward")
def moe_permute_backward_op(grad: Tensor, slot_pos: Tensor, top_k: int) -> Tensor:
    """:func:`~fusedpar.ops.moe.bodies.moe_permute_bwd`."""
    return moe_permute_bwd(grad, slot_pos, top_k)


@moe_permute_backward_op.register_fake
def _(grad, slot_pos, top_k):
    return grad.new_empty((slot_pos.shape[0] // top_k, grad.shape[1]))


def _moe_permute_setup(ctx, inputs, output):
    ctx.top_k = inputs[3]
    ctx.save_for_backward(inputs[2])


def _moe_permute_backward(ctx, grad):
    (slot_pos,) = ctx.saved_tensors
    return input_grads(moe_permute_op, x=moe_permute_backward_op(grad, slot_pos, ctx.top_k))


moe_permute_op.register_autograd(_moe_permute_backward, setup_context=_moe_permute_setup)


@custom_op("moe_unpermute")
def moe_unpermute_op(y: Tensor, weights: Tensor, slot_pos: Tensor, sorted_slot: Tensor, top_k: int) -> Tensor:
    """:func:`~fusedpar.ops.moe.bodies.moe_unpermute_fwd` (``sorted_slot`` is kept for the backward)."""
    return moe_unpermute_fwd(y, weights, slot_pos, top_k)


@moe_unpermute_op.register_fake
def _(y, weights, slot_pos, sorted_slot, top_k):
    return y.new_empty((weights.shape[0], y.shape[1]))


@custom_op("moe_unpermute_backward")
def moe_unpermute_backward_op(grad: Tensor, y: Tensor, weights: Tensor, sorted_slot: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """:func:`~fusedpar.ops.moe.bodies.moe_unpermute_bwd`."""
    return moe_unpermute_bwd(grad, y, weights, sorted_slot, top_k)


@moe_unpermute_backward_op.register_fake
def _(grad, y, weights, sorted_slot, top_k):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _moe_unpermute_setup(ctx, inputs, output):
    y, weights, _, sorted_slot, top_k = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(y, weights, sorted_slot)


def _moe_unpermute_backward(ctx, grad):
    y, weights, sorted_slot = ctx.saved_tensors
    gy, gw = moe_unpermute_backward_op(grad, y, weights, sorted_slot, ctx.top_k)
    return input_grads(moe_unpermute_op, y=gy, weights=gw)


moe_unpermute_op.register_autograd(_moe_unpermute_backward, setup_context=_moe_unpermute_setup)


@custom_op("all_to_all_v")
def all_to_all_v_op(inp: Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], transport_id: str) -> Tensor:
    """``in_splits[r]`` rows of ``inp`` to rank ``r``, ``out_splits[r]`` rows from it (``out_rows`` in all)."""
    return all_to_all_v_fwd(inp, out_rows, out_splits, in_splits, transport_from_id(transport_id))


@all_to_all_v_op.register_fake
def _(inp, out_rows, out_splits, in_splits, transport_id):
    return inp.new_empty((out_rows,) + tuple(inp.shape[1:]))


def _all_to_all_v_setup(ctx, inputs, output):
    inp, _, out_splits, in_splits, transport_id = inputs
    ctx.args = (inp.shape[0], in_splits, out_splits, transport_id)
    ctx.transports = hold(transport_id)  # a Transport instance given inline lives until the backward


def _all_to_all_v_backward(ctx, grad):  # the gradients go back the way the rows came
    return input_grads(all_to_all_v_op, inp=all_to_all_v_op(grad.contiguous(), *ctx.args))


all_to_all_v_op.register_autograd(_all_to_all_v_backward, setup_context=_all_to_all_v_setup)


moe_route_op = custom_op("moe_route")(moe_route_fwd)


@moe_route_op.register_fake
def _(logits, bias, top_k, score, n_group, topk_group, normalize, scale):
    T = logits.shape[0]
    return logits.new_empty((T, top_k)), logits.new_empty((T, top_k), dtype=torch.int64)


moe_route_backward_op = custom_op("moe_route_backward")(moe_route_bwd)


@moe_route_backward_op.register_fake
def _(grad, logits, weights, ids, score, n_group, normalize, scale):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _moe_route_setup(ctx, inputs, output):
    logits, _, _, ctx.score, ctx.n_group, _, ctx.normalize, ctx.scale = inputs
    ctx.save_for_backward(logits, *output)
    ctx.mark_non_differentiable(output[1])


def _moe_route_backward(ctx, grad_weights, _grad_ids):
    logits, weights, ids = ctx.saved_tensors
    dl = moe_route_backward_op(grad_weights.contiguous(), logits, weights, ids, ctx.score, ctx.n_group,
                               ctx.normalize, ctx.scale)
    return input_grads(moe_route_op, logits=dl)


moe_route_op.register_autograd(_moe_route_backward, setup_context=_moe_route_setup)
