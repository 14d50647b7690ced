"""Mixture-of-experts top-k routing: scores, (group-limited) top-k selection and combine weights.

From the fp32 router logits ``[T, E]`` one kernel computes, per token:

* the **scores**: ``softmax(logits)``, ``sigmoid(logits)``, or (``"softmax_topk"``, gpt-oss) the
  logits themselves, the weights being a softmax over the ``k`` selected logits;
* the **selection** on ``scores + bias`` (``bias``: DeepSeek-V3's ``e_score_correction_bias``,
  used for the selection only). **Group-limited**: the ``E`` experts form ``n_group`` groups of
  ``E / n_group`` consecutive ids; a group's score is the sum of its two best (biased) scores;
  the ``topk_group`` best groups are kept and the ``k`` experts are chosen inside them. Ties go to
  the lower expert (group) id, best first;
* **any values**: the selection ranks by one total order, torch's (``torch.topk`` / a stable
  descending ``torch.sort``): NaN above ``+inf`` above every number above ``-inf``, ``-0.0 ==
  +0.0``, ties (NaN with NaN too) towards the lower id. So every token gets ``k`` distinct expert
  ids in ``[0, E)`` whatever its logits (NaN, ``+-inf``, all equal): an all-NaN token takes experts
  ``0 .. k-1`` (within the lowest groups), a token with NaN scores at some experts takes those
  first. The scores and weights are what the float math gives, as torch's: a softmax token with a
  NaN or ``+inf`` logit, or all logits ``-inf``, has NaN scores; a sigmoid score is NaN only where
  its logit is (``sigmoid(+-inf)`` is 1 / 0); a NaN score makes the renormalised weights of its
  token NaN. A NaN stays in its token's weights (so in its output and the losses, where a NaN
  check sees it) and reaches no other token. The kernel ranks by int32 keys
  (:func:`_rank_key`), which compare alike on every device (float ``max`` drops a NaN on a GPU);
* the **combine weights**, from the unbiased scores of the chosen experts: renormalised to sum to
  1 (``normalize``: ``w / (sum w + 1e-20)``, as DeepSeek-V3) and multiplied by ``scale``
  (``routed_scaling_factor``).

Divisions are IEEE round-to-nearest (``tl.math.div_rn``): Triton compiles a plain fp32 ``/`` to
``div.full.f32`` on NVIDIA GPUs (up to 2 ulp off; the interpreter divides exactly), under which a
renormalised top-1 weight ``p / p`` is not exactly 1 and its gradient, exactly 0 in math, leaks
``~1e-7 * |dL/dw|`` into the router's gradient (the first GPU run: router gradient off by 7e-3
relative where the rest of that gradient is small). ``tl.exp`` stays the GPU's fast exponential.

One program holds the scores of ``BLOCK_T`` tokens as a ``[BLOCK_T, G_PAD, EPG_PAD]`` tile (group,
expert within group; padding masked), so the group ranking and the selection are ``topk_group``
and ``k`` rounds of tile reductions: no loop over experts, no sort. The backward recomputes the
scores from the logits and gives ``d logits`` from ``d weights`` (the selection has no gradient).

Layers: ``@triton.jit`` kernels -> :func:`topk_route` / :func:`topk_route_backward` (validate,
allocate, launch) -> :func:`topk_route_reference` (float64 torch, the tests' oracle).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_bool, check_choice, check_int, check_same, check_shape, check_tensor
from .launch import launch_kernel
from .runtime import cdiv, interpreting, next_power_of_2

__all__ = ["SCORE_FUNCS", "check_routing_config", "topk_route", "topk_route_backward", "topk_route_reference"]

#: score functions: name -> constexpr code of the kernels
SCORE_FUNCS = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}
#: most elements one program holds (tokens x padded experts) on a GPU
TILE_ELEMENTS = 2048
INTERPRETED_TILE_ELEMENTS = 1024
#: warps per program: 8 elements of a full tile per thread, so the few live tiles stay in registers
NUM_WARPS = 8


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _tile_offsets(pid, T, E, EPG, BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, EPG_PAD: tl.constexpr):
    """Rows of this program, the ``[BLOCK_T, G_PAD, EPG_PAD]`` expert ids and their mask."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, EPG_PAD)
    eid = g[None, :, None] * EPG + j[None, None, :]
    valid = (rows[:, None, None] < T) & (j[None, None, :] < EPG) & (eid < E)
    eid = tl.where((j[None, None, :] < EPG) & (eid < E), eid, -1)  # padding: no expert
    return rows, eid, valid


