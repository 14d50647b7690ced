"""Tensor-parallel linear layers and MLP over the overlapped ops of :mod:`fusedpar.ops.tensor_parallel`.

* :class:`ColumnParallelLinear` holds a block of rows of the full ``[out, in]`` weight.
  ``sequence_parallel=True``: input ``[batch, seq/tp, in]`` -> :func:`all_gather_matmul` ->
  ``[batch, seq, out/tp]``. ``False``: replicated input ``[batch, seq, in]``, local GEMM, input
  gradient all-reduced (Megatron's "copy to tensor-parallel region").
* :class:`RowParallelLinear` holds a block of columns. ``sequence_parallel=True``: input
  ``[batch, seq, in/tp]`` -> :func:`matmul_reduce_scatter` -> ``[batch, seq/tp, out]``. ``False``:
  :func:`matmul_all_reduce` -> replicated ``[batch, seq, out]``.
* :class:`ParallelMLP`: column-parallel up projection with the activation (gated or not) fused in
  its GEMM epilogue, row-parallel down projection.

``fp8="rowwise"`` / ``"blockwise"`` (constructor, or :func:`enable_fp8` on a module tree) runs a
layer's GEMMs, forward and backward, in fp8 through the same ops (``fp8=`` of
:mod:`fusedpar.ops.tensor_parallel`): a compute format only, the parameters, their placements,
``state_dict`` and checkpoints are those of the high-precision layer.

The full weight is initialised like ``nn.Linear`` (same RNG draws, then sliced), so a given torch
seed gives the same full model at every tensor-parallel degree. How each parameter is split is
declared once, in :meth:`placements` (:mod:`fusedpar.nn.placement`); the constructor, ``from_linear``,
:func:`merge_shards`, checkpoints, the gradient sync plan and ``fusedpar.hf`` all slice and
reassemble through it. ``state_dict`` holds the local shard plus extra state (``tp_rank``,
``tp_size``, ``partition_dim``, ``full_shape``, ``gated``, ``sections``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fusedpar.kernels.checks import check_bool, check_choice, check_divisible, check_int
from fusedpar.kernels.fp8 import check_fp8_device
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.runtime import ACTIVATIONS
from fusedpar.ops import comm
from fusedpar.nn.placement import Placement
from fusedpar.ops.tensor_parallel.api import (
    all_gather_matmul,
    copy_to_tp_matmul,
    gather_features,
    matmul_all_reduce,
    matmul_reduce_scatter,
    scatter_features,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "enable_fp8", "encode_shard_meta", "shard_meta"]

#: where a model's fp8 switch lives, as an fp8 error names it
FP8_OPTION = "TransformerConfig.fp8 or the fp8= of the fusedpar.nn linear layers"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _tp(group):
    group = comm.resolve_group(group)
    return group, comm.group_size(group), comm.group_rank(group)


def _check_features(cls, name, value, size):
    check_int(f"{cls}: {name}", value, min_value=1)
    check_divisible(f"{cls}: {name}", value, size, "the tensor-parallel group size")


def _check_sections(cls, sections, out_features, size, gated):
    """``sections`` of a column-parallel weight's rows: ``None`` (one section, or ``[gate; up]``
    when gated) or positive sizes adding up to ``out_features``, each divisible by ``size``."""
    if sections is None:
        return 1
    if gated:
        raise ValueError(f"{cls}: sections must be None with a gated activation (its rows are [gate; up]), "
                         f"got {sections!r}")
    if not isinstance(sections, (tuple, list)) or not sections or any(
            isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sections):
        raise ValueError(f"{cls}: sections must be a tuple of positive ints, got {sections!r}")
    if sum(sections) != out_features:
        raise ValueError(f"{cls}: sections must add up to out_features={out_features}, got {tuple(sections)}")
    for s in sections:
        check_divisible(f"{cls}: every section of sections={tuple(sections)}", s, size,
                        "the tensor-parallel group size")
    return tuple(sections)


def _check_replicas(cls, replicas, sections, size):
    """``replicas`` of the ``sections`` (None: none), one positive int per section dividing ``size``
    (1 everywhere, or a group of one rank: None)."""
    if replicas is None:
        return None
    if isinstance(sections, int) or not isinstance(replicas, (tuple, list)) or len(replicas) != len(sections) or any(
            isinstance(f, bool) or not isinstance(f, int) or f <= 0 or size % f for f in replicas):
        raise ValueError(f"{cls}: replicas must be one positive int per section dividing the tensor-parallel group "
                         f"size {size}, got replicas={replicas!r} for sections={sections!r}")
    return tuple(replicas) if size > 1 and max(replicas) > 1 else None


def _full_linear_init(out_features, in_features, bias, device=None):
    """The draws of ``nn.Linear.reset_parameters`` for the full layer (fp32, CPU, global RNG).
    On the meta device nothing is drawn (no values exist there)."""
    if device is not None and torch.device(device).type == "meta":
        w = torch.empty(out_features, in_features, device="meta")
        return w, (torch.empty(out_features, device="meta") if bias else None)
    w = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features).uniform_(-bound, bound)
    return w, b


def enable_fp8(module: nn.Module, recipe: str | None, *, grad_high_precision: bool = False,
               option: str = FP8_OPTION) -> nn.Module:
    """Run every :class:`ColumnParallelLinear` / :class:`RowParallelLinear` in ``module`` (itself
    included) with fp8 GEMMs, and every MoE layer's experts (a module with ``set_fp8``,
    :class:`fusedpar.nn.MoE`), ``recipe`` ``"rowwise"`` or ``"blockwise"``, or in high precision
    again with ``None``: what ``TransformerConfig(fp8=...)`` switches. ``option`` names the setting
    in errors (e.g. a GPU without fp8 tensor cores, checked here for parameters on a GPU and again
    in every forward). Returns ``module``."""
    check_choice("enable_fp8: recipe", recipe, (None,) + tuple(FP8_RECIPES))
    check_bool("enable_fp8: grad_high_precision", grad_high_precision)
    for m in module.modules():
        if isinstance(m, _TPLinearBase):
            m.fp8, m.fp8_grad_high_precision, m.fp8_option = recipe, grad_high_precision, option
            m.check_fp8_device(m.weight)
        elif callable(getattr(m, "set_fp8", None)):  # MoE experts (nn/moe.py imports this module)
            m.set_fp8(recipe, grad_high_precision=grad_high_precision, option=option)
    return module


def check_module_fp8_device(module: nn.Module, t: torch.Tensor) -> None:
    """With ``module.fp8`` on, ``FP8UnsupportedError`` naming the device and the option
    (``module.fp8_option``) when ``t`` is on a GPU without fp8 tensor cores (CPU tensors run
    interpreted, meta ones hold no data). The check of every module with an ``fp8`` setting."""
    if module.fp8 is not None and t.device.type == "cuda":
        check_fp8_device(t, option=f"fp8={module.fp8!r} ({module.fp8_option})")


class _TPLinearBase(nn.Module):
    fp8, fp8_grad_high_precision, fp8_option = None, False, FP8_OPTION

    def _set_fp8(self, fp8, fp8_grad_high_precision):
        name = type(self).__name__
        check_choice(f"{name}: fp8", fp8, (None,) + tuple(FP8_RECIPES))
        self.fp8, self.fp8_grad_high_precision = fp8, check_bool(f"{name}: fp8_grad_high_precision",
                                                                 fp8_grad_high_precision)
        self.check_fp8_device(self.weight)

    def check_fp8_device(self, t: torch.Tensor) -> None:
        """:func:`check_module_fp8_device` of this layer."""
        check_module_fp8_device(self, t)

    def _fp8_kwargs(self, x) -> dict:
        self.check_fp8_device(x)
        return dict(fp8=self.fp8, fp8_grad_high_precision=self.fp8_grad_high_precision)

    def _fp8_repr(self) -> str:
        return "" if self.fp8 is None else f", fp8={self.fp8!r}, fp8_grad_high_precision={self.fp8_grad_high_precision}"

    def placements(self) -> dict[str, Placement]:
        """``weight`` by :meth:`weight_placement`, ``bias`` by :meth:`bias_placement`."""
        return {"weight": self.weight_placement(), **({"bias": self.bias_placement()} if self.bias is not None else {})}

    def _meta(self):
        w = self.weight_placement()
        rows = self.out_features_full * (2 if self.gated else 1)
        return {
            "tp_rank": self.tp_rank, "tp_size": self.tp_size, "partition_dim": w.dim,
            "full_shape": [rows, self.in_features], "gated": self.gated,
            "sections": w.full_sections((rows, self.in_features)[w.dim], self.tp_size),
            "bias_split": self.bias_placement().role is not None,
            "replicas": list(w.replicas) if w.replicas is not None else None,
        }

    def get_extra_state(self):
        """The layout as an int64 tensor (a tensor, so that tools which expect every state-dict
        entry to be a tensor, e.g. Hugging Face ``save_pretrained``, accept it); see
        :func:`shard_meta` to read it."""
        return encode_shard_meta(self._meta())

    def set_extra_state(self, state):
        mine = self._meta()
        if not isinstance(state, (dict, torch.Tensor)):
            raise TypeError(f"{type(self).__name__}: extra state must be a dict or an int64 tensor, got "
                            f"{type(state).__name__}")
        state = shard_meta(state)
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs module {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{type(self).__name__}: the checkpoint shard does not belong to this rank/layout ({detail}); "
                "reassemble the full weight with merge_shards() and re-shard it with from_linear()"
            )

    def _set_params(self, weight, bias, device, dtype):
        # Own, contiguous storage: a shard that stayed a view of the full weight would keep the
        # whole full tensor alive (and a column block would be strided).
        self.weight = nn.Parameter(_own_copy(weight, device, dtype))
        if bias is not None:
            self.bias = nn.Parameter(_own_copy(bias, device, dtype))
        else:
            self.register_parameter("bias", None)


def encode_shard_meta(meta: dict) -> torch.Tensor:
    """``{tp_rank, tp_size, partition_dim, full_shape, gated, bias_split, sections, replicas}`` as
    an int64 tensor: the first four fields (5 values), ``gated + 2 * bias_split + 4 * (replicas
    given)``, then the full sizes of the sections along ``partition_dim``, then (when given) the
    replicas of each section (:class:`~fusedpar.nn.Placement`)."""
    rows, cols = meta["full_shape"]
    replicas = meta.get("replicas")
    flags = int(meta["gated"]) + 2 * int(meta["bias_split"]) + 4 * int(replicas is not None)
    head = [meta["tp_rank"], meta["tp_size"], meta["partition_dim"], rows, cols, flags]
    tail = [int(f) for f in replicas] if replicas is not None else []
    return torch.tensor(head + [int(s) for s in meta["sections"]] + tail, dtype=torch.int64)


def shard_meta(state) -> dict:
    """The layout dict of a Column/RowParallelLinear's ``_extra_state`` (the tensor it saves, or a
    dict as saved by earlier versions; a 6-value tensor of an earlier version has no sections and
    no ``bias_split``: they follow from ``gated`` and the split dim, as those versions laid them out)."""
    if isinstance(state, dict):
        meta = dict(state)
    elif isinstance(state, torch.Tensor) and state.dim() == 1 and state.numel() >= 6:
        v = [int(x) for x in state.tolist()]
        meta = {"tp_rank": v[0], "tp_size": v[1], "partition_dim": v[2], "full_shape": [v[3], v[4]],
                "gated": bool(v[5] & 1)}
        if len(v) > 6:
            n = (len(v) - 6) // 2 if v[5] & 4 else len(v) - 6
            meta["sections"], meta["bias_split"] = v[6:6 + n], bool(v[5] & 2)
            meta["replicas"] = v[6 + n:] if v[5] & 4 else None
    else:
        raise ValueError(f"_extra_state must be an int64 tensor of at least 6 values or a dict, got {state!r}")
    if "sections" not in meta:
        n = meta["full_shape"][meta["partition_dim"]]
        meta["sections"] = [n // 2] * 2 if meta["gated"] and meta["partition_dim"] == 0 else [n]
    meta.setdefault("bias_split", meta["partition_dim"] == 0)
    meta.setdefault("replicas", None)
    return meta


def _own_copy(t, device, dtype):
    return t.to(device=device, dtype=dtype).clone(memory_format=torch.contiguous_format)


def merge_shards(state_dicts, prefix=""):
    """Reassemble ``{"weight": full, "bias": full or None}`` from every rank's ``state_dict`` of one
    Column/RowParallelLinear (any order), by the placement its extra state records."""
    metas = [shard_meta(sd[prefix + "_extra_state"]) for sd in state_dicts]
    size = metas[0]["tp_size"]
    if sorted(m["tp_rank"] for m in metas) != list(range(size)):
        raise ValueError(f"merge_shards: need one state dict per rank 0..{size - 1}, got ranks "
                         f"{sorted(m['tp_rank'] for m in metas)}")
    order = sorted(range(len(metas)), key=lambda i: metas[i]["tp_rank"])
    dim = metas[0]["partition_dim"]
    placement = Placement("tp", None, dim, tuple(metas[0]["sections"]), replicas=metas[0]["replicas"])
    weight = placement.full_from_locals([state_dicts[i][prefix + "weight"] for i in order])
    bs = [state_dicts[i].get(prefix + "bias") for i in order]
    bias = None
    if bs[0] is not None:  # split like the weight's rows, or whole on every rank (its bias_placement)
        bias = placement.full_from_locals(bs) if metas[0]["bias_split"] else bs[0]
    if list(weight.shape) != list(metas[0]["full_shape"]):
        raise ValueError(
            f"merge_shards: reassembled weight {tuple(weight.shape)} != full_shape {metas[0]['full_shape']}"
        )
    return {"weight": weight, "bias": bias}


# ----------------------------------------------------------------------------------------------
# ColumnParallelLinear
# ----------------------------------------------------------------------------------------------
class ColumnParallelLinear(_TPLinearBase):
    """``y = act(x @ W^T + b)`` with ``W``'s rows (output features) split over the group.

    ``sequence_parallel=True``: ``x`` is this rank's sequence shard (``[batch, seq/tp, in]``, split
    along ``sequence_dim``); the all-gather is overlapped with the GEMM. ``False``: ``x`` is
    replicated; its gradient is all-reduced in the backward. Output ``[batch, seq, out/tp]``, or
    ``[batch, seq, out]`` with ``gather_output=True``. ``activation`` (a keyword extension) is fused
    into the GEMM epilogue; gated ones (``swiglu``/``geglu``) hold ``[gate shard; up shard]`` rows
    and produce ``out_features`` (= F) features. ``fp8``: ``None``, ``"rowwise"`` or
    ``"blockwise"``, the GEMMs in fp8 (``fp8_grad_high_precision``: the weight gradient in the
    input's dtype), see the module docstring.
    """

    def __init__(self, in_features, out_features, bias=True, *, group=None, sequence_parallel=True,
                 gather_output=False, device=None, dtype=None, activation="none", sequence_dim=1,
                 save_gathered_input=True, sections=None, replicas=None, fp8=None, fp8_grad_high_precision=False):
        super().__init__()
        name = type(self).__name__
        check_choice(f"{name}: activation", activation, ACTIVATIONS)
        self.group, self.tp_size, self.tp_rank = _tp(group)
        _check_features(name, "in_features", in_features, 1)
        _check_features(name, "out_features", out_features, self.tp_size)
        self.in_features, self.out_features_full = in_features, out_features
        self.activation = activation
        self.gated = ACTIVATIONS[activation][1]
        self.sections = _check_sections(name, sections, out_features, self.tp_size, self.gated)
        self.replicas = _check_replicas(name, replicas, self.sections, self.tp_size)
        self.out_features = out_features  # the full layer's, as nn.Linear reports it
        self.out_features_local = out_features // self.tp_size if self.replicas is None else \
            sum(sec * f // self.tp_size for sec, f in zip(self.sections, self.replicas))
        self.sequence_parallel, self.gather_output = bool(sequence_parallel), bool(gather_output)
        self.sequence_dim, self.save_gathered_input = sequence_dim, bool(save_gathered_input)
        rows = 2 * out_features if self.gated else out_features
        w, b = _full_linear_init(rows, in_features, bias, device)
        self._set_params(*self._shard(w, b), device, dtype)
        self._set_fp8(fp8, fp8_grad_high_precision)

    def weight_placement(self) -> Placement:
        """Rows over the group, section by section: ``[gate; up]`` when gated, the given
        ``sections`` (e.g. ``[q; k; v]``), else one; ``replicas``: per section, how many
        consecutive ranks hold the same block (kv heads replicated over tp)."""
        return Placement.tp(self.group, 0, 2 if self.gated else self.sections, self.replicas)

    def bias_placement(self) -> Placement:
        """Split like the rows."""
        return self.weight_placement()

    def _shard(self, weight, bias):
        w = self.weight_placement()
        return w.local_from_full(weight), None if bias is None else w.local_from_full(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, sequence_parallel: bool = False, **kwargs):
        """Shard an existing ``nn.Linear`` (its rows, section by section: ``[gate; up]`` halves
        when ``activation`` is gated, ``sections=`` when given). Keyword options as in the
        constructor, except that ``sequence_parallel`` defaults to False here: a drop-in
        replacement sees the same replicated ``[batch, seq, in]`` input as the ``nn.Linear`` did."""
        gated = ACTIVATIONS.get(kwargs.get("activation", "none"), (0, False))[1]
        if gated and linear.out_features % 2:
            raise ValueError(f"{cls.__name__}.from_linear: a gated activation needs an even out_features "
                             f"(gate rows then up rows), got {linear.out_features}")
        out_features = linear.out_features // 2 if gated else linear.out_features
        mod = cls(linear.in_features, out_features, linear.bias is not None, group=group,
                  sequence_parallel=sequence_parallel, device="meta", dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            mod._set_params(*mod._shard(linear.weight.detach(), None if linear.bias is None else linear.bias.detach()),
                            linear.weight.device, linear.weight.dtype)
        return mod

    def forward(self, x, *, x_fp8=None, return_fp8=False):
        """``x_fp8``: with ``fp8`` on and ``sequence_parallel``, ``x`` already quantised per token in
        the recipe's activation granularity, ``(q, scale)`` (e.g. by the RMSNorm that produced it,
        ``RMSNorm(..., fp8=recipe)``), used instead of quantising ``x`` again
        (:func:`all_gather_matmul`'s ``x_fp8``; the same result). ``return_fp8``: with
        ``fp8="blockwise"`` and ``gather_output=False``, return ``(y, (q, scale))``, ``y``
        quantised per 1x128 tile by the GEMM epilogue (the ``x_fp8`` of a
        :class:`RowParallelLinear`)."""
        fp8 = self._fp8_kwargs(x)
        name = type(self).__name__
        if x_fp8 is not None and not self.sequence_parallel:
            raise ValueError(f"{name}: x_fp8 is taken with sequence_parallel=True (the all-gather "
                             "GEMM), got one with sequence_parallel=False")
        check_bool(f"{name}: return_fp8", return_fp8)
        if return_fp8 and self.gather_output:
            raise ValueError(f"{name}: return_fp8=True needs gather_output=False (the tiles of this rank's "
                             "features), got gather_output=True")
        if self.sequence_parallel:
            y = all_gather_matmul(x, self.weight, self.bias, group=self.group, gather_dim=self.sequence_dim,
                                  activation=self.activation, save_gathered_input=self.save_gathered_input,
                                  x_fp8=x_fp8, return_fp8=return_fp8, **fp8)
        else:
            y = copy_to_tp_matmul(x, self.weight, self.bias, group=self.group, activation=self.activation,
                                  return_fp8=return_fp8, **fp8)
        if self.gather_output:
            y = gather_features(y, self.group)
        return y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.out_features_local}), bias={self.bias is not None}, activation={self.activation!r}, "
                f"tp={self.tp_rank}/{self.tp_size}, sequence_parallel={self.sequence_parallel}, "
                f"gather_output={self.gather_output}{self._fp8_repr()}")


# ----------------------------------------------------------------------------------------------
# RowParallelLinear
# ----------------------------------------------------------------------------------------------
class RowParallelLinear(_TPLinearBase):
    """``y = x @ W^T + b`` with ``W``'s columns (input features) split over the group.

    ``input_is_parallel=True``: ``x`` is ``[batch, seq, in/tp]`` (the output of a column layer);
    ``False``: ``x`` is replicated ``[batch, seq, in]`` and this rank keeps its slice.
    ``sequence_parallel=True``: output ``[batch, seq/tp, out]`` via the fused GEMM + reduce-scatter;
    ``False``: replicated ``[batch, seq, out]`` via the chunked GEMM + all-reduce. The bias is
    replicated and added once; its gradient is the full one (the group's tokens) on every rank.
    ``fp8``, ``fp8_grad_high_precision``: as in :class:`ColumnParallelLinear`.
    """

    gated = False

    def __init__(self, in_features, out_features, bias=True, *, group=None, sequence_parallel=True,
                 input_is_parallel=True, device=None, dtype=None, sequence_dim=1, fp8=None,
                 fp8_grad_high_precision=False):
        super().__init__()
        name = type(self).__name__
        self.group, self.tp_size, self.tp_rank = _tp(group)
        _check_features(name, "in_features", in_features, self.tp_size)
        _check_features(name, "out_features", out_features, 1)
        self.in_features, self.out_features_full = in_features, out_features
        self.out_features = out_features
        self.in_features_local = in_features // self.tp_size
        self.sequence_parallel, self.input_is_parallel = bool(sequence_parallel), bool(input_is_parallel)
        self.sequence_dim = sequence_dim
        w, b = _full_linear_init(out_features, in_features, bias, device)
        self._set_params(self.weight_placement().local_from_full(w), b, device, dtype)
        self._set_fp8(fp8, fp8_grad_high_precision)

    def weight_placement(self) -> Placement:
        """Columns (input features) over the group."""
        return Placement.tp(self.group, 1)

    def bias_placement(self) -> Placement:
        """Whole on every rank, added once after the reduction. Its gradient is whole over the tp
        group's tokens on every rank (kind "dense", nothing to sum over tp): the reduce-scatter's
        backward all-gathers the output gradient and every rank sums every chunk; the all-reduce's
        output gradient is replicated."""
        return Placement.replicated(sequence_sharded=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, sequence_parallel: bool = False, **kwargs):
        """Shard an existing ``nn.Linear`` by columns (the bias stays whole). Keyword options as in
        the constructor, except that ``sequence_parallel`` defaults to False here (replicated
        ``[batch, seq, out]`` output, as the ``nn.Linear`` gave)."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                  sequence_parallel=sequence_parallel, device="meta", dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            mod._set_params(mod.weight_placement().local_from_full(linear.weight.detach()),
                            None if linear.bias is None else linear.bias.detach(),
                            linear.weight.device, linear.weight.dtype)
        return mod

    def forward(self, x, *, x_fp8=None):
        """``x_fp8``: with ``fp8`` on and ``input_is_parallel``, ``x`` already quantised per token
        along this rank's in-features, ``(q, scale)`` (the ``return_fp8`` output of the
        :class:`ColumnParallelLinear` or the attention before it), used instead of quantising ``x``
        again (:func:`matmul_reduce_scatter`'s ``x_fp8``)."""
        if x_fp8 is not None and not self.input_is_parallel and self.tp_size > 1:
            raise ValueError(f"{type(self).__name__}: x_fp8 is taken with input_is_parallel=True (x is this rank's "
                             "in-features), got one with input_is_parallel=False")
        if not self.input_is_parallel and self.tp_size > 1:
            if not isinstance(x, torch.Tensor) or x.shape[-1] != self.in_features:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{type(self).__name__}: with input_is_parallel=False x must have "
                                 f"{self.in_features} features in its last dim, got {shape}")
            x = scatter_features(x, self.group)
        fp8 = dict(self._fp8_kwargs(x), x_fp8=x_fp8)
        if self.sequence_parallel:
            return matmul_reduce_scatter(x, self.weight, self.bias, group=self.group, scatter_dim=self.sequence_dim,
                                         **fp8)
        return matmul_all_reduce(x, self.weight, self.bias, group=self.group, **fp8)

    def extra_repr(self):
        return (f"in_features={self.in_features} (local {self.in_features_local}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, input_is_parallel={self.input_is_parallel}"
                f"{self._fp8_repr()}")


