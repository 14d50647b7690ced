"""The flash backward's one launch (dK/dV programs over key blocks, dQ programs over query
blocks) against float64 on what only it decides: every variant at once on ragged lengths
(``seq_q`` above and below ``seq_k``, GQA, MLA's unequal head dims, windows, softcap, sinks, rows
that see no key), into NaN-poisoned buffers, in both dq modes; the tiles it runs under the
interpreter varied (owned rows above, equal to and below the streamed ones, so the range split
at the diagonal and the half-block masked steps meet every alignment); and one kind of program
at a time (``dq=False`` / ``dk=False``) accumulated into fp32 buffers, block by block (the
ring's steps run both kinds in one launch, into such buffers); both load paths of the streamed tiles (tensor descriptors, pointer
loads) and what keeps the pointer path. test_attention_flash covers the op's cases,
test_attention_varlen the segment tables."""
import pytest
import torch

from _utils import DEVICE, INTERPRETED, assert_close, poison, randn, spy_launches
from fusedpar.kernels import attention_reference, flash_attention_backward, flash_attention_forward, flash_tiles
from fusedpar.kernels import flash_attention_bwd, gemm_loads
from fusedpar.kernels.flash_attention import Segments

#: gradient tolerance relative to max(RMS(reference), RMS(dout)), as in test_attention_flash
#: (fp32: ieee dots; fp16: P and dS rounded to fp16 before their products)
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 5e-3}

# (id, batch, seq_q, seq_k, heads, kv_heads, head_dim, head_dim_v, dtype, options, sinks)
CASES = [
    ("causal-gqa-q-below-k", 2, 19, 45, 4, 2, 16, 16, torch.float32, dict(causal=True, q_offset=30, k_offset=3),
     False),
    ("causal-q-above-k-no-key-rows", 1, 47, 13, 2, 1, 16, 16, torch.float16, dict(causal=True, k_offset=20), False),
    ("mla-dims-window-sinks", 1, 38, 41, 3, 1, 24, 16, torch.float32, dict(window=(9, 0), q_offset=3), True),
    ("softcap-mqa-full", 1, 33, 29, 4, 1, 16, 16, torch.float16, dict(softcap=2.0, q_offset=0, k_offset=0), False),
    ("window-both-sides", 1, 50, 50, 2, 2, 32, 32, torch.float32, dict(window=(6, 4), q_offset=0, k_offset=0), False),
]


def _inputs(case):
    name, b, sq, sk, hq, hk, d, dv, dtype, opts, with_sinks = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k = randn(b, sq, hq, d, dtype=dtype, generator=g), randn(b, sk, hk, d, dtype=dtype, generator=g)
    v, do = randn(b, sk, hk, dv, dtype=dtype, generator=g), randn(b, sq, hq, dv, dtype=dtype, generator=g)
    sinks = randn(hq, generator=g) if with_sinks else None
    return q, k, v, do, sinks, dict(opts)


def _reference(q, k, v, do, sinks, opts):
    ins = [t.double().requires_grad_() for t in (q, k, v)] + ([] if sinks is None else [sinks.double().requires_grad_()])
    out, _ = attention_reference(*ins[:3], sinks=None if sinks is None else ins[3], **opts)
    return torch.autograd.grad(out, ins, do.double())


def _check(got, ref, dtype, do, msg):
    do_rms = do.double().pow(2).mean().sqrt().item()
    for name, g, r in zip(("dq", "dk", "dv", "d_sink"), got, ref):
        if g is False:  # a skipped program kind (dq=False / dk=False)
            continue
        scale = max(r.pow(2).mean().sqrt().item(), do_rms)
        assert_close(g, r, dtype, rtol=GRAD_TOL[dtype], atol=GRAD_TOL[dtype] * scale, msg=f"{name} {msg}")


def _run(case, dq_mode):
    q, k, v, do, sinks, opts = _inputs(case)
    out, lse = flash_attention_forward(q, k, v, sinks=sinks, **opts)
    bufs = [poison(t.shape, t.dtype) for t in (q, k, v)]  # every element must be written
    got = flash_attention_backward(do, q, k, v, out, lse, dq=bufs[0], dk=bufs[1], dv=bufs[2], sinks=sinks,
                                   dq_mode=dq_mode, **opts)
    assert all(g.data_ptr() == b.data_ptr() for g, b in zip(got, bufs))
    _check(got, _reference(q, k, v, do, sinks, opts), q.dtype, do, f"{case[0]} {dq_mode}")


