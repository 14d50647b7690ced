"""MoE kernels: routing metadata, permute / combine (+ backward), grouped GEMM fwd / dgrad / wgrad
(16-bit operands, and e4m3 with their scales).

References: Python loops (routing), fp64 torch (GEMMs), torch autograd in fp64 (backward
epilogues) and torch's own grouped GEMM (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn, spy_launches
from fusedpar.kernels.grouped_gemm import (
    as_group_offsets,
    grouped_matmul,
    grouped_matmul_dact,
    grouped_wgrad,
)
from fusedpar.kernels.moe_permute import combine, combine_backward, permute
from fusedpar.kernels.moe_routing import grouped_matmul_reference, routing_metadata, routing_metadata_reference
from fusedpar.kernels.runtime import activation_reference

# bf16 runs interpreted too: the kernels upcast bf16 operands of tl.dot behind a constexpr there
GEMM_DTYPES = DTYPES if torch.bfloat16 in DTYPES else DTYPES + [torch.bfloat16]


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _ids(T, k, E, g):
    """Random distinct experts per token."""
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)


def _offsets(sizes):
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


# ----------------------------------------------------------------------------------------------
# routing metadata
# ----------------------------------------------------------------------------------------------
def _random_ids(T, k, E, seed):
    return lambda: _ids(T, k, E, torch.Generator().manual_seed(seed))


ROUTING_CASES = {  # name -> (group ids factory, G, capacity)
    # 150 slots span several routing blocks (64 per program under the interpreter)
    **{f"random-cap{cap}": (_random_ids(50, 3, 7, 0), 7, cap) for cap in (None, 0, 1, 13, 1000)},
    "one-group": (lambda: torch.zeros(33, 2, dtype=torch.int64, device=DEVICE), 5, None),
    "one-group-cap7": (lambda: torch.zeros(33, 2, dtype=torch.int64, device=DEVICE), 5, 7),
    "single-token": (lambda: torch.tensor([[3]], device=DEVICE), 4, None),
    "top_k-equals-groups": (_random_ids(9, 6, 6, 1), 6, None),
    # negative ids are not routed; groups >= 2 receive nothing; non power-of-two G
    "holes": (lambda: torch.randint(-1, 2, (41, 2), generator=torch.Generator().manual_seed(2)).to(DEVICE), 11, None),
    "int32-40-groups-cap2": (
        lambda: torch.randint(0, 40, (70, 2), generator=torch.Generator().manual_seed(3)).to(DEVICE).to(torch.int32),
        40, 2),
}


@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_metadata_matches_loop(case):
    make, G, capacity = ROUTING_CASES[case]
    ids = make()
    got = routing_metadata(ids, G, capacity=capacity)
    want = routing_metadata_reference(ids.cpu(), G, capacity)
    for name, a, b in zip(("counts", "offsets", "slot_pos", "sorted_slot"), got, want):
        assert a.dtype == torch.int32, f"{name} ({case})"
        assert a.cpu().tolist() == b.tolist(), f"{name} ({case}: G={G}, capacity={capacity})"


def test_routing_metadata_without_slots():
    counts, offsets, slot_pos, sorted_slot = routing_metadata(torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 3)
    assert counts.tolist() == [0, 0, 0] and offsets.tolist() == [0, 0, 0, 0] and slot_pos.numel() == 0


# ----------------------------------------------------------------------------------------------
# permute / combine
# ----------------------------------------------------------------------------------------------
def _permute_reference(x, sorted_slot, k):
    out = torch.zeros(sorted_slot.numel(), x.shape[1], dtype=torch.float64)
    for p, s in enumerate(sorted_slot.tolist()):
        if s >= 0:
            out[p] = x[s // k].double().cpu()
    return out


def _combine_reference(yd, wd, pos, T, k, H):
    rows = []
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float64)
        for j in range(k):
            if pos[t * k + j] >= 0:
                acc = acc + wd[t, j] * yd[pos[t * k + j]]
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("capacity", [None, 12], ids=lambda c: f"cap{c}")
@pytest.mark.parametrize("top_k", [1, 3], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_permute_combine_and_backward(dtype, top_k, capacity):
    g = torch.Generator().manual_seed(1)
    T, k, E, H = 29, top_k, 6, 37
    tag = f"{_name(dtype)} k={k} capacity={capacity}"
    ids = _ids(T, k, E, g)
    _, _, slot_pos, sorted_slot = routing_metadata(ids, E, capacity=capacity)
    if capacity is not None and k == 3:
        assert (slot_pos < 0).any(), f"the case must drop slots ({tag})"
    base = randn(T, 2 * H, dtype=dtype, generator=g)
    x = base[:, 1::2]  # a strided view: the kernel reads it in place
    out = poison((T * k, H), dtype)
    permute(x, sorted_slot, k, out=out)
    assert_close(out, _permute_reference(x, sorted_slot.cpu(), k), dtype, msg=f"permute {tag}")
    # combine: fp32 sum of weighted rows, dropped slots add nothing
    y = randn(T * k, H, dtype=dtype, generator=g)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    got = combine(y, slot_pos, w, k, out=poison((T, H), dtype))
    yd = y.double().cpu().requires_grad_()
    wd = w.double().cpu().requires_grad_()
    pos = slot_pos.cpu().tolist()
    ref = _combine_reference(yd, wd, pos, T, k, H)
    assert_close(got, ref, dtype, msg=f"combine {tag}")
    go = randn(T, H, dtype=dtype, generator=g)
    (ref * go.double().cpu()).sum().backward()
    gy, gw = combine_backward(go, y, w, sorted_slot, k)
    assert_close(gy, yd.grad, dtype, msg=f"combine backward: grad of expert outputs ({tag})")
    # grad_w = <grad_out, y> sums H products of inputs rounded to dtype
    assert_close(gw, wd.grad, dtype, msg=f"combine backward: grad of routing weights ({tag})")
    # permute's backward is combine without weights: sum of the k slot gradients of each token
    gsum = combine(y, slot_pos, None, k, out=poison((T, H), torch.float32))
    sel = [[p for p in pos[t * k:(t + 1) * k] if p >= 0] for t in range(T)]
    ref_sum = torch.stack([y.double().cpu()[s].sum(0) if s else torch.zeros(H, dtype=torch.float64) for s in sel])
    assert_close(gsum, ref_sum, dtype, msg=f"permute backward ({tag})")


# ----------------------------------------------------------------------------------------------
# grouped GEMM
# ----------------------------------------------------------------------------------------------
# groups of size 0, 1, 17, 0, 33, 5 over 2 cycles of the 4 experts (group g -> expert g % 4),
# then 7 tail rows that belong to no group
FWD_OFFS = _offsets([0, 1, 17, 0, 33, 5, 0, 9])
FWD_M = FWD_OFFS[-1] + 7


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "none"])
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
def test_grouped_matmul_forward(dtype, activation):
    g = torch.Generator().manual_seed(2)
    E, H, Fd = 4, 36, 20
    offs, M = FWD_OFFS, FWD_M
    x = randn(M, 2 * H, dtype=dtype, generator=g)[:, ::2]  # strided rows and columns, read in place
    glu = activation == "swiglu"
    w = randn(E, (2 if glu else 1) * Fd, H, dtype=dtype, generator=g, scale=H ** -0.5)
    pre = poison((M, w.shape[1]), dtype)
    out = grouped_matmul(x, w, torch.tensor(offs, device=DEVICE), activation=activation, preact_out=pre,
                         out=poison((M, Fd), dtype))
    tag = f"{_name(dtype)} {activation}"
    assert_close(out, grouped_matmul_reference(x, w, offs, activation=activation), dtype, msg=f"grouped {tag}")
    assert_close(pre, grouped_matmul_reference(x, w, offs), dtype, msg=f"preact {tag}")


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=_name)
def test_grouped_matmul_layouts(dtype):
    g = torch.Generator().manual_seed(5)
    E, H, Fd = 4, 36, 20
    offs, M = FWD_OFFS, FWD_M
    x = randn(M, 2 * H, dtype=dtype, generator=g)[:, ::2]
    # the kn layout and a transposed view (no copy) give the same product
    w_nk = randn(E, Fd, H, dtype=dtype, generator=g)
    ref = grouped_matmul_reference(x, w_nk, offs)
    got_view = grouped_matmul(x, w_nk.transpose(1, 2), offs, weight_layout="kn")
    assert_close(got_view, ref, dtype, msg=f"kn view ({_name(dtype)})")
    # a single group covering every row
    one = grouped_matmul(x, w_nk[:1], [0, M], out=poison((M, Fd), dtype))
    assert_close(one, grouped_matmul_reference(x, w_nk[:1], [0, M]), dtype, msg=f"one group ({_name(dtype)})")


def test_grouped_matmul_vs_torch_grouped_mm():
    # torch's CPU grouped mm wants 16-byte aligned strides: fp32 with K, N multiples of 4
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        pytest.skip("this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    g = torch.Generator().manual_seed(3)
    E, Kd, N = 3, 28, 20
    offs = [0, 11, 11, 30]
    x = randn(30, Kd, generator=g)
    w_kn = randn(E, Kd, N, generator=g)
    ours = grouped_matmul(x, w_kn, offs, weight_layout="kn", out=poison((30, N), torch.float32))
    theirs = fn(x.cpu(), w_kn.cpu(), offs=torch.tensor(offs[1:], dtype=torch.int32))
    assert_close(ours, theirs.double(), torch.float32, msg="vs torch grouped_mm")


@pytest.fixture
def grouped_launches(monkeypatch):
    """The interpreter's launches of the grouped GEMM kernel, ``[(grid, flags)]`` (compiled ones are
    autotuned: skipped there)."""
    from fusedpar.kernels import grouped_gemm as gg
    if not INTERPRETED:
        pytest.skip("the interpreter's launches are spied on (compiled ones are autotuned)")
    return spy_launches(monkeypatch, gg, "_grouped_gemm_kernel")


def _assert_activation_backward(got, pre, gy, w_kn, offs, dt, msg):
    """``grouped_matmul_dact``'s output against float64: the SwiGLU backward of ``pre`` times the
    grouped product ``gy @ w_kn`` ("kn" weights), zeros in the tail rows after the last group."""
    pre_d = pre.double().cpu().requires_grad_()
    (activation_reference(pre_d, "swiglu") * grouped_matmul_reference(gy, w_kn, offs, weight_layout="kn")).sum().backward()
    ref = pre_d.grad.clone()
    ref[offs[-1]:] = 0
    assert_close(got, ref, dt, msg=f"{msg} fused activation backward")


@pytest.mark.parametrize("path", ["auto", "pointer"])
def test_grouped_load_paths(path, grouped_launches):
    """Both load paths of the grouped forward and data gradient (kernels/gemm_loads.py): "auto"
    loads x and the experts' weights by TMA (fp16 rows of 64 / 256 bytes; the "kn" weights of the
    data gradient through the 3-D descriptor), in persistent programs
    (3 under the interpreter: the tile loop wraps), over empty and one-row groups and a zero tail."""
    from fusedpar.kernels import gemm_loads
    launches = grouped_launches
    g, dt = torch.Generator().manual_seed(31), torch.float16
    E, H, Fd, offs = 3, 32, 24, _offsets([5, 0, 18, 1, 0, 3])
    M = offs[-1] + 3
    x = randn(M, H, dtype=dt, generator=g)
    w1 = randn(E, 2 * Fd, H, dtype=dt, generator=g, scale=H ** -0.5)
    b1 = randn(E, 2 * Fd, dtype=dt, generator=g)
    gy = randn(M, 128, dtype=dt, generator=g)
    w2 = randn(E, 128, Fd, dtype=dt, generator=g, scale=Fd ** -0.5)  # "kn": [E, K = 128, N = F]
    pre = poison((M, 2 * Fd), dt)
    with gemm_loads.load_path_set(path):
        out = grouped_matmul(x, w1, offs, activation="swiglu", bias=b1, preact_out=pre, out=poison((M, Fd), dt))
        got = grouped_matmul_dact(gy, w2, offs, pre, activation="swiglu")
    ref_pre = grouped_matmul_reference(x, w1, offs, bias=b1)
    assert_close(pre, ref_pre, dt, msg=f"{path} pre-activation")
    assert_close(out, grouped_matmul_reference(x, w1, offs, activation="swiglu", bias=b1), dt, msg=f"{path} swiglu")
    _assert_activation_backward(got, pre, gy, w2, offs, dt, path)
    assert [flags["TMA"] for _, flags in launches] == [path == "auto"] * 2
    if path == "auto":
        assert all(grid == (3, 1) for grid, _ in launches)


@pytest.mark.parametrize("path", ["auto", "pointer"])
def test_grouped_kn_weights_stop_at_each_experts_k_edge(path, grouped_launches):
    """"kn" weights ``[E, K, N]`` with K = 40, not a multiple of the 32-deep step: by TMA through
    a 3-D descriptor (the expert an index of its own), so the last step of expert 0 reads zeros
    past its K rows, not expert 1's first row, here infinite (an empty group, so no output of its
    own is infinite); the gated forward (gate and up halves, each through the descriptor) with its
    tail rows zeroed and the fused activation backward, against float64, over a wrapping
    persistent tile loop."""
    from fusedpar.kernels import gemm_loads
    launches = grouped_launches
    g, dt = torch.Generator().manual_seed(41), torch.float16
    E, K, N, offs = 3, 40, 24, _offsets([37, 0, 18])
    M = offs[-1] + 2
    x = randn(M, K, dtype=dt, generator=g)
    w = randn(E, K, 2 * N, dtype=dt, generator=g, scale=K ** -0.5)  # gate and up halves
    w[1, 0] = float("inf")
    w_down = w[:, :, :N]  # the backward's [E, K, N] (rows of 2N: a view, not a copy)
    pre = randn(M, 2 * N, dtype=dt, generator=g)
    with gemm_loads.load_path_set(path):
        out = grouped_matmul(x, w, offs, weight_layout="kn", activation="swiglu", out=poison((M, N), dt))
        got = grouped_matmul_dact(x, w_down, offs, pre, activation="swiglu")
    ref = grouped_matmul_reference(x, w, offs, weight_layout="kn", activation="swiglu")
    assert_close(out[:offs[-1]], ref[:offs[-1]], dt, msg=path)
    assert (out[offs[-1]:] == 0).all(), "the tail rows after the last group are zeroed"
    _assert_activation_backward(got, pre, x, w_down, offs, dt, path)
    assert [flags["TMA"] for _, flags in launches] == [path == "auto"] * 2
    if path == "auto":
        assert not any(flags["W_KMAJOR"] for _, flags in launches)


@pytest.mark.parametrize("path", ["auto", "pointer"])
def test_grouped_weights_sliced_per_expert(path, grouped_launches):
    """Each expert's weight a slice of a larger one (a shard of ``[E, F, H]`` along F, as a
    tensor-parallel expert holds): experts further apart than their rows. "auto" loads them by
    TMA through 3-D descriptors with the expert stride (``"nk"``: ``[E, 2N, H]`` out of 80 rows;
    ``"kn"``: ``[E, K, N]`` out of 56 K rows); the row after each expert's slice is infinite, so a
    descriptor stepping past an expert's edge, or assuming the experts back to back, shows as inf /
    NaN or wrong numbers. Gated forward (gate and up halves) and the fused activation backward,
    against float64, tail rows zeroed; one expert with a stride a descriptor could not take."""
    from fusedpar.kernels import gemm_loads
    launches = grouped_launches
    g, dt = torch.Generator().manual_seed(43), torch.float16
    E, H, N, K, offs = 3, 40, 24, 40, _offsets([29, 0, 18, 5])
    M = offs[-1] + 2
    w_full = randn(E, 80, H, dtype=dt, generator=g, scale=H ** -0.5)
    w_full[:, 8 + 2 * N] = float("inf")
    w = w_full[:, 8:8 + 2 * N]  # nk, expert stride 80 * H > 2N * H
    w_kn_full = randn(E, 56, N, dtype=dt, generator=g, scale=K ** -0.5)
    w_kn_full[:, 8 + K] = float("inf")
    w_kn = w_kn_full[:, 8:8 + K]  # kn, expert stride 56 * N > K * N
    x, gy = randn(M, H, dtype=dt, generator=g), randn(M, K, dtype=dt, generator=g)
    pre = randn(M, 2 * N, dtype=dt, generator=g)
    with gemm_loads.load_path_set(path):
        out = grouped_matmul(x, w, offs, activation="swiglu", out=poison((M, N), dt))
        got = grouped_matmul_dact(gy, w_kn, offs, pre, activation="swiglu")
    ref = grouped_matmul_reference(x, w, offs, activation="swiglu")
    assert_close(out[:offs[-1]], ref[:offs[-1]], dt, msg=path)
    assert (out[offs[-1]:] == 0).all(), "the tail rows after the last group are zeroed"
    _assert_activation_backward(got, pre, gy, w_kn, offs, dt, path)
    # one expert: its stride is never stepped, whatever it is (a descriptor's must be aligned)
    w_one = w_kn[:1].as_strided((1, K, N), (3, N, 1))
    with gemm_loads.load_path_set(path):
        one = grouped_matmul(gy, w_one, _offsets([M]), weight_layout="kn")
    assert_close(one, gy.double() @ w_one[0].double(), dt, msg=f"{path} one expert")
    tma = path == "auto"
    assert [(f["TMA"], f["W_KMAJOR"], f["W_STACKED"]) for _, f in launches] == [
        (tma, True, not tma), (tma, not tma, not tma), (tma, not tma, not tma)]


def test_grouped_gated_kn_weights_with_an_unaligned_up_half(grouped_launches):
    """A gated forward on "kn" weights ``[E, K, 2N]`` loads each expert's up half N columns after
    its gate, a box that must start on a 16-byte boundary: N = 20 fp16 (40 bytes) keeps pointer
    loads, N = 24 takes TMA; both against float64."""
    launches = grouped_launches
    g, dt = torch.Generator().manual_seed(47), torch.float16
    E, K, offs = 2, 32, _offsets([9, 0, 14])
    x = randn(offs[-1], K, dtype=dt, generator=g)
    for n in (20, 24):
        w = randn(E, K, 2 * n, dtype=dt, generator=g, scale=K ** -0.5)
        out = grouped_matmul(x, w, offs, weight_layout="kn", activation="swiglu")
        ref = grouped_matmul_reference(x, w, offs, weight_layout="kn", activation="swiglu")
        assert_close(out, ref, dt, msg=str(n))
    assert [f["TMA"] for _, f in launches] == [False, True]


def test_grouped_pointer_loads_for_expanded_rows_and_an_empty_contraction(grouped_launches):
    """"auto" keeps pointer loads where a tensor descriptor cannot hold the operands: x expanded
    (every row the same memory, stride 0), an expert's weight expanded, and K = 0 with a bias (the
    epilogue alone; a descriptor of no columns); the numbers are right."""
    launches = grouped_launches
    g, dt = torch.Generator().manual_seed(37), torch.float16
    E, H, Fd, offs = 2, 32, 24, _offsets([5, 0, 9])
    M = offs[-1] + 2
    x, w = randn(M, H, dtype=dt, generator=g), randn(E, Fd, H, dtype=dt, generator=g, scale=H ** -0.5)
    b = randn(E, Fd, dtype=dt, generator=g)
    cases = [(randn(1, H, dtype=dt, generator=g).expand(M, H), w),
             (x, randn(1, 1, H, dtype=dt, generator=g).expand(1, Fd, H)),
             (x[:, :0], w[:, :, :0]), (x, w)]
    for xi, wi in cases:
        out = grouped_matmul(xi, wi, offs, bias=b[:wi.shape[0]], out=poison((M, Fd), dt))
        assert_close(out, grouped_matmul_reference(xi, wi, offs, bias=b[:wi.shape[0]]), dt, msg=str(xi.shape))
    assert [flags["TMA"] for _, flags in launches] == [False, False, False, True]  # (the plain operands: TMA)


BWD_SIZES = [5, 0, 18, 1, 0, 3]  # two cycles over 3 experts, with empty groups
BWD_OFFS = _offsets(BWD_SIZES)
BWD_M = BWD_OFFS[-1] + 3  # tail rows


@pytest.mark.parametrize("activation", ["swiglu", "relu", "silu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_grouped_dact(dtype, activation):
    g = torch.Generator().manual_seed(4)
    E, H, Fd = 3, 20, 24
    offs, M = BWD_OFFS, BWD_M
    glu = activation in ("swiglu", "geglu")
    n1 = (2 if glu else 1) * Fd
    pre = randn(M, n1, dtype=dtype, generator=g)
    w2 = randn(E, H, Fd, dtype=dtype, generator=g, scale=Fd ** -0.5)
    gy = randn(M, H, dtype=dtype, generator=g)
    got = grouped_matmul_dact(gy, w2, offs, pre, activation=activation)
    pre_d = pre.double().cpu().requires_grad_()
    dh = grouped_matmul_reference(gy, w2, offs, weight_layout="kn")  # gy @ W2_e per group
    (activation_reference(pre_d, activation) * dh).sum().backward()
    ref = pre_d.grad.clone()
    ref[offs[-1]:] = 0
    assert_close(got, ref, dtype, msg=f"fused activation backward ({_name(dtype)} {activation})")


def _wgrad_reference(dy, x, E_w, init=None):
    ref = torch.zeros(E_w, dy.shape[1], x.shape[1], dtype=torch.float64) if init is None else init
    for grp in range(len(BWD_SIZES)):
        a, b = BWD_OFFS[grp], BWD_OFFS[grp + 1]
        ref[grp % E_w] += dy[a:b].double().cpu().t() @ x[a:b].double().cpu()
    return ref


@pytest.mark.parametrize("num_experts", [3, 6, 7], ids=lambda e: f"E{e}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_grouped_wgrad(dtype, num_experts):
    """Per expert, summed over every group that maps to it; empty experts give zeros."""
    g = torch.Generator().manual_seed(6)
    H, Fd = 20, 24
    x = randn(BWD_M, H, dtype=dtype, generator=g)
    dy = randn(BWD_M, Fd, dtype=dtype, generator=g)
    got = grouped_wgrad(dy, x, BWD_OFFS, num_experts, out=poison((num_experts, Fd, H), dtype))
    assert_close(got, _wgrad_reference(dy, x, num_experts), dtype, msg=f"grouped wgrad E={num_experts} "
                 f"({_name(dtype)})")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_grouped_wgrad_accumulate(dtype):
    g = torch.Generator().manual_seed(7)
    H, Fd = 20, 24
    x = randn(BWD_M, H, dtype=dtype, generator=g)
    dy = randn(BWD_M, Fd, dtype=dtype, generator=g)
    acc = randn(3, Fd, H, dtype=torch.float32, generator=g)
    ref = _wgrad_reference(dy, x, 3, init=acc.double().cpu().clone())
    grouped_wgrad(dy, x, BWD_OFFS, 3, out=acc, accumulate=True)
    assert_close(acc, ref, dtype, msg=f"grouped wgrad accumulate (fp32 buffer, {_name(dtype)})")


# ----------------------------------------------------------------------------------------------
# fp8 grouped GEMMs (e4m3 operands, fp32 scales): against the float64 product of the dequantised
# operands (fp32 accumulation; on a GPU plus the fp8 tensor cores' in-step error,
# tests/test_fp8.py mma_error_bound) and within the quantisation bound of the unquantised one
# ----------------------------------------------------------------------------------------------
fp8_device = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                                reason="fp8 needs compute capability >= 8.9")
FP8_SCALINGS = {"rowwise": ("row", "row"), "blockwise": ("tile", "block")}  # (rows of x, weights)


def _deq(q, s, granularity):
    """Dequantised values and each element's scale (float64, CPU); ``q`` 2-D, or 3-D per expert."""
    from fusedpar.kernels import dequantize_e4m3
    if q.dim() == 3:
        pairs = [_deq(q[e], s[e], granularity) for e in range(q.shape[0])]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    q, s = q.cpu(), s.cpu()
    return dequantize_e4m3(q, s, granularity), dequantize_e4m3(torch.ones_like(q), s, granularity)


