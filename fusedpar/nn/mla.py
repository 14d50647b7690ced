"""Multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi K2) with tensor and sequence parallelism.

:class:`MLAttention` projects the hidden states down to small latents and back up per head:

* queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``q_lora_rank``), or ``q_proj(x)`` without a
  query latent; each head has ``qk_nope_head_dim`` features without and ``qk_rope_head_dim`` with
  the rotary embedding;
* keys and values: ``kv_a_proj_with_mqa(x)`` gives the latent ``c`` (``kv_lora_rank``) and one
  rotary key ``k_pe`` (``qk_rope_head_dim``) shared by every head; ``kv_b_proj(kv_a_layernorm(c))``
  gives each head's non-rotary key part and its value (``v_head_dim``);
* attention over q / k head dim ``nope + rope`` and v head dim ``v_head_dim``, softmax scale
  ``(nope + rope) ** -0.5`` times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN with
  ``mscale_all_dim`` (DeepSeek-V3); ``o_proj`` back to the hidden size.

Parallel layout (Megatron's sequence-parallel tensor parallelism): the input ``x`` is this rank's
``[batch, S / (sp * tp), hidden]`` token shard. The down projections and the two latent norms are
small and replicated; each rank runs them on its own tokens only, so their gradients are partial
and summed over tp and sp (placement kind ``"replicated"``). The up projections are
:class:`ColumnParallelLinear` over the heads with ``sequence_parallel=True``: their fused
all-gather collects the latents of the ``tp`` token pieces of the sequence-parallel shard, and its
backward reduce-scatters the latents' gradients (each rank's heads give a different one);
``k_pe`` travels the same way through :func:`~fusedpar.ops.all_gather_tokens`. Attention runs
over this rank's heads on the sequence-parallel shard (ring, Ulysses or hybrid, as
:class:`ParallelAttention`), and ``o_proj`` is a :class:`RowParallelLinear` whose reduce-scatter
returns the token shard.

The rotary embedding covers the ``qk_rope_head_dim`` features only; ``rope_interleave`` (Hugging
Face's default for DeepSeek-V3) reads them as interleaved pairs ``(x0, x1), (x2, x3), ...``: they
are de-interleaved (evens, then odds) and rotated in the rotate-half convention, which is what
transformers' ``apply_rotary_pos_emb_interleave`` computes.
"""
from __future__ import annotations

import torch
from torch import nn

from fusedpar.kernels.checks import check_bool, check_choice, check_int, check_positive_number
from fusedpar.kernels.flash_attention_bwd import DQ_MODES
from fusedpar.nn.attention import SequenceParallelAttention
from fusedpar.nn.config import MLAConfig, module_config
from fusedpar.nn.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin, yarn_mscale
from fusedpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fusedpar.nn.norm import RMSNorm
from fusedpar.nn.placement import Placement
from fusedpar.ops.sequence_parallel.bodies import ulysses_kv_heads
from fusedpar.ops.tensor_parallel.api import all_gather_tokens

__all__ = ["MLAttention", "mla_softmax_scale"]


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor,
    mscale_all_dim) ** 2`` when ``rope_scaling`` is not the default one and has a non-zero
    ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
        mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            scale *= yarn_mscale(float(rope_scaling["factor"]), float(mscale_all_dim)) ** 2
    return scale


def _replicated_linear(in_features, out_features, bias, device, dtype):
    """An ``nn.Linear`` drawn like ``nn.Linear`` on the CPU's global RNG (as the parallel layers
    draw their full weights), then moved; on the meta device nothing is drawn."""
    meta = device is not None and torch.device(device).type == "meta"
    lin = nn.Linear(in_features, out_features, bias=bias, device="meta" if meta else None)
    return lin if meta else lin.to(device=device, dtype=dtype)


