"""The GPU round's prepared calls, checked on CPU so that a short device lease does not end on a
typo: the two ``benchmarks/gpu_round.sh`` calls of docs/PERF.md's "Prepared for round 3" and the
Makefile's ``GPU_ROUND_BENCH``, each run through the script in its dry mode (``GPU_ROUND_DRY=1``,
which prints each benchmark's command line), every op registered and its options parsed by the
op's own arguments, every test module of ``PYTEST_ARGS`` present, the budgets within a 9-minute
call, and the plan covering the ops the GPU issue asks for."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "benchmarks/gpu_round.sh"
#: seconds one call may take on the device (a command's limit is 10 minutes; set-up and the tarball on top)
MAX_BUDGET_S = 540
#: what the round-3 plan must time (issue 42): the GEMM core, the flash backward, the host cost
PLAN_OPS = {"matmul", "fp8_matmul", "moe", "linear_ce", "attention", "attention_variants", "ring_attention",
            "varlen_attention", "launch", "ag_matmul", "matmul_rs", "persistent_ag", "persistent_rs", "train"}


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def perf_calls():
    """``(env, budget, test_s, entries)`` of every gpu_round.sh call in PERF's "Prepared for round 3"."""
    text = _read("docs/PERF.md")
    section = text.split("## Prepared for round 3", 1)[1].split("\n## ", 1)[0]
    calls = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        words = shlex.split(block.replace("\\\n", " "))
        at = words.index(SCRIPT)
        env = dict(w.split("=", 1) for w in words[:at - 1])
        assert words[at - 1] == "bash", words[:at]
        out, budget, test_s, *entries = words[at + 1:]
        calls.append((env, int(budget), int(test_s), entries))
    return calls


def makefile_entries():
    text = _read("Makefile").replace("\\\n", " ")
    return re.search(r"^GPU_ROUND_BENCH \?= (.*)$", text, re.M).group(1).split()


def dry_run(tmp_path, budget, test_s, entries, env=None):
    """The benchmark command lines the script would run: ``[(op, args, json)]``."""
    run_env = dict(os.environ, GPU_ROUND_DRY="1", GPU_PY="python3", **(env or {}))
    res = subprocess.run(["bash", SCRIPT, str(tmp_path), str(budget), str(test_s), *entries], cwd=ROOT, env=run_env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[dry] python3 -m benchmarks ")]
    assert len(lines) == len(entries), res.stdout
    out = []
    for ln in lines:
        op, *args = ln.split()[4:]
        assert args[-2] == "--json", ln
        out.append((op, args[:-2], args[-1]))
    return out


def parse_op_args(op, args):
    from benchmarks.__main__ import _load_ops
    from benchmarks._common import REGISTRY

    _load_ops()
    assert op in REGISTRY, f"{op} is not a benchmark op"
    parser = argparse.ArgumentParser(prog=op, exit_on_error=False)
    REGISTRY[op].add_args(parser)
    parser.parse_args(args)  # raises on an unknown option or a bad value


@pytest.fixture
def benchmarks_importable(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, SCRIPT)]).returncode == 0


def test_perf_calls_run_registered_ops_with_valid_options(tmp_path, benchmarks_importable):
    calls = perf_calls()
    assert len(calls) == 2, "the round-3 plan is two calls: the tests, then the benchmarks"
    names, ops = [], set()
    for i, (env, budget, test_s, entries) in enumerate(calls):
        assert 0 <= test_s < budget <= MAX_BUDGET_S, (budget, test_s)
        for op, args, json_path in dry_run(tmp_path / str(i), budget, test_s, entries, env):
            parse_op_args(op, args)
            names.append(json_path)
            ops.add(op)
    assert len(names) == len(set(names)), f"two runs write the same JSON file: {sorted(names)}"
    assert PLAN_OPS <= ops, f"not in the plan: {sorted(PLAN_OPS - ops)}"


def test_perf_first_call_runs_the_cuda_graph_test_first_and_every_module_exists():
    env, _, test_s, _ = perf_calls()[0]
    assert test_s > 0
    modules = env["PYTEST_ARGS"].split()
    assert modules[0] == "tests/test_nn_cuda_graph.py", modules[:3]
    missing = [m for m in modules if not os.path.exists(os.path.join(ROOT, m.split("::")[0]))]
    assert not missing, missing
    assert len(modules) == len(set(modules))


def test_makefile_round_runs_registered_ops_with_valid_options(tmp_path, benchmarks_importable):
    entries = makefile_entries()
    runs = dry_run(tmp_path, MAX_BUDGET_S, 0, entries)
    for op, args, _ in runs:
        parse_op_args(op, args)
    ops = {op for op, _, _ in runs}
    epilogues = {a[a.index("--epilogue") + 1] for op, a, _ in runs if op == "matmul" and "--epilogue" in a}
    assert PLAN_OPS <= ops, sorted(PLAN_OPS - ops)
    assert epilogues == {"none", "bias", "gelu", "swiglu"}, epilogues
    assert any(op == "launch" and "--stub-driver" in a for op, a, _ in runs)
