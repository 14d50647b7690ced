"""``python -m benchmarks compile --arch sm_90|sm_80|all [--subset fast|full] [--precision ieee|tf32|both] [--json PATH]``:
compile every kernel variant the shipped launchers can launch for an NVIDIA target, without a
GPU, and report registers, spills, shared memory, the MMA kind, what the SASS says and the prune
decision.

The launchers run for real on ``meta`` tensors under :class:`benchmarks._capture.Capture`, so
every constexpr is the compiled-path value and the autotuners' prune rules decide as they would
on the GPU (every config is recorded with its decision; ``kept`` ones are launchable). Exit 1
on a compile failure or a launchable variant over the shared-memory limit; ``--fail-on-spill``
also fails on spills of launchable bf16/fp16 variants. ``--against TABLE`` compiles nothing: it
captures the launches and checks every launchable variant against a committed table (recorded,
prune estimate within 5%, no bf16/fp16 spills, fp32 spills <= 256 B), which is how CI pins the
rules to the sm_80 figures without compiling for sm_80. ``--precision tf32`` captures the fp32
launches of the GEMM, persistent, grouped and flash launchers with
``torch.backends.cuda.matmul.allow_tf32`` set (rows of dtype "tf32"); ``both`` adds that pass.

Columns: ``regs`` / ``spill`` (bytes of spill stores) from ``ptxas -v``, ``shared`` from Triton's
metadata, ``mma`` the MMA kind in the PTX, and from the SASS of the cubin (``cuobjdump -sass``,
:mod:`benchmarks._sass`): ``loads`` the global-load kinds (``tma``: UTMALDG; ``ldgsts``: cp.async
pointer loads into shared memory; ``ldg``: pointer loads into registers; joined by ``+``),
``utmaldg`` / ``utmastg`` the TMA load / store instructions, ``gmma`` the warpgroup MMAs (HGMMA,
QGMMA for fp8), ``mma_sync`` the warp-level ones (HMMA; QMMA is fp8 mma.sync on sm_89), and
``loop``: ``<loads>/<mma kinds>`` of the main loop (the innermost loops holding an MMA or a TMA
load, less a conditional region that stores to global memory, a flattened persistent loop's
epilogue: ``tma/wgmma``, ``ldgsts/wgmma``, ``ldgsts/mma.sync``, ...). Counts are static
instructions.
``--require-tma PATTERN`` / ``--require-wgmma PATTERN`` (a regular expression searched in the
kernel name) fail the check unless every launchable sm_90 variant of a matching kernel loads
only through TMA / multiplies only with warpgroup MMAs in its main loop (with ``--against``: as
the table records it; a table without the SASS columns fails the requirement as unknown).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

FAMILIES = ("gemm", "persistent", "grouped", "moe", "rmsnorm", "flash", "fp8", "linear_ce")
DTYPES = {"fast": ("bfloat16",), "full": ("bfloat16", "float16", "float32")}
#: the families whose kernels run ``tl.dot``: their fp32 launches are captured a second time with
#: ``torch.backends.cuda.matmul.allow_tf32`` set (dtype "tf32": INPUT_PRECISION "tf32")
TF32_FAMILIES = ("gemm", "persistent", "grouped", "flash", "linear_ce")


def _estimates():
    """The prune rules' shared-memory estimate of each autotuned kernel (bytes per program)."""
    from fusedpar.kernels import fp8_gemm, gemm, grouped_gemm, persistent_config

    return {
        "_fp8_gemm_kernel": fp8_gemm.fp8_smem_estimate,
        "_gemm_kernel": gemm.smem_estimate,
        "_ce_stats_kernel": gemm.smem_estimate,  # the GEMM's main loop: the same shared memory
        "_ce_dlogits_kernel": gemm.smem_estimate,
        "persistent_gemm_kernel": persistent_config.smem_estimate,
        "_grouped_gemm_kernel": grouped_gemm.smem_estimate,
        "_grouped_wgrad_kernel": grouped_gemm.wgrad_smem_estimate,
        "_attn_fwd_kernel": flash_smem_estimate("fwd"),
        "_attn_bwd_kernel": flash_smem_estimate("bwd"),
    }


