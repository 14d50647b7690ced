"""Symmetric-memory schedules of the tensor-parallel GEMMs (one NVLink domain, a
:class:`~fusedpar.ops.comm.symmetric.SymmetricTransport`).

:func:`all_gather_matmul_symmetric`: each rank copies its shard into its slot of the symmetric
buffer; a side stream pulls the peers' slots with copy engines and raises each chunk's ready flag
(:mod:`fusedpar.ops.comm.waits`); one persistent GEMM
(:func:`fusedpar.kernels.persistent_gemm.persistent_matmul`) starts at the local chunk and spins on
each chunk's flag before its first load. :func:`matmul_reduce_scatter_symmetric` inverts it:
the persistent GEMM computes the partial for peer ``rank + 1`` first and the local chunk last, into
the local symmetric buffer, releasing a per-chunk completion counter after every tile; a
:func:`~fusedpar.kernels.persistent_gemm.chunk_reduce` on a side stream reads each peer's partial
of this rank's chunk as soon as its counter says it is complete, summing in fp32. Both take e4m3
operands too. Every launch argument and stream write is the same call after call (CUDA-graph
safe): the all-gather's flags are raised to a constant and lowered once the call is joined, the
reduce-scatter's counters only grow and the reduction waits for a device word that grows with
them; a wait that gives up raises :class:`~fusedpar.kernels.waits.WaitTimeout` at the op's end.
Both are written against :class:`~fusedpar.ops.comm.transport.SymmetricBuffers` and run on real
peers and on an :class:`~fusedpar.ops.comm.transport.EmulatedTransport` with
``in_kernel_waits=True``."""
from __future__ import annotations

import contextlib
import os

import torch

from fusedpar.kernels.checks import (
    check_buffer,
    check_divisible,
    check_dtype,
    check_int,
    check_out_dtype,
    check_shape,
    check_tensor,
    output_buffer,
)
from fusedpar.kernels.persistent_gemm import (
    chunk_reduce,
    chunk_view,
    default_num_programs,
    kernel_config,
    persistent_matmul,
    tiles_per_chunk,
)
from fusedpar.kernels.gemm_loads import ensure_scratch_allocator
from fusedpar.kernels.launch import LaunchRecord, describe, plans_generation
from fusedpar.kernels.runtime import SUPPORTED_DTYPES, activation_features, cdiv, input_precision
from fusedpar.kernels.waits import check_wait_timeouts, spin_bound, status_word
from fusedpar.ops.comm.agreement import agreed_arguments
from fusedpar.ops.comm.symmetric import check_symmetric
from fusedpar.ops.comm.transport import hold_for_graphs
from fusedpar.ops.comm.waits import (
    chunk_flags,
    device_ints,
    fork_side_stream,
    join_side_stream,
    on_stream,
    pull_chunks,
)
from fusedpar.ops.tensor_parallel.schedules import check_linear_args

# SMs the persistent reduce-scatter GEMM leaves to the concurrent chunk_reduce kernel
RS_REDUCE_SMS = int(os.environ.get("FUSEDPAR_RS_REDUCE_SMS", "8"))


# ----------------------------------------------------------------------------------------------
# validation (local, before any barrier or transfer: the same error on every rank)
# ----------------------------------------------------------------------------------------------
def _validate(op, x, weight, bias, activation, dim, dim_name, chunks=None, fp8=False):
    if not fp8:  # (fp8 operands: checked by the GEMM, all_gather_matmul_symmetric)
        check_linear_args(op, x, weight, bias, activation)
    if not isinstance(dim, int) or not 0 <= dim < x.dim() - 1:
        raise ValueError(f"{op}: {dim_name} must be a token dim of x (0..{x.dim() - 2}), got {dim!r}")
    if chunks is not None:
        check_divisible(f"{op}: x.shape[{dim}]", x.shape[dim], chunks)


