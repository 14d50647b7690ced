"""Symmetric-memory transport (fusedpar/symm.py): the single-GPU emulation, transport selection
on real process groups, and the compiled GPU tests (a late producer, a missing wait).

On CPU the emulation runs its producer before the consumer (the interpreter runs programs one
after another, DESIGN.md §3), so these tests check the wiring: chunk order, flags and epochs,
counters, layouts. The overlap itself (spinning programs, copy engines, a producer made late on
purpose) is tested by the ``gpu``-marked tests below.
"""
import os
import random
import re
import time

import pytest
import torch

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn
from _world import rank_rng, world_fixture
from fusedpar import symm
from fusedpar.kernels import wait_timeouts
from fusedpar.kernels.persistent_gemm import persistent_matmul_reference as ref_mm

world2 = world_fixture(2)  # GPU test only (needs 2 GPUs)
world3 = world_fixture(3)


def _gathered(peers, gather_dim):
    """all_gather of the shards ``peers[c]`` along ``gather_dim``."""
    return torch.cat(list(peers), dim=gather_dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_all_gather_matmul(device, dtype):
    """Every rank position, both gather dims, gated activation; repeated calls reuse the flags
    with a rising epoch (a stale flag must not count as ready)."""
    g = torch.Generator().manual_seed(11)
    P, b, s, K, F = 3, 2, 7, 40, 13
    w = randn(2 * F, K, dtype=dtype, generator=g, scale=K ** -0.5).to(device)
    bias = randn(2 * F, dtype=dtype, generator=g).to(device)
    for gather_dim in (1, 0):
        peers = randn(P, b, s, K, dtype=dtype, generator=g).to(device)
        full = _gathered(peers, gather_dim)
        expect = ref_mm(full, w, bias, activation="swiglu")
        for rank in range(P):
            epoch0 = symm._flags_for(peers.device, P).epoch
            out = poison(tuple(expect.shape), dtype, device)
            symm.emulated_all_gather_matmul(peers, w, bias, rank=rank, gather_dim=gather_dim, activation="swiglu",
                                            out=out)
            assert symm._flags_for(peers.device, P).epoch == epoch0 + 1
            assert_close(out, expect, dtype, msg=f"gather_dim={gather_dim} rank={rank}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_matmul_reduce_scatter(device, dtype):
    g = torch.Generator().manual_seed(12)
    P, b, s, K, N = 4, 2, 12, 36, 23
    x = randn(b, s, K, dtype=dtype, generator=g).to(device)
    w = randn(N, K, dtype=dtype, generator=g, scale=K ** -0.5).to(device)
    bias = randn(N, dtype=dtype, generator=g).to(device)
    n = s // P
    expect = sum(ref_mm(x[:, c * n:(c + 1) * n], w) for c in range(P)) + bias.double()
    for rank in (0, 3):
        out = poison((b, n, N), dtype, device)
        symm.emulated_matmul_reduce_scatter(x, w, bias, world=P, rank=rank, out=out)
        # fp32 partials summed in fp32: only the input and output roundings of dtype remain
        assert_close(out, expect, dtype, msg=f"rank={rank}")


def test_flags_epoch_wraps():
    f = symm.ChunkFlags(4, torch.device("cpu"))
    f.epoch = 2 ** 31 - 2
    f.i32.fill_(2 ** 31 - 2)
    assert f.begin() == 1 and f.i32.tolist() == [0, 0, 0, 0]
    f.raise_flag(2)
    assert f.i32.tolist() == [0, 0, 1, 0]


def test_transport_names_are_checked():
    with pytest.raises(ValueError, match="transport must be one of"):
        symm.resolve_transport("nvshmem", torch.zeros(1))


def _transport_cases(rank, size):
    x = torch.randn(2, 3, 8, device=DEVICE)
    ok, reason = symm.symmetric_status(x)
    backend = torch.distributed.get_backend()
    if DEVICE.type == "cpu":
        assert not ok and "cpu" in reason, reason
    elif backend != "nccl":
        assert not ok and backend in reason, reason
    chosen = symm.resolve_transport("auto", x)
    assert chosen == ("symmetric" if ok else "portable")
    assert symm.resolve_transport("portable", x) == "portable"
    if not ok:
        with pytest.raises(ValueError, match=re.escape("transport='symmetric' is not available here: " + reason)):
            symm.resolve_transport("symmetric", x)
    return chosen


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


def _file_workspace_factory(tmpdir, seed):
    calls = [0]

    def factory(group, device, size):
        r, P = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        calls[0] += 1
        paths = [os.path.join(tmpdir, f"ws{calls[0]}_{j}") for j in range(P)]
        with open(paths[r], "wb") as f:
            f.truncate(size)  # zero-filled
        torch.distributed.barrier(group=group)
        bufs = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in paths]
        return bufs[r], _FileHandle(bufs, r, group, random.Random(seed + r))

    return factory


def _symmetric_over_shared_files(rank, size, tmpdir, seed):
    saved = symm._new_workspace
    symm._new_workspace = _file_workspace_factory(tmpdir, seed)
    symm._workspaces.clear()
    try:
        b, s, K, N = 2, 5, 24, 19
        w = torch.randn(N, K, generator=rank_rng(seed))
        bias = torch.randn(N, generator=rank_rng(seed + 1))
        xs = [torch.randn(b, s, K, generator=rank_rng(seed + 2, q)) for q in range(size)]
        for gather_dim, act in ((1, "gelu"), (0, "none")):
            full = torch.cat(xs, dim=gather_dim)
            for _ in range(2):  # the second call reuses slots and flags (epochs, barriers)
                gathered = torch.full((size, b, s, K), float("nan"))
                out = symm.all_gather_matmul_symmetric(xs[rank], w, bias, gather_dim=gather_dim, activation=act,
                                                       gathered_out=gathered)
                assert_close(out, ref_mm(full, w, bias, activation=act), torch.float32, msg=f"AG dim {gather_dim}")
                torch.testing.assert_close(gathered, torch.stack(xs), rtol=0, atol=0)
        # reduce-scatter: rank q holds K_q = 20 input features of a 20*size-wide contraction
        xr = [torch.randn(b, 2 * size, 20, generator=rank_rng(seed + 3, q)) for q in range(size)]
        wr = [torch.randn(N, 20, generator=rank_rng(seed + 4, q)) for q in range(size)]
        total = sum(ref_mm(x, wq) for x, wq in zip(xr, wr)) + bias.double()
        for call in range(2):  # counters keep growing: the second call waits for base + tiles
            out = symm.matmul_reduce_scatter_symmetric(xr[rank], wr[rank], bias, scatter_dim=1)
            assert_close(out, total[:, 2 * rank:2 * rank + 2], torch.float32, msg=f"RS call {call}")
        (ws,) = [v for k, v in symm._workspaces.items() if k[0] == "reduce_scatter"]
        counters = ws.tensor[:4 * size].view(torch.int32)
        assert counters.tolist() == [ws.counter_base] * size and ws.counter_base > 0
    finally:
        symm._new_workspace = saved
        symm._workspaces.clear()
    return rank


@pytest.mark.skipif(not INTERPRETED, reason="the shared-file stand-in runs the kernels interpreted on CPU "
                    "tensors; GPU machines run the real transport (test_gpu_symmetric_transport_two_ranks)")
def test_symmetric_transport_over_shared_memory(world3, tmp_path):
    assert world3.run(_symmetric_over_shared_files, tmpdir=str(tmp_path), seed=41) == [0, 1, 2]


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
    """The producer sleeps ~50 ms before its first copy. With waits the result is right;
    without them the GEMM reads the NaN-poisoned chunks that have not arrived: the test of the
    test (a missing wait shows as wrong data)."""
    g = torch.Generator().manual_seed(21)
    P, b, s, K, N = 8, 1, 256, 512, 384
    peers = randn(P, b, s, K, dtype=dtype, generator=g).cuda()
    w = randn(N, K, dtype=dtype, generator=g, scale=K ** -0.5).cuda()
    expect = ref_mm(_gathered(peers, 1), w)
    for rank in (0, 5):
        gathered = torch.full_like(peers, float("nan"))
        out = symm.emulated_all_gather_matmul(peers, w, rank=rank, gathered=gathered,
                                              delay_cycles=_delay_cycles(50))
        torch.cuda.synchronize()
        assert_close(out, expect, dtype, msg=f"waiting GEMM, rank {rank}")
        assert wait_timeouts("cuda") == 0
    gathered = torch.full_like(peers, float("nan"))
    out = symm.emulated_all_gather_matmul(peers, w, rank=2, gathered=gathered, wait=False,
                                          delay_cycles=_delay_cycles(50))
    torch.cuda.synchronize()
    local = out[:, 2 * s:3 * s]
    assert not torch.isnan(local).any()  # the local chunk was there from the start
    assert torch.isnan(out[:, 3 * s:4 * s]).all(), "no wait, yet the late chunk was read after it arrived?"


@pytest.mark.gpu
def test_gpu_reduce_waits_for_counters():
    """chunk_reduce is launched before the GEMM (made ~20 ms late on purpose) and spins on the
    completion counters; without them it reads partials not computed yet (NaN poison)."""
    g = torch.Generator().manual_seed(22)
    P, b, s, K, N = 8, 1, 2048, 1024, 1024
    x = randn(b, s, K, dtype=torch.bfloat16, generator=g).cuda()
    w = randn(N, K, dtype=torch.bfloat16, generator=g, scale=K ** -0.5).cuda()
    n = s // P
    expect = sum(ref_mm(x[:, c * n:(c + 1) * n], w) for c in range(P))
    partials = torch.full((P, b, n, N), float("nan"), dtype=torch.float32, device="cuda")
    out = symm.emulated_matmul_reduce_scatter(x, w, world=P, rank=3, partials=partials,
                                              gemm_delay_cycles=_delay_cycles(20))
    torch.cuda.synchronize()
    assert_close(out, expect, torch.bfloat16, msg="waiting reduce")
    assert wait_timeouts("cuda") == 0
    partials.fill_(float("nan"))
    out = symm.emulated_matmul_reduce_scatter(x, w, world=P, rank=3, partials=partials, wait=False,
                                              gemm_delay_cycles=_delay_cycles(20))
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "no wait, yet a partial was complete when read?"


def _symmetric_vs_reference(rank, size, seed):
    dev = torch.device("cuda", torch.cuda.current_device())
    x_all = torch.randn(size, 2, 64, 256, generator=rank_rng(seed)).to(dev, torch.bfloat16)
    w = (torch.randn(192, 256, generator=rank_rng(seed + 1)) * 256 ** -0.5).to(dev, torch.bfloat16)
    bias = torch.randn(192, generator=rank_rng(seed + 2)).to(dev, torch.bfloat16)
    x = x_all[rank]
    if symm.resolve_transport("auto", x) != "symmetric":
        return "portable"
    full = torch.cat(list(x_all), dim=1)
    for _ in range(3):  # repeated calls: epochs, barriers, workspace reuse
        out = symm.all_gather_matmul_symmetric(x, w, bias, gather_dim=1, activation="gelu")
        assert_close(out, ref_mm(full, w, bias, activation="gelu"), torch.bfloat16, msg="AG symmetric")
    # reduce-scatter: rank r holds K/size columns of x and of the weight
    xr = torch.randn(2, 64 * size, 128, generator=rank_rng(seed + 3, rank)).to(dev, torch.bfloat16)
    wr = (torch.randn(96, 128, generator=rank_rng(seed + 4, rank)) * 0.1).to(dev, torch.bfloat16)
    xs = [torch.randn(2, 64 * size, 128, generator=rank_rng(seed + 3, q)).to(dev, torch.bfloat16) for q in range(size)]
    ws = [(torch.randn(96, 128, generator=rank_rng(seed + 4, q)) * 0.1).to(dev, torch.bfloat16) for q in range(size)]
    total = sum(ref_mm(a, b) for a, b in zip(xs, ws)) + bias[:96].double()
    for _ in range(3):
        out = symm.matmul_reduce_scatter_symmetric(xr, wr, bias[:96], scatter_dim=1)
        assert_close(out, total[:, rank * 64:(rank + 1) * 64], torch.bfloat16, msg="RS symmetric")
    torch.cuda.synchronize()
    return "symmetric"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_symmetric_transport_two_ranks(world2):
    assert world2.run(_symmetric_vs_reference, seed=31) in (["symmetric"] * 2, ["portable"] * 2)


def test_emulation_errors():
    peers = torch.randn(3, 2, 4, 8)
    w = torch.randn(6, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        symm.emulated_all_gather_matmul(peers, torch.randn(6, 7))
    with pytest.raises(ValueError, match="gather_dim must be a token dim"):
        symm.emulated_all_gather_matmul(peers, w, gather_dim=2)
    with pytest.raises(ValueError, match="rank must be in"):
        symm.emulated_all_gather_matmul(peers, w, rank=3)
    with pytest.raises(ValueError, match="even number of weight rows"):
        symm.emulated_all_gather_matmul(peers, torch.randn(5, 8), activation="swiglu")
    with pytest.raises(ValueError, match=r"x.shape\[1\]=4 must be divisible by the group size \(3\)"):
        symm.emulated_matmul_reduce_scatter(peers[0], w, world=3)
    with pytest.raises(TypeError, match="device and dtype"):
        symm.emulated_matmul_reduce_scatter(peers[0], w.half(), world=2)


def _ops_symmetric_vs_portable(rank, size, tmpdir, seed):
    """fusedpar.ops with transport="symmetric" (over the shared-file stand-in) against
    transport="portable": outputs and every gradient, both ops, gated activation, re-gather."""
    from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter

    saved = symm._new_workspace, symm.symmetric_status
    symm._new_workspace = _file_workspace_factory(tmpdir, seed)
    symm.symmetric_status = lambda x, group=None: (True, "test: file-backed shared memory")
    symm._workspaces.clear()
    try:
        def run(fn, transport, x, w, b, g, **kw):
            x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
            y = fn(x, w, b, transport=transport, **kw)
            (y * g).sum().backward()
            return y.detach(), x.grad, w.grad, b.grad

        K, F = 24, 7
        x = torch.randn(2, 3, K, generator=rank_rng(seed, rank))
        cases = [
            (all_gather_matmul, x, torch.randn(2 * F, K, generator=rank_rng(seed + 1, rank)),
             torch.randn(2 * F, generator=rank_rng(seed + 2)), (2, 3 * size, F),
             dict(gather_dim=1, activation="swiglu")),
            (all_gather_matmul, x, torch.randn(F, K, generator=rank_rng(seed + 3, rank)),
             torch.randn(F, generator=rank_rng(seed + 4)), (2 * size, 3, F),
             dict(gather_dim=0, save_gathered_input=False)),
            (matmul_reduce_scatter, torch.randn(2, 2 * size, K, generator=rank_rng(seed + 5, rank)),
             torch.randn(F, K, generator=rank_rng(seed + 6, rank)), torch.randn(F, generator=rank_rng(seed + 7)),
             (2, 2, F), dict(scatter_dim=1)),
        ]
        for i, (fn, xi, w, b, out_shape, kw) in enumerate(cases):
            g = torch.randn(out_shape, generator=rank_rng(seed + 8 + i, rank))
            ref = run(fn, "portable", xi, w, b, g, **kw)
            got = run(fn, "symmetric", xi, w, b, g, **kw)
            for name, a, e in zip(("out", "dx", "dW", "db"), got, ref):
                assert_close(a, e, torch.float32, msg=f"case {i} {name}")
    finally:
        symm._new_workspace, symm.symmetric_status = saved
        symm._workspaces.clear()
    return rank


@pytest.mark.skipif(not INTERPRETED, reason="the shared-file stand-in runs the kernels interpreted on CPU "
                    "tensors; GPU machines run the real transport (test_gpu_symmetric_transport_two_ranks)")
def test_ops_transport_symmetric_equals_portable(world3, tmp_path):
    assert world3.run(_ops_symmetric_vs_portable, tmpdir=str(tmp_path), seed=51) == [0, 1, 2]


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
