"""Fused RMSNorm (+ residual add): forward and gradients of x, residual and weight vs fp64; its fp8
output (rms_norm_fp8) bit for bit against quantize_e4m3 of the output and torch's e4m3 cast."""
import pytest
import torch

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn
from fusedpar.kernels import quantize_e4m3, rms_norm_bwd, rms_norm_fwd, rms_norm_reference
from fusedpar.kernels.fp8 import E4M3_MAX, SCALE_FLOOR, quantize_e4m3_reference
from fusedpar.kernels.rmsnorm import rms_norm_fp8_fwd
from fusedpar.nn import RMSNorm
from fusedpar.ops import rms_norm
from fusedpar.ops.norm.api import rms_norm_fp8

# bf16 is load/store/cast only here (no tl.dot), which the interpreter handles, so it runs everywhere.
NORM_DTYPES = list(dict.fromkeys(DTYPES + [torch.bfloat16]))
# Gradient tolerances: the backward rounds dy and the saved input to the storage dtype and sums
# H products in fp32; for fp32 the mean over H plus the weight-gradient sum over rows (up to ~100
# terms here) stay within 1e-5 relative of the RMS; fp16/bf16 keep their output rounding bound.
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _ref_grads(x, w, r, dy, dh, eps):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    r64 = r.detach().double().requires_grad_() if r is not None else None
    out = rms_norm_reference(x64, w64, eps, residual=r64)
    if r is None:
        loss = (out * dy.double()).sum()
    else:
        loss = (out[0] * dy.double()).sum() + (out[1] * dh.double()).sum()
    loss.backward()
    return out, x64.grad, (w64.grad if w is not None else None), (r64.grad if r is not None else None)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 65), (2, 9, 127), (37, 19)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_forward_backward_vs_fp64(shape, dtype, with_residual):
    g = torch.Generator().manual_seed(hash((shape, with_residual)) % 2**31)
    H = shape[-1]
    eps = 1e-5
    x = randn(*shape, dtype=dtype, generator=g, scale=2.0).requires_grad_()
    w = (1 + 0.5 * randn(H, dtype=torch.float32, generator=g)).to(dtype).requires_grad_()
    r = randn(*shape, dtype=dtype, generator=g).requires_grad_() if with_residual else None
    dy = randn(*shape, dtype=dtype, generator=g)
    dh = randn(*shape, dtype=dtype, generator=g) if with_residual else None

    out = rms_norm(x, w, eps, residual=r)
    ref, gx, gw, gr = _ref_grads(x, w, r, dy, dh, eps)
    if with_residual:
        y, h = out
        assert h.dtype == r.dtype and y.dtype == dtype
        assert_close(h, ref[1], dtype, msg="new residual")
        assert_close(y, ref[0], dtype, msg="y")
        torch.autograd.backward([y, h], [dy, dh])
    else:
        assert out.dtype == dtype
        assert_close(out, ref, dtype, msg="y")
        out.backward(dy)
    _check_grads(x, w, r, dy, (gx, gw, gr), dtype, with_residual)


def _grad_scales(x, w, r, dy):
    """Magnitudes of the terms the gradients are sums of (the results themselves may cancel to
    ~0, e.g. dx of a 1-feature row is eps-small): dx ~ rstd * dy * w, dweight ~ sum |dy * n|."""
    h = x.detach().double() + (r.detach().double() if r is not None else 0)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    dyw = dy.double() * (w.detach().double() if w is not None else 1)
    sx = (dyw * rstd).pow(2).mean().sqrt().item()
    sw = (dy.double() * h * rstd).abs().reshape(-1, h.shape[-1]).sum(0).pow(2).mean().sqrt().item()
    return sx, sw


def _check_grads(x, w, r, dy, want, dtype, with_residual):
    """``x`` / ``w`` / ``r`` gradients against the reference's ``want = (gx, gw, gr)``, tolerances
    scaled by :func:`_grad_scales`."""
    gx, gw, gr = want
    tol = GRAD_RTOL[dtype]
    sx, sw = _grad_scales(x, w, r, dy)
    assert_close(x.grad, gx, dtype, rtol=tol, atol=tol * sx, msg="dx")
    assert_close(w.grad, gw, dtype, rtol=tol, atol=tol * sw, msg="dweight")
    if with_residual:
        assert_close(r.grad, gr, dtype, rtol=tol, atol=tol * sx, msg="dresidual")


