"""The sequence layout of a :class:`~fusedpar.nn.Transformer`'s input: which tokens and targets
each rank holds (sequence parallel over sp, in the ring layout, then contiguous over tp)."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_choice, check_divisible, check_int, check_tensor
from fusedpar.ops.sequence_parallel.plans import document_bounds

__all__ = ["sequence_order", "shard_tokens"]


def sequence_order(seq_len: int, sp: int, layout: str) -> torch.Tensor:
    """Positions of the full sequence in the order the sp ranks hold them (rank-major)."""
    if layout == "contiguous" or sp == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * sp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2*sp={2 * sp} for the zigzag layout")
    chunks = torch.arange(seq_len).chunk(2 * sp)
    return torch.cat([torch.cat([chunks[i], chunks[2 * sp - 1 - i]]) for i in range(sp)])


def shard_tokens(tokens: torch.Tensor, targets: torch.Tensor, *, sp_size: int, sp_rank: int, tp_size: int,
                 tp_rank: int, layout: str = "zigzag", ring_size: int | None = None, cu_seqlens=None,
                 ignore_index: int = -100):
    """Split a full ``[batch, seq]`` batch into this rank's pieces: the input ids
    ``[batch, seq / (sp*tp)]`` (sequence-parallel over sp, then tp) and the targets of the whole
    sp shard ``[batch, seq / sp]`` (the vocabulary-parallel loss covers all tokens of a tp group).

    ``ring_size`` is the number of ring-attention ranks in sp (default ``sp_size``: pure ring;
    ``1`` for Ulysses; ``sp / sp_ulysses`` for hybrid with ``sp_rank = ring_rank * sp_ulysses +
    ulysses_rank``): ``layout`` applies over the ring ranks, each ring shard splits contiguously.

    Packed rows: with ``cu_seqlens`` (the row's int32 document boundaries, batch 1) the target of
    each document's last token, which would predict the next document's first token, becomes
    ``ignore_index`` (for a loss that skips it); pass the same ``cu_seqlens`` to the model.
    """
    for name, t in (("tokens", tokens), ("targets", targets)):
        check_tensor(name, t)
    for group, size, rank in (("sp", sp_size, sp_rank), ("tp", tp_size, tp_rank)):
        check_int(f"{group}_size", size, min_value=1)
        check_int(f"{group}_rank", rank, min_value=0)
        if rank >= size:
            raise ValueError(f"{group}_rank must be in [0, {group}_size={size}), got {rank}")
    check_choice("layout", layout, ("zigzag", "contiguous"))
    if tokens.dim() != 2 or targets.shape != tokens.shape:
        raise ValueError(f"tokens and targets must both be [batch, seq], got {tuple(tokens.shape)} and "
                         f"{tuple(targets.shape)}")
    ring_size = sp_size if ring_size is None else ring_size
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size <= 0 or sp_size % ring_size:
        raise ValueError(f"ring_size must be a positive int dividing sp_size={sp_size}, got {ring_size!r}")
    S = tokens.shape[1]
    check_divisible("seq_len", S, sp_size * tp_size, "sp * tp")
    order = sequence_order(S, ring_size, layout).to(tokens.device)
    n_sp = S // sp_size
    sp_idx = order[sp_rank * n_sp:(sp_rank + 1) * n_sp]
    n_tp = n_sp // tp_size
    ids = tokens[:, sp_idx[tp_rank * n_tp:(tp_rank + 1) * n_tp]]
    if cu_seqlens is not None:
        ends = document_bounds(cu_seqlens, S)
        last = sorted({e - 1 for a, e in zip(ends, ends[1:]) if e > a and e < S})
        targets = targets.clone()
        targets[:, last] = ignore_index
    return ids, targets[:, sp_idx]
