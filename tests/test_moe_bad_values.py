"""MoE with bad values (issue 43): the routers on NaN / +-inf / all-equal logits (valid, distinct
expert ids by torch's order; the NaN stays in its token), the MoE layer with such tokens (ep 1
here; ep 2 in test_moe_ep.py, whose case "bad-tokens" runs :func:`bad_token_layer_case` on its gloo world), and the
kernels that index memory with data, handed the worst index data they can receive, writing into
views inside guard bands (a sentinel everywhere else in the buffer) and reading from views inside
NaN bands (an out-of-bounds read would bring a NaN into the result)."""
import pytest
import torch

from _utils import DEVICE, assert_close, randn
from fusedpar.kernels.grouped_bias import grouped_bias_grad, grouped_bias_grad_reference
from fusedpar.kernels.grouped_gemm import grouped_matmul, grouped_wgrad
from fusedpar.kernels.linear_ce import linear_ce_dlogits, linear_ce_dlogits_reference, linear_ce_stats
from fusedpar.kernels.linear_ce import linear_ce_stats_reference
from fusedpar.kernels.moe_permute import combine, combine_backward, permute
from fusedpar.kernels.moe_routing import grouped_matmul_reference, moe_mlp_reference, routing_metadata
from fusedpar.kernels.moe_routing import routing_metadata_reference
from fusedpar.kernels.moe_topk import topk_route, topk_route_backward, topk_route_reference
from fusedpar.nn import MoE, MoEConfig

NAN, INF = float("nan"), float("inf")
SENTINEL = 1234.5  # what a guard band holds: an output's neighbours must keep it

# name -> (E, k, options of topk_route; "bias": a selection bias)
ROUTERS = {
    "softmax": (8, 2, dict(score="softmax")),
    "sigmoid-bias-renormalised-scaled": (8, 3, dict(score="sigmoid", bias=True, normalize=True, scale=2.5)),
    "sigmoid-bias-grouped": (12, 3, dict(score="sigmoid", bias=True, n_group=4, topk_group=2, normalize=True)),
    "softmax-grouped-top1-group": (12, 2, dict(score="softmax", n_group=3, topk_group=1, normalize=True)),
    "softmax_topk": (6, 4, dict(score="softmax_topk")),
}


def _bad_rows(E, g):
    """Logit rows that break a float ``max`` / ``==`` selection, by name."""
    def r():
        return torch.randn(E, generator=g)

    def put(row, **at):
        for i, v in at.items():
            row[int(i[1:])] = v
        return row

    mixed = torch.tensor([NAN, INF, -INF, 0.0, -0.0] * E)[:E]
    return {
        "all-nan": torch.full((E,), NAN), "one-nan": put(r(), e5=NAN), "two-nan": put(r(), e1=NAN, e4=NAN),
        "one+inf": put(r(), e3=INF), "all+inf": torch.full((E,), INF), "some-inf": put(r(), e0=-INF, e2=-INF),
        "all-inf": torch.full((E,), -INF), "all-equal": torch.full((E,), 0.7),
        "signed-zeros": torch.tensor([-0.0, 0.0] * E)[:E], "mixed": mixed, "+inf-and--inf": put(r(), e1=INF, e3=-INF),
    }


def _logits_with_bad_rows(E, g):
    """``(logits [T, E], bad rows)``: finite rows interleaved with every bad row (a bad row's
    neighbours share its program tile), and the same logits with the bad rows replaced by finite
    ones (``clean``)."""
    bad = list(_bad_rows(E, g).values())
    T = 2 * len(bad) + 1
    logits = torch.randn(T, E, generator=g)
    clean = logits.clone()
    rows = torch.arange(1, T, 2)
    for i, row in zip(rows.tolist(), bad):
        logits[i] = row
    return logits, clean, rows


def _assert_valid_ids(ids, E, msg):
    assert ((ids >= 0) & (ids < E)).all(), f"{msg}: ids outside [0, {E}): {ids.tolist()}"
    s = ids.sort(dim=1).values
    assert (s[:, 1:] != s[:, :-1]).all(), f"{msg}: a token got the same expert twice: {ids.tolist()}"


