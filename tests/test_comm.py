"""fusedpar.ops.comm transfers and the multi-process test harness itself (gloo on CPU)."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _world import World, WorldError, rank_rng, straggle, world_fixture
from fusedpar.ops import comm
from fusedpar.kernels.checks import check_divisible

world3 = world_fixture(3)


def _ring_and_all_to_all(rank, size, seed):
    straggle(0.02, seed)
    group = None
    # ring shift: receive the left neighbour's tensor, several rounds with buffers reused
    x = torch.randn(5, 7, generator=rank_rng(seed, rank))
    buf = torch.full_like(x, float("nan"))
    cur = x
    for step in range(1, size + 1):
        h = comm.ring_shift(cur, buf, group)
        h.wait()
        expect = torch.randn(5, 7, generator=rank_rng(seed, (rank - step) % size))
        torch.testing.assert_close(buf, expect, rtol=0, atol=0)
        cur, buf = buf, torch.full_like(x, float("nan"))
    # all-to-all-v: rank r sends (r + j + 1) rows to rank j
    in_splits = [rank + j + 1 for j in range(size)]
    out_splits = [j + rank + 1 for j in range(size)]
    inp = torch.cat([torch.full((n, 3), float(rank * 100 + j)) for j, n in enumerate(in_splits)])
    out = torch.full((sum(out_splits), 3), float("nan"))
    comm.all_to_all(out, inp, out_splits, in_splits, group).wait()
    expect = torch.cat([torch.full((n, 3), float(j * 100 + rank)) for j, n in enumerate(out_splits)])
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    # collectives on a subgroup: the group rank -> global rank translation
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        t = torch.full((4,), float(rank))
        g = torch.full((8,), float("nan"))
        comm.all_gather_into(g, t, sub).wait()
        assert g.tolist() == [1.0] * 4 + [2.0] * 4
        o = torch.full((2,), float("nan"))
        comm.reduce_scatter_into(o, torch.arange(4.0) * rank, sub).wait()
        lo = 2 * comm.group_rank(sub)
        assert o.tolist() == [3.0 * lo, 3.0 * (lo + 1)]
        r = torch.zeros(3)
        comm.send_recv(torch.full((3,), float(rank)), 1 - comm.group_rank(sub), r, 1 - comm.group_rank(sub), sub).wait()
        assert r.tolist() == [float(3 - rank)] * 3
    comm.set_straggler(0)
    return rank


def test_transfers_with_stragglers(world3):
    assert world3.run(_ring_and_all_to_all, seed=4) == [0, 1, 2]


def _fail_on_rank1(rank, size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _noop(rank, size):
    return rank


def _hang_on_rank0(rank, size):
    if rank == 0:
        time.sleep(30)
    return rank


def test_harness_reports_tracebacks_and_recovers(world3):
    with pytest.raises(WorldError, match="(?s)rank 1.*ValueError: boom on rank 1"):
        world3.run(_fail_on_rank1)
    assert world3.run(_ring_and_all_to_all, seed=5) == [0, 1, 2]


def test_harness_fails_on_timeout_instead_of_hanging():
    w = World(2, timeout=120)
    try:
        assert w.run(_noop) == [0, 1]  # started and answering, so only the hang can time out
        t0 = time.monotonic()
        with pytest.raises(WorldError, match=r"ranks \[0\] did not finish within 3s"):
            w.run(_hang_on_rank0, timeout=3)
        assert time.monotonic() - t0 < 20
    finally:
        w.close()


def test_check_divisible_message():
    with pytest.raises(ValueError, match=r"seq=10 must be divisible by the group size \(4\)"):
        check_divisible("seq", 10, 4)


class _StreamAPI:
    """Stand-ins for torch.cuda's Stream and Event that count what the emulated transport calls."""

    def __init__(self):
        self.calls = {"Stream": 0, "Event": 0, "record": 0, "wait_event": 0, "set_stream": 0, "record_stream": 0}
        self.main = self.Stream(self)
        self.current = self.main

    class Stream:
        def __init__(self, api, device=None):
            self.api, self.device = api, torch.device("cuda", 0)
            api.calls["Stream"] += 1

        def wait_event(self, event):
            self.api.calls["wait_event"] += 1

    class Event:
        def __init__(self, api):
            api.calls["Event"] += 1
            self.api, self.recorded = api, []

        def record(self, stream=None):
            self.api.calls["record"] += 1
            self.recorded.append(stream)

    def install(self, monkeypatch):
        api = self
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.Stream(api, device))
        monkeypatch.setattr(torch.cuda, "Event", lambda: self.Event(api))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: api.current)

        def set_stream(s):
            api.calls["set_stream"] += 1
            api.current = s

        def record_stream(t, s):
            api.calls["record_stream"] += 1

        monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)


