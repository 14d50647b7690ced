"""Packed variable-length attention: the varlen flash kernels against a float64 per-document
reference (forward and every gradient), the segment tables of sequence-parallel documents
(every visible pair exactly once, nothing for hidden steps), the one-axis grid, bad input. The
one-pass backward (``dq_mode="atomic"``) runs one reference case (ragged, causal, GQA), one with
every score option, and the poisoned-buffer launch."""
import pytest
import torch

from _utils import DEVICE, INTERPRETED, assert_close, poison, randn
from fusedpar.kernels import flash_attention_backward, flash_attention_forward, varlen_attention_reference
from fusedpar.kernels import flash_attention_varlen as flash_attention_varlen_launcher
from fusedpar.kernels import flash_attention_varlen_backward as flash_attention_varlen_backward_launcher
from fusedpar.kernels.flash_attention import MAX_GRID_X, attention_grid
from fusedpar.kernels.flash_varlen import varlen_segments
from fusedpar.ops import EmulatedTransport, document_positions, flash_attention_varlen, ring_attention
from fusedpar.ops.sequence_parallel.plans import shard_chunks
from fusedpar.ops.sequence_parallel.plans import document_plan

# Tolerances as in test_attention_flash.py (fp32: ~1e-6 rounding of the probabilities times
# document lengths up to ~40; fp16: probabilities / dS rounded to fp16 before their products).
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


# (id, query lengths, key lengths (None: the same), heads, kv_heads, head_dim, causal, dtype)
CASES = [
    ("ragged-causal-gqa", [5, 1, 0, 23, 3], None, 4, 2, 16, True, torch.float32),
    ("ragged-full-mqa", [5, 1, 0, 23, 3], None, 4, 1, 32, False, torch.float32),
    ("long-beside-short", [1, 40, 1, 2], None, 2, 2, 64, True, torch.float32),
    ("single-doc", [19], None, 2, 1, 16, True, torch.float32),
    ("q-ne-k-bottom-right", [3, 7, 1, 0], [9, 2, 4, 3], 2, 1, 16, True, torch.float32),
    ("q-ne-k-full", [3, 7, 1, 0], [9, 2, 4, 3], 2, 2, 32, False, torch.float32),
    ("fp16-causal", [17, 2, 9], None, 4, 2, 64, True, torch.float16),
]


def _check_case(lq, lk, hq, hk, d, causal, dtype, seed, dq_mode="separate"):
    lk = lq if lk is None else lk
    cq, ck = _cu(lq), _cu(lk)
    g = torch.Generator().manual_seed(seed)
    q = randn(sum(lq), hq, d, dtype=dtype, generator=g)
    k, v = (randn(sum(lk), hk, d, dtype=dtype, generator=g) for _ in range(2))
    do = randn(sum(lq), hq, d, dtype=dtype, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_varlen(qg, kg, vg, cq, ck, max(lq), max(lk), causal=causal, dq_mode=dq_mode)
    grads = torch.autograd.grad(out, (qg, kg, vg), do)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = varlen_attention_reference(qr, kr, vr, cq.cpu(), ck.cpu(), causal=causal)
    rgrads = torch.autograd.grad(ro, (qr, kr, vr), do.double())
    rl = rl.detach().cpu()  # the fp64 reference ran on q's device: compare the lse on the host
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, sum(lq)) and lse.dtype == torch.float32
    tol = OUT_TOL[dtype]
    assert_close(out, ro, dtype, rtol=tol, atol=tol * max(ro.pow(2).mean().sqrt().item(), 1e-3), msg="out")
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(rl)), "lse -inf pattern"
    fin = torch.isfinite(rl)
    assert_close(lse.cpu()[fin], rl[fin], torch.float32, rtol=tol, atol=tol, msg="lse")
    do_rms = do.double().pow(2).mean().sqrt().item()
    for name, got, ref in zip(("dq", "dk", "dv"), grads, rgrads):
        tol = GRAD_TOL[dtype]
        assert_close(got, ref, dtype, rtol=tol, atol=tol * max(ref.pow(2).mean().sqrt().item(), do_rms), msg=name)


