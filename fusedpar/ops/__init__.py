"""fusedpar's differentiable ops, the functional API of every family, and the transports.

Every differentiable op is importable from here. Each op family is a package,
``fusedpar/ops/<family>/`` (``tensor_parallel``, ``sequence_parallel``, ``attention``, ``moe``,
``norm``, ``loss``, ``fp8``), with the same roles under the same module names:

* ``api.py``: the functional API (argument checks, agreed across ranks where the op
  communicates, then the custom-op object); the family's ``__init__`` exports it and nothing else;
* ``custom_ops.py``: the ``torch.library`` custom ops (forward op, ``*_backward`` op, fakes,
  autograd registration), the only place that defines or registers one;
* ``bodies.py``: the ops' named forward / backward bodies (``<op>_fwd`` / ``<op>_bwd``), plain
  functions over tensors and a transport, testable without autograd on an emulated transport;
* the family's own parts where it has them: schedules, plans, layouts, operand types.

:mod:`fusedpar.ops.comm` is the communication layer (collectives, transports, symmetric memory,
in-kernel waits, the cross-rank agreement check, the keys that name a transport in a schema);
:mod:`fusedpar.ops.common` holds what every op definition uses (the namespace, placeholders of
absent tensors, argument errors under ``torch.compile``). The layer below
(``fusedpar.kernels``) holds kernels and launchers only, the layer above (``fusedpar.nn``)
modules only.
"""
from .attention import flash_attention, flash_attention_varlen
from .comm import EmulatedTransport, PortableTransport, SymmetricTransport, Transport, get_transport, resolve_transport
from .fp8 import fp8_linear
from .loss import attach_aux_loss, global_loss, linear_cross_entropy, vocab_parallel_cross_entropy
from .moe import MoEPlan, grouped_mlp, moe_combine, moe_dispatch, moe_expert_compute, moe_mlp, moe_plan, moe_route
from .norm import rms_norm, rms_norm_fp8, sharded_rms_norm
from .sequence_parallel import (
    LAYOUTS,
    document_positions,
    hybrid_attention,
    ring_attention,
    sequence_shard,
    shard_positions,
    ulysses_attention,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from .tensor_parallel import (
    all_gather_matmul,
    all_gather_tokens,
    copy_to_tp_matmul,
    gather_features,
    matmul_all_reduce,
    matmul_reduce_scatter,
    replicated_rows,
    scatter_features,
)

__all__ = [
    "EmulatedTransport", "PortableTransport", "SymmetricTransport", "Transport", "get_transport", "resolve_transport",
    "all_gather_matmul", "all_gather_tokens", "copy_to_tp_matmul", "gather_features", "matmul_all_reduce",
    "matmul_reduce_scatter", "replicated_rows", "scatter_features",
    "LAYOUTS", "document_positions", "hybrid_attention", "ring_attention", "sequence_shard", "shard_positions",
    "ulysses_attention", "zigzag_positions", "zigzag_shard", "zigzag_unshard",
    "flash_attention", "flash_attention_varlen",
    "MoEPlan", "grouped_mlp", "moe_combine", "moe_dispatch", "moe_expert_compute", "moe_mlp", "moe_plan", "moe_route",
    "rms_norm", "rms_norm_fp8", "sharded_rms_norm",
    "attach_aux_loss", "global_loss", "linear_cross_entropy", "vocab_parallel_cross_entropy",
    "fp8_linear",
]