def flash_smem_estimate(kind: str):
    """The shared-memory term of the flash-attention prune rule (kernels/flash_attention.py)."""
    from fusedpar.kernels import flash_attention

    return lambda cfg, named_args, **kwargs: flash_attention.launch_smem_estimate(kind, cfg, named_args, **kwargs)


def dtypes_of(subset: str, precision: str) -> tuple:
    """The dtype passes: the subset's dtypes (``precision`` "ieee"), only "tf32" (fp32 operands
    with TF32 dots) or both."""
    return {"ieee": DTYPES[subset], "tf32": ("tf32",), "both": DTYPES[subset] + ("tf32",)}[precision]


def capture(arch: str, subset: str, families=FAMILIES, match: str = "", precision: str = "ieee"):
    """Run the cases of ``subset`` under a :class:`Capture` for ``arch``; returns its variants
    (each with its family and the cases that launch it). The "tf32" pass runs the fp32 cases of
    :data:`TF32_FAMILIES` with ``torch.backends.cuda.matmul.allow_tf32`` set. A case whose launcher
    refuses the architecture (fp8 below compute capability 8.9) is recorded in ``cap.unsupported``."""
    import torch

    from fusedpar.kernels.fp8 import FP8UnsupportedError

    from ._capture import Capture
    from ._compile_cases import all_cases

    cap = Capture(arch, _estimates(), sample=subset == "fast")
    allow = torch.backends.cuda.matmul.allow_tf32
    with cap:
        for case in all_cases():
            if case.family not in families or (subset == "fast" and not case.fast) or match not in case.name:
                continue
            for dt in dtypes_of(subset, precision):
                if dt == "tf32" and case.family not in TF32_FAMILIES:
                    continue
                torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
                try:
                    with cap.case(f"{case.family}: {case.name}", dt):
                        case.run(torch.float32 if dt == "tf32" else getattr(torch, dt))
                except FP8UnsupportedError as e:
                    cap.unsupported[f"{case.family}: {case.name}"] = str(e)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = allow
    return cap


