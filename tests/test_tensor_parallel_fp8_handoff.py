"""The fp8 hand-offs: the kernel that produces a projection's input quantises it and the fp8 GEMM
reads that pair instead of quantising the input again. From the RMSNorm kernel to the all-gather
GEMM (``all_gather_matmul(..., fp8=recipe, x_fp8=(q, scale))``: a Transformer block's pre-norms
hand theirs to the attention's qkv and the dense MLP's first projection); from the up projection's
epilogue (``return_fp8``, blockwise) to the down projection's reduce-scatter / all-reduce GEMM
(``x_fp8``); and from the flash forward's epilogue to o_proj.

The pair equals what the op would compute (``rms_norm_fp8``'s fp8 output is bit for bit
``quantize_e4m3`` of its ``y``), so everything must be the same bits with and without the hand-off:
outputs, logits, loss and every gradient compared with ``torch.equal``. The gloo world of tp 2 is
in tests/test_tensor_parallel_ops.py (``test_fp8_x_fp8_world2``, its world2); here one process (tp 1), the
argument checks and the model.
"""
from __future__ import annotations

import pytest
import torch

from _utils import DEVICE, INTERPRETED, assert_tile_quantised
from fusedpar.kernels import quantize_e4m3
from fusedpar.ops import (all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter, rms_norm,
                          rms_norm_fp8)
from fusedpar.ops.comm.transport import EmulatedTransport
from fusedpar.nn import AttentionConfig

pytestmark = pytest.mark.skipif(not INTERPRETED and torch.cuda.get_device_capability() < (8, 9),
                                reason="fp8 needs compute capability >= 8.9")


def norm_then_gemm(x, nw, w, b, *, recipe, handoff, residual=None, **kw):
    """``all_gather_matmul(rms_norm(x [+ residual]), w, b, fp8=recipe)``, the norm's output
    quantised by the norm (``handoff``) or by the op. Returns the output (and the new residual)."""
    if handoff:
        *ys, q, s = rms_norm_fp8(x, nw, 1e-6, residual=residual, recipe=recipe)
        return all_gather_matmul(ys[0], w, b, fp8=recipe, x_fp8=(q, s), **kw), *ys[1:]
    ys = rms_norm(x, nw, 1e-6, residual=residual)
    ys = (ys,) if residual is None else ys
    return all_gather_matmul(ys[0], w, b, fp8=recipe, **kw), *ys[1:]


def assert_same_bits(tag, got, want):
    assert len(got) == len(want), f"{tag}: {len(got)} results vs {len(want)}"
    for name, a, b in zip(("out", *(f"grad {i}" for i in range(len(got) - 1))), got, want):
        assert a is not None and b is not None and torch.equal(a, b), f"{tag}: {name} differs"


@pytest.mark.parametrize("recipe,activation,keep,hp", [("rowwise", "swiglu", True, False),
                                                       ("blockwise", "none", False, True)])
