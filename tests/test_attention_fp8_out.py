"""flash_attention_forward(..., fp8_out=(q8, scale)) and flash_attention_varlen's: the attention
epilogue's e4m3 output (blockwise 1x128 tiles of the ``[b, sq, hq * d_v]`` features o_proj reads),
bit for bit against quantize_e4m3 of the stored ``out`` and torch's cast; ``out`` bit for bit the
same as without fp8_out; the d_v rule and bad input."""
import pytest
import torch

from _utils import DEVICE, INTERPRETED, assert_close, assert_tile_quantised, poison, randn
from fusedpar.kernels import attention_reference, flash_attention_forward, quantize_e4m3, varlen_attention_reference
from fusedpar.kernels import flash_attention_varlen, flash_tiles
from fusedpar.kernels.fp8 import E4M3_MAX, SCALE_FLOOR
from fusedpar.kernels.runtime import clear_tuning_caches


@pytest.fixture(autouse=True)
def _one_tile(monkeypatch):
    """One tile for every launch, so that ``out`` with and without fp8_out (tuned under keys of
    their own: q8's dtype differs) sums in the same order. Interpreted, 32 x 32 (one of the GPU
    configs; the last query and key blocks of these shapes stay ragged): the interpreter's cost is
    per program, and 16 x 16 took 2.5 times as long. Compiled: the first kept config."""
    if INTERPRETED:
        monkeypatch.setattr(flash_tiles, "INTERPRETER_CONFIG", dict(BLOCK_M=32, BLOCK_N=32))
        yield
        return
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "#0")
    clear_tuning_caches()
    yield
    clear_tuning_caches()  # no later test may inherit the '#0' choice


needs_fp8 = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                               reason="fp8 needs compute capability >= 8.9")

