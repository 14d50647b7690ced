"""``RMSNorm`` module over the fused Triton kernel (``fusedpar.ops.rms_norm``), or over
``fusedpar.ops.sharded_rms_norm`` when its features are split over a group."""
from __future__ import annotations

import torch
from torch import nn

from fusedpar.nn.placement import Placement
from fusedpar.ops import comm
from fusedpar.ops.norm.api import rms_norm, rms_norm_fp8, sharded_rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-feature scale.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` adds the residual first
    (fused) and returns ``(normed, new_residual)``. ``forward(..., fp8="rowwise" | "blockwise")``
    also returns the normed rows quantised for an fp8 GEMM by the same kernel,
    ``(normed, q, scale)`` / ``(normed, new_residual, q, scale)`` (:func:`~fusedpar.ops.rms_norm_fp8`;
    not with a ``feature_group`` of more than one rank). Parameters: ``weight`` ``[hidden_size]``,
    initialised to ones (absent with ``elementwise_affine=False``).

    ``offset=1.0`` is Gemma's norm: the scale is ``1 + weight`` (in fp32, as Hugging Face computes
    it), the weight initialised to zeros. ``feature_group``: the ``hidden_size`` features are
    split over this group (``None``: whole on this rank); each rank holds ``hidden_size / P`` of
    them and that slice of the weight, and the row statistics are reduced over the group (OLMo 2's
    q / k norm over a tensor-parallel projection; no fused residual add then).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, elementwise_affine: bool = True,
                 offset: float = 0.0, feature_group=None, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or offset not in (0, 1):
            raise ValueError(f"offset must be 0.0 (scale = weight) or 1.0 (Gemma: scale = 1 + weight), got {offset!r}")
        self.hidden_size, self.eps, self.offset = hidden_size, float(eps), float(offset)
        self.feature_group = comm.resolve_group(feature_group) if feature_group is not None else None
        self.parts = comm.group_size(self.feature_group) if feature_group is not None else 1
        if hidden_size % self.parts:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by the feature_group size {self.parts}")
        self.local_size = hidden_size // self.parts
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.local_size, device=device, dtype=dtype))
            self.reset_parameters()
        else:
            self.register_parameter("weight", None)

    def placements(self) -> dict[str, Placement]:
        """Replicated; fusedpar's norms run on sequence-sharded activations (a Transformer's
        blocks, q/k norms over this rank's heads), so each rank's gradient is partial. With a
        ``feature_group``: a block of the features over that group, its gradient whole for the
        tokens the group holds (the projection's sequence is gathered over tp)."""
        if self.weight is None:
            return {}
        if self.feature_group is not None:
            return {"weight": Placement.tp(self.feature_group, 0)}
        return {"weight": Placement.replicated(sequence_sharded=True)}

    def reset_parameters(self) -> None:
        if self.weight is not None and self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.fill_(1.0 - self.offset)

    def scale(self) -> torch.Tensor | None:
        """The scale the rows are multiplied by: ``weight``, or ``1 + weight`` in fp32 with ``offset``."""
        if self.weight is None or not self.offset:
            return self.weight
        return self.weight.float() + self.offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, fp8: str | None = None):
        if x.shape[-1] != self.local_size:
            raise ValueError(f"x must have {self.local_size} features in its last dim, got shape {tuple(x.shape)}")
        if self.parts > 1:
            if residual is not None:
                raise ValueError("RMSNorm with a feature_group of more than one rank takes no residual, got one")
            if fp8 is not None:
                raise ValueError(f"RMSNorm with a feature_group of more than one rank has no fp8 output, "
                                 f"got fp8={fp8!r}")
            return sharded_rms_norm(x, self.scale(), self.eps, group=self.feature_group)
        if fp8 is not None:
            return rms_norm_fp8(x, self.scale(), self.eps, residual=residual, recipe=fp8)
        return rms_norm(x, self.scale(), self.eps, residual=residual)

    def extra_repr(self) -> str:
        split = f", feature_group of {self.parts} (local {self.local_size})" if self.parts > 1 else ""
        return (f"{self.hidden_size}, eps={self.eps}, elementwise_affine={self.weight is not None}, "
                f"offset={self.offset}{split}")
