"""The functional API of fusedpar's differentiable ops, their named forward / backward functions,
the transports and the schedules.

Every differentiable op is importable from here. Each op family ``F`` (``tensor_parallel``,
``sp_attention``, ``flash``, ``moe``, ``norm``, ``loss``,
``linear_cross_entropy``, ``fp8``, ``replicas``) keeps its functional API (argument
checks, then the custom-op object) in ``fusedpar/ops/F.py``, its ``torch.library`` custom ops
(forward op, ``*_backward`` op, fakes, autograd registration) in ``fusedpar/ops/F_library.py``
and the ops' named bodies (``<op>_fwd`` / ``<op>_bwd``) there or in helper modules
``fusedpar/ops/F_<part>.py``; :mod:`fusedpar.ops.library` holds the namespace and the helpers
every op definition uses. The layers below (``fusedpar.kernels``) hold kernels and launchers
only, the layer above (``fusedpar.nn``) modules only.
"""
from .transport import EmulatedTransport, PortableTransport, Transport, get_transport
from .symmetric import SymmetricTransport, resolve_transport
from .tensor_parallel import (
    TPOptions,
    all_gather_matmul,
    all_gather_tokens,
    copy_to_tp_matmul,
    gather_features,
    matmul_all_reduce,
    matmul_reduce_scatter,
    scatter_features,
)
from .tensor_parallel_library import (
    all_gather_matmul_bwd,
    all_gather_matmul_fwd,
    copy_to_tp_matmul_bwd,
    copy_to_tp_matmul_fwd,
    matmul_all_reduce_bwd,
    matmul_all_reduce_fwd,
    matmul_reduce_scatter_bwd,
    matmul_reduce_scatter_fwd,
)
from .moe import MoEPlan, grouped_mlp, moe_combine, moe_dispatch, moe_expert_compute, moe_mlp, moe_plan, moe_route
from .moe_layout import (
    all_to_all_v_fwd,
    grouped_mlp_bwd,
    grouped_mlp_fwd,
    moe_experts_bwd,
    moe_experts_fwd,
    moe_permute_bwd,
    moe_permute_fwd,
    moe_unpermute_bwd,
    moe_unpermute_fwd,
)
from .flash import flash_attention, flash_attention_varlen
from .varlen import document_positions
from .sp_attention import hybrid_attention, ring_attention, ulysses_attention
from .sp_attention_schedules import (
    ring_attention_bwd,
    ring_attention_fwd,
    sequence_shard,
    shard_positions,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
    ulysses_kv_heads,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from .norm import rms_norm, rms_norm_fp8, sharded_rms_norm
from .loss import attach_aux_loss, global_loss, vocab_parallel_cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .fp8 import fp8_linear
from .fp8_schedules import fp8_linear_bwd, fp8_linear_fwd
from .replicas import replicated_rows

__all__ = [
    "EmulatedTransport", "PortableTransport", "SymmetricTransport", "Transport", "get_transport",
    "resolve_transport",
    "TPOptions", "all_gather_matmul", "all_gather_matmul_bwd", "all_gather_matmul_fwd", "all_gather_tokens",
    "copy_to_tp_matmul",
    "copy_to_tp_matmul_bwd", "copy_to_tp_matmul_fwd", "gather_features", "matmul_all_reduce",
    "matmul_all_reduce_bwd", "matmul_all_reduce_fwd", "matmul_reduce_scatter", "matmul_reduce_scatter_bwd",
    "matmul_reduce_scatter_fwd", "scatter_features",
    "MoEPlan", "all_to_all_v_fwd", "grouped_mlp", "grouped_mlp_bwd", "grouped_mlp_fwd",
    "moe_combine", "moe_dispatch", "moe_expert_compute", "moe_experts_bwd", "moe_experts_fwd", "moe_mlp",
    "moe_permute_bwd", "moe_permute_fwd", "moe_plan", "moe_route", "moe_unpermute_bwd", "moe_unpermute_fwd",
    "flash_attention", "flash_attention_varlen",
    "document_positions", "hybrid_attention", "ring_attention",
    "ring_attention_bwd", "ring_attention_fwd", "sequence_shard", "shard_positions", "ulysses_attention",
    "ulysses_attention_bwd", "ulysses_attention_fwd", "ulysses_kv_heads", "zigzag_positions", "zigzag_shard",
    "zigzag_unshard",
    "rms_norm", "rms_norm_fp8", "sharded_rms_norm", "attach_aux_loss", "global_loss", "linear_cross_entropy",
    "vocab_parallel_cross_entropy",
    "fp8_linear", "fp8_linear_bwd", "fp8_linear_fwd",
    "replicated_rows",
]
