"""fusedpar.nn.ParallelAttention with the attention options (sliding window, softcap, learnable
sinks, a v head dim other than q/k's, softmax_scale, dq_mode) on a 4-rank gloo world: tp2 x ring2,
tp2 x Ulysses2 and the 2 x 2 hybrid equal the single-process AttentionReference, outputs and
every parameter gradient (the sinks' included); the sinks save at tp2 and load at tp1; the
TransformerConfig fields in Hugging Face's terms reach every block's attention."""
import os

import pytest
import torch

from _utils import DEVICE, assert_close
from _world import grid_2x2, rank_rng, straggle, world_fixture
from fusedpar import checkpoint as fck
from fusedpar.hf import to_hf_state_dict
from fusedpar.nn import AttentionReference, ParallelAttention, Transformer, TransformerConfig
from fusedpar.nn.placement import gradient_sync_plan
from fusedpar.ops import comm
from test_nn_attention import check_shard_against_reference
from fusedpar.nn import AttentionConfig, MLAConfig

world4 = world_fixture(4)

# as tests/test_nn_attention.py: fp32 attention (2e-5) plus fp32 projections -> 5e-5
TOL = 5e-5


def _cases(rank, size, seed):
    row, col, single = grid_2x2(rank)
    straggle(0.01, seed)
    hidden, d, S = 32, 8, 16
    try:
        cases = [
            # (name, group kwargs, heads, kv_heads, attention options)
            ("tp2 x ring2 zigzag", dict(tp_group=row, sp_group=col, sp_mode="ring", layout="zigzag"), 4, 2,
             dict(window=(3, 0), softcap=4.0, sinks=True, v_head_dim=12, softmax_scale=0.3)),
            ("tp2 x ulysses2", dict(tp_group=row, sp_group=col, sp_mode="ulysses"), 4, 2,
             dict(window=(5, 0), sinks=True, v_head_dim=4)),
            # the one-pass backward (dQ by fp32 atomics) through the hybrid's Ulysses and ring
            ("hybrid 2x2, tp1, dq_mode='atomic'", dict(tp_group=single, ulysses_group=row, ring_group=col,
                                                       sp_mode="hybrid", layout="contiguous", dq_mode="atomic"),
             4, 2, dict(window=(2, 0), softcap=2.0, sinks=True)),
        ]
        for i, (name, kw, hq, hk, opts) in enumerate(cases):
            torch.manual_seed(seed + i)  # the same full weights on every rank
            ref = AttentionReference(AttentionConfig(hidden, hq, hk, causal=True, rope_theta=500.0, head_dim=d, **opts))
            with torch.no_grad():
                ref.sinks.copy_(torch.randn(hq, generator=rank_rng(seed + 50 + i)))
            mod = ParallelAttention.from_reference(ref, **kw)
            assert mod.sinks.dtype == torch.float32 and mod.sinks.shape == (mod.heads_local,)
            x = torch.randn(1, S, hidden, generator=rank_rng(seed + i))
            dy = torch.randn(1, S, hidden, generator=rank_rng(seed + 100 + i))
            xr = x.clone().requires_grad_()
            yr = ref(xr)
            yr.backward(dy)
            xl = mod.shard(x).requires_grad_()
            pos = mod.local_positions(S)
            y = mod(xl)
            y.backward(dy.index_select(1, pos))
            mod.reduce_sequence_parallel_grads()
            check_shard_against_reference(mod, ref, y, yr, xl, xr, pos, f"{name} rank {rank}")
            # the sinks are tp shards like the heads: their gradient is summed over data x sp only
            assert gradient_sync_plan(mod)["sinks"] == "dense"
    finally:
        comm.set_straggler(0)
    return True


def test_parallel_attention_options_match_reference(world4):
    assert all(world4.run(_cases, seed=17))


def _checkpoint(rank, size, root):
    row, _, single = grid_2x2(rank)
    torch.manual_seed(5)
    ref = AttentionReference(AttentionConfig(32, 4, 2, head_dim=8, sinks=True, v_head_dim=4, window=(3, 0)))
    with torch.no_grad():
        ref.sinks.copy_(torch.arange(4.0) - 1.5)
    tp2 = ParallelAttention.from_reference(ref, tp_group=row, sp_group=single)
    path = os.path.join(root, "attn")
    fck.save(tp2, path)
    saved = fck.full_state(tp2)
    assert torch.equal(saved["sinks"], ref.sinks.detach())
    torch.manual_seed(6)  # other weights, zero sinks: everything must come from the checkpoint
    tp1 = ParallelAttention(AttentionConfig(32, 4, 2, head_dim=8, sinks=True, v_head_dim=4, window=(3, 0)), tp_group=single, sp_group=single)
    fck.load(tp1, path)
    for n, t in fck.full_state(tp1).items():
        assert torch.equal(t, saved[n]), n
    return True


def test_sinks_checkpoint_tp2_to_tp1(world4, tmp_path):
    assert all(world4.run(_checkpoint, str(tmp_path)))  # the ranks share the directory


