"""``RMSNorm`` module over the fused Triton kernel (``fusedpar.ops.rms_norm``)."""
from __future__ import annotations

import torch
from torch import nn

from fusedpar.nn.placement import Placement
from fusedpar.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-feature scale.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` adds the residual first
    (fused) and returns ``(normed, new_residual)``. Parameters: ``weight`` ``[hidden_size]``,
    initialised to ones (absent with ``elementwise_affine=False``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def placements(self) -> dict[str, Placement]:
        """Replicated; fusedpar's norms run on sequence-sharded activations (a Transformer's
        blocks, q/k norms over this rank's heads), so each rank's gradient is partial."""
        return {"weight": Placement.replicated(sequence_sharded=True)} if self.weight is not None else {}

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have {self.hidden_size} features in its last dim, got shape {tuple(x.shape)}")
        return rms_norm(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, elementwise_affine={self.weight is not None}"
