"""In-kernel-wait schedules (fusedpar/ops/symmetric.py): the single-device emulation
(EmulatedTransport(in_kernel_waits=True)), transport selection on real process groups, the real
transport's host logic across processes, and the compiled GPU tests (a late producer, a missing
wait, a wait that gives up, one hardware queue).

On CPU the emulation runs its producer before the consumer (the interpreter runs programs one
after another), so these tests check the wiring: chunk order, flags and their reset, counters,
layouts. The overlap itself (spinning programs, copy engines, a producer made late on purpose)
is tested by the ``gpu``-marked tests below.
"""
import contextlib
import functools
import gc
import os
import random
import re
import subprocess
import sys
import textwrap
import time
import weakref
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, randn
from _world import rank_rng, world_fixture
from fusedpar.kernels import WaitTimeout, wait_timeouts
from fusedpar.kernels import persistent_matmul_reference as ref_mm
from fusedpar.kernels import waits
from fusedpar.kernels.waits import WAIT_CHECKS, canonical_device, status_word
from fusedpar.ops.tensor_parallel import symmetric
from fusedpar.ops.comm.symmetric import (
    GroupCache,
    SymmetricTransport,
    resolve_transport,
    set_workspace_factory,
    symmetric_status,
)
from fusedpar.ops.tensor_parallel.symmetric import all_gather_matmul_symmetric, matmul_reduce_scatter_symmetric
from fusedpar.ops.comm.waits import ChunkFlags, chunk_flags, device_ints
from fusedpar.ops.comm.transport import EmulatedTransport, PortableTransport

world2 = world_fixture(2)  # GPU test only (needs 2 GPUs)
world3 = world_fixture(3)


def _emulated(P, rank, **kw):
    return EmulatedTransport(P, rank, in_kernel_waits=True, **kw)


# --------------------------------------------------------------------------------------------
# the emulation (every peer mirrors this rank): the shipped schedules on one device
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gather_dim", [1, 0])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_emulated_all_gather_matmul(device, dtype, gather_dim, rank):
    """Every rank position, both gather dims, gated activation with the pre-activation and the
    gathered input kept; repeated calls reuse the workspace and its flags (every one raised by the
    call, lowered at the start of the next), and the ready word the GEMM reads stays the same word
    holding 1. By the mirror rule every peer's shard is this rank's."""
    g = torch.Generator().manual_seed(11 + rank + 10 * gather_dim)
    P, b, s, K, F = 3, 2, 7, 40, 13
    w = randn(2 * F, K, dtype=dtype, generator=g, scale=K ** -0.5)
    bias = randn(2 * F, dtype=dtype, generator=g)
    t = _emulated(P, rank)
    for call in range(2):
        x = randn(b, s, K, dtype=dtype, generator=g)
        full = torch.cat([x] * P, dim=gather_dim)
        pre = torch.full((P, b, s, 2 * F), float("nan"), dtype=dtype, device=device)
        gathered = torch.full((P, b, s, K), float("nan"), dtype=dtype, device=device)
        out = all_gather_matmul_symmetric(x, w, bias, transport=t, gather_dim=gather_dim, activation="swiglu",
                                          preact_out=pre, gathered_out=gathered)
        flags = chunk_flags(t.symmetric_workspace("all_gather", x.device, 0), P)
        assert flags.i32.tolist() == [1] * P and flags.ready.tolist() == [1]
        assert_close(out, ref_mm(full, w, bias, activation="swiglu"), dtype, msg=f"call {call}")
        assert_close(pre, ref_mm(torch.stack([x] * P), w, bias), dtype, msg=f"preact call {call}")
        torch.testing.assert_close(gathered, torch.stack([x] * P), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [0, 3])
def test_emulated_matmul_reduce_scatter(device, dtype, rank):
    """Peer j's partial of this rank's chunk is this rank's partial completed at the same step,
    so the result is bias + sum_c x_c @ W^T; the counters keep growing over calls."""
    g = torch.Generator().manual_seed(12 + rank)
    P, b, s, K, N = 4, 2, 12, 36, 23
    x = randn(b, s, K, dtype=dtype, generator=g)
    w = randn(N, K, dtype=dtype, generator=g, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, generator=g)
    n = s // P
    expect = sum(ref_mm(x[:, c * n:(c + 1) * n], w) for c in range(P)) + bias.double()
    t = _emulated(P, rank)
    for call in range(2):
        out = torch.full((b, n, N), float("nan"), dtype=dtype, device=device)
        matmul_reduce_scatter_symmetric(x, w, bias, transport=t, out=out)
        # fp32 partials summed in fp32: only the input and output roundings of dtype remain
        assert_close(out, expect, dtype, msg=f"call {call}")
    # the workspace of the device the op ran on, named as its tensors name it (x.device is "cuda:0"
    # where DEVICE reads "cuda")
    ws = t.symmetric_workspace("reduce_scatter", x.device, 0)
    counters = ws.typed(0, (P,), torch.int32).tolist()
    assert counters == ws.ready.tolist() * P and counters[0] > 0  # the device word the reduction waited for
    # and by its other spelling ("cuda" for cuda:0, "cpu:0" for cpu): one workspace
    assert t.symmetric_workspace("reduce_scatter", _two_spellings(x.device)[1], 0) is ws


def _two_spellings(device):
    """One device named as its tensors report it (``cuda:0``, ``cpu``) and named otherwise
    (``cuda``, ``cpu:0``)."""
    named = torch.empty(0, device=device).device
    return named, torch.device(named.type) if named.index is not None else torch.device(named.type, 0)


def test_per_device_state_is_shared_by_every_spelling_of_the_device(device):
    """The workspaces (with their ready flags) and the timeout word are cached per device: the op
    keys them by its tensors' device (``cuda:0``), a caller may name it ``cuda`` (the tests'
    DEVICE). Both must reach one entry; on the H100 they did not, and the flags read back had an
    epoch that never moved."""
    x, w = randn(2, 3, 8), randn(6, 8)
    named, other = _two_spellings(x.device)
    assert named == x.device and canonical_device(other) == named
    t = _emulated(3, 1)
    all_gather_matmul_symmetric(x, w, transport=t)  # raises the flags both name
    ws = t.symmetric_workspace("all_gather", other, 0)
    assert ws is t.symmetric_workspace("all_gather", named, 0) and ws.flags.i32.tolist() == [1] * 3
    assert status_word(other) is status_word(named)


def test_canonical_device_names_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # no CUDA needed
    assert canonical_device("cuda") == torch.device("cuda", 3)
    assert canonical_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert canonical_device("cpu:0") == torch.device("cpu") == canonical_device("cpu")
    assert canonical_device("meta") == torch.device("meta")


def test_emulated_reduce_scatter_chunked_input(device):
    """chunked=True (the all-gather's dgrad layout): x is already [P, *rows, in]."""
    g = torch.Generator().manual_seed(13)
    P, b, n, K, N = 3, 2, 4, 24, 10
    xc = randn(P, b, n, K, generator=g)
    w = randn(N, K, generator=g)
    out = matmul_reduce_scatter_symmetric(xc, w, transport=_emulated(P, 1), chunked=True)
    assert_close(out, sum(ref_mm(xc[c], w) for c in range(P)), torch.float32)


