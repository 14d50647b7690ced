from .linear import ColumnParallelLinear, ParallelMLP, RowParallelLinear, merge_shards
from .moe import MoE, RouterOutput, TopKRouter  # noqa: F401
from .attention import AttentionReference, ParallelAttention, apply_rotary, rotary_cos_sin  # noqa: F401
