"""The flash-attention launches of the compile check (:mod:`._compile_cases`): forward and
backward at the Llama-3 shapes and the test shapes, the backward's other shapes, a ring step, the
score options, packed documents (varlen), the one-pass backward and the e4m3 output."""
from __future__ import annotations

import torch

from fusedpar.kernels.flash_attention import Segments, flash_attention_forward
from fusedpar.kernels.flash_attention_bwd import flash_attention_backward

from ._compile_cases import LLAMA, Case, meta


def _flash(dt, b, s, hq, hk, d, causal, dv=None, dq_mode=None, **options):
    """Forward and backward launches; ``dv``: v's head dim (default d); ``options``: window,
    softcap, sinks=True (an fp32 [hq] tensor). Cases with options or ``dv`` launch nothing in
    fp32 (and TF32). ``dq_mode="atomic"``: the one-pass backward alone (the forward's out / lse
    as meta tensors, so the forward's variants keep their cases)."""
    dv = d if dv is None else dv
    if dt == torch.float32 and (options or dv != d):
        return  # the score-option cases run 16-bit only: their fp32 / TF32 tiles spill (DESIGN §4.6)
    q, k, v = meta(b, s, hq, d, dtype=dt), meta(b, s, hk, d, dtype=dt), meta(b, s, hk, dv, dtype=dt)
    if options.get("sinks"):
        options["sinks"] = meta(hq, dtype=torch.float32)
    if dq_mode is None:
        out, lse = flash_attention_forward(q, k, v, causal=causal, **options)
    else:
        out, lse = meta(b, s, hq, dv, dtype=dt), meta(b, hq, s, dtype=torch.float32)
        options["dq_mode"] = dq_mode
    flash_attention_backward(meta(b, s, hq, dv, dtype=dt), q, k, v, out, lse, causal=causal, **options)


def _flash_ring_step(dt, b, s, hq, hk, d):
    """One ring-attention backward step (sequence_parallel bodies): the backward alone at global
    offsets, adding into fp32 dq / dk / dv buffers (ACCUM) with delta given."""
    q, k, v = meta(b, s, hq, d, dtype=dt), meta(b, s, hk, d, dtype=dt), meta(b, s, hk, d, dtype=dt)
    lse = meta(b, hq, s, dtype=torch.float32)
    flash_attention_backward(meta(b, s, hq, d, dtype=dt), q, k, v, None, lse, delta=meta(b, hq, s, dtype=torch.float32),
                             causal=True, q_offset=s, k_offset=0, dq=meta(b, s, hq, d, dtype=torch.float32),
                             dk=meta(b, s, hk, d, dtype=torch.float32), dv=meta(b, s, hk, d, dtype=torch.float32),
                             accumulate=True)


