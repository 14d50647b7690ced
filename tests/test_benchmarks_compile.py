"""The compile check (``python -m benchmarks compile``): its fast subset compiles, through the
shipped launchers, every kernel family for sm_90 without a GPU, in a subprocess with
``TRITON_INTERPRET`` unset (this test process runs the interpreter). Asserts no compile failure,
no launchable variant over the shared-memory limit, and that every autotuned kernel's prune
estimate agrees with the compiler's shared memory. The SASS columns (load path, warpgroup and
mma.sync counts, the main loop) are read from tiny kernels compiled for sm_90 (pointer loads into
a 16-row dot: HMMA; tensor-descriptor loads into a 64-row dot: UTMALDG and HGMMA) and from a
hand-written listing whose main loop only the control-flow graph finds."""
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


def test_fast_subset_reports_the_sass(fast_rows):
    """Every compiled row has the SASS columns, and they agree with the PTX's MMA kind; the fp8
    GEMM runs QGMMA (counted as warpgroup MMAs), the GEMM's wgmma tiles run no mma.sync."""
    _, rows = fast_rows
    rows = [r for r in rows if not r["error"]]
    assert rows and all(r[k] is not None for r in rows for k in ("loads", "utmaldg", "utmastg", "gmma", "mma_sync", "loop"))
    for r in rows:
        what = (r["kernel"], r["config"], r["mma"], r["gmma"], r["mma_sync"], r["loads"], r["loop"])
        assert ("tma" in r["loads"].split("+")) == (r["utmaldg"] > 0), what
        assert {"wgmma": r["gmma"] > 0, "mma.sync": r["gmma"] == 0 < r["mma_sync"],
                "-": r["gmma"] == r["mma_sync"] == 0}[r["mma"]], what
        if r["mma"] != "-":  # every MMA kernel loops over its contraction dimension
            assert r["loop"].split("/")[1] in ("wgmma", "mma.sync", "wgmma+mma.sync"), what
    fp8 = [r for r in rows if r["kernel"] == "fp8_gemm_kernel"]
    assert fp8 and all(r["gmma"] > 0 for r in fp8)
    assert all(r["mma_sync"] == 0 for r in rows if r["kernel"] == "gemm_kernel" and r["mma"] == "wgmma")


def test_fast_subset_covers_every_launcher(fast_rows):
    _, rows = fast_rows
    kernels = {r["kernel"] for r in rows}
    assert {"gemm_kernel", "persistent_gemm_kernel", "grouped_gemm_kernel", "grouped_wgrad_kernel",
            "rmsnorm_fwd_kernel", "rmsnorm_bwd_kernel", "route_count_kernel", "route_scatter_kernel",
            "permute_kernel", "combine_kernel", "combine_bwd_kernel", "topk_route_kernel", "topk_route_bwd_kernel",
            "grouped_bias_grad_kernel",
            "attn_fwd_kernel", "attn_bwd_kernel", "fp8_gemm_kernel",
            "quant_blocks_kernel", "ce_stats_kernel", "ce_dlogits_kernel"} <= kernels
    assert all(r["regs"] and r["mma"] for r in rows if not r["error"])
    assert {r["mma"] for r in rows if r["kernel"] == "gemm_kernel"} >= {"wgmma"}
    assert {r["mma"] for r in rows if r["kernel"] == "fp8_gemm_kernel"} == {"wgmma"}  # fp8 wgmma


def test_prune_estimates_match_the_compiler(fast_rows):
    _, rows = fast_rows
    checked = [r for r in rows if r["estimate"] is not None]
    assert {r["kernel"] for r in checked} >= {"gemm_kernel", "persistent_gemm_kernel", "grouped_gemm_kernel",
                                              "grouped_wgrad_kernel", "attn_fwd_kernel", "attn_bwd_kernel",
                                              "ce_stats_kernel",
                                              "ce_dlogits_kernel"}
    off = [(r["kernel"], r["config"], r["estimate"], r["shared"]) for r in checked
           if abs(r["estimate"] - r["shared"]) > ESTIMATE_TOLERANCE * r["shared"]]
    assert not off, off


