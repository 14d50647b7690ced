"""The overlap schedules of the tensor-parallel GEMMs, written against a :class:`Transport`.

* :func:`ring_gather` -- every rank's shard, the local one first, the next one in flight while
  the caller computes on the current one (all-gather GEMM forward, re-gathers in backwards).
* :func:`ring_reduce_scatter` -- one partial GEMM per destination chunk; the partial received
  from the left neighbour is added in the GEMM epilogue and the sum travels on to the right.
* :func:`chunked_matmul_all_reduce` -- rows in chunks, chunk ``i`` all-reduced while chunk
  ``i + 1`` is multiplied.

The GEMM of a chunk is ``matmul`` with the weight in its layout, or, for a weight that carries its
own GEMM (an object with a ``gemm(a, out, bias, residual)`` method: :class:`Fp8Weight`, whose
chunks are :class:`Fp8Rows`, quantised activations sliced like tensors), that GEMM: the same
schedules run the fp8 ops of :mod:`fusedpar.ops.fp8_library` (:func:`chunk_gemm`). The fp8
operands and the packed bytes an fp8 chunk travels as (:class:`Fp8Pack`) are defined at the end.

Every transfer is a method of the transport (``ring_shift``, ``all_reduce``); rank and size come
from it, so the same code runs over torch.distributed, symmetric memory (for the ring
re-gathers) and the single-process emulation. A handle is waited on right before the chunk it
delivers is used.

Under :class:`~fusedpar.ops.transport.EmulatedTransport` (every peer mirrors this rank):
``ring_gather`` yields ``size`` copies of ``x``; ``ring_reduce_scatter`` writes the sum over
every chunk ``c`` of ``a_chunk(c) @ W`` (plus bias), because the partial received at each step
is the one this rank sent; ``chunked_matmul_all_reduce`` returns ``size`` times the local
product (the bias counted on rank 0 only).
"""
from __future__ import annotations

import math

import torch

from fusedpar.kernels import fp8_matmul, matmul, matmul_tn, quantize_e4m3
from fusedpar.kernels.gemm import linear_operands, matmul_checked
from fusedpar.kernels.fp8 import scale_shape
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.kernels.checks import check_choice, check_same, check_shape, check_tensor
from fusedpar.kernels.runtime import ACTIVATIONS, SUPPORTED_DTYPES, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from fusedpar.ops.transport import Transport

__all__ = [
    "ring_gather", "ring_reduce_scatter", "chunked_matmul_all_reduce", "activation_backward",
    "chunk_gemm", "sum_tokens", "WeightGrad", "check_linear_args", "Fp8Rows", "Fp8Weight", "Fp8WeightGrad", "Fp8Pack",
    "token_scaled", "check_fp8_rows",
]


def ring_gather(x: torch.Tensor, transport: Transport, into: torch.Tensor | None = None):
    """Yield ``(src_rank, chunk)`` for every rank's ``x``, the local one first.

    The transfer of the next chunk is posted before the current one is yielded (so it is in flight
    while the caller computes) and waited on only when the caller asks for it. Receive buffers are
    double-buffered, or with ``into`` (a ``[P, *x.shape]`` tensor) every chunk lands in its source
    rank's slot ``into[src]`` (the local one copied there first), so that the caller may hold on to
    every chunk (the gathered input kept for the weight gradient).
    """
    P, r = transport.size, transport.rank
    if into is not None:
        cur = into[r]
        if (cur.data_ptr(), cur.stride()) != (x.data_ptr(), x.stride()):  # (a caller may have written its slot)
            cur.copy_(x)
    else:
        cur = x.contiguous()
    if P == 1:
        yield r, cur
        return
    bufs = None if into is not None else [torch.empty_like(cur) for _ in range(2)]
    for j in range(P):
        handle = None
        if j + 1 < P:
            nxt = into[(r - j - 1) % P] if into is not None else bufs[(j + 1) % 2]
            handle = transport.ring_shift(cur, nxt)
        yield (r - j) % P, cur
        if handle is not None:
            handle.wait()  # the chunk the caller is about to use next
            cur = nxt