# ----------------------------------------------------------------------------------------------
# ParallelMLP
# ----------------------------------------------------------------------------------------------
class ParallelMLP(nn.Module):
    """``down(act(up(x)))``: ``fc1`` a :class:`ColumnParallelLinear` with the activation in its GEMM
    epilogue (gated: one GEMM over ``[gate shard; up shard]`` rows), ``fc2`` a
    :class:`RowParallelLinear`. Sequence parallel: ``[batch, seq/tp, hidden]`` in and out;
    otherwise replicated ``[batch, seq, hidden]`` in and out. ``fp8``, ``fp8_grad_high_precision``:
    both layers' (:class:`ColumnParallelLinear`)."""

    def __init__(self, hidden_size, ffn_hidden_size, *, activation="swiglu", group=None, sequence_parallel=True,
                 bias=False, device=None, dtype=None, save_gathered_input=True, fp8=None,
                 fp8_grad_high_precision=False):
        super().__init__()
        fp8 = dict(fp8=fp8, fp8_grad_high_precision=fp8_grad_high_precision)
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, group=group,
                                        sequence_parallel=sequence_parallel, device=device, dtype=dtype,
                                        activation=activation, save_gathered_input=save_gathered_input, **fp8)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias, group=group,
                                     sequence_parallel=sequence_parallel, input_is_parallel=True,
                                     device=device, dtype=dtype, **fp8)
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation

    def forward(self, x, *, x_fp8=None):
        """``x_fp8``: ``x`` already quantised for ``fc1`` (:meth:`ColumnParallelLinear.forward`).
        With both layers in blockwise fp8, ``fc1``'s epilogue quantises its activated output per
        1x128 tile and hands it to ``fc2`` (``return_fp8`` / ``x_fp8``: the same bits as ``fc2``
        quantising it, one pass fewer)."""
        if self._fp8_handoff():
            h, h_fp8 = self.fc1(x, x_fp8=x_fp8, return_fp8=True)
            return self.fc2(h, x_fp8=h_fp8)
        return self.fc2(self.fc1(x, x_fp8=x_fp8))

    def _fp8_handoff(self) -> bool:
        """Whether ``fc1``'s epilogue quantises its output for ``fc2`` (both blockwise fp8)."""
        return self.fc1.fp8 == "blockwise" and self.fc2.fp8 == "blockwise"

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}"
