"""Tensor-parallel GEMMs with the communication overlapped chunk by chunk, forward and backward,
the functional API:

* :func:`all_gather_matmul` -- ``act(all_gather(x) @ W^T + b)`` (column parallel with sequence
  parallelism);
* :func:`matmul_reduce_scatter` -- ``reduce_scatter(x @ W^T) + b`` (row parallel with sequence
  parallelism);
* :func:`matmul_all_reduce` / :func:`copy_to_tp_matmul` -- the row / column GEMMs without
  sequence parallelism;
* :func:`gather_features` / :func:`scatter_features` / :func:`all_gather_tokens` /
  :func:`replicated_rows` -- the feature-dim gather and scatter of the layers, token gathers, and
  rows several ranks hold alike (kv heads replicated over tp: their gradient summed).

``fp8=`` runs the GEMMs on e4m3 operands (``x_fp8=`` / ``return_fp8=`` hand quantised activations
between ops); ``transport=`` picks the ring over a :class:`~fusedpar.ops.comm.Transport` or the
persistent GEMM with in-kernel waits on symmetric memory."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_bool, check_choice, check_divisible, check_dtype, check_int, check_tensor
from fusedpar.kernels.fp8 import check_fp8_device
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.ops.comm.agreement import agreed_arguments, checks_passed, describe
from fusedpar.ops.comm.keys import transport_size, transport_id_of
from fusedpar.ops.comm.symmetric import TRANSPORTS
from fusedpar.ops.comm.transport import Transport, check_transport_name
from fusedpar.ops.common import call_op, checked_api
from fusedpar.ops.fp8.operands import check_fp8_rows
from fusedpar.ops.tensor_parallel.custom_ops import (
    all_gather_matmul_fp8_op,
    all_gather_matmul_op,
    all_gather_tokens_op,
    copy_to_tp_matmul_fp8_op,
    copy_to_tp_matmul_op,
    gather_features_op,
    matmul_all_reduce_fp8_op,
    matmul_all_reduce_op,
    matmul_reduce_scatter_fp8_op,
    matmul_reduce_scatter_op,
    replicated_rows_op,
    scatter_features_op,
)
from fusedpar.ops.tensor_parallel.bodies import tp_options
from fusedpar.ops.tensor_parallel.schedules import check_linear_args


# ----------------------------------------------------------------------------------------------
# validation (local only: runs before any communication; metadata only, so Dynamo traces it)
# ----------------------------------------------------------------------------------------------
def _token_dim(op, name, dim, x):
    """Normalise a gather/scatter dim: one of x's token dims (not the feature dim)."""
    check_int(f"{op}: {name}", dim)
    nd = x.dim()
    d = dim + nd if dim < 0 else dim
    if not 0 <= d < nd - 1:
        raise ValueError(f"{op}: {name} must be a token dim of x (0..{nd - 2} for shape {tuple(x.shape)}), "
                         f"got {dim}")
    return d


def _partial_dtype(op, name, dtype, x):
    if dtype is None:
        return x.dtype
    check_dtype(f"{op}: {name}", dtype, dict.fromkeys((torch.float32, x.dtype)))
    return dtype


def _transport_id(transport, group, names=TRANSPORTS):
    """The op's transport id; an unknown transport name raises the transports' own error."""
    check_transport_name(transport, names)
    return transport_id_of(transport, group)


def _fp8_options(op, fp8, fp8_grad_high_precision, x):
    """The fp8 options: ``fp8`` None or a recipe of :data:`FP8_RECIPES`; a GPU without fp8
    tensor cores raises ``FP8UnsupportedError`` naming the device and the option."""
    check_bool(f"{op}: fp8_grad_high_precision", fp8_grad_high_precision)
    check_choice(f"{op}: fp8", fp8, (None,) + tuple(FP8_RECIPES))
    if fp8 is not None:
        check_fp8_device(x, option=f"{op}'s fp8={fp8!r}")


def _fp8_rows_text(rows) -> str:
    """What the ranks agree on of an ``x_fp8`` argument: the shapes and dtypes of its pair."""
    if isinstance(rows, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in rows):
        return ", ".join(describe(t) for t in rows)
    return type(rows).__name__


