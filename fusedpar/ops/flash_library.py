"""The flash-attention custom ops of :func:`fusedpar.ops.flash.flash_attention` and
:func:`fusedpar.ops.flash.flash_attention_varlen` (see :mod:`fusedpar.ops.library`).

* ``fusedpar::flash_attention(q, k, v, causal, softmax_scale, q_offset, k_offset, window_left=-1,
  window_right=-1, softcap=None, sinks=None, dq_mode="separate", return_fp8=False) -> (out, lse, out_q,
  out_scale)`` (:data:`flash_attention_op`, body :func:`flash_attention_fwd`) and ``fusedpar::flash_attention_backward``
  (:data:`flash_attention_backward_op`, body :func:`flash_attention_bwd`, returning
  ``(dq, dk, dv, dsinks)``, ``dsinks`` an :func:`~fusedpar.ops.library.absent` placeholder
  without sinks).
* ``fusedpar::flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window_left=-1, window_right=-1, softcap=None, sinks=None,
  dq_mode="separate", return_fp8=False) -> (out, lse, out_q, out_scale)`` (:data:`flash_attention_varlen_op`,
  body :func:`flash_attention_varlen_fwd`)
  and ``fusedpar::flash_attention_varlen_backward`` (:data:`flash_attention_varlen_backward_op`,
  body :func:`flash_attention_varlen_bwd`).

``lse`` is not differentiable; ``sinks`` is (its gradient comes from the backward op). With
``return_fp8`` the forward's epilogue also writes ``out`` quantised per 1x128 tile of its
``heads * d_v`` features (``out_q`` e4m3, ``out_scale`` fp32: :mod:`fusedpar.kernels.flash_fp8_out`,
the blockwise fp8 input of o_proj; not differentiable); without it both are
:func:`~fusedpar.ops.library.absent` placeholders.
``dq_mode`` is read by the backward only ("separate": deterministic; "atomic": the one-pass
backward, whose dq bits vary between GPU runs; see
:func:`~fusedpar.kernels.flash_attention_bwd.flash_attention_backward`). The
bodies call the launchers of :mod:`fusedpar.kernels.flash_attention`,
:mod:`fusedpar.kernels.flash_attention_bwd` and :mod:`fusedpar.kernels.flash_varlen`; the values
of ``cu_seqlens`` are checked there (on CPU tensors), where they are read.
"""
from __future__ import annotations

import torch

from fusedpar.kernels import flash_varlen
from fusedpar.kernels.flash_attention import flash_attention_forward
from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE, flash_attention_backward
from fusedpar.kernels.fp8 import FP8_BLOCK
from fusedpar.ops.library import absent, custom_op, input_grads, present

__all__ = [
    "flash_attention_backward_op", "flash_attention_bwd", "flash_attention_fwd", "flash_attention_op",
    "flash_attention_varlen_backward_op", "flash_attention_varlen_bwd", "flash_attention_varlen_fwd",
    "flash_attention_varlen_op",
]

Tensor = torch.Tensor


def _window(left: int, right: int):
    return None if left == right == -1 else (left, right)


def _with_dsinks(grads, q):
    """``(dq, dk, dv, dsinks)`` from a launcher's 3 or 4 gradients (no sinks: an absent dsinks)."""
    return (*grads[:3], grads[3] if len(grads) == 4 else absent(q.new_empty((), dtype=torch.float32)))


