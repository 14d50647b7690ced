from .moe import MoE, RouterOutput, TopKRouter  # noqa: F401
