"""Layouts that do not fit raise one clear error on every rank, never hang (issue #30, round 2):
modules given several groups check that they fit together at construction, and
``build_parallel_state`` checks that every rank passed the same sizes before creating a group."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _world import world_fixture
from fusedpar.nn import MoE, ParallelAttention, Transformer, TransformerConfig
from fusedpar.parallel import build_parallel_state, check_sizes_agree
from fusedpar.nn import AttentionConfig, MoEConfig

world2 = world_fixture(2, timeout=90)
world4 = world_fixture(4, timeout=90)
SHORT = 60  # a hang fails the test after this many seconds instead of waiting


def _config(**kw):
    return TransformerConfig(**{**dict(vocab_size=16, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                                       ffn_hidden_size=8, num_experts=4, top_k=2, moe_every=2), **kw})


def _build(kind, state):
    """The module of one bad layout, built from ``state``'s groups."""
    world = dist.group.WORLD
    return {
        # the example: pp2 x tp2 without sp_group takes the world as the sequence group
        "transformer tp without sp": lambda: Transformer(_config(), tp_group=state.tp_group),
        "sp given as the world": lambda: Transformer(_config(), tp_group=state.tp_group, sp_group=world),
        "attention tp x world sp": lambda: ParallelAttention(AttentionConfig(16, 4, 2), tp_group=state.tp_group, sp_group=world),
        "attention ulysses = ring": lambda: ParallelAttention(AttentionConfig(16, 4, 2, sp_mode="hybrid"), tp_group=state.sp_group, ulysses_group=state.tp_group, ring_group=world),
        "transformer hybrid overlap": lambda: Transformer(_config(sp_mode="hybrid"), tp_group=state.sp_group,
                                                          ulysses_group=state.tp_group, ring_group=world),
        "vocab over tp": lambda: Transformer(_config(vocab_size=15), tp_group=state.tp_group, sp_group=state.sp_group),
        "heads over tp": lambda: ParallelAttention(AttentionConfig(16, 3, 1, head_dim=4), tp_group=state.tp_group, sp_group=state.sp_group),
        "experts over ep": lambda: MoE(MoEConfig(16, 8, 3, 2), ep_group=state.ep_group),
        "transformer experts over ep": lambda: Transformer(_config(num_experts=3), tp_group=state.tp_group,
                                                           sp_group=state.sp_group, ep_group=state.ep_group),
    }[kind]


# kind -> (layout of the world, the words every rank's message must hold)
CASES = {
    "transformer tp without sp": (dict(pp=-1, tp=2), ["Transformer: tp_group and sp_group must be orthogonal",
                                                      "sp_group (omitted: the world) ranks [0, 1, 2, 3]",
                                                      "pass sp_group"]),
    "sp given as the world": (dict(pp=-1, tp=2), ["tp_group and sp_group must be orthogonal",
                                                         "sp_group ranks [0, 1, 2, 3]"]),
    "attention tp x world sp": (dict(pp=-1, tp=2), ["ParallelAttention: tp_group and sp_group must be orthogonal"]),
    "attention ulysses = ring": (dict(pp=-1, tp=2), ["ulysses_group and ring_group must be orthogonal",
                                                     "ring_group ranks [0, 1, 2, 3]"]),
    "transformer hybrid overlap": (dict(pp=-1, tp=2), ["ulysses_group and ring_group must be orthogonal"]),
    "vocab over tp": (dict(tp=-1), ["config.vocab_size=15 must be divisible by the tensor-parallel group size",
                                    "got tp_group ranks"]),
    "heads over tp": (dict(tp=-1), ["num_heads=3 must be divisible by the tensor-parallel group size",
                                    "got tp_group ranks"]),
    "experts over ep": (dict(ep=-1), ["MoE: num_experts=3 must be divisible by the expert-parallel group size",
                                      "got ep_group ranks"]),
    "transformer experts over ep": (dict(ep=-1), ["config.num_experts=3 must be divisible by the expert-parallel"]),
}


