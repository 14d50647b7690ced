"""``python -m benchmarks model``: predict overlapped vs sequential TP times at scale.

From single-GPU figures (GEMM throughput, local copy bandwidth: measured with ``--measure`` on a
GPU, otherwise assumed H800/H100 SXM values that the output labels as assumptions) and a link
description, it predicts, per rank, for ``all_gather_matmul`` and ``matmul_reduce_scatter``:

* ``T_gemm``: ``2 M N K / tp`` FLOP at the GEMM throughput;
* ``T_comm``: the chunk transfers under the NCCL bus-bandwidth model: ``tp - 1`` chunks of
  ``M/tp`` rows, each ``chunk_bytes / busbw + latency``, where busbw is the NVLink bandwidth
  inside one node and ``min(NVLink, per-GPU inter-node)`` as soon as the group spans nodes
  (a ring or hierarchical collective crosses the inter-node links with every chunk);
* ``T_seq = T_comm + T_gemm`` (+ the local reduction for reduce-scatter): the unfused baseline;
* the overlapped time by a discrete-event pipeline over chunks. All-gather: chunk ``i``
  (the local one first) can be multiplied once it has arrived and chunk ``i-1`` is done.
  Reduce-scatter: chunk ``i``'s partial is sent once computed, over one link served in order;
  the own chunk is computed last and summed with the received partials at the end.
  ``persistent`` is the one-launch waiting GEMM (tiles of every chunk share the SMs: a wave
  tail only at the end); ``per_chunk`` is the portable path (one GEMM launch per chunk: a launch
  gap and a wave-quantisation tail per chunk);
* compute during overlap runs ``--contention`` times slower (HBM/SM interference of the
  transfers; 1.0 means none).

Published figures shown beside the prediction: ByteDance Triton-distributed, 8xH800, M=8192:
AG+GEMM 1.30-1.65x, GEMM+RS 1.06-1.58x over PyTorch+NCCL (their README charts, several shapes).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ._common import register

PUBLISHED = {"all_gather_matmul": "1.30-1.65x (8xH800)", "matmul_reduce_scatter": "1.06-1.58x (8xH800)"}

# Assumptions used when nothing is measured (printed with the results):
#   H800/H100 SXM bf16 dense peak 989 TFLOP/s; large cuBLAS GEMMs reach roughly 650-750 of it.
#   HBM3 device-to-device copy ~ 2.6 TB/s of the 3.35 TB/s peak (read + write counted once).
#   NVLink: H800 400 GB/s bidirectional (200 GB/s per direction), H100 900 GB/s (450); a copy
#   engine pull reaches ~80% of it. Inter-node: one 400 Gb/s NIC per GPU ~ 45 GB/s achieved.
PRESETS = {
    "h800": dict(gemm_tflops=700.0, copy_gbps=2600.0, sms=132, nvlink_gbps=160.0, nvlink_latency_us=3.0,
                 internode_gbps=45.0, internode_latency_us=8.0),
    "h100": dict(gemm_tflops=700.0, copy_gbps=2600.0, sms=132, nvlink_gbps=360.0, nvlink_latency_us=3.0,
                 internode_gbps=45.0, internode_latency_us=8.0),
}
TILE_M, TILE_N = 128, 256  # the tile of a large bf16 GEMM (wave-quantisation model)


@dataclass(frozen=True)
class Device:
    gemm_tflops: float  # achieved dense GEMM throughput at the per-rank shape
    copy_gbps: float  # local device-to-device copy bandwidth (the final reduction reads/writes)
    sms: int = 132
    launch_us: float = 5.0  # gap between dependent kernel launches / stream waits


@dataclass(frozen=True)
class Link:
    nvlink_gbps: float  # per GPU, one direction, achieved
    nvlink_latency_us: float
    ranks_per_node: int = 8
    internode_gbps: float = 45.0  # per GPU, one direction, achieved
    internode_latency_us: float = 8.0

    def busbw(self, tp: int) -> tuple[float, float]:
        """(bandwidth GB/s, latency us) a chunk transfer sees in a group of ``tp`` ranks."""
        if tp <= self.ranks_per_node:
            return self.nvlink_gbps, self.nvlink_latency_us
        return min(self.nvlink_gbps, self.internode_gbps), max(self.nvlink_latency_us, self.internode_latency_us)


def _wave_efficiency(tiles: int, sms: int) -> float:
    """Useful fraction of the SM-time of a launch with ``tiles`` equal tiles."""
    waves = max(1, math.ceil(tiles / sms))
    return tiles / (waves * sms)


def _tiles(rows: int, cols: int) -> int:
    return math.ceil(rows / TILE_M) * math.ceil(cols / TILE_N)


def ag_pipeline(arrivals: list[float], compute: list[float]) -> float:
    """Finish time of chunk GEMMs run in order, each after its chunk arrived and the previous
    chunk's GEMM finished."""
    t = 0.0
    for a, c in zip(arrivals, compute):
        t = max(t, a) + c
    return t


