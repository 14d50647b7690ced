"""Bounded waits of the kernels that synchronise through flags and counters, and the host side
that turns a wait that gave up into an error.

A waiting kernel spins with :func:`wait_ready` (a system-scope acquire read) at most
:func:`spin_bound` reads; a wait that runs out adds 1 to the device's status word
(:func:`status_word`, passed to the kernel) instead of hanging the device.
:func:`check_wait_timeouts` raises :class:`WaitTimeout` for timeouts not reported yet -- on a
GPU as well as under the interpreter: without a host synchronisation at a later check, naming
the op whose wait gave up (``"deferred"``, the default: an asynchronous copy of the word per op),
or right after the work (``"sync"``, ``FUSEDPAR_WAIT_CHECK=sync``: a host synchronisation per op,
and the op that launched the waiting kernel raises instead of returning its output).
"""
from __future__ import annotations

import collections
import os
import threading

import torch
import triton
import triton.language as tl

from .checks import check_choice, check_int, check_tensor
from .runtime import interpreting

__all__ = ["MAX_SPIN_GPU", "MAX_SPIN_INTERPRETED", "WAIT_CHECK", "WAIT_CHECKS", "WaitTimeout", "canonical_device",
           "behind", "capturing", "check_not_capturing", "check_wait_timeouts", "ready_word", "spin_bound", "status_word", "wait_ready", "wait_timeouts"]

# Bound of a flag spin (reads): ~2^27 system-scope loads is about a minute on a GPU; an interpreted
# read takes ~0.3 ms (the flag can only change there when another process writes it).
MAX_SPIN_GPU = 1 << 27
MAX_SPIN_INTERPRETED = 1 << 18  # about a minute: long enough for a peer *process* to finish

# When a wait that gave up becomes an error on the host: "deferred" (the default) copies the status
# word asynchronously into pinned memory after each op and raises at a later check, once the copy
# has landed, naming the op whose copy first showed the timeout (no host synchronisation); "sync"
# reads it right after the work (a host synchronisation per op: the op itself raises).
WAIT_CHECKS = ("deferred", "sync")
WAIT_CHECK = os.environ.get("FUSEDPAR_WAIT_CHECK", "deferred")
if WAIT_CHECK not in WAIT_CHECKS:
    raise ValueError(f"FUSEDPAR_WAIT_CHECK must be one of {WAIT_CHECKS}, got {WAIT_CHECK!r}")
_MAX_PENDING = 64  # deferred snapshots in flight before the oldest is waited for


class WaitTimeout(RuntimeError):
    """A waiting kernel gave up on a flag or counter that never reached its ready value."""


class _Status:
    """Timeouts of one device: ``word`` (int32; every wait that gives up adds 1, nothing resets
    it on the device, so concurrent kernels never race a reset), the count already ``reported``,
    and the deferred snapshots: ``pending`` ``(slot, op name)`` in the order queued, each slot a
    pinned host int (``host``, made at the first deferred check with one event per slot)."""

    def __init__(self, device: torch.device):
        with torch.inference_mode(False):  # kept for later calls
            self.word = torch.zeros(1, dtype=torch.int32, device=device)
        self.cpu_word = self.word.numpy() if self.word.device.type == "cpu" else None  # (read without a torch call)
        self.reported = 0
        self.pending = collections.deque()
        self.host = self.slots = self.events = None
        self.next = 0
        self.lock = threading.Lock()  # checks from several threads (autograd's) take slots in turn

    def report(self, seen: int) -> int:
        n, self.reported = seen - self.reported, max(seen, self.reported)
        return max(n, 0)


_statuses: dict = {}


def canonical_device(device) -> torch.device:
    """``device`` spelled as the tensors allocated there report it: the key of every per-device
    cache (status words here; flags, side streams and workspaces in :mod:`fusedpar.ops.comm.symmetric`).
    ``"cuda"`` names the current CUDA device, whose tensors report ``cuda:<index>``; CPU tensors
    report ``cpu`` without an index, so ``"cpu:0"`` becomes ``cpu``. Without it a caller that
    names the device ``"cuda"`` and an op keyed by its tensor's ``cuda:0`` reach two different
    entries (a flag array whose epoch never moves, a fresh empty workspace)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and device.index is not None:
        return torch.device("cpu")
    return device


def capturing(device: torch.device) -> bool:
    """Whether work queued now on ``device``'s current stream is being captured in a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_not_capturing(what: str, device: torch.device) -> None:
    """Raise where ``what`` (state kept from call to call: a word, flags, a workspace) would be
    made inside a CUDA-graph capture on ``device``: its initialisation would be captured, not run,
    so eager calls would find it unset (and a replay would reset it)."""
    if capturing(device):
        raise RuntimeError(f"{what} must be made before a CUDA-graph capture on {device} (its initialisation would "
                           "be captured, not run), got its first use inside one: run the op once before capturing "
                           "(a warm-up)")


