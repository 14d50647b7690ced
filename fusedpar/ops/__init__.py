from .moe import MoEPlan, grouped_mlp, moe_combine, moe_dispatch, moe_expert_compute, moe_mlp, moe_plan  # noqa: F401
