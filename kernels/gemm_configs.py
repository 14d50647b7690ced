"""The dense GEMM's tile configurations and the rule that prunes them per launch (``_gemm_kernel``
of :mod:`.gemm`; the persistent and linear cross-entropy GEMMs reuse the rule): the candidates of
each load path (:mod:`.gemm_loads`), the interpreter's fixed tile, the register budgets of the
epilogues, the shared-memory estimate, the autotuner's key."""
from __future__ import annotations

import torch
import triton

from .gemm_fp8_epilogue import FP8_OUT_INTERPRETER_CONFIG, fp8_output_configs
from .runtime import (acc_budget_for, acc_per_thread, aligned, device_capability, pipelined, prune_tile_configs,
                      shared_memory_limit, tile_config_problem, tile_smem_bytes, uses_wgmma)

__all__ = ["EPILOGUE_ACC_BUDGET", "INTERPRETER_CONFIG", "SYNC_TIGHT_ACC_BUDGET", "TUNING_KEY", "gpu_configs",
           "interpreter_config", "persistent_epilogue_smem", "prune_gemm_configs", "smem_estimate", "tile_rule",
           "tma_gpu_configs", "tma_tiles_fit"]


INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)


def interpreter_config(tma: bool, fp8_out: bool) -> dict:
    """The interpreter's fixed tile: :data:`INTERPRETER_CONFIG` (the fp8 output's: whole 1x128
    tiles), its epilogue split in column halves on the TMA path (both epilogue forms are run)."""
    cfg = FP8_OUT_INTERPRETER_CONFIG if fp8_out else INTERPRETER_CONFIG
    return dict(cfg, EPILOGUE_SPLIT=2 if tma and not fp8_out else 1)


def tma_gpu_configs():
    """Candidate tiles of TMA launches (Hopper, 16-bit operands; tutorial 09's family), each marked
    ``cfg.tma = True``: 64-deep K steps (128 bytes of a 16-bit row, the widest TMA swizzle),
    ``EPILOGUE_SPLIT`` 2 where the column halves free the shared memory of a deeper pipeline; 8 warps
    (two consumer warpgroups), 4 only for 64 x 64 (the epilogue's conversion buffer of a larger
    tile over 4 warps measured 4096 or 8192 elements by epilogue, sm_90)."""
    out = []
    for bm, bn, stages, warps, split in [(128, 256, 3, 8, 1), (128, 256, 4, 8, 2), (256, 128, 3, 8, 1),
                                         (128, 128, 4, 8, 1), (128, 128, 5, 8, 2), (128, 64, 4, 8, 1),
                                         (64, 128, 4, 8, 1), (64, 64, 4, 4, 1), (64, 64, 4, 8, 1)]:
        cfg = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, EPILOGUE_SPLIT=split),
                            num_stages=stages, num_warps=warps)
        cfg.tma = True
        out.append(cfg)
    return out


def gpu_configs():
    """Candidate tile shapes for Hopper/Ampere (tutorial 03 style), pruned per problem below."""
    configs = []
    for bm, bn, bk, stages, warps in [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 4, 4),
        (128, 256, 32, 4, 8),
        (64, 256, 32, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 8),  # 8 warps: a gated / fused epilogue's accumulators fit in registers
        (64, 128, 64, 4, 8),
        (128, 32, 64, 4, 4),
        (64, 64, 32, 3, 8),  # BLOCK_K 32: problems whose loads do not vectorise (unaligned strides or K)
        (64, 64, 32, 4, 4),
        (32, 64, 32, 4, 4),
        (64, 64, 64, 4, 4),
        (32, 64, 64, 5, 2),
    ]:
        configs.append(
            triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_stages=stages, num_warps=warps)
        )
    return configs


#: fp32 accumulator elements per thread the GEMM epilogues can hold without spilling (sm_90 and
#: sm_80, ``python -m benchmarks compile``): 128 with a plain epilogue (bias, residual, accumulate);
#: 64 with a fused one (activation, gated pair, pre-activation store, residual on split rows),
#: whose activation terms and int64 pointer tiles are live next to the accumulators, and with a
#: residual / accumulate tile wider than the operands (an fp32 ``out`` accumulated from bf16/fp16
#: products: 128 spilled 48-180 B on sm_90, 116-252 B on sm_80).
EPILOGUE_ACC_BUDGET = {"plain": 128, "fused": 64}
#: the same for dots lowered to mma.sync (sm_80, and tiles under 64 rows on sm_90), whose operand
#: fragments are held in registers next to the accumulators: an activation followed by a residual
#: add, or a fused epilogue whose loads do not vectorise (:func:`~fusedpar.kernels.runtime.aligned`),
#: fits 32 (64 spills 4-136 B on sm_80); so does a gated e4m3-output epilogue over unaligned K on
#: any dot (sm_90, 64 x 128 x 32 w8: 88-112 B spilled), and a gated one by pointer loads that do
#: not vectorise (sm_90, 64 x 64 x 32 w4 at K = 70: 4 B spilled with Triton 3.6)
SYNC_TIGHT_ACC_BUDGET = 32


