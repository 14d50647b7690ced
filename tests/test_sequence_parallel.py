"""Ring (zigzag, contiguous), Ulysses and hybrid attention on real gloo worlds: each rank's
output shard and dq/dk/dv shards equal single-process attention over the full sequence. The
ring schedule also runs in one process on an EmulatedTransport (fast CPU tests, no spawn)."""
import pytest
import torch

from _utils import DEVICE, assert_close, randn
from _world import grid_2x2, rank_rng, straggle, world_fixture
from fusedpar.kernels import attention_reference, varlen_attention_reference
from fusedpar.ops import (
    comm,
    hybrid_attention,
    ring_attention,
    sequence_shard,
    shard_positions,
    ulysses_attention,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from fusedpar.ops.sequence_parallel.bodies import ring_attention_fwd
from fusedpar.ops.sequence_parallel.plans import ring_rounds, ring_step_plan, shard_chunks
from fusedpar.ops.comm.transport import EmulatedTransport

world2 = world_fixture(2)
world3 = world_fixture(3)
world4 = world_fixture(4)

# Tolerances against the fp64 full-sequence reference, relative to the RMS of the reference.
#   fp32: the ring merges P partial softmaxes in fp32 and passes dK/dV sums in fp32; each
#         partial carries the kernel's ~1e-6 relative rounding -> 2e-5 for any P tested here.
#   fp16: inputs/outputs rounded to fp16, probabilities rounded before the PV product -> 5e-3.
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _full_inputs(seed, b, S, hq, hk, d, dtype):
    g = rank_rng(seed)  # the same full tensors on every rank
    return tuple(randn(*shape, generator=g, dtype=dtype) for shape in
                 ((b, S, hq, d), (b, S, hk, d), (b, S, hk, d), (b, S, hq, d)))


def _reference(q, k, v, do, causal, cu=None):
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    if cu is None:
        out, _ = attention_reference(qr, kr, vr, causal=causal)
    else:  # packed documents (batch 1): each document attended on its own
        out = varlen_attention_reference(qr[0], kr[0], vr[0], cu, cu, causal=causal)[0][None]
    return (out.detach(), *torch.autograd.grad(out, (qr, kr, vr), do.double()))


def _compare(fn, full, pos, causal, dtype, msg, cu=None):
    q, k, v, do = full
    pos = pos.to(q.device)  # positions are built on the host (shard_positions, arange)
    shards = [t.index_select(1, pos).requires_grad_() for t in (q, k, v)]
    out = fn(*shards)
    grads = torch.autograd.grad(out, shards, do.index_select(1, pos))
    ref = _reference(q, k, v, do, causal, cu)
    tol = TOL[dtype]
    for name, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        scale = max(r.pow(2).mean().sqrt().item(), 1.0)  # errors scale with |dout| = 1 as well
        assert_close(got, r.index_select(1, pos), dtype, rtol=tol, atol=tol * scale, msg=f"{name} {msg}")


# (layout, causal, heads, kv_heads, dtype, batch)
RING_CASES = [
    ("zigzag", True, 2, 1, torch.float32, 1),
    ("contiguous", True, 2, 2, torch.float32, 2),
    ("zigzag", False, 4, 2, torch.float32, 1),
    ("zigzag", True, 2, 2, torch.float16, 1),
]


def _ring_cases(rank, size, seed, s_local, cases):
    straggle(0.01, seed)
    try:
        for i, (layout, causal, hq, hk, dtype, b) in enumerate(cases):
            S = s_local * size
            full = _full_inputs(seed + i, b, S, hq, hk, 16, dtype)
            pos = shard_positions(S, layout=layout, ring_rank=rank, ring_size=size)
            _compare(lambda q, k, v: ring_attention(q, k, v, causal=causal, layout=layout), full, pos, causal, dtype,
                     msg=f"ring {layout} causal={causal} h={hq}/{hk} {dtype} P={size} rank {rank}")
    finally:
        comm.set_straggler(0)
    return True


def test_ring_world2(world2):
    assert all(world2.run(_ring_cases, seed=1, s_local=10, cases=[RING_CASES[i] for i in (0, 1, 3)]))


def test_ring_world4(world4):
    # odd chunk length (3) so the kernel's tails are exercised inside every ring step
    assert all(world4.run(_ring_cases, seed=2, s_local=6, cases=RING_CASES[:3]))


def test_ring_world3(world3):
    assert all(world3.run(_ring_cases, seed=3, s_local=8, cases=RING_CASES[:1]))


def _documents(S):
    """Packed-document boundaries of a sequence of S tokens: a length-1 document, an empty one,
    documents crossing several shard boundaries, a short tail; and one document spanning every
    rank between two short ones."""
    return {"ragged": torch.tensor([0, 1, 1, 7, S - 2, S], dtype=torch.int32),
            "spanning": torch.tensor([0, 2, S - 1, S], dtype=torch.int32)}


# per world: (documents, layout, causal) ring cases and the documents of a Ulysses case
DOC_CASES = {
    2: ([("ragged", "zigzag", True), ("ragged", "contiguous", True), ("spanning", "zigzag", False)], "spanning"),
    3: ([("ragged", "zigzag", True), ("spanning", "contiguous", True)], "ragged"),
    4: ([("ragged", "zigzag", True), ("spanning", "zigzag", True), ("ragged", "contiguous", False)], "ragged"),
}


def _document_cases(rank, size, seed, s_local):
    """Ring (both layouts, causal and not) and Ulysses on packed documents vs the fp64
    per-document reference."""
    straggle(0.01, seed)
    S = s_local * size
    docs = _documents(S)
    ring_cases, ulysses_docs = DOC_CASES[size]
    try:
        for i, (name, layout, causal) in enumerate(ring_cases):
            cu = docs[name]
            full = _full_inputs(seed + i, 1, S, 2, 1, 16, torch.float32)
            pos = shard_positions(S, layout=layout, ring_rank=rank, ring_size=size)
            _compare(lambda q, k, v: ring_attention(q, k, v, causal=causal, layout=layout, cu_seqlens=cu), full,
                     pos, causal, torch.float32, cu=cu, msg=f"ring docs={name} {layout} causal={causal} P={size}")
        cu = docs[ulysses_docs]
        full = _full_inputs(seed + 9, 1, S, size, 1, 16, torch.float32)
        pos = torch.arange(rank * s_local, (rank + 1) * s_local)
        _compare(lambda q, k, v: ulysses_attention(q, k, v, causal=True, cu_seqlens=cu), full, pos, True,
                 torch.float32, cu=cu, msg=f"ulysses docs={ulysses_docs} P={size} rank {rank}")
    finally:
        comm.set_straggler(0)
    return True


@pytest.mark.parametrize("world, s_local", [("world2", 6), ("world3", 4), ("world4", 4)])
def test_documents_across_shards(world, s_local, request):
    w = request.getfixturevalue(world)
    assert all(w.run(_document_cases, seed=40 + w.size, s_local=s_local))


# (causal, heads, kv_heads, batch): kv heads split evenly, replicated (fewer than ranks), MHA
ULYSSES_CASES = [(True, 4, 2, 2), (False, 4, 1, 1), (True, 8, 8, 1)]


def _ulysses_cases(rank, size, seed, s_local):
    straggle(0.01, seed)
    try:
        for i, (causal, hq, hk, b) in enumerate(ULYSSES_CASES):
            S = s_local * size
            full = _full_inputs(seed + i, b, S, hq, hk, 16, torch.float32)
            pos = torch.arange(rank * s_local, (rank + 1) * s_local)
            _compare(lambda q, k, v: ulysses_attention(q, k, v, causal=causal), full, pos, causal, torch.float32,
                     msg=f"ulysses causal={causal} h={hq}/{hk} P={size} rank {rank}")
        # heads that cannot be split: a clear error before any communication
        q = torch.randn(1, s_local, 6, 16, device=DEVICE)
        kv = torch.randn(1, s_local, 3, 16, device=DEVICE)
        with pytest.raises(ValueError, match=r"sizes that work: \[1, 3, 6\]"):
            ulysses_attention(q, kv, kv)
    finally:
        comm.set_straggler(0)
    return True


def test_ulysses_world2(world2):
    assert all(world2.run(_ulysses_cases, seed=10, s_local=9))


def test_ulysses_world4(world4):
    assert all(world4.run(_ulysses_cases, seed=11, s_local=5))


def _hybrid_cases(rank, size, seed):
    # 2 x 2: ulysses groups {0,1} {2,3}, ring groups {0,2} {1,3}
    u_group, r_group, _ = grid_2x2(rank)
    u_rank, r_rank = rank % 2, rank // 2
    straggle(0.01, seed)
    try:
        for i, (layout, causal, hq, hk, b) in enumerate([("zigzag", True, 4, 2, 2), ("contiguous", False, 2, 1, 1)]):
            S = 24
            full = _full_inputs(seed + i, b, S, hq, hk, 16, torch.float32)
            pos = shard_positions(S, layout=layout, ring_rank=r_rank, ring_size=2, ulysses_rank=u_rank, ulysses_size=2)
            _compare(lambda q, k, v: hybrid_attention(q, k, v, ulysses_group=u_group, ring_group=r_group,
                                                      causal=causal, layout=layout),
                     full, pos, causal, torch.float32, msg=f"hybrid {layout} causal={causal} h={hq}/{hk} rank {rank}")
        for i, (layout, name) in enumerate([("zigzag", "ragged"), ("contiguous", "spanning")]):
            cu = _documents(16)[name]
            full = _full_inputs(seed + 5 + i, 1, 16, 2, 2, 16, torch.float32)
            pos = shard_positions(16, layout=layout, ring_rank=r_rank, ring_size=2, ulysses_rank=u_rank, ulysses_size=2)
            _compare(lambda q, k, v: hybrid_attention(q, k, v, ulysses_group=u_group, ring_group=r_group, causal=True,
                                                      layout=layout, cu_seqlens=cu),
                     full, pos, True, torch.float32, cu=cu, msg=f"hybrid docs={name} {layout} rank {rank}")
    finally:
        comm.set_straggler(0)
    return True


def test_hybrid_2x2(world4):
    assert all(world4.run(_hybrid_cases, seed=20))


def test_zigzag_helpers():
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert shards[2][0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(zigzag_unshard(torch.cat(shards, dim=1), 3), x)
    assert zigzag_positions(24, 1, 3).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert torch.equal(sequence_shard(x, layout="contiguous", ring_rank=1, ring_size=3), x[:, 8:16])
    # hybrid: ring shard 1 of 2 in zigzag = chunks 1 and 2 of 4, then ulysses piece 1 of 2
    pos = shard_positions(16, layout="zigzag", ring_rank=1, ring_size=2, ulysses_rank=1, ulysses_size=2)
    assert pos.tolist() == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="seq_len=10"):
        zigzag_positions(10, 0, 3)
    with pytest.raises(ValueError, match="layout"):
        shard_positions(8, layout="striped")
    with pytest.raises(ValueError, match=r"rank must be in \[0, size=3\), got 3"):  # its own argument names
        zigzag_positions(12, 3, 3)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_ring_plan_is_complete_and_zigzag_balanced(size, layout):
    # every (query, key) pair that the causal mask shows is computed exactly once over the ring,
    # and in zigzag every rank does the same amount of work at every step
    s = 6
    S = s * size
    seen = torch.zeros(S, S, dtype=torch.int64)
    work = torch.zeros(size, size)
    for rank in range(size):
        qpos = shard_positions(S, layout=layout, ring_rank=rank, ring_size=size)
        for step in range(size):
            src = (rank - step) % size
            kpos = shard_positions(S, layout=layout, ring_rank=src, ring_size=size)
            launches = ring_step_plan(shard_chunks(layout, rank, size, s), shard_chunks(layout, src, size, s), True)
            for qs, ks, qo, ko, causal in launches:
                qi, kj = qpos[qs][:, None], kpos[ks][None, :]
                if causal:  # offsets must be the chunks' true global starts
                    assert qo == qpos[qs][0] and ko == kpos[ks][0]
                    vis = kj <= qi
                else:
                    assert bool((kj <= qi).all()), "an unmasked launch must see only visible keys"
                    vis = torch.ones(qi.shape[0], kj.shape[1], dtype=torch.bool)
                seen[qi.expand_as(vis)[vis], kj.expand_as(vis)[vis]] += 1
                work[rank, step] += vis.sum()
    assert torch.equal(seen, torch.ones(S, S, dtype=torch.int64).tril()), layout
    if layout == "zigzag":
        for step in range(1, size):
            assert work[:, step].eq(work[0, step]).all(), f"zigzag step {step} unbalanced: {work[:, step]}"


# ----------------------------------------------------------------------------------------------
# one rank of the ring in one process: EmulatedTransport (every peer mirrors this rank)
# ----------------------------------------------------------------------------------------------
def _mirror_reference(q, k, v, do, *, layout, causal, rank, size, window=None):
    """fp64 ``(out, dq, dk, dv)`` of rank ``rank`` under the mirror rule: every rank's K/V equal
    this rank's, so the global sequence holds k/v at every rank's positions; this rank's queries
    sit at its own positions. dk/dv sum over every position the shared k/v stand at."""
    S = q.shape[1] * size
    pos = [shard_positions(S, layout=layout, ring_rank=src, ring_size=size, device=q.device) for src in range(size)]
    inverse = torch.argsort(torch.cat(pos))  # rank-order concatenation -> sequence order
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    k_full, v_full = (t.repeat(1, size, 1, 1).index_select(1, inverse) for t in (kr, vr))
    q_full = torch.zeros(q.shape[0], S, *q.shape[2:], dtype=torch.float64, device=q.device).index_copy(
        1, pos[rank], qr)
    out = attention_reference(q_full, k_full, v_full, causal=causal, window=window)[0].index_select(1, pos[rank])
    return (out.detach(), *torch.autograd.grad(out, (qr, kr, vr), do.double()))


EMULATED_CASES = [(layout, causal, size, rank) for layout in ("zigzag", "contiguous") for causal in (True, False)
                  for size in (2, 3) for rank in range(size)]


@pytest.mark.parametrize("layout, causal, size, rank", EMULATED_CASES,
                         ids=[f"{lay}-{'causal' if c else 'full'}-P{p}-rank{r}" for lay, c, p, r in EMULATED_CASES])
def test_ring_on_emulated_transport(layout, causal, size, rank):
    # the shipped ring (forward and backward through autograd) on one rank of an emulated ring;
    # s_local=6: zigzag chunks of 3 rows exercise the kernels' tails in every step
    g = torch.Generator().manual_seed(100 * size + 10 * rank + causal)
    q, do = (randn(1, 6, 4, 16, generator=g) for _ in range(2))
    k, v = (randn(1, 6, 2, 16, generator=g) for _ in range(2))
    shards = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*shards, transport=EmulatedTransport(size, rank), causal=causal, layout=layout)
    grads = torch.autograd.grad(out, shards, do)
    ref = _mirror_reference(q, k, v, do, layout=layout, causal=causal, rank=rank, size=size)
    tol = TOL[torch.float32]
    for name, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        scale = max(r.pow(2).mean().sqrt().item(), 1.0)
        assert_close(got, r, torch.float32, rtol=tol, atol=tol * scale, msg=f"{name} {layout} causal={causal} "
                     f"P={size} rank {rank}")