# out against the fp64 reference, as test_attention_flash.py's OUT_TOL: fp32 ~1e-6 rounding of the
# probabilities times the sequence length; fp16 / bf16 probabilities rounded before P @ V (11 / 8 bits)
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _poisoned_fp8(out_shape):
    """NaN-filled contiguous ``(q8, scale)`` for an output ``[..., hq, d_v]``: e4m3 NaN, fp32 NaN."""
    *lead, hq, d_v = out_shape
    return (poison(out_shape, torch.float32).to(torch.float8_e4m3fn),
            poison((*lead, hq * d_v // 128), torch.float32))


def _check_tiles(out, q8, scale):
    """(q8, scale) equal quantize_e4m3 of out's flattened features and torch's cast, bit for bit;
    every tile's amax maps to 448 (no all-zero tile in these cases)."""
    n = out.shape[-2] * out.shape[-1]
    assert_tile_quantised(out, q8, scale, n)
    tiles = q8.reshape(-1, n).float().cpu().abs().view(-1, n // 128, 128).amax(2)
    assert (tiles == E4M3_MAX).all() and (scale > SCALE_FLOOR).all(), "each tile's amax maps to 448"


# (id, dtype, head dim, v head dim, options): hq 3 / hk 1 (GQA), 70 query rows, 67 keys (ragged)
CASES = [
    ("bf16-d128-causal-window", torch.bfloat16, 128, 128, dict(causal=True, window=(20, 0))),
    ("fp32-mla192/128-sinks-softcap", torch.float32, 192, 128, dict(softcap=5.0, sinks=True)),
    ("bf16-d128/256-strided", torch.bfloat16, 128, 256, dict(causal=True, sinks=True)),
]


@needs_fp8
@pytest.mark.parametrize("dtype,d,dv,options", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fp8_out_equals_quantize_of_out(dtype, d, dv, options):
    """NaN-poisoned out / q8 / scale; the strided case (batch 2) writes a head slice of a wider
    out (out's head stride is not d_v) and slices of wider q8 / scale buffers. ``out`` equals the
    launch without fp8_out and the fp64 reference within the dtype's tolerance."""
    g, options = torch.Generator().manual_seed(d + dv), dict(options)
    b, sq, sk, hq, hk = 1 + (dv == 256), 70, 73, 3, 1  # sk > sq: every row sees a key (bottom-right causal)
    q, k = randn(b, sq, hq, d, dtype=dtype, generator=g), randn(b, sk, hk, d, dtype=dtype, generator=g)
    v = randn(b, sk, hk, dv, dtype=dtype, generator=g)
    if options.pop("sinks", False):
        options["sinks"] = randn(hq, generator=g)
    if dv == 256:  # strided: out a head slice, q8 / scale slices of wider buffers
        out = poison((b, sq, hq + 1, dv), dtype)[:, :, 1:]
        q8 = poison((b, sq, hq + 2, dv), torch.float32).to(torch.float8_e4m3fn)[:, :, :hq]
        scale = poison((b, sq, hq * dv // 128 + 3), torch.float32)[:, :, 3:]
    else:
        out = poison((b, sq, hq, dv), dtype)
        q8, scale = _poisoned_fp8(out.shape)
    got, lse = flash_attention_forward(q, k, v, out=out, fp8_out=(q8, scale), **options)
    assert got is out
    plain, plain_lse = flash_attention_forward(q, k, v, **options)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse), "out / lse differ from the launch without fp8_out"
    _check_tiles(out, q8, scale)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), **options)
    tol = OUT_TOL[dtype]
    assert_close(out, ref, dtype, rtol=tol, atol=tol * ref.pow(2).mean().sqrt().item(), msg="out")
    if dtype == torch.bfloat16 and dv == 128:  # the bf16 store rounds to nearest even (interpreted too)
        wide, _ = flash_attention_forward(q, k, v, out=poison(out.shape, torch.float32), **options)
        assert torch.equal(out, wide.to(dtype)), "bf16 out is not fp32 out rounded to nearest even"


@needs_fp8
def test_fp8_out_of_varlen_documents():
    """Packed documents (ragged, one of length 1, causal bottom-right, GQA) in fp16 into
    NaN-poisoned buffers: out equals the launch without fp8_out and the per-document fp64 reference."""
    g = torch.Generator().manual_seed(7)
    lens, hq, hk, d = [30, 1, 41], 3, 1, 128
    cu = torch.tensor([0, 30, 31, 72], dtype=torch.int32, device=DEVICE)
    q = randn(sum(lens), hq, d, dtype=torch.float16, generator=g)
    k, v = (randn(sum(lens), hk, d, dtype=torch.float16, generator=g) for _ in range(2))
    q8, scale = _poisoned_fp8((sum(lens), hq, d))
    out, lse = flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, fp8_out=(q8, scale))
    plain, plain_lse = flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    _check_tiles(out, q8, scale)
    ref, _ = varlen_attention_reference(q.double(), k.double(), v.double(), cu.cpu(), cu.cpu(), causal=True)
    tol = OUT_TOL[torch.float16]
    assert_close(out, ref, torch.float16, rtol=tol, atol=tol * ref.pow(2).mean().sqrt().item(), msg="varlen out")


@needs_fp8
def test_fp8_out_without_keys():
    """No key (sk = 0): out = 0, so q8 = 0 and every scale the floor, as quantize_e4m3 gives."""
    q, v = torch.ones(1, 3, 2, 128, device=DEVICE), torch.ones(1, 0, 1, 128, device=DEVICE)
    q8, scale = _poisoned_fp8((1, 3, 2, 128))
    out, _ = flash_attention_forward(q, v, v, fp8_out=(q8, scale))
    assert (out == 0).all() and (q8.float() == 0).all() and (scale == SCALE_FLOOR).all()
    q_k, s_k = quantize_e4m3(out.reshape(3, 256), "tile")
    assert torch.equal(scale.reshape(3, 2), s_k) and torch.equal(q8.reshape(3, 256).view(torch.uint8),
                                                                 q_k.view(torch.uint8))


def test_fp8_out_bad_input():
    """The d_v rule (a multiple of 128: whole tiles per head), accumulate, and the buffers'
    type, dtype, shape, device and row layout; varlen names its own shapes."""
    f8 = torch.float8_e4m3fn
    q = torch.zeros(1, 4, 2, 64, device=DEVICE)
    k, v = torch.zeros(1, 4, 1, 64, device=DEVICE), torch.zeros(1, 4, 1, 128, device=DEVICE)
    with pytest.raises(ValueError, match=r"fp8_out needs .*d_v.* multiple of 128.*d_v=64.*quantize_e4m3"):
        flash_attention_forward(q, k, k, fp8_out=_poisoned_fp8((1, 4, 2, 128)))
    good = (torch.zeros(1, 4, 2, 128, dtype=f8, device=DEVICE), torch.zeros(1, 4, 2, device=DEVICE))
    out, lse = torch.zeros(1, 4, 2, 128, device=DEVICE), torch.zeros(1, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="fp8_out is not supported with accumulate=True"):
        flash_attention_forward(q, k, v, out=out, lse=lse, accumulate=True, fp8_out=good)
    bad = [
        (good[0], TypeError, r"fp8_out must be a \(q8, scale\) pair"),
        ((good[0].float(), good[1]), TypeError, r"fp8_out\[0\] \(q8\) must have dtype torch.float8_e4m3fn"),
        ((good[0], good[1].to(torch.bfloat16)), TypeError, r"fp8_out\[1\] \(scale\) must have dtype torch.float32"),
        ((good[0][:, :3], good[1]), ValueError, r"fp8_out\[0\] \(q8\) must have shape \(1, 4, 2, 128\)"),
        ((good[0], torch.zeros(1, 4, 1, device=DEVICE)), ValueError, r"fp8_out\[1\] \(scale\) must have shape \(1, 4, 2\)"),
        ((good[0], torch.zeros(1, 2, 4, device=DEVICE).transpose(1, 2)), ValueError, "contiguous rows"),
        ((good[0], good[1].to("meta")), ValueError, "must be on out's device"),
    ]
    for fp8_out, err, match in bad:
        with pytest.raises(err, match=match):
            flash_attention_forward(q, k, v, fp8_out=fp8_out)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"fp8_out\[1\] \(scale\) must have shape \(4, 2\)"):
        flash_attention_varlen(q[0], k[0], v[0], cu, cu, 4, 4, fp8_out=(good[0][0], good[1]))