def _check_x_fp8(op, x_fp8, x, fp8):
    """``x_fp8``: None, or with ``fp8`` on ``x``'s quantisation in its activation granularity."""
    if x_fp8 is None:
        return
    if fp8 is None:
        raise ValueError(f"{op}: x_fp8 (x already quantised) needs fp8='rowwise' or 'blockwise', got fp8=None")
    check_fp8_rows(op, "x_fp8", x_fp8, x, fp8)


def _check_return_fp8(op, return_fp8, fp8):
    """``return_fp8``: a bool; True needs the blockwise recipe (the epilogue quantises per 1x128
    tile of the output features; a rowwise scale spans every column program of a row)."""
    check_bool(f"{op}: return_fp8", return_fp8)
    if return_fp8 and fp8 != "blockwise":
        raise ValueError(f"{op}: return_fp8=True needs fp8='blockwise' (the output quantised per 1x128 tile in the "
                         f"GEMM epilogue), got fp8={fp8!r}")


def _with_fp8(out, q, scale, return_fp8):
    """The op's result: ``out``, or ``(out, (q, scale))`` with ``return_fp8``."""
    return (out, (q, scale)) if return_fp8 else out


def _pair(x_fp8) -> tuple:
    """An ``x_fp8`` argument as tensors of a call's key (:func:`checks_passed`)."""
    return () if x_fp8 is None else tuple(x_fp8) if isinstance(x_fp8, (tuple, list)) else (x_fp8,)


def _grad_needed(*tensors):
    """Whether a backward can follow (nothing is kept for one that cannot: inference, no_grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------------
# all_gather_matmul
# ----------------------------------------------------------------------------------------------
def _ag_checks(x, weight, bias, group, gather_dim, activation, save_gathered_input, return_gathered, partial_dtype,
               transport, fp8, fp8_grad_high_precision, x_fp8, return_fp8):
    """:func:`all_gather_matmul`'s checks; ``(gather dim, partial dtype, transport id)``."""
    op = "all_gather_matmul"
    with agreed_arguments(op, transport, group, dict(
            x=x, weight=weight, bias=bias, gather_dim=gather_dim, activation=activation, partial_dtype=partial_dtype,
            save_gathered_input=save_gathered_input, return_gathered=return_gathered, transport=transport, fp8=fp8,
            fp8_grad_high_precision=fp8_grad_high_precision, x_fp8=None if x_fp8 is None else _fp8_rows_text(x_fp8),
            return_fp8=return_fp8)):
        check_linear_args(op, x, weight, bias, activation)
        dim = _token_dim(op, "gather_dim", gather_dim, x)
        partial_dtype = _partial_dtype(op, "partial_dtype", partial_dtype, x)
        check_bool(f"{op}: save_gathered_input", save_gathered_input)
        check_bool(f"{op}: return_gathered", return_gathered)
        _fp8_options(op, fp8, fp8_grad_high_precision, x)
        if fp8 is not None and return_gathered:
            raise ValueError(f"{op}: return_gathered must be False with fp8={fp8!r} (the input travels in fp8), "
                             "got True")
        _check_x_fp8(op, x_fp8, x, fp8)
        _check_return_fp8(op, return_fp8, fp8)
    return dim, partial_dtype, _transport_id(transport, group)