def compile_all(cap, jobs: int, cache_dir: str | None, pruned: bool):
    """Compile the recorded variants (``pruned=False``: only launchable ones) in ``jobs``
    processes; returns ``[(variant, result)]``."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from ._capture import SassBatch, compile_variant

    todo = [v for v in cap.variants.values() if pruned or v.decision != "pruned"]
    work = [(v.key(cap.cc), v.module, v.kernel, v.signature, v.constexprs, v.attrs, v.options, cap.cc, cache_dir)
            for v in todo]
    sass = SassBatch(cap.cc, cache_dir)  # the SASS of the fresh results, in batches as they come
    if jobs <= 1 or len(work) <= 1:
        results = [sass.add(w[0], compile_variant(w)) for w in work]
    else:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            results = [sass.add(w[0], r) for w, r in zip(work, pool.map(compile_variant, work, chunksize=1))]
    sass.flush()
    return list(zip(todo, results))


def rows_of(arch: str, smem_limit: int, compiled) -> list[dict]:
    rows = []
    for v, res in compiled:
        cfg = v.config
        tile = "x".join(str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_H", "BLOCK_R", "BLOCK_T", "BLOCK",
                                              "BLOCK_D") if k in cfg)
        if cfg.get("BLOCK_DV", cfg.get("BLOCK_D")) != cfg.get("BLOCK_D"):  # flash: v's own head dim
            tile += f"/{cfg['BLOCK_DV']}"
        dtypes = {c[1] for c in v.cases}
        if {"float32", "tf32"} <= dtypes:  # one fp32 variant both passes launch: no dot precision
            dtypes.discard("tf32")
        dtypes = sorted(dtypes)
        shared = res.get("shared")
        row = dict(arch=arch, kernel=v.kernel.lstrip("_"), family=v.cases[0][0].split(":")[0],
                   cases="; ".join(sorted({c[0].split(": ", 1)[1] for c in v.cases})), dtype="/".join(dtypes),
                   config=f"{tile} w{cfg['num_warps']} s{cfg['num_stages']}", decision=v.decision,
                   estimate=v.estimate, shared=shared, regs=res.get("regs"), spill=res.get("spill_stores"),
                   mma=res.get("mma"), grid=max((c[2] for c in v.cases), key=len), error=res.get("error"))
        row.update({k: res.get(k) for k in SASS_COLUMNS})
        row["est_err"] = (round(100.0 * (v.estimate - shared) / shared, 1)
                          if v.estimate is not None and shared else None)
        row["over_smem"] = bool(shared is not None and shared > smem_limit)
        row["grid_ok"] = all(_grid_ok(c[2]) for c in v.cases)
        rows.append(row)
    rows.sort(key=lambda r: (FAMILIES.index(r["family"]) if r["family"] in FAMILIES else 99, r["kernel"],
                             r["dtype"], r["config"]))
    return rows


def _grid_ok(grid: str) -> bool:
    from ._capture import CUDA_GRID_LIMITS

    return all(int(g) <= lim for g, lim in zip(grid.split("x"), CUDA_GRID_LIMITS))


def problems(rows, fail_on_spill: bool) -> list[str]:
    """What makes the check fail: compile errors, launchable variants over the shared-memory
    limit, and (``fail_on_spill``) spills of launchable bf16/fp16 variants."""
    out = []
    for r in rows:
        launchable = r["decision"] != "pruned"
        what = f"{r['arch']} {r['kernel']} {r['dtype']} {r['config']} ({r['cases']})"
        if r["error"]:
            out.append(f"compile failure: {what}: {r['error']}")
        elif launchable and r["over_smem"]:
            out.append(f"over the shared-memory limit: {what}: {r['shared']} B")
        elif fail_on_spill and launchable and r["spill"] and r["dtype"] not in FP32_DTYPES:
            out.append(f"spills: {what}: {r['spill']} B")
    return out


#: what the SASS says (benchmarks/_sass.py); absent from tables written before them (unknown there)
SASS_COLUMNS = ["loads", "utmaldg", "utmastg", "gmma", "mma_sync", "loop"]
COLUMNS = ["family", "kernel", "dtype", "config", "decision", "estimate", "shared", "est_err", "regs", "spill", "mma",
           *SASS_COLUMNS, "grid_ok", "cases"]
#: spill bytes an fp32 variant ("ieee": FMA dots, or "tf32") may have; bf16/fp16 variants must have none
FP32_SPILL_LIMIT = 256
FP32_DTYPES = ("float32", "tf32")
#: prune estimate vs the compiler's shared memory
ESTIMATE_TOLERANCE = 0.05


def read_table(path: str) -> list[dict]:
    """The variant rows of a markdown table (``--markdown``) as dicts of strings, keyed by the
    column names of the header above them: a table written before a column has no such key."""
    out, header = [], None
    with open(path) as f:
        for line in f:
            p = [x.strip() for x in line.strip().strip("|").split(" | ")]
            if p[:2] == ["family", "kernel"]:
                header = p
            elif header and len(p) == len(header) and p[0] in FAMILIES:
                out.append(dict(zip(header, p)))
    return out


def table_rows(path: str) -> dict:
    """The variant rows of a committed markdown table (:func:`read_table`), keyed by kernel,
    dtype, config and cases."""
    return {(r["kernel"], r["dtype"], r["config"], r["cases"]): r for r in read_table(path)}


def against_table(rows, table: dict) -> list[str]:
    """Without compiling: every launchable variant of ``rows`` (captured now) must be in the
    committed ``table`` with compiled figures, its prune estimate within ESTIMATE_TOLERANCE of the
    recorded shared memory, and its recorded spills 0 (bf16/fp16) or <= FP32_SPILL_LIMIT (fp32)."""
    out = []
    for r in rows:
        if r["decision"] == "pruned":
            continue
        what = f"{r['kernel']} {r['dtype']} {r['config']} ({r['cases']})"
        t = table.get((r["kernel"], r["dtype"], r["config"].strip(), r["cases"]))
        if t is None or not t["shared"].isdigit():
            out.append(f"launchable but not compiled in the committed table (regenerate it): {what}")
            continue
        shared, spill = int(t["shared"]), int(t["spill"] or 0)
        if r["estimate"] is not None and abs(r["estimate"] - shared) > ESTIMATE_TOLERANCE * shared:
            out.append(f"prune estimate {r['estimate']} B vs the compiler's {shared} B: {what}")
        if spill > (FP32_SPILL_LIMIT if r["dtype"] in FP32_DTYPES else 0):
            out.append(f"spills {spill} B: {what}")
    return out


def with_recorded_sass(rows, table: dict) -> list[dict]:
    """``rows`` (captured, not compiled) with the SASS columns the committed ``table`` records
    for them (None where it has no such row or column)."""
    out = []
    for r in rows:
        t = table.get((r["kernel"], r["dtype"], r["config"].strip(), r["cases"]), {})
        out.append({**r, **{k: t.get(k) for k in SASS_COLUMNS}})
    return out


REQUIREMENTS = {"require_tma": (0, "tma", "loads only through TMA"),
                "require_wgmma": (1, "wgmma", "multiplies only with warpgroup MMAs")}


def unmet_requirements(rows, patterns: dict) -> list[str]:
    """``patterns``: ``{"require_tma" | "require_wgmma": regex or None}``. Every launchable sm_90
    variant of a kernel whose name matches must have a main loop (``loop``) that loads only through
    TMA / multiplies only with warpgroup MMAs; a pattern that matches no launchable sm_90 variant
    (while sm_90 was captured) is a problem too: it would gate nothing."""
    out = []
    for name, pattern in patterns.items():
        if not pattern:
            continue
        part, want, what = REQUIREMENTS[name]
        flag = "--" + name.replace("_", "-")
        hits = [r for r in rows if r["arch"] == "sm_90" and r["decision"] != "pruned" and re.search(pattern, r["kernel"])]
        if not hits and any(r["arch"] == "sm_90" for r in rows):
            out.append(f"{flag} {pattern!r} matches no launchable sm_90 variant")
        for r in hits:
            loop = r.get("loop")
            if not loop or loop == "-" or loop.split("/")[part] != want:
                out.append(f"{flag}: main loop {loop or 'unknown (no SASS figures)'}, not one that {what}: "
                           f"{r['kernel']} {r['dtype']} {r['config']} ({r['cases']})")
    return out


def markdown(rows, arch) -> str:
    cols = COLUMNS
    lines = [f"### {arch}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        vals = [r[c] if r["error"] is None or c not in ("shared", "regs", "spill") else "ERROR" for c in cols]
        lines.append("| " + " | ".join("" if x is None else f"{x:+.1f}%" if c == "est_err" else str(x)
                                       for c, x in zip(cols, vals)) + " |")
    return "\n".join(lines)


def unsupported_markdown(cap) -> str:
    """The cases the launchers refuse on ``cap``'s architecture, with the launcher's error."""
    if not cap.unsupported:
        return ""
    by_message: dict = {}
    for case, message in sorted(cap.unsupported.items()):
        by_message.setdefault(message, []).append(case)
    lines = [f"### {cap.arch}: unsupported", "", "| cases | error |", "|---|---|"]
    lines += [f"| {'; '.join(cases)} | {message} |" for message, cases in by_message.items()]
    return "\n".join(lines)


def summary(rows) -> str:
    """Per kernel: launchable variants, how many spill, the largest spill, the worst estimate
    error, the main loops' kinds (SASS ``loop``)."""
    by = {}
    for r in rows:
        if r["decision"] == "pruned" or r["error"]:
            continue
        kind = {"float32": "fp32", "tf32": "tf32"}.get(r["dtype"], "bf16/fp16")
        s = by.setdefault((r["arch"], r["kernel"], kind), [0, 0, 0, 0.0, set()])
        s[0] += 1
        s[1] += bool(r["spill"])
        s[2] = max(s[2], r["spill"] or 0)
        if r["est_err"] is not None:
            s[3] = max(s[3], abs(r["est_err"]))
        s[4].add(r.get("loop") or "?")
    lines = ["| arch | kernel | dtypes | launchable | spilling | max spill B | max |est err| % | main loops |",
             "|---|---|---|---|---|---|---|---|"]
    for (arch, k, kind), (n, ns, mx, err, loops) in sorted(by.items()):
        lines.append(f"| {arch} | {k} | {kind} | {n} | {ns} | {mx} | {err:.1f} | {', '.join(sorted(loops))} |")
    return "\n".join(lines)


