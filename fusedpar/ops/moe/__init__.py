"""Mixture of experts: routing, dispatch (permute + all-to-all-v), grouped expert MLPs and
combine, with expert parallelism.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops),
:mod:`.bodies` (the stages' forward / backward bodies), :mod:`.plan` (where every routed slot
goes)."""
from .api import grouped_mlp, moe_combine, moe_dispatch, moe_expert_compute, moe_mlp, moe_plan, moe_route
from .plan import MoEPlan

__all__ = ["MoEPlan", "grouped_mlp", "moe_combine", "moe_dispatch", "moe_expert_compute", "moe_mlp", "moe_plan",
           "moe_route"]
