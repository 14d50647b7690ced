"""The rotary position embedding of fusedpar's attention blocks (rotate-half convention, as in
Hugging Face): the inverse frequencies with their scalings (``default``, ``llama3``, ``yarn``),
``cos`` / ``sin`` at given positions and their application to q / k heads (partial rotary too)."""
from __future__ import annotations

import math

import torch

__all__ = ["ROPE_TYPES", "apply_rotary", "rope_attention_factor", "rope_inv_freq", "rotary_cos_sin", "yarn_mscale"]


ROPE_TYPES = ("default", "llama3", "yarn")


def _scaling_value(scaling, key, rope_type, *, default=None):
    if key in scaling and scaling[key] is not None:
        return float(scaling[key])
    if default is None:
        raise ValueError(f"rope_scaling of rope_type {rope_type!r} must have {key!r}, got {scaling!r}")
    return default


def _rope_type(scaling):
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    return rope_type


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor the rotary ``cos`` / ``sin`` are multiplied by (Hugging Face's
    ``attention_scaling``): 1 except for ``"yarn"``, where it is ``attention_factor`` when given,
    else ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are set
    (DeepSeek-V3), else ``yarn_mscale(factor)``."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _scaling_value(scaling, "factor", "yarn")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(inv_freq, head_dim, theta, scaling):
    """YaRN (NTK-by-parts): the frequencies that turn fewer than ``beta_slow`` times over
    ``original_max_position_embeddings`` are divided by ``factor``, those that turn more than
    ``beta_fast`` times are kept, with a linear ramp over the dimensions between (the range
    rounded outwards unless ``truncate`` is False), as transformers' ``_compute_yarn_parameters``."""
    factor = _scaling_value(scaling, "factor", "yarn")
    old_len = _scaling_value(scaling, "original_max_position_embeddings", "yarn")
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations):
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (fp64) of the rotary embedding with base ``theta``.

    ``scaling`` follows Hugging Face's ``rope_scaling`` / ``rope_parameters``: ``None`` or
    ``rope_type`` ``"default"`` leave them; ``"llama3"`` (Llama 3.1) divides the low frequencies by
    ``factor`` and interpolates the middle band between ``low_freq_factor`` and
    ``high_freq_factor`` of ``original_max_position_embeddings``; ``"yarn"`` (DeepSeek-V3, Kimi
    K2, gpt-oss, Qwen long context) takes ``factor``, ``original_max_position_embeddings`` and the
    optional ``beta_fast`` (32), ``beta_slow`` (1), ``truncate`` (True), ``mscale``,
    ``mscale_all_dim``, ``attention_factor`` (see :func:`rope_attention_factor`). Any other type
    raises ``ValueError``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "yarn":
        rope_attention_factor(scaling)  # validates its fields too
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    factor, low, high, old_len = (_scaling_value(scaling, k, "llama3") for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32, scaling=None):
    """``cos, sin`` of shape ``[len(positions), head_dim]`` (rotate-half convention, as in
    GPT-NeoX / Llama), computed in fp64 from integer global positions (``scaling``: see
    :func:`rope_inv_freq`; both are multiplied by :func:`rope_attention_factor`, as Hugging Face
    does)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=positions.device)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_attention_factor(scaling)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[batch, seq, heads, head_dim]`` and
    ``cos``/``sin`` ``[seq, rotary_dim]``; computed in fp32, returned in x's dtype. ``rotary_dim <
    head_dim`` (partial rotary, GLM-4.5): the first ``rotary_dim`` features of each head are rotated
    (rotate-half within them), the others pass unchanged (transformers' ``apply_rotary_pos_emb``)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[None, :, None, :] + rot * sin[None, :, None, :]).to(x.dtype)
