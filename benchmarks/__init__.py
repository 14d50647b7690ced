"""Kernel microbenchmarks: ``python -m benchmarks <op> [options]`` (see ``--help``)."""
