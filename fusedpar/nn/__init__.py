from .linear import ColumnParallelLinear, ParallelMLP, RowParallelLinear, merge_shards
