"""Launch configuration of the flash-attention kernels (:mod:`.flash_attention`,
:mod:`.flash_attention_bwd`): the compile-time flags of a launch (:func:`kernel_flags`), the
fixed interpreter tiles, the GPU config lists with their prune rule (shared-memory and register
estimates checked against ptxas by ``python -m benchmarks compile``), the one-axis grid and the
launch itself (:func:`launch_attention_kernel`). Kinds: "fwd", "bwd" (the backward's one launch
of dK/dV and dQ programs) and "bwd_atomic" (the one-pass backward: the same kernel with
``DQ_ATOMIC``, dK/dV programs only, tuned by the backward's autotuner over configs of its own).
Every kind's ``BLOCK_M`` is the rows a program owns (query rows; keys for dK/dV programs), the M
dimension of its products, and ``BLOCK_N`` the rows it streams.
"""
from __future__ import annotations

import functools

import torch
import triton

from .launch import launch_kernel
from .runtime import (autotuned, cdiv, device_capability, input_precision, interpreting, needs_upcast,
                      next_power_of_2, on_device, shared_memory_limit)

__all__ = [
    "BWD_INTERPRETER_CONFIG", "FP32_BWD_TILE", "FP32_TILE", "INTERPRETER_CONFIG", "MAX_GRID_X", "attention_grid",
    "gpu_configs", "kernel_flags", "launch_attention_kernel", "launch_smem_estimate", "register_estimate", "smem_estimate", "uses_wgmma",
]


# --------------------------------------------------------------------------------------------
# Configurations: fixed small blocks under the interpreter, autotuned pruned configs on GPU
# --------------------------------------------------------------------------------------------
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)
#: the backward's interpreter tiles: programs own 32 rows and stream 32, masked blocks in halves
#: of 16 (so the masked and unmasked steps differ as on a GPU, where 128 rows stream 32 or 64)
BWD_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32)
#: which outputs a tuning run of each kernel kind writes (restored between configs: the
#: accumulate modes read them, and the one-pass backward adds into dQ, so tuning runs must not
#: compound them)
_RESTORE = {"fwd": ["o_ptr", "lse_ptr"], "bwd": ["dq_ptr", "dk_ptr", "dv_ptr"],
            "bwd_atomic": ["dq_ptr", "dk_ptr", "dv_ptr"]}
#: the autotuner (kernel) of each kind
_TUNER_KIND = {"fwd": "fwd", "bwd": "bwd", "bwd_atomic": "bwd"}


