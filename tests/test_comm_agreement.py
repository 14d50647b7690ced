"""The cross-rank agreement check (fusedpar.ops.comm.agreement): ranks of a group that pass different
shapes, dtypes or modes to a collective op all raise the same ValueError, naming the argument and
each rank's value, instead of one aborting inside gloo and the others returning garbage.

One gloo world of 3 ranks runs every case once (module fixture), on the whole world (size 3) and
on the sub-group {0, 1} (size 2); in each case the last rank of the group passes the odd value.
After the failing cases the world still runs collectives (nothing was half-sent). The tests then
read the per-case results. Shapes are tiny (the interpreter runs the cases that agree).
"""
import pytest
import torch
import torch.distributed as dist

from _utils import DEVICE
from _world import rank_rng, world_fixture
from fusedpar.kernels.moe_routing import moe_mlp_reference
from fusedpar.ops import (
    EmulatedTransport,
    all_gather_matmul,
    copy_to_tp_matmul,
    gather_features,
    hybrid_attention,
    matmul_all_reduce,
    matmul_reduce_scatter,
    moe_dispatch,
    moe_mlp,
    moe_plan,
    ring_attention,
    scatter_features,
    ulysses_attention,
    vocab_parallel_cross_entropy,
)
from fusedpar.ops.comm import agreement
from fusedpar.ops.comm.agreement import agreement_check_enabled, check_agreement, describe, set_agreement_check
from fusedpar.ops.comm.symmetric import SymmetricTransport
from fusedpar.ops.tensor_parallel.symmetric import all_gather_matmul_symmetric, matmul_reduce_scatter_symmetric
from fusedpar.ops.comm.transport import PortableTransport

world3 = world_fixture(3)


def _r(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=rank_rng(seed)).to(dtype)


def _qkv(s=2, hq=6, hk=6):
    return _r(1, s, hq, 8), _r(1, s, hk, 8, seed=1), _r(1, s, hk, 8, seed=2)