def _grouped_ref(xd, sx, wd, sw, offs, xq=None, wq=None):
    """Per group ``g`` (expert ``g % E``): ``(xd @ wd_e^T, the quantisation bound of it against the
    unquantised product of (xd, wd) as the unquantised values, the fp8 MMA bound)``, float64."""
    from test_fp8 import REL_BOUND, SUBNORMAL_BOUND, mma_error_bound
    M, N = xd.shape[0], wd.shape[1]
    ref, bound, mma = (torch.zeros(M, N, dtype=torch.float64) for _ in range(3))
    for g in range(len(offs) - 1):
        a, b, e = offs[g], offs[g + 1], g % wd.shape[0]
        ref[a:b] = xd[a:b] @ wd[e].t()
        dx = REL_BOUND * xd[a:b].abs() + SUBNORMAL_BOUND * sx[a:b]
        dw = REL_BOUND * wd[e].abs() + SUBNORMAL_BOUND * sw[e]
        bound[a:b] = dx @ wd[e].abs().t() + xd[a:b].abs() @ dw.t() + dx @ dw.t()
        if xq is not None:
            mma[a:b] = mma_error_bound(xq[a:b].cpu().double(), sx[a:b], wq[e].cpu().double(), sw[e])
    return ref, bound, mma


@fp8_device
@pytest.mark.parametrize("scaling", list(FP8_SCALINGS))
def test_fp8_grouped_matmul(scaling):
    """The MoE up projection (SwiGLU with expert biases, the pre-activation stored) and the down
    projection (plain; the "kn" layout of the same weights too) on e4m3 operands: groups of 0, 1,
    17, 0, 33 rows over 3 experts, a 7-row zero tail, K = 160 (a ragged last 128-block)."""
    from test_fp8 import ACC_RTOL, assert_within
    from fusedpar.kernels import quantize_e4m3
    ga, gw = FP8_SCALINGS[scaling]
    g = torch.Generator().manual_seed(21)
    E, H, Fd, offs = 3, 160, 24, _offsets([0, 1, 17, 0, 33])
    M = offs[-1] + 7
    x = randn(M, H, generator=g)
    w1 = randn(E, 2 * Fd, H, generator=g, scale=H ** -0.5)
    w1[1, 5] = 0.0  # a zero weight row
    b1 = randn(E, 2 * Fd, generator=g)
    (xq, xs), (wq, ws) = quantize_e4m3(x, ga), quantize_e4m3(w1, gw)
    xd, sx = _deq(xq, xs, ga)
    wd, sw = _deq(wq, ws, gw)
    ref, _, mma = _grouped_ref(xd, sx, wd, sw, offs, xq, wq)
    bias = torch.zeros(M, 2 * Fd, dtype=torch.float64)
    for i in range(len(offs) - 1):
        bias[offs[i]:offs[i + 1]] = b1[i % E].double().cpu()
    ref = ref + bias
    scale = ref.pow(2).mean().sqrt().item()
    tol = ACC_RTOL * (ref.abs() + scale) + mma
    kw = dict(activation="swiglu", bias=b1, x_scale=xs, weight_scale=ws, scaling=scaling)
    pre, out = poison((M, 2 * Fd), torch.float32), poison((M, Fd), torch.float32)
    grouped_matmul(xq, wq, offs, preact_out=pre, out=out, **kw)
    assert_within(pre, ref, tol, f"{scaling} pre-activation")
    # the epilogue on the fp32 accumulator: SwiGLU of the stored pre-activation; zeros on the tail
    act = activation_reference(pre.cpu().double(), "swiglu")
    act_tol = ACC_RTOL * (act.abs() + act.pow(2).mean().sqrt())
    assert_within(out, act, act_tol, f"{scaling} swiglu")
    assert (out[offs[-1]:] == 0).all() and (pre[offs[-1]:] == 0).all()
    # bf16 outputs (the default): one bf16 rounding of each (the interpreter's made to round to nearest even)
    pre16 = poison((M, 2 * Fd), torch.bfloat16)
    out16 = grouped_matmul(xq, wq, offs, preact_out=pre16, **kw)
    assert out16.dtype == torch.bfloat16
    assert_within(pre16, ref, 2.0 ** -8 * ref.abs() + tol, f"{scaling} bf16 pre-activation")
    assert_within(out16, act, 2.0 ** -8 * act.abs() + act_tol, f"{scaling} bf16 swiglu")
    # against the unquantised product: within the quantisation bound of every element
    exact, bound, _ = _grouped_ref(x.cpu().double(), sx, w1.cpu().double(), sw, offs)
    err = (pre.cpu().double() - exact - bias).abs()
    assert (err <= bound + tol).all() and err.max() > 1e-4 * scale, (err - bound).max()
    # a down projection (40 outputs): plain, in both weight layouts (a transposed view of the same bytes)
    w2 = randn(E, 40, Fd, generator=g, scale=Fd ** -0.5)
    (hq, hs), (w2q, w2s) = quantize_e4m3(out, ga), quantize_e4m3(w2, gw)
    hd, sh = _deq(hq, hs, ga)
    w2d, sw2 = _deq(w2q, w2s, gw)
    ref2, _, mma2 = _grouped_ref(hd, sh, w2d, sw2, offs, hq, w2q)
    tol2 = ACC_RTOL * (ref2.abs() + ref2.pow(2).mean().sqrt()) + mma2
    y = grouped_matmul(hq, w2q, offs, out=poison((M, 40), torch.float32), x_scale=hs, weight_scale=w2s, scaling=scaling)
    assert_within(y, ref2, tol2, f"{scaling} down")
    y_kn = grouped_matmul(hq, w2q.transpose(1, 2).contiguous(), offs, weight_layout="kn", out_dtype=torch.float32,
                          x_scale=hs, weight_scale=w2s, scaling=scaling)
    assert_within(y_kn, ref2, tol2, f"{scaling} down, kn layout")


