"""fusedpar modules inside the training stacks users run, on 4 gloo processes, each case against
the one-process model (loss and every gradient):

* tensor x sequence (ring attention) x expert parallelism: sp2 x tp2 with MoE over ep4;
* DDP over dp with tensor parallelism inside (dp2 x tp2);
* FSDP2 (``fully_shard`` over the dp mesh dimension) with tensor parallelism inside;
* hybrid sequence parallelism (ulysses2 x ring2) in the Transformer;
* DDP and FSDP2 over dp with ring attention inside (dp2 x sp2; the sp reduction by sync_gradients);
* activation checkpointing of every block, manual gradient sync;
* torch.distributed.pipelining with TP inside each stage: GPipe, 1F1B, interleaved 1F1B;
* DCP: save at tp2 (ep2), load at tp4 (ep4), same weights and same loss;
* kv heads replicated over tp (tp4, 2 kv heads): loss and gradients, and DCP tp4 -> tp1 -> tp4;
  1 kv head at tp2 x sp2 Ulysses.
"""
import os
import re
import shutil
import tempfile

import pytest
import torch

from _compose import batch, compare_grads, data_mean, fsdp2_step, local_batch, reference, tiny_config
from _utils import DEVICE, assert_close
from _world import straggle, world_fixture
from fusedpar import checkpoint as fcheckpoint
from fusedpar.ops import comm
from fusedpar.nn import Transformer
from fusedpar.parallel import build_parallel_state, sync_gradients

world4 = world_fixture(4)

B, S = 4, 8


def _tp_model(config, state, **kw):
    return Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group, **kw)


def _tp_sp_ep(rank, size, ref_loss, ref_grads):
    from fusedpar.nn.attention import ParallelAttention

    straggle(0.004, seed=4)  # random per-rank delays before every transfer: a missing wait -> wrong numbers
    state = build_parallel_state(sp=2, tp=2, ep=4)  # experts over all four sp x tp ranks
    config = tiny_config(num_experts=4, top_k=2, moe_every=2)
    tokens, targets = batch(4, B, S, config.vocab_size)
    ids, tgt = local_batch(tokens, targets, state, layout=config.layout)
    model = _tp_model(config, state)
    attn = model.layers["0"].attn
    assert isinstance(attn, ParallelAttention) and attn.ring_size == 2 and attn.tp_size == 2
    assert model.layers["1"].mlp.ep_size == 4
    # the token layout of shard_tokens is the one the attention module expects (zigzag over sp, then tp)
    full_pos = torch.arange(S)[None].expand(B, S)
    pos, _ = local_batch(full_pos, full_pos, state, layout=config.layout)
    assert torch.equal(pos[0], attn.local_positions(S)), (pos[0], attn.local_positions(S))
    try:
        loss = model.loss(model(ids), tgt)
        loss.backward()
    finally:
        comm.set_straggler(0)
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="sp2 x tp2 x ep4 loss")
    return compare_grads(model, ref_grads, "sp2 x tp2 x ep4")


def test_tensor_sequence_expert_parallel_match_one_process(world4):
    config = tiny_config(num_experts=4, top_k=2, moe_every=2)
    out = world4.run(_tp_sp_ep, *reference(config, *batch(4, B, S, config.vocab_size)))
    assert all(n > 10 for n in out), out