def rs_pipeline(compute: list[float], transfer: list[float]) -> float:
    """Chunks computed back to back; chunk ``i``'s transfer starts when it is computed and the
    link finished the previous transfer. Returns when the last transfer and compute are done."""
    t_compute, t_link = 0.0, 0.0
    for c, x in zip(compute, transfer):
        t_compute += c
        t_link = max(t_link, t_compute) + x
    return max(t_link, t_compute)


def predict(op: str, M: int, N: int, K: int, tp: int, dev: Device, link: Link, *, elem_bytes: int = 2,
            contention: float = 1.0) -> dict:
    """Per-rank times (ms) of ``op`` ("all_gather_matmul" or "matmul_reduce_scatter") at tp
    ranks: the full problem is ``[M, K] @ [K, N]``. All-gather: each rank owns N/tp output
    columns and gathers M/tp-row input chunks. Reduce-scatter: each rank owns K/tp of the
    contraction and reduce-scatters an ``[M, N]`` partial into M/tp-row chunks."""
    if op not in PUBLISHED:
        raise ValueError(f"op must be one of {sorted(PUBLISHED)}, got {op!r}")
    for name, v in (("M", M), ("N", N), ("K", K)):
        if v <= 0 or v % tp:
            raise ValueError(f"{name}={v} must be positive and divisible by tp={tp}")
    if contention < 1.0:
        raise ValueError(f"contention is a slowdown factor >= 1, got {contention}")
    rows = M // tp
    if op == "all_gather_matmul":
        n_loc, k_loc, chunk_bytes = N // tp, K, rows * K * elem_bytes
    else:
        n_loc, k_loc, chunk_bytes = N, K // tp, rows * N * elem_bytes
    flops = 2.0 * M * n_loc * k_loc
    t_gemm = flops / (dev.gemm_tflops * 1e12) * 1e3
    bw, lat = link.busbw(tp)
    t_xfer = chunk_bytes / (bw * 1e9) * 1e3 + lat * 1e-3
    t_comm = (tp - 1) * t_xfer
    g = t_gemm / tp  # one chunk's share at full-GPU efficiency
    g_ov = g * contention
    # per-chunk launches: each chunk's GEMM pays its own wave tail and a launch/stream-wait gap
    chunk_eff = _wave_efficiency(_tiles(rows, n_loc), dev.sms) / _wave_efficiency(_tiles(M, n_loc), dev.sms)
    g_chunk = g_ov / min(1.0, chunk_eff) + dev.launch_us * 1e-3
    if op == "all_gather_matmul":
        arrivals = [0.0] + [i * t_xfer for i in range(1, tp)]  # local chunk first
        t_seq = t_comm + t_gemm
        t_pers = ag_pipeline(arrivals, [g_ov] * tp)
        t_chunk = ag_pipeline(arrivals, [g_chunk] * tp)
        t_reduce = 0.0
    else:
        # partial chunks for the peers first, own chunk last; received partials summed at the end
        t_reduce = tp * chunk_bytes / (dev.copy_gbps * 1e9) * 1e3
        t_seq = t_gemm + t_comm + t_reduce
        xfers = [t_xfer] * (tp - 1) + [0.0]
        t_pers = rs_pipeline([g_ov] * tp, xfers) + t_reduce
        t_chunk = rs_pipeline([g_chunk] * tp, xfers) + t_reduce
    if t_comm > 1.2 * t_gemm:
        bound = "comm"
    elif t_gemm > 1.2 * t_comm:
        bound = "compute"
    else:
        bound = "balanced"
    return dict(
        op=op, tp=tp, M=M, N=N, K=K, chunk_MB=chunk_bytes / 1e6, busbw_GBps=bw,
        T_gemm_ms=t_gemm, T_comm_ms=t_comm, T_seq_ms=t_seq,
        T_persistent_ms=t_pers, T_per_chunk_ms=t_chunk,
        speedup_persistent=t_seq / t_pers, speedup_per_chunk=t_seq / t_chunk,
        bound=bound, published=PUBLISHED[op] if tp == 8 else "-",
    )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _add_args(p):
    p.add_argument("--preset", choices=sorted(PRESETS), default="h800",
                   help="assumed device + link figures (default h800, the published anchor's machine)")
    p.add_argument("--measure", action="store_true",
                   help="on a GPU: measure GEMM TFLOP/s (torch.matmul, bf16, per-rank shape) and local copy GB/s")
    p.add_argument("--gemm-tflops", type=float, default=None)
    p.add_argument("--copy-gbps", type=float, default=None)
    p.add_argument("--nvlink-gbps", type=float, default=None, help="per GPU per direction, achieved")
    p.add_argument("--nvlink-latency-us", type=float, default=None)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--internode-gbps", type=float, default=None, help="per GPU per direction, achieved")
    p.add_argument("--tokens", type=int, default=8192, help="M")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--tp", type=int, nargs="+", default=[8, 16], help="group sizes (16 = 2 nodes x 8)")
    p.add_argument("--contention", type=float, default=1.0,
                   help="compute slowdown while transfers run (copy engines: ~1.0-1.1)")


