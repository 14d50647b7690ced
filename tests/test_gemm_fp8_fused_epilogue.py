"""fp8_matmul's fused epilogue: activation (gated ones too), pre-activation store, residual and the
e4m3 output per 1x128 tile (kernels/fp8_gemm.py, the epilogue of kernels/gemm.py's matmul).

* The pre-activation equals the plain ``fp8_matmul`` output of the same operands and bias in the
  same dtype, bit for bit (the same main loop, K steps, scales and bias add; bf16 rounded to nearest
  even by both): the fused launch adds nothing before the activation.
* The output against the float64 activation of the float64 product of the dequantised operands
  (``fp8_matmul_reference(..., activation=...)``): the pre-activation's error (fp32 accumulation,
  :data:`~test_fp8.ACC_RTOL` of its scale, plus on a GPU the fp8 tensor cores' share,
  :func:`~test_fp8.mma_error_bound`) carried through the activation, whose slope is at most
  :data:`ACT_SLOPE`, plus the fp32 activation (:data:`ACC_RTOL` of the output's scale) and one
  rounding to the output dtype (bf16: 2^-8 relative).
* ``fp8_out`` equals ``quantize_e4m3(out, "tile")`` bit for bit (the stored values quantised).
"""
from __future__ import annotations

import pytest
import torch

from _utils import DEVICE, INTERPRETED, assert_tile_quantised, poison
from fusedpar.kernels import dequantize_e4m3, fp8_matmul, quantize_e4m3
from fusedpar.kernels.fp8_gemm import (FP8_INTERPRETER_CONFIG_FP8_OUT, fp8_gpu_configs, fp8_matmul_reference,
                                       fp8_smem_estimate, fp8_tile_rule)
from fusedpar.kernels.gemm_fp8_epilogue import fp8_output_configs, fp8_output_empty
from fusedpar.kernels.runtime import (ACTIVATIONS, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, activation_reference,
                                     prune_tile_configs)
from test_fp8 import ACC_RTOL, assert_within, mma_error_bound

pytestmark = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                                reason="fp8 needs compute capability >= 8.9")

#: the largest slope of the activations' gate function: gelu (tanh) 1.129, silu 1.100, swiglu_oai's
#: clamped gate 1.100 (relu 1); the up factor (itself, or swiglu_oai's clamp + 1) has slope <= 1
ACT_SLOPE = 1.2
M, K = 37, 160  # a ragged row block, a ragged last 128-wide K block


def _operands(scaling, gb, n_w, seed):
    """e4m3 ``x [M, K]`` and weight ``[n_w, K]`` with their scales (the weight per row, per 128x128
    block or per 1x128 tile), a bf16 bias, and the per-element scales of both (for the bounds)."""
    g = torch.Generator().manual_seed(seed)
    ga = "row" if scaling == "rowwise" else "tile"
    xq, xs = quantize_e4m3(torch.randn(M, K, generator=g).to(DEVICE), ga)
    wq, ws = quantize_e4m3((torch.randn(n_w, K, generator=g) * 0.2).to(DEVICE), gb)
    bias = torch.randn(n_w, generator=g).to(DEVICE, torch.bfloat16)
    ex = dequantize_e4m3(torch.ones_like(xq.cpu()), xs.cpu(), ga)
    ew = dequantize_e4m3(torch.ones_like(wq.cpu()), ws.cpu(), gb)
    return (xq, xs, wq, ws, bias), (ex, ew)


def _pre_error(ops, elem_scales, pre_ref):
    """Per element, the bound of the pre-activation's error (module docstring)."""
    xq, _, wq, _, _ = ops
    mma = mma_error_bound(xq.cpu().double(), elem_scales[0], wq.cpu().double(), elem_scales[1])
    return ACC_RTOL * pre_ref.pow(2).mean().sqrt() + mma


def _out_tolerance(pre_ref, pre_err, activation, out_ref, out_dtype):
    """Per element, the output's tolerance: the pre-activation's error ``e`` through the activation
    (``slope e``; gated ``A(gate) * B(up)``: ``slope |B| e_gate + |A| e_up``), doubled for the
    second-order terms, plus the fp32 activation and the output rounding (module docstring)."""
    if ACTIVATIONS[activation][1]:
        gate, up = pre_ref.chunk(2, dim=-1)
        e_gate, e_up = pre_err.chunk(2, dim=-1)
        if activation == "swiglu_oai":
            gate, up = gate.clamp(max=SWIGLU_OAI_LIMIT), up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1
            a = gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate)
        else:
            a = activation_reference(gate, {"swiglu": "silu", "geglu": "gelu"}[activation])
        carried = 2 * (ACT_SLOPE * up.abs() * e_gate + a.abs() * e_up)
    else:
        carried = 2 * ACT_SLOPE * pre_err
    rnd = 2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0
    return carried + ACC_RTOL * out_ref.pow(2).mean().sqrt() + rnd * out_ref.abs()


