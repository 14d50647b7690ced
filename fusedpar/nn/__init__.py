from .norm import RMSNorm  # noqa: E402,F401
