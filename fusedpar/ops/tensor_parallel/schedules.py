"""The overlap schedules of the tensor-parallel GEMMs, written against a
:class:`~fusedpar.ops.comm.Transport`:

* :func:`ring_gather` -- every rank's shard, the local one first, the next one in flight while
  the caller computes on the current one;
* :func:`ring_reduce_scatter` -- one partial GEMM per destination chunk; the partial received
  from the left neighbour is added in the GEMM epilogue and the sum travels on to the right;
* :func:`chunked_matmul_all_reduce` -- rows in chunks, chunk ``i`` all-reduced while chunk
  ``i + 1`` is multiplied.

The GEMM of a chunk is :func:`chunk_gemm`: ``matmul`` with the weight, or the GEMM of a weight that
carries its own (fp8). :func:`activation_backward` is the activations' closed-form gradient
(autograd cannot run inside an op body); :func:`check_linear_args` the shared argument checks."""
from __future__ import annotations

import math

import torch

from fusedpar.kernels import matmul_tn
from fusedpar.kernels.checks import check_choice, check_same, check_shape, check_tensor
from fusedpar.kernels.gemm import linear_operands, matmul_checked
from fusedpar.kernels.gemm_loads import ensure_scratch_allocator
from fusedpar.kernels.launch import LaunchRecord, PlanCache, describe
from fusedpar.kernels.runtime import (ACTIVATIONS, SUPPORTED_DTYPES, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, input_precision,
                                      interpreting)
from fusedpar.ops.comm.transport import Transport, hold_for_graphs


