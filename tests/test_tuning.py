"""``FUSEDPAR_TUNE_CONFIGS``: which of the configs a prune rule keeps the autotuners try.

The compiled suite (``make gpu-test``) sets it to 1 so each kernel specialization compiles once
(about 1,300 specializations; every kept config of each would be several thousand compiles). So
that the configs the first-config rule skips are still run, the sweeps below run every config
the prune rules keep at their shapes, one at a time (``#K``), on awkward shapes (odd M and N,
tails in every tile dim; K both "unaligned", which keeps only 32-deep tiles, and a multiple of
64, which keeps the 64-deep ones) against a float64 reference, in bf16: the GEMM plain, with a
fused bias + GELU epilogue and gated SwiGLU + residual; the grouped GEMM (plain and gated, empty
and one-row groups) and its weight gradient; flash attention forward and backward (causal and
not, d 64 and 128, GQA; the backward in both dq modes, so the one-pass "atomic" configs of the
backward's autotuner are swept too). Not swept: fp16 / fp32 / TF32 launches (other prune outcomes) and
configs only LLM-sized shapes keep (the benchmarks check those results before timing them).
The parsing and selection rules run on CPU too.
"""
import pytest
import torch
import triton
import triton.language as tl

from _utils import DEVICE, assert_close, randn
from fusedpar.kernels import (
    attention_reference,
    flash_attention_backward,
    flash_attention_forward,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_wgrad,
    matmul,
    matmul_reference,
)
from fusedpar.kernels.runtime import (
    MemoAutotuner,
    clear_tuning_caches,
    kept_config_count,
    select_tuning_configs,
    tuning_selection,
)

# tolerances relative to the reference's RMS, as in test_gemm / test_attention_flash: bf16 inputs
# and outputs carry an 8-bit mantissa (1.6e-2); attention gradients round P and dS to bf16 (4e-2)
OUT_TOL, GRAD_TOL = 1.6e-2, 4e-2


@pytest.mark.parametrize("raw,expected", [("", ("all",)), ("  ", ("all",)), ("1", ("first", 1)), ("3", ("first", 3)),
                                          ("#0", ("index", 0)), ("#7", ("index", 7))])
def test_selection_parsing(monkeypatch, raw, expected):
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", raw)
    assert tuning_selection() == expected


@pytest.mark.parametrize("raw", ["0", "-2", "#-1", "all", "#", "1.5"])
def test_selection_rejects_bad_values(monkeypatch, raw):
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", raw)
    with pytest.raises(ValueError, match=r"FUSEDPAR_TUNE_CONFIGS must be an integer >= 1 or '#K'.*" + repr(raw)[1:-1]):
        tuning_selection()


def test_selection_of_kept_configs(monkeypatch):
    kept = ["a", "b", "c"]
    monkeypatch.delenv("FUSEDPAR_TUNE_CONFIGS", raising=False)
    assert select_tuning_configs("k", kept) == kept and kept_config_count("k") == 3
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "2")
    assert select_tuning_configs("k", kept) == ["a", "b"]
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "5")
    assert select_tuning_configs("k", kept) == kept
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "#4")
    assert select_tuning_configs("k", kept[:2]) == ["a"] and kept_config_count("k") == 3  # the most of any key
    clear_tuning_caches()
    with pytest.raises(KeyError, match="has not been tuned"):
        kept_config_count("k")
    assert select_tuning_configs("k", kept[:2]) == ["a"] and kept_config_count("k") == 2
    with pytest.raises(KeyError, match="has not been tuned"):
        kept_config_count("never_tuned_kernel")


@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@pytest.mark.parametrize("kept", [1, 2])
def test_a_lone_kept_config_is_not_timed(kept):
    """Where the prune rule keeps one config the tuner launches it untimed (Triton 3.6 timed it,
    ~100 runs of the kernel at every new key, e.g. every key of the compiled suite, which keeps one
    config); with two it times both and launches the faster. The timing here launches nothing."""
    configs = [triton.Config({"BLOCK": b}) for b in (16, 32)]
    tuner = MemoAutotuner(_double_kernel, _double_kernel.arg_names, configs, ["n"], None,
                          {"early_config_prune": lambda cfgs, named_args, **kw: cfgs[:kept]})
    timed = []
    tuner.__dict__["do_bench"] = lambda call, quantiles: (timed.append(call), [3.0 - len(timed)] * 3)[-1]
    x = randn(12, generator=torch.Generator().manual_seed(3))
    expected = x * 2
    tuner[(1,)](x, 12)
    assert len(timed) == (0 if kept == 1 else 2)
    assert tuner.best_config is configs[kept - 1]  # (two: the second timed faster)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def _sweep(monkeypatch, kernels, run_and_check):
    """Run ``run_and_check()`` once per kept config of the autotuned ``kernels`` (``#K`` for K up
    to the largest kept count among them; each kernel takes K modulo its own count)."""
    try:
        monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "#0")
        clear_tuning_caches()
        run_and_check()
        counts = {k: kept_config_count(k) for k in kernels}
        for k in range(1, max(counts.values())):
            monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", f"#{k}")
            clear_tuning_caches()
            run_and_check()
    finally:
        clear_tuning_caches()  # no later test may inherit a '#K' choice
    return counts


