"""``FP8Linear``: an ``nn.Linear`` whose three GEMMs run in fp8 (``fusedpar.ops.fp8_linear``)."""
from __future__ import annotations

import math

import torch
from torch import nn

from fusedpar.kernels.checks import check_bool, check_choice, check_int
from fusedpar.nn.placement import Placement
from fusedpar.ops.fp8.api import fp8_linear
from fusedpar.kernels.fp8_gemm import FP8_RECIPES

__all__ = ["FP8Linear"]


class FP8Linear(nn.Module):
    """``y = x @ weight^T + bias`` with e4m3 GEMMs forward and backward (fp32 accumulation).

    Parameters ``weight`` ``[out_features, in_features]`` and ``bias`` ``[out_features]`` (none
    with ``bias=False``) stay in their dtype (fp32 master weights are fine: the fp8 copies exist
    only inside the op) and are initialised as ``nn.Linear``'s. ``recipe``: ``"rowwise"`` or
    ``"blockwise"``; ``grad_high_precision``: the weight gradient in the input's dtype
    (:func:`fusedpar.ops.fp8_linear`). Replicated: one whole copy per rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: str = "rowwise",
                 grad_high_precision: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features = check_int("in_features", in_features, min_value=1)
        self.out_features = check_int("out_features", out_features, min_value=1)
        check_bool("bias", bias)
        check_choice("recipe", recipe, tuple(FP8_RECIPES))
        self.recipe = recipe
        self.grad_high_precision = check_bool("grad_high_precision", grad_high_precision)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def placements(self) -> dict[str, Placement]:
        """Replicated; its gradient covers the tokens this rank saw (kind "dense")."""
        names = ["weight"] + (["bias"] if self.bias is not None else [])
        return {n: Placement.replicated(sequence_sharded=False) for n in names}

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: Kaiming-uniform weight, bias uniform in ``+-1/sqrt(in)``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, recipe=self.recipe, grad_high_precision=self.grad_high_precision)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe!r}, grad_high_precision={self.grad_high_precision}")
