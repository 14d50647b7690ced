"""Checks that the process groups a module is given fit together (construction time, no communication).

A module that takes several groups (:class:`~fusedpar.nn.ParallelAttention`, :class:`~fusedpar.nn.MoE`,
:class:`~fusedpar.nn.TransformerBlock`, :class:`~fusedpar.nn.Transformer`) runs one collective per
group and assumes a layout of them: the tensor-parallel and sequence-parallel groups (or the Ulysses
and ring groups of hybrid sequence parallelism) are *orthogonal*, i.e. their rank sets meet in this
rank only. Groups that overlap more would run a ring over ranks that also split the heads: the
ranks' collectives no longer pair up and the job hangs. So the modules check the rank sets before
anything is allocated and raise one ``ValueError`` naming both groups and their ranks.

An omitted group (``None``) is the default (world) group, as everywhere in fusedpar: a module given
a tensor-parallel group of 2 in a world of 4 and no sequence-parallel group would take the world as
its sequence group; that raises here (pass a group of one rank, e.g.
``ParallelState.sp_group`` of a layout with ``sp=1``, for no parallelism on a dimension).

Every rank of a consistent layout sees the same kind of overlap in its own groups, so every rank
raises (the check reads only group memberships, which every rank knows without communicating).
Group memberships are read through :func:`fusedpar.ops.comm.group_ranks`; transports that are not
over a process group (``EmulatedTransport``) are skipped.
"""
from __future__ import annotations

from fusedpar.ops import comm

__all__ = ["GroupArg", "check_divides", "check_orthogonal", "describe_group", "group_arg"]


class GroupArg:
    """One group argument of a module: its name, the group or transport, whether it was omitted,
    and (when known) its global ranks and this rank's global rank."""

    __slots__ = ("name", "size", "ranks", "me", "omitted")

    def __init__(self, name: str, size: int, ranks: tuple[int, ...] | None, me: int | None, omitted: bool):
        self.name, self.size, self.ranks, self.me, self.omitted = name, size, ranks, me, omitted

    def __str__(self):
        return describe_group(self)


def group_arg(name: str, group=None, transport=None, *, omitted: bool = False) -> GroupArg:
    """A :class:`GroupArg` of a process group (``None``: the world) or of a transport (its
    ``group`` when it has one; otherwise the ranks are unknown and no overlap is checked).
    ``omitted``: the caller left the argument out (the message then says so)."""
    if transport is not None:
        size, rank = transport.size, transport.rank
        if not hasattr(transport, "group"):
            return GroupArg(name, size, None, None, False)
        group = transport.group
    else:
        size, rank = comm.group_size(group), comm.group_rank(group)
    ranks = comm.group_ranks(group)
    return GroupArg(name, size, ranks, ranks[rank] if rank < len(ranks) else None, omitted)


def describe_group(g: GroupArg) -> str:
    """``"sp_group (omitted: the world) ranks [0, 1, 2, 3]"``."""
    what = f"{g.name} (omitted: the world)" if g.omitted else g.name
    return f"{what} ranks {list(g.ranks)}" if g.ranks is not None else f"{what} of size {g.size}"


def check_orthogonal(owner: str, a: GroupArg, b: GroupArg) -> None:
    """Where both groups have more than one rank, their rank sets must meet in this rank only."""
    if a.size <= 1 or b.size <= 1 or a.ranks is None or b.ranks is None:
        return
    shared = sorted(set(a.ranks) & set(b.ranks))
    if shared == [a.me]:
        return
    hint = next((f"; pass {g.name} (a group of one rank for no parallelism on that dimension, e.g. the "
                 f"ParallelState's group of a size-1 dimension)" for g in (b, a) if g.omitted), "")
    same = " (the same group)" if set(a.ranks) == set(b.ranks) else ""
    raise ValueError(f"{owner}: {a.name} and {b.name} must be orthogonal groups (sharing only this rank, {a.me}), "
                     f"got {describe_group(a)} and {describe_group(b)}{same}, sharing {shared}{hint}")


def check_divides(owner: str, what: str, value: int, g: GroupArg, kind: str) -> None:
    """``value`` (a count of heads, experts, vocabulary rows) must split evenly over group ``g``
    (``kind``: "tensor-parallel", "expert-parallel", ...)."""
    if value % g.size:
        raise ValueError(f"{owner}: {what}={value} must be divisible by the {kind} group size ({g.size}), "
                         f"got {describe_group(g)}")


def check_kv_heads(owner: str, what: str, value: int, g: GroupArg) -> None:
    """kv heads split evenly over the tensor-parallel group ``g``, or, fewer of them than ranks,
    divide its size (each kv head replicated on ``size / value`` ranks)."""
    if value % g.size and g.size % value:
        raise ValueError(f"{owner}: {what}={value} must be divisible by the tensor-parallel group size ({g.size}) "
                         f"or divide it (kv heads replicated over tp), got {describe_group(g)}")