def _status(device) -> _Status:
    st = _statuses.get(device)
    if st is None:
        device = canonical_device(device)
        st = _statuses.get(device)
        if st is None:
            check_not_capturing("the wait-timeout status word", device)
            st = _statuses[device] = _Status(device)
    return st


def wait_timeouts(device: torch.device | str, *, reset: bool = True) -> int:
    """Waits on ``device`` that timed out since the last report (synchronises with the device);
    ``reset`` marks them reported (the deferred snapshots still in flight are dropped)."""
    st = _status(device)
    seen = int(st.word.item() if st.cpu_word is None else st.cpu_word[0])
    if not reset:
        return seen - st.reported
    with st.lock:
        st.pending.clear()
        return st.report(seen)


def snapshot_buffers(n: int):
    """``(host, events)``: ``n`` pinned int32 slots and one CUDA event each (the deferred checks'
    snapshots of a status word, made once per device)."""
    with torch.inference_mode(False):  # kept for later calls
        return torch.zeros(n, dtype=torch.int32, pin_memory=True), [torch.cuda.Event() for _ in range(n)]


def deferred_capable(word: torch.Tensor) -> bool:
    """Whether a deferred check of ``word`` can run: a CUDA device, not inside a CUDA-graph
    capture (an event query would break it; the word is cumulative, so the next check outside
    the capture reports what a replay counted)."""
    return word.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def _landed(st: _Status):
    """``(new timeouts, op)`` of the snapshots that have landed (the oldest waited for when
    ``_MAX_PENDING`` are in flight): ``op`` named by the first snapshot that shows a new count."""
    seen, op = st.reported, None
    while st.pending and (len(st.pending) >= _MAX_PENDING or st.events[st.pending[0][0]].query()):
        slot, what = st.pending.popleft()
        st.events[slot].synchronize()  # at once for a landed snapshot; bounds the queue otherwise
        value = int(st.slots[slot])
        if value > seen:
            seen, op = value, op or what
    return st.report(seen), op


def _deferred_timeouts(st: _Status, what: str):
    """:func:`_landed`; then queues a snapshot of now (after the work queued so far on the current
    stream) into the next pinned slot."""
    found = _landed(st)
    if st.host is None:
        st.host, st.events = snapshot_buffers(_MAX_PENDING)
        st.slots = st.host.numpy()  # reads without a torch call
        st.views = list(st.host.split(1))
    slot, st.next = st.next, (st.next + 1) % _MAX_PENDING
    st.views[slot].copy_(st.word, non_blocking=True)  # (queued on the word's device's current stream)
    st.events[slot].record(torch.cuda.current_stream(st.word.device))
    st.pending.append((slot, what))
    return found


def check_wait_timeouts(device: torch.device | str, what: str, *, mode: str | None = None) -> None:
    """Raise :class:`WaitTimeout` if a waiting kernel on ``device`` gave up since the last report.

    ``mode`` (default :data:`WAIT_CHECK`): ``"deferred"`` (GPU) does not synchronise: it queues
    an asynchronous copy of the status word into pinned memory and raises for the copies queued
    by earlier checks that have landed, naming the op whose copy first showed the new count (a
    later op reports it; :func:`wait_timeouts` reports all at once, synchronising). ``"sync"``
    reads the word now; on a GPU that waits for the work queued so far on the current stream, so
    the op whose wait gave up raises instead of returning its output. CPU tensors (the
    interpreter) are always checked at once; inside a CUDA-graph capture nothing is checked."""
    mode = WAIT_CHECK if mode is None else mode
    if mode not in WAIT_CHECKS:
        check_choice("mode", mode, WAIT_CHECKS)
    st = _status(device)
    if st.cpu_word is not None and st.cpu_word[0] <= st.reported:
        return  # (a CPU word is read at once: nothing new)
    if mode == "sync" or not deferred_capable(st.word):
        if st.word.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        n, op, late = wait_timeouts(device), what, ""
    else:
        with st.lock:
            n, op = _deferred_timeouts(st, what)
        late = (f" (found by the deferred check of a later op, {what}; FUSEDPAR_WAIT_CHECK=sync raises in the op "
                "itself)")
    if n:
        hint = " (under the interpreter every flag must be set before the launch)" if interpreting() else ""
        raise WaitTimeout(f"{op}: {n} wait(s) gave up after the spin bound: a flag or counter never reached "
                          f"its ready value{hint}{late}")


