"""torch.compile of the fused linear cross entropy and of the loss over the data ranks, one
process: ``torch.library.opcheck`` of ``fusedpar::linear_cross_entropy``,
``fusedpar::linear_cross_entropy_backward`` and ``fusedpar::global_loss`` (ragged shapes;
tp2 with and without sequence parallelism on an ``EmulatedTransport``), and
``torch.compile(..., backend="aot_eager", fullgraph=True)`` equal to eager (loss and both
gradients) with every option on.

Tolerance: eager and compiled run the same op bodies (aot_eager keeps fusedpar ops opaque): 1e-5."""
import pytest
import torch
from _utils import BACKWARD_OPCHECK, DEVICE

from fusedpar.ops import global_loss, linear_cross_entropy
from fusedpar.ops.comm.transport import EmulatedTransport

TOL = dict(rtol=1e-5, atol=1e-5)
OPCHECK_TESTS = BACKWARD_OPCHECK + ("test_aot_dispatch_dynamic",)


def _args(g, T=7, H=6, V=5, P=1):
    """fp32 hidden states, weight and targets on the test device (drawn on the host)."""
    h = torch.randn(T, H, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(DEVICE).requires_grad_()
    t = torch.randint(0, V * P, (T,), generator=g)
    t[2] = -100
    return h, w, t.to(DEVICE)


def test_opcheck_linear_cross_entropy_ops():
    g = torch.Generator().manual_seed(0)
    emulated = EmulatedTransport(2, 1)  # held: a transport id names its transport weakly
    for transport_id, P, sp in (("@", 1, False), (emulated.transport_id, 2, False), (emulated.transport_id, 2, True)):
        h, w, t = _args(g, P=P)
        if sp:  # [b, s / tp, H], the targets of both blocks in block order
            h = h.detach()[:6].view(2, 3, 6).requires_grad_()
            t = torch.cat([t[:6], t[:6]])
        opts = (transport_id, sp, -100, 0.1, 1e-2, 3.0, 4)
        torch.library.opcheck(torch.ops.fusedpar.linear_cross_entropy.default, (h, w, t, *opts, True),
                              test_utils=OPCHECK_TESTS)
        loss, lse, gathered = torch.ops.fusedpar.linear_cross_entropy(h.detach(), w.detach(), t, *opts, False)
        torch.library.opcheck(torch.ops.fusedpar.linear_cross_entropy_backward.default,
                              (torch.randn_like(loss), h.detach(), w.detach(), t, lse, gathered, *opts, True, True),
                              test_utils=BACKWARD_OPCHECK)
    total = torch.tensor(3.5, requires_grad=True)
    for transport_ids in ("", "@", f"@;{emulated.transport_id}"):
        torch.library.opcheck(torch.ops.fusedpar.global_loss.default, (total, torch.tensor(4), transport_ids, True),
                              test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("sp", [False, True])
def test_compiled_matches_eager(sp):
    g = torch.Generator().manual_seed(1)
    emulated = EmulatedTransport(2, 0)
    h, w, t = _args(g, T=12, P=2)
    h = h.detach().view(2, 6, 6)[:, :3] if sp else h.detach().view(2, 6, 6)
    t = t.view(2, 6)

    def fn(h, w):
        return linear_cross_entropy(h, w, t, transport=emulated, sequence_parallel=sp, label_smoothing=0.1,
                                    z_loss=1e-2, softcap=3.0, chunk_tokens=5, data_group=(None,))

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        hh, ww = h.clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = f(hh, ww)
        out.backward()
        results.append((out.detach(), hh.grad, ww.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.isfinite(results[0][0])


def test_global_loss_single_process_is_the_plain_mean():
    total = torch.tensor(6.0, requires_grad=True)
    out = global_loss(total, torch.tensor(4), None)
    out.backward()
    assert out.item() == 1.5 and total.grad.item() == 0.25
