"""The one communication interface every overlapped op is written against.

An op (all-gather + GEMM, GEMM + reduce-scatter, GEMM + all-reduce, the ring-attention KV
rotation, the MoE all-to-all-v chunks) sees one rank of a group through a :class:`Transport`: its
``rank`` and ``size`` and asynchronous transfers that return a handle, waited on right before the
chunk it delivers is used. Implementations:

* :class:`PortableTransport` -- ``torch.distributed`` over a process group (NCCL, gloo; any
  topology). The default.
* ``SymmetricTransport`` (:mod:`fusedpar.ops.comm.symmetric`) -- the portable transfers plus
  symmetric-memory buffers and in-kernel waits (one NVLink domain, NCCL groups).
* :class:`EmulatedTransport` -- ``size`` ranks emulated in one process on one device: every peer
  is a mirror of this rank, which runs one rank of a schedule on one GPU (benchmarks) or on CPU
  (tests).

:func:`get_transport` builds one by name (:func:`check_transport_name`, the one name check);
:func:`transport_from_id` resolves a transport id (:mod:`.keys`)."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Sequence

import torch

from fusedpar.kernels.checks import check_bool, check_int
from fusedpar.kernels.waits import canonical_device, capturing, check_not_capturing
from fusedpar.ops.comm import collectives
from fusedpar.ops.comm.keys import register_transport, resolve_transport_id

# SMs the emulation's waiting GEMM leaves free: peer copies run on copy engines, but a driver may
# serve a same-device copy with a kernel, which must find an SM while the GEMM programs spin
EMULATION_FREE_SMS = 2


#: the context of a transport that needs none around an op's transfers
NO_SCOPE = contextlib.nullcontext()


class Transport:
    """One rank's view of a communication group. Every transfer is asynchronous and returns a
    handle with ``wait()``; after it the received buffer is valid (on a GPU: for work queued on
    the current stream from then on)."""

    #: name of the implementation ("portable", "symmetric", "emulated")
    name = "abstract"
    #: whether the symmetric-memory schedules (in-kernel waits) can run on this transport
    in_kernel_waits = False

    def __init__(self, size: int, rank: int):
        self.size = size
        self.rank = rank
        #: the string that names this transport in an op's schema (:mod:`fusedpar.ops.common`)
        self.transport_id = register_transport(self)
        #: buffers the schedules keep between calls, per purpose, dtype and device
        self.scratch: dict = {}
        #: what a schedule's checks derived, per description of its arguments
        self.specs: dict = {}
        #: buffers ops captured in a CUDA graph used (:func:`hold_for_graphs`), never dropped
        self.graph_buffers: dict = {}

    def transfers(self, device: torch.device):
        """A context around one op's transfers on ``device``: while it is open the op holds every
        buffer it passes to a transfer and waits for every handle before it ends, so a transport
        need not protect the buffers from the allocator (no ``record_stream``), and it may resolve
        its streams once per op and join its side stream once at the end. Default: nothing."""
        return NO_SCOPE

    # --- point to point --------------------------------------------------------------------
    def send_recv(self, send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None,
                  src: int | None) -> collectives.Handle:
        """Send ``send`` to rank ``dst`` and receive ``recv`` from rank ``src`` (either may be None)."""
        raise NotImplementedError

    def ring_shift(self, send: torch.Tensor, recv: torch.Tensor, *, step: int = 1) -> collectives.Handle:
        """Send to ``rank + step`` and receive from ``rank - step`` (mod size)."""
        return self.send_recv(send, (self.rank + step) % self.size, recv, (self.rank - step) % self.size)

    # --- collectives -----------------------------------------------------------------------
    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> collectives.Handle:
        """``out`` (``[size * n, ...]``) receives every rank's ``inp`` along dim 0."""
        raise NotImplementedError

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor) -> collectives.Handle:
        """``out`` receives the sum over ranks of this rank's dim-0 block of ``inp``."""
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor) -> collectives.Handle:
        """In-place sum over ranks (``t`` contiguous)."""
        raise NotImplementedError

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None) -> collectives.Handle:
        """All-to-all(-v) along dim 0; splits are row counts per rank (``None``: equal blocks)."""
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class PortableTransport(Transport):
    """``torch.distributed`` over ``group`` (``None``: the default group, or a single rank when
    torch.distributed is not initialised). ``weak_group``: hold the group by a weak reference (a
    transport cached per group, which must not keep it alive); using the transport once the group
    is gone raises."""

    name = "portable"

    def __init__(self, group=None, *, weak_group: bool = False):
        group = collectives.resolve_group(group)
        super().__init__(collectives.group_size(group), collectives.group_rank(group))
        self._group = weakref.ref(group) if weak_group and group is not None else group

    @property
    def group(self):
        group = self._group
        if type(group) is weakref.ref:
            group = group()
            if group is None:
                raise RuntimeError(f"{self!r}: its process group no longer exists (destroyed and freed), got a "
                                   "transport of it; use the transport of a live group")
        return group

    def send_recv(self, send, dst, recv, src):
        return collectives.send_recv(send, dst, recv, src, self.group)

    def all_gather_into(self, out, inp):
        return collectives.all_gather_into(out, inp, self.group)

    def reduce_scatter_into(self, out, inp):
        return collectives.reduce_scatter_into(out, inp, self.group)

    def all_reduce(self, t):
        return collectives.all_reduce(t, self.group)

    def all_to_all(self, out, inp, out_splits=None, in_splits=None):
        return collectives.all_to_all(out, inp, out_splits, in_splits, self.group)