@pytest.mark.parametrize("loads", ["auto", "pointer"])  # "auto": descriptors where backward_loads allows
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_variant_against_fp64(case, dq_mode, loads):
    with gemm_loads.load_path_set(loads):
        _run(case, dq_mode)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's fixed tiles; a GPU runs its tuned ones")
@pytest.mark.parametrize("tile, case, dq_mode", [
    ((64, 32), CASES[0], "separate"),  # owned 64, streamed 32, masked 16
    ((64, 32), CASES[2], "atomic"),
    ((16, 16), CASES[1], "separate"),  # the smallest: masked steps = streamed ones
    ((16, 32), CASES[4], "separate"),  # owned below streamed
], ids=["64x32", "64x32-atomic", "16x16", "16x32"])
@pytest.mark.parametrize("loads", ["auto", "pointer"])
def test_interpreter_tiles(monkeypatch, tile, case, dq_mode, loads):
    monkeypatch.setattr(flash_tiles, "BWD_INTERPRETER_CONFIG", dict(BLOCK_M=tile[0], BLOCK_N=tile[1]))
    with gemm_loads.load_path_set(loads):
        _run(case, dq_mode)


def test_one_kind_of_program_at_a_time_accumulates():
    # ring attention's use: keys in two blocks at their global offsets, each block's dQ part and
    # dK/dV part from separate launches (dq=False / dk=False), added into fp32 buffers
    q, k, v, do, _, _ = _inputs(("ring", 1, 21, 40, 4, 2, 16, 16, torch.float16, {}, False))
    opts = dict(causal=True, q_offset=25)
    out, lse = flash_attention_forward(q, k, v, k_offset=0, **opts)
    dq = torch.zeros(q.shape, device=DEVICE)
    dk, dv = torch.zeros(k.shape, device=DEVICE), torch.zeros(v.shape, device=DEVICE)
    for lo, hi in ((23, 40), (0, 23)):
        kb, vb = k[:, lo:hi], v[:, lo:hi]
        got = flash_attention_backward(do, q, kb, vb, out, lse, k_offset=lo, dq=False, dk=dk[:, lo:hi],
                                       dv=dv[:, lo:hi], accumulate=True, **opts)
        assert got[0] is False
        got = flash_attention_backward(do, q, kb, vb, out, lse, k_offset=lo, dq=dq, dk=False, dv=False,
                                       accumulate=True, **opts)
        assert got[1] is False and got[2] is False
    _check((dq, dk, dv), _reference(q, k, v, do, None, dict(opts, k_offset=0)), torch.float16, do, "ring blocks")


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_segments_without_keys_write_zero_dq(dq_mode):
    # a segment table whose documents hold no key: no dK/dV program runs, yet dq is written whole
    # in both modes (rows that see nothing have zero gradient), never left as the caller's buffer
    g = torch.Generator(device="cpu").manual_seed(7)
    q, do = randn(1, 5, 1, 16, generator=g), randn(1, 5, 1, 16, generator=g)
    k, v = randn(1, 3, 1, 16, generator=g), randn(1, 3, 1, 16, generator=g)
    seg = Segments(torch.tensor([[0, 5, 0, 0, 0]], dtype=torch.int32, device=DEVICE), 5, 0)
    out, lse = flash_attention_forward(q, k, v, segments=seg)
    dq, dk, dv = (poison(t.shape, t.dtype) for t in (q, k, v))
    got = flash_attention_backward(do, q, k, v, out, lse, segments=seg, dq=dq, dk=dk, dv=dv, dq_mode=dq_mode)
    assert torch.equal(got[0], torch.zeros_like(q)), dq_mode


#: flash-attention's own acceptance rule (its tests/test_flash_attn.py, adapted): against a float64
#: reference, the kernel's largest error may be at most twice PyTorch's, the same attention run in
#: the operands' 16-bit dtype; (id, seq_q, seq_k, head_dim, dtype, causal) on its ragged lengths
FLASH_ATTN_CASES = [
    ("113x203-d64-causal", 113, 203, 64, torch.bfloat16, True),
    ("108x256-d128", 108, 256, 128, torch.float16, False),
    ("203x113-d64-causal", 203, 113, 64, torch.float16, True),
]