def _fp8_operands(x, x_scale, weight, weight_scale, bias, scaling, *, chunked=False, activation="none",
                  out_dtype=None) -> bool:
    """Whether ``x`` is e4m3. If it is: ``x_scale`` of ``x.shape[:-1]`` (+ ``(ceil(K/128),)``
    blockwise) checked here, then the GEMM's own checks (weight, scales, bias, activation, out
    dtype) on no rows, nothing launched; ``chunked``: ``x`` is a chunked view already, else one
    chunk. 16/32-bit ``x`` must come without scales."""
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn):
        if x_scale is not None or weight_scale is not None:
            got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else f"type {type(x).__name__}"
            raise ValueError(f"x_scale / weight_scale are for float8_e4m3fn operands, got x of {got}")
        return False
    check_tensor("x_scale", x_scale, dims=(x.dim() - 1, x.dim()))
    check_shape("x_scale", x_scale, tuple(x.shape[:-1]) + tuple(x_scale.shape[x.dim() - 1:]))
    a, a_scale = (x, x_scale) if chunked else (x[None], x_scale[None])
    persistent_matmul(a[:1, :0], weight, bias, a_scale=a_scale[:1, :0], weight_scale=weight_scale, scaling=scaling,
                      activation=activation, wait_mode="none", out_dtype=out_dtype)
    return True


def _agreed(op, transport, agree, **fields):
    """The cross-rank agreement check around a symmetric schedule's local checks (see
    :mod:`fusedpar.ops.comm.agreement`); ``agree=False`` (the tensor-parallel ops, which checked their
    own arguments already) skips it."""
    if not agree:
        return contextlib.nullcontext()
    return agreed_arguments(op, transport, None, dict(fields, transport=transport))


def _spec_key(agree, config, x, *parts):
    """The key of a schedule's spec (:func:`_spec`): its arguments, tensors described, and the dot
    precision of ``x``'s dtype (TF32 follows torch's setting; the recorded launches hold it); None
    where no spec is kept (``agree``: the agreement check runs every call, as do the checks inside
    it; a ``config`` that is not a dict; an ``x`` that is not a tensor, which the checks reject)."""
    if agree or not (config is None or type(config) is dict) or not isinstance(x, torch.Tensor):
        return None
    return parts + (None if config is None else tuple(config.items()), input_precision(x.dtype))


def _spec(t, key):
    """What a schedule derived from arguments described by ``key`` in an earlier call on ``t`` whose
    checks passed (kept on the transport, :func:`_keep_spec`); None for a new key or ``key`` None."""
    try:
        return None if key is None else t.specs.get(key)
    except TypeError:  # an argument that cannot be hashed (the checks reject it)
        return None


def _keep_spec(t, key, spec) -> None:
    if key is not None:
        if len(t.specs) >= 64:
            t.specs.clear()
        t.specs[key] = spec


def _launch(steps: list, i: int, named: tuple, launch) -> None:
    """Launch ``i`` of a schedule's call: the launch plan recorded for its spec (``steps[i]``, a
    ``(plan, pick)`` of :meth:`LaunchRecord.slots`, and :func:`plans_generation` then: plans
    cleared since are not launched) with this call's tensors ``named`` where it applies now,
    without the launcher's plan key; else ``launch()`` (the launcher's own path),
    recorded for the next call. The spec's key holds what the launcher's key follows from (the
    arguments described, the config, the dot precision); the schedule's own tensors (workspace
    views, flags, words) are the same or at the same offsets for every call of a spec."""
    step, generation = steps[i], plans_generation()
    if step is not None and step[2] == generation:
        # a TMA launch (the reduce-scatter's GEMM) asks Triton's allocator, a context variable (a
        # thread starts without one, autograd's backward thread too), for its descriptors' scratch
        ensure_scratch_allocator()
        if step[0].launch(step[1](named)):
            return
    with LaunchRecord() as rec:
        launch()
    found = rec.slots(named)
    steps[i] = None if found is None else (*found, generation)


def _check_config(config, a, weight, bias, activation, preact_out, a_scale, weight_scale, scaling, out_dtype):
    """The persistent GEMM's checks of a ``config`` passed in (its keys, the GPU's resources, fp8's
    BLOCK_K), run by the GEMM on no rows of the chunked view ``a`` (nothing launched) while the
    schedule checks its arguments: before it raises a flag or a ready word."""
    if config is not None:
        persistent_matmul(a[:1, :0], weight, bias, activation=activation, wait_mode="none", config=config,
                          preact_out=None if preact_out is None else preact_out[:1, :0],
                          a_scale=None if a_scale is None else a_scale[:1, :0], weight_scale=weight_scale,
                          scaling=scaling, out_dtype=out_dtype)