def test_transformer_config_passes_per_layer_attention_options():
    # Hugging Face's fields -> each block's ParallelAttention: HF's window W is window=(W - 1, 0)
    # on the "sliding_attention" layers only; softmax_scale (Gemma: query_pre_attn_scalar ** -0.5)
    config = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=16,
                               head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                               attn_logit_softcapping=30.0, attention_sinks=True, v_head_dim=6,
                               softmax_scale=0.25)
    model = Transformer(config, seed=1, device=DEVICE)
    attns = [model.layers[str(i)].attn for i in range(2)]
    assert [a.window for a in attns] == [(3, 0), None]
    assert all(a.softcap == 30.0 and a.v_head_dim == 6 and a.softmax_scale == 0.25 for a in attns)
    assert all(a.sinks.shape == (2,) and a.sinks.dtype == torch.float32 for a in attns)
    assert model.gradient_sync_plan()["layers.0.attn.sinks"] == "dense"
    # each block equals its AttentionReference with the same options and weights (12 tokens: the
    # window of 4 cuts), the sinks' gradient included
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for attn in attns:
        ref = AttentionReference(AttentionConfig(16, 2, head_dim=8, window=attn.window, softcap=30.0, sinks=True, v_head_dim=6, softmax_scale=0.25), device=DEVICE)
        with torch.no_grad():
            ref.sinks.copy_(torch.tensor([0.5, -1.0]))
            attn.sinks.copy_(ref.sinks)
            q, k, v = attn.qkv.weight.split((16, 16, 12))
            for proj, w in zip((ref.q_proj, ref.k_proj, ref.v_proj, ref.o_proj), (q, k, v, attn.proj.weight)):
                proj.weight.copy_(w)
        y, yr = attn(x), ref(x)
        assert_close(y, yr, torch.float32, rtol=TOL, atol=TOL * yr.pow(2).mean().sqrt().item(), msg="block attention")
        gs, gr = torch.autograd.grad(y.sum(), attn.sinks)[0], torch.autograd.grad(yr.sum(), ref.sinks)[0]
        assert_close(gs, gr, torch.float32, rtol=TOL, atol=TOL * gr.abs().max().item(), msg="d sinks")


def test_sinks_export_under_their_hugging_face_name():
    # gpt-oss's name: model.layers.{i}.self_attn.sinks, the full fp32 [num_heads] logits
    config = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=16,
                               attention_sinks=True)
    model = Transformer(config, seed=1)
    with torch.no_grad():
        model.layers["0"].attn.sinks.copy_(torch.tensor([0.25, -2.0]))
    sd = to_hf_state_dict(model)
    assert torch.equal(sd["model.layers.0.self_attn.sinks"], torch.tensor([0.25, -2.0]))


def test_sinks_stay_fp32_when_the_model_is_cast():
    """``model.to(torch.bfloat16)`` casts every weight but keeps the sink logits fp32, so the
    forward (which takes fp32 sinks) still runs; their gradient is fp32 too."""
    config = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=16,
                               head_dim=8, attention_sinks=True)
    model = Transformer(config, seed=1, device=DEVICE).to(torch.bfloat16)
    attn = model.layers["0"].attn
    assert attn.qkv.weight.dtype == torch.bfloat16 and attn.sinks.dtype == torch.float32
    ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    model.loss(model(ids), ids).backward()
    assert attn.sinks.grad.dtype == torch.float32 and torch.isfinite(attn.sinks.grad).all()


def test_bad_dq_mode():
    with pytest.raises(ValueError, match=r"ParallelAttention: dq_mode must be one of \('separate', 'atomic'\), "
                                         r"got 'fast'"):
        ParallelAttention(AttentionConfig(32, 4, dq_mode="fast"))


@pytest.mark.parametrize("attention", ["default", "mla"])
def test_config_dq_mode_reaches_every_block_and_keeps_the_gradients(attention):
    """``TransformerConfig(attention_dq_mode="atomic")``: every block's attention (ParallelAttention
    or MLAttention) runs the one-pass backward, whose gradients equal the default's within fp32
    rounding (dQ summed in another order); a bad mode in MLAttention names the argument."""
    mla = dict(attention="mla", kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=6) if attention == "mla" else {}
    grads = {}
    for mode in ("separate", "atomic"):
        cfg = TransformerConfig(vocab_size=24, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=24,
                                attention_dq_mode=mode, **mla)
        torch.manual_seed(3)
        model = Transformer(cfg).to(DEVICE)
        assert {blk.attn.dq_mode for blk in model.layers.values()} == {mode}
        ids = torch.randint(0, 24, (2, 11), generator=torch.Generator().manual_seed(4)).to(DEVICE)
        model(ids).float().square().mean().backward()
        grads[mode] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for name, g in grads["separate"].items():
        assert_close(grads["atomic"][name], g, rtol=1e-4, atol=1e-5, msg=name)
    if attention == "mla":
        from fusedpar.nn.mla import MLAttention
        with pytest.raises(ValueError, match=r"MLAttention: dq_mode must be one of \('separate', 'atomic'\), got 'x'"):
            MLAttention(MLAConfig(16, 2, dq_mode="x", **{k: v for k, v in mla.items() if k != "attention"}))
