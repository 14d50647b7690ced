"""Argument errors under ``torch.compile(fullgraph=True)``: a failing check of a functional API
reaches the caller with the eager error's type and message (``fusedpar.ops.common.checked_api``),
not as Dynamo's ``Unsupported: Observed exception``. One bad call per op family, compiled with
``aot_eager`` on CPU (inductor on a GPU), in one process (world 1 / EmulatedTransport).
"""
import pytest
import torch

from _utils import DEVICE, INTERPRETED
from fusedpar.ops import (
    EmulatedTransport,
    all_gather_matmul,
    flash_attention,
    fp8_linear,
    linear_cross_entropy,
    moe_mlp,
    ring_attention,
    rms_norm,
    vocab_parallel_cross_entropy,
)
from fusedpar.ops.sequence_parallel.layouts import sequence_shard

BACKEND = "aot_eager" if INTERPRETED else "inductor"


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEVICE, dtype)


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


# name -> () -> (op, args, kwargs): each fails one argument check; compiled, it must raise the same error
# (inputs and transports are built outside the compiled function: building a transport is not traceable)
CASES = {
    "tensor_parallel dtype": lambda: (all_gather_matmul, (_r(2, 4, 8), _r(6, 8, dtype=torch.float64)),
                                      dict(transport=EmulatedTransport(2))),
    "tensor_parallel shape": lambda: (all_gather_matmul, (_r(2, 4, 8), _r(6, 5)), dict(transport=EmulatedTransport(2))),
    "sp_attention layout": lambda: (ring_attention, (_r(1, 4, 2, 8), _r(1, 4, 2, 8), _r(1, 4, 2, 8)),
                                    dict(transport=EmulatedTransport(2), layout="striped")),
    "flash causal": lambda: (flash_attention, (_r(1, 4, 2, 8), _r(1, 4, 2, 8), _r(1, 4, 2, 8)), dict(causal="no")),
    "moe weights shape": lambda: (moe_mlp, (_r(4, 8), _ids([0], [1], [0], [1]), _r(4, 2), _r(2, 12, 8), _r(2, 8, 6)),
                                  dict(num_experts=2)),
    "norm eps": lambda: (rms_norm, (_r(2, 8), _r(8), -1.0), {}),
    "norm dtype": lambda: (rms_norm, (_r(2, 8), _r(8, dtype=torch.float64)), {}),
    "loss target dtype": lambda: (vocab_parallel_cross_entropy, (_r(2, 3, 10), torch.zeros(2, 3, device=DEVICE)), {}),
    "linear_cross_entropy reduction": lambda: (linear_cross_entropy, (_r(6, 8), _r(10, 8), _ids(1, 2, 3, 4, 5, 6)),
                                               dict(reduction="avg")),
    "fp8 recipe": lambda: (fp8_linear, (_r(4, 8), _r(3, 8)), dict(recipe="tensorwise")),
    "layout helper rank": lambda: (sequence_shard, (_r(1, 8, 4),), dict(ring_rank=2, ring_size=2)),
}


def _error(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return info.value


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_check_raises_the_eager_error(case):
    op, args, kwargs = CASES[case]()
    eager = _error(lambda: op(*args, **kwargs))
    assert " must " in str(eager), eager  # an argument check, not a failed call
    torch._dynamo.reset()
    compiled_op = torch.compile(lambda *a: op(*a, **kwargs), fullgraph=True, backend=BACKEND)
    compiled = _error(lambda: compiled_op(*args))
    assert isinstance(compiled, type(eager)), (type(compiled), type(eager))
    assert not isinstance(compiled, TypeError if isinstance(eager, ValueError) else ValueError)
    assert str(compiled) == str(eager)


def test_compiled_valid_call_still_compiles():
    torch._dynamo.reset()
    x, w = _r(2, 8), _r(8)
    out = torch.compile(rms_norm, fullgraph=True, backend=BACKEND)(x, w, 1e-6)
    assert torch.equal(out, rms_norm(x, w, 1e-6))


def test_not_fullgraph_raises_the_eager_error_too():
    torch._dynamo.reset()
    op, args, _ = CASES["norm eps"]()
    eager = _error(lambda: op(*args))
    compiled = _error(lambda: torch.compile(op, backend=BACKEND)(*args))
    assert isinstance(compiled, ValueError) and str(compiled) == str(eager)
