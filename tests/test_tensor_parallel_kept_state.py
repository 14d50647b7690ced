"""What a transport keeps between TP op calls (ring buffers, symmetric workspaces, their running
sums and flags, offset tables, ready and timeout words) is made outside inference mode: a call under
``torch.inference_mode()`` that makes or grows it (an eval pass first, or with longer sequences)
must not leave an inference tensor that a later training call writes in place (torch raises
"Inplace update to inference tensor outside InferenceMode"). One process, the emulated transport
at tp 3 (rings and in-kernel waits), fp32 under the interpreter; results against a fresh
transport's, gradients included."""
import pytest
import torch

from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.comm.transport import EmulatedTransport


def _rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _train(op, transport, rows, seed):
    """One call needing gradients; ``(out, dx, dw)``."""
    k = 8
    x = _rnd(rows, k, seed=seed).requires_grad_()
    w = _rnd(6, k, seed=seed + 1).requires_grad_()
    if op == "ag":
        y = all_gather_matmul(x, w, gather_dim=0, transport=transport)
    else:
        y = matmul_reduce_scatter(x, w, scatter_dim=0, transport=transport)
    y.backward(_rnd(*y.shape, seed=seed + 2))
    return y.detach(), x.grad, w.grad


def _eval(op, transport, rows, seed):
    with torch.inference_mode():
        x, w = _rnd(rows, 8, seed=seed), _rnd(6, 8, seed=seed + 1)
        if op == "ag":
            return all_gather_matmul(x, w, gather_dim=0, transport=transport)
        return matmul_reduce_scatter(x, w, scatter_dim=0, transport=transport)


@pytest.mark.parametrize("waits", [False, True], ids=["ring", "in_kernel_waits"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_state_made_under_inference_mode_serves_training_calls(op, waits):
    rows = 6 if op == "rs" else 2  # (the reduce-scatter's rows: a multiple of tp)
    t = EmulatedTransport(3, 1, in_kernel_waits=waits)
    first = _eval(op, t, rows * 4, seed=10)  # an eval pass first, longer than training's
    assert first.is_inference()
    got = _train(op, t, rows, seed=0)
    _eval(op, t, rows * 8, seed=20)  # longer again: every kept buffer grows under inference mode
    again = _train(op, t, rows, seed=0)
    want = _train(op, EmulatedTransport(3, 1, in_kernel_waits=waits), rows, seed=0)
    for g, a, w_ in zip(got, again, want):
        assert torch.equal(g, w_) and torch.equal(a, w_)