def _measure(ctx, M, N, K):
    import torch

    a = torch.randn(M, K, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=ctx.device, dtype=torch.bfloat16)
    ms = ctx.time_ms(lambda: a @ b)
    src = torch.empty(256 << 20, device=ctx.device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms_copy = ctx.time_ms(lambda: dst.copy_(src))
    return 2.0 * M * N * K / (ms * 1e-3) / 1e12, src.numel() / (ms_copy * 1e-3) / 1e9


@register("model", "scale model: predicted overlapped vs sequential TP at 8 and 2x8 GPUs", add_args=_add_args)
def run(args, ctx):
    preset = dict(PRESETS[args.preset])
    source = f"assumed {args.preset.upper()} SXM figures (not measured)"
    if args.measure:
        if not ctx.gpu:
            raise SystemExit("--measure needs a GPU; on CPU the model uses the preset/flag figures")
        tflops, copy = _measure(ctx, args.tokens, args.ffn // 8, args.hidden)
        preset.update(gemm_tflops=tflops, copy_gbps=copy)
        source = f"measured on this GPU: GEMM {tflops:.0f} TFLOP/s, copy {copy:.0f} GB/s; link figures assumed"
    for key in ("gemm_tflops", "copy_gbps", "nvlink_gbps", "nvlink_latency_us", "internode_gbps"):
        v = getattr(args, key)
        if v is not None:
            preset[key] = v
            source += f"; {key}={v} from the command line"
    dev = Device(gemm_tflops=preset["gemm_tflops"], copy_gbps=preset["copy_gbps"], sms=preset["sms"])
    link = Link(nvlink_gbps=preset["nvlink_gbps"], nvlink_latency_us=preset["nvlink_latency_us"],
                ranks_per_node=args.ranks_per_node, internode_gbps=preset["internode_gbps"],
                internode_latency_us=preset["internode_latency_us"])
    rows = []
    for tp in args.tp:
        # Llama-70B-like MLP: up projection all-gathers hidden -> ffn, down projection reduce-scatters
        for op, N, K in (("all_gather_matmul", args.ffn, args.hidden), ("matmul_reduce_scatter", args.hidden, args.ffn)):
            try:
                r = predict(op, args.tokens, N, K, tp, dev, link, contention=args.contention)
            except ValueError as e:
                raise SystemExit(f"model: {e}") from None
            r["gpus"] = f"{tp // args.ranks_per_node}x{args.ranks_per_node}" if tp > args.ranks_per_node else str(tp)
            rows.append(r)
    ctx.notes.append(f"inputs: {source}; device {asdict(dev)}; link {asdict(link)}")
    ctx.notes.append("published (Triton-distributed README, 8xH800, M=8192, several shapes): "
                     "AG+GEMM 1.30-1.65x, GEMM+RS 1.06-1.58x over PyTorch+NCCL")
    return rows
