"""The eager path of the TP ops (``fusedpar.ops.common.call_op``): in plain eager mode a forward
op's body runs without torch's dispatcher, under an ``autograd.Function`` made of the op's own
backward and setup_context when an input requires grad. Its outputs and gradients are the
dispatched op's bit for bit (the same body and backward on the same inputs); anything unusual
(a dispatch or function mode, a tensor subclass, functorch, the profiler, ``torch.compile``)
takes the dispatcher. One process, the emulated transport at tp 3, fp32 under the interpreter."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedpar.ops import all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.ops.common import call_op, plain_eager
from fusedpar.ops.tensor_parallel.custom_ops import all_gather_matmul_op


class PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: the ops go through torch's dispatcher."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


T = EmulatedTransport(3, 1)
CASES = {
    "all_gather_matmul": (lambda x, w, b: all_gather_matmul(x, w, b, gather_dim=0, transport=T, activation="gelu"),
                          (5, 8), (6, 8)),
    "matmul_reduce_scatter": (lambda x, w, b: matmul_reduce_scatter(x, w, b, scatter_dim=0, transport=T),
                              (9, 8), (6, 8)),
    "matmul_all_reduce": (lambda x, w, b: matmul_all_reduce(x, w, b, transport=T, num_chunks=2), (7, 8), (6, 8)),
    "copy_to_tp_matmul": (lambda x, w, b: copy_to_tp_matmul(x, w, b, transport=T, num_chunks=2), (7, 8), (6, 8)),
}


def _run(case, grad: bool, dispatched: bool, seed=0):
    fn, xs, ws = CASES[case]
    x, w, b = _rnd(*xs, seed=seed), _rnd(*ws, seed=seed + 1), _rnd(ws[0], seed=seed + 2)
    for t in (x, w, b):
        t.requires_grad_(grad)
    if dispatched:
        with PassThrough():
            y = fn(x, w, b)
    else:
        y = fn(x, w, b)
    name = type(y.grad_fn).__name__ if y.grad_fn is not None else None
    if not grad:
        return y, None, name
    g = _rnd(*y.shape, seed=seed + 3)
    if dispatched:
        with PassThrough():
            y.backward(g)
    else:
        y.backward(g)
    return y.detach(), (x.grad, w.grad, b.grad), name


@pytest.mark.parametrize("case", list(CASES))
def test_eager_path_equals_the_dispatched_op(case):
    y, grads, node = _run(case, grad=True, dispatched=False)
    y_ref, grads_ref, node_ref = _run(case, grad=True, dispatched=True)
    assert node.startswith("Eager_fusedpar_") and node_ref.startswith("GeneratedBackwardFor_fusedpar_"), (node, node_ref)
    assert torch.equal(y, y_ref)
    for got, want, name in zip(grads, grads_ref, ("x", "weight", "bias")):
        assert got is not None and torch.equal(got, want), name
    y, _, node = _run(case, grad=False, dispatched=False)
    y_ref, _, _ = _run(case, grad=False, dispatched=True)
    assert node is None and torch.equal(y, y_ref) and not y.requires_grad


def test_plain_eager_takes_only_plain_calls():
    x = _rnd(2, 3, seed=0)
    assert plain_eager((x, torch.nn.Parameter(x), None, "options"))
    with PassThrough():
        assert not plain_eager((x,))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not plain_eager((x,))

    class Sub(torch.Tensor):
        pass

    assert not plain_eager((x.as_subclass(Sub),))
    seen = []
    torch.vmap(lambda row: (seen.append(plain_eager((row,))), row)[1])(x)
    assert seen == [False]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not plain_eager((x,))
    with torch.overrides.TorchFunctionMode():
        assert not plain_eager((x,))
    assert not plain_eager((x, torch.empty(2, device="meta")))  # the op's fake answers
    seen.clear()
    torch.jit.trace(lambda v: (seen.append(plain_eager((v,))), v * 2)[1], (x,), check_trace=False)
    assert seen == [False]  # a trace records the op, not its body


def test_meta_tensors_get_the_fake_shapes():
    x, w = torch.empty(5, 8, device="meta"), torch.empty(6, 8, device="meta")
    y = all_gather_matmul(x, w, gather_dim=0, transport=T)
    assert y.device.type == "meta" and y.shape == (15, 6)


def test_call_op_under_a_mode_dispatches():
    """Under a dispatch mode the mode sees the custom op itself (what tracing and fake tensors
    need); in plain eager mode it does not run at all."""
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = _rnd(5, 8, seed=4), _rnd(6, 8, seed=5)
    from fusedpar.ops.comm.keys import transport_id_of
    from fusedpar.ops.tensor_parallel.bodies import tp_options
    options = tp_options(transport_id_of(T, None), 0, torch.float32, "none", False, False, False)
    with Spy():
        out, _, _ = call_op(all_gather_matmul_op, x, w, None, options)
    assert any("fusedpar.all_gather_matmul" in s for s in seen), seen
    ref, _, _ = call_op(all_gather_matmul_op, x, w, None, options)
    assert torch.equal(out, ref)
