"""The fp8 ops under ``torch.compile``: ``opcheck`` of every fp8 custom op (``fp8_linear``, the
RMSNorm with its e4m3 output, and the fp8 tensor-parallel GEMMs on an ``EmulatedTransport`` of
size 2, their backward ops called directly too) and compiled calls (forward and backward, aot_eager on the CPU interpreter) equal to
eager: ``fp8_linear`` and a tensor-parallel MLP with ``fp8=`` (both recipes)."""
from __future__ import annotations

import pytest
import torch

from _utils import BACKWARD_OPCHECK, INTERPRETED
from fusedpar.nn import ParallelMLP
from fusedpar.ops import fp8_linear, rms_norm_fp8
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.ops.tensor_parallel.bodies import tp_options

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="CPU-interpreter test (aot_eager)")

OPS = torch.ops.fusedpar
F32 = torch.float32


def _r(g, *shape, grad=False):
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def test_fp8_linear_under_torch_compile():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, generator=g).requires_grad_()
    w = torch.randn(6, 40, generator=g).requires_grad_()
    b = torch.randn(6, generator=g).requires_grad_()
    torch.library.opcheck(OPS.fp8_linear.default, (x, w, b, "blockwise", False),
                          test_utils=BACKWARD_OPCHECK + ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(OPS.fp8_linear_backward.default,
                          (torch.randn(2, 3, 6, generator=g), x.detach(), w.detach(), "rowwise", True, True, True),
                          test_utils=BACKWARD_OPCHECK)

    def fn(x, w, b):
        return fp8_linear(torch.relu(x), w, b, recipe="rowwise").sum()

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        out = f(xs, ws, bs)
        out.backward()
        results.append((out.detach(), xs.grad, ws.grad, bs.grad))
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_fp8_tp_ops_opcheck():
    """Every fp8 tensor-parallel op (rowwise and blockwise, the gathered pack kept and not, fp8
    and high-precision weight gradients) and every backward op."""
    t = EmulatedTransport(2, rank=1)  # held for the whole test: the transport id names it weakly
    g, K, transport_id = torch.Generator().manual_seed(5), 40, t.transport_id
    # options: (transport id, dim or num_chunks, partial dtype, activation; flags), the recipe
    ag_keep = tp_options(transport_id, 1, F32, "swiglu", False, True, True, False, recipe="blockwise")
    gathered = OPS.all_gather_matmul_fp8(_r(g, 2, 3, K), _r(g, 6, K), None, ag_keep)[2]
    forward = [
        (OPS.all_gather_matmul_fp8, (_r(g, 2, 3, K, grad=True), _r(g, 6, K, grad=True), _r(g, 6, grad=True), ag_keep)),
        (OPS.all_gather_matmul_fp8, (_r(g, 3, K, grad=True), _r(g, 4, K, grad=True), None,
                                     tp_options(transport_id, 0, F32, "none", True, True, False, False, recipe="rowwise"))),
        (OPS.matmul_reduce_scatter_fp8, (_r(g, 2, 4, K, grad=True), _r(g, 5, K, grad=True), _r(g, 5, grad=True),
                                         tp_options(transport_id, 1, F32, "none", False, recipe="rowwise"))),
        (OPS.matmul_all_reduce_fp8, (_r(g, 3, K, grad=True), _r(g, 5, K, grad=True), _r(g, 5, grad=True),
                                     tp_options(transport_id, 2, F32, "none", True, recipe="blockwise"))),
        (OPS.copy_to_tp_matmul_fp8, (_r(g, 2, 3, K, grad=True), _r(g, 6, K, grad=True), _r(g, 6, grad=True),
                                     tp_options(transport_id, 2, F32, "geglu", False, True, False, recipe="rowwise"))),
    ]
    for op, args in forward:
        torch.library.opcheck(op, args)
    backward = [
        (OPS.all_gather_matmul_fp8_backward, (_r(g, 2, 6, 3), None, gathered, _r(g, 6, K), _r(g, 2, 2, 3, 6), transport_id, 1,
                                              "swiglu", F32, "blockwise", False, True, True, True)),
        (OPS.all_gather_matmul_fp8_backward, (_r(g, 6, 4), _r(g, 3, K), None, _r(g, 4, K), None, transport_id, 0, "none", F32,
                                              "rowwise", True, True, True, False)),
        (OPS.matmul_reduce_scatter_fp8_backward, (_r(g, 2, 2, 5), _r(g, 2, 4, K), _r(g, 5, K), transport_id, 1, F32,
                                                  "blockwise", True, True, True, True)),
        (OPS.copy_to_tp_matmul_fp8_backward, (_r(g, 2, 3, 3), _r(g, 2, 3, K), _r(g, 6, K), _r(g, 2, 3, 6), transport_id,
                                              "geglu", 2, F32, "rowwise", False, True, True, True)),
    ]
    for op, args in backward:
        torch.library.opcheck(op, args, test_utils=BACKWARD_OPCHECK)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_mlp_under_torch_compile(recipe):
    """``ParallelMLP(fp8=...)`` (one rank, sequence parallel): compiled with ``fullgraph=True``,
    no graph break; the output and every gradient equal to eager (the same ops run)."""
    torch.manual_seed(0)
    mlp = ParallelMLP(40, 24, activation="swiglu", fp8=recipe)
    x = torch.randn(2, 3, 40)
    results = []
    for f in (mlp, torch.compile(mlp, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        mlp.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        y = f(xs)
        y.pow(2).sum().backward()
        results.append((y.detach(), xs.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad))
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_rms_norm_fp8_under_torch_compile():
    """``fusedpar::rms_norm_fp8``: opcheck (its aot test is left out: it sums the e4m3 output,
    which CPU torch cannot), and a fullgraph compiled call equal to eager bit for bit, the
    gradients through ``y`` included."""
    g = torch.Generator().manual_seed(7)
    x, w, r = _r(g, 2, 3, 200), _r(g, 200), _r(g, 2, 3, 200)
    torch.library.opcheck(OPS.rms_norm_fp8.default, (x.clone().requires_grad_(), w.clone().requires_grad_(), r, 1e-5,
                                                     "blockwise"), test_utils=BACKWARD_OPCHECK)

    def fn(x, w):
        y, q, scale = rms_norm_fp8(x, w, 1e-5, recipe="rowwise")
        return y, q.view(torch.uint8), scale

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, q, scale = f(xs, ws)
        y.square().sum().backward()
        results.append((y.detach(), q, scale, xs.grad, ws.grad))
    for a, c in zip(*results):
        assert torch.equal(a, c)