def test_a_repeated_call_reuses_what_its_checks_derived(monkeypatch):
    """The tensor-parallel ops call the schedules with ``agree=False``: a call whose arguments are
    described as an earlier one's (shapes, strides, dtypes, devices, addresses modulo 16, options)
    skips the checks and reuses the layout they derived (kept on the transport), with exact results;
    a new description is checked again and a bad argument still refused."""
    checked = []
    real = symmetric.check_linear_args
    monkeypatch.setattr(symmetric, "check_linear_args", lambda op, *a: (checked.append(op), real(op, *a))[1])
    g = torch.Generator().manual_seed(15)
    P, t = 3, _emulated(3, 1)
    x, w = randn(2, 4, 16, generator=g), randn(6, 16, generator=g)
    for _ in range(3):
        out = all_gather_matmul_symmetric(x, w, transport=t, agree=False)
        assert_close(out, ref_mm(torch.cat([x] * P, 1), w), torch.float32)
        xr = randn(2, 6, 16, generator=g)
        out = matmul_reduce_scatter_symmetric(xr, w, transport=t, agree=False)
        assert_close(out, sum(ref_mm(xr[:, 2 * c:2 * c + 2], w) for c in range(P)), torch.float32)
    assert checked == ["all_gather_matmul", "matmul_reduce_scatter"]
    out = all_gather_matmul_symmetric(x[:, 1:], w, transport=t, agree=False)  # another view: checked
    assert checked[2:] == ["all_gather_matmul"] and out.shape == (2, 9, 6)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 12, 6\)"):
        all_gather_matmul_symmetric(x, w, transport=t, agree=False, out=torch.empty(2, 4, 6, device=DEVICE))


def test_reduce_scatter_enqueues_the_gemm_before_the_reduction(monkeypatch):
    """The reduction spins on completion counters that the GEMM bumps: it must be enqueued after
    that GEMM (on one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1 or MPS, a spinning kernel queued
    first would wait for one queued behind it). On CPU the kernels run at once in the order of the
    code, which is also the GPU's order (one code path): a reduction first would time out here."""
    calls = []
    for name, tag in (("persistent_matmul", "gemm"), ("chunk_reduce", "reduce")):
        real = getattr(symmetric, name)

        def spy(*args, _real=real, _tag=tag, **kw):
            calls.append(_tag)
            return _real(*args, **kw)

        monkeypatch.setattr(symmetric, name, spy)
    g = torch.Generator().manual_seed(14)
    x, w = randn(2, 6, 16, generator=g), randn(5, 16, generator=g)
    out = matmul_reduce_scatter_symmetric(x, w, transport=_emulated(3, 2), max_spin=50)
    assert calls == ["gemm", "reduce"]
    assert_close(out, sum(ref_mm(x[:, 2 * c:2 * c + 2], w) for c in range(3)), torch.float32)


def test_reduce_scatter_ready_word_follows_the_counters(monkeypatch):
    """The reduction's ready value is set on the device from this rank's counters plus the call's
    tiles per chunk, not from a count kept on the host: a call whose GEMM raised before it launched
    (a rejected config, OutOfResources, an interrupt) leaves nothing behind (with the host's count
    raised first, every later call waited for tiles that never came and timed out), and counters
    that wrapped past 2^31 - 1 (a CUDA graph replayed many times) go on working."""
    g = torch.Generator().manual_seed(16)
    t = _emulated(3, 2)
    x, w = randn(2, 6, 16, generator=g), randn(5, 16, generator=g)
    expect = sum(ref_mm(x[:, 2 * c:2 * c + 2], w) for c in range(3))
    rs = functools.partial(matmul_reduce_scatter_symmetric, x, w, transport=t, max_spin=50)
    rs()

    def fail(*args, **kwargs):
        raise RuntimeError("the GEMM failed to launch")

    with monkeypatch.context() as m:
        m.setattr(symmetric, "persistent_matmul", fail)
        with pytest.raises(RuntimeError, match="failed to launch"):
            rs()
    assert_close(rs(), expect, torch.float32)
    ws = t.symmetric_workspace("reduce_scatter", x.device, 0)
    counters = ws.typed(0, (3,), torch.int32)
    counters.fill_(2 ** 31 - 1)  # where many replays leave them
    for _ in range(2):
        assert_close(rs(), expect, torch.float32)
    assert counters.tolist() == ws.ready.tolist() * 3 and ws.ready.item() < 0


def test_all_gather_flags_are_lowered_before_a_call_raises_any(monkeypatch):
    """A call lowers the flags before it raises one, so a flag its GEMM reads as ready was raised by
    this call: a call that raised after its pulls (a GEMM that failed to launch) left them raised
    (they were lowered after the join only), and on a GPU the next call's GEMM found the remote
    chunks ready before its own pulls landed. The flags are kept per workspace: a call on another
    transport on the device lowers and raises its own."""
    t, other = _emulated(3, 1), _emulated(3, 2)
    x, w = randn(2, 4, 8), randn(6, 8)
    at_pulls, real_pulls = [], symmetric.pull_chunks

    def pulls(chunks, flags, **kw):
        at_pulls.append(flags.i32.tolist())
        return real_pulls(chunks, flags, **kw)

    def fail(*args, **kwargs):
        raise RuntimeError("the GEMM failed to launch")

    monkeypatch.setattr(symmetric, "pull_chunks", pulls)
    all_gather_matmul_symmetric(x, w, transport=t)
    with monkeypatch.context() as m:
        m.setattr(symmetric, "persistent_matmul", fail)
        with pytest.raises(RuntimeError, match="failed to launch"):
            all_gather_matmul_symmetric(x, w, transport=t)
    assert_close(all_gather_matmul_symmetric(x, w, transport=t), ref_mm(torch.cat([x] * 3, 1), w), torch.float32)
    all_gather_matmul_symmetric(x, w, transport=other)
    assert at_pulls == [[0, 0, 0]] * 4
    flags = [chunk_flags(u.symmetric_workspace("all_gather", x.device, 0), 3) for u in (t, other)]
    assert flags[0] is not flags[1] and flags[0].ready is flags[1].ready


