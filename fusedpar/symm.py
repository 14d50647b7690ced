"""Symmetric-memory transport for the tensor-parallel GEMMs, and its single-GPU emulation.

Inside one NVLink domain every rank can map its peers' buffers
(``torch.distributed._symmetric_memory``). The all-gather side then needs neither NCCL nor one
GEMM launch per chunk:

1. each rank copies its shard into slot ``rank`` of its symmetric buffer (``[P, *shard]``),
   and a barrier tells everyone the slots are written;
2. a side stream *pulls* the peers' slots into the local buffer with device-to-device copies
   (copy engines: no SM is used), in the order ``rank + 1, rank + 2, ...``, and after each copy
   writes that chunk's ready flag with ``cuStreamWriteValue32`` (no SM either; it fences the copy);
3. one persistent GEMM (:func:`fusedpar.kernels.persistent_gemm.persistent_matmul`) starts at the
   local chunk and, before each chunk's first load, spins on the chunk's flag (acquire).

The reduce-scatter side inverts it: the persistent GEMM computes the partial for peer
``rank + 1`` first and the local chunk last, into the local symmetric buffer, releasing a
per-chunk completion counter after every tile; concurrently, a small reduction kernel
(:func:`~fusedpar.kernels.persistent_gemm.chunk_reduce`, on a few SMs left free by the GEMM)
reads each peer's partial of *this* rank's chunk over NVLink as soon as that peer's counter says
it is complete, summing in fp32.

Flags never need resetting: a call waits for ``flag >= epoch`` and every call raises the epoch.
Where peers are not reachable this way (CPU tensors, gloo, no symmetric memory in this torch
build, ranks on different hosts, GPUs without peer access) the portable path of
:mod:`fusedpar.ops.tensor_parallel` is used; ``transport="auto"`` decides once per group, with
the same answer on every rank, and ``"symmetric"`` / ``"portable"`` force it (forcing
``"symmetric"`` where it cannot work is a clear error). Both paths compute the same numbers.

:class:`ChunkFlags` and the ``emulated_*`` functions run the same producer and kernels on one
GPU with the "peers" being buffers on that device: the waiting, the flags and the overlap are
exercised and timed without a second GPU (benchmarks/persistent.py, tests/test_symm.py).
"""
from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedpar.ops import comm
from fusedpar.kernels.checks import check_divisible
from fusedpar.kernels.persistent_gemm import (
    chunk_reduce,
    chunk_view,
    default_num_programs,
    kernel_config,
    persistent_matmul,
    tiles_per_chunk,
)

TRANSPORTS = ("auto", "symmetric", "portable")
# what ``transport=None`` means in fusedpar.ops: "portable" until the symmetric path has passed its
# GPU tests on hardware (FUSEDPAR_TRANSPORT=auto opts in)
DEFAULT_TRANSPORT = os.environ.get("FUSEDPAR_TRANSPORT", "portable")
# SMs the persistent reduce-scatter GEMM leaves to the concurrent chunk_reduce kernel
RS_REDUCE_SMS = int(os.environ.get("FUSEDPAR_RS_REDUCE_SMS", "8"))
# SMs the emulation's waiting GEMM leaves free: peer copies run on copy engines, but a driver may
# serve a same-device copy with a kernel, which must find an SM while the GEMM programs spin
EMULATION_FREE_SMS = 2


# ----------------------------------------------------------------------------------------------
# transport selection
# ----------------------------------------------------------------------------------------------
_probe_cache: dict = {}


def _symm_module():
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401
    except ImportError:
        return None
    return symm_mem


def _flag_writer_available() -> bool:
    try:
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError:
        return False
    return hasattr(_SymmetricMemory, "stream_write_value32")


