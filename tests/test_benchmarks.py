"""The benchmark CLI runs (smoke mode off GPU) and writes JSON with an environment line."""
import json

import pytest


@pytest.fixture
def bench_main(monkeypatch):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)
    from benchmarks.__main__ import main

    return main


def test_matmul_cli_json(bench_main, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert bench_main(["matmul", "--shapes", "17x9x33", "--epilogue", "swiglu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["results"]["matmul"][0]
    assert (row["M"], row["N"], row["K"]) == (17, 9, 33)
    assert row["max_rel_err"] < 1e-4 and row["fusedpar_ms"] > 0 and row["torch_ms"] > 0
    assert "torch" in data["env"] and "triton" in data["env"]
    text = capsys.readouterr().out
    assert "| M | N | K |" in text


def test_bad_shape_argument(bench_main):
    with pytest.raises(SystemExit):
        bench_main(["matmul", "--shapes", "17x9"])
