"""``python -m benchmarks persistent_ag`` / ``persistent_rs``: the shipped in-kernel-wait schedules
(:mod:`fusedpar.ops.comm.symmetric`: one persistent GEMM waiting per chunk) on one GPU through
``EmulatedTransport(in_kernel_waits=True)``, against the sequential baseline and the shipped
portable schedule (one GEMM launch per chunk, through ``EmulatedTransport``).

One GPU plays one tensor-parallel rank; every peer mirrors it, so the transfers are
device-to-device copies of the same bytes on a side stream. ``--copy-repeat r`` copies every
chunk ``r`` times, i.e. emulates a link ``r`` times slower than a local copy, and ``--link-gbps
B`` picks ``r`` from the measured local copy bandwidth so that the emulated link runs at about
``B`` GB/s (e.g. 360 for H100 NVLink); the emulated link bandwidth is printed. Rows report:

* ``T_gemm``: the GEMM alone on already-gathered data (cuBLAS ``torch.matmul``, and our
  persistent kernel without waits, on pointer loads as the waiting kernel loads);
* ``T_comm``: the chunk copies alone;
* ``T_seq``: copies, then one cuBLAS GEMM (what ``all_gather`` + ``matmul`` does);
* ``T_per_chunk``: ``fusedpar.ops.all_gather_matmul`` on the portable schedule: one fused-GEMM
  launch per chunk, each after its chunk's transfer;
* ``T_persistent``: :func:`~fusedpar.ops.tensor_parallel.symmetric.all_gather_matmul_symmetric`: one persistent
  GEMM whose tiles wait on the per-chunk flags raised by the copy stream (``cuStreamWriteValue32``);
* ``overlap_eff = (T_gemm + T_comm - T_persistent) / min(T_gemm, T_comm)``;
* ``loads``: how the op's persistent GEMM loads its operands (``"pointer"`` for the waiting
  all-gather GEMM; the reduce-scatter's, without waits, ``"tma"`` on sm_90).

``--fp8 rowwise|blockwise`` (default rowwise on a GPU; needs fp8 tensor cores): the fp8 all-gather
``fusedpar.ops.all_gather_matmul(..., fp8=recipe)`` (forward, no grad) on both transports:
``T_persistent_fp8`` the persistent fp8 GEMM waiting on e4m3 shards and scales,
``T_per_chunk_fp8`` the fp8 ring; each checked against the other's result (the same quantisation
and chunk GEMMs) before timing, ``fp8_speedup_vs_per_chunk`` and ``fp8_speedup_vs_bf16``
(``T_persistent / T_persistent_fp8``). ``persistent_rs --fp8`` likewise times
``fusedpar.ops.matmul_reduce_scatter(..., fp8=recipe)`` on both transports (the signalling fp8 GEMM
and the reduction, against the fp8 ring), its columns on the row of the last ``--reduce-sms``;
both fp8 schedules run the op's default tile and reduction SMs (``RS_REDUCE_SMS``), so
``fp8_speedup_vs_bf16`` compares them with the swept bf16 tile of that row.

Reduce-scatter: ``T_seq`` is the cuBLAS GEMM of all partials, then copies of the ``P - 1``
partials of this rank's chunk (the transfer) and their sum; ``T_per_chunk`` the portable ring of
``fusedpar.ops.matmul_reduce_scatter``; ``T_persistent``
:func:`~fusedpar.ops.tensor_parallel.symmetric.matmul_reduce_scatter_symmetric`: the signalling GEMM with a
``chunk_reduce`` on ``--reduce-sms`` SMs, one row per value. In the emulation the reduction reads
the partials from local memory (a real rank reads them over NVLink).

Target (issue 7): at M=8192, hidden 8192, tp=8, bf16, the persistent AG at least 1.4x faster
than the sequential copy-then-GEMM and faster than the per-chunk path.
"""
from __future__ import annotations

from ._common import check_close, parse_dtype, register, tflops

# per-rank output features at tp=8: hidden 8192 -> 1024, ffn 28672 -> 3584
GPU_N = [1024, 3584]
SMOKE = dict(tokens=24, hidden=32, n=[20], tp=3)
SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
]


def _add_common(p):
    p.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--tokens", type=int, default=None, help="M (all ranks together); GPU default 8192")
    p.add_argument("--hidden", type=int, default=None, help="K of the AG GEMM / N of the RS GEMM; default 8192")
    p.add_argument("--n", type=int, nargs="+", default=None,
                   help="per-rank output features (AG) or per-rank contraction (RS); default 1024 3584")
    p.add_argument("--tp", type=int, default=None, help="ranks emulated (chunks); default 8")
    p.add_argument("--no-sweep", action="store_true", help="use the default tile config instead of sweeping")


