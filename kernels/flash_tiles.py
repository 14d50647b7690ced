"""Launch configuration of the flash-attention kernels (:mod:`.flash_attention`,
:mod:`.flash_attention_bwd`): the compile-time flags of a launch (:func:`kernel_flags`), the
fixed interpreter tiles, the GPU config lists with their prune rule (shared-memory and register
estimates checked against ptxas by ``python -m benchmarks compile``), the one-axis grid and the
launch itself (:func:`launch_attention_kernel`). Kinds: "fwd", "dq", "dkdv" and "bwd" (the
one-pass backward: the dK/dV kernel with ``DQ_ATOMIC``, tuned by the dK/dV kernel's autotuner
over configs of its own).
"""
from __future__ import annotations

import functools

import torch
import triton

from .launch import launch_kernel
from .runtime import (autotuned, cdiv, device_capability, input_precision, interpreting, needs_upcast,
                      next_power_of_2, on_device, shared_memory_limit)

__all__ = [
    "FP32_TILE", "INTERPRETER_CONFIG", "MAX_GRID_X", "attention_grid", "gpu_configs", "kernel_flags",
    "launch_attention_kernel", "launch_smem_estimate", "register_estimate", "smem_estimate", "uses_wgmma",
]


# --------------------------------------------------------------------------------------------
# Configurations: fixed small blocks under the interpreter, autotuned pruned configs on GPU
# --------------------------------------------------------------------------------------------
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16)
#: which outputs a tuning run of each kernel kind writes (restored between configs: the
#: accumulate modes read them, and the one-pass backward adds into dQ, so tuning runs must not
#: compound them). "bwd" is the one-pass backward: the dK/dV kernel with ``DQ_ATOMIC`` (its
#: autotuner is the dK/dV kernel's, whose prune rule picks the configs of the kind)
_RESTORE = {"fwd": ["o_ptr", "lse_ptr"], "dq": ["dq_ptr"], "dkdv": ["dk_ptr", "dv_ptr", "dq_ptr"],
            "bwd": ["dk_ptr", "dv_ptr", "dq_ptr"]}
#: the autotuner (kernel) of each kind
_TUNER_KIND = {"fwd": "fwd", "dq": "dq", "dkdv": "dkdv", "bwd": "dkdv"}


#: per kernel kind: (BLOCK_M, BLOCK_N, num_stages, num_warps). Measured with ``python -m benchmarks
#: compile --family flash`` (ptxas, sm_90 and sm_80): these compile without register spills at
#: head_dim <= 128 in bf16/fp16. For dK/dV BLOCK_N is the resident key block (its dK and dV fp32
#: accumulators dominate the registers), BLOCK_M the streamed query block. The last entry,
#: ``FP32_TILE``, is the only one fp32 "ieee" launches keep (their dots run on FMA units).
FP32_TILE = (32, 16)
_GPU_CONFIGS = {
    "fwd": [(128, 64, 3, 8), (64, 128, 3, 8), (64, 64, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4), (32, 32, 3, 4),
            (*FP32_TILE, 2, 4)],
    "dq": [(64, 128, 3, 8), (64, 64, 3, 8), (64, 32, 4, 4), (32, 32, 3, 4), (*FP32_TILE, 2, 4)],
    "dkdv": [(32, 64, 3, 8), (32, 32, 3, 4), (*FP32_TILE, 2, 4)],
    # the one-pass backward: dK/dV plus the fp32 dQ part [BLOCK_M, BLOCK_D] of each query block
    # (its atomics' pointers too); 16-row query blocks keep 128 resident keys (flash-attention 2's
    # key block: half the dQ atomics of 64) within the registers at head_dim 128 (sm_90)
    "bwd": [(16, 128, 2, 8), (32, 128, 2, 8), (16, 64, 2, 8), (16, 32, 2, 8), (*FP32_TILE, 2, 4)],
}
#: live fp32 score tiles ([BLOCK_M, BLOCK_N]) and the register budget (32-bit registers per
#: thread for the tiles of :func:`register_estimate`) each kind compiles within without spills
_SCORE_TILES = {"fwd": 2, "dq": 2, "dkdv": 4, "bwd": 4}
#: extra live fp32 score tiles of a softcapped launch (tanh's terms, kept for dS' 1 - tanh^2);
#: measured: without them dQ 64x128 and dK/dV 32x32 / 32x64 at head_dim 128 spilled in bf16
_SOFTCAP_TILES = {"fwd": 0, "dq": 2, "dkdv": 1, "bwd": 1}
_REGISTER_BUDGET = {"fwd": 160, "dq": 160, "dkdv": 128, "bwd": 240}
#: dK/dV with q/k and v wider than 128 + 128 padded (MLA's 192 / 128 runs as 256 / 128): measured
#: 32x64 (wgmma) and 32x32 at 232 and 237 registers without spills, estimated 176
_WIDE_DKDV_BUDGET = 176


