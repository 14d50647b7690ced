"""The scaled fp8 GEMMs' tile configurations and prune rules (``_fp8_gemm_kernel`` of
:mod:`.fp8_gemm`; the grouped GEMMs' fp8 tiles and their scale checks for :mod:`.grouped_gemm`):
the candidates of each load path (:mod:`.gemm_loads`), the interpreter's fixed tiles, the fp32
promotion interval, the register budgets, the shared-memory estimate, the autotuner's key."""
from __future__ import annotations

import torch
import triton

from .checks import check_choice, check_same, check_shape, check_tensor
from .fp8 import FP8_BLOCK, check_fp8_device, group_tiles
from .gemm_configs import EPILOGUE_ACC_BUDGET, persistent_epilogue_smem
from .gemm_fp8_epilogue import fp8_output_configs
from .runtime import cdiv, device_capability, interpreting, pipelined, prune_tile_configs, shared_memory_limit, tile_smem_bytes

__all__ = ["FP8_GROUPED_INTERPRETER_CONFIGS", "FP8_INTERPRETER_CONFIG", "FP8_INTERPRETER_CONFIG_FP8_OUT", "FP8_PROMOTE_K",
           "FP8_TUNING_KEY", "GROUPED_FP8_ACC_BUDGET", "SCALINGS", "TILED_B_ACC_BUDGET", "UNALIGNED_FP8_GROUPED_TILE",
           "UNALIGNED_FP8_TILE", "fp8_configs_of_kind", "fp8_gpu_configs", "fp8_grouped_configs",
           "fp8_interpreter_config", "fp8_smem_estimate", "fp8_tile_rule", "fp8_tma_configs", "grouped_fp8_flags",
           "grouped_fp8_scales", "prune_fp8_configs"]

SCALINGS = ("rowwise", "blockwise")

FP8_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, GROUP_M=4)
#: the interpreter's tile with the fp8 output: whole 1x128 tiles per program (kernels/gemm_fp8_epilogue.py)
FP8_INTERPRETER_CONFIG_FP8_OUT = dict(FP8_INTERPRETER_CONFIG, BLOCK_N=FP8_BLOCK)


def fp8_interpreter_config(tma: bool, fp8_out: bool) -> dict:
    """The interpreter's fixed tile of ``_fp8_gemm_kernel``: :data:`FP8_INTERPRETER_CONFIG` (the fp8
    output's: :data:`FP8_INTERPRETER_CONFIG_FP8_OUT`), its epilogue split in column halves on the
    TMA path (both epilogue forms are run; a 128-wide fp8-output tile has no 128-wide halves)."""
    cfg = FP8_INTERPRETER_CONFIG_FP8_OUT if fp8_out else FP8_INTERPRETER_CONFIG
    return dict(cfg, EPILOGUE_SPLIT=2 if tma and not fp8_out else 1)


#: Hopper's fp8 wgmma accumulates in less than fp32: each 32-deep instruction aligns its products
#: and the running sum to their largest exponent and truncates below 2^-13 of it (the model that
#: reproduces the first H100 run's errors, tests/test_fp8.py ``mma_error_bound``; DeepSeek-V3
#: reported about 14 bits), and Triton's default on sm_90 lets a dot accumulate its whole K that
#: way. Both recipes promote to the fp32 accumulator every 128 K elements (DeepSeek-V3's interval):
#: blockwise by its fresh dot per K step, rowwise by ``max_num_imprecise_acc=PROMOTE_K`` (a partial
#: fp32 tile added to the accumulator after each step: a second accumulator tile, counted by the
#: prune rule). So each 128-deep step errs by up to about 2^-13 of its largest partial sum, not of
#: the fp32 total (tests/test_fp8.py ``test_fp8_matmul_promotes_to_fp32_every_128``)
FP8_PROMOTE_K = 128


def fp8_gpu_configs():
    """Candidate tiles of pointer-load launches (sm_89, and what TMA cannot take on sm_90): 128-deep
    K steps (128 bytes of fp8 per row, one scale block of the blockwise recipe), pruned per problem
    by :func:`prune_fp8_configs`."""
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, EPILOGUE_SPLIT=1), num_stages=stages,
                          num_warps=warps)
            for bm, bn, stages, warps in [(128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 4, 8), (128, 128, 4, 4),
                                          (64, 128, 4, 8), (128, 64, 4, 8), (64, 128, 4, 4), (128, 64, 4, 4),
                                          (64, 64, 4, 4), (64, 64, 4, 8)]]


