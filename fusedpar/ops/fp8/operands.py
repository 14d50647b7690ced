"""Quantised operands that the tensor-parallel schedules slice and move like tensors.

:class:`Fp8Rows` (e4m3 rows with their fp32 scales, per token or per 1x128 tile; chunks of rows
are views), :class:`Fp8Weight` (a quantised weight that carries its own GEMM, ``gemm(a, out, bias,
residual)``, so the bf16 schedules run it unchanged), :class:`Fp8WeightGrad` (the weight gradient's
operands quantised along the token axis) and :class:`Fp8Pack` (rows and scales in one byte buffer,
what a ring transfer sends); :func:`check_fp8_rows` validates a caller's ``x_fp8``."""
from __future__ import annotations

import math

import torch

from fusedpar.kernels import fp8_matmul, matmul_tn, quantize_e4m3
from fusedpar.kernels.fp8 import scale_shape
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.ops.tensor_parallel.schedules import sum_tokens


# ----------------------------------------------------------------------------------------------
# fp8 operands of the tensor-parallel schedules
# ----------------------------------------------------------------------------------------------
def _quantised_shapes(lead: tuple, K: int, granularity: str) -> tuple[tuple, tuple]:
    """``(q shape, scale shape)`` of a ``[*lead, K]`` activation quantised per token."""
    rows = math.prod(lead)
    return lead + (K,), lead + scale_shape(rows, K, granularity)[1:]


def check_fp8_rows(op: str, name: str, rows, x: torch.Tensor, recipe: str) -> None:
    """``rows``: ``x`` already quantised per token in ``recipe``'s activation granularity, a pair
    ``(q, scale)`` of the shapes, dtypes and device :meth:`Fp8Rows.of` gives (``q`` e4m3 of
    ``x``'s shape, ``scale`` fp32 ``x.shape[:-1]`` for rowwise, ``x.shape[:-1] + (ceil(K/128),)``
    for blockwise), e.g. the fp8 output of :func:`~fusedpar.ops.rms_norm_fp8`. Errors name ``op``
    and ``name``; the values themselves are the caller's promise (they are not compared with ``x``)."""
    if not (isinstance(rows, (tuple, list)) and len(rows) == 2 and all(isinstance(t, torch.Tensor) for t in rows)):
        raise TypeError(f"{op}: {name} must be None or a pair (q, scale) of tensors, got {type(rows).__name__}")
    lead, K = tuple(x.shape[:-1]), x.shape[-1]
    want = _quantised_shapes(lead, K, FP8_RECIPES[recipe][0])
    for (part, dtype), t, shape in zip(((f"{name}[0] (q)", torch.float8_e4m3fn), (f"{name}[1] (scale)", torch.float32)),
                                       rows, want):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{op}: {part} must be {dtype} of shape {shape} (x of shape {tuple(x.shape)} quantised "
                             f"for fp8={recipe!r}), got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{op}: {part} must be on x's device {x.device}, got {t.device}")


class Fp8Rows:
    """An activation quantised per token (``q``: ``[*lead, K]`` e4m3, ``scale``: ``lead`` for
    rowwise, ``[*lead, ceil(K/128)]`` for blockwise): a chunk operand of the schedules of
    :mod:`fusedpar.ops.tensor_parallel.schedules`, which slice it along its token dims like a
    tensor. ``dtype``: the high-precision dtype of the products it feeds."""

    __slots__ = ("q", "scale", "dtype")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q, self.scale, self.dtype = q, scale, dtype

    @classmethod
    def of(cls, x: torch.Tensor, recipe: str, out=None) -> "Fp8Rows":
        """``x`` (``[..., K]``) quantised per token, once (``out``: buffers of :func:`quantize_e4m3`)."""
        K = x.shape[-1]
        q, s = quantize_e4m3(x.reshape(-1, K), FP8_RECIPES[recipe][0], out=out)
        q_shape, s_shape = _quantised_shapes(tuple(x.shape[:-1]), K, FP8_RECIPES[recipe][0])
        return cls(q.view(q_shape), s.view(s_shape), x.dtype)

    shape = property(lambda self: self.q.shape)
    device = property(lambda self: self.q.device)

    def dim(self) -> int:
        return self.q.dim()

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Rows":
        """The tokens ``start:start + length`` of the token dim ``dim`` (a view)."""
        return Fp8Rows(self.q.narrow(dim, start, length), self.scale.narrow(dim, start, length), self.dtype)

    def reshape(self, *shape) -> "Fp8Rows":
        """The tokens as ``shape[:-1]`` (views of a contiguous quantisation)."""
        lead = tuple(shape[:-1])
        return Fp8Rows(self.q.reshape(*shape), self.scale.reshape(lead + tuple(self.scale.shape[self.q.dim() - 1:])),
                       self.dtype)

    def __getitem__(self, index) -> "Fp8Rows":
        """Rows ``index`` (a slice or an int) of the first dim."""
        return Fp8Rows(self.q[index], self.scale[index], self.dtype)


