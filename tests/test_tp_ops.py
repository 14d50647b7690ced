"""fusedpar.ops tensor-parallel GEMMs on real gloo worlds (2, 3, 4 ranks) against one-process fp64.

Every rank builds the same full problem from a shared generator, runs the distributed op on its
shard, and compares its output shard and ALL its gradients (input, weight, bias) with the fp64
single-process reference. Tolerances: the per-dtype ones of tests/_utils.py (fp32 ieee GEMMs;
fp16 inputs and outputs rounded once, partial sums in fp32).

The same ops also run as one rank of a world on ``EmulatedTransport`` (no process spawn), against
fp64 references that follow the transport's mirror rule (the ``*_emulated`` tests).
"""
import pytest
import torch

from _utils import DEVICE, assert_close
from _world import rank_rng, straggle, world_fixture
from fusedpar.ops import comm
from fusedpar.kernels.runtime import activation_reference
from fusedpar.ops import all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter
from fusedpar.ops.tensor_parallel import all_gather_tokens, gather_features, scatter_features
from fusedpar.ops.transport import EmulatedTransport

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
    """The modules' sequence-parallel paths at tp=4 (the cases live in test_tp_nn.py)."""
    from test_tp_nn import modules_vs_reference

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
    assert world2.run(_bad_inputs) == [15, 15]


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
# the fp64 references follow the mirror rule of each transfer (fusedpar.ops.transport)
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
