"""Bad public arguments give a clear error naming the argument, the expected and the actual value
(one style: fusedpar.kernels.checks), never a silent wrong number: loose booleans, out-of-set
modes, unsupported dtypes, empty sizes (zero heads, zero-size experts), ids out of range.

One process, CPU tensors under the interpreter (the collective ops on an EmulatedTransport, where
every argument check runs exactly as on a real group). Each case is (error type, message
fragment, call); a valid edge case next to each class checks that the check is not too strict.
"""
import pytest
import torch

from _utils import DEVICE
from fusedpar.kernels import grouped_matmul, grouped_wgrad, matmul, matmul_tn, routing_metadata, routing_metadata_reference
from fusedpar.kernels.flash_attention import flash_attention_forward
from fusedpar.nn import Transformer, TransformerConfig, shard_tokens
from fusedpar.nn.attention import AttentionReference, ParallelAttention
from fusedpar.ops import (
    EmulatedTransport,
    all_gather_matmul,
    copy_to_tp_matmul,
    flash_attention,
    grouped_mlp,
    hybrid_attention,
    matmul_all_reduce,
    matmul_reduce_scatter,
    moe_dispatch,
    moe_mlp,
    ring_attention,
    ulysses_attention,
)
from fusedpar.ops.sequence_parallel.layouts import (
    sequence_shard,
    shard_positions,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from fusedpar.ops.sequence_parallel.plans import document_positions
from fusedpar.nn import AttentionConfig


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + 1)).to(DEVICE, dtype)


def _qkv(hq=2, hk=2, s=4):
    return _r(1, s, hq, 8), _r(1, s, hk, 8), _r(1, s, hk, 8)


def _em(size=2):
    return EmulatedTransport(size)


def _tok(seq=8):
    return torch.arange(seq).view(1, seq)


def _cu(*vals, device="cpu"):
    return torch.tensor(vals, dtype=torch.int32, device=device)


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


