"""``torch.compile(block, fullgraph=True)`` of whole transformer blocks, the torchtitan way, against
the same blocks run eagerly (output, every parameter gradient and the input gradient):

* one process: a dense block, a MoE block (the router losses attached to the backward), an MLA
  block (multi-head latent attention with YaRN), and a block under activation checkpointing
  (``torch.utils.checkpoint`` inside the compiled region);
* two gloo processes: tensor parallelism (tp2, sequence parallel; Gemma sandwich norms, OLMo 2 q/k norms over the
  tp-split projection), sequence parallelism with ring
  attention and the experts over the same ranks (sp2 . ep2), Ulysses (sp2), and FSDP2 over the two
  ranks with every block of a Transformer compiled (``block.compile(fullgraph=True)``).

The backend is ``aot_eager`` on CPU: Dynamo and AOTAutograd trace the block (a graph break fails
``fullgraph=True``), the kernels run under the Triton interpreter. On a GPU
(``FUSEDPAR_TEST_DEVICE=cuda``) the one-process cases run on the device with ``inductor``. fp32 throughout: compiled and
eager runs call the same kernels on the same inputs, so they agree to rounding (1e-6 of scale; the
graph may reorder the few plain torch ops between the kernels).
"""
from __future__ import annotations

import pytest
import torch

from _compose import batch, tiny_config
from _utils import BACKWARD_OPCHECK, DEVICE, INTERPRETED, assert_close
from fusedpar.nn import Transformer, TransformerBlock, TransformerConfig

RTOL = 1e-6
#: Inductor (GPU) generates its own kernels for the torch ops between fusedpar's: fp32 rounding of a
#: fused elementwise chain may differ by a few ulps per op, and TF32 is off in the tests
RTOL_INDUCTOR = 1e-5
B, S_LOCAL, H = 2, 6, 16  # 6 local tokens: zigzag needs the ring shard in 2 equal chunks


def _run(block, x, **kw):
    """Output, input gradient and parameter gradients of one forward / backward."""
    x = x.detach().clone().requires_grad_(True)
    y = block(x, **kw)
    g = torch.Generator().manual_seed(7)
    (y * torch.randn(y.shape, generator=g).to(y.device)).sum().backward()
    # a compiled module names its parameters "_orig_mod.<name>"
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def compare_compiled(make_block, x, label, backend="aot_eager", rtol=RTOL, **kw):
    """Build the block twice (same seed: same weights), run one eagerly and one compiled
    (``fullgraph=True``, aot_eager) on the same input and compare everything; returns the number
    of gradients compared."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    eager = make_block()
    torch.manual_seed(3)
    compiled = torch.compile(make_block(), backend=backend, fullgraph=True)
    y0, dx0, g0 = _run(eager, x, **kw)
    y1, dx1, g1 = _run(compiled, x, **kw)
    assert_close(y1, y0, torch.float32, rtol=rtol, msg=f"{label}: output")
    assert_close(dx1, dx0, torch.float32, rtol=rtol, msg=f"{label}: input gradient")
    assert g1.keys() == g0.keys() and g0, (label, sorted(g0), sorted(g1))
    for name in g0:
        assert_close(g1[name], g0[name], torch.float32, rtol=rtol, msg=f"{label}: grad of {name}")
    return len(g0) + 1


def _x(seed, shape=(B, S_LOCAL, H)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class Checkpointed(torch.nn.Module):
    """A block under non-reentrant activation checkpointing (what torchtitan applies before compile)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


MLA = dict(attention="mla", q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4})


def _block(*, aux_loss_scale=0.0, tp_group=None, sp_group=None, ep_group=None, **config):
    """A TransformerBlock of a one-layer model's config (hidden H, 4 heads, ffn 24, 2 kv heads but for MLA)."""
    config = TransformerConfig(**{"vocab_size": 32, "hidden_size": H, "num_layers": 1, "num_heads": 4,
                                  "ffn_hidden_size": 24, "num_kv_heads": None if "q_lora_rank" in config else 2,
                                  **config})
    return TransformerBlock(config.block_config(0), tp_group=tp_group, sp_group=sp_group, ep_group=ep_group,
                            aux_loss_scale=aux_loss_scale)


@pytest.mark.parametrize("kind", ["dense", "moe", "checkpointed", "mla"])
def test_block_compiles_fullgraph_world1(kind):
    moe = dict(num_experts=4, top_k=2, aux_loss_scale=0.5) if kind == "moe" else MLA if kind == "mla" else {}

    def make():
        block = _block(**moe).to(DEVICE)
        return Checkpointed(block) if kind == "checkpointed" else block

    backend, rtol = ("aot_eager", RTOL) if INTERPRETED else ("inductor", RTOL_INDUCTOR)
    assert compare_compiled(make, _x(1, (B, 7, H)).to(DEVICE), kind, backend=backend, rtol=rtol) > 5


