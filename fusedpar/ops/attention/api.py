"""Flash attention on one device, the functional API: :func:`flash_attention` and, for packed
documents, :func:`flash_attention_varlen`.

Each checks its arguments (shapes, dtypes, modes: what ``torch.compile`` traces) and calls its
custom op of :mod:`.custom_ops`; the values of ``cu_seqlens`` are checked inside the op (on CPU
tensors), where they are read. The sequence-parallel schedules call the launchers block by block
instead."""
from __future__ import annotations

from fusedpar.kernels.checks import check_bool, check_softcap
from fusedpar.kernels.flash_attention import check_offsets, check_qkv, check_sinks, check_window, resolve_softmax_scale
from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE, check_dq_mode
from fusedpar.kernels.flash_fp8_out import check_fp8_head_dim
from fusedpar.kernels.flash_varlen import check_varlen_inputs
from fusedpar.kernels.fp8 import check_fp8_device
from fusedpar.ops.attention.custom_ops import flash_attention_op, flash_attention_varlen_op
from fusedpar.ops.common import checked_api


def _score_arguments(q, causal, softmax_scale, head_dim, window, softcap, sinks) -> tuple:
    """The checked ``(softmax_scale, window_left, window_right, softcap)`` of the op's schema."""
    check_bool("causal", causal)
    resolve_softmax_scale(softmax_scale, head_dim)
    left, right = check_window(window)
    cap = check_softcap(softcap)
    check_sinks(sinks, q)
    return None if softmax_scale is None else float(softmax_scale), left, right, (cap or None)


def _check_return_fp8(return_fp8, d_v: int, q) -> None:
    """``return_fp8``: a bool; True needs ``d_v`` a multiple of 128 and fp8 tensor cores
    (:func:`~fusedpar.kernels.flash_fp8_out.check_attention_fp8_out`'s rules, checked before the op)."""
    check_bool("return_fp8", return_fp8)
    if return_fp8:
        check_fp8_head_dim("return_fp8=True", d_v)
        check_fp8_device(q, option="flash_attention's return_fp8")


@checked_api
def flash_attention(q, k, v, *, causal=False, softmax_scale=None, q_offset=None, k_offset=None, window=None,
                    softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE, return_fp8=False):
    """Scaled dot-product attention with a flash kernel; returns ``(out, lse)``.

    q ``[batch, seq_q, heads, head_dim]``, k ``[batch, seq_k, kv_heads, head_dim]``, v
    ``[batch, seq_k, kv_heads, head_dim_v]`` (kv_heads divides heads: grouped-query attention; v
    may have its own head dim, e.g. MLA's 192 / 128), any strides; out is
    ``[batch, seq_q, heads, head_dim_v]``. ``softmax_scale`` defaults to ``head_dim ** -0.5``.
    Query ``i`` sits at position ``q_offset + i``, key ``j`` at ``k_offset + j``; with
    ``causal=True`` the query sees the key iff ``k_offset + j <= q_offset + i``. By default
    (both None) the two are aligned **bottom-right**, as flash-attn (>= 2.1) and
    :func:`flash_attention_varlen` do: the last query sits at the last key, so query ``i`` sees
    key ``j`` iff ``j <= i + seq_k - seq_q`` (with ``seq_q > seq_k`` the first ``seq_q - seq_k``
    rows see nothing). Explicit ints place two blocks of one sequence at global positions (an
    omitted one is 0); ``q_offset=0, k_offset=0`` is top-left alignment (``torch``'s SDPA
    ``is_causal``). ``window=(left, right)`` (flash-attn's convention): query ``i`` sees key ``j``
    iff ``i - left <= j <= i + right`` in those positions, -1 unbounded; ``causal`` sets
    ``right = 0``. ``softcap=c``: scores ``c * tanh(s / c)`` before the
    softmax (Gemma 2). ``sinks`` (fp32 ``[heads]``, differentiable): one learnable logit per query
    head added to the softmax denominator (gpt-oss); it takes probability mass but carries no
    value. Rows that see no key give ``out = 0`` and ``lse = -inf`` (with sinks ``lse = sink``).
    ``lse`` (``[batch, heads, seq_q]``, fp32, natural log, including the sink) is not
    differentiable (it is marked so; gradients flow through ``out``). ``dq_mode`` picks the
    backward: ``"separate"`` (default; deterministic, the same bits every run) or ``"atomic"``
    (one pass, dQ added with fp32 atomics: fewer matrix products, but dq's bits change between
    GPU runs with the order of the additions); see
    :func:`fusedpar.kernels.flash_attention_backward`. ``return_fp8=True``: returns ``(out, lse,
    (out_q, out_scale))``, ``out`` also quantised per 1x128 tile of its ``heads * head_dim_v``
    features by the forward's epilogue (``head_dim_v`` a multiple of 128; bit for bit
    ``quantize_e4m3(out.reshape(-1, heads * head_dim_v), "tile")``; not differentiable): the
    blockwise fp8 input of the output projection (:func:`matmul_reduce_scatter`'s ``x_fp8``).
    The custom op ``fusedpar::flash_attention``: traceable by ``torch.compile``.
    """
    check_qkv(q, k, v)
    check_offsets(q_offset, k_offset, optional=True)
    scale, left, right, cap = _score_arguments(q, causal, softmax_scale, q.shape[3], window, softcap, sinks)
    check_dq_mode(dq_mode)
    _check_return_fp8(return_fp8, v.shape[3], q)
    out, lse, out_q, out_scale = flash_attention_op(q, k, v, causal, scale, q_offset, k_offset, left, right, cap, sinks,
                                                    dq_mode, return_fp8)
    return (out, lse, (out_q, out_scale)) if return_fp8 else (out, lse)


@checked_api
def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window=None, softcap=None, sinks=None, dq_mode=DEFAULT_DQ_MODE,
                           return_fp8=False):
    """Differentiable attention over packed documents (flash-attn's ``flash_attn_varlen_func``
    convention); returns ``(out, lse)``.

    q ``[total_q, heads, d]``, k ``[total_k, kv_heads, d]``, v ``[total_k, kv_heads, d_v]``
    (kv_heads divides heads), ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 ``[num_docs + 1]``
    cumulative document lengths on q's device, ``max_seqlen_*`` at least the longest document.
    Document ``i``'s queries attend to its own keys only; ``causal=True`` is bottom-right aligned
    per document (query ``i`` sees key ``j`` iff ``j <= i + len_k - len_q``), and so is
    ``window=(left, right)`` (``i + shift - left <= j <= i + shift + right``, ``shift = len_k -
    len_q``). ``softcap``, ``sinks`` and ``dq_mode`` as in :func:`flash_attention`. ``lse``
    ``[heads, total_q]`` fp32 is not differentiable. ``return_fp8`` as in :func:`flash_attention`
    (``out_q`` ``[total_q, heads, d_v]``, ``out_scale`` ``[total_q, heads * d_v / 128]``). The kernels-level
    :func:`fusedpar.kernels.flash_attention_varlen` is the same forward without autograd. The custom op ``fusedpar::flash_attention_varlen``:
    traceable by ``torch.compile``.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, values=False)
    scale, left, right, cap = _score_arguments(q, causal, softmax_scale, q.shape[2], window, softcap, sinks)
    check_dq_mode(dq_mode)
    _check_return_fp8(return_fp8, v.shape[2], q)
    out, lse, out_q, out_scale = flash_attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                           max_seqlen_k, causal, scale, left, right, cap, sinks, dq_mode,
                                                           return_fp8)
    return (out, lse, (out_q, out_scale)) if return_fp8 else (out, lse)