def recorded_spills(table_path: str) -> list:
    """``(kernel, dtype, config, {cases}, spill bytes)`` of each launchable compiled row of a
    committed table (its columns read from the header: with or without the SASS columns)."""
    from benchmarks.compile import read_table

    return [(r["kernel"], r["dtype"], r["config"], set(r["cases"].split("; ")), int(r["spill"]))
            for r in read_table(table_path) if r["decision"] != "pruned" and r["spill"].isdigit()]


def test_no_spills(fast_rows):
    """bf16 GEMMs (every epilogue), persistent and grouped GEMMs, RMSNorm (hidden 65536 too, the
    looped kernels), the MoE kernels and flash attention (forward, backward) at LLM shapes: no
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
    exactly the one bf16/fp16 spill its header names (RMSNorm's blockwise fp8 output at a test
    shape: none in the GEMMs, none in the flash backward)."""
    table = os.path.join(ROOT, "benchmarks", "results", "compile_sm90_triton36.md")
    rows = recorded_spills(table)
    spilled = [r for r in rows if r[4] and r[1] in ("bfloat16", "float16")]
    assert len(rows) > 500 and {(r[0], r[2]) for r in spilled} == {("rmsnorm_fwd_kernel", "16x256 w4 s3")}, spilled
    assert max(r[4] for r in spilled) == 24


@pytest.mark.parametrize("table", ["compile_sm90.md", "compile_sm90_triton36.md"])
def test_hopper_rows_multiply_on_warpgroup_mmas(table):
    """The committed sm_90 tables (Triton 3.9 and the GPU machines' 3.6): every launchable variant
    on TMA loads (the GEMM core's, issue 40) multiplies with HGMMA / QGMMA only, no mma.sync, and
    spills nothing; every 16-bit flash backward variant (issue 41) at head dims 64, 128 and MLA's
    192 / 128 (every case but Gemma-2's d 256, whose last-resort 32-row tile runs mma.sync) too.
    A kernel edit that moved a product onto mma.sync shows here once the tables are regenerated."""
    from benchmarks.compile import read_table

    rows = [r for r in read_table(os.path.join(ROOT, "benchmarks", "results", table)) if r["decision"] != "pruned"]
    tma = [r for r in rows if r["loads"].startswith("tma")]
    bwd = [r for r in rows if r["kernel"] == "attn_bwd_kernel" and r["dtype"] in ("bfloat16", "float16")
           and r["config"].split()[0].split("x")[2] in ("64", "128", "256/128")]
    assert len(tma) > 300 and len(bwd) > 100, (len(tma), len(bwd))
    bad = [(r["kernel"], r["dtype"], r["config"], r["cases"]) for r in tma + bwd
           if int(r["mma_sync"]) or not int(r["gmma"]) or (r in tma and int(r["spill"]))]
    assert not bad, bad


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

    kinds = {"attn_fwd_kernel": "fwd", "attn_bwd_kernel": "bwd"}
    elem = {"bfloat16": 2, "float16": 2, "float32": 4, "tf32": 4}
    from benchmarks.compile import read_table

    table = os.path.join(ROOT, "benchmarks", "results", f"compile_{arch.replace('_', '')}.md")
    rows = [r for r in read_table(table) if r["family"] == "flash"]
    checked, tf32 = 0, 0
    for r in rows:
        kernel, dtype, config, decision, shared = r["kernel"], r["dtype"], r["config"], r["decision"], r["shared"]
        if decision == "pruned":
            continue
        kind = kinds[kernel]
        if kind == "bwd" and r["cases"].endswith("dq atomic"):
            kind = "bwd_atomic"  # the one-pass backward: the kernel with DQ_ATOMIC (cases "... dq atomic")
        tile, warps, stages = config.split()
        tile, _, bdv = tile.partition("/")  # "BMxBNxBD[/BDV]": v's own head dim when it differs
        bm, bn, bd = (int(x) for x in tile.split("x"))
        cfg = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=int(warps[1:]), num_stages=int(stages[1:]))
        est = smem_estimate(kind, cfg, bd, elem[dtype], (int(arch[3]), 0),
                            {"float32": "ieee_fp32", "tf32": "tf32"}.get(dtype, ""), int(bdv) if bdv else None,
                            accumulate="ring step" in r["cases"])  # the ring's accumulate mode
        assert abs(est - int(shared)) <= ESTIMATE_TOLERANCE * int(shared), (kernel, dtype, config, est, shared)
        checked += 1
        tf32 += dtype == "tf32"
    assert checked >= 40 and tf32 >= 5, (checked, tf32)