def test_reduce_scatter_keeps_one_running_sum_for_every_shape():
    """The reduction's fp32 running sum is one buffer per workspace, grown to the largest shape and
    sliced per call (with variable sequence lengths it was one buffer per shape, never freed)."""
    g = torch.Generator().manual_seed(17)
    t, w = _emulated(2, 1), randn(5, 16, generator=g)
    for rows in (8, 4, 2, 6):
        x = randn(1, rows, 16, generator=g)
        out = matmul_reduce_scatter_symmetric(x, w, transport=t, max_spin=50)
        assert_close(out, sum(ref_mm(x[:, c * rows // 2:(c + 1) * rows // 2], w) for c in range(2)), torch.float32)
    ws = t.symmetric_workspace("reduce_scatter", x.device, 0)
    sums = {v.untyped_storage().data_ptr() for views in ws.views.values() for v in views
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32}
    sums |= {v.untyped_storage().data_ptr() for v in ws.fp32_views.values()}
    sums.discard(ws.tensor.untyped_storage().data_ptr())  # (the fp32 partials: views of the workspace)
    assert len(sums) == 1 and ws.fp32.numel() == 4 * 5


def test_flags_raise_and_reset_to_constants():
    """A flag is raised to the constant the ready word holds and reset to 0 (no epoch on the host:
    every value written or waited for is the same call after call)."""
    f = ChunkFlags(4, torch.device("cpu"))
    f.raise_flag(2)
    assert f.i32.tolist() == [0, 0, 1, 0] and f.ready.tolist() == [1]
    f.reset()
    assert f.i32.tolist() == [0, 0, 0, 0]


def test_state_kept_across_calls_is_never_made_inside_a_graph_capture(monkeypatch):
    """What an op keeps for later calls (the timeout word, a workspace, its flags, offset tables)
    made inside a CUDA-graph capture would have its initialisation captured, not run (eager calls
    would find it unset): a clear error asks for a warm-up instead. On CPU, with the capture query
    answering yes for a CUDA device that was never used."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda = torch.device("cuda", 7)
    for make in (lambda: status_word(cuda), lambda: _emulated(2, 0).symmetric_workspace("all_gather", cuda, 64),
                 lambda: chunk_flags(SimpleNamespace(flags=None, tensor=SimpleNamespace(device=cuda)), 2),
                 lambda: device_ints((3, 5), cuda)):
        with pytest.raises(RuntimeError, match="must be made before a CUDA-graph capture on cuda:7.*warm-up"):
            make()


def test_buffers_a_captured_op_used_outlive_the_caches(monkeypatch):
    """A CUDA graph replays the addresses it captured: the buffers an op used while captured are
    kept on its transport (``graph_buffers``) whatever the caches drop or replace later (here the
    ring's buffer, replaced for a larger shape; a workspace, its views and running sum likewise).
    On CPU, with the capture query answering yes."""
    from fusedpar.ops.comm import transport as transport_module
    from fusedpar.ops.tensor_parallel.schedules import ring_gather

    t, x = _emulated(2, 1), torch.randn(3, 4)
    matmul_reduce_scatter_symmetric(torch.randn(1, 2, 4), torch.randn(3, 4), transport=t)  # warm-up
    with monkeypatch.context() as m:
        m.setattr(transport_module, "capturing", lambda device: True)
        list(ring_gather(x, t))
        matmul_reduce_scatter_symmetric(torch.randn(1, 2, 4), torch.randn(3, 4), transport=t)
    key = ("ring_gather", x.dtype, x.device)
    flat = t.scratch[key].flat
    list(ring_gather(torch.randn(30, 4), t))  # not captured, larger: the cache replaces the buffer
    held = list(t.graph_buffers.values())
    assert t.scratch[key].flat is not flat and any(
        isinstance(h, tuple) and h[0].untyped_storage().data_ptr() == flat.data_ptr() for h in held)
    ws = t.symmetric_workspace("reduce_scatter", x.device, 0)
    assert any(h is ws for h in held) and any(h is ws.fp32_views[3] for h in held)  # (1 row x 3 features)


def _error_calls():
    x, w = torch.randn(2, 4, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    t = _emulated(3, 0)
    ag, rs = all_gather_matmul_symmetric, matmul_reduce_scatter_symmetric
    return [
        ("weight_shape", ValueError, "weight must have shape", lambda: ag(x, torch.randn(6, 7), transport=t)),
        ("gather_dim", ValueError, "gather_dim must be a token dim", lambda: ag(x, w, transport=t, gather_dim=2)),
        ("rank", ValueError, "rank must be <= 2, got 3", lambda: EmulatedTransport(3, 3, in_kernel_waits=True)),
        ("glu_rows", ValueError, "even number of rows",
         lambda: ag(x, torch.randn(5, 8, device=DEVICE), transport=t, activation="swiglu")),
        ("divisible", ValueError, r"x.shape\[1\]=4 must be divisible by the group size \(3\)",
         lambda: rs(x, w, transport=t)),
        ("dtype", TypeError, "weight must have the same dtype as x", lambda: rs(x, w.half(), transport=_emulated(2, 0))),
        ("out_shape", ValueError, r"out must have shape \(2, 12, 6\)",
         lambda: ag(x, w, transport=t, out=torch.empty(2, 4, 6, device=DEVICE))),
        ("no_waits", ValueError, "transport must support in-kernel waits",
         lambda: ag(x, w, transport=EmulatedTransport(3, 0))),
        ("portable", ValueError, "transport must support in-kernel waits", lambda: ag(x, w, transport=PortableTransport())),
        ("delay_on_cpu", ValueError, "producer_delay_cycles must be 0 on cpu",
         lambda: ag(x.cpu(), w.cpu(), transport=t, producer_delay_cycles=10)),
        ("in_kernel_waits_type", TypeError, "in_kernel_waits must be a bool", lambda: EmulatedTransport(2, in_kernel_waits=1)),
    ]


@pytest.mark.parametrize("case", range(len(_error_calls())), ids=[c[0] for c in _error_calls()])
def test_emulation_errors(case):
    _, exc, pattern, call = _error_calls()[case]
    with pytest.raises(exc, match=pattern):
        call()


# --------------------------------------------------------------------------------------------
# transport selection and the per-group caches
# --------------------------------------------------------------------------------------------
def test_transport_names_are_checked():
    with pytest.raises(ValueError, match="transport must be one of"):
        resolve_transport("nvshmem", torch.zeros(1))


def test_transport_instances_pass_through():
    t = _emulated(4, 1)
    assert resolve_transport(t, torch.zeros(1)) is t
    with pytest.raises(ValueError, match="either group= or a Transport"):
        resolve_transport(t, torch.zeros(1), group=object())
    assert resolve_transport("symmetric", torch.zeros(1)).name == "portable"  # one rank: nothing to gather


def test_group_cache_never_hands_a_freed_groups_entries_to_a_new_group():
    """An entry cached for a group that has been destroyed and freed must not reach a new group
    that the allocator put at the same address (same id()): entries are keyed weakly by the group."""

    class FakeGroup:
        pass

    cache, ids, reused = GroupCache(), set(), 0
    for i in range(50):
        group = FakeGroup()
        reused += id(group) in ids
        ids.add(id(group))
        entries = cache.entries(group)
        assert entries == {}, f"group {i} was handed a freed group's entries {entries}"
        entries["workspace"] = i
        assert cache.entries(group) == {"workspace": i}
        del group, entries  # freed at once (reference counting)
    assert reused, "the loop never reused an id: it did not exercise the hazard"
    assert len(cache) == 0  # a freed group's entries go with it


def _transport_cases(rank, size):
    x = torch.randn(2, 3, 8, device=DEVICE)
    ok, reason = symmetric_status(x)
    backend = torch.distributed.get_backend()
    if DEVICE.type == "cpu":
        assert not ok and "cpu" in reason, reason
    elif backend != "nccl":
        assert not ok and backend in reason, reason
    chosen = resolve_transport("auto", x).name
    assert chosen == ("symmetric" if ok else "portable")
    assert resolve_transport("portable", x).name == "portable"
    assert resolve_transport("auto", x) is resolve_transport("auto", x)  # made once per group (its specs kept)
    _cached_transports_let_their_group_go(x)
    if not ok:
        with pytest.raises(ValueError, match=re.escape("transport='symmetric' is not available here: " + reason)):
            resolve_transport("symmetric", x)
    return chosen


def _cached_transports_let_their_group_go(x):
    """The transport cached per group holds the group weakly: once destroyed and dropped, the group
    is freed (the cache's value held it, so its weak key never died) and the transport says so."""
    group = torch.distributed.new_group(list(range(torch.distributed.get_world_size())))
    t = resolve_transport("portable", x, group)
    assert resolve_transport("portable", x, group) is t and t.group is group
    ref = weakref.ref(group)
    torch.distributed.destroy_process_group(group)
    del group
    gc.collect()
    assert ref() is None, "the transport cache kept a destroyed group alive"
    with pytest.raises(RuntimeError, match="process group no longer exists"):
        t.all_reduce(torch.zeros(1))


def test_transport_selection_on_the_group(world3):
    chosen = world3.run(_transport_cases)
    assert len(set(chosen)) == 1  # every rank takes the same path
    if INTERPRETED:
        assert chosen == ["portable"] * 3


# --------------------------------------------------------------------------------------------
# the symmetric transport's host logic across real CPU processes: symmetric memory replaced by
# file-backed shared memory that every process maps (peer pointers valid in this process), the
# barrier by a gloo barrier with random delays. The kernels run interpreted; the reduce-scatter
# consumer really spins on the peers' counters while the peer processes compute.
# --------------------------------------------------------------------------------------------
class _FileHandle:
    def __init__(self, bufs, rank, group, rng):
        self.bufs, self.rank, self.group, self.rng = bufs, rank, group, rng
        self.buffer_ptrs = [b.data_ptr() for b in bufs]
        self.offset = 0

    def barrier(self, channel=0, timeout_ms=0):
        time.sleep(self.rng.random() * 0.05)
        torch.distributed.barrier(group=self.group)

    def get_remote_tensor(self, peer, sizes, dtype):
        n = int(torch.Size(sizes).numel()) * dtype.itemsize
        return self.bufs[peer][:n].view(dtype).view(sizes)


def _file_workspace_factory(tmpdir, seed, calls):
    def factory(group, device, size):
        r, P = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        calls.append(size)
        paths = [os.path.join(tmpdir, f"ws{seed}_{len(calls)}_{j}") for j in range(P)]
        with open(paths[r], "wb") as f:
            f.truncate(size)  # zero-filled
        torch.distributed.barrier(group=group)
        bufs = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in paths]
        return bufs[r], _FileHandle(bufs, r, group, random.Random(seed + r))

    return factory


def _symmetric_over_shared_files(rank, size, tmpdir, seed):
    calls = []
    saved = set_workspace_factory(_file_workspace_factory(tmpdir, seed, calls))
    try:
        t = SymmetricTransport()
        b, s, K, N = 2, 5, 24, 19
        w = torch.randn(N, K, generator=rank_rng(seed))
        bias = torch.randn(N, generator=rank_rng(seed + 1))
        xs = [torch.randn(b, s, K, generator=rank_rng(seed + 2, q)) for q in range(size)]
        for gather_dim, act in ((1, "gelu"), (0, "none")):
            full = torch.cat(xs, dim=gather_dim)
            for _ in range(2):  # the second call reuses slots and flags (epochs, barriers)
                gathered = torch.full((size, b, s, K), float("nan"))
                out = all_gather_matmul_symmetric(xs[rank], w, bias, transport=t, gather_dim=gather_dim,
                                                  activation=act, gathered_out=gathered)
                assert_close(out, ref_mm(full, w, bias, activation=act), torch.float32, msg=f"AG dim {gather_dim}")
                torch.testing.assert_close(gathered, torch.stack(xs), rtol=0, atol=0)
        # reduce-scatter: rank q holds K_q = 20 input features of a 20*size-wide contraction
        xr = [torch.randn(b, 2 * size, 20, generator=rank_rng(seed + 3, q)) for q in range(size)]
        wr = [torch.randn(N, 20, generator=rank_rng(seed + 4, q)) for q in range(size)]
        total = sum(ref_mm(x, wq) for x, wq in zip(xr, wr)) + bias.double()
        for call in range(2):  # counters keep growing: the second call waits for base + tiles
            out = matmul_reduce_scatter_symmetric(xr[rank], wr[rank], bias, transport=t, scatter_dim=1)
            assert_close(out, total[:, 2 * rank:2 * rank + 2], torch.float32, msg=f"RS call {call}")
        ws = SymmetricTransport().symmetric_workspace("reduce_scatter", "cpu", 0)  # cached per group
        counters = ws.typed(0, (size,), torch.int32).tolist()
        assert counters == ws.ready.tolist() * size and counters[0] > 0
        assert SymmetricTransport().symmetric_workspace("reduce_scatter", "cpu:0", 0) is ws  # per device, any name
        _fresh_groups_get_fresh_workspaces(size, calls)
    finally:
        set_workspace_factory(saved)
    return rank


def _fresh_groups_get_fresh_workspaces(size, calls):
    """Groups created after others were destroyed never see the destroyed groups' workspaces."""
    for i in range(3):
        group = torch.distributed.new_group(list(range(size)))
        before = len(calls)
        ws = SymmetricTransport(group).symmetric_workspace("fresh", "cpu", 64)
        assert len(calls) == before + 1 and ws.ready.item() == 0, f"group {i} got a cached workspace"
        ws.ready.fill_(1000 + i)  # what a stale hand-off would show
        torch.distributed.destroy_process_group(group)
        del group, ws
        gc.collect()


@pytest.mark.skipif(not INTERPRETED, reason="the shared-file stand-in runs the kernels interpreted on CPU "
                    "tensors; GPU machines run the real transport (test_gpu_symmetric_transport_two_ranks)")
def test_symmetric_transport_over_shared_memory(world3, tmp_path):
    assert world3.run(_symmetric_over_shared_files, tmpdir=str(tmp_path), seed=41) == [0, 1, 2]


def _run_op(fn, transport, x, w, b, g, **kw):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = fn(x, w, b, transport=transport, **kw)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def _op_cases(size, seed, rank):
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter

    K, F = 24, 7
    x = torch.randn(2, 3, K, generator=rank_rng(seed, rank))
    return [
        (all_gather_matmul, x, torch.randn(2 * F, K, generator=rank_rng(seed + 1, rank)),
         torch.randn(2 * F, generator=rank_rng(seed + 2)), (2, 3 * size, F), dict(gather_dim=1, activation="swiglu")),
        (all_gather_matmul, x, torch.randn(F, K, generator=rank_rng(seed + 3, rank)),
         torch.randn(F, generator=rank_rng(seed + 4)), (2 * size, 3, F), dict(gather_dim=0, save_gathered_input=False)),
        (matmul_reduce_scatter, torch.randn(2, 2 * size, K, generator=rank_rng(seed + 5, rank)),
         torch.randn(F, K, generator=rank_rng(seed + 6, rank)), torch.randn(F, generator=rank_rng(seed + 7)),
         (2, 2, F), dict(scatter_dim=1)),
        # fp8 without a kept input: the persistent fp8 GEMM, each peer's e4m3 shard and scales in its slot
        (all_gather_matmul, x, torch.randn(2 * F, K, generator=rank_rng(seed + 9, rank)),
         torch.randn(2 * F, generator=rank_rng(seed + 10)), (2, 3 * size, F),
         dict(gather_dim=1, activation="swiglu", save_gathered_input=False, fp8="blockwise")),
    ]


def _ops_symmetric_vs_portable(rank, size, tmpdir, seed):
    """fusedpar.ops on a SymmetricTransport (over the shared-file stand-in) against
    transport="portable": outputs and every gradient, both ops, gated activation, re-gather, and
    the fp8 all-gather GEMM (distinct peers: each slot's scales must be its own shard's); the fp8
    reduce-scatter against one process (distinct peers: each partial from its own rank's operands)."""
    saved = set_workspace_factory(_file_workspace_factory(tmpdir, seed, []))
    try:
        for i, (fn, xi, w, b, out_shape, kw) in enumerate(_op_cases(size, seed, rank)):
            g = torch.randn(out_shape, generator=rank_rng(seed + 8 + i, rank))
            ref = _run_op(fn, "portable", xi, w, b, g, **kw)
            got = _run_op(fn, SymmetricTransport(), xi, w, b, g, **kw)
            for name, a, e in zip(("out", "dx", "dW", "db"), got, ref):
                assert_close(a, e, torch.float32, msg=f"case {i} {name}")
        # matmul_reduce_scatter(fp8=...): the persistent fp8 GEMM and the reduction over the peers'
        # files, output and gradients against one process with the same quantisation (test_tensor_parallel_ops)
        from test_tensor_parallel_ops import _fp8_rs_case

        persistent = symmetric.matmul_reduce_scatter_symmetric
        with mock.patch.object(symmetric, "matmul_reduce_scatter_symmetric", wraps=persistent) as spy:
            _fp8_rs_case(rank, size, recipe="blockwise", scatter_dim=0, hp=False, seed=seed + 20,
                         transport=SymmetricTransport())
        assert spy.call_count == 1
    finally:
        set_workspace_factory(saved)
    return rank


@pytest.mark.skipif(not INTERPRETED, reason="the shared-file stand-in runs the kernels interpreted on CPU "
                    "tensors; GPU machines run the real transport (test_gpu_symmetric_transport_two_ranks)")
def test_ops_transport_symmetric_equals_portable(world3, tmp_path):
    assert world3.run(_ops_symmetric_vs_portable, tmpdir=str(tmp_path), seed=51) == [0, 1, 2]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["ag_swiglu", "ag_batch_regather", "rs"])
def test_ops_emulated_in_kernel_waits_equals_rings(case):
    """One process: the TP ops on EmulatedTransport with in-kernel waits (the symmetric schedules)
    and without (the portable rings) compute the same outputs and gradients (same mirror peers)."""
    fn, x, w, b, out_shape, kw = _op_cases(3, 61, 1)[case]
    x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)
    g = torch.randn(out_shape, generator=rank_rng(69)).to(DEVICE)
    ref = _run_op(fn, EmulatedTransport(3, 1), x, w, b, g, **kw)
    got = _run_op(fn, EmulatedTransport(3, 1, in_kernel_waits=True), x, w, b, g, **kw)
    for name, a, e in zip(("out", "dx", "dW", "db"), got, ref):
        assert_close(a, e, torch.float32, msg=name)


def _ops_transport_errors(rank, size):
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter

    x, w = torch.randn(2, 3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="transport='symmetric' is not available here"):
        all_gather_matmul(x, w, transport="symmetric")
    with pytest.raises(ValueError, match="transport must be one of"):
        matmul_reduce_scatter(torch.randn(2, 3 * size, 8), w, transport="nccl")
    y = all_gather_matmul(x, w, transport="auto")  # portable on gloo/CPU
    assert y.shape == (2, 3 * size, 4)
    return rank


def test_ops_transport_errors(world3):
    if not INTERPRETED:
        pytest.skip("on a GPU machine the world may run NCCL, where 'symmetric' can be available")
    assert world3.run(_ops_transport_errors) == [0, 1, 2]


# --------------------------------------------------------------------------------------------
# compiled GPU tests (skipped off GPU by conftest)
# --------------------------------------------------------------------------------------------
_CYCLES_PER_MS = []


def _delay_cycles(ms):
    """GPU clock cycles that torch.cuda._sleep needs to last about ``ms`` milliseconds
    (calibrated once with events)."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / start.elapsed_time(end))
    return int(ms * _CYCLES_PER_MS[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_late_producer_is_waited_for(dtype):
    """The producer sleeps ~50 ms before its first pull. With waits the result is right; without
    them the GEMM reads the slots that have not arrived, which still hold the previous call's
    NaN shard: the test of the test (a missing wait shows as wrong data)."""
    g = torch.Generator().manual_seed(21)
    P, b, s, K, N = 8, 1, 256, 512, 384
    x = randn(b, s, K, dtype=dtype, generator=g)
    w = randn(N, K, dtype=dtype, generator=g, scale=K ** -0.5)
    nan = torch.full_like(x, float("nan"))
    expect = ref_mm(torch.cat([x] * P, dim=1), w)
    for rank in (0, 5):
        t = _emulated(P, rank)
        all_gather_matmul_symmetric(nan, w, transport=t)  # every slot now holds NaN
        out = all_gather_matmul_symmetric(x, w, transport=t, producer_delay_cycles=_delay_cycles(50))
        torch.cuda.synchronize()
        assert_close(out, expect, dtype, msg=f"waiting GEMM, rank {rank}")
        assert wait_timeouts("cuda") == 0
    t = _emulated(P, 2)
    all_gather_matmul_symmetric(nan, w, transport=t, wait=False)
    out = all_gather_matmul_symmetric(x, w, transport=t, wait=False, producer_delay_cycles=_delay_cycles(50))
    torch.cuda.synchronize()
    assert not torch.isnan(out[:, 2 * s:3 * s]).any()  # the local chunk was there from the start
    assert torch.isnan(out[:, 3 * s:4 * s]).all(), "no wait, yet the late chunk was read after it arrived?"


@pytest.mark.gpu
def test_gpu_reduce_waits_for_counters():
    """The GEMM starts ~20 ms late on purpose; the reduction, enqueued after it on the side
    stream, spins on the completion counters meanwhile. Without the waits it reads the previous
    call's partials (NaN, from a NaN input) before the GEMM overwrote them."""
    g = torch.Generator().manual_seed(22)
    P, b, s, K, N = 8, 1, 2048, 1024, 1024
    x = randn(b, s, K, dtype=torch.bfloat16, generator=g)
    w = randn(N, K, dtype=torch.bfloat16, generator=g, scale=K ** -0.5)
    nan = torch.full_like(x, float("nan"))
    n = s // P
    expect = sum(ref_mm(x[:, c * n:(c + 1) * n], w) for c in range(P))
    t = _emulated(P, 3)
    matmul_reduce_scatter_symmetric(nan, w, transport=t)
    out = matmul_reduce_scatter_symmetric(x, w, transport=t, producer_delay_cycles=_delay_cycles(20))
    torch.cuda.synchronize()
    assert_close(out, expect, torch.bfloat16, msg="waiting reduce")
    assert wait_timeouts("cuda") == 0
    # the NaN refill also compiles the kernels the timed call runs (chunk_reduce without waits): the
    # delay counts from its enqueue, and a reduce compiled by the timed call itself was launched on
    # the H100 after the delay and the GEMM were over, so it read complete partials
    matmul_reduce_scatter_symmetric(nan, w, transport=t, wait=False)
    out = matmul_reduce_scatter_symmetric(x, w, transport=t, wait=False, producer_delay_cycles=_delay_cycles(20))
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "no wait, yet a partial was complete when read?"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", WAIT_CHECKS)
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_gpu_wait_that_gives_up_raises(op, mode, monkeypatch):
    """A producer later than the spin bound: WaitTimeout (compiled, not only interpreted), raised
    by the op itself with FUSEDPAR_WAIT_CHECK=sync; by default (deferred) by the first check after
    the op's snapshot landed (here the next call's), naming the op that timed out."""
    monkeypatch.setattr(waits, "WAIT_CHECK", mode)
    g = torch.Generator().manual_seed(24)
    P, s, K, N = 4, 256, 256, 256
    x, w = randn(1, s, K, dtype=torch.float16, generator=g), randn(N, K, dtype=torch.float16, generator=g)
    t = _emulated(P, 1)
    fn = all_gather_matmul_symmetric if op == "all_gather" else matmul_reduce_scatter_symmetric
    # Compile first: max_spin is a constexpr, so the first call with it compiles the waiting kernel
    # on the host, for longer than the 100 ms delay, which counts from its enqueue; on the H100 the
    # producer had finished before that kernel started (DID NOT RAISE). Without a delay this warm-up
    # may or may not run out of its 1000 reads: what it reports is discarded.
    with contextlib.suppress(WaitTimeout):
        fn(x, w, transport=t, max_spin=1000)
    torch.cuda.synchronize()
    wait_timeouts("cuda")
    name = "all_gather_matmul" if op == "all_gather" else "matmul_reduce_scatter"
    late = ".*found by the deferred check of a later op" if mode == "deferred" else ""
    with pytest.raises(WaitTimeout, match=rf"{name} \(symmetric\): \d+ wait\(s\) gave up{late}"):
        fn(x, w, transport=t, producer_delay_cycles=_delay_cycles(100), max_spin=1000)
        if mode == "deferred":  # no host synchronisation in the op: the next op's check raises
            torch.cuda.synchronize()
            waits.check_wait_timeouts("cuda", "the next op")
    torch.cuda.synchronize()
    assert wait_timeouts("cuda") == 0  # reported once


_ONE_QUEUE = textwrap.dedent(
    """
    import torch
    from fusedpar.ops.comm.symmetric import matmul_reduce_scatter_symmetric
    from fusedpar.ops.comm.transport import EmulatedTransport

    torch.manual_seed(0)
    P, s, K, N = 8, 2048, 1024, 1024
    x = torch.randn(1, s, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    t = EmulatedTransport(P, 3, in_kernel_waits=True)
    for _ in range(3):
        out = matmul_reduce_scatter_symmetric(x, w, transport=t, max_spin=1 << 22)
    ref = (x.float() @ w.float().t()).view(1, P, s // P, N).sum(1)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    print("OK" if err < 3e-2 else f"ERR {err}")
    """
)


@pytest.mark.gpu
def test_gpu_reduce_scatter_on_one_hardware_queue():
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares one hardware queue: a reduction
    enqueued before the GEMM it waits for stalls behind it (and times out); enqueued after it,
    the op completes with the right sum."""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", _ONE_QUEUE], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-1] == "OK", res.stdout


def _symmetric_vs_reference(rank, size, seed):
    dev = torch.device("cuda", torch.cuda.current_device())
    x_all = torch.randn(size, 2, 64, 256, generator=rank_rng(seed)).to(dev, torch.bfloat16)
    w = (torch.randn(192, 256, generator=rank_rng(seed + 1)) * 256 ** -0.5).to(dev, torch.bfloat16)
    bias = torch.randn(192, generator=rank_rng(seed + 2)).to(dev, torch.bfloat16)
    x = x_all[rank]
    t = resolve_transport("auto", x)
    if t.name != "symmetric":
        return "portable"
    full = torch.cat(list(x_all), dim=1)
    for _ in range(3):  # repeated calls: epochs, barriers, workspace reuse
        out = all_gather_matmul_symmetric(x, w, bias, transport=t, gather_dim=1, activation="gelu")
        assert_close(out, ref_mm(full, w, bias, activation="gelu"), torch.bfloat16, msg="AG symmetric")
    # reduce-scatter: rank r holds K/size columns of x and of the weight
    xs = [torch.randn(2, 64 * size, 128, generator=rank_rng(seed + 3, q)).to(dev, torch.bfloat16) for q in range(size)]
    ws = [(torch.randn(96, 128, generator=rank_rng(seed + 4, q)) * 0.1).to(dev, torch.bfloat16) for q in range(size)]
    total = sum(ref_mm(a, b) for a, b in zip(xs, ws)) + bias[:96].double()
    for _ in range(3):
        out = matmul_reduce_scatter_symmetric(xs[rank], ws[rank], bias[:96], transport=t, scatter_dim=1)
        assert_close(out, total[:, rank * 64:(rank + 1) * 64], torch.bfloat16, msg="RS symmetric")
    torch.cuda.synchronize()
    return "symmetric"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_symmetric_transport_two_ranks(world2):
    assert world2.run(_symmetric_vs_reference, seed=31) in (["symmetric"] * 2, ["portable"] * 2)


@pytest.mark.parametrize("scaling,gather_dim,rank", [("rowwise", 1, 1), ("blockwise", 0, 2)])
def test_emulated_all_gather_matmul_fp8(device, scaling, gather_dim, rank):
    """fp8 operands (e4m3 shard and weight with their scales, travelling together in each slot):
    the persistent fp8 GEMM with the gated activation fused. Under the interpreter the
    pre-activation equals fp8_matmul's on the gathered operands bit for bit (the same main loop;
    compiled: within fp8_matmul's tolerance, test_gemm_persistent.assert_fp8_matches); the output is
    the activation of it (an fp32 epilogue: fp32 tolerance); the scales checked before any barrier."""
    from fusedpar.kernels import fp8_matmul, quantize_e4m3
    from test_gemm_persistent import assert_fp8_matches

    g = torch.Generator().manual_seed(31 + rank)
    P, b, s, K, F = 3, 2, 5, 200, 70  # K: a ragged last 128-wide scale block; 2F = 140 weight rows
    x, w = randn(b * s, K, generator=g), randn(2 * F, K, generator=g, scale=0.1)
    bias = randn(2 * F, generator=g)
    xq, xs = quantize_e4m3(x, "row" if scaling == "rowwise" else "tile")
    wq, ws = quantize_e4m3(w, "row" if scaling == "rowwise" else "block")
    xq, xs = xq.view(b, s, K), xs.view(b, s, *xs.shape[1:])
    pre = torch.full((P, b, s, 2 * F), float("nan"), device=device)
    out = all_gather_matmul_symmetric(xq, wq, bias, transport=_emulated(P, rank), gather_dim=gather_dim,
                                      activation="swiglu", preact_out=pre, x_scale=xs, weight_scale=ws,
                                      scaling=scaling, out_dtype=torch.float32)
    expected = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=torch.float32)
    for c in range(P):
        assert_fp8_matches(pre[c], expected, scaling, xq, xs, wq, ws, bias, f"pre-activation of chunk {c}")
    gate, up = torch.cat([pre[c] for c in range(P)], dim=gather_dim).double().split(F, dim=-1)
    assert_close(out, torch.nn.functional.silu(gate) * up, torch.float32, msg="swiglu")
    with pytest.raises(ValueError, match=r"x_scale must have shape \(2, 5\)"):
        all_gather_matmul_symmetric(xq, wq, transport=_emulated(P, rank), x_scale=torch.ones(2, 6, device=device),
                                    weight_scale=ws, scaling=scaling)
    with pytest.raises(ValueError, match="are for float8_e4m3fn operands"):
        all_gather_matmul_symmetric(x.view(b, s, K), w, transport=_emulated(P, rank), x_scale=xs)


def _fp8_op_run(transport, x, w, b, g, recipe, gather_dim, activation, x_fp8):
    """``all_gather_matmul_fp8``'s forward without a kept input (pre-activation kept) and its
    backward: ``(out, preact, dx, dW, db)``."""
    from fusedpar.ops.tensor_parallel.bodies import tp_options
    from fusedpar.ops.tensor_parallel.custom_ops import all_gather_matmul_fp8_op

    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    options = tp_options(transport.transport_id, gather_dim, torch.float32, activation, False, True, False, False,
                         recipe=recipe)
    out, preact = all_gather_matmul_fp8_op(x, w, b, options, *(x_fp8 or (None, None)))[:2]
    out.backward(g)
    return out.detach(), preact, x.grad, w.grad, b.grad


@pytest.mark.parametrize("recipe,gather_dim,activation,rank,handoff,dtype", [
    ("rowwise", 1, "swiglu", 0, False, torch.float32), ("blockwise", 0, "gelu", 1, True, torch.float32),
    ("blockwise", 1, "none", 1, False, torch.float32), ("rowwise", 1, "swiglu", 1, False, torch.bfloat16)])
def test_emulated_fp8_all_gather_matmul_op_equals_ring(recipe, gather_dim, activation, rank, handoff, dtype,
                                                       monkeypatch):
    """``all_gather_matmul(fp8=recipe)`` without a kept input on a transport with in-kernel waits is
    one persistent fp8 GEMM (x quantised once, or the ``x_fp8`` pair, travelling with its scales;
    the activation fused) instead of the ring of fp8_matmul chunks: 2 ranks, against the ring on
    the same transport without in-kernel waits. Interpreted, the pre-activation and every gradient
    (the backward is the ring's, fed the same pre-activation) are the same bits; so is the output
    without an activation; with one it is the epilogue's fp32 activation instead of torch's (fp32
    tolerance). Compiled, the two GEMMs launch different tiles whose fp8 tensor cores may round
    differently (test_gemm_persistent.assert_fp8_matches), and a pre-activation a few ulps off can
    move an element of the quantised dpre by an e4m3 step: bf16 tolerances. A bf16 case too: the
    interpreted epilogue rounds the pre-activation to nearest even as a GPU does (EMULATE)."""
    from fusedpar.kernels import quantize_e4m3

    calls = []
    persistent = symmetric.all_gather_matmul_symmetric
    monkeypatch.setattr(symmetric, "all_gather_matmul_symmetric",
                        lambda *a, **k: calls.append(1) or persistent(*a, **k))

    g = torch.Generator().manual_seed(70 + rank)
    K, rows = 200, 8 if activation == "swiglu" else 6  # K: a ragged last 1x128 tile
    x = randn(2, 3, K, generator=g).to(dtype)
    w, b = randn(rows, K, generator=g, scale=K ** -0.5).to(dtype), randn(rows, generator=g).to(dtype)
    out_shape = [2, 3, rows // 2 if activation == "swiglu" else rows]
    out_shape[gather_dim] *= 2
    go = randn(*out_shape, generator=g).to(dtype)
    x_fp8 = None
    if handoff:
        q, s = quantize_e4m3(x.view(-1, K), "row" if recipe == "rowwise" else "tile")
        x_fp8 = (q.view(x.shape), s.view(2, 3, *s.shape[1:]))
    args = (x, w, b, go, recipe, gather_dim, activation, x_fp8)
    ring = _fp8_op_run(EmulatedTransport(2, rank), *args)
    assert not calls
    got = _fp8_op_run(_emulated(2, rank), *args)
    assert len(calls) == 1  # the forward; the backward's rings run over the transport's transfers
    for i, (name, a, e) in enumerate(zip(("out", "preact", "dx", "dW", "db"), got, ring)):
        if INTERPRETED and (i > 0 or activation == "none"):
            assert torch.equal(a, e), f"{name} differs from the ring's"
        else:
            assert_close(a, e, dtype if INTERPRETED else torch.bfloat16, msg=name)


@pytest.mark.parametrize("scaling,partial_dtype,chunked,rank", [("rowwise", torch.float32, False, 1),
                                                                 ("blockwise", torch.bfloat16, True, 2)])
def test_emulated_matmul_reduce_scatter_fp8(device, scaling, partial_dtype, chunked, rank):
    """fp8 operands (e4m3 x and weight with their scales, x_scale chunked with x, or given as
    chunks): the persistent fp8 GEMM writes every chunk's partial in partial_dtype, the reduction
    sums them in fp32 in the peers' completion order (by the mirror rule chunks r + 1, r + 2, ...,
    r) and adds the bias. Under the interpreter that is, bit for bit, fp8_matmul's chunk products
    rounded to partial_dtype and summed in that order in fp32 (compiled: the two GEMMs launch
    different tiles, test_gemm_persistent.assert_fp8_matches: bf16 tolerance); out is bf16 by
    default; the scales are checked before any barrier."""
    from fusedpar.kernels import fp8_matmul, quantize_e4m3

    g = torch.Generator().manual_seed(41 + rank)
    P, b, n, K, N = 3, 2, 3, 136, 20  # K: a ragged last 128-wide scale block
    x, w = randn(b * P * n, K, generator=g), randn(N, K, generator=g, scale=0.1)
    bias = randn(N, generator=g)
    xq, xs = quantize_e4m3(x, "row" if scaling == "rowwise" else "tile")
    wq, ws = quantize_e4m3(w, "row" if scaling == "rowwise" else "block")
    xq, xs = xq.view(b, P * n, K), xs.view(b, P * n, *xs.shape[1:])
    chunks = [(xq[:, c * n:(c + 1) * n], xs[:, c * n:(c + 1) * n]) for c in range(P)]
    a, a_scale = (torch.stack([q for q, _ in chunks]), torch.stack([s for _, s in chunks])) if chunked else (xq, xs)
    kw = dict(transport=_emulated(P, rank), chunked=chunked, x_scale=a_scale, weight_scale=ws, scaling=scaling)
    out = torch.full((b, n, N), float("nan"), device=device)
    matmul_reduce_scatter_symmetric(a, wq, bias, partial_dtype=partial_dtype, out=out, out_dtype=torch.float32, **kw)
    parts = [fp8_matmul(q, s, wq, ws, scaling=scaling, out_dtype=partial_dtype).float() for q, s in chunks]
    expected = parts[(rank + 1) % P].clone()
    for k in range(2, P + 1):
        expected += parts[(rank + k) % P]
    expected += bias
    if INTERPRETED:
        assert torch.equal(out, expected), "differs from fp8_matmul's partials summed in the peers' order"
    else:
        assert_close(out, expected, torch.bfloat16)
    if not chunked:
        y = matmul_reduce_scatter_symmetric(a, wq, bias, **kw)
        assert y.dtype == torch.bfloat16
        assert_close(y, expected, torch.bfloat16, msg="bf16 out")
    with pytest.raises(ValueError, match="x_scale must have shape"):
        matmul_reduce_scatter_symmetric(a, wq, **dict(kw, x_scale=a_scale[:, :1]))
    with pytest.raises(ValueError, match="are for float8_e4m3fn operands"):
        matmul_reduce_scatter_symmetric(x.view(b, P * n, K), w, transport=_emulated(P, rank), x_scale=xs)


def _fp8_rs_op_run(transport, x, w, b, g, recipe):
    """``matmul_reduce_scatter_fp8``'s forward (fp32 partials) and, with ``g``, its backward:
    ``(out, dx, dW, db)``."""
    from fusedpar.ops.tensor_parallel.bodies import tp_options
    from fusedpar.ops.tensor_parallel.custom_ops import matmul_reduce_scatter_fp8_op

    x, w = (t.detach().clone().requires_grad_(g is not None) for t in (x, w))
    b = b.detach().clone().requires_grad_(g is not None) if b is not None else None
    out = matmul_reduce_scatter_fp8_op(x, w, b, tp_options(transport.transport_id, 1, torch.float32, "none", False,
                                                           recipe=recipe))
    if g is None:
        return out
    out.backward(g)
    return out.detach(), x.grad, w.grad, b.grad


def _within_one_ulp(actual, expected, what):
    """Every element at most one unit in the last place of ``expected``'s dtype (at the larger magnitude)."""
    a, e = actual.double(), expected.double()
    ulp = torch.finfo(expected.dtype).eps * torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), e.abs()))))
    assert ((a - e).abs() <= ulp).all(), f"{what}: more than one ulp from the ring's"


