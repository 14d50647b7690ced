"""The persistent GEMM's two load paths (kernels/persistent_gemm.py): tensor descriptors (TMA)
for a launch without flag waits over A's chunks as one stack (the reduce-scatter side: its A is
the local activation, ordered before the launch by the stream), pointer loads for everything
else; both against float64 into NaN-poisoned outputs, and bit-equal under the interpreter (the
same dots on both paths). Chunks of 26 rows over 16- and 32-row tiles: a tile reaches past its
chunk's rows into the next chunk's, which must feed only rows it does not store."""
import pytest
import torch

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn
from fusedpar.kernels import fp8_matmul, gemm_loads
from fusedpar.kernels.persistent_gemm import (chunk_view, kernel_config, persistent_matmul,
                                              persistent_matmul_reference, tiles_per_chunk)
from test_gemm_persistent import _fp8_operands, assert_fp8_matches

I32 = torch.int32


def _loads():
    return gemm_loads.last_launch("persistent_matmul")["loads"]


def _on_both_paths(call):
    """``call()`` on the "auto" path, then on pointer loads: ``{path: (result, loads)}``."""
    got = {}
    for path in ("auto", "pointer"):
        with gemm_loads.load_path_set(path):
            got[path] = (call(), _loads())
    return got


def _agree(got, dtype):
    """The "auto" path loaded by TMA (on a GPU: sm_90 with 16-bit or e4m3 operands), the pointer
    path by pointers, and interpreted both gave the same bits."""
    assert got["pointer"][1] == "pointer"
    assert got["auto"][1] == ("tma" if gemm_loads.tma_capable(DEVICE, dtype.itemsize) else "pointer")
    if INTERPRETED:
        for a, b in zip(got["auto"][0], got["pointer"][0]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_side_loads_by_tma(dtype):
    """The reduce-scatter's layout: a ``[1, seq, K]`` activation chunked along seq (a 4-D view
    whose chunks are one stack) into NaN-poisoned partials, bias, N = 37 (ragged), the counters
    signalled, the first chunk not 0; then gelu over N = 48; then gated weights, ``[2F, K]`` and
    stored ``[K, 2F]`` (contiguous along N: the transposed descriptor, its up half F = 32 columns
    on a 16-byte boundary), with the fp32 pre-activation. TMA on "auto", both paths right."""
    g = torch.Generator().manual_seed(71)
    C, sc, K, F = 3, 26, 48, 32
    x = randn(1, C * sc, K, dtype=dtype, generator=g).to(DEVICE)
    w37, w48 = (randn(n, K, dtype=dtype, generator=g, scale=K ** -0.5).to(DEVICE) for n in (37, 48))
    bias = randn(37, dtype=dtype, generator=g).to(DEVICE)
    w_gated = randn(2 * F, K, dtype=dtype, generator=g, scale=K ** -0.5).to(DEVICE)

    def plain():
        out, counters = poison((C, 1, sc, 37), dtype, DEVICE), torch.zeros(C, dtype=I32, device=DEVICE)
        persistent_matmul(chunk_view(x, 1, C), w37, bias, first_chunk=1, out=out, wait_mode="none",
                          signal_counters=counters)
        return out, counters

    got = _on_both_paths(plain)
    _agree(got, dtype)
    per = tiles_per_chunk(sc, 37, kernel_config(None, 37, dtype))
    for out, counters in (got["auto"][0], got["pointer"][0]):
        assert_close(out, chunk_view(persistent_matmul_reference(x, w37, bias), 1, C), dtype, msg="bias")
        assert counters.tolist() == [per] * C
    got = _on_both_paths(lambda: (persistent_matmul(chunk_view(x, 1, C), w48, activation="gelu", wait_mode="none",
                                                    out=poison((C, 1, sc, 48), dtype, DEVICE)),))
    _agree(got, dtype)
    for (out,), _ in got.values():
        assert_close(out, chunk_view(persistent_matmul_reference(x, w48, activation="gelu"), 1, C), dtype, msg="gelu")
    for w in (w_gated, w_gated.t().contiguous().t()):
        def gated(w=w):
            out, pre = poison((C, 1, sc, F), dtype, DEVICE), poison((C, 1, sc, 2 * F), torch.float32, DEVICE)
            persistent_matmul(chunk_view(x, 1, C), w, out=out, activation="swiglu", preact_out=pre, wait_mode="none")
            return out, pre

        got = _on_both_paths(gated)
        _agree(got, dtype)
        for out, pre in (got["auto"][0], got["pointer"][0]):
            assert_close(pre, chunk_view(persistent_matmul_reference(x, w), 1, C), dtype, msg="pre-activation")
            assert_close(out, chunk_view(persistent_matmul_reference(x, w, activation="swiglu"), 1, C), dtype,
                         msg=f"swiglu, weight strides {w.stride()}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_sequence_chunks_load_by_tma(dtype):
    """A ``[2, seq, K]`` activation chunked along seq (``[C, 2, 128, K]``: two-level rows) is one
    ``[2 * seq, K]`` tensor whose chunk rows of each batch are a multiple of the tile's (128; the
    interpreter's 32): TMA, a tile within one batch's rows of its chunk; bias, NaN-poisoned
    partials, against float64 and bit-equal to the pointer path interpreted."""
    g = torch.Generator().manual_seed(77)
    C, sc, K, N = 3, 128, 32, 40
    x = randn(2, C * sc, K, dtype=dtype, generator=g).to(DEVICE)
    w = randn(N, K, dtype=dtype, generator=g, scale=K ** -0.5).to(DEVICE)
    bias = randn(N, dtype=dtype, generator=g).to(DEVICE)
    got = _on_both_paths(lambda: (persistent_matmul(chunk_view(x, 1, C), w, bias, first_chunk=2, wait_mode="none",
                                                    out=poison((C, 2, sc, N), dtype, DEVICE)),))
    _agree(got, dtype)
    for (out,), _ in got.values():
        assert_close(out, chunk_view(persistent_matmul_reference(x, w, bias), 1, C), dtype, msg="batched chunks")


def test_what_keeps_pointer_loads():
    """Pointer loads, right numbers: flag waits (``"spin"``, flags ready; ``"skip"``), a split
    ``[batch, seq-chunk]`` view whose chunk rows per batch (13) are no multiple of the tile's, one
    whose batches are not one stride apart (a seq slice of a longer activation), chunks not back
    to back (26 rows of every 29), rows of 90 bytes
    (K = 45 fp16), a gated weight contiguous along N whose up half starts 40 bytes in (F = 20);
    the same operands without the obstacle: TMA."""
    g = torch.Generator().manual_seed(73)
    dt, C, sc, K, N = torch.float16, 3, 26, 48, 40
    w = randn(N, K, dtype=dt, generator=g, scale=K ** -0.5).to(DEVICE)
    a = randn(C * sc, K, dtype=dt, generator=g).to(DEVICE)
    ready = torch.ones(C, dtype=I32, device=DEVICE)
    gapped = randn(C, sc + 3, K, dtype=dt, generator=g).to(DEVICE)[:, :sc]
    x3 = randn(2, C * 13, K, dtype=dt, generator=g).to(DEVICE)
    x_sliced = randn(2, C * 128 + 8, K, dtype=dt, generator=g).to(DEVICE)[:, :C * 128]
    a45, w45 = randn(C * sc, 45, dtype=dt, generator=g).to(DEVICE), randn(N, 45, dtype=dt, generator=g).to(DEVICE)
    w_kn = randn(K, N, dtype=dt, generator=g, scale=K ** -0.5).to(DEVICE)  # [K, 2F], F = 20
    cases = [
        ("spin", chunk_view(a, 0, C), w, dict(wait_flags=ready), "none", a, False),
        ("skip", chunk_view(a, 0, C), w, dict(wait_flags=ready, wait_mode="skip"), "none", a, False),
        ("split view", chunk_view(x3, 1, C), w, dict(wait_mode="none"), "none", x3, False),
        ("sliced batches", chunk_view(x_sliced, 1, C), w, dict(wait_mode="none"), "none", x_sliced, False),
        ("gapped chunks", gapped, w, dict(wait_mode="none"), "none", gapped.reshape(C * sc, K), False),
        ("90-byte rows", chunk_view(a45, 0, C), w45, dict(wait_mode="none"), "none", a45, False),
        ("up half 40 bytes in", chunk_view(a, 0, C), w_kn.t(), dict(wait_mode="none"), "swiglu", a, False),
        ("plain", chunk_view(a, 0, C), w, dict(wait_mode="none"), "none", a, True),
    ]
    for name, chunks, weight, kw, act, full, tma in cases:
        y = persistent_matmul(chunks, weight, activation=act, **kw)
        assert _loads() == ("tma" if tma and gemm_loads.tma_capable(DEVICE, 2) else "pointer"), name
        ref = persistent_matmul_reference(full, weight, activation=act)
        if name in ("split view", "sliced batches"):  # chunk-major output of [batch, seq] chunks along seq
            ref = chunk_view(ref, 1, C)
        assert_close(y.reshape(ref.shape), ref, dt, msg=name)


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_fp8_reduce_scatter_side_on_both_paths(scaling):
    """e4m3 chunk-major operands (both contiguous along K), K = 208 (a ragged last scale block),
    bias, no waits: TMA on "auto" (a GPU: sm_90), bit-equal to the pointer path interpreted,
    and to ``fp8_matmul`` on the same operands."""
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 tensor cores")
    C, r, K, N = 3, 26, 208, 45
    xq, xs, wq, ws, bias = _fp8_operands(scaling, C, r, K, N, seed=75)
    got = _on_both_paths(lambda: (persistent_matmul(xq, wq, bias, a_scale=xs, weight_scale=ws, scaling=scaling,
                                                    wait_mode="none", out=poison((C, r, N), torch.float32, DEVICE)),))
    _agree(got, torch.float8_e4m3fn)
    expected = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=torch.float32)
    for (out,), _ in got.values():
        assert_fp8_matches(out, expected, scaling, xq, xs, wq, ws, bias, scaling)


def test_compiled_choice_follows_the_prune_rules(monkeypatch):
    """Compiled (sm_90 stand-ins, no launch): the default 128x128 tile with a fused epilogue over
    N not a multiple of 16 (gelu, N = 37) passes pointer loads' rule but not TMA's (which holds
    32 accumulator elements per thread there): pointer loads; N = 64, or no activation: TMA;
    flag waits: pointer loads whatever the tile."""
    from fusedpar.kernels import gemm_configs, persistent_config
    from fusedpar.kernels.gemm import linear_operands

    monkeypatch.setattr(persistent_config, "shared_memory_limit", lambda index=0: 232448)
    monkeypatch.setattr(gemm_configs, "device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(persistent_config, "interpreting", lambda: False)
    monkeypatch.setattr(persistent_config, "tma_capable", lambda device, elem_size: True)
    a = torch.empty(4, 64, 4096, dtype=torch.bfloat16, device="meta")
    for act, n, wait, tma in (("gelu", 37, "none", False), ("gelu", 64, "none", True), ("none", 37, "none", True),
                              ("none", 64, "spin", False)):
        w = torch.empty(n, 4096, dtype=torch.bfloat16, device=DEVICE)  # (linear_operands: the kernels' device)
        ops = linear_operands(torch.empty(64, 4096, dtype=torch.bfloat16, device=DEVICE), w, activation=act)
        cfg = persistent_config.gpu_config(ops.n, torch.bfloat16, ops.glu)
        assert (persistent_config.config_problem(cfg, a, ops, False, tma=True) is None) == (n % 16 == 0 or act == "none")
        assert persistent_config.config_problem(cfg, a, ops, False) is None
        got = persistent_config.tma_weight_major(a, w, ops, wait, False, cfg, False)
        assert (got is not None) == tma, (act, n, wait)


def test_sequence_chunks_that_keep_pointer_loads():
    """``[batch, seq-chunk]`` views that are not one ``[batch * seq]`` tensor in whole tiles keep
    pointer loads, with right numbers: every chunk the same memory (chunk stride 0, the batch
    rows still one stride apart), and 64 chunk rows per batch under a 128-row tile (``config=``;
    the interpreter's 32 takes TMA)."""
    g = torch.Generator().manual_seed(79)
    dt, C, sc, K, N = torch.float16, 2, 64, 32, 24
    x = randn(2, C * sc, K, dtype=dt, generator=g).to(DEVICE)
    w = randn(N, K, dtype=dt, generator=g, scale=K ** -0.5).to(DEVICE)
    same = x.as_strided((C, 2, sc, K), (0, C * sc * K, K, 1))  # chunk 0's rows for every chunk
    y = persistent_matmul(same, w, wait_mode="none")
    assert _loads() == "pointer"
    ref0 = persistent_matmul_reference(x[:, :sc], w)
    for c in range(C):
        assert_close(y[c], ref0, dt, msg=f"chunk {c} of the stride-0 view")
    ref = chunk_view(persistent_matmul_reference(x, w), 1, C)
    for block_m, loads in ((128, "pointer"), (32, "tma")):
        y = persistent_matmul(chunk_view(x, 1, C), w, wait_mode="none",
                              config=dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=32, GROUP_M=4))
        if INTERPRETED or loads == "pointer":  # (compiled, the 32-row tile also meets TMA's prune rule or not)
            assert _loads() == loads, block_m
        assert_close(y, ref, dt, msg=f"BLOCK_M {block_m}")