def chunk_gemm(weight, weight_layout: str = "nk"):
    """``gemm(a, out, bias=None, residual=None)``: ``out = a @ W (+ bias) (+ residual)`` with
    ``matmul`` and ``weight`` in ``weight_layout``, or ``weight``'s own ``gemm`` (a quantised fp8
    weight, whose layout it knows).

    The chunks of one schedule share the operand's dtype, device and K, and the schedule makes
    ``out`` and ``residual`` itself: ``matmul`` checks the first GEMM with each bias (and operand
    dtype, device and K), later ones launch through ``matmul_checked`` without the checks (which
    cost more host time than the launch, once per chunk)."""
    if hasattr(weight, "gemm"):
        return weight.gemm
    checked = {}  # (id(bias), dtype, device, K) -> (bias, LinearOperands); holding bias pins its id

    def gemm(a, out, bias=None, residual=None):
        key = (id(bias), a.dtype, a.device, a.shape[-1])
        seen = checked.get(key)
        if seen is None:
            matmul(a, weight, bias, weight_layout=weight_layout, out=out, residual=residual)
            checked[key] = (bias, linear_operands(a, weight, bias, weight_layout=weight_layout))
            return out
        return matmul_checked(a, weight, seen[1], out, residual=residual, weight_layout=weight_layout)

    return gemm


def _split_dim(t):
    return 1 if t.dim() == 3 else 0


