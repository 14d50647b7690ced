"""The persistent GEMM's tile configuration (:mod:`.persistent_gemm`): a fixed config per dtype
(:func:`gpu_config`, never autotuned: a tuning run would consume flags and double-count
counters), the config a launch uses (:func:`kernel_config`), the checks of a ``config=`` passed
in (:func:`check_config`), the size of the persistent grid (:func:`default_num_programs`), the
load path of a launch (:func:`tma_weight_major`) and the shared memory of its main loop
(:func:`smem_estimate`, what the compile check compares with the compiler's)."""
from __future__ import annotations

import torch

from .fp8_gemm import FP8_INTERPRETER_CONFIG
from .gemm import EPILOGUE_ACC_BUDGET, INTERPRETER_CONFIG, LinearOperands, tile_rule
from .gemm import smem_estimate as gemm_smem_estimate
from .gemm_loads import tma_capable, tma_layout
from .runtime import (RowView, input_precision, interpreting, multiprocessor_count, shared_memory_limit,
                      tile_config_problem)

__all__ = ["CONFIG_KEYS", "INTERPRETER_PROGRAMS", "check_config", "default_num_programs", "gpu_config",
           "kernel_config", "smem_estimate", "tma_weight_major"]

# Programs of one interpreted launch: small, but more than one so that the persistent loop
# (several tiles per program, strided by the grid size) is exercised.
INTERPRETER_PROGRAMS = 3


def gpu_config(n: int, dtype: torch.dtype, glu: bool = False) -> dict:
    """A fixed tile configuration for the compiled kernel. Not autotuned: a tuning run of a
    kernel that waits on flags or bumps completion counters would consume or corrupt them;
    benchmarks/persistent.py sweeps configs with waits off and passes the best one in.
    Pipelined shared memory stays under ~150 KB (Hopper/Ampere allow 227/163 KB); the
    accumulators stay within the GEMM epilogue budgets (a gated epilogue holds two)."""
    if dtype == torch.float8_e4m3fn:  # 128-deep K steps (a scale block); two accumulators each: dot and fp32 sum
        return dict(BLOCK_M=128, BLOCK_N=64 if glu else 128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    if dtype == torch.float32:  # FMA dots ("ieee"): <= 32 accumulator elements per thread in all, BLOCK_K 32
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
    if glu:
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    # 128x256 (128 accumulator elements per thread) spills 44 B in the persistent loop on sm_80
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def default_num_programs(device: torch.device, reserve: int = 0) -> int:
    """Programs of a persistent launch: one per SM (minus ``reserve`` SMs left free for
    concurrent kernels such as :func:`chunk_reduce`), a few under the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, multiprocessor_count(index) - reserve)


def kernel_config(config, n, dtype, glu=False):
    """The tile configuration a launch with ``config`` uses (the interpreter keeps its small fixed
    tiles unless ``config`` names block sizes); :func:`tiles_per_chunk` of it is what a
    ``signal_counters`` launch adds to every counter."""
    base = FP8_INTERPRETER_CONFIG if dtype == torch.float8_e4m3fn else INTERPRETER_CONFIG  # fp8: fp8_matmul's
    cfg = dict(base) if interpreting() else dict(config or gpu_config(n, dtype, glu))
    if config is not None and interpreting():
        cfg.update({k: v for k, v in config.items() if k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")})
    return cfg


CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def check_config(config: dict, a: torch.Tensor, ops: LinearOperands, store_aux: bool) -> None:
    """A ``config=`` of :func:`persistent_matmul` (compiled path): every key of
    :data:`CONFIG_KEYS` a positive int (block sizes and ``num_warps`` powers of two, ``BLOCK_K >=
    16``; ``num_warps`` / ``num_stages`` default to 4 / 3), and the autotuned GEMM's
    prune rule (:func:`~fusedpar.kernels.gemm.tile_rule`) finds nothing: the pipelined tiles fit
    this GPU's shared memory and the accumulators fit in registers, on pointer loads (a launch
    takes TMA only where its config also passes TMA's rule: :func:`config_problem`). ValueError
    otherwise."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict of {', '.join(CONFIG_KEYS)} or None, got {type(config).__name__}")
    config = dict(config)
    config.setdefault("num_warps", 4)  # Triton's defaults
    config.setdefault("num_stages", 3)
    for key in CONFIG_KEYS:
        v = config.get(key)
        pow2 = key.startswith("BLOCK_") or key == "num_warps"
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (pow2 and v & (v - 1)):
            raise ValueError(f"config[{key!r}] must be a positive {'power of two' if pow2 else 'int'}, got {v!r}")
    if config["BLOCK_K"] < 16:
        raise ValueError(f"config['BLOCK_K'] must be >= 16 (tl.dot), got {config['BLOCK_K']}")
    if a.device.type == "cpu":  # CPU tensors run interpreted: no GPU resources to check
        return
    problem = config_problem(config, a, ops, store_aux)
    if problem:
        tile = "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        raise ValueError(f"config must fit the GPU, got {tile} with {config['num_warps']} warps and "
                         f"{config['num_stages']} stages, which {problem}")


