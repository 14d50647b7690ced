"""``fusedpar.ops.fp8_linear`` under ``torch.compile``: ``opcheck`` of both custom ops and a
compiled call (forward and backward, aot_eager on the CPU interpreter) equal to eager."""
from __future__ import annotations

import pytest
import torch

from _utils import BACKWARD_OPCHECK, INTERPRETED
from fusedpar.ops import fp8_linear


@pytest.mark.skipif(not INTERPRETED, reason="CPU-interpreter test (aot_eager)")
def test_fp8_linear_under_torch_compile():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, generator=g).requires_grad_()
    w = torch.randn(6, 40, generator=g).requires_grad_()
    b = torch.randn(6, generator=g).requires_grad_()
    torch.library.opcheck(torch.ops.fusedpar.fp8_linear.default, (x, w, b, "blockwise", False),
                          test_utils=BACKWARD_OPCHECK + ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(torch.ops.fusedpar.fp8_linear_backward.default,
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
