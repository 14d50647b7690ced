"""``python -m benchmarks report``: write ``benchmarks/RESULTS.md`` from the JSON of real GPU runs.

Reads every ``*.json`` under ``--results`` (default ``benchmarks/results``) that a benchmark wrote
with ``--json`` on a GPU (``env.mode`` compiled; CPU smoke files are skipped, so no interpreter
figure can reach RESULTS.md), and writes, per run file: its environment line, one table per op with
the shape columns, the times and the ratio columns, each ratio checked against its target. A plot of
every ratio per op, as an SVG next to RESULTS.md, draws the targets as ticks. Nothing is typed by
hand: rerun the command after adding a results file.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass

from ._common import markdown_table


@dataclass(frozen=True)
class Target:
    op: str
    column: str
    bound: float
    at_least: bool = True  # False: the ratio must stay at or below ``bound``
    when: tuple = ()  # (column, value) pairs a row must match

    def applies(self, op: str, row: dict) -> bool:
        return op == self.op and row.get(self.column) is not None and all(row.get(c) == v for c, v in self.when)

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound

    def text(self) -> str:
        return f"{'≥' if self.at_least else '≤'} {self.bound:g}"


# The targets of the GPU issue, as ratios measured in the same run.
TARGETS = [
    Target("matmul", "ratio_vs_torch", 0.95, when=(("epilogue", "none"),)),
    Target("matmul", "ratio_vs_torch", 1.0, when=(("epilogue", "bias"),)),
    Target("matmul", "ratio_vs_torch", 1.0, when=(("epilogue", "gelu"),)),
    Target("matmul", "ratio_vs_torch", 1.0, when=(("epilogue", "swiglu"),)),
    Target("matmul", "fp8_out_speedup", 1.0),
    Target("attention", "fwd_ratio_vs_sdpa", 1.0),
    Target("attention", "bwd_ratio_vs_sdpa", 0.9),
    Target("attention", "bwd_atomic_ratio_vs_sdpa", 0.9),
    Target("moe", "ratio_vs_baseline", 0.95, when=(("bench", "grouped_gemm"),)),
    Target("moe", "ratio_vs_baseline", 0.8, when=(("bench", "permute"),)),
    Target("moe", "ratio_vs_baseline", 0.8, when=(("bench", "unpermute"),)),
    Target("moe", "ratio_vs_baseline", 3.0, when=(("bench", "layer_fwd_bwd"),)),
    Target("ag_matmul", "speedup_vs_sequential", 1.3),
    Target("ag_matmul", "overlapped_vs_max", 1.1, at_least=False),
    Target("matmul_rs", "speedup_vs_sequential", 1.25),
    Target("persistent_ag", "speedup_vs_per_chunk", 1.0),
    Target("persistent_ag", "fp8_speedup_vs_per_chunk", 1.0),
    Target("persistent_rs", "fp8_speedup_vs_per_chunk", 1.0),
    Target("ring_attention", "efficiency_vs_plain", 0.92),
    Target("fp8_matmul", "ratio_vs_scaled_mm", 0.95, when=(("scaling", "rowwise"),)),
    Target("fp8_matmul", "speedup_vs_bf16", 1.6, when=(("M", 8192), ("N", 8192), ("K", 8192))),
    Target("fp8_matmul", "fused_speedup", 1.0),
    Target("train", "mfu", 0.45, when=(("variant", "dense"),)),
    Target("linear_ce", "ratio_vs_materialised", 0.95),
    Target("linear_ce", "peak_ratio_vs_materialised", 0.25, at_least=False),
]
RATIO_WORDS = ("ratio", "speedup", "efficiency", "_vs_", "mfu")


def is_ratio(column: str) -> bool:
    return any(w in column for w in RATIO_WORDS)


def load_runs(results_dir: str) -> list[tuple[str, dict]]:
    """``(file name, content)`` of every GPU run file, oldest date first."""
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or "env" not in data or "results" not in data:
            continue  # not a benchmark run file (e.g. the compile tables)
        if not str(data["env"].get("mode", "")).startswith("compiled") or data["env"].get("tune_configs"):
            continue  # CPU smoke runs; runs with the autotuners limited (FUSEDPAR_TUNE_CONFIGS)
        runs.append((os.path.basename(path), data))
    runs.sort(key=lambda r: str(r[1]["env"].get("date", "")))
    return runs


def check_row(op: str, row: dict) -> list[str]:
    """``"column 1.23 (target ≥ 1.3: missed)"`` for every target that applies to ``row``."""
    out = []
    for t in TARGETS:
        if t.applies(op, row):
            v = float(row[t.column])
            out.append(f"{t.column} {v:.3g} ({t.text()}: {'met' if t.met(v) else 'MISSED'})")
    return out


def op_table(op: str, rows: list[dict]) -> str:
    """The benchmark's own markdown table with a last column of the targets each row meets."""
    return markdown_table([{**r, "targets": "; ".join(check_row(op, r))} for r in rows])


