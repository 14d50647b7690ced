from .tensor_parallel import all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter
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
