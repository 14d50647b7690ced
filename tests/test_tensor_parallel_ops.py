"""fusedpar.ops tensor-parallel GEMMs on real gloo worlds (2, 3, 4 ranks) against one-process fp64.

Every rank builds the same full problem from a shared generator, runs the distributed op on its
shard, and compares its output shard and ALL its gradients (input, weight, bias) with the fp64
single-process reference. Tolerances: the per-dtype ones of tests/_utils.py (fp32 ieee GEMMs;
fp16 inputs and outputs rounded once, partial sums in fp32).

The same ops also run as one rank of a world on ``EmulatedTransport`` (no process spawn), against
fp64 references that follow the transport's mirror rule (the ``*_emulated`` tests).
"""
import contextlib
import re

import pytest
import torch

from _utils import DEVICE, assert_close
from _world import rank_rng, straggle, world_fixture
from fusedpar.ops import comm
from fusedpar.kernels.fp8 import scale_shape
from fusedpar.kernels.runtime import activation_reference
from fusedpar.ops import all_gather_matmul, copy_to_tp_matmul, fp8_linear, matmul_all_reduce, matmul_reduce_scatter
from fusedpar.ops.fp8.bodies import fp8_linear_bwd, fp8_linear_fwd
from fusedpar.ops.tensor_parallel.api import all_gather_tokens, gather_features, scatter_features
from fusedpar.ops.tensor_parallel.schedules import activation_backward
from fusedpar.ops.comm.transport import EmulatedTransport

world2 = world_fixture(2)
world3 = world_fixture(3)
world4 = world_fixture(4)


def _device():
    """Where this process's tensors live: its GPU in an NCCL world, the CPU in a gloo world, the
    test device outside a world."""
    import torch.distributed as dist

    if dist.is_initialized():
        nccl = dist.get_backend() == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return DEVICE


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=_device(), dtype=dtype)


def _ref_grads(fn, inputs, grad_out):
    """fp64 reference: output and the gradients of every input."""
    leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(grad_out.double())
    return y.detach(), [t.grad for t in leaves]


def _chunk(t, dim, rank, size):
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def _rows_of(t, rank, size, gated):
    """This rank's block of output features ([gate block; up block] when gated)."""
    if gated:
        gate, up = t.chunk(2, 0)
        return torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)])
    return _chunk(t, 0, rank, size)


def _check(name, got, want, dtype):
    assert got is not None, f"{name}: missing gradient"
    assert_close(got, want, dtype, msg=name)


# ----------------------------------------------------------------------------------------------
# all_gather_matmul: [b, s/tp, K] (dim 1) or [b/tp, s, K] (dim 0) -> [b, s, N/tp]
# ----------------------------------------------------------------------------------------------
def _ag_case(rank, size, *, dtype, gather_dim, bias, activation, save_gathered, seed, b_loc=1, s_loc=3,
             K=11, f_loc=5, x_grad=True):
    g = rank_rng(seed)
    gated = activation in ("swiglu", "geglu")
    B = b_loc * size if gather_dim == 0 else 2
    S = s_loc * size if gather_dim == 1 else 3
    F = f_loc * size
    rows = 2 * F if gated else F
    X = _rand(g, B, S, K, dtype=dtype)
    W = _rand(g, rows, K, dtype=dtype, scale=K ** -0.5)
    bvec = _rand(g, rows, dtype=dtype) if bias else None
    G = _rand(g, B, S, F, dtype=dtype)

    def ref(x, w, *b):
        return activation_reference(torch.nn.functional.linear(x, w, b[0] if b else None), activation)

    y_ref, grads = _ref_grads(ref, [X, W] + ([bvec] if bias else []), G)

    def rows_of(t):
        return _rows_of(t, rank, size, gated)

    x = _chunk(X, gather_dim, rank, size).clone().requires_grad_(x_grad)
    w = rows_of(W).clone().requires_grad_(True)
    b = rows_of(bvec).clone().requires_grad_(True) if bias else None
    if save_gathered:  # also ask for the gathered input (then the kept copy feeds the wgrad)
        y, gathered = all_gather_matmul(x, w, b, gather_dim=gather_dim, activation=activation, return_gathered=True)
        torch.testing.assert_close(gathered, X, rtol=0, atol=0)
    else:  # only the local shard is saved: the backward re-gathers it, overlapped with dgrad
        y = all_gather_matmul(x, w, b, gather_dim=gather_dim, activation=activation, save_gathered_input=False)
    y.backward(_chunk(G, -1, rank, size))
    tag = f"AG {dtype} dim{gather_dim} bias={bias} {activation} keep={save_gathered} x_grad={x_grad} tp{size}"
    _check(f"{tag} y", y, _chunk(y_ref, -1, rank, size), dtype)
    if x_grad:
        _check(f"{tag} dx", x.grad, _chunk(grads[0], gather_dim, rank, size), dtype)
    else:
        assert x.grad is None
    _check(f"{tag} dW", w.grad, rows_of(grads[1]), dtype)
    if bias:
        _check(f"{tag} db", b.grad, rows_of(grads[2]), dtype)
    return y.detach(), x.grad, w.grad


# ----------------------------------------------------------------------------------------------
# matmul_reduce_scatter: [b, s, K/tp] -> [b, s/tp, N] (dim 1) or [b/tp, s, N] (dim 0)
# ----------------------------------------------------------------------------------------------
def _rs_case(rank, size, *, dtype, scatter_dim, bias, seed, partial_dtype=torch.float32, N=9, k_loc=6,
             x_grad=True):
    g = rank_rng(seed)
    B = size if scatter_dim == 0 else 2
    S = 3 * size + size if scatter_dim == 1 else 5
    K = k_loc * size
    X = _rand(g, B, S, K, dtype=dtype)
    W = _rand(g, N, K, dtype=dtype, scale=K ** -0.5)
    bvec = _rand(g, N, dtype=dtype) if bias else None
    G = _rand(g, B, S, N, dtype=dtype)

    def ref(x, w, *b):
        return torch.nn.functional.linear(x, w, b[0] if b else None)

    y_ref, grads = _ref_grads(ref, [X, W] + ([bvec] if bias else []), G)
    x = _chunk(X, -1, rank, size).clone().requires_grad_(x_grad)
    w = _chunk(W, 1, rank, size).clone().requires_grad_(True)
    b = bvec.clone().requires_grad_(True) if bias else None
    y = matmul_reduce_scatter(x, w, b, scatter_dim=scatter_dim, partial_dtype=partial_dtype)
    y.backward(_chunk(G, scatter_dim, rank, size))
    tag = f"RS {dtype} dim{scatter_dim} bias={bias} partial={partial_dtype} x_grad={x_grad} tp{size}"
    _check(f"{tag} y", y, _chunk(y_ref, scatter_dim, rank, size), dtype)
    if x_grad:
        _check(f"{tag} dx", x.grad, _chunk(grads[0], -1, rank, size), dtype)
    else:
        assert x.grad is None
    _check(f"{tag} dW", w.grad, _chunk(grads[1], 1, rank, size), dtype)
    if bias:
        _check(f"{tag} db", b.grad, grads[2], dtype)
    return y.detach(), x.grad, w.grad


