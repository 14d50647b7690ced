"""Arithmetic of the scale model (benchmarks/model.py): limits with closed-form answers."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.model import Device, Link, ag_pipeline, predict, rs_pipeline  # noqa: E402

M, N, K, TP = 8192, 28672, 8192, 8
BYTES = 2


def _link(gbps, lat_us=0.0, **kw):
    return Link(nvlink_gbps=gbps, nvlink_latency_us=lat_us, **kw)


def test_pipelines():
    # all chunks present at 0: the GEMMs run back to back
    assert ag_pipeline([0, 0, 0], [1, 2, 3]) == 6
    # late arrivals stall the GEMM: finish = last arrival + last GEMM
    assert ag_pipeline([0, 10, 20], [1, 1, 1]) == 21
    # reduce-scatter: a transfer starts when its chunk is computed and the link is free
    assert rs_pipeline([1, 1, 1], [5, 5, 0]) == 11
    assert rs_pipeline([4, 4, 4], [1, 1, 0]) == 12


def test_compute_bound_limit():
    """Infinite link: no communication time, overlap gains nothing, speedup 1."""
    dev = Device(gemm_tflops=500.0, copy_gbps=1e12, launch_us=0.0)
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        r = predict(op, M, N, K, TP, dev, _link(1e12))
        t_gemm = 2.0 * M * N * K / TP / 500e12 * 1e3
        assert r["T_gemm_ms"] == pytest.approx(t_gemm)
        assert r["T_comm_ms"] == pytest.approx(0.0, abs=1e-6)
        assert r["T_persistent_ms"] == pytest.approx(t_gemm, rel=1e-6)
        assert r["speedup_persistent"] == pytest.approx(1.0, rel=1e-6)
        assert r["bound"] == "compute"


def test_comm_bound_limit():
    """GEMM nearly free: the overlapped time is the transfer time plus one chunk's GEMM, and
    the speedup tends to 1 + T_gemm / T_comm."""
    dev = Device(gemm_tflops=1e6, copy_gbps=1e12, launch_us=0.0)
    link = _link(100.0, lat_us=2.0)
    r = predict("all_gather_matmul", M, N, K, TP, dev, link)
    chunk = M // TP * K * BYTES
    t_comm = (TP - 1) * (chunk / 100e9 * 1e3 + 2e-3)
    assert r["T_comm_ms"] == pytest.approx(t_comm)
    assert r["T_persistent_ms"] == pytest.approx(t_comm + r["T_gemm_ms"] / TP)
    assert r["speedup_persistent"] == pytest.approx(1 + r["T_gemm_ms"] * (1 - 1 / TP) / r["T_persistent_ms"])
    assert r["bound"] == "comm"


def test_balanced_closed_form():
    """T_gemm == T_comm (latency 0): the all-gather pipeline is set by arrivals, finishing at
    T_comm + T_gemm / tp, so speedup = 2 tp / (tp + 1)."""
    chunk = M // TP * K * BYTES
    t_comm_s = (TP - 1) * chunk / 200e9
    tflops = 2.0 * M * (N // TP) * K / t_comm_s / 1e12
    dev = Device(gemm_tflops=tflops, copy_gbps=1e12, launch_us=0.0)
    r = predict("all_gather_matmul", M, N, K, TP, dev, _link(200.0))
    assert r["T_gemm_ms"] == pytest.approx(r["T_comm_ms"])
    assert r["bound"] == "balanced"
    assert r["speedup_persistent"] == pytest.approx(2 * TP / (TP + 1))


def test_per_chunk_path_pays_tails_and_launches():
    dev = Device(gemm_tflops=700.0, copy_gbps=2600.0, launch_us=5.0)
    r = predict("all_gather_matmul", M, N, K, TP, dev, _link(400.0, 3.0))
    assert r["T_per_chunk_ms"] > r["T_persistent_ms"]
    # contention slows the overlapped compute only
    slow = predict("all_gather_matmul", M, N, K, TP, dev, _link(400.0, 3.0), contention=1.2)
    assert slow["T_seq_ms"] == pytest.approx(r["T_seq_ms"]) and slow["T_persistent_ms"] > r["T_persistent_ms"]


def test_multi_node_uses_the_slower_link():
    link = Link(nvlink_gbps=160.0, nvlink_latency_us=3.0, ranks_per_node=8, internode_gbps=45.0,
                internode_latency_us=8.0)
    assert link.busbw(8) == (160.0, 3.0)
    assert link.busbw(16) == (45.0, 8.0)
    dev = Device(gemm_tflops=700.0, copy_gbps=2600.0)
    r8 = predict("matmul_reduce_scatter", M, 8192, 28672, 8, dev, link)
    r16 = predict("matmul_reduce_scatter", M, 8192, 28672, 16, dev, link)
    assert r16["T_comm_ms"] > r8["T_comm_ms"] and r16["T_gemm_ms"] == pytest.approx(r8["T_gemm_ms"] / 2)


def test_errors():
    dev, link = Device(700.0, 2600.0), _link(100.0)
    with pytest.raises(ValueError, match="divisible by tp=3"):
        predict("all_gather_matmul", 8192, N, K, 3, dev, link)
    with pytest.raises(ValueError, match="op must be"):
        predict("all_reduce", M, N, K, TP, dev, link)
    with pytest.raises(ValueError, match="contention"):
        predict("all_gather_matmul", M, N, K, TP, dev, link, contention=0.5)


def test_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks.__main__ import main

    out = tmp_path / "model.json"
    assert main(["model", "--tp", "8", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["model"]
    assert [(r["op"], r["gpus"]) for r in rows] == [
        ("all_gather_matmul", "8"), ("matmul_reduce_scatter", "8"),
        ("all_gather_matmul", "2x8"), ("matmul_reduce_scatter", "2x8"),
    ]
    assert all(r["speedup_persistent"] >= 1.0 for r in rows)
    text = capsys.readouterr().out
    assert "assumed H800" in text and "1.30-1.65x" in text
    with pytest.raises(SystemExit, match="divisible by tp=3"):
        main(["model", "--tp", "3"])
    if "cuda" not in os.environ.get("FUSEDPAR_TEST_DEVICE", "cpu"):
        with pytest.raises(SystemExit):
            main(["model", "--measure"])
