"""Triton kernels and their host launchers (installed as ``fusedpar.kernels``).

Nothing here touches ``torch.distributed``; nothing here runs GPU work at import time.
"""
if __name__ == "kernels":  # pragma: no cover - guards against importing the source dir directly
    raise ImportError(
        "the kernels/ directory is the package fusedpar.kernels; import fusedpar.kernels instead "
        "(install the project with `pip install -e .`)"
    )

from .runtime import interpreting
from .gemm import ACTIVATIONS, matmul, matmul_reference, matmul_tn
from .moe import (
    combine,
    combine_backward,
    grouped_matmul,
    grouped_matmul_dact,
    grouped_matmul_reference,
    grouped_wgrad,
    moe_mlp_reference,
    permute,
    routing_metadata,
    routing_metadata_reference,
)
from .persistent_gemm import WaitTimeout, chunk_reduce, chunk_view, persistent_matmul, wait_timeouts

__all__ = ["ACTIVATIONS", "interpreting", "matmul", "matmul_reference", "matmul_tn"]
__all__ += [
    "combine", "combine_backward", "grouped_matmul", "grouped_matmul_dact", "grouped_matmul_reference",
    "grouped_wgrad", "moe_mlp_reference", "permute", "routing_metadata", "routing_metadata_reference",
]
from .flash_attention import (  # noqa: E402
    attention_delta,
    attention_reference,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
)

__all__ += [
    "attention_delta",
    "attention_reference",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
]
__all__ += ["WaitTimeout", "chunk_reduce", "chunk_view", "persistent_matmul", "wait_timeouts"]
from .rmsnorm import rms_norm_bwd, rms_norm_fwd, rms_norm_reference  # noqa: E402,F401
