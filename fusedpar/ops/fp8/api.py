"""fp8 family API: :func:`fp8_linear`, a linear layer whose three GEMMs (forward, input gradient,
weight gradient) run on e4m3 operands with fp32 scales, over the custom ops of :mod:`.custom_ops`.

Recipes (``recipe=``): ``"rowwise"`` (one scale per token of activations and gradients, per output
row of the weight) and ``"blockwise"`` (DeepSeek-V3: 1x128 tiles of activations and gradients,
128x128 blocks of the weight); scales come from the current amax (:mod:`fusedpar.kernels.fp8`).
``grad_high_precision=True`` keeps the weight-gradient GEMM in the input's dtype. Needs fp8
tensor cores on a GPU (compute capability >= 8.9); under the interpreter it runs on CPU tensors."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import (
    check_bool,
    check_choice,
    check_float_tensor,
    check_same,
    check_shape,
    check_supported_dtype,
    check_tensor,
)
from fusedpar.kernels.fp8 import check_fp8_device
from fusedpar.kernels.fp8_gemm import FP8_RECIPES
from fusedpar.ops.common import checked_api
from fusedpar.ops.fp8.custom_ops import fp8_linear_op


def check_fp8_linear_args(x, weight, bias, recipe, grad_high_precision) -> None:
    """The argument checks of :func:`fp8_linear` (one error style, :mod:`fusedpar.kernels.checks`)."""
    check_float_tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim (features last), got shape {tuple(x.shape)}")
    check_float_tensor("weight", weight, dims=(2,))
    check_same("weight", weight, "x", x, dtype=False)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"inner dimensions differ: x has K={x.shape[-1]} (shape {tuple(x.shape)}) but weight "
                         f"[N, K] has K={weight.shape[1]} (shape {tuple(weight.shape)})")
    if bias is not None:
        check_tensor("bias", bias, dims=(1,))
        check_shape("bias", bias, (weight.shape[0],))
        check_same("bias", bias, "x", x, dtype=False)
        check_supported_dtype("bias", bias)
    check_choice("recipe", recipe, tuple(FP8_RECIPES))
    check_bool("grad_high_precision", grad_high_precision)
    check_fp8_device(x)


@checked_api
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe: str = "rowwise",
               grad_high_precision: bool = False) -> torch.Tensor:
    """``x @ weight^T + bias`` with fp8 (e4m3) GEMMs forward and backward, fp32 accumulation.

    x:      ``[..., K]``, fp32 / fp16 / bf16; the result has ``x``'s dtype and ``[..., N]``.
    weight: ``[N, K]`` (``nn.Linear`` layout) in any supported dtype (fp32 master weights are
            kept as they are: the fp8 copies exist only inside the op); its gradient has its dtype.
    recipe: ``"rowwise"`` or ``"blockwise"`` (module docstring); ``grad_high_precision``: the
            weight gradient ``dY^T @ x`` in ``x``'s dtype instead of fp8.

    The custom op ``fusedpar::fp8_linear`` (:data:`~fusedpar.ops.fp8.custom_ops.fp8_linear_op`):
    traceable by ``torch.compile``.
    """
    check_fp8_linear_args(x, weight, bias, recipe, grad_high_precision)
    return fp8_linear_op(x, weight, bias, recipe, grad_high_precision)