def gpu_configs(kind: str):
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_stages=stages, num_warps=warps)
            for bm, bn, stages, warps in _GPU_CONFIGS[kind]]


def _tuner_configs(tuner_kind: str):
    """The configs of the autotuner ``tuner_kind``: those of every kind it launches (the dK/dV
    tuner: "dkdv" then the one-pass "bwd" entries it lacks), each once."""
    seen = []
    for kind in _RESTORE:
        if _TUNER_KIND[kind] == tuner_kind:
            seen += [c for c in _GPU_CONFIGS[kind] if c not in seen]
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_stages=stages, num_warps=warps)
            for bm, bn, stages, warps in seen]


def _on_keys(kind: str) -> bool:
    """Whether programs of ``kind`` own key blocks (BLOCK_N resident, BLOCK_M streamed)."""
    return kind in ("dkdv", "bwd")


def register_estimate(kind: str, block_m: int, block_n: int, block_d: int, num_warps: int, elem_size: int,
                      block_dv: int | None = None, softcap: bool = False) -> int:
    """32-bit registers per thread of the live tiles of one program: the fp32 accumulators
    (O ``[rows, BLOCK_DV]`` or dQ ``[rows, BLOCK_D]``; dK and dV), the resident operands (Q; Q and
    dO; K and V) and the fp32 score tiles; the one-pass "bwd" adds its fp32 dQ part ``[BLOCK_M,
    BLOCK_D]``. The prune rule keeps configs within ``_REGISTER_BUDGET``. ``block_dv``: v's
    padded head dim (default ``block_d``); ``softcap`` adds the softcap's score tiles."""
    rows = block_n if _on_keys(kind) else block_m
    bdv = block_d if block_dv is None else block_dv
    acc_d, res_d = (bdv, block_d) if kind == "fwd" else (block_d, block_d + bdv) if kind == "dq" else \
        (block_d + bdv, block_d + bdv)
    score_tiles = _SCORE_TILES[kind] + (_SOFTCAP_TILES[kind] if softcap else 0)
    words = rows * (acc_d + res_d * elem_size / 4) + score_tiles * block_m * block_n
    if kind == "bwd":
        words += block_m * block_d
    return int(words // (32 * num_warps))


def uses_wgmma(kind: str, block_m: int, block_n: int, capability: tuple, precision: str) -> bool:
    """Whether Triton compiles the kernel's dots to Hopper wgmma (operands from shared memory):
    sm_90 with a 64-row MMA tile (the rows are BLOCK_N for dK/dV) and tensor-core precision."""
    rows = block_n if _on_keys(kind) else block_m
    return capability[0] == 9 and rows >= 64 and precision != "ieee_fp32"


def smem_estimate(kind: str, cfg, block_d: int, elem_size: int, capability: tuple, precision: str = "",
                  block_dv: int | None = None) -> int:
    """Shared memory (bytes) of one program as Triton 3.9 allocates it (checked against the
    compiler by ``python -m benchmarks compile``). wgmma: ``num_stages`` buffers of the streamed
    tile pair plus the resident tiles (Q; Q and dO; K and V). mma.sync and fp32 "ieee" FMA dots:
    ``num_stages - 1`` buffers plus the layout-conversion buffers of the resident and score tiles
    (fitted per kernel from the compiler's figures). dK/dV also pipelines lse and delta. ``precision``:
    "" (16-bit operands), "ieee_fp32" or "tf32" (fp32 operands, FMA or tensor-core dots).
    ``block_dv`` (v's padded head dim, default ``block_d``): the streamed pair (K and V; Q and
    dO) and the resident tiles (dQ: Q and dO; dK/dV: K and V) count each tile at its own width;
    the fitted layout-conversion terms keep ``block_d``."""
    bm, bn, stages, e = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_stages, elem_size
    bdv = block_d if block_dv is None else block_dv
    if kind == "bwd":  # (fitted, Triton 3.9: the one-pass configs on sm_90 and sm_80, 16-bit, TF32, fp32)
        pair, res, lse = bm * (block_d + bdv) * e, bn * (block_d + bdv) * e, (stages - 1) * 2 * bm * 4
        if precision == "ieee_fp32":  # (sm_80: 4.0% over at head_dim 128)
            return (stages - 1) * pair + lse + res + (4 if capability[0] >= 9 else 2) * bm * bn * e
        if uses_wgmma(kind, bm, bn, capability, precision):  # K once more (dS^T K's operand), the fp32 dQ part
            return stages * pair + lse + res + bn * block_d * e + 4 * bm * block_d
        return (stages - 1) * pair + lse + res + (3 if precision == "tf32" else 1) * bm * block_d * e
    stream_rows, rows = (bm, bn) if kind == "dkdv" else (bn, bm)
    pair = stream_rows * (block_d + bdv) * e
    tile = rows * block_d * e  # one resident tile (Q, or the q/k-width one)
    if kind != "fwd" and bdv != block_d:  # the fitted conversion terms of dQ / dK/dV: mean width
        tile = rows * ((block_d + bdv) // 2) * e
    res = tile if kind == "fwd" else rows * (block_d + bdv) * e  # every resident tile
    lse = (stages - 1) * 2 * bm * 4 if kind == "dkdv" else 0
    if uses_wgmma(kind, bm, bn, capability, precision):
        # tf32: the fp32 resident operands of dQ / dK/dV stage one tile (fitted)
        return stages * pair + (tile if precision == "tf32" and kind != "fwd" else res) + lse
    base = (stages - 1) * pair + lse
    if precision == "ieee_fp32":
        return base + res + bm * bn * e
    if precision == "tf32" and kind != "fwd":  # mma.sync on fp32 operands (fitted)
        if kind == "dq":
            return base + (tile if bn <= bm else 0) + min(bm, bn) * 32 * e + bm * bn * e
        return base + (res + bm * block_d * e if bn < bm else tile + (bm * bn * e // 2 if bn > bm else 0))
    if kind == "fwd":
        return base + tile + (bm * bn * e if bm < block_d else 0)
    if kind == "dq":  # (fitted: the dO-wide tile; MLA 192 / 128: exact on sm_80, -3.3% on sm_90)
        return base + (rows * bdv * e if bn <= bm else 0) + min(bm, bn) * 32 * e
    if bn < bm:  # 16-bit dK/dV only as the fallback tile (fitted: head dims 128 and 192 / 128)
        return base + rows * block_d * e + tile + 2 * bm * bn * e
    return base + tile + bm * bn * e + (bm * bdv * e if bn > bm else 0)


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
                         precision, bdv)


def _one_pass_spills(bm: int, bn: int, bd: int, bdv: int, num_warps: int, elem_size: int, capability: tuple) -> bool:
    """The one-pass backward's tiles that spill although :func:`register_estimate` fits them
    (measured, bf16, ``python -m benchmarks compile``): 32-row query blocks at head_dim 128
    (32x64 wgmma on sm_90: 96 B; 32x32 on sm_80: 128 B); more than 32 resident keys with q/k and
    v wider than 128 + 128 (MLA's 256 / 128: 16x64 spilled 132 B on sm_90, 40 B on sm_80) or with
    fp32 operands (TF32, head_dim 128: 16x64 spilled 760 B on sm_90); on sm_80 (mma.sync) 8-warp
    tiles with more than 16 query rows (head_dim 64: 32x64, 32x128 spilled 44, 40 B) and 128
    resident keys at head_dim 128 (44 B)."""
    if (bd >= 128 and bm > 16) or (bn > 32 and (bd + bdv > 256 or elem_size == 4)):
        return True
    return capability[0] < 9 and ((num_warps == 8 and bm > 16) or (bd >= 128 and bn > 64))


def _launch_kind(kind: str, kwargs) -> str:
    """The kind a launch of the ``kind`` autotuner runs: the dK/dV kernel with ``DQ_ATOMIC`` is
    the one-pass "bwd"."""
    return "bwd" if kind == "dkdv" and kwargs.get("DQ_ATOMIC") else kind


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
        limit = shared_memory_limit(q.device.index or 0)
        sq, sk = named_args["SQ"], named_args["SK"]
        ieee_fp32 = kwargs.get("INPUT_PRECISION") == "ieee" and elem == 4
        kept = []
        for cfg in configs:
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            if launch_smem_estimate(kind, cfg, named_args, **kwargs) > limit:
                continue
            budget = _WIDE_DKDV_BUDGET if _on_keys(kind) and bd + bdv > 256 else _REGISTER_BUDGET[kind]
            if register_estimate(kind, bm, bn, bd, cfg.num_warps, elem, bdv, bool(kwargs.get("SOFTCAP"))) > budget:
                continue
            if kind == "dq" and bd < 128 and bm > 32 and device_capability(q.device.index or 0)[0] < 9:
                continue  # measured: 64-row dQ tiles of a head_dim-64 spill with mma.sync (sm_80)
            if kind == "dkdv" and kwargs.get("LEFT") and bn > 32 and device_capability(q.device.index or 0)[0] < 9:
                continue  # measured: a windowed dK/dV's 64-key tiles spill 44 B with mma.sync (sm_80, d 64)
            if kind == "fwd" and kwargs.get("FP8_OUT") and bdv > 128 and (bm, bn, cfg.num_stages) == (32, 32, 3):
                continue  # measured: with the e4m3 output at d_v 256 this tile spills 4 B (sm_90)
            if kind == "bwd" and _one_pass_spills(bm, bn, bd, bdv, cfg.num_warps, elem,
                                                  device_capability(q.device.index or 0)):
                continue
            if elem == 4 and not ieee_fp32 and (bn > 64 if kind == "dq" else kind == "dkdv" and bn > bm and
                                                 device_capability(q.device.index or 0)[0] < 9):
                continue  # measured, tf32: 128-wide dQ key blocks (sm_90) and wide dK/dV tiles (sm_80) spill
            if ieee_fp32 != ((bm, bn) == FP32_TILE):
                continue  # fp32 "ieee" dots run on FMA units: only FP32_TILE compiles (nearly) without spills
            if bm > 2 * next_power_of_2(sq) and bm > 32:
                continue
            if bn > 2 * next_power_of_2(sk) and bn > 32:
                continue
            kept.append(cfg)
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]

    return prune


@functools.lru_cache(maxsize=None)
def _tuned(kernel, tuner_kind: str):
    return autotuned(
        kernel, configs=_tuner_configs(tuner_kind),
        key=["SQ", "SK", "HEAD_DIM", "HEAD_DIM_V", "RIGHT", "LEFT", "SOFTCAP", "GROUP", "SEGMENTED",
             "INPUT_PRECISION"]  # fp32 ieee prunes differently
        + (["DQ_ATOMIC"] if tuner_kind == "dkdv" else [])
        + (["FP8_OUT"] if tuner_kind == "fwd" else []),  # the e4m3 output's epilogue: its own registers
        prune=_prune(tuner_kind), restore_value=_RESTORE[tuner_kind],
    )


#: the smallest block of each kind's configs along the grid's dim (its largest grid)
_SMALLEST_BLOCK = {(kind, key): min(c[0 if key == "BLOCK_M" else 1] for c in cfgs)
                   for kind, cfgs in _GPU_CONFIGS.items() for key in ("BLOCK_M", "BLOCK_N")}
#: CUDA's limit on grid axis 0 (axes 1 and 2 stop at 65535, so nothing goes there)
MAX_GRID_X = 2**31 - 1


def attention_grid(rows: int, n_bh: int, block: int) -> tuple:
    """The launch grid of an attention kernel: ``(cdiv(rows, block) * n_bh,)`` programs on axis 0
    (block index fastest, see ``program_tile``); ``n_bh`` counts (batch or segment) x heads.
    One axis keeps batch x heads beyond axis 1's 65535 launchable."""
    n = cdiv(rows, block) * n_bh
    if n > MAX_GRID_X:
        raise ValueError(f"attention grid must have at most {MAX_GRID_X} programs (CUDA grid axis 0), "
                         f"got {n} ({cdiv(rows, block)} blocks x {n_bh} batch-heads)")
    return (n,)


def launch_attention_kernel(kernel, kind: str, grid_rows: int, n_bh: int, args, flags) -> None:
    """Launch one attention kernel over :func:`attention_grid` programs: fixed small blocks under
    the interpreter, the autotuned configs on a GPU. ``kind`` is ``"fwd"``, ``"dq"`` (one program
    per block of query rows), ``"dkdv"`` (one per block of key rows) or ``"bwd"`` (the dK/dV
    kernel with ``DQ_ATOMIC``: one pass, dQ by atomics)."""
    if kind not in _RESTORE:
        raise ValueError(f"kind must be one of {tuple(_RESTORE)}, got {kind!r}")
    if (kind == "bwd") != bool(flags.get("DQ_ATOMIC")):
        raise ValueError(f"kind {kind!r} does not match DQ_ATOMIC={flags.get('DQ_ATOMIC')}")
    key = "BLOCK_N" if _on_keys(kind) else "BLOCK_M"
    if interpreting():
        cfg = INTERPRETER_CONFIG
        kernel[attention_grid(grid_rows, n_bh, cfg[key])](*args, **flags, **cfg)
        return
    attention_grid(grid_rows, n_bh, _SMALLEST_BLOCK[kind, key])  # fail here, not in autotune
    grid = lambda meta: attention_grid(grid_rows, n_bh, meta[key])  # noqa: E731
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
