"""One :class:`~fusedpar.nn.TransformerBlock` forward + backward captured in a CUDA graph
(``torch.cuda.graph``) and replayed three times, each with fresh data copied into the static
input and output gradient: the output, the input gradient and every parameter gradient are the
same bits as an eager run of the block on the same inputs (issue #39 item 5, issue #42).

Cases (bf16, head dim 128, GQA, SwiGLU MLP):

* ``tp1``: the block as built (no process group: tensor-parallel ops of one rank);
* ``emulated2`` / ``emulated4``: one rank of tensor parallelism over an ``EmulatedTransport`` of 2
  and 4 ranks (the ring schedules: copies on the transport's side stream, its event ring, the op
  scope's join, the chunk GEMMs' launch plans and the rings' kept receive buffers);
* ``symmetric2`` / ``symmetric4``: the same with ``in_kernel_waits=True`` (one persistent GEMM
  waiting per chunk on flags raised by copies on a side stream, the reduce-scatter's device ready
  word set from the counters each call, the flags lowered at each call's start; a graph replays
  all of it);
* ``tp1-fp8-rowwise``, ``emulated2-fp8-blockwise``: the dense training path in fp8 (the norms hand
  their e4m3 output to qkv / fc1; blockwise also fc1's epilogue tiles to fc2 and the flash
  forward's to o_proj).

The emulated ranks: the block's column and row projections call their ops
(``all_gather_matmul``, ``matmul_reduce_scatter``) with the transport instead of the block's
group of one, so each op runs one rank of its schedule on a gathered sequence ``P`` times the
block's input, with the block's (whole) weights; the attention runs over that gathered sequence.

Order (so that nothing but launches happens inside the capture): eager warm-up (Triton's
compiles, autotuning, launch plans built on a key's second launch, the transports' buffers and
streams, the deferred wait checks' pinned slots), the eager references, warm-up on a side stream
(as ``torch.cuda.graph`` asks), capture, replays. Compiled kernels only: skipped on CPU (the
interpreter has no CUDA graphs).
"""
from __future__ import annotations

import pytest
import torch

import fusedpar.nn.linear as nn_linear
from _utils import DEVICE, INTERPRETED
from fusedpar.nn import TransformerBlock, TransformerConfig
from fusedpar.ops.comm.transport import EmulatedTransport

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("cuda_graph")]

B, S, H = 2, 64, 256  # batch, tokens per rank, hidden (2 heads of 128, one kv head)
REPLAYS = 3
WARMUP = 2  # eager calls before the references: a launch plan is built on a key's second launch

# name: (emulated tensor-parallel size or None, in-kernel waits, fp8 recipe)
CASES = {
    "tp1": (None, False, None),
    "emulated2": (2, False, None),
    "emulated4": (4, False, None),
    "symmetric2": (2, True, None),
    "symmetric4": (4, True, None),
    "tp1-fp8-rowwise": (None, False, "rowwise"),
    "emulated2-fp8-blockwise": (2, False, "blockwise"),
}


def _block(fp8):
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=64, hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1,
                               ffn_hidden_size=2 * H, fp8=fp8)
    return TransformerBlock(config.block_config(0), device=DEVICE, dtype=torch.bfloat16)


def _over(transport, op):
    """``op`` called with ``transport`` in place of the module's group."""
    def call(*args, group=None, **kwargs):
        return op(*args, transport=transport, **kwargs)
    return call


def _inputs(n, seed):
    """``n`` pairs (x, output gradient), fresh random data each."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(B, S, H, generator=g).to(device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
            for _ in range(n)]


def _clear(block, x):
    block.zero_grad(set_to_none=True)
    x.grad = None


def _results(block, y, x):
    """The output, the input gradient and every parameter gradient (by name)."""
    out = {"output": y, "input grad": x.grad}
    out.update({f"grad of {n}": p.grad for n, p in block.named_parameters()})
    missing = [k for k, v in out.items() if v is None]
    assert not missing, f"no gradient: {missing}"
    return out


def _eager(block, x, gy):
    x = x.detach().clone().requires_grad_(True)
    _clear(block, x)
    y = block(x)
    y.backward(gy)
    return {k: v.detach().clone() for k, v in _results(block, y, x).items()}


def _capture(block, static_x, static_gy):
    """The graph of one forward + backward on the static tensors and its static output, after a
    warm-up on a side stream; the gradients it writes are allocated by the capture itself."""
    def step():
        y = block(static_x)
        y.backward(static_gy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            _clear(block, static_x)
            step()
    torch.cuda.current_stream().wait_stream(side)
    _clear(block, static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    return graph, static_y


def _assert_same_bits(label, got, want):
    assert got.keys() == want.keys(), (label, sorted(got), sorted(want))
    for name, w in want.items():
        g = got[name]
        assert torch.isfinite(w.float()).all(), f"{label}: eager {name} is not finite"
        if not torch.equal(g, w):
            diff = (g.float() - w.float()).abs()
            raise AssertionError(f"{label}: {name} differs from eager ({int((diff > 0).sum())} of {w.numel()} "
                                 f"elements, largest {diff.max().item():.3g})")


@pytest.mark.parametrize("case", list(CASES))
def test_block_forward_backward_replays_bit_equal_to_eager(case, monkeypatch):
    size, waits, fp8 = CASES[case]
    if fp8 is not None and not INTERPRETED and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    from fusedpar.kernels.waits import wait_timeouts

    if size is not None:
        t = EmulatedTransport(size, rank=1, in_kernel_waits=waits)
        for name in ("all_gather_matmul", "matmul_reduce_scatter"):
            monkeypatch.setattr(nn_linear, name, _over(t, getattr(nn_linear, name)))
    block = _block(fp8)
    warm, *inputs = _inputs(1 + REPLAYS, seed=11)
    for _ in range(WARMUP):
        _eager(block, *warm)
    wanted = [_eager(block, x, gy) for x, gy in inputs]
    assert not torch.equal(wanted[0]["output"], wanted[1]["output"]), "inputs too alike to tell replays apart"
    wait_timeouts(DEVICE)  # (reported: the replays' count starts here)

    static_x = warm[0].clone().requires_grad_(True)
    static_gy = warm[1].clone()
    graph, static_y = _capture(block, static_x, static_gy)
    for i, (x, gy) in enumerate(inputs):
        with torch.no_grad():
            static_x.copy_(x)
            static_gy.copy_(gy)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_bits(f"{case} replay {i}", _results(block, static_y, static_x), wanted[i])
    assert wait_timeouts(DEVICE) == 0, f"{case}: an in-kernel wait gave up during a replay"
