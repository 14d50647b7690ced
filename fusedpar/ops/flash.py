"""Differentiable flash attention on one device: :func:`flash_attention` and, for packed
documents, :func:`flash_attention_varlen` (autograd) over the
launchers :func:`fusedpar.kernels.flash_attention.flash_attention_forward` and
:func:`fusedpar.kernels.flash_attention_bwd.flash_attention_backward`.

Layers: Triton kernels -> launchers (``fusedpar.kernels``) -> :class:`FlashAttentionFunction` ->
:func:`flash_attention`. The sequence-parallel ops (:mod:`fusedpar.ops.attention`) call the
launchers block by block instead.
"""
from __future__ import annotations

import torch

from fusedpar.kernels.flash_attention import flash_attention_forward
from fusedpar.kernels.flash_attention_bwd import flash_attention_backward
from fusedpar.kernels.flash_varlen import flash_attention_varlen as flash_attention_varlen_forward
from fusedpar.kernels.flash_varlen import flash_attention_varlen_backward

__all__ = ["FlashAttentionFunction", "FlashAttentionVarlenFunction", "flash_attention", "flash_attention_varlen"]


class FlashAttentionFunction(torch.autograd.Function):
    """``(out, lse)`` of one attention block; ``lse`` is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, q_offset, k_offset):
        out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                           q_offset=q_offset, k_offset=k_offset)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, softmax_scale, q_offset, k_offset)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, q_offset, k_offset = ctx.args
        if dout is None:
            return None, None, None, None, None, None, None
        dq, dk, dv = flash_attention_backward(dout.to(q.dtype), q, k, v, out, lse, causal=causal,
                                              softmax_scale=scale, q_offset=q_offset, k_offset=k_offset)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0):
    """Scaled dot-product attention with a flash kernel; returns ``(out, lse)``.

    q ``[batch, seq_q, heads, head_dim]``, k/v ``[batch, seq_k, kv_heads, head_dim]`` (kv_heads
    divides heads: grouped-query attention), any strides. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``. With ``causal=True`` query ``i`` sees key ``j`` iff
    ``k_offset + j <= q_offset + i`` (global positions of two blocks of one sequence); rows that
    see no key give ``out = 0`` and ``lse = -inf``. ``lse`` (``[batch, heads, seq_q]``, fp32,
    natural log) is not differentiable (it is marked so; gradients flow through ``out``).
    """
    return FlashAttentionFunction.apply(q, k, v, causal, softmax_scale, q_offset, k_offset)


class FlashAttentionVarlenFunction(torch.autograd.Function):
    """``(out, lse)`` of packed documents (flash-attn's varlen convention); ``lse`` is not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
        out, lse = flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal=causal, softmax_scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale = ctx.args
        if dout is None:
            return (None,) * 9
        dq, dk, dv = flash_attention_varlen_backward(dout.to(q.dtype), q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                     causal=causal, softmax_scale=scale)
        return dq, dk, dv, None, None, None, None, None, None


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
    same forward without autograd.
    """
    return FlashAttentionVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal, softmax_scale)