def _poisoned_fp8(out_shape):
    q = poison(out_shape, torch.float32).to(torch.float8_e4m3fn)
    return q, poison(tuple(out_shape[:-1]) + (-(-out_shape[-1] // 128),), torch.float32)


# rowwise; blockwise with 128x128 weight blocks (F = 72: block 0 holds the gate rows and the first 56
# up rows; F = 136: the up rows start inside block 1 and end in block 2) and with 1x128-tiled
# weight rows (B_SCALE_ROWS 1); the output 72 (one ragged 1x128 tile) or 136 (two) features
CASES = [("rowwise", "row", "swiglu", 72), ("rowwise", "row", "gelu", 136), ("blockwise", "block", "swiglu", 72),
         ("blockwise", "block", "swiglu_oai", 136), ("blockwise", "block", "gelu", 72),
         ("blockwise", "tile", "swiglu", 136)]


@pytest.mark.parametrize("scaling,gb,activation,F", CASES)
def test_fused_epilogue(scaling, gb, activation, F):
    """bf16 and fp32 outputs, each with a pre-activation of its dtype and the e4m3 output, into
    NaN-poisoned buffers: the pre-activation is the plain fp8_matmul's, the output the activation
    of the float64 reference, the e4m3 pair the quantisation of the stored output."""
    glu = ACTIVATIONS[activation][1]
    n_w = 2 * F if glu else F
    ops, elem_scales = _operands(scaling, gb, n_w, seed=F + len(activation))
    xq, xs, wq, ws, bias = ops
    pre_ref = fp8_matmul_reference(*(t.cpu() for t in ops[:4]), bias.cpu(), scaling=scaling)
    out_ref = fp8_matmul_reference(*(t.cpu() for t in ops[:4]), bias.cpu(), scaling=scaling, activation=activation)
    pre_err = _pre_error(ops, elem_scales, pre_ref)
    for dtype in (torch.bfloat16, torch.float32):
        out, pre, (q, s) = poison((M, F), dtype), poison((M, n_w), dtype), _poisoned_fp8((M, F))
        y = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, activation=activation, out=out, preact_out=pre,
                       fp8_out=(q, s))
        assert y is out
        plain = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=dtype)
        assert torch.equal(pre, plain), f"{dtype}: the pre-activation differs from fp8_matmul's output"
        assert_within(out, out_ref, _out_tolerance(pre_ref, pre_err, activation, out_ref, dtype), f"{dtype} output")
        assert_tile_quantised(out, q, s)


# without the e4m3 output every epilogue, gated ones too, loads by TMA on "auto" (e4m3 rows of 160
# bytes; persistent, the epilogue in column halves): only a gated epilogue WITH the e4m3 output keeps
# pointer loads (kernels/fp8_gemm.py ``_loads_by_tma``). Both gated activations, rowwise and
# blockwise scaling with 128x128 weight blocks and 1x128 weight tiles, and one ungated activation;
# bf16 and fp32 outputs, one per case
TMA_CASES = [("rowwise", "row", "swiglu_oai", 72, torch.float32), ("blockwise", "block", "swiglu", 72, torch.bfloat16),
             ("blockwise", "block", "swiglu_oai", 136, torch.float32),
             ("blockwise", "tile", "swiglu", 136, torch.bfloat16), ("blockwise", "block", "gelu", 72, torch.bfloat16)]


@pytest.mark.parametrize("scaling,gb,activation,F,dtype", TMA_CASES)
def test_epilogue_without_fp8_out_on_both_load_paths(scaling, gb, activation, F, dtype):
    """The output with a residual (of its dtype) and the pre-activation, into NaN-poisoned buffers,
    on "auto" (TMA, the launch record says) and on pointer loads: interpreted, the same bits on
    both (the same main loop, K steps and epilogue: test_fp8's load-path agreement); the
    pre-activation is the plain fp8_matmul's, the output the activation of the float64 reference
    plus the residual."""
    from fusedpar.kernels import gemm_loads
    glu = ACTIVATIONS[activation][1]
    n_w = 2 * F if glu else F
    ops, elem_scales = _operands(scaling, gb, n_w, seed=3 * F + len(activation))
    xq, xs, wq, ws, bias = ops
    pre_ref = fp8_matmul_reference(*(t.cpu() for t in ops[:4]), bias.cpu(), scaling=scaling)
    out_ref = fp8_matmul_reference(*(t.cpu() for t in ops[:4]), bias.cpu(), scaling=scaling, activation=activation)
    pre_err = _pre_error(ops, elem_scales, pre_ref)
    res = torch.randn(M, F, generator=torch.Generator().manual_seed(F)).to(DEVICE, dtype)
    want = out_ref + res.cpu().double()
    runs = {}
    for path in ("auto", "pointer"):
        out, pre = poison((M, F), dtype), poison((M, n_w), dtype)
        with gemm_loads.load_path_set(path):
            y = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, activation=activation, residual=res, out=out,
                           preact_out=pre)
            loads, tma = gemm_loads.last_launch("fp8_matmul")["loads"], gemm_loads.tma_capable(xq.device, 1)
            plain = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=dtype)
        assert y is out and loads == ("tma" if tma else "pointer"), (path, loads)
        assert torch.equal(pre, plain), f"{path}: the pre-activation differs from fp8_matmul's output"
        assert_within(out, want, _out_tolerance(pre_ref, pre_err, activation, want, dtype), f"{path} output")
        runs[path] = out
    if INTERPRETED:
        assert torch.equal(runs["auto"], runs["pointer"]), "the load paths' outputs differ"


