"""Attention variants under sequence parallelism on real gloo worlds (4; ring also 2 and 3): sliding windows (in
global positions, crossing shard boundaries, smaller than a zigzag chunk, both sides; rings the
window shortens, one way and both ways),
softcapping, attention sinks and a v head dim other than q/k's, through ring attention (zigzag
and contiguous over 4, a few cases over 2 and 3), Ulysses over 4 (kv heads split and replicated) and the 2 x 2 hybrid,
dense and on packed documents. Each rank's output and q/k/v gradients equal the fp64
one-process reference at its positions; the sinks' gradient summed over the group equals the
reference's."""
import pytest
import torch
import torch.distributed as dist

from _utils import DEVICE, assert_close, randn
from _world import grid_2x2, rank_rng, straggle, world_fixture
from fusedpar.kernels import attention_reference, varlen_attention_reference
from fusedpar.ops import comm, hybrid_attention, ring_attention, shard_positions, ulysses_attention
from fusedpar.ops.sequence_parallel.plans import ring_rounds, ring_schedule, ring_step_plan, shard_chunks
from fusedpar.ops.comm.transport import EmulatedTransport

world2 = world_fixture(2)
world3 = world_fixture(3)
world4 = world_fixture(4)

# fp32 against the fp64 reference, relative to the reference's RMS: the ring merges 4 partial
# softmaxes in fp32 and folds the sinks in once (~1e-6 relative each), as in test_sequence_parallel.
TOL = 2e-5


def _inputs(seed, S, hq, hk, d, dv, sinks):
    g = rank_rng(seed)  # the same full tensors on every rank
    q, k, v, do = (randn(*shape, generator=g) for shape in ((1, S, hq, d), (1, S, hk, d), (1, S, hk, dv),
                                                           (1, S, hq, dv)))
    s = randn(hq, generator=g) if sinks else None
    return q, k, v, do, s


