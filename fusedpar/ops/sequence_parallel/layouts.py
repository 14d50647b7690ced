"""Sequence layouts of sequence parallelism, from shapes alone: which global positions each rank's
shard holds (:func:`shard_positions`; ``"contiguous"`` or ``"zigzag"``, the causal-balanced layout
in which rank ``r`` of ``P`` holds chunks ``r`` and ``2P - 1 - r``), and the helpers that cut a
full sequence into this rank's shard and back (:func:`sequence_shard`, :func:`zigzag_shard`,
:func:`zigzag_unshard`, :func:`zigzag_positions`)."""
from __future__ import annotations

import torch

from fusedpar.kernels.checks import check_choice, check_int, check_tensor
from fusedpar.ops.common import checked_api

LAYOUTS = ("zigzag", "contiguous")


# ----------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------
def _check_rank(name, rank, size, *, rank_name=None, size_name=None):
    """``size >= 1`` and ``rank`` in ``[0, size)`` (named ``<name>_rank`` / ``<name>_size`` unless given)."""
    size_name, rank_name = size_name or f"{name}_size", rank_name or f"{name}_rank"
    check_int(size_name, size, min_value=1)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{rank_name} must be an int, got {type(rank).__name__} {rank!r}")
    if not 0 <= rank < size:
        raise ValueError(f"{rank_name} must be in [0, {size_name}={size}), got {rank}")


def _check_dim(x, dim):
    check_tensor("x", x)
    check_int("dim", dim, min_value=-x.dim(), max_value=x.dim() - 1)


@checked_api
def shard_positions(seq_len: int, *, layout: str = "zigzag", ring_rank: int = 0, ring_size: int = 1,
                    ulysses_rank: int = 0, ulysses_size: int = 1, device=None) -> torch.Tensor:
    """Global positions (``int64``, in local order) of the tokens one rank holds.

    The sequence is first split over the ring (``layout="contiguous"``: ``ring_size`` equal
    pieces; ``"zigzag"``: ``2 * ring_size`` chunks, ring rank ``r`` holding chunks ``r`` and
    ``2*ring_size-1-r`` in that order), then the ring shard is cut into ``ulysses_size``
    contiguous pieces. Plain ring attention uses ``ulysses_size=1``, plain Ulysses
    ``ring_size=1`` (then the layout does not matter).
    """
    check_int("seq_len", seq_len, min_value=0)
    check_choice("layout", layout, LAYOUTS)
    _check_rank("ring", ring_rank, ring_size)
    _check_rank("ulysses", ulysses_rank, ulysses_size)
    n_chunks = 2 * ring_size if layout == "zigzag" and ring_size > 1 else ring_size
    if seq_len % n_chunks or (seq_len // ring_size) % ulysses_size:
        raise ValueError(
            f"seq_len={seq_len} must split into {n_chunks} equal {layout} chunks, and each ring shard "
            f"(seq_len / {ring_size}) into ulysses_size={ulysses_size} equal pieces"
        )
    c = seq_len // n_chunks
    # made on ``device`` (no host-to-device copy, which synchronises and cannot be captured in a CUDA graph)
    if n_chunks > ring_size:
        ring = torch.cat([torch.arange(ring_rank * c, (ring_rank + 1) * c, device=device),
                          torch.arange((n_chunks - 1 - ring_rank) * c, (n_chunks - ring_rank) * c, device=device)])
    else:
        ring = torch.arange(ring_rank * c, (ring_rank + 1) * c, device=device)
    piece = ring.numel() // ulysses_size
    return ring[ulysses_rank * piece:(ulysses_rank + 1) * piece]


@checked_api
def zigzag_positions(seq_len: int, rank: int, size: int, *, device=None) -> torch.Tensor:
    """Global positions of rank ``rank``'s zigzag shard (chunks ``rank`` and ``2*size-1-rank`` of
    ``2*size``): the position ids to use for rotary embeddings."""
    _check_rank("", rank, size, rank_name="rank", size_name="size")
    return shard_positions(seq_len, layout="zigzag", ring_rank=rank, ring_size=size, device=device)


@checked_api
def sequence_shard(x: torch.Tensor, *, layout: str = "zigzag", ring_rank: int = 0, ring_size: int = 1,
                   ulysses_rank: int = 0, ulysses_size: int = 1, dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (along ``dim``), see :func:`shard_positions`."""
    _check_dim(x, dim)
    pos = shard_positions(x.shape[dim], layout=layout, ring_rank=ring_rank, ring_size=ring_size,
                          ulysses_rank=ulysses_rank, ulysses_size=ulysses_size, device=x.device)
    return x.index_select(dim, pos)


@checked_api
def zigzag_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x``: chunks ``rank`` and
    ``2*size-1-rank`` of ``2*size`` equal chunks along ``dim``, concatenated."""
    _check_rank("", rank, size, rank_name="rank", size_name="size")
    return sequence_shard(x, layout="zigzag", ring_rank=rank, ring_size=size, dim=dim)


@checked_api
def zigzag_unshard(x: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard` over all ranks: ``x`` is every rank's shard concatenated in
    rank order along ``dim`` (what an all-gather returns); the result is the full sequence."""
    _check_dim(x, dim)
    check_int("size", size, min_value=1)
    n = x.shape[dim]
    pos = torch.cat([zigzag_positions(n, r, size) for r in range(size)]).to(x.device)
    out = torch.empty_like(x)
    out.index_copy_(dim, pos, x)
    return out
