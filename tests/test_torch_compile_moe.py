"""torch.compile of the MoE layer and the losses (issue #16): ``torch.library.opcheck`` on every
MoE / loss op (small odd shapes; the expert-parallel schedule on an ``EmulatedTransport``), and ``torch.compile(..., backend="aot_eager", fullgraph=True)`` of
:class:`fusedpar.nn.MoE` (world 1, emulated ep2, ep2) and of ``vocab_parallel_cross_entropy``
(world 1, tp2): output, aux loss and every gradient equal to eager.

Tolerances: eager and compiled run the same kernels in the same order (aot_eager keeps every
fusedpar op opaque), so fp32 results agree to rounding of the few torch ops AOT may reorder
(``1e-5``)."""

import pytest
import torch
import torch.distributed as dist
from _utils import BACKWARD_OPCHECK, INTERPRETED
from _world import rank_rng

from fusedpar.nn import MoE
from fusedpar.ops import attach_aux_loss, vocab_parallel_cross_entropy
from fusedpar.ops.comm.keys import transport_id_of
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.nn import MoEConfig

# CPU tensors under the interpreter (opcheck, aot_eager); on a GPU the compiled check is the block test
# (tests/test_torch_compile_block.py runs its one-process cases there with inductor)
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="CPU-interpreter test; on a GPU: test_torch_compile_block")

TOL = dict(rtol=1e-5, atol=1e-5)
#: no test_aot_dispatch_static: the dynamic variant traces the same graph with symbolic sizes
OPCHECK_TESTS = BACKWARD_OPCHECK + ("test_aot_dispatch_dynamic",)


def _opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_TESTS)


def _opcheck_backward(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs, test_utils=BACKWARD_OPCHECK)


def _routing(g, T, k, E):
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).requires_grad_()
    return ids, weights


def _experts(g, E, H, F, glu=True):
    w1 = (torch.randn(E, 2 * F if glu else F, H, generator=g) * 0.3).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) * 0.3).requires_grad_()
    return w1, w2