@fp8_device
@pytest.mark.parametrize("scaling", list(FP8_SCALINGS))
def test_fp8_grouped_dact(scaling):
    """The SwiGLU backward fused into the fp8 data-gradient GEMM: ``grad`` quantised per row, the
    down projection's ``W2^T [E, F, H]`` (a quantised transposed view) per row / 128x128 blocks;
    the result in the pre-activation's dtype (fp32, and bf16)."""
    from test_fp8 import ACC_RTOL, assert_within
    from fusedpar.kernels import quantize_e4m3
    ga, gw = FP8_SCALINGS[scaling]
    g = torch.Generator().manual_seed(22)
    E, H, Fd, offs = 3, 160, 24, BWD_OFFS
    M = BWD_M
    gy = randn(M, H, generator=g)
    w2 = randn(E, H, Fd, generator=g, scale=Fd ** -0.5)
    (gq, gs), (wq, ws) = quantize_e4m3(gy, ga), quantize_e4m3(w2.transpose(1, 2), gw)
    gd, sg = _deq(gq, gs, ga)
    wd, sw = _deq(wq, ws, gw)
    dh, _, mma = _grouped_ref(gd, sg, wd, sw, offs, gq, wq)
    for dtype in (torch.float32, torch.bfloat16):
        pre = randn(M, 2 * Fd, dtype=dtype, generator=g)
        got = grouped_matmul_dact(gq, wq, offs, pre, weight_layout="nk", grad_scale=gs, weight_scale=ws,
                                  scaling=scaling)
        assert got.dtype == dtype
        pd = pre.cpu().double().requires_grad_()
        (activation_reference(pd, "swiglu") * dh).sum().backward()
        ref = pd.grad.clone()
        pf = pre.cpu().double().requires_grad_()  # the factors of dh in each half (mma's share scales with them)
        activation_reference(pf, "swiglu").sum().backward()
        tol = ACC_RTOL * (ref.abs() + ref.pow(2).mean().sqrt()) + pf.grad.abs() * torch.cat([mma, mma], 1)
        if dtype == torch.bfloat16:
            tol = tol + 2.0 ** -8 * ref.abs()
        assert_within(got, ref, tol, f"{scaling} fp8 dact ({dtype})")
        assert (got[offs[-1]:] == 0).all()