def _mirror_ulysses_reference(q, k, v, do, *, causal, size):
    """fp64 ``(out, dq, dk, dv)`` of one Ulysses rank under the mirror rule (the all-to-all hands
    back what this rank sends): the gathered sequence's chunk ``j`` holds this shard's query head
    group ``j`` and the kv head rank ``j`` takes (``j * kv_heads // size``, replicated when kv heads
    are fewer than ranks); dk/dv sum over every chunk a kv head stands in."""
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    hq_l, hk = q.shape[2] // size, k.shape[2]
    kv = [j * hk // size for j in range(size)]
    q_g = torch.cat([qr[:, :, j * hq_l:(j + 1) * hq_l] for j in range(size)], dim=1)
    k_g, v_g = (torch.cat([t[:, :, h:h + 1] for h in kv], dim=1) for t in (kr, vr))
    out_g = attention_reference(q_g, k_g, v_g, causal=causal)[0]
    out = torch.cat(out_g.chunk(size, dim=1), dim=2)  # chunk j -> query head group j
    return (out.detach(), *torch.autograd.grad(out, (qr, kr, vr), do.double()))


# (size, heads, kv_heads, causal): 3 and 4 replicas of each kv head (two kv heads: replicas must
# be summed into the right one)
ULYSSES_REPLICATED = [(6, 6, 2, True), (4, 4, 1, False)]


@pytest.mark.parametrize("size, hq, hk, causal", ULYSSES_REPLICATED,
                         ids=[f"P{p}-h{hq}-kv{hk}" for p, hq, hk, _ in ULYSSES_REPLICATED])
def test_ulysses_replicated_kv_heads_on_emulated_transport(size, hq, hk, causal):
    # the replicas' dK/dV are summed in a fixed order (no atomics): the fp64 mirror reference,
    # and the same bits on a second run
    g = torch.Generator().manual_seed(31 * size + hk)
    q, do = (randn(1, 4, hq, 16, generator=g) for _ in range(2))
    k, v = (randn(1, 4, hk, 16, generator=g) for _ in range(2))
    runs = []
    for _ in range(2):
        shards = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*shards, transport=EmulatedTransport(size, 1), causal=causal)
        runs.append((out.detach(), *torch.autograd.grad(out, shards, do)))
    ref = _mirror_ulysses_reference(q, k, v, do, causal=causal, size=size)
    tol = TOL[torch.float32]
    for name, got, again, r in zip(("out", "dq", "dk", "dv"), *runs, ref):
        scale = max(r.pow(2).mean().sqrt().item(), 1.0)
        assert_close(got, r, torch.float32, rtol=tol, atol=tol * scale, msg=f"{name} ulysses P={size} kv={hk}")
        assert torch.equal(got, again), f"{name}: two runs differ (ulysses P={size} kv={hk})"