@pytest.mark.parametrize("lq, lk, hq, hk, d, causal, dtype, dq_mode",
                         [(*c[1:], "separate") for c in CASES] + [(*CASES[0][1:], "atomic")],
                         ids=[c[0] for c in CASES] + [f"{CASES[0][0]}-atomic"])
def test_varlen_against_fp64_reference(lq, lk, hq, hk, d, causal, dtype, dq_mode):
    _check_case(lq, lk, hq, hk, d, causal, dtype, seed=len(lq) * 31 + d + causal, dq_mode=dq_mode)


# (id, query lengths, key lengths, heads, kv_heads, head_dim, head_dim_v, options, sinks)
OPTION_CASES = [
    ("window-sinks-gqa-bottom-right", [5, 1, 0, 23, 3], [9, 2, 4, 20, 3], 4, 2, 16, 16,
     dict(window=(3, 2)), True),
    ("causal-window-softcap-qk24-v16", [7, 19, 2], None, 2, 1, 24, 16, dict(causal=True, window=(4, -1), softcap=1.0),
     True),
]


@pytest.mark.parametrize("case, dq_mode", [(c, "separate") for c in OPTION_CASES] + [(OPTION_CASES[1], "atomic")],
                         ids=[c[0] for c in OPTION_CASES] + [f"{OPTION_CASES[1][0]}-atomic"])
def test_varlen_window_softcap_sinks(case, dq_mode):
    # the op and the launchers (NaN-poisoned buffers) against the per-document fp64 oracle: the
    # window follows each document's bottom-right alignment (shift = len_k - len_q) like causal.
    # The launcher's gradients equal the op's bit for bit; with dq_mode="atomic" on a GPU, dq's
    # fp32 atomic sums run in a varying order, so there dq agrees to fp32 summation order
    # (RTOL[fp32] = 1e-5 of the RMS), dk / dv / d_sink still bit for bit.
    name, lq, lk, hq, hk, d, dv, opts, with_sinks = case
    lk = lq if lk is None else lk
    cq, ck = _cu(lq), _cu(lk)
    g = torch.Generator().manual_seed(len(name))
    q, k = randn(sum(lq), hq, d, generator=g, scale=3.0), randn(sum(lk), hk, d, generator=g)
    v, do = randn(sum(lk), hk, dv, generator=g), randn(sum(lq), hq, dv, generator=g)
    sinks = randn(hq, generator=g) if with_sinks else None
    ins = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    out, lse = flash_attention_varlen(*ins[:3], cq, ck, max(lq), max(lk), sinks=ins[3] if with_sinks else None,
                                      dq_mode=dq_mode, **opts)
    grads = torch.autograd.grad(out, ins, do)
    refs = [t.detach().double().requires_grad_() for t in ins]
    ro, rl = varlen_attention_reference(*refs[:3], cq.cpu(), ck.cpu(), sinks=refs[3] if with_sinks else None, **opts)
    rgrads = torch.autograd.grad(ro, refs, do.double())
    rl = rl.detach().cpu()  # the fp64 reference ran on q's device: compare the lse on the host
    tol = OUT_TOL[torch.float32]
    assert_close(out, ro, torch.float32, rtol=tol, atol=tol * ro.pow(2).mean().sqrt().item(), msg="out")
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(rl)), "lse -inf pattern"
    fin = torch.isfinite(rl)
    assert_close(lse.cpu()[fin], rl[fin], torch.float32, rtol=tol, atol=tol, msg="lse")
    do_rms = do.double().pow(2).mean().sqrt().item()
    for gname, got, ref in zip(("dq", "dk", "dv", "d_sink"), grads, rgrads):
        tol = GRAD_TOL[torch.float32]
        assert_close(got, ref, torch.float32, rtol=tol, atol=tol * max(ref.pow(2).mean().sqrt().item(), do_rms),
                     msg=gname)
    seg = varlen_segments(cq, ck, max(lq), max(lk), sum(lq), sum(lk))
    out_p, lse_p = poison((1, *out.shape), out.dtype), poison((1, *lse.shape), torch.float32)
    flash_attention_forward(q[None], k[None], v[None], out=out_p, lse=lse_p, segments=seg, sinks=sinks, **opts)
    assert torch.equal(out_p[0], out.detach()) and torch.equal(lse_p[0], lse)
    dq, dk, dv = poison((1, *q.shape), q.dtype), poison((1, *k.shape), k.dtype), poison((1, *v.shape), v.dtype)
    res = flash_attention_backward(do[None], q[None], k[None], v[None], out_p, lse_p, dq=dq, dk=dk, dv=dv,
                                   segments=seg, sinks=sinks, dq_mode=dq_mode, **opts)
    for gname, got, want in zip(("dq", "dk", "dv", "d_sink"), (dq[0], dk[0], dv[0], *res[3:]), grads):
        if gname == "dq" and dq_mode == "atomic" and not INTERPRETED:
            assert_close(got, want, torch.float32, msg="launcher dq (atomic)")
        else:
            assert torch.equal(got, want), gname


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_launchers_write_every_row_into_poisoned_buffers(dq_mode):
    # the kernels-level launchers with the segment table: every output row, lse entry and
    # gradient row is written (poisoned with NaN beforehand), rows of empty-key documents too
    lq, lk = [4, 0, 17, 1, 3], [4, 2, 17, 0, 5]
    cq, ck = _cu(lq), _cu(lk)
    seg = varlen_segments(cq, ck, max(lq), max(lk), sum(lq), sum(lk))
    g = torch.Generator().manual_seed(7)
    q, do = (randn(1, sum(lq), 2, 16, generator=g) for _ in range(2))
    k, v = (randn(1, sum(lk), 1, 16, generator=g) for _ in range(2))
    out, lse = poison(q.shape, q.dtype), poison((1, 2, sum(lq)), torch.float32)
    flash_attention_forward(q, k, v, causal=True, out=out, lse=lse, segments=seg)
    dq, dk, dv = poison(q.shape, q.dtype), poison(k.shape, k.dtype), poison(v.shape, v.dtype)
    flash_attention_backward(do, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv, segments=seg, dq_mode=dq_mode)
    ro, rl = varlen_attention_reference(q[0].double(), k[0].double(), v[0].double(), cq.cpu(), ck.cpu(), causal=True)
    assert_close(out[0], ro, torch.float32, msg="out")
    assert not torch.isnan(lse).any() and torch.isinf(lse[0, :, 4 + 17]).all()  # the empty-key document
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has unwritten rows"
    o2, l2 = flash_attention_varlen_launcher(q[0], k[0], v[0], cq, ck, max(lq), max(lk), causal=True)
    assert torch.equal(o2, out[0]) and torch.equal(l2, lse[0])


