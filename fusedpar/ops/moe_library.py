"""The custom ops of the mixture-of-experts family (:mod:`fusedpar.ops.moe`; see
:mod:`fusedpar.ops.library`). Each op is bound to ``<op>_op`` (``<op>_backward_op``); its body
is a named ``<op>_fwd`` / ``<op>_bwd`` function, here or in :mod:`fusedpar.ops.moe_layout`.

* ``fusedpar::moe_mlp(x, expert_ids, weights, w1, w2, b1, b2, num_experts, token, ep, capacity,
  activation, num_chunks, fp8, fp8_grad_high_precision)`` (``b1`` / ``b2``: optional expert
  biases; ``fp8``: None or the recipe of :class:`~fusedpar.ops.moe_layout.Fp8Experts`, the
  dispatched rows then e4m3 + scales, ``recv`` their byte rows) (:data:`moe_mlp_op`, body :func:`moe_mlp_fwd`; backward
  :data:`moe_mlp_backward_op`, body :func:`moe_mlp_bwd`) — the whole routed MLP of
  :func:`fusedpar.ops.moe_mlp` in one op:
  routing, the count exchange and host read (``ep > 1``), permute, the experts (the pipelined
  schedule of :func:`~fusedpar.ops.moe_layout.moe_experts_fwd` at ``ep > 1``) and the weighted
  combine. Its residuals are the expert-side rows ``(recv, h, pre)``, the token-side expert
  outputs and the plan as tensors (:func:`~fusedpar.ops.moe_layout.plan_residuals`: slot maps and
  group offsets on the device, the host split sizes as a CPU tensor), so the backward op
  ``fusedpar::moe_mlp_backward`` rebuilds the plan without a device read and recomputes nothing.
  At ``ep > 1`` the number of expert-side rows depends on the other ranks' routing: the fake
  gives those residuals an unbacked size (``get_ctx().new_dynamic_size()``); they only flow
  into the backward op, so nothing downstream needs the value.
* ``fusedpar::grouped_mlp`` / ``grouped_mlp_backward`` (:data:`grouped_mlp_op` /
  :data:`grouped_mlp_backward_op`, bodies :func:`~fusedpar.ops.moe_layout.grouped_mlp_fwd` /
  :func:`~fusedpar.ops.moe_layout.grouped_mlp_bwd`) — the expert MLP over given offsets.
* ``fusedpar::moe_permute`` / ``moe_unpermute`` (+ backward ops) and ``all_to_all_v`` (its own
  backward with the splits swapped) — the pieces of the stage API (:func:`fusedpar.ops.moe_dispatch`
  ...), whose plan is built eagerly; bodies ``moe_permute_fwd`` ... ``all_to_all_v_fwd`` of
  :mod:`fusedpar.ops.moe_layout`.
* ``fusedpar::moe_route(logits, bias, top_k, score, n_group, topk_group, normalize, scale)``
  (:data:`moe_route_op`, body :func:`moe_route_fwd`; backward :data:`moe_route_backward_op`) —
  the router's top-k selection and combine weights (:func:`fusedpar.kernels.moe_topk.topk_route`):
  ``(weights [T, k] fp32, ids [T, k] int64)``; only the weights are differentiable, w.r.t. the logits.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.grouped_gemm import as_group_offsets
from ..kernels.moe_topk import topk_route, topk_route_backward
from .library import absent, custom_op, hold, input_grads, present
from .moe_layout import (Fp8Experts, TokenPack, all_to_all_v_fwd, build_plan, grouped_mlp_bwd, grouped_mlp_fwd,
                         moe_experts_bwd, moe_experts_fwd, moe_permute_bwd, moe_permute_fwd, moe_unpermute_bwd,
                         moe_unpermute_fwd, plan_from_residuals, plan_residuals)
from .transport import token_transport

__all__ = [  # the API is fusedpar.ops.moe
    "all_to_all_v_op", "grouped_mlp_backward_op", "grouped_mlp_op", "moe_mlp_backward_op", "moe_mlp_bwd", "moe_mlp_fwd",
    "moe_mlp_op", "moe_permute_backward_op", "moe_route_backward_op", "moe_route_bwd", "moe_route_fwd", "moe_route_op", "moe_permute_op", "moe_unpermute_backward_op", "moe_unpermute_op",
]

_T = torch.Tensor


def _needs(ctx, *idx) -> bool:
    return any(ctx.needs_input_grad[i] for i in idx)


# ----------------------------------------------------------------------------------------------
# grouped_mlp
# ----------------------------------------------------------------------------------------------
@custom_op("grouped_mlp")
def grouped_mlp_op(x: _T, w1: _T, w2: _T, b1: Optional[_T], b2: Optional[_T], offsets: _T, activation: str,
                   check_offsets: bool) -> tuple[_T, _T, _T]:
    if check_offsets:  # the value check reads the offsets on the host: inside the op, not in a trace
        as_group_offsets(offsets, x.shape[0], x.device)
    return grouped_mlp_fwd(x, w1, w2, offsets, activation, b1=b1, b2=b2)


@grouped_mlp_op.register_fake
def _(x, w1, w2, b1, b2, offsets, activation, check_offsets):
    M = x.shape[0]
    return x.new_empty((M, w2.shape[1])), x.new_empty((M, w2.shape[2])), x.new_empty((M, w1.shape[1]))


def _or_absent(grads, likes):
    return tuple(g if g is not None else absent(like) for g, like in zip(grads, likes))


def _bias_grad_shapes(w1, w2, need: bool):
    return (w1.new_empty(w1.shape[:2]), w2.new_empty(w2.shape[:2])) if need else (w1.new_empty((0,)),
                                                                                  w2.new_empty((0,)))


@custom_op("grouped_mlp_backward")
def grouped_mlp_backward_op(gy: _T, x: _T, h: _T, pre: _T, w1: _T, w2: _T, offsets: _T, activation: str,
                            need_input_grad: bool, need_weight_grad: bool,
                            biases: bool) -> tuple[_T, _T, _T, _T, _T]:
    grads = grouped_mlp_bwd(gy, x, h, pre, w1, w2, offsets, activation, need_input_grad=need_input_grad,
                            need_weight_grad=need_weight_grad, biases=biases)
    return _or_absent(grads, (x, w1, w2, w1, w2))


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


# ----------------------------------------------------------------------------------------------
# moe_mlp: the whole routed MLP (ep == 1 and the pipelined ep > 1 schedule)
# ----------------------------------------------------------------------------------------------
def moe_mlp_fwd(x: _T, expert_ids: _T, weights: _T, w1: _T, w2: _T, b1: Optional[_T], b2: Optional[_T],
                num_experts: int, token: str, ep: int, capacity: int | None, activation: str,
                num_chunks: int, fp8: Optional[str] = None,
                fp8_grad_high_precision: bool = False) -> tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T]:
    """``(out, recv, h, pre, y_perm, slot_pos, sorted_slot, offsets, splits)``; see the module
    docstring. ``fp8``: the tokens quantised per token once, then permuted (and dispatched) as
    e4m3 + scales (:class:`~fusedpar.ops.moe_layout.TokenPack`)."""
    plan, pending = build_plan(x, expert_ids, num_experts, token_transport(token), capacity, num_chunks if ep > 1 else 1)
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


moe_mlp_op = custom_op("moe_mlp")(moe_mlp_fwd)


@moe_mlp_op.register_fake
def _(x, expert_ids, weights, w1, w2, b1, b2, num_experts, token, ep, capacity, activation, num_chunks, fp8=None,
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


def moe_mlp_bwd(grad: _T, weights: _T, w1: _T, w2: _T, recv: _T, h: _T, pre: _T, y_perm: _T, slot_pos: _T,
                sorted_slot: _T, offsets: _T, splits: _T, num_experts: int, token: str, activation: str,
                need_input_grad: bool, need_weight_grad: bool, biases: bool, fp8: Optional[str] = None,
                fp8_grad_high_precision: bool = False) -> tuple[_T, _T, _T, _T, _T, _T]:
    """``(grad_x, grad_weights, grad_w1, grad_w2, grad_b1, grad_b2)`` (absent where not needed)
    from the forward's residuals. ``fp8``: the output gradients quantised per routed row (and so
    dispatched), the input gradients returned in the model's dtype."""
    k = weights.shape[1]
    gy_perm, gw = moe_unpermute_bwd(grad, y_perm, weights, sorted_slot, k)
    transport = token_transport(token)
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
    return (gx, gw) + _or_absent((dw1, dw2, db1, db2), (w1, w2, w1, w2))