# ----------------------------------------------------------------------------------------------
# matmul_all_reduce (row, replicated output) and copy_to_tp_matmul (column, replicated input)
# ----------------------------------------------------------------------------------------------
def _ar_case(rank, size, *, dtype, bias, seed, num_chunks=3, N=9, k_loc=5):
    g = rank_rng(seed)
    K = k_loc * size
    X = _rand(g, 2, 7, K, dtype=dtype)
    W = _rand(g, N, K, dtype=dtype, scale=K ** -0.5)
    bvec = _rand(g, N, dtype=dtype) if bias else None
    G = _rand(g, 2, 7, N, dtype=dtype)
    y_ref, grads = _ref_grads(lambda x, w, *b: torch.nn.functional.linear(x, w, b[0] if b else None),
                              [X, W] + ([bvec] if bias else []), G)
    x = _chunk(X, -1, rank, size).clone().requires_grad_(True)
    w = _chunk(W, 1, rank, size).clone().requires_grad_(True)
    b = bvec.clone().requires_grad_(True) if bias else None
    y = matmul_all_reduce(x, w, b, num_chunks=num_chunks)
    y.backward(G)
    tag = f"AR {dtype} bias={bias} chunks={num_chunks} tp{size}"
    _check(f"{tag} y", y, y_ref, dtype)
    _check(f"{tag} dx", x.grad, _chunk(grads[0], -1, rank, size), dtype)
    _check(f"{tag} dW", w.grad, _chunk(grads[1], 1, rank, size), dtype)
    if bias:
        _check(f"{tag} db", b.grad, grads[2], dtype)


def _copy_case(rank, size, *, dtype, bias, activation, seed, K=10, f_loc=4):
    g = rank_rng(seed)
    F = f_loc * size
    gated = activation in ("swiglu", "geglu")
    rows = 2 * F if gated else F
    X = _rand(g, 2, 5, K, dtype=dtype)
    W = _rand(g, rows, K, dtype=dtype, scale=K ** -0.5)
    bvec = _rand(g, rows, dtype=dtype) if bias else None
    G = _rand(g, 2, 5, F, dtype=dtype)

    def ref(x, w, *b):
        return activation_reference(torch.nn.functional.linear(x, w, b[0] if b else None), activation)

    y_ref, grads = _ref_grads(ref, [X, W] + ([bvec] if bias else []), G)
    x = X.clone().requires_grad_(True)
    w = _rows_of(W, rank, size, gated).clone().requires_grad_(True)
    b = _rows_of(bvec, rank, size, gated).clone().requires_grad_(True) if bias else None
    y = copy_to_tp_matmul(x, w, b, activation=activation, num_chunks=2)
    y.backward(_chunk(G, -1, rank, size))
    tag = f"copy {dtype} bias={bias} {activation} tp{size}"
    _check(f"{tag} y", y, _chunk(y_ref, -1, rank, size), dtype)
    _check(f"{tag} dx (all-reduced)", x.grad, grads[0], dtype)
    _check(f"{tag} dW", w.grad, _rows_of(grads[1], rank, size, gated), dtype)
    if bias:
        _check(f"{tag} db", b.grad, _rows_of(grads[2], rank, size, gated), dtype)


# ----------------------------------------------------------------------------------------------
# world bodies: many cases per world.run
# ----------------------------------------------------------------------------------------------
def _all_cases(rank, size, seed, full):
    cases = 0
    for i, (dtype, dim, bias) in enumerate(
        [(dt, d, b) for dt in (torch.float32, torch.float16) for d in (0, 1) for b in (True, False)]
    ):
        if not full and i % 3:
            continue
        act = ["none", "swiglu", "gelu", "none"][i % 4]
        _ag_case(rank, size, dtype=dtype, gather_dim=dim, bias=bias, activation=act,
                 save_gathered=(i % 2 == 0), seed=seed + i)
        _rs_case(rank, size, dtype=dtype, scatter_dim=dim, bias=bias, seed=seed + 50 + i,
                 partial_dtype=torch.float32 if i % 2 == 0 else dtype)
        cases += 2
    if full:  # weight (and bias) gradients only, with the input not requiring grad
        for keep in (True, False):
            _ag_case(rank, size, dtype=torch.float32, gather_dim=1, bias=True, activation="swiglu",
                     save_gathered=keep, seed=seed + 60 + keep, x_grad=False)
        _rs_case(rank, size, dtype=torch.float32, scatter_dim=1, bias=True, seed=seed + 70, x_grad=False)
        cases += 3
    for i, dtype in enumerate((torch.float32, torch.float16)):
        _ar_case(rank, size, dtype=dtype, bias=i == 0, seed=seed + 100 + i, num_chunks=3 + i)
        _copy_case(rank, size, dtype=dtype, bias=i == 1, activation=["swiglu", "none"][i], seed=seed + 110 + i)
        cases += 2
    return cases


def _straggler_case(rank, size, seed):
    """Random per-rank delays before every transfer give bit-identical results."""
    kw = dict(dtype=torch.float32, bias=True, seed=seed)
    calm = [_ag_case(rank, size, gather_dim=1, activation="swiglu", save_gathered=False, **kw),
            _rs_case(rank, size, scatter_dim=1, **kw)]
    straggle(0.01, seed)
    try:
        slow = [_ag_case(rank, size, gather_dim=1, activation="swiglu", save_gathered=False, **kw),
                _rs_case(rank, size, scatter_dim=1, **kw)]
    finally:
        comm.set_straggler(0)
    for a, b in zip(calm, slow):
        for t, u in zip(a, b):
            torch.testing.assert_close(t, u, rtol=0, atol=0)
    return True


def test_tp_ops_world2(world2):
    assert world2.run(_all_cases, seed=11, full=True) == [23, 23]


def test_tp_ops_world3(world3):
    assert world3.run(_all_cases, seed=21, full=False) == [10] * 3
    # stragglers on a ring of three distinct neighbours (a non-power-of-two size)
    assert all(world3.run(_straggler_case, seed=3))


def test_tp_ops_world4(world4):
    assert world4.run(_all_cases, seed=31, full=False) == [10] * 4


