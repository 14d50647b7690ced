"""Variable-length (packed) flash attention in flash-attn's convention: q ``[total_q, heads, d]``,
k/v ``[total_k, kv_heads, d]``, documents delimited by int32 ``cu_seqlens`` (``[num_docs + 1]``,
cumulative lengths from 0). Document ``i``'s queries ``[cu_seqlens_q[i], cu_seqlens_q[i+1])``
attend only to its keys ``[cu_seqlens_k[i], cu_seqlens_k[i+1])``.

There is no separate kernel: the flash kernels of :mod:`.flash_attention` /
:mod:`.flash_attention_bwd` take a segment table (:class:`~.flash_attention.Segments`, one row
per document, read by each program) and their grid runs over ``(document, block, head)`` with
``max_seqlen`` sizing the block axis; blocks past a document's end do no work, so the cost
follows ``sum(len_q * len_k)``, not ``total ** 2``.

Causal masking is bottom-right aligned per document, as flash-attn (>= 2.1) does when
``seqlen_q != seqlen_k``: query ``i`` of a document sees key ``j`` iff ``j <= i + len_k - len_q``
(the usual causal mask when the lengths are equal; a query row that sees no key gives
``out = 0``, ``lse = -inf``). The dense launchers align the same way by default, so a single
document equals :func:`~.flash_attention.flash_attention_forward` of its rows.

Validation of ``cu_seqlens`` values (start at 0, non-decreasing, last == total, ``max_seqlen`` >=
every length) runs when they are CPU tensors (the interpreter; a CPU copy costs nothing). On a
GPU only dtype, shape and device are checked: reading the values would cost a device-to-host
sync per call, so, as in flash-attn, they are not read there; the segment table is built from
them clamped into the rows and made non-decreasing on the device (:func:`varlen_segments`), so a
bad value gives wrong documents, never an access outside q / k / v or the outputs, and fails a
device-side assert under ``TRITON_DEBUG=1`` (as do a first boundary not 0, a last not the total and
a document longer than ``max_seqlen``, whose rows past ``max_seqlen`` are left unwritten: the grid
is sized by it).

These are launchers (not differentiable); the differentiable op is
:func:`fusedpar.ops.flash_attention_varlen`.
"""
from __future__ import annotations

import torch
from triton import knobs

from .checks import check_buffer, check_float_tensor, check_int, check_same, check_shape, check_tensor
from .flash_attention import Segments, attention_reference, check_qkv, flash_attention_forward
from .flash_attention_bwd import DEFAULT_DQ_MODE, flash_attention_backward
from .flash_fp8_out import check_attention_fp8_out

__all__ = [
    "check_cu_seqlens", "check_cu_seqlens_values", "check_varlen_inputs", "flash_attention_varlen",
    "flash_attention_varlen_backward", "varlen_attention_reference", "varlen_segments",
]


def check_cu_seqlens(name: str, cu, total: int, max_seqlen=None, *, max_name: str = "max_seqlen",
                     values: bool = True) -> None:
    """``cu`` is an int32 ``[num_docs + 1]`` tensor; on the CPU also (unless ``values=False``):
    ``cu[0] == 0``, non-decreasing, ``cu[-1] == total`` and (when given) every length ``<= max_seqlen``."""
    check_tensor(name, cu, dims=(1,), dtypes=(torch.int32,))
    if cu.numel() == 0:
        raise ValueError(f"{name} must have num_docs + 1 >= 1 entries, got 0")
    if max_seqlen is not None:
        check_int(max_name, max_seqlen, min_value=0)
    if not values or cu.device.type != "cpu":
        return  # trusted on a GPU (see the module docstring)
    lengths = check_cu_seqlens_values(name, cu.tolist(), total)
    if max_seqlen is not None and lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} must be >= the longest document ({max(lengths)}), got {max_seqlen}")


