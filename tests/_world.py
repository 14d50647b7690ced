"""Run a test body on N real processes (gloo on CPU, NCCL on GPU), one world per module.

Usage in a test module::

    world2 = world_fixture(2)           # module-scoped fixture, started once

    def _case(rank, size, n):           # module-level so spawned workers can import it
        ...assert on this rank's shard...

    def test_something(world2):
        world2.run(_case, n=33)

``World.run`` sends the function to every rank, waits for all of them, and fails the test with
each failing rank's traceback. A rank that does not answer within ``timeout`` seconds fails the
test (no hang): the world is then torn down and the next test starts a fresh one. Workers run
with one intra-op thread each (CI has 2 cores).
"""
from __future__ import annotations

import datetime
import os
import queue
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = float(os.environ.get("FUSEDPAR_TEST_TIMEOUT", "180"))


def _worker(rank, size, init_file, tasks, results, sys_path, backend, collective_timeout):
    sys.path[:] = sys_path
    if backend == "gloo":
        # gloo moves CPU tensors: a world that has too few GPUs for NCCL runs its kernels on CPU
        # tensors under the interpreter. Set before the test module (and so triton) is imported.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["FUSEDPAR_TEST_DEVICE"] = "cpu"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    while True:
        item = tasks.get()
        if item is None:
            # Every result has been read by the parent. Leave without destroy_process_group:
            # its shutdown handshake can stall for seconds, and the whole world exits together.
            os._exit(0)
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(rank, size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))


def _context():
    """Workers fork from a server process that has imported torch once (import costs seconds per
    process on a 2-core machine). In a CUDA run triton is not preloaded, so each world still
    decides TRITON_INTERPRET for itself (see _worker). In a CPU run (FUSEDPAR_TEST_DEVICE=cpu) every
    world interprets, as the server does (conftest set TRITON_INTERPRET=1 before it started), so it
    also preloads ``torch._dynamo`` (which imports triton; fusedpar's ops and torch's custom-op
    dispatch import it): about 1.5 CPU-seconds a worker, over a hundred workers in the suite."""
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed", "numpy"]
    if os.environ.get("FUSEDPAR_TEST_DEVICE") == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        preload.append("torch._dynamo")
    ctx.set_forkserver_preload(preload)
    return ctx


class WorldError(AssertionError):
    pass


class World:
    def __init__(self, size: int, timeout: float = DEFAULT_TIMEOUT):
        self.size = size
        self.timeout = timeout
        self.procs = []
        self.broken = False
        self.backend = ("nccl" if os.environ.get("FUSEDPAR_TEST_DEVICE") == "cuda" and torch.cuda.device_count() >= size
                        else "gloo")
        # gloo workers run the kernels interpreted (a GPU machine's Triton 3.6 with NumPy >= 2.4 cannot).
        # Imported here, not at module level: workers import this module before they set TRITON_INTERPRET.
        from fusedpar.kernels.interpreter import interpreter_problem

        problem = interpreter_problem() if self.backend == "gloo" else None
        if problem:
            pytest.skip(f"a gloo world of {size} runs its kernels interpreted: {problem}")
        self._start()

    def _start(self):
        ctx = _context()
        fd, self._init_file = tempfile.mkstemp(prefix="fusedpar_world_")
        os.close(fd)
        os.unlink(self._init_file)  # the file store wants to create it
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.size, self._init_file, self.tasks[r], self.results, list(sys.path), self.backend,
                      self.timeout),
                daemon=True,
            )
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float | None = None, **kwargs):
        """Run ``fn(rank, size, *args, **kwargs)`` on every rank; return the per-rank results."""
        if self.broken:
            self.close()
            self._start()
        timeout = self.timeout if timeout is None else timeout
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.size:
            remaining = deadline - time.monotonic()
            if errors:  # the others may be stuck in a collective with the failed rank
                remaining = min(remaining, 15.0)
            try:
                rank, ok, value = self.results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            (out if ok else errors)[rank] = value
            if any(not p.is_alive() for p in self.procs) and len(out) + len(errors) < self.size:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                errors.update({r: f"rank {r} died (exit code {self.procs[r].exitcode})" for r in dead if r not in out})
        missing = [r for r in range(self.size) if r not in out and r not in errors]
        if errors or missing:
            self.broken = True
            self.close()
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"ranks {missing} did not finish within {timeout:.0f}s (hang or deadlock)")
            raise WorldError(f"{getattr(fn, '__name__', fn)} failed on world of {self.size}:\n" + "\n".join(parts))
        return [out[r] for r in range(self.size)]

    def close(self):
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


def world_fixture(size: int, timeout: float = DEFAULT_TIMEOUT):
    """A module-scoped pytest fixture holding a started world of ``size`` ranks."""

    @pytest.fixture(scope="module")
    def _fixture():
        w = World(size, timeout)
        yield w
        w.close()

    return _fixture


def rank_rng(seed: int, rank: int | None = None) -> torch.Generator:
    """A generator with the same stream on every rank (rank=None) or a per-rank one."""
    g = torch.Generator()
    g.manual_seed(seed if rank is None else seed * 1009 + rank)
    return g


def grid_2x2(rank: int):
    """This rank's groups in a 2 x 2 world: its row ``{0, 1}`` / ``{2, 3}`` (rank in it: ``rank % 2``),
    its column ``{0, 2}`` / ``{1, 3}`` (rank in it: ``rank // 2``), which are orthogonal, and a
    group of itself alone. Every rank creates every group, in the same order."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    return rows[rank // 2], cols[rank % 2], singles[rank]


def straggle(max_delay_s: float, seed: int):
    """Turn on random per-rank delays before every fusedpar transfer (see fusedpar.ops.comm)."""
    from fusedpar.ops import comm

    comm.set_straggler(max_delay_s, seed=seed + dist.get_rank())
    return comm
