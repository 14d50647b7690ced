"""fusedpar.kernels.matmul / matmul_tn against an fp64 reference (interpreter on CPU, compiled on GPU)."""
import pytest
import torch
import triton
import triton.language as tl

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn
from fusedpar.kernels import ACTIVATIONS, gemm, gemm_configs, matmul, matmul_reference, matmul_tn, runtime
from fusedpar.kernels.gemm import gpu_configs
from fusedpar.kernels.runtime import prune_tile_configs

SHAPES = [(1, 1, 1), (7, 33, 19), (33, 7, 65), (127, 1, 40), (257, 129, 31), (64, 64, 64), (2, 257, 16)]


def _weight(n, k, layout, dtype, g):
    w = randn(n, k, dtype=dtype, generator=g)
    return w if layout == "nk" else w.t().contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matmul_shapes(M, N, K, layout, dtype):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    a = randn(M, K, dtype=dtype, generator=g)
    w = _weight(N, K, layout, dtype, g)
    out = poison((M, N), dtype)
    matmul(a, w, weight_layout=layout, out=out)
    assert_close(out, matmul_reference(a, w, weight_layout=layout), dtype, msg=f"{M}x{N}x{K} {layout}")


@pytest.mark.parametrize("load_path", ["auto", "pointer"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_epilogue_bias_activation_residual(activation, dtype, load_path):
    """Every activation with bias, residual and pre-activation, on both load paths: ragged M / N
    (45 x 37 on 32 x 32 tiles); K = 48 for "auto" (a ragged last 32-deep step; rows of 96 / 192
    bytes, so it takes TMA interpreted: persistent, the epilogue in column halves), 50 for pointer
    loads (rows no 16-byte multiple, the masked K tail). The launch record
    says which path ran (compiled, "auto" takes TMA only where the device and the tile rule allow
    it: asserted only where it cannot)."""
    from fusedpar.kernels import gemm_loads
    g = torch.Generator().manual_seed(7)
    M, F, K = 45, 37, 48 if gemm_loads_mode() == "auto" else 50
    gated = ACTIVATIONS[activation][1]
    n_w = 2 * F if gated else F
    a = randn(M, K, dtype=dtype, generator=g)
    w = randn(n_w, K, dtype=dtype, generator=g, scale=K ** -0.5)
    bias = randn(n_w, dtype=dtype, generator=g)
    res = randn(M, F, dtype=dtype, generator=g)
    pre = poison((M, n_w), dtype)
    out = matmul(a, w, bias, activation=activation, residual=res, preact_out=pre)
    loads = gemm_loads.last_launch("matmul")["loads"]
    assert out.shape == (M, F)
    assert_close(out, matmul_reference(a, w, bias, activation=activation, residual=res), dtype, msg=activation)
    assert_close(pre, matmul_reference(a, w, bias), dtype, msg=f"{activation} pre-activation")
    path = gemm_loads.load_path()
    if INTERPRETED:  # interpreted, "auto" takes TMA for any dtype
        assert loads == ("tma" if path == "auto" else "pointer"), (path, loads)
        assert load_path.launches[-1][1]["TMA"] == (loads == "tma")
    elif path == "pointer" or not gemm_loads.tma_capable(a.device, a.element_size()):
        assert loads == "pointer", (path, dtype, loads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_into_fp32(dtype):
    """C += A @ B with fp32 accumulation of the existing values (reduce-scatter epilogue, grad accumulation)."""
    g = torch.Generator().manual_seed(3)
    a = randn(29, 41, dtype=dtype, generator=g)
    w = randn(23, 41, dtype=dtype, generator=g)
    bias = randn(23, dtype=torch.float32, generator=g)
    c = randn(29, 23, dtype=torch.float32, generator=g)
    expected = c.double() + matmul_reference(a, w, bias)
    matmul(a, w, bias, out=c, accumulate=True)
    assert_close(c, expected, dtype)


def test_strided_sequence_chunk_in_place():
    """A reads a [batch, seq-chunk, K] view and C writes a [batch, seq-chunk, N] view, in place."""
    g = torch.Generator().manual_seed(11)
    B, S, K, N, lo, hi = 3, 13, 21, 17, 4, 9
    x = randn(B, S, K, generator=g)
    w = randn(N, K, generator=g)
    y = poison((B, S, N), torch.float32)
    matmul(x[:, lo:hi], w, out=y[:, lo:hi])
    assert_close(y[:, lo:hi], matmul_reference(x[:, lo:hi], w), torch.float32)
    untouched = torch.cat([y[:, :lo], y[:, hi:]], dim=1)
    assert torch.isnan(untouched).all(), "matmul wrote outside its output view"


def test_strided_operands_transposed_and_sliced():
    g = torch.Generator().manual_seed(5)
    a = randn(40, 31, generator=g).t()  # [31, 40] column-major view
    w = randn(50, 70, generator=g)[::2, 5:45]  # [25, 40] with row stride 140
    out_big = poison((31, 60), torch.float32)
    out = out_big[:, 3:53:2]  # [31, 25] with column stride 2
    matmul(a, w, out=out)
    assert_close(out, matmul_reference(a, w), torch.float32)
    assert torch.isnan(out_big[:, 0:3]).all()


def test_3d_output_accumulate_into_chunk():
    g = torch.Generator().manual_seed(13)
    x = randn(2, 10, 19, generator=g)
    w = randn(9, 19, generator=g)
    y = randn(2, 30, 9, generator=g)
    expected = y.double().clone()
    expected[:, 10:20] += matmul_reference(x, w)
    matmul(x, w, out=y[:, 10:20], accumulate=True)
    assert_close(y, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,dy_chunk", [(11, False), (11, True), (45, True)])
def test_matmul_tn_weight_gradient_over_strided_tokens(dtype, S, dy_chunk):
    """dW = dY^T X with the token dim a [batch, seq-chunk] view of x (and of dY): the two-level
    contraction index, advanced without division, for chunks shorter and longer than BLOCK_K."""
    g = torch.Generator().manual_seed(17 + S)
    B, N, K = 3, 19, 26
    dy = randn(B, 2 * S + 3, N, dtype=dtype, generator=g)[:, 2 : 2 + S] if dy_chunk else \
        randn(B, S, N, dtype=dtype, generator=g)
    x = randn(B, 2 * S + 1, K, dtype=dtype, generator=g)[:, 5 : 5 + S]
    out = poison((N, K), torch.float32)
    matmul_tn(dy, x, out=out)
    expected = dy.double().reshape(-1, N).t() @ x.double().reshape(-1, K)
    assert_close(out, expected, dtype)
    acc = randn(N, K, generator=g)
    expected2 = acc.double() + expected
    matmul_tn(dy, x, out=acc, accumulate=True)
    assert_close(acc, expected2, dtype)


def test_empty_dims():
    a = randn(5, 0)
    w = randn(4, 0)
    b = randn(4)
    assert_close(matmul(a, w, b), b.double().expand(5, 4), torch.float32)
    assert matmul(randn(0, 3), randn(4, 3)).shape == (0, 4)
    out = randn(4, 3)
    assert torch.equal(matmul_tn(randn(0, 4), randn(0, 3), out=out.clone(), accumulate=True), out)


def _bad_calls():
    a, w = randn(8, 16), randn(12, 16)
    meta = torch.empty(12, 16, device="meta")
    return [
        ("inner_k", ValueError, "inner dimensions differ.*K=16.*K=15", lambda: matmul(a, randn(12, 15))),
        ("weight_dtype", TypeError, "weight must have the same dtype as a", lambda: matmul(a, w.half())),
        ("fp64", TypeError, "a must have dtype .*got torch.float64", lambda: matmul(a.double(), w.double())),
        ("int32", TypeError, "a must have dtype .*got torch.int32", lambda: matmul(a.int(), w.int())),
        ("out_shape", ValueError, r"out must have shape \(8, 12\), got \(8, 13\)",
         lambda: matmul(a, w, out=torch.empty(8, 13, device=DEVICE))),
        ("a_1d", ValueError, "a must be 2-D or 3-D, got shape \\(16,\\)", lambda: matmul(a[0], w)),
        ("a_4d", ValueError, "a must be 2-D or 3-D.*4-D", lambda: matmul(a.reshape(1, 2, 4, 16), w)),
        ("weight_3d", ValueError, "weight must be 2-D, got shape \\(1, 12, 16\\)", lambda: matmul(a, w[None])),
        ("activation", ValueError, "activation must be one of", lambda: matmul(a, w, activation="tanh")),
        ("layout", ValueError, "weight_layout must be", lambda: matmul(a, w, weight_layout="nn")),
        ("bias_shape", ValueError, "bias must have shape \\(12,\\)", lambda: matmul(a, w, randn(11))),
        ("accumulate_no_out", ValueError, "accumulate=True needs out=", lambda: matmul(a, w, accumulate=True)),
        ("glu_odd", ValueError, "even number of weight output features",
         lambda: matmul(a, randn(13, 16), activation="swiglu")),
        ("tn_leading", ValueError, "same leading", lambda: matmul_tn(randn(8, 4), randn(7, 4))),
        ("meta", ValueError, "meta", lambda: matmul(a, meta)),
        ("not_tensor", TypeError, "a must be a torch.Tensor", lambda: matmul([[1.0]], w)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_input_errors(case):
    _, exc, pattern, call = _bad_calls()[case]
    with pytest.raises(exc, match=pattern):
        call()


@pytest.fixture
def set_tf32():
    """Sets torch.backends.cuda.matmul.allow_tf32 for one test (restored after it; monkeypatch
    cannot undo an attribute of torch's cuBLAS settings module)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    yield lambda value: setattr(torch.backends.cuda.matmul, "allow_tf32", value)
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_input_precision_follows_the_tf32_flag_when_compiled(monkeypatch, set_tf32, allow_tf32):
    """The compiled path runs fp32 tl.dot in TF32 exactly when torch.backends.cuda.matmul.allow_tf32
    is set (as torch.matmul does); half-precision inputs and the interpreter always use ieee."""
    set_tf32(allow_tf32)
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    assert runtime.input_precision(torch.float32) == ("tf32" if allow_tf32 else "ieee")
    assert runtime.input_precision(torch.float16) == "ieee"
    assert runtime.input_precision(torch.bfloat16) == "ieee"
    monkeypatch.setattr(runtime, "interpreting", lambda: True)
    assert runtime.input_precision(torch.float32) == "ieee"


def test_input_precision_follows_torch_s_new_tf32_api(monkeypatch):
    """TF32 set through torch's new API (torch.backends.cuda.matmul.fp32_precision, or the global
    torch.backends.fp32_precision) reaches the kernels, and the rule does not read the legacy
    allow_tf32, which then raises ("mix of the legacy and new APIs")."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision, torch.backends.fp32_precision
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    try:
        for setting, expected in (("tf32", "tf32"), ("ieee", "ieee")):
            matmul.fp32_precision = setting
            assert runtime.input_precision(torch.float32) == expected
        matmul.fp32_precision = "none"  # follow the global setting
        torch.backends.fp32_precision = "tf32"
        assert runtime.input_precision(torch.float32) == "tf32"
    finally:
        matmul.fp32_precision, torch.backends.fp32_precision = saved


def test_tuning_key_holds_every_flag_the_prune_rule_reads(monkeypatch):
    """A tuned config is reused for every launch with the same key: the key must hold whatever the
    prune rule decides on, or a tile kept for tf32 runs as "ieee" FMA dots (they spill) after a
    launch with the other torch.backends.cuda.matmul.allow_tf32, a plain epilogue's tile with a
    fused one, a pipelined tile whose rows lost their alignment. The flags and strides tile_rule
    reads are recorded (it reads each through named_args.get)."""
    class Recording(dict):
        def get(self, k, default=None):
            read.add(k)
            return super().get(k, default)

    read = set()
    monkeypatch.setattr(gemm_configs, "device_capability", lambda index: (9, 0))
    for has_res in (False, True):  # a residual makes the rule read R_M_SPLIT too
        gemm.tile_rule(Recording(a_ptr=torch.empty(1, dtype=torch.bfloat16), M=64, N=64, K=64, HAS_RES=has_res))
    flags = {k for k in read if k.isupper()}
    assert {"INPUT_PRECISION", "ACT", "R_M_SPLIT"} <= flags, flags
    assert flags <= set(gemm.TUNING_KEY), flags - set(gemm.TUNING_KEY)
    # and the strides it reads (the rows' 16-byte alignment decides pipelining), of the kernel's arguments
    strides = {k for k in read if k.startswith("s_")} & set(gemm._tuned_kernel().arg_names)
    assert {"s_am0", "s_bn"} <= strides and strides <= set(gemm.TUNING_KEY), strides - set(gemm.TUNING_KEY)


def test_interpreter_choice_is_fixed_at_import(monkeypatch):
    """The launchers' path follows how triton.jit decorated the kernels at import, not a later
    TRITON_INTERPRET: on a GPU an in-process run that set it (fusedpar.demo --device cpu) sent the
    compiled kernels down the interpreter's path (no autotuning, "ieee" dots), and under the
    interpreter unsetting it must not select the compiled path either."""
    monkeypatch.setenv("TRITON_INTERPRET", "0" if INTERPRETED else "1")
    assert runtime.interpreting() == INTERPRETED
    monkeypatch.delenv("TRITON_INTERPRET")
    assert runtime.interpreting() == INTERPRETED


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_matmul_launches_with_the_runtime_input_precision(monkeypatch, set_tf32, allow_tf32):
    """matmul takes its tl.dot precision from runtime.input_precision (no private copy of the rule):
    the kernel sees whatever that helper answers."""
    seen = []

    def spy(dtype):
        seen.append(dtype)
        return "ieee"

    set_tf32(allow_tf32)
    monkeypatch.setattr(gemm, "input_precision", spy)
    g = torch.Generator().manual_seed(19)
    a, w = randn(9, 20, generator=g), randn(7, 20, generator=g)
    assert_close(matmul(a, w), matmul_reference(a, w), torch.float32)
    assert seen == [torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("allow_tf32", [True, False])
def test_gpu_tf32_matmul(set_tf32, allow_tf32):
    """Compiled fp32 GEMM with TF32 on and off: TF32 rounds the inputs to a 10-bit mantissa
    (2^-11 relative), so it passes at the fp16 tolerance but not at the fp32 one; ieee passes the
    fp32 tolerance. The first half shows the flag reaches the kernel."""
    set_tf32(allow_tf32)
    g = torch.Generator().manual_seed(23)
    M, N, K = 256, 192, 512
    a, w = randn(M, K, generator=g), randn(N, K, generator=g, scale=K ** -0.5)
    out = matmul(a, w)
    ref = matmul_reference(a, w)
    if allow_tf32:
        assert_close(out, ref, torch.float16, msg="tf32 within the 10-bit-mantissa tolerance")
        err = ((out.double() - ref.to(out.device)).abs().max() / ref.abs().max()).item()
        assert err > 1e-5, f"allow_tf32=True, yet the result is ieee-exact (rel err {err:.2e}): tf32 not used?"
    else:
        assert_close(out, ref, torch.float32, msg="ieee fp32")


def test_gpu_config_pruning_by_shared_memory_and_problem_size():
    """The autotuner's candidate list (GPU only) is pruned on the host: checked here on CPU."""
    configs = gpu_configs()

    def smem(c, b_tiles):
        k = c.kwargs
        return (k["BLOCK_M"] * k["BLOCK_K"] + b_tiles * k["BLOCK_K"] * k["BLOCK_N"]) * 2 * c.num_stages

    limit = 160 * 1024
    big = prune_tile_configs(configs, elem_size=2, b_tiles=1, smem_limit=limit, dims={"BLOCK_M": 8192, "BLOCK_N": 8192})
    assert big and all(smem(c, 1) <= limit for c in big)
    assert [c for c in configs if smem(c, 1) <= limit] == big
    gated = prune_tile_configs(configs, elem_size=2, b_tiles=2, smem_limit=limit, dims={"BLOCK_M": 8192, "BLOCK_N": 8192})
    assert all(smem(c, 2) <= limit for c in gated) and len(gated) < len(big)
    narrow = prune_tile_configs(configs, elem_size=2, b_tiles=1, smem_limit=limit, dims={"BLOCK_M": 8192, "BLOCK_N": 40})
    # N=40 rounds up to 64: tiles up to 2 * 64 = 128 wide stay, the 256-wide ones go
    assert any(c.kwargs["BLOCK_N"] == 256 for c in big)
    assert narrow and all(c.kwargs["BLOCK_N"] <= 128 for c in narrow)
    assert [c for c in big if c.kwargs["BLOCK_N"] <= 128] == narrow
    tiny = prune_tile_configs(configs, elem_size=4, b_tiles=2, smem_limit=1024, dims={"BLOCK_M": 1, "BLOCK_N": 1})
    assert len(tiny) == 1 and tiny[0] is min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])


def test_prune_rule_models_the_compiler():
    """The shared-memory and register terms of the prune rule, at figures the compile check
    (``python -m benchmarks compile``) measured: wgmma (sm_90, >= 64 rows) buffers num_stages
    tiles, mma.sync (sm_80, or fewer rows) num_stages - 1; a gated 128x128 tile over 8 warps holds
    128 accumulator elements per thread, over the fused-epilogue budget."""
    from fusedpar.kernels.runtime import tile_config_problem, tile_smem_bytes

    big = triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), num_stages=3, num_warps=8)
    small = triton.Config(dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), num_stages=4, num_warps=4)
    assert tile_smem_bytes(big, elem_size=2, b_tiles=1, capability=(9, 0)) == 147456
    assert tile_smem_bytes(big, elem_size=2, b_tiles=1, capability=(8, 0)) == 98304
    assert tile_smem_bytes(small, elem_size=2, b_tiles=2, capability=(9, 0)) == 55296
    # the grouped weight gradient's dot is dy^T [N, M] @ x [M, K]: rows block is the contraction
    wgrad = triton.Config(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128), num_stages=3, num_warps=8)
    assert tile_smem_bytes(wgrad, elem_size=2, b_tiles=1, dims=("BLOCK_N", "BLOCK_K", "BLOCK_M")) == 98304
    gated = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), num_stages=4, num_warps=8)
    rule = dict(elem_size=2, b_tiles=2, smem_limit=232448, acc_tiles=2)
    assert "128 fp32 accumulator elements per thread > 64" in tile_config_problem(
        gated, acc_budget=gemm.EPILOGUE_ACC_BUDGET["fused"], **rule)
    assert tile_config_problem(gated, acc_budget=gemm.EPILOGUE_ACC_BUDGET["plain"], **rule) is None


