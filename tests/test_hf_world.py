"""fusedpar.hf in a gloo world of 2 against transformers' fp32 model in one process: every rank
loads only its shards from the HF model, and the gathered logits and every local gradient (after
fusedpar.parallel.sync_gradients) equal HF's, at tp2, sp2 (ring zigzag), sp2 (Ulysses) and
sp2 x ep2 (experts over the two sequence-parallel ranks; MoE families). One world for the module."""
from __future__ import annotations

import pytest
import torch

from _hf import TOL, compare_grads, hf_model, hf_named_reference, hf_reference, tokens_targets
from _world import world_fixture

pytest.importorskip("transformers")

world2 = world_fixture(2)

LAYOUTS = {  # name -> (build_parallel_state sizes, config overrides)
    "tp2": (dict(tp=2), {}),
    "sp2-ring-zigzag": (dict(sp=2), dict(sp_mode="ring", layout="zigzag")),
    "sp2-ulysses": (dict(sp=2), dict(sp_mode="ulysses")),
    "sp2-ep2": (dict(sp=2, ep=2), dict(sp_mode="ring", layout="zigzag")),
}
# llama / mistral share llama31's code path (default RoPE, untied head: covered at world 1)
CASES = [(f, lay) for f in ("llama31", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe") for lay in LAYOUTS
         if not (lay == "sp2-ep2" and f in ("llama31", "qwen2", "qwen3"))]
B, S = 2, 8


def _layout_case(rank, size, family, layout, tokens, targets, ref_logits, ref_grads):
    from fusedpar.hf import from_hf
    from fusedpar.nn.transformer import shard_tokens
    from fusedpar.parallel import build_parallel_state, sync_gradients

    sizes, overrides = LAYOUTS[layout]
    state = build_parallel_state(**sizes)
    hf = hf_model(family)  # same seed on every rank: the same full model
    # HF pools its aux loss over all tokens, fusedpar over each rank's: compared at world 1 only
    model = from_hf(hf, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                    aux_loss_coef=0.0, **overrides)
    ids, tgt = shard_tokens(tokens, targets, sp_size=state.sp, sp_rank=state.sp_rank, tp_size=state.tp,
                            tp_rank=state.tp_rank, layout=model.config.layout,
                            ring_size=1 if model.config.sp_mode == "ulysses" else state.sp)
    logits = model(ids)
    full = model.gather_logits(logits)
    err = (full - ref_logits).abs().max().item()
    assert err <= TOL * ref_logits.abs().max().item(), f"{family} {layout}: logits off by {err:.3g}"
    model.loss(logits, tgt).backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    return compare_grads(model, ref_grads, f"{family} {layout}")


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_layout_matches_transformers(world2, family, layout):
    tokens, targets = tokens_targets(5, B, S)
    ref_logits, _, ref_grads = hf_reference(hf_model(family), tokens, targets, aux=False)
    out = world2.run(_layout_case, family, layout, tokens, targets, ref_logits, ref_grads)
    assert all(n > 10 for n in out), out


def _replicated_tokens_case(rank, size, x, r, ref):
    import torch.distributed as dist

    from fusedpar.nn import MoE

    torch.manual_seed(3)
    moe = MoE(16, 8, 4, 2, ep_group=dist.group.WORLD, replicated_group=dist.group.WORLD, normalize=True,
              aux_loss_coef=0.0, z_loss_coef=0.0)
    xr = x.clone().requires_grad_()
    y = moe(xr)  # the same tokens on both ranks (a TP group without sequence parallelism)
    (y * r).sum().backward()
    router_grad = moe.router.weight.grad  # whole on each rank: every rank routes all tokens
    n = moe.experts_per_rank
    for got, want, what in ((y.detach(), ref["y"], "output"), (xr.grad, ref["x"], "input grad"),
                            (moe.w1.grad, ref["w1"][rank * n:(rank + 1) * n], "w1 grad"),
                            (moe.w2.grad, ref["w2"][rank * n:(rank + 1) * n], "w2 grad"),
                            (router_grad, ref["router"], "router grad")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
    return True


def test_moe_with_tokens_replicated_over_the_ep_ranks_counts_each_token_once(world2):
    from fusedpar.nn import MoE

    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g)
    torch.manual_seed(3)
    moe = MoE(16, 8, 4, 2, normalize=True, aux_loss_coef=0.0, z_loss_coef=0.0)
    xr = x.clone().requires_grad_()
    y = moe(xr)
    (y * r).sum().backward()
    ref = {"y": y.detach(), "x": xr.grad, "w1": moe.w1.grad, "w2": moe.w2.grad, "router": moe.router.weight.grad}
    assert all(world2.run(_replicated_tokens_case, x, r, ref))


def _expected_shard(name, full, rank, size, tp):
    """The piece of HF's full gradient ``full`` that parameter ``name`` of the parallelised model
    holds (experts split over the 2 ranks; linears over tp)."""
    if ".mlp.moe." in name:
        n = full.shape[0] // size
        return full[rank * n:(rank + 1) * n]
    leaf = name.split(".")[-2]
    if tp and leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return full.chunk(size, dim=0)[rank]
    if tp and leaf in ("o_proj", "down_proj") and name.endswith("weight"):
        return full.chunk(size, dim=1)[rank]
    return full


def _hf_name(name):
    return name.replace(".mlp.moe.w1", ".mlp.experts.gate_up_proj").replace(".mlp.moe.w2", ".mlp.experts.down_proj")


def _compare_hf_grads(hf, ref_grads, rank, size, tp, msg):
    n = 0
    for name, p in hf.named_parameters():
        expect = _expected_shard(name, ref_grads[_hf_name(name)], rank, size, tp)
        err = (p.grad - expect).abs().max().item()
        assert err <= TOL * (expect.abs().max().item() + 1e-12), f"{msg}: grad of {name} off by {err:.3g}"
        n += 1
    return n


def _parallelize_case(rank, size, family, tokens, targets, ref_logits, ref_grads, ref_extra):
    """Route B at tp2 = ep2: logits, HF's router logits and aux loss (every rank routes all tokens:
    exact), and every gradient of the loss with the aux loss included."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from fusedpar.hf import parallelize

    hf = parallelize(hf_model(family), tp_group=dist.group.WORLD, ep_group=dist.group.WORLD)
    out = hf(tokens)
    err = (out.logits - ref_logits).abs().max().item()
    assert err <= TOL * ref_logits.abs().max().item(), f"{family}: logits off by {err:.3g}"
    loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    if "aux_loss" in ref_extra:
        assert len(out.router_logits) == len(ref_extra["router_logits"])
        for got, want in zip(out.router_logits, ref_extra["router_logits"]):
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * want.abs().max().item())
        assert abs(out.aux_loss.item() - ref_extra["aux_loss"].item()) <= TOL * ref_extra["aux_loss"].item()
        loss = loss + hf.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return _compare_hf_grads(hf, ref_grads, rank, size, True, family)


@pytest.mark.parametrize("family", ["llama31", "qwen2", "mixtral", "qwen2_moe"])
def test_parallelize_hf_model_in_place_tp2_ep2(world2, family):
    tokens, targets = tokens_targets(6, B, S)
    logits, _, grads, extra = hf_named_reference(hf_model(family), tokens, targets, aux=True)
    res = world2.run(_parallelize_case, family, tokens, targets, logits, grads, extra)
    assert all(r > 10 for r in res), res


SP_CASES = {  # family -> (sp_mode, experts over the two sp ranks, HF's own shifted labels loss)
    "llama31": ("ring", False, True),
    "mistral": ("ulysses", False, False),  # sliding_window=8: accepted at 8 tokens, refused at 16
    "qwen2_moe": ("ring", True, False),
}


def _parallelize_sp_case(rank, size, family, tokens, targets, ref_logits, ref_grads):
    from fusedpar.hf import gather_sequence, gradient_sync_plan, parallelize, sequence_parallel_loss, shard_batch
    from fusedpar.ops import shard_positions
    from fusedpar.parallel import build_parallel_state, sync_gradients

    mode, ep, labels = SP_CASES[family]
    state = build_parallel_state(sp=2, ep=2 if ep else 1)
    hf = parallelize(hf_model(family), sp_group=state.sp_group, sp_mode=mode, ep_group=state.ep_group if ep else None)
    ids, pos, tgt = shard_batch(hf, tokens, tokens if labels else None)
    expect_pos = shard_positions(S, layout="zigzag" if mode == "ring" else "contiguous", ring_rank=rank if mode == "ring"
                                 else 0, ring_size=2 if mode == "ring" else 1, ulysses_rank=0 if mode == "ring" else rank,
                                 ulysses_size=1 if mode == "ring" else 2)
    assert torch.equal(pos[0], expect_pos), pos
    tgt = tgt if labels else targets[:, pos[0]]
    out = hf(input_ids=ids, position_ids=pos)
    full = gather_sequence(hf, out.logits)
    err = (full - ref_logits).abs().max().item()
    assert err <= TOL * ref_logits.abs().max().item(), f"{family} sp2 {mode}: logits off by {err:.3g}"
    sequence_parallel_loss(hf, out.logits, tgt).backward()
    sync_gradients(hf.named_parameters(), state, gradient_sync_plan(hf))
    if family == "mistral":  # 16 tokens > sliding_window=8: refused (the global length, not the shard's)
        with pytest.raises(ValueError, match="sliding_window=8 is shorter than the sequence length 16"):
            hf(torch.cat([ids, ids], dim=1))
    return _compare_hf_grads(hf, ref_grads, rank, size, False, f"{family} sp2 {mode}")


@pytest.mark.parametrize("family", list(SP_CASES))
def test_parallelize_sequence_parallel_matches_transformers(world2, family):
    """Route B at sp2: ring zigzag / Ulysses through transformers' attention interface; gathered
    logits and every gradient (after sync_gradients with gradient_sync_plan) equal HF's."""
    tokens, targets = tokens_targets(7, B, S)
    labels = SP_CASES[family][2]
    logits, _, grads, _ = hf_named_reference(hf_model(family), tokens, None if labels else targets, aux=False)
    res = world2.run(_parallelize_sp_case, family, tokens, targets, logits, grads)
    assert all(r > 10 for r in res), res
