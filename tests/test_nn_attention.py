"""fusedpar.nn.ParallelAttention on a 4-rank gloo world: tensor parallel x sequence parallel
(ring, Ulysses) and 2-D sequence parallel (hybrid); outputs and parameter gradients equal the
single-process AttentionReference with the same seed."""
import pytest
import torch

from _utils import DEVICE, assert_close
from _world import grid_2x2, rank_rng, straggle, world_fixture
from fusedpar.ops import comm
from fusedpar.nn import AttentionReference, ParallelAttention
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.nn import AttentionConfig

world4 = world_fixture(4)

# fp32 end to end; the attention itself is the kernel's fp32 (see test_sequence_parallel.py: 2e-5) and
# the projections add fp32 GEMM rounding over hidden <= 64 terms -> 5e-5 relative to the RMS.
TOL = 5e-5


def reference_shard_grads(ref, mod):
    """The reference's gradients cut into the shards ParallelAttention ``mod`` holds on its tp
    rank: this rank's q / k / v heads (v of its own head dim) and o_proj input columns, the
    biases, the replicated q / k norm scales (every head's share summed) and the sinks' heads."""
    t, hl, kl, d, dv = mod.tp_rank, mod.heads_local, mod.kv_heads_local, mod.head_dim, mod.v_head_dim

    def heads(g, n, width):  # this rank's n heads of the given width
        return g[t * n * width:(t + 1) * n * width]

    def qkv(q, k, v):
        return torch.cat([heads(q, hl, d), heads(k, kl, d), heads(v, kl, dv)])

    projs = (ref.q_proj, ref.k_proj, ref.v_proj)
    out = {"qkv.weight": qkv(*(p.weight.grad for p in projs)),
           "proj.weight": ref.o_proj.weight.grad[:, t * hl * dv:(t + 1) * hl * dv]}
    if ref.q_proj.bias is not None:
        out["qkv.bias"] = qkv(*(p.bias.grad for p in projs))
    if ref.o_proj.bias is not None:
        out["proj.bias"] = ref.o_proj.bias.grad
    if ref.q_norm is not None:
        out["q_norm.weight"], out["k_norm.weight"] = ref.q_norm.weight.grad, ref.k_norm.weight.grad
    if ref.sinks is not None:
        out["sinks"] = heads(ref.sinks.grad, hl, 1)
    return out


def check_shard_against_reference(mod, ref, y, yr, xl, xr, pos, msg):
    """This rank's output ``y`` and input gradient ``xl.grad`` against the reference's at this
    rank's token positions ``pos`` (no reduction needed), and every parameter's gradient against
    :func:`reference_shard_grads`; tolerances relative to each tensor's RMS (``TOL``)."""
    ry = yr.detach().index_select(1, pos)
    assert_close(y, ry, torch.float32, rtol=TOL, atol=TOL * ry.pow(2).mean().sqrt().item(), msg=f"out {msg}")
    gx = xr.grad.index_select(1, pos)
    assert_close(xl.grad, gx, torch.float32, rtol=TOL, atol=TOL * gx.pow(2).mean().sqrt().item(), msg=f"dx {msg}")
    expect = reference_shard_grads(ref, mod)
    params = dict(mod.named_parameters())
    assert set(params) == set(expect), (sorted(params), sorted(expect))
    for pname, g in expect.items():
        assert_close(params[pname].grad, g, torch.float32, rtol=TOL, atol=TOL * g.pow(2).mean().sqrt().item(),
                     msg=f"grad {pname} {msg}")


