"""Differentiable flash attention on one device: :func:`flash_attention` (autograd) over the
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

__all__ = ["FlashAttentionFunction", "flash_attention"]


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