def _moe(odd, group, *, E=None, H=8, activation="swiglu", chunks=2, T=4, fn=moe_mlp):
    P = dist.get_world_size(group)
    E = 2 * P if E is None else E
    x = _r(T, H)
    ids = torch.arange(2 * T).reshape(T, 2) % E
    if fn is moe_mlp:
        w1, w2 = _r(E // P, 12, H), _r(E // P, H, 6)
        return moe_mlp(x, ids, torch.ones(T, 2), w1, w2, num_experts=E, ep_group=group, activation=activation,
                       num_chunks=chunks)
    if fn is moe_plan:
        return moe_plan(x, ids, E, ep_group=group, num_chunks=chunks)
    return moe_dispatch(x, ids, E, ep_group=group)


# name: (call(odd, group), op, the argument named in the error, texts of the two values)
CASES = {
    "agm_rows": (lambda odd, g: all_gather_matmul(_r(2, 6 if odd else 4, 8), _r(6, 8), group=g),
                 "all_gather_matmul", "x", ["shape (2, 4, 8)", "shape (2, 6, 8)"]),
    "agm_same_numel": (lambda odd, g: all_gather_matmul(_r(4, 2, 8) if odd else _r(2, 4, 8), _r(6, 8), group=g),
                       "all_gather_matmul", "x", ["shape (2, 4, 8)", "shape (4, 2, 8)"]),
    "agm_dtype": (lambda odd, g: all_gather_matmul(_r(2, 4, 8, dtype=torch.float16 if odd else torch.float32),
                                                   _r(6, 8, dtype=torch.float16 if odd else torch.float32), group=g),
                  "all_gather_matmul", "x", ["torch.float32", "torch.float16"]),
    "agm_save_gathered": (lambda odd, g: all_gather_matmul(_r(2, 4, 8), _r(6, 8), group=g,
                                                           save_gathered_input=not odd),
                          "all_gather_matmul", "save_gathered_input", ["True", "False"]),
    "mrs_weight": (lambda odd, g: matmul_reduce_scatter(_r(2, 6, 8), _r(4 if odd else 6, 8), group=g),
                   "matmul_reduce_scatter", "weight", ["shape (6, 8)", "shape (4, 8)"]),
    "mrs_scatter_dim": (lambda odd, g: matmul_reduce_scatter(_r(6, 6, 8), _r(4, 8), group=g,
                                                             scatter_dim=0 if odd else 1),
                        "matmul_reduce_scatter", "scatter_dim", ["1", "0"]),
    "mar_chunks": (lambda odd, g: matmul_all_reduce(_r(4, 8), _r(6, 8), group=g, num_chunks=4 if odd else 2),
                   "matmul_all_reduce", "num_chunks", ["2", "4"]),
    "mar_bias": (lambda odd, g: matmul_all_reduce(_r(4, 8), _r(6, 8), _r(6) if odd else None, group=g),
                 "matmul_all_reduce", "bias", ["None", "shape (6,)"]),
    "copy_activation": (lambda odd, g: copy_to_tp_matmul(_r(4, 8), _r(6, 8), group=g,
                                                         activation="relu" if odd else "none"),
                        "copy_to_tp_matmul", "activation", ["'none'", "'relu'"]),
    "gather_features": (lambda odd, g: gather_features(_r(2, 4 if odd else 3), g),
                        "gather_features", "t", ["shape (2, 3)", "shape (2, 4)"]),
    "scatter_features": (lambda odd, g: scatter_features(_r(3 if odd else 2, 6), g),
                         "scatter_features", "t", ["shape (2, 6)", "shape (3, 6)"]),
    "different_ops": (lambda odd, g: (matmul_reduce_scatter(_r(2, 6, 8), _r(6, 8), group=g) if odd else
                                      all_gather_matmul(_r(2, 6, 8), _r(6, 8), group=g)),
                      "all_gather_matmul", "the op", ["all_gather_matmul", "matmul_reduce_scatter"]),
    "ring_causal": (lambda odd, g: ring_attention(*_qkv(), group=g, causal=not odd),
                    "ring_attention", "causal", ["True", "False"]),
    "ring_layout": (lambda odd, g: ring_attention(*_qkv(), group=g, layout="contiguous" if odd else "zigzag"),
                    "ring_attention", "layout", ["'zigzag'", "'contiguous'"]),
    "ring_scale": (lambda odd, g: ring_attention(*_qkv(), group=g, softmax_scale=0.5 if odd else None),
                   "ring_attention", "softmax_scale", ["None", "0.5"]),
    "ulysses_seq": (lambda odd, g: ulysses_attention(*_qkv(s=4 if odd else 2), group=g),
                    "ulysses_attention", "q", ["shape (1, 2, 6, 8)", "shape (1, 4, 6, 8)"]),
    "ulysses_kv_heads": (lambda odd, g: ulysses_attention(*_qkv(hk=dist.get_world_size(g) if odd else 6), group=g),
                         "ulysses_attention", "k", ["shape (1, 2, 6, 8)", "shape (1, 2, "]),
    "hybrid_causal": (lambda odd, g: hybrid_attention(*_qkv(), ulysses_group=g or dist.group.WORLD,
                                                      ring_group=_SELF[dist.get_rank()], causal=odd,
                                                      layout="contiguous"),
                      "hybrid_attention", "causal", ["False", "True"]),
    "symmetric_ag_rows": (lambda odd, g: all_gather_matmul_symmetric(_r(2, 6 if odd else 4, 8), _r(6, 8),
                                                                     transport=SymmetricTransport(g)),
                          "all_gather_matmul_symmetric", "x", ["shape (2, 4, 8)", "shape (2, 6, 8)"]),
    "symmetric_rs_reduce_sms": (lambda odd, g: matmul_reduce_scatter_symmetric(_r(2, 6, 8), _r(4, 8),
                                                                               transport=SymmetricTransport(g),
                                                                               reduce_sms=4 if odd else 8),
                                "matmul_reduce_scatter_symmetric", "reduce_sms", ["8", "4"]),
    "moe_num_experts": (lambda odd, g: _moe(odd, g, E=4 * dist.get_world_size(g) if odd else None),
                        "moe_mlp", "num_experts", [None, None]),
    "moe_hidden": (lambda odd, g: _moe(odd, g, H=4 if odd else 8, fn=moe_dispatch),
                   "moe_dispatch", "hidden_size", ["8", "4"]),
    "moe_chunks": (lambda odd, g: _moe(odd, g, chunks=1 if odd else 2, fn=moe_plan),
                   "moe_plan", "num_chunks", ["2", "1"]),
    "moe_activation": (lambda odd, g: _moe(odd, g, activation="geglu" if odd else "swiglu"),
                       "moe_mlp", "activation", ["'swiglu'", "'geglu'"]),
}
_SELF = {}

# local checks that fail on some ranks only, or on every rank alike: (call(odd, group), the error
# every rank of the group raises)
LOCAL_CASES = {
    "moe_ids_of_other_tokens": (
        lambda odd, g: moe_mlp(_r(4, 8), torch.zeros(3 if odd else 4, 2, dtype=torch.int64), torch.ones(4, 2),
                               _r(2, 12, 8), _r(2, 8, 6), num_experts=2 * dist.get_world_size(g), ep_group=g),
        "ValueError: moe_mlp: the arguments of every rank must pass its checks (a rank cannot go on alone), got "
        "rank 0: valid; "),
    "ring_negative_scale_on_one_rank": (
        lambda odd, g: ring_attention(*_qkv(), group=g, softmax_scale=-1.0 if odd else None),
        "ValueError: ring_attention: softmax_scale must be the same on every rank of the group, got rank 0: None; "),
    "agm_bad_activation_everywhere": (
        lambda odd, g: all_gather_matmul(_r(2, 4, 8), _r(6, 8), group=g, activation="tanh"),
        "ValueError: all_gather_matmul: activation must be one of"),
    "loss_target_out_of_vocab_on_one_rank": (
        lambda odd, g: vocab_parallel_cross_entropy(_r(1, 3, 4), torch.tensor([[0, 100 if odd else 2, 1]]), g),
        "ValueError: vocab_parallel_cross_entropy: the arguments of every rank must pass its checks (a rank cannot "
        "go on alone), got rank 0: valid; "),
    "ulysses_causal_string_everywhere": (
        lambda odd, g: ulysses_attention(*_qkv(), group=g, causal="no"),
        "TypeError: causal must be a bool, got str 'no'"),
}


def _run(fn, odd, group):
    try:
        fn(odd, group)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(e).__name__}: {e}"