def test_prune_rule_follows_the_mma_kind_and_the_load_pipelining():
    """Figures of the sm_80 compile check: mma.sync (sm_80) holds its operand fragments in
    registers, so an activation + residual epilogue over 64 accumulator elements per thread is
    dropped there but kept for wgmma (sm_90); fp32 "ieee" (FMA) dots keep BLOCK_K <= 32 and <= 32
    accumulator elements per thread in all; loads that do not vectorise (bf16, K = 70) are not
    pipelined, so shared memory is one A and one B tile (8192 B for 64x64x32 s4, not 36864)."""
    from fusedpar.kernels.runtime import pipelined, tile_config_problem, tile_smem_bytes

    wide = triton.Config(dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64), num_stages=4, num_warps=4)
    rule = dict(elem_size=2, b_tiles=1, smem_limit=166912, acc_budget=gemm.EPILOGUE_ACC_BUDGET["fused"],
                sync_acc_budget=gemm.SYNC_TIGHT_ACC_BUDGET)
    assert "64 fp32 accumulator elements per thread > 32" in tile_config_problem(wide, capability=(8, 0), **rule)
    assert tile_config_problem(wide, capability=(9, 0), **rule) is None
    fma = dict(elem_size=4, b_tiles=1, smem_limit=166912, capability=(8, 0), precision="ieee", acc_budget=32)
    assert "contraction block of 64 > 32" in tile_config_problem(
        triton.Config(dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64), num_stages=5, num_warps=2), **fma)
    assert tile_config_problem(triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), num_stages=3, num_warps=8),
                               **fma) is None
    assert not pipelined(2, 70, 70, 70) and pipelined(4, 70, 70) and pipelined(2, 4096, 4096)
    small = triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), num_stages=4, num_warps=4)
    assert tile_smem_bytes(small, elem_size=2, b_tiles=2, capability=(8, 0)) == 36864
    assert tile_smem_bytes(small, elem_size=2, b_tiles=2, capability=(8, 0), pipelined=False) == 8192