class _CountingTransport(EmulatedTransport):
    """An emulated rank that counts its point-to-point transfers (every ring shift is one)."""

    def __init__(self, size, rank):
        super().__init__(size, rank)
        self.transfers = 0

    def send_recv(self, send, dst, recv, src):
        self.transfers += 1
        return super().send_recv(send, dst, recv, src)


# (layout, causal, window, size, rank, forward + backward hops of K/V, each hop one transfer of K and
# one of V); s_local 8 (zigzag chunks of 4)
WINDOWED_RING = [
    ("contiguous", True, (7, 0), 8, 5, 1),  # ceil(7 / 8) = 1 hop instead of 7
    ("contiguous", True, (12, 0), 8, 1, 2),
    ("zigzag", True, (5, 0), 8, 6, 4),  # chunks of 4: 2 hops forward (low chunks), 2 back (high chunks)
    ("contiguous", False, (3, 9), 8, 0, 3),  # 1 hop forward, 2 back
    ("contiguous", True, (31, 0), 4, 2, 3),  # the window covers the sequence: the full ring
    ("zigzag", False, (40, 40), 4, 1, 3),
]


@pytest.mark.parametrize("layout, causal, window, size, rank, hops", WINDOWED_RING,
                         ids=[f"{c[0]}-{'causal' if c[1] else 'full'}-w{c[2][0]},{c[2][1]}-P{c[3]}"
                              for c in WINDOWED_RING])