class Fp8Weight:
    """A weight quantised once for the GEMMs of one op (per output row / 128x128 blocks), as the
    ``B [N, K]`` of :func:`fp8_matmul`: ``W`` itself (``layout="nk"``: the forward) or ``W^T``
    (``"kn"``: the data gradient, scaled along ``W``'s rows, its contraction, read from the
    transposed view in place). :meth:`gemm` is the chunk GEMM of the schedules."""

    def __init__(self, weight: torch.Tensor, recipe: str, layout: str = "nk"):
        self.recipe = recipe
        self.q, self.scale = quantize_e4m3(weight if layout == "nk" else weight.t(), FP8_RECIPES[recipe][1])

    shape = property(lambda self: self.q.shape)

    def gemm(self, a: Fp8Rows, out: torch.Tensor, bias=None, residual=None, **epilogue) -> torch.Tensor:
        """``out = act(a @ W^T + bias) (+ residual)``; ``epilogue``: :func:`fp8_matmul`'s
        ``activation`` / ``preact_out`` / ``fp8_out``."""
        return fp8_matmul(a.q, a.scale, self.q, self.scale, bias, scaling=self.recipe, out=out, residual=residual,
                          **epilogue)


class Fp8WeightGrad:
    """``dW = sum over chunks c of dY_c^T x_c`` accumulated in fp32: each chunk's product an fp8
    GEMM of ``dY_c^T`` and ``x_c^T`` quantised along the chunk's tokens (per feature, or 1x128
    tiles of tokens), or with ``grad_high_precision`` ``matmul_tn`` in the operands' dtype."""

    def __init__(self, weight: torch.Tensor, recipe: str, grad_high_precision: bool):
        self.recipe, self.hp, self.dtype = recipe, grad_high_precision, weight.dtype
        self.acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        self.first = True

    def add(self, grad_t, x_t) -> None:
        """``grad_t`` / ``x_t``: the chunk's ``(q, scale)`` of ``dY_c^T`` / ``x_c^T`` (see
        :func:`token_scaled`); with ``grad_high_precision`` the chunks ``dY_c`` / ``x_c`` themselves."""
        if self.hp:
            matmul_tn(grad_t, x_t, out=self.acc, accumulate=not self.first)
        else:
            fp8_matmul(*grad_t, *x_t, scaling=self.recipe, out=self.acc, residual=None if self.first else self.acc)
        self.first = False

    def result(self) -> torch.Tensor:
        return self.acc.to(self.dtype)


def token_scaled(t: torch.Tensor, recipe: str, out=None):
    """``(q, scale)`` of ``t^T`` (``t``: ``[..., F]``, its tokens flattened): scaled along the
    tokens, the contraction of a weight gradient (a strided chunk is copied first)."""
    t2 = t.reshape(-1, t.shape[-1])
    return quantize_e4m3(t2.t(), FP8_RECIPES[recipe][0], out=out)