class SymmetricWorkspace:
    """A byte buffer (``tensor``, uint8, zeroed at creation) that every rank of a group holds at
    the same size, with the typed views the schedules lay over it. ``ready``: this rank's int32
    device word that a reduce-scatter's reduction waits for (written by stream-ordered work only,
    from the completion counters in the buffer); ``flags``: an all-gather's chunk flags (local,
    made by the schedule); ``handle``: the symmetric-memory rendezvous handle (``None`` in the
    emulation)."""

    def __init__(self, tensor: torch.Tensor, nbytes: int, handle=None):
        self.tensor, self.nbytes, self.handle = tensor, nbytes, handle
        self.ready = torch.zeros(1, dtype=torch.int32, device=tensor.device)
        self.flags = None
        #: views a schedule lays over the buffer, per shape (:meth:`keep`: at most 64 shapes)
        self.views: dict = {}
        self.fp32 = None  # a local fp32 buffer (:meth:`fp32_scratch`) and its views per size
        self.fp32_views: dict = {}

    def keep(self, key, views):
        """``views[key] = views`` (what a schedule lays over the buffer for one shape), forgetting
        the others first once 64 shapes are kept (views hold no memory of their own)."""
        if len(self.views) >= 64:
            self.views.clear()
        self.views[key] = views
        return views

    def fp32_scratch(self, n: int) -> torch.Tensor:
        """``n`` (at least 1) fp32 elements of this rank's local buffer on the workspace's device:
        one buffer for every shape, grown to the largest ``n`` asked for (a reduction's running
        sum), not one per shape."""
        view = self.fp32_views.get(n)
        if view is None:
            if self.fp32 is None or self.fp32.numel() < n:
                with torch.inference_mode(False):  # kept for later calls
                    self.fp32 = torch.empty(max(n, 1), dtype=torch.float32, device=self.tensor.device)
                self.fp32_views = {}
            if len(self.fp32_views) >= 64:
                self.fp32_views.clear()
            view = self.fp32_views[n] = self.fp32[:max(n, 1)]
        return view

    def typed(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """The ``shape`` tensor of ``dtype`` at byte ``offset`` of the buffer (a view)."""
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if offset % dtype.itemsize or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"a {dtype} view of shape {tuple(shape)} at byte offset {offset} must fit aligned in the "
                             f"{self.nbytes}-byte workspace, got one ending at byte {offset + nbytes}")
        return self.tensor[offset:offset + nbytes].view(dtype).view(shape)


