"""torch.compile of fusedpar's attention: ``torch.library.opcheck`` of every attention custom op
(flash, varlen, ring, Ulysses/hybrid and their backwards) on fresh random inputs of small odd
shapes, and ``torch.compile(backend="aot_eager", fullgraph=True)`` of the functional ops and of
ParallelAttention at world 1 with packed documents (ring zigzag and Ulysses at sp2 compile inside
whole blocks in tests/test_torch_compile_block.py, in a gloo world of 2): output and every input
and parameter gradient equal to eager.

Compiled and eager runs call the same kernels (aot_eager runs the traced graph's aten ops and the
opaque custom ops); the only difference is the rotary embedding's aten decomposition, so fp32
results agree to rounding: COMPILED_TOL (relative to the RMS of the eager value).
"""
import pytest
import torch

from _utils import BACKWARD_OPCHECK, INTERPRETED, assert_close
from fusedpar.nn import ParallelAttention
from fusedpar.ops import flash_attention, flash_attention_varlen, hybrid_attention, ring_attention
from fusedpar.ops.sequence_parallel.bodies import head_widths, split_heads
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.nn import AttentionConfig

# CPU tensors under the interpreter (opcheck, aot_eager); on a GPU the compiled check is the block test
# (tests/test_torch_compile_block.py runs its one-process cases there with inductor)
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="CPU-interpreter test; on a GPU: test_torch_compile_block")

#: fp32, same kernels in both runs; the traced elementwise ops (rotary) may round differently
COMPILED_TOL = 1e-5


def _qkv(gen, b, s, hq, hk, d=8, requires_grad=False):
    return tuple(torch.randn(b, s, h, d, generator=gen).requires_grad_(requires_grad) for h in (hq, hk, hk))


def _opcheck(op, args):
    torch.library.opcheck(op, args)


def _opcheck_backward(op, args):
    torch.library.opcheck(op, args, test_utils=BACKWARD_OPCHECK)


def _assert_same(got, want, msg):
    scale = max(want.detach().pow(2).mean().sqrt().item(), 1e-6)
    assert_close(got, want, torch.float32, rtol=COMPILED_TOL, atol=COMPILED_TOL * scale, msg=msg)


# ----------------------------------------------------------------------------------------------
# opcheck, one process
# ----------------------------------------------------------------------------------------------
def test_opcheck_flash_ops():
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(g, 1, 5, 2, 1, requires_grad=True)
    k, v = (torch.randn(1, 7, 1, 8, generator=g).requires_grad_() for _ in range(2))
    args = (q, k, v, True, None, 0, 2)  # causal with offsets: a block of a longer sequence
    _opcheck(torch.ops.fusedpar.flash_attention.default, args)
    out, lse, *_ = torch.ops.fusedpar.flash_attention(*args)
    dout = torch.randn(out.shape, generator=g)
    _opcheck_backward(torch.ops.fusedpar.flash_attention_backward.default,
             (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, None, 0, 2))

    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)  # an empty document
    qv, kv, vv = (torch.randn(7, h, 8, generator=g).requires_grad_() for h in (2, 1, 1))
    vargs = (qv, kv, vv, cu, cu, 5, 5, True, 0.3)
    _opcheck(torch.ops.fusedpar.flash_attention_varlen.default, vargs)
    out, lse, *_ = torch.ops.fusedpar.flash_attention_varlen(*vargs)
    dout = torch.randn(out.shape, generator=g)
    _opcheck_backward(torch.ops.fusedpar.flash_attention_varlen_backward.default,
             (dout, qv.detach(), kv.detach(), vv.detach(), out.detach(), lse, cu, cu, 5, 5, True, 0.3))


def test_opcheck_flash_ops_window_softcap_sinks():
    # the new schema arguments: window (left, right), softcap, differentiable sinks, v head dim 6 != 8;
    # the offsets None (bottom-right aligned: 5 queries, 7 keys)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 5, 2, 8, generator=g).requires_grad_()
    k = torch.randn(1, 7, 1, 8, generator=g).requires_grad_()
    v = torch.randn(1, 7, 1, 6, generator=g).requires_grad_()
    sinks = torch.randn(2, generator=g).requires_grad_()
    args = (q, k, v, True, None, None, None, 3, -1, 2.0, sinks)
    _opcheck(torch.ops.fusedpar.flash_attention.default, args)
    out, lse, *_ = torch.ops.fusedpar.flash_attention(*args)
    dout = torch.randn(out.shape, generator=g)
    _opcheck_backward(torch.ops.fusedpar.flash_attention_backward.default,
                      (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, True, None, None, None, 3, -1,
                       2.0, sinks.detach()))

    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    qv, kv = (torch.randn(7, h, 8, generator=g).requires_grad_() for h in (2, 1))
    vv = torch.randn(7, 1, 6, generator=g).requires_grad_()
    vargs = (qv, kv, vv, cu, cu, 5, 5, False, 0.3, 1, 2, None, sinks)
    _opcheck(torch.ops.fusedpar.flash_attention_varlen.default, vargs)
    out, lse, *_ = torch.ops.fusedpar.flash_attention_varlen(*vargs)
    dout = torch.randn(out.shape, generator=g)
    _opcheck_backward(torch.ops.fusedpar.flash_attention_varlen_backward.default,
                      (dout, qv.detach(), kv.detach(), vv.detach(), out.detach(), lse, cu, cu, 5, 5, False, 0.3, 1, 2,
                       None, sinks.detach()))