def _moe_op_args(g, transport_id, ep, T=7, H=6, F=5, E=4, k=2, capacity=None, chunks=2, biases=False):
    """``fusedpar::moe_mlp``'s arguments; ``biases``: expert biases and gpt-oss's swiglu_oai."""
    x = torch.randn(T, H, generator=g).requires_grad_()
    ids, weights = _routing(g, T, k, E)
    w1, w2 = _experts(g, E // ep, H, F)
    b1 = b2 = None
    if biases:
        b1, b2 = (torch.randn(E // ep, n, generator=g).requires_grad_() for n in (2 * F, H))
    return (x, ids, weights, w1, w2, b1, b2, E, transport_id, ep, capacity, "swiglu_oai" if biases else "swiglu", chunks)


def _moe_backward_args(fwd_args):
    """Inputs of fusedpar::moe_mlp_backward from one eager forward (grads requested for all)."""
    with torch.no_grad():
        out, *res = torch.ops.fusedpar.moe_mlp(*fwd_args)
    x, _, weights, w1, w2, b1, _, E, transport_id, _, _, act, _ = fwd_args
    return (torch.randn_like(out), weights.detach(), w1.detach(), w2.detach(), *res, E, transport_id, act, True, True,
            b1 is not None)


def _check_loss_ops(g, group, V=5, T=7):
    transport_id = transport_id_of(None, group)
    logits = torch.randn(T, V, generator=g).requires_grad_()
    vocab = V * (dist.get_world_size(group) if group is not None else 1)
    target = torch.randint(0, vocab, (T,), generator=rank_rng(6))  # the same on every rank of the group
    target[2] = -100
    _opcheck(torch.ops.fusedpar.vocab_parallel_cross_entropy.default, (logits, target, transport_id, -100, True))
    _, lse, idx, inside = torch.ops.fusedpar.vocab_parallel_cross_entropy(logits.detach(), target, transport_id, -100, False)
    _opcheck_backward(torch.ops.fusedpar.vocab_parallel_cross_entropy_backward.default,
             (torch.randn(T, generator=g), logits.detach(), lse, idx, inside))


def _compiled_matches_eager(fn, inputs, params=()):
    """``fn(*inputs)`` -> (out, extra loss or None); eager vs aot_eager fullgraph: outputs and grads."""
    torch._dynamo.reset()
    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        for p in params:
            p.grad = None
        out, extra = f(*xs)
        gen = torch.Generator().manual_seed(5)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum() + (0 if extra is None else extra)
        loss.backward()
        grads = [t.grad for t in xs if t.requires_grad] + [p.grad.clone() for p in params]
        results.append((out.detach(), None if extra is None else extra.detach(), grads))
    (o1, e1, g1), (o2, e2, g2) = results
    torch.testing.assert_close(o2, o1, **TOL)
    if e1 is not None:
        torch.testing.assert_close(e2, e1, **TOL)
    assert len(g1) == len(g2) and all(a is not None for a in g1 + g2)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, **TOL)


def _check_moe_compiles(g, seed, **moe_kwargs):
    torch.manual_seed(seed)  # the expert weights' base seed: the same on every rank
    layout = {k: moe_kwargs.pop(k) for k in ("transport", "ep_group") if k in moe_kwargs}
    moe = MoE(MoEConfig(10, 6, 4, 2, num_chunks=2, **moe_kwargs), **layout)

    def fn(x):
        return moe(x), moe.aux_loss

    x = torch.randn(3, 5, 10, generator=g).requires_grad_()
    _compiled_matches_eager(fn, [x], params=list(moe.parameters()))


def _check_cross_entropy_compiles(g, group, V=5):
    vocab = V * (dist.get_world_size(group) if group is not None else 1)
    target = torch.randint(0, vocab, (2, 7), generator=rank_rng(3))  # the same on every rank of the group
    target[0, 3] = -100

    def fn(logits):
        return vocab_parallel_cross_entropy(logits, target, group), None

    _compiled_matches_eager(fn, [torch.randn(2, 7, V, generator=g).requires_grad_()])


# ----------------------------------------------------------------------------------------------
# single process
# ----------------------------------------------------------------------------------------------
def test_opcheck_moe_and_loss_ops_single_process():
    g = torch.Generator().manual_seed(0)
    x, ids, weights, w1, w2 = _moe_op_args(g, "@", 1)[:5]
    M = x.shape[0]
    offsets = torch.tensor([0, 2, 2, 5, M - 1], dtype=torch.int32)  # an empty group, a zero tail row
    _opcheck(torch.ops.fusedpar.grouped_mlp.default, (x, w1, w2, None, None, offsets, "swiglu", True))
    b1, b2 = torch.randn(w1.shape[:2], generator=g).requires_grad_(), torch.randn(w2.shape[:2], generator=g)
    _opcheck(torch.ops.fusedpar.grouped_mlp.default, (x, w1, w2, b1, b2, offsets, "swiglu_oai", True))
    y, h, pre = torch.ops.fusedpar.grouped_mlp(x.detach(), w1.detach(), w2.detach(), None, None, offsets, "swiglu",
                                               False)
    for biases in (False, True):
        _opcheck_backward(torch.ops.fusedpar.grouped_mlp_backward.default,
                          (torch.randn_like(y), x.detach(), h, pre, w1.detach(), w2.detach(), offsets, "swiglu", True,
                           True, biases))
    emulated = EmulatedTransport(2, 1)  # held: a transport id names its transport weakly
    for ep, transport_id, capacity, biases in ((1, "@", 2, False), (2, emulated.transport_id, None, False), (1, "@", 2, True),
                                        (2, emulated.transport_id, None, True)):
        args = _moe_op_args(g, transport_id, ep, capacity=capacity, biases=biases)
        _opcheck(torch.ops.fusedpar.moe_mlp.default, args)
        _opcheck_backward(torch.ops.fusedpar.moe_mlp_backward.default, _moe_backward_args(args))
    # the stage API's pieces
    slot_pos = torch.randperm(M * 2, generator=g).to(torch.int32)
    sorted_slot = torch.argsort(slot_pos).to(torch.int32)
    _opcheck(torch.ops.fusedpar.moe_permute.default, (x, sorted_slot, slot_pos, 2))
    _opcheck_backward(torch.ops.fusedpar.moe_permute_backward.default, (torch.randn(2 * M, 6, generator=g), slot_pos, 2))
    y = torch.randn(2 * M, 6, generator=g).requires_grad_()
    _opcheck(torch.ops.fusedpar.moe_unpermute.default, (y, weights, slot_pos, sorted_slot, 2))
    _opcheck_backward(torch.ops.fusedpar.moe_unpermute_backward.default,
             (torch.randn(M, 6, generator=g), y.detach(), weights.detach(), sorted_slot, 2))
    emulated = EmulatedTransport(3, 2)
    _opcheck(torch.ops.fusedpar.all_to_all_v.default, (x, 7, [2, 3, 2], [2, 3, 2], emulated.transport_id))
    _check_loss_ops(g, None)
    aux = torch.rand((), generator=g).requires_grad_()
    _opcheck(torch.ops.fusedpar.attach_aux_loss.default, (x, aux, 0.25, None))
    res = torch.randn(x.shape, generator=g, dtype=torch.float64).requires_grad_()  # an fp64 residual stream
    _opcheck(torch.ops.fusedpar.attach_aux_loss.default, (x.t(), aux, 0.25, res.t()))


def test_opcheck_moe_mlp_fp8():
    """``fusedpar::moe_mlp`` with ``fp8``: its fake gives the routed rows as e4m3 + scale bytes
    (``uint8 [R, row_bytes]``; at ep > 1 R is the same unbacked size as without fp8), and the
    backward op takes the recipe. One case at ep1, the fakes only: the schema and the autograd
    code are the 16-bit cases' (CI time: each fp8 call is some twenty interpreted launches; the
    AOT-traced forward and backward, test_aot_dispatch_dynamic, would add 2 s)."""
    g = torch.Generator().manual_seed(1)
    args = _moe_op_args(g, "@", 1, capacity=5) + ("blockwise", True)
    torch.library.opcheck(torch.ops.fusedpar.moe_mlp.default, args,
                          test_utils=("test_faketensor",))
    with torch.no_grad():
        out, *res = torch.ops.fusedpar.moe_mlp(*args)
    assert res[0].dtype == torch.uint8 and res[0].shape == (14, 16 + 16)  # H = 6: 16 bytes of e4m3, a 16-byte scale
    x, _, weights, w1, w2, _, _, E, transport_id, _, _, act, _, recipe, hp = args
    torch.library.opcheck(torch.ops.fusedpar.moe_mlp_backward.default,
                          (torch.randn_like(out), weights.detach(), w1.detach(), w2.detach(), *res, E, transport_id, act,
                           True, True, False, recipe, hp), test_utils=("test_faketensor",))


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_layer_compiles_fullgraph_single_process(ep):
    """World 1, and ep2 emulated in this process (every peer mirrors this rank)."""
    transport = EmulatedTransport(2, 1) if ep == 2 else None
    _check_moe_compiles(torch.Generator().manual_seed(ep), 7, transport=transport, capacity_factor=1.5)


def test_gpt_oss_moe_layer_compiles_fullgraph_single_process():
    """Expert biases and swiglu_oai (gpt-oss) through the compiled layer: every parameter's gradient."""
    _check_moe_compiles(torch.Generator().manual_seed(3), 8, activation="swiglu_oai", score="softmax_topk",
                        router_bias=True, expert_bias=True)


def test_losses_compile_fullgraph_single_process():
    _check_cross_entropy_compiles(torch.Generator().manual_seed(1), None)
    aux = torch.rand((), generator=torch.Generator().manual_seed(2)).requires_grad_()

    def fn(x, aux):
        return attach_aux_loss(x * 2, aux * 3, 0.5), None

    _compiled_matches_eager(fn, [torch.randn(4, 3), aux])


def test_stage_api_is_eager_only_under_compile():
    from fusedpar.ops import moe_dispatch

    def fn(x, ids):
        return moe_dispatch(x, ids, 4)[0]

    x, ids = torch.randn(5, 6), torch.randint(0, 4, (5, 2))
    with pytest.raises(Exception, match="cannot be traced by torch.compile"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(x, ids)


# ----------------------------------------------------------------------------------------------
# 2-rank gloo world: ep2 and tp2
# ----------------------------------------------------------------------------------------------
def _world_case(rank, size):
    g = rank_rng(17, rank)  # each rank its own tokens
    # the ops are opchecked in one process (at ep2 on an EmulatedTransport: the same schema, fakes
    # and schedule); here they run on the real all-to-all inside the compiled ep2 layer
    _check_moe_compiles(g, 9, ep_group=dist.group.WORLD)
    _check_cross_entropy_compiles(g, dist.group.WORLD)
    return rank


def test_ep2_and_tp2_compile_in_a_world(world2_compile):
    assert world2_compile.run(_world_case) == [0, 1]


@pytest.mark.parametrize("score,n_group,topk_group", [("softmax", 1, 1), ("sigmoid", 2, 1), ("softmax_topk", 1, 1)])
def test_opcheck_moe_route(score, n_group, topk_group):
    """The routing op (softmax / DeepSeek-V3 sigmoid with a correction bias and group-limited
    selection / gpt-oss) and its backward: schema, fake, autograd registration."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 8, generator=g).requires_grad_()
    bias = torch.randn(8, generator=g) * 0.1 if score == "sigmoid" else None
    args = (logits, bias, 2, score, n_group, topk_group, score != "softmax", 1.5)
    _opcheck(torch.ops.fusedpar.moe_route.default, args)
    weights, ids = torch.ops.fusedpar.moe_route(logits.detach(), *args[1:])
    _opcheck_backward(torch.ops.fusedpar.moe_route_backward.default,
                      (torch.randn_like(weights), logits.detach(), weights, ids, score, n_group, score != "softmax", 1.5))
