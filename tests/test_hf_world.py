"""fusedpar.hf in a gloo world of 2 against transformers' fp32 model in one process: every rank
loads only its shards from the HF model, and the gathered logits and every local gradient (after
fusedpar.parallel.sync_gradients) equal HF's, at tp2, sp2 (ring zigzag), sp2 (Ulysses) and
sp2 (ring zigzag or Ulysses) x ep2 (experts over the two sequence-parallel ranks; MoE families).
Route B (``parallelize``, the HF model kept) at tp2 = ep2, at sp2 (ring or Ulysses, MoE families with
ep2) and, for DeepSeek-V3 and gpt-oss, at world 1 (one-rank groups). One world for the module."""
from __future__ import annotations

import pytest
import torch

from _hf import TOL, compare_grads, hf_model, hf_named_reference, hf_reference, tokens_targets
from _world import world_fixture
from fusedpar.hf import HFMoEBlock
from fusedpar.nn import MoEConfig

pytest.importorskip("transformers")

world2 = world_fixture(2)

LAYOUTS = {  # name -> (build_parallel_state sizes, config overrides)
    "tp2": (dict(tp=2), {}),
    "sp2-ring-zigzag": (dict(sp=2), dict(sp_mode="ring", layout="zigzag")),
    "sp2-ulysses": (dict(sp=2), dict(sp_mode="ulysses")),
    "sp2-ep2": (dict(sp=2, ep=2), dict(sp_mode="ring", layout="zigzag")),
    "sp2-ulysses-ep2": (dict(sp=2, ep=2), dict(sp_mode="ulysses")),
}
# every family at every layout (the MoE families also with experts over the sp ranks): each family's
# own feature meets each layout (tied head / qkv bias / QK-norm / shared expert under tp, rotary
# scaling under the zigzag ring, head splits under Ulysses); mistral shares llama31's code path. The
# MoE families meet the zigzag ring with their experts over the sp ranks (sp2-ep2) only: without
# ep their experts are local to each rank's tokens, the ring the dense families' (suite time)
CASES = [(f, lay) for f in ("llama31", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
         for lay in ("tp2", "sp2-ring-zigzag", "sp2-ulysses", "sp2-ep2")
         if not (lay == "sp2-ep2" and f in ("llama31", "qwen2", "qwen3"))
         and not (lay == "sp2-ring-zigzag" and f in ("mixtral", "qwen2_moe", "qwen3_moe"))]
# GLM-4.5 (partial rotary, q/k/v biases, qk-norm, dense first block, sigmoid group router with its
# correction bias, ungated shared expert): tp2, and the zigzag ring with experts over the sp ranks
CASES += [("glm4_moe", "tp2"), ("glm4_moe", "sp2-ep2")]
# DeepSeek-V3 (route A): MLA's heads split over tp (its latents gathered), and the zigzag ring with
# the experts and the score-bias router over the sp ranks (MLA under sp is also in test_nn_mla_world.py)
CASES += [("deepseek_v3", "tp2"), ("deepseek_v3", "sp2-ep2")]
# OLMo 2 and Gemma at every dense layout (OLMo 2's q / k norm statistics reduced over tp; Gemma's
# (1 + w) norms, scaled embedding, GeGLU, tied head); Gemma 2's sandwich norms, attention scale and
# capped head under tp, Ulysses and the zigzag ring (its attention logit softcap and sliding layer, window 5
# of 8 tokens, on each ring step's block of scores), Gemma 3's (1 + w) per-head q / k norms under tp and its
# per-layer RoPE bases under the zigzag ring
CASES += [(f, lay) for f in ("olmo2", "gemma") for lay in ("tp2", "sp2-ring-zigzag", "sp2-ulysses")]
CASES += [("gemma2", "tp2"), ("gemma2", "sp2-ring-zigzag"), ("gemma2", "sp2-ulysses"), ("gemma3", "tp2"),
          ("gemma3", "sp2-ring-zigzag")]
# gpt-oss (route A): sinks split with the heads, the o_proj bias, q / k / v biases under tp; the sliding
# layer, YaRN and the sinks under the zigzag ring with the biased experts and router over the sp ranks
CASES += [("gpt_oss", "tp2"), ("gpt_oss", "sp2-ep2")]
# Ulysses for the families tested above without it: Mistral's window (5 of 8 tokens) and Gemma 3's
# sliding layer over the gathered sequence; GLM-4.5's partial rotary, DeepSeek-V3's MLA heads (v head
# dim 6) and gpt-oss's sinks of each rank's heads after the all-to-all, with the experts over the sp ranks
CASES += [("mistral", "sp2-ulysses"), ("gemma3", "sp2-ulysses")]
CASES += [(f, "sp2-ulysses-ep2") for f in ("glm4_moe", "deepseek_v3", "gpt_oss")]
# sp2-ep2 loads from a checkpoint directory: one tensor per expert (save_pretrained's format) or
# transformers 5's stacked expert tensors (gpt-oss: its biases too, in HF's transposed, interleaved
# layout, rearranged after the rows are read); each rank must read only its own experts' bytes
FROM_DIRECTORY = {"mixtral": "per-expert", "qwen2_moe": "stacked", "gpt_oss": "stacked"}
B, S = 2, 8
# the references are computed here and sent to the world's workers: on the CPU, where a gloo world
# runs (a worker moves them to its device where it compares)
CPU = torch.device("cpu")


def _recording_safe_open(reads: list):
    """``safetensors.safe_open`` that appends ``(tensor name, rows or None)`` to ``reads`` for
    every tensor read (``get_tensor``: whole; ``get_slice(name)[rows]``: those rows)."""
    import safetensors

    real = safetensors.safe_open

    class Slice:
        def __init__(self, name, sl):
            self.name, self.sl = name, sl

        def __getitem__(self, rows):
            reads.append((self.name, rows))
            return self.sl[rows]

    class Recording:
        def __init__(self, path, framework):
            self.f = real(path, framework)

        def __enter__(self):
            self.h = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.h.keys()

        def get_tensor(self, name):
            reads.append((name, None))
            return self.h.get_tensor(name)

        def get_slice(self, name):
            return Slice(name, self.h.get_slice(name))

    return real, Recording


def _check_expert_reads(reads, rank, fmt):
    """Only this rank's experts (2 of 4) were read, of every layer's expert tensors."""
    expert_reads = [(n, rows) for n, rows in reads if ".experts." in n]
    assert expert_reads, reads
    if fmt == "per-expert":  # ...experts.{j}.w1.weight: whole tensors of experts 2r, 2r+1 only
        assert {int(n.split(".experts.")[1].split(".")[0]) for n, _ in expert_reads} == {2 * rank, 2 * rank + 1}
        assert all(rows is None for _, rows in expert_reads)
    else:  # ...experts.gate_up_proj / down_proj: rows 2r:2r+2 only
        assert all(rows == slice(2 * rank, 2 * rank + 2) for _, rows in expert_reads), expert_reads


def _load(family, layout, state, overrides, directory, rank):
    import safetensors

    from fusedpar.hf import from_hf

    # HF pools its aux loss over all tokens, fusedpar over each rank's: compared at world 1 only
    kw = dict(tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group, aux_loss_coef=0.0,
              **overrides)
    if directory is None:
        return from_hf(hf_model(family), **kw)  # same seed on every rank: the same full model
    reads = []
    real, safetensors.safe_open = _recording_safe_open(reads)
    try:
        model = from_hf(directory, **kw)
    finally:
        safetensors.safe_open = real
    _check_expert_reads(reads, rank, FROM_DIRECTORY[family])
    return model


def _layout_case(rank, size, family, layout, tokens, targets, ref_logits, ref_grads, directory=None):
    from fusedpar.nn.transformer import shard_tokens
    from fusedpar.parallel import build_parallel_state, sync_gradients

    sizes, overrides = LAYOUTS[layout]
    state = build_parallel_state(**sizes)
    model = _load(family, layout, state, overrides, directory, rank)
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


def _save(hf, path, fmt):
    if fmt == "per-expert":
        hf.save_pretrained(path)
    else:
        from safetensors.torch import save_file

        hf.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_layout_matches_transformers(world2, family, layout, tmp_path):
    tokens, targets = tokens_targets(5, B, S, device=CPU)
    hf = hf_model(family, device=CPU)
    from_dir = layout == "sp2-ep2" and family in FROM_DIRECTORY
    directory = _save(hf, tmp_path, FROM_DIRECTORY[family]) if from_dir else None
    ref_logits, _, ref_grads = hf_reference(hf, tokens, targets, aux=False)
    out = world2.run(_layout_case, family, layout, tokens, targets, ref_logits, ref_grads, directory)
    assert all(n > 10 for n in out), out


def _replicated_tokens_case(rank, size, x, r, ref):
    import torch.distributed as dist

    from fusedpar.nn import MoE

    torch.manual_seed(3)
    moe = MoE(MoEConfig(16, 8, 4, 2, normalize=True, aux_loss_coef=0.0, z_loss_coef=0.0), ep_group=dist.group.WORLD, replicated_group=dist.group.WORLD)
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
    moe = MoE(MoEConfig(16, 8, 4, 2, normalize=True, aux_loss_coef=0.0, z_loss_coef=0.0))
    xr = x.clone().requires_grad_()
    y = moe(xr)
    (y * r).sum().backward()
    ref = {"y": y.detach(), "x": xr.grad, "w1": moe.w1.grad, "w2": moe.w2.grad, "router": moe.router.weight.grad}
    assert all(world2.run(_replicated_tokens_case, x, r, ref))


def _expected_shard(name, full, rank, size, tp, projection_norms=False, ep=None):
    """The piece of HF's full gradient ``full`` that parameter ``name`` of the parallelised model
    holds (experts split over ``ep`` ranks, default all; linears over tp, MLA's up projections
    q_b_proj / kv_b_proj included; gpt-oss's sinks with the heads; OLMo 2's q / k norms, which span
    the whole projection, over tp)."""
    if ".mlp.moe." in name:
        n = full.shape[0] // (ep or size)
        r = rank % (ep or size)
        return full[r * n:(r + 1) * n]
    leaf = name.split(".")[-2]
    if tp and name.endswith("self_attn.sinks"):
        return full.chunk(size, dim=0)[rank]
    if tp and projection_norms and leaf in ("q_norm", "k_norm"):
        return full.chunk(size, dim=0)[rank]
    if tp and leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj"):
        return full.chunk(size, dim=0)[rank]
    if tp and leaf in ("o_proj", "down_proj") and name.endswith("weight"):
        return full.chunk(size, dim=1)[rank]
    return full


# HFMoEBlock's expert parameters -> HF's (gpt-oss's biases too)
_EXPERTS = {".mlp.moe.w1": ".mlp.experts.gate_up_proj", ".mlp.moe.w2": ".mlp.experts.down_proj",
            ".mlp.moe.b1": ".mlp.experts.gate_up_proj_bias", ".mlp.moe.b2": ".mlp.experts.down_proj_bias"}


def _hf_full_grad(name, ref_grads):
    """HF's full gradient of the parallelised model's parameter ``name``, in its layout (gpt-oss's
    experts: transposed back, the gate / up columns de-interleaved)."""
    from fusedpar.hf_parallel import gpt_oss_experts_from_hf

    for ours, theirs in _EXPERTS.items():
        if name.endswith(ours):
            hf = name[:-len(ours)] + theirs
            grad = ref_grads[hf]
            gpt_oss = name[:-len(ours)] + ".mlp.experts.down_proj_bias" in ref_grads  # biased experts
            return gpt_oss_experts_from_hf(hf.rsplit(".", 1)[1], grad) if gpt_oss else grad
    if name in ref_grads:
        return ref_grads[name]
    return ref_grads[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")]  # GLM-4.5 / DeepSeek-V3's name


def _compare_hf_grads(hf, ref_grads, rank, size, tp, msg, ep=None):
    n = 0
    for name, p in hf.named_parameters():
        expect = _expected_shard(name, _hf_full_grad(name, ref_grads), rank, size, tp,
                                 hf.config.model_type == "olmo2", ep)
        assert p.grad is not None, f"{msg}: {name} has no gradient"
        err = (p.grad - expect).abs().max().item()
        assert err <= TOL * (expect.abs().max().item() + 1e-12), f"{msg}: grad of {name} off by {err:.3g}"
        n += 1
    assert n == len(ref_grads), f"{msg}: {n} parameters, HF has {len(ref_grads)}"
    return n


def _parallelize_case(rank, size, family, tokens, targets, ref_logits, ref_grads, ref_extra, world=2):
    """Route B at tp2 = ep2: logits, HF's router logits and aux loss (every rank routes all tokens:
    exact), and every gradient of the loss with the aux loss included. ``world=1``: each rank
    alone (one-rank tp and ep groups: tp off, the MoE blocks fusedpar's with every expert)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from fusedpar.hf import gradient_sync_plan, parallelize
    from fusedpar.parallel import build_parallel_state, sync_gradients

    if world == 1:
        alone = [dist.new_group([r]) for r in range(size)][rank]  # new_group: a collective of every rank
        hf = parallelize(hf_model(family), tp_group=alone, ep_group=alone)
        assert sum(isinstance(m, HFMoEBlock) for m in hf.modules()) == {"deepseek_v3": 1, "gpt_oss": 2}[family]
    else:
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
    if world == 1:
        return _compare_hf_grads(hf, ref_grads, rank, size, False, f"{family} world 1", ep=1)
    # a no-op but for the qk-norm scales (GLM-4.5), whose gradients cover this rank's heads: summed over tp
    sync_gradients(hf.named_parameters(), build_parallel_state(tp=2, ep=2), gradient_sync_plan(hf))
    return _compare_hf_grads(hf, ref_grads, rank, size, True, family)


# DeepSeek-V3: MLA's up projections split over the heads (the shared rotary key's gradient summed
# over tp), the sigmoid group router with its correction bias, an ungated shared expert, a dense
# first block; gpt-oss: sinks split with the heads, q / k / v / o biases, a sliding layer, the
# biased router and experts (HF's transposed, interleaved layout rearranged), the clamped SwiGLU
PARALLELIZE_TP = ["llama31", "qwen2", "mixtral", "qwen2_moe", "glm4_moe", "olmo2", "gemma2", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("family", PARALLELIZE_TP)
def test_parallelize_hf_model_in_place_tp2_ep2(world2, family):
    tokens, targets = tokens_targets(6, B, S, device=CPU)
    logits, _, grads, extra = hf_named_reference(hf_model(family, device=CPU), tokens, targets, aux=True)
    res = world2.run(_parallelize_case, family, tokens, targets, logits, grads, extra)
    assert all(r > 10 for r in res), res


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_parallelize_at_world_1_matches_transformers(world2, family):
    """Route B in one process (each rank alone, one-rank groups): HF's MoE blocks become
    HFMoEBlocks holding every expert (DeepSeek-V3's group router; gpt-oss's experts rearranged
    from HF's layout), the rest HF's own; logits, router logits, HF's aux loss and every gradient."""
    tokens, targets = tokens_targets(8, B, S, device=CPU)
    logits, _, grads, extra = hf_named_reference(hf_model(family, device=CPU), tokens, targets, aux=True)
    res = world2.run(_parallelize_case, family, tokens, targets, logits, grads, extra, world=1)
    assert all(r > 10 for r in res), res


SP_CASES = {  # family -> (sp_mode, experts over the two sp ranks, HF's own shifted labels loss)
    "llama31": ("ring", False, True),
    "mistral": ("ulysses", False, False),  # sliding_window=5 over 8 tokens: an active window
    "qwen2_moe": ("ring", True, False),
    "glm4_moe": ("ulysses", True, False),  # partial rotary on the shard's positions, GLM's router over ep2
    "gemma3": ("ulysses", False, True),  # sliding_window=8 on its sliding layers, query_pre_attn_scalar
    "olmo2": ("ring", False, False),  # HF's own whole-projection q / k norms on each shard's tokens
    # MLA (v head dim 6 != q / k 8, interleaved YaRN rope on the zigzag positions) through the ring,
    # the group router and the shared expert with the experts over the sp ranks
    "deepseek_v3": ("ring", True, False),
    # the sinks of each rank's heads after the all-to-all, the sliding layer (window 5 over 8), HF's
    # biased router and experts over the sp ranks
    "gpt_oss": ("ulysses", True, False),
}


def _parallelize_sp_case(rank, size, family, tokens, targets, ref_logits, ref_grads):
    from fusedpar.hf import (
        causal_lm_loss,
        gather_sequence,
        gradient_sync_plan,
        parallelize,
        sequence_parallel_loss,
        shard_batch,
    )
    from fusedpar.ops import shard_positions
    from fusedpar.parallel import build_parallel_state, sync_gradients

    mode, ep, labels = SP_CASES[family]
    state = build_parallel_state(sp=2, ep=2 if ep else 1)
    hf = parallelize(hf_model(family), sp_group=state.sp_group, sp_mode=mode, ep_group=state.ep_group if ep else None)
    ids, pos, tgt = shard_batch(hf, tokens, tokens if labels else None)
    ring = mode == "ring"
    expect_pos = shard_positions(S, layout="zigzag" if ring else "contiguous", ring_rank=rank if ring else 0,
                                 ring_size=2 if ring else 1, ulysses_rank=0 if ring else rank,
                                 ulysses_size=1 if ring else 2)
    assert torch.equal(pos[0], expect_pos), pos
    tgt = tgt if labels else targets[:, pos[0]]
    out = hf(input_ids=ids, position_ids=pos)
    full = gather_sequence(hf, out.logits)
    err = (full - ref_logits).abs().max().item()
    assert err <= TOL * ref_logits.abs().max().item(), f"{family} sp2 {mode}: logits off by {err:.3g}"
    if ep and hf.config.output_router_logits:  # the reference has no aux loss, which causal_lm_loss would add
        sequence_parallel_loss(hf, out.logits, tgt).backward()
    else:  # the fused loss: decoder hidden states -> chunked linear cross entropy, no logits
        loss = causal_lm_loss(hf, ids, tgt, position_ids=pos, chunk_tokens=3)
        torch.testing.assert_close(loss.detach(), sequence_parallel_loss(hf, out.logits, tgt).detach(),
                                   rtol=1e-5, atol=1e-6, msg=f"{family} fused loss")
        loss.backward()
    sync_gradients(hf.named_parameters(), state, gradient_sync_plan(hf))
    return _compare_hf_grads(hf, ref_grads, rank, size, False, f"{family} sp2 {mode}")


@pytest.mark.parametrize("family", list(SP_CASES))
def test_parallelize_sequence_parallel_matches_transformers(world2, family):
    """Route B at sp2: ring zigzag / Ulysses through transformers' attention interface; gathered
    logits and every gradient (after sync_gradients with gradient_sync_plan) equal HF's."""
    tokens, targets = tokens_targets(7, B, S, device=CPU)
    labels = SP_CASES[family][2]
    logits, _, grads, _ = hf_named_reference(hf_model(family, device=CPU), tokens, None if labels else targets,
                                             aux=False)
    res = world2.run(_parallelize_sp_case, family, tokens, targets, logits, grads)
    assert all(r > 10 for r in res), res