@checked_api
def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    gather_dim: int = 1,
    activation: str = "none",
    save_gathered_input: bool = True,
    return_gathered: bool = False,
    partial_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
    fp8: str | None = None,
    fp8_grad_high_precision: bool = False,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_fp8: bool = False,
):
    """``act(all_gather(x, gather_dim) @ weight.T + bias)`` with the gather overlapped with the GEMM.

    x:        this rank's shard, ``[batch, seq/tp, in]`` (``gather_dim=1``) or ``[batch/tp, seq, in]``
              / ``[tokens/tp, in]`` (``gather_dim=0``). Every rank's shard has the same shape.
    weight:   this rank's ``[out_shard, in]`` rows (``[2F_shard, in]``, gate rows then up rows, for
              gated activations).
    activation: fused into the GEMM epilogue (``"swiglu"`` etc.); the pre-activation is kept for
              the backward only when a gradient is needed.
    save_gathered_input: keep the gathered input for the weight gradient (default). ``False``
              saves only the local shard and re-gathers it in the backward, overlapped with the
              data-gradient GEMMs (less memory, one more all-gather of ``x``).
    return_gathered: also return ``all_gather(x, gather_dim)`` (non-differentiable; assembled by a
              copy, only when asked).
    partial_dtype: dtype of the partial sums that travel in the backward reduce-scatter
              (fp32 by default; ``None`` or ``x.dtype`` halves the traffic, the sums still
              accumulate in fp32 inside each GEMM).
    transport: a :class:`Transport` instance (then ``group`` must be None), or a name:
              ``"portable"`` (the ring over torch.distributed, any backend), ``"symmetric"`` (one
              persistent GEMM waiting per chunk on copy-engine pulls from symmetric memory; one
              NVLink domain, NCCL), ``"auto"`` (symmetric where it can run, the same choice on
              every rank), or ``None`` (the default of :mod:`fusedpar.ops.comm.symmetric`). All give
              the same numbers.
    fp8:      ``None`` (GEMMs in ``x``'s dtype) or a recipe, ``"rowwise"`` / ``"blockwise"``
              (:func:`fusedpar.ops.fp8_linear`): this rank's shard is quantised once and travels as
              e4m3 + scales (about half of bf16's bytes), each chunk's GEMM is an fp8 GEMM, and the
              backward's too (``fp8_grad_high_precision``: the weight gradient in ``x``'s dtype).
              ``return_gathered`` is not available. On a symmetric transport without
              ``save_gathered_input`` (or with no weight gradient) the forward is one persistent
              fp8 GEMM, the activation fused; otherwise the ring over the transport's transfers,
              the activation an elementwise pass after each chunk's GEMM.
    x_fp8:    with ``fp8``, ``x`` already quantised per token in the recipe's activation
              granularity, ``(q, scale)``: ``q`` e4m3 of ``x``'s shape, ``scale`` fp32 of shape
              ``x.shape[:-1]`` (rowwise) or ``x.shape[:-1] + (ceil(in / 128),)`` (blockwise), as
              :func:`fusedpar.kernels.quantize_e4m3` makes them and the fp8 output of
              :func:`fusedpar.ops.rms_norm_fp8` is: they travel instead of a quantisation of
              ``x`` (the norm's output is not quantised a second time). The result is the same
              bits as without it when the pair is ``x``'s quantisation; the backward's operands
              scaled along the tokens still come from ``x``. Not differentiable.
    return_fp8: with ``fp8="blockwise"``, also return the output quantised per 1x128 tile of its
              features, ``(out, (q, scale))``: written by each chunk GEMM's epilogue (the
              persistent path: one quantisation pass after it), bit for bit
              ``quantize_e4m3(out, "tile")``, the ``x_fp8`` of the next fp8 GEMM (the down
              projection's :func:`matmul_reduce_scatter`). Not differentiable.
    Returns ``[batch, seq, out_shard]`` (gather_dim 1), i.e. the gather dim grows ``tp`` times.
    """
    dim, partial_dtype, transport_id = checks_passed(
        "all_gather_matmul", transport, group, (x, weight, bias) + _pair(x_fp8),
        (gather_dim, activation, save_gathered_input, return_gathered, partial_dtype, fp8, fp8_grad_high_precision,
         return_fp8),
        lambda: _ag_checks(x, weight, bias, group, gather_dim, activation, save_gathered_input, return_gathered,
                           partial_dtype, transport, fp8, fp8_grad_high_precision, x_fp8, return_fp8))
    need_dw = _grad_needed(weight)
    need_grad = need_dw or _grad_needed(x, bias)
    if fp8 is not None:
        x_q, x_scale = (None, None) if x_fp8 is None else x_fp8
        out, _, _, q, scale = call_op(all_gather_matmul_fp8_op, x, weight, bias, tp_options(
            transport_id, dim, partial_dtype, activation, fp8_grad_high_precision, need_grad,
            save_gathered_input and need_dw, return_fp8, recipe=fp8), x_q, x_scale)
        return _with_fp8(out, q, scale, return_fp8)
    keep = return_gathered or (save_gathered_input and need_dw)
    out, _, gathered = call_op(all_gather_matmul_op, x, weight, bias, tp_options(
        transport_id, dim, partial_dtype, activation, need_grad, keep, keep and need_dw))
    if not return_gathered:
        return out
    # [P, *x.shape] by source rank -> concatenated along the gather dim (a copy made only on request)
    return out, torch.cat(gathered.detach().unbind(0), dim=dim)


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter
# ----------------------------------------------------------------------------------------------
def _rs_checks(x, weight, bias, group, scatter_dim, partial_dtype, transport, fp8, fp8_grad_high_precision, x_fp8):
    """:func:`matmul_reduce_scatter`'s checks; ``(scatter dim, partial dtype, transport id)``."""
    op = "matmul_reduce_scatter"
    with agreed_arguments(op, transport, group, dict(x=x, weight=weight, bias=bias, scatter_dim=scatter_dim,
                                                     partial_dtype=partial_dtype, transport=transport, fp8=fp8,
                                                     fp8_grad_high_precision=fp8_grad_high_precision,
                                                     x_fp8=None if x_fp8 is None else _fp8_rows_text(x_fp8))):
        check_linear_args(op, x, weight, bias)
        dim = _token_dim(op, "scatter_dim", scatter_dim, x)
        partial_dtype = _partial_dtype(op, "partial_dtype", partial_dtype, x)
        _fp8_options(op, fp8, fp8_grad_high_precision, x)
        _check_x_fp8(op, x_fp8, x, fp8)
    transport_id = _transport_id(transport, group)
    check_divisible(f"{op}: x.shape[{dim}]", x.shape[dim], transport_size(transport, group))
    return dim, partial_dtype, transport_id