@pytest.mark.parametrize("recipe,dtype,rank", [("rowwise", torch.float32, 0), ("blockwise", torch.bfloat16, 2)])
def test_emulated_fp8_matmul_reduce_scatter_op_equals_ring(recipe, dtype, rank, monkeypatch):
    """``matmul_reduce_scatter(fp8=recipe)`` on a transport with in-kernel waits is the persistent
    fp8 GEMM and the reduction (x quantised once, its scales chunked with it) instead of the ring
    of fp8_matmul chunks: 3 ranks, fp32 partials, against the ring on the same transport without
    in-kernel waits. Interpreted, the chunk products are the same bits and a sum of three is the
    same in either order; the two differ only in where the bias goes: the ring adds it in its last
    GEMM's epilogue, ``(p_r + b) + S``, the reduction after the partials, ``(S + p_r) + b``. So in
    fp32 the output is the ring's without a bias plus the bias, bit for bit. In bf16 it is within
    one bf16 ulp of the ring's (that place of the bias; both round to nearest even, chunk_reduce's
    store under the interpreter through ``EMULATE``). Compiled, the GEMMs launch different tiles
    (bf16 tolerance). The
    backward is the ring's on the same x, W and dY: the same bits on any device."""
    calls = []
    persistent = symmetric.matmul_reduce_scatter_symmetric
    monkeypatch.setattr(symmetric, "matmul_reduce_scatter_symmetric",
                        lambda *a, **k: calls.append(1) or persistent(*a, **k))
    g = torch.Generator().manual_seed(80 + rank)
    K, N = 136, 6  # K: a ragged last 1x128 tile
    x = randn(2, 6, K, generator=g).to(dtype)
    w, b = randn(N, K, generator=g, scale=K ** -0.5).to(dtype), randn(N, generator=g).to(dtype)
    go = randn(2, 2, N, generator=g).to(dtype)
    ring = _fp8_rs_op_run(EmulatedTransport(3, rank), x, w, b, go, recipe)
    assert not calls
    got = _fp8_rs_op_run(_emulated(3, rank), x, w, b, go, recipe)
    assert len(calls) == 1  # the forward; the backward gathers the output gradient over the transfers
    for name, a, e in zip(("dx", "dW", "db"), got[1:], ring[1:]):
        assert torch.equal(a, e), f"{name} differs from the ring's"
    if not INTERPRETED:
        assert_close(got[0], ring[0], torch.bfloat16, msg="out")
    elif dtype == torch.float32:
        with torch.no_grad():
            unbiased = _fp8_rs_op_run(EmulatedTransport(3, rank), x, w, None, None, recipe)
        assert torch.equal(got[0], unbiased + b), "out differs from the ring's without a bias plus the bias"
    else:
        _within_one_ulp(got[0], ring[0], "out")