CASES = {
    # booleans are bools
    "flash causal str": (TypeError, "causal must be a bool, got str 'no'",
                         lambda: flash_attention(*_qkv(), causal="no")),
    "flash causal int": (TypeError, "causal must be a bool, got int 1", lambda: flash_attention(*_qkv(), causal=1)),
    "flash launcher causal None": (TypeError, "causal must be a bool, got NoneType",
                                   lambda: flash_attention_forward(*_qkv(), causal=None)),
    "ring causal str": (TypeError, "causal must be a bool, got str 'no'",
                        lambda: ring_attention(*_qkv(), transport=_em(), causal="no")),
    "ulysses causal str": (TypeError, "causal must be a bool, got str 'yes'",
                           lambda: ulysses_attention(*_qkv(), transport=_em(), causal="yes")),
    "hybrid causal str": (TypeError, "causal must be a bool, got str 'no'",
                          lambda: hybrid_attention(*_qkv(), ulysses_transport=_em(), ring_transport=_em(),
                                                   causal="no")),
    "ParallelAttention causal str": (TypeError, "ParallelAttention: causal must be a bool, got str 'no'",
                                     lambda: ParallelAttention(AttentionConfig(16, 2, causal="no"))),
    "AttentionReference causal int": (TypeError, "AttentionReference: causal must be a bool, got int 0",
                                      lambda: AttentionReference(AttentionConfig(16, 2, causal=0))),
    "all_gather_matmul save_gathered_input str": (
        TypeError, "all_gather_matmul: save_gathered_input must be a bool, got str 'yes'",
        lambda: all_gather_matmul(_r(2, 4, 8), _r(6, 8), transport=_em(), save_gathered_input="yes")),
    "all_gather_matmul return_gathered int": (
        TypeError, "all_gather_matmul: return_gathered must be a bool, got int 1",
        lambda: all_gather_matmul(_r(2, 4, 8), _r(6, 8), transport=_em(), return_gathered=1)),
    "routing check_ids str": (TypeError, "check_ids must be a bool",
                              lambda: routing_metadata(_ids([0, 1]), 2, check_ids="no")),
    # modes from their documented set
    "ring layout": (ValueError, "layout must be one of ('zigzag', 'contiguous'), got 'striped'",
                    lambda: ring_attention(*_qkv(), transport=_em(), layout="striped")),
    "tp activation": (ValueError, "copy_to_tp_matmul: activation must be one of",
                      lambda: copy_to_tp_matmul(_r(4, 8), _r(6, 8), transport=_em(), activation="tanh")),
    "tp transport name": (ValueError, "transport must be one of",
                          lambda: matmul_all_reduce(_r(4, 8), _r(6, 8), transport="nvlink")),
    "moe activation": (ValueError, "activation must be one of",
                       lambda: grouped_mlp(_r(4, 8), _r(2, 6, 8), _r(2, 8, 3), [0, 2, 4], activation="tanh")),
    # supported dtypes
    "matmul out_dtype int32": (TypeError, "out_dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
                               "got torch.int32", lambda: matmul(_r(4, 8), _r(6, 8), out_dtype=torch.int32)),
    "matmul out_dtype float64": (TypeError, "out_dtype must be one of", lambda: matmul(_r(4, 8), _r(6, 8),
                                                                                      out_dtype=torch.float64)),
    "matmul out_dtype str": (TypeError, "out_dtype must be one of", lambda: matmul(_r(4, 8), _r(6, 8),
                                                                                  out_dtype="float32")),
    "matmul_tn out_dtype int64": (TypeError, "out_dtype must be one of",
                                  lambda: matmul_tn(_r(4, 6), _r(4, 8), out_dtype=torch.int64)),
    "tp partial_dtype int": (TypeError, "matmul_reduce_scatter: partial_dtype must be one of torch.float32, got "
                             "torch.int32", lambda: matmul_reduce_scatter(_r(2, 4, 8), _r(6, 8), transport=_em(),
                                                                          partial_dtype=torch.int32)),
    "tp x int dtype": (TypeError, "all_gather_matmul: x must have dtype torch.float32 or torch.float16 or "
                       "torch.bfloat16, got torch.int32",
                       lambda: all_gather_matmul(_r(2, 4, 8).int(), _r(6, 8).int(), transport=_em())),
    # sizes positive
    "flash zero query heads": (ValueError, "q must have at least one head (dim 2), got shape (1, 4, 0, 8)",
                               lambda: flash_attention(_r(1, 4, 0, 8), _r(1, 4, 1, 8), _r(1, 4, 1, 8))),
    "flash zero heads everywhere": (ValueError, "q must have at least one head",
                                    lambda: flash_attention(*_qkv(hq=0, hk=0))),
    "ring zero query heads": (ValueError, "q must have at least one head",
                              lambda: ring_attention(*_qkv(hq=0, hk=1), transport=_em())),
    "ulysses zero heads": (ValueError, "q must have at least one head",
                           lambda: ulysses_attention(*_qkv(hq=0, hk=0), transport=_em())),
    "ParallelAttention zero heads": (ValueError, "num_heads must be a positive int, got 0",
                                     lambda: ParallelAttention(AttentionConfig(16, 0))),
    "tp num_chunks 0": (ValueError, "matmul_all_reduce: num_chunks must be >= 1, got 0",
                        lambda: matmul_all_reduce(_r(4, 8), _r(6, 8), transport=_em(), num_chunks=0)),
    "tp num_chunks bool": (TypeError, "num_chunks must be an int, got bool True",
                           lambda: copy_to_tp_matmul(_r(4, 8), _r(6, 8), transport=_em(), num_chunks=True)),
    "grouped_mlp zero experts": (ValueError, "w1 must have at least one expert (dim 0), got shape (0, 6, 8)",
                                 lambda: grouped_mlp(_r(4, 8), _r(0, 6, 8), _r(0, 8, 3), [0])),
    "grouped_mlp zero ffn": (ValueError, "w1 must have at least one row (dim 1)",
                             lambda: grouped_mlp(_r(4, 8), _r(2, 0, 8), _r(2, 8, 0), [0, 2, 4])),
    "moe_mlp zero ffn": (ValueError, "w1 must have at least one row (dim 1)",
                         lambda: moe_mlp(_r(4, 8), _ids([0], [1], [0], [1]), _r(4, 1), _r(2, 0, 8), _r(2, 8, 0),
                                         num_experts=2)),
    "moe_mlp zero hidden": (ValueError, "x must be [..., hidden] with at least 2 dims and hidden >= 1, got shape "
                            "(4, 0)", lambda: moe_mlp(_r(4, 0), _ids([0], [1], [0], [1]), _r(4, 1), _r(2, 6, 0),
                                                      _r(2, 0, 3), num_experts=2)),
    "moe_dispatch x not a tensor": (TypeError, "x must be a torch.Tensor, got list",
                                    lambda: moe_dispatch([[1.0]], _ids([0]), 2)),
    "moe num_experts bool": (TypeError, "num_experts must be an int, got bool True",
                             lambda: moe_dispatch(_r(2, 8), _ids([0], [0]), True)),
    "moe num_chunks 0": (ValueError, "num_chunks must be >= 1, got 0",
                         lambda: moe_mlp(_r(4, 8), _ids([0], [1], [0], [1]), _r(4, 1), _r(1, 6, 8), _r(1, 8, 3),
                                         num_experts=2, transport=_em(), num_chunks=0)),
    # ids in range
    "routing id == num_groups": (ValueError, r"group_ids must lie in [0, 8) (or be -1: not routed), got 1 id(s)",
                                 lambda: routing_metadata(_ids([0, 1], [2, 8], [3, 4], [5, 6]), 8)),
    "routing id < -1": (ValueError, "group_ids must lie in [0, 3)", lambda: routing_metadata(_ids([0, -5]), 3)),
    "moe expert id out of range": (ValueError, r"expert_ids must lie in [0, 2), got values in [0, 2]",
                                   lambda: moe_mlp(_r(2, 8), _ids([0], [2]), _r(2, 1), _r(2, 6, 8), _r(2, 8, 3),
                                                   num_experts=2)),
    "grouped_wgrad out_dtype int32": (TypeError, "out_dtype must be one of torch.float32, torch.float16, torch.bfloat16, got torch.int",
                                      lambda: grouped_wgrad(_r(4, 6), _r(4, 8), [0, 2, 4], 2, out_dtype=torch.int32)),
    "grouped_matmul out_dtype int64": (TypeError, "out_dtype must be one of torch.float32, torch.float16, torch.bfloat16, got torch.int",
                                       lambda: grouped_matmul(_r(4, 8), _r(2, 6, 8), [0, 2, 4],
                                                              out_dtype=torch.int64)),
    # the model's configuration and its token ids
    "config causal str": (TypeError, "TransformerConfig.causal must be a bool, got str 'no'",
                          lambda: _config(causal="no")),
    "config moe_ffn 0": (ValueError, "TransformerConfig.moe_ffn_hidden_size must be >= 1, got 0",
                         lambda: _config(num_experts=2, moe_ffn_hidden_size=0)),
    "config top_k > experts": (ValueError, "TransformerConfig.top_k must be <= 2, got 3",
                               lambda: _config(num_experts=2, top_k=3)),
    "config sp_mode": (ValueError, "TransformerConfig.sp_mode must be one of ('ring', 'ulysses', 'hybrid'), got 'rign'",
                       lambda: _config(sp_mode="rign")),
    "config attention_dq_mode": (ValueError, "TransformerConfig.attention_dq_mode must be one of ('separate', 'atomic'), "
                                 "got 'fast'", lambda: _config(attention_dq_mode="fast")),
    "config qk_norm int": (TypeError, "TransformerConfig.qk_norm must be a bool, got int 1", lambda: _config(qk_norm=1)),
    "config norm_eps 0": (ValueError, "TransformerConfig.norm_eps must be a positive number, got 0",
                          lambda: _config(norm_eps=0)),
    "token id >= vocab": (ValueError, "input_ids must hold token ids in [0, 10), got values in [0, 10]",
                          lambda: Transformer(_config())(torch.tensor([[0, 3, 10]]))),  # CPU: a GPU trusts the embedding
    "token id < 0": (ValueError, "input_ids must hold token ids in [0, 10), got values in [-1, 3]",
                     lambda: Transformer(_config())(torch.tensor([[-1, 3]]))),
    "float token ids": (TypeError, "input_ids must have dtype torch.int32 or torch.int64, got torch.float32",
                        lambda: Transformer(_config())(torch.randn(1, 3))),
    "pipeline_args microbatch_size 0": (ValueError, "microbatch_size must be >= 1, got 0",
                                        lambda: Transformer(_config()).pipeline_args(0, 8)),
    # layout helpers: ranks in [0, size), sizes >= 1, lengths that split as required
    "shard_tokens sp_rank": (ValueError, "sp_rank must be in [0, sp_size=2), got 2",
                             lambda: shard_tokens(_tok(), _tok(), sp_size=2, sp_rank=2, tp_size=1, tp_rank=0)),
    "shard_tokens sp_rank negative": (ValueError, "sp_rank must be >= 0, got -1",
                                      lambda: shard_tokens(_tok(), _tok(), sp_size=2, sp_rank=-1, tp_size=1, tp_rank=0)),
    "shard_tokens tp_rank": (ValueError, "tp_rank must be in [0, tp_size=2), got 2",
                             lambda: shard_tokens(_tok(), _tok(), sp_size=1, sp_rank=0, tp_size=2, tp_rank=2)),
    "shard_tokens tp_size 0": (ValueError, "tp_size must be >= 1, got 0",
                               lambda: shard_tokens(_tok(), _tok(), sp_size=1, sp_rank=0, tp_size=0, tp_rank=0)),
    "shard_tokens layout": (ValueError, "layout must be one of ('zigzag', 'contiguous'), got 'zz'",
                            lambda: shard_tokens(_tok(), _tok(), sp_size=2, sp_rank=0, tp_size=1, tp_rank=0,
                                                 layout="zz")),
    "sequence_shard ring_rank": (ValueError, "ring_rank must be in [0, ring_size=2), got 2",
                                 lambda: sequence_shard(_r(1, 8, 4), ring_rank=2, ring_size=2)),
    "sequence_shard ulysses_rank": (ValueError, "ulysses_rank must be in [0, ulysses_size=2), got -1",
                                    lambda: sequence_shard(_r(1, 8, 4), ulysses_rank=-1, ulysses_size=2)),
    "sequence_shard dim": (ValueError, "dim must be <= 2, got 3", lambda: sequence_shard(_r(1, 8, 4), dim=3)),
    "shard_positions ring_size 0": (ValueError, "ring_size must be >= 1, got 0",
                                    lambda: shard_positions(8, ring_rank=0, ring_size=0)),
    "shard_positions seq_len float": (TypeError, "seq_len must be an int, got float 8.0",
                                      lambda: shard_positions(8.0, ring_size=2)),
    "shard_positions seq_len negative": (ValueError, "seq_len must be >= 0, got -4", lambda: shard_positions(-4)),
    "shard_positions indivisible": (ValueError, "seq_len=6 must split into 4 equal zigzag chunks",
                                    lambda: shard_positions(6, ring_size=2)),
    "zigzag_positions rank": (ValueError, "rank must be in [0, size=2), got 2", lambda: zigzag_positions(8, 2, 2)),
    "zigzag_positions size 0": (ValueError, "size must be >= 1, got 0", lambda: zigzag_positions(8, 0, 0)),
    "zigzag_shard rank": (ValueError, "rank must be in [0, size=2), got 3", lambda: zigzag_shard(_r(1, 8, 4), 3, 2)),
    "zigzag_shard rank bool": (TypeError, "rank must be an int, got bool True",
                               lambda: zigzag_shard(_r(1, 8, 4), True, 2)),
    "zigzag_unshard size 0": (ValueError, "size must be >= 1, got 0", lambda: zigzag_unshard(_r(1, 8, 4), 0)),
    "zigzag_unshard indivisible": (ValueError, "seq_len=8 must split into 6 equal zigzag chunks",
                                   lambda: zigzag_unshard(_r(1, 8, 4), 3)),
    "zigzag_unshard dim": (ValueError, "dim must be >= -3, got -4", lambda: zigzag_unshard(_r(1, 8, 4), 2, dim=-4)),
    "document_positions empty": (ValueError, "cu_seqlens must have num_docs + 1 >= 1 entries, got 0",
                                 lambda: document_positions(_cu())),
    "document_positions start": (ValueError, "cu_seqlens must start at 0, got 1",
                                 lambda: document_positions(_cu(1, 3, 8))),
    "document_positions decreasing": (ValueError, "cu_seqlens must be non-decreasing, got [0, 5, 3, 8]",
                                      lambda: document_positions(_cu(0, 5, 3, 8))),
    "document_positions total": (ValueError, "cu_seqlens[-1] must equal total (5), got 8",
                                 lambda: document_positions(_cu(0, 3, 8), 5)),
    # cu_seqlens on another device than q: a clear device message, as flash_attention_varlen's check
    "ring cu_seqlens device": (ValueError, "cu_seqlens must be on the CPU or on the same device as q",
                               lambda: ring_attention(*_qkv(), transport=_em(), cu_seqlens=_cu(0, 3, 8, device="meta"))),
    "ulysses cu_seqlens device": (ValueError, "cu_seqlens must be on the CPU or on the same device as q",
                                  lambda: ulysses_attention(*_qkv(), transport=_em(),
                                                            cu_seqlens=_cu(0, 3, 8, device="meta"))),
    "hybrid cu_seqlens device": (ValueError, "cu_seqlens must be on the CPU or on the same device as q",
                                 lambda: hybrid_attention(*_qkv(), ulysses_transport=_em(), ring_transport=_em(1),
                                                          cu_seqlens=_cu(0, 3, 8, device="meta"))),
}