@fp8_device
@pytest.mark.parametrize("granularity", ["row", "tile"])
def test_fp8_grouped_wgrad(granularity):
    """The weight gradient from operands quantised along the rows per group (one scale per group,
    or per 128-row tile): groups of 0, 1, 130, 0, 140 and 9 rows over 4 experts (expert 3's only
    group is empty: exact zeros), fp32 into a NaN-poisoned buffer, accumulating into one, and
    within the quantisation bound of the unquantised product."""
    from test_fp8 import ACC_RTOL, GROUP_OFFSETS, REL_BOUND, SUBNORMAL_BOUND, assert_within, mma_error_bound
    from fusedpar.kernels.fp8 import quantize_e4m3_groups
    g = torch.Generator().manual_seed(23)
    offs, E, N, K = GROUP_OFFSETS, 4, 40, 24
    M = offs[-1] + 5
    dy, x = randn(M, N, generator=g), randn(M, K, generator=g)
    (dq, ds), (xq, xs) = (quantize_e4m3_groups(t, torch.tensor(offs, device=DEVICE), granularity) for t in (dy, x))
    ref, bound, mma = (torch.zeros(E, N, K, dtype=torch.float64) for _ in range(3))
    for i in range(len(offs) - 1):
        for a in range(offs[i], offs[i + 1], 128):  # each 128-row tile of the group: one scale column
            b, t = min(a + 128, offs[i + 1]), offs[i] // 128 + i + (a - offs[i]) // 128
            c = 16 * (offs[i] // 16 + i) + a - offs[i]  # the rows' columns of q (kernels/fp8.py group_columns)
            qa, qb = dq[:, c:c + b - a].cpu(), xq[:, c:c + b - a].cpu()
            sa, sb = (s[:, t:t + 1].cpu().double().expand(-1, b - a) for s in (ds, xs))
            da, db = qa.double() * sa, qb.double() * sb
            ref[i % E] += da @ db.t()
            ea = REL_BOUND * dy[a:b].t().cpu().double().abs() + SUBNORMAL_BOUND * sa
            eb = REL_BOUND * x[a:b].t().cpu().double().abs() + SUBNORMAL_BOUND * sb
            bound[i % E] += ea @ db.abs().t() + da.abs() @ eb.t() + ea @ eb.t()
            mma[i % E] += mma_error_bound(qa.double(), sa, qb.double(), sb)
    scale = ref.pow(2).mean().sqrt().item()
    kw = dict(grad_scale=ds, x_scale=xs)
    got = grouped_wgrad(dq.t(), xq.t(), offs, E, out=poison((E, N, K), torch.float32), **kw)
    assert_within(got, ref, ACC_RTOL * (ref.abs() + scale) + mma, f"fp8 wgrad {granularity}")
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    acc = randn(E, N, K, generator=g)
    want = ref + acc.cpu().double()
    grouped_wgrad(dq.t(), xq.t(), offs, E, out=acc, accumulate=True, **kw)
    assert_within(acc, want, ACC_RTOL * (want.abs() + scale) + mma, f"fp8 wgrad accumulate {granularity}")
    exact = torch.zeros(E, N, K, dtype=torch.float64)
    for i in range(len(offs) - 1):
        exact[i % E] += dy[offs[i]:offs[i + 1]].t().cpu().double() @ x[offs[i]:offs[i + 1]].cpu().double()
    err = (got.cpu().double() - exact).abs()
    assert (err <= bound + ACC_RTOL * scale + mma).all() and err.max() > 1e-4 * scale, (err - bound).max()


@fp8_device
def test_fp8_grouped_bad_input():
    from fusedpar.kernels import quantize_e4m3
    x, w = torch.randn(8, 256, device=DEVICE), torch.randn(2, 12, 256, device=DEVICE)
    (xq, xs), (wq, ws) = quantize_e4m3(x), quantize_e4m3(w)
    with pytest.raises(TypeError, match="x_scale must be a torch.Tensor"):
        grouped_matmul(xq, wq, [0, 8], weight_scale=ws)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(2, 12\)"):
        grouped_matmul(xq, wq, [0, 8], x_scale=xs, weight_scale=ws[:, :11])
    with pytest.raises(ValueError, match=r"x_scale must have shape \(8, 2\)"):
        grouped_matmul(xq, wq, [0, 8], x_scale=xs, weight_scale=ws, scaling="blockwise")
    with pytest.raises(ValueError, match="x_scale is for float8_e4m3fn operands, got x of dtype torch.float32"):
        grouped_matmul(x, w, [0, 8], x_scale=xs)
    with pytest.raises(TypeError, match="weight must have the same dtype as x"):
        grouped_matmul(xq, w, [0, 8], x_scale=xs, weight_scale=ws)
    with pytest.raises(ValueError, match="scaling must be one of"):
        grouped_matmul(xq, wq, [0, 8], x_scale=xs, weight_scale=ws, scaling="tensorwise")
    with pytest.raises(TypeError, match="grad_scale must have dtype torch.float32"):
        grouped_matmul_dact(xq, wq.transpose(1, 2), [0, 8], torch.randn(8, 24, device=DEVICE), grad_scale=xs.half(),
                            weight_scale=ws)
    with pytest.raises(ValueError, match=r"x_scale must have shape \(256, 3\)"):  # group_tiles(8, 2) columns
        grouped_wgrad(xq[:, :12], xq, [0, 3, 8], 2, grad_scale=torch.ones(12, 3, device=DEVICE),
                      x_scale=torch.ones(256, 2, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
def test_kernel_errors():
    x = torch.randn(8, 16, device=DEVICE)
    w = torch.randn(2, 12, 16, device=DEVICE)
    with pytest.raises(ValueError, match="inner dimensions differ: x has K=16"):
        grouped_matmul(x, torch.randn(2, 12, 15, device=DEVICE), [0, 4, 8])
    with pytest.raises(ValueError, match="offsets must start at 0, be non-decreasing"):
        grouped_matmul(x, w, [0, 6, 4])
    with pytest.raises(ValueError, match="end at most at M=8"):
        grouped_matmul(x, w, [0, 4, 9])
    with pytest.raises(TypeError, match="offsets must have dtype torch.int32 or torch.int64"):
        grouped_matmul(x, w, torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="weight must be 3-D"):
        grouped_matmul(x, w[0], [0, 8])
    with pytest.raises(TypeError, match="weight must have the same dtype as x"):
        grouped_matmul(x, w.half(), [0, 8])
    with pytest.raises(ValueError, match="activation 'swiglu' needs an even number"):
        grouped_matmul(x, torch.randn(2, 7, 16, device=DEVICE), [0, 8], activation="swiglu")
    with pytest.raises(ValueError, match=r"out must have shape \(8, 12\)"):
        grouped_matmul(x, w, [0, 8], out=torch.empty(8, 11, device=DEVICE))
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        routing_metadata(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), 0)
    with pytest.raises(TypeError, match="group_ids must have dtype torch.int32 or torch.int64"):
        routing_metadata(torch.zeros(3, 1, device=DEVICE), 2)
    with pytest.raises(ValueError, match="sorted_slot must have 16 elements"):
        permute(x, torch.zeros(15, dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match=r"weights must have shape \(4, 2\)"):
        combine(x, torch.zeros(8, dtype=torch.int32, device=DEVICE), torch.ones(4, 3, device=DEVICE), 2)


BAD_OFFSETS = {  # name -> (offsets for 8 rows, expected message)
    "start-not-0": ([1, 4, 8], "offsets must start at 0"),
    "decreasing": ([0, 6, 4], "be non-decreasing"),
    "past-the-rows": ([0, 4, 9], "end at most at M=8"),
    "one-entry": ([0], r"offsets must be 1-D with G \+ 1 >= 2 entries"),
}
OFFSET_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("offsets_device", OFFSET_DEVICES)
@pytest.mark.parametrize("case", list(BAD_OFFSETS))
def test_offsets_checked_on_every_device(case, offsets_device):
    """The kernels read offsets unchecked, so every launcher checks them, whatever their device
    (a CUDA tensor was trusted: out-of-bounds reads and writes)."""
    offs, msg = BAD_OFFSETS[case]
    offsets = torch.tensor(offs, dtype=torch.int32, device=offsets_device)
    x = torch.randn(8, 16, device=DEVICE)
    w = torch.randn(2, 12, 16, device=DEVICE)
    with pytest.raises(ValueError, match=msg):
        grouped_matmul(x, w, offsets)
    with pytest.raises(ValueError, match=msg):
        grouped_matmul_dact(torch.randn(8, 12, device=DEVICE), w, offsets, torch.randn(8, 32, device=DEVICE))
    with pytest.raises(ValueError, match=msg):
        grouped_wgrad(torch.randn(8, 12, device=DEVICE), x, offsets, 2)
    with pytest.raises(ValueError, match=msg):
        as_group_offsets(offsets, 8, DEVICE)
    # offsets that are correct by construction may skip the host read
    good = torch.tensor([0, 3, 8], dtype=torch.int32, device=offsets_device)
    assert as_group_offsets(good, 8, DEVICE, check=False).tolist() == [0, 3, 8]


# ----------------------------------------------------------------------------------------------
# edges: empty groups in the weight gradient, 64-bit offsets
# ----------------------------------------------------------------------------------------------
def test_grouped_wgrad_empty_groups_give_exact_zeros():
    """An expert whose groups are all empty (here experts 1 and 3: no rows at all; expert 2's
    only group is empty too) gets exactly zero weight gradient, also over a NaN-poisoned output
    and when accumulating into an existing fp32 buffer (left untouched)."""
    g = torch.Generator().manual_seed(11)
    offs = _offsets([4, 0, 0, 0, 19, 0])  # 6 groups over 4 experts: g % 4 -> 0, 1, 2, 3, 0, 1
    x = randn(23, 20, generator=g)
    dy = randn(23, 24, generator=g)
    got = grouped_wgrad(dy, x, offs, 4, out=poison((4, 24, 20), torch.float32))
    assert not got.isnan().any()
    for e in (1, 2, 3):
        assert torch.equal(got[e], torch.zeros_like(got[e])), f"expert {e} without rows"
    ref0 = dy[:4].double().cpu().t() @ x[:4].double().cpu() + dy[4:].double().cpu().t() @ x[4:].double().cpu()
    assert_close(got[0], ref0, torch.float32, msg="expert 0 (two groups)")
    acc = randn(4, 24, 20, dtype=torch.float32, generator=g)
    before = acc.clone()
    grouped_wgrad(dy, x, offs, 4, out=acc, accumulate=True)
    for e in (1, 2, 3):
        assert torch.equal(acc[e], before[e]), f"accumulate: expert {e} without rows must be left as is"
    # no rows at all (M == 0): every expert is zero
    empty = grouped_wgrad(dy[:0], x[:0], [0, 0, 0], 2, out=poison((2, 24, 20), torch.float32))
    assert torch.equal(empty, torch.zeros_like(empty))


# The kernels' addresses are ``row * stride`` with int32 rows and strides (a launch specialises
# every int argument below 2^31 to i32), so a product must be formed in int64 or it wraps once
# tokens x hidden (or experts x rows, or a transposed buffer's column stride x features) passes
# 2^31. Without a 2^31-element tensor, the check reads the kernels' Triton IR (as generated from
# the source for sm_90, no GPU needed): no 32-bit multiplication may take a scalar argument (a
# stride, a width, an offset such as the gated activation's ``glu_offset``) as an operand.
_INT64_CHECK = textwrap.dedent(
    """
    import re
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton._C.libtriton import ir
    from fusedpar.kernels import grouped_bias as gb, grouped_gemm as gg, moe_permute as mp, moe_routing as mr
    from fusedpar.kernels import moe_topk as mt

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    LINE = re.compile(r"^\\s*(%[\\w.]+) = ([\\w.]+) (.*?) : (.*?) loc")

    def i32_products(fn, const, ptr_types):
        # (the 32-bit products of a scalar argument, the number of fp32 arith.divf: Triton lowers
        # them to div.full.f32 on NVIDIA, up to 2 ulp off)
        names = fn.arg_names
        sig = {n: "constexpr" if n in const else ptr_types.get(n, "*fp32") if n.endswith("_ptr") else
               "fp32" if n == "scale" else "i32" for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs={})
        opts = backend.parse_options({})
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        text = str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(),
                               ctx))
        # values that are a scalar int argument, splatted / broadcast / expanded
        derived = {"%" + n for n in names if n not in const and sig[n] == "i32"}
        bad = []
        for line in text.splitlines():
            m = LINE.match(line)
            if not m:
                continue
            res, op, operands, types = m.groups()
            uses = [o for o in re.findall(r"%[\\w.]+", operands) if o in derived]
            if op in ("tt.splat", "tt.broadcast", "tt.expand_dims") and uses:
                derived.add(res)
            elif op == "arith.muli" and uses and "i64" not in types:
                bad.append(line.strip().split(" loc(")[0])
        approx_div = sum(1 for line in text.splitlines() if (m := LINE.match(line)) and m.group(2) == "arith.divf"
                         and "f32" in m.group(4))
        return bad, approx_div

    gemm = dict(UPCAST=False, INPUT_PRECISION="ieee", G_PAD=8, FP8=False, BLOCKWISE=False, EMULATE=False,
                PROMOTE_K=None, TMA=False, W_KMAJOR=True, W_STACKED=True, BLOCK_M=16, BLOCK_N=32,
                BLOCK_K=32)
    fp8 = dict(gemm, FP8=True, PROMOTE_K=128, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128)
    e4m3 = {n: "*fp8e4nv" for n in ("x_ptr", "w_ptr", "dy_ptr")}
    route = dict(TOPK_GROUP=1, TOP_K=2, K_PAD=2, NORMALIZE=True, BLOCK_T=16, G_PAD=1, EPG_PAD=8)
    idx = {n: "*i32" for n in ("offsets_ptr", "sorted_slot_ptr", "slot_pos_ptr", "counts_ptr", "bad_ptr",
                               "prefix_ptr")}
    idx.update(ids_ptr="*i64")
    cases = {
        "grouped_gemm forward swiglu + pre-activation": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=True, DACT=False, HAS_BIAS=False, **gemm)),
        "grouped_gemm forward swiglu_oai + bias + pre-activation": (gg._grouped_gemm_kernel,
            dict(ACT=4, GLU=True, STORE_AUX=True, DACT=False, HAS_BIAS=True, **gemm)),
        "grouped_gemm dact swiglu": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=False, DACT=True, HAS_BIAS=False, **gemm)),
        "grouped_gemm plain": (gg._grouped_gemm_kernel,
            dict(ACT=0, GLU=False, STORE_AUX=False, DACT=False, HAS_BIAS=False, **gemm)),
        "grouped_gemm TMA swiglu + pre-activation": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=True, DACT=False, HAS_BIAS=False, **dict(gemm, TMA=True, BLOCK_M=64))),
        "grouped_gemm TMA dact swiglu, kn weights": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=False, DACT=True, HAS_BIAS=False,
                 **dict(gemm, TMA=True, W_KMAJOR=False, W_STACKED=False, BLOCK_M=64))),
        "grouped_gemm TMA swiglu, nk weights sliced per expert": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=False, DACT=False, HAS_BIAS=False,
                 **dict(gemm, TMA=True, W_STACKED=False, BLOCK_M=64))),
        "grouped_gemm fp8 blockwise swiglu + bias + pre-activation": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=True, DACT=False, HAS_BIAS=True, **dict(fp8, BLOCKWISE=True)), e4m3),
        "grouped_gemm fp8 rowwise dact swiglu": (gg._grouped_gemm_kernel,
            dict(ACT=3, GLU=True, STORE_AUX=False, DACT=True, HAS_BIAS=False, **fp8), e4m3),
        "grouped_bias_grad": (gb._grouped_bias_grad_kernel, dict(ACCUMULATE=True, BLOCK_M=32, BLOCK_N=64)),
        "grouped_wgrad": (gg._grouped_wgrad_kernel, dict(ACCUMULATE=True, UPCAST=False, INPUT_PRECISION="ieee",
                                                         FP8=False, EMULATE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)),
        "grouped_wgrad fp8": (gg._grouped_wgrad_kernel, dict(ACCUMULATE=True, UPCAST=False, INPUT_PRECISION="ieee",
                                                             FP8=True, EMULATE=False, BLOCK_M=128, BLOCK_N=64,
                                                             BLOCK_K=64), e4m3),
        "permute": (mp._permute_kernel, dict(BLOCK_R=16, BLOCK_H=32)),
        "combine": (mp._combine_kernel, dict(HAS_WEIGHT=True, BLOCK_T=16, BLOCK_H=32)),
        "combine_backward": (mp._combine_bwd_kernel, dict(BLOCK_R=16, BLOCK_H=32)),
        "routing count": (mr._route_count_kernel, dict(BLOCK=64, G_PAD=8)),
        "routing scatter": (mr._route_scatter_kernel, dict(BLOCK=64, G_PAD=8)),
        "topk_route": (mt._topk_route_kernel, dict(SCORE=1, HAS_BIAS=True, **route)),
        "topk_route_backward": (mt._topk_route_bwd_kernel,
                                dict(SCORE=1, **{k: v for k, v in route.items() if k not in ("TOPK_GROUP", "K_PAD")})),
    }
    # products known to stay small: the expert id within a row of logits (g * EPG + j < E)
    allowed = {"topk_route": ("%eid",), "topk_route_backward": ("%eid",)}
    for name, (fn, const, *ptrs) in cases.items():
        bad, approx_div = i32_products(fn, const, dict(idx, **(ptrs[0] if ptrs else {})))
        bad = [b for b in bad if not b.startswith(allowed.get(name, ("-",)))]
        print(f"{name}: {bad}")
        print(f"approximate fp32 divisions of {name} = {approx_div}")
    """
)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="reads the IR for sm_90 off-GPU (the interpreted run covers it)")
def test_kernel_offsets_are_64_bit():
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this triton build has no NVIDIA backend")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _INT64_CHECK], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ": [" in ln]
    assert len(lines) == 19, res.stdout
    assert all(ln.endswith(": []") for ln in lines), "32-bit products of a stride / width:\n" + "\n".join(lines)
    # the routing kernels divide with IEEE rounding (tl.math.div_rn): a plain fp32 ``/`` compiles to
    # div.full.f32 (up to 2 ulp off on a GPU, exact in the interpreter), which left a renormalised
    # top-1 weight p / p off 1 and leaked into the router gradient on the first GPU run
    divs = dict(ln.removeprefix("approximate fp32 divisions of ").split(" = ") for ln in res.stdout.splitlines()
                if ln.startswith("approximate fp32 divisions of "))
    assert len(divs) == 19 and divs["topk_route"] == divs["topk_route_backward"] == "0", divs


def test_row_counts_past_int32_positions_are_refused():
    """Positions and row indices are int32 (with headroom for a program's last row block): every
    launcher refuses more rows than MAX_ROWS, before touching the data (expanded views: no
    memory behind the 2^31 rows)."""
    from fusedpar.kernels.moe_routing import MAX_ROWS

    n = MAX_ROWS + 1
    assert MAX_ROWS + 1024 < 2**31  # the largest row block of any launch still fits
    msg = f"at most {MAX_ROWS}"
    x = torch.zeros(1, 16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE).expand(n)
    with pytest.raises(ValueError, match=msg):
        permute(x.expand(n, 16), slots, 1)
    with pytest.raises(ValueError, match=msg):
        combine(x, slots, None, 1)
    with pytest.raises(ValueError, match=msg):
        combine_backward(x, x.expand(n, 16), torch.ones(1, 1, device=DEVICE), slots, 1)
    with pytest.raises(ValueError, match=msg):
        routing_metadata(torch.zeros(1, dtype=torch.int64, device=DEVICE).expand(n), 4)
    w = torch.zeros(2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=msg):
        grouped_matmul(x.expand(n, 16), w, [0, 0, 0], check_offsets=False)
    with pytest.raises(ValueError, match=msg):
        grouped_wgrad(torch.zeros(1, 8, device=DEVICE).expand(n, 8), x.expand(n, 16), [0, 0, 0], 2,
                      check_offsets=False)


def test_tuning_keys_hold_every_flag_the_prune_rules_read(monkeypatch):
    """As for the dense GEMM (tests/test_gemm.py): a tuned config is reused for every launch with the
    same key, so each grouped autotuner's key holds every flag its prune rule reads (a tile kept
    for tf32 must not run as "ieee" FMA dots, a plain epilogue's tile with a fused one)."""
    from fusedpar.kernels import grouped_gemm as gg, grouped_gemm_configs as ggc

    class Recording(dict):
        def get(self, k, default=None):
            read.add(k)
            return super().get(k, default)

    monkeypatch.setattr(ggc, "device_capability", lambda index: (9, 0))
    read = set()
    gg.tile_rule(Recording(x_ptr=torch.empty(1, dtype=torch.bfloat16), N=64, K=64))
    flags = {k for k in read if k.isupper() or k.startswith("s_")}  # the strides: the rows' alignment
    assert {"INPUT_PRECISION", "STORE_AUX", "ACT", "GLU", "DACT", "s_xm"} <= flags, flags
    assert flags <= set(gg.TUNING_KEY), flags - set(gg.TUNING_KEY)
    read = set()
    gg.wgrad_tile_rule(Recording(dy_ptr=torch.empty(1, dtype=torch.bfloat16), N=64, K=64))
    flags = {k for k in read if k.isupper() or k.startswith("s_")}
    assert {"INPUT_PRECISION", "s_dm"} <= flags and flags <= set(gg.WGRAD_TUNING_KEY), flags
