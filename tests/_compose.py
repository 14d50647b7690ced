"""Shared pieces of the composition tests: tiny configs, the one-process reference, comparisons."""
from __future__ import annotations

import torch
import torch.distributed as dist

from _utils import assert_close
from fusedpar.nn import parameter_placements
from fusedpar.nn import Transformer, TransformerConfig
from fusedpar.nn.transformer import shard_tokens

# fp32 everywhere (the interpreter); the sharded run sums the same products in another order
# (chunked GEMMs, ring reductions, per-rank token means averaged, fp32 gradient buckets). The
# largest difference seen was 8e-7 of the tensor's RMS (the embedding gradient, summed over 4 ranks,
# in the sp2 x tp2 x ep4 case) and every case passes at 1e-5; 2e-5 keeps a margin and stays far
# below the O(1) error of a wrong shard, a missing reduction or a double count.
RTOL = 2e-5


def tiny_config(**kw) -> TransformerConfig:
    base = dict(vocab_size=32, hidden_size=16, num_layers=2, num_heads=4, ffn_hidden_size=24, num_kv_heads=4,
                aux_loss_coef=0.0, z_loss_coef=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def batch(seed: int, B: int, S: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    targets = torch.randint(0, vocab, (B, S), generator=g)
    return tokens, targets


def reference(config, tokens, targets, seed=0):
    """Loss and full gradients of the one-process model (same seed, hence same full weights).
    Run in the pytest process (no process group: every fusedpar group has size 1), once per case,
    and handed to the ranks."""
    model = Transformer(config, seed=seed)
    ids, tgt = shard_tokens(tokens, targets, sp_size=1, sp_rank=0, tp_size=1, tp_rank=0)
    loss = model.loss(model(ids), tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def local_batch(tokens, targets, state, layout="zigzag"):
    """This rank's piece of a global batch: rows by dp rank, then the sequence by sp (ring x
    ulysses) and tp."""
    B = tokens.shape[0]
    rows = slice(state.dp_rank * B // state.dp, (state.dp_rank + 1) * B // state.dp)
    return shard_tokens(tokens[rows], targets[rows], sp_size=state.sp, sp_rank=state.sp_rank, tp_size=state.tp,
                        tp_rank=state.tp_rank, layout=layout, ring_size=state.sp_ring)


def data_mean(loss, state):
    """The global loss: mean over the data group of the per-rank losses (same on every rank)."""
    t = loss.detach().clone().reshape(1)
    dist.all_reduce(t, group=state.data_group)
    return t / state.data_size


def fsdp2_step(model, state, ids, tgt, data_parallel_done=True):
    """FSDP2 over the dp mesh dimension (each block, then the root), one forward + backward, the
    gradients synced by the model's plan and gathered whole: ``(loss, {name: full gradient})``."""
    from torch.distributed.fsdp import fully_shard

    from fusedpar.parallel import sync_gradients

    for block in model.layers.values():
        fully_shard(block, mesh=state.mesh["dp"])
    fully_shard(model, mesh=state.mesh["dp"])
    loss = model.loss(model(ids), tgt)
    loss.backward()
    sync_gradients(model.named_parameters(), state, model.gradient_sync_plan(), data_parallel_done=data_parallel_done)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # gather the dp shards
    model.unshard()
    return loss, grads


def compare_grads(model, ref_grads, msg, grads=None):
    """Every local gradient equals the matching shard of the reference's full gradient."""
    placements = parameter_placements(model)
    checked = 0
    for name, p in model.named_parameters():
        g = p.grad if grads is None else grads[name]
        assert g is not None, f"{msg}: {name} has no gradient"
        full = ref_grads[name]
        expect = placements[name].local_from_full(full)
        assert_close(g, expect, torch.float32, rtol=RTOL, atol=RTOL * full.pow(2).mean().sqrt().item() + 1e-12,
                     msg=f"{msg}: grad of {name}")
        checked += 1
    return checked