def _reference(q, k, v, do, sinks, opts, cu):
    """fp64 ``(out, dq, dk, dv, dsinks)`` of the full sequence (per document with ``cu``)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    sr = None if sinks is None else sinks.double().requires_grad_()
    if cu is None:
        out = attention_reference(*leaves, sinks=sr, **opts)[0]
    else:
        out = varlen_attention_reference(*(t[0] for t in leaves), cu, cu, sinks=sr, **opts)[0][None]
    grads = torch.autograd.grad(out, leaves + ([sr] if sr is not None else []), do.double())
    return (out.detach(), *grads)


def _compare(fn, full, pos, opts, msg, cu=None, group=None):
    q, k, v, do, sinks = full
    pos = pos.to(q.device)  # positions are built on the host (shard_positions, arange)
    shards = [t.index_select(1, pos).requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    out = fn(*shards, s)
    grads = list(torch.autograd.grad(out, shards + ([s] if s is not None else []), do.index_select(1, pos)))
    if s is not None:  # each rank holds its part of the sinks' gradient
        dist.all_reduce(grads[3], group=group)
    ref = _reference(q, k, v, do, sinks, opts, cu)
    names = ("out", "dq", "dk", "dv", "dsinks")
    for name, got, r in zip(names, (out, *grads), ref):
        r = r if name == "dsinks" else r.index_select(1, pos)
        scale = max(r.pow(2).mean().sqrt().item(), 1.0)  # errors scale with |dout| = 1 as well
        assert_close(got, r, torch.float32, rtol=TOL, atol=TOL * scale, msg=f"{name} {msg}")


def _documents(S):
    """A length-1 document, documents crossing shard boundaries, one spanning several ranks."""
    return torch.tensor([0, 1, 9, S - 3, S], dtype=torch.int32)


# (layout, causal, window, softcap, sinks, hq, hk, d, dv, documents); s_local 6, zigzag chunks of 3
RING_CASES = [
    ("zigzag", True, (2, 0), None, True, 2, 1, 16, 8, False),  # window smaller than a chunk
    ("zigzag", True, (9, 0), 5.0, False, 2, 2, 16, 16, False),  # window over several ranks' chunks
    ("contiguous", False, (4, 7), None, True, 2, 1, 8, 16, False),  # both sides, non-causal
    ("contiguous", True, None, 3.0, True, 2, 1, 16, 16, False),  # softcap and sinks, full causal
    ("zigzag", True, (4, 0), 5.0, True, 2, 1, 16, 8, True),  # documents with a window
    ("contiguous", False, (3, 2), None, False, 2, 2, 16, 16, True),
    # a ring shortened by the window (ring_rounds): one hop forward over 3 and 4 ranks; one hop
    # backward only (a window ahead of the query), with documents
    ("contiguous", True, (5, 0), None, True, 2, 1, 16, 8, False),
    ("contiguous", False, (0, 5), 4.0, False, 2, 2, 16, 16, True),
]


def _ring_cases(rank, size, seed, s_local, cases=tuple(range(len(RING_CASES)))):
    straggle(0.01, seed)
    S = s_local * size
    try:
        for i in cases:
            layout, causal, window, softcap, sinks, hq, hk, d, dv, docs = RING_CASES[i]
            full = _inputs(seed + i, S, hq, hk, d, dv, sinks)
            cu = _documents(S) if docs else None
            pos = shard_positions(S, layout=layout, ring_rank=rank, ring_size=size)
            opts = dict(causal=causal, window=window, softcap=softcap)
            _compare(lambda q, k, v, s: ring_attention(q, k, v, layout=layout, sinks=s, cu_seqlens=cu, **opts),
                     full, pos, opts, cu=cu, msg=f"ring case {i} rank {rank}")
    finally:
        comm.set_straggler(0)
    return True


def test_ring_variants(world4):
    # four ranks: the window over several ranks' chunks, both sides non-causal, softcap and sinks
    # with full causal masking, documents with a two-sided window, a ring shortened to one hop;
    # the other cases run over 2 and 3 ranks below
    assert all(world4.run(_ring_cases, seed=1, s_local=6, cases=(1, 2, 3, 5, 6)))


def test_ring_variants_world2(world2):
    # two ranks: the window over several chunks with softcap, and the two-sided non-causal window
    assert all(world2.run(_ring_cases, seed=4, s_local=6, cases=(1, 2)))


def test_ring_variants_world3(world3):
    # an odd ring: the window smaller than a chunk, documents with a window, softcap and sinks,
    # and a ring the window cuts to one backward hop
    assert all(world3.run(_ring_cases, seed=5, s_local=6, cases=(0, 4, 7)))


# (causal, window, softcap, sinks, hq, hk, d, dv, documents): kv heads split, replicated
ULYSSES_CASES = [
    (True, (3, 0), 4.0, True, 4, 2, 16, 8, False),
    (False, (2, 5), None, True, 8, 1, 8, 16, False),
    (True, (5, 0), None, True, 4, 4, 16, 16, True),
]


def _ulysses_cases(rank, size, seed, s_local):
    straggle(0.01, seed)
    S = s_local * size
    try:
        for i, (causal, window, softcap, sinks, hq, hk, d, dv, docs) in enumerate(ULYSSES_CASES):
            full = _inputs(seed + i, S, hq, hk, d, dv, sinks)
            cu = _documents(S) if docs else None
            pos = torch.arange(rank * s_local, (rank + 1) * s_local)
            opts = dict(causal=causal, window=window, softcap=softcap)
            _compare(lambda q, k, v, s: ulysses_attention(q, k, v, sinks=s, cu_seqlens=cu, **opts), full, pos, opts,
                     cu=cu, msg=f"ulysses case {i} rank {rank}")
    finally:
        comm.set_straggler(0)
    return True


def test_ulysses_variants(world4):
    assert all(world4.run(_ulysses_cases, seed=10, s_local=5))


def _hybrid_cases(rank, size, seed):
    # 2 x 2: ulysses groups {0,1} {2,3}, ring groups {0,2} {1,3}
    u_group, r_group, _ = grid_2x2(rank)
    u_rank, r_rank = rank % 2, rank // 2
    straggle(0.01, seed)
    S = 24
    try:
        for i, (layout, causal, window, docs) in enumerate([("zigzag", True, (4, 0), False),
                                                            ("contiguous", False, (2, 9), True)]):
            full = _inputs(seed + i, S, 4, 2, 16, 8, True)
            cu = _documents(S) if docs else None
            pos = shard_positions(S, layout=layout, ring_rank=r_rank, ring_size=2, ulysses_rank=u_rank,
                                  ulysses_size=2)
            opts = dict(causal=causal, window=window, softcap=6.0)
            _compare(lambda q, k, v, s: hybrid_attention(q, k, v, ulysses_group=u_group, ring_group=r_group,
                                                         layout=layout, sinks=s, cu_seqlens=cu, **opts),
                     full, pos, opts, cu=cu, msg=f"hybrid case {i} rank {rank}")
    finally:
        comm.set_straggler(0)
    return True


def test_hybrid_variants(world4):
    assert all(world4.run(_hybrid_cases, seed=20))


def _disagreeing_window(rank, size):
    # one rank asks for another window: every rank raises the same error before any transfer
    q = torch.randn(1, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        ring_attention(q, q, q, causal=True, window=(2, 0) if rank else (3, 0))
    return True


def test_ranks_agree_on_the_window(world4):
    assert all(world4.run(_disagreeing_window))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal, window", [(True, (2, 0)), (True, (7, 0)), (False, (3, 5)), (False, (0, 0))])
def test_windowed_ring_plan_covers_the_window_once(layout, causal, window):
    # every (query, key) pair inside the window is computed exactly once over the ring; blocks
    # outside every query's window launch nothing; an unmasked launch sees only visible pairs
    size, s = 4, 6
    S = size * s
    qi_all, kj_all = torch.arange(S)[:, None], torch.arange(S)[None, :]
    right = 0 if causal else window[1]
    want = (kj_all >= qi_all - window[0]) & (kj_all <= qi_all + right)
    seen = torch.zeros(S, S, dtype=torch.int64)
    for rank in range(size):
        qpos = shard_positions(S, layout=layout, ring_rank=rank, ring_size=size)
        for step in range(size):
            src = (rank - step) % size
            kpos = shard_positions(S, layout=layout, ring_rank=src, ring_size=size)
            launches = ring_step_plan(shard_chunks(layout, rank, size, s), shard_chunks(layout, src, size, s), causal,
                                      window)
            for qs, ks, qo, ko, masked in launches:
                qi, kj = qpos[qs][:, None], kpos[ks][None, :]
                vis = want[qi, kj]
                assert vis.any(), "a launch with nothing visible"
                if masked:  # offsets must be the chunks' true global starts
                    assert qo == qpos[qs][0] and ko == kpos[ks][0]
                else:
                    assert bool(vis.all()), "an unmasked launch must see only visible keys"
                seen[qi.expand_as(vis)[vis], kj.expand_as(vis)[vis]] += 1
    assert torch.equal(seen, want.long())


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_rounds_cover_every_visible_block(layout, size):
    # the shortened ring (ring_rounds) meets every block some query sees; a causal window of w
    # over the contiguous layout travels ceil(w / s_local) hops; a window over the whole
    # sequence (or none) is the full ring, one way
    s = 4
    S = size * s
    for causal in (True, False):
        for window in ((0, 0), (1, 0), (3, 0), (5, 0), (9, 0), (2, 3), (0, 6), (S, S), (-1, 2), (-1, -1)):
            forward, backward = ring_rounds(layout, size, s, causal, window)
            offsets = {t for t, _, _ in ring_schedule((forward, backward), size)}
            assert len(offsets) == forward + backward + 1 < size + 1
            for rank in range(size):
                for offset in set(range(size)) - offsets:
                    src = (rank - offset) % size
                    assert not ring_step_plan(shard_chunks(layout, rank, size, s), shard_chunks(layout, src, size, s),
                                              causal, window), f"{layout} {causal} {window}: rank {rank} misses {src}"
            if layout == "contiguous" and causal and window[0] >= 0:
                assert (forward, backward) == (min(-(-window[0] // s), size - 1), 0), window
            if window[0] in (-1, S) and (causal or window[1] in (-1, S)):
                assert (forward, backward) == (size - 1, 0), window


def _dq_modes(rank, size, seed):
    # the one-pass backward (dQ by fp32 atomics) through ring and Ulysses: the reference's
    # gradients, and the default mode's within fp32 rounding
    S = 4 * size
    full = _inputs(seed, S, 2, 2, 16, 8, True)
    opts = dict(causal=True, window=(3, 0), softcap=None)
    calls = {"ring": (lambda q, k, v, s, mode: ring_attention(q, k, v, layout="zigzag", sinks=s, dq_mode=mode,
                                                               **opts),
                      shard_positions(S, layout="zigzag", ring_rank=rank, ring_size=size)),
             "ulysses": (lambda q, k, v, s, mode: ulysses_attention(q, k, v, sinks=s, dq_mode=mode, **opts),
                         torch.arange(rank * 4, (rank + 1) * 4))}
    for name, (fn, pos) in calls.items():
        _compare(lambda q, k, v, s: fn(q, k, v, s, "atomic"), full, pos, opts, msg=f"{name} dq_mode=atomic")
        shards = [t.index_select(1, pos.to(t.device)).requires_grad_() for t in full[:3]]
        sinks = full[4].clone().requires_grad_()
        do = full[3].index_select(1, pos.to(full[3].device))
        got = [torch.autograd.grad(fn(*shards, sinks, mode), shards + [sinks], do) for mode in ("separate", "atomic")]
        for what, a, b in zip(("dq", "dk", "dv", "dsinks"), *got):
            assert_close(b, a, torch.float32, rtol=TOL, atol=TOL, msg=f"{name} {what}: atomic against separate")
    return True


def test_dq_modes_agree(world2):
    assert all(world2.run(_dq_modes, seed=30))


_Q = (1, 8, 2, 16)


# (id, exception, message pattern, keyword arguments (built at test time, on the test device))
BAD_OPTIONS = [
    ("window shape", TypeError, "window must be None or a", lambda: dict(window=3)),
    ("window value", ValueError, r"window\[0\] \(left\)", lambda: dict(window=(-2, 0))),
    ("softcap", ValueError, "softcap", lambda: dict(softcap=-1.0)),
    ("sinks shape", ValueError, r"sinks must have shape \(2,\)", lambda: dict(sinks=torch.zeros(3, device=DEVICE))),
    ("sinks dtype", TypeError, "sinks", lambda: dict(sinks=torch.zeros(2, dtype=torch.float64, device=DEVICE))),
    ("dq_mode", ValueError, r"dq_mode must be one of \('separate', 'atomic'\), got 'fast'",
     lambda: dict(dq_mode="fast")),
]


@pytest.mark.parametrize("exc, pattern, make_kwargs", [c[1:] for c in BAD_OPTIONS],
                         ids=[c[0] for c in BAD_OPTIONS])
@pytest.mark.parametrize("op", ["ring", "ulysses", "hybrid"])
def test_bad_options(op, exc, pattern, make_kwargs):
    # q on the test device: a CPU q on a GPU run fails the device check before the option checks
    q, kwargs = torch.randn(*_Q, device=DEVICE), make_kwargs()
    t = EmulatedTransport(2)
    call = {"ring": lambda: ring_attention(q, q, q, transport=t, **kwargs),
            "ulysses": lambda: ulysses_attention(q, q, q, transport=t, **kwargs),
            "hybrid": lambda: hybrid_attention(q, q, q, ulysses_transport=t, ring_transport=EmulatedTransport(2),
                                               **kwargs)}[op]
    with pytest.raises(exc, match=pattern):
        call()