def _bad_layout(rank, size, kind):
    layout = {k: (size // 2 if k == "pp" else size) if v == -1 else v for k, v in CASES[kind][0].items()}
    state = build_parallel_state(**layout)
    with pytest.raises(ValueError) as info:
        _build(kind, state)()
    msg = str(info.value)
    for words in CASES[kind][1]:
        words = words.replace("[0, 1, 2, 3]", str(list(range(size))))
        assert words in msg, f"rank {rank}: {words!r} not in {msg!r}"
    t = torch.ones(1)  # nothing was left half-sent: the world still works
    dist.all_reduce(t)
    return msg


@pytest.mark.parametrize("kind", sorted(CASES))
def test_bad_layout_raises_on_every_rank(world4, kind):
    msgs = world4.run(_bad_layout, kind, timeout=SHORT)
    assert len(msgs) == 4 and all(m for m in msgs)


@pytest.mark.parametrize("kind", ["attention tp x world sp", "experts over ep"])
def test_bad_layout_raises_on_every_rank_world2(world2, kind):
    assert all(world2.run(_bad_layout, kind, timeout=SHORT))


def _good_layout(rank, size):
    # dp=None on one rank and the dp it resolves to on the others agree
    state = build_parallel_state(pp=2, tp=2, dp=None if rank == 0 else 1)
    model = Transformer(_config(), tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group)
    single = dist.new_group([rank], use_local_synchronization=True)
    ParallelAttention(AttentionConfig(16, 4, 2), tp_group=state.tp_group, sp_group=single)  # a group of one: no sp
    return len(list(model.parameters()))


def test_orthogonal_groups_are_accepted(world4):
    assert len(set(world4.run(_good_layout, timeout=SHORT))) == 1


# --- build_parallel_state: sizes agree across ranks ----------------------------------------
SIZE_CASES = {
    "tp differs on one rank": (lambda r, n: dict(tp=4 if r == n - 1 else 2), "tp=2 on ranks"),
    "dp None vs a dp that does not fit": (lambda r, n: dict(dp=None if r == 0 else n, tp=2), "on ranks [0] and dp="),
    "ep and sp differ": (lambda r, n: dict(sp=2, ep=1 + r % 2), "ep=1 on ranks"),
    "non-int on one rank": (lambda r, n: dict(pp=1.0 if r == 0 else 1), "pp=a non-int on ranks [0]"),
    "bad size on one rank": (lambda r, n: dict(tp=3 if r == 1 else 1), "tp=1 on ranks"),
}


def _sizes_disagree(rank, size, kind):
    sizes, words = SIZE_CASES[kind]
    with pytest.raises(ValueError, match="the sizes must be the same on every rank") as info:
        build_parallel_state(**sizes(rank, size))
    assert words in str(info.value), str(info.value)
    t = torch.ones(1)
    dist.all_reduce(t)  # no group was half-created: the world still works
    return str(info.value)


@pytest.mark.parametrize("kind", sorted(SIZE_CASES))
@pytest.mark.parametrize("n", [2, 4])
def test_sizes_must_agree_across_ranks(request, kind, n):
    world = request.getfixturevalue(f"world{n}")
    msgs = world.run(_sizes_disagree, kind, timeout=SHORT)
    assert len(set(msgs)) == 1, msgs  # the same message on every rank


def _missing_rank(rank, size):
    sizes = dict(dp=None, pp=1, tp=1, sp=1, ep=1, sp_ulysses=1)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="every rank of the world .* must call it"):
            check_sizes_agree(sizes, timeout_s=1.0)
        assert time.monotonic() - t0 < 20
    else:
        time.sleep(2.0)
        check_sizes_agree(sizes, timeout_s=30.0)  # late: completes rank 0's abandoned exchange
    return True


def test_a_rank_that_never_arrives_times_out(world2):
    assert all(world2.run(_missing_rank, timeout=SHORT))


_INIT = r"""
import os, sys
from fusedpar.parallel import init_parallel
rank = int(os.environ["RANK"])
try:
    init_parallel(tp=3 if rank == 1 else 1, backend="gloo", timeout_s=60)  # tp=3 does not fit a world of 2
except ValueError as e:
    os.write(1, f"rank {rank}: {e}\n".encode())  # one write: the two ranks share the pipe (print may split it)
    sys.exit(3)
"""


@pytest.mark.world
def test_init_parallel_ranks_with_different_sizes_all_raise(tmp_path):
    """Under torchrun, a rank whose sizes do not fit still joins, so that the other is not left at
    the rendezvous: both raise the same ValueError, quickly."""
    import os
    import subprocess
    import sys

    script = tmp_path / "init.py"
    script.write_text(_INIT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's fusedpar
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0 and time.monotonic() - t0 < 120
    lines = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("rank "))
    assert len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    msgs = {ln.split(": ", 1)[1] for ln in lines}
    assert len(msgs) == 1 and "tp=1 on ranks [0] and tp=3 on ranks [1]" in msgs.pop(), lines