def _parallel_blocks(rank, size):
    import torch.distributed as dist

    group = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(size)][rank]  # tp of one beside sp over both ranks
    x = _x(10 + rank)  # each rank's shard
    counts = {}
    cases = {
        # with the OLMo 2 / Gemma pieces: sandwich norms with (1 + w) scales, q / k norms over the
        # whole projection (statistics all-reduced over tp inside the graph), an attention scale
        "tp2 sandwich norms, q/k norm over the projection": dict(
            tp_group=group, sp_group=alone, norm_layout="sandwich", norm_offset=1.0, qk_norm=True,
            qk_norm_scope="projection", softmax_scale=0.3),
        "sp2 ring zigzag x ep2": dict(tp_group=alone, sp_group=group, ep_group=group, num_experts=4, top_k=2,
                                      aux_loss_scale=0.5),
        "sp2 ulysses": dict(tp_group=alone, sp_group=group, sp_mode="ulysses"),
    }
    for label, kw in cases.items():
        counts[label] = compare_compiled(lambda: _block(**kw), x, label)
    return counts


def _fsdp2_compiled_blocks(rank, size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = tiny_config(num_layers=2)
    ids, targets = batch(5, B, 6, config.vocab_size)  # the same batch on both ranks: the dp mean is the local grad
    alone = [dist.new_group([r]) for r in range(size)][rank]  # no tp / sp / ep: the two ranks are dp
    groups = dict(tp_group=alone, sp_group=alone, ep_group=alone)
    eager = Transformer(config, seed=1, **groups)
    loss0 = eager.loss(eager(ids), targets)
    loss0.backward()
    torch._dynamo.reset()
    model = Transformer(config, seed=1, **groups)
    mesh = init_device_mesh("cpu", (size,))
    for block in model.layers.values():  # the torchtitan recipe: compile each block, then shard it
        block.compile(backend="aot_eager", fullgraph=True)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss1 = model.loss(model(ids), targets)
    loss1.backward()
    assert_close(loss1.detach(), loss0.detach(), torch.float32, rtol=RTOL, msg="FSDP2 loss")
    ref = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad.full_tensor(), ref[name].grad, torch.float32, rtol=RTOL, msg=f"FSDP2 grad of {name}")
    dist.barrier()
    return len(ref)


def test_blocks_compile_fullgraph_tp2_sp2_ep2(world2_compile):
    out = world2_compile.run(_parallel_blocks)
    assert all(c == out[0] and min(c.values()) > 5 for c in out), out


def test_fsdp2_over_compiled_blocks(world2_compile):
    out = world2_compile.run(_fsdp2_compiled_blocks)
    assert out[0] == out[1] > 10, out


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors under the interpreter")
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_ops_pass_opcheck(residual):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 5, 37, generator=g, requires_grad=True)
    w = torch.randn(37, generator=g, requires_grad=True)
    r = torch.randn(3, 5, 37, generator=g, requires_grad=True) if residual else None
    torch.library.opcheck(torch.ops.fusedpar.rms_norm.default, (x, w, r, 1e-5))
    torch.library.opcheck(torch.ops.fusedpar.rms_norm.default, (x, None, r, 1e-5))
    rstd = torch.rand(15, generator=g) + 0.5
    h = x.detach() + (r.detach() if residual else 0)
    gh = torch.randn(3, 5, 37, generator=g) if residual else None
    torch.library.opcheck(torch.ops.fusedpar.rms_norm_backward.default,
                          (torch.randn(3, 5, 37, generator=g), gh, h, w.detach(), rstd, True),
                          test_utils=BACKWARD_OPCHECK)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors under the interpreter")
def test_sharded_rms_norm_ops_pass_opcheck():
    """One process: the group of the transport id ``"@"`` has one rank (the all-reduces are skipped);
    the reduction over ranks is checked against fp64 in test_nn_tensor_parallel.py."""
    g = torch.Generator().manual_seed(22)
    x = torch.randn(3, 5, 12, generator=g, requires_grad=True)
    w = torch.randn(12, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.fusedpar.sharded_rms_norm.default, (x, w, 1e-5, "@"))
    torch.library.opcheck(torch.ops.fusedpar.sharded_rms_norm.default, (x, None, 1e-5, "@"))
    torch.library.opcheck(torch.ops.fusedpar.sharded_rms_norm_backward.default,
                          (torch.randn(3, 5, 12, generator=g), x.detach(), w.detach(),
                           torch.rand(3, 5, generator=g) + 0.5, "@", True), test_utils=BACKWARD_OPCHECK)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors under the interpreter")
def test_replicated_rows_ops_pass_opcheck():
    from fusedpar.ops import replicated_rows

    g = torch.Generator().manual_seed(23)
    w = torch.randn(6, 5, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.fusedpar.replicated_rows.default, (w, "@", 2, 1, 2))
    torch.library.opcheck(torch.ops.fusedpar.replicated_rows_backward.default,
                          (torch.randn(6, 5, generator=g), "@", 2, 1, 2), test_utils=BACKWARD_OPCHECK)
    with pytest.raises(ValueError, match="block must be <= 1, got 2"):
        replicated_rows(w, 2, 2, 2)


def test_every_registered_op_is_opchecked():
    """Each ``torch.ops.fusedpar`` op is named in an opcheck of these compile test modules."""
    import glob
    import os
    import re

    import fusedpar.nn  # noqa: F401 - registers every op

    here = os.path.dirname(__file__)
    source = "".join(open(f).read() for f in glob.glob(os.path.join(here, "test_torch_compile_*.py")))
    missing = [op for op in torch.ops.fusedpar if not re.search(rf"\b{op}\b", source)]
    assert not missing, f"ops without an opcheck: {missing}"
