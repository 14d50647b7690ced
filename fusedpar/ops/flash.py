"""Differentiable flash attention on one device: :func:`flash_attention` and, for packed
documents, :func:`flash_attention_varlen`, as ``torch.library`` custom ops over the launchers
:func:`fusedpar.kernels.flash_attention.flash_attention_forward` /
:func:`fusedpar.kernels.flash_attention_bwd.flash_attention_backward` (and their varlen twins).

Ops (see :mod:`fusedpar.ops.library`): ``torch.ops.fusedpar.flash_attention(q, k, v, causal,
softmax_scale, q_offset, k_offset) -> (out, lse)`` and ``fusedpar::flash_attention_backward``;
``torch.ops.fusedpar.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal, softmax_scale) -> (out, lse)`` and ``fusedpar::flash_attention_varlen_backward``.
``lse`` is not differentiable. The functional API checks its arguments (shapes, dtypes, modes;
what ``torch.compile`` traces) before calling the op; the values of ``cu_seqlens`` are checked
inside the op (on CPU tensors), where they are read.

Layers: Triton kernels -> launchers (``fusedpar.kernels``) -> the custom ops ->
:func:`flash_attention`. The sequence-parallel ops (:mod:`fusedpar.ops.attention`) call the
launchers block by block instead.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_bool
from fusedpar.kernels.flash_attention import check_offsets, check_qkv, flash_attention_forward, resolve_softmax_scale
from fusedpar.kernels.flash_attention_bwd import flash_attention_backward
from fusedpar.kernels.flash_varlen import check_varlen_inputs
from fusedpar.kernels.flash_varlen import flash_attention_varlen as flash_attention_varlen_forward
from fusedpar.kernels.flash_varlen import flash_attention_varlen_backward

__all__ = ["flash_attention", "flash_attention_varlen"]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::flash_attention", mutates_args=())
def _flash_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None, q_offset: int,
              k_offset: int) -> tuple[Tensor, Tensor]:
    return flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset,
                                   k_offset=k_offset)


@_flash_op.register_fake
def _(q, k, v, causal, softmax_scale, q_offset, k_offset):
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("fusedpar::flash_attention_backward", mutates_args=())
def _flash_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: float | None, q_offset: int, k_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    return flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                    q_offset=q_offset, k_offset=k_offset)


@_flash_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, q_offset, k_offset):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_setup(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)  # causal, softmax_scale, q_offset, k_offset


def _flash_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        return (None,) * 7
    dq, dk, dv = torch.ops.fusedpar.flash_attention_backward(dout.to(q.dtype), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


_flash_op.register_autograd(_flash_backward, setup_context=_flash_setup)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0):
    """Scaled dot-product attention with a flash kernel; returns ``(out, lse)``.

    q ``[batch, seq_q, heads, head_dim]``, k/v ``[batch, seq_k, kv_heads, head_dim]`` (kv_heads
    divides heads: grouped-query attention), any strides. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``. With ``causal=True`` query ``i`` sees key ``j`` iff
    ``k_offset + j <= q_offset + i`` (global positions of two blocks of one sequence); rows that
    see no key give ``out = 0`` and ``lse = -inf``. ``lse`` (``[batch, heads, seq_q]``, fp32,
    natural log) is not differentiable (it is marked so; gradients flow through ``out``).
    A ``torch.library`` op (``torch.ops.fusedpar.flash_attention``): traceable by ``torch.compile``.
    """
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset)
    check_bool("causal", causal)
    resolve_softmax_scale(softmax_scale, q.shape[3])
    scale = None if softmax_scale is None else float(softmax_scale)
    return torch.ops.fusedpar.flash_attention(q, k, v, causal, scale, q_offset, k_offset)


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention_varlen
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fusedpar::flash_attention_varlen", mutates_args=())
def _varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: float | None) -> tuple[Tensor, Tensor]:
    return flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, softmax_scale=softmax_scale)


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fusedpar::flash_attention_varlen_backward", mutates_args=())
def _varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        causal: bool, softmax_scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    return flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, causal=causal, softmax_scale=softmax_scale)


@_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = tuple(args)  # max_seqlen_q, max_seqlen_k, causal, softmax_scale


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        return (None,) * 9
    dq, dk, dv = torch.ops.fusedpar.flash_attention_varlen_backward(dout.to(q.dtype), q, k, v, out, lse, cu_q, cu_k,
                                                                    *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None):
    """Differentiable attention over packed documents (flash-attn's ``flash_attn_varlen_func``
    convention); returns ``(out, lse)``.

    q ``[total_q, heads, d]``, k/v ``[total_k, kv_heads, d]`` (kv_heads divides heads),
    ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 ``[num_docs + 1]`` cumulative document lengths on
    q's device, ``max_seqlen_*`` at least the longest document. Document ``i``'s queries attend
    to its own keys only; ``causal=True`` is bottom-right aligned per document (query ``i`` sees
    key ``j`` iff ``j <= i + len_k - len_q``). ``lse`` ``[heads, total_q]`` fp32 is not
    differentiable. The kernels-level :func:`fusedpar.kernels.flash_attention_varlen` is the
    same forward without autograd. A ``torch.library`` op
    (``torch.ops.fusedpar.flash_attention_varlen``): traceable by ``torch.compile``.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, values=False)
    check_bool("causal", causal)
    resolve_softmax_scale(softmax_scale, q.shape[2])
    scale = None if softmax_scale is None else float(softmax_scale)
    return torch.ops.fusedpar.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     causal, scale)