def add_args(p):
    p.add_argument("--arch", choices=["sm_90", "sm_80", "all"], default="sm_90")
    p.add_argument("--subset", choices=["fast", "full"], default="fast",
                   help="fast: bf16, one LLM shape per launcher (CI); full: every shape and dtype")
    p.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--precision", choices=["ieee", "tf32", "both"], default="ieee",
                   help="ieee: the subset's dtypes (fp32 dots in IEEE fp32); tf32: only fp32 operands with "
                        "allow_tf32 set (dtype 'tf32'; GEMM, persistent, grouped, flash); both: the two passes")
    p.add_argument("--cases", default="", help="only the cases whose name contains this")
    p.add_argument("--pruned", action="store_true", help="also compile configs the prune rules drop")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    p.add_argument("--cache-dir", default=os.environ.get("FUSEDPAR_COMPILE_CACHE",
                                                          os.path.join(os.path.expanduser("~"), ".cache", "fusedpar", "compile")),
                   help="results cache ('' disables); keyed by Triton's source hash, target and options")
    p.add_argument("--fail-on-spill", action="store_true",
                   help="also fail on spills of launchable bf16/fp16 variants")
    p.add_argument("--markdown", help="write the tables to this markdown file")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--against", metavar="TABLE",
                   help="compile nothing: check the launchable variants against a committed --markdown table "
                        "(recorded, estimate within 5%%, no bf16/fp16 spills, fp32 spills <= 256 B)")
    p.add_argument("--require-tma", metavar="PATTERN",
                   help="fail unless every launchable sm_90 variant of a kernel whose name matches this regular "
                        "expression loads only through TMA (UTMALDG) in its main loop")
    p.add_argument("--require-wgmma", metavar="PATTERN",
                   help="fail unless every launchable sm_90 variant of a kernel whose name matches this regular "
                        "expression runs only warpgroup MMAs (HGMMA / QGMMA) in its main loop")