def _cases(rank, size, seed):
    row, col, single = grid_2x2(rank)
    straggle(0.01, seed)
    try:
        docs = [0, 1, 6, 6, 15, 16]  # packed documents crossing shards: lengths 1, 5, 0, 9, 1
        cases = [
            # (name, kwargs, heads, kv_heads, bias, seq, batch, document boundaries)
            ("tp2 x ring2 zigzag", dict(tp_group=row, sp_group=col, sp_mode="ring", layout="zigzag"),
             4, 2, True, 16, 2, None),
            ("tp2 x ring2 contiguous", dict(tp_group=row, sp_group=col, sp_mode="ring", layout="contiguous"),
             2, 2, False, 12, 1, None),
            ("tp2 x ulysses2", dict(tp_group=row, sp_group=col, sp_mode="ulysses"), 4, 2, False, 12, 1, None),
            ("hybrid 2x2, tp1", dict(tp_group=single, ulysses_group=row, ring_group=col, sp_mode="hybrid"),
             4, 2, True, 16, 1, None),
            ("tp2 x ring2 zigzag, documents", dict(tp_group=row, sp_group=col, sp_mode="ring", layout="zigzag"),
             2, 2, False, 16, 1, docs),
            ("hybrid 2x2, documents", dict(tp_group=single, ulysses_group=row, ring_group=col, sp_mode="hybrid"),
             4, 2, False, 16, 1, docs),
            ("tp2 x ulysses2, q/k norms", dict(tp_group=row, sp_group=col, sp_mode="ulysses", qk_norm=True),
             4, 2, True, 8, 1, None),
        ]
        for i, (name, kw, hq, hk, bias, S, b, cu) in enumerate(cases):
            d, hidden = 8, 32
            torch.manual_seed(seed + i)  # the same full weights on every rank, at every parallel degree
            norms = dict(qk_norm=kw.get("qk_norm", False))
            ref = AttentionReference(AttentionConfig(hidden, hq, hk, bias=bias, causal=True, rope_theta=500.0, head_dim=d, **norms))
            torch.manual_seed(seed + i)
            layout = {k: v for k, v in kw.items() if k.endswith("_group")}  # the module's parallel layout
            options = {k: v for k, v in kw.items() if k not in layout}  # the config's
            mod = ParallelAttention(AttentionConfig(hidden, hq, hk, bias=bias, causal=True, rope_theta=500.0, head_dim=d,
                                                    **options), **layout)
            # from_reference shards the same weights
            mod2 = ParallelAttention.from_reference(ref, **{k: v for k, v in kw.items() if k not in norms})
            for (n1, p1), (n2, p2) in zip(mod.named_parameters(), mod2.named_parameters()):
                assert n1 == n2 and torch.equal(p1, p2), f"{name}: {n1} differs between init and from_reference"
            x = torch.randn(b, S, hidden, generator=rank_rng(seed + i))
            dy = torch.randn(b, S, hidden, generator=rank_rng(seed + 100 + i))
            xr = x.clone().requires_grad_()
            if cu is None:
                yr = ref(xr)
            else:  # the reference runs each document on its own (positions from 0)
                yr = torch.cat([ref(xr[:, a:e]) for a, e in zip(cu, cu[1:]) if e > a], dim=1)
                cu = torch.tensor(cu, dtype=torch.int32)
            yr.backward(dy)

            xl = mod.shard(x).requires_grad_()
            pos = mod.local_positions(S)
            y = mod(xl, cu_seqlens=cu)
            y.backward(dy.index_select(1, pos))
            mod.reduce_sequence_parallel_grads()
            check_shard_against_reference(mod, ref, y, yr, xl, xr, pos, f"{name} rank {rank}")
        # errors before any communication
        with pytest.raises(ValueError, match="divisible by the tensor-parallel group size"):
            ParallelAttention(AttentionConfig(32, 3, 3, head_dim=8), tp_group=row, sp_group=col)
        with pytest.raises(ValueError, match="same group"):
            ParallelAttention(AttentionConfig(32, 4, 2, head_dim=8), tp_group=row, sp_group=row)
        with pytest.raises(ValueError, match="hybrid"):
            ParallelAttention(AttentionConfig(32, 4, 2, sp_mode="hybrid", head_dim=8), tp_group=single, sp_group=col)
        with pytest.raises(ValueError, match="sp_mode"):
            ParallelAttention(AttentionConfig(32, 4, 2, sp_mode="striped", head_dim=8), tp_group=single, sp_group=col)
        with pytest.raises(ValueError, match="sizes that work"):
            ParallelAttention(AttentionConfig(32, 2, 2, sp_mode="ulysses", head_dim=8), tp_group=row, sp_group=col)
    finally:
        comm.set_straggler(0)
    return True


