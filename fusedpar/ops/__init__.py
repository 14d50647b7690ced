from .norm import RMSNormFunction, rms_norm  # noqa: E402,F401
