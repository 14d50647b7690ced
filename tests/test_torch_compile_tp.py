"""The tensor-parallel ops under ``torch.library.opcheck`` and the tensor-parallel modules under
``torch.compile(backend="aot_eager", fullgraph=True)``, at world 1 and in a gloo world of 2.

* opcheck (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes, which
  also runs each backward op through ``register_autograd``) on every op of
  :mod:`fusedpar.ops.tensor_parallel.custom_ops`: in this process on an ``EmulatedTransport`` of size 2 (the
  multi-rank schedules in one process; its transport id names the instance), the backward ops called
  directly too. In the world of 2 the fakes run on name ids (a process group) while the
  modules compile.
* compiled modules: ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP`` (sequence
  parallel and not, an activation): no graph break (``fullgraph=True``), the output and every
  input and parameter gradient equal to eager. Eager mode is checked against fp64 references by
  tests/test_tensor_parallel_ops.py and tests/test_nn_tensor_parallel.py; here both sides run the same kernels in the same
  order (aot_eager calls the same custom ops), so the comparison is exact (tolerance 0).
"""
import pytest
import torch

from _utils import BACKWARD_OPCHECK, INTERPRETED
from _world import rank_rng
from fusedpar.nn import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from fusedpar.ops import all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter
from fusedpar.ops.tensor_parallel.api import gather_features, scatter_features
from fusedpar.ops.tensor_parallel.bodies import tp_options
from fusedpar.ops.comm.transport import EmulatedTransport

# CPU tensors under the interpreter (opcheck, aot_eager); on a GPU the compiled check is the block test
# (tests/test_torch_compile_block.py runs its one-process cases there with inductor)
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="CPU-interpreter test; on a GPU: test_torch_compile_block")

OPS = torch.ops.fusedpar
F32 = torch.float32


def _r(g, *shape, grad=False):
    return torch.randn(*shape, generator=g).requires_grad_(grad)


# ----------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------
def _forward_cases(transport_id, P, g):
    """``(op, args)`` for every forward op: small odd shapes, inputs that require grad."""
    K = 5
    return [
        # all_gather_matmul: gated activation, pre-activation and gathered input kept
        (OPS.all_gather_matmul, (_r(g, 2, 3, K, grad=True), _r(g, 6, K, grad=True), _r(g, 6, grad=True),
                                 tp_options(transport_id, 1, F32, "swiglu", True, True, True))),
        (OPS.matmul_reduce_scatter, (_r(g, 2, 3 * P, K, grad=True), _r(g, 4, K, grad=True), _r(g, 4, grad=True),
                                     tp_options(transport_id, 1, F32))),
        (OPS.matmul_all_reduce, (_r(g, 3, K, grad=True), _r(g, 4, K, grad=True), _r(g, 4, grad=True),
                                 tp_options(transport_id, 2, F32))),
        (OPS.copy_to_tp_matmul, (_r(g, 2, 3, K, grad=True), _r(g, 6, K, grad=True), _r(g, 6, grad=True),
                                 tp_options(transport_id, 2, F32, "geglu", True))),
        (OPS.gather_features, (_r(g, 2, 3, 3, grad=True), transport_id)),
        (OPS.scatter_features, (_r(g, 3, 2 * P, grad=True), transport_id)),
        (OPS.all_gather_tokens, (_r(g, 2, 3, 5, grad=True), transport_id, 1)),
    ]


def _backward_cases(transport_id, P, g):
    """``(op, args)`` for every backward op, called directly (every gradient asked for)."""
    K = 5
    x, gathered = _r(g, 2, 3, K), _r(g, P, 2, 3, K)
    return [
        (OPS.all_gather_matmul_backward, (_r(g, 2, 3 * P, 3), None, gathered, _r(g, 6, K), _r(g, P, 2, 3, 6),
                                          transport_id, 1, "swiglu", F32, True, True, True)),
        (OPS.all_gather_matmul_backward, (_r(g, 2 * P, 3, 4), x, None, _r(g, 4, K), None, transport_id, 0, "none", F32,
                                          True, True, False)),
        (OPS.matmul_reduce_scatter_backward, (_r(g, 2, 3, 4), _r(g, 2, 3 * P, K), _r(g, 4, K), transport_id, 1, F32,
                                              True, True, True)),
        (OPS.matmul_all_reduce_backward, (_r(g, 3, 4), _r(g, 3, K), _r(g, 4, K), True, True, True)),
        (OPS.copy_to_tp_matmul_backward, (_r(g, 2, 3, 3), x, _r(g, 6, K), _r(g, 6, 6), transport_id, "geglu", 2, F32,
                                          True, True, True)),
        (OPS.all_gather_tokens_backward, (_r(g, 2, 3 * P, 5), transport_id, 1)),
    ]