def cached_workspace(cache: dict, key, nbytes: int, create) -> SymmetricWorkspace:
    """``cache[key]`` (``key``: a purpose and a device), replaced by ``create(size)`` when missing
    or smaller than ``nbytes`` (the new size at least doubles, so a slowly growing shape does not
    reallocate every call); never inside a CUDA-graph capture (its zeroing would be captured, not
    run: warm up first)."""
    ws = cache.get(key)
    if ws is None or ws.nbytes < nbytes:
        check_not_capturing(f"a {nbytes}-byte {key[0]!r} workspace", key[1])
        with torch.inference_mode(False):  # kept for later calls (made under inference mode, the
            # later calls' in-place writes outside it would raise)
            ws = cache[key] = create(max(nbytes, 2 * ws.nbytes if ws is not None else 0))
    return ws


def hold_for_graphs(transport, device: torch.device, *buffers) -> None:
    """While the current stream of ``device`` is being captured in a CUDA graph, keep ``buffers``
    (what the op being captured reads or writes: a workspace, views of a kept buffer) alive as long
    as ``transport`` (``graph_buffers``), whatever its caches evict or replace later: a graph
    replays the addresses it captured."""
    if capturing(device):
        held = getattr(transport, "graph_buffers", None)
        if held is None:
            held = transport.graph_buffers = {}
        for b in buffers:
            held[id(b)] = b


class SymmetricBuffers:
    """What the in-kernel-wait schedules need from a transport beyond :class:`Transport`.

    Slot arrays are ``[P, ...]`` views made by :meth:`SymmetricWorkspace.typed`; ``peer_slot``
    and ``peer_slot_offset`` name peer ``peer``'s copy of ``slots[slot]``."""

    def symmetric_workspace(self, purpose: str, device, nbytes: int) -> SymmetricWorkspace:
        """This rank's workspace for ``purpose`` with at least ``nbytes`` (collective when it is
        created or grown on a real group: every rank asks for the same size)."""
        raise NotImplementedError

    def symmetric_barrier(self, ws: SymmetricWorkspace, channel: int = 0) -> None:
        """Every rank reached this point (stream-ordered on a GPU)."""
        raise NotImplementedError

    def peer_slot(self, ws: SymmetricWorkspace, slots: torch.Tensor, peer: int, slot: int) -> torch.Tensor:
        """Peer ``peer``'s ``slots[slot]``, readable (copyable) from this process."""
        raise NotImplementedError

    def peer_slot_offset(self, ws: SymmetricWorkspace, slots: torch.Tensor, peer: int, slot: int) -> int:
        """Elements from this rank's ``slots[slot]`` to peer ``peer``'s (a kernel's pointer offset)."""
        raise NotImplementedError

    def peer_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One pull: ``dst.copy_(src)`` on the current stream."""
        dst.copy_(src)

    def free_sms(self, device: torch.device) -> int:
        """SMs a waiting persistent GEMM leaves free for the work it waits for."""
        return 0


class _EventHandle:
    """A copy queued on a side stream: ``wait()`` makes the current stream of the copy's device
    wait for it."""

    __slots__ = ("_event", "_device")

    def __init__(self, event, device=None):
        self._event, self._device = event, device

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None


_NO_COPY = _EventHandle(None)


class SideStream:
    """The side stream of one device and thread, with the events its transfers record: ``fork``,
    recorded on the caller's stream and waited for by the side stream at once (and the other way
    round at an op scope's end), and a ring of ``EVENTS`` handle events recorded on the side stream
    only, one per transfer: a handle's event is recorded again ``EVENTS`` transfers later, on the
    side stream, so a handle not waited for by then makes its waiter wait for a later copy, never
    for less. Nothing here is created per transfer; ``scope``: the current stream of the op scope
    open on this device in this thread (:meth:`EmulatedTransport.transfers`)."""

    EVENTS = 16

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)
        self.fork = torch.cuda.Event()
        self.events = [torch.cuda.Event() for _ in range(self.EVENTS)]
        self.next = 0
        self.scope = None

    def after(self, main) -> None:
        """The side stream waits for the work queued so far on ``main``."""
        self.fork.record(main)
        self.stream.wait_event(self.fork)

    def join(self, main) -> None:
        """``main`` waits for the work queued so far on the side stream."""
        self.fork.record(self.stream)
        main.wait_event(self.fork)

    def mark(self):
        """A handle's event, recorded on the side stream now."""
        e = self.events[self.next]
        self.next = (self.next + 1) % self.EVENTS
        e.record(self.stream)
        return e


