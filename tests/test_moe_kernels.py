"""MoE kernels: routing metadata, permute / combine (+ backward), grouped GEMM fwd / dgrad / wgrad.

References: Python loops (routing), fp64 torch (GEMMs), torch autograd in fp64 (backward
epilogues) and torch's own grouped GEMM (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``).
"""
import pytest
import torch
import torch.nn.functional as F

from _utils import DEVICE, DTYPES, assert_close, poison, randn

# bf16 runs interpreted too: the kernels upcast bf16 operands of tl.dot behind a constexpr there
GEMM_DTYPES = DTYPES if torch.bfloat16 in DTYPES else DTYPES + [torch.bfloat16]
from fusedpar.kernels import moe as K
from fusedpar.kernels.gemm import activation_reference


def _ids(T, k, E, g):
    """Random distinct experts per token."""
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)


def _check_meta(ids, G, capacity=None):
    got = K.routing_metadata(ids, G, capacity=capacity)
    want = K.routing_metadata_reference(ids.cpu(), G, capacity)
    for name, a, b in zip(("counts", "offsets", "slot_pos", "sorted_slot"), got, want):
        assert a.dtype == torch.int32, name
        assert a.cpu().tolist() == b.tolist(), f"{name} (G={G}, capacity={capacity})"


def test_routing_metadata_matches_loop():
    g = torch.Generator().manual_seed(0)
    # 151 slots span several routing blocks (64 per program under the interpreter)
    ids = _ids(50, 3, 7, g)
    for cap in (None, 0, 1, 13, 1000):
        _check_meta(ids, 7, cap)
    _check_meta(torch.zeros(33, 2, dtype=torch.int64, device=DEVICE), 5)  # all to one group
    _check_meta(torch.zeros(33, 2, dtype=torch.int64, device=DEVICE), 5, capacity=7)
    _check_meta(torch.tensor([[3]], device=DEVICE), 4)  # a single token
    _check_meta(_ids(9, 6, 6, g), 6)  # top_k == number of experts
    # negative ids are not routed; groups >= 2 receive nothing; non power-of-two G
    holes = torch.randint(-1, 2, (41, 2), generator=g).to(DEVICE)
    _check_meta(holes, 11)
    _check_meta(torch.randint(0, 40, (70, 2), generator=g).to(DEVICE).to(torch.int32), 40, capacity=2)
    counts, offsets, slot_pos, sorted_slot = K.routing_metadata(torch.empty(0, 2, dtype=torch.int64, device=DEVICE), 3)
    assert counts.tolist() == [0, 0, 0] and offsets.tolist() == [0, 0, 0, 0] and slot_pos.numel() == 0


