"""The communication layer every op family is written against: process-group helpers and
asynchronous collectives (:mod:`.collectives`), the :class:`Transport` interface and its
implementations (:mod:`.transport`, :mod:`.symmetric`), the strings that name a transport in an
op's schema (:mod:`.keys`), the host side of in-kernel waits (:mod:`.waits`) and the cross-rank
agreement check (:mod:`.agreement`)."""
from .collectives import (
    DONE,
    Handle,
    all_gather_into,
    all_reduce,
    all_to_all,
    global_rank,
    group_rank,
    group_ranks,
    group_size,
    reduce_scatter_into,
    resolve_group,
    ring_shift,
    send_recv,
    set_straggler,
)
from .symmetric import SymmetricTransport, resolve_transport
from .transport import EmulatedTransport, PortableTransport, Transport, get_transport

__all__ = [
    "DONE", "Handle", "all_gather_into", "all_reduce", "all_to_all", "global_rank", "group_rank", "group_ranks",
    "group_size", "reduce_scatter_into", "resolve_group", "ring_shift", "send_recv", "set_straggler",
    "EmulatedTransport", "PortableTransport", "SymmetricTransport", "Transport", "get_transport", "resolve_transport",
]
