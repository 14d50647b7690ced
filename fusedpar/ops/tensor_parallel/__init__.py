"""Tensor-parallel GEMMs with their communication overlapped: the all-gather GEMM, the GEMM +
reduce-scatter, the GEMM + all-reduce and the copy-to-TP GEMM (bf16 / fp16 / fp32 or fp8, over a
ring of per-chunk GEMMs or one persistent GEMM that waits per chunk), the feature-dim gather /
scatter of the tensor-parallel layers and their replicated rows.

Roles: :mod:`.api` (the checked functional API), :mod:`.custom_ops` (the registered custom ops
with fakes and autograd), :mod:`.bodies` (the ops' named forward / backward bodies),
:mod:`.schedules` (the ring schedules), :mod:`.symmetric` (the in-kernel-wait schedules)."""
from .api import (
    all_gather_matmul,
    all_gather_tokens,
    copy_to_tp_matmul,
    gather_features,
    matmul_all_reduce,
    matmul_reduce_scatter,
    replicated_rows,
    scatter_features,
)

__all__ = ["all_gather_matmul", "all_gather_tokens", "copy_to_tp_matmul", "gather_features", "matmul_all_reduce",
           "matmul_reduce_scatter", "replicated_rows", "scatter_features"]