def _check_delay(delay_cycles, device):
    check_int("producer_delay_cycles", delay_cycles, min_value=0)
    if delay_cycles and device.type != "cuda":
        raise ValueError(f"producer_delay_cycles must be 0 on {device} (it sleeps on a CUDA stream), got {delay_cycles}")


# ----------------------------------------------------------------------------------------------
# all_gather_matmul over symmetric buffers
# ----------------------------------------------------------------------------------------------
def _ag_buffers(x, weight, activation, gather_dim, P, out, preact_out, gathered_out, out_dtype):
    n_w = weight.shape[0]
    shape = list(x.shape[:-1]) + [activation_features(n_w, activation)]
    shape[gather_dim] *= P
    out = output_buffer("out", out, shape, x.device if out is not None else "meta", out_dtype)  # (meta: its layout)
    if preact_out is not None:
        check_buffer("preact_out", preact_out, (P,) + tuple(x.shape[:-1]) + (n_w,), x.device)
    if gathered_out is not None:
        check_buffer("gathered_out", gathered_out, (P,) + tuple(x.shape), x.device, x.dtype)
    return out


def all_gather_matmul_symmetric(x, weight, bias=None, *, transport, gather_dim=1, activation="none", out=None,
                                preact_out=None, gathered_out=None, config=None, wait=True, producer_delay_cycles=0,
                                num_programs=None, max_spin=None, agree=True, x_scale=None, weight_scale=None,
                                scaling="rowwise", out_dtype=None):
    """Forward of ``all_gather_matmul`` with in-kernel waits: ``x`` is this rank's shard (equal
    shapes on every rank), the result ``act(all_gather(x, gather_dim) @ W^T + bias)``. Arguments
    are checked before the first barrier.

    transport:    a :class:`SymmetricTransport` or an ``EmulatedTransport(in_kernel_waits=True)``.
    out:          ``all_gather(x) @ W^T`` layout (``x.shape`` with the gather dim ``P`` times
                  larger, ``N`` features); allocated when omitted.
    preact_out:   optional chunk-major ``[P, *x.shape[:-1], weight.shape[0]]`` pre-activation.
    gathered_out: optional ``[P, *x.shape]`` tensor receiving a copy of the gathered input (the
                  symmetric buffer is reused by the next call), for the weight gradient (not fp8).
    x_scale, weight_scale, scaling, out_dtype: fp8 (e4m3 ``x`` and ``weight``; their fp32 scales as
                  ``persistent_matmul`` takes them, ``x_scale`` of ``x.shape[:-1]`` (+ ``(ceil(K/128),)``
                  blockwise) travels with ``x``); ``out`` in ``out_dtype`` (default ``x``'s, bf16 for fp8).
    Test knobs: ``wait=False`` launches the GEMM without waiting on the flags (a missing wait
    must show as wrong data), ``producer_delay_cycles`` makes the pulls start late on purpose
    (a sleep enqueued on the pull stream before the GEMM is launched: it counts from the enqueue,
    so a GEMM specialisation launched for the first time, which compiles on the host meanwhile,
    can start after the delay is over; warm it up first), ``num_programs`` / ``max_spin`` /
    ``config`` as in ``persistent_matmul``. ``agree``: check that the ranks agree on the
    arguments first (:mod:`fusedpar.ops.comm.agreement`; the tensor-parallel ops pass False, they
    checked their own).
    """
    t = check_symmetric(transport, "all_gather_matmul")
    key = _spec_key(agree, config, x, "all_gather_matmul", describe(x), describe(weight), describe(bias), gather_dim,
                    activation, describe(out), describe(preact_out), describe(gathered_out), wait,
                    producer_delay_cycles, num_programs, max_spin, describe(x_scale), describe(weight_scale), scaling,
                    out_dtype)
    spec = _spec(t, key)
    if spec is None:
        spec = _ag_spec(t, x, weight, bias, gather_dim, activation, out, preact_out, gathered_out, wait,
                        producer_delay_cycles, num_programs, max_spin, config, agree, x_scale, weight_scale, scaling,
                        out_dtype)
        _keep_spec(t, key, spec)
    fp8, out_shape, out_dtype, chunks, row, xb, views, num_programs, steps = spec
    P, r = t.size, t.rank
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    ws = t.symmetric_workspace("all_gather", x.device, P * row)
    gathered, g_scale, pulls, raised = ws.views.get(views) or _ag_views(t, ws, views, x, x_scale if fp8 else None,
                                                                         row, xb)
    flags = chunk_flags(ws, P)
    hold_for_graphs(t, x.device, ws, flags)
    flags.reset()  # before any raise (the previous call joined): a flag read as ready is this call's
    t.symmetric_barrier(ws, 0)  # every peer finished reading our slot in the previous call
    gathered[r].copy_(x)
    if fp8:
        g_scale[r].copy_(x_scale)
    t.symmetric_barrier(ws, 1)  # every slot holds its owner's shard
    side = pull_chunks(pulls, flags, copy=t.peer_copy, delay_cycles=producer_delay_cycles, local=r, raised=raised)
    try:
        outc = out.as_strided(*chunks)
        _launch(steps, 0, (gathered, weight, outc, bias, preact_out, g_scale, weight_scale, flags.i32, flags.ready,
                           status_word(x.device)), lambda: persistent_matmul(
            gathered, weight, bias, first_chunk=r, out=outc, activation=activation,
            wait_flags=flags.i32 if wait else None, wait_mode="spin" if wait else "none", ready_value=flags.ready,
            preact_out=preact_out, config=config, num_programs=num_programs, max_spin=max_spin, check_waits=False,
            a_scale=g_scale, weight_scale=weight_scale, scaling=scaling,
        ))
    finally:
        # the copy reads every slot: join the pulls first instead of relying on the GEMM's waits
        # (wait=False, or a wait that gave up, would let it read a slot still being written); joined
        # when the GEMM raised too, so the next call's reset follows every pull of this one
        join_side_stream(x.device, side)
    if gathered_out is not None:
        gathered_out.copy_(gathered)
    check_wait_timeouts(x.device, "all_gather_matmul (symmetric)")
    return out