@pytest.mark.parametrize("case", list(ROUTERS))
def test_router_on_nan_inf_and_equal_logits(case):
    """Every token gets k distinct ids in [0, E) in torch's order (NaN largest, ties to the lower
    id: the float64 reference's stable sorts); weights and d logits equal the reference's, NaN
    where its float math gives NaN, only in the bad rows; the finite rows are bit-identical to a
    launch whose rows are all finite (nothing leaks between the tokens of a tile)."""
    E, k, opts = ROUTERS[case]
    g = torch.Generator().manual_seed(43 + list(ROUTERS).index(case))
    logits, clean, bad = _logits_with_bad_rows(E, g)
    kw = {n: v for n, v in opts.items() if n != "bias"}
    bias = (torch.randn(E, generator=g) * 0.3).to(DEVICE) if opts.get("bias") else None
    finite = torch.ones(logits.shape[0], dtype=torch.bool)
    finite[bad] = False
    gw = torch.randn(logits.shape[0], k, generator=g)
    results = []
    for lg in (logits, clean):
        lg = lg.to(DEVICE)
        w, ids = topk_route(lg, k, bias=bias, **kw)
        bwd = dict(score=kw["score"], n_group=kw.get("n_group", 1), normalize=kw.get("normalize", False),
                   scale=kw.get("scale", 1.0))
        results.append((w.cpu(), ids.cpu(), topk_route_backward(gw.to(DEVICE), lg, w, ids, **bwd).cpu()))
    (w, ids, dl), (w_c, ids_c, dl_c) = results
    _assert_valid_ids(ids, E, case)
    ref_logits = logits.double().requires_grad_()
    rw, rids = topk_route_reference(ref_logits, k, bias=None if bias is None else bias.cpu(), **kw)
    assert torch.equal(ids, rids), f"{case}: not torch's order\n{ids.tolist()}\n{rids.tolist()}"
    torch.testing.assert_close(w.double(), rw.detach(), rtol=1e-6, atol=1e-6, equal_nan=True)
    rw.backward(gw.double())
    torch.testing.assert_close(dl.double(), ref_logits.grad, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert not w[finite].isnan().any() and not dl[finite].isnan().any(), case
    assert torch.isnan(w[bad[0]]).all(), f"{case}: an all-NaN token must have NaN weights"
    for name, a, b in (("ids", ids, ids_c), ("weights", w, w_c), ("d logits", dl, dl_c)):
        assert torch.equal(a[finite], b[finite]), f"{case}: a bad row changed the {name} of a finite row"
    if bias is not None:  # a bad selection bias: the same rule, every token picks its NaN expert first
        bias = bias.clone()
        bias[1], bias[2], bias[3] = NAN, INF, -INF
        w, ids = topk_route(logits.to(DEVICE), k, bias=bias, **kw)
        _assert_valid_ids(ids, E, f"{case} with a bad bias")
        assert torch.equal(ids.cpu(), topk_route_reference(logits.double(), k, bias=bias.cpu(), **kw)[1]), case


# ----------------------------------------------------------------------------------------------
# the MoE layer with bad tokens
# ----------------------------------------------------------------------------------------------
H, FFN = 16, 24
LAYERS = {  # name -> (num_experts, top_k, MoEConfig options, a selection bias)
    "softmax": (6, 2, dict(score="softmax"), None),
    "sigmoid-bias-grouped-scaled": (6, 2, dict(score="sigmoid", normalize=True, n_group=3, topk_group=2,
                                               routed_scaling_factor=2.0, score_bias=True),
                                    [0.1, -0.2, 0.3, 0.0, -0.1, 0.2]),
}


def bad_token_layer(name, *, ep_group=None, device=None):
    """The MoE of ``LAYERS[name]`` (seeded: the same weights on every rank and at every ep) with
    its router's hidden features 0 and 1 set so that an ``inf`` there makes every logit ``+inf``
    (feature 0) or half of them ``+inf`` and half ``-inf`` (feature 1)."""
    E, k, opts, bias = LAYERS[name]
    torch.manual_seed(7)
    m = MoE(MoEConfig(H, FFN, E, k, **opts), ep_group=ep_group, device=device)
    with torch.no_grad():
        m.router.weight[:, 0] = 2.0
        m.router.weight[:, 1] = torch.tensor([2.0, -2.0] * E)[:E]
        if bias is not None:
            m.router.e_score_correction_bias.copy_(torch.tensor(bias))
    return m


def bad_tokens(T, seed, first_bad):
    """``(x [T, H], go, bad token indices)``: random tokens with, from row ``first_bad``, a NaN
    token, all logits +inf, all -inf, +-inf, and an all-equal (zero) token, which stays finite."""
    g = torch.Generator().manual_seed(seed)
    x, go = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    rows = [first_bad + 2 * i for i in range(5)]
    x[rows[0], 3] = NAN
    for i, (f, v) in zip(rows[1:4], ((0, INF), (0, -INF), (1, INF))):
        x[i] = 0.0
        x[i, f] = v
    x[rows[4]] = 0.0
    return x, go, rows[:4]


def _reference_layer(m, full_w1, full_w2, xs):
    """float64 forward of the layer's router (topk_route_reference) and experts (the per-expert
    loop) over each rank's tokens ``xs``; returns the leaves, outputs and losses."""
    r = m.router
    rw = r.weight.detach().cpu().double().requires_grad_()
    w1, w2 = (w.detach().cpu().double().requires_grad_() for w in (full_w1, full_w2))
    bias = None if r.e_score_correction_bias is None else r.e_score_correction_bias.cpu().double()
    leaves, outs = [], []
    for x in xs:
        xd = x.cpu().double().requires_grad_()
        logits = xd @ rw.t()
        w, ids = topk_route_reference(logits, r.top_k, score=r.score, bias=bias, n_group=r.n_group,
                                      topk_group=r.topk_group, normalize=r.normalize, scale=r.routed_scaling_factor)
        y = moe_mlp_reference(xd, ids, w, w1, w2, activation=m.activation)
        scores = torch.sigmoid(logits) if r.score == "sigmoid" else torch.softmax(logits, -1)
        probs = scores / scores.sum(-1, keepdim=True)
        f = torch.bincount(ids.reshape(-1), minlength=r.num_experts).double() / ids.numel()
        loss = r.aux_loss_coef * r.num_experts * (f * probs.mean(0)).sum()
        loss = loss + r.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
        leaves.append(xd)
        outs.append((y, ids, loss))
    return leaves, outs, (w1, w2)


def bad_token_layer_case(name, m, full, xs, gos, bads, rank):
    """Forward + backward (outputs and aux losses) of the layer ``m`` on this rank's tokens
    ``xs[rank]`` against the float64 reference over every rank's tokens (``full``: the same layer
    with all experts): valid ids, this rank's finite tokens' outputs and input gradients, and the
    gradients of the experts no bad token reached; NaN in the NaN token's output and the loss."""
    x = xs[rank].clone().requires_grad_()
    y = m(x)
    ((y * gos[rank]).sum() + m.aux_loss).backward()
    ids = m.router_output.expert_ids
    _assert_valid_ids(ids, m.num_experts, name)
    leaves, outs, (w1, w2) = _reference_layer(full, full.w1, full.w2, xs)
    sum(((yr * go.cpu().double()).sum() + loss for (yr, _, loss), go in zip(outs, gos))).backward()
    assert torch.equal(ids.cpu(), outs[rank][1]), f"{name}: routing differs from the float64 reference"
    finite = torch.ones(x.shape[0], dtype=torch.bool)
    finite[bads[rank]] = False
    assert torch.isnan(y[bads[rank][0]]).all() and torch.isnan(m.aux_loss), f"{name}: the NaN must reach the output and loss"
    assert_close(y.cpu()[finite], outs[rank][0][finite], torch.float32, msg=f"{name}: finite tokens' outputs")
    assert_close(x.grad.cpu()[finite], leaves[rank].grad[finite], torch.float32,
                 msg=f"{name}: finite tokens' input grads")
    hit = set(torch.cat([o[1][b].reshape(-1) for o, b in zip(outs, bads)]).tolist())
    lo, n = m.first_expert, m.experts_per_rank
    clean = [e for e in range(lo, lo + n) if e not in hit]
    for wname, ours, ref in (("w1", m.w1, w1), ("w2", m.w2, w2)):
        assert_close(ours.grad[[e - lo for e in clean]], ref.grad[clean], torch.float32, msg=f"{name}: {wname} grad")
    return clean


@pytest.mark.parametrize("name", list(LAYERS))
def test_moe_layer_with_nan_and_inf_tokens(name):
    """ep 1: the NaN token no longer indexes buffers out of range (an IndexError in
    TopKRouter._losses, an illegal access on a GPU); every other token is untouched."""
    m = bad_token_layer(name, device=DEVICE)
    x, go, bad = bad_tokens(13, 5, 1)
    clean = bad_token_layer_case(name, m, m, [x.to(DEVICE)], [go.to(DEVICE)], [bad], 0)
    assert clean, f"{name}: some expert must be out of the bad tokens' reach"


# ----------------------------------------------------------------------------------------------
# data-indexed kernels, worst index data, guard bands
# ----------------------------------------------------------------------------------------------
def _banded(rows, cols, dtype=torch.float32, fill=SENTINEL):
    """``(buffer, view)``: a ``[rows, cols]`` view with a border of ``fill`` around it (row stride
    ``cols + 6``: a column overrun lands in the band too)."""
    buf = torch.full((rows + 2, cols + 6), fill, dtype=dtype, device=DEVICE)
    return buf, buf[1:rows + 1, 3:cols + 3]


def _nan_banded(t):
    """``t`` copied into a view inside a NaN band (reads past it bring NaN into a result)."""
    buf, view = _banded(*t.shape, dtype=t.dtype, fill=NAN)
    view.copy_(t)
    return view


def _assert_band_kept(buf, name):
    band = buf.clone()
    band[1:-1, 3:-3] = SENTINEL
    assert (band == SENTINEL).all(), f"{name} wrote outside its output"


def _index_banded(values, dtype):
    """An index tensor as a view inside a band of out-of-range values."""
    buf = torch.full((len(values) + 8,), 2**30, dtype=dtype, device=DEVICE)
    view = buf[4:4 + len(values)]
    view.copy_(torch.tensor(values, dtype=dtype))
    return view


T_, K_ = 5, 2  # tokens, top_k of the permute cases: 10 slots
SLOTS = T_ * K_
# sorted_slot / slot_pos as routing_metadata makes them (-1 tail, the extremes 0 and n - 1) and values
# past them, which the kernels mask like -1 (-2, n, 2^31 - 1; 2^40 for int64)
WORST_SLOTS = [SLOTS - 1, 0, -1, 7, SLOTS, -2, 3, 2**31 - 1, 4, -1]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_permute_and_combine_keep_to_their_rows(dtype):
    """permute, combine and combine_backward handed the extreme and the out-of-range slots: in-range
    rows move as the loop says, the rest are zero / add nothing, no write leaves the output views,
    no read leaves the NaN-banded inputs."""
    g = torch.Generator().manual_seed(3)
    worst = WORST_SLOTS + ([2**40] if dtype == torch.int64 else [-1])
    slots = _index_banded(worst[:SLOTS], dtype)
    ok = [0 <= s < SLOTS for s in slots.tolist()]
    Hd = 6
    x = _nan_banded(randn(T_, Hd, generator=g))
    buf, out = _banded(SLOTS, Hd)
    permute(x, slots, K_, out=out)
    _assert_band_kept(buf, "permute")
    for p, s in enumerate(slots.tolist()):
        assert torch.equal(out[p], x[s // K_] if ok[p] else torch.zeros(Hd, device=DEVICE)), f"permute row {p}"
    # combine: slot_pos into y's R rows
    R = SLOTS
    y = _nan_banded(randn(R, Hd, generator=g))
    w = _nan_banded(torch.rand(T_, K_, generator=g).to(DEVICE))
    buf, out = _banded(T_, Hd)
    combine(y, slots, w, K_, out=out)
    _assert_band_kept(buf, "combine")
    ref = torch.zeros(T_, Hd, dtype=torch.float64)
    for s, p in enumerate(slots.tolist()):
        if ok[s]:
            ref[s // K_] += w.reshape(-1)[s].double().cpu() * y[p].double().cpu()
    assert_close(out, ref, torch.float32, msg="combine")
    go = _nan_banded(randn(T_, Hd, generator=g))
    gy, gw = combine_backward(go, y, w, slots, K_)
    for p, s in enumerate(slots.tolist()):
        exp_gy = w.reshape(-1)[s] * go[s // K_] if ok[p] else torch.zeros(Hd, device=DEVICE)
        assert_close(gy[p], exp_gy.cpu().double(), torch.float32, msg=f"combine_backward grad_y row {p}")
    ref_gw = torch.zeros(SLOTS, dtype=torch.float64)
    for p, s in enumerate(slots.tolist()):
        if ok[p]:
            ref_gw[s] = (go[s // K_].double() * y[p].double()).sum().cpu()
    assert_close(gw.reshape(-1), ref_gw, torch.float32, msg="combine_backward grad_weights")


def test_routing_metadata_drops_out_of_range_ids():
    """The counting sort handed -1 and the extreme ids (0, G - 1) and ids past them (G, -2,
    2^31 - 1): the latter are dropped (check_ids=False) or raise naming group_ids (True); every
    position it returns lies in [-1, n), so the permutes that read them stay in range."""
    G = 3
    values = [G - 1, 0, -1, G, 1, -2, 2**31 - 1, G - 1, 0, 0]
    ids = _index_banded(values, torch.int64).view(5, 2)
    counts, offsets, slot_pos, sorted_slot = routing_metadata(ids, G, check_ids=False)
    dropped = torch.tensor([v if 0 <= v < G else -1 for v in values])
    for ours, ref in zip((counts, offsets, slot_pos, sorted_slot), routing_metadata_reference(dropped, G)):
        assert torch.equal(ours.cpu().long(), ref)
    assert int(offsets[-1]) <= ids.numel() and ((slot_pos >= -1) & (slot_pos < ids.numel())).all()
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 3\) \(or be -1: not routed\), got 3 id"):
        routing_metadata(ids, G)


# offsets as the routing makes them: empty groups, every row in one group, a tail after the last group
WORST_OFFSETS = {"all-in-one-group": [0, 0, 9, 9], "empty-ends-and-tail": [0, 0, 4, 4, 6]}


@pytest.mark.parametrize("case", list(WORST_OFFSETS))
def test_grouped_kernels_keep_to_their_rows(case):
    """The grouped GEMM (forward with the pre-activation), its weight gradient and the expert-bias
    gradient on the extreme offsets the routing gives them (trusted: check_offsets=False): results
    as the loop's, nothing written outside the output views, nothing read outside the NaN-banded
    inputs."""
    offs = torch.tensor(WORST_OFFSETS[case], dtype=torch.int32, device=DEVICE)
    M, Kd, E, F = 9, 16, 2, 8
    g = torch.Generator().manual_seed(9)
    x = _nan_banded(randn(M, Kd, generator=g))
    w1 = randn(E, 2 * F, Kd, generator=g, scale=0.3)
    buf_h, h = _banded(M, F)
    buf_p, pre = _banded(M, 2 * F)
    grouped_matmul(x, w1, offs, activation="swiglu", out=h, preact_out=pre, check_offsets=False)
    _assert_band_kept(buf_h, "grouped_matmul out")
    _assert_band_kept(buf_p, "grouped_matmul preact_out")
    assert_close(h, grouped_matmul_reference(x, w1, offs.tolist(), activation="swiglu"), torch.float32,
                 msg=f"grouped_matmul {case}")
    gy = _nan_banded(randn(M, 2 * F, generator=g))
    buf_w, dw = _banded(E * 2 * F, Kd)
    grouped_wgrad(gy, x, offs, E, out=dw.unflatten(0, (E, 2 * F)), check_offsets=False)
    _assert_band_kept(buf_w, "grouped_wgrad")
    o = offs.tolist()
    ref = torch.zeros(E, 2 * F, Kd, dtype=torch.float64)
    for grp in range(len(o) - 1):
        ref[grp % E] += gy[o[grp]:o[grp + 1]].double().cpu().t() @ x[o[grp]:o[grp + 1]].double().cpu()
    assert_close(dw.unflatten(0, (E, 2 * F)), ref, torch.float32, msg=f"grouped_wgrad {case}")
    buf_b, db = _banded(E, 2 * F)
    grouped_bias_grad(gy, offs, E, out=db, check_offsets=False)
    _assert_band_kept(buf_b, "grouped_bias_grad")
    assert_close(db, grouped_bias_grad_reference(gy, o, E), torch.float32, msg=f"grouped_bias_grad {case}")


def test_linear_ce_targets_only_select_columns():
    """The linear cross-entropy kernels compare the targets with column indices and never address
    memory with them: ignored (-100, -1), extreme (0, N - 1) and out-of-range (N, 2^31 - 1) targets
    write nothing outside the output views (out-of-range ones pick nothing, as a negative one)."""
    g = torch.Generator().manual_seed(17)
    M, N, Kd = 6, 40, 16
    hidden, weight = randn(M, Kd, generator=g), randn(N, Kd, generator=g, scale=0.3)
    tgt = _index_banded([-100, N - 1, 0, N, 2**31 - 1, -1], torch.int64)
    buf, stats = _banded(3, M)
    linear_ce_stats(hidden, weight, tgt, out=stats)
    _assert_band_kept(buf, "linear_ce_stats")
    inside = torch.where((tgt >= 0) & (tgt < N), tgt, -1)
    assert_close(stats, linear_ce_stats_reference(hidden.cpu(), weight.cpu(), inside.cpu()), torch.float32,
                 msg="linear_ce_stats")
    lse = stats[0].contiguous()
    coef = [torch.rand(M, generator=g).to(DEVICE) for _ in range(3)]
    buf, dz = _banded(M, 24)
    linear_ce_dlogits(hidden, weight[16:], tgt, lse, *coef, col_offset=16, out=dz)
    _assert_band_kept(buf, "linear_ce_dlogits")
    ref = linear_ce_dlogits_reference(hidden.cpu(), weight[16:].cpu(), tgt.cpu(), lse.cpu(), *(c.cpu() for c in coef),
                                      col_offset=16)
    assert_close(dz, ref, torch.float32, msg="linear_ce_dlogits")
