"""Expert parallelism on gloo (2 and 4 ranks): the EP layer equals the single-process layer on each
rank's tokens (outputs, input / router gradients; expert gradients summed over the ranks' tokens),
with uneven token counts, a rank without tokens, capacity drops, several chunk counts, stragglers."""
import pytest
import torch
import torch.distributed as dist

from _utils import assert_close
from _world import rank_rng, straggle, world_fixture
from fusedpar.ops import comm
from fusedpar.kernels import moe_mlp_reference
from fusedpar.nn import MoE
from fusedpar.ops import moe_combine, moe_dispatch, moe_expert_compute, moe_mlp
from test_moe_layer import reference_moe

world2 = world_fixture(2)
world4 = world_fixture(4)

H, FFN, E, K = 16, 24, 4, 2


def _inputs(seed, r, T):
    g = rank_rng(seed, r)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def _f64(t):
    return t.detach().double().requires_grad_()


def _layer_vs_single(rank, size, seed, self_group, *, tokens, capacity_factor, num_chunks, score, activation,
                     single_layer):
    """EP layer on this rank's tokens vs the single-process layer (``single_layer``) and vs the
    fp64 loop; expert gradients vs the fp64 loop summed over every rank's tokens."""
    tag = f"rank {rank}/{size} tokens={tokens} cf={capacity_factor} chunks={num_chunks} {score}/{activation}"
    kw = dict(capacity_factor=capacity_factor, activation=activation, score=score, num_chunks=num_chunks)
    torch.manual_seed(seed)
    ep = MoE(H, FFN, E, K, **kw)
    torch.manual_seed(seed)
    full = MoE(H, FFN, E, K, ep_group=self_group, **kw)  # all experts on this rank
    lo, n = ep.first_expert, ep.experts_per_rank
    assert n == E // size and lo == rank * n
    # the full expert weights do not depend on the EP degree
    assert torch.equal(ep.w1.detach(), full.w1.detach()[lo:lo + n]), tag
    assert torch.equal(ep.w2.detach(), full.w2.detach()[lo:lo + n]), tag
    assert torch.equal(ep.router.weight.detach(), full.router.weight.detach()), tag

    x, go = _inputs(seed, rank, tokens[rank])
    x.requires_grad_()
    y = ep(x)
    ((y * go).sum() + ep.aux_loss).backward()

    if single_layer:  # the single-process layer on this rank's tokens
        xs = x.detach().clone().requires_grad_()
        ys = full(xs)
        ((ys * go).sum() + full.aux_loss).backward()
        assert torch.equal(ep.router_output.expert_ids, full.router_output.expert_ids), tag
        assert_close(y, ys, torch.float32, msg=f"output vs single-process layer {tag}")
        assert_close(ep.aux_loss, full.aux_loss, torch.float32, msg=f"losses vs single-process layer {tag}")
        assert_close(x.grad, xs.grad, torch.float32, msg=f"input grad vs single-process layer {tag}")
        assert_close(ep.router.weight.grad, full.router.weight.grad, torch.float32,
                     msg=f"router grad vs single-process layer {tag}")

    # fp64 loop over every rank's tokens: this rank's output / input / router gradients, and the
    # expert gradients summed over all ranks (what the EP backward accumulates per expert)
    w1, w2 = _f64(full.w1), _f64(full.w2)
    for r in range(size):
        xr, gor = _inputs(seed, r, tokens[r])
        if not tokens[r]:
            continue
        with torch.no_grad():
            ids = full.router(xr).expert_ids
        xd, rw = _f64(xr), _f64(full.router.weight)
        yr, aux, z, _ = reference_moe(xd, rw, w1, w2, top_k=K, score=score, normalize=full.router.normalize,
                                      activation=activation, capacity_factor=capacity_factor, ids=ids)
        ((yr * gor.double()).sum() + aux + z).backward()
        if r == rank:
            assert torch.equal(ep.router_output.expert_ids, ids), tag
            assert_close(y, yr, torch.float32, msg=f"output {tag}")
            assert_close(ep.aux_loss, aux + z, torch.float32, msg=f"losses {tag}")
            assert_close(x.grad, xd.grad, torch.float32, msg=f"input grad {tag}")
            assert_close(ep.router.weight.grad, rw.grad, torch.float32, msg=f"router grad {tag}")
    assert_close(ep.w1.grad, w1.grad[lo:lo + n], torch.float32, msg=f"w1 grad {tag}")
    assert_close(ep.w2.grad, w2.grad[lo:lo + n], torch.float32, msg=f"w2 grad {tag}")