def test_emulated_transfers_create_nothing_per_transfer(monkeypatch):
    """The emulated transport's side-stream path (CUDA only; here on CPU tensors with counting
    stand-ins for streams and events): the side stream and its event ring are made once per
    transport and device; inside an op's scope a transfer records two events and makes the side
    stream wait for one, makes the side stream current around its copies only, calls no
    record_stream, and the scope joins once; outside a scope the buffers are recorded on the side
    stream; the copies happen and the current stream is the caller's afterwards."""
    api = _StreamAPI()
    api.install(monkeypatch)
    t = comm.EmulatedTransport(4, 1)
    cuda = torch.device("cuda", 0)
    src, dst = torch.arange(6.0), torch.zeros(6)
    for op in range(2):  # two ops: nothing made the second time
        before = dict(api.calls)
        with t.transfers(cuda):
            for _ in range(5):
                t._copies(cuda, [(dst, src)]).wait()
        made = {k: api.calls[k] - before[k] for k in api.calls}
        assert made == {"Stream": 1 - op, "Event": 17 * (1 - op), "record": 5 * 2 + 1, "wait_event": 5 * 2 + 1,
                        "set_stream": 5 * 2, "record_stream": 0}, made
        assert api.current is api.main and torch.equal(dst, src)
    t._copies(cuda, [(dst, src)])  # no scope: nobody holds the buffers until a join
    assert api.calls["record_stream"] == 2
    assert t.transfers(torch.device("cpu")) is comm.transport.NO_SCOPE


def test_a_handles_event_is_recorded_on_the_side_stream_only(monkeypatch):
    """A transfer's handle is an event of a ring of 16 recorded on the side stream only: recorded
    again 16 transfers later, and then on the side stream (a later copy: its waiter waits for more,
    never for less). With one ring for the handles and for the side stream's waits on the caller's
    stream, a handle's event was recorded again 8 transfers later, on the caller's stream, and its
    waiter no longer waited for the copy."""
    api = _StreamAPI()
    api.install(monkeypatch)
    t, cuda = comm.EmulatedTransport(2, 0), torch.device("cuda", 0)
    src, dst = torch.arange(6.0), torch.zeros(6)
    with t.transfers(cuda):
        events = [t._copies(cuda, [(dst, src)])._event for _ in range(17)]
    side = t._side(cuda).stream
    assert len({id(e) for e in events[:16]}) == 16
    assert events[0] is events[16] and events[16].recorded == [side, side]


def test_an_op_scope_is_its_threads_own(monkeypatch):
    """Each thread has its own side stream, event ring and op scope on a transport: a transfer made
    by another thread while an op's scope is open is not that op's (it ran on the op's stream,
    skipped record_stream and was left to the other thread's scope to join)."""
    api = _StreamAPI()
    api.install(monkeypatch)
    t, cuda = comm.EmulatedTransport(2, 0), torch.device("cuda", 0)
    src, dst = torch.arange(6.0), torch.zeros(6)
    with t.transfers(cuda):
        other = threading.Thread(target=lambda: t._copies(cuda, [(dst, src)]))
        other.start()
        other.join()
    assert api.calls["Stream"] == 1 + 2 and api.calls["record_stream"] == 2  # (the stand-in main stream, a side per thread)