class EmulatedTransport(Transport, SymmetricBuffers):
    """``size`` ranks in one process, this one being ``rank``; every peer mirrors this rank (see
    the module docstring). On a CUDA device the copies run on a side stream that first waits for
    the current stream (what the data depends on), and ``wait()`` makes the current stream wait
    for the copy; on a CPU device copies run at once. ``copy_repeat`` copies every transfer (and
    every symmetric-buffer pull) that many times: a link that many times slower than a
    device-local copy. ``in_kernel_waits=True``: the tensor-parallel ops run their symmetric-memory
    schedules (one waiting persistent GEMM) on the emulated symmetric buffers instead of the
    portable rings."""

    name = "emulated"

    def __init__(self, size: int, rank: int = 0, *, copy_repeat: int = 1, in_kernel_waits: bool = False):
        check_int("EmulatedTransport: size", size, min_value=1)
        check_int("EmulatedTransport: rank", rank, min_value=0, max_value=size - 1)
        check_int("EmulatedTransport: copy_repeat", copy_repeat, min_value=1)
        check_bool("EmulatedTransport: in_kernel_waits", in_kernel_waits)
        super().__init__(size, rank)
        self.copy_repeat = copy_repeat
        if copy_repeat == 1 and type(self).peer_copy is EmulatedTransport.peer_copy:
            self.peer_copy = torch.Tensor.copy_  # one plain copy per transfer: no Python frame of its own
        self.in_kernel_waits = in_kernel_waits
        self._streams: dict = {}
        self._workspaces: dict = {}

    def transfers(self, device):
        if device.type != "cuda":
            return NO_SCOPE
        return self._scope(self._side(device))

    @contextlib.contextmanager
    def _scope(self, side: SideStream):
        """One op's transfers, all issued from the stream current when it opens (resolved once);
        at the end that stream waits for the side stream (every copy of the op), so no buffer needs
        ``record_stream``."""
        if side.scope is not None:  # nested: the outer scope joins
            yield
            return
        main = torch.cuda.current_stream(side.stream.device)
        side.scope = main
        try:
            yield
        finally:
            side.scope = None
            side.join(main)

    def __repr__(self):
        return (f"EmulatedTransport(size={self.size}, rank={self.rank}, copy_repeat={self.copy_repeat}, "
                f"in_kernel_waits={self.in_kernel_waits})")

    # --- symmetric buffers: this rank's own, read by the mirror rule ------------------------
    def symmetric_workspace(self, purpose, device, nbytes):
        ws = self._workspaces.get((purpose, device))  # (a tensor's device: the key canonical_device gives it)
        if ws is not None and ws.nbytes >= nbytes:
            return ws
        device = canonical_device(device)
        return cached_workspace(self._workspaces, (purpose, device), nbytes,
                                lambda size: SymmetricWorkspace(torch.zeros(size, dtype=torch.uint8, device=device), size))

    def symmetric_barrier(self, ws, channel=0):
        pass  # every "peer" is this rank, at the same point of the same stream

    def _mirror(self, peer: int, slot: int) -> int:
        return (slot + self.rank - peer) % self.size

    def peer_slot(self, ws, slots, peer, slot):
        return slots[self._mirror(peer, slot)]

    def peer_slot_offset(self, ws, slots, peer, slot):
        return (self._mirror(peer, slot) - slot) * slots.stride(0)

    def peer_copy(self, dst, src):
        for _ in range(self.copy_repeat):
            dst.copy_(src)

    def free_sms(self, device):
        return EMULATION_FREE_SMS if torch.device(device).type == "cuda" else 0

    def _side(self, device: torch.device) -> SideStream | None:
        """The side stream of ``device`` and of the calling thread (each thread its own: its op
        scope, its event ring), None on CPU."""
        if device.type != "cuda":
            return None
        thread = threading.get_ident()
        s = self._streams.get((device, thread))  # (a tensor's device: the key canonical_device gives it)
        if s is not None:
            return s
        device = canonical_device(device)
        s = self._streams.get((device, thread))
        if s is None:
            s = self._streams[device, thread] = SideStream(device)
        return s

    def _copies(self, device: torch.device, pairs) -> _EventHandle:
        """Run ``dst.copy_(src)`` for every pair, on the side stream when there is one: after the
        work queued so far on the current stream, with the side stream made current around the
        copies only (torch enqueues a copy on the current stream), a ring event as the handle.
        Outside an op scope (:meth:`transfers`) the buffers are also recorded on the side stream."""
        side = self._side(device)
        if side is None:
            for _ in range(self.copy_repeat):
                for dst, src in pairs:
                    dst.copy_(src)
            return _NO_COPY
        main = side.scope if side.scope is not None else torch.cuda.current_stream(device)
        side.after(main)
        torch.cuda.set_stream(side.stream)
        try:
            for _ in range(self.copy_repeat):
                for dst, src in pairs:
                    dst.copy_(src)
        finally:
            torch.cuda.set_stream(main)
        ev = side.mark()
        if side.scope is None:  # nobody holds the buffers until a join: the allocator must know
            for dst, src in pairs:
                dst.record_stream(side.stream)
                src.record_stream(side.stream)
        return _EventHandle(ev, device)

    def send_recv(self, send, dst, recv, src):
        if recv is None:
            return _NO_COPY  # a send alone: the mirror peer receives it, nothing lands here
        if send is None:
            raise ValueError("EmulatedTransport.send_recv: a receive needs a send (the mirror peer sends "
                             "what this rank sends), got send=None")
        if send.shape != recv.shape:
            raise ValueError(f"EmulatedTransport.send_recv: recv must have send's shape {tuple(send.shape)}, "
                             f"got {tuple(recv.shape)}")
        return self._copies(recv.device, [(recv, send)])

    def all_gather_into(self, out, inp):
        blocks = out.view((self.size,) + tuple(inp.shape))
        return self._copies(out.device, [(blocks[j], inp) for j in range(self.size)])

    def reduce_scatter_into(self, out, inp):
        n = inp.shape[0] // self.size
        mine = inp[self.rank * n:(self.rank + 1) * n]
        h = self._copies(out.device, [(out, mine)])
        h.wait()
        out.mul_(self.size)
        return collectives.DONE

    def all_reduce(self, t):
        t.mul_(self.size)
        return collectives.DONE

    def all_to_all(self, out, inp, out_splits=None, in_splits=None):
        if out_splits is None and in_splits is None:
            return self._copies(out.device, [(out, inp)])
        o = [int(s) for s in out_splits] if out_splits is not None else None
        i = [int(s) for s in in_splits] if in_splits is not None else None
        if o != i:
            raise ValueError("EmulatedTransport.all_to_all: mirror peers need out_splits == in_splits "
                             f"(what peer j sends here is what this rank sends to j), got {o} and {i}")
        return self._copies(out.device, [(out, inp)])


