from .attention import (  # noqa: F401
    hybrid_attention,
    ring_attention,
    sequence_shard,
    shard_positions,
    ulysses_attention,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
