"""``python -m benchmarks <op> [options]``; ``python -m benchmarks all`` runs every op's default set;
``python -m benchmarks compile --arch sm_90`` compiles every launchable kernel variant for a GPU
target without a GPU (see benchmarks/compile.py)."""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from ._common import REGISTRY, Context, emit, env_info, select_backend
from .report import write_report

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_ops():
    import benchmarks

    for m in pkgutil.iter_modules(benchmarks.__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"benchmarks.{m.name}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compile"]:  # compiled path without a GPU: must not select the interpreter
        from .compile import main as compile_main

        return compile_main(argv[1:])
    gpu = select_backend()  # before anything imports triton
    import torch

    _load_ops()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="op", required=True)
    p_all = sub.add_parser("all", help="every registered op with its default settings")
    p_all.add_argument("--json", help="write all results to this JSON file")
    p_rep = sub.add_parser("report", help="write RESULTS.md (and a ratio plot) from the GPU runs' JSON files")
    p_rep.add_argument("--results", default=os.path.join(HERE, "results"), help="folder of run JSON files")
    p_rep.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    sub.add_parser("compile", help="compile every launchable kernel variant for sm_90/sm_80 (no GPU needed); "
                   "see python -m benchmarks compile --help", add_help=False)
    for name, op in sorted(REGISTRY.items()):
        p = sub.add_parser(name, help=op.help)
        p.add_argument("--json", help="write the results to this JSON file")
        op.add_args(p)
    args = parser.parse_args(argv)
    if args.op == "report":
        n_runs, missed = write_report(args.results, args.out)
        print(f"wrote {args.out} from {n_runs} GPU run file(s); targets missed: {missed}")
        return 0

    ctx = Context(gpu=gpu, device=torch.device("cuda" if gpu else "cpu"))
    info = env_info(ctx)
    print("fusedpar benchmarks: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    results: dict = {}
    if args.op == "all":
        for name, op in sorted(REGISTRY.items()):
            if not op.in_all:
                continue
            op_args = sub.choices[name].parse_args([])
            emit(name, op.run(op_args, ctx), ctx, info, args.json, results)
    else:
        emit(args.op, REGISTRY[args.op].run(args, ctx), ctx, info, args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
