"""fusedpar.hf in a gloo world of 2 against transformers' fp32 model in one process: every rank
loads only its shards from the HF model, and the gathered logits and every local gradient (after
fusedpar.parallel.sync_gradients) equal HF's, at tp2, sp2 (ring zigzag), sp2 (Ulysses) and
sp2 x ep2 (experts over the two sequence-parallel ranks). One world for the module."""
from __future__ import annotations

import pytest
import torch

from _hf import TOL, compare_grads, hf_model, hf_reference, tokens_targets
from _world import world_fixture

pytest.importorskip("transformers")

world2 = world_fixture(2)

LAYOUTS = {  # name -> (build_parallel_state sizes, config overrides)
    "tp2": (dict(tp=2), {}),
    "sp2-ring-zigzag": (dict(sp=2), dict(sp_mode="ring", layout="zigzag")),
    "sp2-ulysses": (dict(sp=2), dict(sp_mode="ulysses")),
    "sp2-ep2": (dict(sp=2, ep=2), dict(sp_mode="ring", layout="zigzag")),
}
CASES = [(f, lay) for f in ("llama31", "mixtral", "qwen2_moe", "qwen3") for lay in LAYOUTS
         if not (lay == "sp2-ep2" and f in ("llama31", "qwen3"))]
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
