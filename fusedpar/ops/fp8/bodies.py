"""The bodies of the fp8 linear ops: :func:`fp8_linear_fwd` quantises ``x`` per token (rowwise)
or per 1x128 tile (blockwise) and the weight per output row or per 128x128 block, then runs the
scaled fp8 GEMM (:func:`fusedpar.kernels.fp8_matmul`); :func:`fp8_linear_bwd` quantises each
gradient GEMM's operands along its own contraction axis (``dw`` in the high-precision GEMM with
``grad_high_precision``)."""
from __future__ import annotations

import torch

from fusedpar.kernels import fp8_matmul, matmul_tn, quantize_e4m3
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.ops.common import absent


def fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
                   grad_high_precision: bool) -> torch.Tensor:
    """``y = (q(x) * sx) @ (q(W) * sw)^T + bias`` in ``x``'s dtype (``grad_high_precision`` is
    the backward's option)."""
    act, wgt = FP8_RECIPES[recipe]
    N, K = weight.shape
    xq, xs = quantize_e4m3(x.reshape(-1, K), act)
    wq, ws = quantize_e4m3(weight, wgt)
    y = fp8_matmul(xq, xs, wq, ws, bias, scaling=recipe, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], N)


def fp8_linear_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str,
                   grad_high_precision: bool, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` (each absent unless asked for): ``dx = q(dY) @ q(W)`` with ``dY`` scaled per
    token (1x128 tiles along N) and ``W`` per input column (its 128x128 blocks);
    ``dw = q(dY)^T @ q(x)`` with both scaled along the tokens (per feature, or 128-token tiles),
    or ``dY^T @ x`` in ``x``'s dtype with ``grad_high_precision``."""
    act, wgt = FP8_RECIPES[recipe]
    N, K = weight.shape
    g2 = grad_y.reshape(-1, N)
    x2 = x.reshape(-1, K)
    dx = dw = absent(x)
    if need_dx:
        gq, gs = quantize_e4m3(g2, act)
        wq, ws = quantize_e4m3(weight.t(), wgt)  # [K, N]: scaled along N, the contraction
        dx = fp8_matmul(gq, gs, wq, ws, scaling=recipe, out_dtype=x.dtype).view(x.shape)
    if need_dw:
        if grad_high_precision:
            dw = matmul_tn(g2, x2, out_dtype=weight.dtype)
        else:
            gq, gs = quantize_e4m3(g2.t(), act)  # [N, T]: scaled along the tokens
            xq, xs = quantize_e4m3(x2.t(), act)  # [K, T]
            dw = fp8_matmul(gq, gs, xq, xs, scaling=recipe, out_dtype=weight.dtype)
    return dx, dw