class Scratch:
    """One buffer a transport keeps for a purpose (:func:`scratch`), grown to the largest set of
    shapes asked for, and its views per set of shapes (64 kept: views hold no memory)."""

    __slots__ = ("flat", "views")

    def __init__(self):
        self.flat, self.views = None, {}

    def carve(self, shapes, dtype, device):
        """Views of ``shapes`` laid one after another in the buffer, each at a multiple of 256
        bytes (an allocator's alignment: whatever a launch specialises on does not change)."""
        step = max(256 // dtype.itemsize, 1)
        sizes = [-(-math.prod(s) // step) * step for s in shapes]
        if self.flat is None or self.flat.numel() < sum(sizes):
            with torch.inference_mode(False):  # kept for later calls: not an inference tensor
                self.flat, self.views = torch.empty(sum(sizes), dtype=dtype, device=device), {}
        if len(self.views) >= 64:
            self.views.clear()
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        views = self.views[shapes] = tuple(self.flat[o:o + math.prod(s)].view(s) for o, s in zip(offsets, shapes))
        return views


def scratch(transport: Transport, key, shapes):
    """``(kept, views)``: views of ``shapes`` (a tuple of shapes) in a buffer the transport keeps
    between calls per ``key`` (a purpose, dtype and device: one buffer whatever the shapes, grown to
    the largest set asked for), taken out while the schedule uses it and put back by
    :func:`keep_scratch`, so two schedules running at once never share it. On a GPU the next
    call's writes are stream-ordered after this call's reads (one stream issues both, and a
    transport's side stream waits for it before each copy)."""
    cache = getattr(transport, "scratch", None)
    kept = cache.pop(key, None) if cache is not None else None
    if kept is None:
        kept = Scratch()
    views = kept.views.get(shapes)
    return kept, views if views is not None else kept.carve(shapes, key[1], key[2])


def keep_scratch(transport: Transport, key, kept) -> None:
    """Put back what :func:`scratch` handed out."""
    cache = getattr(transport, "scratch", None)
    if cache is not None:
        cache[key] = kept


def ring_gather(x: torch.Tensor, transport: Transport, into: torch.Tensor | None = None):
    """Yield ``(src_rank, chunk)`` for every rank's ``x``, the local one first.

    The transfer of the next chunk is posted before the current one is yielded (so it is in flight
    while the caller computes) and waited on only when the caller asks for it. Receive buffers are
    double-buffered (kept on the transport for the next call, :func:`scratch`), or with ``into`` (a
    ``[P, *x.shape]`` tensor) every chunk lands in its source rank's slot ``into[src]`` (the local
    one copied there first), so that the caller may hold on to every chunk (the gathered input kept
    for the weight gradient). Run it inside ``transport.transfers(device)`` (every handle is waited
    for before the generator ends).
    """
    P, r = transport.size, transport.rank
    slots = into.unbind(0) if into is not None else None
    if into is not None:
        cur = slots[r]
        if (cur.data_ptr(), cur.stride()) != (x.data_ptr(), x.stride()):  # (a caller may have written its slot)
            cur.copy_(x)
    else:
        cur = x.contiguous()
    if P == 1:
        yield r, cur
        return
    if into is None:
        key = ("ring_gather", cur.dtype, cur.device)
        kept, slots = scratch(transport, key, (cur.shape, cur.shape))
        hold_for_graphs(transport, cur.device, slots)
    try:
        for j in range(P):
            handle = None
            if j + 1 < P:
                nxt = slots[(r - j - 1) % P] if into is not None else slots[(j + 1) % 2]
                handle = transport.ring_shift(cur, nxt)
            yield (r - j) % P, cur
            if handle is not None:
                handle.wait()  # the chunk the caller is about to use next
                cur = nxt
    finally:
        if into is None:
            keep_scratch(transport, key, kept)


def chunk_gemm(weight, weight_layout: str = "nk"):
    """``gemm(a, out, bias=None, residual=None)``: ``out = a @ W (+ bias) (+ residual)`` with
    ``matmul`` and ``weight`` in ``weight_layout`` (a :class:`ChunkGemms`), or ``weight``'s own
    ``gemm`` (a quantised fp8 weight, whose layout it knows)."""
    if hasattr(weight, "gemm"):
        return weight.gemm
    return ChunkGemms(weight, weight_layout)


#: ``{op key: ((plan, slots), ...)}``: the chunk GEMMs' launch plans of one op call (:class:`ChunkGemms`)
_OP_PLANS = PlanCache(limit=1024)


class ChunkGemms:
    """The chunk GEMMs of one call of a schedule: ``gemms(a, out, bias=None, residual=None, *,
    ops=None, preact_out=None)`` is ``matmul_checked``. The chunks share the operand's dtype,
    device and K, and the schedule makes ``out`` and ``residual`` itself (of ``matmul``'s shapes, a
    supported dtype, the operand's device): ``linear_operands`` checks the operand, weight and
    bias of the first GEMM with each bias (:meth:`operands`), no later one is checked (the checks
    cost more host time than the launch).

    After :meth:`plan` with an op key -- everything each chunk GEMM's own plan key follows from:
    the caller's operands described, the schedule's structure (the transport's size and rank); the
    buffers a schedule makes are fresh allocations or views at offsets that follow from the key --
    a call whose every GEMM launched through its launch plan is recorded (:meth:`finish`), and a
    later call with the key launches the recorded plans with its own tensors in their slots,
    without forming a key per GEMM (a plan that does not apply now takes ``matmul_checked``)."""

    __slots__ = ("weight", "layout", "checked", "key", "steps", "done", "record", "streams")

    def __init__(self, weight, weight_layout: str = "nk"):
        self.weight, self.layout = weight, weight_layout
        self.checked = {}  # (id(bias), dtype, device, K) -> (bias, LinearOperands); holding bias pins its id
        self.key = self.steps = self.record = self.streams = None
        self.done = 0

    def operands(self, a, bias=None):
        key = (id(bias), a.dtype, a.device, a.shape[-1])
        seen = self.checked.get(key)
        if seen is None:
            seen = self.checked[key] = (bias, linear_operands(a, self.weight, bias, weight_layout=self.layout))
        return seen[1]

    def plan(self, key) -> None:
        """Replay the GEMMs of an earlier call with op key ``key``, or record this call's."""
        if key is None or interpreting():
            return
        self.key, self.steps = key, _OP_PLANS.find(key)
        self.record = [] if self.steps is None else None
        if self.steps is not None:  # where each distinct plan applies now: its stream (None: it does not)
            streams = self.streams = {}
            for plan, _ in self.steps:  # (a call repeats a few plans: each asked once)
                if id(plan) not in streams:
                    streams[id(plan)] = plan.stream()
            # a TMA launch asks Triton's allocator (a context variable: a thread starts without one,
            # autograd's backward thread too) for its descriptors' scratch, as matmul's path sets it
            ensure_scratch_allocator()

    def __call__(self, a, out, bias=None, residual=None, *, ops=None, preact_out=None):
        ops = ops or self.operands(a, bias)
        steps = self.steps
        if steps is not None and self.done < len(steps):
            plan, slots = steps[self.done]
            self.done += 1
            stream = self.streams[id(plan)]  # (the current stream is the op's at every GEMM of a schedule)
            if stream is not None:
                plan.call(slots((a, self.weight, out, ops.bias, residual, preact_out)), stream)
                return out
        elif self.record is not None:
            with LaunchRecord() as rec:
                matmul_checked(a, self.weight, ops, out, residual=residual, preact_out=preact_out,
                               weight_layout=self.layout)
            self.record.append(rec.slots((a, self.weight, out, ops.bias, residual, preact_out)))
            return out
        return matmul_checked(a, self.weight, ops, out, residual=residual, preact_out=preact_out,
                              weight_layout=self.layout)

    def finish(self) -> None:
        """Keep a recorded call's plans for its key (each GEMM launched by exactly one plan)."""
        if self.record and all(step is not None for step in self.record):
            _OP_PLANS.keep(self.key, tuple(self.record))
        self.record = None


def op_key(transport: Transport, kind: str, ops, *tensors, extra=()):
    """The op key of a schedule's :class:`ChunkGemms` (None where the operands carry none): the
    schedule ``kind``, the transport's size and rank, ``ops``' weight / bias / activation part, each
    tensor described, the operand dtype's dot precision (TF32 follows torch's setting), ``extra``."""
    if not ops.plan_part:
        return None
    precision = input_precision(tensors[0].dtype)
    return (kind, transport.size, transport.rank, ops.plan_part, precision, extra) + tuple(describe(t) for t in tensors)


def _split_dim(t):
    return 1 if t.dim() == 3 else 0


def _halves(length):
    """Row ranges of the two sub-chunks of a reduce-scatter step (one when there is one row)."""
    if length < 2:
        return [(0, length)]
    return [(0, length // 2), (length // 2, length)]


def _split(a, sizes, dim):
    """``a`` in pieces of ``sizes`` along ``dim``: one ``split`` of a tensor, else (an operand
    that knows ``narrow`` only, the fp8 rows) one ``narrow`` per piece."""
    if isinstance(a, torch.Tensor):
        return a.split_with_sizes(sizes, dim)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [a.narrow(dim, lo, n) for lo, n in zip(starts, sizes)]


def ring_reduce_scatter(a_chunk, weight, weight_layout, bias, out, transport: Transport, partial_dtype,
                        between=None):
    """``out = sum over ranks q of (a_chunk_q(r) @ W_q) + bias`` where ``r`` is this rank.

    ``a_chunk(c)`` is this rank's operand for destination chunk ``c`` (leading dims = ``out``'s);
    or a tensor whose ``P`` equal chunks along ``out``'s row dim (dim 1 of a 3-D ``out``, else 0)
    are those operands: split once into every step's halves, described once in the op key.
    Ring: at step ``j`` rank ``r`` computes the partial of chunk ``(r - j - 1) mod P``, adding in
    the GEMM epilogue the partial that the left neighbour computed for the same chunk at step
    ``j - 1``, and sends the sum (in ``partial_dtype``) to the right neighbour; at the last step
    the chunk is its own and the result (plus bias) is written into ``out``. Each step is split in
    two row halves, so that one half's partial travels while the other half's GEMM runs.
    ``between(j)`` (optional) runs after step ``j`` (independent work that also hides the
    transfers, e.g. a weight gradient). The partial buffers (two sets to send, two to receive) are
    kept on the transport (:func:`scratch`); the transfers run inside ``transport.transfers``.
    """
    P, r = transport.size, transport.rank
    gemm = chunk_gemm(weight, weight_layout)
    if P == 1:
        gemm(a_chunk if isinstance(a_chunk, torch.Tensor) else a_chunk(r), out, bias)
        if between is not None:
            between(0)
        return out
    sd = _split_dim(out)
    sizes = [hi - lo for lo, hi in _halves(out.shape[sd])]
    outs = out.split_with_sizes(sizes, sd)
    key, halves = ("ring_reduce_scatter", partial_dtype, out.device), len(outs)
    kept, views = scratch(transport, key, tuple(o.shape for o in outs) * 4)  # two sets to send, two to receive
    hold_for_graphs(transport, out.device, views)
    send = [views[:halves], views[halves:2 * halves]]
    recv = [views[2 * halves:3 * halves], views[3 * halves:]]
    if isinstance(a_chunk, torch.Tensor):  # one split, one description (each half's follows from it)
        pieces = a_chunk.split_with_sizes(sizes * P, sd)
        described = (a_chunk,)
        chunk_halves = [pieces[c * halves:(c + 1) * halves] for c in range(P)]
    else:
        described = tuple(a_chunk(c) for c in range(P))
        chunk_halves = [_split(a, sizes, sd) for a in described]
    ops = ops_bias = None
    if isinstance(gemm, ChunkGemms):  # every GEMM's plan key follows from the chunks, out, bias and weight
        first = chunk_halves[0][0]
        ops, ops_bias = gemm.operands(first), gemm.operands(first, bias)
        gemm.plan(op_key(transport, "rs", ops_bias, out, *described, extra=(partial_dtype, between is None)))
    gemm_kw, last_kw = ({"ops": ops}, {"ops": ops_bias}) if ops is not None else ({}, {})
    handles = [None] * len(sizes)
    with transport.transfers(out.device):
        for j in range(P):
            for h, a_h in enumerate(chunk_halves[(r - j - 1) % P]):
                residual = None
                if j > 0:
                    handles[h].wait()  # the neighbour's partial for this half
                    residual = recv[(j - 1) % 2][h]
                if j < P - 1:
                    dst = send[j % 2][h]
                    gemm(a_h, dst, None, residual, **gemm_kw)
                    handles[h] = transport.ring_shift(dst, recv[j % 2][h])
                else:
                    gemm(a_h, outs[h], bias, residual, **last_kw)
            if between is not None:
                between(j)
    keep_scratch(transport, key, kept)
    if isinstance(gemm, ChunkGemms):
        gemm.finish()
    return out


def chunked_matmul_all_reduce(x, weight, weight_layout, bias, transport: Transport, num_chunks: int,
                              reduce_dtype: torch.dtype) -> torch.Tensor:
    """``all_reduce(x @ W) (+ bias once)``; chunk ``i`` is reduced while chunk ``i + 1`` is computed.

    The bias is added by rank 0's GEMM epilogue only, so the sum holds it once. Partials are
    reduced in ``reduce_dtype`` and rounded to ``x.dtype`` at the end.
    """
    P, r = transport.size, transport.rank
    gemm = weight.gemm if hasattr(weight, "gemm") else ChunkGemms(weight, weight_layout)
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