def test_tp_modules_world4(world4):
    """The modules' sequence-parallel paths at tp=4 (the cases live in test_nn_tensor_parallel.py)."""
    from test_nn_tensor_parallel import modules_vs_reference

    assert all(world4.run(modules_vs_reference, seed=4, light=True))


# ----------------------------------------------------------------------------------------------
# bad input: the same clear error on every rank, before any transfer (then the world still works)
# ----------------------------------------------------------------------------------------------
def _bad_inputs(rank, size):
    x = torch.randn(2, 3, 8)
    w = torch.randn(6, 8)
    checks = [
        (ValueError, "must be divisible by the group size", lambda: matmul_reduce_scatter(torch.randn(2, 5, 8), w)),
        (ValueError, "must be divisible", lambda: matmul_reduce_scatter(torch.randn(3, 4, 8), w, scatter_dim=0)),
        (TypeError, "weight must have the same dtype as x", lambda: all_gather_matmul(x, w.half())),
        (TypeError, "bias must have the same dtype as x",
         lambda: matmul_reduce_scatter(torch.randn(2, 4, 8), w, torch.randn(6).half())),
        (ValueError, "weight must be on the same device as x",
         lambda: all_gather_matmul(x, torch.empty(6, 8, device="meta"))),
        (ValueError, r"weight must have shape \[out, 8\]", lambda: all_gather_matmul(x, torch.randn(6, 7))),
        (ValueError, r"weight must have shape \[out, 8\]", lambda: matmul_all_reduce(x, torch.randn(8, 6))),
        (ValueError, r"bias must have shape \(6,\)", lambda: matmul_all_reduce(x, w, torch.randn(5))),
        (ValueError, "gather_dim must be a token dim", lambda: all_gather_matmul(x, w, gather_dim=2)),
        (ValueError, "gather_dim must be a token dim", lambda: all_gather_matmul(x[0], w)),
        (ValueError, "even number of rows", lambda: all_gather_matmul(x, torch.randn(7, 8), activation="swiglu")),
        (ValueError, "activation must be one of", lambda: all_gather_matmul(x, w, activation="tanh")),
        (TypeError, "partial_dtype must be", lambda: matmul_reduce_scatter(torch.randn(2, 4, 8), w,
                                                                           partial_dtype=torch.float64)),
        (ValueError, "num_chunks must be >= 1, got 0", lambda: matmul_all_reduce(x, w, num_chunks=0)),
        (TypeError, "x must be a torch.Tensor", lambda: all_gather_matmul([1.0], w)),
        (ValueError, r"all_gather_matmul: fp8 must be one of \(None, 'rowwise', 'blockwise'\), got 'e5m2'",
         lambda: all_gather_matmul(x, w, fp8="e5m2")),
        (TypeError, "matmul_all_reduce: fp8_grad_high_precision must be a bool, got int",
         lambda: matmul_all_reduce(x, w, fp8="rowwise", fp8_grad_high_precision=1)),
        (ValueError, "all_gather_matmul: return_gathered must be False with fp8='blockwise'",
         lambda: all_gather_matmul(x, w, fp8="blockwise", return_gathered=True)),
    ]
    for exc, pattern, fn in checks:
        with pytest.raises(exc, match=pattern):
            fn()
    # nothing was left in flight: a real op afterwards works and agrees across ranks
    dev = _device()
    y = all_gather_matmul(torch.full((1, 2, 8), float(rank), device=dev), torch.ones(3, 8, device=dev))
    expect = torch.cat([torch.full((1, 2, 3), 8.0 * r, device=dev) for r in range(size)], dim=1)
    torch.testing.assert_close(y, expect, rtol=0, atol=0)
    return len(checks)


def test_tp_ops_bad_input_every_rank(world2):
    assert world2.run(_bad_inputs) == [18, 18]


def _group_of_one(rank, size):
    """A group holding only this rank: every op is the plain fused GEMM, no transfer."""
    import torch.distributed as dist

    from fusedpar.kernels import matmul

    groups = [dist.new_group([r]) for r in range(size)]
    solo = groups[rank]
    g = rank_rng(17, rank)
    x, w, b = (t.to(_device()) for t in (torch.randn(2, 5, 8, generator=g), torch.randn(6, 8, generator=g),
                                          torch.randn(6, generator=g)))
    plain = matmul(x, w, b)
    for op in (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce):
        torch.testing.assert_close(op(x, w, b, group=solo), plain, rtol=0, atol=0, msg=op.__name__)
    return comm.group_size(solo)


def test_tp_ops_group_of_one(world2):
    assert world2.run(_group_of_one) == [1, 1]