def test_strided_sequence_chunk_in_place_and_poisoned_outputs():
    """[batch, seq-chunk, H] views (batch and seq strides do not merge, feature stride 2) are read
    and written in place; elements outside the destination views stay NaN."""
    g = torch.Generator().manual_seed(3)
    B, S, H, lo, hi = 3, 11, 21, 2, 7
    big_x = randn(B, S, 2 * H, generator=g)
    x = big_x[:, lo:hi, ::2]
    r = randn(B, S, H, generator=g)[:, lo:hi]
    w = randn(H, generator=g)
    y_big, h_big = poison((B, S, H), torch.float32), poison((B, S, H), torch.float32)
    y, h, rstd = rms_norm_fwd(x, w, 1e-6, residual=r, out=y_big[:, lo:hi], residual_out=h_big[:, lo:hi])
    ref_y, ref_h = rms_norm_reference(x, w, 1e-6, residual=r)
    assert_close(y_big[:, lo:hi], ref_y, torch.float32, msg="y in place")
    assert_close(h_big[:, lo:hi], ref_h, torch.float32, msg="h in place")
    assert torch.isnan(torch.cat([y_big[:, :lo], y_big[:, hi:]], 1)).all(), "wrote outside the y view"
    assert torch.isnan(torch.cat([h_big[:, :lo], h_big[:, hi:]], 1)).all(), "wrote outside the h view"
    assert rstd.shape == (B * (hi - lo),) and rstd.dtype == torch.float32
    # gradients through strided, non-contiguous leaves (autograd path)
    xs = big_x.clone().requires_grad_()
    out = rms_norm(xs[:, lo:hi, ::2], w.requires_grad_())
    dy = randn(*out.shape, generator=g)
    out.backward(dy)
    _, gx, gw, _ = _ref_grads(x, w, None, dy, None, 1e-6)
    assert_close(xs.grad[:, lo:hi, ::2], gx, torch.float32, msg="dx strided")
    assert (xs.grad[:, lo:hi, 1::2] == 0).all() and (xs.grad[:, :lo] == 0).all()
    assert_close(w.grad, gw, torch.float32, msg="dweight strided")


def test_mixed_precision_residual_stream_and_no_weight():
    """fp16 activations with an fp32 residual stream; elementwise_affine=False (no weight)."""
    g = torch.Generator().manual_seed(5)
    x = randn(4, 6, 40, dtype=torch.float16, generator=g).requires_grad_()
    r = randn(4, 6, 40, dtype=torch.float32, generator=g).requires_grad_()
    y, h = rms_norm(x, None, 1e-6, residual=r)
    assert y.dtype == torch.float16 and h.dtype == torch.float32
    ref_y, ref_h = rms_norm_reference(x, None, 1e-6, residual=r)
    assert_close(y, ref_y, torch.float16)
    assert_close(h, ref_h, torch.float16)  # x was fp16: the sum is exact in fp32 up to x's rounding
    (y.float().sum() + 3 * h.sum()).backward()
    assert x.grad.dtype == torch.float16 and r.grad.dtype == torch.float32
    _, gx, _, gr = _ref_grads(x, None, r, torch.ones_like(y), torch.full_like(h, 3.0), 1e-6)
    assert_close(r.grad, gr, torch.float16, rtol=GRAD_RTOL[torch.float16], msg="dresidual")
    assert_close(x.grad, gx, torch.float16, rtol=GRAD_RTOL[torch.float16], msg="dx")


