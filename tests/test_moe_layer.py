"""MoE layer on one process: TopKRouter, MoE and the functional stages against a plain fp64
per-expert loop (outputs, input / router / expert-weight gradients, aux and z losses)."""
import math

import pytest
import torch

from _utils import DEVICE, assert_close, randn
from fusedpar.kernels.moe_routing import moe_mlp_reference
from fusedpar.kernels.runtime import activation_reference
from fusedpar.nn import MoE, TopKRouter
from fusedpar.ops import grouped_mlp, moe_combine, moe_dispatch, moe_expert_compute, moe_mlp, moe_plan
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.nn import MoEConfig


def reference_moe(x, router_w, w1, w2, *, top_k, score="softmax", normalize=False, activation="swiglu",
                  capacity_factor=None, aux_coef=1e-2, z_coef=1e-3, ids=None):
    """Router + per-expert loop in the dtype of the inputs (fp64 in the tests). ``ids``: the
    discrete routing decision to use (the layer's); the continuous parts are recomputed here."""
    T, E = x.shape[0], router_w.shape[0]
    logits = x @ router_w.t()
    if score == "softmax":
        probs = scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    ref_ids = torch.sort(scores.detach(), dim=-1, descending=True, stable=True)[1][:, :top_k]
    ids = ref_ids if ids is None else ids
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    cap = None if capacity_factor is None else math.ceil(capacity_factor * T * top_k / E)
    y = moe_mlp_reference(x, ids, weights, w1, w2, activation=activation, capacity=cap, compute_dtype=x.dtype)
    f = torch.bincount(ids.reshape(-1), minlength=E).to(x.dtype) / (T * top_k)
    aux = aux_coef * E * (f * probs.mean(0)).sum()
    z = z_coef * torch.logsumexp(logits, -1).pow(2).mean()
    return y, aux, z, ref_ids


def _f64(t):
    return t.detach().cpu().double().requires_grad_()


def _layer_case(m, x, g, *, score, normalize, capacity_factor, activation):
    """Forward + backward of the layer and of the fp64 reference; compare everything."""
    x = x.detach().requires_grad_()
    y = m(x)
    go = randn(*y.shape, generator=g)
    ((y * go).sum() + m.aux_loss).backward()
    H = x.shape[-1]
    xd, rw, w1, w2 = _f64(x.reshape(-1, H)), _f64(m.router.weight), _f64(m.w1), _f64(m.w2)
    ids = m.router_output.expert_ids.cpu()
    yr, aux, z, ref_ids = reference_moe(xd, rw, w1, w2, top_k=m.top_k, score=score, normalize=normalize,
                                        activation=activation, capacity_factor=capacity_factor, ids=ids)
    assert torch.equal(ids, ref_ids), "routing decision differs from the fp64 stable top-k"
    ((yr * go.reshape(-1, H).double().cpu()).sum() + aux + z).backward()
    tag = f"{score}/{activation}/cf={capacity_factor}"
    # fp32 kernels with fp32 accumulation over tens of terms: the fp32 tolerances of _utils
    assert_close(y.reshape(-1, H), yr, torch.float32, msg=f"output {tag}")
    assert_close(m.router_output.aux_loss, aux, torch.float32, msg=f"aux loss {tag}")
    assert_close(m.router_output.z_loss, z, torch.float32, msg=f"z loss {tag}")
    assert_close(x.grad.reshape(-1, H), xd.grad, torch.float32, msg=f"input grad {tag}")
    assert_close(m.router.weight.grad, rw.grad, torch.float32, msg=f"router grad {tag}")
    assert_close(m.w1.grad, w1.grad, torch.float32, msg=f"w1 grad {tag}")
    assert_close(m.w2.grad, w2.grad, torch.float32, msg=f"w2 grad {tag}")


