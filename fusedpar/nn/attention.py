"""Attention block with tensor parallelism (heads) and sequence parallelism (tokens).

:class:`ParallelAttention` = column-parallel fused QKV projection (:class:`ColumnParallelLinear`,
its all-gather over the tensor-parallel group overlapped with the GEMM) -> rotary embedding at the
tokens' *global* positions -> sequence-parallel attention over this rank's heads (ring, Ulysses or
hybrid over ``sp_group``) -> row-parallel output projection (:class:`RowParallelLinear`, GEMM
fused with the reduce-scatter).

Sequence layout: the full sequence (length ``S``) is first split over the sequence-parallel
ranks (:func:`fusedpar.ops.shard_positions`: zigzag or contiguous over the ring, contiguous over
Ulysses), then each sequence-parallel shard is cut into ``tp`` contiguous pieces, one per
tensor-parallel rank (Megatron's sequence-parallel TP). :meth:`ParallelAttention.local_positions`
gives the global positions of the tokens one rank holds, :meth:`ParallelAttention.shard` cuts
them out of a full sequence.

:class:`AttentionReference` is the plain single-process block (``nn.Linear`` projections, the
same rotary embedding, fp64/fp32 attention); both modules draw their full weights in the same
order from the global RNG, so one seed gives the same model at every parallel degree.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from fusedpar.kernels.checks import check_bool, check_positive_number, check_softcap
from fusedpar.kernels.flash_attention import attention_reference, check_window, resolve_softmax_scale
from fusedpar.kernels.flash_attention_bwd import DEFAULT_DQ_MODE, DQ_MODES
from fusedpar.kernels.fp8 import FP8_BLOCK
from fusedpar.nn.config import AttentionConfig, module_config
from fusedpar.nn.groups import check_divides, check_kv_heads, check_orthogonal, group_arg
from fusedpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fusedpar.nn.norm import RMSNorm
from fusedpar.nn.placement import Placement, gradient_sync_plan
from fusedpar.nn.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin
from fusedpar.ops import comm
from fusedpar.ops.attention.api import flash_attention
from fusedpar.ops.tensor_parallel.api import replicated_rows
from fusedpar.ops.sequence_parallel.bodies import ulysses_kv_heads
from fusedpar.ops.sequence_parallel.layouts import LAYOUTS, shard_positions
from fusedpar.ops.sequence_parallel.api import hybrid_attention, ring_attention, ulysses_attention
from fusedpar.ops.tensor_parallel.api import all_gather_matmul
from fusedpar.ops.comm.transport import get_transport
from fusedpar.ops.sequence_parallel.plans import document_positions

SP_MODES = ("ring", "ulysses", "hybrid")

__all__ = ["AttentionReference", "ParallelAttention", "SequenceParallelAttention"]


# ----------------------------------------------------------------------------------------------
# validation shared by both modules
# ----------------------------------------------------------------------------------------------
def _check_shape_args(cls, hidden_size, num_heads, num_kv_heads, head_dim):
    for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{cls}: {name} must be a positive int, got {val!r}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0 \
            or num_heads % num_kv_heads:
        raise ValueError(f"{cls}: num_kv_heads must be a positive int dividing num_heads={num_heads}, "
                         f"got {num_kv_heads!r}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"{cls}: hidden_size={hidden_size} must be divisible by num_heads={num_heads} "
                             "(or pass head_dim)")
        head_dim = hidden_size // num_heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{cls}: head_dim must be a positive even int (rotary embedding), got {head_dim!r}")
    return num_kv_heads, head_dim


def _check_score_args(cls, head_dim, v_head_dim, window, softcap, sinks, softmax_scale):
    """The checked ``(v_head_dim, window, softcap, sinks, softmax_scale)`` of both modules."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim <= 0:
        raise ValueError(f"{cls}: v_head_dim must be a positive int or None (head_dim), got {v_head_dim!r}")
    left, right = check_window(window)
    check_bool(f"{cls}: sinks", sinks)
    resolve_softmax_scale(softmax_scale, head_dim)
    return (v_head_dim, None if left == right == -1 else (left, right), check_softcap(softcap) or None, bool(sinks),
            None if softmax_scale is None else float(softmax_scale))