#: a persistent kernel's shape in ``cuobjdump -sass`` form: a TMA load before the tile loop, the K
#: loop (TMA loads, a wgmma, a barrier wait whose spin loop sits out of line after EXIT and branches
#: back into the K loop), then an epilogue with a pointer load inside the tile loop
PERSISTENT_SASS = """
        code for sm_90a
                Function : tiny_kernel
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   S2R R0, SR_CTAID.X ;                        /* 0x0000000000007919 */
                                                                               /* 0x000e220000002500 */
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;                   /* 0x00000008040075b4 */
        /*0020*/                   IMAD R1, R0, 0x2, RZ ;                      /* 0x0000000200017824 */
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R1 ; /* 0x0000000000007919 */
        /*0040*/              @!P0 BRA 0xc0 ;                                  /* 0x0000000000007919 */
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ; /* 0x0000000000007919 */
        /*0060*/               @P1 UTMALDG.2D [UR8], [UR4] ;                   /* 0x0000000000007919 */
        /*0070*/               @P2 BRA 0x30 ;                                  /* 0x0000000000007919 */
        /*0080*/                   LDG.E R2, desc[UR6][R4.64] ;                /* 0x0000000000007919 */
        /*0090*/                   STG.E desc[UR6][R4.64], R2 ;                /* 0x0000000000007919 */
        /*00a0*/               @P3 BRA 0x20 ;                                  /* 0x0000000000007919 */
        /*00b0*/                   EXIT ;                                      /* 0x0000000000007919 */
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R1 ; /* 0x0000000000007919 */
        /*00d0*/              @!P0 BRA 0xc0 ;                                  /* 0x0000000000007919 */
        /*00e0*/                   BRA 0x50 ;                                  /* 0x0000000000007919 */
        /*00f0*/                   BRA 0xf0;                                   /* 0x0000000000007919 */
"""