def test_module_matches_reference_and_repr():
    g = torch.Generator().manual_seed(9)
    norm = RMSNorm(33, eps=1e-5, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(33, generator=g))
    x = randn(2, 5, 33, generator=g)
    assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-5), torch.float32)
    y, h = norm(x, x)
    assert_close(h, 2 * x.double(), torch.float32)
    assert "33, eps=1e-05" in repr(norm)
    assert RMSNorm(8, elementwise_affine=False).weight is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_scales_by_one_plus_weight(dtype):
    """``offset=1.0``: zero-initialised weight, scale ``1 + w`` formed in fp32 (as Hugging Face's
    Gemma norm), with the residual add fused; output and gradients of x, residual and weight vs
    fp64 (the weight's gradient is that of the scale)."""
    g = torch.Generator().manual_seed(10)
    norm = RMSNorm(37, eps=1e-5, offset=1.0, device=DEVICE, dtype=dtype)
    assert torch.equal(norm.weight, torch.zeros_like(norm.weight)) and "offset=1.0" in repr(norm)
    with torch.no_grad():
        norm.weight.copy_(randn(37, generator=g) * 0.5)
    x, r = randn(3, 5, 37, generator=g, dtype=dtype), randn(3, 5, 37, generator=g, dtype=dtype)
    dy, dh = randn(3, 5, 37, generator=g, dtype=dtype), randn(3, 5, 37, generator=g, dtype=dtype)
    xg, rg = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
    y, h = norm(xg, residual=rg)
    ((y.float() * dy.float()).sum() + (h.float() * dh.float()).sum()).backward()
    (y64, h64), dx64, dscale64, dr64 = _ref_grads(x, 1 + norm.weight.detach().double(), r, dy, dh, 1e-5)
    assert_close(y, y64, dtype, msg="output")
    for got, want, what in ((xg.grad, dx64, "x"), (rg.grad, dr64, "residual"), (norm.weight.grad, dscale64, "weight")):
        assert_close(got, want, dtype, rtol=GRAD_RTOL[dtype], msg=f"grad of {what}")
    with pytest.raises(ValueError, match="offset must be 0.0"):
        RMSNorm(8, offset=0.5)


