"""One transformer block, :class:`TransformerBlock`: attention and MLP (dense or MoE) with their
norms and residual adds, over ``[batch, seq / (sp * tp), hidden]`` activations."""
from __future__ import annotations

import torch
from torch import nn

from fusedpar.kernels.checks import check_bool, check_choice
from fusedpar.ops.loss.api import attach_aux_loss

from .attention import ParallelAttention
from .config import NORM_LAYOUTS, AttentionConfig, BlockConfig, MLAConfig, module_config
from .linear import FP8_OPTION, ColumnParallelLinear, ParallelMLP, enable_fp8
from .mla import MLAttention
from .moe import MoE, SharedExpertGate
from .norm import RMSNorm

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x))``; ``y = h + mlp(norm2(h))`` (the second norm is
    fused with the residual add). ``x`` and ``y`` are ``[batch, seq / (sp*tp), hidden]``.

    ``norm_layout="post"`` (OLMo 2): ``h = x + post_attn_norm(attn(x))``; ``y = h +
    post_mlp_norm(mlp(h))`` (no norm1 / norm2). ``"sandwich"`` (Gemma 2/3): ``h = x +
    post_attn_norm(attn(norm1(x)))``; ``y = h + post_mlp_norm(mlp(norm2(h)))`` (norm2 fused with
    the residual add). ``norm_offset=1.0``: every norm scales by ``1 + weight`` (Gemma).

    ``config``: a :class:`~fusedpar.nn.config.BlockConfig` (a model's:
    :meth:`TransformerConfig.block_config`). ``config.moe`` replaces the dense :class:`ParallelMLP`
    with a :class:`MoE` over ``ep_group``; its router losses (``self.mlp.aux_loss``) are attached to
    the backward with weight ``aux_loss_scale`` when that is non-zero. An :class:`MLAConfig` as
    ``config.attention`` builds an :class:`MLAttention` instead of a :class:`ParallelAttention`.

    ``sp_mode="hybrid"`` (in the attention's config) takes ``ulysses_group`` and ``ring_group`` (e.g.
    a :class:`~fusedpar.parallel.ParallelState`'s) instead of ``sp_group``. Omitted groups and the
    construction-time layout checks: as in :class:`Transformer` (an omitted group is the world; a
    layout that does not fit raises one ``ValueError`` naming the groups and their ranks). ``fp8``,
    ``fp8_grad_high_precision``: the tensor-parallel projections of the attention, the dense MLP
    and the shared expert in fp8 (:func:`~fusedpar.nn.linear.enable_fp8`), and the routed experts
    (:meth:`MoE.set_fp8`: fp8 dispatch and expert GEMMs); the router stays in fp32. With fp8 the
    pre-norms that feed the attention's qkv projection and the dense MLP's first projection write
    their output's quantisation in the norm kernel (:func:`~fusedpar.ops.rms_norm_fp8`), which the
    projection gathers instead of quantising the norm's output again (the same bits).
    """

    def __init__(self, config: BlockConfig, *, tp_group=None, sp_group=None, ep_group=None, ulysses_group=None,
                 ring_group=None, aux_loss_scale: float = 0.0, device=None, dtype=None):
        super().__init__()
        self.config = c = module_config("TransformerBlock", config, BlockConfig)
        check_choice("TransformerBlock: norm_layout", c.norm_layout, NORM_LAYOUTS)
        hidden_size = c.hidden_size
        self.hidden_size, self.norm_layout = hidden_size, c.norm_layout
        norm = lambda: RMSNorm(hidden_size, c.norm_eps, offset=c.norm_offset, device=device, dtype=dtype)  # noqa: E731
        pre, post = c.norm_layout in ("pre", "sandwich"), c.norm_layout in ("post", "sandwich")
        self.norm1 = norm() if pre else None
        groups = dict(tp_group=tp_group, sp_group=sp_group, ulysses_group=ulysses_group, ring_group=ring_group,
                      device=device, dtype=dtype)
        attention = module_config("TransformerBlock: config.attention", c.attention, (AttentionConfig, MLAConfig))
        self.attn = (MLAttention if isinstance(attention, MLAConfig) else ParallelAttention)(attention, **groups)
        self.post_attn_norm = norm() if post else None
        self.norm2 = norm() if pre else None
        self.is_moe = c.moe is not None
        self.shared_expert = self.shared_expert_gate = None
        if self.is_moe:
            self.mlp = MoE(c.moe, ep_group=ep_group, device=device, dtype=dtype)
            if c.shared_expert_ffn_hidden_size:  # Qwen2-MoE: y = moe(x) + sigmoid(gate x) * mlp(x)
                self.shared_expert = ParallelMLP(hidden_size, c.shared_expert_ffn_hidden_size,
                                                 activation=c.activation, group=tp_group, sequence_parallel=True,
                                                 bias=False, device=device, dtype=dtype)
                if check_bool("shared_expert_gate", c.shared_expert_gate):  # DeepSeek-V3: y = moe(x) + mlp(x)
                    self.shared_expert_gate = SharedExpertGate(hidden_size, device=device, dtype=dtype)
        else:
            self.mlp = ParallelMLP(hidden_size, c.ffn_hidden_size, activation=c.activation, group=tp_group,
                                   sequence_parallel=True, bias=False, device=device, dtype=dtype)
        self.post_mlp_norm = norm() if post else None
        self.aux_loss_scale = float(aux_loss_scale)
        self._enable_fp8(c.fp8, c.fp8_grad_high_precision)

    def _enable_fp8(self, fp8, grad_high_precision) -> None:
        if fp8 is not None and getattr(self.attn, "kv_replicas", 1) > 1:  # its projection bypasses qkv's forward
            raise ValueError(f"fp8={fp8!r} (TransformerConfig.fp8) needs num_kv_heads divisible by the tensor-parallel "
                             f"size (kv heads replicated over tp are not fp8 yet), got {self.attn.num_kv_heads} kv "
                             f"heads at tp {self.attn.tp_size}")
        for part in (self.attn, None if self.is_moe else self.mlp, self.shared_expert):
            if part is not None:
                enable_fp8(part, fp8, grad_high_precision=grad_high_precision)
        if self.is_moe:
            self.mlp.set_fp8(fp8, grad_high_precision=grad_high_precision, option=FP8_OPTION)

    def forward(self, x: torch.Tensor, *, cu_seqlens=None, position_ids=None) -> torch.Tensor:
        """``cu_seqlens`` / ``position_ids``: packed documents, see :meth:`ParallelAttention.forward`."""
        n1, kw1 = x, {}
        if self.norm1 is not None:
            (n1,), kw1 = self._pre_norm(self.norm1, x, None, self._attn_projection())
        a = self.attn(n1, cu_seqlens=cu_seqlens, position_ids=position_ids, **kw1)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        kw2 = {}
        if self.norm2 is not None:
            (n2, h), kw2 = self._pre_norm(self.norm2, a, x, self.mlp.fc1 if isinstance(self.mlp, ParallelMLP) else None)
        else:
            n2 = h = x + a
        m = self.feed_forward(n2, **kw2)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        if self.is_moe and self.aux_loss_scale and torch.is_grad_enabled():
            # the router losses ride on the residual add (no extra pass over the activations)
            return attach_aux_loss(m, self.mlp.aux_loss, self.aux_loss_scale, residual=h)
        return h + m

    def _attn_projection(self):
        """The projection that takes the attention's input as it is: the qkv one of a
        :class:`ParallelAttention` whose kv heads are not replicated over tp (None for MLA)."""
        attn = self.attn
        return attn.qkv if isinstance(attn, ParallelAttention) and attn.kv_replicas == 1 else None

    @staticmethod
    def _handoff_recipe(norm, projection) -> str | None:
        """The fp8 recipe in which ``norm`` hands its output to ``projection`` (its consumer as it
        is, or None) already quantised: the projection's, where it is an fp8 column-parallel one
        over the all-gather and the norm holds all its features; else None."""
        if isinstance(projection, ColumnParallelLinear) and projection.sequence_parallel and norm.parts == 1:
            return projection.fp8
        return None

    def _pre_norm(self, norm, x, residual, projection):
        """``(outputs, kwargs)``: ``norm(x, residual)``'s outputs as a tuple (``(y,)`` or ``(y, h)``)
        and what ``projection`` is called with: with a :meth:`_handoff_recipe` the norm writes
        ``y``'s quantisation too (:func:`~fusedpar.ops.rms_norm_fp8`), handed over as ``x_fp8``:
        one quantisation of ``y`` instead of two."""
        recipe = self._handoff_recipe(norm, projection)
        if recipe is None:
            out = norm(x, residual=residual)
            return (out if residual is not None else (out,)), {}
        out = norm(x, residual=residual, fp8=recipe)
        return tuple(out[:-2]), {"x_fp8": tuple(out[-2:])}

    def feed_forward(self, x: torch.Tensor, *, x_fp8=None) -> torch.Tensor:
        """The MLP sub-block on normed ``x`` (no residual): the dense MLP, or the MoE plus its shared
        expert (times its sigmoid gate when it has one), e.g. transformers' ``DeepseekV3MoE``.
        ``x_fp8``: ``x`` already quantised for the dense MLP's fp8 first projection."""
        m = self.mlp(x) if x_fp8 is None else self.mlp(x, x_fp8=x_fp8)
        if self.shared_expert is None:
            return m
        s = self.shared_expert(x)
        return m + (s if self.shared_expert_gate is None else self.shared_expert_gate(x) * s)