def _check_dq_mode(cls, dq_mode):
    """``dq_mode`` of the attention backward, one of :data:`~fusedpar.kernels.flash_attention_bwd.DQ_MODES`."""
    if not isinstance(dq_mode, str) or dq_mode not in DQ_MODES:
        raise ValueError(f"{cls}: dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    return dq_mode


def _check_qk_norm_scope(cls, qk_norm_scope):
    if qk_norm_scope not in ("head", "projection"):
        raise ValueError(f"{cls}: qk_norm_scope must be 'head' or 'projection', got {qk_norm_scope!r}")
    return qk_norm_scope


def _rotary_dim(cls, rotary_dim, head_dim):
    """The rotated features per head: ``head_dim`` by default, else an even int in ``[2, head_dim]``."""
    if rotary_dim is None:
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 2 <= rotary_dim <= head_dim \
            or rotary_dim % 2:
        raise ValueError(f"{cls}: rotary_dim must be an even int in [2, head_dim={head_dim}], got {rotary_dim!r}")
    return rotary_dim


class AttentionReference(nn.Module):
    """Plain single-process attention block: ``o_proj(attn(rope(q_proj x), rope(k_proj x),
    v_proj x))`` with ``nn.Linear`` projections drawn in the order q, k, v, o. The oracle of the
    tests, and the source of :class:`ParallelAttention`'s full weights.

    ``config``: an :class:`~fusedpar.nn.config.AttentionConfig` (its ``sp_mode``, ``layout`` and
    ``dq_mode`` are ignored: one process, the float64 oracle). Attention options (those of
    :func:`~fusedpar.ops.attention.api.flash_attention`): ``window=(left,
    right)`` (a sliding window in sequence positions), ``softcap`` (Gemma 2's logit
    softcapping), ``sinks=True`` (a learnable fp32 logit per head in the softmax denominator,
    gpt-oss; the parameter ``sinks`` ``[num_heads]``, initialised to 0), ``v_head_dim`` (the
    head dim of v and of the attention output, default ``head_dim``) and ``softmax_scale``
    (default ``head_dim ** -0.5``; Gemma's ``query_pre_attn_scalar ** -0.5``). With ``qk_norm``, q
    and k are normalised before the rotary embedding, per head or over the whole projection
    (``qk_norm_scope``), with Gemma's ``(1 + w)`` scales under ``norm_offset=1.0``."""

    def __init__(self, config: AttentionConfig, *, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        self.config = c = module_config(name, config, AttentionConfig)
        hidden_size, num_heads, num_kv_heads, head_dim, v_head_dim = (
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.v_head_dim)
        causal, bias, qkv_bias, qk_norm, qk_norm_eps, qk_norm_scope, norm_offset = (
            c.causal, c.bias, c.qkv_bias, c.qk_norm, c.qk_norm_eps, c.qk_norm_scope, c.norm_offset)
        rope_theta, rope_scaling, rotary_dim, window, softcap, sinks, softmax_scale = (
            c.rope_theta, c.rope_scaling, c.rotary_dim, c.window, c.softcap, c.sinks, c.softmax_scale)
        num_kv_heads, head_dim = _check_shape_args(name, hidden_size, num_heads, num_kv_heads, head_dim)
        self.rotary_dim = _rotary_dim(name, rotary_dim, head_dim)
        check_bool(f"{name}: causal", causal)
        dv, self.window, self.softcap, _, self.softmax_scale = _check_score_args(
            name, head_dim, v_head_dim, window, softcap, sinks, softmax_scale)
        self.hidden_size, self.num_heads, self.head_dim, self.v_head_dim = hidden_size, num_heads, head_dim, dv
        self.num_kv_heads, self.qk_norm_scope = num_kv_heads, _check_qk_norm_scope(name, qk_norm_scope)
        self.causal, self.rope_theta = bool(causal), float(rope_theta)
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        rope_inv_freq(head_dim, self.rope_theta, self.rope_scaling)  # validates the scaling
        kw = dict(bias=bias if qkv_bias is None else bool(qkv_bias), device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * dv, **kw)
        self.o_proj = nn.Linear(num_heads * dv, hidden_size, bias=bias, device=device, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=torch.float32)) if sinks else None
        self.q_norm = self.k_norm = None
        if qk_norm:  # RMSNorm of q and k before the rotary embedding: over head_dim of every head
            # (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
            whole = qk_norm_scope == "projection"
            self.q_norm, self.k_norm = (RMSNorm(n * head_dim if whole else head_dim, qk_norm_eps, offset=norm_offset,
                                                device=device, dtype=dtype) for n in (num_heads, num_kv_heads))

    def forward(self, x, positions=None, *, compute_dtype=torch.float64):
        b, s, _ = x.shape
        d = self.head_dim
        positions = torch.arange(s, device=x.device) if positions is None else positions
        cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.rope_theta, scaling=self.rope_scaling)
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and self.qk_norm_scope == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, self.num_heads, d), k.view(b, s, self.num_kv_heads, d)
        if self.q_norm is not None and self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.v_head_dim)
        o, _ = attention_reference(q, k, v, causal=self.causal, compute_dtype=compute_dtype, window=self.window,
                                   softcap=self.softcap, sinks=self.sinks, softmax_scale=self.softmax_scale)
        return self.o_proj(o.to(x.dtype).reshape(b, s, self.num_heads * self.v_head_dim))


