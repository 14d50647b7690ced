"""The grouped GEMMs' tile configurations and prune rules (``_grouped_gemm_kernel`` /
``_grouped_wgrad_kernel`` of :mod:`.grouped_gemm`): the candidates of each kind (16/32-bit
pointer loads, TMA, e4m3), the interpreter's fixed tiles, the register budgets per epilogue and
MMA kind, the shared-memory estimates, the autotuners' keys."""
from __future__ import annotations

import triton

from .fp8_gemm_configs import GROUPED_FP8_ACC_BUDGET, fp8_configs_of_kind, fp8_grouped_configs
from .runtime import (acc_budget_for, aligned, device_capability, pipelined, prune_tile_configs, shared_memory_limit,
                      tile_smem_bytes)

__all__ = ["GROUPED_ACC_BUDGET", "GROUPED_SYNC_ACC_BUDGET", "INTERPRETER_GEMM_CONFIG", "INTERPRETER_WGRAD_CONFIG",
           "TUNING_KEY", "WGRAD_TUNING_KEY", "gemm_gpu_configs", "prune_grouped", "prune_grouped_wgrad",
           "smem_estimate", "tile_rule", "wgrad_gpu_configs", "wgrad_smem_estimate", "wgrad_tile_rule"]


INTERPRETER_GEMM_CONFIG = INTERPRETER_WGRAD_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)


def _configs(tiles) -> list:
    return [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=stages, num_warps=warps)
            for bm, bn, bk, stages, warps in tiles]