#: a flattened persistent loop (tile and K loop in one): the epilogue, a conditional region that
#: loads the bias and stores the tile, runs inside the loop on a tile's last K step
FLATTENED_SASS = """
                Function : flat_kernel
        /*0000*/                   S2R R0, SR_CTAID.X ;
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R1 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0040*/               @P1 UTMALDG.2D [UR8], [UR4] ;
        /*0050*/               @P0 BRA 0x90 ;
        /*0060*/                   LDG.E R2, desc[UR6][R4.64] ;
        /*0070*/                   STG.E desc[UR6][R4.64], R2 ;
        /*0080*/                   NOP ;
        /*0090*/               @P2 BRA 0x20 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_sass_main_loop_from_the_control_flow_graph():
    """The main loop is the innermost natural loop with an MMA or a TMA load: the K loop with its
    out-of-line spin wait, not the tile loop around it (whose epilogue loads through a pointer), nor
    an address range that runs from the spin wait's return over EXIT; in a flattened loop, less the
    conditional region that stores to global memory (the epilogue), not a conditional region that
    only loads. A kernel without a loop has no main loop."""
    from benchmarks._sass import summarize

    assert summarize(FLATTENED_SASS) == dict(loads="tma+ldg", utmaldg=2, utmastg=0, gmma=1, mma_sync=0, loop="tma/wgmma")
    assert summarize(FLATTENED_SASS.replace("STG.E desc[UR6][R4.64], R2", "FMUL R2, R2, R2"))["loop"] == "tma+ldg/wgmma"

    assert summarize(PERSISTENT_SASS) == dict(loads="tma+ldg", utmaldg=2, utmastg=0, gmma=1, mma_sync=0, loop="tma/wgmma")
    straight = PERSISTENT_SASS.replace("@P2 BRA 0x30", "NOP").replace("@P3 BRA 0x20", "NOP").replace("BRA 0x50", "EXIT")
    assert summarize(straight)["loop"] == "-"
    sync = PERSISTENT_SASS.replace("HGMMA.64x64x16.F32.BF16", "HMMA.16816.F32.BF16").replace("UTMALDG.2D", "LDGSTS.E.128")
    assert summarize(sync) == dict(loads="ldgsts+ldg", utmaldg=0, utmastg=0, gmma=0, mma_sync=1, loop="ldgsts/mma.sync")


#: compiles two tiny kernels for sm_90 (no GPU) and writes their SASS columns as JSON to argv[1]
TINY_KERNELS = '''
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks._sass import disassemble, summarize_functions

@triton.jit
def pointer_dot(a, b, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(tl.load(a + rm[:, None] * K + k + rk[None, :]), tl.load(b + (k + rk[:, None]) * BN + rn[None, :]), acc)
    tl.store(c + rm[:, None] * BN + rn[None, :], acc)

@triton.jit
def descriptor_dot(a, b, c, bias, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    da = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    db = tl.make_tensor_descriptor(b, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    dc = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(da.load([0, k]), db.load([k, 0]), acc)
    dc.store([0, 0], (acc + tl.load(bias + tl.arange(0, BN))[None, :]).to(tl.bfloat16))

cases = {"pointer_dot 16x64x32": (pointer_dot, dict(a="*bf16", b="*bf16", c="*fp32", K="i32"), dict(BM=16, BN=64, BK=32)),
         "descriptor_dot 64x64x32": (descriptor_dot, dict(a="*bf16", b="*bf16", c="*bf16", bias="*fp32", M="i32", N="i32",
                                                          K="i32"), dict(BM=64, BN=64, BK=32))}
aligned = lambda signature: {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}  # vectorised loads
cubins = [triton.compile(ASTSource(fn, signature, constexprs, aligned(signature)), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=2)).asm["cubin"] for fn, signature, constexprs in cases.values()]
out = {name: summarize_functions(funcs) for name, funcs in zip(cases, disassemble(cubins, 90))}
# nvdisasm rejects the target "SM1": the fallback disassembles each cubin with cuobjdump -sass
out["cuobjdump"] = [summarize_functions(funcs) for funcs in disassemble(cubins, 1)]
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
'''


@pytest.fixture(scope="module")
def tiny_sass(tmp_path_factory):
    d = tmp_path_factory.mktemp("sass")
    (d / "tiny.py").write_text(TINY_KERNELS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(d / "tiny.py"), str(d / "out.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((d / "out.json").read_text())


def test_sass_of_tiny_kernels_compiled_for_sm90(tiny_sass):
    """Pointer loads into a 16-row dot: cp.async (LDGSTS) and mma.sync (HMMA); tensor-descriptor
    loads into a 64-row dot: TMA (UTMALDG, the store UTMASTG) and warpgroup MMAs (HGMMA), the
    epilogue's pointer load (the bias) outside the main loop. The batched raw disassembly reads
    what ``cuobjdump -sass`` of each cubin reads."""
    ptr, desc = tiny_sass["pointer_dot 16x64x32"], tiny_sass["descriptor_dot 64x64x32"]
    assert tiny_sass["cuobjdump"] == [ptr, desc]
    assert ptr["gmma"] == 0 < ptr["mma_sync"] and ptr["utmaldg"] == 0 and ptr["loop"] == "ldgsts/mma.sync", ptr
    assert desc["mma_sync"] == 0 < desc["gmma"] and desc["utmaldg"] > 0 and desc["utmastg"] == 1, desc
    assert desc["loads"] == "tma+ldg" and desc["loop"] == "tma/wgmma", desc


def test_tables_old_and_new_and_the_requirements(tmp_path):
    """A table written now round-trips its SASS columns (the committed tables hold them on every
    row); a table written before them reads as unknown there, which ``--require-tma`` / ``--require-wgmma`` report; the
    requirements pass only on a main loop of TMA loads / warpgroup MMAs, and a pattern that
    matches no launchable sm_90 variant is reported."""
    from benchmarks.compile import COLUMNS, markdown, read_table, table_rows, unmet_requirements, with_recorded_sass

    row = dict(arch="sm_90", family="gemm", kernel="gemm_kernel", dtype="bfloat16", config="128x128x64 w8 s4",
               decision="kept", estimate=131072, shared=131072, est_err=0.0, regs=128, spill=0, mma="wgmma",
               loads="tma+ldg", utmaldg=3, utmastg=0, gmma=4, mma_sync=0, loop="tma/wgmma", grid_ok=True,
               cases="llama3-8b qkv+bias", error=None)
    (tmp_path / "t.md").write_text(markdown([row, {**row, "config": "64x64x32 w4 s4", "loop": "ldgsts/mma.sync"}], "sm_90"))
    new = table_rows(str(tmp_path / "t.md"))
    assert list(next(iter(new.values()))) == COLUMNS and len(new) == 2
    captured = [{**row, "loop": None}, {**row, "config": "64x64x32 w4 s4", "loop": None}]
    recorded = with_recorded_sass(captured, new)
    assert [r["loop"] for r in recorded] == ["tma/wgmma", "ldgsts/mma.sync"]
    assert not unmet_requirements(recorded[:1], dict(require_tma="^gemm_kernel$", require_wgmma="gemm"))
    unmet = unmet_requirements(recorded, dict(require_tma="gemm_kernel", require_wgmma=None))
    assert len(unmet) == 1 and "ldgsts/mma.sync" in unmet[0] and "64x64x32" in unmet[0], unmet
    assert len(unmet_requirements(recorded, dict(require_tma=None, require_wgmma="gemm"))) == 1
    assert "matches no launchable" in unmet_requirements(recorded, dict(require_tma="nothing", require_wgmma=None))[0]
    # a table written before the SASS columns: its rows have no such keys
    older = [c for c in COLUMNS if c not in ("loads", "utmaldg", "utmastg", "gmma", "mma_sync", "loop")]
    (tmp_path / "old.md").write_text("| " + " | ".join(older) + " |\n|" + "---|" * len(older) + "\n| "
                                     + " | ".join(str(row[c]) for c in older) + " |\n")
    old = read_table(str(tmp_path / "old.md"))
    assert len(old) == 1 and "loop" not in old[0] and old[0]["cases"] == row["cases"]
    for arch in ("sm90", "sm80"):  # the committed tables: every row with its SASS
        rows = read_table(os.path.join(ROOT, "benchmarks", "results", f"compile_{arch}.md"))
        assert len(rows) > 500 and all(r.get("loop") for r in rows), arch
    unknown = unmet_requirements(with_recorded_sass(captured[:1], {}), dict(require_tma="gemm", require_wgmma=None))
    assert len(unknown) == 1 and "unknown" in unknown[0], unknown


def test_cache_entries_without_the_sass_fields_are_compiled_again(tmp_path):
    from benchmarks._capture import RESULT_FIELDS, cached

    full = {k: 0 for k in RESULT_FIELDS}
    (tmp_path / "new.json").write_text(json.dumps(full))
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in full.items() if k != "loop"}))
    assert cached(str(tmp_path / "new.json")) == full
    assert cached(str(tmp_path / "old.json")) is None and cached(str(tmp_path / "none.json")) is None