def test_sequence_chunk_views_residual_after_the_activation():
    """A 3-D sequence-chunk view of a (its scales too), of out, residual, q and scale (two-level
    rows, read and written in place and nowhere else); the residual is added after the activation
    and is in what is quantised; no bias; the residual accumulates into out (``residual=out``)."""
    B, S, lo, hi, F = 2, 11, 3, 9, 136
    g = torch.Generator().manual_seed(5)
    xq, xs = quantize_e4m3(torch.randn(B * S, K, generator=g).to(DEVICE), "tile")
    wq, ws = quantize_e4m3((torch.randn(2 * F, K, generator=g) * 0.2).to(DEVICE), "block")
    xq, xs = xq.view(B, S, K), xs.view(B, S, -1)
    res = torch.randn(B, S, F, generator=g).to(DEVICE, torch.bfloat16)
    out = poison((B, S, F), torch.bfloat16)
    q, s = _poisoned_fp8((B, S, F))
    view = (slice(None), slice(lo, hi))
    pre = poison((B * (hi - lo), 2 * F), torch.float32)
    out[view] = res[view]
    fp8_matmul(xq[view], xs[view], wq, ws, scaling="blockwise", activation="swiglu", residual=out[view],
               out=out[view], preact_out=pre, fp8_out=(q[view], s[view]))
    rows = xq[view].reshape(-1, K)
    assert torch.equal(pre, fp8_matmul(rows, xs[view].reshape(rows.shape[0], -1), wq, ws, scaling="blockwise",
                                       out_dtype=torch.float32))
    gate, up = pre.double().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).view(B, hi - lo, F) + res[view].double()
    assert_within(out[view], expected.cpu(), 2.0 ** -8 * expected.abs().cpu() + 1e-5, "swiglu + residual")
    assert_tile_quantised(out[view].contiguous(), q[view].contiguous(), s[view].contiguous())
    outside = [t[:, :lo] for t in (out, q, s)] + [t[:, hi:] for t in (out, q, s)]
    assert all(torch.isnan(t.float()).all() for t in outside), "written outside the views"


