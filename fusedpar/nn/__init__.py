from .placement import Placement, checkpoint_buffers, parameter_placements  # noqa: F401
from .linear import ColumnParallelLinear, ParallelMLP, RowParallelLinear, merge_shards
from .moe import MoE, RouterLoad, RouterOutput, TopKRouter  # noqa: F401
from .attention import AttentionReference, ParallelAttention  # noqa: F401
from .rotary import apply_rotary, rotary_cos_sin  # noqa: F401
from .mla import MLAttention  # noqa: F401
from .norm import RMSNorm  # noqa: E402,F401
from .fp8 import FP8Linear  # noqa: E402,F401
from .config import AttentionConfig, BlockConfig, MLAConfig, MoEConfig, TransformerConfig  # noqa: E402,F401
from .block import TransformerBlock  # noqa: E402,F401
from .transformer import Transformer, shard_tokens, vocab_parallel_cross_entropy  # noqa: E402,F401