# ----------------------------------------------------------------------------------------------
# sequence-parallel transports of ParallelAttention
# ----------------------------------------------------------------------------------------------
def _size_rank(transport):
    return (1, 0) if transport is None else (transport.size, transport.rank)


def _one_of(name, group_name, group, transport_name, transport):
    if group is not None and transport is not None:
        raise ValueError(f"{name}: pass {group_name} or {transport_name}, not both (got {group_name}={group!r}, "
                         f"{transport_name}={transport!r})")
    return get_transport(transport, group)


def _sp_transports(name, sp_mode, sp_group, sp_transport, ulysses_group, ulysses_transport, ring_group,
                   ring_transport):
    """``(ulysses_transport, ring_transport)`` of a sequence-parallel mode (None: no such dimension)."""
    if sp_mode == "hybrid":
        if sp_group is not None or sp_transport is not None:
            raise ValueError(f"{name}: sp_mode='hybrid' takes ulysses_group and ring_group (or their transports), "
                             "not sp_group / sp_transport")
        if (ulysses_group is None and ulysses_transport is None) or (ring_group is None and ring_transport is None):
            raise ValueError(f"{name}: sp_mode='hybrid' needs both ulysses_group and ring_group (or "
                             "ulysses_transport and ring_transport)")
        return (_one_of(name, "ulysses_group", ulysses_group, "ulysses_transport", ulysses_transport),
                _one_of(name, "ring_group", ring_group, "ring_transport", ring_transport))
    if any(x is not None for x in (ulysses_group, ring_group, ulysses_transport, ring_transport)):
        raise ValueError(f"{name}: ulysses_group / ring_group (and their transports) are for sp_mode='hybrid'; "
                         "use sp_group or sp_transport")
    t = _one_of(name, "sp_group", sp_group, "sp_transport", sp_transport)
    return (None, t) if sp_mode == "ring" else (t, None)


def _check_attention_groups(name, tp_arg, ulysses_transport, ring_transport, *, sp_omitted=False):
    """tp and the sequence-parallel group(s) pairwise orthogonal (see :mod:`fusedpar.nn.groups`);
    the sequence groups are named as passed (``sp_group`` outside hybrid mode)."""
    hybrid = ulysses_transport is not None and ring_transport is not None
    sp_omitted = sp_omitted and not hybrid  # hybrid mode needs both groups: none is omitted
    sp = [group_arg("ulysses_group" if hybrid else "sp_group", transport=ulysses_transport, omitted=sp_omitted)
          if ulysses_transport is not None else None,
          group_arg("ring_group" if hybrid else "sp_group", transport=ring_transport, omitted=sp_omitted)
          if ring_transport is not None else None]
    sp = [g for g in sp if g is not None]
    for g in sp:
        check_orthogonal(name, tp_arg, g)
    if len(sp) == 2:
        check_orthogonal(name, sp[0], sp[1])


