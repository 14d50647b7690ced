"""Sequence-parallel attention: ring (zigzag or contiguous), Ulysses and the 2-D hybrid, with
packed documents, windows, sinks and softcap, over the flash kernels.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops),
:mod:`.bodies` (the ring and Ulysses forward / backward bodies), :mod:`.layouts` (how a sequence
is sharded), :mod:`.plans` (which kernel launches a ring step makes, from shapes and document
boundaries alone)."""
from .api import hybrid_attention, ring_attention, ulysses_attention
from .layouts import LAYOUTS, sequence_shard, shard_positions, zigzag_positions, zigzag_shard, zigzag_unshard
from .plans import document_positions

__all__ = ["LAYOUTS", "document_positions", "hybrid_attention", "ring_attention", "sequence_shard", "shard_positions",
           "ulysses_attention", "zigzag_positions", "zigzag_shard", "zigzag_unshard"]