def get_transport(transport=None, group=None) -> Transport:
    """The transport an op runs on: a :class:`Transport` instance as given (then ``group`` must
    be None), else :class:`PortableTransport` over ``group``. Names of the tensor-parallel
    transports ("auto", "symmetric", "portable") are resolved by :mod:`fusedpar.ops.comm.symmetric`."""
    if isinstance(transport, Transport):
        if group is not None:
            raise ValueError("pass either group= or a Transport instance as transport=, not both "
                             f"(got group={group!r} and transport={transport!r})")
        return transport
    check_transport_name(transport)
    return PortableTransport(group)


def check_transport_name(transport, names=("portable",)) -> None:
    """``transport`` is ``None``, a :class:`Transport` or one of the transport ``names`` an op
    accepts (``("portable",)``; the tensor-parallel ops also take ``"symmetric"`` and ``"auto"``).
    Raises ``ValueError`` naming what is accepted."""
    if transport is None or isinstance(transport, Transport) or transport in names:
        return
    if tuple(names) == ("portable",):
        raise ValueError(f"transport must be None, 'portable' or a fusedpar.ops.Transport, got {transport!r}")
    raise ValueError(f"transport must be one of {names} or a fusedpar.ops.Transport, got {transport!r}")


def transport_from_id(transport_id: str) -> Transport:
    """The transport a transport id (:mod:`fusedpar.ops.comm.keys`) names, inside an op body: the registered
    instance, or :class:`PortableTransport` over the id's group."""
    return get_transport(*resolve_transport_id(transport_id))
