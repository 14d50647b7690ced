"""The host side of the in-kernel waits of the symmetric tensor-parallel schedules, on one device
and independent of process groups: the per-chunk ready flags a persistent GEMM spins on
(:class:`ChunkFlags`, kept with a workspace, written without an SM by ``cuStreamWriteValue32``
where this torch build has it, :func:`flag_writer_available`), the copy producer that pulls
chunks and raises their flags on a side stream (:func:`pull_chunks`), the side stream itself
(:func:`fork_side_stream`, :func:`join_side_stream`), and cached int64 device tensors
(:func:`device_ints`: offset tables a kernel reads, made without a host sync after the first
call)."""
from __future__ import annotations

import contextlib
import functools

import torch

from fusedpar.kernels.checks import check_int
from fusedpar.kernels.waits import canonical_device, check_not_capturing, ready_word


def flag_writer_available() -> bool:
    """Whether this torch build writes flags from the host queue without an SM
    (``_SymmetricMemory.stream_write_value32``)."""
    try:
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError:
        return False
    return hasattr(_SymmetricMemory, "stream_write_value32")


#: the value of a raised flag
READY = 1


class ChunkFlags:
    """Per-chunk ready flags of one workspace (:func:`chunk_flags`): a uint32 tensor (what
    ``cuStreamWriteValue32`` writes) viewed as int32 by the kernel. A flag is 0 (not ready) or
    :data:`READY`; a call lowers them all first (:meth:`reset`, on the current stream, which the
    previous call's readers and writers were joined into), then raises the flags it produces
    (:meth:`raise_flag`), so a flag its GEMM reads as ready was raised by this call whatever the
    previous one did (an exception between its raises and its join included). Every value written
    and waited for is a constant (``ready``: the device word holding :data:`READY` that the kernel
    reads), so a call's launches and stream writes are the same call after call."""

    def __init__(self, capacity: int, device: torch.device):
        with torch.inference_mode(False):  # kept for later calls
            self.u32 = torch.zeros(capacity, dtype=torch.uint32, device=device)
            self.i32 = self.u32.view(torch.int32)
        self.ready = ready_word(device, READY)
        self.sm_free = device.type == "cuda" and flag_writer_available()
        self.raises: dict = {}  # chunks -> the write that raises their flags (raise_flags)

    def raise_flag(self, chunk: int) -> None:
        """Set ``flag[chunk] = READY`` on the current stream, after the work queued before it."""
        if self.sm_free:
            from torch._C._distributed_c10d import _SymmetricMemory

            _SymmetricMemory.stream_write_value32(self.u32, chunk, READY)
        else:
            self.i32[chunk:chunk + 1].fill_(READY)

    def raise_flags(self, chunks: tuple) -> None:
        """:meth:`raise_flag` of every chunk in ``chunks`` at once (one write where they need no
        order among themselves: on CPU, where the consumer starts after them all): a fill of the
        first ``n`` flags where ``chunks`` are ``0..n-1`` in any order (the all-gather's), else an
        indexed fill; the write is made once per tuple of chunks."""
        write = self.raises.get(chunks)
        if write is None:
            n = len(chunks)
            if sorted(chunks) == list(range(n)):
                write = functools.partial(torch.Tensor.fill_, self.i32[:n], READY)
            else:
                write = functools.partial(torch.Tensor.index_fill_, self.i32, 0, device_ints(chunks, self.i32.device),
                                          READY)
            if len(self.raises) >= 64:
                self.raises.clear()
            self.raises[chunks] = write
        write()

    def reset(self) -> None:
        """Every flag back to 0 on the current stream: at the start of a call, after the consumer
        and the producers of the previous one (joined), before this call's producers (forked after
        it)."""
        self.i32.zero_()


_side_streams: dict = {}


_int_tensors: dict = {}


def chunk_flags(ws, chunks: int) -> ChunkFlags:
    """The ready flags kept with the workspace ``ws`` (a ``SymmetricWorkspace``; at least
    ``chunks`` of them, on its device): one set per transport (or group) and device, so ops of two
    transports never lower each other's flags."""
    f = ws.flags
    if f is None or f.u32.numel() < chunks:
        check_not_capturing("the chunk flags", ws.tensor.device)
        f = ws.flags = ChunkFlags(chunks, ws.tensor.device)
    return f


def fork_side_stream(device):
    """The side stream of ``device``, made to wait for the work queued so far on the current
    stream (None on CPU, where everything runs in program order)."""
    if device.type != "cuda":
        return None
    device = canonical_device(device)
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    side = _side_streams[device]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def on_stream(stream):
    """A context that makes ``stream`` current (nothing for ``None``: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def join_side_stream(device, side):
    """The current stream of ``device`` waits for ``side`` (nothing for ``None``)."""
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)


def pull_chunks(pulls, flags: ChunkFlags, *, raised: tuple, copy=None, delay_cycles: int = 0, local=None):
    """On the side stream: for ``(c, dst, src)`` in ``pulls`` (in order; tensors on the flags'
    device) ``copy(dst, src)`` (default ``dst.copy_(src)``) and raise flag ``c``. The side stream
    first waits for the current stream (the local chunk, the barrier, and the previous call's
    readers of the destinations). ``local``: a chunk already in place whose flag is raised on the
    current stream first. ``delay_cycles`` sleeps on the side stream first (tests: a late producer).
    Returns the side stream (``None`` on CPU, where the copies run right away and every flag is
    raised in one write after them: ``raised``, the chunks of ``pulls`` and ``local``, a tuple the
    caller keeps; the interpreter's consumer must find its flags set before it starts); join it
    after the consuming kernel."""
    check_int("delay_cycles", delay_cycles, min_value=0)
    device = flags.i32.device
    if local is not None and device.type == "cuda":
        flags.raise_flag(local)  # before the fork: the pulls' stream waits for it too
    side = fork_side_stream(device)
    if delay_cycles and side is None:
        raise ValueError(f"delay_cycles must be 0 on {device} (it sleeps on a CUDA producer stream), got {delay_cycles}")
    copy = copy or torch.Tensor.copy_
    if side is None:  # program order: every copy lands before the consumer is launched
        for _, dst, src in pulls:
            copy(dst, src)
        flags.raise_flags(raised)
        return None
    try:
        with on_stream(side):
            if delay_cycles:
                torch.cuda._sleep(int(delay_cycles))
            for c, dst, src in pulls:
                copy(dst, src)
                flags.raise_flag(c)
    except BaseException:
        join_side_stream(device, side)  # what was queued: before the next call's reset
        raise
    return side


def device_ints(values, device) -> torch.Tensor:
    """A cached int64 device tensor of ``values``: made once (a synchronous host-to-device copy),
    then reused, so that no call blocks the host on a stream that waits for peers (1024 kept: a
    caller keeps what it reuses, as a workspace's views do)."""
    values = tuple(values)
    t = _int_tensors.get((device, values))  # (a tensor's device: the key canonical_device gives it)
    if t is None:
        device = canonical_device(device)
        t = _int_tensors.get((device, values))
        if t is None:
            check_not_capturing(f"an offset table {values}", device)  # (a synchronous copy)
            if len(_int_tensors) >= 1024:
                _int_tensors.clear()
            with torch.inference_mode(False):  # kept for later calls
                t = _int_tensors[device, values] = torch.tensor(values, dtype=torch.int64, device=device)
    return t
