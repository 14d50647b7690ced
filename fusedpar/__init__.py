"""fusedpar: Triton kernels for distributed training on stock ``triton`` + ``torch``."""
__version__ = "0.1.0"