def fp8_tma_configs():
    """Candidate tiles of TMA launches (Hopper), each marked ``cfg.tma = True``: 128-deep K steps
    (128 bytes, the widest TMA swizzle), persistent; the 128 x 256 tiles are kept only where the
    accumulator is not doubled (fast accumulation: no promotion tile), as in FBGEMM's fp8 GEMMs;
    ``EPILOGUE_SPLIT`` 2 runs the epilogue per column half."""
    out = []
    for bm, bn, stages, warps, split in [(128, 256, 3, 8, 1), (128, 256, 4, 8, 2), (256, 128, 3, 8, 1),
                                         (128, 128, 4, 8, 1), (128, 128, 5, 8, 2), (128, 64, 4, 8, 1),
                                         (64, 128, 4, 8, 1), (64, 64, 4, 4, 1), (64, 64, 4, 8, 1)]:
        cfg = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, EPILOGUE_SPLIT=split),
                            num_stages=stages, num_warps=warps)
        cfg.tma = True
        out.append(cfg)
    return out


def fp8_grouped_configs(wgrad: bool = False):
    """Candidate tiles of the grouped GEMMs' fp8 launches (``kernels/grouped_gemm.py``), each
    marked ``cfg.fp8 = True`` (the grouped autotuners hold both lists; their prune rules keep the
    fp8 tiles for fp8 launches only): 128-deep contraction steps (one scale block), at least 64
    rows per dot (fp8 wgmma). Forward / data gradient ``BLOCK_K = 128``; weight gradient
    ``BLOCK_M = 128`` (its contraction, the rows)."""
    tiles = ([(128, 128, 64, 4, 8), (128, 64, 128, 4, 8), (128, 64, 64, 4, 8), (128, 64, 64, 4, 4)] if wgrad else
             [(128, 128, 128, 4, 8), (128, 64, 128, 4, 4), (128, 64, 128, 4, 8), (64, 128, 128, 4, 4),
              (64, 128, 128, 4, 8), (64, 64, 128, 4, 4), (64, 32, 128, 4, 8)])
    out = []
    for bm, bn, bk, stages, warps in tiles:
        cfg = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=stages, num_warps=warps)
        cfg.fp8 = True
        out.append(cfg)
    return out


#: the grouped GEMMs' interpreted fp8 tiles (forward / data gradient, weight gradient): 128-deep steps
FP8_GROUPED_INTERPRETER_CONFIGS = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128), dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=32))
#: output tile elements of a grouped fp8 launch whose loads do not vectorise (K or a row stride not a
#: multiple of 16 bytes): 64x32 over 8 warps compiles without spills on sm_90 with the gated
#: epilogue's two B tiles (64x64 spills 128-280 B, 64x32 over 4 warps 60 B; test shape 61x24x200)
UNALIGNED_FP8_GROUPED_TILE = 64 * 32
#: fp32 accumulator elements per thread of the grouped GEMMs' fp8 launches, all tiles together (each
#: accumulator counts twice: the step's dot and the running fp32 sum), by epilogue (``python -m
#: benchmarks compile``, sm_90: no spills; the weight gradient's 128x128x128 over 8 warps, 128, spills 56 B)
GROUPED_FP8_ACC_BUDGET = {"plain": 128, "fused": 128, "dact": 64, "wgrad": 64}


