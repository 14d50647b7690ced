"""The compile check (``python -m benchmarks compile``): its fast subset compiles, through the
shipped launchers, every kernel family for sm_90 without a GPU, in a subprocess with
``TRITON_INTERPRET`` unset (this test process runs the interpreter). Asserts no compile failure,
no launchable variant over the shared-memory limit, and that every autotuned kernel's prune
estimate agrees with the compiler's shared memory."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# under pytest-xdist (make gpu-test) the module's tests share one worker, so the fast subset
# (a compile subprocess of its own, one process per core) is compiled once
pytestmark = pytest.mark.xdist_group("compile")
#: prune estimate vs the compiler's shared memory, for every autotuned kernel (GEMMs, flash attention)
ESTIMATE_TOLERANCE = 0.05
#: the Triton release benchmarks/results/compile_sm90.md and compile_sm80.md were compiled with
TABLE_RELEASE = (3, 9)


@pytest.fixture(scope="module")
def fast_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "fast.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSEDPAR_COMPILE_CACHE"] = str(out.parent / "cache")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "compile", "--arch", "sm_90", "--subset", "fast",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if out.exists() else []


def test_fast_subset_compiles_without_failures(fast_rows):
    proc, rows = fast_rows
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert rows and not [r for r in rows if r["error"]]
    assert not [r for r in rows if r["decision"] != "pruned" and r["over_smem"]]


def test_fast_subset_covers_every_launcher(fast_rows):
    _, rows = fast_rows
    kernels = {r["kernel"] for r in rows}
    assert {"gemm_kernel", "persistent_gemm_kernel", "grouped_gemm_kernel", "grouped_wgrad_kernel",
            "rmsnorm_fwd_kernel", "rmsnorm_bwd_kernel", "route_count_kernel", "route_scatter_kernel",
            "permute_kernel", "combine_kernel", "combine_bwd_kernel", "topk_route_kernel", "topk_route_bwd_kernel",
            "grouped_bias_grad_kernel",
            "attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel", "fp8_gemm_kernel",
            "quant_blocks_kernel", "ce_stats_kernel", "ce_dlogits_kernel"} <= kernels
    assert all(r["regs"] and r["mma"] for r in rows if not r["error"])
    assert {r["mma"] for r in rows if r["kernel"] == "gemm_kernel"} >= {"wgmma"}
    assert {r["mma"] for r in rows if r["kernel"] == "fp8_gemm_kernel"} == {"wgmma"}  # fp8 wgmma


def test_prune_estimates_match_the_compiler(fast_rows):
    _, rows = fast_rows
    checked = [r for r in rows if r["estimate"] is not None]
    assert {r["kernel"] for r in checked} >= {"gemm_kernel", "persistent_gemm_kernel", "grouped_gemm_kernel",
                                              "grouped_wgrad_kernel", "attn_fwd_kernel", "attn_bwd_dq_kernel",
                                              "attn_bwd_dkdv_kernel", "ce_stats_kernel", "ce_dlogits_kernel"}
    off = [(r["kernel"], r["config"], r["estimate"], r["shared"]) for r in checked
           if abs(r["estimate"] - r["shared"]) > ESTIMATE_TOLERANCE * r["shared"]]
    assert not off, off


def recorded_spills(table_path: str) -> list:
    """``(kernel, dtype, config, {cases}, spill bytes)`` of each launchable row of a committed
    table (``| family | kernel | dtype | config | decision | estimate | shared | est_err | regs |
    spill | mma | grid_ok | cases |``)."""
    out = []
    with open(table_path) as f:
        for line in f:
            p = [x.strip() for x in line.strip().strip("|").split(" | ")]
            if len(p) == 13 and line.startswith("| ") and p[4] != "pruned" and p[9].isdigit():
                out.append((p[1], p[2], p[3], set(p[12].split("; ")), int(p[9])))
    return out


def test_no_spills(fast_rows):
    """bf16 GEMMs (every epilogue), persistent and grouped GEMMs, RMSNorm (hidden 65536 too, the
    looped kernels), the MoE kernels and flash attention (forward, dQ, dK/dV) at LLM shapes: no
    launchable variant spills with the Triton release of the committed tables (TABLE_RELEASE).
    Another release allocates registers differently: there a spill must be exactly one its own
    committed table records (compile_sm90_triton36.md for the GPU machines' 3.6), and a release
    without a table must not spill at all."""
    import triton

    from fusedpar.kernels.runtime import release

    _, rows = fast_rows
    assert {"rmsnorm_fwd_looped_kernel", "rmsnorm_bwd_looped_kernel"} <= {r["kernel"] for r in rows}
    spills = [(r["kernel"], r["dtype"], r["config"].strip(), r["cases"], r["spill"]) for r in rows
              if r["decision"] != "pruned" and r["spill"]]
    major, minor = release(triton.__version__)
    table = os.path.join(ROOT, "benchmarks", "results", f"compile_sm90_triton{major}{minor}.md")
    if (major, minor) == TABLE_RELEASE or not os.path.exists(table):
        assert not spills, spills
        return
    recorded = recorded_spills(table)
    unexpected = [s for s in spills if not any(r[:3] == s[:3] and set(s[3].split("; ")) <= r[3] and s[4] <= r[4]
                                               for r in recorded)]
    assert not unexpected, (f"spills that {os.path.basename(table)} does not record", unexpected)


def test_release_table_records_its_spills():
    """The Triton 3.6 table (the GPU machines' release) holds the whole sm_90 matrix and records
    exactly the three bf16/fp16 spills its header names."""
    table = os.path.join(ROOT, "benchmarks", "results", "compile_sm90_triton36.md")
    rows = recorded_spills(table)
    spilled = [r for r in rows if r[4] and r[1] in ("bfloat16", "float16")]
    assert len(rows) > 500 and {(r[0], r[2]) for r in spilled} == {("attn_bwd_dkdv_kernel", "32x64x128 w8 s3"),
                                                                   ("gemm_kernel", "64x64x32 w4 s4"),
                                                                   ("grouped_gemm_kernel", "64x64x32 w4 s4")}, spilled
    assert max(r[4] for r in spilled) == 76


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_launch_decisions_match_the_committed_tables(arch):
    """Without compiling (capture only, ~5 s): every variant the launchers can launch over the
    full matrix (every family, shape and dtype, and the fp32 launches once more with TF32 dots:
    dtype "tf32") is in benchmarks/results/compile_{arch}.md with 0 spills (fp32 "ieee": <= 256 B)
    and, for autotuned kernels, a prune estimate within 5% of the compiler's shared memory: the
    prune rules cannot drift from the last full run (sm_80 is not compiled in CI). The fp8 cases
    are reported unsupported on sm_80 (and only there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    table = os.path.join("benchmarks", "results", f"compile_{arch.replace('_', '')}.md")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "compile", "--arch", arch, "--subset", "full",
                           "--precision", "both", "--against", table], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 problem(s)" in proc.stdout and int(proc.stdout.split()[0]) >= 500, proc.stdout[-2000:]
    # fp8 has no tensor cores below compute capability 8.9: its cases are reported, not launched
    assert ("case(s) unsupported on this architecture" in proc.stdout) == (arch == "sm_80"), proc.stdout[-2000:]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_flash_estimates_match_the_committed_tables(arch):
    """The flash-attention prune rule's shared memory against the compiler's figures recorded in
    benchmarks/results/compile_{arch}.md (the full matrix, every dtype; sm_80 is not compiled in
    CI, so this pins its rule to the last full run)."""
    import triton

    from fusedpar.kernels.flash_attention import smem_estimate

    kinds = {"attn_fwd_kernel": "fwd", "attn_bwd_dq_kernel": "dq", "attn_bwd_dkdv_kernel": "dkdv"}
    elem = {"bfloat16": 2, "float16": 2, "float32": 4, "tf32": 4}
    table = os.path.join(ROOT, "benchmarks", "results", f"compile_{arch.replace('_', '')}.md")
    with open(table) as f:
        rows = [line.split(" | ") for line in f if line.startswith("| flash |")]
    checked, tf32 = 0, 0
    for _, kernel, dtype, config, decision, _, shared, *rest in rows:
        if decision == "pruned":
            continue
        kind = kinds[kernel]
        if kind == "dkdv" and rest[-1].strip().strip("|").strip().endswith("dq atomic"):
            kind = "bwd"  # the one-pass backward: the dK/dV kernel with DQ_ATOMIC (cases "... dq atomic")
        tile, warps, stages = config.split()
        tile, _, bdv = tile.partition("/")  # "BMxBNxBD[/BDV]": v's own head dim when it differs
        bm, bn, bd = (int(x) for x in tile.split("x"))
        cfg = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=int(warps[1:]), num_stages=int(stages[1:]))
        est = smem_estimate(kind, cfg, bd, elem[dtype], (int(arch[3]), 0),
                            {"float32": "ieee_fp32", "tf32": "tf32"}.get(dtype, ""), int(bdv) if bdv else None)
        assert abs(est - int(shared)) <= ESTIMATE_TOLERANCE * int(shared), (kernel, dtype, config, est, shared)
        checked += 1
        tf32 += dtype == "tf32"
    assert checked >= 40 and tf32 >= 5, (checked, tf32)