@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_emulated_all_gather_matmul_empty_shard(device, fp8):
    """No tokens on a transport with in-kernel waits, 16-bit and fp8: the empty output and a zero
    weight gradient, as the ring gives (the symmetric slot of an empty shard is 16 bytes, so its
    views keep their dtype: a 0-byte slot could not be viewed as bf16 / fp32)."""
    from fusedpar.ops import all_gather_matmul

    x, w = torch.zeros(2, 0, 40, device=device, requires_grad=True), randn(8, 40, scale=0.1).requires_grad_()
    y = all_gather_matmul(x, w, activation="swiglu", save_gathered_input=False, fp8=fp8, transport=_emulated(2, 0))
    y.sum().backward()
    assert y.shape == (2, 0, 4) and x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("agree", [True, False])
@pytest.mark.parametrize("x", [None, [[1.0]]], ids=["None", "list"])
def test_a_direct_call_with_x_not_a_tensor_raises_the_checks_error(x, agree):
    """The schedule's spec key reads nothing of ``x`` before its checks: ``x`` that is not a tensor
    reaches them (inside the agreement check on a group, where every rank then raises alike)."""
    w = randn(6, 8)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        all_gather_matmul_symmetric(x, w, transport=_emulated(2, 0), agree=agree)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        matmul_reduce_scatter_symmetric(x, w, transport=_emulated(2, 0), agree=agree)


def test_flags_raised_at_once_on_the_cpu():
    """``ChunkFlags.raise_flags`` (the CPU pulls' one write): chunks ``0..n-1`` in any order fill the
    first ``n`` flags, other chunks an indexed fill; flags outside stay down; the write is kept per
    tuple and still writes after a reset."""
    from fusedpar.ops.comm.waits import READY, ChunkFlags

    flags = ChunkFlags(6, torch.device("cpu"))
    flags.raise_flags((2, 0, 1))
    assert flags.i32.tolist() == [READY] * 3 + [0] * 3
    flags.reset()
    flags.raise_flags((4, 1))
    assert flags.i32.tolist() == [0, READY, 0, 0, READY, 0]
    flags.reset()
    flags.raise_flags((2, 0, 1))
    assert flags.i32.tolist() == [READY] * 3 + [0] * 3 and len(flags.raises) == 2