moe_mlp_backward_op = custom_op("moe_mlp_backward")(moe_mlp_bwd)


@moe_mlp_backward_op.register_fake
def _(grad, weights, w1, w2, recv, h, pre, y_perm, slot_pos, sorted_slot, offsets, splits, num_experts, token,
      activation, need_input_grad, need_weight_grad, biases, fp8=None, fp8_grad_high_precision=False):
    # contiguous, as the kernels allocate them, whatever the strides of grad / weights / w1 / w2
    gx = grad.new_empty(grad.shape) if need_input_grad else grad.new_empty((0,))
    gw = weights.new_empty(weights.shape)
    db = _bias_grad_shapes(w1, w2, need_weight_grad and biases)
    if not need_weight_grad:
        return (gx, gw, w1.new_empty((0,)), w2.new_empty((0,))) + db
    return (gx, gw, w1.new_empty(w1.shape), w2.new_empty(w2.shape)) + db


def _moe_mlp_setup(ctx, inputs, output):
    _, _, weights, w1, w2, b1, b2, num_experts, token, _, _, activation, _, *fp8 = inputs
    ctx.num_experts, ctx.token, ctx.activation = num_experts, token, activation
    ctx.fp8 = tuple(fp8) + (None, False)[len(fp8):]  # (recipe, grad_high_precision)
    ctx.biases = b1 is not None or b2 is not None
    ctx.transports = hold(token)  # a Transport instance given inline lives until the backward
    ctx.save_for_backward(weights, w1, w2, *output[1:])