def _halves(length):
    """Row ranges of the two sub-chunks of a reduce-scatter step (one when there is one row)."""
    if length < 2:
        return [(0, length)]
    return [(0, length // 2), (length // 2, length)]


def _partial_buffers(shapes, dtype, device):
    """``(send, recv)``: two double-buffered sets of ``shapes`` buffers, views of one allocation
    (one allocator call per op instead of eight)."""
    sizes = [math.prod(s) for s in shapes]
    flat = torch.empty(4 * sum(sizes), dtype=dtype, device=device)
    views, off = [], 0
    for _ in range(4):
        views.append([])
        for shape, n in zip(shapes, sizes):
            views[-1].append(flat[off:off + n].view(shape))
            off += n
    return views[:2], views[2:]


def ring_reduce_scatter(a_chunk, weight, weight_layout, bias, out, transport: Transport, partial_dtype,
                        between=None):
    """``out = sum over ranks q of (a_chunk_q(r) @ W_q) + bias`` where ``r`` is this rank.

    ``a_chunk(c)`` is this rank's operand for destination chunk ``c`` (leading dims = ``out``'s).
    Ring: at step ``j`` rank ``r`` computes the partial of chunk ``(r - j - 1) mod P``, adding in
    the GEMM epilogue the partial that the left neighbour computed for the same chunk at step
    ``j - 1``, and sends the sum (in ``partial_dtype``) to the right neighbour; at the last step
    the chunk is its own and the result (plus bias) is written into ``out``. Each step is split in
    two row halves, so that one half's partial travels while the other half's GEMM runs.
    ``between(j)`` (optional) runs after step ``j`` (independent work that also hides the
    transfers, e.g. a weight gradient).
    """
    P, r = transport.size, transport.rank
    gemm = chunk_gemm(weight, weight_layout)
    if P == 1:
        gemm(a_chunk(r), out, bias)
        if between is not None:
            between(0)
        return out
    sd = _split_dim(out)
    parts = _halves(out.shape[sd])
    shapes = [out.narrow(sd, lo, hi - lo).shape for lo, hi in parts]
    send, recv = _partial_buffers(shapes, partial_dtype, out.device)
    handles = [None] * len(parts)
    for j in range(P):
        a = a_chunk((r - j - 1) % P)
        for h, (lo, hi) in enumerate(parts):
            a_h = a.narrow(sd, lo, hi - lo)
            residual = None
            if j > 0:
                handles[h].wait()  # the neighbour's partial for this half
                residual = recv[(j - 1) % 2][h]
            if j < P - 1:
                dst = send[j % 2][h]
                gemm(a_h, dst, None, residual)
                handles[h] = transport.ring_shift(dst, recv[j % 2][h])
            else:
                gemm(a_h, out.narrow(sd, lo, hi - lo), bias, residual)
        if between is not None:
            between(j)
    return out


def chunked_matmul_all_reduce(x, weight, weight_layout, bias, transport: Transport, num_chunks: int,
                              reduce_dtype: torch.dtype) -> torch.Tensor:
    """``all_reduce(x @ W) (+ bias once)``; chunk ``i`` is reduced while chunk ``i + 1`` is computed.

    The bias is added by rank 0's GEMM epilogue only, so the sum holds it once. Partials are
    reduced in ``reduce_dtype`` and rounded to ``x.dtype`` at the end.
    """
    P, r = transport.size, transport.rank
    gemm = chunk_gemm(weight, weight_layout)
    n_out = weight.shape[0] if weight_layout == "nk" else weight.shape[1]
    lead = tuple(x.shape[:-1])
    M = int(torch.Size(lead).numel())
    x2 = x.reshape(M, x.shape[-1])
    if P == 1:
        return gemm(x2, torch.empty((M, n_out), dtype=x.dtype, device=x.device), bias).view(lead + (n_out,))
    y = torch.empty((M, n_out), dtype=reduce_dtype, device=x.device)
    step = -(-M // num_chunks) if M else 1
    handles = []
    for lo in range(0, M, step):
        hi = min(lo + step, M)
        gemm(x2[lo:hi], y[lo:hi], bias if r == 0 else None)
        handles.append(transport.all_reduce(y[lo:hi]))
    for h in handles:
        h.wait()
    return y.to(x.dtype).view(lead + (n_out,))


def _act_and_grad(x: torch.Tensor, code: int):
    """``(act(x), act'(x))`` in fp32 for the activation of code ``code`` (:data:`ACTIVATIONS`)."""
    if code == 1:
        return torch.relu(x), (x > 0).to(x.dtype)
    if code == 2:  # gelu_tanh(x) = x * sigmoid(k * (x + c x^3)), k = 2 sqrt(2/pi)
        k, c = 1.5957691216057308, 0.044715
        s = torch.sigmoid(k * (x + c * x * x * x))
        return x * s, s + x * s * (1 - s) * k * (1 + 3 * c * x * x)
    if code == 3:  # silu
        s = torch.sigmoid(x)
        return x * s, s + x * s * (1 - s)
    if code == 4:  # swiglu_oai's gate: g = min(x, L), g * sigmoid(alpha g); no gradient above L
        g = x.clamp(max=SWIGLU_OAI_LIMIT)
        s = torch.sigmoid(SWIGLU_OAI_ALPHA * g)
        return g * s, torch.where(x <= SWIGLU_OAI_LIMIT, s + SWIGLU_OAI_ALPHA * g * s * (1 - s), 0.0)
    return x, torch.ones_like(x)


def activation_backward(preact: torch.Tensor, grad: torch.Tensor, activation: str) -> torch.Tensor:
    """``d(act(preact))/d(preact) * grad``, in fp32 (``preact`` is ``[..., 2F]`` gate|up when gated),
    returned in ``grad``'s dtype. Closed-form derivatives (no autograd: it runs inside ops)."""
    code, glu = ACTIVATIONS[activation]
    p, g = preact.float(), grad.float()
    if not glu:
        return (g * _act_and_grad(p, code)[1]).to(grad.dtype)
    gate, up = p.chunk(2, dim=-1)
    a, da = _act_and_grad(gate, code)
    if code == 4:  # the up factor clamp(up, -L, L) + 1, no gradient outside the range
        a = torch.where(up.abs() <= SWIGLU_OAI_LIMIT, a, 0.0)
        up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1
    return torch.cat([g * up * da, g * a], dim=-1).to(grad.dtype)


def sum_tokens(t: torch.Tensor) -> torch.Tensor:
    """fp32 sum over every dim but the last (a bias gradient)."""
    return t.float().sum(dim=tuple(range(t.dim() - 1)))


class WeightGrad:
    """A weight gradient accumulated chunk by chunk in fp32 with ``matmul_tn``, straight from
    strided chunk views; :meth:`result` rounds it to the weight's dtype."""

    def __init__(self, weight: torch.Tensor):
        self.dtype = weight.dtype
        self.acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        self.first = True

    def add(self, grad: torch.Tensor, x: torch.Tensor) -> None:
        matmul_tn(grad, x, out=self.acc, accumulate=not self.first)
        self.first = False

    def result(self) -> torch.Tensor:
        return self.acc.to(self.dtype)


def check_linear_args(op, x, weight, bias, activation="none"):
    """The operands of a tensor-parallel linear op: ``x`` 2-D/3-D, ``weight`` ``[out, x's last
    dim]`` (``nn.Linear`` layout; an even number of rows for gated activations), ``bias``
    ``[out]``, all on ``x``'s device with ``x``'s dtype (a supported float dtype). Errors name ``op``
    and the argument."""
    check_tensor(f"{op}: x", x, dims=(2, 3), dtypes=SUPPORTED_DTYPES)
    check_tensor(f"{op}: weight", weight, dims=(2,))
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must have shape [out, {x.shape[-1]}] (nn.Linear layout, in = x's last "
                         f"dim), got {tuple(weight.shape)}")
    check_same(f"{op}: weight", weight, "x", x)
    check_choice(f"{op}: activation", activation, ACTIVATIONS)
    if ACTIVATIONS[activation][1] and weight.shape[0] % 2:
        raise ValueError(f"{op}: activation {activation!r} needs weight with an even number of rows "
                         f"(gate rows then up rows), got {weight.shape[0]}")
    if bias is not None:
        check_tensor(f"{op}: bias", bias)
        check_shape(f"{op}: bias", bias, (weight.shape[0],))
        check_same(f"{op}: bias", bias, "x", x)


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
    :mod:`fusedpar.ops.tensor_parallel_schedules`, which slice it along its token dims like a
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