def _ddp_fsdp_checkpointing(rank, size, ref_loss, ref_grads):
    from torch.nn.parallel import DistributedDataParallel as DDP

    config = tiny_config(num_layers=1)
    tokens, targets = batch(1, B, S, config.vocab_size)
    state = build_parallel_state(dp=2, tp=2)
    ids, tgt = local_batch(tokens, targets, state)
    checked = {}

    # DDP over the dp group; TP collectives inside the model over the tp group
    model = _tp_model(config, state)
    ddp = DDP(model, process_group=state.dp_group)
    loss = model.loss(ddp(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan(), data_parallel_done=True)
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="DDP loss")
    checked["ddp"] = compare_grads(model, ref_grads, "DDP")

    # FSDP2: each block and the root sharded over the dp mesh dimension
    model = _tp_model(config, state)
    loss, full = fsdp2_step(model, state, ids, tgt)
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="FSDP2 loss")
    checked["fsdp2"] = compare_grads(model, ref_grads, "FSDP2", grads=full)

    # activation checkpointing of every block; gradients synced by hand (no wrapper)
    model = _tp_model(config, state, activation_checkpointing=True)
    loss = model.loss(model(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="checkpointed loss")
    checked["checkpointing"] = compare_grads(model, ref_grads, "activation checkpointing")
    return checked


def test_ddp_fsdp2_and_activation_checkpointing_match_one_process(world4):
    config = tiny_config(num_layers=1)
    out = world4.run(_ddp_fsdp_checkpointing, *reference(config, *batch(1, B, S, config.vocab_size)))
    n_params = len(list(Transformer(config).parameters()))
    assert all(c == {"ddp": n_params, "fsdp2": n_params, "checkpointing": n_params} for c in out), out


def _sequence_parallel_compositions(rank, size, ref_loss, ref_grads):
    """Hybrid sequence parallelism (ulysses 2 x ring 2) in the Transformer; DDP and FSDP2 over dp
    with ring attention over sp inside (dp2 x sp2)."""
    import dataclasses

    from torch.nn.parallel import DistributedDataParallel as DDP

    config = tiny_config(num_layers=1)
    tokens, targets = batch(1, B, S, config.vocab_size)
    checked = {}

    # hybrid: sp4 = ring 2 x ulysses 2 (ulysses ranks neighbours); manual gradient sync over sp
    state = build_parallel_state(sp=4, sp_ulysses=2)
    assert (state.sp_ring, comm.group_size(state.ulysses_group), comm.group_size(state.ring_group)) == (2, 2, 2)
    assert (state.ring_rank, state.ulysses_rank) == divmod(rank, 2)
    hybrid = dataclasses.replace(config, sp_mode="hybrid")
    model = Transformer(hybrid, tp_group=state.tp_group, ulysses_group=state.ulysses_group,
                        ring_group=state.ring_group, ep_group=state.ep_group)
    attn = model.layers["0"].attn
    assert attn.sp_mode == "hybrid" and (attn.ring_size, attn.ulysses_size) == (2, 2)
    full_pos = torch.arange(S)[None].expand(B, S)
    pos, _ = local_batch(full_pos, full_pos, state)  # shard_tokens' hybrid order = the attention's
    assert torch.equal(pos[0], attn.local_positions(S)), (pos[0], attn.local_positions(S))
    ids, tgt = local_batch(tokens, targets, state)
    loss = model.loss(model(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="hybrid sp loss")
    checked["hybrid"] = compare_grads(model, ref_grads, "hybrid ulysses2 x ring2")

    # dp2 x sp2 (ring attention), tp1: the wrappers reduce over dp only, sync_gradients adds sp
    state = build_parallel_state(dp=2, sp=2)
    assert comm.group_size(state.dp_group) == 2 and comm.group_size(state.data_group) == 4
    ids, tgt = local_batch(tokens, targets, state)
    model = _tp_model(config, state)
    ddp = DDP(model, process_group=state.dp_group)
    loss = model.loss(ddp(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan(), data_parallel_done="dp")
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="DDP dp2 x sp2 loss")
    checked["ddp"] = compare_grads(model, ref_grads, "DDP dp2 x sp2")

    model = _tp_model(config, state)
    loss, full = fsdp2_step(model, state, ids, tgt, data_parallel_done="dp")
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="FSDP2 dp2 x sp2 loss")
    checked["fsdp2"] = compare_grads(model, ref_grads, "FSDP2 dp2 x sp2", grads=full)
    return checked


def test_hybrid_sp_and_ddp_fsdp2_with_sequence_parallel_match_one_process(world4):
    config = tiny_config(num_layers=1)
    out = world4.run(_sequence_parallel_compositions, *reference(config, *batch(1, B, S, config.vocab_size)))
    n_params = len(list(Transformer(config).parameters()))
    assert all(c == {"hybrid": n_params, "ddp": n_params, "fsdp2": n_params} for c in out), out


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)]