def _add_ag_args(p):
    _add_common(p)
    _add_fp8(p)
    link = p.add_mutually_exclusive_group()
    link.add_argument("--copy-repeat", type=int, default=1,
                      help="copy every chunk this many times: a link this many times slower than a local copy")
    link.add_argument("--link-gbps", type=float, default=None,
                      help="emulate a link of about this bandwidth (sets --copy-repeat from a measured copy)")


def _add_fp8(p):
    p.add_argument("--fp8", choices=["none", "rowwise", "blockwise"], default=None,
                   help="also time the op with this fp8 recipe on both schedules (default: rowwise on a GPU with "
                        "fp8 tensor cores, else none)")


def _add_rs_args(p):
    _add_common(p)
    _add_fp8(p)
    p.add_argument("--reduce-sms", type=int, nargs="+", default=None,
                   help="SMs of the concurrent chunk_reduce (one row each); GPU default 8 16 32")
    p.add_argument("--partial-dtype", choices=["fp32", "same"], default="fp32",
                   help="dtype of the partials (fp32, or the input dtype: half the bytes)")


def _setup(args, ctx):
    import torch

    dtype = args.dtype or (torch.bfloat16 if ctx.gpu else torch.float32)
    if ctx.smoke:
        tokens, hidden, ns, tp = (args.tokens or SMOKE["tokens"], args.hidden or SMOKE["hidden"],
                                  args.n or SMOKE["n"], args.tp or SMOKE["tp"])
    else:
        tokens, hidden, ns, tp = args.tokens or 8192, args.hidden or 8192, args.n or GPU_N, args.tp or 8
    if tokens % tp:
        raise SystemExit(f"--tokens {tokens} must be divisible by --tp {tp}")
    if getattr(args, "copy_repeat", 1) < 1:
        raise SystemExit(f"--copy-repeat must be >= 1, got {args.copy_repeat}")
    return dtype, tokens, hidden, ns, tp


def _best_config(ctx, run_with):
    """Fastest tile config of the persistent kernel with waits off (tuning a waiting kernel
    would consume its flags; see kernels/persistent_gemm.gpu_config)."""
    if ctx.smoke:
        return None, 0.0
    best = None
    for cfg in SWEEP:
        try:
            ms = ctx.time_ms(lambda: run_with(cfg))
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
            ctx.notes.append(f"config {cfg} skipped: {type(e).__name__}")
            continue
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best


def _copy_chunks(gathered, shard, order, repeat):
    """The transfers alone: every peer's chunk (a mirror of ``shard``) copied ``repeat`` times."""
    for c in order:
        for _ in range(repeat):
            gathered[c].copy_(shard)


def _link_repeat(args, ctx, copies, chunk_bytes, P):
    """``--copy-repeat``, or the repeat that makes the emulated link about ``--link-gbps``."""
    if args.link_gbps is None or not ctx.gpu:
        return args.copy_repeat
    t1 = ctx.time_ms(copies)
    local = (P - 1) * chunk_bytes / (t1 * 1e-3) / 1e9
    repeat = max(1, round(local / args.link_gbps))
    ctx.notes.append(f"local copy {local:.0f} GB/s: each chunk copied {repeat}x to emulate ~{args.link_gbps} GB/s")
    return repeat


def _ag_row(tokens, N, K, P, dtype, repeat, chunk_bytes, times, err, cfg):
    t_gemm, t_comm, t_pers = times["T_gemm_cublas_ms"], times["T_comm_ms"], times["T_persistent_ms"]
    return {
        "M": tokens, "N_local": N, "K": K, "tp": P, "dtype": str(dtype).replace("torch.", ""), "copy_repeat": repeat,
        "emulated_link_GBps": (P - 1) * chunk_bytes / (t_comm * 1e-3) / 1e9 if t_comm > 0 else float("nan"),
        **times,
        "speedup_vs_seq": times["T_seq_ms"] / t_pers, "speedup_vs_per_chunk": times["T_per_chunk_ms"] / t_pers,
        "overlap_eff": (t_gemm + t_comm - t_pers) / min(t_gemm, t_comm),
        "TFLOPs_persistent": tflops(2.0 * tokens * N * K, t_pers), "max_rel_err": err, "config": _cfg_name(cfg),
    }


@register("persistent_ag", "persistent waiting AG GEMM (single-GPU emulation) vs sequential and per-chunk",
          add_args=_add_ag_args)
