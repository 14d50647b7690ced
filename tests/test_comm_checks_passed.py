"""``agreement.checks_passed``: an op's argument checks run once per kind of call (the same op,
transport, tensor types / shapes / dtypes / devices and other arguments of the same values and
types), never where the agreement check exchanges (a collective every rank must make), and a
call unlike every kept one is checked: its error is the one the checks raise."""
import pytest
import torch

from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter
from fusedpar.ops.comm import agreement
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.ops.tensor_parallel import api


@pytest.fixture
def counted(monkeypatch):
    """``{name: calls}`` of the TP GEMM ops' check functions."""
    calls = {}
    for name in ("_ag_checks", "_rs_checks", "_reduce_checks"):
        real = getattr(api, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(api, name, counting)
    agreement._passed.clear()
    yield calls
    agreement._passed.clear()


def _operands(seed=0, rows=8, k=16, n=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g, dtype=dtype), torch.randn(n, k, generator=g, dtype=dtype)


def test_a_call_alike_runs_no_checks_and_gives_the_same_result(counted):
    t = EmulatedTransport(2, 0)
    x, w = _operands()
    first = all_gather_matmul(x, w, gather_dim=0, transport=t)
    x2, _ = _operands(seed=1)
    second = all_gather_matmul(x2, w, gather_dim=0, transport=t)  # other values, the same kind of call
    assert counted == {"_ag_checks": 1}
    ref = torch.cat([x2, x2]).double() @ w.double().T  # (an emulated peer holds this rank's shard)
    torch.testing.assert_close(second.double(), ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(first, second)
    matmul_reduce_scatter(x, w, scatter_dim=0, transport=t)
    matmul_reduce_scatter(x, w, scatter_dim=0, transport=t)
    assert counted == {"_ag_checks": 1, "_rs_checks": 1}


@pytest.mark.parametrize("change, error", [
    (dict(gather_dim=True), "gather_dim"),  # equal to 1 (a kept call's), of another type
    (dict(activation="swish"), "activation"),
    (dict(weight=torch.randn(24, 16, dtype=torch.float64)), "dtype"),
    (dict(weight=torch.randn(24, 12)), "weight must have shape"),
    (dict(x=torch.randn(2, 8, 16, 4)), "x"),
    (dict(transport="nonesuch"), "transport"),
], ids=["bool-dim", "activation", "weight-dtype", "weight-shape", "x-dims", "transport-name"])
def test_a_call_unlike_the_kept_ones_is_checked(counted, change, error):
    t = EmulatedTransport(2, 0)
    x, w = _operands()
    args = dict(x=torch.randn(2, 8, 16), weight=w, gather_dim=1, transport=t, activation="relu")
    all_gather_matmul(**args)
    all_gather_matmul(**args)
    assert counted == {"_ag_checks": 1}
    with pytest.raises((ValueError, TypeError), match=error):
        all_gather_matmul(**dict(args, **change))
    with pytest.raises((ValueError, TypeError), match=error):  # a failed call is not kept
        all_gather_matmul(**dict(args, **change))


def test_nothing_is_kept_where_the_agreement_check_exchanges(counted, monkeypatch):
    monkeypatch.setattr(agreement, "_exchanges", lambda transport, group: True)
    t = EmulatedTransport(2, 0)
    x, w = _operands()
    for _ in range(3):
        all_gather_matmul(x, w, gather_dim=0, transport=t)
    assert counted == {"_ag_checks": 3} and not agreement._passed


def test_turning_the_agreement_check_on_or_off_forgets_the_kept_calls(counted):
    t = EmulatedTransport(2, 0)
    x, w = _operands()
    all_gather_matmul(x, w, gather_dim=0, transport=t)
    assert agreement._passed
    agreement.set_agreement_check(None)
    assert not agreement._passed
    all_gather_matmul(x, w, gather_dim=0, transport=t)
    assert counted == {"_ag_checks": 2}


def test_checks_passed_itself():
    agreement._passed.clear()
    runs = []
    t = EmulatedTransport(2, 0)
    x = torch.zeros(2, 3)

    def checks():
        runs.append(1)
        return ("derived",)

    assert agreement.checks_passed("op", t, None, (x, None), (1, "a"), checks) == ("derived",)
    assert agreement.checks_passed("op", t, None, (x.new_ones(2, 3), None), (1, "a"), checks) == ("derived",)
    assert len(runs) == 1
    for tensors, scalars in [((x.double(), None), (1, "a")), ((x, x), (1, "a")), ((x[:1], None), (1, "a")),
                             ((x, None), (True, "a")), ((x, None), (1.0, "a")), ((x, None), (1, "b"))]:
        agreement.checks_passed("op", t, None, tensors, scalars, checks)
    assert len(runs) == 7
    agreement.checks_passed("op", t, None, (x, None), ([1], "a"), checks)  # an argument that cannot be hashed
    agreement.checks_passed("op", t, None, (x, None), ([1], "a"), checks)
    agreement.checks_passed("op", t, None, ([x], None), (1, "a"), checks)  # a list where a tensor goes
    agreement.checks_passed("op", t, None, ([x], None), (1, "a"), checks)
    assert len(runs) == 11
    agreement._passed.clear()


def test_a_kept_call_keeps_no_transport_alive():
    """A transport made for a few calls (a benchmark's sweep) is freed with its buffers once the
    caller drops it: the kept checks hold it weakly."""
    import gc
    import weakref

    agreement._passed.clear()
    t = EmulatedTransport(2, 0)
    x, w = _operands()
    all_gather_matmul(x, w, gather_dim=0, transport=t)
    assert agreement._passed
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None
    agreement._passed.clear()