def symmetric_status(x: torch.Tensor, group=None) -> tuple[bool, str]:
    """Whether the symmetric-memory transport can serve ``group`` for tensors like ``x``, and why
    not. The answer is the same on every rank of the group: local facts (device type, backend,
    torch build) are equal by construction, and the cross-rank facts (one host, peer access) are
    gathered once per group and cached, which is a collective the first time."""
    if x.device.type != "cuda":
        return False, f"tensors are on {x.device.type}, the symmetric transport needs CUDA tensors"
    if not dist.is_available() or not dist.is_initialized():
        return False, "torch.distributed is not initialised"
    group = comm.resolve_group(group)
    backend = dist.get_backend(group)
    if backend != "nccl":
        return False, f"process group backend is {backend!r}, the symmetric transport runs with NCCL groups"
    if _symm_module() is None:
        return False, "this torch build has no torch.distributed._symmetric_memory"
    if not _flag_writer_available():
        return False, "this torch build lacks _SymmetricMemory.stream_write_value32 (SM-free flag writes)"
    key = (id(group), x.device.index)
    if key not in _probe_cache:
        size = dist.get_world_size(group)
        info = [None] * size
        dist.all_gather_object(info, (socket.gethostname(), torch.cuda.current_device()), group=group)
        hosts = {h for h, _ in info}
        me = torch.cuda.current_device()
        peer_ok = all(d == me or torch.cuda.can_device_access_peer(me, d) for _, d in info)
        ok = torch.tensor([1 if (len(hosts) == 1 and peer_ok) else 0], device=x.device, dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if ok.item():
            _probe_cache[key] = (True, "one host, peer access between all GPUs of the group")
        elif len(hosts) > 1:
            _probe_cache[key] = (False, f"the group spans {len(hosts)} hosts; symmetric memory needs one NVLink domain")
        else:
            _probe_cache[key] = (False, "some GPUs of the group cannot access each other's memory (no P2P)")
    return _probe_cache[key]


def resolve_transport(transport: str | None, x: torch.Tensor, group=None) -> str:
    """``"symmetric"`` or ``"portable"`` for ``transport`` in ``("auto", "symmetric", "portable")``
    (``None``: :data:`DEFAULT_TRANSPORT`). Raises ``ValueError`` for an unknown name, or when
    ``"symmetric"`` is forced where it cannot run (before any data moves, on every rank alike)."""
    if transport is None:
        transport = DEFAULT_TRANSPORT
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "portable" or comm.group_size(group) == 1:
        return "portable"
    ok, reason = symmetric_status(x, group)
    if transport == "symmetric" and not ok:
        raise ValueError(f"transport='symmetric' is not available here: {reason}")
    return "symmetric" if ok else "portable"


# ----------------------------------------------------------------------------------------------
# flags and the copy producer
# ----------------------------------------------------------------------------------------------
class ChunkFlags:
    """Per-chunk ready flags of one device: a uint32 tensor (what ``cuStreamWriteValue32``
    writes) viewed as int32 by the kernel, and a host-side epoch. ``begin()`` starts a call: the
    kernel then waits for ``flag >= epoch``, so the previous call's flags read as not ready."""

    def __init__(self, capacity: int, device: torch.device):
        self.u32 = torch.zeros(capacity, dtype=torch.uint32, device=device)
        self.i32 = self.u32.view(torch.int32)
        self.epoch = 0
        self.sm_free = device.type == "cuda" and _flag_writer_available()

    def begin(self) -> int:
        if self.epoch >= 2 ** 31 - 2:
            self.i32.zero_()  # stream-ordered before every later write and wait
            self.epoch = 0
        self.epoch += 1
        return self.epoch

    def raise_flag(self, chunk: int) -> None:
        """Set ``flag[chunk] = epoch`` on the current stream, after the work queued before it."""
        if self.sm_free:
            from torch._C._distributed_c10d import _SymmetricMemory

            _SymmetricMemory.stream_write_value32(self.u32, chunk, self.epoch)
        else:
            self.i32[chunk:chunk + 1].fill_(self.epoch)


_flags: dict = {}
_side_streams: dict = {}


def _flags_for(device: torch.device, chunks: int) -> ChunkFlags:
    f = _flags.get(device)
    if f is None or f.u32.numel() < chunks:
        f = _flags[device] = ChunkFlags(max(chunks, 64), device)
    return f


def _side_stream(device: torch.device):
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _side_streams[device]


def pull_chunks(gathered: torch.Tensor, sources, order, flags: ChunkFlags, *, delay_cycles: int = 0,
                repeat: int = 1):
    """On the side stream: for ``c`` in ``order`` copy ``sources(c)`` into ``gathered[c]`` and
    raise flag ``c``. The side stream first waits for the current stream (the local chunk, the
    barrier, and the previous call's readers of ``gathered``). ``delay_cycles`` sleeps on the side
    stream first (tests: a late producer); ``repeat > 1`` copies every chunk that many times (the
    emulation of a link slower than a local copy). Returns the side stream (``None`` on CPU, where the
    copies run right away: the interpreter's consumer must find its flags set before it starts);
    the caller joins it after the consuming kernel with :func:`_join`."""
    side = _fork(gathered.device)
    if delay_cycles and side is None:
        raise ValueError("delay_cycles needs a CUDA device (it sleeps on the producer's stream)")
    with _on(side):
        if delay_cycles:
            torch.cuda._sleep(int(delay_cycles))
        for c in order:
            for _ in range(repeat):
                gathered[c].copy_(sources(c))
            flags.raise_flag(c)
    return side


def _fork(device):
    """The side stream of ``device``, made to wait for the current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _on(stream):
    import contextlib

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _join(device, side):
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)


def _ag_programs(device, flags: ChunkFlags) -> int:
    # a flag written by a kernel (no cuStreamWriteValue32) needs an SM the waiting GEMM leaves free
    return default_num_programs(device, reserve=0 if flags.sm_free else 2)


def _ag_launch(gathered, out_view, weight, bias, activation, first, flags, preact_view, config, *, wait=True,
               num_programs=None):
    persistent_matmul(
        gathered, weight, bias, first_chunk=first, out=out_view, activation=activation,
        wait_flags=flags.i32 if wait else None, wait_mode="spin" if wait else "none", ready_value=flags.epoch,
        preact_out=preact_view, config=config, num_programs=num_programs or _ag_programs(gathered.device, flags),
    )


def _out_shape(x, gather_dim, P, n_out):
    shape = list(x.shape[:-1]) + [n_out]
    shape[gather_dim] *= P
    return shape


def _n_out(weight, activation):
    from fusedpar.kernels import ACTIVATIONS

    return weight.shape[0] // 2 if ACTIVATIONS[activation][1] else weight.shape[0]


# ----------------------------------------------------------------------------------------------
# validation (local, before any barrier or transfer: the same error on every rank)
# ----------------------------------------------------------------------------------------------
def _validate(op, x, weight, bias, activation, dim, dim_name, chunks=None):
    from fusedpar.kernels import ACTIVATIONS

    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{op}: x must be 2-D [tokens, in] or 3-D [batch, seq, in], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must have shape [out, {x.shape[-1]}] (nn.Linear layout), "
                         f"got {tuple(weight.shape)}")
    if weight.device != x.device or weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight must match x's device and dtype ({x.device}, {x.dtype}), "
                        f"got ({weight.device}, {weight.dtype})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if ACTIVATIONS[activation][1] and weight.shape[0] % 2:
        raise ValueError(f"{op}: activation {activation!r} needs an even number of weight rows, got {weight.shape[0]}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must be a tensor of shape ({weight.shape[0]},), got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias must be on x's device ({x.device}), got {bias.device}")
    if not isinstance(dim, int) or not 0 <= dim < x.dim() - 1:
        raise ValueError(f"{op}: {dim_name} must be a token dim of x (0..{x.dim() - 2}), got {dim!r}")
    if chunks is not None:
        check_divisible(f"{op}: x.shape[{dim}]", x.shape[dim], chunks)


# ----------------------------------------------------------------------------------------------
# symmetric-memory workspaces
# ----------------------------------------------------------------------------------------------
@dataclass
class _Workspace:
    tensor: torch.Tensor  # uint8, symmetric, zeroed at creation
    handle: object
    nbytes: int
    counter_base: int = 0  # reduce-scatter: value of every completion counter before the next call


_workspaces: dict = {}


def _workspace(purpose: str, group, device, nbytes: int) -> _Workspace:
    """A symmetric uint8 buffer of at least ``nbytes`` on every rank of ``group``, one per
    ``purpose`` (collective when it is created or grown; every rank asks for the same size since
    TP shapes are equal)."""
    symm_mem = _symm_module()
    key = (purpose, id(group), device.index)
    ws = _workspaces.get(key)
    if ws is None or ws.nbytes < nbytes:
        size = max(nbytes, 2 * ws.nbytes if ws else 0)
        if symm_mem is not None and hasattr(symm_mem, "enable_symm_mem_for_group"):
            # needed by older torch releases; newer ones deprecate it as a no-op requirement
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group.group_name)
        t, hdl = _new_workspace(group, device, size)
        ws = _workspaces[key] = _Workspace(t, hdl, size)
    return ws


def _new_workspace(group, device, size: int):
    """``(tensor, handle)``: a zeroed symmetric uint8 tensor of ``size`` bytes and its
    rendezvous handle (``barrier``, ``buffer_ptrs``, ``get_remote_tensor``). Tests replace it
    with file-backed shared memory across CPU processes (tests/test_symm.py)."""
    t = _symm_module().empty(size, dtype=torch.uint8, device=device)
    t.zero_()  # counters start at 0; ordered before the first call's barrier on this stream
    return t, _symm_module().rendezvous(t, group.group_name)


def _typed(ws: _Workspace, offset_bytes: int, shape, dtype) -> torch.Tensor:
    numel = int(torch.Size(shape).numel())
    nbytes = numel * dtype.itemsize
    return ws.tensor[offset_bytes:offset_bytes + nbytes].view(dtype).view(shape)


_int_tensors: dict = {}


def _device_ints(values, device) -> torch.Tensor:
    """A cached int64 device tensor of ``values``: made once (a synchronous host-to-device copy),
    then reused, so that no call blocks the host on a stream that waits for peers."""
    key = (device, tuple(values))
    t = _int_tensors.get(key)
    if t is None:
        t = _int_tensors[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return t


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------------------------
# all_gather_matmul over symmetric memory
# ----------------------------------------------------------------------------------------------
def all_gather_matmul_symmetric(x, weight, bias=None, *, group=None, gather_dim=1, activation="none",
                                out=None, preact_out=None, gathered_out=None, config=None):
    """Forward of ``all_gather_matmul`` with the symmetric transport: ``x`` is this rank's shard
    (equal shapes on every rank), the result ``act(all_gather(x, gather_dim) @ W^T + bias)``.
    Arguments are checked before the first barrier.

    out:          ``all_gather(x) @ W^T`` layout (``x.shape`` with the gather dim ``P`` times
                  larger, ``N`` features); allocated when omitted.
    preact_out:   optional chunk-major ``[P, *x.shape[:-1], weight.shape[0]]`` pre-activation.
    gathered_out: optional ``[P, *x.shape]`` tensor receiving a copy of the gathered input (the
                  symmetric buffer is reused by the next call), for the weight gradient.
    """
    _validate("all_gather_matmul", x, weight, bias, activation, gather_dim, "gather_dim")
    group = comm.resolve_group(group)
    P, r = comm.group_size(group), comm.group_rank(group)
    n_out = _n_out(weight, activation)
    if out is None:
        out = torch.empty(_out_shape(x, gather_dim, P, n_out), dtype=x.dtype, device=x.device)
    ws = _workspace("all_gather", group, x.device, P * x.numel() * x.element_size())
    gathered = _typed(ws, 0, (P,) + tuple(x.shape), x.dtype)
    flags = _flags_for(x.device, P)
    hdl = ws.handle
    hdl.barrier(channel=0)  # every peer finished reading our slot in the previous call
    gathered[r].copy_(x)
    hdl.barrier(channel=1)  # every slot holds its owner's shard
    flags.begin()
    flags.raise_flag(r)

    def source(c):
        return _typed(_PeerView(_remote_bytes(hdl, c, ws.nbytes)), 0, (P,) + tuple(x.shape), x.dtype)[c]

    order = [(r + i) % P for i in range(1, P)]
    side = pull_chunks(gathered, source, order, flags)
    _ag_launch(gathered, chunk_view(out, gather_dim, P), weight, bias, activation, r, flags, preact_out, config)
    if gathered_out is not None:
        gathered_out.copy_(gathered)
    _join(x.device, side)
    return out


def _remote_bytes(hdl, peer: int, nbytes: int) -> torch.Tensor:
    """Peer ``peer``'s copy of our rendezvoused tensor (the allocation may sit ``hdl.offset``
    bytes into the symmetric buffer), as ``nbytes`` uint8 mapped into this process."""
    if hasattr(hdl, "get_remote_tensor"):
        return hdl.get_remote_tensor(peer, (nbytes,), torch.uint8)
    return hdl.get_buffer(peer, (nbytes,), torch.uint8, int(getattr(hdl, "offset", 0)))


@dataclass
class _PeerView:
    """A peer's symmetric workspace, mapped into this process as a uint8 tensor."""

    tensor: torch.Tensor


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter over symmetric memory
# ----------------------------------------------------------------------------------------------
def _rs_order(r: int, P: int):
    """Peers in the order they complete the partial of chunk ``r``: peer ``j`` computes chunk
    ``r`` at step ``(r - j - 1) mod P``, so ``r - 1`` first and ``r`` itself last."""
    return [(r - 1 - k) % P for k in range(P)]