def _permute_reference(x, sorted_slot, k):
    out = torch.zeros(sorted_slot.numel(), x.shape[1], dtype=torch.float64)
    for p, s in enumerate(sorted_slot.tolist()):
        if s >= 0:
            out[p] = x[s // k].double().cpu()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_combine_and_backward(dtype):
    g = torch.Generator().manual_seed(1)
    T, k, E, H = 29, 3, 6, 37
    ids = _ids(T, k, E, g)
    _, _, slot_pos, sorted_slot = K.routing_metadata(ids, E, capacity=12)  # some slots dropped
    assert (slot_pos < 0).any()
    base = randn(T, 2 * H, dtype=dtype, generator=g)
    x = base[:, 1::2]  # a strided view: the kernel reads it in place
    out = poison((T * k, H), dtype)
    K.permute(x, sorted_slot, k, out=out)
    assert_close(out, _permute_reference(x, sorted_slot.cpu(), k), dtype, msg="permute")
    # combine: fp32 sum of weighted rows, dropped slots add nothing
    y = randn(T * k, H, dtype=dtype, generator=g)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    got = K.combine(y, slot_pos, w, k, out=poison((T, H), dtype))
    yd = y.double().cpu().requires_grad_()
    wd = w.double().cpu().requires_grad_()
    pos = slot_pos.cpu().tolist()
    rows = []
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float64)
        for j in range(k):
            if pos[t * k + j] >= 0:
                acc = acc + wd[t, j] * yd[pos[t * k + j]]
        rows.append(acc)
    ref = torch.stack(rows)
    assert_close(got, ref, dtype, msg="combine")
    go = randn(T, H, dtype=dtype, generator=g)
    (ref * go.double().cpu()).sum().backward()
    gy, gw = K.combine_backward(go, y, w, sorted_slot, k)
    assert_close(gy, yd.grad, dtype, msg="combine backward: grad of expert outputs")
    # grad_w = <grad_out, y> sums H products of inputs rounded to dtype
    assert_close(gw, wd.grad, dtype, msg="combine backward: grad of routing weights")
    # permute's backward is combine without weights: sum of the k slot gradients of each token
    gsum = K.combine(y, slot_pos, None, k, out=poison((T, H), torch.float32))
    sel = [[p for p in pos[t * k:(t + 1) * k] if p >= 0] for t in range(T)]
    ref_sum = torch.stack([y.double().cpu()[s].sum(0) if s else torch.zeros(H, dtype=torch.float64) for s in sel])
    assert_close(gsum, ref_sum, dtype, msg="permute backward")


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_grouped_matmul_forward(dtype):
    g = torch.Generator().manual_seed(2)
    E, H, Fd = 4, 36, 20
    # groups of size 0, 1, 17, 0, 33, 5 over 2 cycles of the 4 experts (group g -> expert g % 4),
    # then 7 tail rows that belong to no group
    sizes = [0, 1, 17, 0, 33, 5, 0, 9]
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    M = offs[-1] + 7
    x = randn(M, 2 * H, dtype=dtype, generator=g)[:, ::2]  # strided rows and columns, read in place
    for act in ("swiglu", "gelu", "none"):
        glu = act == "swiglu"
        w = randn(E, (2 if glu else 1) * Fd, H, dtype=dtype, generator=g, scale=H ** -0.5)
        pre = poison((M, w.shape[1]), dtype)
        out = K.grouped_matmul(x, w, torch.tensor(offs, device=DEVICE), activation=act, preact_out=pre,
                               out=poison((M, Fd), dtype))
        assert_close(out, K.grouped_matmul_reference(x, w, offs, activation=act), dtype, msg=f"grouped {act}")
        assert_close(pre, K.grouped_matmul_reference(x, w, offs), dtype, msg=f"preact {act}")
    # the kn layout and a transposed view (no copy) give the same product
    w_nk = randn(E, Fd, H, dtype=dtype, generator=g)
    ref = K.grouped_matmul_reference(x, w_nk, offs)
    got_view = K.grouped_matmul(x, w_nk.transpose(1, 2), offs, weight_layout="kn")
    assert_close(got_view, ref, dtype, msg="kn view")
    # a single group covering every row
    one = K.grouped_matmul(x, w_nk[:1], [0, M], out=poison((M, Fd), dtype))
    assert_close(one, K.grouped_matmul_reference(x, w_nk[:1], [0, M]), dtype, msg="one group")


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
    ours = K.grouped_matmul(x, w_kn, offs, weight_layout="kn", out=poison((30, N), torch.float32))
    theirs = fn(x.cpu(), w_kn.cpu(), offs=torch.tensor(offs[1:], dtype=torch.int32))
    assert_close(ours, theirs.double(), torch.float32, msg="vs torch grouped_mm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_backward_kernels(dtype):
    g = torch.Generator().manual_seed(4)
    E, H, Fd = 3, 20, 24
    sizes = [5, 0, 18, 1, 0, 3]  # two cycles over 3 experts, with empty groups
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    M = offs[-1] + 3  # tail rows
    for act in ("swiglu", "relu", "silu", "geglu"):
        glu = act in ("swiglu", "geglu")
        n1 = (2 if glu else 1) * Fd
        pre = randn(M, n1, dtype=dtype, generator=g)
        w2 = randn(E, H, Fd, dtype=dtype, generator=g, scale=Fd ** -0.5)
        gy = randn(M, H, dtype=dtype, generator=g)
        got = K.grouped_matmul_dact(gy, w2, offs, pre, activation=act)
        pre_d = pre.double().cpu().requires_grad_()
        dh = K.grouped_matmul_reference(gy, w2, offs, weight_layout="kn")  # gy @ W2_e per group
        (activation_reference(pre_d, act) * dh).sum().backward()
        ref = pre_d.grad.clone()
        ref[offs[-1]:] = 0
        assert_close(got, ref, dtype, msg=f"fused activation backward ({act})")
    # wgrad: per expert, summed over every group that maps to it; empty experts give zeros
    x = randn(M, H, dtype=dtype, generator=g)
    dy = randn(M, Fd, dtype=dtype, generator=g)
    for E_w in (3, 6, 7):
        ref = torch.zeros(E_w, Fd, H, dtype=torch.float64)
        for grp in range(len(sizes)):
            a, b = offs[grp], offs[grp + 1]
            ref[grp % E_w] += dy[a:b].double().cpu().t() @ x[a:b].double().cpu()
        got = K.grouped_wgrad(dy, x, offs, E_w, out=poison((E_w, Fd, H), dtype))
        assert_close(got, ref, dtype, msg=f"grouped wgrad E={E_w}")
    acc = randn(3, Fd, H, dtype=torch.float32, generator=g)
    ref = acc.double().cpu().clone()
    for grp in range(len(sizes)):
        a, b = offs[grp], offs[grp + 1]
        ref[grp % 3] += dy[a:b].double().cpu().t() @ x[a:b].double().cpu()
    K.grouped_wgrad(dy, x, offs, 3, out=acc, accumulate=True)
    assert_close(acc, ref, dtype, msg="grouped wgrad accumulate (fp32 buffer)")


def test_kernel_errors():
    x = torch.randn(8, 16, device=DEVICE)
    w = torch.randn(2, 12, 16, device=DEVICE)
    with pytest.raises(ValueError, match="inner dimensions differ: x has K=16"):
        K.grouped_matmul(x, torch.randn(2, 12, 15, device=DEVICE), [0, 4, 8])
    with pytest.raises(ValueError, match="offsets must start at 0, be non-decreasing"):
        K.grouped_matmul(x, w, [0, 6, 4])
    with pytest.raises(ValueError, match="end at most at M=8"):
        K.grouped_matmul(x, w, [0, 4, 9])
    with pytest.raises(TypeError, match="offsets must have dtype torch.int32 or torch.int64"):
        K.grouped_matmul(x, w, torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="weight must be 3-D"):
        K.grouped_matmul(x, w[0], [0, 8])
    with pytest.raises(TypeError, match="weight must have the same dtype as x"):
        K.grouped_matmul(x, w.half(), [0, 8])
    with pytest.raises(ValueError, match="activation 'swiglu' needs an even number"):
        K.grouped_matmul(x, torch.randn(2, 7, 16, device=DEVICE), [0, 8], activation="swiglu")
    with pytest.raises(ValueError, match=r"out must have shape \(8, 12\)"):
        K.grouped_matmul(x, w, [0, 8], out=torch.empty(8, 11, device=DEVICE))
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        K.routing_metadata(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), 0)
    with pytest.raises(TypeError, match="group_ids must have dtype torch.int32 or torch.int64"):
        K.routing_metadata(torch.zeros(3, 1, device=DEVICE), 2)
    with pytest.raises(ValueError, match="sorted_slot must have 16 elements"):
        K.permute(x, torch.zeros(15, dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match=r"weights must have shape \(4, 2\)"):
        K.combine(x, torch.zeros(8, dtype=torch.int32, device=DEVICE), torch.ones(4, 3, device=DEVICE), 2)
