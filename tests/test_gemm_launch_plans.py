"""Launch plans (``fusedpar.kernels.launch``): a repeated launch passes exactly what Triton's own
path would, for the dense GEMM's plans and the kernel-level plans of every other launcher.
``tests/_launch_plan_world.py`` runs Triton's real launch path (binder, specialisation, cache key)
beside the plans in a subprocess without the interpreter, the compiler and driver replaced; here
its report is checked case by case."""
import json
import os
import subprocess
import sys

import pytest

from fusedpar.kernels.launch import PlanCache, describe

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_launch_plan_world.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = ["plain", "misaligned_view", "aligned_view_same_shape", "k_not_16", "m_is_1", "n_is_1", "transposed_a",
         "weight_kn", "weight_kn_unaligned_rows", "fp16_swiglu_kn", "bias_gelu", "swiglu_preact", "residual", "residual_view", "accumulate_fp32", "out_dtype_fp32",
         "seq_chunk_3d", "fp8_out", "fp32_ieee_and_tf32", "checked_chunks",
         # kernel-level plans (launch_kernel): every other family's launchers
         "rmsnorm_fwd_bwd", "rmsnorm_misaligned_view", "rmsnorm_aligned_view", "flash_fwd_bwd", "quantize_rows_tiles",
         "fp8_matmul_rowwise", "grouped_matmul", "moe_route_permute_combine", "persistent_matmul",
         "persistent_matmul_epochs",
         # launcher-level plans keyed on the launcher's call (persistent GEMM, chunk_reduce, RMSNorm)
         "persistent_waits_bias_gelu", "persistent_misaligned_view", "persistent_aligned_view", "persistent_4d_chunks",
         "persistent_fp8_rowwise", "chunk_reduce_waits_bias", "chunk_reduce_view_workspace",
         "rmsnorm_residual_out_dtype", "rmsnorm_seq_chunk_no_weight", "rmsnorm_4d_and_1d", "rmsnorm_strided_weight",
         "rmsnorm_wide_rows_fwd_bwd", "rmsnorm_bwd_grad_residual", "rmsnorm_fp8_tiles", "rmsnorm_fp8_rows_into"]
EMPTY = ["empty_m", "empty_k", "persistent_empty_rows", "rmsnorm_empty_rows"]
#: launcher-level plans: a hit runs none of the launcher's checks (the epochs case changes its key per call)
LAUNCHER_PLANS = [c for c in CASES if c.startswith(("persistent_", "chunk_reduce", "rmsnorm_"))
                  and c != "persistent_matmul_epochs"]


def test_the_world_runs_every_case(report):
    assert sorted(report["cases"]) == sorted(CASES + EMPTY)


@pytest.mark.parametrize("case", LAUNCHER_PLANS)
def test_a_launcher_plan_hit_skips_the_checks(report, case):
    assert report["cases"][case]["checks_with_plans"] == 0


@pytest.mark.parametrize("case", CASES)
def test_plan_launch_equals_tritons_own(report, case):
    """Same compiled kernel (specialisation), grid, current stream and arguments (inputs by
    identity, the call's result as such) as Triton's path, with the plans of every other case
    present, and no launch through Triton's path."""
    r = report["cases"][case]
    assert r["launches"] >= 1 and r["triton_runs_before"] >= 1
    assert r["same"], r["first_difference"]
    assert r["triton_runs_with_plans"] == 0


def test_plans_cover_both_load_paths(report):
    """The dense GEMM's launches on sm_90 load by TMA where every operand allows it (16-byte aligned
    base and rows, kernels/gemm_loads.py) and by pointers elsewhere: both kinds are planned above;
    so does the flash backward at head_dim 64 (bf16, contiguous)."""
    tma = {case for case in CASES if report["cases"][case]["tma"]}
    assert {"plain", "aligned_view_same_shape", "k_not_16", "transposed_a", "weight_kn", "fp16_swiglu_kn",
            "swiglu_preact", "fp8_out", "checked_chunks", "flash_fwd_bwd"} <= tma, tma
    assert not tma & {"misaligned_view", "weight_kn_unaligned_rows", "seq_chunk_3d", "fp32_ieee_and_tf32"}, tma


def test_empty_products_launch_nothing(report):
    for case in EMPTY:
        assert report["cases"][case]["launches"] == 0 and report["cases"][case]["same"]


@pytest.mark.parametrize("case,launches", [("plain", 1), ("rmsnorm_fwd_bwd", 2)])
def test_plans_fall_back_where_they_must_not_apply(report, case, launches):
    """A launch hook, Triton's debug option, another current device: Triton's path, every launch;
    afterwards the plans apply again."""
    r = report["fallbacks"]
    assert [r[f"{case}:{why}"] for why in ("hook", "debug", "other_device")] == [launches] * 3
    assert r[f"{case}:plans_again"] == 0


