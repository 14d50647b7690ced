"""The names this module held before the sequence-parallel attention family moved to
:mod:`fusedpar.ops.sp_attention` (the functional API), :mod:`fusedpar.ops.sp_attention_library`
(the custom ops) and :mod:`fusedpar.ops.sp_attention_schedules` (the layouts and the schedules):
re-exported here so that existing imports keep working. New code imports from those modules.
"""
from fusedpar.ops.sp_attention_schedules import (  # noqa: F401 - re-exported
    LAYOUTS,
    check_sp_args,
    check_transport,
    document_plan,
    ring_attention_bwd,
    ring_attention_fwd,
    ring_step_plan,
    sequence_shard,
    shard_chunks,
    shard_positions,
    split_heads,
    ulysses_attention_bwd,
    ulysses_attention_fwd,
    ulysses_kv_heads,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "LAYOUTS", "check_sp_args", "check_transport", "document_plan", "ring_attention_bwd", "ring_attention_fwd",
    "ring_step_plan", "sequence_shard", "shard_chunks", "shard_positions", "split_heads", "ulysses_attention_bwd",
    "ulysses_attention_fwd", "ulysses_kv_heads", "zigzag_positions", "zigzag_shard", "zigzag_unshard",
]