def _ag_spec(t, x, weight, bias, gather_dim, activation, out, preact_out, gathered_out, wait, producer_delay_cycles,
             num_programs, max_spin, config, agree, x_scale, weight_scale, scaling, out_dtype):
    """What :func:`all_gather_matmul_symmetric` derives from its arguments once they passed its
    checks (run here, inside the agreement check when ``agree``): whether it is fp8, the output's
    shape and dtype, its chunked view's ``(shape, strides)``, the slot sizes, the views' key, the
    GEMM's programs and the launches recorded for the next call (:func:`_launch`)."""
    P, r = t.size, t.rank
    with _agreed("all_gather_matmul_symmetric", t, agree, x=x, weight=weight, bias=bias, gather_dim=gather_dim,
                 activation=activation, wait=wait, x_scale=x_scale, weight_scale=weight_scale, scaling=scaling):
        fp8 = _fp8_operands(x, x_scale, weight, weight_scale, bias, scaling, activation=activation,
                            out_dtype=out_dtype)
        _validate("all_gather_matmul", x, weight, bias, activation, gather_dim, "gather_dim", fp8=fp8)
        if fp8 and gathered_out is not None:
            raise ValueError("gathered_out must be None with fp8 operands (the scales travel with x), got a tensor")
        out = _ag_buffers(x, weight, activation, gather_dim, P, out, preact_out, gathered_out,
                          out_dtype or (torch.bfloat16 if fp8 else x.dtype))
        _check_delay(producer_delay_cycles, x.device)
        spin_bound(max_spin)
        if num_programs is not None:
            check_int("num_programs", num_programs, min_value=1)
        empty = lambda v: None if v is None else v.new_empty((1, 0) + tuple(v.shape[1:]))  # noqa: E731 (a slot's)
        _check_config(config, empty(x), weight, bias, activation, preact_out, empty(x_scale) if fp8 else None,
                      weight_scale, scaling, out.dtype)
    # slot c: chunk c's bytes padded to 16 (fp8: then its scales'), one pull per chunk; slots 16-byte aligned
    nx, ns = x.numel() * x.element_size(), x_scale.numel() * 4 if fp8 else 0
    row = max(16 * cdiv((xb := 16 * cdiv(nx, 16)) + ns, 16), 16)  # an empty shard's slot: 16 B
    chunks = chunk_view(out, gather_dim, P)
    if num_programs is None:
        num_programs = default_num_programs(x.device, reserve=t.free_sms(x.device))
    views = ("all_gather", P, r, row, xb, x.dtype, tuple(x.shape), None if not fp8 else tuple(x_scale.shape))
    return (fp8, tuple(out.shape), out.dtype, (tuple(chunks.shape), chunks.stride()), row, xb, views, num_programs,
            [None])


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter over symmetric buffers
# ----------------------------------------------------------------------------------------------
def _ag_views(t, ws, key, x, x_scale, row, xb):
    """The views of one all-gather shape over ``ws``, kept in ``ws.views[key]`` (made once per
    workspace and shape): the gathered chunks (and scales), the pulls ``(chunk, its slot, the
    peer's slot it is pulled from)`` in the order they run (the next rank's chunk first), and every
    chunk whose flag a call raises (the local one first)."""
    P, r = t.size, t.rank
    nx, slots = x.numel() * x.element_size(), ws.typed(0, (P, row), torch.uint8)
    gathered = slots[:, :nx].view(x.dtype).view((P,) + tuple(x.shape))
    g_scale = None
    if x_scale is not None:
        g_scale = slots[:, xb:xb + x_scale.numel() * 4].view(torch.float32).view((P,) + tuple(x_scale.shape))
    order = [(r + i) % P for i in range(1, P)]
    dsts = slots.unbind(0)
    pulls = tuple((c, dsts[c], t.peer_slot(ws, slots, c, c)) for c in order)
    return ws.keep(key, (gathered, g_scale, pulls, (r, *order)))


