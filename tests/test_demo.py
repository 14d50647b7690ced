"""The demo (`make demo`) runs as a user runs it: torchrun, 4 processes, tp2 x sp2 with MoE over
ep4, and its pipeline path pp2 x tp2 — here for two short steps each."""
import math
import os
import re
import subprocess
import sys

import pytest

from fusedpar.demo import default_layout, parse_args, synthetic_batch


def _run_demo(*args):
    """Run the demo under torchrun on 4 CPU processes; return its stdout and per-step losses."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the demo decides by itself (interpreter when no GPU per rank)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "fusedpar.demo", "--steps", "2", "--seq", "8", "--device", "cpu", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr[-4000:]}"
    losses = [float(m) for m in re.findall(r"^step +\d+/2 +loss (\S+)", out, flags=re.M)]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses), out
    assert re.search(r"tokens/s", out) and re.search(r"^loss \S+ -> \S+ over 2 steps", out, flags=re.M), out
    # the first loss is the untrained model's: about ln(vocab) (uniform predictions)
    assert abs(losses[0] - math.log(32)) < 1.5, losses
    return out


@pytest.mark.world
def test_demo_runs_under_torchrun():
    out = _run_demo()
    assert "world 4 = dp 1 x pp 1 x sp 2 x tp 2 (ep 4)" in out, out


@pytest.mark.world
def test_demo_pipeline_path_pp2_x_tp2():
    """``--pp 2`` on 4 processes: two 1F1B pipeline stages (embedding + dense block | MoE block +
    head), tp2 inside each, experts over the stage's tp group; tiny sizes, two steps."""
    out = _run_demo("--pp", "2", "--hidden", "16", "--heads", "2", "--experts", "2", "--top-k", "1")
    assert "world 4 = dp 1 x pp 2 x sp 1 x tp 2 (ep 2)" in out, out


def test_synthetic_data():
    x, y = synthetic_batch(0, 3, 10, 16, seed=1, device="cpu")
    assert x.shape == y.shape == (3, 10)
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are the next tokens
    x2, _ = synthetic_batch(0, 3, 10, 16, seed=1, device="cpu")
    assert (x == x2).all()  # the same batch on every rank


@pytest.mark.parametrize("world,pp,expected", [(4, 1, (2, 2)), (8, 2, (2, 2)), (2, 1, (2, 1)), (1, 1, (1, 1))],
                         ids=["world4", "world8-pp2", "world2", "world1"])
def test_layout_choice(world, pp, expected):
    assert default_layout(world, pp, None, None) == expected


def test_bad_dtype_argument():
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "fp8"])