def tile_rule(named_args: dict, **kwargs) -> dict:
    """The prune rule's parameters (:func:`~fusedpar.kernels.runtime.tile_config_problem`) of a
    GEMM launch with ``named_args`` / constexpr ``kwargs`` (``_gemm_kernel`` and the persistent one)."""
    def get(k, default=False):
        return kwargs.get(k, named_args.get(k, default))

    a, glu, precision = named_args["a_ptr"], bool(get("GLU")), get("INPUT_PRECISION", "ieee")
    act = glu or get("ACT", 0) != 0
    fused = act or get("STORE_AUX") or get("FP8_OUT") or (get("HAS_RES") and get("R_M_SPLIT"))
    extents = [named_args.get(k, 16) for k in ("K", "s_am0", "s_am1", "s_ak0", "s_ak1", "s_ak", "s_bk0", "s_bk1", "s_bk",
                                                "s_bn")]
    extents = [e for e in extents if e != 1]
    # a masked contiguous dim counts too: A contiguous along M (matmul_tn), B along N ("kn")
    extents += [named_args[d] for d, s in (("M", "s_am1"), ("N", "s_bn")) if d in named_args and named_args.get(s) == 1]
    vectorised = aligned(a.element_size(), *extents)
    unaligned = named_args.get("K", 64) % 64 != 0 or not vectorised
    res = named_args.get("r_ptr")
    wide_res = bool(get("HAS_RES")) and isinstance(res, torch.Tensor) and res.element_size() > a.element_size()
    budget = EPILOGUE_ACC_BUDGET["fused" if fused or wide_res else "plain"]
    tma = bool(get("TMA"))  # TMA copies whole tiles into shared memory: no per-element addresses
    budget = SYNC_TIGHT_ACC_BUDGET if glu and ((get("FP8_OUT") and unaligned) or not (tma or vectorised)) else budget
    sync = SYNC_TIGHT_ACC_BUDGET if fused and (unaligned or (act and get("HAS_RES"))) else budget
    if tma and fused and ((act and get("HAS_RES")) or named_args.get("N", 16) % 16):
        # persistent: an activation then a residual, or a fused epilogue over N not a multiple of 16
        # columns (per-element addresses: a gated up half, a cross-entropy block) spilled 12-1192 B
        # at 64 accumulator elements per thread (sm_90: 2x19x40 gelu+residual, 37x45x80 swiglu,
        # 40x51x8 logit gradients with a soft cap)
        budget = SYNC_TIGHT_ACC_BUDGET
    cap = dict(elem_size=a.element_size(), precision=precision, acc_tiles=2 if glu else 1,
               reads_out_tile=bool(get("HAS_RES")))
    return dict(elem_size=a.element_size(), b_tiles=2 if glu else 1, acc_tiles=2 if glu else 1,
                acc_budget=acc_budget_for(budget, **cap), sync_acc_budget=acc_budget_for(sync, **cap, sync=True),
                capability=device_capability(a.device.index or 0), precision=precision,
                unaligned=unaligned and not tma, pipelined=tma or pipelined(a.element_size(), *extents))


def smem_estimate(cfg, named_args, **kwargs) -> int:
    """The prune rule's shared-memory bytes of ``cfg`` for a launch with ``named_args``: the main
    loop's buffers or, for a wgmma tile whose output is wider than its operands (fp32 ``out`` from
    bf16/fp16: the linear cross entropy's ``d_hidden``) or quantised (``FP8_OUT``: 16384 B, not 12288,
    for 64 x 128 x 32 over unaligned K), the output tile Triton stages through shared memory to
    convert the accumulator's layout, whichever is larger (measured: a 128 x 256 x 32 tile of 4
    stages needs 131072 B, not the 98304 B of its buffers)."""
    r = tile_rule(named_args, **kwargs)
    smem = tile_smem_bytes(cfg, elem_size=r["elem_size"], b_tiles=r["b_tiles"], capability=r["capability"],
                           precision=r["precision"], pipelined=r["pipelined"])
    c = named_args.get("c_ptr")
    kw = cfg.kwargs if hasattr(cfg, "kwargs") else cfg
    if kwargs.get("TMA", named_args.get("TMA", False)):  # (no c_ptr: the cross-entropy statistics)
        return smem + persistent_epilogue_smem(cfg, c.element_size() if isinstance(c, torch.Tensor) else 0)
    wide = isinstance(c, torch.Tensor) and (c.element_size() > r["elem_size"] or kwargs.get("FP8_OUT", False))
    if wide and uses_wgmma(r["capability"], kw["BLOCK_M"], r["elem_size"], r["precision"]):
        smem = max(smem, kw["BLOCK_M"] * kw["BLOCK_N"] * c.element_size())
    return smem


