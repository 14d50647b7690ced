"""Packed rows through the modules: a single-process Transformer on a packed row equals the same
model run on each document separately (outputs and parameter gradients), rotary positions
restart per document, shard_tokens masks the targets that cross a document boundary."""
import pytest
import torch

from _utils import DEVICE, assert_close
from fusedpar.nn import ParallelAttention, Transformer, TransformerConfig, shard_tokens
from fusedpar.ops import EmulatedTransport
from fusedpar.nn import AttentionConfig

# fp32 end to end: attention is the fp32 flash kernel (~1e-6 relative), the rest fp32 GEMMs and
# norms over <= 64 terms; the packed and per-document runs differ only in summation order -> 5e-5.
TOL = 5e-5


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def test_transformer_packed_row_equals_documents_run_separately():
    config = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=48)
    model = Transformer(config, seed=5, device=DEVICE)
    lengths = [5, 1, 11, 3]
    tokens = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dy = torch.randn(1, sum(lengths), 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    packed = model(tokens, cu_seqlens=_cu(lengths))
    packed.backward(dy)
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    outs, start = [], 0
    for n in lengths:
        out = model(tokens[:, start:start + n])
        out.backward(dy[:, start:start + n])
        outs.append(out.detach())
        start += n
    ref = torch.cat(outs, dim=1)
    assert_close(packed, ref, torch.float32, rtol=TOL, atol=TOL * ref.pow(2).mean().sqrt().item(), msg="logits")
    for name, p in model.named_parameters():
        assert_close(g_packed[name], p.grad, torch.float32, rtol=TOL,
                     atol=TOL * p.grad.pow(2).mean().sqrt().item() + 1e-7, msg=f"grad {name}")


def test_position_ids_and_document_positions():
    torch.manual_seed(0)
    mod = ParallelAttention(AttentionConfig(16, 2, 1, head_dim=8), device=DEVICE)
    cu = _cu([3, 0, 5])
    assert mod.rotary_positions(8, cu_seqlens=cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    pos = torch.arange(8).flip(0)
    assert mod.rotary_positions(8, cu_seqlens=cu, position_ids=pos).tolist() == pos.tolist()
    x = torch.randn(1, 8, 16, device=DEVICE)
    # explicit document positions are the default ones
    assert torch.equal(mod(x, cu_seqlens=cu), mod(x, cu_seqlens=cu, position_ids=torch.tensor(
        [0, 1, 2, 0, 1, 2, 3, 4], device=DEVICE)))
    # rank 1 of an emulated zigzag ring of 2 holds global positions [2, 3, 4, 5] of 8
    ring = ParallelAttention(AttentionConfig(16, 2, 1, head_dim=8), sp_transport=EmulatedTransport(2, 1), device=DEVICE)
    assert ring.rotary_positions(8, cu_seqlens=cu).tolist() == [2, 0, 1, 2]
    with pytest.raises(ValueError, match=r"position_ids must be \[8\]"):
        mod(x, position_ids=torch.arange(4))


def test_shard_tokens_masks_targets_across_documents():
    tokens = torch.arange(12)[None]
    targets = torch.arange(1, 13)[None]
    cu = torch.tensor([0, 4, 4, 9, 12], dtype=torch.int32)
    ids, tg = shard_tokens(tokens, targets, sp_size=1, sp_rank=0, tp_size=1, tp_rank=0, cu_seqlens=cu)
    assert torch.equal(ids, tokens)
    expect = targets.clone()
    expect[0, [3, 8]] = -100  # the last token of each document but the row's last
    assert torch.equal(tg, expect)
    # sharded: the masked targets travel with their tokens
    _, tg1 = shard_tokens(tokens, targets, sp_size=2, sp_rank=1, tp_size=1, tp_rank=0, cu_seqlens=cu)
    order = [3, 4, 5, 6, 7, 8]
    assert torch.equal(tg1, expect[:, order])
    with pytest.raises(ValueError, match="full packed length"):
        shard_tokens(tokens, targets, sp_size=1, sp_rank=0, tp_size=1, tp_rank=0, cu_seqlens=cu[:-1])