def _attention_16bit(q, k, v, causal):
    """Attention as PyTorch runs it in the operands' dtype (flash-attention's ``attention_ref``
    without upcasting): scores, softmax and products in 16 bits; ``[b, s, h, d]``, causal
    bottom-right, rows that see no key 0."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    sq, sk = scores.shape[-2:]
    hidden = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1) if causal else torch.zeros(sq, sk, dtype=torch.bool)
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden.all(-1, keepdim=True), 0.0)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("case", FLASH_ATTN_CASES, ids=[c[0] for c in FLASH_ATTN_CASES])
def test_flash_attention_criterion(case):
    """Output and gradients within 2x of PyTorch's own 16-bit error (flash-attention's criterion;
    causal bottom-right, as it aligns): the one-launch backward is held to flash-attention's bar."""
    name, sq, sk, d, dtype, causal = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k, v = (randn(1, s, 2, d, dtype=dtype, generator=g) for s in (sq, sk, sk))
    do = randn(1, sq, 2, d, dtype=dtype, generator=g)
    out, lse = flash_attention_forward(q, k, v, causal=causal)
    got = (out,) + tuple(flash_attention_backward(do, q, k, v, out, lse, causal=causal))

    ins = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    exact, _ = attention_reference(*ins, causal=causal)
    exact = (exact,) + torch.autograd.grad(exact, ins, do.double().cpu())
    ins = [t.cpu().requires_grad_() for t in (q, k, v)]
    torch_16bit = _attention_16bit(*ins, causal)
    torch_16bit = (torch_16bit,) + torch.autograd.grad(torch_16bit, ins, do.cpu())
    for what, ours, ref, theirs in zip(("out", "dq", "dk", "dv"), got, exact, torch_16bit):
        err, bar = (ours.cpu().double() - ref).abs().max().item(), (theirs.double() - ref).abs().max().item()
        assert err <= 2 * bar, f"{name} {what}: {err:.3g} > 2 x PyTorch's {bar:.3g}"


#: the load-path comparison (descriptors load the streamed tiles of every block, the masked half
#: blocks' too): lengths that give, over the three cases, both kinds of program unmasked 32-row
#: blocks, masked 16-row blocks and tail rows on the interpreter's tiles; GQA, padded head dims (24
#: and MLA's 24 / 16 in 32: zero-filled by the descriptor, masked by the pointer loads), a window,
#: a softcap, sinks, fp32 (which the interpreter loads by descriptor too; a GPU does not)
LOAD_CASES = [
    ("gqa-causal-d24", 1, 83, 97, 4, 2, 24, 24, torch.float16, dict(causal=True), False),
    ("mla-dims-window-sinks", 2, 70, 66, 2, 1, 24, 16, torch.float32, dict(window=(40, 5), q_offset=0, k_offset=0),
     True),
    ("softcap-full", 1, 96, 75, 2, 2, 32, 32, torch.float16, dict(softcap=3.0, q_offset=0, k_offset=0), False),
]