def test_grid_is_one_axis_beyond_65535_batch_heads():
    # batch x heads used to sit on grid axis 1 (CUDA limit 65535): now one axis, limit 2**31 - 1
    n_bh = 70_000 * 4
    grid = attention_grid(1000, n_bh, 64)
    assert grid == (16 * n_bh,) and grid[0] <= MAX_GRID_X
    assert attention_grid(10, 1, 16) == (1,)
    with pytest.raises(ValueError, match="attention grid must have at most"):
        attention_grid(2**20, 2**20, 16)


def _pairs_seen(cu, layout, size, S, causal, window=(-1, -1)):
    """How often the document plans of all ranks and steps cover each (query, key) position pair
    (under the causal mask and ``window``; every segment must hold a visible pair)."""
    s = S // size
    left, right = window[0], 0 if causal else window[1]
    seen = torch.zeros(S, S, dtype=torch.int64)
    launches = 0
    for rank in range(size):
        plan = document_plan(cu, layout, rank, size, s, causal, "cpu", window)
        q_pos = [c[2] + i for c in shard_chunks(layout, rank, size, s) for i in range(c[1])]
        for step, segs in enumerate(plan):
            src = (rank - step) % size
            k_pos = [c[2] + i for c in shard_chunks(layout, src, size, s) for i in range(c[1])]
            launches += len(segs)
            for seg in segs:
                for q0, q1, k0, k1, shift in seg.table.tolist():
                    assert q1 - q0 <= seg.max_q and k1 - k0 <= seg.max_k
                    visible = 0
                    for i in range(q0, q1):
                        for j in range(k0, k1):
                            d = j - k0 - (i - q0 + shift)  # key minus query, in global positions
                            if (right < 0 or d <= right) and (left < 0 or d >= -left):
                                seen[q_pos[i], k_pos[j]] += 1
                                visible += 1
                    assert visible, "a segment part the mask hides completely"
    return seen, launches


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_document_plan_covers_every_visible_pair_once(size, layout, causal):
    S = 4 * size
    cu = torch.tensor([0, 1, 1, 3, S - 1, S], dtype=torch.int32)
    seen, _ = _pairs_seen(cu, layout, size, S, causal)
    doc = torch.searchsorted(cu[1:].long(), torch.arange(S), right=True)
    expected = (doc[:, None] == doc[None, :]).long()
    if causal:
        expected = expected.tril()
    assert torch.equal(seen, expected)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal, window", [(True, (2, 0)), (False, (1, 3)), (True, (9, 0))])
