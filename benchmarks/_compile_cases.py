"""The launches the compile check drives: every launcher of fusedpar.kernels at the test-suite
shapes and at LLM shapes (Llama-3 8B / 70B, Mixtral 8x7B, a DeepSeek-style MoE), on ``meta``
tensors. A case is ``(family, name, fast, fn(dtype))``; ``fast`` cases form the CI subset."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fusedpar.kernels import (
    combine,
    combine_backward,
    grouped_bias_grad,
    grouped_matmul,
    grouped_matmul_dact,
    grouped_wgrad,
    matmul,
    matmul_tn,
    permute,
)
from fusedpar.kernels.fp8 import quantize_e4m3
from fusedpar.kernels.fp8_gemm import fp8_matmul
from fusedpar.kernels.linear_ce import linear_ce_dlogits, linear_ce_stats
from fusedpar.kernels.moe_routing import routing_metadata
from fusedpar.kernels.moe_topk import topk_route, topk_route_backward
from fusedpar.kernels.persistent_gemm import chunk_reduce, chunk_view, persistent_matmul
from fusedpar.kernels.rmsnorm import rms_norm_bwd, rms_norm_fp8_fwd, rms_norm_fwd
from fusedpar.ops.loss.bodies import default_chunk_tokens, vocab_block

#: dense transformer layers: hidden, ffn, query heads, kv heads, head dim, tokens per batch
LLAMA = {
    "llama3-8b": dict(hidden=4096, ffn=14336, heads=32, kv=8, d=128, batch=2, seq=4096),
    "llama3-70b": dict(hidden=8192, ffn=28672, heads=64, kv=8, d=128, batch=1, seq=8192),
}
#: MoE layers: hidden, expert ffn, experts, top-k, tokens
MOE = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=8192),
    "deepseek-moe": dict(hidden=2048, ffn=1408, experts=64, top_k=6, tokens=8192),
}
TP = 8  # tensor-parallel degree of the sequence-chunk (split view) cases


@dataclass
class Case:
    family: str
    name: str
    fast: bool
    run: Callable


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _seq_chunk(batch, seq, feats, dtype):
    """Rank 1's sequence chunk of a ``[batch, seq, feats]`` activation: a split row view."""
    lo = seq // TP
    return meta(batch, seq, feats, dtype=dtype)[:, lo:2 * lo]


# --------------------------------------------------------------------------------------------
# dense GEMMs (matmul, matmul_tn) and the persistent GEMM
# --------------------------------------------------------------------------------------------
def _gemm_cases():
    cases = []
    for model, c in LLAMA.items():
        H, F, T = c["hidden"], c["ffn"], c["batch"] * c["seq"]
        qkv = (c["heads"] + 2 * c["kv"]) * c["d"]
        fast = model == "llama3-8b"
        cases += [
            Case("gemm", f"{model} qkv+bias", fast, lambda dt, H=H, T=T, n=qkv: matmul(
                meta(T, H, dtype=dt), meta(n, H, dtype=dt), meta(n, dtype=dt))),
            Case("gemm", f"{model} o_proj+residual", False, lambda dt, H=H, T=T: matmul(
                meta(T, H, dtype=dt), meta(H, H, dtype=dt), residual=meta(T, H, dtype=dt))),
            Case("gemm", f"{model} swiglu+preact", fast, lambda dt, H=H, F=F, T=T: matmul(
                meta(T, H, dtype=dt), meta(2 * F, H, dtype=dt), activation="swiglu",
                preact_out=meta(T, 2 * F, dtype=dt))),
            Case("gemm", f"{model} gelu+residual split", fast, lambda dt, c=c: matmul(
                _seq_chunk(c["batch"], c["seq"], c["hidden"], dt), meta(c["hidden"], c["hidden"], dtype=dt),
                meta(c["hidden"], dtype=dt), activation="gelu",
                residual=_seq_chunk(c["batch"], c["seq"], c["hidden"], dt),
                out=_seq_chunk(c["batch"], c["seq"], c["hidden"], dt))),
            Case("gemm", f"{model} down accumulate", False, lambda dt, H=H, F=F, T=T: matmul(
                meta(T, F, dtype=dt), meta(H, F, dtype=dt), out=meta(T, H, dtype=dt), accumulate=True)),
            Case("gemm", f"{model} wgrad", False, lambda dt, H=H, F=F, T=T: matmul_tn(
                meta(T, H, dtype=dt), meta(T, F, dtype=dt))),
            Case("gemm", f"{model} wgrad split accumulate", fast, lambda dt, c=c: matmul_tn(
                _seq_chunk(c["batch"], c["seq"], c["hidden"], dt), _seq_chunk(c["batch"], c["seq"], c["ffn"], dt),
                out=meta(c["hidden"], c["ffn"], dtype=dt), accumulate=True)),
        ]
    cases += [  # the test suite's shapes: tiny, odd, K not a multiple of 64
        Case("gemm", "tests 37x45x70 swiglu", False, lambda dt: matmul(
            meta(37, 70, dtype=dt), meta(90, 70, dtype=dt), activation="swiglu", preact_out=meta(37, 90, dtype=dt))),
        Case("gemm", "37x45x80 swiglu (K masked, vectorised)", False, lambda dt: matmul(
            meta(37, 80, dtype=dt), meta(90, 80, dtype=dt), activation="swiglu", preact_out=meta(37, 90, dtype=dt))),
        Case("gemm", "tests 2x19x40 gelu+residual", False, lambda dt: matmul(
            meta(2, 19, 40, dtype=dt), meta(24, 40, dtype=dt), activation="gelu", residual=meta(2, 19, 24, dtype=dt))),
    ]
    return cases