def run_ag(args, ctx):
    import torch

    from fusedpar.kernels import chunk_view, gemm_loads, persistent_matmul
    from fusedpar.ops import all_gather_matmul
    from fusedpar.ops.tensor_parallel.symmetric import all_gather_matmul_symmetric
    from fusedpar.ops.comm.transport import EmulatedTransport

    dtype, tokens, K, ns, P = _setup(args, ctx)
    rank, rows = 0, tokens // P
    order = [(rank + i) % P for i in range(1, P)]
    rows_out = []
    for N in ns:
        x = torch.randn(1, rows, K, device=ctx.device, dtype=dtype)  # this rank's shard; every peer's too
        w = torch.randn(N, K, device=ctx.device, dtype=dtype) * K ** -0.5
        gathered = x.unsqueeze(0).repeat(P, 1, 1, 1)
        out = torch.empty(1, tokens, N, device=ctx.device, dtype=dtype)
        full = torch.cat([x] * P, dim=1)
        # the sweep (waits off) on pointer loads, as the waiting GEMM loads (kernels/persistent_gemm.py)
        with gemm_loads.load_path_set("pointer"):
            best = None if args.no_sweep else _best_config(ctx, lambda cfg: persistent_matmul(
                gathered, w, out=chunk_view(out, 1, P), wait_mode="none", config=cfg))
        cfg = best[0] if best else None
        chunk_bytes = rows * K * x.element_size()
        repeat = _link_repeat(args, ctx, lambda: _copy_chunks(gathered, x, order, 1), chunk_bytes, P)
        symm = EmulatedTransport(P, rank, copy_repeat=repeat, in_kernel_waits=True)
        ring = EmulatedTransport(P, rank, copy_repeat=repeat)

        def sequential():
            gathered[rank].copy_(x)
            _copy_chunks(gathered, x, order, repeat)
            return torch.matmul(gathered.permute(1, 0, 2, 3).reshape(1, tokens, K), w.t())

        def per_chunk():
            with torch.no_grad():
                return all_gather_matmul(x, w, transport=ring)

        def persistent():
            return all_gather_matmul_symmetric(x, w, transport=symm, out=out, config=cfg)

        reference = torch.matmul(full, w.t())
        err = check_close(persistent(), reference)
        check_close(per_chunk(), reference)
        check_close(sequential(), reference)
        times = {
            "T_gemm_cublas_ms": ctx.time_ms(lambda: torch.matmul(full, w.t())),
            "T_gemm_persistent_ms": best[1] if best and best[0] is not None else _pointer_ms(
                ctx, lambda: persistent_matmul(gathered, w, out=chunk_view(out, 1, P), wait_mode="none")),
            "T_comm_ms": ctx.time_ms(lambda: _copy_chunks(gathered, x, order, repeat)),
            "T_seq_ms": ctx.time_ms(sequential), "T_per_chunk_ms": ctx.time_ms(per_chunk),
            "T_persistent_ms": ctx.time_ms(persistent),
        }
        rows_out.append(dict(_ag_row(tokens, N, K, P, dtype, repeat, chunk_bytes, times, err, cfg),
                             loads=_persistent_loads(persistent)))
        rows_out[-1].update(_fp8_columns(args, ctx, lambda t, r: all_gather_matmul(x, w, transport=t, fp8=r), symm,
                                         ring, times["T_persistent_ms"]))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed and copies run before the GEMM; "
                         "these numbers are not performance.")
    return rows_out


# bf16 output of the same fp32-accumulated fp8 chunk GEMMs on both schedules: one bf16 rounding
# (2^-8 relative) of each output, plus summation orders of tile configs that may differ
FP8_SCHEDULES_TOL = 2 ** -7


def _fp8_columns(args, ctx, op, symm, ring, t_bf16) -> dict:
    """With ``--fp8``: ``op(transport, recipe)`` (the fp8 form of the row's op) over the in-kernel-
    wait transport (the persistent fp8 GEMM) and over the ring, checked against each other, timed."""
    import torch

    fp8_cores = ctx.gpu and torch.cuda.get_device_capability(ctx.device) >= (8, 9)
    recipe = args.fp8 or ("rowwise" if fp8_cores else "none")
    if recipe == "none":
        return {}

    def run(transport):
        with torch.no_grad():
            return op(transport, recipe)

    err = check_close(run(symm), run(ring), tol=FP8_SCHEDULES_TOL)
    t_symm, t_ring = ctx.time_ms(lambda: run(symm)), ctx.time_ms(lambda: run(ring))
    return {"fp8": recipe, "T_persistent_fp8_ms": t_symm, "T_per_chunk_fp8_ms": t_ring,
            "fp8_speedup_vs_per_chunk": t_ring / t_symm, "fp8_speedup_vs_bf16": t_bf16 / t_symm, "fp8_rel_err": err}


def _pointer_ms(ctx, fn):
    from fusedpar.kernels.gemm_loads import load_path_set
    with load_path_set("pointer"):
        return ctx.time_ms(fn)