def test_prune_rule_for_an_fp32_output_over_16_bit_operands(monkeypatch):
    """The linear cross entropy's ``d_hidden += dz_b W_b`` (bf16 operands, fp32 ``out``), figures
    of the compile check: accumulating into the fp32 tile spills at 128 accumulator elements per
    thread (48-180 B on sm_90, 116-252 B on sm_80), so it takes the fused-epilogue budget (a bf16
    ``out`` keeps the plain one); a wgmma tile storing fp32 stages its output tile in shared
    memory (128 x 256 x 32, 4 stages: 131072 B, not the main loop's 98304)."""
    monkeypatch.setattr(gemm_configs, "device_capability", lambda index: (9, 0))
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    args = dict(a_ptr=meta(1), M=8192, N=4096, K=14336, s_am1=14336, s_ak1=1, s_bk1=4096, s_bn=1)
    wide = gemm.tile_rule(dict(args, r_ptr=meta(1, dt=torch.float32), c_ptr=meta(1, dt=torch.float32)), HAS_RES=True)
    same = gemm.tile_rule(dict(args, r_ptr=meta(1), c_ptr=meta(1)), HAS_RES=True)
    assert wide["acc_budget"] == gemm.EPILOGUE_ACC_BUDGET["fused"] and same["acc_budget"] == 128
    cfg = triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32), num_stages=4, num_warps=8)
    assert gemm.smem_estimate(cfg, dict(args, c_ptr=meta(1, dt=torch.float32))) == 131072
    assert gemm.smem_estimate(cfg, dict(args, c_ptr=meta(1))) == 98304
    monkeypatch.setattr(gemm_configs, "device_capability", lambda index: (8, 0))  # mma.sync stores from registers
    assert gemm.smem_estimate(cfg, dict(args, c_ptr=meta(1, dt=torch.float32))) == 73728


