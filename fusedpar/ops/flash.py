"""Differentiable flash attention on one device, the functional API: :func:`flash_attention`
and, for packed documents, :func:`flash_attention_varlen`.

Each checks its arguments (shapes, dtypes, modes: what ``torch.compile`` traces) and calls its
custom op of :mod:`fusedpar.ops.flash_library` (:data:`~fusedpar.ops.flash_library.flash_attention_op`,
:data:`~fusedpar.ops.flash_library.flash_attention_varlen_op`); the values of ``cu_seqlens`` are
checked inside the op (on CPU tensors), where they are read.

Layers: Triton kernels -> launchers (``fusedpar.kernels``) -> the custom ops ->
:func:`flash_attention`. The sequence-parallel schedules
(:mod:`fusedpar.ops.sp_attention_schedules`) call the launchers block by block instead.
"""
from __future__ import annotations

from fusedpar.kernels.checks import check_bool
from fusedpar.kernels.flash_attention import check_offsets, check_qkv, resolve_softmax_scale
from fusedpar.kernels.flash_varlen import check_varlen_inputs
from fusedpar.ops.flash_library import flash_attention_op, flash_attention_varlen_op
from fusedpar.ops.library import checked_api

__all__ = ["flash_attention", "flash_attention_varlen"]


@checked_api
def flash_attention(q, k, v, *, causal=False, softmax_scale=None, q_offset=0, k_offset=0):
    """Scaled dot-product attention with a flash kernel; returns ``(out, lse)``.

    q ``[batch, seq_q, heads, head_dim]``, k/v ``[batch, seq_k, kv_heads, head_dim]`` (kv_heads
    divides heads: grouped-query attention), any strides. ``softmax_scale`` defaults to
    ``head_dim ** -0.5``. With ``causal=True`` query ``i`` sees key ``j`` iff
    ``k_offset + j <= q_offset + i`` (global positions of two blocks of one sequence); rows that
    see no key give ``out = 0`` and ``lse = -inf``. ``lse`` (``[batch, heads, seq_q]``, fp32,
    natural log) is not differentiable (it is marked so; gradients flow through ``out``).
    The custom op ``fusedpar::flash_attention``: traceable by ``torch.compile``.
    """
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset)
    check_bool("causal", causal)
    resolve_softmax_scale(softmax_scale, q.shape[3])
    scale = None if softmax_scale is None else float(softmax_scale)
    return flash_attention_op(q, k, v, causal, scale, q_offset, k_offset)


@checked_api
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
    same forward without autograd. The custom op
    ``fusedpar::flash_attention_varlen``: traceable by ``torch.compile``.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, values=False)
    check_bool("causal", causal)
    resolve_softmax_scale(softmax_scale, q.shape[2])
    scale = None if softmax_scale is None else float(softmax_scale)
    return flash_attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
