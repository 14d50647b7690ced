"""The demo (`make demo`) runs as a user runs it: torchrun, 4 processes, tp2 x sp2 with MoE over
ep4, and its pipeline path pp2 x tp2 — here for two short steps each. Then the main job's
promises on 2 processes with a tiny model: a rank killed under ``torchrun --max-restarts 1``
recovers from the last checkpoint with exactly the uninterrupted losses; a damaged newest and an
interrupted checkpoint are skipped with a message; resuming at another layout (tp2 -> dp2) gives
the same losses within reduction-order tolerance. And the data: sources, split, sharded loader,
bad ``--data`` paths."""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fusedpar.data import BatchLoader, DataError, load_tokens, split, unigram_baseline, unigram_entropy
from fusedpar.demo import default_layout, lr_at, main, parse_args
from fusedpar.kernels.interpreter import interpreter_problem


def _torchrun_cmd(nproc, *args, restarts=0):
    problem = interpreter_problem()  # the CPU ranks run the kernels interpreted
    if problem:
        pytest.skip(problem)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the demo decides by itself (interpreter when no GPU per rank)
    return env, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                 "--max-restarts", str(restarts), "-m", "fusedpar.demo", "--device", "cpu", *args]


def _torchrun(nproc, *args, restarts=0, check=True):
    env, cmd = _torchrun_cmd(nproc, *args, restarts=restarts)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if check:
        assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def _run_demo(*args):
    """Run the demo under torchrun on 4 CPU processes; return its stdout."""
    out = _torchrun(4, "--steps", "2", "--seq", "8", "--batch", "2", "--eval-every", "2", "--eval-batches", "1",
                    "--max-bytes", "100000", *args).stdout
    losses = [float(m) for m in re.findall(r"^step +\d+/2 +loss (\S+)", out, flags=re.M)]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses), out
    assert re.search(r"tokens/s", out) and re.search(r"^summary: train loss \S+ \(step 1\) -> \S+ \(step 2\), "
                                                     r"val loss \S+", out, flags=re.M), out
    assert re.search(r"unigram baseline \d\.\d+ nats/token", out), out
    # the first loss is the untrained model's: about ln(256) (uniform predictions over bytes)
    assert abs(losses[0] - math.log(256)) < 1.0, losses
    return out


@pytest.mark.world
def test_demo_runs_under_torchrun():
    """The default layout with DeepSeek-V3 style routing (sigmoid scores, the bias update, the
    sequence-wise loss); each step line shows the MoE block's global per-expert load."""
    out = _run_demo("--router-score", "sigmoid", "--bias-update-rate", "1e-3", "--seq-aux-coef", "1e-3")
    assert "world 4 = dp 1 x pp 1 x sp 2 x tp 2 (ep 4)" in out, out
    loads = re.findall(r"^step +\d+/2 .* layer 1 load \[(\d+), (\d+), (\d+), (\d+)\] maxvio (\S+)$", out, flags=re.M)
    # 2 sequences of 8 tokens, top-2: 32 routed slots per step, summed over the 4 ranks
    assert len(loads) == 2 and all(sum(int(c) for c in row[:4]) == 32 for row in loads), out
    assert "Python standard library sources" in out, out


@pytest.mark.world
def test_demo_pipeline_path_pp2_x_tp2():
    """``--pp 2`` on 4 processes: two 1F1B pipeline stages (embedding + dense block | MoE block +
    head), tp2 inside each, experts over the stage's tp group; tiny sizes, two steps."""
    out = _run_demo("--pp", "2", "--hidden", "16", "--heads", "2", "--experts", "2", "--top-k", "1")
    assert "world 4 = dp 1 x pp 2 x sp 1 x tp 2 (ep 2)" in out, out
    # the router counts exactly the step's tokens (2 sequences x 8, top-1): no shape-inference pass
    # running the MoE stage on uninitialised memory (torch.empty) adds its garbage tokens
    loads = [sum(map(int, m.split(","))) for m in re.findall(r"load \[([\d, ]+)\]", out)]
    assert loads == [16, 16], out


