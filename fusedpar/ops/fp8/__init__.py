"""fp8 (e4m3) linear layers and the quantised operands every fp8 op passes around.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops),
:mod:`.bodies` (the forward / backward bodies), :mod:`.operands` (quantised activations, weights
and weight gradients)."""
from .api import fp8_linear

__all__ = ["fp8_linear"]