def test_opcheck_flash_ops_return_fp8():
    # return_fp8: the forward's e4m3 output (d_v 128: one 1x128 tile per head) as two more outputs,
    # not differentiable (no test_schema: its mutation check multiplies the outputs, which CPU torch
    # cannot for e4m3)
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 5, h, 8, generator=g).requires_grad_() for h in (2, 1))
    v = torch.randn(1, 5, 1, 128, generator=g).requires_grad_()
    utils = ("test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.fusedpar.flash_attention.default, (q, k, v, True, None, 0, 0, -1, -1, None, None,
                                                                       "separate", True), test_utils=utils)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fusedpar.flash_attention_varlen.default,
                          (q[0], k[0], v[0], cu, cu, 3, 3, True, None, -1, -1, None, None, "separate", True),
                          test_utils=utils)


def test_flash_options_compile_fullgraph():
    # window, softcap and sinks through torch.compile: out and every gradient (d_sink included) equal eager;
    # 6 queries, 9 keys at the default (bottom-right) offsets
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g, 1, 6, 2, 1)
    k, v = (torch.randn(1, 9, 1, 8, generator=g) for _ in range(2))
    sinks = torch.randn(2, generator=g)
    fn = lambda q, k, v, s: flash_attention(q, k, v, causal=True, window=(2, -1), softcap=1.5, sinks=s)[0]  # noqa: E731
    torch._dynamo.reset()
    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        y = f(*xs)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
        results.append((y.detach(), *torch.autograd.grad(y, xs, dy)))
    for name, got, want in zip(("out", "dq", "dk", "dv", "d_sink"), results[1], results[0]):
        _assert_same(got, want, f"{name} flash options")


def _sp_opchecks(g, ring_transport_id, uly_transport_id, ring_layout, ring_cu=None, uly_cu=None, hybrid_ring_transport_id=None,
                 options=False):
    """opcheck of the ring and Ulysses ops (forward and backward) over the given transport ids;
    ``options``: with a window, softcap, sinks and a v head dim of 4 (q/k: 8)."""
    q, k, v = _qkv(g, 1, 6, 2, 1, requires_grad=True)
    scores = ()
    if options:
        v = torch.randn(1, 6, 1, 4, generator=g).requires_grad_()
        scores = (3, 0, 2.5, torch.randn(2, generator=g).requires_grad_())  # window_left/right, softcap, sinks
    args = (q, k, v, ring_transport_id, True, ring_layout, None, ring_cu, *scores)
    _opcheck(torch.ops.fusedpar.ring_attention.default, args)
    out, lse = torch.ops.fusedpar.ring_attention(*args)
    dout = torch.randn(out.shape, generator=g)
    plain = tuple(t.detach() for t in (q, k, v, out))
    _opcheck_backward(torch.ops.fusedpar.ring_attention_backward.default,
             (dout, *plain, lse, ring_transport_id, True, ring_layout, None, ring_cu, *scores))

    uargs = (q, k, v, uly_transport_id, hybrid_ring_transport_id, True, ring_layout, 0.4, uly_cu, *scores)
    _opcheck(torch.ops.fusedpar.ulysses_attention.default, uargs)
    out, heads, out_heads, lse = torch.ops.fusedpar.ulysses_attention(*uargs)
    # 2 / size q heads, 1 replicated kv head
    qh, kh, vh = split_heads(heads, head_widths(2, 1, 2, 8, v.shape[3]))
    dout = torch.randn(out.shape, generator=g)
    _opcheck_backward(torch.ops.fusedpar.ulysses_attention_backward.default,
             (dout, qh, kh, vh, out_heads, lse, uly_transport_id, hybrid_ring_transport_id, 1, True, ring_layout, 0.4, uly_cu,
              *scores))