LAYER_CASES = {
    "softmax-swiglu": dict(score="softmax", normalize=False, capacity_factor=None, activation="swiglu"),
    "sigmoid-gelu": dict(score="sigmoid", normalize=True, capacity_factor=None, activation="gelu"),
    "softmax-swiglu-cf0.75": dict(score="softmax", normalize=True, capacity_factor=0.75, activation="swiglu"),  # drops
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_moe_layer_matches_reference(case):
    c = LAYER_CASES[case]
    i = list(LAYER_CASES).index(case)
    g = torch.Generator().manual_seed(i)
    torch.manual_seed(10 + i)
    m = MoE(MoEConfig(20, 24, 6, 2, capacity_factor=c["capacity_factor"], activation=c["activation"], score=c["score"], normalize=c["normalize"]), device=DEVICE)
    x = randn(3, 7, 20, generator=g)
    _layer_case(m, x, g, **c)
    if c["capacity_factor"] is not None:
        cap = m.router_output.capacity
        counts = torch.bincount(m.router_output.expert_ids.reshape(-1), minlength=6)
        assert cap == math.ceil(0.75 * 21 * 2 / 6) and (counts > cap).any(), f"the case must drop slots ({case})"


def _functional_case(T, k, E, ids, g, *, capacity=None, H=16, Fd=24, activation="swiglu"):
    x = randn(T, H, generator=g).requires_grad_()
    w = torch.rand(T, k, generator=g).to(DEVICE).requires_grad_()
    n1 = 2 * Fd if activation == "swiglu" else Fd
    w1 = randn(E, n1, H, generator=g, scale=H ** -0.5).requires_grad_()
    w2 = randn(E, H, Fd, generator=g, scale=Fd ** -0.5).requires_grad_()
    y = moe_mlp(x, ids.to(DEVICE), w, w1, w2, num_experts=E, capacity=capacity, activation=activation)
    go = randn(T, H, generator=g)
    (y * go).sum().backward()
    ref_in = [_f64(t) for t in (x, w, w1, w2)]
    yr = moe_mlp_reference(ref_in[0], ids, ref_in[1], ref_in[2], ref_in[3], activation=activation, capacity=capacity)
    yr = yr + 0.0 * sum(t.sum() for t in ref_in)  # every input in the graph (all-dropped case: zero grads)
    (yr * go.double().cpu()).sum().backward()
    tag = f"T={T} k={k} E={E} capacity={capacity}"
    assert_close(y, yr, torch.float32, msg=f"output {tag}")
    for name, ours, ref in zip(("x", "weights", "w1", "w2"), (x, w, w1, w2), ref_in):
        assert_close(ours.grad, ref.grad, torch.float32, msg=f"grad {name} {tag}")


def _perms(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


EDGE_CASES = {  # name -> (T, k, E, expert ids factory, options)
    # every token to expert 0 (top-1), and every token to experts (3, 0) (top-2)
    "all-to-expert-0": (13, 1, 4, lambda: torch.zeros(13, 1, dtype=torch.int64), {}),
    "all-to-experts-3-0": (13, 2, 4, lambda: torch.tensor([[3, 0]] * 13), {}),
    "single-token": (1, 2, 5, lambda: torch.tensor([[4, 1]]), {}),
    # top_k == num_experts: every expert sees every token
    "top_k-equals-experts": (7, 4, 4, lambda: _perms(7, 4, 4, 1), {}),
    # experts that receive nothing (only 1 and 5 of 8 are used)
    "idle-experts-relu": (11, 1, 8, lambda: torch.tensor([[1], [5]] * 5 + [[1]]), dict(activation="relu")),
    # capacity dropping: 3 slots per expert kept, the earliest tokens; later ones contribute zero
    "capacity-3": (10, 2, 3, lambda: _perms(10, 3, 2, 2), dict(capacity=3)),
    "capacity-0": (6, 2, 3, lambda: _perms(10, 3, 2, 2)[:6], dict(capacity=0)),  # all dropped: zero grads
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases(case):
    T, k, E, make_ids, kw = EDGE_CASES[case]
    _functional_case(T, k, E, make_ids(), torch.Generator().manual_seed(list(EDGE_CASES).index(case)), **kw)


def test_router_ties_and_losses():
    g = torch.Generator().manual_seed(2)
    r = TopKRouter(12, 6, 2, device=DEVICE)
    # small integers times powers of two: every logit is exact whatever the GEMM's summation
    # order, so equal weight rows give bit-identical scores (a real tie)
    x = torch.randint(-3, 4, (9, 12), generator=g).float().to(DEVICE)
    row = (torch.randint(-3, 4, (1, 12), generator=g).float() * 0.25).to(DEVICE)
    with torch.no_grad():
        r.weight.copy_(row.expand(6, 12))  # all experts score the same
    out = r(x)
    assert out.expert_ids.tolist() == [[0, 1]] * 9, "ties must go to the lowest expert ids"
    with torch.no_grad():
        r.weight.zero_()
        r.weight[[2, 4]] = row.abs() + 0.25  # experts 2 and 4 tie at the top
    out = r(x.abs() + 1)
    assert out.expert_ids.tolist() == [[2, 4]] * 9
    for score in ("softmax", "sigmoid"):  # ties among the top-k and at the k-th place
        r3 = TopKRouter(12, 5, 3, score=score, device=DEVICE)
        with torch.no_grad():
            r3.weight.copy_(torch.stack([row[0] * c for c in (0.5, 1.0, 0.5, 1.0, 0.5)]))
        out = r3(x.abs() * torch.sign(row) + 1)
        assert out.expert_ids.tolist() == [[1, 3, 0]] * 9, score
    # uniform routing gives a balance loss of 1 (f and P both uniform), z-loss = log(E)^2
    with torch.no_grad():
        r.weight.zero_()
    r2 = TopKRouter(12, 6, 6, aux_loss_coef=1.0, z_loss_coef=1.0, device=DEVICE)
    with torch.no_grad():
        r2.weight.zero_()
    out = r2(x)
    assert abs(out.aux_loss.item() - 1.0) < 1e-6 and abs(out.z_loss.item() - math.log(6) ** 2) < 1e-5
    assert r2.aux_loss is out.aux_loss and r2.z_loss is out.z_loss
    # capacity: ceil(factor * T * k / E)
    assert TopKRouter(12, 6, 2, capacity_factor=1.25).capacity(9) == math.ceil(1.25 * 9 * 2 / 6)


def test_stages_compose_to_the_layer():
    g = torch.Generator().manual_seed(3)
    T, k, E, H, Fd = 15, 2, 5, 16, 24
    x = randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    w1 = randn(E, 2 * Fd, H, generator=g, scale=0.3)
    w2 = randn(E, H, Fd, generator=g, scale=0.3)
    go = randn(T, H, generator=g)
    grads = []
    for staged in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
        if staged:
            tokens, plan = moe_dispatch(leaves[0], ids, E, capacity=4)
            y = moe_combine(moe_expert_compute(tokens, leaves[2], leaves[3], plan), plan, leaves[1])
        else:
            y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], num_experts=E, capacity=4)
        (y * go).sum().backward()
        grads.append([y.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("y", "x", "w", "w1", "w2"), *grads):
        assert torch.equal(a, b), f"stages differ from moe_mlp in {name}"
    # grouped_mlp is differentiable on its own, against an fp64 loop
    offs = [0, 4, 4, 11, 15, 15]
    xs = x.clone().requires_grad_()
    w1s, w2s = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    (grouped_mlp(xs, w1s, w2s, offs) * go).sum().backward()
    refs = [_f64(t) for t in (x, w1, w2)]
    out = torch.zeros(T, H, dtype=torch.float64)
    for e in range(E):
        a, b = offs[e], offs[e + 1]
        out[a:b] = activation_reference(refs[0][a:b] @ refs[1][e].t(), "swiglu") @ refs[2][e].t()
    (out * go.double().cpu()).sum().backward()
    for name, ours, ref in zip(("x", "w1", "w2"), (xs, w1s, w2s), refs):
        assert_close(ours.grad, ref.grad, torch.float32, msg=f"grouped_mlp grad {name}")


def test_fp16_layer_forward_backward():
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    m = MoE(MoEConfig(16, 24, 4, 2), device=DEVICE, dtype=torch.float16)
    x = randn(11, 16, dtype=torch.float16, generator=g, scale=2.0).requires_grad_()
    y = m(x)
    go = randn(11, 16, dtype=torch.float16, generator=g)
    (y.float() * go.float()).sum().backward()
    xd, w1, w2 = _f64(x), _f64(m.w1), _f64(m.w2)
    wts = m.router_output.weights.detach().cpu().double()
    yr = moe_mlp_reference(xd, m.router_output.expert_ids.cpu(), wts, w1, w2)
    (yr * go.double().cpu()).sum().backward()
    # fp16: the intermediate activation is rounded to fp16 between the two GEMMs and every
    # output once more (2^-11 each): 4e-3 relative covers the chained roundings
    for name, a, b in (("y", y, yr), ("w1", m.w1.grad, w1.grad), ("w2", m.w2.grad, w2.grad)):
        assert_close(a, b, torch.float16, rtol=4e-3, atol=4e-3 * b.pow(2).mean().sqrt().item(), msg=f"fp16 {name}")


def test_bad_input():
    with pytest.raises(ValueError, match="top_k must be <= num_experts \\(4\\), got 5"):
        MoE(MoEConfig(16, 24, 4, 5))
    with pytest.raises(ValueError, match="score must be one of"):
        TopKRouter(16, 4, 2, score="tanh")
    with pytest.raises(ValueError, match="capacity_factor must be None or a number > 0"):
        MoE(MoEConfig(16, 24, 4, 2, capacity_factor=0))
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(MoEConfig(16, 24, 4, 2, activation="none"))
    m = MoE(MoEConfig(16, 24, 4, 2), device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[..., hidden_size=16\]"):
        m(torch.randn(3, 5, 15, device=DEVICE))
    x = torch.randn(6, 16, device=DEVICE)
    w1, w2 = m.w1.detach(), m.w2.detach()
    ids = torch.zeros(6, 2, dtype=torch.int64, device=DEVICE)
    wts = torch.ones(6, 2, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be in \\[1, num_experts=4\\], got 5"):
        moe_mlp(x, torch.zeros(6, 5, dtype=torch.int64, device=DEVICE), torch.ones(6, 5, device=DEVICE), w1, w2,
                num_experts=4)
    with pytest.raises(ValueError, match="expert_ids has 5 tokens but x has 6"):
        moe_mlp(x, ids[:5], wts[:5], w1, w2, num_experts=4)
    with pytest.raises(ValueError, match=r"weights must have shape \(6, 2\)"):
        moe_mlp(x, ids, wts[:, :1], w1, w2, num_experts=4)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\), got values in \[0, 4\]"):
        moe_mlp(x, ids + torch.tensor([[0, 4]], device=DEVICE), wts, w1, w2, num_experts=4)
    with pytest.raises(TypeError, match="expert_ids must have dtype torch.int32 or torch.int64"):
        moe_mlp(x, ids.float(), wts, w1, w2, num_experts=4)
    with pytest.raises(ValueError, match=r"w2 must have shape \(4, 16, 24\)"):
        moe_mlp(x, ids, wts, w1, w2[:, :, :20], num_experts=4)
    with pytest.raises(ValueError, match="w1 must hold the 4 experts of this rank, got 3"):
        moe_mlp(x, ids, wts, w1[:3], w2[:3], num_experts=4)
    with pytest.raises(ValueError, match="capacity must be None or an int >= 0"):
        moe_mlp(x, ids, wts, w1, w2, num_experts=4, capacity=-1)
    with pytest.raises(ValueError, match="pass either group= or a Transport instance"):
        moe_mlp(x, ids, wts, w1, w2, num_experts=4, ep_group=object(), transport=EmulatedTransport(2))
    with pytest.raises(ValueError, match="pass either group= or a Transport instance"):
        MoE(MoEConfig(16, 24, 4, 2), ep_group=object(), transport=EmulatedTransport(2))


fp8_device = pytest.mark.skipif(DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9),
                                reason="fp8 needs compute capability >= 8.9")


@fp8_device
def test_fp8_layer_within_the_quantisation_error():
    """``MoE(fp8=...)`` (rowwise; blockwise with the high-precision weight gradient): the output
    and every gradient (input, router, both expert weights) within 2^-3 of the unquantised float64
    layer in norm (each e4m3 operand is within 2^-4 of itself, each GEMM multiplies two of them)
    and farther than 2^-8 from it (the quantisation is real: bf16 would be within 2^-8). The
    kernels are checked element by element in tests/test_moe_kernels.py, the dispatch against one
    process with the same quantisation in tests/test_moe_ep.py. Then the model switch: ``fp8`` of
    a TransformerConfig (and of a block) runs the routed experts in fp8 too."""
    from fusedpar.nn import Transformer, TransformerConfig

    for i, (recipe, hp) in enumerate((("rowwise", False), ("blockwise", True))):
        torch.manual_seed(10 + i)
        m = MoE(MoEConfig(20, 24, 6, 2, fp8=recipe, fp8_grad_high_precision=hp), device=DEVICE)
        assert f"fp8={recipe!r}, fp8_grad_high_precision={hp}" in repr(m)
        g = torch.Generator().manual_seed(i)
        x = randn(3, 7, 20, generator=g).requires_grad_()
        y = m(x)
        go = randn(*y.shape, generator=g)
        ((y * go).sum() + m.aux_loss).backward()
        xd, rw, w1, w2 = _f64(x.reshape(-1, 20)), _f64(m.router.weight), _f64(m.w1), _f64(m.w2)
        yr, aux, z, _ = reference_moe(xd, rw, w1, w2, top_k=2, ids=m.router_output.expert_ids.cpu())
        ((yr * go.reshape(-1, 20).double().cpu()).sum() + aux + z).backward()
        for name, a, b in (("output", y.reshape(-1, 20), yr), ("x grad", x.grad.reshape(-1, 20), xd.grad),
                           ("router grad", m.router.weight.grad, rw.grad), ("w1 grad", m.w1.grad, w1.grad),
                           ("w2 grad", m.w2.grad, w2.grad)):
            rel = ((a.detach().cpu().double() - b).norm() / b.norm()).item()
            assert 2.0 ** -8 < rel < 2.0 ** -3, f"{recipe}: {name} off by {rel:.4f} of its norm"
    kw = dict(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=16, num_experts=4,
              first_k_dense_replace=1)
    model = Transformer(TransformerConfig(**kw, fp8="blockwise", fp8_grad_high_precision=True), seed=1)
    moe = model.layers["1"].mlp
    assert isinstance(moe, MoE) and (moe.fp8, moe.fp8_grad_high_precision) == ("blockwise", True)
    assert model.layers["0"].mlp.fc1.fp8 == "blockwise" and moe.router.weight.dtype == torch.float32
    moe.set_fp8(None)
    assert moe.fp8 is None and "fp8=" not in repr(moe)
    with pytest.raises(ValueError, match=r"MoE: fp8 must be one of \(None, 'rowwise', 'blockwise'\), got 'e5m2'"):
        MoE(MoEConfig(16, 24, 4, 2, fp8="e5m2"))
    with pytest.raises(ValueError, match=r"fp8 must be one of \(None, 'rowwise', 'blockwise'\), got 'row'"):
        moe_mlp(torch.randn(4, 16, device=DEVICE), torch.zeros(4, 2, dtype=torch.int64, device=DEVICE),
                torch.ones(4, 2, device=DEVICE), moe.w1.detach(), moe.w2.detach(), num_experts=4, fp8="row")


def bad_ids(kind, T, k, E):
    ids = torch.zeros(T, k, dtype=torch.int64)
    ids[:, 0] = torch.arange(T) % E
    bad = {"E": E, "negative": -1, "huge": 2**40}[kind]
    ids[T // 2, k - 1] = bad
    return ids.to(DEVICE), bad


def call_entry(entry, x, ids, E, *, transport=None):
    """Run ``moe_plan`` / ``moe_dispatch`` / ``moe_mlp`` (zero swiglu experts) on ``x`` and ``ids``."""
    T, k = ids.shape
    if entry == "moe_plan":
        return moe_plan(x, ids, E, transport=transport)
    if entry == "moe_dispatch":
        return moe_dispatch(x, ids, E, transport=transport)
    e_loc = E // (1 if transport is None else transport.size)
    w1 = torch.zeros(e_loc, 8, x.shape[1], device=x.device)
    w2 = torch.zeros(e_loc, x.shape[1], 4, device=x.device)
    return moe_mlp(x, ids, torch.ones(T, k, device=x.device), w1, w2, num_experts=E, transport=transport)


ENTRIES = ["moe_plan", "moe_dispatch", "moe_mlp"]


@pytest.mark.parametrize("kind", ["E", "negative", "huge"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_out_of_range_expert_ids_single_rank(entry, kind):
    """Out-of-range ids would be dropped silently by the routing sort: every entry point raises."""
    x = torch.randn(6, 16, device=DEVICE)
    ids, bad = bad_ids(kind, 6, 2, 4)
    lo, hi = min(bad, 0), max(bad, 3)
    with pytest.raises(ValueError, match=rf"expert_ids must lie in \[0, 4\), got values in \[{lo}, {hi}\]$"):
        call_entry(entry, x, ids, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ENTRIES)
def test_out_of_range_expert_ids_single_rank_cuda(entry):
    """The single-rank CUDA path checked nothing (to stay sync-free); the check now rides on a
    copy queued behind the routing kernels."""
    x = torch.randn(6, 16, device="cuda")
    ids, _ = bad_ids("E", 6, 2, 4)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\), got values in \[0, 4\]"):
        call_entry(entry, x, ids.cuda(), 4)


def test_tokens_must_match_the_plan():
    """The plan's offsets address exactly the dispatched rows; other tokens are refused."""
    x = torch.randn(6, 16, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]] * 3, device=DEVICE)
    tokens, plan = moe_dispatch(x, ids, 4)
    w1 = torch.zeros(4, 8, 16, device=DEVICE)
    w2 = torch.zeros(4, 16, 4, device=DEVICE)
    for rows in (tokens.shape[0] - 3, tokens.shape[0] + 3):
        with pytest.raises(ValueError, match=f"tokens must have the 12 rows the plan dispatched, got shape \\({rows},"):
            moe_expert_compute(torch.zeros(rows, 16, device=DEVICE), w1, w2, plan)


@pytest.mark.parametrize("offsets_device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_mlp_checks_offsets(offsets_device):
    x = torch.randn(8, 16, device=DEVICE)
    w1 = torch.zeros(2, 8, 16, device=DEVICE)
    w2 = torch.zeros(2, 16, 4, device=DEVICE)
    for offs, msg in (([0, 6, 4], "non-decreasing"), ([0, 4, 9], "end at most at M=8"), ([2, 8], "start at 0")):
        with pytest.raises(ValueError, match=msg):
            grouped_mlp(x, w1, w2, torch.tensor(offs, device=offsets_device))


def test_benchmark_cli_smoke(tmp_path):
    import json
    import os
    import re
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    try:
        from benchmarks.__main__ import main
    finally:
        sys.path.remove(root)
    out = tmp_path / "moe.json"
    # every shape explicit and small, fp32 (the 1e-3 bound below is fp32's): on a GPU the defaults
    # are the benchmark's real shapes (the DeepSeek-V3 row alone is GBs), not a test's
    assert main(["moe", "--tokens", "9", "--hidden", "32", "--ffn", "24", "--experts", "3", "--top-k", "2",
                 "--dtype", "fp32", "--deepseek-shape", "smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["moe"]
    kinds = {r["bench"] for r in rows}
    assert kinds == {"grouped_gemm", "grouped_gemm_fp8", "permute", "unpermute", "layer_fwd_bwd", "layer_fwd_bwd_fp8",
                     "ep_layer_fwd_bwd", "deepseek_v3_layer_fwd_bwd"}
    for bench in ("grouped_gemm_fp8", "layer_fwd_bwd_fp8"):
        assert sorted(r["recipe"] for r in rows if r["bench"] == bench) == ["blockwise", "rowwise"]
    # the fp8 layer is checked against the 16-bit one within two e4m3 roundings (2^-3 of the
    # output's scale), every other row against its fp32 baseline
    assert all(r["max_rel_err"] < (2 ** -3 if r["bench"] == "layer_fwd_bwd_fp8" else 1e-3) for r in rows)
    assert all(r["tokens"] == 9 and r["dtype"] == "float32" for r in rows)
    (ds,) = [r for r in rows if r["bench"] == "deepseek_v3_layer_fwd_bwd"]  # its own (smoke) shape
    assert (ds["experts"], ds["top_k"], ds["groups"], ds["routing_agreement"]) == (16, 4, "4/8", 1.0)
    assert (ds["ep"], ds["experts_per_rank"]) == (2, 8)  # one rank of 2 emulated expert-parallel ranks
    assert all(r["experts"] == 3 and r["hidden"] == 32 for r in rows if r is not ds)
    # the grouped GEMM rows record what ran (gemm_loads.last_launch): "BMxBNxBK wW sS", the loads,
    # persistent exactly when by TMA
    gemm_rows = [r for r in rows if r["bench"] in ("grouped_gemm", "grouped_gemm_fp8")]
    assert len(gemm_rows) == 3
    for r in gemm_rows:
        assert re.fullmatch(r"\d+x\d+x\d+ w\d+ s\d+( split2)?", r["config"]), r
        assert r["loads"] in ("tma", "pointer") and r["persistent"] == (r["loads"] == "tma"), r


# ----------------------------------------------------------------------------------------------
# edges of routing: idle experts, all tokens to one expert, top_k == E, capacity drops, with the
# sigmoid + correction-bias selection (DeepSeek-V3)
# ----------------------------------------------------------------------------------------------
def _assert_idle_grads_zero(w1g, w2g, idle, tag):
    for name, gr in (("w1", w1g), ("w2", w2g)):
        assert gr is not None and not gr.isnan().any(), f"{name} grad has NaN ({tag})"
        for e in idle:
            assert torch.equal(gr[e], torch.zeros_like(gr[e])), f"{name} grad of idle expert {e} is not 0 ({tag})"


def test_idle_expert_weight_grads_are_exact_zeros():
    """moe_mlp: experts 1 and 4 of 5 receive no token (top-1 and top-2, dropless and with capacity
    drops): their weight gradients are exactly zero, nothing is NaN, the rest matches fp64."""
    g = torch.Generator().manual_seed(21)
    T, E, H, Fd = 9, 5, 16, 24
    for k, cap in ((1, None), (2, None), (2, 3)):
        ids = torch.stack([torch.tensor([0, 2, 3])[torch.randperm(3, generator=g)[:k]] for _ in range(T)])
        x = randn(T, H, generator=g).requires_grad_()
        w = torch.rand(T, k, generator=g).to(DEVICE).requires_grad_()
        w1 = randn(E, 2 * Fd, H, generator=g, scale=H ** -0.5).requires_grad_()
        w2 = randn(E, H, Fd, generator=g, scale=Fd ** -0.5).requires_grad_()
        y = moe_mlp(x, ids.to(DEVICE), w, w1, w2, num_experts=E, capacity=cap)
        go = randn(T, H, generator=g)
        (y * go).sum().backward()
        tag = f"k={k} capacity={cap}"
        _assert_idle_grads_zero(w1.grad, w2.grad, (1, 4), tag)
        ref = [_f64(t) for t in (x, w, w1, w2)]
        yr = moe_mlp_reference(ref[0], ids, ref[1], ref[2], ref[3], capacity=cap)
        (yr * go.double().cpu()).sum().backward()
        assert_close(y, yr, torch.float32, msg=f"output {tag}")
        for name, ours, r in zip(("x", "weights", "w1", "w2"), (x, w, w1, w2), ref):
            assert_close(ours.grad, r.grad, torch.float32, msg=f"grad {name} {tag}")


def _biased_selection(x, router_w, bias, k):
    """fp64 DeepSeek-V3 selection: top-k of sigmoid(logits) + bias, stable (ties: lowest id)."""
    s = torch.sigmoid(x.double().cpu() @ router_w.double().cpu().t()) + bias.double().cpu()
    return torch.sort(s, dim=-1, descending=True, stable=True)[1][:, :k]


BIASED_CASES = {  # name -> (E, k, capacity_factor, correction bias, idle experts)
    "all-to-expert-2": (4, 1, None, [0.0, 0.0, 4.0, 0.0], (0, 1, 3)),
    "all-to-experts-3-0": (4, 2, None, [3.0, 0.0, 0.0, 4.0], (1, 2)),
    "all-to-one-capacity": (4, 1, 1.0, [0.0, 4.0, 0.0, 0.0], (0, 2, 3)),  # cap ceil(T/E): most dropped
    "top_k-equals-experts": (4, 4, None, [0.3, -0.2, 0.1, 0.0], ()),
    "skewed-capacity": (5, 2, 0.75, [1.5, 0.0, 0.0, 0.0, -4.0], (4,)),  # expert 0 overflows
}


@pytest.mark.parametrize("case", list(BIASED_CASES))
def test_sigmoid_correction_bias_edges(case):
    """MoE with TopKRouter(score="sigmoid", score_bias=True): the bias picks the experts (all
    tokens to one or two of them, every expert, overflowing ones with capacity drops) while the
    weights stay the unbiased normalised sigmoid scores; outputs, losses and every gradient match
    the fp64 reference, idle experts' gradients are exact zeros."""
    E, k, cf, bias, idle = BIASED_CASES[case]
    i = list(BIASED_CASES).index(case)
    g = torch.Generator().manual_seed(30 + i)
    torch.manual_seed(30 + i)
    m = MoE(MoEConfig(16, 24, E, k, score="sigmoid", score_bias=True, capacity_factor=cf), device=DEVICE)
    assert m.router.normalize
    with torch.no_grad():
        m.router.e_score_correction_bias.copy_(torch.tensor(bias))
    x = randn(2, 6, 16, generator=g)
    _layer_case_ids(m, x, g, cf, _biased_selection(x.reshape(-1, 16), m.router.weight, m.router.e_score_correction_bias, k))
    ids = m.router_output.expert_ids.cpu()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    for e in idle:
        assert counts[e] == 0, f"expert {e} must be idle ({case})"
    _assert_idle_grads_zero(m.w1.grad, m.w2.grad, idle, case)
    if cf is not None:
        assert (counts > m.router_output.capacity).any(), f"the case must drop slots ({case})"


def _layer_case_ids(m, x, g, capacity_factor, expected_ids):
    """Like _layer_case, for a selection the plain reference does not make (the bias): the ids
    are checked against ``expected_ids``, the continuous parts recomputed in fp64."""
    x = x.detach().requires_grad_()
    y = m(x)
    go = randn(*y.shape, generator=g)
    ((y * go).sum() + m.aux_loss).backward()
    H = x.shape[-1]
    ids = m.router_output.expert_ids.cpu()
    assert torch.equal(ids, expected_ids), "selection differs from the fp64 biased top-k"
    xd, rw, w1, w2 = _f64(x.reshape(-1, H)), _f64(m.router.weight), _f64(m.w1), _f64(m.w2)
    yr, aux, z, _ = reference_moe(xd, rw, w1, w2, top_k=m.top_k, score="sigmoid", normalize=True,
                                  capacity_factor=capacity_factor, ids=ids)
    ((yr * go.reshape(-1, H).double().cpu()).sum() + aux + z).backward()
    assert_close(y.reshape(-1, H), yr, torch.float32, msg="output")
    assert_close(m.router_output.aux_loss, aux, torch.float32, msg="aux loss")
    assert_close(x.grad.reshape(-1, H), xd.grad, torch.float32, msg="input grad")
    assert_close(m.router.weight.grad, rw.grad, torch.float32, msg="router grad")
    assert_close(m.w1.grad, w1.grad, torch.float32, msg="w1 grad")
    assert_close(m.w2.grad, w2.grad, torch.float32, msg="w2 grad")