class MLAttention(SequenceParallelAttention):
    """Tensor- and sequence-parallel multi-head latent attention (see the module docstring).

    ``config``: an :class:`~fusedpar.nn.config.MLAConfig`. Input ``x``: ``[batch, S / (sp * tp),
    hidden_size]``, this rank's tokens; output the same shape. ``num_heads`` must split over
    ``tp_group``; the groups, ``sp_mode``, ``layout`` and the transports are those of
    :class:`ParallelAttention`. ``q_lora_rank=None``: a plain
    column-parallel ``q_proj``. ``bias``: Hugging Face's ``attention_bias`` (on ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and ``o_proj``). ``norm_eps``: the latent norms' epsilon (1e-6 in
    transformers, whatever the model's ``rms_norm_eps``). Submodules carry Hugging Face's names.

    Gradients: sum the replicated parameters' (the down projections, the latent norms; kind
    ``"replicated"``) over tp and sp and the others over sp: :func:`fusedpar.parallel.sync_gradients`
    with the model's gradient plan, or :meth:`reduce_sequence_parallel_grads` for the module alone.
    """

    def __init__(self, config: MLAConfig, *, tp_group=None, sp_group=None, ulysses_group=None, ring_group=None,
                 sp_transport=None, ulysses_transport=None, ring_transport=None, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        self.config = c = module_config(name, config, MLAConfig)
        hidden_size, num_heads, q_lora_rank, kv_lora_rank = c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        causal, bias, rope_theta, rope_scaling, rope_interleave = (
            c.causal, c.bias, c.rope_theta, c.rope_scaling, c.rope_interleave)
        norm_eps, sp_mode, layout, dq_mode = c.norm_eps, c.sp_mode, c.layout, c.dq_mode
        for arg, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                         ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            check_int(f"{name}: {arg}", val, min_value=1)
        check_int(f"{name}: qk_nope_head_dim", qk_nope_head_dim, min_value=0)
        if q_lora_rank is not None:
            check_int(f"{name}: q_lora_rank", q_lora_rank, min_value=1)
        if qk_rope_head_dim % 2:
            raise ValueError(f"{name}: qk_rope_head_dim must be even (rotary pairs), got {qk_rope_head_dim}")
        for arg, val in (("causal", causal), ("bias", bias), ("rope_interleave", rope_interleave)):
            check_bool(f"{name}: {arg}", val)
        check_positive_number(f"{name}: rope_theta", rope_theta)
        check_choice(f"{name}: dq_mode", dq_mode, DQ_MODES)
        self.dq_mode = dq_mode
        check_positive_number(f"{name}: norm_eps", norm_eps)
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        rope_inv_freq(qk_rope_head_dim, float(rope_theta), self.rope_scaling)  # validates the scaling
        self.init_layout({"num_heads": num_heads}, tp_group=tp_group, sp_group=sp_group, sp_mode=sp_mode,
                         layout=layout, ulysses_group=ulysses_group, ring_group=ring_group, sp_transport=sp_transport,
                         ulysses_transport=ulysses_transport, ring_transport=ring_transport)
        self.hidden_size, self.num_heads, self.heads_local = hidden_size, num_heads, num_heads // self.tp_size
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.causal, self.rope_theta, self.rope_interleave = bool(causal), float(rope_theta), bool(rope_interleave)
        self.softmax_scale = mla_softmax_scale(self.qk_head_dim, self.rope_scaling)
        if self.ulysses_size > 1:
            ulysses_kv_heads(self.heads_local, self.heads_local, self.ulysses_size)
        # built in Hugging Face's order: one seed gives the same full weights at every layout
        col = dict(group=self.tp_group, sequence_parallel=True, device=device, dtype=dtype)
        self.q_a_proj = self.q_a_layernorm = self.q_b_proj = self.q_proj = None
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * self.qk_head_dim, False, **col)
        else:
            self.q_a_proj = _replicated_linear(hidden_size, q_lora_rank, bias, device, dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, device=device, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * self.qk_head_dim, False, **col)
        self.kv_a_proj_with_mqa = _replicated_linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias, device, dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, **col)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, group=self.tp_group,
                                        sequence_parallel=True, input_is_parallel=True, device=device, dtype=dtype)

    def placements(self) -> dict[str, Placement]:
        """The down projections: whole on every rank, run on this rank's tokens only (their
        gradients are summed over tp and sp). The other parameters are declared by their modules."""
        out = {}
        for prefix in ("q_a_proj", "kv_a_proj_with_mqa"):
            proj = getattr(self, prefix)
            if proj is not None:
                out.update({f"{prefix}.{n}": Placement.replicated(sequence_sharded=True)
                            for n, _ in proj.named_parameters()})
        return out

    def _rotate(self, x, cos, sin):
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> evens then odds (rotate-half layout)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def forward(self, x, *, cu_seqlens=None, position_ids=None):
        """``cu_seqlens`` / ``position_ids``: packed documents, as in :meth:`ParallelAttention.forward`."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__}: x must be [batch, seq_local, {self.hidden_size}], got {shape}")
        hl, dn, dr, dv = self.heads_local, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [b, s_sp, hl * (dn + dr)]
        b, s_sp, _ = q.shape
        q = q.view(b, s_sp, hl, dn + dr)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(b, s_sp, hl, dn + dv)
        k_pe = all_gather_tokens(k_pe.contiguous(), self.tp_group, dim=1)  # [b, s_sp, dr], one head for all
        seq_len = s_sp * self.ring_size * self.ulysses_size
        pos = self.rotary_positions(seq_len, x.device, cu_seqlens=cu_seqlens, position_ids=position_ids)
        cos, sin = rotary_cos_sin(pos, dr, self.rope_theta, scaling=self.rope_scaling)
        k_rot = self._rotate(k_pe[:, :, None, :], cos, sin).expand(b, s_sp, hl, dr)
        q = torch.cat([q[..., :dn], self._rotate(q[..., dn:], cos, sin)], dim=-1)
        k = torch.cat([kv[..., :dn], k_rot], dim=-1)
        v = kv[..., dn:].contiguous()  # its own head dim: the sp ops take v of any head dim
        return self.attend_project(self.o_proj, q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                                   cu_seqlens=cu_seqlens, dq_mode=self.dq_mode)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads} (local {self.heads_local}), "
                f"q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_head_dim={self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
                f"softmax_scale={self.softmax_scale:.6g}, sp_mode={self.sp_mode!r}, layout={self.layout!r}, "
                f"tp={self.tp_rank}/{self.tp_size}, causal={self.causal}, dq_mode={self.dq_mode!r}")