class Fp8Pack:
    """The bytes one rank's chunk travels as: named segments in one uint8 buffer (each 16-byte
    aligned, fp32 first), so that a ring moves one buffer per step. Segments of a ``[*lead, F]``
    activation (:meth:`activation`): ``"a"`` its per-token quantisation (``q`` and ``scale``, the
    GEMM operand), ``"t"`` the weight-gradient operand (``q``/``scale`` of its transpose scaled
    along the tokens, or the tensor itself in its dtype with ``grad_high_precision``), ``"db"`` an
    fp32 vector (a partial bias gradient)."""

    def __init__(self, segments):
        self.layout, self.pads, off = {}, [], 0
        for name, shape, dtype in sorted(segments, key=lambda s: -s[2].itemsize):
            self.layout[name] = (off, tuple(shape), dtype)
            end = off + math.prod(shape) * dtype.itemsize
            off = max(-(-end // 16) * 16, 16)
            self.pads.append((end, off))  # the alignment padding: zeroed, so that the bytes are defined
        self.nbytes = max(off, 16)

    @classmethod
    def activation(cls, lead: tuple, F: int, dtype, recipe: str, *, rows: bool, wgrad: str | None,
                   bias_grad: bool = False) -> "Fp8Pack":
        """The segments of a ``[*lead, F]`` activation: ``rows`` the GEMM operand, ``wgrad``
        (``"fp8"``, ``"hp"`` or None) the weight-gradient operand, ``bias_grad`` an ``[F]`` sum."""
        act, tokens = FP8_RECIPES[recipe][0], math.prod(lead)
        seg = []
        if rows:
            q_shape, s_shape = _quantised_shapes(lead, F, act)
            seg += [("aq", q_shape, torch.float8_e4m3fn), ("as", s_shape, torch.float32)]
        if wgrad == "fp8":
            seg += [("tq", (F, tokens), torch.float8_e4m3fn), ("ts", scale_shape(F, tokens, act), torch.float32)]
        elif wgrad == "hp":
            seg += [("th", lead + (F,), dtype)]
        if bias_grad:
            seg += [("db", (F,), torch.float32)]
        pack = cls(seg)
        pack.dtype, pack.recipe = dtype, recipe
        return pack

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        off, shape, dtype = self.layout[name]
        return buf[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def fill(self, buf: torch.Tensor, t: torch.Tensor, rows=None) -> torch.Tensor:
        """Write ``t``'s segments into ``buf`` (quantising in place); returns ``buf``. ``rows``:
        ``t``'s per-token ``(q, scale)`` already made (:func:`check_fp8_rows`), copied into the
        ``"a"`` segments instead of quantising ``t`` again."""
        for lo, hi in self.pads:
            if hi > lo:
                buf[lo:hi].zero_()
        if "aq" in self.layout and rows is not None:
            self.view(buf, "aq").copy_(rows[0])
            self.view(buf, "as").copy_(rows[1])
        elif "aq" in self.layout:
            Fp8Rows.of(t, self.recipe, out=(self.view(buf, "aq").view(-1, t.shape[-1]),
                                            self.view(buf, "as").view(-1, *self.layout["as"][1][t.dim() - 1:])))
        if "tq" in self.layout:
            token_scaled(t, self.recipe, out=(self.view(buf, "tq"), self.view(buf, "ts")))
        if "th" in self.layout:
            self.view(buf, "th").copy_(t)
        if "db" in self.layout:
            self.view(buf, "db").copy_(sum_tokens(t))
        return buf

    def rows(self, buf: torch.Tensor) -> Fp8Rows:
        return Fp8Rows(self.view(buf, "aq"), self.view(buf, "as"), self.dtype)

    def wgrad(self, buf: torch.Tensor):
        """The weight-gradient operand: ``(q, scale)`` of the transpose, or the tensor (``"hp"``)."""
        return self.view(buf, "th") if "th" in self.layout else (self.view(buf, "tq"), self.view(buf, "ts"))


def rows_of(x: torch.Tensor, recipe: str, x_fp8) -> Fp8Rows:
    """``x`` quantised per token, or its given quantisation ``x_fp8 = (q, scale)``."""
    return Fp8Rows.of(x, recipe) if x_fp8 is None else Fp8Rows(*x_fp8, x.dtype)
