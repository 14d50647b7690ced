"""Persistent chunked GEMMs that synchronise with a transport through per-chunk flags.

The portable tensor-parallel path launches one GEMM per chunk and lets the stream wait for each
chunk's transfer. Here one *persistent* launch (a fixed grid of programs, one per SM on GPU)
walks over all output tiles of all chunks, in chunk order: no launch gap or tail between chunks.

* **all-gather side** (``wait_mode="spin"``): before it loads a chunk's rows of A, a program
  spins on that chunk's int32 ready flag (acquire) until it reaches ``ready_value``; a producer
  (copy engine on a side stream, :mod:`fusedpar.ops.comm.symmetric`) fills the chunks and raises the
  flags. Tiles start at ``first_chunk`` (the local chunk), so work never waits for data that
  arrives later than data it skipped over.
* **reduce-scatter side** (``signal_counters``): after each tile's store a program adds 1 to its
  chunk's counter (release): a chunk is complete when its counter has grown by
  :func:`tiles_per_chunk`, and a consumer can move it while the other chunks still compute.
* :func:`chunk_reduce` is that consumer: it sums one chunk of the partials of several "peers"
  (one base pointer plus per-peer element offsets: symmetric-memory peers or single-GPU
  emulation buffers), reading each peer's partial after its completion counter says so.

Operands are *chunked views*: ``[C, rows, F]`` or ``[C, batch, rows, F]`` tensors with any
strides, chunk ``c`` being ``t[c]`` (:func:`chunk_view` makes one from a ``[batch, seq, F]``
activation without copying): a sequence chunk is read or written in place. fp8 operands (e4m3
``a`` and weight with fp32 scales, the constexpr ``FP8``) run the same kernel with the main loop
and scale layouts of :func:`~fusedpar.kernels.fp8_gemm.fp8_matmul` (rowwise or blockwise), whose
results they reproduce bit for bit under the interpreter.

Every spin is bounded: a wait that runs out counts a timeout in a per-device status word, which
:func:`check_wait_timeouts` turns into a :class:`WaitTimeout` on the host (GPU and interpreter),
at a later check without a host synchronisation (``"deferred"``, default) or right after the work
(``FUSEDPAR_WAIT_CHECK=sync``).
Triton's interpreter runs programs one after another (a spin on a flag raised later would hang):
interpreted tests set flags before the launch, or use ``wait_mode="skip"`` (a tile whose flag is
not ready is skipped). ``tile_log`` records per tile a global ticket taken when it was computed
(-1 stays for skipped tiles).

Layers: :func:`persistent_gemm_kernel` / :func:`chunk_reduce_kernel` (jit) -> :func:`persistent_matmul`
/ :func:`chunk_reduce` (validate, allocate, launch) -> :func:`persistent_matmul_reference`.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .checks import (check_buffer, check_choice, check_float_tensor, check_int, check_out_dtype, check_same,
                     check_shape, check_tensor, output_buffer)
from .fp8 import FP8_BLOCK, check_fp8_device, rne_for_store
from .fp8_gemm import FP8_PROMOTE_K, SCALINGS
from .gemm import linear_operands, matmul_reference
from .gemm_core import gemm_epilogue, gemm_mainloop, grouped_tile, operand_descriptors
from .gemm_loads import ensure_scratch_allocator, note_launch
from .launch import PlanCache, describe, exact_ints, launch_planned
from .persistent_config import (CONFIG_KEYS, INTERPRETER_PROGRAMS, check_config, default_num_programs, gpu_config,
                                kernel_config, tma_weight_major)
from .runtime import RowView, cdiv, input_precision, interpreting, needs_upcast, on_device, row_offsets
from .waits import (WaitTimeout, behind, check_wait_timeouts, ready_word, spin_bound, status_word, wait_ready,
                    wait_timeouts)

__all__ = [
    "CONFIG_KEYS", "WAIT_MODES", "check_config", "chunk_reduce", "chunk_reduce_kernel", "chunk_view", "default_num_programs", "gpu_config",
    "kernel_config", "persistent_gemm_kernel", "persistent_matmul", "persistent_matmul_reference", "tiles_per_chunk",
    # re-exported from .waits and .persistent_config
    "WaitTimeout", "check_wait_timeouts", "wait_timeouts", "INTERPRETER_PROGRAMS",
]

WAIT_MODES = {"none": 0, "spin": 1, "skip": 2}

# ---------------------------------------- Triton kernels ----------------------------------------
@triton.jit
def persistent_gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, aux_ptr, sa_ptr, sb_ptr, flag_ptr, count_ptr, log_ptr, status_ptr, ready_ptr,
    ROWS, N, K, num_chunks, first_chunk,
    s_a_chunk, a_m_inner, s_am0, s_am1, s_ak, s_bk, s_bn, glu_offset,
    s_c_chunk, c_m_inner, s_cm0, s_cm1, s_cn, s_x_chunk, x_m_inner, s_xm0, s_xm1, s_xn,
    s_sa_chunk, sa_m_inner, s_sam0, s_sam1, s_sak, s_sbn, s_sbk,
    A_M_SPLIT: tl.constexpr, C_M_SPLIT: tl.constexpr, X_M_SPLIT: tl.constexpr, SA_M_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_AUX: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, BLOCKWISE: tl.constexpr, EMULATE: tl.constexpr, PROMOTE_K: tl.constexpr,
    WAIT: tl.constexpr, SIGNAL: tl.constexpr, LOG: tl.constexpr, MAX_SPIN: tl.constexpr,
    TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Every tile of every chunk from ``first_chunk`` on: the flag wait (a flag is ready at the
    value of the device word ``*ready_ptr``, read once per program: no host value in the launch),
    ``gemm_mainloop`` (``FP8``: with the scales), ``gemm_epilogue``, the store, the release of
    the chunk's counter. ``TMA`` (no flag waits: a load through a descriptor after an acquire
    would need a proxy fence): A's chunks as one stack ``[num_chunks * ROWS, K]`` (``A_M_SPLIT``:
    the ``[batch, num_chunks * a_m_inner]`` rows of the activation the chunks split) and the weight
    (``B_KMAJOR``: ``[N_w, K]``, else ``[K, N_w]``) through tensor descriptors; a tile reaching
    past its chunk's rows reads the next chunk's, which feed only rows it does not store."""
    tl.static_assert(BLOCK_K >= 16, "tl.dot needs BLOCK_K >= 16")
    tl.static_assert(not FP8 or BLOCK_K == 128, "fp8 steps K one 128-wide scale block at a time")
    tl.static_assert(WAIT >= 0 and WAIT <= 2, "WAIT: 0 none, 1 spin, 2 skip")
    tl.static_assert(ACT >= 0 and ACT <= 4, "unknown activation code")
    tl.static_assert(not TMA or WAIT == 0, "TMA: no flag waits")

    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(ROWS, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_chunk = num_pid_m * num_pid_n
    total = per_chunk * num_chunks
    ready_value = tl.load(ready_ptr)  # written by stream-ordered work before the launch
    a_desc, b_desc = a_ptr, b_ptr  # (unused by pointer loads)
    if TMA:
        a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, num_chunks * ROWS, N + glu_offset, K, s_am1, s_ak, s_bk,
                                             s_bn, True, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
    # The outer loop is deliberately a plain range (no flattening/pipelining across tiles): a
    # prefetch of the next tile's A would be hoisted above that tile's flag wait.
    for tile in range(pid, total, num_programs):
        step = tile // per_chunk
        chunk = (first_chunk + step) % num_chunks
        local = tile % per_chunk
        pid_m, pid_n = grouped_tile(local, ROWS, N, BLOCK_M, BLOCK_N, GROUP_M)  # inside the chunk
        if WAIT == 1:
            wait_ready(flag_ptr + chunk, ready_value, status_ptr, MAX_SPIN)
        run = True
        if WAIT == 2:
            run = ~behind(tl.atomic_add(flag_ptr + chunk, 0, sem="acquire", scope="sys"), ready_value)
        if run:
            chunk64 = chunk.to(tl.int64)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_mask = rm < ROWS
            n_mask = rn < N
            a_rows = chunk64 * s_a_chunk + row_offsets(rm, a_m_inner, s_am0, s_am1, A_M_SPLIT)
            b_cols = rn.to(tl.int64) * s_bn
            b_cols_up = (rn + glu_offset).to(tl.int64) * s_bn
            # the tile's first row in A's descriptor (TMA): chunk-major rows, or (a [batch, seq-chunk]
            # view of one [batch, seq] activation) batch b's rows of the chunk, a whole tile in one
            # batch (the host checked a_m_inner % BLOCK_M == 0)
            a_row0 = 0
            if TMA:
                a_row0 = chunk * ROWS + pid_m * BLOCK_M
                if A_M_SPLIT:
                    a_row0 = (pid_m * BLOCK_M // a_m_inner) * (num_chunks * a_m_inner) + chunk * a_m_inner \
                        + pid_m * BLOCK_M % a_m_inner
            if FP8:  # the core's scaled main loop, as fp8_matmul runs it (rowwise / blockwise)
                sa_rows = chunk64 * s_sa_chunk + row_offsets(rm, sa_m_inner, s_sam0, s_sam1, SA_M_SPLIT)
                rows_per_scale: tl.constexpr = 128 if BLOCKWISE else 1
                acc, acc_up = gemm_mainloop(
                    a_ptr, b_ptr, a_rows, b_cols, b_cols_up, m_mask, n_mask, K, 1, 0, s_ak, 1, 0, s_bk,
                    False, False, GLU, False, EVEN_K, "ieee", BLOCK_M, BLOCK_N, BLOCK_K,
                    sa_rows=sa_ptr + sa_rows, sb_cols=sb_ptr + (rn // rows_per_scale).to(tl.int64) * s_sbn,
                    a_desc=a_desc, b_desc=b_desc, m0=a_row0, n0=pid_n * BLOCK_N,
                    glu_offset=glu_offset, TMA=TMA, A_KMAJOR=True, B_KMAJOR=B_KMAJOR,
                    sb_up=sb_ptr + ((rn + glu_offset) // rows_per_scale).to(tl.int64) * s_sbn, s_sak=s_sak,
                    s_sbk=s_sbk, SCALING=2 if BLOCKWISE else 1, PROMOTE_K=PROMOTE_K)
            else:
                acc, acc_up = gemm_mainloop(
                    a_ptr, b_ptr, a_rows, b_cols, b_cols_up, m_mask, n_mask, K, 1, 0, s_ak, 1, 0, s_bk,
                    False, False, GLU, UPCAST, EVEN_K, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                    a_desc, b_desc, a_row0, pid_n * BLOCK_N, glu_offset, TMA, True, B_KMAJOR)
            out_mask = m_mask[:, None] & n_mask[None, :]
            x_off = chunk64 * s_x_chunk + row_offsets(rm, x_m_inner, s_xm0, s_xm1, X_M_SPLIT)[:, None] \
                + rn.to(tl.int64)[None, :] * s_xn
            acc = gemm_epilogue(acc, acc_up, rn, n_mask, out_mask, bias_ptr, aux_ptr, x_off, glu_offset, s_xn,
                                HAS_BIAS, STORE_AUX, ACT, GLU, EMULATE)
            if EMULATE:  # the interpreter's bf16 cast truncates (kernels/fp8.py)
                acc = rne_for_store(acc, c_ptr)
            c_off = chunk64 * s_c_chunk + row_offsets(rm, c_m_inner, s_cm0, s_cm1, C_M_SPLIT)[:, None] \
                + rn.to(tl.int64)[None, :] * s_cn
            tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=out_mask)
            if SIGNAL:
                # every thread's stores of this tile happen before the release below
                tl.debug_barrier()
                tl.atomic_add(count_ptr + chunk, 1, sem="release", scope="sys")
            if LOG:
                ticket = tl.atomic_add(log_ptr + total, 1)
                tl.store(log_ptr + tile, ticket)


@triton.jit(do_not_specialize=["chunk"])  # chunk == 1 would become a constexpr int (no .to)
def chunk_reduce_kernel(
    src_ptr, peer_off_ptr, count_ptr, count_off_ptr, out_ptr, acc_ptr, bias_ptr, status_ptr, ready_ptr,
    ROWS, N, num_peers, chunk,
    s_src_chunk, src_m_inner, s_srcm0, s_srcm1, s_srcn,
    o_m_inner, s_om0, s_om1, s_on,
    SRC_M_SPLIT: tl.constexpr, O_M_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, WAIT: tl.constexpr,
    MAX_SPIN: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``out = bias + sum_p src_p[chunk]``, peers in the order given, each read only after its
    counter reached the device word ``*ready_ptr`` (modulo 2^32). Peer-outer loop: the partial of
    the first peer is summed while later peers still compute; the running sum lives in the fp32
    ``acc`` buffer (``EMULATE``: a bf16 ``out`` rounded to nearest even, as a GPU's cast does)."""
    tl.static_assert(WAIT >= 0 and WAIT <= 1, "WAIT: 0 none, 1 spin")
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    total = tl.cdiv(ROWS, BLOCK_M) * num_pid_n
    chunk64 = chunk.to(tl.int64)
    ready_value = tl.load(ready_ptr)
    for p in range(0, num_peers):
        if WAIT == 1:
            wait_ready(count_ptr + tl.load(count_off_ptr + p) + chunk64, ready_value, status_ptr, MAX_SPIN)
        base = tl.load(peer_off_ptr + p) + chunk64 * s_src_chunk
        for tile in range(pid, total, num_programs):
            rm = (tile // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = (tile % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rm < ROWS)[:, None] & (rn < N)[None, :]
            s_off = base + row_offsets(rm, src_m_inner, s_srcm0, s_srcm1, SRC_M_SPLIT)[:, None] \
                + rn.to(tl.int64)[None, :] * s_srcn
            acc_off = rm.to(tl.int64)[:, None] * N + rn.to(tl.int64)[None, :]
            part = tl.load(src_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
            if p > 0:
                part += tl.load(acc_ptr + acc_off, mask=mask, other=0.0)
            if p < num_peers - 1:
                tl.store(acc_ptr + acc_off, part, mask=mask)
            else:
                if HAS_BIAS:
                    part += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
                o_off = row_offsets(rm, o_m_inner, s_om0, s_om1, O_M_SPLIT)[:, None] \
                    + rn.to(tl.int64)[None, :] * s_on
                if EMULATE:
                    part = rne_for_store(part, out_ptr)
                tl.store(out_ptr + o_off, part.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def chunk_view(t: torch.Tensor, dim: int, num_chunks: int) -> torch.Tensor:
    """``t`` (``[rows, F]`` or ``[batch, seq, F]``) split into ``num_chunks`` equal chunks along
    ``dim`` as a chunked view ``[C, rows/C, F]`` / ``[C, batch, seq/C, F]`` (``dim=1``) /
    ``[C, batch/C, seq, F]`` (``dim=0``), without copying."""
    check_tensor("chunk_view: t", t, dims=(2, 3))
    if not isinstance(dim, int) or not 0 <= dim < t.dim() - 1:
        raise ValueError(f"chunk_view: dim must index a row dimension (0..{t.dim() - 2}), got {dim}")
    if not isinstance(num_chunks, int) or num_chunks <= 0 or t.shape[dim] % num_chunks:
        raise ValueError(f"chunk_view: dim {dim} of size {t.shape[dim]} is not divisible into {num_chunks} chunks")
    v = t.unflatten(dim, (num_chunks, t.shape[dim] // num_chunks))
    return v.movedim(dim, 0)


def tiles_per_chunk(rows: int, n: int, config: dict) -> int:
    """Output tiles of one chunk: the value a chunk's completion counter grows by per launch."""
    return cdiv(rows, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"])


def _chunk_rows(t: torch.Tensor) -> RowView:
    """Row addressing of one chunk of a chunked view (all dims between the chunk dim and the last)."""
    return RowView.rows(t[0]) if t.shape[0] else RowView(1, 0, 0, False)


def _check_counters(name, t, num_chunks, device):
    """Flags and counters: contiguous 1-D int32, one entry per chunk, on the operands' device."""
    check_tensor(name, t, dims=(1,), dtypes=(torch.int32,))
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.numel() < num_chunks:
        raise ValueError(f"{name} needs one entry per chunk ({num_chunks}), got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")


def _fp8_operands(a, weight, bias, activation, a_scale, weight_scale, scaling):
    """Check e4m3 ``a`` / ``weight`` and their fp32 scales (:func:`persistent_matmul`); returns the
    operands and ``(a_scale, weight_scale, blockwise)``."""
    check_tensor("weight", weight, dims=(2,), dtypes=(torch.float8_e4m3fn,), kernel_device=True)
    check_same("weight", weight, "a", a)
    check_choice("scaling", scaling, SCALINGS)
    def like(t):  # a bf16 stand-in of t's shape (no copy): linear_operands checks shapes, bias, activation
        return torch.empty((), device=t.device, dtype=torch.bfloat16).expand(t.shape)
    ops = replace(linear_operands(like(a[0]), like(weight), bias, activation=activation, a_name="a[0]"),
                  s_bk=weight.stride(1), s_bn=weight.stride(0))
    kb, blockwise = cdiv(ops.k, FP8_BLOCK), scaling == "blockwise"
    for name, s, shape in (("a_scale", a_scale, a.shape[:-1] + ((kb,) if blockwise else ())),
                           ("weight_scale", weight_scale, (cdiv(ops.n_w, FP8_BLOCK), kb) if blockwise else (ops.n_w,))):
        check_tensor(name, s, dtypes=(torch.float32,))
        check_shape(name, s, shape)
        check_same(name, s, "a", a, dtype=False)
    check_fp8_device(a)
    return ops, (a_scale, weight_scale, blockwise)


def _check_persistent_args(a, weight, bias, activation, first_chunk, wait_mode, wait_flags, signal_counters,
                           ready_value, a_scale, weight_scale, scaling):
    if not isinstance(a, torch.Tensor) or a.dim() not in (3, 4):
        raise ValueError("a must be a chunked view [C, rows, K] or [C, batch, rows, K] (see chunk_view), got "
                         + (f"shape {tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__))
    scales = None
    if a.dtype == torch.float8_e4m3fn:
        ops, scales = _fp8_operands(a, weight, bias, activation, a_scale, weight_scale, scaling)
    elif a_scale is not None or weight_scale is not None:
        raise ValueError(f"a_scale / weight_scale are for float8_e4m3fn operands, got a of dtype {a.dtype}")
    else:
        ops = linear_operands(a[0], weight, bias, activation=activation, a_name="a[0]")
    check_choice("wait_mode", wait_mode, sorted(WAIT_MODES))
    C = a.shape[0]
    if not isinstance(first_chunk, int) or not 0 <= first_chunk < max(C, 1):
        raise ValueError(f"first_chunk must be in [0, {C}), got {first_chunk}")
    if wait_mode != "none":
        if wait_flags is None:
            raise ValueError(f"wait_flags must be an int32 tensor (one flag per chunk) with wait_mode={wait_mode!r}, "
                             "got None")
        _check_counters("wait_flags", wait_flags, C, a.device)
    if signal_counters is not None:
        _check_counters("signal_counters", signal_counters, C, a.device)
    return ops, scales, ready_word(a.device, ready_value)


def _chunked_outputs(a, ops, out, out_dtype, preact_out, tile_log, total):
    """Check (or allocate) the chunked outputs of :func:`persistent_matmul`; returns ``out``."""
    if preact_out is not None:
        check_buffer("preact_out", preact_out, tuple(a.shape[:-1]) + (ops.n_w,), a.device)
    if tile_log is not None:
        check_tensor("tile_log", tile_log, dims=(1,), dtypes=(torch.int32,))
        if not tile_log.is_contiguous() or tile_log.numel() != total + 1 or tile_log.device != a.device:
            raise ValueError(f"tile_log must be a contiguous tensor of {total + 1} entries (tiles + 1) on {a.device}, "
                             f"got shape {tuple(tile_log.shape)} on {tile_log.device}")
    return output_buffer("out", out, tuple(a.shape[:-1]) + (ops.n,), a.device, out_dtype)


def _persistent_tensors(a, weight, out, bias, preact_out, sa, sb, wait_flags, signal_counters, tile_log, ready):
    """The tensor arguments of ``persistent_gemm_kernel`` in order (``out`` for an absent one; ``sa``
    and ``sb`` the scales or ``out``): what a launch and its plan (:data:`_PLANS`) pass."""
    return (a, weight, out, out if bias is None else bias, out if preact_out is None else preact_out, sa, sb,
            out if wait_flags is None else wait_flags, out if signal_counters is None else signal_counters,
            out if tile_log is None else tile_log, status_word(a.device), ready)


def _launch_persistent(a, weight, out, ops, cfg, scales, b_kmajor, *, first_chunk, wait_mode, wait_flags, ready,
                       signal_counters, preact_out, tile_log, num_programs, max_spin, total, plan_key=None):
    a_r, c_r = _chunk_rows(a), _chunk_rows(out)
    x_r = _chunk_rows(preact_out) if preact_out is not None else RowView(1, 0, 0, False)
    bias, dummy, emulate = ops.bias, out, interpreting() and scales is not None
    sa, sb, blockwise = scales or (dummy, dummy, False)
    sa_r = _chunk_rows(sa if blockwise or scales is None else sa.unsqueeze(-1))  # rowwise: a row view of a's rows
    args = (
        *_persistent_tensors(a, weight, out, bias.float() if emulate and bias is not None else bias, preact_out, sa,
                             sb, wait_flags, signal_counters, tile_log, ready),
        int(torch.Size(a.shape[1:-1]).numel()), ops.n, ops.k, a.shape[0], first_chunk,
        a.stride(0), *a_r.args(), a.stride(-1), ops.s_bk, ops.s_bn, ops.n if ops.glu else 0,
        out.stride(0), *c_r.args(), out.stride(-1),
        preact_out.stride(0) if preact_out is not None else 0, *x_r.args(),
        preact_out.stride(-1) if preact_out is not None else 0,
        sa.stride(0), *sa_r.args(), sa.stride(-1) if blockwise else 0, sb.stride(0), sb.stride(-1),
    )
    meta = dict(
        A_M_SPLIT=a_r.split, C_M_SPLIT=c_r.split, X_M_SPLIT=x_r.split, SA_M_SPLIT=sa_r.split,
        HAS_BIAS=bias is not None, STORE_AUX=preact_out is not None, ACT=ops.act, GLU=ops.glu,
        UPCAST=needs_upcast(a.dtype), EVEN_K=ops.k % cfg["BLOCK_K"] == 0, INPUT_PRECISION=input_precision(a.dtype),
        FP8=scales is not None, BLOCKWISE=blockwise, EMULATE=emulate, PROMOTE_K=FP8_PROMOTE_K,
        WAIT=WAIT_MODES[wait_mode], SIGNAL=signal_counters is not None, LOG=tile_log is not None,
        MAX_SPIN=spin_bound(max_spin), **cfg,
    )
    meta.update(TMA=b_kmajor is not None, B_KMAJOR=bool(b_kmajor))
    if b_kmajor is not None and not interpreting():
        ensure_scratch_allocator()
    grid = (min(num_programs, total),)
    with on_device(a.device):
        plan = launch_planned(_PLANS, plan_key, persistent_gemm_kernel, grid, args, meta)
    if plan is not None:
        plan.extra = (out.shape, out.dtype, b_kmajor is not None)
    note_launch("persistent_matmul", None, cfg, b_kmajor is not None)


#: the launch plans of :func:`persistent_matmul` and :func:`chunk_reduce`, keyed on their calls
_PLANS = PlanCache()


def _persistent_key(a, weight, bias, first_chunk, out, activation, wait_flags, wait_mode, ready_value,
                    signal_counters, preact_out, tile_log, num_programs, config, max_spin, a_scale, weight_scale,
                    scaling, out_dtype):
    """:func:`persistent_matmul`'s plan key: its call, each tensor described (a ready value by its
    value or its word's description, the config by its items, the dot precision of fp32 operands
    as torch's setting has it now); None where no plan is kept (the interpreter, odd arguments)."""
    if (interpreting() or not isinstance(a, torch.Tensor) or not exact_ints(first_chunk, num_programs, max_spin)
            or not (config is None or type(config) is dict)):
        return None
    ready = ready_value if type(ready_value) is int else describe(ready_value)
    return (describe(a), describe(weight), describe(bias), first_chunk, describe(out), activation,
            describe(wait_flags), wait_mode, ready, describe(signal_counters), describe(preact_out),
            describe(tile_log), num_programs, config and tuple(config.items()), max_spin, describe(a_scale),
            describe(weight_scale), scaling, out_dtype, input_precision(a.dtype))


def _planned_persistent(plan, a, weight, bias, out, wait_flags, ready_value, signal_counters, preact_out,
                        tile_log, a_scale, weight_scale):
    """:func:`persistent_matmul` through ``plan`` (its key's checks passed when it was built): ``out``
    allocated as that launch had it, the tensors in their slots; None, having launched nothing,
    where the plan does not apply now."""
    if out is None:
        out = torch.empty(plan.extra[0], dtype=plan.extra[1], device=a.device)
    ready = ready_word(a.device, ready_value) if type(ready_value) is int else ready_value
    sa, sb = (out, out) if a_scale is None else (a_scale, weight_scale)
    if plan.extra[2]:
        ensure_scratch_allocator()
    if plan.launch(_persistent_tensors(a, weight, out, bias, preact_out, sa, sb, wait_flags, signal_counters,
                                       tile_log, ready)):
        return out
    return None


def persistent_matmul(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, first_chunk: int = 0,
    out: torch.Tensor | None = None, activation: str = "none", wait_flags: torch.Tensor | None = None,
    wait_mode: str = "spin", ready_value: int | torch.Tensor = 1, signal_counters: torch.Tensor | None = None,
    preact_out: torch.Tensor | None = None, tile_log: torch.Tensor | None = None, num_programs: int | None = None,
    config: dict | None = None, max_spin: int | None = None, check_waits: bool = True,
    a_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None, scaling: str = "rowwise",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[c] = act(a[c] @ weight.T + bias)`` for every chunk ``c``, in one persistent launch.

    a:        chunked view ``[C, rows, K]`` or ``[C, batch, rows, K]`` (any strides; see
              :func:`chunk_view`). ``C`` is the number of chunks.
    weight:   ``[N, K]`` (``nn.Linear`` layout, any strides); ``[2F, K]`` gate|up for gated activations.
    out:      chunked view with the same leading dims and ``N`` (``F``) features, written in
              place; allocated contiguous (``[C, ..., N]``) when omitted, of ``out_dtype``
              (default ``a``'s dtype; bf16 for fp8 operands).
    a_scale, weight_scale, scaling: for e4m3 ``a`` and ``weight``: fp32 scales as ``fp8_matmul``
              takes them, ``"rowwise"`` ``a.shape[:-1]`` and ``[weight.shape[0]]``, ``"blockwise"``
              ``a.shape[:-1] + (kb,)`` (1x128 tiles) and ``[ceil(weight.shape[0] / 128), kb]``
              (128x128 blocks), ``kb = ceil(K/128)``; the bias and activation follow the scales.
    first_chunk: tiles are processed chunk by chunk starting here: ``first_chunk``,
              ``first_chunk + 1``, ... (mod C). Put the local chunk first for an all-gather,
              the chunk the first peer needs first for a reduce-scatter.
    wait_flags: int32 ``[C]``; before a program reads chunk ``c`` it waits (``"spin"``) until
              ``wait_flags[c]`` reached ``ready_value`` (compared modulo 2^32: a counter may wrap),
              or (``"skip"``, a test mode) skips tiles whose flag is not ready, leaving them unwritten. ``ready_value``: an int, or a 1-element
              int32 tensor on ``a``'s device read by the kernel when it starts (a device-resident
              epoch: the launch's arguments are then the same call after call, CUDA-graph safe).
    signal_counters: int32 ``[C]``; after storing a tile of chunk ``c`` its program atomically
              adds 1 to ``signal_counters[c]`` (release). A launch adds
              :func:`tiles_per_chunk` to every counter.
    preact_out: optional chunked view like ``out`` with ``weight.shape[0]`` features: receives the
              pre-activation values (for an activation's backward).
    tile_log: optional int32 ``[C * tiles_per_chunk + 1]`` initialised by the caller (e.g. -1,
              with the last entry 0): tile ``t`` (chunk-order index) receives the global ticket
              at which it was computed; the last entry counts computed tiles.
    num_programs: size of the persistent grid (default: one per SM; 3 under the interpreter).
    config:   tile configuration (``BLOCK_M/N/K``, ``GROUP_M``, ``num_warps``, ``num_stages``);
              default :func:`gpu_config` (the interpreter always uses a small fixed one).
    max_spin: bound of each flag spin in reads (default ~a minute on GPU); a wait that runs out
              is counted and raises :class:`WaitTimeout` (:func:`check_wait_timeouts`).
    check_waits: check for timed-out waits after a ``"spin"`` launch (default). An op that
              launches several waiting kernels passes False and checks once at its end.
    """
    key = _persistent_key(a, weight, bias, first_chunk, out, activation, wait_flags, wait_mode, ready_value,
                          signal_counters, preact_out, tile_log, num_programs, config, max_spin, a_scale, weight_scale,
                          scaling, out_dtype)
    plan = _PLANS.find(key) if key is not None else None
    done = plan and _planned_persistent(plan, a, weight, bias, out, wait_flags, ready_value, signal_counters,
                                        preact_out, tile_log, a_scale, weight_scale)
    if done is not None:
        if wait_mode == "spin" and check_waits:
            check_wait_timeouts(a.device, "persistent_matmul")
        return done
    ops, scales, ready = _check_persistent_args(a, weight, bias, activation, first_chunk, wait_mode, wait_flags,
                                                signal_counters, ready_value, a_scale, weight_scale, scaling)
    if config is not None and not interpreting():
        check_config(config, a, ops, preact_out is not None)
    cfg = kernel_config(config, ops.n, a.dtype, ops.glu)
    if scales is not None and cfg["BLOCK_K"] != FP8_BLOCK:
        raise ValueError(f"config['BLOCK_K'] must be {FP8_BLOCK} for fp8 operands (one scale block per step), "
                         f"got {cfg['BLOCK_K']}")
    check_out_dtype("out_dtype", out_dtype)
    C, rows = a.shape[0], int(torch.Size(a.shape[1:-1]).numel())
    total = C * tiles_per_chunk(rows, ops.n, cfg)
    out = _chunked_outputs(a, ops, out, out_dtype or (torch.bfloat16 if scales else a.dtype), preact_out, tile_log,
                           total)
    num_programs = default_num_programs(a.device) if num_programs is None else num_programs
    check_int("num_programs", num_programs, min_value=1)
    if rows == 0 or ops.n == 0 or C == 0:
        return out
    if ops.k == 0:
        raise ValueError("a must have K > 0 features (an empty contraction has nothing to overlap), got K=0")
    b_kmajor = tma_weight_major(a, weight, ops, wait_mode, scales is not None, cfg, preact_out is not None)
    _launch_persistent(a, weight, out, ops, cfg, scales, b_kmajor, first_chunk=first_chunk, wait_mode=wait_mode,
                       wait_flags=wait_flags, ready=ready, signal_counters=signal_counters,
                       preact_out=preact_out, tile_log=tile_log, num_programs=num_programs, max_spin=max_spin,
                       total=total, plan_key=key if ops.bias is bias else None)
    if wait_mode == "spin" and check_waits:
        check_wait_timeouts(a.device, "persistent_matmul")
    return out


def _check_reduce_args(src, peer_offsets, chunk, out, bias, counters, counter_offsets):
    if not isinstance(src, torch.Tensor) or src.dim() not in (3, 4):
        raise ValueError("src must be a chunked view [C, rows, N] or [C, batch, rows, N], got "
                         + (f"shape {tuple(src.shape)}" if isinstance(src, torch.Tensor) else type(src).__name__))
    C, N = src.shape[0], src.shape[-1]
    if not isinstance(chunk, int) or not 0 <= chunk < C:
        raise ValueError(f"chunk must be in [0, {C}), got {chunk}")
    check_float_tensor("src[0]", src[0], dims=(2, 3))
    check_tensor("peer_offsets", peer_offsets, dims=(1,), dtypes=(torch.int64,))
    if peer_offsets.numel() == 0:
        raise ValueError("peer_offsets must hold one offset per peer, got an empty tensor")
    check_buffer("out", out, tuple(src.shape[1:]), src.device)
    if bias is not None:
        check_tensor("bias", bias, dims=(1,))
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if counters is not None:
        _check_counters("counters", counters, C, src.device)
        check_tensor("counter_offsets", counter_offsets, dims=(1,), dtypes=(torch.int64,))
        if counter_offsets.shape != peer_offsets.shape:
            raise ValueError(f"counter_offsets must have shape {tuple(peer_offsets.shape)} (one per peer), got "
                             f"{tuple(counter_offsets.shape)}")


def chunk_reduce(
    src: torch.Tensor, peer_offsets: torch.Tensor, chunk: int, *, out: torch.Tensor, bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, counter_offsets: torch.Tensor | None = None,
    ready_value: int | torch.Tensor = 1,
    workspace: torch.Tensor | None = None, num_programs: int | None = None, block: tuple[int, int] = (32, 128),
    max_spin: int | None = None, check_waits: bool = True,
) -> torch.Tensor:
    """``out = bias + sum_p partial_p[chunk]`` summed in fp32, peers in the given order.

    src:          chunked view ``[C, rows, N]`` / ``[C, batch, rows, N]`` of *this* process's
                  partials buffer; peer ``p``'s partials live at the same layout ``peer_offsets[p]``
                  elements away (int64 ``[P]``; 0 is this buffer). With symmetric memory the
                  offsets are ``(peer_ptr - local_ptr) / element_size``; in the single-GPU
                  emulation and in tests they point into one local buffer.
    out:          ``[rows, N]`` or ``[batch, rows, N]`` (any strides), written.
    counters:     int32 completion counters of this process (one per chunk), with
                  ``counter_offsets`` (int64 ``[P]``, elements) locating each peer's; peer ``p``'s
                  partial is read after its ``counters[chunk]`` reached ``ready_value`` (an int or
                  a device word, as in :func:`persistent_matmul`). ``None``: no waiting (the
                  partials are known complete).
    workspace:    fp32 ``[rows * N]`` running sum (allocated when omitted); ``check_waits``: as in
                  :func:`persistent_matmul`.
    """
    key = None
    if not interpreting() and isinstance(src, torch.Tensor) and exact_ints(chunk, num_programs, max_spin):
        key = ("reduce", describe(src), describe(peer_offsets), chunk, describe(out), describe(bias),
               describe(counters), describe(counter_offsets), ready_value if type(ready_value) is int else
               describe(ready_value), describe(workspace), num_programs, block, max_spin)
        plan = _PLANS.find(key)
        if plan is not None and _planned_reduce(plan, src, peer_offsets, out, bias, counters, counter_offsets,
                                                ready_value, workspace):
            if counters is not None and check_waits:
                check_wait_timeouts(src.device, "chunk_reduce")
            return out
    _check_reduce_args(src, peer_offsets, chunk, out, bias, counters, counter_offsets)
    ready = ready_word(src.device, ready_value)
    rows, N = int(torch.Size(src.shape[1:-1]).numel()), src.shape[-1]
    if workspace is None:
        workspace = torch.empty(max(rows * N, 1), device=src.device, dtype=torch.float32)
    elif workspace.dtype != torch.float32 or workspace.numel() < rows * N or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous fp32 tensor of at least {rows * N} elements")
    if rows == 0 or N == 0:
        return out
    bm, bn = (16, 16) if interpreting() else block
    total = cdiv(rows, bm) * cdiv(N, bn)
    if num_programs is None:
        num_programs = total if src.device.type == "cuda" else INTERPRETER_PROGRAMS
    s_r, o_r = _chunk_rows(src), RowView.rows(out)
    wait = counters is not None
    tensors = _reduce_tensors(src, peer_offsets, out, bias, counters, counter_offsets, ready, workspace)
    args = (*tensors, rows, N, peer_offsets.numel(), chunk, src.stride(0), *s_r.args(), src.stride(-1), *o_r.args(),
            out.stride(-1))
    meta = dict(SRC_M_SPLIT=s_r.split, O_M_SPLIT=o_r.split, HAS_BIAS=bias is not None, WAIT=int(wait),
                MAX_SPIN=spin_bound(max_spin), EMULATE=interpreting(), BLOCK_M=bm, BLOCK_N=bn)
    if src.device.type == "cuda":
        meta["num_warps"] = 4
    grid = (max(1, min(num_programs, total)),)
    with on_device(src.device):
        plan = launch_planned(_PLANS, key, chunk_reduce_kernel, grid, args, meta)
    if plan is not None:
        plan.extra = workspace.numel()
    if wait and check_waits:
        check_wait_timeouts(src.device, "chunk_reduce")
    return out


def _reduce_tensors(src, peer_offsets, out, bias, counters, counter_offsets, ready, workspace):
    """The tensor arguments of ``chunk_reduce_kernel`` in order (``peer_offsets`` for absent
    counters, ``workspace`` for an absent bias; offset tables on ``src``'s device, the bias
    contiguous: copies where they were not, made by a plan's launch too)."""
    offsets = peer_offsets.to(src.device)
    wait = counters is not None
    return (src, offsets, counters if wait else offsets, counter_offsets.to(src.device) if wait else offsets, out,
            workspace, bias.contiguous() if bias is not None else workspace, status_word(src.device), ready)


def _planned_reduce(plan, src, peer_offsets, out, bias, counters, counter_offsets, ready_value, workspace) -> bool:
    """:func:`chunk_reduce` through ``plan`` (the running sum allocated as at its build when not
    given); False, having launched nothing, where the plan does not apply now."""
    if workspace is None:
        workspace = torch.empty(plan.extra, device=src.device, dtype=torch.float32)
    ready = ready_word(src.device, ready_value) if type(ready_value) is int else ready_value
    return plan.launch(_reduce_tensors(src, peer_offsets, out, bias, counters, counter_offsets, ready, workspace))


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def persistent_matmul_reference(a, weight, bias=None, *, activation="none", compute_dtype=torch.float64):
    """What :func:`persistent_matmul` computes for a chunked view ``a`` (all flags ready)."""
    return matmul_reference(a, weight, bias, activation=activation, compute_dtype=compute_dtype)