def check_cu_seqlens_values(name: str, vals, total: int, *, total_name: str = "the number of tokens") -> list:
    """The boundaries ``vals`` (ints, read from a ``cu_seqlens`` tensor) start at 0, do not
    decrease and end at ``total`` (``total_name`` in the message); returns the document lengths."""
    vals = list(vals)
    if not vals:
        raise ValueError(f"{name} must have num_docs + 1 >= 1 entries, got 0")
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    lengths = [b - a for a, b in zip(vals, vals[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] must equal {total_name} ({total}), got {vals[-1]}")
    return lengths


def _bounded(cu, total: int, max_seqlen: int) -> torch.Tensor:
    """``cu`` as boundaries the kernels can trust, on its device without a sync: each clamped into
    ``[0, total]``, then made non-decreasing (a running maximum). Valid boundaries are unchanged;
    bad ones on a GPU (not read on the host) give documents inside the rows, never an address past
    them. Under ``TRITON_DEBUG=1`` boundaries that are not valid (changed here, not from 0 to
    ``total``, or a document longer than ``max_seqlen``) fail a device-side assert (CPU: at once)."""
    c = cu.to(torch.int32)
    bounded = torch.cummax(c.clamp(0, total), 0).values
    if knobs.runtime.debug:
        valid = (bounded == c).all() & (c[0] == 0) & (c[-1] == total) & (c[1:] - c[:-1] <= max_seqlen).all()
        torch._assert_async(valid, "cu_seqlens: a boundary outside [0, total], decreasing, not from 0 to total, or a "
                                   "document longer than max_seqlen")
    return bounded


def varlen_segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, total_q: int,
                    total_k: int) -> Segments:
    """The kernels' segment table of documents ``(q_start, q_end, k_start, k_end, len_k - len_q)``
    (the shift aligns causal masks bottom-right), built on the tensors' device without a sync, its
    boundaries inside ``[0, total_q]`` / ``[0, total_k]`` and non-decreasing whatever the values
    (:func:`_bounded`: the host checks them only on the CPU)."""
    cq, ck = _bounded(cu_seqlens_q, total_q, max_seqlen_q), _bounded(cu_seqlens_k, total_k, max_seqlen_k)
    shift = (ck[1:] - ck[:-1]) - (cq[1:] - cq[:-1])
    table = torch.stack((cq[:-1], cq[1:], ck[:-1], ck[1:], shift), dim=1).contiguous()
    return Segments(table, int(max_seqlen_q), int(max_seqlen_k))


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, values=True) -> None:
    """The checks of :func:`flash_attention_varlen`'s arguments; ``values=False``: only those that
    read no tensor values (shapes, dtypes, devices: what ``torch.compile`` traces)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t, dims=(3,))
    check_qkv(q[None], k[None], v[None])  # head dims, heads, one dtype and device (views: no copy)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, max_name="max_seqlen_q", values=values)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, max_name="max_seqlen_k", values=values)
    check_same("cu_seqlens_q", cu_seqlens_q, "q", q, dtype=False)
    check_same("cu_seqlens_k", cu_seqlens_k, "q", q, dtype=False)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k must have as many documents as cu_seqlens_q "
                         f"({cu_seqlens_q.numel() - 1}), got {cu_seqlens_k.numel() - 1}")


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window=None, softcap=None, sinks=None, fp8_out=None):
    """Packed attention: ``(out, lse)``, out ``[total_q, heads, d_v]`` in q's dtype, lse
    ``[heads, total_q]`` fp32 (natural log). q ``[total_q, heads, d]``, k ``[total_k, kv_heads, d]``,
    v ``[total_k, kv_heads, d_v]`` (kv_heads divides heads), ``cu_seqlens_*`` int32 ``[docs + 1]``
    on q's device, ``max_seqlen_*`` >= the longest document. ``window`` / ``softcap`` / ``sinks``
    as in :func:`~.flash_attention.flash_attention_forward`, in each document's bottom-right
    aligned positions (query ``i`` sees key ``j`` iff ``i + shift - left <= j <= i + shift + right``,
    ``shift = len_k - len_q``). ``fp8_out=(q8, scale)``: ``q8`` ``float8_e4m3fn``
    ``[total_q, heads, d_v]``, ``scale`` fp32 ``[total_q, heads * d_v // 128]`` (d_v a multiple of
    128), written with ``out``'s 1x128-tile quantisation (:mod:`.flash_fp8_out`). Not
    differentiable (see :func:`fusedpar.ops.flash_attention_varlen`)."""
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_attention_fp8_out(fp8_out, (q.shape[0], q.shape[1], v.shape[2]), q.device)
    seg = varlen_segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    lse = torch.empty((1, q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
    out, lse = flash_attention_forward(q[None], k[None], v[None], causal=causal, softmax_scale=softmax_scale,
                                       lse=lse, segments=seg, window=window, softcap=softcap, sinks=sinks,
                                       fp8_out=None if fp8_out is None else (fp8_out[0][None], fp8_out[1][None]))
    return out[0], lse[0]


def _check_varlen_row_terms(dout, out, lse, q, v) -> None:
    """The backward's row terms as the caller passed them (before the launchers add a batch axis):
    ``dout`` ``[total_q, heads, d_v]`` in q's dtype and device, ``out`` that shape on q's device
    (a supported float dtype), ``lse`` fp32 ``[heads, total_q]`` on q's device."""
    o_shape = (q.shape[0], q.shape[1], v.shape[2])
    check_tensor("dout", dout, dims=(3,))
    check_same("dout", dout, "q", q)
    check_shape("dout", dout, o_shape)
    check_tensor("out", out, dims=(3,))
    check_buffer("out", out, o_shape, q.device)
    check_tensor("lse", lse, dims=(2,))
    check_buffer("lse", lse, (q.shape[1], q.shape[0]), q.device, torch.float32)


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, *, causal=False, softmax_scale=None, window=None, softcap=None,
                                    sinks=None, dq_mode=DEFAULT_DQ_MODE):
    """Gradients ``(dq, dk, dv)`` of :func:`flash_attention_varlen` from its ``out`` / ``lse``;
    with ``sinks=`` also ``dsinks`` (fp32 ``[heads]``): ``(dq, dk, dv, dsinks)``. ``dq_mode``:
    "separate" (deterministic) or "atomic" (one pass, dQ by fp32 atomics: its bits vary between
    GPU runs), see :func:`~.flash_attention_bwd.flash_attention_backward`."""
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_row_terms(dout, out, lse, q, v)
    seg = varlen_segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    grads = flash_attention_backward(dout[None], q[None], k[None], v[None], out[None], lse[None], causal=causal,
                                     softmax_scale=softmax_scale, segments=seg, window=window, softcap=softcap,
                                     sinks=sinks, dq_mode=dq_mode)
    return (*(g[0] for g in grads[:3]), *grads[3:])


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                               compute_dtype=torch.float64, window=None, softcap=None, sinks=None):
    """Plain torch oracle: each document attended separately with :func:`attention_reference`
    (bottom-right causal and window); ``(out [total_q, h, d_v], lse [h, total_q])``. Differentiable."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        o, lse = attention_reference(q[None, qs], k[None, ks], v[None, ks], causal=causal,  # bottom-right
                                     softmax_scale=softmax_scale, compute_dtype=compute_dtype, window=window,
                                     softcap=softcap, sinks=sinks)
        outs.append(o[0])
        lses.append(lse[0])
    h, d = q.shape[1], v.shape[2]
    if not outs:
        return q.new_zeros((0, h, d), dtype=compute_dtype), q.new_zeros((h, 0), dtype=compute_dtype)
    return torch.cat(outs), torch.cat(lses, dim=1)
