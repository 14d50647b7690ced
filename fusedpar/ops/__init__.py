from .tensor_parallel import all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter
from .moe import MoEPlan, grouped_mlp, moe_combine, moe_dispatch, moe_expert_compute, moe_mlp, moe_plan  # noqa: F401
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
from .norm import RMSNormFunction, rms_norm  # noqa: E402,F401