def _pipeline(rank, size, refs):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}
    state = build_parallel_state(pp=2, tp=2)
    results = {}
    for name, per_rank in SCHEDULES:
        cls = classes[name]
        n_stages = state.pp * per_rank
        config = tiny_config(num_layers=n_stages)
        tokens, targets = batch(2, B, S, config.vocab_size)
        ref_loss, ref_grads = refs[per_rank]
        ids, tgt = local_batch(tokens, targets, state)
        stage_ids = [state.pp_rank + k * state.pp for k in range(per_rank)]
        models = [_tp_model(config, state, layers=[s], embed=s == 0, head=s == n_stages - 1) for s in stage_ids]
        # the stages' shapes given (Transformer.pipeline_args): no shape-inference pass on torch.empty
        stages = [PipelineStage(m, s, n_stages, state.device, *m.pipeline_args(B // 2, S), group=state.pp_group)
                  for m, s in zip(models, stage_ids)]
        loss_fn = models[-1].loss  # every rank passes it: the schedule plans a backward only when given one
        if per_rank == 1:
            schedule = cls(stages[0], n_microbatches=2, loss_fn=loss_fn)
        else:
            schedule = cls(stages, n_microbatches=2, loss_fn=loss_fn)
        losses = []
        schedule.step(*((ids,) if state.is_first_stage else ()), target=tgt, losses=losses)
        if state.is_last_stage:
            assert len(losses) == 2
            assert_close(torch.stack(losses).mean().reshape(1), ref_loss.reshape(1), torch.float32,
                         msg=f"{name} loss")
        checked = 0
        for m in models:
            sync_gradients(m.named_parameters(), state, m.gradient_sync_plan())
            checked += compare_grads(m, ref_grads, name)
        results[name] = checked
    return results


def test_pipeline_schedules_with_tp_inside_each_stage(world4):
    refs = {}
    for per_rank in (1, 2):  # pp=2 ranks, one or two stages each, one block per stage
        config = tiny_config(num_layers=2 * per_rank)
        refs[per_rank] = reference(config, *batch(2, B, S, config.vocab_size))
    out = world4.run(_pipeline, refs)
    for r in out:
        assert set(r) == {"gpipe", "1f1b", "interleaved1f1b"} and all(v > 0 for v in r.values()), out


def _dcp_reshard(rank, size, path):
    config = tiny_config(num_experts=4, top_k=2, moe_every=2)
    tokens, targets = batch(3, B, S, config.vocab_size)
    # save at dp2 x tp2 (experts over ep2 = the tp group)
    st2 = build_parallel_state(dp=2, tp=2, ep=2)
    m2 = _tp_model(config, st2, seed=11)
    full2 = fcheckpoint.full_state(m2)
    fcheckpoint.save(m2, path, extra={"step": torch.tensor(7)})
    ids, tgt = local_batch(tokens, targets, st2)
    with torch.no_grad():
        loss2 = data_mean(m2.loss(m2(ids), tgt), st2)
    # load at tp4 (experts over ep4) into a differently initialised model
    st4 = build_parallel_state(tp=4, ep=4)
    m4 = _tp_model(config, st4, seed=99)
    step = torch.tensor(0)
    fcheckpoint.load(m4, path, extra={"step": step})
    assert step.item() == 7
    full4 = fcheckpoint.full_state(m4)
    assert full4.keys() == full2.keys()
    for k in full2:
        assert torch.equal(full4[k], full2[k]), f"{k} differs after resharding tp2 -> tp4"
    ids, tgt = local_batch(tokens, targets, st4)
    with torch.no_grad():
        loss4 = data_mean(m4.loss(m4(ids), tgt), st4)
    assert_close(loss4, loss2, torch.float32, msg="loss after resharding")
    return len(full2)


def test_dcp_save_at_tp2_load_at_tp4(world4):
    path = tempfile.mkdtemp(prefix="fusedpar_dcp_")
    try:
        out = world4.run(_dcp_reshard, os.path.join(path, "ckpt"))
        assert out[0] == out[-1] > 10
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _kv_replicated(rank, size, ref_loss, ref_grads, path):
    """tp4 with 2 kv heads (qkv bias included): ranks 0, 1 hold kv head 0, ranks 2, 3 kv head 1;
    loss and every gradient (the k / v rows summed over their two holders) equal the one-process
    model's; model and AdamW state saved at tp4 load at tp1 (dp4) and back at tp4."""
    from fusedpar.hf import to_hf_state_dict
    from fusedpar.nn import merge_shards

    config = tiny_config(num_heads=4, num_kv_heads=2, qkv_bias=True, num_layers=1)
    tokens, targets = batch(6, B, S, config.vocab_size)
    st4 = build_parallel_state(tp=4)
    model = _tp_model(config, st4)
    attn = model.layers["0"].attn
    assert attn.kv_replicas == 2 and attn.kv_heads_local == 1
    assert fcheckpoint.placements_of(model)["layers.0.attn.qkv.weight"].replicas \
        == (1, 2, 2)
    ids, tgt = local_batch(tokens, targets, st4)
    loss = model.loss(model(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), st4, model.gradient_sync_plan())
    assert_close(data_mean(loss, st4), ref_loss.reshape(1), torch.float32, msg="tp4 kv2 loss")
    checked = compare_grads(model, ref_grads, "tp4 with 2 kv heads")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    full = fcheckpoint.full_state(model)
    exported = to_hf_state_dict(model)  # one copy of each kv head, as HF holds it
    assert torch.equal(exported["model.layers.0.self_attn.k_proj.weight"], full["layers.0.attn.qkv.weight"][16:24])
    shards = [None] * size
    torch.distributed.all_gather_object(shards, {k: v for k, v in attn.qkv.state_dict().items()})
    assert torch.equal(merge_shards(shards)["weight"], full["layers.0.attn.qkv.weight"])
    fcheckpoint.save(model, path, optimizer=opt)
    st1 = build_parallel_state(dp=4)
    one = _tp_model(config, st1, seed=5)
    opt1 = torch.optim.AdamW(one.parameters(), lr=1e-2)
    fcheckpoint.load(one, path, optimizer=opt1)
    for n, p in one.named_parameters():
        assert torch.equal(p.detach(), full[n]), f"{n} differs after tp4 -> tp1"
    placements = fcheckpoint.placements_of(model)
    for n, p in model.named_parameters():  # the optimizer moments reshard with the rows
        assert torch.equal(placements[n].full_from_local(opt.state[p]["exp_avg"]), opt1.state[dict(
            one.named_parameters())[n]]["exp_avg"]), f"exp_avg of {n} differs after tp4 -> tp1"
    fcheckpoint.save(one, path + "_tp1", optimizer=opt1)
    back = _tp_model(config, st4, seed=6)
    opt4 = torch.optim.AdamW(back.parameters(), lr=1e-2)
    fcheckpoint.load(back, path + "_tp1", optimizer=opt4)  # every holder of a kv head gets all of its rows
    for (n, p), q in zip(back.named_parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{n} differs after tp1 -> tp4"
        assert torch.equal(opt4.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"]), f"moment of {n} after tp1 -> tp4"
    return checked


def _kv_replicated_ulysses(rank, size, ref_loss, ref_grads):
    """tp2 x sp2 Ulysses with 1 kv head: replicated over tp (this module) and again over the
    Ulysses ranks (the all-to-all's own replication); loss and every gradient as one process."""
    config = tiny_config(num_heads=4, num_kv_heads=1, num_layers=1, sp_mode="ulysses")
    tokens, targets = batch(7, B, S, config.vocab_size)
    state = build_parallel_state(tp=2, sp=2)
    model = _tp_model(config, state)
    assert model.layers["0"].attn.kv_replicas == 2
    ids, tgt = local_batch(tokens, targets, state, layout="contiguous")
    loss = model.loss(model(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="tp2 x sp2 Ulysses kv1 loss")
    return compare_grads(model, ref_grads, "tp2 x sp2 Ulysses with 1 kv head")


def test_kv_head_replicated_over_tp_under_ulysses_matches_one_process(world4):
    config = tiny_config(num_heads=4, num_kv_heads=1, num_layers=1, sp_mode="ulysses")
    out = world4.run(_kv_replicated_ulysses, *reference(config, *batch(7, B, S, config.vocab_size)))
    assert all(n > 5 for n in out), out


def test_kv_heads_replicated_over_tp4_match_one_process_and_reshard(world4):
    config = tiny_config(num_heads=4, num_kv_heads=2, qkv_bias=True, num_layers=1)
    path = tempfile.mkdtemp(prefix="fusedpar_kv_")
    try:
        out = world4.run(_kv_replicated, *reference(config, *batch(6, B, S, config.vocab_size)),
                         os.path.join(path, "ckpt"))
        assert all(n > 5 for n in out), out
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_autocast_leaves_an_fp32_model_unchanged():
    """Under ``torch.autocast`` (bf16) an fp32 MoE model computes what it computes without it: the
    fusedpar ops run in their operands' dtype, and the router's logits, fp32 by design, are not
    cast down by autocast (their matmul runs with autocast off; a bf16 matmul there was refused by
    moe_route). CPU autocast covers matmul as CUDA's does, so the interpreter checks it too."""
    import copy

    config = tiny_config(num_experts=4, top_k=2, moe_every=2)
    tokens, targets = (t.to(DEVICE) for t in batch(6, B, S, config.vocab_size))
    model = Transformer(config, device=DEVICE)
    auto = copy.deepcopy(model)
    loss = model.loss(model(tokens), targets)
    loss.backward()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits = auto(tokens)
        auto_loss = auto.loss(logits, targets)
    auto_loss.backward()
    assert logits.dtype == torch.float32 and auto_loss.dtype == torch.float32
    # the same fp32 ops on the same operands: equal up to fp32 rounding (not bf16's 2^-8)
    assert_close(auto_loss.detach().reshape(1), loss.detach().reshape(1), torch.float32, msg="loss under autocast")
    grads = dict(model.named_parameters())
    for name, p in auto.named_parameters():
        assert_close(p.grad, grads[name].grad, torch.float32, msg=f"grad of {name} under autocast")


@pytest.mark.gpu
def test_bf16_autocast_on_gpu():
    """bf16 parameters and activations (compiled kernels) under ``torch.autocast``: the loss and
    every gradient stay within bf16 rounding of the fp32 model (one process, one GPU)."""
    import copy

    config = tiny_config(num_experts=4, top_k=2, moe_every=2)
    tokens, targets = batch(6, B, S, config.vocab_size)
    tokens, targets = tokens.cuda(), targets.cuda()
    model32 = Transformer(config, device="cuda")
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    loss32 = model32.loss(model32(tokens), targets)
    loss32.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model16(tokens)
        loss16 = model16.loss(logits, targets)
    loss16.backward()
    assert logits.dtype == torch.bfloat16 and loss16.dtype == torch.float32
    # bf16 keeps 8 mantissa bits (2^-8 relative per rounding); a few roundings per layer through
    # two blocks -> 5e-2 of each tensor's RMS, far below the O(1) error of a wrong gradient
    assert_close(loss16, loss32.detach(), torch.bfloat16, rtol=5e-2, atol=5e-2 * loss32.item(), msg="bf16 loss")
    grads32 = dict(model32.named_parameters())
    for name, p in model16.named_parameters():
        g32 = grads32[name].grad
        assert p.grad.dtype == torch.bfloat16, name
        assert_close(p.grad.float(), g32, torch.bfloat16, rtol=5e-2, atol=5e-2 * g32.pow(2).mean().sqrt().item(),
                     msg=f"bf16 grad of {name}")


def test_vocab_parallel_loss_and_layout_helpers_single_process():
    """Without a group the loss is torch's cross entropy (values and logits gradient); the token
    layout helper and the config reject bad sizes."""
    from fusedpar.nn import TransformerConfig, shard_tokens, vocab_parallel_cross_entropy
    from fusedpar.nn.transformer import sequence_order

    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(3, 7, 13, generator=g) * 3).requires_grad_()
    target = torch.randint(0, 13, (3, 7), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, 13), target.reshape(-1))
    ref.backward()
    loss.backward()
    assert_close(loss.reshape(1), ref.reshape(1), torch.float32)
    assert_close(logits.grad, ref_logits.grad, torch.float32)
    per_token = vocab_parallel_cross_entropy(logits.detach(), target, reduction="none")
    assert per_token.shape == (3, 7)
    with pytest.raises(ValueError, match=r"target must have shape \(3, 7\)"):
        vocab_parallel_cross_entropy(logits, target[:, :5])
    with pytest.raises(TypeError, match="integer class ids"):
        vocab_parallel_cross_entropy(logits, target.float())
    # zigzag over sp=2: chunks 0 and 3 on rank 0, 1 and 2 on rank 1; then tp splits contiguously
    assert sequence_order(8, 2, "zigzag").tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    tok = torch.arange(16).reshape(2, 8)
    ids, tgt = shard_tokens(tok, tok + 100, sp_size=2, sp_rank=1, tp_size=2, tp_rank=1)
    assert ids.tolist() == [[4, 5], [12, 13]] and tgt.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    # hybrid sp4 = ring 2 x ulysses 2: zigzag over the 2 ring ranks, each ring shard in 2 pieces
    ids, tgt = shard_tokens(tok, tok, sp_size=4, sp_rank=1, tp_size=1, tp_rank=0, ring_size=2)
    assert ids.tolist() == [[6, 7], [14, 15]] and tgt.tolist() == ids.tolist()
    ids, _ = shard_tokens(tok, tok, sp_size=4, sp_rank=1, tp_size=1, tp_rank=0, ring_size=1)  # ulysses
    assert ids.tolist() == [[2, 3], [10, 11]]
    with pytest.raises(ValueError, match="ring_size must be a positive int dividing sp_size=4, got 3"):
        shard_tokens(tok, tok, sp_size=4, sp_rank=0, tp_size=1, tp_rank=0, ring_size=3)
    with pytest.raises(ValueError, match=r"seq_len=8 must be divisible by sp \* tp \(3\)"):
        shard_tokens(tok, tok, sp_size=3, sp_rank=0, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        TransformerConfig(vocab_size=8, hidden_size=8, num_layers=0, num_heads=2, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="layer index 5 is outside 0..1"):
        Transformer(tiny_config(), layers=[5])


EXPECTED_PLAN = {
    "embedding.weight": "replicated", "norm.weight": "replicated", "head.weight": "dense",
    **{f"layers.{i}.{n}": "replicated" for i in (0, 1) for n in ("norm1.weight", "norm2.weight")},
    **{f"layers.{i}.attn.{n}.weight": "dense" for i in (0, 1) for n in ("qkv", "proj")},
    "layers.0.mlp.fc1.weight": "dense", "layers.0.mlp.fc2.weight": "dense",
    "layers.1.mlp.w1": "expert", "layers.1.mlp.w2": "expert", "layers.1.mlp.router.weight": "replicated",
}


def test_placement_with_replicated_sections_round_trips():
    """Sections [q; k; v] = [8; 4; 4] rows over 4 ranks, k and v blocks held by 2 ranks each: every
    rank's block, the full tensor from the blocks (one copy of each replicated block), the DCP
    pieces (each rank a distinct quarter of every section) and the checks of the arguments."""
    from fusedpar.nn import Placement

    full = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)
    pl = Placement("tp", None, 0, (8, 4, 4), replicas=(1, 2, 2))
    blocks = [pl.local_from_full(full, rank=r, size=4) for r in range(4)]
    for r, b in enumerate(blocks):
        j = r // 2
        rows = [full[2 * r:2 * r + 2], full[8 + 2 * j:10 + 2 * j], full[12 + 2 * j:14 + 2 * j]]
        assert torch.equal(b, torch.cat(rows))
    assert torch.equal(pl.full_from_locals(blocks), full)
    assert pl.local_sections(6, 4) == [2, 2, 2]
    assert Placement("tp", None, 0, (8, 4, 4), replicas=(1, 1, 1)).replicas is None
    with pytest.raises(ValueError, match="replicas must be positive ints, one per section"):
        Placement("tp", None, 0, (8, 4, 4), replicas=(1, 2))
    with pytest.raises(ValueError, match="held by 2 ranks each"):
        Placement("tp", None, 0, (8, 2, 2), replicas=(1, 2, 2)).local_from_full(full[:12], rank=0, size=4)


def test_gradient_sync_plan_of_every_parameter():
    model = Transformer(tiny_config(num_experts=4, top_k=2, moe_every=2))
    assert model.gradient_sync_plan() == EXPECTED_PLAN


def _add_bare_parameter(model):
    model.layers["0"].scale = torch.nn.Parameter(torch.ones(3))
    return "layers.0.scale"


def _add_plain_linear(model):
    model.layers["1"].extra = torch.nn.Linear(2, 2, bias=False)
    return "layers.1.extra.weight"


def _add_parameter_to_attention(model):
    model.layers["0"].attn.gate = torch.nn.Parameter(torch.ones(2))
    return "layers.0.attn.gate"


@pytest.mark.parametrize("add", [_add_bare_parameter, _add_plain_linear, _add_parameter_to_attention],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_gradient_sync_plan_rejects_unknown_parameters(add):
    """A parameter the plan does not know would be synced as "dense" by guess (wrong for a
    replicated copy): it raises, naming the parameter."""
    model = Transformer(tiny_config(num_experts=4, top_k=2, moe_every=2))
    name = add(model)
    with pytest.raises(ValueError, match=rf"{re.escape(name)!s}"):
        model.gradient_sync_plan()


class _FakeGroup:
    """Stands for a process group (weak-referenceable, like torch's)."""


def test_checkpoint_mesh_cache_never_hands_a_dead_groups_mesh_to_a_new_group(monkeypatch):
    """The DCP mesh cache is keyed by the group object: once a group is gone, a new group that
    happens to get the same id() must get its own mesh, not the dead group's."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device_type: object()))
    group = _FakeGroup()
    old_id, old_mesh = id(group), fcheckpoint.group_mesh(group, "cpu")
    assert fcheckpoint.group_mesh(group, "cpu") is old_mesh  # cached while the group lives
    del group
    gc.collect()
    keep = []
    for _ in range(10000):  # CPython hands the freed slot to the next object of that size
        keep.append(_FakeGroup())
        if id(keep[-1]) == old_id:
            break
    else:
        pytest.skip("no new object reused the dead group's id")
    assert fcheckpoint.group_mesh(keep[-1], "cpu") is not old_mesh


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_attach_aux_loss_sends_its_scale_into_the_aux_loss(scale):
    """The functional op behind TransformerBlock's router-loss wiring: identity forward, and the
    aux loss receives gradient ``scale`` through the backward of ``x``'s consumer."""
    from fusedpar import nn as fnn
    from fusedpar import ops

    assert fnn.vocab_parallel_cross_entropy is ops.vocab_parallel_cross_entropy  # re-exported for nn users
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(2, requires_grad=True)
    aux = (w * w).sum()
    y = ops.attach_aux_loss(x, aux, scale)
    assert torch.equal(y, x)
    (3 * y).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    assert_close(w.grad, 2 * scale * w.detach(), torch.float32)
    # on the residual add of a block: y = x + residual in one pass, gradients to both and to aux
    x.grad = w.grad = None
    residual = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)  # an fp64 residual stream
    y = ops.attach_aux_loss(x, (w * w).sum(), scale, residual=residual)
    assert y.dtype == torch.float64 and torch.equal(y, x.double() + residual)
    (3 * y).sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.full_like(x, 3.0))
    assert torch.equal(residual.grad, torch.full_like(residual, 3.0))
    assert_close(w.grad, 2 * scale * w.detach(), torch.float32)
    with pytest.raises(ValueError, match=r"residual must have the same shape as x \(\(3, 4\)\), got \(4, 3\)"):
        ops.attach_aux_loss(x, (w * w).sum(), scale, residual=residual.t())
