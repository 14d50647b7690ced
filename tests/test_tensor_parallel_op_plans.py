"""Whole-op launch plans of the ring schedules (``schedules.ChunkGemms``): a call of an op key seen
before launches every chunk GEMM's recorded plan with its own tensors, without a per-GEMM key; the
symmetric schedules (``transport`` with in-kernel waits) launch their persistent GEMM and reduction
by the plans recorded with their spec, without the launchers' keys.
``tests/_op_plan_world.py`` runs Triton's real launch path (binder, specialisation, cache key) with
the compiler and the driver replaced, in a subprocess without the interpreter; here its report is
checked case by case."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
#: case -> its launches (chunk GEMMs; the symmetric schedules' persistent GEMM and reduction)
CASES = {"ag_gelu_bias": 4, "ag_seq_dim": 4, "rs_misaligned": 8, "rs_aligned_same_shape": 8, "rs_bias": 8,
         "rs_fp16_partials": 8, "ag_backward": 16, "ag_waits_gelu_bias": 1, "ag_waits_seq_dim": 1,
         "rs_waits_misaligned": 2, "rs_waits_aligned_same_shape": 2, "rs_waits_bias": 2}
RING_OPS = 6  # the ring cases (the symmetric ones keep their plans with their specs)


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_op_plan_world.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_op_launches_what_tritons_path_does(report, case):
    """Every launch of the replayed call: the same kernel specialisation, grid, stream and
    arguments (inputs by identity, buffers by shape, strides, dtype and address mod 16) as Triton's
    own path, with the plans of every other case present; the replay calls no launcher
    (matmul_checked, persistent_matmul, chunk_reduce)."""
    r = report[case]
    assert r["launches"] == CASES[case] and r["per_gemm_same"] and r["replayed_same"], r
    assert r["checked_calls_in_replay"] == 0


def test_each_case_keeps_its_own_op_plans(report):
    assert report["op_plans"] == RING_OPS + 2  # (the backward case: its forward and its reduce-scatter)


def test_a_replay_sets_the_descriptor_allocator_in_a_new_thread(monkeypatch):
    """An op's replay may be the first launch of its thread (autograd's backward thread, under
    activation checkpointing): a TMA chunk GEMM asks Triton's allocator (a context variable, unset
    in a new thread) for its descriptors' scratch, which matmul's own path sets before a launch.
    Here a stand-in plan asks for it as a TMA launch does (no allocator: Triton's 'no allocator was
    set')."""
    from triton.runtime import _allocation

    from fusedpar.ops.tensor_parallel import schedules

    class Plan:
        def stream(self):
            return 7

        def call(self, tensors, stream):
            _allocation._allocator.get()(64, 16, stream)

    monkeypatch.setattr(schedules, "interpreting", lambda: False)
    key = ("test: a replay in a new thread",)
    schedules._OP_PLANS.keep(key, ((Plan(), lambda named: named[:3]),))
    errors = []

    def replay():
        try:
            gemms = schedules.ChunkGemms(torch.zeros(4, 8))
            gemms.plan(key)
            gemms(torch.zeros(2, 8), torch.zeros(2, 4))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=replay)
    thread.start()
    thread.join()
    schedules._OP_PLANS.pop(key)
    assert not errors, errors


class _StandInPlan:
    """A launch plan's part that records and replays (``launch`` is LaunchPlan's own)."""

    def __init__(self):
        self.calls = []

    def launch(self, tensors):
        from fusedpar.kernels.launch import LaunchPlan

        return LaunchPlan.launch(self, tensors)

    def stream(self):
        return 7

    def call(self, tensors, stream):
        self.calls.append(tensors)


def test_cleared_plans_are_not_launched_by_a_symmetric_spec():
    """``clear_plans()`` reaches the launches a symmetric schedule recorded with its spec: the next
    call takes the launcher's own path (and records again), as every other plan does."""
    from fusedpar.kernels import launch
    from fusedpar.ops.tensor_parallel import symmetric

    plan, named, fallbacks = _StandInPlan(), (torch.zeros(2), torch.zeros(3)), []
    steps = [(plan, lambda named: named[1:], launch.plans_generation())]
    symmetric._launch(steps, 0, named, lambda: fallbacks.append(1))
    assert len(plan.calls) == 1 and plan.calls[0][0] is named[1] and not fallbacks
    launch.clear_plans()
    symmetric._launch(steps, 0, named, lambda: fallbacks.append(1))
    assert len(plan.calls) == 1 and fallbacks == [1] and steps[0] is None  # (the fallback launched no plan)


def test_launch_records_of_two_threads_stay_apart():
    """Two threads recording at once (each op's schedule on its own thread): each record holds its
    own thread's launches, and closing them in another order than opened raises nothing."""
    from fusedpar.kernels.launch import LaunchRecord

    plans = {name: _StandInPlan() for name in "ab"}
    entered, a_closed, recs = threading.Barrier(2), threading.Event(), {}

    def record(name):
        with LaunchRecord() as rec:
            entered.wait()
            if name == "b":
                a_closed.wait()  # a's record closes first, while b's is open
            plans[name].launch((name,))
        recs[name] = rec
        if name == "a":
            a_closed.set()

    threads = [threading.Thread(target=record, args=(n,)) for n in "ab"]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert recs["a"] == [(plans["a"], ("a",))] and recs["b"] == [(plans["b"], ("b",))]
