"""Transport ids: the strings that stand for a transport or a process group in a custom op's
schema (a schema holds tensors, numbers and strings, not Python objects).

:func:`register_transport` / :func:`transport_id_of` give a transport its id (kept alive while an
op that names it may still run, see :func:`hold`); :func:`resolve_transport_id` turns an id back
into the transport inside an op body; :func:`transport_id_size` / :func:`transport_id_group` read
its size and group where a fake or a check needs them."""
from __future__ import annotations

import itertools
import weakref

import torch.distributed as dist

_OBJECT_PREFIX = "object:"


_objects: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


_counter = itertools.count()


def register_transport(transport) -> str:
    """A fresh transport id naming ``transport`` (held weakly); called once by every Transport's constructor."""
    transport_id = f"{_OBJECT_PREFIX}{next(_counter)}"
    _objects[transport_id] = transport
    return transport_id


def transport_id_of(transport, group) -> str:
    """The string an op's schema carries for ``transport=`` / ``group=`` (see the module
    docstring). Pure Python on constants: Dynamo folds it into the graph. Raises the same
    ``ValueError`` as the transports for a Transport instance passed together with a group."""
    if isinstance(transport, str) or transport is None:
        name = "" if transport is None else transport
        return f"{name}@{'' if group is None else group.group_name}"
    transport_id = getattr(transport, "transport_id", None)
    if not isinstance(transport_id, str):
        raise TypeError(f"transport must be None, a transport name or a fusedpar.ops.Transport, "
                        f"got {type(transport).__name__}")
    if group is not None:
        raise ValueError("pass either group= or a Transport instance as transport=, not both "
                         f"(got group={group!r} and transport={transport!r})")
    return transport_id


def transport_size(transport, group) -> int:
    """The group size an op will run on, from its ``transport=`` / ``group=`` arguments without
    building the transport (Dynamo folds ``dist.get_world_size`` into a constant)."""
    if transport is not None and not isinstance(transport, str):
        return transport.size
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def transport_id_group(transport_id: str):
    """The process group a name id names (``None``: the default group)."""
    name = transport_id.rpartition("@")[2]
    if not name:
        return None
    # torch's own registry of group names (what its functional collectives resolve names with)
    return dist.distributed_c10d._resolve_process_group(name)


def resolve_transport_id(transport_id: str):
    """``(transport, group)`` for a transport id: a registered Transport instance and ``None``, or the
    transport name (``None`` for the op's default) and the process group it names."""
    if transport_id.startswith(_OBJECT_PREFIX):
        transport = _objects.get(transport_id)
        if transport is None:
            raise ValueError(f"transport id {transport_id!r} names a Transport that no longer exists")
        return transport, None
    name = transport_id.rpartition("@")[0]
    return (name or None), transport_id_group(transport_id)


def transport_id_size(transport_id: str) -> int:
    """The group size a transport id names, without building a transport (what the fakes need)."""
    return transport_size(*resolve_transport_id(transport_id))


def hold(*transport_ids) -> tuple:
    """What a backward's context keeps for the transport ids it will use (``None`` entries skipped): a
    Transport made for one call (``transport=EmulatedTransport(2)``) is named by its transport id only
    weakly, so the context holds it until the backward has run."""
    return tuple(resolve_transport_id(t)[0] for t in transport_ids if t is not None)
