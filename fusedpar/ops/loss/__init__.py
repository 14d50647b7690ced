"""Losses of a parallel model: the vocabulary-parallel cross entropy, the fused linear head +
cross entropy (the logits never exist), the global mean over data ranks and the router loss
carried by the backward.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops),
:mod:`.bodies` (the forward / backward bodies)."""
from .api import attach_aux_loss, global_loss, linear_cross_entropy, vocab_parallel_cross_entropy

__all__ = ["attach_aux_loss", "global_loss", "linear_cross_entropy", "vocab_parallel_cross_entropy"]