def test_x_fp8_is_bit_identical_at_tp1(recipe, activation, keep, hp):
    """The norm (with a fused residual add) and the GEMM, forward and backward, with and without
    the hand-off: the same bits (K = 200: a ragged last 1x128 tile)."""
    g = torch.Generator().manual_seed(5)
    K, rows = 200, 12
    leaves = [torch.randn(2, 3, K, generator=g), torch.randn(2, 3, K, generator=g),
              1 + 0.1 * torch.randn(K, generator=g), torch.randn(rows, K, generator=g) * K ** -0.5,
              torch.randn(rows, generator=g)]
    go = torch.randn(2, 3, rows // 2 if activation == "swiglu" else rows, generator=g)
    gh = torch.randn(2, 3, K, generator=g)
    runs = []
    for handoff in (False, True):
        x, r, nw, w, b = (t.to(DEVICE).requires_grad_() for t in leaves)
        y, h = norm_then_gemm(x, nw, w, b, residual=r, recipe=recipe, handoff=handoff, activation=activation,
                              save_gathered_input=keep, fp8_grad_high_precision=hp)
        torch.autograd.backward([y, h], [go.to(DEVICE), gh.to(DEVICE)])
        runs.append((y.detach(), h.detach(), x.grad, r.grad, nw.grad, w.grad, b.grad))
    assert_same_bits(f"{recipe} tp1", runs[1], runs[0])


def test_x_fp8_is_what_travels():
    """The pair is used, not recomputed: scales twice as large give twice the output."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(2, 3, 40, generator=g).to(DEVICE), torch.randn(8, 40, generator=g).to(DEVICE)
    for recipe in ("rowwise", "blockwise"):
        _, q, s = rms_norm_fp8(x, None, recipe=recipe)
        y = all_gather_matmul(rms_norm(x, None), w, fp8=recipe)
        assert torch.equal(all_gather_matmul(x, w, fp8=recipe, x_fp8=(q, 2 * s)), 2 * y), recipe


def test_x_fp8_opcheck():
    """``fusedpar::all_gather_matmul_fp8`` with ``x_q`` / ``x_scale`` given and ``out_fp8``, the
    reduce-scatter and all-reduce ops with their ``x_q`` / ``x_scale`` and the copy-to-tp op with
    ``out_fp8`` pass ``opcheck`` (fake, autograd registration; tests/test_torch_compile_fp8.py checks
    them without)."""
    from fusedpar.ops.tensor_parallel.custom_ops import (
        all_gather_matmul_fp8_op,
        copy_to_tp_matmul_fp8_op,
        matmul_all_reduce_fp8_op,
        matmul_reduce_scatter_fp8_op,
    )
    from fusedpar.ops.comm.transport import EmulatedTransport
    from fusedpar.ops.tensor_parallel.bodies import tp_options

    t, g = EmulatedTransport(2, rank=1), torch.Generator().manual_seed(8)
    x, w, b = (torch.randn(*s, generator=g).to(DEVICE).requires_grad_() for s in ((2, 3, 40), (6, 40), (6,)))
    _, q, s = rms_norm_fp8(x.detach(), None, recipe="blockwise")
    # (no test_schema: its mutation check multiplies the inputs, which CPU torch cannot for e4m3;
    # the compiled graph: test_block_handoff_compiles_fullgraph)
    utils = ("test_faketensor", "test_autograd_registration")
    f32 = torch.float32
    torch.library.opcheck(all_gather_matmul_fp8_op, (x, w, b, tp_options(t.transport_id, 1, f32, "swiglu", False, True, True,
                                                                         True, recipe="blockwise"), q, s),
                          test_utils=utils)
    # the down projection's ops with their input's pair, the column ops with their epilogue's tiles
    w2 = torch.randn(6, 40, generator=g).to(DEVICE).requires_grad_()
    x2 = torch.randn(2, 4, 40, generator=g).to(DEVICE).requires_grad_()
    q2, s2 = (v.view(2, 4, -1) for v in quantize_e4m3(x2.detach().reshape(8, 40), "tile"))
    torch.library.opcheck(matmul_reduce_scatter_fp8_op, (x2, w2, None, tp_options(t.transport_id, 1, f32, "none", False,
                                                                                  recipe="blockwise"), q2, s2),
                          test_utils=utils)
    torch.library.opcheck(matmul_all_reduce_fp8_op, (x2, w2, None, tp_options(t.transport_id, 2, f32, "none", False,
                                                                              recipe="blockwise"), q2, s2),
                          test_utils=utils)
    torch.library.opcheck(copy_to_tp_matmul_fp8_op, (x2, w2, None, tp_options(t.transport_id, 2, f32, "swiglu", False, True,
                                                                              True, recipe="blockwise")),
                          test_utils=utils)


def test_block_handoff_compiles_fullgraph():
    """An fp8 block with the hand-off compiles without a graph break (``aot_eager`` runs the same
    kernels: the same bits as eager, output and gradients)."""
    from fusedpar.nn import TransformerBlock, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=24,
                               fp8="blockwise")
    block = TransformerBlock(config.block_config(0)).to(DEVICE)
    x = torch.randn(1, 6, 16, device=DEVICE, requires_grad=True)
    runs = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        block.zero_grad()
        x.grad = None
        y = fn(x)
        y.backward(torch.ones_like(y))
        runs.append([y.detach(), x.grad] + [p.grad for p in block.parameters()])
    assert_same_bits("compiled fp8 block", runs[1], runs[0])


def test_x_fp8_bad_input():
    x, w = torch.randn(2, 3, 200, device=DEVICE), torch.randn(4, 200, device=DEVICE)
    _, q, s = rms_norm_fp8(x, None, recipe="rowwise")
    _, qb, sb = rms_norm_fp8(x, None, recipe="blockwise")
    with pytest.raises(ValueError, match=r"all_gather_matmul: x_fp8 \(x already quantised\) needs fp8="):
        all_gather_matmul(x, w, x_fp8=(q, s))
    with pytest.raises(TypeError, match="all_gather_matmul: x_fp8 must be None or a pair"):
        all_gather_matmul(x, w, fp8="rowwise", x_fp8=q)
    with pytest.raises(ValueError, match=r"x_fp8\[1\] \(scale\) must be torch.float32 of shape \(2, 3\) \(x of "
                                         r"shape \(2, 3, 200\) quantised for fp8='rowwise'\), got torch.float32 "
                                         r"of shape \(2, 3, 2\)"):
        all_gather_matmul(x, w, fp8="rowwise", x_fp8=(qb, sb))  # the blockwise pair, a rowwise GEMM
    with pytest.raises(ValueError, match=r"x_fp8\[0\] \(q\) must be torch.float8_e4m3fn of shape \(2, 3, 200\)"):
        all_gather_matmul(x, w, fp8="blockwise", x_fp8=(qb.float(), sb))
    with pytest.raises(ValueError, match=r"x_fp8\[0\] \(q\) must be .* got torch.float8_e4m3fn of shape \(3, 2, 200\)"):
        all_gather_matmul(x, w, fp8="rowwise", x_fp8=(q.view(3, 2, 200), s))


def _model_run(recipe, norm_layout, norm_offset, *, handoff, monkeypatch):
    """Logits, loss and every gradient of a tiny two-block model, with the pre-norms' hand-off on
    or off (off: the block's recipe choice patched to None), and the number of standalone
    quantisations (``quantize_e4m3`` calls of the fp8 operand types) in the forward."""
    from fusedpar.nn import ParallelMLP, Transformer, TransformerConfig
    from fusedpar.nn.block import TransformerBlock
    from fusedpar.ops.fp8 import operands as schedules

    with monkeypatch.context() as mp:
        if not handoff:
            mp.setattr(TransformerBlock, "_handoff_recipe", staticmethod(lambda norm, projection: None))
            mp.setattr(ParallelMLP, "_fp8_handoff", lambda self: False)
        calls = []
        quantize = schedules.quantize_e4m3
        mp.setattr(schedules, "quantize_e4m3", lambda *a, **k: calls.append(1) or quantize(*a, **k))
        cfg = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=24,
                                fp8=recipe, norm_layout=norm_layout, norm_offset=norm_offset)
        model = Transformer(cfg, seed=7).to(DEVICE)
        ids = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        logits = model(ids)
        forward_calls = len(calls)
        loss = model.loss(logits, ids)
        loss.backward()
    return forward_calls, [logits.detach(), loss.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe,norm_layout,norm_offset", [("rowwise", "pre", 0.0), ("blockwise", "sandwich", 1.0)])
def test_model_handoff_is_bit_identical(recipe, norm_layout, norm_offset, monkeypatch):
    """``TransformerConfig(fp8=recipe)``: the same logits, loss and gradients with the hand-offs on and
    off, and per block two quantisations fewer (the qkv and first MLP projections' input), three with
    the blockwise recipe (the down projection's input too, from the up projection's epilogue)."""
    off_calls, off = _model_run(recipe, norm_layout, norm_offset, handoff=False, monkeypatch=monkeypatch)
    on_calls, on = _model_run(recipe, norm_layout, norm_offset, handoff=True, monkeypatch=monkeypatch)
    assert off_calls - on_calls == 2 * (3 if recipe == "blockwise" else 2), (off_calls, on_calls)
    assert_same_bits(f"model {recipe} {norm_layout}", on, off)


def up_down_handoff(up, transport, seed=11):
    """``all_gather_matmul`` / ``copy_to_tp_matmul(..., fp8="blockwise", return_fp8=True)``, then
    ``matmul_reduce_scatter`` / ``matmul_all_reduce(x_fp8=...)``, against the down projection
    quantising its input: the pair equals ``quantize_e4m3`` of the activated output, and the output
    and every gradient are the same bits (F = 136: a ragged last tile). ``transport``: the ops' (None:
    the default group)."""
    g, K, F, H = torch.Generator().manual_seed(seed), 40, 136, 24
    act = "swiglu" if up == "ag" else "gelu"
    n_w = 2 * F if act == "swiglu" else F
    leaves = [torch.randn(2, 4, K, generator=g), torch.randn(n_w, K, generator=g) * K ** -0.5,
              torch.randn(H, F, generator=g) * F ** -0.5, torch.randn(H, generator=g)]
    runs = []
    for handoff in (False, True):
        x, w1, w2, b2 = (v.to(DEVICE).requires_grad_() for v in leaves)
        kw = dict(fp8="blockwise", transport=transport)
        if up == "ag":
            h = all_gather_matmul(x, w1, activation=act, return_fp8=handoff, **kw)
        else:
            h = copy_to_tp_matmul(x, w1, activation=act, num_chunks=2, return_fp8=handoff, **kw)
        if handoff:
            h, pair = h
            assert_tile_quantised(h.detach(), *pair, msg=f"{up} {transport}")
        down = matmul_reduce_scatter if up == "ag" else matmul_all_reduce
        y = down(h, w2, b2, x_fp8=pair if handoff else None, **kw)
        y.backward(torch.ones_like(y))
        runs.append((y.detach(), x.grad, w1.grad, w2.grad, b2.grad))
    assert_same_bits(f"{up} -> down, {transport}", runs[1], runs[0])


@pytest.mark.parametrize("up,transport", [("ag", None), ("ag", "emulated"), ("ag", "waits"), ("copy", None)])
def test_up_projection_hands_its_epilogue_tiles_to_the_down_projection(up, transport):
    """:func:`up_down_handoff` in one process, on an emulated rank of 2 (chunk GEMMs writing their
    rows of the tiles), and with in-kernel waits (the persistent all-gather GEMM, one quantisation
    pass after it; the persistent fp8 reduce-scatter reading the pair); the gloo world of tp 2 is in
    tests/test_tensor_parallel_ops.py (``test_fp8_x_fp8_world2``)."""
    t = {None: None, "emulated": EmulatedTransport(2, rank=1),
         "waits": EmulatedTransport(2, rank=0, in_kernel_waits=True)}[transport]
    up_down_handoff(up, t)


def test_flash_output_handed_to_o_proj_is_bit_identical():
    """``ParallelAttention`` in blockwise fp8 with a v head dim of 128: the flash forward's epilogue
    quantises the output for o_proj (``return_fp8`` / ``x_fp8``); output and every gradient the same
    bits as o_proj quantising it, and one quantisation fewer."""
    from fusedpar.nn import ParallelAttention
    from fusedpar.nn.linear import enable_fp8
    from fusedpar.ops import flash_attention
    from fusedpar.ops.fp8 import operands as schedules

    torch.manual_seed(3)
    attn = ParallelAttention(AttentionConfig(64, 2, head_dim=128)).to(DEVICE)
    enable_fp8(attn, "blockwise")
    x0 = torch.randn(1, 5, 64, device=DEVICE)
    runs, counts = [], []
    for handoff in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if not handoff:
                mp.setattr(type(attn), "_fp8_handoff", lambda self, proj, dv, cu: False)
            calls, quantize = [], schedules.quantize_e4m3
            mp.setattr(schedules, "quantize_e4m3", lambda *a, **k: calls.append(1) or quantize(*a, **k))
            attn.zero_grad()
            x = x0.clone().requires_grad_()
            y = attn(x)
            counts.append(len(calls))
            y.backward(torch.ones_like(y))
        runs.append([y.detach(), x.grad] + [p.grad for p in attn.parameters()])
    assert_same_bits("attention -> o_proj", runs[1], runs[0])
    assert counts[0] - counts[1] == 1, counts
    q, k, v = (torch.randn(1, 5, 2, 128, device=DEVICE) for _ in range(3))
    out, lse, pair = flash_attention(q, k, v, causal=True, return_fp8=True)
    assert_tile_quantised(out.reshape(1, 5, 256), *pair, msg="flash_attention(return_fp8=True)")
    assert all(torch.equal(a, b) for a, b in zip((out, lse), flash_attention(q, k, v, causal=True)))


def test_return_fp8_and_x_fp8_bad_input():
    x, w = torch.randn(2, 4, 40, device=DEVICE), torch.randn(8, 40, device=DEVICE)
    with pytest.raises(ValueError, match=r"all_gather_matmul: return_fp8=True needs fp8='blockwise' .* got "
                                         r"fp8='rowwise'"):
        all_gather_matmul(x, w, fp8="rowwise", return_fp8=True)
    with pytest.raises(TypeError, match="copy_to_tp_matmul: return_fp8 must be a bool, got int"):
        copy_to_tp_matmul(x, w, fp8="blockwise", return_fp8=1)
    with pytest.raises(ValueError, match=r"matmul_reduce_scatter: x_fp8 \(x already quantised\) needs fp8="):
        matmul_reduce_scatter(x, w, x_fp8=quantize_e4m3(x.reshape(-1, 40), "tile"))
    with pytest.raises(ValueError, match=r"matmul_all_reduce: x_fp8\[0\] \(q\) must be torch.float8_e4m3fn of shape "
                                         r"\(2, 4, 40\) .* got torch.float8_e4m3fn of shape \(8, 40\)"):
        matmul_all_reduce(x, w, fp8="blockwise", x_fp8=quantize_e4m3(x.reshape(-1, 40), "tile"))
    from fusedpar.ops import flash_attention
    q = torch.randn(1, 3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"return_fp8=True needs v's head dim d_v to be a multiple of 128 \(whole "
                                         r"1x128 tiles per head\), got d_v=64"):
        flash_attention(q, q, q, return_fp8=True)