def gemm_gpu_configs():
    """The forward / data-gradient candidates: the 16/32-bit pointer-load tiles, the fp8 ones, then
    the TMA tiles (``cfg.tma``; 64-deep 16-bit steps, 128-deep e4m3 ones); each launch's prune rule
    keeps its kind."""
    tma = _configs([(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (128, 64, 64, 4, 8), (64, 128, 64, 4, 4),
                    (64, 128, 64, 4, 8), (64, 64, 64, 4, 4)])
    tma_fp8 = _configs([(128, 128, 128, 4, 8), (128, 64, 128, 4, 8), (64, 128, 128, 4, 4), (64, 128, 128, 4, 8),
                        (64, 64, 128, 4, 4)])
    for cfg in tma + tma_fp8:
        cfg.tma = True
    for cfg in tma_fp8:
        cfg.fp8 = True
    return _configs([(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
                     (128, 64, 64, 4, 8), (64, 128, 64, 4, 8), (64, 64, 32, 4, 4), (32, 64, 32, 4, 4),
                     (64, 64, 64, 4, 4), (64, 256, 32, 4, 4), (32, 64, 64, 5, 2), (16, 64, 64, 4, 4)]) + \
        fp8_grouped_configs() + tma + tma_fp8


def wgrad_gpu_configs():
    """The weight-gradient candidates (16/32-bit, then fp8)."""
    return _configs([(64, 128, 128, 3, 8), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (32, 64, 64, 4, 4),
                     (64, 64, 64, 4, 4)]) + fp8_grouped_configs(wgrad=True)


#: fp32 accumulator elements per thread without spills (``python -m benchmarks compile``, sm_90
#: and sm_80): plain epilogue 128; forward activation / gated pair / pre-activation store 64; the
#: fused activation backward (``DACT``: loads the gate and up pre-activations, forms act and act')
#: 32 (fp8 launches: :data:`~fusedpar.kernels.fp8_gemm.GROUPED_FP8_ACC_BUDGET`).
GROUPED_ACC_BUDGET = {"plain": 128, "fused": 64, "dact": 32}
#: the same for dots lowered to mma.sync (sm_80, tiles under 64 rows), whose operand fragments are
#: held in registers too: a plain 128 spills 4-8 B on sm_80 (the group lookup is live as well); a
#: fused epilogue whose loads do not vectorise fits 32
GROUPED_SYNC_ACC_BUDGET = {"plain": 64, "fused": 64, "dact": 32, "fused unaligned": 32}


def tile_rule(named_args: dict, **kwargs) -> dict:
    """The prune rule's parameters (:func:`~fusedpar.kernels.runtime.tile_config_problem`) of a
    grouped forward / data-gradient launch."""
    def get(k, default=False):
        return kwargs.get(k, named_args.get(k, default))

    x, dact, fp8 = named_args["x_ptr"], bool(get("DACT")), bool(get("FP8"))
    glu = bool(get("GLU")) and not dact  # the backward reads the up half from aux, one B tile
    kind = "dact" if dact else "fused" if glu or get("ACT", 0) != 0 or get("STORE_AUX") else "plain"
    precision = get("INPUT_PRECISION", "ieee")
    extents = [e for e in (named_args.get(k, 16) for k in ("K", "s_xm", "s_xk", "s_wn", "s_wk")) if e != 1]
    if named_args.get("s_wn") == 1:  # "kn" weights: the masked N is the contiguous dim
        extents.append(named_args["N"])
    unaligned = not fp8 and (named_args["K"] % 64 != 0 or not aligned(x.element_size(), *extents))
    sync = GROUPED_SYNC_ACC_BUDGET["fused unaligned" if kind == "fused" and unaligned else kind]
    acc_tiles = (2 if glu else 1) * (2 if fp8 else 1)
    cap = dict(elem_size=x.element_size(), precision=precision, acc_tiles=acc_tiles)
    budget = (GROUPED_FP8_ACC_BUDGET if fp8 else GROUPED_ACC_BUDGET)[kind]
    return dict(elem_size=x.element_size(), b_tiles=2 if glu else 1, acc_tiles=acc_tiles,
                acc_budget=acc_budget_for(budget, **cap), sync_acc_budget=acc_budget_for(sync, **cap, sync=True),
                capability=device_capability(x.device.index or 0), precision=precision,
                unaligned=unaligned and not get("TMA"), pipelined=bool(get("TMA")) or pipelined(x.element_size(), *extents))


def wgrad_tile_rule(named_args: dict, **kwargs) -> dict:
    """The prune rule's parameters of a grouped weight-gradient launch: its dot is
    ``dy^T [BLOCK_N, BLOCK_M] @ x [BLOCK_M, BLOCK_K]`` (the rows block is the contraction); the
    loads are masked along N and K, their contiguous dims (fp8: along the rows)."""
    dy = named_args["dy_ptr"]
    extents = [e for e in (named_args.get(k, 16) for k in ("N", "K", "s_dm", "s_dn", "s_xm", "s_xk")) if e != 1]
    return dict(elem_size=dy.element_size(), b_tiles=1, capability=device_capability(dy.device.index or 0),
                precision=kwargs.get("INPUT_PRECISION", named_args.get("INPUT_PRECISION", "ieee")),
                dims=("BLOCK_N", "BLOCK_K", "BLOCK_M"), pipelined=pipelined(dy.element_size(), *extents))


def smem_estimate(cfg, named_args, **kwargs) -> int:
    """The prune rule's shared-memory bytes of a grouped forward / dgrad config."""
    r = tile_rule(named_args, **kwargs)
    return tile_smem_bytes(cfg, elem_size=r["elem_size"], b_tiles=r["b_tiles"], capability=r["capability"],
                           precision=r["precision"], pipelined=r["pipelined"])


def wgrad_smem_estimate(cfg, named_args, **kwargs) -> int:
    """The prune rule's shared-memory bytes of a grouped weight-gradient config."""
    return tile_smem_bytes(cfg, **wgrad_tile_rule(named_args, **kwargs))


def prune_grouped(configs, named_args, **kwargs):
    """The forward / data-gradient prune rule (:func:`tile_rule` over the launch's kind)."""
    x, rule = named_args["x_ptr"], tile_rule(named_args, **kwargs)
    tma = bool(kwargs.get("TMA", named_args.get("TMA", False)))
    configs = [c for c in configs if getattr(c, "tma", False) == tma]
    return prune_tile_configs(fp8_configs_of_kind(configs, named_args, kwargs, rule["pipelined"]),
                              smem_limit=shared_memory_limit(x.device.index or 0),
                              dims={"BLOCK_N": named_args["N"], "BLOCK_K": named_args["K"]}, **rule)


def prune_grouped_wgrad(configs, named_args, **kwargs):
    """The weight-gradient prune rule (:func:`wgrad_tile_rule`)."""
    r = wgrad_tile_rule(named_args, **kwargs)
    fp8 = bool(kwargs.get("FP8", named_args.get("FP8", False)))
    configs = fp8_configs_of_kind(configs, named_args, kwargs, r["pipelined"])
    r["tile_dims"] = r.pop("dims")
    budget = acc_budget_for(GROUPED_FP8_ACC_BUDGET["wgrad"] if fp8 else GROUPED_ACC_BUDGET["plain"],
                            elem_size=r["elem_size"], precision=r["precision"])
    return prune_tile_configs(configs, smem_limit=shared_memory_limit(named_args["dy_ptr"].device.index or 0),
                              dims={"BLOCK_N": named_args["N"], "BLOCK_K": named_args["K"]},
                              acc_tiles=2 if fp8 else 1, acc_budget=budget, **r)


#: the autotuners' keys: the problem size and every flag and stride the prune rules (:func:`tile_rule`,
#: :func:`wgrad_tile_rule`) read, so that a config tuned for one launch is never reused by a launch
#: whose rule would prune it (a tf32 tile run as "ieee" FMA dots, a plain tile with a fused one, fp8,
#: a pipelined tile whose rows lose 16-byte alignment)
TUNING_KEY = ["N", "K", "G", "ACT", "GLU", "DACT", "HAS_BIAS", "STORE_AUX", "INPUT_PRECISION", "FP8", "BLOCKWISE",
              "TMA", "s_xm", "s_xk", "s_wn", "s_wk"]
WGRAD_TUNING_KEY = ["N", "K", "G", "ACCUMULATE", "INPUT_PRECISION", "FP8", "s_dm", "s_dn", "s_xm", "s_xk"]