def _moe_mlp_backward(ctx, grad, *unused):
    saved = ctx.saved_tensors
    gx, gw, dw1, dw2, db1, db2 = moe_mlp_backward_op(grad, *saved, ctx.num_experts, ctx.token, ctx.activation,
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
def moe_permute_op(x: _T, sorted_slot: _T, slot_pos: _T, top_k: int) -> _T:
    """:func:`~fusedpar.ops.moe_layout.moe_permute_fwd` (``slot_pos`` is kept for the backward)."""
    return moe_permute_fwd(x, sorted_slot, top_k)


@moe_permute_op.register_fake
def _(x, sorted_slot, slot_pos, top_k):
    return x.new_empty((x.shape[0] * top_k, x.shape[1]))


@custom_op("moe_permute_backward")
def moe_permute_backward_op(grad: _T, slot_pos: _T, top_k: int) -> _T:
    """:func:`~fusedpar.ops.moe_layout.moe_permute_bwd`."""
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
def moe_unpermute_op(y: _T, weights: _T, slot_pos: _T, sorted_slot: _T, top_k: int) -> _T:
    """:func:`~fusedpar.ops.moe_layout.moe_unpermute_fwd` (``sorted_slot`` is kept for the backward)."""
    return moe_unpermute_fwd(y, weights, slot_pos, top_k)


@moe_unpermute_op.register_fake
def _(y, weights, slot_pos, sorted_slot, top_k):
    return y.new_empty((weights.shape[0], y.shape[1]))


@custom_op("moe_unpermute_backward")
def moe_unpermute_backward_op(grad: _T, y: _T, weights: _T, sorted_slot: _T, top_k: int) -> tuple[_T, _T]:
    """:func:`~fusedpar.ops.moe_layout.moe_unpermute_bwd`."""
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
def all_to_all_v_op(inp: _T, out_rows: int, out_splits: list[int], in_splits: list[int], token: str) -> _T:
    """``in_splits[r]`` rows of ``inp`` to rank ``r``, ``out_splits[r]`` rows from it (``out_rows`` in all)."""
    return all_to_all_v_fwd(inp, out_rows, out_splits, in_splits, token_transport(token))


@all_to_all_v_op.register_fake
def _(inp, out_rows, out_splits, in_splits, token):
    return inp.new_empty((out_rows,) + tuple(inp.shape[1:]))


def _all_to_all_v_setup(ctx, inputs, output):
    inp, _, out_splits, in_splits, token = inputs
    ctx.args = (inp.shape[0], in_splits, out_splits, token)
    ctx.transports = hold(token)  # a Transport instance given inline lives until the backward


def _all_to_all_v_backward(ctx, grad):  # the gradients go back the way the rows came
    return input_grads(all_to_all_v_op, inp=all_to_all_v_op(grad.contiguous(), *ctx.args))


all_to_all_v_op.register_autograd(_all_to_all_v_backward, setup_context=_all_to_all_v_setup)


# ----------------------------------------------------------------------------------------------
# moe_route: the router's selection and combine weights
# ----------------------------------------------------------------------------------------------
def moe_route_fwd(logits: _T, bias: Optional[_T], top_k: int, score: str, n_group: int, topk_group: int,
                  normalize: bool, scale: float) -> tuple[_T, _T]:
    """:func:`~fusedpar.kernels.moe_topk.topk_route` of ``logits``."""
    return topk_route(logits, top_k, score=score, bias=bias, n_group=n_group, topk_group=topk_group,
                      normalize=normalize, scale=scale)


moe_route_op = custom_op("moe_route")(moe_route_fwd)


@moe_route_op.register_fake
def _(logits, bias, top_k, score, n_group, topk_group, normalize, scale):
    T = logits.shape[0]
    return logits.new_empty((T, top_k)), logits.new_empty((T, top_k), dtype=torch.int64)


def moe_route_bwd(grad: _T, logits: _T, weights: _T, ids: _T, score: str, n_group: int, normalize: bool,
                  scale: float) -> _T:
    """:func:`~fusedpar.kernels.moe_topk.topk_route_backward`: ``d logits``."""
    return topk_route_backward(grad, logits, weights, ids, score=score, n_group=n_group, normalize=normalize,
                               scale=scale)


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
