"""Checkpoints that cannot be loaded wrong, on a 2-rank gloo world: every failure of DCP becomes
the same :class:`fusedpar.checkpoint.CheckpointError` (an ``Exception``) on every rank, naming
the path, the key and expected vs found shape; changed bytes fail their crc32; an interrupted
save is never loaded; model and optimizer state reshard (tp2 x ep2 -> dp2); the manager keeps
the last K and falls back past damaged checkpoints. Also the demo's bf16 mixed precision
against fp32."""
import json
import os
import shutil

import torch
import torch.distributed as dist

from fusedpar import checkpoint as fck
from fusedpar.nn import Placement, Transformer
from fusedpar.nn.placement import gradient_sync_plan
from fusedpar.ops import comm
from fusedpar.parallel import build_parallel_state, sync_gradients

from _compose import batch, local_batch, tiny_config
from _world import world_fixture

world2 = world_fixture(2)
B, S = 2, 8


def _model(state, **kw):
    config = tiny_config(num_experts=2, top_k=1, moe_every=2, **kw)
    return Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                       seed=3)


def _trained(state, **kw):
    """A tiny model and AdamW after one step (so the moments are not zero)."""
    model = _model(state, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = batch(5, B, S, model.config.vocab_size)
    ids, tgt = local_batch(tokens, targets, state)
    model.loss(model(ids), tgt).backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    opt.step()
    return model, opt


def _full(model, tensors):
    placements = fck.placements_of(model)
    return {n: placements[n].full_from_local(t) for n, t in tensors.items()}


def _moments(model, opt):
    return _full(model, {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()})


def _on_rank0(rank, fn):
    if rank == 0:
        fn()
    dist.barrier()


def _copy(rank, src, dst, damage=None):
    def work():
        shutil.copytree(src, dst)
        if damage:
            damage(dst)
    _on_rank0(rank, work)
    return dst


def _chunk(path, key_prefix="model.layers.0.attn.qkv.weight"):
    """(file, offset, length, chunk name) of a stored chunk of ``key_prefix``."""
    with open(os.path.join(path, fck.MARKER)) as f:
        chunks = json.load(f)["chunks"]
    name = next(n for n in sorted(chunks) if n.startswith(key_prefix))
    fname, off, n, _ = chunks[name]
    return os.path.join(path, fname), off, n, name


def _flip(path):
    fpath, off, n, _ = _chunk(path)
    with open(fpath, "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([b[0] ^ 0x5A]))


def _truncate(path):
    fpath, off, n, _ = _chunk(path)
    with open(fpath, "r+b") as f:
        f.truncate(off + n // 2)


def _garbage_metadata(path):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(os.urandom(300))


def _error(fn):
    try:
        fn()
    except fck.CheckpointError as e:
        assert isinstance(e, Exception)
        return type(e).__name__, str(e)
    raise AssertionError("no CheckpointError")


def _failures(rank, size, root):
    state = build_parallel_state(tp=2, ep=2)
    model, opt = _trained(state)
    good = os.path.join(root, "good")
    fck.save(model, good, optimizer=opt, extra={"step": torch.tensor(1)})
    fresh = _model(state)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    out = {}

    def load(path, target=fresh, **kw):
        return _error(lambda: fck.load(target, path, optimizer=fresh_opt if target is fresh else None, **kw))

    out["missing path"] = load(os.path.join(root, "nowhere"))
    out["no marker"] = load(_copy(rank, good, os.path.join(root, "partial"),
                                  lambda p: os.remove(os.path.join(p, fck.MARKER))))
    out["garbage metadata"] = load(_copy(rank, good, os.path.join(root, "garbage"), _garbage_metadata))
    out["truncated file"] = load(_copy(rank, good, os.path.join(root, "truncated"), _truncate))
    out["changed bytes"] = load(_copy(rank, good, os.path.join(root, "flipped"), _flip))
    out["another size"] = load(good, target=_model(state, hidden_size=32))
    out["key not saved"] = load(good, extra={"not_saved": torch.zeros(2)})
    out["fewer layers"] = _error(lambda: fck.load(_model(state, num_layers=1), good))
    out["flipped chunk"] = _chunk(os.path.join(root, "flipped"))[3].split("@")[0]
    # the damaged loads left nothing half-loaded that a good load does not overwrite
    fck.load(fresh, good, optimizer=fresh_opt)
    got = fck.full_state(fresh)
    for n, p in fck.full_state(model).items():
        assert torch.equal(got[n], p), n
    return out


def test_every_checkpoint_failure_is_a_fusedpar_error_on_every_rank(world2, tmp_path):
    r0, r1 = world2.run(_failures, str(tmp_path))  # the ranks share the directory
    assert r0 == r1, (r0, r1)  # the same error on both ranks
    flipped = r0.pop("flipped chunk")
    expect = {  # case -> (error class, words the message must hold)
        "missing path": ("CheckpointError", ["nowhere", "no such directory"]),
        "no marker": ("CheckpointError", ["partial", "incomplete", fck.MARKER]),
        "garbage metadata": ("CheckpointError", ["garbage", ".metadata", "changed on disk"]),
        "truncated file": ("CheckpointError", ["truncated", "key 'model.", "file ends", "a truncated file"]),
        "changed bytes": ("CheckpointError", ["flipped", repr(flipped), "crc32", "changed on disk"]),
        "another size": ("CheckpointMismatchError", ["good", "expected shape", "found", "another model size"]),
        "key not saved": ("CheckpointMismatchError", ["'extra.not_saved' is not in the checkpoint"]),
        "fewer layers": ("CheckpointMismatchError", ["keys this model does not have", "model.layers.1."]),
    }
    assert set(r0) == set(expect)
    for case, (cls, words) in expect.items():
        name, msg = r0[case]
        assert name == cls, (case, name, msg)
        assert msg.startswith("checkpoint ") and os.sep in msg, (case, msg)
        for w in words:
            assert w in msg, (case, w, msg)
    assert "key 'model.embedding.weight': expected shape (32, 32), found (32, 16)" in r0["another size"][1], r0


def _reshard(rank, size, root):
    saved_at = build_parallel_state(tp=2, ep=2)
    model, opt = _trained(saved_at)
    path = os.path.join(root, "ck")
    fck.save(model, path, optimizer=opt, extra={"step": torch.tensor(9)})
    full, moments = fck.full_state(model), _moments(model, opt)
    loaded_at = build_parallel_state(dp=2)  # tp1, ep1: every tensor whole on each rank
    m2 = _model(loaded_at)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    step = torch.tensor(0)
    assert fck.load(m2, path, optimizer=opt2, extra={"step": step}) == {"step"}
    assert step.item() == 9
    for n, t in fck.full_state(m2).items():
        assert torch.equal(t, full[n]), n
    for n, t in _moments(m2, opt2).items():
        assert torch.equal(t, moments[n]), n
    assert all(opt2.state[p]["step"].item() == 1 for p in m2.parameters())
    return len(full)


def test_model_and_optimizer_reshard_tp2_ep2_to_dp2(world2, tmp_path):
    n = world2.run(_reshard, str(tmp_path))  # the ranks share the directory
    assert n[0] == n[1] > 0


class _SectionedScale(torch.nn.Module):
    """A parallel module that exists only in this test: ``y = x * weight[:, j] + offset`` where
    ``weight [8, 3]`` is a fused pair of unequal sections ``[a (6 rows); b (2 rows)]`` split by
    rows over ``group`` and ``offset [3]`` is replicated with a sequence-sharded gradient. It
    declares its placements and nothing else: checkpoints, resharding, ``full_state`` and the
    gradient sync must follow from that alone."""

    SECTIONS = (6, 2)

    def __init__(self, group):
        super().__init__()
        self.group = group
        full = torch.arange(24, dtype=torch.float32).view(8, 3) / 7
        self.weight = torch.nn.Parameter(self.placements()["weight"].local_from_full(full))
        self.offset = torch.nn.Parameter(torch.full((3,), 0.5))

    def placements(self):
        return {"weight": Placement.tp(self.group, 0, self.SECTIONS),
                "offset": Placement.replicated(sequence_sharded=True)}


def _new_module(rank, size, root):
    tp2 = build_parallel_state(tp=2)
    m = _SectionedScale(tp2.tp_group)
    a, b = m.weight.detach()[:3], m.weight.detach()[3:]  # this rank's blocks of the two sections
    full = torch.arange(24, dtype=torch.float32).view(8, 3) / 7
    assert torch.equal(a, full[:6].chunk(2)[rank]) and torch.equal(b, full[6:].chunk(2)[rank])
    with torch.no_grad():
        m.weight.mul_(-1.5)
        m.offset.add_(1.0)
    before = fck.full_state(m)
    path = os.path.join(root, "new")
    fck.save(m, path)
    tp1 = build_parallel_state(dp=2)  # tp1: every tensor whole on each rank
    one = _SectionedScale(tp1.tp_group)
    fck.load(one, path)
    assert torch.equal(one.weight.detach(), before["weight"]) and torch.equal(one.offset.detach(), before["offset"])
    back = _SectionedScale(tp2.tp_group)  # and back to tp2
    fck.load(back, path)
    assert torch.equal(back.weight.detach(), m.weight.detach())
    # gradient sync from the declaration: "dense" weight shards stay (one data rank), the
    # "replicated" offset is summed over tp
    assert gradient_sync_plan(m) == {"weight": "dense", "offset": "replicated"}
    m.weight.grad = torch.full_like(m.weight, float(rank + 1))
    m.offset.grad = torch.full_like(m.offset, float(rank + 1))
    sync_gradients(m.named_parameters(), tp2, gradient_sync_plan(m))
    assert torch.equal(m.weight.grad, torch.full_like(m.weight, float(rank + 1)))
    assert torch.equal(m.offset.grad, torch.full_like(m.offset, 3.0))
    return comm.group_size(tp2.tp_group)


def test_a_new_parallel_module_needs_only_its_placements(world2, tmp_path):
    """Defined here, declared once: saved at tp2, loaded at tp1 and back, its gradients synced."""
    assert world2.run(_new_module, str(tmp_path)) == [2, 2]


def _manager(rank, size, root):
    state = build_parallel_state(tp=2, ep=2)
    model, opt = _trained(state)
    said = []
    mgr = fck.CheckpointManager(os.path.join(root, "run"), keep=2, log=said.append)
    for step in (1, 2, 3):
        mgr.save(step, model, optimizer=opt, extra={"step": torch.tensor(step)})
    names = sorted(os.listdir(mgr.directory))
    _on_rank0(rank, lambda: (_flip(mgr.path(3)), os.makedirs(mgr.path(4))))  # damaged 3, interrupted 4
    step_t = torch.tensor(0)
    target = _model(state)
    got = mgr.resume(target, optimizer=torch.optim.AdamW(target.parameters()), extra={"step": step_t})
    # an intact checkpoint of another model is an error, not skipped (that would restart training)
    other = _error(lambda: mgr.resume(_model(state, hidden_size=32)))
    return names, got, step_t.item(), said, other


def test_manager_keeps_last_k_and_skips_damaged_and_partial_checkpoints(world2, tmp_path):
    r0, r1 = world2.run(_manager, str(tmp_path))  # the ranks share the directory
    names, (step, loaded), step_value, said, other = r0
    assert names == ["step_00000002", "step_00000003"], names  # keep=2, no partial directories left
    assert (step, loaded, step_value) == (2, {"step"}, 2)
    assert r1[1] == r0[1] and r1[3] == [], r1  # rank 1 agrees and stays quiet
    assert "step_00000004: incomplete" in said[0], said
    assert "step_00000003" in said[1] and "changed on disk" in said[1], said
    assert "resumed from" in said[2] and "step_00000002" in said[2], said
    assert other[0] == "CheckpointMismatchError" and "not skipped" in other[1], other


def _mixed_precision(rank, size):
    from fusedpar import demo

    losses = {}
    for dtype in ("fp32", "bf16"):
        args = demo.parse_args(["--seq", "8", "--hidden", "16", "--heads", "2", "--experts", "2", "--top-k", "1",
                                "--batch", "2", "--max-bytes", "20000", "--lr", "1e-2", "--warmup", "1",
                                "--dtype", dtype, "--tp", "2", "--sp", "1"])
        run = demo.setup(args, use_cuda=False)
        assert {p.dtype for p in run.model.parameters()} == {run.dtype}
        assert all(t.dtype == torch.float32 for t in run.master.tensors.values())
        losses[dtype] = [demo.train_step(step, run) for step in range(3)]
    return losses


def test_bf16_mixed_precision_tracks_fp32(world2):
    """bf16 parameters/activations with fp32 master weights follow the fp32 run within bf16
    rounding (8 mantissa bits: relative 2^-8 per rounding, a few roundings deep)."""
    out = world2.run(_mixed_precision)
    assert out[0] == out[1]
    fp32, bf16 = out[0]["fp32"], out[0]["bf16"]
    assert fp32 != bf16  # bf16 really ran
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 2e-2 * abs(a), (fp32, bf16)


def _router_bias(rank, size, root):
    """DeepSeek-V3 routing at tp2 x ep2 (each rank routes its own sequence shard): the step's
    counts are summed over the stage's ranks, both ranks get the same bias, and a checkpoint keeps
    it (loaded at dp2)."""
    config = tiny_config(num_experts=4, top_k=2, moe_every=2, score_func="sigmoid", n_group=2, topk_group=1,
                         routed_scaling_factor=2.0, bias_update_rate=0.01)
    state = build_parallel_state(tp=2, ep=2)
    model = Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group, seed=3)
    ids, tgt = local_batch(*batch(5, B, S, config.vocab_size), state)
    model.loss(model(ids), tgt).backward()
    router = model.layers["1"].mlp.router
    local = router.step_counts().clone()
    summed = local.clone()
    dist.all_reduce(summed)
    loads = model.update_router_bias(state.data_tp_group)
    assert torch.equal(loads["layers.1"].counts, summed)
    assert torch.equal(router.e_score_correction_bias, 0.01 * torch.sign(summed.sum() - 4 * summed).float())
    path = os.path.join(root, "bias")
    fck.save(model, path)
    at = build_parallel_state(dp=2)
    other = Transformer(config, tp_group=at.tp_group, sp_group=at.sp_group, ep_group=at.ep_group, seed=4)
    fck.load(other, path)
    return local.tolist(), router.e_score_correction_bias.tolist(), \
        other.layers["1"].mlp.router.e_score_correction_bias.tolist()


def test_router_bias_is_summed_identical_and_checkpointed(world2, tmp_path):
    r0, r1 = world2.run(_router_bias, str(tmp_path))  # the ranks share the directory
    assert sum(r0[0]) == sum(r1[0]) > 0  # each rank routed its own tokens
    assert r0[1] == r1[1] == r0[2] == r1[2] and any(r0[1]), (r0, r1)