def _persistent(dt, c, activation, wait):
    H, T = c["hidden"], c["batch"] * c["seq"]
    n_w = 2 * c["ffn"] if activation == "swiglu" else H
    a = chunk_view(meta(T, H, dtype=dt), 0, TP)
    kw = dict(wait_flags=meta(TP, dtype=torch.int32), wait_mode="spin", check_waits=False) if wait else \
        dict(wait_mode="none", signal_counters=meta(TP, dtype=torch.int32))
    if activation == "swiglu":
        kw["preact_out"] = chunk_view(meta(T, n_w, dtype=dt), 0, TP)
    persistent_matmul(a, meta(n_w, H, dtype=dt), activation=activation, **kw)


def _persistent_cases():
    cases = []
    for model, c in LLAMA.items():
        fast = model == "llama3-8b"
        cases += [
            Case("persistent", f"{model} all-gather swiglu", fast, lambda dt, c=c: _persistent(dt, c, "swiglu", True)),
            Case("persistent", f"{model} reduce-scatter", fast, lambda dt, c=c: _persistent(dt, c, "none", False)),
            # the [batch, seq] activation chunked along seq (two-level rows; TMA: one [batch * seq] tensor)
            Case("persistent", f"{model} reduce-scatter seq chunks", False, lambda dt, c=c: persistent_matmul(
                chunk_view(meta(c["batch"], c["seq"], c["hidden"], dtype=dt), 1, TP), meta(c["hidden"], c["hidden"],
                dtype=dt), wait_mode="none", signal_counters=meta(TP, dtype=torch.int32))),
            Case("persistent", f"{model} chunk_reduce", False, lambda dt, c=c: chunk_reduce(
                chunk_view(meta(c["batch"] * c["seq"], c["hidden"], dtype=torch.float32), 0, TP),
                torch.zeros(TP, dtype=torch.int64), 1, out=meta(c["batch"] * c["seq"] // TP, c["hidden"], dtype=dt),
                counters=meta(TP, dtype=torch.int32), counter_offsets=torch.zeros(TP, dtype=torch.int64),
                check_waits=False)),
        ]
    return cases


# --------------------------------------------------------------------------------------------
# MoE: routing, permute / combine, grouped GEMMs
# --------------------------------------------------------------------------------------------
def _offsets(rows, groups):
    step = rows // groups
    return [g * step for g in range(groups)] + [rows]


def _moe_cases():
    cases = []
    for model, c in MOE.items():
        H, F, E, k, T = c["hidden"], c["ffn"], c["experts"], c["top_k"], c["tokens"]
        M = T * k
        off = _offsets(M, E)
        fast = model == "mixtral"
        cases += [
            Case("grouped", f"{model} up swiglu+preact", fast, lambda dt, H=H, F=F, E=E, M=M, off=off: grouped_matmul(
                meta(M, H, dtype=dt), meta(E, 2 * F, H, dtype=dt), off, activation="swiglu",
                preact_out=meta(M, 2 * F, dtype=dt))),
            Case("grouped", f"{model} down", False, lambda dt, H=H, F=F, E=E, M=M, off=off: grouped_matmul(
                meta(M, F, dtype=dt), meta(E, H, F, dtype=dt), off)),
            Case("grouped", f"{model} dgrad swiglu", fast, lambda dt, H=H, F=F, E=E, M=M, off=off: grouped_matmul_dact(
                meta(M, H, dtype=dt), meta(E, H, F, dtype=dt), off, meta(M, 2 * F, dtype=dt))),
            Case("grouped", f"{model} dgrad x", False, lambda dt, H=H, F=F, E=E, M=M, off=off: grouped_matmul(
                meta(M, 2 * F, dtype=dt), meta(E, 2 * F, H, dtype=dt), off, weight_layout="kn")),
            Case("grouped", f"{model} wgrad up", fast, lambda dt, H=H, F=F, E=E, M=M, off=off: grouped_wgrad(
                meta(M, 2 * F, dtype=dt), meta(M, H, dtype=dt), off, E)),
            Case("grouped", f"{model} wgrad down accumulate", False, lambda dt, H=H, F=F, E=E, M=M, off=off:
                 grouped_wgrad(meta(M, H, dtype=dt), meta(M, F, dtype=dt), off, E, out=meta(E, H, F, dtype=dt),
                               accumulate=True)),
            Case("moe", f"{model} routing", fast, lambda dt, E=E, k=k, T=T: routing_metadata(
                meta(T, k, dtype=torch.int32), E, capacity=T)),
            Case("moe", f"{model} permute/combine", fast, lambda dt, H=H, k=k, T=T: (
                permute(meta(T, H, dtype=dt), meta(T * k, dtype=torch.int32), k),
                combine(meta(T * k, H, dtype=dt), meta(T * k, dtype=torch.int32), meta(T, k, dtype=dt), k),
                combine_backward(meta(T, H, dtype=dt), meta(T * k, H, dtype=dt), meta(T, k, dtype=dt),
                                 meta(T * k, dtype=torch.int32), k))),
        ]
    cases += _gpt_oss_cases()
    cases += _router_cases()
    cases.append(Case("grouped", "tests 5 groups 61x24x40 swiglu", False, lambda dt: grouped_matmul(
        meta(61, 40, dtype=dt), meta(3, 48, 40, dtype=dt), [0, 7, 7, 30, 41, 55], activation="swiglu")))
    # a gated forward on "kn" weights (the 3-D descriptor's up-half load)
    cases.append(Case("grouped", "tests 5 groups 61x24x40 swiglu kn", False, lambda dt: grouped_matmul(
        meta(61, 40, dtype=dt), meta(3, 40, 48, dtype=dt), [0, 7, 7, 30, 41, 55], weight_layout="kn",
        activation="swiglu")))
    # experts' weights as a tensor-parallel shard along F of the whole ones (views: experts further
    # apart than their rows, each through a 3-D descriptor with the expert stride)
    H, F, E, k, T = (MOE["mixtral"][n] for n in ("hidden", "ffn", "experts", "top_k", "tokens"))
    off = _offsets(T * k, E)
    cases.append(Case("grouped", "mixtral up swiglu tp2 shard", False, lambda dt: grouped_matmul(
        meta(T * k, H, dtype=dt), meta(E, 2 * F, H, dtype=dt)[:, :F], off, activation="swiglu",
        preact_out=meta(T * k, F, dtype=dt))))
    cases.append(Case("grouped", "mixtral dgrad x tp2 shard kn", False, lambda dt: grouped_matmul(
        meta(T * k, F // 2, dtype=dt), meta(E, F, H, dtype=dt)[:, :F // 2], off, weight_layout="kn")))
    return cases


def _gpt_oss_cases():
    """gpt-oss's expert MLP (hidden = ffn = 2880, 128 experts, top-4): the clamped SwiGLU
    ``swiglu_oai`` with the per-expert biases of both projections, and its fused backward."""
    H, F, E, M = 2880, 2880, 128, 8192 * 4
    off = _offsets(M, E)
    return [
        Case("grouped", "gpt-oss up swiglu_oai+bias+preact", True, lambda dt: grouped_matmul(
            meta(M, H, dtype=dt), meta(E, 2 * F, H, dtype=dt), off, activation="swiglu_oai",
            bias=meta(E, 2 * F, dtype=dt), preact_out=meta(M, 2 * F, dtype=dt))),
        Case("grouped", "gpt-oss down +bias", False, lambda dt: grouped_matmul(
            meta(M, F, dtype=dt), meta(E, H, F, dtype=dt), off, bias=meta(E, H, dtype=dt))),
        Case("grouped", "gpt-oss dgrad swiglu_oai", True, lambda dt: grouped_matmul_dact(
            meta(M, H, dtype=dt), meta(E, H, F, dtype=dt), off, meta(M, 2 * F, dtype=dt), activation="swiglu_oai")),
        Case("moe", "gpt-oss bias grad", True, lambda dt: grouped_bias_grad(
            meta(M, 2 * F, dtype=dt), off, E, check_offsets=False)),
        Case("moe", "gpt-oss bias grad accumulate", False, lambda dt: grouped_bias_grad(
            meta(M, H, dtype=dt), off, E, out=meta(E, H, dtype=torch.float32), accumulate=True,
            check_offsets=False)),
    ]


#: routers (fp32 logits, whatever the pass's dtype): experts, top-k, tokens, options
ROUTERS = {
    "mixtral softmax": (8, 2, 8192, dict(score="softmax")),
    "deepseek-v3 sigmoid grouped 8/4 +bias": (256, 8, 8192, dict(score="sigmoid", n_group=8, topk_group=4,
                                                                  normalize=True, scale=2.5, bias=True)),
    "gpt-oss softmax_topk": (128, 4, 8192, dict(score="softmax_topk")),
    "tests 12 experts groups 4/2": (12, 3, 13, dict(score="sigmoid", n_group=4, topk_group=2, normalize=True,
                                                    bias=True)),
}


def _router(E, k, T, opts):
    opts = dict(opts)
    bias = meta(E, dtype=torch.float32) if opts.pop("bias", False) else None
    logits = meta(T, E, dtype=torch.float32)
    w, ids = topk_route(logits, k, bias=bias, **opts)
    opts.pop("topk_group", None)
    topk_route_backward(meta(T, k, dtype=torch.float32), logits, w, ids, **opts)


def _router_cases():
    return [Case("moe", f"{name} router top-k", name.startswith(("mixtral", "deepseek")),
                 lambda dt, c=c: _router(*c)) for name, c in ROUTERS.items()]


# --------------------------------------------------------------------------------------------
# RMSNorm (flash attention: _compile_flash_cases.py)
# --------------------------------------------------------------------------------------------
def _rmsnorm(dt, T, H, residual):
    y, h, rstd = rms_norm_fwd(meta(T, H, dtype=dt), meta(H, dtype=dt),
                              residual=meta(T, H, dtype=dt) if residual else None)
    rms_norm_bwd(meta(T, H, dtype=dt), meta(T, H, dtype=dt), meta(H, dtype=dt), rstd,
                 grad_residual=meta(T, H, dtype=dt) if residual else None)


def _norm_cases():
    return [
        Case("rmsnorm", "llama3-8b residual", True, lambda dt: _rmsnorm(dt, 8192, 4096, True)),
        Case("rmsnorm", "llama3-70b", False, lambda dt: _rmsnorm(dt, 8192, 8192, False)),
        Case("rmsnorm", "wide 65536 residual", True, lambda dt: _rmsnorm(dt, 64, 65536, True)),
        Case("rmsnorm", "tests 3x7x40", False, lambda dt: _rmsnorm(dt, 21, 40, True)),
    ]


# --------------------------------------------------------------------------------------------
# fp8: quantisation and the scaled GEMM (bf16 passes only: fp8 operands whatever the dtype; sm_80
# raises FP8UnsupportedError, which the check reports as unsupported)
# --------------------------------------------------------------------------------------------
def _fp8_gemm(dt, M, N, K, scaling, b_granularity, out_dtype=None, bias=False, fast_accum=False):
    if dt != torch.bfloat16:
        return
    f8 = torch.float8_e4m3fn
    kb = -(-K // 128)
    if scaling == "rowwise":
        sa, sb = meta(M, dtype=torch.float32), meta(N, dtype=torch.float32)
    else:
        sa = meta(M, kb, dtype=torch.float32)
        sb = meta(-(-N // 128) if b_granularity == "block" else N, kb, dtype=torch.float32)
    fp8_matmul(meta(M, K, dtype=f8), sa, meta(N, K, dtype=f8), sb, meta(N, dtype=dt) if bias else None,
               scaling=scaling, out_dtype=out_dtype or dt, fast_accum=fast_accum)


def _fp8_fc1(dt, M, K, F, activation, scaling, fp8_out, bias=False):
    """fp8_matmul's fused epilogue (the fp8 up projection): the activation (swiglu: 2F weight rows
    in 128x128 blocks or per row), the pre-activation and, with ``fp8_out``, the e4m3 output per
    1x128 tile (bf16 pass only: fp8 operands whatever the dtype)."""
    if dt != torch.bfloat16:
        return
    f8, f32, kb, n_w = torch.float8_e4m3fn, torch.float32, -(-K // 128), 2 * F if activation == "swiglu" else F
    sa, sb = ((meta(M, dtype=f32), meta(n_w, dtype=f32)) if scaling == "rowwise" else
              (meta(M, kb, dtype=f32), meta(-(-n_w // 128), kb, dtype=f32)))
    fp8_matmul(meta(M, K, dtype=f8), sa, meta(n_w, K, dtype=f8), sb, meta(n_w, dtype=dt) if bias else None,
               scaling=scaling, out_dtype=dt, activation=activation, preact_out=meta(M, n_w, dtype=dt),
               fp8_out=(meta(M, F, dtype=f8), meta(M, -(-F // 128), dtype=f32)) if fp8_out else None)


def _fp8_quantize(dt, rows, cols, granularity, transposed=False):
    if dt != torch.bfloat16:
        return
    quantize_e4m3(meta(cols, rows, dtype=dt).t() if transposed else meta(rows, cols, dtype=dt), granularity)


def _gemm_fp8_out(dt, M, K, N, activation, split=False):
    """matmul's fused e4m3 output (kernels/gemm_fp8_epilogue.py), every dtype."""
    c = LLAMA["llama3-8b"]
    n_w = 2 * N if activation == "swiglu" else N
    if split:
        a, out = _seq_chunk(c["batch"], c["seq"], K, dt), _seq_chunk(c["batch"], c["seq"], N, dt)
        q = _seq_chunk(c["batch"], c["seq"], N, torch.float8_e4m3fn)
        s = _seq_chunk(c["batch"], c["seq"], -(-N // 128), torch.float32)
    else:
        a, out = meta(M, K, dtype=dt), meta(M, N, dtype=dt)
        q, s = meta(M, N, dtype=torch.float8_e4m3fn), meta(M, -(-N // 128), dtype=torch.float32)
    matmul(a, meta(n_w, K, dtype=dt), activation=activation, out=out, fp8_out=(q, s),
           preact_out=None if split or activation == "none" else meta(M, n_w, dtype=dt))


def _persistent_fp8(dt, T, K, n_w, activation, wait, scaling):
    """The persistent GEMM on fp8 operands: the gathered chunk-major e4m3 activation and its scales,
    the weight per output row / 128x128 blocks (bf16 pass only: fp8 operands whatever the dtype)."""
    if dt != torch.bfloat16:
        return
    f32, kb = torch.float32, -(-K // 128)
    sa = meta(TP, T // TP, dtype=f32) if scaling == "rowwise" else meta(TP, T // TP, kb, dtype=f32)
    sw = meta(n_w, dtype=f32) if scaling == "rowwise" else meta(-(-n_w // 128), kb, dtype=f32)
    kw = dict(wait_flags=meta(TP, dtype=torch.int32), wait_mode="spin", check_waits=False) if wait else \
        dict(wait_mode="none", signal_counters=meta(TP, dtype=torch.int32))
    if activation == "swiglu":
        kw["preact_out"] = meta(TP, T // TP, n_w, dtype=dt)
    persistent_matmul(meta(TP, T // TP, K, dtype=torch.float8_e4m3fn), meta(n_w, K, dtype=torch.float8_e4m3fn),
                      meta(n_w, dtype=dt), activation=activation, a_scale=sa, weight_scale=sw, scaling=scaling,
                      out_dtype=dt, **kw)


def _rmsnorm_fp8(dt, T, H, residual, recipe):
    """The RMSNorm forward with its fused e4m3 output (kernels/rmsnorm.py), every dtype."""
    rms_norm_fp8_fwd(meta(T, H, dtype=dt), meta(H, dtype=dt), recipe=recipe,
                     residual=meta(T, H, dtype=dt) if residual else None)


def _fp8_fast_accum_cases(T, H, F, qkv):
    """fp8_matmul's fast accumulation (rowwise, no fp32 promotion): one accumulator tile, 128 x 256
    tiles kept."""
    return [
        Case("fp8", "llama3-8b up rowwise fast_accum", False, lambda dt: _fp8_gemm(
            dt, T, 2 * F, H, "rowwise", "row", fast_accum=True)),
        Case("fp8", "llama3-8b qkv+bias rowwise fast_accum", False, lambda dt: _fp8_gemm(
            dt, T, qkv, H, "rowwise", "row", bias=True, fast_accum=True)),
    ]


def _fp8_cases():
    c = LLAMA["llama3-8b"]
    H, F, T = c["hidden"], c["ffn"], c["batch"] * c["seq"]
    qkv = (c["heads"] + 2 * c["kv"]) * c["d"]
    cases = _fp8_fast_accum_cases(T, H, F, qkv)
    for scaling, wg in (("rowwise", "row"), ("blockwise", "block")):
        cases += [
            Case("fp8", f"llama3-8b qkv+bias {scaling}", False, lambda dt, s=scaling, wg=wg: _fp8_gemm(
                dt, T, qkv, H, s, wg, bias=True)),
            Case("fp8", f"llama3-8b up {scaling}", scaling == "blockwise", lambda dt, s=scaling, wg=wg: _fp8_gemm(
                dt, T, 2 * F, H, s, wg)),
            Case("fp8", f"llama3-8b down dgrad {scaling}", False, lambda dt, s=scaling, wg=wg: _fp8_gemm(
                dt, T, F, H, s, wg)),
            Case("fp8", f"llama3-8b down wgrad fp32 {scaling}", False, lambda dt, s=scaling: _fp8_gemm(
                dt, H, F, T, s, "tile", out_dtype=torch.float32)),
            Case("fp8", f"tests 37x45x200 {scaling}", False, lambda dt, s=scaling, wg=wg: _fp8_gemm(
                dt, 37, 45, 200, s, wg, bias=True)),
            Case("fp8", f"llama3-8b fc1 swiglu+preact {scaling}", False, lambda dt, s=scaling: _fp8_fc1(
                dt, T, H, F, "swiglu", s, False)),
            Case("fp8", f"llama3-8b fc1 swiglu+preact fp8_out {scaling}", False,
                 lambda dt, s=scaling: _fp8_fc1(dt, T, H, F, "swiglu", s, True)),
            Case("fp8", f"llama3-8b fc1 gelu+preact fp8_out {scaling}", False, lambda dt, s=scaling: _fp8_fc1(
                dt, T, H, F, "gelu", s, True)),
            Case("fp8", f"tests 37x72x160 fc1 swiglu+bias+preact fp8_out {scaling}", False,
                 lambda dt, s=scaling: _fp8_fc1(dt, 37, 160, 72, "swiglu", s, True, bias=True)),
            Case("fp8", f"tests 37x72x200 fc1 swiglu fp8_out {scaling}", False,  # K: loads that do not vectorise
                 lambda dt, s=scaling: _fp8_fc1(dt, 37, 200, 72, "swiglu", s, True)),
            Case("fp8", f"llama3-8b persistent all-gather {scaling}", scaling == "blockwise",
                 lambda dt, s=scaling: _persistent_fp8(dt, T, H, H, "none", True, s)),
            Case("fp8", f"llama3-8b persistent all-gather swiglu {scaling}", False,
                 lambda dt, s=scaling: _persistent_fp8(dt, T, H, 2 * F, "swiglu", True, s)),
            Case("fp8", f"llama3-8b persistent reduce-scatter {scaling}", False,
                 lambda dt, s=scaling: _persistent_fp8(dt, T, F, H, "none", False, s)),
        ]
    for granularity in ("row", "tile", "block"):
        cases.append(Case("fp8", f"llama3-8b quantize {granularity}", granularity == "tile",
                          lambda dt, g=granularity: _fp8_quantize(dt, T, H if g != "block" else 2 * F, g)))
    for granularity in ("row", "tile"):
        cases.append(Case("fp8", f"llama3-8b quantize {granularity} transposed", False,
                          lambda dt, g=granularity: _fp8_quantize(dt, H, T, g, transposed=True)))
    for recipe in ("rowwise", "blockwise"):
        cases += [
            Case("fp8", f"llama3-8b residual rmsnorm {recipe}", recipe == "blockwise",
                 lambda dt, r=recipe: _rmsnorm_fp8(dt, T, H, True, r)),
            Case("fp8", f"llama3-70b rmsnorm {recipe}", False, lambda dt, r=recipe: _rmsnorm_fp8(dt, T, 8192, False, r)),
            Case("fp8", f"wide 65536 residual rmsnorm {recipe}", False,
                 lambda dt, r=recipe: _rmsnorm_fp8(dt, 64, 65536, True, r)),
            Case("fp8", f"tests 3x7x200 rmsnorm {recipe}", False, lambda dt, r=recipe: _rmsnorm_fp8(dt, 21, 200, True, r)),
        ]
    cases += [
        Case("fp8", "llama3-8b up swiglu+preact fp8_out", True, lambda dt: _gemm_fp8_out(dt, T, H, F, "swiglu")),
        Case("fp8", "llama3-8b up gelu+preact fp8_out", False, lambda dt: _gemm_fp8_out(dt, T, H, F, "gelu")),
        Case("fp8", "llama3-8b none fp8_out", False, lambda dt: _gemm_fp8_out(dt, T, H, F, "none")),
        Case("fp8", "llama3-8b swiglu split fp8_out", False, lambda dt: _gemm_fp8_out(dt, T, H, F, "swiglu", True)),
        Case("fp8", "tests 37x200x70 swiglu fp8_out", False, lambda dt: _gemm_fp8_out(dt, 37, 70, 200, "swiglu")),
    ]
    return cases + _fp8_grouped_cases()


def _fp8_grouped(dt, kind, scaling, H, F, E, M):
    """One launch of an fp8 MoE layer (fusedpar/ops/moe_layout.py) at ``M`` routed rows: the expert
    GEMMs on the operands the layer gives them (the dispatched tokens and output gradients as
    e4m3 + scale byte rows, a TokenPack; the hidden activation and the pre-activation gradient
    quantised per row; the weights per expert, transposed for the data gradients; the weight
    gradient's operands quantised along the rows per group) and those quantisations."""
    from fusedpar.kernels.fp8 import group_columns, group_tiles, quantize_e4m3_groups
    from fusedpar.ops.moe.bodies import TokenPack

    if dt != torch.bfloat16:
        return
    f8, f32, off, gran = torch.float8_e4m3fn, torch.float32, _offsets(M, E), ("row" if scaling == "rowwise" else "tile")
    pack = TokenPack(H, scaling)
    buf = meta(M, pack.row_bytes, dtype=torch.uint8)
    rows = (lambda k: meta(M, dtype=f32)) if gran == "row" else (lambda k: meta(M, -(-k // 128), dtype=f32))
    blocks = (lambda n, k: meta(E, n, dtype=f32)) if gran == "row" else \
        (lambda n, k: meta(E, -(-n // 128), -(-k // 128), dtype=f32))
    kw = dict(scaling=scaling, check_offsets=False)
    if kind == "up swiglu+bias+preact":
        grouped_matmul(pack.q(buf), meta(E, 2 * F, H, dtype=f8), off, activation="swiglu", bias=meta(E, 2 * F, dtype=dt),
                       preact_out=meta(M, 2 * F, dtype=dt), x_scale=pack.scale(buf), weight_scale=blocks(2 * F, H),
                       out_dtype=dt, **kw)
    elif kind == "down":
        grouped_matmul(meta(M, F, dtype=f8), meta(E, H, F, dtype=f8), off, x_scale=rows(F), weight_scale=blocks(H, F),
                       out_dtype=dt, **kw)
    elif kind == "dgrad swiglu":
        grouped_matmul_dact(pack.q(buf), meta(E, F, H, dtype=f8), off, meta(M, 2 * F, dtype=dt), weight_layout="nk",
                            grad_scale=pack.scale(buf), weight_scale=blocks(F, H), **kw)
    elif kind == "dgrad x":
        grouped_matmul(meta(M, 2 * F, dtype=f8), meta(E, H, 2 * F, dtype=f8), off, x_scale=rows(2 * F),
                       weight_scale=blocks(H, 2 * F), out_dtype=dt, **kw)
    elif kind == "wgrad up accumulate":  # the operands' rows padded per group (kernels/fp8.py group_columns)
        P = group_columns(M, E)
        T = group_tiles(P, E)
        grouped_wgrad(meta(2 * F, P, dtype=f8).t(), meta(H, P, dtype=f8).t(), off, E, out=meta(E, 2 * F, H, dtype=f32),
                      accumulate=True, grad_scale=meta(2 * F, T, dtype=f32), x_scale=meta(H, T, dtype=f32),
                      check_offsets=False)
    elif kind == "quantize groups":  # the wgrad operands: from the dispatched byte rows, and from the hidden activation
        quantize_e4m3_groups(pack.q(buf), off, gran, x_scale=pack.scale(buf), check_offsets=False)
        quantize_e4m3_groups(meta(M, F, dtype=dt), off, gran, check_offsets=False)
    else:  # "quantize experts": the weights per expert, and transposed (the data gradients')
        quantize_e4m3(meta(E, 2 * F, H, dtype=dt), "row" if gran == "row" else "block")
        quantize_e4m3(meta(E, H, F, dtype=dt).transpose(1, 2), "row" if gran == "row" else "block")


def _fp8_grouped_cases():
    """The fp8 MoE layer's launches at Mixtral's shape (every one) and DeepSeek-MoE's (64 experts,
    ffn 1408: the up projection and its data gradient), and at a test shape whose K (200) does not
    vectorise."""
    c, d = MOE["mixtral"], MOE["deepseek-moe"]
    cases = []
    for scaling in ("rowwise", "blockwise"):
        for kind in ("up swiglu+bias+preact", "down", "dgrad swiglu", "dgrad x", "wgrad up accumulate",
                     "quantize groups", "quantize experts"):
            cases.append(Case("fp8", f"mixtral grouped {kind} {scaling}", False, lambda dt, k=kind, s=scaling: _fp8_grouped(
                dt, k, s, c["hidden"], c["ffn"], c["experts"], c["tokens"] * c["top_k"])))
        for kind in ("up swiglu+bias+preact", "dgrad swiglu"):
            cases.append(Case("fp8", f"deepseek-moe grouped {kind} {scaling}", False, lambda dt, k=kind, s=scaling:
                              _fp8_grouped(dt, k, s, d["hidden"], d["ffn"], d["experts"], d["tokens"] * d["top_k"])))
        cases.append(Case("fp8", f"tests 5 groups 61x24x200 grouped up swiglu {scaling}", False,
                          lambda dt, s=scaling: _fp8_grouped(dt, "up swiglu+bias+preact", s, 200, 24, 5, 61)))
    return cases


# --------------------------------------------------------------------------------------------
# fused linear + cross entropy: the logits GEMM with its statistics / gradient epilogues (the
# block's d_weight GEMM, matmul_tn of [T, Vb] x [T, H] into the weight's dtype, is the gemm
# family's "wgrad" variant; its d_hidden GEMM, fp32 accumulate, is a case here)
# --------------------------------------------------------------------------------------------
#: Llama-3 heads: tokens, hidden, vocabulary (one rank)
HEADS = {"llama3-8b": (8192, 4096, 128256), "llama3-70b": (8192, 8192, 128256)}


def _ce_stats(dt, T, H, V, softcap, smoothing):
    linear_ce_stats(meta(T, H, dtype=dt), meta(V, H, dtype=dt), meta(T, dtype=torch.int64), softcap=softcap,
                    smoothing=smoothing)


def _ce_block(dt, T, H, V, softcap, d_hidden=None):
    """The backward's first vocabulary block at the default chunk: its gradient (the dlogits
    kernel) or, ``d_hidden`` "first" / "accumulate", the fp32 ``d_hidden (+)= dz_b W_b`` GEMM."""
    vb = vocab_block(T, V, default_chunk_tokens(T, V), torch.empty((), dtype=dt).element_size())
    h, w_b, dz = meta(T, H, dtype=dt), meta(V, H, dtype=dt)[:vb], meta(T, vb, dtype=dt)
    if d_hidden:
        matmul(dz, w_b, weight_layout="kn", out=meta(T, H, dtype=torch.float32), accumulate=d_hidden == "accumulate")
        return
    rows = meta(T, dtype=torch.float32)
    linear_ce_dlogits(h, w_b, meta(T, dtype=torch.int64), rows, rows, rows, rows, softcap=softcap, out=dz)


def _linear_ce_cases():
    cases = []
    for model, (T, H, V) in HEADS.items():
        fast = model == "llama3-8b"
        cases += [
            Case("linear_ce", f"{model} stats", False, lambda dt, s=(T, H, V): _ce_stats(dt, *s, 0.0, False)),
            Case("linear_ce", f"{model} stats softcap+smoothing", fast,
                 lambda dt, s=(T, H, V): _ce_stats(dt, *s, 30.0, True)),
            Case("linear_ce", f"{model} dlogits", False, lambda dt, s=(T, H, V): _ce_block(dt, *s, 0.0)),
            Case("linear_ce", f"{model} dlogits softcap", fast, lambda dt, s=(T, H, V): _ce_block(dt, *s, 30.0)),
            Case("linear_ce", f"{model} d_hidden first block", False,
                 lambda dt, s=(T, H, V): _ce_block(dt, *s, 0.0, d_hidden="first")),
            Case("linear_ce", f"{model} d_hidden block accumulate", False,
                 lambda dt, s=(T, H, V): _ce_block(dt, *s, 0.0, d_hidden="accumulate")),
        ]
    cases += [  # the test suite's shapes: ragged, K not a multiple of 64
        Case("linear_ce", "tests 37x101x40 stats softcap+smoothing", False,
             lambda dt: _ce_stats(dt, 37, 40, 101, 2.5, True)),
        Case("linear_ce", "tests 40x51x8 dlogits softcap", False, lambda dt: _ce_block(dt, 40, 8, 51, 4.0)),
    ]
    return cases


def all_cases():
    from ._compile_flash_cases import flash_cases  # (it imports Case, meta and LLAMA from here)
    return (_gemm_cases() + _persistent_cases() + _moe_cases() + _norm_cases() + flash_cases() + _fp8_cases()
            + _linear_ce_cases())