def _opcheck_all(cases, test_utils=None):
    for op, args in cases:
        if test_utils is None:
            torch.library.opcheck(op, args)
        else:
            torch.library.opcheck(op, args, test_utils=test_utils)


def test_opcheck_on_an_emulated_transport():
    t = EmulatedTransport(2, rank=1)  # held for the whole test: the transport id names it weakly
    g = rank_rng(11)
    _opcheck_all(_forward_cases(t.transport_id, t.size, g))
    _opcheck_all(_backward_cases(t.transport_id, t.size, g), BACKWARD_OPCHECK)


# ----------------------------------------------------------------------------------------------
# torch.compile: modules and functional ops, equal to eager
# ----------------------------------------------------------------------------------------------
def _check_compiled(fn, params, inputs, g, tag):
    """Run ``fn(*inputs)`` eagerly and compiled (aot_eager, fullgraph); the outputs and the
    gradients of ``inputs`` and ``params`` must be equal."""
    leaves = list(inputs) + list(params)
    y = fn(*inputs)
    ys = y if isinstance(y, tuple) else (y,)
    grads_out = [torch.randn(t.shape, generator=g) for t in ys]
    torch.autograd.backward([t for t in ys if t.requires_grad], [d for t, d in zip(ys, grads_out) if t.requires_grad])
    want = [t.detach() for t in ys] + [p.grad for p in leaves]
    for p in leaves:
        p.grad = None
    yc = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
    ycs = yc if isinstance(yc, tuple) else (yc,)
    torch.autograd.backward([t for t in ycs if t.requires_grad],
                            [d for t, d in zip(ycs, grads_out) if t.requires_grad])
    got = [t.detach() for t in ycs] + [p.grad for p in leaves]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None and b is not None, f"{tag}: result {i} missing"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{tag}: result {i}\n{m}")


def _module_cases(size):
    """``(tag, module, input shape)``: every module and layout at tensor-parallel degree ``size``
    (at tp 1 the MLPs only: the feature gather / scatter of the others are then the identity)."""
    H, F, S = 9, 3 * size, 5 * size
    return [
        ("mlp sp swiglu", lambda: ParallelMLP(H, F, activation="swiglu", sequence_parallel=True), (2, 5, H)),
        ("mlp no-sp gelu bias", lambda: ParallelMLP(H, F, activation="gelu", sequence_parallel=False, bias=True,
                                                    save_gathered_input=False), (2, S, H)),
        ("column sp regather gather_output", lambda: ColumnParallelLinear(H, F, sequence_parallel=True,
                                                                          gather_output=True,
                                                                          save_gathered_input=False), (2, 5, H)),
        ("row no-sp input not parallel", lambda: RowParallelLinear(2 * size, H, sequence_parallel=False,
                                                                   input_is_parallel=False), (3, S, 2 * size)),
    ]


def _compile_modules(rank, size, seed):
    g = rank_rng(seed)
    for tag, make, shape in _module_cases(size)[:2 if size == 1 else None]:
        torch.manual_seed(seed)  # the same full weights on every rank
        module = make()
        x = torch.randn(*shape, generator=g).requires_grad_(True)
        _check_compiled(module, list(module.parameters()), [x], g, f"{tag} (tp={size})")
        torch._dynamo.reset()
    return True


def test_compiled_modules_equal_eager_world1():
    _compile_modules(0, 1, seed=21)


def test_compiled_modules_equal_eager_world2(world2_compile):
    assert all(world2_compile.run(_compile_modules, seed=22))


def test_compiled_ops_on_an_emulated_transport():
    """The functional ops with a Transport instance (its transport id is a constant of the graph) and
    the options the modules do not use: return_gathered, gather / scatter dim 0, 2-D inputs."""
    t = EmulatedTransport(2, rank=1)
    g = rank_rng(23)

    x, w1, b1, w2 = _r(g, 3, 4, 5, grad=True), _r(g, 6, 5, grad=True), _r(g, 6, grad=True), _r(g, 7, 3, grad=True)
    x2, w3 = _r(g, 3, 5, grad=True), _r(g, 4, 5, grad=True)

    def fn(x, x2):  # the weights: closed over, as a module's parameters are
        y, xg = all_gather_matmul(x, w1, b1, gather_dim=0, activation="swiglu", return_gathered=True, transport=t)
        z = matmul_reduce_scatter(y, w2, scatter_dim=0, transport=t)
        u = copy_to_tp_matmul(x2, w3, activation="relu", num_chunks=2, transport=t)
        v = matmul_all_reduce(scatter_features(gather_features(u, transport=t), transport=t), w3.t().contiguous(),
                              num_chunks=3, transport=t)
        return z, xg, v

    _check_compiled(fn, [w1, b1, w2, w3], [x, x2], g, "emulated ops")  # xg: an output, not differentiable