#: per kernel kind: (BLOCK_M, BLOCK_N, num_stages, num_warps), BLOCK_M the rows a program owns,
#: BLOCK_N the rows it streams. Measured with ``python -m benchmarks compile --family flash``
#: (ptxas, sm_90 and sm_80): the prune rule keeps, per launch, those that compile without register
#: spills in bf16/fp16. The last entry, ``FP32_TILE`` (forward) or ``FP32_BWD_TILE``, is the only
#: one fp32 "ieee" launches keep (their dots run on FMA units).
FP32_TILE = (32, 16)
FP32_BWD_TILE = (32, 16)
_GPU_CONFIGS = {
    "fwd": [(128, 64, 3, 8), (64, 128, 3, 8), (64, 64, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4), (32, 32, 3, 4),
            (*FP32_TILE, 2, 4)],
    # 128 owned rows on 8 warps (two warpgroups of wgmma, 64 rows each; dK and dV both fp32
    # accumulators): streamed 64 rows at head_dim 64, 32 or 16 at 128; 64 owned rows for q/k and v
    # wider than 128 + 128 (MLA's 256 / 128 padded), and 64x16 for a softcap at head_dim 128 (the
    # only tile there without spills on Triton 3.6 and 3.9); 32x16 on 8 warps (mma.sync) where no
    # 64-row tile fits a 16-bit launch (:data:`_BWD_LAST_RESORT`: head_dim 256 with a softcap,
    # Gemma-2, where 64x16 spilled 252 B and the fp32 tile on 4 warps 168 B; 8 warps 227 registers)
    "bwd": [(128, 64, 2, 8), (128, 32, 3, 8), (128, 32, 2, 8), (128, 16, 3, 8), (128, 16, 2, 8), (64, 32, 2, 8),
            (64, 16, 2, 8), (32, 16, 2, 8), (*FP32_BWD_TILE, 2, 4)],
    # the one-pass backward: dK/dV plus the fp32 dQ part of each streamed block (its fp32 tile on 8
    # warps: on 4 its FMA dQ part spilled 1.6 KB on sm_80 at head_dim 128)
    "bwd_atomic": [(128, 32, 2, 8), (128, 16, 2, 8), (64, 16, 2, 8), (*FP32_BWD_TILE, 2, 8)],
}
#: the backward's 16-bit tile kept only where no larger one is (a small tile would lose to any of them)
_BWD_LAST_RESORT = (32, 16, 2, 8)
#: live fp32 score tiles ([BLOCK_M, BLOCK_N]) and the register budget (32-bit registers per
#: thread for the tiles of :func:`register_estimate`) each kind compiles within without spills
_SCORE_TILES = {"fwd": 2, "bwd": 4, "bwd_atomic": 4}
#: extra live fp32 score tiles of a softcapped launch: the backward recomputes tanh in every loop
#: (``t``, ``e = exp2(-2|t|)``, the quotient, ``1 - tanh^2`` kept for dS, their temporaries).
#: Fitted on sm_90 with Triton 3.6 and 3.9 (the rule must hold on both): at one tile, head_dim 128
#: kept 128x16 and 64x32, which spilled 4 / 28 B on 3.6 with the window, 64x32 68 B on 3.9 not
#: causal, 128x32x64 at three stages 4-24 B; five leave 64x16 at head_dim 128 (214-251 registers)
_SOFTCAP_TILES = {"fwd": 0, "bwd": 5, "bwd_atomic": 5}
#: registers of a window's left edge (``LEFT``) in the backward: the row bounds ``k_hi`` / ``q_lo``
#: and the window's extra masked block range, live through the loops. Fitted (Triton 3.6 on sm_90;
#: 3.9 did not spill): the tiles at the budget spilled with it, 128x64x64 8 B (gpt-oss, window 128)
#: and 128x16x128 at three stages 36 B (window 4096), while 128x64x64 without a window took 252
_WINDOW_REGISTERS = {"fwd": 0, "bwd": 8, "bwd_atomic": 8}
_REGISTER_BUDGET = {"fwd": 160, "bwd": 192, "bwd_atomic": 192}
#: the backward's budget with mma.sync (sm_80: its operands pass through registers)
_MMA_SYNC_BWD_BUDGET = 168
#: the backward's registers per pipeline stage beyond two (fitted, Triton 3.9 on sm_90: 128x16 at
#: head_dim 128 compiles at three stages, softcapped it spills 28 B; 128x32 spills 36 B at three)
_BWD_STAGE_REGISTERS = 32


def gpu_configs(kind: str):
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_stages=stages, num_warps=warps)
            for bm, bn, stages, warps in _GPU_CONFIGS[kind]]


def _tuner_configs(tuner_kind: str):
    """The configs of the autotuner ``tuner_kind``: those of every kind it launches (the
    backward's: "bwd" then the one-pass "bwd_atomic" entries it lacks), each once."""
    seen = []
    for kind in _RESTORE:
        if _TUNER_KIND[kind] == tuner_kind:
            seen += [c for c in _GPU_CONFIGS[kind] if c not in seen]
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_stages=stages, num_warps=warps)
            for bm, bn, stages, warps in seen]