def test_windowed_ring_transfers(layout, causal, window, size, rank, hops):
    # a window shortens the ring: K/V travel only the hops some rank needs, the dK/dV sums one
    # chain per direction whose last hop sends them straight home; the results are the mirror
    # rule's (every needed block met once, forward and backward)
    g = torch.Generator().manual_seed(7 * size + rank)
    q, do = (randn(1, 8, 2, 16, generator=g) for _ in range(2))
    k, v = (randn(1, 8, 1, 16, generator=g) for _ in range(2))
    shards = [t.clone().requires_grad_() for t in (q, k, v)]
    t = _CountingTransport(size, rank)
    out = ring_attention(*shards, transport=t, causal=causal, layout=layout, window=window)
    assert t.transfers == 2 * hops, f"forward: {t.transfers} K and V transfers, want {2 * hops}"
    grads = torch.autograd.grad(out, shards, do)
    forward, backward = ring_rounds(layout, size, 8, causal, window)
    assert forward + backward == hops
    # backward: K and V again (one transfer each per hop), plus each direction's dK/dV chain (one
    # fp32 buffer; forward: hops 0..F; backward: 1..B)
    assert t.transfers == 4 * hops + hops + (forward > 0), f"backward: {t.transfers - 2 * hops} transfers"
    ref = _mirror_reference(q, k, v, do, layout=layout, causal=causal, rank=rank, size=size, window=window)
    tol = TOL[torch.float32]
    for name, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        scale = max(r.pow(2).mean().sqrt().item(), 1.0)
        assert_close(got, r, torch.float32, rtol=tol, atol=tol * scale, msg=f"{name} {layout} window={window} "
                     f"P={size} rank {rank}")


