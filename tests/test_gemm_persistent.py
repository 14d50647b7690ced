"""Persistent chunked GEMM (kernels/persistent_gemm.py) against fp64 references.

Under the interpreter programs run one after another, so a spin on a flag raised later would
hang: the spin tests set every flag before the launch, and the flag logic itself
is tested with ``wait_mode="skip"`` (a tile whose chunk flag is not ready is not computed) and
with the tile log (the global order in which tiles were computed).
"""
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn
from fusedpar.kernels import WaitTimeout, check_wait_timeouts, dequantize_e4m3, fp8_matmul, quantize_e4m3, wait_timeouts
from fusedpar.kernels.fp8 import FP8UnsupportedError
from fusedpar.kernels import persistent_gemm as pg
from fusedpar.kernels.persistent_gemm import (
    chunk_reduce,
    chunk_view,
    kernel_config,
    persistent_matmul,
    persistent_matmul_reference,
    tiles_per_chunk,
)
from fusedpar.kernels.waits import WAIT_CHECKS, status_word
from test_fp8 import ACC_RTOL, assert_within, mma_error_bound

I32 = torch.int32


def _cfg(n, dtype, glu=False):
    return kernel_config(None, n, dtype, glu)


def _log(num_tiles, device):
    log = torch.full((num_tiles + 1,), -1, dtype=I32, device=device)
    log[-1] = 0
    return log


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_ready_gather_layout(device, dtype):
    """All-gather layout: A chunk-major (what the producer fills), C a sequence chunk of the
    user's [batch, seq, N] output (strided, two-level rows); local chunk first; flags at an
    epoch value; bias + gelu; counters grow by the tiles per chunk."""
    g = torch.Generator().manual_seed(1)
    C, b, sc, K, N = 3, 2, 13, 45, 37  # rows per chunk 26: a partial M tile; K, N tails
    gathered = randn(C, b, sc, K, dtype=dtype, generator=g)
    w = randn(N, K, dtype=dtype, generator=g, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, generator=g)
    out = poison((b, C * sc, N), dtype, device)
    epoch = 7
    flags = torch.full((C,), epoch, dtype=I32, device=device)
    counters = torch.tensor([5, 0, 11], dtype=I32, device=device)
    persistent_matmul(gathered.to(device), w.to(device), bias.to(device), first_chunk=2,
                      out=chunk_view(out, 1, C), activation="gelu",
                      wait_flags=flags, ready_value=epoch, signal_counters=counters)
    # reference: the gathered [b, seq, K] activation, chunk c = seq rows c*sc .. (c+1)*sc
    full = gathered.permute(1, 0, 2, 3).reshape(b, C * sc, K)
    assert_close(out, persistent_matmul_reference(full, w, bias, activation="gelu"), dtype, msg="gather layout")
    per = tiles_per_chunk(b * sc, N, _cfg(N, dtype))
    assert counters.tolist() == [5 + per, per, 11 + per]


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_ready_scatter_layout_swiglu_preact(device, dtype):
    """Reduce-scatter layout: A is the [batch, seq, K] input chunked along seq in place, C a
    chunk-major partials buffer; gated activation with the pre-activation output."""
    g = torch.Generator().manual_seed(2)
    C, b, s, K, F = 4, 3, 20, 33, 19
    x = randn(b, s, K, dtype=dtype, generator=g).to(device)
    w = randn(2 * F, K, dtype=dtype, generator=g, scale=K ** -0.5).to(device)
    out = poison((C, b, s // C, F), dtype, device)
    pre = poison((C, b, s // C, 2 * F), torch.float32, device)
    counters = torch.zeros(C, dtype=I32, device=device)
    persistent_matmul(chunk_view(x, 1, C), w, first_chunk=1, out=out, activation="swiglu",
                      wait_mode="none", signal_counters=counters, preact_out=pre, num_programs=2)
    ref_pre = persistent_matmul_reference(x, w)
    ref = persistent_matmul_reference(x, w, activation="swiglu")
    assert_close(out, chunk_view(ref, 1, C), dtype, msg="scatter layout")
    # pre-activation stored in fp32 from the fp32 accumulator: only the input rounding remains
    assert_close(pre, chunk_view(ref_pre, 1, C), dtype, msg="preact")
    assert counters.tolist() == [tiles_per_chunk(b * s // C, F, _cfg(F, dtype, glu=True))] * C


def test_2d_rows_and_batch_chunks(device):
    """2-D [M, K] chunks along dim 0, and [batch, seq, K] chunks along the batch dim."""
    g = torch.Generator().manual_seed(3)
    a = randn(35, 21, generator=g).to(device)
    w = randn(17, 21, generator=g).to(device)
    out = poison((35, 17), torch.float32, device)
    flags = torch.ones(5, dtype=I32, device=device)
    persistent_matmul(chunk_view(a, 0, 5), w, first_chunk=3, out=chunk_view(out, 0, 5), wait_flags=flags,
                      activation="relu", num_programs=4)
    assert_close(out, persistent_matmul_reference(a, w, activation="relu"), torch.float32, msg="2-D")
    x = randn(4, 9, 21, generator=g).to(device)
    y = persistent_matmul(chunk_view(x, 0, 2), w, wait_mode="none")  # allocated chunk-major output
    assert y.shape == (2, 2, 9, 17)
    assert_close(y.reshape(4, 9, 17), persistent_matmul_reference(x, w), torch.float32, msg="batch chunks")


def test_skip_mode_computes_only_ready_chunks_in_chunk_order(device):
    """Flags of chunks 0 and 3 below the ready value (one stale epoch, one never set): exactly
    their rows stay NaN, every other chunk is right, their counters do not move, and the tile
    log shows tiles processed chunk by chunk starting at first_chunk."""
    g = torch.Generator().manual_seed(4)
    C, sc, K, N = 5, 19, 40, 70
    a = randn(C * sc, K, generator=g).to(device)
    w = randn(N, K, generator=g).to(device)
    epoch = 3
    flags = torch.tensor([epoch - 1, epoch, epoch + 1, 0, epoch], dtype=I32, device=device)
    counters = torch.zeros(C, dtype=I32, device=device)
    out = poison((C * sc, N), torch.float32, device)
    per = tiles_per_chunk(sc, N, _cfg(N, torch.float32))
    log = _log(C * per, device)
    first, nprog = 2, 3
    word = torch.tensor([epoch], dtype=I32, device=device)  # a device-resident epoch: read by the kernel
    persistent_matmul(chunk_view(a, 0, C), w, first_chunk=first, out=chunk_view(out, 0, C),
                      wait_flags=flags, wait_mode="skip", ready_value=word, signal_counters=counters,
                      tile_log=log, num_programs=nprog)
    ref = persistent_matmul_reference(a, w)
    ready = [c for c in range(C) if flags[c] >= epoch]
    for c in range(C):
        rows = out[c * sc:(c + 1) * sc]
        if c in ready:
            assert_close(rows, ref[c * sc:(c + 1) * sc], torch.float32, msg=f"chunk {c}")
            assert counters[c].item() == per
        else:
            assert torch.isnan(rows).all(), f"chunk {c} was computed although its flag was not ready"
            assert counters[c].item() == 0
    # tile t belongs to chunk (first + t // per) % C: the skipped tiles are those of the stale chunks
    log = log.cpu()
    computed = (log[:-1] >= 0).nonzero().flatten().tolist()
    expect = [t for t in range(C * per) if (first + t // per) % C in ready]
    assert computed == expect
    assert log[-1].item() == len(expect)
    # each program walks its tiles (t = pid, pid + nprog, ...) in increasing chunk-order index
    for pid in range(nprog):
        tickets = [log[t].item() for t in range(pid, C * per, nprog) if log[t] >= 0]
        assert tickets == sorted(tickets)
    if INTERPRETED:  # programs run sequentially: tickets are program-major
        assert sorted(log[:-1][log[:-1] >= 0].tolist()) == list(range(len(expect)))
    for bad, exc, text in ((word.float(), TypeError, "ready_value must have dtype"),
                           (torch.zeros(2, dtype=I32, device=device), ValueError, "1-element int32 tensor"),
                           (2 ** 31, ValueError, "ready_value must be <=")):
        with pytest.raises(exc, match=text):
            persistent_matmul(chunk_view(a, 0, C), w, wait_flags=flags, wait_mode="skip", ready_value=bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_reduce_peers_in_order(device, dtype):
    """Sum of one chunk over 3 'peers' addressed by element offsets into one buffer, each
    behind a ready counter; bias; strided [batch, rows, N] output."""
    g = torch.Generator().manual_seed(5)
    P, C, b, r, N = 3, 4, 2, 7, 29
    parts = randn(P, C, b, r, N, dtype=dtype, generator=g).to(device)
    bias = randn(N, dtype=dtype, generator=g).to(device)
    counters = torch.tensor([[1, 2, 9, 1], [0, 0, 9, 0], [4, 4, 9, 4]], dtype=I32, device=device).flatten()
    big = poison((b, 3 * r, N), dtype, device)
    out = big[:, r:2 * r]
    order = [2, 0, 1]
    offsets = torch.tensor([p * parts[0].numel() for p in order], dtype=torch.int64)
    chunk_reduce(parts[0], offsets, 2, out=out, bias=bias, counters=counters[:C],
                 counter_offsets=torch.tensor([p * C for p in order], dtype=torch.int64), ready_value=9)
    ref = parts[:, 2].double().sum(0) + bias.double()
    # the sum runs in fp32 over P partials already rounded to dtype: only the output rounding
    assert_close(out, ref, dtype, msg="chunk_reduce")
    assert torch.isnan(big[:, :r]).all() and torch.isnan(big[:, 2 * r:]).all()


@pytest.mark.skipif(not INTERPRETED, reason="on GPU the late-producer tests in test_tensor_parallel_symmetric.py cover waiting")
def test_missing_flag_times_out_instead_of_hanging(device):
    """A spin whose flag never comes gives up after max_spin reads and raises (the interpreter
    cannot see a flag change within one launch), for the GEMM and for chunk_reduce."""
    a = torch.randn(3, 8, 16, device=device)
    w = torch.randn(8, 16, device=device)
    flags = torch.tensor([1, 0, 1], dtype=I32, device=device)
    with pytest.raises(WaitTimeout, match="1 wait"):
        persistent_matmul(a, w, wait_flags=flags, max_spin=50)
    assert wait_timeouts(device) == 0  # reported and reset
    counters = torch.tensor([2, 1, 2], dtype=I32, device=device)
    with pytest.raises(WaitTimeout, match="chunk_reduce"):
        chunk_reduce(a, torch.zeros(1, dtype=torch.int64), 1, out=torch.empty(8, 16, device=device),
                     counters=counters, counter_offsets=torch.zeros(1, dtype=torch.int64), ready_value=2,
                     max_spin=50)


def test_waits_compare_counters_modulo_2_32(device):
    """Completion counters only grow and wrap past 2^31 - 1 (nothing resets them: a CUDA graph may
    replay a call any number of times) and a ready value computed from them wraps with them, so a
    wait compares modulo 2^32: a counter 4 short of a wrapped ready value is behind (compared as
    ints it is far above it, and the reduction read the partials early), one that wrapped with it
    has reached it; the GEMM's skip mode likewise."""
    a = randn(2, 8, 16).to(device)
    out, zero = torch.empty(8, 16, device=device), torch.zeros(1, dtype=torch.int64)
    ready = torch.tensor([-2 ** 31 + 1], dtype=I32, device=device)  # (2^31 - 3) + 4, wrapped
    wait_timeouts(device)
    for counter, timeouts in ((2 ** 31 - 3, 1), (-2 ** 31 + 1, 0)):
        out.fill_(float("nan"))
        chunk_reduce(a, zero, 0, out=out, counters=torch.tensor([counter, 0], dtype=I32, device=device),
                     counter_offsets=zero, ready_value=ready, max_spin=20, check_waits=False)
        assert wait_timeouts(device) == timeouts, counter
        if not timeouts:
            torch.testing.assert_close(out, a[0])
    w = randn(8, 16).to(device)
    c = poison((2, 8, 8), torch.float32, device)
    flags = torch.tensor([-2 ** 31 + 1, 2 ** 31 - 4], dtype=I32, device=device)  # 4 past, 1 short of the ready value
    persistent_matmul(a, w, out=c, wait_flags=flags, wait_mode="skip",
                      ready_value=torch.tensor([2 ** 31 - 3], dtype=I32, device=device))
    assert_close(c[0], persistent_matmul_reference(a[:1], w)[0], torch.float32)
    assert torch.isnan(c[1]).all()


@pytest.mark.skipif(not INTERPRETED, reason="runs the launchers as if compiled while the kernels stay "
                    "interpreted; test_gpu_missing_flag_times_out is the compiled version")
@pytest.mark.parametrize("launcher", ["persistent_matmul", "chunk_reduce"])
def test_wait_timeout_raises_when_compiled_too(device, monkeypatch, launcher):
    """A wait that gives up is an error on a GPU as well, not only under the interpreter (on a
    GPU the op would otherwise return what it read without the data): the launchers below see
    themselves compiled (interpreting() is False for them) and still raise WaitTimeout."""
    monkeypatch.setattr(pg, "interpreting", lambda: False)
    a = torch.randn(3, 8, 16, device=device)
    w = torch.randn(8, 16, device=device)
    wait_timeouts(device)
    with pytest.raises(WaitTimeout, match=f"{launcher}: 1 wait"):
        if launcher == "persistent_matmul":
            persistent_matmul(a, w, wait_flags=torch.tensor([1, 0, 1], dtype=I32, device=device), max_spin=50,
                              config=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4))
        else:
            chunk_reduce(a, torch.zeros(1, dtype=torch.int64), 1, out=torch.empty(8, 16, device=device),
                         counters=torch.tensor([2, 1, 2], dtype=I32, device=device),
                         counter_offsets=torch.zeros(1, dtype=torch.int64), ready_value=2, max_spin=50,
                         block=(16, 16))
    assert wait_timeouts(device) == 0  # reported once


@pytest.mark.parametrize("mode", WAIT_CHECKS)
def test_check_wait_timeouts_reports_each_timeout_once(device, mode):
    """The host side of a timeout: new counts raise once, naming the op; "deferred" (GPU) raises
    at the first check after its snapshot has landed, without synchronising itself."""
    wait_timeouts(device)
    check_wait_timeouts(device, "op", mode=mode)  # nothing new
    status_word(device).add_(2)  # two waits gave up
    if device.type == "cuda" and mode == "deferred":
        check_wait_timeouts(device, "op", mode=mode)  # queues a snapshot; none has landed before it
        torch.cuda.synchronize()
    with pytest.raises(WaitTimeout, match="op: 2 wait"):
        check_wait_timeouts(device, "op", mode=mode)
    check_wait_timeouts(device, "op", mode=mode)
    assert wait_timeouts(device) == 0
    with pytest.raises(ValueError, match="mode must be one of"):
        check_wait_timeouts(device, "op", mode="never")


class _FakeEvent:
    """A CUDA event's host API as the deferred check uses it; ``landed`` says what query() answers,
    ``streams`` where it was recorded."""
    landed = True
    synchronized = 0
    streams = []

    def record(self, stream=None):
        _FakeEvent.streams.append(stream)

    def query(self):
        return _FakeEvent.landed

    def synchronize(self):
        _FakeEvent.synchronized += 1


def test_deferred_check_names_the_op_without_synchronising(monkeypatch):
    """The default check (deferred) on CPU tensors standing for a GPU's: an op's check copies the
    status word into a pinned slot and raises nothing for its own kernels; the next check whose
    earlier copy has landed raises, naming the op whose copy first showed the count and the op
    that found it; a count is reported once; at most 64 copies wait in flight (the oldest is then
    waited for); the status word is never read synchronously; each copy's event is recorded on the
    current stream of the word's device (where the copy is queued), not of the current device."""
    from fusedpar.kernels import waits

    dev = torch.device("cpu")
    monkeypatch.setattr(waits, "deferred_capable", lambda word: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current stream of", device))
    monkeypatch.setattr(_FakeEvent, "streams", [])
    monkeypatch.setattr(waits, "snapshot_buffers",
                        lambda n: (torch.zeros(n, dtype=I32), [_FakeEvent() for _ in range(n)]))
    monkeypatch.setitem(waits._statuses, dev, waits._Status(dev))  # a fresh word and no snapshots
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("the deferred check read the word"))
    check = functools.partial(check_wait_timeouts, dev, mode="deferred")
    check("op A")  # snapshot: 0
    status_word(dev).add_(2)  # two waits of op B's kernels give up
    check("op B")  # op A's copy has landed (0); op B's queued: nothing raised by B itself
    with pytest.raises(WaitTimeout, match=r"op B: 2 wait\(s\) gave up.*deferred check of a later op, op C"):
        check("op C")
    check("op D")  # reported once
    monkeypatch.setattr(_FakeEvent, "landed", False)
    monkeypatch.setattr(_FakeEvent, "synchronized", 0)
    status_word(dev).add_(1)  # before op 0's copy
    for i in range(64):  # copies that never land: op D's and 63 more in flight, then the oldest is waited for
        check(f"op {i}")
    assert _FakeEvent.synchronized == 1  # op D's copy (nothing new)
    with pytest.raises(WaitTimeout, match="op 0: 1 wait"):
        check("op 64")
    assert set(_FakeEvent.streams) == {("current stream of", dev)}


@pytest.mark.gpu
def test_gpu_missing_flag_times_out():
    """Compiled: a flag that never comes ends in a WaitTimeout after the launch, not in a hung
    device or a silently wrong result (sync: at once; deferred, the default: at the next check
    once the snapshot has landed); with check_waits=False the count waits for wait_timeouts."""
    a = torch.randn(4, 64, 128, device="cuda", dtype=torch.float16)
    w = torch.randn(96, 128, device="cuda", dtype=torch.float16)
    wait_timeouts("cuda")  # clear
    flags = torch.tensor([1, 1, 0, 1], dtype=I32, device="cuda")
    with pytest.raises(WaitTimeout, match="persistent_matmul"):
        persistent_matmul(a, w, wait_flags=flags, max_spin=10_000, num_programs=4)
        torch.cuda.synchronize()
        check_wait_timeouts("cuda", "the next op")  # deferred (the default): the landed snapshot
    assert wait_timeouts("cuda") == 0
    persistent_matmul(a, w, wait_flags=flags, max_spin=10_000, num_programs=4, check_waits=False)
    torch.cuda.synchronize()
    assert wait_timeouts("cuda") >= 1
    persistent_matmul(a, w, wait_flags=torch.ones(4, dtype=I32, device="cuda"), max_spin=10_000)
    torch.cuda.synchronize()
    assert wait_timeouts("cuda") == 0


def _error_calls(device):
    a = torch.randn(2, 5, 8, device=device)
    w = torch.randn(6, 8, device=device)
    return [
        ("no_flags", ValueError, "wait_flags", lambda: persistent_matmul(a, w)),
        ("flag_dtype", TypeError, "int32", lambda: persistent_matmul(a, w, wait_flags=torch.ones(2, device=device))),
        ("flag_count", ValueError, "one entry per chunk",
         lambda: persistent_matmul(a, w, wait_flags=torch.ones(1, dtype=I32, device=device))),
        ("first_chunk", ValueError, "first_chunk", lambda: persistent_matmul(a, w, wait_mode="none", first_chunk=2)),
        ("inner_k", ValueError, "inner dimensions",
         lambda: persistent_matmul(a, torch.randn(6, 7, device=device), wait_mode="none")),
        ("wait_mode", ValueError, "wait_mode", lambda: persistent_matmul(a, w, wait_mode="poll")),
        ("not_chunked", ValueError, "chunked view", lambda: persistent_matmul(a[0], w, wait_mode="none")),
        ("out_shape", ValueError, "out must have shape",
         lambda: persistent_matmul(a, w, wait_mode="none", out=torch.empty(2, 5, 7, device=device))),
        ("tile_log", ValueError, "tile_log",
         lambda: persistent_matmul(a, w, wait_mode="none", tile_log=torch.zeros(5, dtype=I32, device=device))),
        ("num_programs", ValueError, "num_programs must be >= 1",
         lambda: persistent_matmul(a, w, wait_mode="none", num_programs=0)),
        ("chunk_view", ValueError, "not divisible into 4 chunks", lambda: chunk_view(torch.randn(2, 6, 3), 1, 4)),
        ("reduce_chunk", ValueError, "chunk must be in",
         lambda: chunk_reduce(a.unsqueeze(-1).expand(2, 5, 8, 3)[..., 0], torch.zeros(1, dtype=torch.int64), 2,
                              out=torch.empty(5, 8, device=device))),
    ]


@pytest.mark.parametrize("case", range(len(_error_calls("cpu"))), ids=[c[0] for c in _error_calls("cpu")])
def test_errors(device, case):
    _, exc, pattern, call = _error_calls(device)[case]
    with pytest.raises(exc, match=pattern):
        call()


_COMPILE_CHECK = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels import persistent_gemm as pg

    def comp(fn, const, div16, ptr_types, opts):
        # signature as a real launch specialises it: unit strides constexpr, 16-divisible hints
        names = fn.arg_names
        sig, attrs = {}, {}
        for i, n in enumerate(names):
            if n in const:
                sig[n] = "constexpr"
            elif n.endswith("_ptr"):
                sig[n] = ptr_types.get(n, "*i32")
            else:
                sig[n] = "i64" if n.startswith("s_") else "i32"
            if n not in const and (n in div16 or n.endswith("_ptr")):
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

    NO_FP8 = dict(SA_M_SPLIT=False, FP8=False, BLOCKWISE=False, EMULATE=False, PROMOTE_K=128, TMA=False, B_KMAJOR=True)
    bf16 = {n: "*bf16" for n in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "aux_ptr")}
    k = comp(pg.persistent_gemm_kernel,
             dict(A_M_SPLIT=False, C_M_SPLIT=True, X_M_SPLIT=False, HAS_BIAS=True, STORE_AUX=False, ACT=0,
                   GLU=False, UPCAST=False, EVEN_K=True, INPUT_PRECISION="ieee", WAIT=1, SIGNAL=True, LOG=False,
                  MAX_SPIN=1 << 27, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, s_ak=1, s_bk=1, s_cn=1,
                  **NO_FP8),
             {"s_am1", "s_bn", "s_cm1", "s_cm0", "K", "N", "ROWS", "s_a_chunk", "s_c_chunk"}, bf16,
             dict(num_warps=8, num_stages=3))
    ptx = k.asm["ptx"]
    print("ACQUIRE", "ld.global.sys.acquire" in ptx or "atom.global.sys.acquire" in ptx)
    print("RELEASE", ".sys.release" in ptx)
    print("WGMMA", "wgmma" in ptx)
    print("PIPELINED", "cp.async" in ptx)
    tg = k.asm["ttgir"]
    # no prefetch of A/B is hoisted above the flag wait: every async copy comes after the spin
    print("LOADS_AFTER_WAIT", -1 < tg.find("scf.while") < tg.find("async_copy_global_to_local"))
    fp16 = {n: "*fp16" for n in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr")}
    comp(pg.persistent_gemm_kernel,
         dict(A_M_SPLIT=True, C_M_SPLIT=False, X_M_SPLIT=False, HAS_BIAS=True, STORE_AUX=True, ACT=3, GLU=True,
              UPCAST=False, EVEN_K=False, INPUT_PRECISION="ieee", WAIT=2, SIGNAL=False, LOG=True,
              MAX_SPIN=1 << 27, BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, s_ak=1, s_bk=1, **NO_FP8),
         {"K"}, dict(fp16, aux_ptr="*fp32"), dict(num_warps=4, num_stages=3))
    print("SKIP_GLU_AUX", True)
    # fp8 operands, both recipes: the K loop on fp8 wgmma (e4m3 x e4m3), still after the wait
    fp8 = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", bias_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32")
    for blockwise in (False, True):
        k = comp(pg.persistent_gemm_kernel,
                 dict(NO_FP8, A_M_SPLIT=False, C_M_SPLIT=True, X_M_SPLIT=False, HAS_BIAS=True, STORE_AUX=False,
                      ACT=0, GLU=False, UPCAST=False, EVEN_K=True, INPUT_PRECISION="ieee", FP8=True,
                      BLOCKWISE=blockwise, WAIT=1, SIGNAL=False, LOG=False, MAX_SPIN=1 << 27, BLOCK_M=128,
                      BLOCK_N=128, BLOCK_K=128, GROUP_M=8, s_ak=1, s_bk=1, s_cn=1, s_sak=1),
                 {"s_am1", "s_bn", "s_cm1", "s_cm0", "K", "N", "ROWS", "s_a_chunk", "s_c_chunk"}, fp8,
                 dict(num_warps=8, num_stages=4))
        tg = k.asm["ttgir"]
        print("FP8_WGMMA_" + ("BLOCKWISE" if blockwise else "ROWWISE"),
              "wgmma" in k.asm["ptx"] and ".e4m3.e4m3" in k.asm["ptx"]
              and -1 < tg.find("scf.while") < tg.find("async_copy_global_to_local"))
    k = comp(pg.chunk_reduce_kernel,
             dict(SRC_M_SPLIT=False, O_M_SPLIT=True, HAS_BIAS=True, WAIT=1, MAX_SPIN=1 << 27, BLOCK_M=32,
                  BLOCK_N=128, s_srcn=1, s_on=1),
             {"N"}, {"src_ptr": "*fp32", "peer_off_ptr": "*i64", "count_off_ptr": "*i64", "out_ptr": "*bf16",
                     "acc_ptr": "*fp32", "bias_ptr": "*bf16"}, dict(num_warps=4))
    print("REDUCE_ACQUIRE", "ld.global.sys.acquire" in k.asm["ptx"])
    # the reduce-scatter side (no waits) on TMA: descriptor loads into wgmma, the release after the stores
    k = comp(pg.persistent_gemm_kernel,
             dict(NO_FP8, A_M_SPLIT=False, C_M_SPLIT=False, X_M_SPLIT=False, HAS_BIAS=False, STORE_AUX=False, ACT=0,
                  GLU=False, UPCAST=False, EVEN_K=True, INPUT_PRECISION="ieee", WAIT=0, SIGNAL=True, LOG=False,
                  MAX_SPIN=1 << 27, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, s_ak=1, s_bk=1, s_cn=1,
                  TMA=True),
             {"s_am1", "s_bn", "s_cm1", "K", "N", "ROWS", "s_a_chunk", "s_c_chunk"}, bf16,
             dict(num_warps=8, num_stages=4))
    ptx = k.asm["ptx"]
    print("TMA_RS", "cp.async.bulk.tensor" in ptx and "wgmma" in ptx and ".sys.release" in ptx
          and "cp.async.cg" not in ptx)
    """
)


@pytest.mark.skipif(not INTERPRETED, reason="the compiled tests cover this on a GPU machine")
def test_compiles_for_sm90_with_acquire_release_and_pipelining():
    """Without a GPU, compile the kernels for sm_90 down to a cubin (Triton's own toolchain,
    specialised like a real launch): the flag wait lowers to a system-scope acquire, no load is
    hoisted above it, the completion signal lowers to a system-scope release, the K loop keeps
    wgmma + async copies (fp8 operands: e4m3 wgmma, both recipes, loads after the wait); the
    skip/gated/pre-activation variant and the chunk_reduce consumer compile too; the
    reduce-scatter side on TMA loads (no cp.async) still releases its counters."""
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(line.split() for line in res.stdout.splitlines() if line.split()[0].isupper())
    assert lines == {"ACQUIRE": "True", "RELEASE": "True", "WGMMA": "True", "PIPELINED": "True", "LOADS_AFTER_WAIT": "True",
                     "SKIP_GLU_AUX": "True", "FP8_WGMMA_ROWWISE": "True", "FP8_WGMMA_BLOCKWISE": "True",
                     "REDUCE_ACQUIRE": "True", "TMA_RS": "True"}, res.stdout


@pytest.mark.skipif(not INTERPRETED, reason="smoke mode of the CLI (the GPU run is a benchmark, not a test)")
def test_benchmark_cli_smoke(tmp_path, monkeypatch):
    """python -m benchmarks persistent_ag / persistent_rs run their CPU smoke mode, check their
    results against the baseline before timing, and write JSON rows (with the GEMM's loads)."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)
    from benchmarks.__main__ import main

    for op, key, extra in (("persistent_ag", "N_local", ["--fp8", "blockwise"]),
                           ("persistent_rs", "K_local", ["--fp8", "rowwise"])):
        path = tmp_path / f"{op}.json"
        assert main([op, "--tokens", "12", "--hidden", "16", "--n", "20", "--tp", "3", *extra, "--json", str(path)]) == 0
        (row,) = json.loads(path.read_text())["results"][op]
        assert row[key] == 20 and row["tp"] == 3 and row["max_rel_err"] < 1e-4
        assert row["T_persistent_ms"] > 0 and row["T_seq_ms"] > 0
        # the op's GEMM: the all-gather's waits keep pointer loads, the reduce-scatter's takes TMA
        assert row["loads"] == ("tma" if op == "persistent_rs" else "pointer"), (op, row["loads"])
    # the fp8 columns: the persistent fp8 GEMM's result was checked against the fp8 ring's before timing
    for op, recipe in (("persistent_ag", "blockwise"), ("persistent_rs", "rowwise")):
        (row,) = json.loads((tmp_path / f"{op}.json").read_text())["results"][op]
        assert row["fp8"] == recipe and row["T_persistent_fp8_ms"] > 0 and row["fp8_rel_err"] < 2 ** -7
    with pytest.raises(SystemExit):
        main(["persistent_ag", "--tokens", "10", "--tp", "3"])


def test_config_is_validated_with_the_gemm_prune_rule(monkeypatch):
    """A ``config=`` is checked (compiled path) with the autotuned GEMM's rule: SwiGLU 128x256x64
    with 3 stages needs 245760 B of shared memory > 232448 B on sm_90; a fused epilogue whose
    accumulators would spill and malformed configs are refused too; the defaults pass."""
    from fusedpar.kernels import gemm_configs, persistent_config
    from fusedpar.kernels.gemm import linear_operands

    monkeypatch.setattr(persistent_config, "shared_memory_limit", lambda index=0: 232448)
    monkeypatch.setattr(gemm_configs, "device_capability", lambda index=0: (9, 0))
    def operands(dtype, activation):  # kernel operands: on the tests' device (linear_operands checks it)
        x = torch.empty(64, 64, dtype=dtype, device=DEVICE)
        w = torch.empty(128 if activation == "swiglu" else 64, 64, dtype=dtype, device=DEVICE)
        return linear_operands(x, w, activation=activation)

    a = torch.empty(4, 64, 4096, dtype=torch.bfloat16, device="meta")  # CPU tensors skip the GPU checks
    glu, plain = operands(torch.bfloat16, "swiglu"), operands(torch.bfloat16, "none")
    big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match="needs 245760 B of shared memory > 232448 B"):
        pg.check_config(big, a, glu, store_aux=True)
    pg.check_config(big, a, plain, store_aux=False)
    with pytest.raises(ValueError, match="128 fp32 accumulator elements per thread > 64"):
        pg.check_config(dict(big, BLOCK_N=128, num_stages=4), a, glu, store_aux=False)
    with pytest.raises(ValueError, match=r"config\['BLOCK_K'\] must be a positive power of two, got 48"):
        pg.check_config(dict(big, BLOCK_K=48), a, plain, store_aux=False)
    with pytest.raises(ValueError, match=r"config\['num_warps'\] must be a positive power of two, got 6"):
        pg.check_config(dict(big, num_warps=6), a, plain, store_aux=False)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = a.to(dtype)
        for ops in (operands(dtype, "swiglu"), operands(dtype, "none")):
            pg.check_config(pg.gpu_config(ops.n, dtype, ops.glu), x, ops, store_aux=ops.glu)
    f8 = torch.float8_e4m3fn  # fp8 defaults: twice the accumulators, within the fp8 GEMM's budget
    for ops in (glu, plain):
        pg.check_config(pg.gpu_config(ops.n, f8, ops.glu), a.to(f8), ops, store_aux=ops.glu)
    with pytest.raises(ValueError, match="256 fp32 accumulator elements per thread > 128"):
        pg.check_config(dict(big, BLOCK_K=128, num_stages=2), a.to(f8), plain, store_aux=False)


# --------------------------------------------------------------------------------------------
# fp8 operands (e4m3 with fp32 scales, the recipes of kernels/fp8_gemm.py)
# --------------------------------------------------------------------------------------------
def _fp8_operands(scaling, b, s, K, n_w, seed):
    """A ``[b, s, K]`` activation and an ``[n_w, K]`` weight quantised by the recipe (activation
    per token / per 1x128 tile, weight per output row / per 128x128 block), with a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b * s, K, generator=g).to(DEVICE)
    w = (torch.randn(n_w, K, generator=g) * 0.1).to(DEVICE)
    xq, xs = quantize_e4m3(x, "row" if scaling == "rowwise" else "tile")
    wq, ws = quantize_e4m3(w, "row" if scaling == "rowwise" else "block")
    return xq.view(b, s, K), xs.view(b, s, *xs.shape[1:]), wq, ws, torch.randn(n_w, generator=g).to(DEVICE)


def _scale_chunks(xs, C):
    """The chunked view of an activation's scales (``[b, s]`` per token, ``[b, s, kb]`` per tile)."""
    return chunk_view(xs.unsqueeze(-1), 1, C)[..., 0] if xs.dim() == 2 else chunk_view(xs, 1, C)


def assert_fp8_matches(actual, expected, scaling, qa, sa, qw, sw, bias, what):
    """Interpreted: bit for bit what ``fp8_matmul`` gives on the same operands (the same main loop,
    K step and accumulation order; bf16 rounded to nearest even by both). Compiled, the two launch
    different tiles (their fp8 tensor cores may truncate differently), so ``actual`` is checked
    against the float64 product of the dequantised operands as tests/test_fp8.py checks
    fp8_matmul: fp32 accumulation (:data:`ACC_RTOL` of the result's scale), the tensor cores'
    share (:func:`mma_error_bound`) and one output rounding (bf16: 2^-8 relative)."""
    if INTERPRETED:
        assert torch.equal(actual, expected), f"{what}: differs from fp8_matmul"
        return
    ga, gb = ("row", "row") if scaling == "rowwise" else ("tile", "block")
    qa2, sa2, qw, sw = qa.reshape(-1, qa.shape[-1]).cpu(), sa.reshape(qa.shape[0] * qa.shape[1], -1).cpu(), qw.cpu(), sw.cpu()
    sa2 = sa2.squeeze(-1) if scaling == "rowwise" else sa2
    ref = dequantize_e4m3(qa2, sa2, ga) @ dequantize_e4m3(qw, sw, gb).t() + bias.cpu().double()
    mma = mma_error_bound(qa2.double(), dequantize_e4m3(torch.ones_like(qa2), sa2, ga), qw.double(),
                          dequantize_e4m3(torch.ones_like(qw), sw, gb))
    rnd = 2.0 ** -8 if actual.dtype == torch.bfloat16 else 0.0
    tol = ACC_RTOL * ref.pow(2).mean().sqrt() + mma + rnd * ref.abs()
    assert_within(actual.reshape(ref.shape), ref, tol, what)


@pytest.mark.parametrize("scaling,out_dtype", [("rowwise", torch.bfloat16), ("blockwise", torch.float32)])
def test_fp8_all_ready_matches_fp8_matmul(device, scaling, out_dtype):
    """All-gather layout (a and its scales sequence chunks of [batch, seq, K] views, read in
    place; out a sequence chunk view of the NaN-poisoned [batch, seq, N] result), the local chunk
    first, flags at an epoch value; ragged M / N tiles and K = 200 (a ragged last 128-wide scale
    block), bias: equal to fp8_matmul on the same operands; the counters grow by the tiles per chunk."""
    C, b, sc, K, N = 3, 2, 13, 200, 45
    xq, xs, wq, ws, bias = _fp8_operands(scaling, b, C * sc, K, N, seed=11)
    out = poison((b, C * sc, N), out_dtype, device)
    epoch = 5
    counters = torch.zeros(C, dtype=I32, device=device)
    persistent_matmul(chunk_view(xq, 1, C), wq, bias, a_scale=_scale_chunks(xs, C), weight_scale=ws, scaling=scaling,
                      first_chunk=1, out=chunk_view(out, 1, C), wait_flags=torch.full((C,), epoch, dtype=I32,
                      device=device), ready_value=epoch, signal_counters=counters)
    expected = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=out_dtype)
    assert_fp8_matches(out, expected, scaling, xq, xs, wq, ws, bias, scaling)
    assert counters.tolist() == [tiles_per_chunk(b * sc, N, kernel_config(None, N, xq.dtype))] * C


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_fp8_late_flags_swiglu_preact(device, scaling):
    """Chunk-major [C, rows, K] operands (2-D chunks), gated activation over 2F = 140 weight rows
    (blockwise: the up half starts inside the first 128-row scale block and runs into the second),
    fp32 pre-activation. One chunk's flag comes late: a first launch (``"skip"``) leaves exactly its
    rows NaN, the launch after the flag is raised computes them. The pre-activation equals
    fp8_matmul's product; the output is act(gate) * up of it (fp32 epilogue: fp32 tolerance)."""
    C, r, K, F = 3, 21, 200, 70
    xq, xs, wq, ws, bias = _fp8_operands(scaling, C, r, K, 2 * F, seed=12)
    out = poison((C, r, F), torch.float32, device)
    pre = poison((C, r, 2 * F), torch.float32, device)
    flags = torch.tensor([1, 0, 1], dtype=I32, device=device)
    kw = dict(a_scale=xs, weight_scale=ws, scaling=scaling, out=out, activation="swiglu", preact_out=pre,
              wait_flags=flags, wait_mode="skip")
    persistent_matmul(xq, wq, bias, **kw)
    assert torch.isnan(out[1]).all() and torch.isnan(pre[1]).all()
    assert not torch.isnan(out[0]).any() and not torch.isnan(out[2]).any()
    flags[1] = 1  # the late producer
    persistent_matmul(xq, wq, bias, **kw)
    expected = fp8_matmul(xq, xs, wq, ws, bias, scaling=scaling, out_dtype=torch.float32)
    assert_fp8_matches(pre, expected, scaling, xq, xs, wq, ws, bias, "pre-activation")
    gate, up = pre.double().split(F, dim=-1)
    assert_close(out, torch.nn.functional.silu(gate) * up, torch.float32, msg="swiglu of the pre-activation")


def _fp8_error_calls(device):
    f8 = torch.float8_e4m3fn
    a, w = torch.zeros(2, 5, 200, device=device).to(f8), torch.zeros(6, 200, device=device).to(f8)
    sa, sw = torch.ones(2, 5, device=device), torch.ones(6, device=device)
    call = functools.partial(persistent_matmul, a, w, wait_mode="none")
    return [
        ("recipe", ValueError, "scaling must be one of", lambda: call(a_scale=sa, weight_scale=sw, scaling="tensor")),
        ("a_scale_missing", TypeError, "a_scale must be a torch.Tensor", lambda: call(weight_scale=sw)),
        ("a_scale_dtype", TypeError, "a_scale must have dtype torch.float32",
         lambda: call(a_scale=sa.half(), weight_scale=sw)),
        ("a_scale_shape", ValueError, r"a_scale must have shape \(2, 5, 2\)",
         lambda: call(a_scale=sa, weight_scale=torch.ones(1, 2, device=device), scaling="blockwise")),
        ("weight_scale_shape", ValueError, r"weight_scale must have shape \(1, 2\)",
         lambda: call(a_scale=torch.ones(2, 5, 2, device=device), weight_scale=sw, scaling="blockwise")),
        ("weight_dtype", TypeError, "weight must have dtype torch.float8_e4m3fn",
         lambda: persistent_matmul(a, w.float(), wait_mode="none", a_scale=sa, weight_scale=sw)),
        ("scales_without_fp8", ValueError, "are for float8_e4m3fn operands",
         lambda: persistent_matmul(a.float(), w.float(), wait_mode="none", a_scale=sa, weight_scale=sw)),
        ("block_k", ValueError, r"config\['BLOCK_K'\] must be 128",
         lambda: call(a_scale=sa, weight_scale=sw, config=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=4))),
        ("out_dtype", TypeError, "out_dtype", lambda: call(a_scale=sa, weight_scale=sw, out_dtype=torch.int32)),
    ]


@pytest.mark.parametrize("case", range(len(_fp8_error_calls("cpu"))), ids=[c[0] for c in _fp8_error_calls("cpu")])
def test_fp8_errors(device, case):
    _, exc, pattern, call = _fp8_error_calls(device)[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_fp8_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    """The operands on a GPU of compute capability 8.0 (simulated: meta tensors that the device
    checks take for usable, the capability and the name the fp8 check reads): FP8UnsupportedError
    naming the device, before any launch."""
    import fusedpar.kernels.checks as checks
    import fusedpar.kernels.fp8 as fp8_kernels

    monkeypatch.setattr(checks, "check_device_usable", lambda name, t: None)
    monkeypatch.setattr(fp8_kernels, "device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    a = torch.empty(2, 5, 64, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(6, 64, dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(FP8UnsupportedError, match="NVIDIA A100-SXM4-80GB has compute capability 8.0"):
        persistent_matmul(a, w, a_scale=torch.empty(2, 5, device="meta"), weight_scale=torch.empty(6, device="meta"),
                          wait_mode="none")