def matmul_reduce_scatter_symmetric(x, weight, bias=None, *, group=None, scatter_dim=1,
                                    partial_dtype=torch.float32, out=None, config=None,
                                    reduce_sms=RS_REDUCE_SMS, chunked=False):
    """Forward of ``matmul_reduce_scatter`` with the symmetric transport: ``x`` is
    ``[batch, seq, in_shard]`` (or ``[tokens, in_shard]``), the result this rank's
    ``[batch, seq/P, out]`` chunk of ``sum over ranks (x @ W^T) + bias``. ``chunked=True``: ``x``
    is already a chunked view ``[P, *chunk rows, in_shard]`` (chunk ``c`` goes to rank ``c``)."""
    group = comm.resolve_group(group)
    P, r = comm.group_size(group), comm.group_rank(group)
    if chunked:
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or x.shape[0] != P:
            raise ValueError(f"matmul_reduce_scatter: a chunked x must be [P={P}, *rows, in], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        _validate("matmul_reduce_scatter", x[0], weight, bias, "none", 0, "scatter_dim")
        xv = x
    else:
        _validate("matmul_reduce_scatter", x, weight, bias, "none", scatter_dim, "scatter_dim", chunks=P)
        xv = chunk_view(x, scatter_dim, P)
    N = weight.shape[0]
    chunk_shape = tuple(xv.shape[1:-1]) + (N,)
    if out is None:
        out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
    # counters first (a fixed place whatever the shapes of later calls), then the partials
    head = _align(4 * P)
    ws = _workspace("reduce_scatter", group, x.device, head + P * int(torch.Size(chunk_shape).numel())
                    * partial_dtype.itemsize)
    counters = _typed(ws, 0, (P,), torch.int32)
    partials = _typed(ws, head, (P,) + chunk_shape, partial_dtype)
    per = tiles_per_chunk(int(torch.Size(chunk_shape[:-1]).numel()), N, kernel_config(config, N, x.dtype))
    base = ws.counter_base
    hdl = ws.handle
    hdl.barrier(channel=0)  # peers finished reading our partials of the previous call
    if base + per >= 2 ** 31 - 1:
        counters.zero_()
        hdl.barrier(channel=1)
        base = 0
    ws.counter_base = base + per
    esz = partials.element_size()
    ptrs = hdl.buffer_ptrs  # every rank's tensor sits at the same offset in its buffer
    order = _rs_order(r, P)
    diffs = [int(ptrs[j]) - int(ptrs[r]) for j in order]
    peer_off = _device_ints([d // esz for d in diffs], x.device)
    cnt_off = _device_ints([d // 4 for d in diffs], x.device)

    def gemm():
        persistent_matmul(xv, weight, first_chunk=(r + 1) % P, out=partials, wait_mode="none",
                          signal_counters=counters, config=config,
                          num_programs=default_num_programs(x.device, reserve=reduce_sms))

    def reduce():
        chunk_reduce(partials, peer_off, r, out=out, bias=bias, counters=counters, counter_offsets=cnt_off,
                     ready_value=base + per, num_programs=reduce_sms if x.is_cuda else None)

    side = _fork(x.device)
    if side is None:  # CPU (interpreter): own GEMM first; the reduce then waits for the peers' counters
        gemm()
        reduce()
        return out
    with _on(side):
        reduce()  # launched first: spins on the peers' counters while the GEMM computes
    gemm()
    _join(x.device, side)
    out.record_stream(side)
    return out


# ----------------------------------------------------------------------------------------------
# single-GPU emulation: the peers are buffers on this device
# ----------------------------------------------------------------------------------------------
def emulated_all_gather_matmul(peers, weight, bias=None, *, rank=0, gather_dim=1, activation="none", out=None,
                               gathered=None, wait=True, delay_cycles=0, copy_repeat=1, config=None,
                               num_programs=None):
    """One rank's all-gather GEMM with ``peers[c]`` (``[P, *shard]``, on this device) standing in
    for the peers' symmetric slots: the local shard ``peers[rank]`` is copied on the current
    stream, the others are pulled on the side stream with per-chunk flags, and the persistent
    GEMM waits per chunk. ``wait=False`` launches it without waiting (tests: a missing wait must
    show as wrong data); ``delay_cycles`` makes the producer late on purpose; ``copy_repeat``
    copies each chunk that many times (a link that many times slower than a local copy)."""
    if not isinstance(peers, torch.Tensor) or peers.dim() not in (3, 4):
        raise ValueError("peers must be a [P, *shard] tensor (shard 2-D or 3-D), got "
                         + (f"shape {tuple(peers.shape)}" if isinstance(peers, torch.Tensor) else type(peers).__name__))
    P = peers.shape[0]
    shard = peers[0]
    _validate("emulated_all_gather_matmul", shard, weight, bias, activation, gather_dim, "gather_dim")
    if not 0 <= rank < P:
        raise ValueError(f"rank must be in [0, {P}), got {rank}")
    n_out = _n_out(weight, activation)
    if out is None:
        out = torch.empty(_out_shape(shard, gather_dim, P, n_out), dtype=peers.dtype, device=peers.device)
    if gathered is None:
        gathered = torch.empty_like(peers)
    flags = _flags_for(peers.device, P)
    gathered[rank].copy_(peers[rank])
    flags.begin()
    flags.raise_flag(rank)
    order = [(rank + i) % P for i in range(1, P)]
    side = pull_chunks(gathered, lambda c: peers[c], order, flags, delay_cycles=delay_cycles, repeat=copy_repeat)
    if num_programs is None:
        num_programs = default_num_programs(peers.device, reserve=EMULATION_FREE_SMS)
    _ag_launch(gathered, chunk_view(out, gather_dim, P), weight, bias, activation, rank, flags, None, config,
               wait=wait, num_programs=num_programs)
    _join(peers.device, side)
    return out


def emulated_matmul_reduce_scatter(x, weight, bias=None, *, world, rank=0, scatter_dim=1,
                                   partial_dtype=torch.float32, out=None, partials=None, wait=True, config=None,
                                   reduce_sms=RS_REDUCE_SMS, gemm_delay_cycles=0):
    """One rank's reduce-scatter GEMM on one GPU, ``world`` chunks along ``scatter_dim``. The
    persistent GEMM computes every chunk's partial (peer ``rank + 1``'s first, the own chunk
    last) and releases a counter per chunk; concurrently, on a side stream and ``reduce_sms``
    SMs, ``chunk_reduce`` sums in completion order the partials a real rank would read from its
    peers. Here "peer ``j``'s partial of chunk ``rank``" is this GPU's partial of the chunk it
    completes at the same step, so the result is ``bias + sum_c x_c @ W^T`` over the chunks
    ``x_c``. ``wait=False`` reads without waiting on the counters (tests: wrong data);
    ``gemm_delay_cycles`` starts the GEMM late on purpose. On CPU (interpreter) the GEMM runs
    first, then the reduction finds its counters complete."""
    P = world
    _validate("emulated_matmul_reduce_scatter", x, weight, bias, "none", scatter_dim, "scatter_dim", chunks=P)
    if not 0 <= rank < P:
        raise ValueError(f"rank must be in [0, {P}), got {rank}")
    xv = chunk_view(x, scatter_dim, P)
    N = weight.shape[0]
    chunk_shape = tuple(xv.shape[1:-1]) + (N,)
    if out is None:
        out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
    if partials is None:
        partials = torch.empty((P,) + chunk_shape, dtype=partial_dtype, device=x.device)
    counters = torch.zeros(P, dtype=torch.int32, device=x.device)
    cfg = None if config is None else dict(config)
    per = tiles_per_chunk(int(torch.Size(chunk_shape[:-1]).numel()), N, kernel_config(cfg, N, x.dtype))
    done = [(rank + 1 + k) % P for k in range(P)]  # completion order of this GPU's chunks
    peer_off = _device_ints([(c - rank) * partials.stride(0) for c in done], x.device)
    cnt_off = _device_ints([c - rank for c in done], x.device)

    def gemm():
        persistent_matmul(xv, weight, first_chunk=(rank + 1) % P, out=partials, wait_mode="none",
                          signal_counters=counters, config=cfg,
                          num_programs=default_num_programs(x.device, reserve=reduce_sms))

    def reduce():
        chunk_reduce(partials, peer_off, rank, out=out, bias=bias, counters=counters if wait else None,
                     counter_offsets=cnt_off if wait else None, ready_value=per,
                     num_programs=reduce_sms if x.is_cuda else None)

    side = _fork(x.device)
    if side is None:
        if gemm_delay_cycles:
            raise ValueError("gemm_delay_cycles needs a CUDA device")
        gemm()
        reduce()
        return out
    with _on(side):
        reduce()  # launched first: it spins on the counters while the GEMM computes
    if gemm_delay_cycles:
        torch.cuda._sleep(int(gemm_delay_cycles))
    gemm()
    _join(x.device, side)
    out.record_stream(side)
    return out
