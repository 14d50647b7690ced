"""Symmetric memory and the transport that uses it.

Inside one NVLink domain every rank can map its peers' buffers
(``torch.distributed._symmetric_memory``). :class:`SymmetricTransport` is the portable transfers
plus symmetric-memory workspaces (one per group, :class:`GroupCache`), so that the
tensor-parallel GEMMs (:mod:`fusedpar.ops.tensor_parallel.symmetric`) pull chunks with copy
engines and wait for them inside one persistent kernel. :func:`symmetric_status` says whether
this machine and group can run it and why not; :func:`resolve_transport` maps ``"auto"`` /
``"symmetric"`` / ``"portable"`` to a transport; :func:`check_symmetric` validates a request."""
from __future__ import annotations

import os
import socket
import warnings
import weakref

import torch
import torch.distributed as dist

from fusedpar.kernels.waits import canonical_device
from fusedpar.ops.comm import collectives
from fusedpar.ops.comm.transport import (
    PortableTransport,
    SymmetricBuffers,
    SymmetricWorkspace,
    Transport,
    cached_workspace,
    check_transport_name,
    get_transport,
)
from fusedpar.ops.comm.waits import (
    flag_writer_available,
)

TRANSPORTS = ("auto", "symmetric", "portable")


# what ``transport=None`` means in fusedpar.ops: "portable" until the symmetric path has passed its
# GPU tests on hardware (FUSEDPAR_TRANSPORT=auto opts in)
DEFAULT_TRANSPORT = os.environ.get("FUSEDPAR_TRANSPORT", "portable")


# ----------------------------------------------------------------------------------------------
# per-group caches
# ----------------------------------------------------------------------------------------------
class GroupCache:
    """Entries cached per process group that die with the group. Keyed by a weak reference to
    the group object, never by ``id(group)``: once a destroyed group is freed its id can be
    reused by a new group, which must not be handed the old group's probe answer or buffers."""

    def __init__(self):
        self._by_group = weakref.WeakKeyDictionary()

    def entries(self, group) -> dict:
        """The (mutable) dict of ``group``'s entries, empty for a group not seen before."""
        d = self._by_group.get(group)
        if d is None:
            d = self._by_group[group] = {}
        return d

    def clear(self) -> None:
        self._by_group.clear()

    def __len__(self):
        return len(self._by_group)


_probe_cache = GroupCache()


_workspaces = GroupCache()


# ----------------------------------------------------------------------------------------------
# availability and transport selection
# ----------------------------------------------------------------------------------------------
def _symm_module():
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401
    except ImportError:
        return None
    return symm_mem