def _fp8_buffers(out_shape, q: Tensor, return_fp8: bool):
    """``(out_q, out_scale)`` for an output of ``out_shape`` (``[..., heads, d_v]``) with
    ``return_fp8`` (e4m3 of that shape, fp32 ``[..., heads * d_v / 128]``), else absent."""
    if not return_fp8:
        return absent(q), absent(q)
    *lead, h, dv = out_shape
    return (q.new_empty(tuple(out_shape), dtype=torch.float8_e4m3fn),
            q.new_empty((*lead, h * dv // FP8_BLOCK), dtype=torch.float32))


def _backward_fake(q, k, v):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty((0,), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# fusedpar::flash_attention
# ----------------------------------------------------------------------------------------------
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None, q_offset: int,
                        k_offset: int, window_left: int = -1, window_right: int = -1, softcap: float | None = None,
                        sinks: Tensor | None = None, dq_mode: str = DEFAULT_DQ_MODE,
                        return_fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, lse, out_q, out_scale)`` of the flash forward kernel (``dq_mode``: for the backward;
    ``return_fp8``: the epilogue's fp8 output, else absent placeholders)."""
    fp8 = _fp8_buffers((*q.shape[:3], v.shape[3]), q, return_fp8)
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset,
                                       k_offset=k_offset, window=_window(window_left, window_right), softcap=softcap,
                                       sinks=sinks, fp8_out=fp8 if return_fp8 else None)
    return out, lse, *fp8


flash_attention_op = custom_op("flash_attention")(flash_attention_fwd)


@flash_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, q_offset, k_offset, window_left=-1, window_right=-1, softcap=None, sinks=None,
      dq_mode=DEFAULT_DQ_MODE, return_fp8=False):
    b, sq, hq, _ = q.shape
    return (q.new_empty((b, sq, hq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32),
            *_fp8_buffers((b, sq, hq, v.shape[3]), q, return_fp8))


def flash_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                        softmax_scale: float | None, q_offset: int, k_offset: int, window_left: int = -1,
                        window_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None,
                        dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` of the flash backward kernels (``dsinks`` absent without sinks)."""
    return _with_dsinks(flash_attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, q_offset=q_offset, k_offset=k_offset,
        window=_window(window_left, window_right), softcap=softcap, sinks=sinks, dq_mode=dq_mode), q)


flash_attention_backward_op = custom_op("flash_attention_backward")(flash_attention_bwd)


@flash_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, q_offset, k_offset, window_left=-1, window_right=-1,
      softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    return _backward_fake(q, k, v) if sinks is None else (*_backward_fake(q, k, v)[:3], sinks.new_empty(sinks.shape))


def _flash_setup(ctx, inputs, output):
    q, k, v, *args, sinks, dq_mode, _ = inputs
    out, lse, *fp8 = output
    ctx.mark_non_differentiable(lse, *fp8)
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.args = tuple(args)  # causal, softmax_scale, q_offset, k_offset, window_left, window_right, softcap
    ctx.dq_mode = dq_mode


def _flash_backward(ctx, dout, dlse, dout_q, dout_scale):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if dout is None:
        return input_grads(flash_attention_op)
    dq, dk, dv, dsinks = flash_attention_backward_op(dout.to(q.dtype), q, k, v, out, lse, *ctx.args, sinks,
                                                     ctx.dq_mode)
    return input_grads(flash_attention_op, q=dq, k=dk, v=dv, sinks=present(dsinks))


flash_attention_op.register_autograd(_flash_backward, setup_context=_flash_setup)


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
    fp8 = _fp8_buffers((*q.shape[:2], v.shape[2]), q, return_fp8)
    out, lse = flash_varlen.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   causal=causal, softmax_scale=softmax_scale,
                                                   window=_window(window_left, window_right), softcap=softcap,
                                                   sinks=sinks, fp8_out=fp8 if return_fp8 else None)
    return out, lse, *fp8


flash_attention_varlen_op = custom_op("flash_attention_varlen")(flash_attention_varlen_fwd)


@flash_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left=-1,
      window_right=-1, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE, return_fp8=False):
    return (q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            *_fp8_buffers((*q.shape[:2], v.shape[2]), q, return_fp8))


def flash_attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               causal: bool, softmax_scale: float | None, window_left: int = -1,
                               window_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None,
                               dq_mode: str = DEFAULT_DQ_MODE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` of the varlen backward launcher (``dsinks`` absent without sinks)."""
    return _with_dsinks(flash_varlen.flash_attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window=_window(window_left, window_right), softcap=softcap, sinks=sinks,
        dq_mode=dq_mode), q)


flash_attention_varlen_backward_op = custom_op("flash_attention_varlen_backward")(flash_attention_varlen_bwd)


@flash_attention_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left=-1, window_right=-1, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE):
    return _backward_fake(q, k, v) if sinks is None else (*_backward_fake(q, k, v)[:3], sinks.new_empty(sinks.shape))


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args, sinks, dq_mode, _ = inputs
    out, lse, *fp8 = output
    ctx.mark_non_differentiable(lse, *fp8)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.args = tuple(args)  # max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap
    ctx.dq_mode = dq_mode


def _varlen_backward(ctx, dout, dlse, dout_q, dout_scale):
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    if dout is None:
        return input_grads(flash_attention_varlen_op)
    dq, dk, dv, dsinks = flash_attention_varlen_backward_op(dout.to(q.dtype), q, k, v, out, lse, cu_q, cu_k,
                                                            *ctx.args, sinks, ctx.dq_mode)
    return input_grads(flash_attention_varlen_op, q=dq, k=dk, v=dv, sinks=present(dsinks))


flash_attention_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)