def test_parallel_attention_matches_reference(world4):
    assert all(world4.run(_cases, seed=7))


def test_reference_and_local_module():
    # without torch.distributed: a single-rank ParallelAttention is the reference block
    torch.manual_seed(3)
    ref = AttentionReference(AttentionConfig(24, 3, 1, bias=True, head_dim=8)).to(DEVICE)  # drawn on CPU, like the module
    torch.manual_seed(3)
    mod = ParallelAttention(AttentionConfig(24, 3, 1, bias=True, head_dim=8), device=DEVICE)
    x = torch.randn(2, 11, 24, device=DEVICE)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head_dim"):
        ParallelAttention(AttentionConfig(24, 3, head_dim=7))
    with pytest.raises(ValueError, match="num_kv_heads"):
        ParallelAttention(AttentionConfig(24, 4, 3))
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_local, 24\]"):
        mod(torch.randn(2, 11, 23, device=DEVICE))


def test_sequence_parallel_transports():
    # each sequence-parallel dimension may be given as a Transport (one of group / transport)
    torch.manual_seed(3)
    ref = AttentionReference(AttentionConfig(24, 4, 2, head_dim=8)).to(DEVICE)
    torch.manual_seed(3)
    mod = ParallelAttention(AttentionConfig(24, 4, 2, head_dim=8), sp_transport=EmulatedTransport(1), device=DEVICE)
    x = torch.randn(2, 11, 24, device=DEVICE)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)
    # rank 1 of an emulated ring of 2: its zigzag positions, and gradients summed over the
    # transport (every mirror peer holds the same gradients: the sum is 2x)
    mod = ParallelAttention(AttentionConfig(24, 4, 2, head_dim=8), sp_transport=EmulatedTransport(2, 1), device=DEVICE)
    assert (mod.ring_size, mod.ring_rank, mod.ulysses_size) == (2, 1, 1)
    assert mod.local_positions(12).tolist() == [3, 4, 5, 6, 7, 8]
    mod(torch.randn(1, 6, 24, device=DEVICE)).sum().backward()
    grads = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.reduce_sequence_parallel_grads()
    for n, p in mod.named_parameters():
        assert torch.equal(p.grad, 2 * grads[n]), n
    hybrid = ParallelAttention(AttentionConfig(24, 4, 2, head_dim=8, sp_mode="hybrid"), ulysses_transport=EmulatedTransport(2, 1), ring_transport=EmulatedTransport(3, 2))
    assert (hybrid.ulysses_size, hybrid.ulysses_rank, hybrid.ring_size, hybrid.ring_rank) == (2, 1, 3, 2)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(sp_group=object(), sp_transport=EmulatedTransport(2)), "sp_group or sp_transport, not both"),
    (dict(ring_transport=EmulatedTransport(2)), "are for sp_mode='hybrid'"),
    (dict(sp_mode="hybrid", ring_transport=EmulatedTransport(2)), "needs both"),
    (dict(sp_mode="hybrid", sp_transport=EmulatedTransport(2), ulysses_transport=EmulatedTransport(2),
          ring_transport=EmulatedTransport(2)), "not sp_group / sp_transport"),
    (dict(sp_mode="ulysses", sp_transport=EmulatedTransport(3)), "sizes that work"),
], ids=["group and transport", "ring transport outside hybrid", "hybrid one dim", "hybrid sp transport",
        "ulysses heads"])
def test_bad_sequence_parallel_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        options = {k: v for k, v in kwargs.items() if k == "sp_mode"}
        ParallelAttention(AttentionConfig(24, 4, 2, head_dim=8, **options),
                          **{k: v for k, v in kwargs.items() if k not in options})
