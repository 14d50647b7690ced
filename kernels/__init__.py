"""Triton kernels and their host launchers (installed as ``fusedpar.kernels``).

Nothing here touches ``torch.distributed``; nothing here runs GPU work at import time.
"""
if __name__ == "kernels":  # the source dir imported as a top-level package (repository root on sys.path)
    # An unrelated PyPI package is called ``kernels`` (Hugging Face's hub kernels; transformers >= 5.25
    # depends on it and imports it). Where it is installed, this directory hands the import over to
    # it: the module importlib returns is whatever sys.modules holds once this file has run.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _ROOT]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.origin is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        try:
            _spec.loader.exec_module(_module)
        except BaseException:
            _sys.modules.pop("kernels", None)
            raise
    else:
        # Not installed: not an error at import time either (libraries probe for that package and
        # read its version); this module then looks like a package without a version and without
        # any of that package's names.
        _MESSAGE = ("the kernels/ directory is the package fusedpar.kernels; import fusedpar.kernels instead "
                    "(install the project with `pip install -e .`)")

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise AttributeError(f"module 'kernels' has no attribute {name!r}: {_MESSAGE}")

        __all__ = []
else:
    from .interpreter import check_interpreter
    from .runtime import ACTIVATIONS, interpreting

    check_interpreter()
    from .gemm import matmul, matmul_reference, matmul_tn
    from .linear_ce import linear_ce_dlogits, linear_ce_dlogits_reference, linear_ce_stats, linear_ce_stats_reference
    from .grouped_bias import grouped_bias_grad
    from .fp8 import dequantize_e4m3, quantize_e4m3
    from .fp8_gemm import fp8_matmul
    from .grouped_gemm import (
        as_group_offsets,
        grouped_matmul,
        grouped_matmul_dact,
        grouped_wgrad,
    )
    from .moe_permute import combine, combine_backward, permute
    from .moe_routing import grouped_matmul_reference, moe_mlp_reference, routing_metadata, routing_metadata_reference
    from .persistent_gemm import chunk_reduce, chunk_view, persistent_matmul, persistent_matmul_reference
    from .waits import WaitTimeout, check_wait_timeouts, wait_timeouts
    from .flash_attention import attention_reference, flash_attention_forward
    from .flash_attention_bwd import attention_delta, flash_attention_backward
    from .flash_varlen import flash_attention_varlen, flash_attention_varlen_backward, varlen_attention_reference
    from .rmsnorm import rms_norm_bwd, rms_norm_fp8_fwd, rms_norm_fwd, rms_norm_reference

    __all__ = [
        "ACTIVATIONS", "interpreting", "matmul", "matmul_reference", "matmul_tn",
        "linear_ce_dlogits", "linear_ce_dlogits_reference", "linear_ce_stats", "linear_ce_stats_reference",
        "dequantize_e4m3", "fp8_matmul", "quantize_e4m3",
        "as_group_offsets", "combine", "combine_backward", "grouped_bias_grad", "grouped_matmul", "grouped_matmul_dact",
        "grouped_matmul_reference", "grouped_wgrad", "moe_mlp_reference", "permute", "routing_metadata",
        "routing_metadata_reference",
        "WaitTimeout", "check_wait_timeouts", "chunk_reduce", "chunk_view", "persistent_matmul",
        "persistent_matmul_reference", "wait_timeouts",
        "attention_delta", "attention_reference", "flash_attention_backward", "flash_attention_forward",
        "flash_attention_varlen", "flash_attention_varlen_backward", "varlen_attention_reference",
        "rms_norm_bwd", "rms_norm_fp8_fwd", "rms_norm_fwd", "rms_norm_reference",
    ]