# --------------------------------------------------------------------------------------------
# load paths (kernels/gemm_loads.py): TMA through tensor descriptors, or pointer loads
# --------------------------------------------------------------------------------------------
class _KernelSpy:
    """Stands in for ``gemm._gemm_kernel`` (interpreted launches): records each launch's grid and
    flags, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **flags):
            self.launches.append((grid, flags))
            return self.kernel[grid](*args, **flags)
        return launch


@pytest.fixture
def load_path(request, monkeypatch):
    """Runs a test under ``gemm_loads.set_load_path(request.param)``; yields the kernel spy, None
    compiled (autotuned launches are not spied on: tests that read the spy call :func:`_spied`)."""
    from fusedpar.kernels import gemm_loads
    spy = None
    if INTERPRETED:
        spy = _KernelSpy(gemm._gemm_kernel)
        monkeypatch.setattr(gemm, "_gemm_kernel", spy)
    gemm_loads.set_load_path(request.param)
    yield spy
    gemm_loads.set_load_path("auto")


def _spied(load_path):
    """Skip a test that reads the kernel spy of :func:`load_path` where there is none (compiled)."""
    if load_path is None:
        pytest.skip("the interpreter's launches are spied on (compiled ones are autotuned)")


@pytest.mark.parametrize("load_path", ["auto", "pointer"], indirect=True)
def test_load_paths_fused_epilogues_ragged(load_path):
    """Both load paths over ragged M / N / K (37 x 48 x 40 on 32 x 32 x 32 tiles: partial tiles
    everywhere, fp16 rows of 80 and 96 bytes, so "auto" takes TMA, zero-filled past the edges
    instead of masked) with the fused
    epilogues: SwiGLU on an "nk" weight with bias, pre-activation and residual; GELU on a "kn"
    weight accumulated into fp32; ``matmul_tn`` (A contiguous along M). The TMA launches are
    persistent: 3 programs over 4 tiles, the first one wrapping, the epilogue in column halves."""
    _spied(load_path)
    g = torch.Generator().manual_seed(41)
    M, F, K, dt = 37, 48, 40, torch.float16
    a = randn(M, K, dtype=dt, generator=g)
    w = randn(2 * F, K, dtype=dt, generator=g, scale=K ** -0.5)
    bias, res = randn(2 * F, dtype=dt, generator=g), randn(M, F, dtype=dt, generator=g)
    pre = poison((M, 2 * F), dt)
    out = matmul(a, w, bias, activation="swiglu", residual=res, preact_out=pre)
    assert_close(out, matmul_reference(a, w, bias, activation="swiglu", residual=res), dt, msg="swiglu")
    assert_close(pre, matmul_reference(a, w, bias), dt, msg="pre-activation")
    w_kn = randn(K, F, dtype=dt, generator=g, scale=K ** -0.5)
    acc = randn(M, F, generator=g)
    expected = acc.double() + matmul_reference(a, w_kn, weight_layout="kn")
    matmul(a, w_kn, weight_layout="kn", out=acc, accumulate=True)
    assert_close(acc, expected, dt, msg="kn accumulate")
    dy, x = randn(M, F, dtype=dt, generator=g), randn(M, K, dtype=dt, generator=g)
    dw = poison((F, K), dt)
    assert matmul_tn(dy, x, out=dw) is dw
    assert_close(dw, dy.double().t() @ x.double(), dt, msg="matmul_tn")
    tma = load_path.launches[0][1]["TMA"]
    assert all(flags["TMA"] == tma for _, flags in load_path.launches)
    assert tma == (gemm_loads_mode() == "auto")
    if tma:  # persistent: fewer programs than tiles; A of matmul_tn contiguous along M
        assert all(grid[0] == 3 for grid, _ in load_path.launches)
        assert [flags["A_KMAJOR"] for _, flags in load_path.launches] == [True, True, False]
        assert [flags["B_KMAJOR"] for _, flags in load_path.launches] == [True, False, False]


def gemm_loads_mode():
    from fusedpar.kernels import gemm_loads
    return gemm_loads.load_path()


@pytest.mark.parametrize("load_path", ["auto"], indirect=True)
def test_what_tma_cannot_take_loads_through_pointers(load_path):
    """"auto" keeps pointer loads for an unaligned base (a view one element in), rows that are not
    16-byte multiples (K = 19 fp32), a split [batch, seq-chunk] row view; TMA otherwise."""
    _spied(load_path)
    g = torch.Generator().manual_seed(43)
    big = randn(40, 80, generator=g)
    w = randn(24, 32, generator=g)
    x = randn(2, 9, 32, generator=g)
    cases = [(big[3:40, 1:33], True), (big[3:40, 8:40], False), (randn(20, 19, generator=g), True),
             (x[:, 2:7], True), (x[:, :], False)]
    for a, pointer in cases:
        w_k = w if a.shape[-1] == 32 else randn(24, 19, generator=g)
        assert_close(matmul(a, w_k), matmul_reference(a, w_k), torch.float32)
        assert load_path.launches[-1][1]["TMA"] == (not pointer), (tuple(a.shape), a.stride())


@pytest.mark.parametrize("load_path", ["auto"], indirect=True)
def test_gated_kn_weights_with_an_unaligned_up_half_load_through_pointers(load_path):
    """A gated epilogue on "kn" weights (``[K, 2N]``, contiguous along N) loads its up half N
    columns after the gate: a box's first column must sit on a 16-byte boundary, so N = 20 fp16
    (40 bytes) keeps pointer loads (a descriptor would fail there), N = 24 (48 bytes) takes TMA;
    both against float64, and the "nk" layout of the same N = 20 (the up half a row offset) TMA."""
    from fusedpar.kernels import gemm_loads
    _spied(load_path)
    g = torch.Generator().manual_seed(53)
    dt, M, K = torch.float16, 19, 32
    a = randn(M, K, dtype=dt, generator=g)
    for n, layout, tma in ((20, "kn", False), (24, "kn", True), (20, "nk", True)):
        w = randn(*((K, 2 * n) if layout == "kn" else (2 * n, K)), dtype=dt, generator=g, scale=K ** -0.5)
        got = matmul(a, w, weight_layout=layout, activation="swiglu")
        assert_close(got, matmul_reference(a, w, weight_layout=layout, activation="swiglu"), dt, msg=f"{n} {layout}")
        assert load_path.launches[-1][1]["TMA"] == tma, (n, layout)
    assert not gemm_loads.up_half_aligned(False, 20, 2) and gemm_loads.up_half_aligned(True, 20, 2)


@pytest.mark.parametrize("load_path", ["auto"], indirect=True)
def test_expanded_and_overlapping_rows_load_through_pointers(load_path):
    """A tensor descriptor holds neither a row stride of 0 (an expanded view: every row the same
    memory) nor rows that overlap (a stride shorter than the row): "auto" keeps pointer loads for
    them, and the numbers are right. Expanded A, expanded weight, A with rows 16 elements apart
    over K = 32 (fp16: 32-byte strides, 16-byte multiples), and matmul_tn over expanded tokens."""
    _spied(load_path)
    g = torch.Generator().manual_seed(47)
    M, N, K, dt = 20, 24, 32, torch.float16
    a, w = randn(M, K, dtype=dt, generator=g), randn(N, K, dtype=dt, generator=g, scale=K ** -0.5)
    flat = randn(M * 16 + K, dtype=dt, generator=g)
    cases = [(randn(1, K, dtype=dt, generator=g).expand(M, K), w), (a, randn(1, K, dtype=dt, generator=g).expand(N, K)),
             (flat.as_strided((M, K), (16, 1)), w)]
    for x, wx in cases:
        assert_close(matmul(x, wx), matmul_reference(x, wx), dt)
        assert not load_path.launches[-1][1]["TMA"], (x.stride(), wx.stride())
    dy, xt = randn(1, N, dtype=dt, generator=g).expand(M, N), randn(M, K, dtype=dt, generator=g)
    assert_close(matmul_tn(dy, xt), dy.double().t() @ xt.double(), dt, msg="matmul_tn, expanded tokens")
    assert not load_path.launches[-1][1]["TMA"]
    assert_close(matmul(a, w), matmul_reference(a, w), dt)
    assert load_path.launches[-1][1]["TMA"]  # (the same shapes, plain: TMA)


def test_tma_layout_rules(monkeypatch):
    """The host's TMA rule (kernels/gemm_loads.py): 16-byte aligned base and strides, contiguous
    along K or along the other dim; e4m3 operands K-major both; sm_90 and 16-bit (or 8-bit) on a
    GPU, any dtype interpreted; the persistent grid; pointer loads by choice."""
    from fusedpar.kernels import gemm_loads
    a = torch.zeros(64, 72, dtype=torch.bfloat16)
    b = torch.zeros(48, 72, dtype=torch.bfloat16)
    mnk = (64, 48, 72)  # (M, N, K): the extents of the views below
    assert gemm_loads.tma_layout(a, 72, 1, b, 1, 72, mnk) == (True, True)
    assert gemm_loads.tma_layout(a, 1, 64, b, 48, 1, mnk) == (False, False)  # transposed views of both
    assert gemm_loads.tma_layout(a, 1, 64, b, 1, 72, mnk, k_major=True) is None
    assert gemm_loads.tma_layout(a[:, 1:], 72, 1, b, 1, 72, mnk) is None  # base 2 bytes in
    assert gemm_loads.tma_layout(a, 36, 1, b, 1, 72, (64, 48, 36)) is None  # a row stride of 72 bytes
    assert gemm_loads.tma_layout(a, 72, 2, b, 1, 72, mnk) is None  # contiguous along neither dim
    # a row stride of 0 (expanded) or shorter than the row (overlapping rows), either operand or layout
    for strides in ((0, 1, 1, 72), (72, 1, 1, 0), (64, 1, 1, 72), (72, 1, 1, 8), (1, 0, 48, 1), (1, 64, 40, 1)):
        assert gemm_loads.tma_layout(a, strides[0], strides[1], b, strides[2], strides[3], mnk) is None, strides
    monkeypatch.setattr(gemm_loads, "interpreting", lambda: False)
    for cap, size, expected in (((9, 0), 2, True), ((9, 0), 1, True), ((9, 0), 4, False), ((8, 0), 2, False)):
        monkeypatch.setattr(gemm_loads, "device_capability", lambda index, cap=cap: cap)
        assert gemm_loads.tma_capable(torch.device("cuda", 0), size) == expected
    monkeypatch.setattr(gemm_loads, "multiprocessor_count", lambda index: 132)
    assert [gemm_loads.num_programs(t, torch.device("cuda", 0), p) for t, p in ((500, True), (7, True), (500, False))] \
        == [132, 7, 500]
    try:
        gemm_loads.set_load_path("pointer")
        assert not gemm_loads.tma_capable(torch.device("cuda", 0), 2)
        with pytest.raises(ValueError, match="path must be one of"):
            gemm_loads.set_load_path("tma")
    finally:
        gemm_loads.set_load_path("auto")
    with pytest.raises(RuntimeError, match="inside"):  # the path of a block, restored when it raises
        with gemm_loads.load_path_set("pointer"):
            assert gemm_loads.load_path() == "pointer"
            raise RuntimeError("inside")
    assert gemm_loads.load_path() == "auto"


def test_scratch_allocator_is_set_per_context_and_never_replaces_a_users():
    """Device-side descriptors need Triton's allocator in the launching context: autograd's worker
    threads start without it, so every compiled launch installs it where none is set; an allocator
    set by the user stays. Ours keeps one buffer per stream."""
    import threading

    import triton
    from triton.runtime import _allocation

    from fusedpar.kernels.gemm_loads import ensure_scratch_allocator
    seen = {}

    def worker():
        seen["before"] = _allocation._allocator.get()
        ensure_scratch_allocator()
        mine = _allocation._allocator.get()
        seen["buffer"] = mine(256, 128, 7)
        seen["reused"] = mine(4096, 128, 7) is seen["buffer"] and mine(256, 128, 8) is not seen["buffer"]
        user = lambda size, alignment, stream: torch.empty(size, dtype=torch.int8)  # noqa: E731
        triton.set_allocator(user)
        ensure_scratch_allocator()
        seen["kept"] = _allocation._allocator.get() is user

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert seen["buffer"].numel() >= 256 and seen["buffer"].dtype == torch.int8 and seen["kept"]
    assert seen["reused"]  # one buffer per stream (launches on a stream run in order)


def test_scratch_allocator_allocates_on_the_launching_device(monkeypatch):
    """One allocator serves every device of the context: each buffer on the device current at the
    launch (a launcher enters its tensors' device), kept per device and stream (two devices' streams
    may share a handle value). Two fake devices: the CPU and ``meta``."""
    import threading

    from triton.runtime import _allocation

    from fusedpar.kernels import gemm_loads
    current = [torch.device("cpu")]
    monkeypatch.setattr(gemm_loads, "scratch_device", lambda: current[0])
    seen = {}

    def worker():
        gemm_loads.ensure_scratch_allocator()
        alloc = _allocation._allocator.get()
        first = alloc(256, 128, 7)
        current[0] = torch.device("meta")
        second, again = alloc(256, 128, 7), alloc(512, 128, 7)
        current[0] = torch.device("cpu")
        seen.update(first=first, second=second, again=again, back=alloc(256, 128, 7))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["first"].device.type == "cpu" and seen["second"].device.type == "meta"
    assert seen["again"] is seen["second"] and seen["back"] is seen["first"]