# ----------------------------------------------------------------------------------------------
# no process group (or a group of one): the plain fused GEMM
# ----------------------------------------------------------------------------------------------
def test_tp_ops_without_process_group():
    assert comm.group_size(None) == 1
    _ag_case(0, 1, dtype=torch.float32, gather_dim=1, bias=True, activation="geglu", save_gathered=False, seed=1)
    _rs_case(0, 1, dtype=torch.float16, scatter_dim=1, bias=True, seed=2)
    _ar_case(0, 1, dtype=torch.float32, bias=True, seed=3)
    _copy_case(0, 1, dtype=torch.float32, bias=True, activation="relu", seed=4)
    # inference under no_grad: nothing kept for a backward, same numbers
    x, w = torch.randn(2, 3, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        for op in (all_gather_matmul, copy_to_tp_matmul):
            y = op(x, w, activation="swiglu")
            assert not y.requires_grad
            want = activation_reference(torch.nn.functional.linear(x.double(), w.double()), "swiglu")
            assert_close(y, want, torch.float32, msg=f"{op.__name__} under no_grad")


# ----------------------------------------------------------------------------------------------
# one rank of a world on EmulatedTransport (no process spawn): every peer mirrors this rank, so
# the fp64 references follow the mirror rule of each transfer (fusedpar.ops.comm.transport)
# ----------------------------------------------------------------------------------------------
EMU_P = 3


def _emu_leaves(g, shapes, dtype):
    return [_rand(g, *s, dtype=dtype, scale=sc).requires_grad_(True) for s, sc in shapes]


def _emu_check(tag, got, want, dtype):
    for name, a, e in zip(("y", "dx", "dW", "db"), got, want):
        if e is not None:
            _check(f"{tag} {name}", a, e, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("gather_dim", [0, 1])
@pytest.mark.parametrize("rank,activation,keep,waits", [
    (0, "none", True, False), (2, "swiglu", False, False), (1, "gelu", True, False), (1, "swiglu", False, True),
])
def test_all_gather_matmul_emulated(dtype, gather_dim, rank, activation, keep, waits):
    """Mirror: the gathered input is EMU_P copies of x (the ring receives what this rank sends);
    the op is act(cat([x] * P) @ W^T + b) and its gradients are autograd's of that (the backward
    reduce-scatter sums every chunk's partial, all computed by this rank). ``waits``: the
    in-kernel-wait (symmetric) schedules, under the same mirror rule."""
    P, g = EMU_P, rank_rng(40 + rank)
    K, rows = 7, (8 if activation == "swiglu" else 5)
    x, w, b = _emu_leaves(g, [((2, 3, K), 1.0), ((rows, K), K ** -0.5), ((rows,), 1.0)], dtype)

    def ref(x, w, b):
        return activation_reference(torch.nn.functional.linear(torch.cat([x] * P, gather_dim), w, b), activation)

    out_shape = ref(x.detach().double(), w.detach().double(), b.detach().double()).shape
    G = _rand(g, *out_shape, dtype=dtype)
    y_ref, grads = _ref_grads(ref, [x, w, b], G)
    t = EmulatedTransport(P, rank, in_kernel_waits=waits)
    y = all_gather_matmul(x, w, b, gather_dim=gather_dim, activation=activation, save_gathered_input=keep,
                          transport=t)
    y.backward(G)
    _emu_check(f"AG emulated rank{rank}", (y, x.grad, w.grad, b.grad), [y_ref] + grads, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("scatter_dim", [0, 1])
@pytest.mark.parametrize("rank,partial,waits", [(0, "fp32", False), (2, "x.dtype", False), (1, "fp32", True)])
def test_matmul_reduce_scatter_emulated(dtype, scatter_dim, rank, partial, waits):
    """Mirror: the partial received at each ring step is the one this rank sent, so the result is
    sum over chunks c of x_c @ W^T + b. Backward: the all-gathered output gradient is EMU_P copies
    of g, so dx_c = g @ W, dW = sum_c g^T x_c, and db = P * sum(g) (every rank adds the bias to its
    own chunk; under the mirror every rank's output gradient is this one's). ``waits``: the
    in-kernel-wait (symmetric) schedules."""
    P, g = EMU_P, rank_rng(50 + rank)
    K, N = 6, 5
    shape = (2 * P, 3, K) if scatter_dim == 0 else (2, 2 * P, K)
    x, w, b = _emu_leaves(g, [(shape, 1.0), ((N, K), K ** -0.5), ((N,), 1.0)], dtype)
    n = shape[scatter_dim] // P

    def ref(x, w, b):
        return sum(torch.nn.functional.linear(x.narrow(scatter_dim, c * n, n), w) for c in range(P)) + b

    G = _rand(g, *ref(x.detach().double(), w.detach().double(), b.detach().double()).shape, dtype=dtype)
    y_ref, (dx, dw, db) = _ref_grads(ref, [x, w, b], G)
    y = matmul_reduce_scatter(x, w, b, scatter_dim=scatter_dim, transport=EmulatedTransport(P, rank, in_kernel_waits=waits),
                              partial_dtype=torch.float32 if partial == "fp32" else None)
    y.backward(G)
    _emu_check(f"RS emulated rank{rank}", (y, x.grad, w.grad, b.grad), (y_ref, dx, dw, P * db), dtype)


def test_ring_buffers_are_kept_per_transport_and_purpose():
    """A transport keeps the rings' receive and partial buffers between calls: one buffer per
    purpose, dtype and device whatever the shapes (the same tensors the next call; with a shape
    per call, variable sequence lengths, it was a set per shape), grown to the largest; the results
    do not depend on them."""
    g, f32 = rank_rng(77), torch.float32
    t = EmulatedTransport(EMU_P, 1)
    x, w = _rand(g, 32 * EMU_P, 4, dtype=f32), _rand(g, 5, 4, dtype=f32)

    def calls(rows=2 * EMU_P):
        return (matmul_reduce_scatter(x[:rows], w, scatter_dim=0, transport=t),
                all_gather_matmul(x[:rows // EMU_P], w, gather_dim=0, transport=t))

    first = calls()
    kept = dict(t.scratch)
    flats = {k: v.flat for k, v in kept.items()}
    assert sorted(k[0] for k in kept) == ["ring_gather", "ring_reduce_scatter"]
    for got, want in zip(calls(), first):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert t.scratch.keys() == kept.keys() and all(t.scratch[k] is v for k, v in kept.items())
    calls(EMU_P)  # smaller shapes: views of the same buffers
    assert all(t.scratch[k].flat is f for k, f in flats.items())
    calls(32 * EMU_P)  # larger (past the 256-byte alignment of each view): replaced by buffers that hold them
    assert t.scratch.keys() == kept.keys() and all(t.scratch[k].flat is not f for k, f in flats.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rank,num_chunks", [(0, 3), (1, 1)])
def test_matmul_all_reduce_emulated(dtype, rank, num_chunks):
    """Mirror: all_reduce multiplies by P and only rank 0's epilogue adds the bias, so the output
    is P * (x @ W^T + b [rank 0]); the backward is local (dx = g @ W, dW = g^T x, db = sum g)."""
    P, g = EMU_P, rank_rng(60 + rank)
    x, w, b = _emu_leaves(g, [((2, 5, 6), 1.0), ((4, 6), 6 ** -0.5), ((4,), 1.0)], dtype)
    G = _rand(g, 2, 5, 4, dtype=dtype)
    y_loc, grads = _ref_grads(torch.nn.functional.linear, [x, w, b], G)
    y_ref = P * (y_loc if rank == 0 else y_loc - b.detach().double())
    y = matmul_all_reduce(x, w, b, num_chunks=num_chunks, transport=EmulatedTransport(P, rank))
    y.backward(G)
    _emu_check(f"AR emulated rank{rank}", (y, x.grad, w.grad, b.grad), [y_ref] + grads, dtype)


@pytest.mark.parametrize("activation", ["none", "swiglu"])
def test_copy_to_tp_matmul_emulated(activation):
    """Mirror: a local forward; the all-reduced input gradient is P times the local one."""
    P, g, dtype = EMU_P, rank_rng(70), torch.float32
    rows = 8 if activation == "swiglu" else 4
    x, w, b = _emu_leaves(g, [((2, 5, 6), 1.0), ((rows, 6), 6 ** -0.5), ((rows,), 1.0)], dtype)

    def ref(x, w, b):
        return activation_reference(torch.nn.functional.linear(x, w, b), activation)

    G = _rand(g, 2, 5, rows // 2 if activation == "swiglu" else rows, dtype=dtype)
    y_ref, (dx, dw, db) = _ref_grads(ref, [x, w, b], G)
    y = copy_to_tp_matmul(x, w, b, activation=activation, num_chunks=2, transport=EmulatedTransport(P, 1))
    y.backward(G)
    _emu_check("copy emulated", (y, x.grad, w.grad, b.grad), (y_ref, P * dx, dw, db), dtype)


def test_feature_gather_scatter_emulated():
    """Mirror: gather_features concatenates P copies; scatter_features keeps this rank's slice and
    its backward gathers P copies of the gradient slice."""
    t = EmulatedTransport(EMU_P, 1)
    x = torch.randn(2, 3, 4, requires_grad=True)
    y = gather_features(x, transport=t)
    torch.testing.assert_close(y, torch.cat([x] * EMU_P, -1), rtol=0, atol=0)
    g = torch.randn(2, 3, 4 * EMU_P)
    y.backward(g)
    torch.testing.assert_close(x.grad, g[..., 4:8], rtol=0, atol=0)
    z = torch.randn(2, 3, 4 * EMU_P, requires_grad=True)
    s = scatter_features(z, transport=t)
    torch.testing.assert_close(s, z[..., 4:8], rtol=0, atol=0)
    gs = torch.randn(2, 3, 4)
    s.backward(gs)
    torch.testing.assert_close(z.grad, torch.cat([gs] * EMU_P, -1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="must be divisible"):
        scatter_features(torch.randn(2, 5), transport=t)


def test_all_gather_tokens_emulated():
    """Mirror: all_gather_tokens concatenates P copies along the token dim; its backward
    reduce-scatters, i.e. P times this rank's block of the gradient on mirrored peers."""
    t = EmulatedTransport(EMU_P, 1)
    x = torch.randn(2, 3, 5, requires_grad=True)
    y = all_gather_tokens(x, dim=1, transport=t)
    torch.testing.assert_close(y, torch.cat([x] * EMU_P, 1), rtol=0, atol=0)
    g = torch.randn(2, 3 * EMU_P, 5)
    y.backward(g)
    torch.testing.assert_close(x.grad, EMU_P * g[:, 3:6], rtol=0, atol=0)
    with pytest.raises(ValueError, match="dim must be a dim of t"):
        all_gather_tokens(x, dim=3, transport=t)


def test_transport_instance_excludes_group():
    with pytest.raises(ValueError, match="group"):
        all_gather_matmul(torch.randn(2, 3, 8), torch.randn(4, 8), transport=EmulatedTransport(2), group=object())


# ----------------------------------------------------------------------------------------------
# fp8 (``fp8="rowwise"`` / ``"blockwise"``) against one process with the same quantisation: the
# references are fp8_linear's own bodies (tested against float64 in tests/test_fp8_linear.py) run
# on the quantisation groups the ops use: per token along this rank's features (activations and
# gradients), per output row / 128x128 blocks of this rank's weight, and a weight gradient summed
# over the gathered chunks, each quantised along its own tokens. Every chunk GEMM of a reference
# has the op's operands and shape, so the pre-activations (and the quantised gradients that follow
# from them) agree to the bit; what differs is the order of the fp32 sums over ranks (fp32
# tolerances of tests/_utils.py; fp16 outputs and fp16 partials one rounding).
# ----------------------------------------------------------------------------------------------
def _fp8_pre(x, w, b, recipe):
    """One process's fp8 GEMM of one chunk (the pre-activation)."""
    return fp8_linear_fwd(x.contiguous(), w, b, recipe, False)


def _fp8_dpre(pre, g, activation):
    """The gradient of the pre-activation, by the closed form the ops use."""
    return g.contiguous() if activation == "none" else activation_backward(pre, g.contiguous(), activation)


def _fp8_dx(g, x, w, recipe):
    return fp8_linear_bwd(g.contiguous(), x.contiguous(), w, recipe, False, True, False)[0].double()


def _fp8_dw(g, x, w, recipe, hp):
    return fp8_linear_bwd(g.contiguous(), x.contiguous(), w, recipe, hp, False, True)[1].double()


def _tokens_sum(t):
    return t.double().sum(dim=tuple(range(t.dim() - 1)))


def _fp8_ag_case(rank, size, *, recipe, gather_dim, activation, keep, hp, seed, dtype=torch.float32, bias=True,
                 x_grad=True, transport=None):
    """all_gather_matmul(fp8=recipe) against: each rank q's pre-activation of chunk c is
    fp8_linear(X_c, W_q, b_q); dx of chunk r is the sum over q of fp8 dgrads of its dpre_{q,r};
    dW_r sums the chunks' fp8 wgrads."""
    g, P, K, f_loc = rank_rng(seed), size, 40, 4
    rows = 2 * f_loc if activation in ("swiglu", "geglu") else f_loc
    B, S = (2 * P, 3) if gather_dim == 0 else (2, 2 * P)
    X = _rand(g, B, S, K, dtype=dtype)
    Ws = [_rand(g, rows, K, dtype=dtype, scale=K ** -0.5) for _ in range(P)]
    bs = [_rand(g, rows, dtype=dtype) if bias else None for _ in range(P)]
    Gs = [_rand(g, B, S, f_loc, dtype=dtype) for _ in range(P)]
    xs = [_chunk(X, gather_dim, c, P) for c in range(P)]
    # rank q's pre-activation and its gradient, for chunk c: needed for q = rank (y, dW) or c = rank (dx)
    pre = {(q, c): _fp8_pre(xs[c], Ws[q], bs[q], recipe) for q in range(P) for c in range(P) if rank in (q, c)}
    dpre = {k: _fp8_dpre(p, _chunk(Gs[k[0]], gather_dim, k[1], P), activation) for k, p in pre.items()}
    x = xs[rank].clone().requires_grad_(x_grad)
    w = Ws[rank].clone().requires_grad_(True)
    b = bs[rank].clone().requires_grad_(True) if bias else None
    y = all_gather_matmul(x, w, b, gather_dim=gather_dim, activation=activation, save_gathered_input=keep,
                          fp8=recipe, fp8_grad_high_precision=hp, transport=transport)
    y.backward(Gs[rank])
    tag = f"AG fp8 {recipe} {dtype} dim{gather_dim} {activation} keep={keep} hp={hp} tp{size}"
    y_ref = torch.cat([activation_reference(pre[rank, c].double(), activation) for c in range(P)], gather_dim)
    _check(f"{tag} y", y, y_ref, dtype)
    if x_grad:
        _check(f"{tag} dx", x.grad, sum(_fp8_dx(dpre[q, rank], xs[rank], Ws[q], recipe) for q in range(P)), dtype)
    else:
        assert x.grad is None
    _check(f"{tag} dW", w.grad, sum(_fp8_dw(dpre[rank, c], xs[c], Ws[rank], recipe, hp) for c in range(P)), dtype)
    if bias:
        _check(f"{tag} db", b.grad, sum(_tokens_sum(dpre[rank, c]) for c in range(P)), dtype)
    return y.detach(), x.grad, w.grad


def _fp8_rs_case(rank, size, *, recipe, scatter_dim, hp, seed, dtype=torch.float32, partial_dtype=torch.float32,
                 transport=None):
    """matmul_reduce_scatter(fp8=recipe) against: chunk r of the output is the sum over ranks q of
    fp8_linear(X_q[chunk r], W_q) plus the bias; rank r's dx of chunk c is the fp8 dgrad of the
    output gradient G_c, its dW the sum over c of the fp8 wgrads of (G_c, X_r[chunk c])."""
    g, P, K, N = rank_rng(seed), size, 40, 6
    B, S = (2 * P, 3) if scatter_dim == 0 else (2, 2 * P)
    Xs = [_rand(g, B, S, K, dtype=dtype) for _ in range(P)]
    Ws = [_rand(g, N, K, dtype=dtype, scale=K ** -0.5) for _ in range(P)]
    bvec = _rand(g, N, dtype=dtype)
    Gs = [_rand(g, *_chunk(Xs[0], scatter_dim, 0, P).shape[:-1], N, dtype=dtype) for _ in range(P)]

    def xc(q, c):
        return _chunk(Xs[q], scatter_dim, c, P)

    x = Xs[rank].clone().requires_grad_(True)
    w = Ws[rank].clone().requires_grad_(True)
    b = bvec.clone().requires_grad_(True)
    y = matmul_reduce_scatter(x, w, b, scatter_dim=scatter_dim, partial_dtype=partial_dtype, fp8=recipe,
                              fp8_grad_high_precision=hp, transport=transport)
    y.backward(Gs[rank])
    tag = f"RS fp8 {recipe} {dtype} dim{scatter_dim} hp={hp} partial={partial_dtype} tp{size}"
    _check(f"{tag} y", y, sum(_fp8_pre(xc(q, rank), Ws[q], None, recipe).double() for q in range(P)) + bvec.double(),
           dtype)
    _check(f"{tag} dx", x.grad, torch.cat([_fp8_dx(Gs[c], xc(rank, c), w, recipe) for c in range(P)], scatter_dim),
           dtype)
    _check(f"{tag} dW", w.grad, sum(_fp8_dw(Gs[c], xc(rank, c), Ws[rank], recipe, hp) for c in range(P)), dtype)
    _check(f"{tag} db", b.grad, sum(_tokens_sum(G) for G in Gs), dtype)
    return y.detach(), x.grad, w.grad


def _fp8_ar_case(rank, size, *, recipe, hp, seed, num_chunks=3):
    """matmul_all_reduce(fp8=recipe): the sum over q of fp8_linear(X_q, W_q) plus the bias; the
    backward fp8_linear's on this rank's shard."""
    g, P, K, N = rank_rng(seed), size, 40, 6
    Xs = [_rand(g, 2, 5, K, dtype=torch.float32) for _ in range(P)]
    Ws = [_rand(g, N, K, dtype=torch.float32, scale=K ** -0.5) for _ in range(P)]
    bvec, G = _rand(g, N, dtype=torch.float32), _rand(g, 2, 5, N, dtype=torch.float32)
    x, w, b = (t.clone().requires_grad_(True) for t in (Xs[rank], Ws[rank], bvec))
    y = matmul_all_reduce(x, w, b, num_chunks=num_chunks, fp8=recipe, fp8_grad_high_precision=hp)
    y.backward(G)
    tag = f"AR fp8 {recipe} hp={hp} tp{size}"
    _check(f"{tag} y", y, sum(_fp8_pre(Xs[q], Ws[q], None, recipe).double() for q in range(P)) + bvec.double(),
           torch.float32)
    _check(f"{tag} dx", x.grad, _fp8_dx(G, Xs[rank], Ws[rank], recipe), torch.float32)
    _check(f"{tag} dW", w.grad, _fp8_dw(G, Xs[rank], Ws[rank], recipe, hp), torch.float32)
    _check(f"{tag} db", b.grad, _tokens_sum(G), torch.float32)


def _fp8_copy_case(rank, size, *, recipe, activation, hp, seed):
    """copy_to_tp_matmul(fp8=recipe): rank q's act(fp8_linear(X, W_q, b_q)); dx the sum over q
    of the fp8 dgrads of dpre_q (all-reduced), dW the local fp8 wgrad."""
    g, P, K, f_loc = rank_rng(seed), size, 40, 4
    rows = 2 * f_loc if activation in ("swiglu", "geglu") else f_loc
    X = _rand(g, 2, 5, K, dtype=torch.float32)
    Ws = [_rand(g, rows, K, dtype=torch.float32, scale=K ** -0.5) for _ in range(P)]
    bs = [_rand(g, rows, dtype=torch.float32) for _ in range(P)]
    Gs = [_rand(g, 2, 5, f_loc, dtype=torch.float32) for _ in range(P)]
    pre = [_fp8_pre(X, Ws[q], bs[q], recipe) for q in range(P)]
    dpre = [_fp8_dpre(pre[q], Gs[q], activation) for q in range(P)]
    x, w, b = (t.clone().requires_grad_(True) for t in (X, Ws[rank], bs[rank]))
    y = copy_to_tp_matmul(x, w, b, activation=activation, num_chunks=2, fp8=recipe, fp8_grad_high_precision=hp)
    y.backward(Gs[rank])
    tag = f"copy fp8 {recipe} {activation} hp={hp} tp{size}"
    _check(f"{tag} y", y, activation_reference(pre[rank].double(), activation), torch.float32)
    _check(f"{tag} dx", x.grad, sum(_fp8_dx(dpre[q], X, Ws[q], recipe) for q in range(P)), torch.float32)
    _check(f"{tag} dW", w.grad, _fp8_dw(dpre[rank], X, Ws[rank], recipe, hp), torch.float32)
    _check(f"{tag} db", b.grad, _tokens_sum(dpre[rank]), torch.float32)


def _fp8_cases(rank, size, seed, variant):
    """The fp8 cases of one world: every op, both recipes, both gather / scatter dims, kept and
    re-gathered inputs, fp8 and high-precision weight gradients, fp16 with fp16 partials."""
    s = seed
    if variant == 2:
        _fp8_ag_case(rank, size, recipe="rowwise", gather_dim=1, activation="swiglu", keep=True, hp=False, seed=s)
        _fp8_ag_case(rank, size, recipe="blockwise", gather_dim=0, activation="none", keep=False, hp=True,
                     seed=s + 1, dtype=torch.float16)
        _fp8_rs_case(rank, size, recipe="rowwise", scatter_dim=1, hp=False, seed=s + 2)
        _fp8_rs_case(rank, size, recipe="blockwise", scatter_dim=0, hp=True, seed=s + 3, dtype=torch.float16,
                     partial_dtype=torch.float16)
        _fp8_ar_case(rank, size, recipe="rowwise", hp=False, seed=s + 4)
        _fp8_copy_case(rank, size, recipe="blockwise", activation="swiglu", hp=False, seed=s + 5)
        return 6
    if variant == 3:  # the all-gather ring on a SymmetricTransport (a kept input: its portable transfers); the
        # symmetric fp8 reduce-scatter needs symmetric buffers: tests/test_tensor_parallel_symmetric.py's shared-file world
        from fusedpar.ops.comm.symmetric import SymmetricTransport

        _fp8_ag_case(rank, size, recipe="blockwise", gather_dim=1, activation="gelu", keep=True, hp=False, seed=s,
                     transport=SymmetricTransport())
        _fp8_rs_case(rank, size, recipe="rowwise", scatter_dim=1, hp=True, seed=s + 1)
        _fp8_ar_case(rank, size, recipe="blockwise", hp=False, seed=s + 2)
        _fp8_copy_case(rank, size, recipe="rowwise", activation="gelu", hp=True, seed=s + 3)
        return 4
    # the weight gradient alone (x needs none): the re-gather ring runs without the dgrad ring
    _fp8_ag_case(rank, size, recipe="rowwise", gather_dim=1, activation="swiglu", keep=False, hp=True, seed=s,
                 x_grad=False)
    _fp8_rs_case(rank, size, recipe="blockwise", scatter_dim=0, hp=False, seed=s + 1)
    _fp8_ar_case(rank, size, recipe="blockwise", hp=True, seed=s + 2)
    _fp8_copy_case(rank, size, recipe="rowwise", activation="none", hp=False, seed=s + 3)
    return 4


def test_tp_ops_fp8_world2(world2):
    assert world2.run(_fp8_cases, seed=81, variant=2) == [6, 6]


def test_tp_ops_fp8_world3(world3):
    assert world3.run(_fp8_cases, seed=83, variant=3) == [4] * 3


def test_tp_ops_fp8_world4(world4):
    assert world4.run(_fp8_cases, seed=85, variant=4) == [4] * 4


def _fp8_handoff_cases(rank, size, seed):
    """``all_gather_matmul(fp8=recipe, x_fp8=...)`` fed by ``rms_norm_fp8`` against the same op
    quantising the norm's output itself (tests/test_tensor_parallel_fp8_handoff.py): the same bits, output and
    every gradient (the norm's included), both recipes, kept and re-gathered input."""
    from test_tensor_parallel_fp8_handoff import assert_same_bits, norm_then_gemm

    for i, (recipe, dim, act, keep, hp) in enumerate((("rowwise", 1, "swiglu", True, False),
                                                      ("blockwise", 0, "none", False, True))):
        g, K, rows = rank_rng(seed + i, rank), 136, 8
        leaves = [_rand(g, 2, 3, K, dtype=torch.float32), _rand(g, K, dtype=torch.float32),
                  _rand(g, rows, K, dtype=torch.float32, scale=K ** -0.5), _rand(g, rows, dtype=torch.float32)]
        go = _rand(g, *((2, 3 * size) if dim == 1 else (2 * size, 3)), rows // 2 if act == "swiglu" else rows,
                   dtype=torch.float32)
        runs = []
        for handoff in (False, True):
            x, nw, w, b = (t.clone().requires_grad_() for t in leaves)
            y, = norm_then_gemm(x, nw, w, b, recipe=recipe, handoff=handoff, gather_dim=dim, activation=act,
                                save_gathered_input=keep, fp8_grad_high_precision=hp)
            y.backward(go)
            runs.append((y.detach(), x.grad, nw.grad, w.grad, b.grad))
        assert_same_bits(f"x_fp8 {recipe} tp{size}", runs[1], runs[0])
    # the up projection's epilogue tiles handed to the down projection (return_fp8 / x_fp8)
    from test_tensor_parallel_fp8_handoff import up_down_handoff

    for up in ("ag", "copy"):
        up_down_handoff(up, None, seed=seed + 10 * rank)
    return 4


def test_fp8_x_fp8_world2(world2):
    assert world2.run(_fp8_handoff_cases, seed=87) == [4, 4]


@pytest.mark.parametrize("op,waits,recipe", [("ag", False, "rowwise"), ("ag", True, "blockwise"),
                                             ("rs", False, "blockwise"), ("rs", True, "rowwise"),
                                             ("ar", False, "blockwise"), ("copy", False, "rowwise")])
def test_fp8_ops_emulated(op, waits, recipe):
    """One rank of EMU_P on EmulatedTransport (with in-kernel waits the all-gather forward, input not
    kept, is the persistent fp8 GEMM, the other schedules fp8's rings over its transfers), against
    the mirror rule with fp8_linear's bodies: every chunk is this rank's (AG: y = cat(act(pre)),
    dx and dW sum over the chunks' dpre; RS: y = sum over chunks c of the chunk GEMMs, backward
    from EMU_P copies of the output gradient; AR: EMU_P times the local product, the bias on rank
    0; copy: dx EMU_P times the local one)."""
    P, g, K = EMU_P, rank_rng(90 + (op == "rs")), 40
    t = EmulatedTransport(P, 1 if op != "ar" else 0, in_kernel_waits=waits)
    act = "swiglu" if op in ("ag", "copy") else "none"
    rows = 8 if act == "swiglu" else 5
    hp = op == "rs"
    shape = (2, 2 * P, K) if op == "rs" else (2, 3, K)
    x, w, b = _emu_leaves(g, [(shape, 1.0), ((rows, K), K ** -0.5), ((rows,), 1.0)], torch.float32)
    kw = dict(transport=t, fp8=recipe, fp8_grad_high_precision=hp)
    if op == "ag":
        y = all_gather_matmul(x, w, b, activation=act, save_gathered_input=not waits, **kw)
    elif op == "rs":
        y = matmul_reduce_scatter(x, w, b, **kw)
    elif op == "ar":
        y = matmul_all_reduce(x, w, b, num_chunks=2, **kw)
    else:
        y = copy_to_tp_matmul(x, w, b, activation=act, num_chunks=2, **kw)
    G = _rand(g, *y.shape, dtype=torch.float32)
    y.backward(G)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    if op == "rs":
        xs = [xd[:, 2 * c:2 * c + 2] for c in range(P)]
        want = (sum(_fp8_pre(c, wd, None, recipe).double() for c in xs) + bd.double(),
                torch.cat([_fp8_dx(G, c, wd, recipe) for c in xs], 1),
                sum(_fp8_dw(G, c, wd, recipe, hp) for c in xs), P * _tokens_sum(G))
    else:
        pre = _fp8_pre(xd, wd, bd, recipe)
        y_loc = activation_reference(pre.double(), act)
        if op == "ag":
            dpre = [_fp8_dpre(pre, G[:, 3 * c:3 * c + 3], act) for c in range(P)]
            want = (torch.cat([y_loc] * P, 1), sum(_fp8_dx(d, xd, wd, recipe) for d in dpre),
                    sum(_fp8_dw(d, xd, wd, recipe, hp) for d in dpre), sum(_tokens_sum(d) for d in dpre))
        else:
            dpre = _fp8_dpre(pre, G, act)
            scale = P if op == "copy" else 1
            want = (y_loc if op == "copy" else P * y_loc, scale * _fp8_dx(dpre, xd, wd, recipe),
                    _fp8_dw(dpre, xd, wd, recipe, hp), _tokens_sum(dpre))
    _emu_check(f"{op} fp8 {recipe} emulated waits={waits}", (y, x.grad, w.grad, b.grad), want, torch.float32)


def test_fp8_ops_without_process_group_are_fp8_linear():
    """At one rank every op with ``fp8=`` is fp8_linear, bit for bit (output, dx, dW); the weight
    gradient alone (input not requiring grad) runs the weight-gradient steps without the ring."""
    g = rank_rng(95)
    for recipe in ("rowwise", "blockwise"):
        X, W, B = _rand(g, 2, 5, 40, dtype=torch.float32), _rand(g, 6, 40, dtype=torch.float32), \
            _rand(g, 6, dtype=torch.float32)
        G = _rand(g, 2, 5, 6, dtype=torch.float32)
        ref = [t.clone().requires_grad_(True) for t in (X, W, B)]
        ref_y = fp8_linear(*ref, recipe=recipe)
        ref_y.backward(G)
        ref_y = ref_y.detach()
        for op, x_grad in ((all_gather_matmul, True), (all_gather_matmul, False), (matmul_reduce_scatter, True),
                           (matmul_all_reduce, True), (copy_to_tp_matmul, True)):
            x, w, b = X.clone().requires_grad_(x_grad), W.clone().requires_grad_(True), B.clone().requires_grad_(True)
            y = op(x, w, b, fp8=recipe)
            y.backward(G)
            tag = f"{op.__name__} fp8={recipe} x_grad={x_grad}"
            torch.testing.assert_close(y, ref_y, rtol=0, atol=0, msg=tag)
            torch.testing.assert_close(w.grad, ref[1].grad, rtol=0, atol=0, msg=tag)
            assert_close(b.grad, ref[2].grad, torch.float32, msg=tag)
            if x_grad:
                torch.testing.assert_close(x.grad, ref[0].grad, rtol=0, atol=0, msg=tag)
            else:
                assert x.grad is None


class _CountingTransport(EmulatedTransport):
    """An EmulatedTransport that records what each transfer sends: (dtype, bytes)."""

    def __init__(self, size, rank):
        super().__init__(size, rank)
        self.sent = []

    def send_recv(self, send, dst, recv, src):
        if send is not None:
            self.sent.append((send.dtype, send.numel() * send.element_size()))
        return super().send_recv(send, dst, recv, src)


@pytest.mark.parametrize("recipe,scale_bytes", [("rowwise", 4), ("blockwise", 8)])
def test_fp8_all_gather_moves_e4m3_and_scales(recipe, scale_bytes):
    """What travels: the forward ring of ``all_gather_matmul(fp8=...)`` sends each fp16 shard once
    per step as e4m3 + fp32 scales (1 byte per element and 4 per scale, padded to 16 bytes: about
    half of the fp16 shard); the kept weight-gradient operand is a second pack of the same size."""
    P, K, tokens = EMU_P, 256, 6
    x = torch.randn(2, 3, K, dtype=torch.float16, device=DEVICE, requires_grad=True)
    w = (torch.randn(8, K) / 16).to(DEVICE, torch.float16)
    pack = -(-(tokens * scale_bytes) // 16) * 16 + tokens * K
    for keep, sends in ((False, 1), (True, 2)):
        t = _CountingTransport(P, 1)
        with torch.no_grad() if not keep else torch.enable_grad():
            all_gather_matmul(x, w.requires_grad_(keep), transport=t, fp8=recipe)
        n_scales = torch.Size(scale_shape(K, tokens, "row" if recipe == "rowwise" else "tile")).numel()
        kept = -(-(n_scales * 4) // 16) * 16 + K * tokens  # x^T scaled along the tokens
        want = [(torch.uint8, pack)] + ([(torch.uint8, kept)] if keep else [])
        assert sorted(t.sent) == sorted(want * (P - 1)), t.sent
        assert pack < 0.52 * x.numel() * x.element_size()  # 1568 of 3072 bytes (blockwise: 1584)


def test_a_malformed_options_string_names_the_argument():
    """The TP ops' options string (one schema argument, made by ``tp_options``) is checked where it
    is parsed: a direct op call with a malformed one raises a ValueError naming ``options``, what it
    must hold and what it got (it raised a bare unpacking, KeyError or int() error, or indexed x out
    of range), in the op and in its fake (what torch.compile runs) alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusedpar.ops.tensor_parallel.bodies import tp_options
    from fusedpar.ops.tensor_parallel.custom_ops import all_gather_matmul_op, matmul_all_reduce_op

    t, f32 = EmulatedTransport(2, 0), torch.float32
    tid = t.transport_id
    good = tp_options(tid, 1, f32, "none", False, False, False)
    cases = [(all_gather_matmul_op, s) for s in (
        "1|none|float32|", f"x|none|float32||000|{tid}", f"1|none|float64||000|{tid}", f"1|none|float32||01|{tid}",
        f"1|none|float32||012|{tid}", f"2|none|float32||000|{tid}", f"-1|none|float32||000|{tid}")]
    cases += [(matmul_all_reduce_op, f"0|none|float32|||{tid}")]
    for fake in (False, True):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            x, w = torch.randn(2, 4, 8), torch.randn(6, 8)
            assert all_gather_matmul_op(x, w, None, good)[0].shape == (2, 8, 6)
            for op, bad in cases:
                name = op._name.split("::")[-1]
                with pytest.raises(ValueError, match=rf"{name}: options must be 'dim\|activation.*got '{re.escape(bad)}'"):
                    op(x, w, None, bad)
