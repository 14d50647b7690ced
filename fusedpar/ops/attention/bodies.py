"""The bodies of the flash-attention custom ops over the launchers of
``fusedpar.kernels.flash_attention`` / ``flash_varlen``, and the helpers the sequence-parallel
family shares with them: :func:`window_of` (a ``(left, right)`` window as the kernels' pair),
:func:`with_dsinks` / :func:`dsinks_like` (the sinks' gradient or its absent placeholder) and
:func:`fp8_output_buffers` (the e4m3 output and its scales of ``return_fp8``)."""
from __future__ import annotations

import torch
from torch import Tensor

from fusedpar.kernels import flash_varlen
from fusedpar.kernels.flash_attention import flash_attention_forward, resolve_offsets
from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE, flash_attention_backward
from fusedpar.kernels.fp8 import FP8_BLOCK
from fusedpar.ops.common import absent


def window_of(left: int, right: int):
    """A schema's ``window_left`` / ``window_right`` (-1, -1: none) as the kernels' ``window``."""
    return None if left == right == -1 else (left, right)


def with_dsinks(grads, q):
    """``(dq, dk, dv, dsinks)`` from a launcher's or a schedule's 3 or 4 gradients (no sinks: an
    absent dsinks), what every attention backward op returns."""
    return (*grads[:3], grads[3] if len(grads) == 4 else absent(q.new_empty((), dtype=torch.float32)))


def dsinks_like(sinks, q):
    """The fake of a backward op's ``dsinks``: ``sinks``' shape, or the absent placeholder."""
    return q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)


def fp8_output_buffers(out_shape, q: Tensor, return_fp8: bool):
    """``(out_q, out_scale)`` for an output of ``out_shape`` (``[..., heads, d_v]``) with
    ``return_fp8`` (e4m3 of that shape, fp32 ``[..., heads * d_v / 128]``), else absent."""
    if not return_fp8:
        return absent(q), absent(q)
    *lead, h, dv = out_shape
    return (q.new_empty(tuple(out_shape), dtype=torch.float8_e4m3fn),
            q.new_empty((*lead, h * dv // FP8_BLOCK), dtype=torch.float32))


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention
# ----------------------------------------------------------------------------------------------
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None,
                        q_offset: int | None = None, k_offset: int | None = None, window_left: int = -1,
                        window_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None,
                        dq_mode: str = DEFAULT_DQ_MODE,
                        return_fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, out_q, out_scale)`` of the flash forward kernel (offsets None, None: bottom-right
    aligned, :func:`~fusedpar.kernels.flash_attention.resolve_offsets`; ``dq_mode``: for the
    backward; ``return_fp8``: the epilogue's fp8 output, else absent placeholders)."""
    fp8 = fp8_output_buffers((*q.shape[:3], v.shape[3]), q, return_fp8)
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset,
                                       k_offset=k_offset, window=window_of(window_left, window_right), softcap=softcap,
                                       sinks=sinks, fp8_out=fp8 if return_fp8 else None)
    return out, lse, *fp8


def flash_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                        softmax_scale: float | None, q_offset: int | None = None, k_offset: int | None = None,
                        window_left: int = -1, window_right: int = -1, softcap: float | None = None,
                        sinks: Tensor | None = None,
                        dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` of the flash backward kernels (``dsinks`` absent without sinks), the
    offsets resolved as the forward's and passed explicitly."""
    q_offset, k_offset = resolve_offsets(q_offset, k_offset, q.shape[1], k.shape[1])
    return with_dsinks(flash_attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset, k_offset=k_offset,
        window=window_of(window_left, window_right), softcap=softcap, sinks=sinks, dq_mode=dq_mode), q)


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention_varlen
# ----------------------------------------------------------------------------------------------
def flash_attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float | None,
                               window_left: int = -1, window_right: int = -1, softcap: float | None = None,
                               sinks: Tensor | None = None, dq_mode: str = DEFAULT_DQ_MODE,
                               return_fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, out_q, out_scale)`` of the varlen launcher (which checks the ``cu_seqlens``
    values; ``dq_mode``: for the backward; ``return_fp8`` as in :func:`flash_attention_fwd`)."""
    fp8 = fp8_output_buffers((*q.shape[:2], v.shape[2]), q, return_fp8)
    out, lse = flash_varlen.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   causal=causal, softmax_scale=softmax_scale,
                                                   window=window_of(window_left, window_right), softcap=softcap,
                                                   sinks=sinks, fp8_out=fp8 if return_fp8 else None)
    return out, lse, *fp8


def flash_attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               causal: bool, softmax_scale: float | None, window_left: int = -1,
                               window_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None,
                               dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` of the varlen backward launcher (``dsinks`` absent without sinks)."""
    return with_dsinks(flash_varlen.flash_attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window=window_of(window_left, window_right), softcap=softcap, sinks=sinks,
        dq_mode=dq_mode), q)