def _on_both_paths(monkeypatch, call):
    """``call()`` on the "auto" load path, then on pointer loads: ``{path: result}`` and, under
    the interpreter, the TMA flag of every launch on each path (compiled launches are autotuned:
    not spied on)."""
    seen = spy_launches(monkeypatch, flash_attention_bwd, "_attn_bwd_kernel") if INTERPRETED else []
    got, flags = {}, {}
    for path in ("auto", "pointer"):
        with gemm_loads.load_path_set(path):
            start = len(seen)
            got[path] = call()
            flags[path] = {f["TMA"] for _, f in seen[start:]}
    return got, flags


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
@pytest.mark.parametrize("case", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_paths_agree(monkeypatch, case, dq_mode):
    """Descriptor loads and pointer loads: both against float64; under the interpreter (the same
    dots on both paths) the same bits, and "auto" launched with ``TMA`` (the one pass: without)."""
    q, k, v, do, sinks, opts = _inputs(case)
    out, lse = flash_attention_forward(q, k, v, sinks=sinks, **opts)
    got, flags = _on_both_paths(monkeypatch, lambda: flash_attention_backward(
        do, q, k, v, out, lse, sinks=sinks, dq_mode=dq_mode, **opts))
    ref = _reference(q, k, v, do, sinks, opts)
    for path, grads in got.items():
        _check(grads, ref, q.dtype, do, f"{case[0]} {dq_mode} {path}")
    if INTERPRETED:
        assert flags == {"auto": {dq_mode == "separate"}, "pointer": {False}}  # the one pass: pointers
        for name, a, b in zip(("dq", "dk", "dv", "d_sink"), got["auto"], got["pointer"]):
            assert torch.equal(a, b), f"{name}: the load paths differ"


def _nan_framed(rows, heads, d, dt, g, filled):
    """``[1, rows, heads, d]`` views of an all-NaN ``[1, rows + 9, heads, 32]`` buffer whose rows
    ``filled`` (a list of ``(start, stop)``) hold ``randn`` in the first ``d`` columns: NaN in the
    columns past the head dim, in the rows between the ranges and after the last."""
    buf = torch.full((1, rows + 9, heads, 32), float("nan"), dtype=dt, device=DEVICE)
    for a, b in filled:
        buf[:, a:b, :, :d] = randn(1, b - a, heads, d, dtype=dt, generator=g)
    return buf[:, :rows, :, :d]


def test_descriptors_stop_at_each_sequence(monkeypatch):
    """Two sequences of a batch whose rows continue with NaN past ``seq`` (views of longer
    buffers) and whose head dim (24) is followed by NaN columns: a descriptor that reached past
    its (batch, head)'s rows or columns would read NaN, where the pointer loads mask. Both paths,
    causal with ragged tails (70 query rows, 83 keys on 32-row tiles)."""
    g = torch.Generator().manual_seed(61)
    dt, d = torch.float16, 24
    q, do = (torch.cat([_nan_framed(70, 4, d, dt, g, [(0, 70)]) for _ in range(2)]) for _ in range(2))
    k, v = (torch.cat([_nan_framed(83, 2, d, dt, g, [(0, 83)]) for _ in range(2)]) for _ in range(2))
    q, do, k, v = (t[:, :n] for t, n in ((q, 70), (do, 70), (k, 83), (v, 83)))
    out, lse = flash_attention_forward(q, k, v, causal=True)
    got, flags = _on_both_paths(monkeypatch, lambda: flash_attention_backward(do, q, k, v, out, lse, causal=True))
    ref = _reference(q, k, v, do, None, dict(causal=True))
    for path, grads in got.items():
        _check(grads, ref, dt, do, f"nan-framed {path}")
    if INTERPRETED:
        assert flags == {"auto": {True}, "pointer": {False}}
        assert all(torch.equal(a, b) for a, b in zip(got["auto"], got["pointer"]))


def test_load_paths_agree_over_documents_and_ring_sums(monkeypatch):
    """Packed documents with NaN rows between and after them and NaN columns past the head dim
    (each descriptor spans one document's rows: its edge zero-fills where a gap starts) and a ring
    step's accumulate mode into fp32 buffers, both paths, every document row against float64."""
    g = torch.Generator().manual_seed(53)
    lengths, hq, hk, d, dt = [70, 45, 81], 4, 2, 24, torch.float16
    starts = [sum(lengths[:i]) + 5 * i for i in range(len(lengths))]  # 5 NaN rows after each document
    total, docs = starts[-1] + lengths[-1] + 5, [(s, s + n) for s, n in zip(starts, lengths)]
    q, do = (_nan_framed(total, hq, d, dt, g, docs) for _ in range(2))
    k, v = (_nan_framed(total, hk, d, dt, g, docs) for _ in range(2))
    table = torch.tensor([[a, b, a, b, 0] for a, b in docs], dtype=torch.int32, device=DEVICE)
    seg = Segments(table, max(lengths), max(lengths))
    out, lse = flash_attention_forward(q, k, v, causal=True, segments=seg)
    seeds = [randn(*t.shape, generator=g) for t in (q, k, v)]

    def step():
        bufs = [t.clone() for t in seeds]
        flash_attention_backward(do, q, k, v, out, lse, causal=True, segments=seg, dq=bufs[0], dk=bufs[1],
                                 dv=bufs[2], accumulate=True)
        return [torch.cat([(b - seed)[:, a:e] for a, e in docs], dim=1) for b, seed in zip(bufs, seeds)]

    got, flags = _on_both_paths(monkeypatch, step)
    parts = [_reference(q[:, a:e], k[:, a:e], v[:, a:e], do[:, a:e], None, dict(causal=True)) for a, e in docs]
    ref = [torch.cat([p[i].cpu() for p in parts], dim=1) for i in range(3)]
    do_docs = torch.cat([do[:, a:e] for a, e in docs], dim=1)
    for path, grads in got.items():
        _check(grads, ref, dt, do_docs, f"documents {path}")
    if INTERPRETED:
        assert flags == {"auto": {True}, "pointer": {False}}
        assert all(torch.equal(a, b) for a, b in zip(got["auto"], got["pointer"]))


def test_what_descriptors_cannot_take_loads_through_pointers():
    """``backward_loads``: pointer loads for a base off 16 bytes (a view one element in), a head
    stride that is not a 16-byte multiple (head dim 20 fp16), a head dim not contiguous, head dims
    above ``TMA_MAX_HEAD_DIM`` (q / k's or v's: 80, MLA's 96 / 64), and after
    ``set_load_path("pointer")``; descriptors otherwise (the interpreter takes fp32, a GPU 16-bit
    only). The first case runs against float64 too."""
    g = torch.Generator().manual_seed(59)
    dt = torch.float16
    big = randn(1, 40, 2, 48, dtype=dt, generator=g)
    plain = [randn(1, 40, 2, 32, dtype=dt, generator=g) for _ in range(4)]
    tma = "tma" if gemm_loads.tma_capable(plain[0].device, 2) else "pointer"  # (sm_80: pointers)
    assert flash_attention_bwd.backward_loads(*plain) == tma
    shifted = big[..., 1:33]
    assert flash_attention_bwd.backward_loads(shifted, *plain[1:]) == "pointer"
    assert flash_attention_bwd.backward_loads(*plain[:3], big[..., 8:40]) == tma  # 16 bytes in
    narrow = [randn(1, 40, 2, 20, dtype=dt, generator=g) for _ in range(4)]
    assert flash_attention_bwd.backward_loads(*narrow) == "pointer"
    wide = [randn(1, 40, 2, d, dtype=dt, generator=g) for d in (80, 96, 64)]
    assert flash_attention_bwd.TMA_MAX_HEAD_DIM == 64
    assert flash_attention_bwd.backward_loads(wide[0], wide[0], wide[0], wide[0]) == "pointer"
    assert flash_attention_bwd.backward_loads(wide[1], wide[1], wide[2], wide[2]) == "pointer"
    assert flash_attention_bwd.backward_loads(wide[2], wide[2], wide[2], wide[2]) == tma
    strided = randn(1, 40, 32, 2, dtype=dt, generator=g).transpose(2, 3)
    assert flash_attention_bwd.backward_loads(strided, *plain[1:]) == "pointer"
    with gemm_loads.load_path_set("pointer"):
        assert flash_attention_bwd.backward_loads(*plain) == "pointer"
    fp32 = [t.float() for t in plain]
    assert flash_attention_bwd.backward_loads(*fp32) == ("tma" if INTERPRETED else "pointer")
    q, k, v, do = shifted, *plain[1:]
    out, lse = flash_attention_forward(q, k, v, causal=True)
    got = flash_attention_backward(do, q, k, v, out, lse, causal=True)
    _check(got, _reference(q, k, v, do, None, dict(causal=True)), dt, do, "unaligned q")


def test_one_program_kind_checks_only_what_it_streams(monkeypatch):
    """A launch of one program kind (``dq=False``: dK/dV programs, streaming q and dO;
    ``dk=False``: dQ programs, streaming k and v) takes descriptors whatever the other kind's
    tensors are: ``backward_loads`` with k and v (q and dO) a view off 16 bytes; the launches
    with k (q) such a view. Both against float64, and (interpreted) launched with ``TMA``."""
    g = torch.Generator().manual_seed(61)
    dt = torch.float16
    big = randn(1, 37, 2, 40, dtype=dt, generator=g)
    off = big[..., 1:33]  # base 2 bytes in, row stride 80 bytes: pointer loads only
    al = [randn(1, 37, 2, 32, dtype=dt, generator=g) for _ in range(4)]
    assert flash_attention_bwd.backward_loads(al[0], off, off, al[3], dq=False) == ("tma" if INTERPRETED else
                                                                                  flash_attention_bwd.backward_loads(*al))
    assert flash_attention_bwd.backward_loads(al[0], off, off, al[3]) == "pointer"
    assert flash_attention_bwd.backward_loads(off, al[1], al[2], off, dkv=False) == flash_attention_bwd.backward_loads(
        *al)
    assert flash_attention_bwd.backward_loads(off, al[1], al[2], off, dq=False) == "pointer"
    seen = spy_launches(monkeypatch, flash_attention_bwd, "_attn_bwd_kernel") if INTERPRETED else []
    opts = dict(causal=True)
    for q, k, v, do, kind in ((al[0], off, off.clone() * 0.5, al[3], "dkv"), (off, al[1], al[2], off * 0.5, "dq")):
        out, lse = flash_attention_forward(q, k, v, **opts)
        ref = _reference(q, k, v, do, None, opts)
        skip = dict(dq=False) if kind == "dkv" else dict(dk=False, dv=False)
        got = flash_attention_backward(do, q, k, v, out, lse, **skip, **opts)
        assert [g is False for g in got] == ([True, False, False] if kind == "dkv" else [False, True, True])
        _check(got, ref, dt, do, f"{kind} programs only")
    if INTERPRETED:
        assert [f["TMA"] for _, f in seen] == [True, True]
