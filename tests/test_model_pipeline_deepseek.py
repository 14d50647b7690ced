"""A DeepSeek-V3-style Transformer (MLA with YaRN, a dense first block, then MoE blocks with the
sigmoid group-limited router, its correction bias and an ungated shared expert) at pp2 x tp2 on 4
gloo processes, under torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``: 4 stages of
one block, 2 per rank (rank p of the pipeline holds stages p and p + 2), tensor parallelism inside
each stage and the experts over the stage's two tp ranks (ep2 = tp2). The zero-bubble schedule
splits each stage's backward into an input-gradient pass and a later weight-gradient pass
(``torch.autograd.grad`` over the stage's graph twice), through fusedpar's custom ops and their
collectives. The loss and every gradient equal the one-process model's. The stages are built with
their shapes given (``Transformer.pipeline_args``): the schedule's shape inference would otherwise
run the later stages' MoE blocks on ``torch.empty`` memory (DESIGN §5, "Composition").
(``ScheduleInterleaved1F1B`` with tp inside each stage: tests/test_model_composition.py, dense blocks.)
One world for the module."""
from __future__ import annotations

import torch

from _compose import batch, compare_grads, local_batch, tiny_config
from _utils import assert_close
from _world import world_fixture
from fusedpar.nn import MLAttention, MoE, Transformer
from fusedpar.nn.transformer import shard_tokens
from fusedpar.parallel import build_parallel_state, sync_gradients

world4 = world_fixture(4)

B, S, STAGES = 4, 8, 4
# q / k head dim 4 + 4, v head dim 6, a q latent, YaRN with mscale_all_dim; layer 0 dense, layers 1-3
# MoE: 4 experts in 2 groups (1 searched), top-2, scores renormalised and scaled by 2.5, one ungated
# shared expert; no router losses (DeepSeek-V3 trains none in transformers)
DEEPSEEK = dict(attention="mla", q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                              "mscale": 1.0, "mscale_all_dim": 0.8},
                num_experts=4, top_k=2, moe_ffn_hidden_size=8, first_k_dense_replace=1, score_func="sigmoid",
                score_correction_bias=True, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                shared_expert_ffn_hidden_size=8, shared_expert_gate=False)


def _config():
    return tiny_config(num_layers=STAGES, **DEEPSEEK)


def _steer_routers(model):
    """A fixed, non-zero correction bias per MoE block (drawn from the layer index), so the
    selection differs from the scores' own top-k and every layout sees the same one."""
    for i, block in model.layers.items():
        if isinstance(block.mlp, MoE):
            g = torch.Generator().manual_seed(100 + int(i))
            block.mlp.router.e_score_correction_bias.copy_(torch.randn(4, generator=g) * 0.3)


def _reference(config, tokens, targets):
    model = Transformer(config)
    _steer_routers(model)
    assert isinstance(model.layers["0"].attn, MLAttention) and not isinstance(model.layers["0"].mlp, MoE)
    assert all(isinstance(model.layers[str(i)].mlp, MoE) for i in range(1, STAGES))
    ids, tgt = shard_tokens(tokens, targets, sp_size=1, sp_rank=0, tp_size=1, tp_rank=0)
    loss = model.loss(model(ids), tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _interleaved_zero_bubble(rank, size, ref_loss, ref_grads):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    state = build_parallel_state(pp=2, tp=2, ep=2)
    config = _config()
    tokens, targets = batch(3, B, S, config.vocab_size)
    ids, tgt = local_batch(tokens, targets, state)
    stage_ids = [state.pp_rank + k * state.pp for k in range(STAGES // state.pp)]
    models = [Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                          layers=[s], embed=s == 0, head=s == STAGES - 1) for s in stage_ids]
    for m in models:
        _steer_routers(m)
    stages = [PipelineStage(m, s, STAGES, state.device, *m.pipeline_args(B // 2, S), group=state.pp_group)
              for m, s in zip(models, stage_ids)]
    # every rank passes loss_fn (the schedule plans a backward only where it has one)
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=2, loss_fn=models[-1].loss)
    losses = []
    schedule.step(*((ids,) if state.is_first_stage else ()), target=tgt, losses=losses)
    if state.is_last_stage:
        assert len(losses) == 2
        assert_close(torch.stack(losses).mean().reshape(1), ref_loss.reshape(1), torch.float32, msg="loss")
    checked = 0
    for m in models:
        sync_gradients(m.named_parameters(), state, m.gradient_sync_plan())
        checked += compare_grads(m, ref_grads, f"pp2 x tp2 interleaved zero bubble rank {rank}")
    return checked


def test_deepseek_v3_style_model_pp2_tp2_interleaved_zero_bubble_matches_one_process(world4):
    config = _config()
    ref_loss, ref_grads = _reference(config, *batch(3, B, S, config.vocab_size))
    out = world4.run(_interleaved_zero_bubble, ref_loss, ref_grads)
    # the ranks of one tp group check the same names; both pipeline ranks together hold the whole model
    assert out[0] == out[1] and out[2] == out[3] and out[0] + out[2] == len(ref_grads), out