def _mesh_case(odd, group):
    """The 2-D exchange of hybrid attention (one all-gather per mesh dimension) on two views of
    one group: every row is labelled by both ranks."""
    check_agreement({"ulysses": (PortableTransport(group), None), "ring": (None, group)}, "mesh_op",
                    {"x": _r(3 if odd else 2, 4)})


def _agreeing_moe(rank, group):
    """Ranks with different token counts and capacities agree (they may): the output equals the
    single-process loop over the full expert weights on this rank's tokens."""
    P = dist.get_world_size(group)
    E, H = 2 * P, 8
    T = 3 + rank
    x = torch.randn(T, H, generator=rank_rng(7, rank))
    ids = torch.randint(0, E, (T, 2), generator=rank_rng(8, rank))
    wts = torch.rand(T, 2, generator=rank_rng(9, rank))
    w1, w2 = torch.randn(E, 12, H, generator=rank_rng(10)), torch.randn(E, H, 6, generator=rank_rng(11))
    lo = dist.get_rank(group) * (E // P)
    y = moe_mlp(x, ids, wts, w1[lo:lo + E // P], w2[lo:lo + E // P], num_experts=E, ep_group=group, capacity=T)
    want = moe_mlp_reference(x, ids, wts, w1, w2, capacity=T)
    return float((y.double() - want).abs().max())


def _all_cases(rank, size):
    set_agreement_check(True)
    groups = {2: dist.new_group([0, 1]), 3: None}
    for r in range(size):
        _SELF[r] = dist.new_group([r])
    out = {}
    for gs, group in groups.items():
        if rank >= gs:
            continue
        odd = rank == gs - 1
        for name, (fn, *_rest) in list(CASES.items()) + list(LOCAL_CASES.items()):
            out[name, gs] = _run(fn, odd, group)
        out["mesh", gs] = _run(_mesh_case, odd, group)
        out["moe_tokens_differ", gs] = _agreeing_moe(rank, group)
        y = all_gather_matmul(_r(2, 2, 8), _r(6, 8), group=group)  # the group still works
        out["after", gs] = tuple(y.shape)
    return out


@pytest.fixture(scope="module")
def results(world3):
    return world3.run(_all_cases, timeout=600)


def _group_results(results, key, gs):
    return [results[r][key] for r in range(gs)]


@pytest.mark.parametrize("gs", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_disagreement_raises_the_same_error_on_every_rank(results, case, gs):
    _fn, op, arg, values = CASES[case]
    msgs = _group_results(results, (case, gs), gs)
    assert len(set(msgs)) == 1, f"ranks raised different errors: {msgs}"
    msg = msgs[0]
    prefix = f"{op}: {arg}" if arg != "the op" else arg
    assert msg.startswith(f"ValueError: {prefix} must be the same on every rank of the group"), msg
    assert "got rank 0: " in msg, msg
    for v in values:
        if v is not None:
            assert v in msg, msg
    assert f"rank {gs - 1}: " in msg and f"rank {gs}: " not in msg, msg
    if case == "moe_num_experts":
        assert f"rank 0: {2 * gs}; " in msg and f"rank {gs - 1}: {4 * gs}" in msg, msg


@pytest.mark.parametrize("gs", [2, 3])
@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_local_check_failures_stop_every_rank(results, case, gs):
    """A rank whose own arguments fail a check does not leave the others waiting: they all raise."""
    msgs = _group_results(results, (case, gs), gs)
    assert len(set(msgs)) == 1, f"ranks raised different errors: {msgs}"
    assert msgs[0].startswith(LOCAL_CASES[case][1]), msgs[0]
    if case == "moe_ids_of_other_tokens":
        assert f"rank {gs - 1}: ValueError: expert_ids has 3 tokens but x has 4" in msgs[0], msgs[0]
    if case == "loss_target_out_of_vocab_on_one_rank":
        assert f"rank {gs - 1}: ValueError: target must hold ids in [0, {4 * gs}) or ignore_index=-100, got 100" \
            in msgs[0], msgs[0]


@pytest.mark.parametrize("gs", [2, 3])
def test_mesh_exchange_names_every_rank_of_both_dimensions(results, gs):
    msgs = _group_results(results, ("mesh", gs), gs)
    assert len(set(msgs)) == 1, msgs
    odd = gs - 1
    assert f"ring rank {odd}, ulysses rank {odd}: shape (3, 4)" in msgs[0], msgs[0]
    assert "ring rank 0, ulysses rank 0: shape (2, 4)" in msgs[0], msgs[0]


@pytest.mark.parametrize("gs", [2, 3])
def test_agreeing_ranks_run_and_the_group_survives(results, gs):
    for err in _group_results(results, ("moe_tokens_differ", gs), gs):
        assert err < 1e-4, err  # fp32 kernels vs the fp64 loop
    assert _group_results(results, ("after", gs), gs) == [(2, 2 * gs, 6)] * gs


# ----------------------------------------------------------------------------------------------
# one process: the switch, the descriptions, the transports it skips
# ----------------------------------------------------------------------------------------------
def test_switch_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv(agreement.AGREEMENT_ENV, raising=False)
    try:
        set_agreement_check(None)
        assert agreement_check_enabled("cpu") and not agreement_check_enabled("cuda")
        set_agreement_check(True)
        assert agreement_check_enabled("cuda") and agreement_check_enabled("cpu")
        set_agreement_check(False)
        assert not agreement_check_enabled("cpu")
        with pytest.raises(TypeError, match="enabled must be a bool or None, got str 'yes'"):
            set_agreement_check("yes")
        monkeypatch.setenv(agreement.AGREEMENT_ENV, "1")
        set_agreement_check(None)
        assert agreement_check_enabled("cuda")
    finally:
        monkeypatch.delenv(agreement.AGREEMENT_ENV, raising=False)
        set_agreement_check(None)


def test_descriptions():
    assert describe(torch.zeros(2, 3, dtype=torch.float16)) == "shape (2, 3) torch.float16"
    assert describe(torch.bfloat16) == "torch.bfloat16"
    assert describe("zigzag") == "'zigzag'" and describe(None) == "None" and describe(True) == "True"
    assert describe(EmulatedTransport(2)) == "emulated"


class _Counting(EmulatedTransport):
    gathers = 0

    def all_gather_into(self, out, inp):
        type(self).gathers += 1
        return super().all_gather_into(out, inp)


def test_emulated_and_single_rank_transports_exchange_nothing():
    set_agreement_check(True)
    try:
        t = _Counting(2)
        check_agreement(t, "op", {"x": torch.zeros(2)})
        y = all_gather_matmul(_r(2, 2, 8).to(DEVICE), _r(6, 8).to(DEVICE), transport=t)  # in this process
        assert y.shape == (2, 4, 6)
        assert _Counting.gathers == 0  # the ring gather shifts; the check sends nothing
        check_agreement(PortableTransport(), "op", {"x": torch.zeros(2)})  # one rank, no process group
    finally:
        set_agreement_check(None)


def test_too_many_fields_is_a_programming_error():
    fields = {f"a{i}": i for i in range(agreement.FINGERPRINT_FIELDS)}
    with pytest.raises(ValueError, match="fields must be at most 14, got 16"):
        check_agreement(_TwoRanks(), "op", fields, device="cpu")


class _TwoRanks(PortableTransport):
    """A PortableTransport that claims two ranks (its exchange is never reached)."""

    def __init__(self):
        super().__init__()
        self.size = 2