def test_opcheck_sequence_parallel_ops_emulated():
    # rank 1 / rank 0 of emulated groups of 2: ring and the hybrid (Ulysses x ring), packed documents
    uly, ring = EmulatedTransport(2, 1), EmulatedTransport(2, 0)
    ring_cu = torch.tensor([0, 1, 7, 12], dtype=torch.int32)  # 12 tokens: the ring's
    uly_cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)  # 24 tokens: the 2 x 2 grid's
    _sp_opchecks(torch.Generator().manual_seed(2), ring.transport_id, uly.transport_id, "zigzag", ring_cu=ring_cu, uly_cu=uly_cu,
                 hybrid_ring_transport_id=ring.transport_id)
    _sp_opchecks(torch.Generator().manual_seed(3), ring.transport_id, uly.transport_id, "contiguous", hybrid_ring_transport_id=ring.transport_id,
                 options=True)


# ----------------------------------------------------------------------------------------------
# the functional ops under torch.compile, one process (emulated ranks)
# ----------------------------------------------------------------------------------------------
def _compiled_equals_eager(fn, inputs, msg, extra=()):
    """fn(*inputs, *extra) compiled (aot_eager, fullgraph) vs eager: output and input gradients."""
    torch._dynamo.reset()
    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        y = f(*xs, *extra)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(99))
        results.append((y.detach(), *torch.autograd.grad(y, xs, dy)))
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), results[1], results[0]):
        _assert_same(got, want, f"{name} {msg}")


def test_functional_ops_compile_fullgraph():
    g = torch.Generator().manual_seed(3)
    uly, ring = EmulatedTransport(2, 1), EmulatedTransport(2, 0)
    qkv = _qkv(g, 1, 6, 2, 1)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    _compiled_equals_eager(lambda q, k, v: flash_attention(q, k, v, causal=True)[0], qkv, "flash")
    _compiled_equals_eager(lambda q, k, v, c: flash_attention_varlen(q, k, v, c, c, 6, 6, causal=True)[0],
                           [t[0] for t in qkv], "varlen", extra=(torch.tensor([0, 1, 6], dtype=torch.int32),))
    _compiled_equals_eager(lambda q, k, v, c: ring_attention(q, k, v, transport=ring, causal=True, cu_seqlens=c),
                           qkv, "ring emulated zigzag documents", extra=(cu,))
    _compiled_equals_eager(lambda q, k, v: hybrid_attention(q, k, v, ulysses_transport=uly, ring_transport=ring,
                                                            causal=True, layout="contiguous"),
                           qkv, "hybrid emulated 2x2")
    # window, softcap, sinks (their gradient too) and a v head dim of 4
    opts = dict(causal=True, window=(4, 0), softcap=3.0)
    qkvs = (*qkv[:2], torch.randn(1, 6, 1, 4, generator=g), torch.randn(2, generator=g))
    _compiled_equals_eager(lambda q, k, v, s: ring_attention(q, k, v, transport=ring, sinks=s, **opts), qkvs,
                           "ring emulated zigzag options")
    _compiled_equals_eager(lambda q, k, v, s: hybrid_attention(q, k, v, ulysses_transport=uly, ring_transport=ring,
                                                               layout="contiguous", sinks=s, **opts),
                           qkvs, "hybrid emulated 2x2 options")


# ----------------------------------------------------------------------------------------------
# ParallelAttention compiled: world 1 and a 2-rank world
# ----------------------------------------------------------------------------------------------
def _module_compiled_equals_eager(mod, x, msg, **kwargs):
    """One compile of ``mod``; forward output, input gradient and every parameter gradient of
    the compiled module equal eager."""
    torch._dynamo.reset()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(98))
    results = []
    for f in (mod, torch.compile(mod, backend="aot_eager", fullgraph=True)):
        mod.zero_grad(set_to_none=True)
        xs = x.detach().clone().requires_grad_()
        y = f(xs, **kwargs)
        y.backward(dy)
        results.append((y.detach(), xs.grad, {n: p.grad.clone() for n, p in mod.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    _assert_same(y1, y0, f"out {msg}")
    _assert_same(gx1, gx0, f"dx {msg}")
    assert set(gp1) == set(gp0)
    for n in gp0:
        _assert_same(gp1[n], gp0[n], f"grad {n} {msg}")


def test_parallel_attention_compiles_world1():
    torch.manual_seed(4)
    mod = ParallelAttention(AttentionConfig(24, 3, 1, head_dim=8, bias=True, causal=True))
    x = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(5))
    _module_compiled_equals_eager(mod, x, "world 1", cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    # the attention options: window, softcap, the sinks parameter (its gradient too), a v head dim of 4
    mod = ParallelAttention(AttentionConfig(24, 2, 1, head_dim=8, window=(3, 0), softcap=20.0, sinks=True, v_head_dim=4))
    with torch.no_grad():
        mod.sinks.copy_(torch.tensor([0.5, -1.0]))
    _module_compiled_equals_eager(mod, x, "world 1 options")