def spin_bound(max_spin=None) -> int:
    """``max_spin`` checked, or the default bound (about a minute on a GPU or interpreted)."""
    if max_spin is not None:
        return check_int("max_spin", max_spin, min_value=0)
    return MAX_SPIN_INTERPRETED if interpreting() else MAX_SPIN_GPU


def status_word(device) -> torch.Tensor:
    """The int32 timeout counter of ``device`` that waiting kernels add to."""
    return _status(device).word


#: ``{(device, value): int32 word}``: the words :func:`ready_word` made for int ready values
_ready_words: dict = {}


def ready_word(device, value, name: str = "ready_value") -> torch.Tensor:
    """The int32 device word a waiting kernel compares its flags or counters with (it reads the
    word when it starts, so a launch carries no host value that changes from call to call).
    ``value``: such a word already (a 1-element int32 tensor on ``device``: a device-resident
    epoch, moved by stream-ordered work), returned as is; or an int, for which a word holding it
    is made once per device and value (a fill on the current stream, no host synchronisation; past
    1024 values, and inside a CUDA-graph capture, a word per call, never one evicted)."""
    word = _ready_words.get((device, value)) if type(value) is int else None
    if word is not None:
        return word
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, dtypes=(torch.int32,))
        if value.numel() != 1 or (value.device != device and value.device != canonical_device(device)):
            raise ValueError(f"{name} must be an int or a 1-element int32 tensor on {canonical_device(device)}, got "
                             f"shape {tuple(value.shape)} on {value.device}")
        return value
    check_int(name, value, min_value=-(2 ** 31), max_value=2 ** 31 - 1)
    device = canonical_device(device)
    word = _ready_words.get((device, value))
    if word is None:
        with torch.inference_mode(False):  # kept for later calls
            word = torch.full((1,), value, dtype=torch.int32, device=device)
        # a word is never evicted (a captured graph may read it); one made inside a capture is the
        # graph's (its fill is captured, not run): not kept for eager calls
        if len(_ready_words) < 1024 and not capturing(device):
            _ready_words[device, value] = word
    return word


# --------------------------------------------------------------------------------------------
# the spin (Triton)
# --------------------------------------------------------------------------------------------
@triton.jit
def wait_ready(flag_ptr, ready_value, status_ptr, MAX_SPIN: tl.constexpr):
    """Spin until ``*flag_ptr`` reached ``ready_value`` (int32, compared modulo 2^32:
    :func:`behind`). The read is an atomic with acquire semantics at system scope (the flag may be
    written by a copy engine or a peer GPU), so loads issued after it observe the data published
    before the flag. Triton executes a scalar atomic once per program and broadcasts the result to
    every thread of the program.

    The spin is bounded: after ``MAX_SPIN`` reads (about a minute on a GPU, a few thousand
    interpreted reads) it gives up and counts a timeout in ``*status_ptr``, so a producer that
    never comes turns into an error the host reports instead of a hung device."""
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    n = 0
    while behind(v, ready_value) & (n < MAX_SPIN):
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        n += 1
    if behind(v, ready_value):
        tl.atomic_add(status_ptr, 1)


@triton.jit
def behind(value, ready_value):
    """Whether an int32 counter ``value`` has not reached ``ready_value`` yet, modulo 2^32:
    ``value - ready_value`` (wrapping) is negative. Completion counters only grow and wrap past 2^31 - 1
    (nothing resets them: a CUDA graph may replay a call any number of times), and the ready value
    a call computes wraps with them, so the comparison holds while a counter is within 2^31 of its
    ready value (a call adds far less)."""
    return (value - ready_value).to(tl.int32) < 0