def _config(**overrides):
    return TransformerConfig(**{**dict(vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=6),
                                **overrides})


@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument_is_a_clear_error(case):
    exc, fragment, call = CASES[case]
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value), f"{case}: {info.value}"


def test_routing_keeps_every_in_range_id_and_drops_only_the_sentinel():
    """The issue's example: one id of 8 groups out of range used to give counts summing to 7 of 8.
    In range, every slot is counted; -1 (not routed) is the one id dropped on purpose."""
    ids = _ids([0, 1], [2, 7], [3, 4], [5, 6])
    counts, offsets, slot_pos, sorted_slot = routing_metadata(ids, 8)
    assert int(counts.sum()) == 8 and int(offsets[-1]) == 8
    ids[1, 1] = -1
    got = routing_metadata(ids, 8)
    want = routing_metadata_reference(ids.cpu(), 8)
    for g, w in zip(got, want):
        assert g.cpu().tolist() == w.tolist()
    assert int(got[0].sum()) == 7 and int(got[2][3]) == -1


def test_routing_error_belongs_to_the_call_that_made_it():
    """An out-of-range id raises from its own routing_metadata call, on every device (on a GPU the
    call waits for the kernel's flag), and leaves nothing behind: the next valid call returns
    correct metadata and raises nothing. (The first GPU run reported the flag from a later call
    without waiting: an unrelated MoE test failed with another test's bad ids.)"""
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 3\) \(or be -1: not routed\), got 2 id\(s\)"):
        routing_metadata(_ids([0, 3], [-7, 1]), 3)
    ids = _ids([2, 0], [1, -1])
    got = routing_metadata(ids, 3)
    for g, w in zip(got, routing_metadata_reference(ids.cpu(), 3)):
        assert g.device == ids.device and g.cpu().tolist() == w.tolist()


