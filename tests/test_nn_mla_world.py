"""MLA (attention="mla") in a 4-rank gloo world: a Transformer of MLA blocks at sp2 Ulysses,
tp2 x sp2 ring zigzag and sp4 hybrid (the rest of the world data parallel) gives the one-process model's loss
and, after fusedpar.parallel.sync_gradients with the model's gradient plan, every gradient (the
replicated down projections and latent norms summed over tp and sp, the up projections split by
heads); a checkpoint saved at tp2 x sp2 loads at tp1. One world for the module."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from _compose import RTOL, batch, compare_grads, data_mean, local_batch, reference, tiny_config
from _utils import assert_close
from _world import world_fixture
from fusedpar import checkpoint as fcheckpoint
from fusedpar.nn import MLAttention, Transformer, parameter_placements
from fusedpar.parallel import build_parallel_state, sync_gradients
from fusedpar.nn import MLAConfig

world4 = world_fixture(4)

B, S = 2, 8
# q / k head dim 4 + 4 = 8, v head dim 6 (padded to 8 under the ring), the q latent on, YaRN with
# DeepSeek's mscale_all_dim (the softmax scale correction and an attention factor != 1 on cos / sin)
MLA = dict(attention="mla", q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "mscale": 1.0,
                         "mscale_all_dim": 0.8})
# name -> (build_parallel_state sizes, sp_mode); tp2 alone and sp2 ring zigzag alone are compared with
# transformers' DeepSeek-V3 in test_hf_world.py (deepseek_v3 at tp2 and sp2 x ep2)
# the module alone: q through a plain q_proj, biases on the down projections and o_proj
MODULE = dict(q_lora_rank=None, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, bias=True,
              rope_scaling=MLA["rope_scaling"])
LAYOUTS = {"sp2 ulysses": (dict(sp=2), "ulysses"), "tp2 x sp2 ring zigzag": (dict(tp=2, sp=2), "ring"),
           "sp4 hybrid (ulysses2 x ring2 zigzag)": (dict(sp=4, sp_ulysses=2), "hybrid")}


def _config(**kw):
    return tiny_config(num_layers=1, **dict(MLA, **kw))


def _layouts(rank, size, ref_loss, ref_grads):
    tokens, targets = batch(5, B, S, _config().vocab_size)
    checked = {}
    for name, (sizes, sp_mode) in LAYOUTS.items():
        config = _config(sp_mode=sp_mode)
        state = build_parallel_state(**sizes)
        groups = (dict(ulysses_group=state.ulysses_group, ring_group=state.ring_group) if sp_mode == "hybrid"
                  else dict(sp_group=state.sp_group))
        model = Transformer(config, tp_group=state.tp_group, ep_group=state.ep_group, **groups)
        attn = model.layers["0"].attn
        assert isinstance(attn, MLAttention) and (attn.tp_size, attn.ring_size * attn.ulysses_size) == (state.tp, state.sp)
        ids, tgt = local_batch(tokens, targets, state, layout="contiguous" if sp_mode == "ulysses" else config.layout)
        loss = model.loss(model(ids), tgt)
        loss.backward()
        sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
        assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, rtol=RTOL, msg=f"{name} loss")
        checked[name] = compare_grads(model, ref_grads, f"{name} rank {rank}")
    return checked


def _module_tp2_sp2(rank, size, x, dy, ref_y, ref_dx, ref_grads):
    """The module alone at tp2 x sp2 (ring zigzag): output, input gradient and, after
    reduce_sequence_parallel_grads (replicated parameters over tp too), every gradient."""
    state = build_parallel_state(tp=2, sp=2)
    torch.manual_seed(4)
    mod = MLAttention(MLAConfig(16, 4, **MODULE), tp_group=state.tp_group, sp_group=state.sp_group)
    pos = mod.local_positions(x.shape[1])
    xl = mod.shard(x).requires_grad_()
    y = mod(xl)
    y.backward(dy.index_select(1, pos))
    mod.reduce_sequence_parallel_grads()
    assert_close(y, ref_y.index_select(1, pos), torch.float32, rtol=RTOL, msg=f"out rank {rank}")
    assert_close(xl.grad, ref_dx.index_select(1, pos), torch.float32, rtol=RTOL, msg=f"dx rank {rank}")
    placements = parameter_placements(mod)
    for name, p in mod.named_parameters():
        want = placements[name].local_from_full(ref_grads[name])
        assert_close(p.grad, want, torch.float32, rtol=RTOL, msg=f"grad {name} rank {rank}")
    return len(placements)


def test_mla_module_at_tp2_sp2_matches_one_process(world4):
    torch.manual_seed(4)
    ref = MLAttention(MLAConfig(16, 4, **MODULE))
    g = torch.Generator().manual_seed(8)
    x, dy = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    y.backward(dy)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    out = world4.run(_module_tp2_sp2, x, dy, y.detach(), xr.grad, grads)
    assert out == [len(grads)] * 4, out


def test_mla_transformer_matches_one_process_at_tp_sp(world4):
    config = _config()
    out = world4.run(_layouts, *reference(config, *batch(5, B, S, config.vocab_size)))
    # embedding, norms, q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    # o_proj, MLP, head: every parameter checked at every layout
    assert all(n == len(dict(Transformer(config).named_parameters())) for r in out for n in r.values()), out


def _save_tp2_load_tp1(rank, size, path):
    config = _config(q_lora_rank=None)
    tokens, targets = batch(6, 4, S, config.vocab_size)  # 4 rows: one per data-parallel rank at dp4
    st2 = build_parallel_state(tp=2, sp=2)
    m2 = Transformer(config, tp_group=st2.tp_group, sp_group=st2.sp_group, ep_group=st2.ep_group, seed=3)
    fcheckpoint.save(m2, path)
    full2 = fcheckpoint.full_state(m2)
    ids, tgt = local_batch(tokens, targets, st2)
    with torch.no_grad():
        loss2 = data_mean(m2.loss(m2(ids), tgt), st2)
    st1 = build_parallel_state(dp=4)
    m1 = Transformer(config, tp_group=st1.tp_group, sp_group=st1.sp_group, ep_group=st1.ep_group, seed=99)
    fcheckpoint.load(m1, path)
    full1 = fcheckpoint.full_state(m1)
    assert full1.keys() == full2.keys()
    for k in full2:
        assert torch.equal(full1[k], full2[k]), f"{k} differs after loading the tp2 x sp2 checkpoint at tp1"
    ids, tgt = local_batch(tokens, targets, st1)
    with torch.no_grad():
        loss1 = data_mean(m1.loss(m1(ids), tgt), st1)
    assert_close(loss1, loss2, torch.float32, rtol=RTOL, msg="loss after loading at tp1")
    return len(full2)


def test_mla_checkpoint_saved_at_tp2_loads_at_tp1(world4):
    path = tempfile.mkdtemp(prefix="fusedpar_mla_")
    try:
        out = world4.run(_save_tp2_load_tp1, os.path.join(path, "ckpt"))
        assert out[0] == out[-1] > 8, out
    finally:
        shutil.rmtree(path, ignore_errors=True)