@checked_api
def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    scatter_dim: int = 1,
    partial_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
    fp8: str | None = None,
    fp8_grad_high_precision: bool = False,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """``reduce_scatter(x @ weight.T, scatter_dim) + bias`` with the reduction fused into the GEMMs.

    x:      ``[batch, seq, in_shard]`` (or ``[tokens, in_shard]`` with ``scatter_dim=0``); the
            scatter dim must be divisible by the group size.
    weight: this rank's ``[out, in_shard]`` columns; bias ``[out]`` (replicated, added once).
    partial_dtype: what travels between ranks. fp32 (default) keeps the sum as exact as a
            single-process fp32-accumulated GEMM; ``None``/``x.dtype`` halves the traffic for
            fp16/bf16 and rounds each partial once per hop (accumulation stays fp32 in the epilogue).
    transport: as in :func:`all_gather_matmul`; ``"symmetric"`` runs one persistent GEMM that
            releases per-chunk counters while a small reduction kernel pulls the peers' partials
            (of ``partial_dtype``) over NVLink and sums them in fp32.
    fp8:    ``None`` or a recipe (as in :func:`all_gather_matmul`): the partial GEMMs take ``x``
            quantised per token (along this rank's in-features) and the weight once; the partials
            still travel in ``partial_dtype``. Backward: each rank's output gradient travels once,
            packed as e4m3 + scales (plus its weight-gradient operand and its bias-gradient sum).
    x_fp8:  with ``fp8``, ``x`` already quantised per token along this rank's in-features,
            ``(q, scale)`` (as in :func:`all_gather_matmul`; e.g. the ``return_fp8`` output of the
            up projection or of :func:`fusedpar.ops.flash_attention`): the partial GEMMs read it
            instead of a quantisation of ``x``. Not differentiable.
    Returns ``[batch, seq/tp, out]``. The bias gradient is the full one on every rank.
    """
    dim, partial_dtype, transport_id = checks_passed(
        "matmul_reduce_scatter", transport, group, (x, weight, bias) + _pair(x_fp8),
        (scatter_dim, partial_dtype, fp8, fp8_grad_high_precision),
        lambda: _rs_checks(x, weight, bias, group, scatter_dim, partial_dtype, transport, fp8, fp8_grad_high_precision,
                           x_fp8))
    if fp8 is not None:
        x_q, x_scale = (None, None) if x_fp8 is None else x_fp8
        return call_op(matmul_reduce_scatter_fp8_op, x, weight, bias, tp_options(
            transport_id, dim, partial_dtype, "none", fp8_grad_high_precision, recipe=fp8), x_q, x_scale)
    return call_op(matmul_reduce_scatter_op, x, weight, bias, tp_options(transport_id, dim, partial_dtype))


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce and its mirror for replicated inputs (Megatron "copy to TP region")
# ----------------------------------------------------------------------------------------------
def _reduce_options(op, x, weight, bias, activation, num_chunks, reduce_dtype, transport, group, fp8, fp8_hp,
                    x_fp8=None, return_fp8=False):
    """Checks of the two all-reduce ops (:func:`checks_passed`); returns ``(transport id, reduce_dtype)``."""
    return checks_passed(op, transport, group, (x, weight, bias) + _pair(x_fp8),
                         (activation, num_chunks, reduce_dtype, fp8, fp8_hp, return_fp8),
                         lambda: _reduce_checks(op, x, weight, bias, activation, num_chunks, reduce_dtype, transport,
                                                group, fp8, fp8_hp, x_fp8, return_fp8))


