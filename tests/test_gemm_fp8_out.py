"""matmul(..., fp8_out=(q, scale)): the GEMM epilogue's e4m3 output (blockwise 1x128 tiles) bit for
bit against quantize_e4m3 of the stored output and torch's cast; the tile rule of its launches."""
import pytest
import torch

from _utils import DEVICE, INTERPRETED, assert_close, assert_tile_quantised, poison, randn
from fusedpar.kernels import gemm, gemm_configs, matmul, matmul_reference
from fusedpar.kernels.fp8 import E4M3_MAX, SCALE_FLOOR
from fusedpar.kernels.gemm import gpu_configs
from fusedpar.kernels.gemm_fp8_epilogue import FP8_OUT_CONFIGS, fp8_output_configs, fp8_output_empty
from fusedpar.kernels.runtime import prune_tile_configs

needs_fp8 = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                               reason="fp8 needs compute capability >= 8.9")


def _poisoned_fp8(out_shape, n_tiles):
    """NaN-filled ``(q, scale)``: e4m3 NaN and fp32 NaN."""
    q = poison(out_shape, torch.float32).to(torch.float8_e4m3fn)
    return q, poison(tuple(out_shape[:-1]) + (n_tiles,), torch.float32)


def _check_tiles(out, q, s):
    """(q, s) equal quantize_e4m3(out, "tile") and torch's cast of the same values, bit for bit."""
    assert_tile_quantised(out, q, s)


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "none"])
def test_fp8_output_equals_quantize_of_the_output(activation, dtype):
    """At N = 128 (one tile), 200 (ragged last tile) and 448 (three tiles and a ragged one, over
    two column programs compiled), M = 37 (ragged row block), into NaN-poisoned buffers: ``out`` is
    matmul's and (q, scale) its quantisation as stored; the zero row of ``a`` gets the floor scale
    and zeros (without a bias), and every other tile's amax maps to 448. bf16 runs under the interpreter too: its
    truncating bf16 store is what is quantised (the operands are upcast for the dot)."""
    g = torch.Generator().manual_seed(31)
    gated = activation == "swiglu"
    M, K = 37, 48
    for N in (128, 200, 448):
        n_w = 2 * N if gated else N
        a = randn(M, K, dtype=dtype, generator=g)
        a[1] = 0.0
        w = randn(n_w, K, dtype=dtype, generator=g, scale=K ** -0.5)
        bias = randn(n_w, dtype=dtype, generator=g) if activation == "gelu" else None
        out = poison((M, N), dtype)
        q, s = _poisoned_fp8((M, N), -(-N // 128))
        assert matmul(a, w, bias, activation=activation, out=out, fp8_out=(q, s)) is out
        assert_close(out, matmul_reference(a, w, bias, activation=activation), dtype,
                     msg=f"{activation} N={N}")
        _check_tiles(out, q, s)
        qf, sf = q.float().cpu(), s.cpu()
        rest = torch.arange(M) != 1 if bias is None else torch.ones(M, dtype=torch.bool)
        if bias is None:
            assert (sf[1] == SCALE_FLOOR).all() and (qf[1] == 0).all(), "the zero row"
        assert (sf[rest] > SCALE_FLOOR).all()
        for t in range(-(-N // 128)):
            assert (qf[rest, 128 * t:128 * (t + 1)].abs() == E4M3_MAX).any(1).all(), f"tile {t}: amax -> 448"


@needs_fp8
def test_fp8_output_of_sequence_chunks_residual_and_wide_tiles(monkeypatch):
    """3-D sequence-chunk views (two-level rows) of out, residual and of larger q / scale buffers,
    written in place and nowhere else; the residual is in what is quantised. The interpreter's
    tile is widened to BLOCK_N = 256 (two 1x128 tiles per program, the reshaped amax) over
    N = 448 (the second program's last tile ragged), as the compiled 128 x 256 tiles run."""
    if INTERPRETED:
        monkeypatch.setattr(gemm_configs, "FP8_OUT_INTERPRETER_CONFIG", dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=32, GROUP_M=4))
    g = torch.Generator().manual_seed(32)
    B, S, K, N, lo, hi = 2, 11, 40, 448, 3, 9
    x = randn(B, S, K, dtype=torch.float16, generator=g)
    w = randn(2 * N, K, dtype=torch.float16, generator=g, scale=K ** -0.5)
    res = randn(B, S, N, dtype=torch.float16, generator=g)
    out = poison((B, S, N), torch.float16)
    q, s = _poisoned_fp8((B, S, N), 4)
    view = (slice(None), slice(lo, hi))
    matmul(x[view], w, activation="swiglu", residual=res[view], out=out[view], fp8_out=(q[view], s[view]))
    assert_close(out[view], matmul_reference(x[view], w, activation="swiglu", residual=res[view]), torch.float16)
    _check_tiles(out[view].contiguous(), q[view].contiguous(), s[view].contiguous())
    outside = torch.cat([s[:, :lo], s[:, hi:]], dim=1)
    assert torch.isnan(outside).all() and torch.isnan(torch.cat([q[:, :lo], q[:, hi:]], dim=1).float()).all()


@needs_fp8
def test_fp8_output_of_an_epilogue_split_past_the_last_column(monkeypatch):
    """A 256-wide tile whose epilogue runs in 128-wide column halves (the compiled 128 x 256 split
    2 tile with the fp8 output, sm_90) over N = 300: the last column tile's second half lies wholly
    past N, and no scale is stored for its 1x128 tile, which does not exist (its index was the next
    row's first tile, past the buffer for the last row). ``matmul`` and ``fp8_matmul``: q and scale
    bit for bit ``quantize_e4m3(out, "tile")``, the scale a view of a larger buffer whose guard row
    stays as it was. The interpreter's tile is forced (its own fp8-output tile is 128 wide)."""
    from fusedpar.kernels import fp8_gemm, fp8_matmul, quantize_e4m3
    split = dict(BLOCK_M=32, BLOCK_N=256, GROUP_M=4, EPILOGUE_SPLIT=2)
    monkeypatch.setattr(gemm, "interpreter_config", lambda tma, fp8_out: dict(split, BLOCK_K=32))
    monkeypatch.setattr(fp8_gemm, "fp8_interpreter_config", lambda tma, fp8_out: dict(split, BLOCK_K=128))
    g = torch.Generator().manual_seed(33)
    M, N, K = 40, 300, 128
    x, w = randn(M, K, generator=g), randn(N, K, generator=g, scale=K ** -0.5)
    a16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    (a8, sa), (w8, sw) = quantize_e4m3(x, "row"), quantize_e4m3(w, "row")
    calls = {"matmul": lambda out, fp8_out: matmul(a16, w16, out=out, fp8_out=fp8_out),
             "fp8_matmul": lambda out, fp8_out: fp8_matmul(a8, sa, w8, sw, out=out, fp8_out=fp8_out)}
    for name, call in calls.items():
        out = poison((M, N), torch.bfloat16)
        q, _ = _poisoned_fp8((M, N), 3)
        guard = torch.full((M + 1, 3), -1.0, device=DEVICE)
        call(out, (q, guard[:M]))
        _check_tiles(out, q, guard[:M])
        assert (guard[M] == -1.0).all(), f"{name}: a scale written past the last row"


@needs_fp8
def test_fp8_output_of_an_empty_contraction_and_new_buffers():
    """K = 0: the epilogue runs on the host (bias only) and is quantised there; M = 0 writes nothing;
    fp8_output_empty allocates the pair for an output."""
    b = randn(200)
    out = torch.empty(5, 200, device=DEVICE)
    q, s = fp8_output_empty(out)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.dtype == torch.float32
    matmul(randn(5, 0), randn(200, 0), b, out=out, fp8_out=(q, s))
    _check_tiles(out, q, s)
    empty = torch.empty(0, 200, device=DEVICE)
    assert matmul(randn(0, 8), randn(200, 8), out=empty, fp8_out=fp8_output_empty(empty)).shape == (0, 200)


def test_fp8_output_launches_take_whole_1x128_tiles(monkeypatch):
    """The autotuner's list (the shared candidates, then FP8_OUT_CONFIGS): launches with the fp8
    output keep only BLOCK_N multiples of 128, through the prune rule too (its fallback included);
    others never take FP8_OUT_CONFIGS, so their tuning is unchanged; the fp8 output counts as a fused
    epilogue (its budget; the tight one when gated over unaligned K) and is in the tuning key. The interpreter's tile is 128 wide."""
    monkeypatch.setattr(gemm_configs, "device_capability", lambda index: (9, 0))
    tuned = gpu_configs() + list(FP8_OUT_CONFIGS)
    assert [c.kwargs for c in fp8_output_configs(tuned, False)] == [c.kwargs for c in gpu_configs()]
    meta = torch.empty(1, dtype=torch.bfloat16, device="meta")
    for glu, k, n in ((True, 4096, 14336), (True, 70, 200), (False, 4096, 40), (False, 64, 1)):
        args = dict(a_ptr=meta, M=8192, N=n, K=k, s_am1=k, s_ak1=1, s_bk1=1, s_bn=k)
        rule = gemm.tile_rule(args, FP8_OUT=True, GLU=glu, ACT=3 if glu else 0)
        # a gated epilogue over unaligned K (70) takes the tight budget (64 x 128 x 32 w8 spilled on sm_90)
        tight = glu and k % 64 != 0
        assert rule["acc_budget"] == (gemm.SYNC_TIGHT_ACC_BUDGET if tight else gemm.EPILOGUE_ACC_BUDGET["fused"])
        kept = prune_tile_configs(fp8_output_configs(tuned, True), smem_limit=232448,
                                  dims={"BLOCK_M": 8192, "BLOCK_N": n}, **rule)
        assert kept and all(c.kwargs["BLOCK_N"] % 128 == 0 for c in kept), (glu, k, n)
    assert "FP8_OUT" in gemm.TUNING_KEY and gemm_configs.FP8_OUT_INTERPRETER_CONFIG["BLOCK_N"] == 128


def test_gated_fp8_output_over_ragged_n_takes_pointer_loads(monkeypatch):
    """sm_90, compiled: a gated epilogue with the e4m3 output over N not a multiple of 16 takes the
    tight register budget (32 accumulator elements per thread) and every TMA tile of whole 1x128
    tiles holds 64, so no TMA tile passes the prune rule: the launch takes pointer loads, not the
    rule's fallback tile (which spills). N = 256 and an ungated epilogue over N = 200 keep TMA.
    The launch's decision, with the autotuner faked (it records the flags)."""
    from fusedpar.kernels import gemm_loads
    for module in (gemm_configs, gemm_loads):
        monkeypatch.setattr(module, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(gemm_configs, "shared_memory_limit", lambda index=0: 232448)
    monkeypatch.setattr(gemm_configs, "_TMA_FITS", {})
    for module in (gemm, gemm_loads):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    launches = []

    class Tuner:
        best_config = None

        def __getitem__(self, grid):
            return lambda *args, **flags: launches.append(flags)
    monkeypatch.setattr(gemm, "_tuned_kernel", lambda: Tuner())
    for activation, n, tma in (("swiglu", 200, False), ("swiglu", 256, True), ("gelu", 200, True)):
        a = torch.zeros(64, 64, dtype=torch.bfloat16)
        w = torch.zeros(2 * n if activation == "swiglu" else n, 64, dtype=torch.bfloat16)
        out = torch.empty(64, n, dtype=torch.bfloat16)
        matmul(a, w, activation=activation, out=out, fp8_out=fp8_output_empty(out))
        assert launches[-1]["TMA"] == tma, (activation, n)
    assert not gemm_configs.tma_tiles_fit(dict(a_ptr=a, c_ptr=out, r_ptr=out, M=64, N=200, K=64, s_am1=64, s_ak1=1,
                                               s_bk1=1, s_bn=64), GLU=True, ACT=3, FP8_OUT=True)


def _bad_calls():
    a, w = randn(8, 16), randn(200, 16)
    out = torch.empty(8, 200, device=DEVICE)
    q, s = fp8_output_empty(out)
    return [
        ("not_pair", TypeError, "fp8_out must be a \\(q, scale\\) pair", lambda: matmul(a, w, out=out, fp8_out=q)),
        ("q_dtype", TypeError, r"fp8_out\[0\] \(q\) must have dtype", lambda: matmul(a, w, out=out, fp8_out=(out, s))),
        ("q_shape", ValueError, r"fp8_out\[0\] \(q\) must have shape \(8, 200\), got \(8, 100\)",
         lambda: matmul(a, w, out=out, fp8_out=(q[:, :100], s))),
        ("scale_shape", ValueError, r"fp8_out\[1\] \(scale\) must have shape \(8, 2\), got \(8, 1\)",
         lambda: matmul(a, w, out=out, fp8_out=(q, s[:, :1]))),
        ("scale_dtype", TypeError, r"fp8_out\[1\] \(scale\) must have dtype",
         lambda: matmul(a, w, out=out, fp8_out=(q, s.double()))),
        ("q_rows", ValueError, r"fp8_out\[0\] \(q\) must have contiguous rows",
         lambda: matmul(a, w, out=out, fp8_out=(fp8_output_empty(torch.empty(400, 8, device=DEVICE))[0].t()[:, ::2], s))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_fp8_output(case):
    _, exc, pattern, call = _bad_calls()[case]
    with pytest.raises(exc, match=pattern):
        call()