def _persistent_loads(call):
    """How the op's persistent GEMM loaded in a fresh launch of ``call`` (a launch plan's hit
    records nothing): ``"tma"`` or ``"pointer"``."""
    from fusedpar.kernels.gemm_loads import last_launch
    from fusedpar.kernels.launch import clear_plans
    clear_plans()
    call()
    return last_launch("persistent_matmul").get("loads", "pointer")


def _cfg_name(cfg):
    if not cfg:
        return "default"
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}/w{cfg.get('num_warps')}/s{cfg.get('num_stages')}"


def _rs_row(tokens, N, K, P, dtype, partial_dtype, sms, times, err, cfg):
    t_pers = times["T_persistent_ms"]
    return {
        "M": tokens, "N": N, "K_local": K, "tp": P, "dtype": str(dtype).replace("torch.", ""),
        "partials": str(partial_dtype).replace("torch.", ""), "reduce_sms": sms, **times,
        "speedup_vs_seq": times["T_seq_ms"] / t_pers, "speedup_vs_per_chunk": times["T_per_chunk_ms"] / t_pers,
        "TFLOPs_persistent": tflops(2.0 * tokens * N * K, t_pers), "max_rel_err": err, "config": _cfg_name(cfg),
    }


@register("persistent_rs", "signalling persistent GEMM + concurrent chunk_reduce (single-GPU emulation) vs sequential",
          add_args=_add_rs_args)
def run_rs(args, ctx):
    import torch

    from fusedpar.kernels import chunk_view, persistent_matmul
    from fusedpar.ops import matmul_reduce_scatter
    from fusedpar.ops.tensor_parallel.symmetric import RS_REDUCE_SMS, matmul_reduce_scatter_symmetric
    from fusedpar.ops.comm.transport import EmulatedTransport

    dtype, tokens, N, ks, P = _setup(args, ctx)
    rank, rows = 0, tokens // P
    partial_dtype = torch.float32 if args.partial_dtype == "fp32" else dtype
    sms_list = args.reduce_sms or ([8, 16, 32] if ctx.gpu else [RS_REDUCE_SMS])
    symm, ring = EmulatedTransport(P, rank, in_kernel_waits=True), EmulatedTransport(P, rank)
    rows_out = []
    for K in ks:
        x = torch.randn(1, tokens, K, device=ctx.device, dtype=dtype)
        w = torch.randn(N, K, device=ctx.device, dtype=dtype) * K ** -0.5
        partials = torch.empty(P, 1, rows, N, device=ctx.device, dtype=partial_dtype)
        out = torch.empty(1, rows, N, device=ctx.device, dtype=dtype)
        recv = torch.empty(P - 1, 1, rows, N, device=ctx.device, dtype=dtype)
        cfg = None
        if not args.no_sweep:
            best = _best_config(ctx, lambda c: persistent_matmul(
                chunk_view(x, 1, P), w, out=partials, wait_mode="none", config=c))
            cfg = best[0] if best else None

        def sequential():
            y = torch.matmul(x, w.t())  # every chunk's partial, [1, tokens, N]
            ych = y.view(1, P, rows, N)
            for i in range(P - 1):  # the partials of this rank's chunk that the peers would send
                recv[i].copy_(ych[:, (rank + 1 + i) % P])
            return (recv.float().sum(0) + ych[:, rank].float()).to(dtype)

        def per_chunk():
            with torch.no_grad():
                return matmul_reduce_scatter(x, w, transport=ring, partial_dtype=partial_dtype)

        reference = torch.matmul(x, w.t()).float().view(1, P, rows, N).sum(1)
        check_close(sequential(), reference)
        check_close(per_chunk(), reference)
        t_gemm = ctx.time_ms(lambda: torch.matmul(x, w.t()))
        t_seq = ctx.time_ms(sequential)
        t_chunk = ctx.time_ms(per_chunk)
        for sms in sms_list:
            def persistent():
                return matmul_reduce_scatter_symmetric(x, w, transport=symm, out=out, config=cfg, reduce_sms=sms,
                                                       partial_dtype=partial_dtype)

            err = check_close(persistent(), reference)
            times = dict(T_gemm_cublas_ms=t_gemm, T_seq_ms=t_seq, T_per_chunk_ms=t_chunk,
                         T_persistent_ms=ctx.time_ms(persistent))
            rows_out.append(dict(_rs_row(tokens, N, K, P, dtype, partial_dtype, sms if ctx.gpu else "n/a", times, err,
                                         cfg), loads=_persistent_loads(persistent)))
        rows_out[-1].update(_fp8_columns(args, ctx, lambda t, r: matmul_reduce_scatter(
            x, w, transport=t, partial_dtype=partial_dtype, fp8=r), symm, ring, rows_out[-1]["T_persistent_ms"]))
    if ctx.smoke:
        ctx.notes.append("CPU smoke mode: the Triton interpreter is timed; these numbers are not performance.")
    return rows_out