BAD_INPUTS = [
    ("weight-shape", lambda x: rms_norm(x, randn(7)), ValueError, r"weight must have shape \(8,\), got \(7,\)"),
    ("residual-shape", lambda x: rms_norm(x, randn(8), residual=randn(3, 9)), ValueError,
     r"residual must have shape \(3, 8\), got \(3, 9\)"),
    ("int-dtype", lambda x: rms_norm(torch.ones(3, 8, dtype=torch.int64, device=DEVICE)), TypeError,
     "x must have one of the dtypes .* got torch.int64"),
    ("negative-eps", lambda x: rms_norm(x, None, -1.0), ValueError, "eps must be a non-negative number"),
    ("empty-hidden", lambda x: rms_norm(torch.ones(3, 0, device=DEVICE)), ValueError, "non-empty hidden"),
    ("module-features", lambda x: RMSNorm(8, device=DEVICE)(randn(3, 9)), ValueError,
     r"x must have 8 features in its last dim, got shape \(3, 9\)"),
    ("module-size", lambda x: RMSNorm(0), ValueError, "hidden_size must be a positive int"),
    ("not-a-tensor", lambda x: rms_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor, got list"),
    ("rstd-dtype", lambda x: rms_norm_bwd(x, x, None, torch.ones(3, dtype=torch.float64, device=DEVICE)), TypeError,
     "rstd must have dtype torch.float32, got torch.float64"),
    ("rstd-shape", lambda x: rms_norm_bwd(x, x, None, torch.ones(4, device=DEVICE)), ValueError,
     r"rstd must have shape \(3,\), got \(4,\)"),
    ("residual-out-without-residual", lambda x: rms_norm_fwd(x, None, residual_out=torch.empty_like(x)), ValueError,
     "residual_out must be None without a residual"),
]


@pytest.mark.parametrize("call,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call(randn(3, 8))


def test_shape_errors_come_before_the_device_error():
    """What a tensor is (shape) is checked before where it lives: an empty hidden dim or a bad
    weight shape gives the same error whatever the device (a meta tensor here, refused by the
    device check on every machine; a CPU tensor on a GPU machine alike), then the device error."""
    with pytest.raises(ValueError, match="non-empty hidden"):
        rms_norm(torch.ones(3, 0, device="meta"))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\), got \(7,\)"):
        rms_norm(randn(3, 8), torch.ones(7, device="meta"))
    with pytest.raises(ValueError, match="x must be a CUDA tensor .* got a tensor on meta"):
        rms_norm(torch.ones(3, 8, device="meta"))
    with pytest.raises(ValueError, match="weight must be a CUDA tensor .* got a tensor on meta"):
        rms_norm(randn(3, 8), torch.ones(8, device="meta"))


def test_four_dim_input_and_unviewable_output():
    g = torch.Generator().manual_seed(12)
    x = randn(2, 3, 4, 10, generator=g).transpose(1, 2)  # 4-D, not viewable as [rows, H]: copied
    w = randn(10, generator=g)
    assert_close(rms_norm(x, w), rms_norm_reference(x, w), torch.float32)
    with pytest.raises(ValueError, match=r"out of shape \(2, 4, 3, 10\) .* cannot be viewed"):
        rms_norm_fwd(x, w, out=poison((2, 3, 4, 10), torch.float32).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("H,limit,chunk", [(65536, 8192, 4096), (300, 64, 32)])
def test_wide_rows_take_the_looped_kernels(monkeypatch, H, limit, chunk, dtype, with_residual):
    """Rows wider than ROW_BLOCK_LIMIT are streamed in chunks (two passes) instead of held in
    registers: forward and gradients vs fp64 at hidden 65536 and at a small limit with a ragged
    last chunk and several rows per backward program."""
    from fusedpar.kernels import rmsnorm

    monkeypatch.setattr(rmsnorm, "ROW_BLOCK_LIMIT", limit)
    monkeypatch.setattr(rmsnorm, "LOOP_CHUNK", chunk)
    g = torch.Generator().manual_seed(H + with_residual)
    shape = (3, H) if H > 1000 else (2, 5, H)
    x = randn(*shape, dtype=dtype, generator=g, scale=2.0).requires_grad_()
    w = (1 + 0.5 * randn(H, dtype=torch.float32, generator=g)).to(dtype).requires_grad_()
    r = randn(*shape, dtype=dtype, generator=g).requires_grad_() if with_residual else None
    dy = randn(*shape, dtype=dtype, generator=g)
    dh = randn(*shape, dtype=dtype, generator=g) if with_residual else None
    out = rms_norm(x, w, 1e-5, residual=r)
    ref, gx, gw, gr = _ref_grads(x, w, r, dy, dh, 1e-5)
    if with_residual:
        assert_close(out[1], ref[1], dtype, msg="new residual")
        assert_close(out[0], ref[0], dtype, msg="y")
        torch.autograd.backward(list(out), [dy, dh])
    else:
        assert_close(out, ref, dtype, msg="y")
        out.backward(dy)
    _check_grads(x, w, r, dy, (gx, gw, gr), dtype, with_residual)


# --------------------------------------------------------------------------------------------
# the fp8 output: rms_norm's y quantised by the same kernel (rms_norm_fp8)
# --------------------------------------------------------------------------------------------
needs_fp8 = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                               reason="fp8 needs compute capability >= 8.9")


def _fp8_rows(dtype, shape, g):
    """Rows with the quantiser's hard cases: an all-zero row, one huge outlier, a row whose
    normalised small values are subnormal in bf16 / fp32 (a 1e19 element beside 1e-21 ones; its
    squares still fit fp32), and a weight with a large entry."""
    H = shape[-1]
    x = torch.randn(*shape, generator=g) * 2
    r = torch.randn(*shape, generator=g)
    rows, rrows = x.view(-1, H), r.view(-1, H)
    rows[1] = 0.0
    rrows[1] = 0.0
    rows[2, 5] = 1e4
    if dtype != torch.float16:
        rows[3, 0], rows[3, 1:20], rrows[3] = 1e19, 1e-21 * torch.randn(19, generator=g), 0.0
    w = 1 + 0.5 * torch.randn(H, generator=g)
    w[H // 2] = 300.0
    return x.to(DEVICE, dtype), r.to(DEVICE, dtype), w.to(DEVICE, dtype)


def _check_fp8_output(y, q, s, recipe, H):
    """(q, s) equal quantize_e4m3 of y and torch's cast of the same scaled values, bit for bit."""
    gran = {"rowwise": "row", "blockwise": "tile"}[recipe]
    y2 = y.reshape(-1, H)
    q_k, s_k = quantize_e4m3(y2, gran)
    q_t, s_t = quantize_e4m3_reference(y2.cpu(), gran)
    assert q.dtype == torch.float8_e4m3fn and q.shape == y.shape and q.is_contiguous()
    assert s.shape == y.shape[:-1] + ((-(-H // 128),) if gran == "tile" else ())
    assert torch.equal(s.reshape(s_k.shape), s_k) and torch.equal(s.reshape(s_k.shape).cpu(), s_t), "scales differ"
    assert torch.equal(q.reshape(-1, H).view(torch.uint8), q_k.view(torch.uint8)), "q differs from quantize_e4m3(y)"
    assert torch.equal(q.reshape(-1, H).view(torch.uint8).cpu(), q_t.view(torch.uint8)), "q differs from torch's cast"


@needs_fp8
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_output_equals_quantize_of_the_output(recipe, dtype):
    """rms_norm_fp8_fwd = rms_norm_fwd (y, h, rstd bit for bit) plus quantize_e4m3(y) bit for bit
    (the stored y, rounded to its dtype, is what is quantised), at ragged hidden sizes (ragged last
    1x128 tile, a single partial tile), with and without a residual, into NaN-poisoned outputs; the
    zero row gets the floor scale and zeros, the outlier alone maps to 448."""
    g = torch.Generator().manual_seed(21)
    for H, residual in ((200, True), (130, False), (96, True)):
        x, r, w = _fp8_rows(dtype, (2, 5, H), g)
        r = r if residual else None
        y0, h0, rstd0 = rms_norm_fwd(x, w, 1e-5, residual=r)
        y_out, q_out = poison(x.shape, dtype), poison(x.shape, torch.float32).to(torch.float8_e4m3fn)
        s_out = poison((2, 5) + ((-(-H // 128),) if recipe == "blockwise" else ()), torch.float32)
        y, h, rstd, q, s = rms_norm_fp8_fwd(x, w, 1e-5, recipe=recipe, residual=r, out=y_out,
                                            fp8_out=(q_out, s_out))
        assert y is y_out and q is q_out and s is s_out
        assert torch.equal(y, y0) and torch.equal(rstd, rstd0) and torch.equal(h, h0), "y / rstd / h differ"
        _check_fp8_output(y, q, s, recipe, H)
        qf, sf = q.reshape(-1, H).float().cpu(), s.reshape(10, -1).cpu()
        assert (sf[1] == SCALE_FLOOR).all() and (qf[1] == 0).all(), "the zero row"
        assert torch.isfinite(sf).all() and (sf > 0).all() and torch.isfinite(qf).all()
        assert (qf[torch.arange(10) != 1].abs() == E4M3_MAX).any(1).all()  # each other row's amax maps to 448


@needs_fp8
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_output_of_the_looped_kernel(monkeypatch, recipe):
    """Rows streamed in chunks (a small ROW_BLOCK_LIMIT / LOOP_CHUNK, ragged last chunk): tiles
    quantised as pass 2 goes (chunks narrower than a tile widened to 128 there), per-row scales
    from a pass 3; bit for bit as above."""
    from fusedpar.kernels import rmsnorm

    monkeypatch.setattr(rmsnorm, "ROW_BLOCK_LIMIT", 64)
    monkeypatch.setattr(rmsnorm, "LOOP_CHUNK", 32)
    x, r, w = _fp8_rows(torch.bfloat16, (2, 5, 300), torch.Generator().manual_seed(22))
    y0, h0, rstd0 = rms_norm_fwd(x, w, 1e-5, residual=r)
    y, h, rstd, q, s = rms_norm_fp8_fwd(x, w, 1e-5, recipe=recipe, residual=r)
    assert torch.equal(y, y0) and torch.equal(rstd, rstd0) and torch.equal(h, h0)
    _check_fp8_output(y, q, s, recipe, 300)


@needs_fp8
def test_fp8_gradients_and_module_equal_the_plain_norm():
    """rms_norm_fp8's gradients (x, residual, weight) equal rms_norm's bit for bit (the same
    backward: it needs h and rstd, not the output); q and scale are not differentiable; the
    module's fp8= path; the custom op's schema, fakes and autograd registration."""
    g = torch.Generator().manual_seed(23)
    x, r, w = _fp8_rows(torch.bfloat16, (2, 3, 200), g)
    dy, dh = randn(2, 3, 200, dtype=torch.bfloat16, generator=g), randn(2, 3, 200, dtype=torch.bfloat16, generator=g)
    grads = []
    for fp8 in (False, True):
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        out = rms_norm_fp8(xs, ws, 1e-5, residual=rs, recipe="blockwise") if fp8 else rms_norm(xs, ws, 1e-5, residual=rs)
        if fp8:
            assert not out[2].requires_grad and not out[3].requires_grad
        torch.autograd.backward(list(out[:2]), [dy, dh])
        grads.append((out[0], out[1], xs.grad, rs.grad, ws.grad))
    for a, b, what in zip(*grads, ("y", "h", "dx", "dresidual", "dweight")):
        assert torch.equal(a, b), what
    norm = RMSNorm(200, eps=1e-5, device=DEVICE, dtype=torch.bfloat16)
    y, q, s = norm(x, fp8="rowwise")
    assert torch.equal(y, norm(x)) and s.shape == (2, 3)
    _check_fp8_output(y, q, s, "rowwise", 200)


FP8_BAD_INPUTS = [
    ("unknown-recipe", lambda x: rms_norm_fp8(x, recipe="tile"), ValueError,
     r"recipe must be one of \('rowwise', 'blockwise'\), got 'tile'"),
    ("recipe-none", lambda x: rms_norm_fp8_fwd(x, None, recipe=None), ValueError, "recipe must be one of"),
    ("int-dtype", lambda x: rms_norm_fp8(x.to(torch.int32)), TypeError, "x must have one of the dtypes .* got torch.int32"),
    ("fp8-input", lambda x: rms_norm_fp8(x.to(torch.float8_e4m3fn)), TypeError,
     "x must have one of the dtypes .* got torch.float8_e4m3fn"),
    ("q-dtype", lambda x: rms_norm_fp8_fwd(x, None, fp8_out=(torch.empty_like(x), torch.empty(3))), TypeError,
     r"fp8_out\[0\] \(q\) must have dtype torch.float8_e4m3fn, got torch.float32"),
    ("scale-shape", lambda x: rms_norm_fp8_fwd(x, None, recipe="blockwise", fp8_out=(
        torch.empty(3, 8, dtype=torch.float8_e4m3fn), torch.empty(3))), ValueError,
     r"fp8_out\[1\] \(scale\) must have shape \(3, 1\), got \(3,\)"),
    ("q-strided", lambda x: rms_norm_fp8_fwd(x, None, fp8_out=(
        torch.empty(8, 3, dtype=torch.float8_e4m3fn).t(), torch.empty(3))), ValueError, r"fp8_out\[0\] \(q\) must be contiguous"),
    ("sharded-module", lambda x: _two_part_norm()(x[:, :4], fp8="rowwise"), ValueError, "has no fp8 output, got fp8='rowwise'"),
]


def _two_part_norm():
    norm = RMSNorm(8)
    norm.parts, norm.local_size = 2, 4  # a feature_group of two ranks, as far as forward's checks go
    return norm


@pytest.mark.parametrize("call,exc,match", [pytest.param(*c[1:], id=c[0]) for c in FP8_BAD_INPUTS])
def test_fp8_bad_input_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call(randn(3, 8))