def _reduce_checks(op, x, weight, bias, activation, num_chunks, reduce_dtype, transport, group, fp8, fp8_hp, x_fp8,
                   return_fp8):
    with agreed_arguments(op, transport, group, dict(x=x, weight=weight, bias=bias, activation=activation,
                                                     num_chunks=num_chunks, reduce_dtype=reduce_dtype,
                                                     transport=transport, fp8=fp8, fp8_grad_high_precision=fp8_hp,
                                                     x_fp8=None if x_fp8 is None else _fp8_rows_text(x_fp8),
                                                     return_fp8=return_fp8)):
        check_linear_args(op, x, weight, bias, activation)
        check_int(f"{op}: num_chunks", num_chunks, min_value=1)
        reduce_dtype = _partial_dtype(op, "reduce_dtype", reduce_dtype, x)
        _fp8_options(op, fp8, fp8_hp, x)
        _check_x_fp8(op, x_fp8, x, fp8)
        _check_return_fp8(op, return_fp8, fp8)
    return _transport_id(transport, group), reduce_dtype


@checked_api
def matmul_all_reduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    num_chunks: int = 4,
    reduce_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
    fp8: str | None = None,
    fp8_grad_high_precision: bool = False,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """``all_reduce(x @ weight.T) + bias`` (row parallel without sequence parallelism).

    x: ``[..., in_shard]``, weight ``[out, in_shard]``, bias ``[out]`` (replicated; added once, by
    rank 0's epilogue). The token rows are split into ``num_chunks`` chunks: chunk ``i`` is
    all-reduced asynchronously while chunk ``i + 1`` is computed. ``reduce_dtype``: dtype of the
    reduction (fp32 default; ``None`` reduces in ``x.dtype``). ``transport``/``group``: as in
    :func:`all_gather_matmul` (the all-reduce uses the transport's ``all_reduce``). Backward: no
    communication (the replicated output's gradient is the full one on every rank). ``fp8``: the
    chunks' GEMMs in fp8, the partials reduced in ``reduce_dtype``; the backward is
    :func:`fusedpar.ops.fp8_linear`'s (as in :func:`all_gather_matmul`). ``x_fp8``: ``x`` already
    quantised, as in :func:`matmul_reduce_scatter`.
    """
    transport_id, reduce_dtype = _reduce_options("matmul_all_reduce", x, weight, bias, "none", num_chunks,
                                                 reduce_dtype, transport, group, fp8, fp8_grad_high_precision,
                                                 x_fp8=x_fp8)
    if fp8 is not None:
        x_q, x_scale = (None, None) if x_fp8 is None else x_fp8
        return call_op(matmul_all_reduce_fp8_op, x, weight, bias, tp_options(
            transport_id, num_chunks, reduce_dtype, "none", fp8_grad_high_precision, recipe=fp8), x_q, x_scale)
    return call_op(matmul_all_reduce_op, x, weight, bias, tp_options(transport_id, num_chunks, reduce_dtype))


@checked_api
def copy_to_tp_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    activation: str = "none",
    num_chunks: int = 4,
    reduce_dtype: torch.dtype | None = torch.float32,
    transport: Transport | str | None = None,
    fp8: str | None = None,
    fp8_grad_high_precision: bool = False,
    return_fp8: bool = False,
):
    """Column-parallel GEMM on a replicated input: ``act(x @ weight.T + bias)`` locally; in the
    backward the input gradient (a partial sum per rank) is all-reduced, chunked and overlapped
    like :func:`matmul_all_reduce` (Megatron's "copy to tensor-parallel region"). ``fp8``: every
    GEMM in fp8 (as in :func:`all_gather_matmul`), the input-gradient partials reduced in
    ``reduce_dtype``. ``return_fp8``: as in :func:`all_gather_matmul` (the epilogue's 1x128 tiles
    of the output, for the down projection's :func:`matmul_all_reduce`)."""
    transport_id, reduce_dtype = _reduce_options("copy_to_tp_matmul", x, weight, bias, activation, num_chunks,
                                                 reduce_dtype, transport, group, fp8, fp8_grad_high_precision,
                                                 return_fp8=return_fp8)
    if fp8 is not None:
        out, _, q, scale = call_op(copy_to_tp_matmul_fp8_op, x, weight, bias, tp_options(
            transport_id, num_chunks, reduce_dtype, activation, fp8_grad_high_precision, _grad_needed(x, weight, bias),
            return_fp8, recipe=fp8))
        return _with_fp8(out, q, scale, return_fp8)
    out, _ = call_op(copy_to_tp_matmul_op, x, weight, bias, tp_options(transport_id, num_chunks, reduce_dtype, activation,
                                                              _grad_needed(x, weight, bias)))
    return out


