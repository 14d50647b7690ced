from .linear import ColumnParallelLinear, ParallelMLP, RowParallelLinear, merge_shards
from .moe import MoE, RouterOutput, TopKRouter  # noqa: F401