def _skew_and_stages(rank, size, seed):
    """Every token of every rank to experts E-1 and 0 (two ranks receive everything, the others
    nothing), and the three stages composed by hand equal the pipelined moe_mlp."""
    g = rank_rng(seed + 1)
    w1f = torch.randn(E, 2 * FFN, H, generator=g) * 0.3
    w2f = torch.randn(E, H, FFN, generator=g) * 0.3
    n = E // size
    w1, w2 = w1f[rank * n:(rank + 1) * n], w2f[rank * n:(rank + 1) * n]
    T = 3 + 2 * rank
    x = torch.randn(T, H, generator=rank_rng(seed, rank))
    wts = torch.rand(T, 2, generator=rank_rng(seed + 2, rank))
    ids = torch.tensor([[E - 1, 0]] * T)
    leaves = [t.clone().requires_grad_() for t in (x, wts)]
    y = moe_mlp(leaves[0], ids, leaves[1], w1, w2, num_experts=E, num_chunks=2)
    go = torch.randn(T, H, generator=rank_rng(seed + 3, rank))
    (y * go).sum().backward()
    ref = [_f64(t) for t in (x, wts)]
    yr = moe_mlp_reference(ref[0], ids, ref[1], w1f.double(), w2f.double())
    (yr * go.double()).sum().backward()
    assert_close(y, yr, torch.float32, msg=f"skewed output rank {rank}")
    for name, a, b in zip(("x", "weights"), leaves, ref):
        assert_close(a.grad, b.grad, torch.float32, msg=f"skewed grad {name} rank {rank}")

    if size > 2:  # the staged composition runs once, at 2 ranks (keeps the 4-rank world short)
        return
    ids = torch.stack([torch.randperm(E, generator=rank_rng(seed + 4 + t, rank))[:2] for t in range(T)])
    outs = []
    for staged in (False, True):
        lv = [t.clone().requires_grad_() for t in (x, wts, w1, w2)]
        if staged:
            tokens, plan = moe_dispatch(lv[0], ids, E, capacity=2)
            yy = moe_combine(moe_expert_compute(tokens, lv[2], lv[3], plan), plan, lv[1])
        else:
            yy = moe_mlp(lv[0], ids, lv[1], lv[2], lv[3], num_experts=E, capacity=2, num_chunks=3)
        (yy * go).sum().backward()
        outs.append([yy.detach()] + [t.grad for t in lv])
    for name, a, b in zip(("y", "x", "weights", "w1", "w2"), *outs):
        assert_close(a, b, torch.float32, msg=f"stages vs moe_mlp: {name} rank {rank}")


def _pipeline_order(rank, size, seed):
    """The dispatch is pipelined: every chunk's all-to-all starts before the first is waited on,
    and chunk 0's results are sent back before chunk 1 is waited on (so chunk 1 travels while
    chunk 0 computes); the backward mirrors it."""
    log = []
    real = comm.all_to_all

    class _Spy:
        def __init__(self, i, handle):
            self.i, self.handle = i, handle

        def wait(self):
            log.append(("wait", self.i))
            self.handle.wait()

    def spy(out, inp, out_splits=None, in_splits=None, group=None):
        i = sum(1 for e in log if e[0] == "start")
        log.append(("start", i))
        return _Spy(i, real(out, inp, out_splits, in_splits, group))

    x = torch.randn(7, H, generator=rank_rng(seed, rank)).requires_grad_()
    ids = torch.tensor([[0, E - 1]] * 7)
    w1 = torch.randn(E // size, 2 * FFN, H, generator=rank_rng(seed + 1, rank)).requires_grad_()
    w2 = torch.randn(E // size, H, FFN, generator=rank_rng(seed + 2, rank)).requires_grad_()
    comm.all_to_all = spy
    try:
        y = moe_mlp(x, ids, torch.ones(7, 2), w1, w2, num_experts=E, num_chunks=2)
        y.sum().backward()
    finally:
        comm.all_to_all = real
    s, w = (lambda i: ("start", i)), (lambda i: ("wait", i))
    expected = [s(0), w(0),  # counts
                s(1), s(2), w(1), s(3), w(2), s(4), w(3), w(4),  # dispatch 0, 1; return 0, 1
                s(5), s(6), w(5), s(7), w(6), s(8), w(7), w(8)]  # backward: grads out, grads in
    assert log == expected, f"rank {rank}: transfer order {log}"


def _errors(rank, size):
    bad_e = 2 * size + 1
    msg = f"num_experts={bad_e} must be divisible by the expert-parallel group size \\({size}\\)"
    with pytest.raises(ValueError, match=msg):
        MoE(H, FFN, bad_e, K)
    x = torch.randn(4, H)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    w1 = torch.randn(E // size, 2 * FFN, H)
    w2 = torch.randn(E // size, H, FFN)
    with pytest.raises(ValueError, match=f"num_experts={bad_e} must be divisible"):
        moe_mlp(x, ids, torch.ones(4, 2), w1, w2, num_experts=bad_e)
    with pytest.raises(ValueError, match=f"w1 must hold the {E // size} experts of this rank, got {E}"):
        moe_mlp(x, ids, torch.ones(4, 2), torch.randn(E, 2 * FFN, H), torch.randn(E, H, FFN), num_experts=E)
    with pytest.raises(ValueError, match="expert_ids must lie in"):
        moe_mlp(x, ids - 1, torch.ones(4, 2), w1, w2, num_experts=E)
    # the world still works after every rank rejected its input (nothing was half-sent)
    t = torch.ones(1)
    comm.all_reduce(t).wait()
    assert t.item() == size


def _run_all(rank, size, seed):
    self_groups = [dist.new_group([r]) for r in range(size)]  # collective: every rank creates every group
    straggle(0.01, seed)
    try:
        tokens = [5, 13, 1, 9][:size] if size == 4 else [6, 11]
        _layer_vs_single(rank, size, seed, self_groups[rank], tokens=tokens, capacity_factor=None, num_chunks=2,
                         score="softmax", activation="swiglu", single_layer=True)
        zero = [0, 7, 3, 10][:size] if size == 4 else [0, 9]  # a rank without tokens, capacity drops
        _layer_vs_single(rank, size, seed + 1, self_groups[rank], tokens=zero, capacity_factor=0.5, num_chunks=3,
                         score="sigmoid", activation="gelu", single_layer=False)
        _skew_and_stages(rank, size, seed)
        if size == 2:
            _pipeline_order(rank, size, seed)
    finally:
        comm.set_straggler(0)
    _errors(rank, size)
    return rank


def test_ep_world2(world2):
    assert world2.run(_run_all, seed=11) == [0, 1]


def test_ep_world4(world4):
    assert world4.run(_run_all, seed=23) == [0, 1, 2, 3]