def _flash_fp8_out(dt, b, s, hq, hk, d, causal):
    """The forward alone with its e4m3 output for o_proj (kernels/flash_fp8_out.py), bf16 only (sm_80
    raises FP8UnsupportedError, which the check reports as unsupported)."""
    if dt != torch.bfloat16:
        return
    flash_attention_forward(meta(b, s, hq, d, dtype=dt), meta(b, s, hk, d, dtype=dt), meta(b, s, hk, d, dtype=dt),
                            causal=causal, fp8_out=(meta(b, s, hq, d, dtype=torch.float8_e4m3fn),
                                                    meta(b, s, hq * d // 128, dtype=torch.float32)))


def _flash_docs(dt, docs, doc_len, hq, hk, d, causal, dv=None, ring_step=False, **options):
    """Packed documents (``flash_attention_varlen`` / a ring step over them): ``docs`` segments of
    ``doc_len`` tokens each in one batch-1 sequence, forward and backward (a ring step: the
    backward alone, adding into fp32 buffers). 16-bit only (the fp32 tiles as without documents)."""
    if dt == torch.float32:
        return
    dv, total = d if dv is None else dv, docs * doc_len
    q, k, v = meta(1, total, hq, d, dtype=dt), meta(1, total, hk, d, dtype=dt), meta(1, total, hk, dv, dtype=dt)
    seg = Segments(meta(docs, 5, dtype=torch.int32), doc_len, doc_len)
    if ring_step:
        f32 = torch.float32
        flash_attention_backward(meta(1, total, hq, dv, dtype=dt), q, k, v, None, meta(1, hq, total, dtype=f32),
                                 delta=meta(1, hq, total, dtype=f32), causal=causal, segments=seg,
                                 dq=meta(1, total, hq, d, dtype=f32), dk=meta(1, total, hk, d, dtype=f32),
                                 dv=meta(1, total, hk, dv, dtype=f32), accumulate=True, **options)
        return
    out, lse = flash_attention_forward(q, k, v, causal=causal, segments=seg, **options)
    flash_attention_backward(meta(1, total, hq, dv, dtype=dt), q, k, v, out, lse, causal=causal, segments=seg,
                             **options)


def _varlen_cases():
    """Packed documents (issue 41's audit: the segment bounds cost registers, a 128x16 three-stage
    backward at head_dim 128 spilled 52 B with Triton 3.6), and the score options' other halves."""
    return [
        Case("flash", "llama3-8b varlen 4x4096 causal", False, lambda dt: _flash_docs(dt, 4, 4096, 32, 8, 128, True)),
        Case("flash", "d64 varlen 4x4096 full", False, lambda dt: _flash_docs(dt, 4, 4096, 32, 8, 64, False)),
        Case("flash", "gpt-oss varlen window 128", False, lambda dt: _flash_docs(
            dt, 4, 4096, 64, 8, 64, True, window=(127, 0))),
        Case("flash", "softcap 50 window 4096 d128 varlen", False, lambda dt: _flash_docs(
            dt, 4, 4096, 16, 8, 128, True, window=(4095, 0), softcap=50.0)),
        Case("flash", "mla 192/128 varlen causal", False, lambda dt: _flash_docs(dt, 4, 4096, 128, 128, 192, True,
                                                                                 dv=128)),
        Case("flash", "llama3-8b ring step bwd documents", False, lambda dt: _flash_docs(
            dt, 4, 2048, 32, 8, 128, True, ring_step=True)),
        Case("flash", "mla 192/128 full", False, lambda dt: _flash(dt, 1, 4096, 128, 128, 192, False, dv=128)),
        Case("flash", "softcap 50 d128 full", False, lambda dt: _flash(dt, 1, 8192, 16, 8, 128, False, softcap=50.0)),
    ]


def flash_cases():
    cases = []
    for model, c in LLAMA.items():
        cases.append(Case("flash", f"{model} causal", model == "llama3-8b", lambda dt, c=c: _flash(
            dt, c["batch"], c["seq"], c["heads"], c["kv"], c["d"], True)))
    cases.append(Case("flash", "tests 2x33x4/2x64", False, lambda dt: _flash(dt, 2, 33, 4, 2, 64, False)))
    # the backward's other shapes (issue 41): not causal at d 128, causal at d 64, a ring step (ACCUM)
    c8 = LLAMA["llama3-8b"]
    cases.append(Case("flash", "llama3-8b full", False, lambda dt: _flash(
        dt, c8["batch"], c8["seq"], c8["heads"], c8["kv"], c8["d"], False)))
    cases.append(Case("flash", "d64 causal", False, lambda dt: _flash(dt, 4, 2048, 32, 8, 64, True)))
    cases.append(Case("flash", "llama3-8b ring step bwd", False, lambda dt: _flash_ring_step(
        dt, 1, 2048, c8["heads"], c8["kv"], c8["d"])))
    # the score options (issue 25): gpt-oss (window 128 + sinks, d 64), a Gemma-2-like softcap +
    # window at d 128, MLA's q/k 192 with v 128 (DeepSeek-V3: 128 heads); the softcap case is not
    # in the fast subset (CI time: each case compiles ~10 s uncached), --against pins it
    cases.append(Case("flash", "gpt-oss window 128 sinks", True, lambda dt: _flash(
        dt, 1, 8192, 64, 8, 64, True, window=(127, 0), sinks=True)))
    cases.append(Case("flash", "softcap 50 window 4096 d128", False, lambda dt: _flash(
        dt, 1, 8192, 16, 8, 128, True, window=(4095, 0), softcap=50.0)))
    cases.append(Case("flash", "gemma2-9b softcap 50 window 4096 d256", False, lambda dt: _flash(
        dt, 1, 8192, 16, 8, 256, True, window=(4095, 0), softcap=50.0)))
    cases.append(Case("flash", "mla 192/128 causal", True, lambda dt: _flash(dt, 1, 4096, 128, 128, 192, True, dv=128)))
    # the one-pass backward (dq_mode="atomic": dK/dV with DQ_ATOMIC) at d 128 and 64, with the options;
    # none in the fast subset (CI time), --against pins them to the committed tables
    c = LLAMA["llama3-8b"]
    cases += [
        Case("flash", "llama3-8b causal dq atomic", False, lambda dt: _flash(
            dt, c["batch"], c["seq"], c["heads"], c["kv"], c["d"], True, dq_mode="atomic")),
        Case("flash", "d64 causal dq atomic", False, lambda dt: _flash(dt, 4, 2048, 32, 8, 64, True, dq_mode="atomic")),
        Case("flash", "gpt-oss window 128 sinks dq atomic", False, lambda dt: _flash(
            dt, 1, 8192, 64, 8, 64, True, window=(127, 0), sinks=True, dq_mode="atomic")),
        Case("flash", "softcap 50 window 4096 d128 dq atomic", False, lambda dt: _flash(
            dt, 1, 8192, 16, 8, 128, True, window=(4095, 0), softcap=50.0, dq_mode="atomic")),
        Case("flash", "mla 192/128 causal dq atomic", False, lambda dt: _flash(
            dt, 1, 4096, 128, 128, 192, True, dv=128, dq_mode="atomic")),
    ]
    # the forward's fp8 output for o_proj (issue 29), bf16 at Llama-3 8B's d 128; not in the fast subset
    cases += [Case("flash", f"llama3-8b{' causal' if causal else ''} fwd fp8_out", False,
                   lambda dt, causal=causal: _flash_fp8_out(dt, c["batch"], c["seq"], c["heads"], c["kv"], c["d"],
                                                            causal)) for causal in (True, False)]
    # d_v 256: two tiles per head (the epilogue's reshape to [BLOCK_M, 2, 128])
    cases.append(Case("flash", "d256 causal fwd fp8_out", False, lambda dt: _flash_fp8_out(dt, 1, 4096, 16, 8, 256,
                                                                                          True)))
    return cases + _varlen_cases()