def _probe_peers(x: torch.Tensor, group) -> tuple[bool, str]:
    """The cross-rank facts (one host, peer access), gathered with collectives on ``group``."""
    size = dist.get_world_size(group)
    info = [None] * size
    dist.all_gather_object(info, (socket.gethostname(), torch.cuda.current_device()), group=group)
    hosts = {h for h, _ in info}
    me = torch.cuda.current_device()
    peer_ok = all(d == me or torch.cuda.can_device_access_peer(me, d) for _, d in info)
    ok = torch.tensor([1 if (len(hosts) == 1 and peer_ok) else 0], device=x.device, dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item():
        return True, "one host, peer access between all GPUs of the group"
    if len(hosts) > 1:
        return False, f"the group spans {len(hosts)} hosts; symmetric memory needs one NVLink domain"
    return False, "some GPUs of the group cannot access each other's memory (no P2P)"


def symmetric_status(x: torch.Tensor, group=None) -> tuple[bool, str]:
    """Whether the symmetric-memory transport can serve ``group`` for tensors like ``x``, and why
    not. The answer is the same on every rank of the group: local facts (device type, backend,
    torch build) are equal by construction, and the cross-rank facts (one host, peer access) are
    gathered once per group and cached, which is a collective the first time."""
    if x.device.type != "cuda":
        return False, f"tensors are on {x.device.type}, the symmetric transport needs CUDA tensors"
    if not dist.is_available() or not dist.is_initialized():
        return False, "torch.distributed is not initialised"
    group = collectives.resolve_group(group)
    backend = dist.get_backend(group)
    if backend != "nccl":
        return False, f"process group backend is {backend!r}, the symmetric transport runs with NCCL groups"
    if _symm_module() is None:
        return False, "this torch build has no torch.distributed._symmetric_memory"
    if not flag_writer_available():
        return False, "this torch build lacks _SymmetricMemory.stream_write_value32 (SM-free flag writes)"
    cache = _probe_cache.entries(group)
    if x.device.index not in cache:
        cache[x.device.index] = _probe_peers(x, group)
    return cache[x.device.index]


def resolve_transport(transport, x: torch.Tensor, group=None) -> Transport:
    """The transport a tensor-parallel op runs on. ``transport``: a :class:`Transport` instance
    (returned as is; ``group`` must then be None), or a name in :data:`TRANSPORTS` (``None``:
    :data:`DEFAULT_TRANSPORT`): ``"portable"`` -> :class:`PortableTransport`, ``"symmetric"`` /
    ``"auto"`` -> :class:`SymmetricTransport` where :func:`symmetric_status` allows it, else
    (``"auto"``) the portable one. Raises ``ValueError`` for an unknown name, or when
    ``"symmetric"`` is forced where it cannot run (before any data moves, on every rank alike)."""
    if isinstance(transport, Transport):
        return get_transport(transport, group)
    if transport is None:
        transport = DEFAULT_TRANSPORT
    check_transport_name(transport, TRANSPORTS)
    if transport == "portable" or collectives.group_size(group) == 1:
        return portable_transport(group)
    ok, reason = symmetric_status(x, group)
    if transport == "symmetric" and not ok:
        raise ValueError(f"transport='symmetric' is not available here: {reason}")
    return portable_transport(group, SymmetricTransport if ok else PortableTransport)


_portables = GroupCache()


def portable_transport(group=None, kind=None) -> PortableTransport:
    """The :class:`PortableTransport` of ``group`` (``None``: the default group; ``kind``: that
    class or :class:`SymmetricTransport`), made once per group and kept while the group lives
    (with the buffers and the per-shape specs its schedules keep), so an op named by a transport
    name builds no transport per call; a new one each call while torch.distributed is not
    initialised. The cached transport holds its group weakly (``weak_group``): the cache, keyed
    weakly by the group, keeps nothing alive once the group is destroyed and dropped."""
    kind = kind or PortableTransport
    resolved = collectives.resolve_group(group)
    if resolved is None:
        return kind(group)
    entries = _portables.entries(resolved)
    t = entries.get(kind)
    if t is None:
        t = entries[kind] = kind(resolved, weak_group=True)
    return t


# ----------------------------------------------------------------------------------------------
# the symmetric-memory transport
# ----------------------------------------------------------------------------------------------
def _new_symmetric_workspace(group, device, size: int):
    """``(tensor, handle)``: a zeroed symmetric uint8 tensor of ``size`` bytes on every rank of
    ``group`` and its rendezvous handle (``barrier``, ``buffer_ptrs``, ``get_remote_tensor``)."""
    symm_mem = _symm_module()
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        # needed by older torch releases; newer ones deprecate it as a no-op requirement
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    t = symm_mem.empty(size, dtype=torch.uint8, device=device)
    t.zero_()  # counters start at 0; ordered before the first call's barrier on this stream
    return t, symm_mem.rendezvous(t, group.group_name)


_factory = [_new_symmetric_workspace]


def set_workspace_factory(factory=None):
    """Replace how :class:`SymmetricTransport` allocates a workspace: ``factory(group, device,
    size) -> (zeroed uint8 tensor, handle)``, collective over ``group`` (the handle has
    ``barrier(channel=)``, ``buffer_ptrs`` and ``get_remote_tensor(peer, sizes, dtype)``). ``None``
    restores symmetric memory. Clears the cached workspaces; returns the previous factory. Tests
    use file-backed shared memory across CPU processes."""
    previous = _factory[0]
    _factory[0] = factory or _new_symmetric_workspace
    clear_workspaces()
    return previous


def clear_workspaces() -> None:
    """Drop every cached symmetric workspace (the next call of each purpose allocates anew)."""
    _workspaces.clear()


def _remote_bytes(hdl, peer: int, nbytes: int) -> torch.Tensor:
    """Peer ``peer``'s copy of our rendezvoused tensor (the allocation may sit ``hdl.offset``
    bytes into the symmetric buffer), as ``nbytes`` uint8 mapped into this process."""
    if hasattr(hdl, "get_remote_tensor"):
        return hdl.get_remote_tensor(peer, (nbytes,), torch.uint8)
    return hdl.get_buffer(peer, (nbytes,), torch.uint8, int(getattr(hdl, "offset", 0)))


class SymmetricTransport(PortableTransport, SymmetricBuffers):
    """The portable transfers over ``group`` plus symmetric-memory buffers, so that the
    tensor-parallel GEMMs wait for chunks inside one persistent kernel. Made by
    :func:`resolve_transport` where :func:`symmetric_status` allows it (construct it directly only
    where that holds, or with a test factory, :func:`set_workspace_factory`)."""

    name = "symmetric"
    in_kernel_waits = True

    def __init__(self, group=None, *, weak_group: bool = False):
        super().__init__(group, weak_group=weak_group)
        if self.group is None:
            raise ValueError("SymmetricTransport needs an initialised torch.distributed group, got none "
                             "(torch.distributed is not initialised)")

    def symmetric_workspace(self, purpose, device, nbytes):
        device = canonical_device(device)  # "cuda" and the tensors' "cuda:0" are one workspace

        def create(size):
            tensor, handle = _factory[0](self.group, device, size)
            return SymmetricWorkspace(tensor, size, handle)

        return cached_workspace(_workspaces.entries(self.group), (purpose, device), nbytes, create)

    def symmetric_barrier(self, ws, channel=0):
        ws.handle.barrier(channel=channel)

    def peer_slot(self, ws, slots, peer, slot):
        offset = slots.data_ptr() - ws.tensor.data_ptr()  # slots is a typed view of ws
        nbytes = slots.numel() * slots.element_size()
        remote = _remote_bytes(ws.handle, peer, ws.nbytes)[offset:offset + nbytes]
        return remote.view(slots.dtype).view(slots.shape)[slot]

    def peer_slot_offset(self, ws, slots, peer, slot):
        ptrs = ws.handle.buffer_ptrs  # every rank's workspace sits at the same offset in its buffer
        diff = int(ptrs[peer]) - int(ptrs[self.rank])
        if diff % slots.element_size():
            raise ValueError(f"peer buffers must be {slots.element_size()}-byte aligned to each other, got a "
                             f"{diff}-byte distance to peer {peer}")
        return diff // slots.element_size()

    def free_sms(self, device):
        # a flag written by a kernel (no cuStreamWriteValue32) needs an SM the waiting GEMM leaves free
        return 0 if flag_writer_available() else 2


def check_symmetric(transport, op: str):
    if not isinstance(transport, SymmetricBuffers) or not transport.in_kernel_waits:
        raise ValueError(f"{op}: transport must support in-kernel waits (a SymmetricTransport or an "
                         f"EmulatedTransport(in_kernel_waits=True)), got {transport!r}")
    return transport