def _rs_order(r: int, P: int):
    """Peers in the order they complete the partial of chunk ``r``: peer ``j`` computes chunk
    ``r`` at step ``(r - j - 1) mod P``, so ``r - 1`` first and ``r`` itself last."""
    return [(r - 1 - k) % P for k in range(P)]


def _rs_input(x, weight, bias, scatter_dim, chunked, P, x_scale, weight_scale, scaling):
    """``x`` as a chunked view ``[P, *chunk rows, in]`` (chunk ``c`` goes to rank ``c``), checked,
    and e4m3 ``x``'s scales as the same chunks (``[P, *chunk rows]`` rowwise, ``[P, *chunk rows,
    kb]`` blockwise; ``None`` for 16/32-bit ``x``)."""
    op = "matmul_reduce_scatter"
    if chunked:
        check_tensor(f"{op}: x", x, dims=(3, 4))
        if x.shape[0] != P:
            raise ValueError(f"{op}: a chunked x must be [P={P}, *rows, in], got {tuple(x.shape)}")
    fp8 = _fp8_operands(x, x_scale, weight, weight_scale, bias, scaling, chunked=chunked)
    if chunked:
        _validate(op, x[0], weight, bias, "none", 0, "scatter_dim", fp8=fp8)
        return x, x_scale if fp8 else None
    _validate(op, x, weight, bias, "none", scatter_dim, "scatter_dim", chunks=P, fp8=fp8)
    # the scales' token dims are x's: the same chunks (chunk_view wants a feature dim, rowwise has none)
    scales = x_scale.unflatten(scatter_dim, (P, x.shape[scatter_dim] // P)).movedim(scatter_dim, 0) if fp8 else None
    return chunk_view(x, scatter_dim, P), scales


def _rs_begin(t, device, nbytes, views, per):
    """This call's counters and partials in the workspace (of ``nbytes``, laid out as ``views``
    says), after the barrier that says the peers finished reading the previous call's partials;
    returns them with the counters' ready value: the workspace's device word ``ready``, set here on
    the current stream to this rank's first counter plus ``per`` (what this call's GEMM adds to
    every counter). Read from the counters on the device, not kept on the host, it follows what
    the GEMMs really launched: a call that raised before its GEMM launched leaves nothing behind,
    a CUDA graph recomputes it at every replay, and it wraps past 2^31 - 1 with the counters (the
    kernels compare modulo 2^32)."""
    ws = t.symmetric_workspace("reduce_scatter", device, nbytes)
    found = ws.views.get(views)
    if found is None:  # (views: "reduce_scatter", P, the counters' bytes, a chunk's shape, the partials' dtype)
        _, P, head, chunk_shape, dtype = views
        counters = ws.typed(0, (P,), torch.int32)
        found = ws.keep(views, (counters, ws.typed(head, (P,) + chunk_shape, dtype), counters[:1]))
    counters, partials, first = found
    t.symmetric_barrier(ws, 0)
    torch.add(first, per, out=ws.ready)  # (every counter of this rank holds the same count between calls)
    return ws, counters, partials, ws.ready


def matmul_reduce_scatter_symmetric(x, weight, bias=None, *, transport, scatter_dim=1, partial_dtype=torch.float32,
                                    out=None, config=None, chunked=False, reduce_sms=RS_REDUCE_SMS, wait=True,
                                    producer_delay_cycles=0, max_spin=None, agree=True, x_scale=None,
                                    weight_scale=None, scaling="rowwise", out_dtype=None):
    """Forward of ``matmul_reduce_scatter`` with in-kernel waits: ``x`` is ``[batch, seq,
    in_shard]`` (or ``[tokens, in_shard]``), the result this rank's ``[batch, seq/P, out]``
    chunk of ``sum over ranks (x @ W^T) + bias``. ``chunked=True``: ``x`` is already a chunked
    view ``[P, *chunk rows, in_shard]`` (chunk ``c`` goes to rank ``c``). ``reduce_sms``: SMs of
    the reduction (the GEMM leaves them free). ``x_scale``, ``weight_scale``, ``scaling``: fp8,
    e4m3 ``x`` and ``weight`` with their fp32 scales as in :func:`all_gather_matmul_symmetric`
    (``x_scale`` chunked with ``x``): the persistent fp8 GEMM writes the ``partial_dtype``
    partials, the reduction is unchanged. ``out`` (allocated when omitted) of ``out_dtype``,
    default ``x``'s, bf16 for fp8. Test knobs: ``wait=False`` reads the partials
    without waiting on the counters, ``producer_delay_cycles`` starts the GEMM late on purpose
    (counted from its enqueue, before the reduction is launched: a ``chunk_reduce``
    specialisation compiled by this call starts late itself; warm it up first).
    ``agree``: as in :func:`all_gather_matmul_symmetric`."""
    t = check_symmetric(transport, "matmul_reduce_scatter")
    key = _spec_key(agree, config, x, "matmul_reduce_scatter", describe(x), describe(weight), describe(bias),
                    scatter_dim, partial_dtype, describe(out), chunked, reduce_sms, wait, producer_delay_cycles,
                    max_spin, describe(x_scale), describe(weight_scale), scaling, out_dtype)
    spec = _spec(t, key)
    if spec is None:
        spec = _rs_spec(t, x, weight, bias, scatter_dim, partial_dtype, out, config, chunked, reduce_sms, wait,
                        producer_delay_cycles, max_spin, agree, x_scale, weight_scale, scaling, out_dtype)
        _keep_spec(t, key, spec)
    x_view, fp8, s_view, out_shape, out_dtype, nbytes, views, per, programs, steps = spec
    P, r = t.size, t.rank
    xv = x if x_view is None else x.as_strided(*x_view)
    sv = None if not fp8 else x_scale if s_view is None else x_scale.as_strided(*s_view)
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    ws, counters, partials, ready = _rs_begin(t, x.device, nbytes, views, per)
    reduce_args = ws.views.get((views, r)) or _rs_reduce_args(t, ws, (views, r), counters, partials)
    peer_off, cnt_off, n = reduce_args
    acc = ws.fp32_scratch(n)  # the reduction's running sum: one buffer for every shape
    hold_for_graphs(t, x.device, ws, reduce_args, acc)
    side = fork_side_stream(x.device)  # the reduction's stream: after the work queued so far, not after the GEMM
    if producer_delay_cycles:
        torch.cuda._sleep(int(producer_delay_cycles))
    named = (xv, weight, partials, counters, sv, weight_scale, out, bias, peer_off, cnt_off, ready, acc,
             status_word(x.device))
    _launch(steps, 0, named, lambda: persistent_matmul(
        xv, weight, first_chunk=(r + 1) % P, out=partials, wait_mode="none", ready_value=ready,
        signal_counters=counters, config=config, num_programs=programs, a_scale=sv, weight_scale=weight_scale,
        scaling=scaling))
    with on_stream(side):  # enqueued after the GEMM whose counters it waits for: no launch-order stall
        _launch(steps, 1, named, lambda: chunk_reduce(
            partials, peer_off, r, out=out, bias=bias, counters=counters if wait else None,
            counter_offsets=cnt_off if wait else None, ready_value=ready, workspace=acc,
            num_programs=reduce_sms if x.is_cuda else None, max_spin=max_spin, check_waits=False))
    join_side_stream(x.device, side)  # (out, written on the side stream, is held until here: no record_stream)
    check_wait_timeouts(x.device, "matmul_reduce_scatter (symmetric)")
    return out


def _rs_spec(t, x, weight, bias, scatter_dim, partial_dtype, out, config, chunked, reduce_sms, wait,
             producer_delay_cycles, max_spin, agree, x_scale, weight_scale, scaling, out_dtype):
    """What :func:`matmul_reduce_scatter_symmetric` derives from its arguments once they passed its
    checks (run here, inside the agreement check when ``agree``): the chunked views of ``x`` and
    its scales as ``(shape, strides)`` (None: the tensor as given), whether it is fp8, the output's
    shape and dtype, the workspace's size and layout, what a call adds to every counter and the
    GEMM's programs."""
    P = t.size
    with _agreed("matmul_reduce_scatter_symmetric", t, agree, x=x, weight=weight, bias=bias,
                 scatter_dim=scatter_dim, partial_dtype=partial_dtype, chunked=chunked, reduce_sms=reduce_sms,
                 wait=wait, x_scale=x_scale, weight_scale=weight_scale, scaling=scaling, out_dtype=out_dtype):
        xv, sv = _rs_input(x, weight, bias, scatter_dim, chunked, P, x_scale, weight_scale, scaling)
        check_dtype("partial_dtype", partial_dtype, SUPPORTED_DTYPES)
        check_out_dtype("out_dtype", out_dtype)
        check_int("reduce_sms", reduce_sms, min_value=1)
        n = weight.shape[0]
        out = output_buffer("out", out, tuple(xv.shape[1:-1]) + (n,), x.device if out is not None else "meta",
                            out_dtype or (x.dtype if sv is None else torch.bfloat16))  # (meta: its layout)
        _check_delay(producer_delay_cycles, x.device)
        spin_bound(max_spin)
        _check_config(config, xv, weight, None, "none", None, sv, weight_scale, scaling, partial_dtype)
    chunk_shape = tuple(xv.shape[1:-1]) + (n,)
    head = (4 * P + 255) // 256 * 256  # counters first: a fixed place whatever later shapes are
    nbytes = head + P * int(torch.Size(chunk_shape).numel()) * partial_dtype.itemsize
    per = tiles_per_chunk(int(torch.Size(chunk_shape[:-1]).numel()), n, kernel_config(config, n, xv.dtype))
    view = lambda v, of: None if v is of else (tuple(v.shape), v.stride())  # noqa: E731
    return (view(xv, x), sv is not None, None if sv is None else view(sv, x_scale), tuple(out.shape), out.dtype,
            nbytes, ("reduce_scatter", P, head, chunk_shape, partial_dtype), per,
            default_num_programs(x.device, reserve=reduce_sms), [None, None])


def _rs_reduce_args(t, ws, key, counters, partials):
    """The reduction's peer offsets of the partials and of the counters (in the order the peers
    complete this rank's chunk) and the size of its fp32 running sum, kept in ``ws.views[key]``
    (once per workspace and shape)."""
    r = t.rank
    order = _rs_order(r, t.size)
    return ws.keep(key, (device_ints([t.peer_slot_offset(ws, partials, j, r) for j in order], partials.device),
                         device_ints([t.peer_slot_offset(ws, counters, j, r) for j in order], partials.device),
                         partials[0].numel()))
