"""Flash attention on one device (dense and packed documents), differentiable.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops),
:mod:`.bodies` (the forward / backward bodies over the kernels)."""
from .api import flash_attention, flash_attention_varlen

__all__ = ["flash_attention", "flash_attention_varlen"]