@pytest.mark.gpu
def test_every_gemm_config(monkeypatch):
    g = torch.Generator().manual_seed(3)
    dt = torch.bfloat16
    cases = []
    for k in (200, 256):  # K = 200 is "unaligned" (only BLOCK_K 32 tiles); K = 256 keeps the 64-deep ones
        a, w, bias = (randn(93, k, dtype=dt, generator=g), randn(135, k, dtype=dt, generator=g),
                      randn(135, dtype=dt, generator=g))
        wg, res = randn(2 * 71, k, dtype=dt, generator=g), randn(93, 71, dtype=dt, generator=g)
        cases.append((a, w, bias, wg, res, matmul_reference(a, w, bias, activation="gelu"),
                      matmul_reference(a, wg, activation="swiglu", residual=res), matmul_reference(a, w)))

    def check():
        for a, w, bias, wg, res, ref, ref_g, ref_p in cases:
            k = a.shape[1]
            assert_close(matmul(a, w), ref_p, dt, rtol=OUT_TOL, msg=f"plain K={k}")
            assert_close(matmul(a, w, bias, activation="gelu"), ref, dt, rtol=OUT_TOL, msg=f"bias+gelu K={k}")
            assert_close(matmul(a, wg, activation="swiglu", residual=res), ref_g, dt, rtol=OUT_TOL,
                         msg=f"swiglu+residual K={k}")

    assert _sweep(monkeypatch, ["_gemm_kernel"], check)["_gemm_kernel"] >= 8


@pytest.mark.gpu
def test_every_grouped_config(monkeypatch):
    g = torch.Generator().manual_seed(4)
    dt = torch.bfloat16
    offsets = [0, 37, 37, 120, 121, 190]  # an empty group, a one-row group, ragged tails
    cases = []
    for k in (96, 256):  # K = 96 is "unaligned" for 64-deep tiles; K = 256 keeps them
        x, w, wp = (randn(197, k, dtype=dt, generator=g), randn(3, 2 * 72, k, dtype=dt, generator=g),
                    randn(3, 88, k, dtype=dt, generator=g))
        dy = randn(197, 80, dtype=dt, generator=g)
        ref_w = torch.zeros(3, 80, k, dtype=torch.float64, device=DEVICE)
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            ref_w[i % 3] += dy[lo:hi].double().t() @ x[lo:hi].double()
        cases.append((x, w, wp, dy, grouped_matmul_reference(x, w, offsets, activation="swiglu"),
                      grouped_matmul_reference(x, wp, offsets), ref_w))

    def check():
        for x, w, wp, dy, ref, ref_p, ref_w in cases:
            k = x.shape[1]
            assert_close(grouped_matmul(x, w, offsets, activation="swiglu"), ref, dt, rtol=OUT_TOL,
                         msg=f"grouped swiglu K={k}")
            assert_close(grouped_matmul(x, wp, offsets), ref_p, dt, rtol=OUT_TOL, msg=f"grouped plain K={k}")
            assert_close(grouped_wgrad(dy, x, offsets, 3), ref_w, dt, rtol=OUT_TOL, msg=f"grouped wgrad K={k}")

    counts = _sweep(monkeypatch, ["_grouped_gemm_kernel", "_grouped_wgrad_kernel"], check)
    assert counts["_grouped_gemm_kernel"] >= 6 and counts["_grouped_wgrad_kernel"] >= 2, counts


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_flash_config(monkeypatch, head_dim, causal):
    g = torch.Generator().manual_seed(5 + head_dim)
    dt = torch.bfloat16
    q = randn(2, 203, 4, head_dim, dtype=dt, generator=g)
    k, v = randn(2, 203, 2, head_dim, dtype=dt, generator=g), randn(2, 203, 2, head_dim, dtype=dt, generator=g)
    do = randn(2, 203, 4, head_dim, dtype=dt, generator=g)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, _ = attention_reference(q64, k64, v64, causal=causal)
    ro.backward(do.double())
    do_rms = do.double().pow(2).mean().sqrt().item()

    def check():
        out, lse = flash_attention_forward(q, k, v, causal=causal)
        assert_close(out, ro.detach(), dt, rtol=OUT_TOL, msg="flash out")
        grads = [(f"{name} {mode}", got, ref) for mode in ("separate", "atomic") for name, got, ref in zip(
            "dq dk dv".split(), flash_attention_backward(do, q, k, v, out, lse, causal=causal, dq_mode=mode),
            (q64.grad, k64.grad, v64.grad))]
        for name, got, ref in grads:
            # absolute error scales with |dout| as well (as in test_attention_flash): the backward's
            # delta = rowsum(dout * out) reads the bf16 output (rounded once there, and its
            # probabilities once before the PV product), an error of ~2^-8 * |dout| |out| sqrt(d)
            # that dq carries as scale * d_delta * (P @ K), whatever dq's own size. Causal rows with
            # one or two visible keys have a dq that nearly cancels (2.5% of the tensor's RMS on
            # row 1 here), so an atol of GRAD_TOL * RMS(dq) alone failed 6 of 207872 elements
            # (|err| 1.1e-2 against 7.6e-3, on row 1) on the H100; emulating these roundings in
            # torch, no kernel involved, gives the same size on causal rows 1-10 (8.8e-3 at d 128,
            # 1.6e-2 at d 64); GRAD_TOL * RMS(dout) = 4e-2.
            scale = max(ref.pow(2).mean().sqrt().item(), do_rms)
            assert_close(got, ref, dt, rtol=GRAD_TOL, atol=GRAD_TOL * scale, msg=name)

    _sweep(monkeypatch, ["_attn_fwd_kernel", "_attn_bwd_kernel"], check)