@pytest.mark.world
def test_demo_trains_in_fp8_like_fp32(tmp_path):
    """``--fp8 rowwise`` trains like the fp32 run: the demo's default 12 steps, model and schedule
    (2 blocks, one MoE, hidden 32, lr 2e-2 with warm-up and cosine decay) in the smallest honest
    variant: the fp8 run on 2 processes at tp2 (the fp8 projections run the tensor-parallel fp8 ops,
    fp8 gathers and reduce-scatters included; the experts in fp8), the fp32 run on one process,
    2 sequences of 16 tokens per step, one validation batch at the end. The final validation loss is within 3% of the fp32 run's and both runs learned (below the
    unigram baseline). The default run (4 processes x 4 sequences of 32, or 2 at tp2) costs about
    110 CPU-seconds per run under the interpreter, too slow to run twice more in CI; this variant
    about 46 (measured: 2.1559 fp32, 2.1439 fp8 rowwise; the default at tp2: 2.8379 fp32, 2.8391
    rowwise, 2.8362 blockwise). ``blockwise`` at sp2 (ring attention, experts over ep2) as a third
    run of this variant doubles its time (96 s), so it is run by hand: 2026-11-27, 2.1578 fp32,
    2.1587 rowwise tp2, 2.1535 blockwise sp2 (the same command with ``--tp 1 --sp 2 --fp8
    blockwise``)."""
    runs = {}
    # the fp8 run at tp2, the fp32 baseline on one process (one seed gives the same model and data at
    # every layout: DESIGN §2), both at once on the 2 cores
    for name, nproc, extra in (("fp32", 1, ("--tp", "1")), ("fp8", 2, ("--tp", "2", "--fp8", "rowwise"))):
        env, cmd = _torchrun_cmd(nproc, "--sp", "1", "--seq", "16", "--batch", "2", "--eval-batches", "1",
                                 "--eval-every", "12", "--max-bytes", "100000",
                                 "--metrics", str(tmp_path / f"{name}.jsonl"), *extra)
        runs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    val, baseline = {}, {}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"demo {name} failed ({proc.returncode}):\n{out}\n{err[-4000:]}"
        metrics = tmp_path / f"{name}.jsonl"
        assert ("fp8 rowwise projections" in out) == (name == "fp8"), out
        recs = _metrics(metrics)
        assert [r["step"] for r in recs] == list(range(1, 13)) and "val_loss" in recs[-1], recs
        val[name] = recs[-1]["val_loss"]
        baseline[name] = float(re.search(r"unigram baseline (\d\.\d+)", out).group(1))
    assert baseline["fp8"] == baseline["fp32"] and val["fp32"] < baseline["fp32"] and val["fp8"] < baseline["fp8"], \
        (val, baseline)
    assert abs(val["fp8"] - val["fp32"]) <= 0.03 * val["fp32"], val