def ratio_points(runs) -> list[tuple[str, float, Target | None]]:
    """(label, value, target) for every targeted ratio of the newest session: the run files of the
    newest run's device and day (``make gpu-check`` writes one file per part)."""
    if not runs:
        return []
    newest = runs[-1][1]["env"]
    day, device = str(newest.get("date", ""))[:10], newest.get("device")
    pts = []
    for _, data in runs:
        if str(data["env"].get("date", ""))[:10] != day or data["env"].get("device") != device:
            continue
        for op, rows in data["results"].items():
            for i, row in enumerate(rows):
                pts += [(f"{op}[{i}] {t.column}", float(row[t.column]), t) for t in TARGETS if t.applies(op, row)]
    return pts


def svg_plot(points) -> str:
    """Horizontal bars of each ratio with its target as a tick (plain SVG, no plotting library)."""
    bar_h, left, width = 16, 330, 420
    top = max([p[1] for p in points] + [p[2].bound for p in points if p[2]] + [1.0]) * 1.1
    height = bar_h * len(points) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{height}" '
             'font-family="monospace" font-size="11">']
    for i, (label, v, t) in enumerate(points):
        y = 10 + i * bar_h
        w = 0 if math.isnan(v) else width * v / top
        color = "#2a7" if t is None or t.met(v) else "#c33"
        parts.append(f'<text x="{left - 6}" y="{y + 11}" text-anchor="end">{label}</text>')
        parts.append(f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bar_h - 4}" fill="{color}"/>')
        parts.append(f'<text x="{left + w + 4:.1f}" y="{y + 11}">{v:.2f}</text>')
        if t is not None:
            x = left + width * t.bound / top
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + bar_h}" stroke="black"/>')
    x1 = left + width / top
    parts.append(f'<line x1="{x1:.1f}" x2="{x1:.1f}" y1="5" y2="{height - 15}" stroke="#999" stroke-dasharray="3"/>')
    parts.append("</svg>")
    return "\n".join(parts)


def render(runs, plot_name: str | None) -> str:
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks report` from the JSON files in `benchmarks/results/` "
             "(real GPU runs only; CPU smoke runs are never included). Every figure is a ratio against "
             "the baseline measured in the same run; targets from the GPU issue are checked per row.", ""]
    lines += ["## Targets", "", "| op | ratio | target | rows |", "|---|---|---|---|"]
    lines += [f"| {t.op} | {t.column} | {t.text()} | {', '.join(f'{c}={v}' for c, v in t.when) or 'all'} |"
              for t in TARGETS]
    lines.append("")
    if not runs:
        lines += ["No GPU run has been recorded yet. On a GPU machine: `make gpu-check` (see the README), "
                  "then `python -m benchmarks report`.", ""]
        return "\n".join(lines)
    if plot_name:
        lines += [f"![ratios of the newest run, targets as ticks]({plot_name})", ""]
    for name, data in runs:
        env = data["env"]
        lines += [f"## {name}", "", "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
        for op, rows in data["results"].items():
            lines += [f"### {op}", "", op_table(op, rows), ""]
    return "\n".join(lines)


def write_report(results_dir: str, out_path: str) -> tuple[int, int]:
    """Write RESULTS.md (and the SVG when there are targeted ratios). Returns (runs, missed targets)."""
    runs = load_runs(results_dir)
    points = ratio_points(runs)
    plot_name = None
    if points:
        plot_name = os.path.splitext(os.path.basename(out_path))[0].lower() + "_ratios.svg"
        with open(os.path.join(os.path.dirname(out_path) or ".", plot_name), "w") as f:
            f.write(svg_plot(points))
    with open(out_path, "w") as f:
        f.write(render(runs, plot_name))
    missed = sum(1 for _, v, t in points if t is not None and not t.met(v))
    return len(runs), missed
