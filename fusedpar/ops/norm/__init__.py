"""RMSNorm (with the fused residual add, the fp8 output, a feature-sharded form), differentiable.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops),
:mod:`.bodies` (the forward / backward bodies over the kernels)."""
from .api import rms_norm, rms_norm_fp8, sharded_rms_norm

__all__ = ["rms_norm", "rms_norm_fp8", "sharded_rms_norm"]