TINY = ("--seq", "8", "--hidden", "16", "--heads", "2", "--experts", "2", "--top-k", "1", "--eval-batches", "1",
        "--eval-every", "2", "--steps", "4", "--save-every", "2", "--max-bytes", "100000")


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.world
def test_killed_rank_recovers_and_resume_is_exact_and_reshards(tmp_path):
    """One uninterrupted run (tp2) is the reference. A run whose rank 1 dies at step 3 under
    ``torchrun --max-restarts 1`` resumes from the step-2 checkpoint: the same losses to 1e-6.
    Then the reference's checkpoints with the newest damaged and an interrupted step-6 directory:
    a run at dp2 (another layout, same global batch) skips both with a message and continues
    from step 2 with the reference's losses within reduction-order tolerance."""
    ref_dir, ref_metrics = tmp_path / "ref", tmp_path / "ref.jsonl"
    _torchrun(2, *TINY, "--batch", "2", "--ckpt-dir", str(ref_dir), "--metrics", str(ref_metrics))
    ref = _metrics(ref_metrics)
    assert [r["step"] for r in ref] == [1, 2, 3, 4] and all("val_loss" in r for r in ref[1::2]), ref
    assert all(set(r) >= {"loss", "lr", "tokens_per_s", "elapsed_s"} for r in ref)
    damaged = tmp_path / "damaged"
    shutil.copytree(ref_dir, damaged)

    crash_dir, crash_metrics = tmp_path / "crash", tmp_path / "crash.jsonl"
    proc = _torchrun(2, *TINY, "--batch", "2", "--ckpt-dir", str(crash_dir), "--metrics", str(crash_metrics),
                     "--simulate-failure", "3", restarts=1)
    assert "simulated failure of rank 1 at step 3" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"resumed from \S+step_00000002", proc.stdout), proc.stdout
    crash = _metrics(crash_metrics)
    assert [r["step"] for r in crash] == [1, 2, 3, 4], crash  # the repeated steps are not doubled
    for a, b in zip(ref, crash):
        for key in ("loss", "val_loss"):
            if key in a:
                assert abs(b[key] - a[key]) <= 1e-6 * abs(a[key]), (key, ref, crash)
    assert sorted(os.listdir(crash_dir)) == ["step_00000002", "step_00000004"]

    # damage the newest checkpoint's bytes, and leave an interrupted save behind
    with open(damaged / "step_00000004" / "fusedpar_complete.json") as f:
        fname, off, n, _ = next(iter(json.load(f)["chunks"].values()))
    with open(damaged / "step_00000004" / fname, "r+b") as f:
        f.seek(off + n // 2)
        byte = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.makedirs(damaged / "step_00000006")
    re_metrics = tmp_path / "reshard.jsonl"
    proc = _torchrun(2, *TINY, "--tp", "1", "--sp", "1", "--batch", "1", "--ckpt-dir", str(damaged),
                     "--metrics", str(re_metrics))
    out = proc.stdout
    assert "world 2 = dp 2 x pp 1 x sp 1 x tp 1" in out, out
    assert re.search(r"skipping \S+step_00000006: incomplete", out), out
    assert re.search(r"skipping \S+step_00000004: .*changed on disk", out), out
    assert re.search(r"resumed from \S+step_00000002", out), out
    resharded = _metrics(re_metrics)
    assert [r["step"] for r in resharded] == [3, 4]
    for a, b in zip(ref[2:], resharded):
        assert abs(b["loss"] - a["loss"]) <= 1e-3 * abs(a["loss"]), (ref, resharded)



@pytest.mark.parametrize("world,pp,expected", [(4, 1, (2, 2)), (8, 2, (2, 2)), (2, 1, (2, 1)), (1, 1, (1, 1))],
                         ids=["world4", "world8-pp2", "world2", "world1"])
def test_layout_choice(world, pp, expected):
    assert default_layout(world, pp, None, None) == expected


@pytest.mark.parametrize("argv", [["--dtype", "fp8"], ["--steps", "0"], ["--save-every", "2"],
                                  ["--simulate-failure", "3"], ["--eval-every", "-1"], ["--bias-update-rate", "-1"]],
                         ids=["dtype", "steps", "save-without-dir", "failure-without-dir", "eval-every",
                              "bias-update-rate"])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_lr_schedule_warms_up_and_decays():
    args = parse_args(["--lr", "1.0", "--warmup", "4", "--steps", "20"])
    lrs = [lr_at(s, args) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] > 0.1


def test_default_corpus_is_the_stdlib_and_deterministic():
    a, b = load_tokens(None, max_bytes=50000), load_tokens(None, max_bytes=50000)
    assert a.vocab == 256 and len(a.ids) == 50000 and np.array_equal(a.ids, b.ids)
    assert "standard library" in a.source and a.fingerprint() == b.fingerprint()
    train, val = split(a, 0.1, 16)
    assert len(val) == 5000 and np.array_equal(np.concatenate([train, val]), a.ids)
    # Python source is far from uniform over bytes
    assert 2.0 < unigram_entropy(train, 256) < math.log(256) - 1.0
    # the baseline is a cross entropy: at least the validation split's own entropy
    assert unigram_baseline(train, val, 256) >= unigram_entropy(val, 256) - 1e-9
    assert unigram_baseline(train, train, 256) == pytest.approx(unigram_entropy(train, 256), abs=5e-3)  # add-half smoothing


def test_loader_shards_the_global_batch_and_resumes_at_its_position():
    ids = np.arange(1000) % 256
    whole = BatchLoader(ids, 8, 4, seed=3)
    halves = [BatchLoader(ids, 8, 2, dp=2, dp_rank=r, seed=3) for r in range(2)]
    for _ in range(40):  # past an epoch boundary (124 windows, 4 per step)
        x, y = whole.next_batch()
        parts = [h.next_batch() for h in halves]
        assert (x == np.concatenate([p[0] for p in parts])).all() and (y == np.concatenate([p[1] for p in parts])).all()
        assert (x[:, 1:] == y[:, :-1]).all()
    again = BatchLoader(ids, 8, 4, seed=3)
    again.load_state_dict(whole.state_dict())
    assert (again.next_batch()[0] == whole.next_batch()[0]).all()


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_data_sources_and_bad_paths(tmp_path):
    text = _write(tmp_path / "a.txt", b"hello world\n" * 10)
    assert load_tokens(text).ids.tobytes() == b"hello world\n" * 10
    os.makedirs(tmp_path / "dir" / "sub")
    _write(tmp_path / "dir" / "sub" / "b.txt", b"BBB")
    _write(tmp_path / "dir" / "a.txt", b"AAA")
    _write(tmp_path / "dir" / ".hidden", b"HHH")
    assert load_tokens(str(tmp_path / "dir")).ids.tobytes() == b"AAABBB"  # sorted paths, hidden skipped
    ids = np.array([1, 70000, 5], dtype=np.uint32)
    big = _write(tmp_path / "big.bin", ids.tobytes())
    assert load_tokens(big, vocab=70001).ids.tolist() == [1, 70000, 5]
    small = _write(tmp_path / "small.bin", np.array([3, 2, 1], dtype=np.uint16).tobytes())
    assert load_tokens(small, vocab=4).ids.tolist() == [3, 2, 1]
    os.makedirs(tmp_path / "empty")
    cases = [
        ((str(tmp_path / "missing.txt"), None), "no such file or directory"),
        ((str(tmp_path / "empty"), None), "holds no (non-hidden) files"),
        ((_write(tmp_path / "empty.txt", b""), None), "empty file"),
        ((small, None), "--vocab must be given"),
        ((small, 3), "token ids must be < --vocab 3, found id 3"),
        ((_write(tmp_path / "odd.bin", b"\x00\x01\x02"), 10), "not a positive multiple of 2"),
        ((text, 1000), "--vocab must be 256 for byte-level text"),
    ]
    for (path, vocab), words in cases:
        with pytest.raises(DataError, match=re.escape(words)) as e:
            load_tokens(path, vocab)
        assert path in str(e.value) or "--vocab" in str(e.value)
    with pytest.raises(DataError, match="fewer than one sequence"):
        split(load_tokens(_write(tmp_path / "short.txt", b"abc" * 10)), 0.1, 16)


def test_bad_data_path_fails_the_demo_clearly(tmp_path, capsys):
    """The demo reads its data before it joins a world: a bad path fails at once, by name, in one
    line without a traceback (``--debug`` raises it)."""
    assert main(["--data", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"fusedpar.demo: error: --data '.*nope': no such file or directory", err), err
    with pytest.raises(DataError, match=r"--data '.*nope': no such file or directory"):
        main(["--data", str(tmp_path / "nope"), "--device", "cpu", "--debug"])


# --- user mistakes: one line on rank 0, exit code 2, no traceback (issue #30) ---------------
def _demo_error(argv, capsys, monkeypatch, world=None):
    if world is not None:  # sizes are checked against WORLD_SIZE before the world is joined
        monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main([*argv, "--device", "cpu"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedpar.demo: error: "), out.err
    assert "Traceback" not in out.err and out.out == "", out
    return lines[0]


@pytest.mark.parametrize("argv,world,words", [
    (["--tp", "0"], None, "--tp must be positive, got 0"),
    (["--sp", "-2"], None, "--sp must be positive, got -2"),
    (["--pp", "0"], None, "--pp must be positive, got 0"),
    (["--batch", "0"], None, "--batch must be positive, got 0"),
    (["--seq", "0"], None, "--seq must be positive, got 0"),
    (["--val-fraction", "1.5"], None, "--val-fraction must be in (0, 1), got 1.5"),
    (["--lr", "0"], None, "--lr must be positive, got 0.0"),
    (["--top-k", "3", "--experts", "2"], None, "--top-k must be <= --experts (2), got 3"),
    (["--hidden", "30", "--heads", "4"], None, "--hidden must be a multiple of --heads (4)"),
    (["--tp", "x"], None, "argument --tp: invalid int value: 'x'"),
    (["--fp8", "e5m2"], None, "argument --fp8: invalid choice: 'e5m2' (choose from"),
    (["--save-every", "2"], None, "--save-every and --simulate-failure need --ckpt-dir"),
    (["--tp", "3"], 4, "--pp 1 x --tp 3 x --sp 1 = 3 must divide the world size 4"),
    (["--pp", "2", "--batch", "3"], None, "--batch must be a multiple of --microbatches (2) with --pp > 1, got 3"),
    (["--pp", "2", "--layers", "3"], 4, "--layers must be divisible by --pp 2, got 3"),
    (["--ep", "3", "--tp", "1", "--sp", "1"], 4, "--ep 3 must divide the ranks of one pipeline stage (4)"),
    (["--tp", "4", "--sp", "1", "--heads", "2", "--hidden", "16"], 4, "--tp 4 must divide --heads (2)"),
    (["--seq", "10"], 4, "--seq must be divisible by 4 (--sp 2, --tp 2, zigzag layout), got 10"),
    (["--simulate-failure", "1", "--ckpt-dir", "."], None, "--simulate-failure fails rank 1: it needs at least 2"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_user_mistakes_exit_with_one_line(argv, world, words, capsys, monkeypatch):
    line = _demo_error(argv, capsys, monkeypatch, world)
    assert words in line, line


def test_user_mistakes_print_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert main(["--tp", "0", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ""


def test_debug_keeps_the_traceback():
    with pytest.raises(SystemExit, match="--tp must be positive"):
        main(["--tp", "0", "--device", "cpu", "--debug"])


def test_bad_sources_and_checkpoint_directories(tmp_path, capsys, monkeypatch):
    a_file = _write(tmp_path / "a_file.txt", b"hello")
    (tmp_path / "empty_dir").mkdir()
    cases = [
        (["--data", str(tmp_path / "empty_dir")], "--data '", "the directory holds no"),
        (["--data", str(a_file), "--vocab", "300"], "--vocab must be 256", ""),
        (["--data", str(a_file), "--seq", "64"], "a shorter --seq", ""),
        (["--ckpt-dir", str(a_file)], f"--ckpt-dir must be a directory, got {str(a_file)!r} (a file)", ""),
        (["--ckpt-dir", os.path.join(a_file, "sub")], "--ckpt-dir must be a directory that can be created", ""),
    ]
    for argv, *words in cases:
        line = _demo_error(argv, capsys, monkeypatch)
        assert all(w in line for w in words), line


def test_a_checkpoint_of_another_model_is_one_line(tmp_path, capsys):
    """An intact checkpoint of another model in --ckpt-dir is a user mistake: one line naming
    --ckpt-dir (in-process, world of 1, no training step: the checkpoint is written directly)."""
    import torch

    from fusedpar.checkpoint import CheckpointManager
    from fusedpar.nn import Transformer, TransformerConfig

    other = Transformer(TransformerConfig(vocab_size=256, hidden_size=8, num_layers=1, num_heads=2,
                                          ffn_hidden_size=8))
    CheckpointManager(str(tmp_path), log=lambda m: None).save(1, other)
    data = _write(tmp_path / "d.txt", bytes(range(256)) * 8)
    rc = main(["--data", str(data), "--ckpt-dir", str(tmp_path), "--device", "cpu", "--seq", "8", "--steps", "2",
               "--max-bytes", "4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("fusedpar.demo: error: --ckpt-dir: "), err
    assert not torch.distributed.is_initialized()  # the in-process world was left


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(seq=0, batch=2), ValueError, "seq must be >= 1, got 0"),
    (dict(seq=4, batch=0), ValueError, "batch must be >= 1, got 0"),
    (dict(seq=4, batch=2, dp=0), ValueError, "dp must be >= 1, got 0"),
    (dict(seq=4.0, batch=2), TypeError, "seq must be an int, got float 4.0"),
    (dict(seq=4, batch=2, dp=2, dp_rank=2), ValueError, "dp_rank must be in [0, 2), got 2"),
    (dict(seq=4, batch=2, seed=-1), ValueError, "seed must be >= 0, got -1"),
], ids=["seq0", "batch0", "dp0", "seq-float", "dp-rank", "seed"])
def test_batch_loader_validates_its_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        BatchLoader(np.arange(100), **kwargs)


def test_data_functions_validate_their_arguments(tmp_path):
    text = _write(tmp_path / "t.txt", b"x" * 100)
    with pytest.raises(ValueError, match=re.escape("max_bytes must be >= 1, got 0")):
        load_tokens(text, max_bytes=0)
    with pytest.raises(TypeError, match="path must be a str, a path or None, got int 3"):
        load_tokens(3)
    with pytest.raises(ValueError, match=re.escape("seq must be >= 1, got 0")):
        split(load_tokens(text), 0.1, 0)
    with pytest.raises(ValueError, match=re.escape("n_batches must be >= 1, got 0")):
        list(BatchLoader(np.arange(100), 4, 2).eval_batches(0))