# ----------------------------------------------------------------------------------------------
# the groups and the sequence layout every attention block shares
# ----------------------------------------------------------------------------------------------
class SequenceParallelAttention(nn.Module):
    """Base of fusedpar's attention blocks (:class:`ParallelAttention`, :class:`~fusedpar.nn.MLAttention`):
    the tensor-parallel group that splits the heads, the sequence-parallel group(s) and mode,
    the sequence layout of the input tokens and the gradient reduction over the sequence-parallel
    ranks. A subclass calls :meth:`init_layout` first in its constructor."""

    def init_layout(self, head_counts: dict, *, tp_group, sp_group, sp_mode, layout, ulysses_group, ring_group,
                    sp_transport, ulysses_transport, ring_transport) -> None:
        """Check and keep the groups (see :class:`ParallelAttention` for their meaning):
        ``head_counts`` (name -> count) must each split over the tensor-parallel group; sets
        ``layout``, ``sp_mode``, ``tp_group`` / ``tp_size`` / ``tp_rank``, the transports and
        ``ulysses_size`` / ``ulysses_rank`` / ``ring_size`` / ``ring_rank``."""
        name = type(self).__name__
        if sp_mode not in SP_MODES:
            raise ValueError(f"{name}: sp_mode must be one of {SP_MODES}, got {sp_mode!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"{name}: layout must be one of {LAYOUTS}, got {layout!r}")
        tp_arg = group_arg("tp_group", tp_group, omitted=tp_group is None)
        tp_group = comm.resolve_group(tp_group)
        for what, n in head_counts.items():
            check_divides(name, what, n, tp_arg, "tensor-parallel")
        self.layout, self.sp_mode = layout, sp_mode
        self.tp_group, self.tp_size, self.tp_rank = tp_group, comm.group_size(tp_group), comm.group_rank(tp_group)
        self.ulysses_transport, self.ring_transport = _sp_transports(
            name, sp_mode, sp_group, sp_transport, ulysses_group, ulysses_transport, ring_group, ring_transport)
        self.sp_transports = tuple(t for t in (self.ulysses_transport, self.ring_transport) if t is not None)
        self.ulysses_size, self.ulysses_rank = _size_rank(self.ulysses_transport)
        self.ring_size, self.ring_rank = _size_rank(self.ring_transport)
        _check_attention_groups(name, tp_arg, self.ulysses_transport, self.ring_transport,
                                sp_omitted=sp_group is None and sp_transport is None)

    def _sp_positions(self, seq_len, device=None):
        return shard_positions(seq_len, layout=self.layout if self.ring_size > 1 else "contiguous",
                               ring_rank=self.ring_rank, ring_size=self.ring_size,
                               ulysses_rank=self.ulysses_rank, ulysses_size=self.ulysses_size, device=device)

    def local_positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions of the tokens this rank's ``x`` holds, for a full length ``seq_len``."""
        pos = self._sp_positions(seq_len, device)
        if pos.numel() % self.tp_size:
            raise ValueError(f"the sequence-parallel shard of {pos.numel()} tokens must split over tp={self.tp_size}")
        n = pos.numel() // self.tp_size
        return pos[self.tp_rank * n:(self.tp_rank + 1) * n]

    def shard(self, x_full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's input tokens out of a full sequence ``x_full`` (along ``dim``)."""
        return x_full.index_select(dim, self.local_positions(x_full.shape[dim], x_full.device))

    def rotary_positions(self, seq_len: int, device=None, *, cu_seqlens=None, position_ids=None) -> torch.Tensor:
        """Rotary positions of this rank's sequence-parallel shard of a full sequence of
        ``seq_len`` tokens: the global positions, or ``position_ids`` (``[seq_len]``, of the full
        packed row, the same on every rank) at them; with ``cu_seqlens`` and no
        ``position_ids``, positions restart at 0 at every document."""
        pos = self._sp_positions(seq_len, device)
        if position_ids is None and cu_seqlens is not None:
            position_ids = document_positions(cu_seqlens, seq_len)
        if position_ids is None:
            return pos
        if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != (seq_len,):
            shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise ValueError(f"{type(self).__name__}: position_ids must be [{seq_len}] (the full packed row), got {shape}")
        return position_ids.to(pos.device).index_select(0, pos)

    def attend(self, q, k, v, **options):
        """Attention of this rank's shard in the block's sequence-parallel mode: ring (with the
        layout), Ulysses or hybrid over the block's transports; ``options`` as the ops take them."""
        if self.sp_mode == "ring":
            return ring_attention(q, k, v, transport=self.ring_transport, layout=self.layout, **options)
        if self.sp_mode == "ulysses":
            return ulysses_attention(q, k, v, transport=self.ulysses_transport, **options)
        return hybrid_attention(q, k, v, ulysses_transport=self.ulysses_transport, ring_transport=self.ring_transport,
                                layout=self.layout, **options)

    def attend_project(self, proj, q, k, v, *, cu_seqlens=None, **options):
        """``proj`` of the attention output's flattened heads (:meth:`attend`). With ``proj`` in
        blockwise fp8, no sequence parallelism, dense rows and a v head dim a multiple of 128,
        the flash forward's epilogue quantises the output per 1x128 tile and hands it to
        ``proj`` (``return_fp8`` / ``x_fp8``: the same bits as ``proj`` quantising it, one pass
        fewer); otherwise ``proj`` quantises it (ring and Ulysses merge or move the output after
        the kernels, packed rows take the documents' segment tables)."""
        b, s, hl, dv = *q.shape[:3], v.shape[3]
        if self._fp8_handoff(proj, dv, cu_seqlens):
            o, _, (o_q, o_scale) = flash_attention(q, k, v, return_fp8=True, **options)
            return proj(o.reshape(b, s, hl * dv), x_fp8=(o_q.reshape(b, s, hl * dv), o_scale))
        o = self.attend(q, k, v, cu_seqlens=cu_seqlens, **options)
        return proj(o.reshape(b, s, hl * dv))

    def _fp8_handoff(self, proj, dv: int, cu_seqlens) -> bool:
        """Whether the attention kernel quantises its output for ``proj`` (:meth:`attend_project`)."""
        return (getattr(proj, "fp8", None) == "blockwise" and dv % FP8_BLOCK == 0 and cu_seqlens is None
                and self.ring_size * self.ulysses_size == 1)

    def reduce_sequence_parallel_grads(self):
        """Sum the parameter gradients over the sequence-parallel group(s), in place (hybrid: over
        the Ulysses group, then the ring group, i.e. over the whole 2-D grid), and the gradients of
        the parameters declared "replicated" (q / k norm scales, MLA's down projections and latent
        norms: each tp rank's covers its heads or its tokens) over the tp group too: the rule
        :func:`fusedpar.parallel.sync_gradients` applies to the same placements."""
        plan = gradient_sync_plan(self)
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            for t in self.sp_transports:
                if t.size > 1:
                    t.all_reduce(p.grad).wait()
            if plan[name] == "replicated" and self.tp_size > 1:
                comm.all_reduce(p.grad, self.tp_group).wait()


# ----------------------------------------------------------------------------------------------
# ParallelAttention
# ----------------------------------------------------------------------------------------------
class ParallelAttention(SequenceParallelAttention):
    """Tensor- and sequence-parallel attention block (see the module docstring for the layout).

    Input ``x``: ``[batch, S / (sp * tp), hidden_size]``, this rank's tokens; output the same shape.
    ``tp_group`` splits the heads (``num_heads`` and ``num_kv_heads`` must be divisible by its
    size), ``sp_group`` the sequence (``sp_mode="ring"``: ring attention with ``layout``;
    ``"ulysses"``: all-to-all, the group size must split this rank's heads; ``"hybrid"``: pass
    ``ulysses_group`` and ``ring_group`` instead of ``sp_group``). An omitted group
    (``None``) means the default (world) group, as everywhere in fusedpar; for no parallelism on a
    dimension pass a group of one rank. Groups of more than one rank must be orthogonal (tp and sp,
    or tp, Ulysses and ring: their rank sets meet in this rank only): at construction, an overlap
    (e.g. ``tp_group`` of 2 in a world of 4 with ``sp_group`` omitted, so the world) raises one
    ``ValueError`` naming the groups and their ranks, on every rank (:mod:`fusedpar.nn.groups`).
    Each sequence-parallel group may be given as a :class:`~fusedpar.ops.Transport` instead (``sp_transport``, ``ulysses_transport``,
    ``ring_transport``; e.g. an ``EmulatedTransport`` to run one rank's schedule in one process).

    Attention options ``window``, ``softcap``, ``sinks``, ``v_head_dim``, ``softmax_scale``: as in
    :class:`AttentionReference` (the window in global sequence positions); the ``sinks``
    parameter is split over tp by heads, like the heads themselves. ``dq_mode``: the attention
    backward, ``"separate"`` (default, deterministic) or ``"atomic"`` (one pass, dQ added with
    fp32 atomics; dq's bits vary between GPU runs), in every sequence-parallel mode (see
    :func:`~fusedpar.ops.sequence_parallel.api.ring_attention`).

    Parameters are replicated across the sequence-parallel ranks and each rank's gradients cover
    its own tokens only: sum them over the sequence-parallel group(s) (include those ranks in the
    data-parallel gradient reduction, or call :meth:`reduce_sequence_parallel_grads`).

    With fewer kv heads than tp ranks (tp a multiple of ``num_kv_heads``) each rank keeps the kv
    head its q heads use (``kv_replicas`` ranks hold each; declared as the projection's
    ``Placement.replicas``) and the k / v rows' gradient is summed over those ranks in the backward
    (:func:`fusedpar.ops.replicated_rows`). ``qk_norm_scope``: the q / k RMSNorm over ``head_dim``
    of each head (``"head"``) or over the whole projection (``"projection"``, OLMo 2: its scales
    split over tp with the heads, the statistics reduced over tp); ``norm_offset=1.0``: Gemma's
    ``(1 + w)`` scales.
    """

    def __init__(self, config: AttentionConfig, *, tp_group=None, sp_group=None, ulysses_group=None,
                 ring_group=None, sp_transport=None, ulysses_transport=None, ring_transport=None, device=None,
                 dtype=None, _reference=None):
        super().__init__()
        name = type(self).__name__
        self.config = c = module_config(name, config, AttentionConfig)
        hidden_size, num_heads, num_kv_heads, head_dim, v_head_dim = (
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.v_head_dim)
        causal, qk_norm, qk_norm_scope = c.causal, c.qk_norm, c.qk_norm_scope
        rope_theta, rotary_dim = c.rope_theta, c.rotary_dim
        window, softcap, sinks, softmax_scale = c.window, c.softcap, c.sinks, c.softmax_scale
        sp_mode, layout, dq_mode = c.sp_mode, c.layout, c.dq_mode
        self.dq_mode = _check_dq_mode(name, dq_mode)
        num_kv_heads, head_dim = _check_shape_args(name, hidden_size, num_heads, num_kv_heads, head_dim)
        self.rotary_dim = _rotary_dim(name, rotary_dim, head_dim)
        check_bool(f"{name}: causal", causal)
        check_positive_number(f"{name}: rope_theta", rope_theta)
        self.v_head_dim, self.window, self.softcap, _, self.softmax_scale = _check_score_args(
            name, head_dim, v_head_dim, window, softcap, sinks, softmax_scale)
        qk_norm_scope = _check_qk_norm_scope(name, qk_norm_scope)
        check_kv_heads(name, "num_kv_heads", num_kv_heads, group_arg("tp_group", tp_group, omitted=tp_group is None))
        self.init_layout({"num_heads": num_heads}, tp_group=tp_group,
                         sp_group=sp_group, sp_mode=sp_mode, layout=layout, ulysses_group=ulysses_group,
                         ring_group=ring_group, sp_transport=sp_transport, ulysses_transport=ulysses_transport,
                         ring_transport=ring_transport)
        tp = self.tp_size
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_kv_heads = num_kv_heads
        # fewer kv heads than tp ranks: each rank keeps the kv head its q heads use, held alike by
        # kv_replicas consecutive ranks (their k / v gradients summed over those ranks: forward)
        self.kv_replicas = max(1, tp // num_kv_heads)
        if self.kv_replicas > 1 and qk_norm and qk_norm_scope == "projection" and _reference is None:
            raise ValueError(f"{name}: qk_norm_scope='projection' (a k norm over the whole k projection) needs "
                             f"num_kv_heads={num_kv_heads} divisible by the tensor-parallel size {tp}, not kv heads "
                             "replicated over tp")
        self.heads_local, self.kv_heads_local = num_heads // tp, max(1, num_kv_heads // tp)
        self.causal, self.rope_theta = bool(causal), float(rope_theta)
        if self.ulysses_size > 1:
            ulysses_kv_heads(self.heads_local, self.kv_heads_local, self.ulysses_size)

        # full weights drawn exactly as AttentionReference draws them (CPU, fp32, global RNG)
        # (on the meta device the reference is built there too: nothing is drawn or allocated)
        ref = _reference if _reference is not None else AttentionReference(
            c, device="meta" if device is not None and torch.device(device).type == "meta" else None)
        self.rope_scaling, self.qk_norm_scope = ref.rope_scaling, ref.qk_norm_scope
        self._shard_from(ref, device=device, dtype=dtype)

    @classmethod
    def from_reference(cls, ref: AttentionReference, *, sp_mode: str = "ring", layout: str = "zigzag",
                       dq_mode: str = DEFAULT_DQ_MODE, **kwargs):
        """Shard the weights of an :class:`AttentionReference`: its config with the sequence-parallel
        fields ``sp_mode``, ``layout`` and ``dq_mode`` (which the reference ignores); ``kwargs``: the
        constructor's groups, transports, device and dtype."""
        if not isinstance(ref, AttentionReference):
            raise TypeError(f"from_reference needs an AttentionReference, got {type(ref).__name__}")
        config = dataclasses.replace(ref.config, sp_mode=sp_mode, layout=layout, dq_mode=dq_mode)
        return cls(config, _reference=ref, **kwargs)

    def _shard_from(self, ref, *, device, dtype):
        """One fused ``[q; k; v]`` projection, column-parallel with three sections, so that every
        tensor-parallel rank holds whole heads: ``[its q heads; its k heads; its v heads]``; the
        sinks (fp32) split by heads too."""
        d, dv = self.head_dim, self.v_head_dim
        with torch.no_grad():
            projs = (ref.q_proj, ref.k_proj, ref.v_proj)
            fused = nn.Linear(self.hidden_size, (self.num_heads + self.num_kv_heads) * d + self.num_kv_heads * dv,
                              bias=ref.q_proj.bias is not None, device="meta")
            fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in projs]))
            if ref.q_proj.bias is not None:
                fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in projs]))
            f = self.kv_replicas
            self.qkv = ColumnParallelLinear.from_linear(
                fused, group=self.tp_group, sequence_parallel=True,
                sections=(self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * dv),
                replicas=(1, f, f) if f > 1 else None)
            self.proj = RowParallelLinear.from_linear(ref.o_proj, group=self.tp_group, sequence_parallel=True,
                                                      input_is_parallel=True)
            self.q_norm = self.k_norm = None
            if ref.q_norm is not None and self.qk_norm_scope == "head":  # replicated [head_dim] scales
                self.q_norm, self.k_norm = copy.deepcopy(ref.q_norm), copy.deepcopy(ref.k_norm)
            elif ref.q_norm is not None:  # over the whole projection: this rank's heads' slice of the scales
                self.q_norm, self.k_norm = (self._sharded_norm(n) for n in (ref.q_norm, ref.k_norm))
            self.sinks = None if ref.sinks is None else nn.Parameter(Placement.tp(self.tp_group, 0).local_from_full(
                ref.sinks.detach()))
            # own storage: no views into the full weights (nor into ref's parameters); new
            # Parameters rather than set_data, which cannot move a tensor to the meta device
            for mod in self.modules():
                for pname, p in list(mod.named_parameters(recurse=False)):
                    fp32 = mod is self and pname == "sinks"  # the sink logits stay fp32
                    t = p.detach().to(device=device, dtype=torch.float32 if fp32 else dtype)
                    setattr(mod, pname, nn.Parameter(t.clone()))

    def _sharded_norm(self, full: RMSNorm) -> RMSNorm:
        """An RMSNorm over a whole q or k projection whose features (heads) are split over tp:
        the statistics reduced over tp, the scales a block of the full ones (OLMo 2)."""
        group = self.tp_group if self.tp_size > 1 else None
        norm = RMSNorm(full.hidden_size, full.eps, offset=full.offset, feature_group=group, device="meta")
        norm.weight = nn.Parameter(norm.placements()["weight"].local_from_full(full.weight.detach()))
        return norm

    def _apply(self, fn, recurse=True):
        """``module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` keep the sink logits fp32 (the
        attention ops take fp32 sinks; a bf16 logit would also lose the precision they train in)."""
        super()._apply(fn, recurse)
        if self.sinks is not None and self.sinks.dtype != torch.float32:
            self.sinks.data = self.sinks.data.to(torch.float32)
        return self

    def placements(self) -> dict[str, Placement]:
        """``sinks``: one logit per head, split over tp like the heads (the projections and norms
        declare their own)."""
        return {} if self.sinks is None else {"sinks": Placement.tp(self.tp_group, 0)}

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x, *, cu_seqlens=None, position_ids=None, x_fp8=None):
        """``cu_seqlens``: int32 document boundaries of the full packed row (batch 1; global
        positions, the same on every rank): attention stays inside each document and rotary
        positions restart per document unless ``position_ids`` (``[seq_len]``) are given.
        ``x_fp8``: ``x`` already quantised for the fp8 qkv projection, ``(q, scale)`` (the fp8
        output of the norm that produced ``x``; :meth:`ColumnParallelLinear.forward`)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__}: x must be [batch, seq_local, {self.hidden_size}], got {shape}")
        hl, kl, d, dv = self.heads_local, self.kv_heads_local, self.head_dim, self.v_head_dim
        if self.kv_replicas > 1:  # the k / v rows' gradient summed over the ranks holding that kv head
            rows = dict(start=hl * d, block=self.tp_rank // self.kv_replicas, blocks=self.num_kv_heads,
                        group=self.tp_group)
            bias = self.qkv.bias
            y = all_gather_matmul(x, replicated_rows(self.qkv.weight, **rows), None if bias is None else
                                  replicated_rows(bias, **rows), group=self.tp_group, gather_dim=1,
                                  save_gathered_input=self.qkv.save_gathered_input, x_fp8=x_fp8)
        else:
            # [b, s_sp, (hl + kl) * d + kl * dv]: the sequence-parallel shard, this rank's heads
            y = self.qkv(x, x_fp8=x_fp8)
        b, s_sp, _ = y.shape
        q, k, v = (t.unflatten(2, (n, -1)) for t, n in zip(y.split((hl * d, kl * d, kl * dv), dim=2), (hl, kl, kl)))
        seq_len = s_sp * self.ring_size * self.ulysses_size
        pos = self.rotary_positions(seq_len, y.device, cu_seqlens=cu_seqlens, position_ids=position_ids)
        cos, sin = rotary_cos_sin(pos, self.rotary_dim, self.rope_theta, scaling=self.rope_scaling)
        if self.q_norm is not None and self.qk_norm_scope == "head":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        elif self.q_norm is not None:  # over this rank's slice of the projection, statistics over tp
            q = self.q_norm(q.reshape(b, s_sp, hl * d)).view(b, s_sp, hl, d)
            k = self.k_norm(k.reshape(b, s_sp, kl * d)).view(b, s_sp, kl, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.attend_project(self.proj, q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, window=self.window,
                                   softcap=self.softcap, sinks=self.sinks, softmax_scale=self.softmax_scale,
                                   dq_mode=self.dq_mode)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads} (local {self.heads_local}), "
                f"kv_heads={self.num_kv_heads} (local {self.kv_heads_local}), head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, window={self.window}, softcap={self.softcap}, "
                f"sinks={self.sinks is not None}, softmax_scale={self.softmax_scale}, dq_mode={self.dq_mode!r}, "
                f"sp_mode={self.sp_mode!r}, layout={self.layout!r}, tp={self.tp_rank}/{self.tp_size}, "
                f"causal={self.causal}")