# ----------------------------------------------------------------------------------------------
# feature-dim gather / scatter (gather_output, input_is_parallel=False): not on the hot path
# ----------------------------------------------------------------------------------------------
@checked_api
def gather_features(t: torch.Tensor, group=None, *, transport: Transport | str | None = None) -> torch.Tensor:
    """All-gather the last (feature) dim over the group: ``[..., n]`` -> ``[..., P * n]`` in rank
    order. Backward: this rank's slice of the (replicated) gradient. A group of one returns ``t``."""
    with agreed_arguments("gather_features", transport, group, dict(t=t, transport=transport)):
        check_tensor("gather_features: t", t)
    transport_id = _transport_id(transport, group, names=("portable",))
    if transport_size(transport, group) == 1:
        return t
    return gather_features_op(t, transport_id)


@checked_api
def scatter_features(t: torch.Tensor, group=None, *, transport: Transport | str | None = None) -> torch.Tensor:
    """This rank's slice of the last (feature) dim of a replicated ``t``: ``[..., P * n]`` ->
    ``[..., n]``. Backward: all-gathers the gradient. A group of one returns ``t``."""
    with agreed_arguments("scatter_features", transport, group, dict(t=t, transport=transport)):
        check_tensor("scatter_features: t", t)
    transport_id = _transport_id(transport, group, names=("portable",))
    size = transport_size(transport, group)
    if size == 1:
        return t
    check_divisible("scatter_features: t.shape[-1]", t.shape[-1], size)
    return scatter_features_op(t, transport_id)


@checked_api
def all_gather_tokens(t: torch.Tensor, group=None, *, dim: int = 1,
                      transport: Transport | str | None = None) -> torch.Tensor:
    """Every rank's ``t`` concatenated along the token dim ``dim``, in rank order: ``[b, n, ...]``
    -> ``[b, P * n, ...]`` for ``dim=1``. Backward: the gradient reduce-scattered (summed over the
    ranks in fp32, then this rank's block): each rank may use the gathered tensor differently.
    Every rank's ``t`` must have the same shape. A group of one returns ``t``."""
    with agreed_arguments("all_gather_tokens", transport, group, dict(t=t, dim=dim, transport=transport)):
        check_tensor("all_gather_tokens: t", t)
        check_int("all_gather_tokens: dim", dim)
        if not -t.dim() <= dim < t.dim():
            raise ValueError(f"all_gather_tokens: dim must be a dim of t (shape {tuple(t.shape)}), got {dim}")
    transport_id = _transport_id(transport, group, names=("portable",))
    if transport_size(transport, group) == 1:
        return t
    return all_gather_tokens_op(t, transport_id, dim % t.dim())


@checked_api
def replicated_rows(t: torch.Tensor, start: int, block: int, blocks: int, *, group=None,
                    transport=None) -> torch.Tensor:
    """``t`` (a copy, differentiable) whose rows ``start:`` hold block ``block`` of ``blocks``,
    the same rows on every rank of ``group`` (default: the default group) that holds that block:
    in the backward their gradient is summed over those ranks (one fp32 all-reduce over the group
    of a ``[blocks, rows, ...]`` buffer); rows ``:start`` keep this rank's gradient."""
    check_tensor("t", t)
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension (its rows), got a scalar")
    check_int("start", start, min_value=0, max_value=t.shape[0])
    check_int("blocks", blocks, min_value=1)
    check_int("block", block, min_value=0, max_value=blocks - 1)
    return replicated_rows_op(t, transport_id_of(transport, group), start, block, blocks)