def grouped_fp8_scales(a_name: str, a, a_scale, b_scale, scaling: str, *, n_experts: int = 0, n_w: int = 0,
                       K: int = 0, wgrad_of: tuple | None = None):
    """The scales of a grouped GEMM launch (``kernels/grouped_gemm.py``) on operand ``a`` (named
    ``a_name``): None for 16/32-bit operands (no scale may be given); for e4m3 ones ``(scale
    pointers, their strides, blockwise)`` once ``scaling`` and the scales are checked (fp32, on
    ``a``'s device, of the shapes below; a ``ValueError`` names the one that is not).

    Forward / data gradient (``a [M, K]``, a weight of ``n_w`` rows per expert, the second scale
    ``weight_scale``): "rowwise" ``[M]`` per row and ``[E, n_w]`` per expert and weight row;
    "blockwise" ``[M, ceil(K/128)]`` (1x128 tiles) and ``[E, ceil(n_w/128), ceil(K/128)]``
    (128x128 blocks per expert). Weight gradient (``wgrad_of=(G, N, K)``, ``a`` the gradient
    ``[M, N]``, the second scale ``x_scale`` of ``x [M, K]``), both quantised along the rows per
    group (:func:`~fusedpar.kernels.fp8.quantize_e4m3_groups`): ``[N, T]`` and ``[K, T]``,
    ``T =`` :func:`~fusedpar.kernels.fp8.group_tiles` ``(M, G)`` (either recipe)."""
    if wgrad_of is None:
        M, kb = a.shape[0], cdiv(K, FP8_BLOCK)
        scales = {f"{a_name}_scale": (a_scale, (M,), (M, kb)),
                  "weight_scale": (b_scale, (n_experts, n_w), (n_experts, cdiv(n_w, FP8_BLOCK), kb))}
    else:
        (_, N, K), T = wgrad_of, group_tiles(a.shape[0], wgrad_of[0])
        scales = {f"{a_name}_scale": (a_scale, (N, T), (N, T)), "x_scale": (b_scale, (K, T), (K, T))}
    if a.dtype != torch.float8_e4m3fn:
        given = [name for name, (t, _, _) in scales.items() if t is not None]
        if given:
            raise ValueError(f"{given[0]} is for float8_e4m3fn operands, got {a_name} of dtype {a.dtype}")
        return None
    check_choice("scaling", scaling, SCALINGS)
    check_fp8_device(a)
    blockwise = scaling == "blockwise"
    for name, (t, row_shape, block_shape) in scales.items():
        check_tensor(name, t, dtypes=(torch.float32,))
        check_shape(name, t, block_shape if blockwise else row_shape)
        check_same(name, t, a_name, a, dtype=False)
    sa, sb = a_scale, b_scale
    return (sa, sb, sa.stride(0), sa.stride(1) if sa.dim() > 1 else 0, sb.stride(0), sb.stride(1),
            sb.stride(2) if sb.dim() > 2 else 0, blockwise)


def grouped_fp8_flags(fp8, *outputs) -> dict:
    """The fp8 constexprs of a grouped GEMM launch (``fp8``: :func:`grouped_fp8_scales`'s result;
    ``EMULATE``, the interpreter's bf16 rounding, only when one of ``outputs`` is bf16)."""
    bf16 = any(t is not None and t.dtype == torch.bfloat16 for t in outputs)
    return dict(FP8=fp8 is not None, BLOCKWISE=bool(fp8 and fp8[-1]), EMULATE=interpreting() and bf16 and fp8 is not None,
                PROMOTE_K=FP8_PROMOTE_K if fp8 is not None else None)


def fp8_configs_of_kind(configs, named_args, kwargs, fp8_tile_ok=True):
    """The configs of a grouped launch's kind (the prune rules' first step): the
    :func:`fp8_grouped_configs` tiles for fp8 launches (loads that do not vectorise: those within
    :data:`UNALIGNED_FP8_GROUPED_TILE` over 8 warps), the others for the rest."""
    fp8 = bool(kwargs.get("FP8", named_args.get("FP8", False)))
    kind = [c for c in configs if getattr(c, "fp8", False) == fp8]
    if fp8 and not fp8_tile_ok:  # every element its own address: small tiles over 8 warps
        kind = [c for c in kind if c.num_warps == 8 and c.kwargs["BLOCK_N"] * c.kwargs[
            "BLOCK_K" if "dy_ptr" in named_args else "BLOCK_M"] <= UNALIGNED_FP8_GROUPED_TILE] or kind
    return kind


#: fp32 accumulator elements per thread (both tiles) of a blockwise GEMM whose B scales are per row
#: (1x128 tiles: a vector of scales and its pointers live next to the accumulators in every K
#: step): 128 spills 16 B on sm_90 (128x128 w8 at the weight-gradient shape), 64 does not
TILED_B_ACC_BUDGET = 64
#: output tile elements of a GEMM whose loads do not vectorise (K or a row stride not a multiple of
#: 16 bytes: every element carries its own address and mask): 64x64 compiles without spills on
#: sm_90, every larger tile of the list spills 200-4100 B at the test shape 37x45x200
UNALIGNED_FP8_TILE = 64 * 64