def test_routing_without_checks_drops_out_of_range_ids_as_documented():
    counts, _, slot_pos, _ = routing_metadata(_ids([0, 9], [1, 2]), 3, check_ids=False)
    assert counts.cpu().tolist() == [1, 1, 1] and int(slot_pos[1]) == -1


def test_valid_edge_inputs_still_pass():
    """Checks that are strict but not too strict: fp32 out_dtype, bools given as bools, one head."""
    y = matmul(_r(4, 8), _r(6, 8), out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (4, 6)
    out, lse = flash_attention(*_qkv(hq=1, hk=1), causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    y = all_gather_matmul(_r(2, 4, 8), _r(6, 8), transport=_em(), save_gathered_input=False, return_gathered=True)
    assert y[0].shape == (2, 8, 6) and y[1].shape == (2, 8, 8)


@pytest.mark.gpu
def test_routing_check_ids_is_refused_while_a_cuda_graph_is_captured():
    """The flag cannot be read on the host during a capture: check_ids=True is refused there
    (replays would drop bad ids silently), check_ids=False is the documented way in."""
    ids = torch.tensor([[0, 1], [2, 3]], device="cuda")
    routing_metadata(ids, 4, check_ids=False)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=r"check_ids=True .* CUDA graph is captured; pass check_ids=False"):
        with torch.cuda.graph(graph):
            routing_metadata(ids, 4)


@pytest.mark.parametrize("triton_version,numpy_version,bad", [
    ("3.6.0", "2.4.6", True), ("3.6.0+git1a2b3c4", "2.4.0rc1", True), ("3.6.0", "2.3.5", False),
    ("3.7.0", "2.4.6", False), ("3.9.0", "2.4.6", False), ("3.6.0", "1.26.4", False)])
def test_interpreter_version_check(triton_version, numpy_version, bad):
    """Triton 3.6's interpreter cannot run loops whose start is a program id with NumPy >= 2.4
    (int() of a one-element array): the versions are named instead of a TypeError deep in a kernel."""
    from fusedpar.kernels.interpreter import interpreter_incompatibility

    problem = interpreter_incompatibility(triton_version, numpy_version)
    if bad:
        assert triton_version in problem and numpy_version in problem and "numpy<2.4" in problem, problem
    else:
        assert problem is None, problem


def test_interpreter_version_check_runs_at_import():
    """``import fusedpar.kernels`` under TRITON_INTERPRET=1 with the bad pair raises the message."""
    import os
    import subprocess
    import sys

    code = ("import numpy, triton; numpy.__version__ = '2.4.1'; triton.__version__ = '3.6.0'\n"
            "try:\n    import fusedpar.kernels\nexcept RuntimeError as e:\n    print('raised:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=120)
    assert "raised: Triton 3.6.0's interpreter" in out.stdout and "numpy<2.4" in out.stdout, out.stdout + out.stderr