def config_problem(config: dict, a: torch.Tensor, ops: LinearOperands, store_aux: bool,
                   tma: bool = False) -> str | None:
    """Why the compiled kernel cannot run ``config`` well on this GPU (None if it can), by the
    autotuned GEMM's prune rule for a launch loading by pointers or (``tma``) by TMA."""
    args = {"a_ptr": a, "GLU": ops.glu, "ACT": ops.act, "STORE_AUX": store_aux, "K": ops.k, "s_am1": a.stride(-2),
            "s_ak": a.stride(-1), "s_bk": ops.s_bk, "s_bn": ops.s_bn, "INPUT_PRECISION": input_precision(a.dtype)}
    rule = tile_rule(dict(args, N=ops.n), TMA=True) if tma else tile_rule(args)
    if a.dtype == torch.float8_e4m3fn:  # each accumulator twice (the step's dot, the fp32 sum), the fp8 GEMM's
        # budget (sm_90: 128x128x128, gated 128x64x128, 8 warps: 205-238 registers, no spills); fp8 loads that do
        # not vectorise spill at every tile (60-3700 B at K=200): a speed matter, not refused
        rule.update(acc_tiles=2 * rule["acc_tiles"], acc_budget=EPILOGUE_ACC_BUDGET["plain"], sync_acc_budget=None,
                    unaligned=False)
    return tile_config_problem(config, smem_limit=shared_memory_limit(a.device.index or 0), **rule)


def tma_weight_major(a, weight, ops, wait_mode, fp8, cfg, store_aux):
    """Whether a launch of :func:`~.persistent_gemm.persistent_matmul` (chunked view ``a``) loads by
    TMA (:mod:`.gemm_loads`), and how: None (pointer loads), else
    whether the weight is contiguous along K. Only without flag waits (an acquire does not order
    a descriptor's load after it: that needs a proxy fence, not tested on hardware yet), with A's
    chunks one 2-D stack (chunks back to back; a split ``[batch, seq-chunk]`` view where the
    activation's ``[batch, seq]`` rows are one stride and a chunk's rows per batch a multiple of
    the tile's) contiguous along K, what a descriptor takes of A and the weight (e4m3: both contiguous along K), and,
    compiled, where the tile config ``cfg`` passes TMA's prune rule too (a fused epilogue over N
    not a multiple of 16 holds fewer accumulators there: :func:`config_problem`)."""
    C, rows = a.shape[0], int(torch.Size(a.shape[1:-1]).numel())
    if wait_mode != "none" or not C or not tma_capable(a.device, a.element_size()):
        return None
    a_r = RowView.rows(a[0])
    if a_r.split:  # [batch, seq-chunk]: one 2-D [batch * seq, K] tensor, a tile within one batch's chunk
        if a.stride(0) != a_r.inner * a_r.s_inner or a_r.s_outer != C * a_r.inner * a_r.s_inner \
                or a_r.inner % cfg["BLOCK_M"]:
            return None
    elif C > 1 and a.stride(0) != rows * a_r.s_inner:
        return None
    if C * rows >= 2 ** 31:
        return None
    majors = tma_layout(a, a_r.s_inner, a.stride(-1), weight, ops.s_bk, ops.s_bn, (C * rows, ops.n_w, ops.k),
                        k_major=fp8, up_offset=ops.n if ops.glu else 0)
    if majors is None or not majors[0]:
        return None
    if not interpreting() and config_problem(cfg, a, ops, store_aux, tma=True):
        return None
    return majors[1]


def smem_estimate(cfg, named_args, **kwargs) -> int:
    """The shared memory of a launch's main loop (:func:`~.gemm_configs.smem_estimate` without a
    persistent epilogue's tile: the tile loop is not flattened, so no next tile's buffers stay live
    beside the epilogue, whatever the load path)."""
    return gemm_smem_estimate(cfg, named_args, **dict(kwargs, TMA=False))