def fp8_tile_rule(named_args: dict, **kwargs) -> dict:
    """The prune rule's parameters: 1-byte operands, two accumulator tiles per output tile (the
    running fp32 sum and the step's dot: blockwise's fresh dot, rowwise's partial accumulator;
    gated: gate and up, four tiles and two B tiles), the plain epilogue's register budget, fused
    epilogues too (sm_90: gated 64 x 128 / 128 x 64 over 8 warps 172-241 registers, gelu + e4m3
    output 128 x 128 over 8 warps 240-250, no spills)."""
    def get(k, default=False):
        return kwargs.get(k, named_args.get(k, default))

    a, glu = named_args["a_ptr"], bool(get("GLU"))
    tiled_b = bool(get("BLOCKWISE")) and get("B_SCALE_ROWS", 1) == 1
    extents = [e for e in (named_args["K"], named_args["s_am"], named_args["a_so"], named_args["s_bn"]) if e != 1]
    budget = TILED_B_ACC_BUDGET if tiled_b else EPILOGUE_ACC_BUDGET["plain"]
    # fast accumulation (rowwise without promotion): one accumulator tile per output tile
    promoted = bool(get("BLOCKWISE")) or get("PROMOTE_K", FP8_PROMOTE_K) is not None
    acc_tiles = (2 if glu else 1) * (2 if promoted else 1)
    if get("TMA") and glu and get("FP8_OUT"):
        # persistent: a gated pair with the e4m3 output spilled 24-72 B at 128 accumulator elements
        # per thread (sm_90, 64 x 128 w8)
        budget = EPILOGUE_ACC_BUDGET["fused"]
    if get("TMA") and get("ACT") and get("STORE_AUX") and get("FP8_OUT") and promoted and not get("BLOCKWISE"):
        # persistent rowwise with an activation, its pre-activation and the e4m3 output: 128 x 128
        # over 8 warps (128 elements per thread) took 255 registers and spilled 8 B with Triton 3.6
        # (sm_90; none with 3.9); blockwise's took 255 without spilling on both
        budget = EPILOGUE_ACC_BUDGET["fused"]
    return dict(elem_size=1, b_tiles=2 if glu else 1, acc_tiles=acc_tiles, acc_budget=budget,
                sync_acc_budget=budget, capability=device_capability(a.device.index or 0), precision="ieee",
                pipelined=bool(get("TMA")) or pipelined(1, *extents))


def fp8_smem_estimate(cfg, named_args, **kwargs) -> int:
    """The prune rule's shared-memory bytes of ``cfg`` for a launch with ``named_args``."""
    r = fp8_tile_rule(named_args, **kwargs)
    smem = tile_smem_bytes(cfg, elem_size=1, b_tiles=r["b_tiles"], capability=r["capability"], precision="ieee",
                           pipelined=r["pipelined"])
    if kwargs.get("TMA", named_args.get("TMA", False)):  # persistent: the epilogue beside the buffers
        c = named_args.get("c_ptr")
        smem += persistent_epilogue_smem(cfg, c.element_size() if isinstance(c, torch.Tensor) else 2)
    return smem


def prune_fp8_configs(configs, named_args, **kwargs):
    """:func:`~fusedpar.kernels.runtime.prune_tile_configs` with the fp8 rule (:func:`fp8_tile_rule`)
    over the tiles of the launch's kind (the fp8 output's: ``BLOCK_N`` a multiple of 128); loads
    that do not vectorise keep only tiles within :data:`UNALIGNED_FP8_TILE` (a compiled launch
    fuses no e4m3 output there, :func:`epilogue_fits`)."""
    a, rule = named_args["a_ptr"], fp8_tile_rule(named_args, **kwargs)
    fp8_out, tma = (bool(kwargs.get(k, named_args.get(k, False))) for k in ("FP8_OUT", "TMA"))
    configs = [c for c in fp8_output_configs(configs, fp8_out) if getattr(c, "tma", False) == tma
               and not (fp8_out and (c.kwargs["BLOCK_N"] // c.kwargs.get("EPILOGUE_SPLIT", 1)) % 128)]
    if tma:  # the epilogue's shared memory comes on top of the pipelined buffers
        limit = shared_memory_limit(a.device.index or 0)
        configs = [c for c in configs if fp8_smem_estimate(c, named_args, **kwargs) <= limit] or configs[-1:]
    if not rule["pipelined"]:  # over 8 warps: 64 x 64 over 4 spilled 4 B in the core's main loop (sm_90)
        configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= UNALIGNED_FP8_TILE
                   and c.num_warps == 8] or configs
    return prune_tile_configs(configs, smem_limit=shared_memory_limit(a.device.index or 0),
                              dims={"BLOCK_M": named_args["M"], "BLOCK_N": named_args["N"]}, **rule)


#: the autotuner's key: the problem size, the flags and strides :func:`fp8_tile_rule` and the tile
#: filter read, and the epilogue's (a tile tuned for the plain epilogue is not reused by a fused one,
#: nor an aligned launch's by one whose rows lose 16-byte alignment)
FP8_TUNING_KEY = ["M", "N", "K", "BLOCKWISE", "B_SCALE_ROWS", "ACT", "GLU", "STORE_AUX", "FP8_OUT", "TMA", "PROMOTE_K",
                  "s_am", "a_so", "s_bn"]