def _check_against(args) -> int:
    from ._capture import ARCHS

    table, bad, n, unsupported, recorded = table_rows(args.against), [], 0, 0, []
    for arch in (list(ARCHS) if args.arch == "all" else [args.arch]):
        cap = capture(arch, args.subset, tuple(args.family), args.cases, args.precision)
        rows = rows_of(arch, cap.smem, [(v, {}) for v in cap.variants.values()])
        n += sum(r["decision"] != "pruned" for r in rows)
        unsupported += len(cap.unsupported)
        bad += against_table(rows, table)
        recorded += with_recorded_sass(rows, table)
    bad += unmet_requirements(recorded, requirements(args))
    print(f"{n} launchable variants checked against {args.against}; {len(bad)} problem(s)"
          + (f"; {unsupported} case(s) unsupported on this architecture" if unsupported else ""))
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


def requirements(args) -> dict:
    return {name: getattr(args, name) for name in REQUIREMENTS}


def main(argv=None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("FUSEDPAR_TUNE_CONFIGS", None)  # the decisions are the prune rules' alone
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("triton was imported in interpreter mode; run the compile check in a fresh process")
    p = argparse.ArgumentParser(prog="python -m benchmarks compile", description=__doc__.split("\n\n")[0])
    add_args(p)
    args = p.parse_args(argv)
    from ._capture import ARCHS

    t0 = time.time()
    if args.against:
        return _check_against(args)
    from ._sass import tool_path

    try:
        tool_path("nvdisasm")
        tool_path("cuobjdump")
    except RuntimeError as e:
        raise SystemExit(str(e)) from e
    all_rows, text = [], []
    for arch in (list(ARCHS) if args.arch == "all" else [args.arch]):
        cap = capture(arch, args.subset, tuple(args.family), args.cases, args.precision)
        rows = rows_of(arch, cap.smem, compile_all(cap, args.jobs, args.cache_dir or None, args.pruned))
        all_rows += rows
        text += [markdown(rows, arch)] + ([unsupported_markdown(cap)] if cap.unsupported else [])
    bad = problems(all_rows, args.fail_on_spill) + unmet_requirements(all_rows, requirements(args))
    report = "\n\n".join(text + ["### summary (launchable variants)", "", summary(all_rows)])
    print(report)
    print(f"\n{len(all_rows)} variants compiled in {time.time() - t0:.1f} s; {len(bad)} problem(s)")
    for b in bad:
        print("  " + b)
    if args.markdown:
        with open(args.markdown, "w") as f:
            shown = [a for a in (argv if argv is not None else sys.argv[2:]) if a != args.cache_dir and a != "--cache-dir"]
            f.write(f"# Compile check: `python -m benchmarks compile {' '.join(shown)}`\n\n"
                    + report + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
    return 1 if bad else 0
