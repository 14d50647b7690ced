"""One causal convention for dense and packed attention when ``seq_q != seq_k``: bottom-right, as
flash-attn (>= 2.1) aligns it, with explicit offsets for any other alignment.

Dense :func:`flash_attention` with its default offsets (None) puts the last query at the last key
(query ``i`` sees key ``j`` iff ``j <= i + seq_k - seq_q``; windows shift alike), which is what
``flash_attention_varlen`` does per document; ``q_offset=0, k_offset=0`` given explicitly is
top-left, torch SDPA's ``is_causal``. Checked both ways (``seq_q < seq_k``, ``seq_q > seq_k``),
forward and backward through the op: against SDPA with an explicit boolean mask (bottom-right),
against SDPA's ``is_causal`` (explicit top-left), dense against a one-document varlen call, and
the launchers' defaults against their explicit offsets. fp32, small shapes (interpreter)."""
import pytest
import torch
import torch.nn.functional as F

from _utils import DEVICE, assert_close, randn
from fusedpar.kernels import attention_reference, flash_attention_backward, flash_attention_forward
from fusedpar.kernels.flash_attention import resolve_offsets
from fusedpar.ops import flash_attention, flash_attention_varlen

#: fp32 under ieee dots (interpreter) against an fp64 oracle; gradients relative to their RMS
TOL = 2e-5
#: (seq_q, seq_k): fewer queries than keys (decoding with a cache) and more (rows that see nothing)
LENGTHS = [(5, 11), (11, 5)]
#: (id, flash options, visible(i, j, shift)) with shift = seq_k - seq_q (bottom-right)
MASKS = [
    ("causal", dict(causal=True), lambda i, j, s: j <= i + s),
    ("window", dict(window=(3, 1)), lambda i, j, s: (j >= i + s - 3) & (j <= i + s + 1)),
    ("causal-window", dict(causal=True, window=(2, -1)), lambda i, j, s: (j >= i + s - 2) & (j <= i + s)),
]