def test_windowed_document_plan_covers_the_window_once(layout, causal, window):
    size, S = 4, 24
    cu = torch.tensor([0, 1, 1, 3, 17, S], dtype=torch.int32)
    seen, _ = _pairs_seen(cu, layout, size, S, causal, window)
    doc = torch.searchsorted(cu[1:].long(), torch.arange(S), right=True)
    d = torch.arange(S)[None, :] - torch.arange(S)[:, None]
    right = 0 if causal else window[1]
    expected = ((doc[:, None] == doc[None, :]) & (d >= -window[0]) & (d <= right)).long()
    assert torch.equal(seen, expected)


def test_steps_without_visible_keys_launch_nothing():
    # documents inside one contiguous shard each: only step 0 (the rank's own block) has work
    size, S = 4, 16
    cu = torch.tensor([0, 3, 4, 8, 10, 12, 16], dtype=torch.int32)
    for rank in range(size):
        plan = document_plan(cu, "contiguous", rank, size, S // size, True, "cpu")
        assert len(plan[0]) == 1 and all(len(step) == 0 for step in plan[1:]), rank
    # one document per rank pair, causal: a rank meets the block of its left neighbour only
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    plan = document_plan(cu, "contiguous", 1, size, S // size, True, "cpu")
    assert [len(step) for step in plan] == [1, 1, 0, 0]


def test_document_positions():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    assert document_positions(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


def test_ring_of_one_with_documents_equals_varlen():
    lengths = [6, 1, 9]
    cu = _cu(lengths)
    g = torch.Generator().manual_seed(3)
    q, k, v = (randn(1, 16, 2, 16, generator=g) for _ in range(3))
    out = ring_attention(q, k, v, transport=EmulatedTransport(1), causal=True, layout="contiguous", cu_seqlens=cu)
    ref, _ = flash_attention_varlen(q[0], k[0], v[0], cu, cu, 9, 9, causal=True)
    assert torch.equal(out[0], ref)


def _qkv(total=8):
    return [torch.randn(total, 2, 16, device=DEVICE) for _ in range(3)]


def _i32(*vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


def _varlen_bwd(**bad):
    """The varlen backward launcher on valid arguments (8 rows, 2 heads, d 16), ``bad`` replacing some."""
    q, k, v = _qkv()
    out, lse = flash_attention_varlen_launcher(q, k, v, _i32(0, 8), _i32(0, 8), 8, 8)
    args = dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=_i32(0, 8),
                cu_seqlens_k=_i32(0, 8), max_seqlen_q=8, max_seqlen_k=8)
    args.update({name: make(args) for name, make in bad.items()})
    return flash_attention_varlen_backward_launcher(**args)


# (id, exception, message pattern, call, needs CPU values)
BAD_INPUTS = [
    ("cu int64", TypeError, "cu_seqlens_q must have dtype torch.int32",
     lambda: flash_attention_varlen(*_qkv(), _i32(0, 8).long(), _i32(0, 8), 8, 8), False),
    ("cu 2-D", ValueError, "cu_seqlens_q must be 1-D", lambda: flash_attention_varlen(*_qkv(), _i32(0, 8)[None],
                                                                                      _i32(0, 8), 8, 8), False),
    ("q 4-D", ValueError, "q must be 3-D", lambda: flash_attention_varlen(torch.randn(1, 8, 2, 16, device=DEVICE),
                                                                          *_qkv()[1:], _i32(0, 8), _i32(0, 8), 8, 8),
     False),
    ("doc counts", ValueError, "as many documents", lambda: flash_attention_varlen(*_qkv(), _i32(0, 8),
                                                                                   _i32(0, 4, 8), 8, 8), False),
    ("max_seqlen str", TypeError, "max_seqlen_q", lambda: flash_attention_varlen(*_qkv(), _i32(0, 8), _i32(0, 8),
                                                                                 "8", 8), False),
    ("start", ValueError, "must start at 0", lambda: flash_attention_varlen(*_qkv(), _i32(1, 8), _i32(0, 8), 8, 8),
     True),
    ("decreasing", ValueError, "non-decreasing", lambda: flash_attention_varlen(*_qkv(), _i32(0, 5, 3, 8),
                                                                                _i32(0, 2, 3, 8), 8, 8), True),
    ("last", ValueError, r"cu_seqlens_k\[-1\] must equal the number of tokens \(8\), got 7",
     lambda: flash_attention_varlen(*_qkv(), _i32(0, 8), _i32(0, 7), 8, 8), True),
    ("max too small", ValueError, "max_seqlen_q must be >= the longest document", lambda: flash_attention_varlen(
        *_qkv(), _i32(0, 2, 8), _i32(0, 4, 8), 4, 8), True),
    ("sp batch 2", ValueError, "batch size must be 1 with cu_seqlens", lambda: ring_attention(
        *(torch.randn(2, 8, 2, 16, device=DEVICE),) * 3, cu_seqlens=_i32(0, 8)), False),
    ("sp total", ValueError, r"full packed length \(16\)", lambda: ring_attention(
        *(torch.randn(1, 8, 2, 16, device=DEVICE),) * 3, transport=EmulatedTransport(2), cu_seqlens=_i32(0, 8)),
     False),
    # the varlen backward checks dout / out / lse as passed (not with the batch axis it adds)
    ("bwd dout None", TypeError, "dout must be a torch.Tensor, got NoneType",
     lambda: _varlen_bwd(dout=lambda a: None), False),
    ("bwd dout 2-D", ValueError, r"dout must be 3-D, got shape \(8, 32\) \(2-D\)",
     lambda: _varlen_bwd(dout=lambda a: a["dout"].reshape(8, 32)), False),
    ("bwd dout shape", ValueError, r"dout must have shape \(8, 2, 16\), got \(8, 2, 8\)",
     lambda: _varlen_bwd(dout=lambda a: a["dout"][..., :8]), False),
    ("bwd dout dtype", TypeError, r"dout must have the same dtype as q \(torch.float32\), got torch.float16",
     lambda: _varlen_bwd(dout=lambda a: a["dout"].half()), False),
    ("bwd out None", TypeError, "out must be a torch.Tensor, got NoneType",
     lambda: _varlen_bwd(out=lambda a: None), False),
    ("bwd out shape", ValueError, r"out must have shape \(8, 2, 16\), got \(7, 2, 16\)",
     lambda: _varlen_bwd(out=lambda a: a["out"][:7]), False),
    ("bwd out 4-D", ValueError, r"out must be 3-D, got shape \(1, 8, 2, 16\) \(4-D\)",
     lambda: _varlen_bwd(out=lambda a: a["out"][None]), False),
    ("bwd lse None", TypeError, "lse must be a torch.Tensor, got NoneType",
     lambda: _varlen_bwd(lse=lambda a: None), False),
    ("bwd lse shape", ValueError, r"lse must have shape \(2, 8\), got \(8, 2\)",
     lambda: _varlen_bwd(lse=lambda a: a["lse"].t()), False),
    ("bwd lse dtype", TypeError, r"lse must have dtype torch.float32, got torch.float64",
     lambda: _varlen_bwd(lse=lambda a: a["lse"].double()), False),
]


@pytest.mark.parametrize("exc, pattern, call, cpu_only", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(exc, pattern, call, cpu_only):
    if cpu_only and not INTERPRETED:
        pytest.skip("cu_seqlens values are trusted on a GPU (checking them would cost a sync)")
    with pytest.raises(exc, match=pattern):
        call()


def test_segments_argument_checks():
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    seg = varlen_segments(_cu([3, 5]), _cu([3, 5]), 5, 5, 8, 8)
    with pytest.raises(ValueError, match="q_offset and k_offset must be 0 with segments="):
        flash_attention_forward(q, q, q, segments=seg, q_offset=2)
    with pytest.raises(ValueError, match="q batch size must be 1 with segments="):
        flash_attention_forward(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                                segments=seg)
    with pytest.raises(ValueError, match="5 columns"):
        flash_attention_forward(q, q, q, segments=seg._replace(table=seg.table[:, :4]))
    with pytest.raises(TypeError, match="segments must be a Segments"):
        flash_attention_forward(q, q, q, segments=(seg.table, 5, 5))
    if INTERPRETED:  # table values are range-checked on the CPU only
        with pytest.raises(ValueError, match="lengths <= max_q=4"):
            flash_attention_forward(q, q, q, segments=seg._replace(max_q=4))


# bad boundaries as a GPU receives them (values not read on the host): each in its own way out of
# [0, total] or decreasing; total 12 rows of q and of k
BAD_CU = {"past-the-end": [0, 5, 40], "negative": [-7, 5, 12], "decreasing": [0, 9, 4, 12],
          "huge": [0, 2**31 - 1, 12], "last-short": [0, 5, 9]}


@pytest.mark.parametrize("name", list(BAD_CU))
def test_bad_boundaries_make_a_table_inside_the_rows(name, monkeypatch):
    """``varlen_segments`` (what the launchers build the kernels' table with) clamps the boundaries
    into the rows and keeps them non-decreasing on the device, so the kernels handed the worst
    ``cu_seqlens`` read and write only inside q / k / v (here views inside NaN bands: a read
    outside would bring a NaN into the result) and the outputs; valid boundaries are unchanged;
    under ``TRITON_DEBUG=1`` a changed boundary fails the device-side assert."""
    from triton import knobs

    cu = torch.tensor(BAD_CU[name], dtype=torch.int32, device=DEVICE)
    seg = varlen_segments(cu, cu, 12, 12, 12, 12)
    table = seg.table.cpu()
    assert (table[:, :4] >= 0).all() and (table[:, :4] <= 12).all(), table
    assert (table[:, 1] >= table[:, 0]).all() and (table[:, 3] >= table[:, 2]).all(), table
    assert (table[1:, 0] >= table[:-1, 1]).all(), table  # documents do not overlap
    band = torch.full((1, 20, 2, 16), float("nan"), device=DEVICE)
    q, k, v = (band[:, 4:16].clone() for _ in range(3))
    for t in (q, k, v):
        t.copy_(randn(1, 12, 2, 16))
    qb, kb, vb = (band.clone() for _ in range(3))
    for b, t in ((qb, q), (kb, k), (vb, v)):
        b[:, 4:16] = t
    out, lse = flash_attention_forward(qb[:, 4:16], kb[:, 4:16], vb[:, 4:16], causal=True, segments=seg)
    covered = torch.zeros(12, dtype=torch.bool)
    for q0, q1, *_ in table.tolist():
        covered[q0:q1] = True
    assert not torch.isnan(out[0, covered.to(out.device)]).any()
    valid = _cu([5, 7])
    assert torch.equal(varlen_segments(valid, valid, 7, 7, 12, 12).table[:, :4].cpu(),
                       torch.tensor([[0, 5, 0, 5], [5, 12, 5, 12]], dtype=torch.int32))
    monkeypatch.setattr(knobs.runtime, "debug", True)
    if INTERPRETED:  # (CPU: the assert raises at once; on a GPU it fails the stream asynchronously)
        with pytest.raises(RuntimeError, match="cu_seqlens: a boundary outside"):
            varlen_segments(cu, cu, 12, 12, 12, 12)
        with pytest.raises(RuntimeError, match="longer than max_seqlen"):
            varlen_segments(valid, valid, 6, 7, 12, 12)  # a 7-row document, max_seqlen_q 6
        varlen_segments(valid, valid, 7, 7, 12, 12)