def persistent_epilogue_smem(cfg, out_elem_size: int) -> int:
    """Shared memory a persistent (TMA) launch holds beside its main loop's buffers, which stay
    live through the epilogue (the next tile's loads are in flight): the layout conversion of the
    accumulator (or of a column half with ``EPILOGUE_SPLIT`` 2) for its stores: the whole (half)
    tile of an fp32 output, a 16-bit one in pieces of at most 16384 elements over 8 warps (4096
    over 4, the 64 x 64 tiles; measured, sm_90); ``out_elem_size`` 0: no output tile (the
    cross-entropy statistics reduce theirs in registers: a 64-byte scratch per warp)."""
    kw, warps = (cfg.kwargs, cfg.num_warps) if hasattr(cfg, "kwargs") else (cfg, cfg.get("num_warps", 4))
    if out_elem_size == 0:
        return 64 * warps
    elems = kw["BLOCK_M"] * kw["BLOCK_N"] // kw.get("EPILOGUE_SPLIT", 1)
    return (elems if out_elem_size >= 4 else min(elems, 2048 * warps)) * max(out_elem_size, 2)


def prune_gemm_configs(configs, named_args, **kwargs):
    """The dense GEMM's prune rule: the configs of the launch's load path (and fp8 output), TMA ones
    with their epilogue's shared memory, then :func:`~fusedpar.kernels.runtime.prune_tile_configs`
    with :func:`tile_rule`."""
    a = named_args["a_ptr"]
    fp8_out, tma = (bool(kwargs.get(k, named_args.get(k, False))) for k in ("FP8_OUT", "TMA"))
    configs = [c for c in fp8_output_configs(configs, fp8_out) if getattr(c, "tma", False) == tma
               and not (fp8_out and (c.kwargs["BLOCK_N"] // c.kwargs.get("EPILOGUE_SPLIT", 1)) % 128)]
    if tma:  # the epilogue's shared memory comes on top of the pipelined buffers
        limit = shared_memory_limit(a.device.index or 0)
        configs = [c for c in configs if smem_estimate(c, named_args, **kwargs) <= limit] or configs[-1:]
    if tma and kwargs.get("HAS_RES", named_args.get("HAS_RES", False)):
        # a residual / accumulate tile read beside 128 accumulator elements per thread spilled 8-28 B
        # in the persistent loop (sm_90, 128 x 128 w4, 256 x 128 w8): whole-tile epilogues keep 64
        configs = [c for c in configs if c.kwargs.get("EPILOGUE_SPLIT", 1) == 2
                   or acc_per_thread(c) <= EPILOGUE_ACC_BUDGET["fused"]] or configs[-1:]
    return prune_tile_configs(configs, smem_limit=shared_memory_limit(a.device.index or 0),
                              dims={"BLOCK_M": named_args["M"], "BLOCK_N": named_args["N"]},
                              **tile_rule(named_args, **kwargs))


def tma_tiles_fit(named_args, **kwargs) -> bool:
    """Whether a TMA launch with ``named_args`` / constexpr ``kwargs`` has a tile that
    :func:`prune_gemm_configs` keeps on its merits (within shared memory and the register budgets
    of :func:`tile_rule`), not only as its fallback when none does: a launch whose every TMA tile
    would spill takes pointer loads (a gated epilogue with the e4m3 output over N not a multiple
    of 16 holds 64 accumulator elements per thread in its smallest 1x128-tile TMA tile, against
    the tight budget of 32 that such an epilogue spilled beyond). Memoised per launch kind."""
    kwargs = dict(kwargs, TMA=True)
    a, get = named_args["a_ptr"], lambda k: kwargs.get(k, named_args.get(k))
    key = (tuple(get(k) for k in TUNING_KEY), a.dtype, a.device,
           *(getattr(named_args.get(k), "dtype", None) for k in ("c_ptr", "r_ptr")))
    fits = _TMA_FITS.get(key)
    if fits is None:
        limit, rule = shared_memory_limit(a.device.index or 0), tile_rule(named_args, **kwargs)
        res = bool(get("HAS_RES"))
        fits = any(smem_estimate(c, named_args, **kwargs) <= limit and tile_config_problem(c, smem_limit=limit, **rule)
                   is None and (not res or c.kwargs.get("EPILOGUE_SPLIT", 1) == 2
                                or acc_per_thread(c) <= EPILOGUE_ACC_BUDGET["fused"])
                   for c in prune_gemm_configs(tma_gpu_configs(), named_args, **kwargs))
        if len(_TMA_FITS) >= 4096:
            _TMA_FITS.clear()
        _TMA_FITS[key] = fits
    return fits


_TMA_FITS: dict = {}


#: the autotuner's key: the problem size, every flag :func:`tile_rule` reads and the strides it
#: reads (a launch whose rows lose 16-byte alignment is unpipelined), so that the config tuned for
#: one launch is never reused by a launch whose rule would prune it (a tf32 tile run as "ieee" FMA
#: dots, a plain epilogue's 128-accumulator tile with a fused epilogue, a pipelined tile unpipelined)
TUNING_KEY = ["M", "N", "K", "GLU", "A_K_SPLIT", "HAS_RES", "R_M_SPLIT", "ACT", "STORE_AUX", "INPUT_PRECISION",
              "FP8_OUT", "TMA", "s_am0", "s_am1", "s_ak0", "s_ak1", "s_bk0", "s_bk1", "s_bn"]
