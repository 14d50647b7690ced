"""The bodies of the RMSNorm ops over ``fusedpar.kernels.rmsnorm``: :func:`rms_norm_fwd` /
:func:`rms_norm_bwd`, :func:`rms_norm_fp8_fwd` (the norm's kernel also writes the e4m3 rows and
scales) and the feature-sharded norm (:func:`sharded_rms_norm_fwd` / :func:`sharded_rms_norm_bwd`,
torch bodies with one fp32 all-reduce of row statistics each way)."""
from __future__ import annotations

import torch

from fusedpar.kernels import rmsnorm as launchers
from fusedpar.ops.comm.transport import transport_from_id
from fusedpar.ops.common import absent


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd)``: the normalised rows, ``x + residual`` (absent without a residual) and the
    fp32 reciprocal RMS of every row."""
    y, h, rstd = launchers.rms_norm_fwd(x, weight, eps, residual=residual)
    return y, (h if residual is not None else absent(x)), rstd


def rms_norm_bwd(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor, need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, dw)``: the gradient of the normalised input ``h`` (with ``grad_h``, the gradient
    that reached ``h`` from later layers, folded in) and of the weight (absent unless
    ``need_weight_grad``)."""
    dh, dw = launchers.rms_norm_bwd(grad_y, h, weight, rstd, grad_residual=grad_h)
    return dh, (dw if dw is not None and need_weight_grad else absent(h))


# ----------------------------------------------------------------------------------------------
# with the output quantised for an fp8 GEMM
# ----------------------------------------------------------------------------------------------
def rms_norm_fp8_fwd(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
                     recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd, q, scale)``: :func:`rms_norm_fwd`'s outputs and ``y`` quantised per
    ``recipe`` (``q`` e4m3 of ``x``'s shape; ``scale`` fp32 ``x.shape[:-1]`` for ``"rowwise"``,
    ``x.shape[:-1] + (ceil(H / 128),)`` for ``"blockwise"``)."""
    y, h, rstd, q, scale = launchers.rms_norm_fp8_fwd(x, weight, eps, recipe=recipe, residual=residual)
    return y, (h if residual is not None else absent(x)), rstd, q, scale


# ----------------------------------------------------------------------------------------------
# features split over a group
# ----------------------------------------------------------------------------------------------
def _row_sum_over_group(t: torch.Tensor, transport_id: str) -> torch.Tensor:
    """``t`` (fp32 per-row partial sums) summed over the group of ``token``, in place."""
    transport = transport_from_id(transport_id)
    if transport.size > 1:
        transport.all_reduce(t).wait()
    return t


def sharded_rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                         transport_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: ``y = x * rstd * weight`` in ``x.dtype`` with ``rstd = 1 / sqrt(mean(x^2) +
    eps)`` over the full row, whose ``H / P`` local features ``x`` ``[..., H / P]`` holds (one
    all-reduce of the fp32 row sums of squares over the group of ``token``)."""
    xf = x.float()
    sumsq = _row_sum_over_group(xf.square().sum(-1), transport_id)
    rstd = torch.rsqrt(sumsq / (x.shape[-1] * transport_from_id(transport_id).size) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


def sharded_rms_norm_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                         transport_id: str, need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``: ``dx = rstd * (dn - n * mean(dn * n))`` with ``n = x * rstd``, ``dn = dy *
    weight`` and the mean over the full row (one all-reduce of its fp32 row sums); ``dw`` (this
    rank's slice, absent unless ``need_weight_grad``) sums ``dy * n`` over the local rows."""
    n = x.float() * rstd.unsqueeze(-1)
    dy = grad_y.float()
    dn = dy * weight.float() if weight is not None else dy
    full = x.shape[-1] * transport_from_id(transport_id).size
    c = _row_sum_over_group((dn * n).sum(-1), transport_id) / full
    dx = (rstd.unsqueeze(-1) * (dn - n * c.unsqueeze(-1))).to(x.dtype)
    if weight is None or not need_weight_grad:
        return dx, absent(x)
    return dx, (dy * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
