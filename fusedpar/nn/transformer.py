"""A pre-norm transformer built from fusedpar modules, and the pieces that compose it with
data, pipeline and expert parallelism.

Activation layout between layers: ``[batch, seq / (sp * tp), hidden]`` on every rank (Megatron
sequence parallelism over tp, context parallelism over sp). Inside a block:

* attention: :class:`~fusedpar.nn.ParallelAttention` (QKV column-parallel over tp with the
  sequence all-gather fused into the GEMM, attention over the local heads sequence-parallel across
  sp, output row-parallel with the reduce-scatter fused into the GEMM);
* MLP: :class:`~fusedpar.nn.ParallelMLP` (dense) or :class:`~fusedpar.nn.MoE` (experts over
  the ep group, tokens routed from this rank's sequence shard);
* norms: the fused Triton :class:`~fusedpar.nn.RMSNorm`, the second one fused with the residual
  add.

The token sequence is put into the sp layout at the input (:func:`shard_tokens`): with ring
attention in ``"zigzag"`` layout sp rank ``i`` holds chunks ``i`` and ``2*sp-1-i`` of ``2*sp``
chunks (balanced causal work), then tp splits that rank's tokens contiguously. The loss uses the
same permutation for the targets, so nothing has to be un-permuted. With ``sp_mode="hybrid"``
the zigzag runs over the ``ring_size`` ring ranks and each ring shard is split into
``sp / ring_size`` contiguous Ulysses pieces (sp rank ``ring_rank * ulysses_size + ulysses_rank``),
the layout :func:`fusedpar.ops.hybrid_attention` documents; ``sp_mode="ulysses"`` is
``ring_size=1`` (contiguous).

The output head is column-parallel over the vocabulary;
:func:`fusedpar.ops.vocab_parallel_cross_entropy` computes the loss without gathering the logits,
and :meth:`Transformer.loss` of the final hidden states (``model(ids, return_hidden=True)``) fuses
the head into the loss (:func:`fusedpar.ops.linear_cross_entropy`): the logits never exist.
Every rank of a tp group ends with the same loss (over that tp group's tokens), which is what the
gradient rules in :mod:`fusedpar.parallel` assume; :meth:`Transformer.gradient_sync_plan` names
the rule of every parameter, from the placements its modules declare.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedpar.kernels.checks import check_bool, check_int
from fusedpar.ops import comm
from fusedpar.ops.loss.api import linear_cross_entropy
from fusedpar.ops.loss.api import vocab_parallel_cross_entropy

from fusedpar.ops.sequence_parallel.layouts import shard_positions
from fusedpar.ops.tensor_parallel.api import all_gather_matmul

from .block import TransformerBlock
from .config import TransformerConfig, check_token_ids
from .groups import check_divides, check_kv_heads, check_orthogonal, group_arg
from .linear import ColumnParallelLinear
from .moe import RouterLoad, hf_load_balancing_loss, recomputation_contexts, sum_over_groups
from .norm import RMSNorm
from .placement import Placement, gradient_sync_plan
from .sequence import sequence_order, shard_tokens  # the input layout, re-exported

__all__ = ["Transformer", "sequence_order", "shard_tokens",
           "vocab_parallel_cross_entropy"]  # the loss lives in fusedpar.ops.loss, re-exported here

# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
def _check_groups(config, tp_group, sp_group, ep_group, ulysses_group, ring_group) -> None:
    """The groups fit together (:mod:`fusedpar.nn.groups`), checked once for the whole model (also
    for a pipeline stage without blocks); the blocks' attention checks them again with its
    transports."""
    tp = group_arg("tp_group", tp_group, omitted=tp_group is None)
    check_divides("Transformer", "config.vocab_size", config.vocab_size, tp, "tensor-parallel")
    check_divides("Transformer", "config.num_heads", config.num_heads, tp, "tensor-parallel")
    check_kv_heads("Transformer", "config.num_kv_heads", config.num_kv_heads or config.num_heads, tp)
    if any(config.is_moe(i) for i in range(config.num_layers)):
        ep = group_arg("ep_group", ep_group, omitted=ep_group is None)
        check_divides("Transformer", "config.num_experts", config.num_experts, ep, "expert-parallel")
    if config.sp_mode != "hybrid":
        check_orthogonal("Transformer", tp, group_arg("sp_group", sp_group, omitted=sp_group is None))
    elif ulysses_group is not None and ring_group is not None:
        uly, ring = group_arg("ulysses_group", ulysses_group), group_arg("ring_group", ring_group)
        for a, b in ((tp, uly), (tp, ring), (uly, ring)):
            check_orthogonal("Transformer", a, b)


class Transformer(nn.Module):
    """Embedding -> blocks -> final RMSNorm -> vocabulary-parallel head, or one pipeline stage of it.

    ``layers`` selects the global block indices this module holds (default all); ``embed`` /
    ``head`` say whether it holds the embedding (input: token ids ``[batch, seq/(sp*tp)]``) and
    the final norm + head (output: logits ``[batch, seq/sp, vocab/tp]``). Blocks live in
    ``self.layers`` (a ``ModuleDict`` keyed by the global index), so parameter names — and
    checkpoints — do not depend on the pipeline split.

    With ``config.sp_mode == "hybrid"`` pass ``ulysses_group`` and ``ring_group`` (a
    :class:`~fusedpar.parallel.ParallelState` built with ``sp_ulysses`` has them) instead of
    ``sp_group``; the input ids then come from :func:`shard_tokens` with ``ring_size`` = the ring
    group's size.

    Groups: an omitted group (``None``) is the default (world) group, as everywhere in fusedpar;
    for no parallelism on a dimension pass a group of one rank (a
    :class:`~fusedpar.parallel.ParallelState` has one for every size-1 dimension: pass all its
    groups). The groups are checked at construction (:mod:`fusedpar.nn.groups`): tp and sp (tp,
    Ulysses and ring) must be orthogonal where more than one of them has more than one rank, and
    the tensor-parallel size must divide the vocabulary and the heads, the expert-parallel size the
    experts; a layout that does not fit raises one ``ValueError`` on every rank naming the groups
    and their ranks, where running it would hang (e.g. ``tp_group=state.tp_group`` alone in a
    pp2 x tp2 world: the omitted ``sp_group`` is the world of 4, which overlaps tp).

    Initialisation does not depend on the parallel layout: every block is initialised from a
    generator seeded with ``seed + layer`` (embedding ``seed - 1``, head ``seed - 2``), so a
    one-process model and any split of it hold the same full weights.
    """

    def __init__(self, config: TransformerConfig, *, tp_group=None, sp_group=None, ep_group=None,
                 ulysses_group=None, ring_group=None, layers: Iterable[int] | None = None, embed: bool = True,
                 head: bool = True, seed: int = 0,
                 activation_checkpointing: bool = False, aux_loss_scale: float = 0.0, device=None, dtype=None,
                 return_hidden: bool = False):
        super().__init__()
        self.config = config
        self.return_hidden = check_bool("return_hidden", return_hidden)
        self.tp_group, self.sp_group, self.ep_group = tp_group, sp_group, ep_group
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        _check_groups(config, tp_group, sp_group, ep_group, ulysses_group, ring_group)
        self.activation_checkpointing = bool(activation_checkpointing)
        layers = list(range(config.num_layers)) if layers is None else [int(i) for i in layers]
        for i in layers:
            if not 0 <= i < config.num_layers:
                raise ValueError(f"layer index {i} is outside 0..{config.num_layers - 1}")
        self.layer_ids = layers
        self.embedding = None
        if embed:
            on_meta = device is not None and torch.device(device).type == "meta"
            with _seeded(seed - 1):  # drawn on the CPU like every fusedpar layer: same weights on any device
                self.embedding = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id,
                                              device="meta" if on_meta else None).to(device=device, dtype=dtype)
        if config.aux_loss_style == "hf" and aux_loss_scale:
            raise ValueError("aux_loss_scale must be 0 with config.aux_loss_style='hf' (the loss is pooled over "
                             f"layers: add model.aux_loss() to the training loss), got {aux_loss_scale}")
        if config.tie_word_embeddings and not (embed and head):
            raise ValueError("config.tie_word_embeddings needs the embedding and the head in the same module "
                             f"(embed=True, head=True), got embed={embed}, head={head}")
        self.layers = nn.ModuleDict()
        for i in layers:
            with _seeded(seed + i):
                self.layers[str(i)] = TransformerBlock(
                    config.block_config(i), tp_group=tp_group, sp_group=sp_group, ep_group=ep_group,
                    ulysses_group=ulysses_group, ring_group=ring_group, aux_loss_scale=aux_loss_scale, device=device,
                    dtype=dtype)
        self.norm = self.head = None
        if head:
            self.norm = RMSNorm(config.hidden_size, config.norm_eps, offset=config.norm_offset, device=device,
                                dtype=dtype)
            if not config.tie_word_embeddings:  # tied: the head multiplies by this rank's rows of the embedding
                with _seeded(seed - 2):
                    self.head = ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False,
                                                     group=tp_group, sequence_parallel=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, *, cu_seqlens=None, position_ids=None,
                return_hidden: bool | None = None) -> torch.Tensor:
        """``cu_seqlens``: int32 document boundaries of the full packed row (batch 1, the same on
        every rank): attention stays inside documents and rotary positions restart at each one
        (or follow ``position_ids``, ``[seq_len]`` of the full row).

        ``return_hidden`` (default: the constructor's, ``False``): a module holding the head
        returns the final-norm hidden states ``[batch, seq/(sp*tp), hidden]`` instead of the logits,
        for :meth:`loss` to fuse the head (a pipeline's last stage built with
        ``return_hidden=True`` hands them to ``loss_fn=model.loss``)."""
        if self.embedding is not None:
            check_token_ids("input_ids", x, self.config.vocab_size)
            x = self.embedding(x)
            if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the model's dtype as in HF
                x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype).item()
        docs = dict(cu_seqlens=cu_seqlens, position_ids=position_ids)
        for block in self.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False, context_fn=recomputation_contexts, **docs)
            else:
                x = block(x, **docs)
        if self.norm is not None:
            x = self.norm(x)
            if not (self.return_hidden if return_hidden is None else return_hidden):
                x = self.head(x) if self.head is not None else self._tied_head(x)
                cap = self.config.final_logit_softcap
                if cap is not None:  # Gemma 2/3: c * tanh(z / c), as HF computes it
                    x = torch.tanh(x / cap) * cap
        return x

    def pipeline_args(self, microbatch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_args, output_args)``: meta tensors of this stage's input (token ids where it
        holds the embedding, else hidden states) and output (``[microbatch, seq/(sp*tp), hidden]``,
        or the local logits ``[microbatch, seq/sp, vocab/tp]``; the floating ones need a
        gradient), for ``PipelineStage(..., input_args=, output_args=)``. With them the schedule skips its shape-inference pass, which runs a later stage's blocks on uninitialised
        memory (``torch.empty``): that pass would count its garbage tokens in the routers' loads."""
        check_int("microbatch_size", microbatch_size, min_value=1)
        check_int("seq_len", seq_len, min_value=1)
        tp, sp = comm.group_size(self.tp_group), 1
        for g in self.data_groups():
            sp *= comm.group_size(g)
        if seq_len % (tp * sp):
            raise ValueError(f"seq_len must be a multiple of tp * sp = {tp * sp}, got {seq_len}")
        dtype = next(self.parameters()).dtype
        local = (microbatch_size, seq_len // (tp * sp))
        hidden = torch.empty(*local, self.config.hidden_size, device="meta", dtype=dtype, requires_grad=True)
        inputs = torch.empty(*local, device="meta", dtype=torch.long) if self.embedding is not None else hidden
        if self.norm is not None and not self.return_hidden:  # the head gathers the sequence over tp
            return inputs, torch.empty(microbatch_size, seq_len // sp, self.config.vocab_size // tp,
                                       device="meta", dtype=dtype, requires_grad=True)
        return inputs, hidden

    def head_weight(self) -> torch.Tensor:
        """This rank's ``[vocab / tp, hidden]`` rows of the head: the head's weight, or with tied
        embeddings this rank's vocabulary rows of the embedding table (their gradient lands in
        those rows; the embedding's "replicated" rule sums it over tp and sp)."""
        if self.norm is None:
            raise ValueError("head_weight needs a module holding the head (head=True)")
        if self.head is not None:
            return self.head.weight
        n = self.config.vocab_size // comm.group_size(self.tp_group)
        r = comm.group_rank(self.tp_group)
        return self.embedding.weight[r * n:(r + 1) * n]

    def _tied_head(self, x):
        return all_gather_matmul(x, self.head_weight(), None, group=self.tp_group, gather_dim=1)

    def data_groups(self) -> tuple:
        """The groups whose ranks hold other tokens of the same sequences: the sp group, or the
        Ulysses and ring groups of ``sp_mode="hybrid"`` (``None``: the default group)."""
        if self.config.sp_mode == "hybrid":
            return (self.ulysses_group, self.ring_group)
        return (self.sp_group,)

    @torch.no_grad()
    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The full logits ``[batch, seq, vocab]`` in the original token order, on every rank, from
        this rank's ``[batch, seq / sp, vocab / tp]`` output (gathered over tp, then over the
        sequence-parallel group(s), and un-permuted from the zigzag / hybrid layout). A collective
        over tp and sp; not differentiable (for evaluation and tests)."""
        if not self.layers or self.norm is None:
            raise ValueError("gather_logits needs a module holding the head and at least one block")
        attn = next(iter(self.layers.values())).attn
        tp = comm.group_size(self.tp_group)
        x = local_logits.contiguous()
        if tp > 1:
            buf = torch.empty((tp,) + tuple(x.shape), device=x.device, dtype=x.dtype)
            comm.all_gather_into(buf.view(-1, *x.shape[1:]), x, self.tp_group).wait()
            x = torch.cat(list(buf), dim=-1)
        seq = x.shape[1] * attn.ring_size * attn.ulysses_size
        pos = shard_positions(seq, layout=attn.layout if attn.ring_size > 1 else "contiguous",
                              ring_rank=attn.ring_rank, ring_size=attn.ring_size, ulysses_rank=attn.ulysses_rank,
                              ulysses_size=attn.ulysses_size, device=x.device)
        for t in attn.sp_transports:
            if t.size > 1:
                xs = torch.empty((t.size,) + tuple(x.shape), device=x.device, dtype=x.dtype)
                t.all_gather_into(xs.view(-1, *x.shape[1:]), x).wait()
                ps = torch.empty((t.size,) + tuple(pos.shape), device=pos.device, dtype=pos.dtype)
                t.all_gather_into(ps.view(-1), pos).wait()
                x, pos = torch.cat(list(xs), dim=1), torch.cat(list(ps))
        out = torch.empty_like(x)
        out[:, pos] = x
        return out

    def loss(self, output: torch.Tensor, targets: torch.Tensor, *, reduction: str = "mean",
             ignore_index: int = -100, data_group="sp", **fused) -> torch.Tensor:
        """Cross entropy of this rank's ``output`` against ``targets`` ``[batch, seq / sp]`` (the
        targets of :func:`shard_tokens`); ``ignore_index`` targets are left out.

        ``output``: the logits ``[batch, seq / sp, vocab / tp]`` of ``model(ids)``, or the hidden
        states ``[batch, seq / (sp*tp), hidden]`` of ``model(ids, return_hidden=True)``: then the
        head is fused into the loss (:func:`fusedpar.ops.linear_cross_entropy`, the logits never
        exist; ``fused`` passes its ``label_smoothing``, ``z_loss``, ``softcap``, ``chunk_tokens``;
        ``config.final_logit_softcap`` is applied in both cases: the logits of ``model(ids)`` are capped).
        Which one is read from the shapes (hidden when both fit: ``tp == 1`` and ``hidden ==
        vocab``, and ``return_hidden`` was set at construction).

        ``reduction="mean"``: the mean over the counted tokens of every rank of ``data_group``
        (default ``"sp"``: the sequence-parallel group(s), i.e. the whole sequences; pass
        ``(state.data_group,)`` for the global batch, ``None`` for this tp group's tokens only), the
        same value on each of those ranks; its gradient is scaled by their number, which
        :func:`~fusedpar.parallel.sync_gradients` divides by, so the synced gradients equal the
        one-process ones however unevenly ignored tokens fall. ``"sum"`` likewise sums over them;
        ``"none"``: per-token losses of this tp group's tokens."""
        groups = self.data_groups() if isinstance(data_group, str) and data_group == "sp" else data_group
        if self._is_hidden(output, targets):
            if self.config.final_logit_softcap is not None:
                if fused.get("softcap") not in (None, self.config.final_logit_softcap):
                    raise ValueError(f"softcap must be config.final_logit_softcap={self.config.final_logit_softcap} "
                                     f"(applied by the model) or omitted, got {fused['softcap']}")
                fused["softcap"] = self.config.final_logit_softcap
            return linear_cross_entropy(output, self.head_weight(), targets, group=self.tp_group,
                                        sequence_parallel=True, ignore_index=ignore_index, reduction=reduction,
                                        data_group=groups, **fused)
        if fused:
            raise ValueError(f"{', '.join(sorted(fused))}: only with hidden states (model(ids, return_hidden=True))")
        return vocab_parallel_cross_entropy(output, targets, self.tp_group, reduction=reduction,
                                            ignore_index=ignore_index, data_group=groups)

    def _is_hidden(self, output: torch.Tensor, targets: torch.Tensor) -> bool:
        """Whether :meth:`loss` was given hidden states (else logits), from the shapes."""
        tp = comm.group_size(self.tp_group)
        if output.dim() != 3 or targets.dim() != 2:
            return False
        hidden = output.shape[-1] == self.config.hidden_size and output.shape[1] * tp == targets.shape[1]
        logits = output.shape[-1] == self.config.vocab_size // tp and output.shape[1] == targets.shape[1]
        return hidden and (not logits or self.return_hidden)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE router losses of the last forward (``None`` without MoE blocks); with
        ``config.aux_loss_style == "hf"``: ``aux_loss_coef`` times Hugging Face's load-balancing
        loss pooled over the blocks (:func:`~fusedpar.nn.moe.hf_load_balancing_loss`, over this
        rank's tokens)."""
        if self.config.aux_loss_style == "hf":
            routers = [b.mlp.router for b in self.layers.values() if b.is_moe]
            return self.config.aux_loss_coef * hf_load_balancing_loss(routers) if routers else None
        losses = [b.mlp.aux_loss for b in self.layers.values() if b.is_moe and b.mlp.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def update_router_bias(self, groups=None) -> dict[str, RouterLoad]:
        """After each optimizer step: sum every MoE router's per-expert counts of the step over
        ``groups`` (one all-reduce per group for all layers; pass the groups whose ranks route
        different tokens, i.e. every rank of this pipeline stage: ``state.data_tp_group``; ``()``:
        this rank only) and apply each router's bias update (:meth:`TopKRouter.update_bias`; none
        at ``bias_update_rate == 0``). Collective. Returns ``{"layers.<i>": RouterLoad}`` (the
        step's counts and max violation), also kept as ``self.router_loads``."""
        moes = {f"layers.{i}": b.mlp for i, b in self.layers.items() if b.is_moe}
        if not moes:
            return {}
        counts = torch.stack([m.router.step_counts() for m in moes.values()])
        sum_over_groups(counts, groups)
        self.router_loads = {name: m.router.update_bias(c) for (name, m), c in zip(moes.items(), counts)}
        return self.router_loads

    def placements(self) -> dict[str, Placement]:
        """The embedding table is replicated; each rank looks up its own sequence shard's tokens."""
        return {"embedding.weight": Placement.replicated(sequence_sharded=True)} if self.embedding is not None else {}

    def gradient_sync_plan(self) -> dict[str, str]:
        """Parameter name -> gradient kind for :func:`fusedpar.parallel.sync_gradients`, read from
        the placement every module declares (:mod:`fusedpar.nn.placement`): ``"replicated"`` for
        copies that see only this rank's sequence shard (norms, embedding, router, MLA's down
        projections), ``"expert"`` for expert weights, ``"dense"`` for
        tensor-parallel shards. A parameter no module declares raises ``ValueError`` naming it: a
        guess would silently reduce its gradient over the wrong ranks."""
        return gradient_sync_plan(self)


class _seeded:
    """Seed torch's global CPU generator (where fusedpar layers draw their full weights) for the
    duration, restoring its state after, so a module's initial weights depend only on the seed and
    not on what was built before it. Device generators are left alone."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self.state = torch.random.get_rng_state()
        torch.random.default_generator.manual_seed(self.seed)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.state)
        return False