@triton.jit
def _scores(logits, valid, row_ok, SCORE: tl.constexpr):
    """Scores of a ``[BLOCK_T, G_PAD, EPG_PAD]`` logit tile (padding: 0; ``row_ok [BLOCK_T]``: the
    rows that are tokens). A token's softmax is torch's: NaN everywhere when a logit is NaN or
    ``+inf`` or all are ``-inf`` (``exp(x - max)`` meets ``inf - inf``), whichever way ``tl.max``
    treats NaN (the GPU's ``max.f32`` ignores it)."""
    if SCORE == 0:
        m = tl.max(tl.max(logits, axis=2), axis=1)
        m = tl.where(row_ok, m, 0.0)  # rows past the end (all -inf)
        e = tl.where(valid, tl.exp(logits - m[:, None, None]), 0.0)
        s = tl.sum(tl.sum(e, axis=2), axis=1)
        s = tl.where(row_ok, s, 1.0)
        out = tl.math.div_rn(e, s[:, None, None])
    elif SCORE == 1:
        out = tl.where(valid, tl.math.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + tl.exp(-logits)), 0.0)
    else:
        out = tl.where(valid, logits, 0.0)
    return out


@triton.jit
def _rank_key(x, ok):
    """The selection order of fp32 ``x`` as int32 keys: increasing with ``x``, ``-0.0 == +0.0``,
    every NaN one key above ``+inf`` (torch.topk / torch.sort: NaN is the largest), and
    ``-0x7FFFFFFF`` (*excluded*: below ``-inf``'s key) where not ``ok``. Integer keys compare the same way on every
    device, NaN included (float ``max`` / ``==`` do not: ``max.f32`` drops a NaN, ``NaN == NaN`` is
    false)."""
    x = tl.where(x == 0.0, 0.0, x)
    i = x.to(tl.int32, bitcast=True)
    key = tl.where(i >= 0, i, i ^ 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    key = tl.where(x != x, 0x7FFFFFFF, key)
    return tl.where(ok, key, -0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """The fp32 value of a :func:`_rank_key` key (NaN for the NaN key)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _topk_route_kernel(logits_ptr, stride_t, bias_ptr, weights_ptr, ids_ptr, T, E, EPG, N_GROUP, scale,
                       SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORMALIZE: tl.constexpr,
                       BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, EPG_PAD: tl.constexpr):
    pid = tl.program_id(0)
    rows, eid, valid = _tile_offsets(pid, T, E, EPG, BLOCK_T, G_PAD, EPG_PAD)
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None, None] * stride_t + eid, mask=valid,
                     other=float("-inf"))
    row_ok = rows < T
    scores = _scores(logits, valid, row_ok, SCORE)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + eid, mask=valid, other=0.0)
    key = _rank_key(choice, valid)  # excluded: padding, then the chosen experts and dropped groups
    big = 2147483647
    if TOPK_GROUP > 0:  # group-limited: keep the TOPK_GROUP groups with the best top-2 sums
        g = tl.arange(0, G_PAD)
        k1 = tl.max(key, axis=2)
        first = tl.min(tl.where(key == k1[:, :, None], eid, big), axis=2)
        k2 = tl.max(tl.where(eid == first[:, :, None], -0x7FFFFFFF, key), axis=2)
        gkey = _rank_key(_key_value(k1) + _key_value(k2), row_ok[:, None] & (g[None, :] < N_GROUP))
        keep = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(gkey, axis=1)
            gid = tl.min(tl.where(gkey == top[:, None], g[None, :], big), axis=1)
            hit = g[None, :] == gid[:, None]
            keep = keep | hit
            gkey = tl.where(hit, -0x7FFFFFFF, gkey)
        key = tl.where(keep[:, :, None], key, -0x7FFFFFFF)
    kk = tl.arange(0, K_PAD)
    sel_id = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    sel_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # a token keeps >= TOP_K eligible experts (check_routing_config), so top > excluded and e is
        # a real, not yet chosen expert; only rows past the end (never stored) pick padding
        top = tl.max(tl.max(key, axis=2), axis=1)
        e = tl.min(tl.min(tl.where(key == top[:, None, None], eid, big), axis=2), axis=1)
        hit = eid == e[:, None, None]
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        key = tl.where(hit, -0x7FFFFFFF, key)
        sel_id = tl.where(kk[None, :] == j, e[:, None], sel_id)
        sel_w = tl.where(kk[None, :] == j, w[:, None], sel_w)
    in_k = kk[None, :] < TOP_K
    if SCORE == 2:  # softmax over the selected logits
        m = tl.max(tl.where(in_k, sel_w, float("-inf")), axis=1)
        ex = tl.where(in_k, tl.exp(sel_w - m[:, None]), 0.0)
        sel_w = tl.math.div_rn(ex, tl.sum(ex, axis=1)[:, None])
    elif NORMALIZE:
        sel_w = tl.math.div_rn(sel_w, tl.sum(tl.where(in_k, sel_w, 0.0), axis=1)[:, None] + 1e-20)
    sel_w = sel_w * scale
    out = rows.to(tl.int64)[:, None] * TOP_K + kk[None, :]
    mask = row_ok[:, None] & in_k
    tl.store(weights_ptr + out, sel_w, mask=mask)
    tl.store(ids_ptr + out, sel_id.to(tl.int64), mask=mask)


@triton.jit
def _topk_route_bwd_kernel(logits_ptr, stride_t, weights_ptr, ids_ptr, grad_ptr, dlogits_ptr, T, E, EPG, scale,
                           SCORE: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
                           BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, EPG_PAD: tl.constexpr):
    """``d logits`` of ``w_j = scale * p_j / N`` (``N = sum_j p_j + 1e-20`` or 1): ``dp_j = scale *
    (g_j - [normalize] sum_m g_m u_m) / N`` on the chosen experts (``u_m = w_m / scale``), then the
    score function's own backward; ``softmax_topk``: ``dl_j = w_j (g_j - sum_m g_m u_m)``. Written
    with ``u`` so that a renormalised top-1 (``u`` exactly 1) gives exactly 0: the GPU contracts
    ``scale * g - g * w`` into an fma, which keeps the rounding of ``g * w`` (about 1 ulp)."""
    pid = tl.program_id(0)
    rows, eid, valid = _tile_offsets(pid, T, E, EPG, BLOCK_T, G_PAD, EPG_PAD)
    row_ok = rows < T
    sel = tl.zeros([BLOCK_T, G_PAD, EPG_PAD], dtype=tl.int1)
    gt = tl.zeros([BLOCK_T, G_PAD, EPG_PAD], dtype=tl.float32)
    wt = tl.zeros([BLOCK_T, G_PAD, EPG_PAD], dtype=tl.float32)
    dot = tl.zeros([BLOCK_T], dtype=tl.float32)
    base = rows.to(tl.int64) * TOP_K
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + base + j, mask=row_ok, other=-1).to(tl.int32)
        gj = tl.load(grad_ptr + base + j, mask=row_ok, other=0.0)
        wj = tl.load(weights_ptr + base + j, mask=row_ok, other=0.0)
        hit = eid == e[:, None, None]
        sel = sel | hit
        gt = tl.where(hit, gj[:, None, None], gt)
        wt = tl.where(hit, wj[:, None, None], wt)
        dot += gj * tl.math.div_rn(wj, scale)
    out = rows.to(tl.int64)[:, None, None] * stride_t + eid
    if SCORE == 2:
        dl = tl.where(sel, wt * (gt - dot[:, None, None]), 0.0)
    else:
        logits = tl.load(logits_ptr + out, mask=valid, other=float("-inf"))
        p = _scores(logits, valid, row_ok, SCORE)
        if NORMALIZE:
            n = tl.sum(tl.sum(tl.where(sel, p, 0.0), axis=2), axis=1) + 1e-20
            dp = tl.where(sel, tl.math.div_rn(scale * (gt - dot[:, None, None]), n[:, None, None]), 0.0)
        else:
            dp = tl.where(sel, scale * gt, 0.0)
        if SCORE == 0:
            dl = p * (dp - tl.sum(tl.sum(p * dp, axis=2), axis=1)[:, None, None])
        else:
            dl = dp * p * (1.0 - p)
    tl.store(dlogits_ptr + out, dl, mask=valid)


# --------------------------------------------------------------------------------------------
# host launchers
# --------------------------------------------------------------------------------------------
def check_routing_config(num_experts: int, top_k: int, *, score: str = "softmax", n_group: int = 1,
                         topk_group: int | None = None, scale: float = 1.0, prefix: str = "",
                         score_name: str = "score") -> int:
    """Check a routing configuration (``ValueError`` / ``TypeError`` naming ``prefix + field``;
    ``score_name``: the score function's field); returns the effective ``topk_group``
    (``n_group`` when ``None``)."""
    check_int(f"{prefix}num_experts", num_experts, min_value=1)
    check_int(f"{prefix}top_k", top_k, min_value=1, max_value=num_experts)
    check_choice(f"{prefix}{score_name}", score, tuple(SCORE_FUNCS))
    check_int(f"{prefix}n_group", n_group, min_value=1, max_value=num_experts)
    topk_group = n_group if topk_group is None else topk_group
    check_int(f"{prefix}topk_group", topk_group, min_value=1, max_value=n_group)
    if num_experts % n_group:
        raise ValueError(f"{prefix}num_experts must be divisible by {prefix}n_group ({n_group}), got {num_experts}")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError(f"{prefix}n_group must leave at least 2 experts per group (groups are ranked by their "
                         f"top-2 scores), got {n_group} groups of {num_experts} experts")
    if top_k > topk_group * per_group:
        raise ValueError(f"{prefix}top_k must be <= {prefix}topk_group * experts per group ({topk_group} * "
                         f"{per_group} = {topk_group * per_group}), got {top_k}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"{prefix}routed_scaling_factor must be a number > 0, got {scale!r}")
    return topk_group


def _launch_shape(E: int, n_group: int, T: int):
    epg = E // n_group
    g_pad, epg_pad = next_power_of_2(n_group), next_power_of_2(epg)
    limit = INTERPRETED_TILE_ELEMENTS if interpreting() else TILE_ELEMENTS
    block_t = max(1, min(next_power_of_2(max(T, 1)), limit // (g_pad * epg_pad)))
    return epg, g_pad, epg_pad, block_t


def _check_logits(logits: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensor("logits", logits, dims=(2,), dtypes=(torch.float32,))
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have unit stride along the experts, got strides {tuple(logits.stride())}")
    if bias is not None:
        check_tensor("bias", bias, dims=(1,), dtypes=(torch.float32,))
        check_same("bias", bias, "logits", logits, dtype=False)
        check_shape("bias", bias, (logits.shape[1],))


def topk_route(logits: torch.Tensor, top_k: int, *, score: str = "softmax", bias: torch.Tensor | None = None,
               n_group: int = 1, topk_group: int | None = None, normalize: bool = False,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``logits [T, E]`` (fp32, unit stride along ``E``): ``(weights [T, k] fp32, ids [T, k]
    int64)``, best first (by the biased scores), ties towards the lower expert id. ``bias [E]``
    (fp32) shifts the scores for the selection only; ``n_group`` / ``topk_group``: group-limited
    selection (module docstring); ``normalize``: weights renormalised to sum to 1 (ignored by
    ``"softmax_topk"``, whose weights already do); ``scale`` multiplies the weights."""
    _check_logits(logits, bias)
    check_bool("normalize", normalize)
    T, E = logits.shape
    topk_group = check_routing_config(E, top_k, score=score, n_group=n_group, topk_group=topk_group, scale=scale)
    weights = torch.empty(T, top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(T, top_k, device=logits.device, dtype=torch.int64)
    if T == 0:
        return weights, ids
    epg, g_pad, epg_pad, block_t = _launch_shape(E, n_group, T)
    grouped = n_group > 1 and topk_group < n_group
    launch_kernel(
        _topk_route_kernel, (cdiv(T, block_t),),
        (logits, logits.stride(0), bias if bias is not None else logits, weights, ids, T, E, epg, n_group,
         float(scale)),
        dict(SCORE=SCORE_FUNCS[score], HAS_BIAS=bias is not None, TOPK_GROUP=topk_group if grouped else 0, TOP_K=top_k,
             K_PAD=next_power_of_2(top_k), NORMALIZE=bool(normalize), BLOCK_T=block_t, G_PAD=g_pad, EPG_PAD=epg_pad,
             num_warps=NUM_WARPS))
    return weights, ids


def topk_route_backward(grad_weights: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        *, score: str = "softmax", n_group: int = 1, normalize: bool = False,
                        scale: float = 1.0) -> torch.Tensor:
    """``d logits [T, E]`` (fp32) of :func:`topk_route`'s weights given ``grad_weights [T, k]``
    and the forward's ``logits``, ``weights`` and ``ids`` (the selection is held fixed)."""
    _check_logits(logits, None)
    check_bool("normalize", normalize)
    T, E = logits.shape
    check_routing_config(E, ids.shape[-1] if ids.dim() == 2 else 1, score=score, n_group=n_group, scale=scale)
    k = ids.shape[1]
    for name, t in (("grad_weights", grad_weights), ("weights", weights)):
        check_tensor(name, t, dims=(2,), dtypes=(torch.float32,))
        check_shape(name, t, (T, k))
    check_tensor("ids", ids, dims=(2,), dtypes=(torch.int64,))
    check_shape("ids", ids, (T, k))
    grad_weights, weights, ids = grad_weights.contiguous(), weights.contiguous(), ids.contiguous()
    dlogits = torch.empty(T, E, device=logits.device, dtype=torch.float32)
    if T == 0:
        return dlogits
    epg, g_pad, epg_pad, block_t = _launch_shape(E, n_group, T)
    launch_kernel(
        _topk_route_bwd_kernel, (cdiv(T, block_t),),
        (logits, logits.stride(0), weights, ids, grad_weights, dlogits, T, E, epg, float(scale)),
        dict(SCORE=SCORE_FUNCS[score], TOP_K=k, NORMALIZE=bool(normalize) and score != "softmax_topk", BLOCK_T=block_t,
             G_PAD=g_pad, EPG_PAD=epg_pad, num_warps=NUM_WARPS))
    return dlogits


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def topk_route_reference(logits: torch.Tensor, top_k: int, *, score: str = "softmax",
                         bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int | None = None,
                         normalize: bool = False, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_route` in float64 torch (stable descending sorts: NaN first, ties towards the
    lower id); the weights are differentiable w.r.t. ``logits``."""
    T, E = logits.shape
    topk_group = n_group if topk_group is None else topk_group
    x = logits.double()
    scores = {"softmax": lambda: torch.softmax(x, -1), "sigmoid": lambda: torch.sigmoid(x),
              "softmax_topk": lambda: x}[score]()
    choice = scores.detach() + (0 if bias is None else bias.double())
    order = torch.sort(choice, dim=-1, descending=True, stable=True)[1]
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(T, n_group, E // n_group)
        gscore = torch.sort(grouped, dim=-1, descending=True, stable=True)[0][..., :2].sum(-1)
        keep = torch.sort(gscore, dim=-1, descending=True, stable=True)[1][:, :topk_group]
        mask = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(E // n_group, 1)
        # the kept groups' experts first, each part in choice order (a -inf in a kept group beats any dropped one)
        order = order.gather(1, torch.sort(mask.gather(1, order).to(torch.int8), dim=-1, descending=True,
                                           stable=True)[1])
    ids = order[:, :top_k]
    w = scores.gather(1, ids)
    if score == "softmax_topk":
        w = torch.softmax(w, -1)
    elif normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids
