"""Process-group helpers and asynchronous transfers. Only ``torch.distributed`` underneath.

Every fusedpar op moves data through these functions, so that

* group ranks are translated to global ranks in one place (P2P calls need global ranks);
* transfers are asynchronous: each returns a :class:`Handle` whose ``wait()`` is called right
  before the chunk it delivers is consumed (never on the whole collective);
* tests can inject stragglers (:func:`set_straggler`): a random delay before each transfer, per
  rank, which turns a missing ``wait()`` into wrong numbers instead of a lucky pass."""
from __future__ import annotations

import os
import random
import time
from typing import Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


_straggler = {"max_delay": 0.0, "rng": None}


# torch 2.13 renamed the single-tensor collectives (all_gather_single / reduce_scatter_single) and
# deprecated the old names; torch 2.11 has only the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def set_straggler(max_delay_s: float, seed: int = 0) -> None:
    """Sleep a random time in ``[0, max_delay_s)`` before every transfer started on this rank.

    A testing and debugging aid (0 turns it off). ``FUSEDPAR_STRAGGLE_MS`` sets it at import.
    """
    _straggler["max_delay"] = float(max_delay_s)
    _straggler["rng"] = random.Random(seed)


def _straggle() -> None:
    if _straggler["max_delay"] > 0:
        time.sleep(_straggler["rng"].random() * _straggler["max_delay"])


if os.environ.get("FUSEDPAR_STRAGGLE_MS"):
    set_straggler(float(os.environ["FUSEDPAR_STRAGGLE_MS"]) / 1000.0, seed=int(os.environ.get("RANK", "0")))


# ----------------------------------------------------------------------------------------------
# groups
# ----------------------------------------------------------------------------------------------
def resolve_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``None`` means the default (world) group. Raises if torch.distributed is not initialised
    and a group is needed."""
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.group.WORLD
    return group


def group_size(group: ProcessGroup | None) -> int:
    group = resolve_group(group)
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    group = resolve_group(group)
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` in group-rank order (``None``: the world; ``(0,)`` when
    torch.distributed is not initialised)."""
    group = resolve_group(group)
    if group is None:
        return (0,)
    if group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def global_rank(group: ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` inside ``group``."""
    group = resolve_group(group)
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


# ----------------------------------------------------------------------------------------------
# handles
# ----------------------------------------------------------------------------------------------
class Handle:
    """Work in flight. ``wait()`` is idempotent; after it the received buffers are valid (on GPU:
    for work queued on the current stream from then on)."""

    __slots__ = ("_works", "_done")

    def __init__(self, works: Sequence | None = None):
        self._works = [w for w in (works or []) if w is not None]
        self._done = False

    def wait(self) -> None:
        if not self._done:
            for w in self._works:
                w.wait()
            self._done = True


DONE = Handle()


def _async_op(fn, *args, **kwargs) -> Handle:
    _straggle()
    return Handle([fn(*args, async_op=True, **kwargs)])


# ----------------------------------------------------------------------------------------------
# transfers
# ----------------------------------------------------------------------------------------------
def send_recv(
    send: torch.Tensor | None,
    dst: int | None,
    recv: torch.Tensor | None,
    src: int | None,
    group: ProcessGroup | None = None,
) -> Handle:
    """Start sending ``send`` to group rank ``dst`` and receiving ``recv`` from group rank ``src``.

    Either side may be ``None``. Both are posted together (``batch_isend_irecv``) so a ring of
    ranks that each send and receive cannot deadlock.
    """
    group = resolve_group(group)
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), global_rank(group, dst), group))
    if recv is not None:
        if not recv.is_contiguous():
            raise ValueError("send_recv: recv buffer must be contiguous")
        ops.append(dist.P2POp(dist.irecv, recv, global_rank(group, src), group))
    if not ops:
        return DONE
    _straggle()
    return Handle(dist.batch_isend_irecv(ops))


def ring_shift(send: torch.Tensor, recv: torch.Tensor, group: ProcessGroup | None = None, *, step: int = 1) -> Handle:
    """Send to ``rank + step`` and receive from ``rank - step`` (mod group size)."""
    n, r = group_size(group), group_rank(group)
    return send_recv(send, (r + step) % n, recv, (r - step) % n, group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None = None) -> Handle:
    """``out`` (``[P * n, ...]`` contiguous) receives every rank's ``inp`` along dim 0."""
    return _async_op(_all_gather_tensor, out, inp.contiguous(), group=resolve_group(group))


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None = None) -> Handle:
    """``out`` receives the sum over ranks of this rank's dim-0 block of ``inp``."""
    return _async_op(_reduce_scatter_tensor, out, inp.contiguous(), group=resolve_group(group))


def all_reduce(t: torch.Tensor, group: ProcessGroup | None = None) -> Handle:
    """In-place sum over ranks."""
    if not t.is_contiguous():
        raise ValueError("all_reduce: tensor must be contiguous")
    return _async_op(dist.all_reduce, t, group=resolve_group(group))


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int] | None = None,
    in_splits: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
) -> Handle:
    """All-to-all(-v) along dim 0; splits are row counts per rank (``None``: equal blocks)."""
    return _async_op(
        dist.all_to_all_single, out, inp.contiguous(),
        output_split_sizes=None if out_splits is None else [int(s) for s in out_splits],
        input_split_sizes=None if in_splits is None else [int(s) for s in in_splits],
        group=resolve_group(group),
    )
