"""``python -m benchmarks ag_matmul`` / ``matmul_rs`` run their CPU smoke mode (numbers are not performance)."""
import json
import os

import pytest


@pytest.fixture
def bench_main(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.__main__ import main

    return main


@pytest.mark.parametrize("op,extra", [
    ("ag_matmul", ["--tokens", "6", "--hidden", "8", "--ffn", "4", "--tp", "2"]),
    ("matmul_rs", ["--tokens", "9", "--hidden", "5", "--ffn", "6", "--tp", "3"]),
])
def test_tp_bench_cli(bench_main, tmp_path, op, extra):
    out = tmp_path / "tp.json"
    assert bench_main([op, *extra, "--dtype", "fp32", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][op][0]
    for key in ("T_gemm_ms", "T_comm_ms", "T_sequential_ms", "T_overlapped_ms"):
        assert row[key] > 0, key
    assert row["max_rel_err"] < 1e-4  # the overlapped schedule computed the right result
    assert row["tp"] == int(extra[extra.index("--tp") + 1]) and "overlap_eff" in row


def test_tp_bench_rejects_indivisible_tokens(bench_main):
    with pytest.raises(SystemExit, match="divisible"):
        bench_main(["ag_matmul", "--tokens", "7", "--tp", "2"])
