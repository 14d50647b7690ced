"""The benchmark CLI runs (smoke mode off GPU) and writes JSON with an environment line."""
import json

import pytest

from _utils import INTERPRETED


def _err_bound(row, fp32_bound, common):
    """The bound on a row's ``max_rel_err``: ``fp32_bound`` for an fp32 row (the CPU smoke runs,
    and GPU runs asked for fp32); a bf16 / fp16 row (the GPU default, kept where fp32 does not fit:
    the attention variants' score-option tiles are built for 16-bit operands, their fp32 ones
    spill) rounds inputs, probabilities and outputs to an 8 / 11-bit mantissa, so it gets the
    benchmark's own per-dtype tolerance (``_common.TOLERANCES``: bf16 5e-2, fp16 1e-2), which
    ``check_close`` enforced before timing."""
    return fp32_bound if row["dtype"] == "float32" else common.TOLERANCES[row["dtype"]]


@pytest.fixture
def bench_main(monkeypatch):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)
    from benchmarks.__main__ import main

    return main


def test_matmul_cli_json(bench_main, tmp_path, capsys):
    out = tmp_path / "m.json"
    # fp32 on every device (the GPU default, bf16, rounds to 8 bits: ~3e-3 here, not within 1e-4)
    assert bench_main(["matmul", "--shapes", "17x9x33", "--epilogue", "swiglu", "--dtype", "fp32", "--fp8-out",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["results"]["matmul"][0]
    assert (row["M"], row["N"], row["K"], row["dtype"]) == (17, 9, 33, "float32")
    assert row["max_rel_err"] < 1e-4 and row["fusedpar_ms"] > 0 and row["torch_ms"] > 0
    # the fused e4m3 output's bits were checked equal to matmul + quantize_e4m3 before timing
    assert row["fp8_out_ms"] > 0 and row["unfused_fp8_ms"] > 0 and row["fp8_out_speedup"] > 0
    assert row["loads"] in ("tma", "pointer") and row["config"]  # what ran (gemm_loads.last_launch)
    assert "torch" in data["env"] and "triton" in data["env"]
    text = capsys.readouterr().out
    assert "| M | N | K |" in text


def test_bad_shape_argument(bench_main):
    with pytest.raises(SystemExit):
        bench_main(["matmul", "--shapes", "17x9"])


@pytest.fixture
def common(monkeypatch):
    import os

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import _common

    return _common


def _off_by(dtype, err, ref_dtype=None):
    """A reference of max magnitude 1 and a result that differs from it by ``err`` in one element."""
    import torch

    ref = torch.zeros(64, dtype=ref_dtype or dtype)
    ref[0] = 1.0
    ours = ref.to(dtype, copy=True)
    ours[5] = err
    return ours, ref


# (dtype of ours, of the reference, error, passes): each dtype's tolerance sits between its cases
CHECK_CASES = [
    ("float32", "float32", 1e-6, True),
    ("float32", "float32", 1e-2, False),  # was accepted with one 5e-2 tolerance for every dtype
    ("float32", "float32", 1e-3, False),
    ("float16", "float16", 4e-3, True),
    ("float16", "float16", 3e-2, False),
    ("bfloat16", "bfloat16", 3e-2, True),
    ("bfloat16", "bfloat16", 1e-1, False),
    ("bfloat16", "float32", 3e-2, True),  # a bf16 result against an fp32 reference: bf16's tolerance
    ("float32", "float16", 4e-3, True),
]


@pytest.mark.parametrize("dtype,ref_dtype,err,passes", CHECK_CASES,
                         ids=[f"{a}-vs-{b}-err{e:g}" for a, b, e, _ in CHECK_CASES])
def test_check_close_per_dtype_tolerance(common, dtype, ref_dtype, err, passes):
    import torch

    ours, ref = _off_by(getattr(torch, dtype), err, getattr(torch, ref_dtype))
    if passes:
        assert common.check_close(ours, ref) == pytest.approx(err, rel=1e-2)
    else:
        with pytest.raises(AssertionError, match="relative max error"):
            common.check_close(ours, ref)


def test_check_close_tf32_and_explicit_tolerances(common, monkeypatch):
    import torch

    fp32 = common.default_tolerance(torch.float32, tf32=False)
    tf32 = common.default_tolerance(torch.float32, tf32=True)
    assert fp32 < tf32 < 1e-2 < common.default_tolerance(torch.bfloat16)
    assert common.default_tolerance(torch.float16) < common.default_tolerance(torch.bfloat16)
    monkeypatch.setattr(common, "tf32_enabled", lambda: True)
    ours, ref = _off_by(torch.float32, 1e-3)
    assert common.check_close(ours, ref) == pytest.approx(1e-3, rel=1e-3)  # tf32 rounding allowed
    with pytest.raises(AssertionError):
        common.check_close(*_off_by(torch.float32, 1e-2))  # an fp32 result off by 1e-2 still fails
    # an explicit tolerance wins; tol=0.0 means exact
    assert common.check_close(*_off_by(torch.float32, 1e-2), tol=2e-2) == pytest.approx(1e-2)
    assert common.check_close(ref, ref.clone(), tol=0.0) == 0.0
    with pytest.raises(AssertionError):
        common.check_close(ours, ref, tol=0.0)
    with pytest.raises(AssertionError):
        common.check_close(torch.full((3,), float("nan")), torch.ones(3))


def test_train_cli_smoke(bench_main, tmp_path):
    """The training-throughput benchmark runs the shipped Transformer (dense and MoE) for real steps."""
    out = tmp_path / "t.json"
    assert bench_main(["train", "--steps", "1", "--warmup", "0", "--seq", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["train"]
    assert [r["variant"] for r in rows] == ["dense", "moe"]
    for r in rows:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["loss"] > 0
        assert r["matmul_params"] > 0 and r["model_TFLOPs"] > 0


def test_linear_ce_cli_smoke(bench_main, tmp_path):
    """The fused linear cross entropy against the materialised logits + loss, the shrunk head on
    every device (a GPU's default is the two Llama-3 heads, in bf16)."""
    out = tmp_path / "l.json"
    assert bench_main(["linear_ce", "--tp", "2", "--heads", "smoke", "--chunk-tokens", "16", "--dtype", "fp32",
                       "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]["linear_ce"]
    assert (row["tokens"], row["vocab"], row["tp"], row["chunk_tokens"]) == (48, 250, 2, 16)
    assert row["fused_ms"] > 0 and row["materialised_ms"] > 0 and row["max_rel_err"] < 1e-4
    assert row["stats_loads"] in ("tma", "pointer") and row["dlogits_config"]  # what its GEMMs ran
    if INTERPRETED:
        assert row["fused_peak_MiB"] is None and row["materialised_peak_MiB"] is None  # measured on a GPU only
        assert row["peak_ratio_vs_materialised"] is None
    else:
        assert row["fused_peak_MiB"] > 0 and row["materialised_peak_MiB"] > 0
        assert row["peak_ratio_vs_materialised"] == row["fused_peak_MiB"] / row["materialised_peak_MiB"]


def _run_file(path, mode, date, rows, **extra_env):
    env = {"date": date, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "mode": mode, **extra_env}
    path.write_text(json.dumps({"env": env, "results": rows}))


def test_attention_cli_compares_load_paths(bench_main, common, tmp_path):
    """``attention --compare-loads``: the backward on the path it takes (``bwd_loads``; the
    interpreter takes descriptors at head_dim 16) and on pointer loads, each checked against SDPA
    before timing; without the flag the row has no pointer columns."""
    out = tmp_path / "a.json"
    assert bench_main(["attention", "--causal", "yes", "--compare-loads", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]["attention"]
    assert row["bwd_loads"] in ("tma", "pointer") and (row["bwd_loads"] == "tma" or not INTERPRETED)
    assert row["bwd_pointer_ms"] > 0 and row["bwd_tma_speedup"] > 0
    assert row["max_rel_err"] < _err_bound(row, 1e-5, common)
    assert bench_main(["attention", "--causal", "no", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]["attention"]
    assert "bwd_loads" in row and "bwd_pointer_ms" not in row


def test_attention_variants_cli_smoke(bench_main, common, tmp_path):
    """Each variant row (window, sinks, MLA 24/16 on CPU, softcap) is checked against its baseline's
    result (SDPA with the equivalent mask, or the float64 reference for softcap) before timing."""
    out = tmp_path / "v.json"
    assert bench_main(["attention_variants", "--seq", "24", "--window", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["attention_variants"]
    assert [r["variant"] for r in rows] == ["window", "sinks", "mla", "softcap"]
    assert all(r["max_rel_err"] < _err_bound(r, 1e-5, common) and r["fwd_ms"] > 0 and r["baseline_bwd_ms"] > 0
               for r in rows), rows
    assert rows[2]["qk_head_dim"] != rows[2]["v_head_dim"] and rows[0]["window"] == 5
    with pytest.raises(ValueError, match="--variants must be a comma-separated subset"):
        bench_main(["attention_variants", "--variants", "window,alibi"])


def test_report_from_gpu_runs_only(bench_main, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    attn = [{"seq": 4096, "fwd_ratio_vs_sdpa": 1.07, "bwd_ratio_vs_sdpa": 0.81}]
    _run_file(results / "h100-attention.json", "compiled (CUDA)", "2026-11-23 10:00 UTC", {"attention": attn})
    _run_file(results / "cpu.json", "CPU smoke (Triton interpreter): numbers are NOT performance",
              "2026-11-23 11:00 UTC", {"matmul": [{"epilogue": "none", "ratio_vs_torch": 123.0}]})
    _run_file(results / "limited.json", "compiled (CUDA)", "2026-11-23 12:00 UTC",
              {"matmul": [{"epilogue": "none", "ratio_vs_torch": 456.0}]}, tune_configs="1")
    (results / "compile_sm90.json").write_text(json.dumps([{"kernel": "not a run file"}]))
    out = tmp_path / "RESULTS.md"
    assert bench_main(["report", "--results", str(results), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## h100-attention.json" in text and "cpu.json" not in text and "123" not in text
    assert "limited.json" not in text and "456" not in text  # autotuners limited: not tuned figures
    assert "fwd_ratio_vs_sdpa 1.07 (≥ 1: met)" in text
    assert "bwd_ratio_vs_sdpa 0.81 (≥ 0.9: MISSED)" in text
    svg = (tmp_path / "results_ratios.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 2 and 'fill="#c33"' in svg


def test_report_without_runs_lists_the_targets(bench_main, tmp_path):
    out = tmp_path / "RESULTS.md"
    assert bench_main(["report", "--results", str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "No GPU run has been recorded yet" in text and "| ring_attention | efficiency_vs_plain | ≥ 0.92 |" in text
    assert not (tmp_path / "results_ratios.svg").exists()


def test_env_line_names_limited_autotuners(common, monkeypatch):
    """A run under FUSEDPAR_TUNE_CONFIGS records it in its env (and the report leaves it out)."""
    import torch

    ctx = common.Context(gpu=False, device=torch.device("cpu"))
    monkeypatch.delenv("FUSEDPAR_TUNE_CONFIGS", raising=False)
    assert "tune_configs" not in common.env_info(ctx)
    monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "1")
    assert common.env_info(ctx)["tune_configs"] == "1"


def test_fp8_matmul_cli_smoke(bench_main, tmp_path):
    """Rowwise and blockwise rows, each checked before timing against ``torch._scaled_mm`` (GPU,
    rowwise) or the float64 product of the dequantised operands; a ragged K (not a multiple of the
    128-wide scale blocks) on every device; N = 24, which ``torch._scaled_mm`` refuses (N and K
    must be multiples of 16; seen on the first GPU run), checked against the float64 product."""
    out = tmp_path / "f.json"
    assert bench_main(["fp8_matmul", "--shapes", "40x32x48", "40x24x48", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["fp8_matmul"]
    assert [(r["N"], r["scaling"]) for r in rows] == [(n, s) for n in (32, 24)
                                                      for s in ("rowwise", "rowwise fast", "blockwise")]
    for r in rows:
        assert (r["M"], r["K"]) == (40, 48)
        assert r["fusedpar_ms"] > 0 and r["bf16_ms"] > 0 and r["max_rel_err"] < 2 ** -7
        assert r["loads"] in ("tma", "pointer") and r["config"]  # what ran (gemm_loads.last_launch)
    # _scaled_mm (GPU) for the rowwise rows whose N it takes, with its fast accumulation for the fast one
    assert [("ratio_vs_scaled_mm" in r) for r in rows] == [not INTERPRETED] * 2 + [False] * 4
    with pytest.raises(SystemExit, match="--scalings"):
        bench_main(["fp8_matmul", "--scalings", "rowwise,tensorwise"])
    # --epilogue swiglu: the fused up-projection epilogue against fp8_matmul + SwiGLU + quantise
    assert bench_main(["fp8_matmul", "--shapes", "40x40x48", "--scalings", "blockwise", "--epilogue", "swiglu",
                       "--json", str(out)]) == 0
    plain, fused = json.loads(out.read_text())["results"]["fp8_matmul"]
    assert fused["epilogue"] == "swiglu+fp8_out" and fused["N"] == 40 and fused["fused_speedup"] > 0
    assert fused["max_rel_err"] < 2 ** -7


def test_ceilings_and_launch_cli_smoke(bench_main, tmp_path):
    """The floors' denominators and the host cost per call run and report positive figures."""
    out = tmp_path / "c.json"
    assert bench_main(["ceilings", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["ceilings"]
    assert [r["ceiling"] for r in rows] == ["copy", "matmul"]
    assert rows[0]["GB_per_s"] > 0 and rows[1]["TFLOPs"] > 0
    out = tmp_path / "h.json"
    assert bench_main(["launch", "--calls", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["launch"]
    assert len(rows) == 5 and all(r["host_us_per_call"] > 0 for r in rows)


def test_launch_stub_kernels(bench_main, tmp_path, capsys):
    """--stub-kernels times the host path alone (no kernel runs) and puts the launches back;
    --profile prints the launcher's functions by their own time per call."""
    import triton

    from fusedpar.kernels.runtime import interpreting

    if interpreting():
        from triton.runtime.interpreter import InterpretedFunction as kernel_class
    else:
        kernel_class = triton.runtime.JITFunction
    run = kernel_class.run
    out = tmp_path / "h.json"
    assert bench_main(["launch", "--stub-kernels", "--calls", "2", "--profile", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["launch"]
    assert len(rows) == 5 and all(r["kernels"] == "stubbed" and r["host_us_per_call"] > 0 for r in rows)
    assert kernel_class.run is run
    printed = capsys.readouterr().out
    profile = printed.split("profile of fusedpar.kernels.matmul 64^3, per call:\n", 1)[1].split("\nnote:", 1)[0]
    assert len(profile.splitlines()) == 3 and all(" us own " in line for line in profile.splitlines()), printed


def test_rmsnorm_cli_smoke(bench_main, tmp_path):
    """The fused norm against torch's, and its fused e4m3 output against norm + quantize_e4m3 (the
    same bits, checked before timing), both recipes, at a ragged hidden size."""
    out = tmp_path / "n.json"
    assert bench_main(["rmsnorm", "--shapes", "9x200", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["rmsnorm"]
    assert [(r["bench"], r.get("recipe")) for r in rows] == [("rms_norm", None), ("rms_norm_fp8", "rowwise"),
                                                             ("rms_norm_fp8", "blockwise")]
    assert all((r["tokens"], r["hidden"]) == (9, 64 if INTERPRETED else 200) for r in rows)
    assert rows[0]["max_rel_err"] < 1e-5 and all(r["fusedpar_ms"] > 0 and r["baseline_ms"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="--shapes"):
        bench_main(["rmsnorm", "--shapes", "9x0"])


def test_launch_stub_driver_measures_the_compiled_path_without_a_gpu(bench_main, tmp_path, monkeypatch):
    """--stub-driver: a process of its own runs Triton's compiled launch path (sm_90 kernels, Triton's
    C launcher) against the stand-in libcuda; every row says how many kernels it launched and its
    cost over the bare launcher's in the same run (above it: the launcher is inside every call)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the stub, Triton's cache: built here
    out = tmp_path / "s.json"
    assert bench_main(["launch", "--stub-driver", "--calls", "2", "--entries", "matmul,all_gather_matmul",
                       "--json", str(out)]) == 0
    rows = {r["entry"]: r for r in json.loads(out.read_text())["results"]["launch"]}
    assert rows["matmul 64^3"]["launches"] == 1 and rows["all_gather_matmul ring tp8"]["launches"] == 8
    assert rows["all_gather_matmul persistent tp8"]["launches"] == 1
    assert all(r["kernels"] == "stub driver" and r["x_floor"] > 1 for r in rows.values()), rows
