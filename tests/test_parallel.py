"""fusedpar.parallel: mesh layout, group membership, size validation, gradient sync rules."""
import os
import pytest
import torch
import torch.distributed as dist

from _world import world_fixture
from fusedpar import parallel
from fusedpar.parallel import build_parallel_state, resolve_sizes, sync_gradients

world4 = world_fixture(4)


def _members(group):
    return dist.get_process_group_ranks(group)


def _expected(rank, pp, dp, sp, tp, ep, uly=1):
    """Group members from the documented layout formula, computed independently of the mesh."""
    coords = {}
    for r in range(pp * dp * sp * tp):
        t, rest = r % tp, r // tp
        s, rest = rest % sp, rest // sp
        d, p = rest % dp, rest // dp
        coords[r] = (p, d, s, t)
    p, d, s, t = coords[rank]
    same = lambda keep: sorted(r for r, c in coords.items() if all(c[i] == (p, d, s, t)[i] for i in keep))  # noqa: E731
    stage = dp * sp * tp
    local = rank % stage
    ep_block = [p * stage + (local // ep) * ep + j for j in range(ep)]
    edp = [p * stage + b * ep + local % ep for b in range(stage // ep)]
    sp_members = same((0, 1, 3))  # ordered by sp rank; sp rank = ring rank * uly + ulysses rank
    return dict(
        tp=same((0, 1, 2)), sp=sp_members, dp=same((0, 2, 3)), pp=same((1, 2, 3)),
        data=same((0, 3)), data_tp=same((0,)), ep=ep_block, edp=edp,
        ulysses=[r for i, r in enumerate(sp_members) if i // uly == s // uly],
        ring=[r for i, r in enumerate(sp_members) if i % uly == s % uly],
        coord=dict(pp_rank=p, dp_rank=d, sp_rank=s, tp_rank=t, ep_rank=local % ep),
    )


LAYOUTS = [
    dict(dp=2, tp=2), dict(pp=2, tp=2), dict(sp=2, tp=2, ep=2), dict(dp=2, sp=2, ep=4), dict(dp=4, ep=2),
    dict(pp=4), dict(sp=4, sp_ulysses=2), dict(dp=2, sp=2, sp_ulysses=2), dict(sp=2, tp=2, sp_ulysses=2),
]


def _layouts(rank, size):
    for layout in LAYOUTS:
        st = build_parallel_state(**layout)
        full = resolve_sizes(size, **layout)
        exp = _expected(rank, full["pp"], full["dp"], full["sp"], full["tp"], full["ep"], full["sp_ulysses"])
        for name in ("tp", "sp", "dp", "pp", "data", "data_tp", "ep", "edp", "ulysses", "ring"):
            assert _members(st.group(name)) == exp[name], (layout, name, _members(st.group(name)), exp[name])
        for k, v in exp["coord"].items():
            assert getattr(st, k) == v, (layout, k)
        assert (st.dp, st.pp, st.tp, st.sp, st.ep) == tuple(full[k] for k in ("dp", "pp", "tp", "sp", "ep"))
        assert (st.ring_rank, st.ulysses_rank) == divmod(st.sp_rank, st.sp_ulysses)
        assert st.sp_ring * st.sp_ulysses == st.sp
        assert st.mesh.mesh_dim_names == ("pp", "dp", "sp", "tp")
        assert st.mesh["tp"].size() == st.tp and st.data_mesh.size() == st.dp * st.sp
        assert st.is_first_stage == (st.pp_rank == 0) and st.is_last_stage == (st.pp_rank == st.pp - 1)
        # the groups really work: a sum over the tp group counts its members
        t = torch.ones(1)
        dist.all_reduce(t, group=st.tp_group)
        assert t.item() == st.tp
    return True


def test_layouts_and_groups(world4):
    assert world4.run(_layouts) == [True] * 4


def _sync_rules(rank, size):
    """dp=2 x tp=2 with ep=2 (experts over the tp pair, copies across dp): each rule sums over its
    own group and scales by 1/(dp*sp); after DDP/FSDP only the replicated kind is summed over tp."""
    st = build_parallel_state(dp=2, tp=2, ep=2)
    kinds = ("dense", "replicated", "expert")
    params = {k: torch.nn.Parameter(torch.zeros(3)) for k in kinds}
    for p in params.values():
        p.grad = torch.full((3,), float(rank + 1))
    sync_gradients(params.items(), st, {k: k for k in kinds})
    assert _members(st.edp_group) == _members(st.data_group) == [rank % 2, rank % 2 + 2]
    dense = sum(r + 1 for r in _members(st.data_group)) / 2
    assert params["dense"].grad.tolist() == [dense] * 3
    assert params["replicated"].grad.tolist() == [sum(r + 1 for r in range(4)) / 2] * 3
    assert params["expert"].grad.tolist() == [dense] * 3
    for p in params.values():
        p.grad = torch.full((3,), float(rank + 1))
    sync_gradients(params.items(), st, {k: k for k in kinds}, data_parallel_done=True)
    tp_sum = sum(r + 1 for r in _members(st.tp_group))
    assert [params[k].grad[0].item() for k in kinds] == [rank + 1, tp_sum, rank + 1]
    with pytest.raises(ValueError, match="data_parallel_done must be False, True, 'data' or 'dp', got 'tp'"):
        sync_gradients(params.items(), st, {k: k for k in kinds}, data_parallel_done="tp")
    # a wrapper over dp only, sp > 1: dense/expert summed over sp, replicated over sp then tp, / sp
    st_sp = build_parallel_state(dp=2, sp=2)  # tp1: ep == tp == 1
    for p in params.values():
        p.grad = torch.full((3,), float(rank + 1))
    sync_gradients(params.items(), st_sp, {k: k for k in kinds}, data_parallel_done="dp")
    sp_mean = sum(r + 1 for r in _members(st_sp.sp_group)) / 2
    assert [params[k].grad[0].item() for k in kinds] == [sp_mean] * 3
    with pytest.raises(ValueError, match="gradient kind of 'x' must be one of"):
        sync_gradients([("x", params["dense"])], st, {"x": "bogus"})
    with pytest.raises(ValueError, match="parameter 'y' is not in the gradient plan"):
        sync_gradients([("y", params["dense"])], st, {"x": "dense"})  # unnamed: no silent "dense"
    st4 = build_parallel_state(dp=2, tp=2, ep=4)  # edp has one member: experts sum over nothing
    params["expert"].grad = torch.full((3,), float(rank + 1))
    sync_gradients([("w", params["expert"])], st4, {"w": "expert"})
    assert params["expert"].grad.tolist() == [(rank + 1) / 2] * 3
    with pytest.raises(ValueError, match=r"only right when ep \(4\) equals tp \(2\)"):
        sync_gradients([("w", params["expert"])], st4, {"w": "expert"}, data_parallel_done=True)
    return True


def test_sync_gradients_rules(world4):
    assert world4.run(_sync_rules) == [True] * 4


def _bad_sizes(rank, size):
    with pytest.raises(ValueError, match=r"dp\*pp\*tp\*sp = 2\*1\*3\*1 = 6 must equal the world size 4"):
        build_parallel_state(dp=2, tp=3)
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by pp\*tp\*sp = 1\*3\*1 = 3"):
        build_parallel_state(tp=3)
    with pytest.raises(ValueError, match="ep=3 must divide dp\\*sp\\*tp = 2\\*1\\*2 = 4"):
        build_parallel_state(dp=2, tp=2, ep=3)
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        build_parallel_state(tp=0)
    with pytest.raises(TypeError, match="pp must be a positive int, got float 2.0"):
        build_parallel_state(pp=2.0)
    with pytest.raises(ValueError, match="sp_ulysses=3 must divide sp=2"):
        build_parallel_state(sp=2, sp_ulysses=3)
    with pytest.raises(ValueError, match="unknown group name 'xp'"):
        build_parallel_state(tp=2).group("xp")
    # the world still works after the rejected layouts (nothing half-built, no hang)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_bad_sizes_clear_errors_on_every_rank(world4):
    assert world4.run(_bad_sizes) == [4.0] * 4


def test_resolve_sizes_without_a_world():
    assert resolve_sizes(8, pp=2, tp=2) == dict(dp=2, pp=2, tp=2, sp=1, ep=1, sp_ulysses=1)
    assert resolve_sizes(8, dp=2, sp=2, tp=2, ep=8)["ep"] == 8
    with pytest.raises(ValueError, match="dp must be a positive int, got -1"):
        resolve_sizes(4, dp=-1)
    with pytest.raises(RuntimeError, match="not initialised"):
        parallel.build_parallel_state(tp=1)


_ELASTIC = r"""
import datetime, os
import torch.distributed as dist
from fusedpar.parallel import elastic_store, init_parallel

timeout = datetime.timedelta(seconds=60)
shared = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)  # torchrun's, shared by attempts
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(shared.port), RANK="0", WORLD_SIZE="1",
                  TORCHELASTIC_USE_AGENT_STORE="True")
for attempt in (0, 1):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    store = elastic_store(timeout)
    store.set("probe", str(attempt))
    assert shared.get(f"fusedpar.attempt{attempt}/probe") == str(attempt).encode()
    assert not store.check(["stale"]), "a key of the previous attempt is visible to this one"
    store.set("stale", "written by this attempt: the next one must not read it")
    before = shared.num_keys()
    state = init_parallel(backend="gloo")  # joins through the prefixed store, not the plain one
    assert state.world_size == 1 and shared.num_keys() > before
    dist.destroy_process_group()
assert not shared.check(["stale"]) and shared.check(["fusedpar.attempt0/stale", "fusedpar.attempt1/stale"])
print("ok")
"""


def test_init_parallel_joins_through_a_store_per_restart_attempt():
    """Under torchelastic, init_parallel joins the world through torchrun's shared store prefixed
    with the restart attempt, so a restarted world never reads the previous attempt's peers."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "WORLD_"))}
    out = subprocess.run([sys.executable, "-c", _ELASTIC], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


_ENV_RANK = r"""
import sys
import torch
import torch.distributed as dist
from fusedpar.parallel import init_parallel

state = init_parallel(tp=2, backend="gloo", timeout_s=60)  # env://: RANK, WORLD_SIZE, MASTER_ADDR / _PORT
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t, group=state.tp_group)
print(f"rank {dist.get_rank()} of {state.world_size}: tp {state.tp_rank} of {state.tp}, dp {state.dp}, sum {t.item()}")
dist.destroy_process_group()
"""


def test_init_parallel_joins_from_the_environment_without_torchelastic():
    """Outside torchrun (a launcher that only sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, as Slurm or MPI wrappers do), two processes join one world through ``env://``
    and build the same layout: a tp group of both ranks whose all-reduce sums them."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "WORLD_",
                                                                      "LOCAL_RANK"))}
    procs = [subprocess.Popen([sys.executable, "-c", _ENV_RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(base, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                  MASTER_PORT=str(port)))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:  # a rank left waiting at the rendezvous must not outlive the test
        for p in procs:
            p.kill()
            p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        assert out.strip() == f"rank {r} of 2: tp {r} of 2, dp 1, sum 3.0", out