def register_estimate(kind: str, block_m: int, block_n: int, block_d: int, num_warps: int, elem_size: int,
                      block_dv: int | None = None, softcap: bool = False, num_stages: int = 2,
                      window: bool = False) -> int:
    """32-bit registers per thread of the live tiles of one program. Forward: the fp32 O
    ``[BLOCK_M, BLOCK_DV]``, the resident Q and the fp32 score tiles ``[BLOCK_M, BLOCK_N]``.
    Backward (a dK/dV program, which bounds its dQ programs): the fp32 dK and dV (K and V stay in
    shared memory), the score tiles (held by ``BLOCK_M / 16`` warps: 64 rows on 8 warps hold each
    twice), :data:`_BWD_STAGE_REGISTERS` per stage beyond two; the one-pass "bwd_atomic" adds its
    fp32 dQ part ``[BLOCK_D, BLOCK_N]``. The prune rule keeps configs within
    ``_REGISTER_BUDGET``. ``block_dv``: v's padded head dim (default ``block_d``); ``softcap``
    adds the softcap's score tiles (:data:`_SOFTCAP_TILES`), ``window`` (a left window edge) the
    window's registers (:data:`_WINDOW_REGISTERS`)."""
    bdv = block_d if block_dv is None else block_dv
    score_tiles = _SCORE_TILES[kind] + (_SOFTCAP_TILES[kind] if softcap else 0)
    if kind == "fwd":
        words = block_m * (bdv + block_d * elem_size / 4) + score_tiles * block_m * block_n
        return int(words // (32 * num_warps))
    acc = block_m * (block_d + bdv) + (block_d * block_n if kind == "bwd_atomic" else 0)
    scores = score_tiles * block_m * block_n / min(num_warps, max(block_m // 16, 1))
    return int(acc // (32 * num_warps) + scores // 32 + _BWD_STAGE_REGISTERS * max(num_stages - 2, 0)
               + (_WINDOW_REGISTERS[kind] if window else 0))


def uses_wgmma(kind: str, block_m: int, block_n: int, capability: tuple, precision: str) -> bool:
    """Whether Triton compiles the kernel's dots to Hopper wgmma (operands from shared memory):
    sm_90 with a 64-row MMA tile (BLOCK_M, the rows a program owns) and tensor-core precision."""
    return capability[0] == 9 and block_m >= 64 and precision != "ieee_fp32"


def smem_estimate(kind: str, cfg, block_d: int, elem_size: int, capability: tuple, precision: str = "",
                  block_dv: int | None = None, accumulate: bool = False) -> int:
    """Shared memory (bytes) of one program as Triton 3.9 allocates it (checked against the
    compiler by ``python -m benchmarks compile``). The forward: ``num_stages`` (wgmma) or
    ``num_stages - 1`` buffers of the streamed K and V tiles plus the resident Q and the fitted
    layout-conversion buffers (mma.sync, fp32 "ieee" FMA dots). The backward: see
    :func:`_bwd_smem_estimate`. ``precision``: "" (16-bit operands), "ieee_fp32" or "tf32" (fp32
    operands, FMA or tensor-core dots). ``block_dv``: v's padded head dim (default ``block_d``);
    ``accumulate``: the backward's accumulate mode."""
    bm, bn, stages, e = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_stages, elem_size
    bdv = block_d if block_dv is None else block_dv
    if kind != "fwd":
        est = _bwd_smem_estimate(kind, bm, bn, stages, block_d, bdv, e, capability, precision)
        # accumulate mode converts the fp32 dV it reads back into the accumulator's layout; fitted:
        # with 64 owned rows that conversion fits in the buffers counted already (64x16x128 on sm_80)
        return max(est, bm * (block_d + bdv) * e + bm * bdv * 2) if accumulate and bm >= 128 else est
    pair = bn * (block_d + bdv) * e
    tile = bm * block_d * e  # the resident Q
    if uses_wgmma(kind, bm, bn, capability, precision):
        return stages * pair + tile
    base = (stages - 1) * pair
    if precision == "ieee_fp32":
        return base + tile + bm * bn * e
    return base + tile + (bm * bn * e if bm < block_d else 0)


def _bwd_smem_estimate(kind, bm, bn, stages, bd, bdv, e, capability, precision) -> int:
    """The backward's shared memory, a dK/dV program's (larger than a dQ program's, which has no
    lse / delta rows): the resident K and V, the streamed Q and dO tiles (``num_stages`` buffers
    with wgmma, one fewer otherwise) and ``num_stages - 1`` buffers of their lse and delta rows,
    plus layout-conversion buffers fitted to Triton 3.9's figures (sm_90 and sm_80): a score tile
    with fp32 FMA dots, part of Q with TF32 mma.sync, a score tile for 64 owned rows at head_dim
    128+ with mma.sync; the one-pass "bwd_atomic" adds its fp32 dQ part (converted for coalesced
    atomics) and, where its dot reads K transposed from a copy (``K^T dS^T`` on mma.sync, TF32),
    that copy."""
    res, pair, rows = bm * (bd + bdv) * e, bn * (bd + bdv) * e, (stages - 1) * 2 * bn * 4
    atomic = kind == "bwd_atomic"
    if uses_wgmma(kind, bm, bn, capability, precision):
        return res + stages * pair + rows + (bm * bd * e if atomic and precision else bd * bn * 4 if atomic else 0)
    base = res + (stages - 1) * pair + rows
    if precision == "ieee_fp32":
        return base + bm * bn * e + (max(bd - (64 if capability[0] >= 9 else 32), 0) * bn * 4 if atomic else 0)
    if precision == "tf32":
        return base + bm * bd * 2 + (bm * bd * e if atomic else 0)
    atomic_part = (bm * bd * e if bm >= 64 else 0) + bd * bn * 4 if atomic else 0  # K^T copy where dQ^T is formed
    return base + (bm * bn * e if bm < 128 and bd >= 128 else 0) + atomic_part


def launch_smem_estimate(kind: str, cfg, named_args, **kwargs) -> int:
    """:func:`smem_estimate` of ``cfg`` for an autotuned launch with ``named_args`` (the prune
    rule's figure; the compile check compares it with the compiler's)."""
    q = named_args["q_ptr"]
    kind = _launch_kind(kind, kwargs)
    precision = ("" if q.element_size() != 4 else
                 "ieee_fp32" if kwargs.get("INPUT_PRECISION") == "ieee" else "tf32")
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    bdv = kwargs.get("BLOCK_DV", named_args.get("BLOCK_DV", bd))
    return smem_estimate(kind, cfg, bd, q.element_size(), device_capability(q.device.index or 0),
                         precision, bdv, bool(kwargs.get("ACCUM")))


def _launch_kind(kind: str, kwargs) -> str:
    """The kind a launch of the ``kind`` autotuner runs: the backward with ``DQ_ATOMIC`` is the
    one-pass "bwd_atomic"."""
    return "bwd_atomic" if kind == "bwd" and kwargs.get("DQ_ATOMIC") else kind


def _measured_spill(kind: str, cfg, bd: int, bdv: int, elem: int, capability: tuple, kwargs) -> bool:
    """Configs that spill although :func:`register_estimate` fits them (measured, ``python -m
    benchmarks compile``)."""
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    if kind == "fwd":
        if capability[0] < 9 and kwargs.get("SEGMENTED") and not kwargs.get("RIGHT"):
            # mma.sync over packed documents without a causal mask: 64x32 at four stages spilled 4 B (d 64)
            return (bm, bn, cfg.num_stages) == (64, 32, 4)
        # with the e4m3 output at d_v 256 this tile spills 4 B (sm_90)
        return bool(kwargs.get("FP8_OUT")) and bdv > 128 and (bm, bn, cfg.num_stages) == (32, 32, 3)
    if capability[0] < 9:  # mma.sync: the one-pass 64-row and 32-wide tiles spilled 8-228 B
        return kind == "bwd_atomic" and (bm < 128 or bn > 16) and (bm, bn) != FP32_BWD_TILE
    if bd + bdv == 256 and (bm, bn) == (128, 32):  # head_dim 128, not causal: spilled 32 B (sm_90)
        return not kwargs.get("RIGHT")
    # at three stages, accumulate mode (the ring's fp32 sums) and packed documents (their segment
    # bounds): 128x16 spilled 8 B (accumulate, Triton 3.9) and 52 B (documents, causal, Triton 3.6)
    # at head_dim 128 (sm_90)
    return bool(kwargs.get("ACCUM") or kwargs.get("SEGMENTED")) and cfg.num_stages > 2 and bd + bdv >= 256


def _fp32_tile_only(kind: str, elem: int, kwargs) -> bool:
    """Whether a launch keeps only the fp32 tile: fp32 "ieee" dots (FMA units) and the backward's
    fp32 operands with TF32 dots too (measured, sm_90: its 128-row tiles spilled 288-1048 B at
    head_dim 128 and up to 200 B at 64; the 32x16 tile on mma.sync none)."""
    return elem == 4 and (kind != "fwd" or kwargs.get("INPUT_PRECISION") == "ieee")


def _prune(tuner_kind):
    def prune(configs, named_args, **kwargs):
        """Keep the configs of the launch's kind; drop those whose tiles overflow shared memory
        or the register budget, or are far larger than the sequence (a 128-row tile on a
        40-row problem only wastes work)."""
        kind = _launch_kind(tuner_kind, kwargs)
        own = set(_GPU_CONFIGS[kind])
        configs = [c for c in configs
                   if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps) in own]
        q = named_args["q_ptr"]
        bd, elem = kwargs.get("BLOCK_D", named_args.get("BLOCK_D")), q.element_size()
        bdv = kwargs.get("BLOCK_DV", named_args.get("BLOCK_DV", bd))
        limit, capability = shared_memory_limit(q.device.index or 0), device_capability(q.device.index or 0)
        # the lengths each block runs along: the forward's query rows own BLOCK_M and stream BLOCK_N keys;
        # the backward's programs own BLOCK_M rows of either and stream BLOCK_N of the other
        own_len = named_args["SQ"] if kind == "fwd" else max(named_args["SQ"], named_args["SK"])
        stream_len = named_args["SK"] if kind == "fwd" else max(named_args["SQ"], named_args["SK"])
        fp32_tile = _GPU_CONFIGS[kind][-1]  # (BLOCK_M, BLOCK_N, stages, warps)
        fp32_only = _fp32_tile_only(kind, elem, kwargs)
        kept, last_resort = [], []
        for cfg in configs:
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            tile = (bm, bn, cfg.num_stages, cfg.num_warps)
            if launch_smem_estimate(kind, cfg, named_args, **kwargs) > limit:
                continue
            budget = _MMA_SYNC_BWD_BUDGET if kind != "fwd" and capability[0] < 9 else _REGISTER_BUDGET[kind]
            if register_estimate(kind, bm, bn, bd, cfg.num_warps, elem, bdv, bool(kwargs.get("SOFTCAP")),
                                 cfg.num_stages, bool(kwargs.get("LEFT"))) > budget:
                continue
            if _measured_spill(kind, cfg, bd, bdv, elem, capability, kwargs):
                continue
            if fp32_only != (tile == fp32_tile):
                continue
            if bm > 2 * next_power_of_2(own_len) and bm > 32:
                continue
            if bn > 2 * next_power_of_2(stream_len) and bn > 32:
                continue
            (last_resort if kind == "bwd" and tile == _BWD_LAST_RESORT else kept).append(cfg)
        if kept or last_resort:
            return kept or last_resort
        # nothing fits: the smallest tile (for fp32 operands the fp32 tile, whatever else is as small)
        fallback = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps)
                    == fp32_tile] if fp32_only else []
        return [min(fallback or configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]

    return prune


@functools.lru_cache(maxsize=None)
def _tuned(kernel, tuner_kind: str):
    return autotuned(
        kernel, configs=_tuner_configs(tuner_kind),
        key=["SQ", "SK", "HEAD_DIM", "HEAD_DIM_V", "RIGHT", "LEFT", "SOFTCAP", "GROUP", "SEGMENTED",
             "INPUT_PRECISION", "ACCUM"]  # fp32 ieee and the accumulate mode prune differently
        + (["DQ_ATOMIC", "TMA"] if tuner_kind == "bwd" else [])
        + (["FP8_OUT"] if tuner_kind == "fwd" else []),  # the e4m3 output's epilogue: its own registers
        prune=_prune(tuner_kind), restore_value=_RESTORE[tuner_kind],
    )


#: the smallest owned block of each kind's configs (its largest grid)
_SMALLEST_BLOCK = {kind: min(c[0] for c in cfgs) for kind, cfgs in _GPU_CONFIGS.items()}
#: CUDA's limit on grid axis 0 (axes 1 and 2 stop at 65535, so nothing goes there)
MAX_GRID_X = 2**31 - 1


def attention_grid(rows, n_bh, block: int) -> tuple:
    """The launch grid of an attention kernel: ``(cdiv(rows, block) * n_bh,)`` programs on axis 0
    (block index fastest, see ``program_tile``); ``n_bh`` counts (batch or segment) x heads.
    ``rows`` and ``n_bh`` may be tuples, one entry per kind of program (the backward: keys and
    kv heads of the dK/dV programs, then query rows and heads of the dQ programs), the grid their
    sum. One axis keeps batch x heads beyond axis 1's 65535 launchable."""
    parts = tuple(zip(rows, n_bh)) if isinstance(rows, tuple) else ((rows, n_bh),)
    n = sum(cdiv(r, block) * m for r, m in parts)
    if n > MAX_GRID_X:
        raise ValueError(f"attention grid must have at most {MAX_GRID_X} programs (CUDA grid axis 0), got {n} ("
                         + " + ".join(f"{cdiv(r, block)} blocks x {m} batch-heads" for r, m in parts) + ")")
    return (n,)


def launch_attention_kernel(kernel, kind: str, grid_rows, n_bh, args, flags) -> None:
    """Launch one attention kernel over :func:`attention_grid` programs of ``BLOCK_M`` rows:
    fixed small blocks under the interpreter, the autotuned configs on a GPU. ``kind`` is
    ``"fwd"``, ``"bwd"`` (dK/dV programs over ``grid_rows[0]`` keys, then dQ programs over
    ``grid_rows[1]`` query rows) or ``"bwd_atomic"`` (the same kernel with ``DQ_ATOMIC``: dK/dV
    programs only, one pass, dQ by atomics)."""
    if kind not in _RESTORE:
        raise ValueError(f"kind must be one of {tuple(_RESTORE)}, got {kind!r}")
    if (kind == "bwd_atomic") != bool(flags.get("DQ_ATOMIC")):
        raise ValueError(f"kind {kind!r} does not match DQ_ATOMIC={flags.get('DQ_ATOMIC')}")
    if interpreting():
        cfg = INTERPRETER_CONFIG if kind == "fwd" else BWD_INTERPRETER_CONFIG
        kernel[attention_grid(grid_rows, n_bh, cfg["BLOCK_M"])](*args, **flags, **cfg)
        return
    attention_grid(grid_rows, n_bh, _SMALLEST_BLOCK[kind])  # fail here, not in autotune
    grid = lambda meta: attention_grid(grid_rows, n_bh, meta["BLOCK_M"])  # noqa: E731
    with on_device(args[0].device):
        launch_kernel(_tuned(kernel, _TUNER_KIND[kind]), grid, args, flags)


def kernel_flags(q: torch.Tensor, causal: bool, accumulate: bool, segmented: bool = False, *, v=None,
                 window=(-1, -1), softcap: float = 0.0, sinks: bool = False) -> dict:
    """The compile-time flags every attention kernel takes, for q ``[b, s, h, d]`` and v
    ``[b, s, h, d_v]`` (default: q's head dim). ``window``: the effective ``(left, right)``
    (-1 unbounded; causal has right = 0), ``causal`` alone meaning ``(-1, 0)``: ``RIGHT`` /
    ``LEFT`` say which bound masks; ``SOFTCAP`` whether ``softcap`` (> 0) caps the scores,
    ``SINKS`` whether a sink logit per head enters the forward's denominator."""
    d = q.shape[3]
    dv = d if v is None else v.shape[3]
    bd = max(16, 1 << (d - 1).bit_length())  # the next power of two (triton's costs microseconds on the host)
    bdv = max(16, 1 << (dv - 1).bit_length())
    left, right = window
    return dict(HEAD_DIM=d, BLOCK_D=bd, PAD_D=bd != d, HEAD_DIM_V=dv, BLOCK_DV=bdv, PAD_DV=bdv != dv,
                RIGHT=bool(causal) or right >= 0, LEFT=left >= 0, SOFTCAP=softcap > 0, SINKS=bool(sinks),
                ACCUM=bool(accumulate), UPCAST=needs_upcast(q.dtype), INPUT_PRECISION=input_precision(q.dtype),
                SEGMENTED=bool(segmented))