@pytest.fixture(autouse=True)
def _ieee_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _inputs(sq, sk, seed, hq=2, hk=1, d=16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (randn(1, sq, hq, d, generator=g), randn(1, sk, hk, d, generator=g), randn(1, sk, hk, d, generator=g),
            randn(1, sq, hq, d, generator=g))


def _op(q, k, v, do, **opts):
    """``(out, lse, dq, dk, dv)`` of the differentiable op."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, **opts)
    return (out.detach(), lse, *torch.autograd.grad(out, leaves, do))


def _sdpa(q, k, v, do, *, mask=None, is_causal=False):
    """``(out, dq, dk, dv)`` of torch SDPA in fp64 (GQA expanded). Rows whose mask is all False
    (SDPA would give NaN) attend to every key with a zero upstream gradient and output 0, which is
    flash attention's answer for a row that sees nothing."""
    hq, hk = q.shape[2], k.shape[2]
    qs, ks, vs = (t.double().transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dos = do.double().transpose(1, 2)
    empty = None
    if mask is not None:
        empty = ~mask.any(-1)
        mask = mask | empty[:, None]
        dos = dos.masked_fill(empty[:, None], 0.0)
    out = F.scaled_dot_product_attention(qs, ks.repeat_interleave(hq // hk, 1), vs.repeat_interleave(hq // hk, 1),
                                         attn_mask=mask, is_causal=is_causal)
    grads = torch.autograd.grad(out, (qs, ks, vs), dos)
    if empty is not None:
        out = out.masked_fill(empty[:, None], 0.0)
    return tuple(t.transpose(1, 2) for t in (out, *grads))


def _assert_matches(got, want, msg):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        scale = max(w.pow(2).mean().sqrt().item(), 1e-3)
        assert_close(g, w, torch.float32, rtol=TOL, atol=TOL * scale, msg=f"{name} {msg}")


@pytest.mark.parametrize("name, opts, visible", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("sq, sk", LENGTHS, ids=[f"q{a}-k{b}" for a, b in LENGTHS])
def test_default_is_bottom_right(sq, sk, name, opts, visible):
    """The default offsets align the mask bottom-right (SDPA with that boolean mask), and a single
    document of ``flash_attention_varlen`` gives the same out, lse and gradients."""
    q, k, v, do = _inputs(sq, sk, seed=sq * 7 + sk + len(name))
    out, lse, *grads = _op(q, k, v, do, **opts)
    i, j = torch.arange(sq, device=DEVICE)[:, None], torch.arange(sk, device=DEVICE)[None, :]
    _assert_matches((out, *grads), _sdpa(q, k, v, do, mask=visible(i, j, sk - sq)), f"{name} q{sq} k{sk}")
    if sq > sk and name == "causal":  # the first sq - sk rows see no key
        assert torch.equal(out[:, :sq - sk], torch.zeros_like(out[:, :sq - sk]))
        assert bool(torch.isneginf(lse[..., :sq - sk]).all()) and bool(torch.isfinite(lse[..., sq - sk:]).all())
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (sq, sk))
    leaves = [t[0].detach().clone().requires_grad_() for t in (q, k, v)]
    vout, vlse = flash_attention_varlen(*leaves, cu_q, cu_k, sq, sk, **opts)
    vgrads = torch.autograd.grad(vout, leaves, do[0])
    _assert_matches((vout, *vgrads), tuple(t[0] for t in (out, *grads)), f"varlen {name} q{sq} k{sk}")
    assert torch.equal(torch.isinf(vlse), torch.isinf(lse[0]))
    fin = torch.isfinite(vlse)
    assert_close(vlse[fin], lse[0][fin], torch.float32, rtol=TOL, atol=TOL, msg=f"varlen lse {name}")


@pytest.mark.parametrize("sq, sk", LENGTHS, ids=[f"q{a}-k{b}" for a, b in LENGTHS])
def test_explicit_zero_offsets_are_top_left(sq, sk):
    """``q_offset=0, k_offset=0``: the old default, torch SDPA's ``is_causal`` (top-left)."""
    q, k, v, do = _inputs(sq, sk, seed=sq + 3 * sk)
    out, _, *grads = _op(q, k, v, do, causal=True, q_offset=0, k_offset=0)
    _assert_matches((out, *grads), _sdpa(q, k, v, do, is_causal=True), f"top-left q{sq} k{sk}")


def test_resolve_offsets():
    assert resolve_offsets(None, None, 5, 11) == (6, 0)  # the last query at the last key
    assert resolve_offsets(None, None, 11, 5) == (0, 6)
    assert resolve_offsets(None, None, 7, 7) == (0, 0)
    assert resolve_offsets(None, None, 5, 11, segmented=True) == (0, 0)  # the segments' shifts align them
    assert resolve_offsets(0, 0, 5, 11) == (0, 0)  # explicit: global positions, as before
    assert resolve_offsets(3, None, 5, 11) == (3, 0) and resolve_offsets(None, 4, 5, 11) == (0, 4)


def test_launcher_defaults_equal_resolved_offsets():
    """The kernel-level forward and backward and the fp64 reference resolve None like the op; one
    given offset keeps its old meaning (the other 0)."""
    q, k, v, do = _inputs(4, 9, seed=2)
    for opts in (dict(causal=True), dict(window=(2, 0))):
        out, lse = flash_attention_forward(q, k, v, **opts)
        out_x, lse_x = flash_attention_forward(q, k, v, q_offset=5, k_offset=0, **opts)
        assert torch.equal(out, out_x) and torch.equal(lse, lse_x), opts
        grads = flash_attention_backward(do, q, k, v, out, lse, **opts)
        grads_x = flash_attention_backward(do, q, k, v, out, lse, q_offset=5, k_offset=0, **opts)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_x)), opts
        ref, ref_lse = attention_reference(q, k, v, **opts)
        ref_x, ref_lse_x = attention_reference(q, k, v, q_offset=5, k_offset=0, **opts)
        assert torch.equal(ref, ref_x) and torch.equal(ref_lse, ref_lse_x), opts
        assert_close(out, ref, torch.float32, rtol=TOL, atol=TOL, msg=f"launcher default {opts}")
    one, _ = attention_reference(q, k, v, causal=True, q_offset=2)
    assert torch.equal(one, attention_reference(q, k, v, causal=True, q_offset=2, k_offset=0)[0])
