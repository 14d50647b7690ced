"""3-D parallelism on 8 gloo processes: dp2 x pp2 x tp2 (1F1B pipeline over two stages, tensor
parallelism inside each stage, data parallelism across the two pipelines). Loss and every
gradient equal the one-process model's."""
import torch

from _compose import batch, compare_grads, data_mean, local_batch, reference, tiny_config
from _utils import assert_close
from _world import world_fixture
from fusedpar.nn import Transformer
from fusedpar.parallel import build_parallel_state, sync_gradients

world8 = world_fixture(8)

B, S = 4, 8


def _three_d(rank, size, ref_loss, ref_grads):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    state = build_parallel_state(dp=2, pp=2, tp=2)
    config = tiny_config()
    tokens, targets = batch(5, B, S, config.vocab_size)
    ids, tgt = local_batch(tokens, targets, state)
    s = state.pp_rank
    model = Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                        layers=[s], embed=s == 0, head=s == 1)
    stage = PipelineStage(model, s, 2, state.device, group=state.pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=model.loss)
    losses = []
    schedule.step(*((ids,) if state.is_first_stage else ()), target=tgt, losses=losses)
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    if state.is_last_stage:
        assert_close(data_mean(torch.stack(losses).mean(), state), ref_loss.reshape(1), torch.float32, msg="loss")
    return compare_grads(model, ref_grads, f"dp2 x pp2 x tp2 rank {rank}")


def test_dp2_pp2_tp2_matches_one_process(world8):
    config = tiny_config()
    out = world8.run(_three_d, *reference(config, *batch(5, B, S, config.vocab_size)))
    # every rank checked all of its stage's parameters: both stages together hold the whole model
    assert all(n > 0 for n in out) and out[0] + out[-1] == len(dict(Transformer(config).named_parameters()))