def test_single_process_equals_flash():
    # without torch.distributed every op is local attention
    full = _full_inputs(5, 1, 13, 2, 1, 16, torch.float32)
    pos = torch.arange(13)
    _compare(lambda q, k, v: ring_attention(q, k, v, causal=True, layout="contiguous"), full, pos, True,
             torch.float32, msg="ring P=1")
    _compare(lambda q, k, v: ulysses_attention(q, k, v, causal=False), full, pos, False, torch.float32,
             msg="ulysses P=1")


_BQ = (1, 8, 2, 16)


def _t(shape=_BQ):
    return torch.randn(*shape, device=DEVICE)


# (id, exception, message pattern, call)
BAD_INPUTS = [
    ("layout", ValueError, "layout", lambda: ring_attention(_t(), _t(), _t(), layout="striped")),
    ("k/v length", ValueError, "k/v shards", lambda: ring_attention(_t(), _t((1, 4, 2, 16)), _t((1, 4, 2, 16)))),
    ("causal str", TypeError, "causal", lambda: ring_attention(_t(), _t(), _t(), causal="yes")),
    ("group int", TypeError, "ProcessGroup", lambda: ulysses_attention(_t(), _t(), _t(), group=3)),
    ("hybrid one dim", ValueError, "both", lambda: hybrid_attention(_t(), _t(), _t(), ulysses_group=None,
                                                                    ring_group=None)),
    ("transport name", ValueError, "transport must be", lambda: ring_attention(_t(), _t(), _t(), transport="nccl")),
    ("fwd transport", TypeError, "transport must be a fusedpar.ops.Transport",
     lambda: ring_attention_fwd(_t(), _t(), _t(), None)),
    ("zigzag odd", ValueError, "even ring shard",
     lambda: ring_attention(*(_t((1, 7, 2, 16)),) * 3, transport=EmulatedTransport(2), layout="zigzag")),
    ("hybrid zigzag odd", ValueError, "even ring shard",
     lambda: hybrid_attention(*(_t((1, 3, 2, 16)),) * 3, ulysses_transport=EmulatedTransport(1),
                              ring_transport=EmulatedTransport(2))),
    ("ulysses heads", ValueError, r"sizes that work: \[1, 2\]",
     lambda: ulysses_attention(_t(), _t(), _t(), transport=EmulatedTransport(3))),
]


@pytest.mark.parametrize("exc, pattern, call", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(exc, pattern, call):
    with pytest.raises(exc, match=pattern):
        call()