def test_gated_epilogue_where_it_does_not_fit(monkeypatch):
    """Compiled launches whose loads do not vectorise run a gated epilogue around a plain fp8 GEMM
    (``epilogue_fits``: K or a row stride not a multiple of 16 bytes; at K = 200 every tile
    spilled): forced here under the interpreter, the pre-activation, output (residual included)
    and e4m3 tiles are those of the fused epilogue (the same fp32 pre-activation; the activation in
    torch instead of the kernel: fp32 rounding apart)."""
    from fusedpar.kernels import fp8_gemm

    assert fp8_gemm.epilogue_fits(200, 0, 200, 200) == INTERPRETED
    assert fp8_gemm.epilogue_fits(208, 0, 208, 208)
    ops, _ = _operands("blockwise", "block", 2 * 72, seed=9)
    xq, xs, wq, ws, bias = ops
    res = torch.randn(M, 72, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    runs = []
    for fits in (True, False):
        monkeypatch.setattr(fp8_gemm, "epilogue_fits", lambda *a, fits=fits: fits)
        out, pre, (q, s) = poison((M, 72), torch.float32), poison((M, 144), torch.float32), _poisoned_fp8((M, 72))
        fp8_matmul(xq, xs, wq, ws, bias, scaling="blockwise", activation="swiglu", out=out, preact_out=pre,
                   residual=res, fp8_out=(q, s))
        assert_tile_quantised(out, q, s)
        runs.append((out, pre))
    assert torch.equal(runs[1][1], runs[0][1]), "the pre-activation differs"
    assert_within(runs[1][0], runs[0][0].double().cpu(), 1e-6 * runs[0][0].abs().cpu() + 1e-6, "fallback output")


def test_empty_contraction_runs_the_epilogue():
    """K = 0: the pre-activation is the bias, the output its activation plus the residual, and the
    e4m3 pair its quantisation (all on the host)."""
    F = 130
    a = quantize_e4m3(torch.randn(3, 0, device=DEVICE))
    b = quantize_e4m3(torch.randn(2 * F, 0, device=DEVICE))
    bias, res = torch.randn(2 * F, device=DEVICE), torch.randn(3, F, device=DEVICE)
    out, pre, (q, s) = poison((3, F), torch.float32), poison((3, 2 * F), torch.float32), _poisoned_fp8((3, F))
    fp8_matmul(*a, *b, bias, activation="swiglu", residual=res, out=out, preact_out=pre, fp8_out=(q, s))
    assert torch.equal(pre, bias.expand(3, 2 * F))
    gate, up = bias.double().chunk(2)
    expected = (torch.nn.functional.silu(gate) * up).float() + res
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert_tile_quantised(out, q, s)


def test_tile_rule_of_fused_launches(monkeypatch):
    """On sm_90: the fp8 output keeps only tiles whose BLOCK_N is a multiple of 128; a gated launch
    counts four accumulator tiles (gate and up, each the running sum and the step's dot) and two B
    tiles, so its largest tile is 64 x 128 over 8 warps; the interpreter's fp8-output tile is 128 wide."""
    monkeypatch.setattr("fusedpar.kernels.fp8_gemm_configs.device_capability", lambda index: (9, 0))
    meta = torch.empty(1, dtype=torch.float8_e4m3fn, device="meta")
    args = dict(a_ptr=meta, M=8192, N=14336, K=4096, s_am=4096, a_so=0, s_bn=4096)
    for glu, fp8_out in ((True, True), (True, False), (False, True)):
        rule = fp8_tile_rule(args, GLU=glu, FP8_OUT=fp8_out, BLOCKWISE=True, B_SCALE_ROWS=128)
        assert (rule["acc_tiles"], rule["b_tiles"]) == ((4, 2) if glu else (2, 1))
        kept = prune_tile_configs(fp8_output_configs(fp8_gpu_configs(), fp8_out), smem_limit=232448,
                                  dims={"BLOCK_M": 8192, "BLOCK_N": 14336}, **rule)
        tiles = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept}
        assert tiles and (not fp8_out or all(n % 128 == 0 for _, n, _ in tiles)), tiles
        # accumulator elements per thread, all tiles: within the budget (gated: 64 x 128 over 8 warps at most)
        assert max(rule["acc_tiles"] * m * n // (32 * w) for m, n, w in tiles) == 128, tiles
    cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128)
    assert fp8_smem_estimate(dict(cfg, num_stages=4), args, GLU=True) == (64 * 128 + 2 * 128 * 128) * 4
    assert FP8_INTERPRETER_CONFIG_FP8_OUT["BLOCK_N"] == 128


def test_bad_epilogue_arguments():
    """Each bad argument raises an error naming it, with the expected and actual values."""
    x = quantize_e4m3(torch.randn(8, 128, device=DEVICE))
    w = quantize_e4m3(torch.randn(20, 128, device=DEVICE))
    odd = quantize_e4m3(torch.randn(7, 128, device=DEVICE))
    out = torch.empty(8, 10, device=DEVICE)
    q, s = fp8_output_empty(out)
    calls = [
        (ValueError, r"activation must be one of", dict(activation="tanh")),
        (ValueError, r"activation 'swiglu' needs an even number of rows of b .* got b of shape \(7, 128\)",
         dict(activation="swiglu", b=odd)),
        (ValueError, r"preact_out must have shape \(8, 20\), got \(8, 10\)",
         dict(activation="swiglu", out=out, preact_out=torch.empty(8, 10, device=DEVICE))),
        (ValueError, r"bias must have shape \(20,\), got \(10,\)",
         dict(activation="swiglu", bias=torch.zeros(10, device=DEVICE))),
        (TypeError, r"fp8_out must be a \(q, scale\) pair", dict(activation="swiglu", out=out, fp8_out=q)),
        (ValueError, r"fp8_out\[0\] \(q\) must have shape \(8, 10\), got \(8, 20\)",
         dict(activation="swiglu", out=out, fp8_out=(fp8_output_empty(torch.empty(8, 20, device=DEVICE))[0], s))),
        (ValueError, r"fp8_out\[1\] \(scale\) must have shape \(8, 1\), got \(8, 2\)",
         dict(activation="swiglu", out=out, fp8_out=(q, torch.empty(8, 2, device=DEVICE)))),
    ]
    for exc, pattern, kw in calls:
        b = kw.pop("b", w)
        with pytest.raises(exc, match=pattern):
            fp8_matmul(*x, *b, **kw)