def test_a_call_that_copies_its_bias_builds_no_plan(report):
    assert report["fallbacks"]["strided_bias"] == 1


def test_the_launcher_takes_what_plans_pass():
    """The compiled launcher's calling convention the plans' generated calls follow (Triton 3.6 and
    3.9): grid, stream, function, packed metadata, launch metadata, the two hooks, the arguments."""
    import inspect

    from triton.backends.nvidia.driver import CudaLauncher

    params = list(inspect.signature(CudaLauncher.__call__).parameters.values())
    names = [p.name for p in params]
    if len(names) == 7:  # Triton 3.6: (self, gridX, gridY, gridZ, stream, function, *args)
        assert names[:6] == ["self", "gridX", "gridY", "gridZ", "stream", "function"]
    else:
        assert names[:6] == ["self", "gridX", "gridY", "gridZ", "stream", "function"] and len(names) == 11
    assert params[-1].kind is inspect.Parameter.VAR_POSITIONAL


def test_plan_cache_finds_nothing_for_unhashable_keys_and_stays_bounded():
    cache = PlanCache(limit=2)
    assert cache.find(([1],)) is None
    for i in range(3):
        cache.keep(i, object())
    assert len(cache) == 1 and 2 in cache  # full: emptied, then the new plan kept
    cache.keep(9, None)
    assert 9 not in cache


def test_describe_covers_what_triton_specialises_on():
    import torch
    t = torch.zeros(4, 9, dtype=torch.bfloat16)
    assert describe(t) == (torch.Size([4, 9]), (9, 1), torch.bfloat16, torch.device("cpu"), t.data_ptr() % 16)
    assert describe(t[:, 1:])[-1] == (t.data_ptr() + 2) % 16
    assert describe(None) is None
    assert describe([1.0]) is describe("x") is not describe(t)  # not a tensor: one key part for all


def test_keys_tell_devices_apart():
    """A ``meta`` tensor (the compile check's capture) never finds the plan of a real launch."""
    import torch

    from fusedpar.kernels.launch import _arg_key
    real, meta = torch.zeros(8), torch.empty(8, device="meta")
    assert meta.data_ptr() % 16 == real.data_ptr() % 16 == 0
    assert _arg_key((real, 3), ()) != _arg_key((meta, 3), ())
    assert describe(real)[3] != describe(meta)[3]


def test_direct_c_launch_passes_what_tritons_launcher_passes(tmp_path):
    """Where the Triton release's CUDA launcher is known (3.6, 3.9), a plan calls its C launch
    function itself: on Triton's real compiled path against the stand-in driver
    (``tests/_stub_c_launch.py``), the arguments and the allocator requests (the TMA GEMM's
    descriptor scratch sized for its grid) equal what ``CudaLauncher.__call__`` passes for the
    same plan; another release calls the launcher object (``layout_release`` None). And the dense
    GEMM and the TP ops (rings, symmetric path; tp 8 emulated) called twice launch the same kernels
    with the same scalar arguments (no host state baked into a launch: CUDA-graph safe)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["XDG_CACHE_HOME"] = str(tmp_path)  # the stub and Triton's cache: built here
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_stub_c_launch.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    import triton

    from fusedpar.kernels.runtime import release
    expected = {(3, 6): "flat", (3, 9): "tuple"}.get(release(triton.__version__))
    assert report["layout_release"] == expected
    cases = report["cases"]
    assert sorted(cases) == ["matmul_pointer_loads", "matmul_tma", "matmul_tma_two_programs", "rms_norm_fwd"]
    for name, r in cases.items():
        assert r.get("error") is None and r["layout"] == expected and r["calls"] == 2 and r["equal"], (name, r)
    tma = cases["matmul_tma"]["scratch"], cases["matmul_tma_two_programs"]["scratch"]
    assert len(tma[0]) == 2 and tma[0][0] == tma[0][1] and tma[1][0] == tma[1][1], tma
    assert tma[1][0][0] == 2 * tma[0][0][0] and cases["matmul_tma_two_programs"]["grid"] == [2, 1, 1]
    assert cases["matmul_pointer_loads"]["scratch"] == [] and cases["rms_norm_fwd"]["scratch"] == []
    # replay invariance (what a CUDA graph replays): the same kernels and scalar arguments call after call
    launches = {"matmul": 1, "all_gather_matmul ring": 8, "matmul_reduce_scatter ring": 16,
                "all_gather_matmul persistent": 1, "matmul_reduce_scatter persistent": 2}
    assert {k: v["launches"] for k, v in report["replays"].items()} == launches
    assert all(v["invariant"] for v in report["replays"].values()), report["replays"]
