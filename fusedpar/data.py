"""Training data for the main job: token streams, a train/validation split, and a loader that
shards each global batch over the data-parallel ranks and whose position is checkpointed.

Sources (:func:`load_tokens`):

* ``None``: the Python standard library's own source files (every machine that runs fusedpar has
  them, no download), read in sorted path order and capped at ``max_bytes`` — byte-level text,
  vocabulary 256;
* a text file, or a directory of text files (read recursively, sorted by path, hidden files
  skipped): byte-level, vocabulary 256;
* a ``.bin`` file of pre-tokenized ids (the nanoGPT convention: a flat array of ``uint16`` ids, or
  ``uint32`` when the vocabulary exceeds 65536), read with ``np.memmap``; ``vocab`` is required.

The last ``val_fraction`` of the tokens is held out for validation; :func:`unigram_baseline` is
the validation loss a context-free model would reach. :class:`BatchLoader` cuts the
training tokens into windows of ``seq + 1`` tokens, visits them in a seeded random order per epoch
and hands data-parallel rank ``r`` rows ``r*b .. (r+1)*b`` of every global batch of ``dp*b``
windows: its only state is ``position`` (windows consumed globally), so a run resumed at another
data-parallel size with the same global batch reads the same windows.
"""
from __future__ import annotations

import dataclasses
import os
import sysconfig
import zlib

import numpy as np
import torch

BYTE_VOCAB = 256
DEFAULT_MAX_BYTES = 4 << 20


class DataError(ValueError):
    """A ``--data`` source that cannot be used (missing, unreadable, empty, too short, ids out of
    range). Arguments of the wrong type or out of range (``seq=0``, ``batch=0``) raise
    ``TypeError`` / ``ValueError`` naming the argument."""


def stdlib_dir() -> str:
    """The directory of the Python standard library's source files."""
    path = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
    return path if os.path.isdir(path) else os.path.dirname(os.__file__)


def text_files(root: str, suffixes: tuple[str, ...] | None = None) -> list[str]:
    """Regular files under ``root`` in sorted path order (hidden entries, ``__pycache__`` and
    installed packages skipped), optionally only those ending in one of ``suffixes``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and d not in ("__pycache__", "site-packages", "dist-packages"))
        for f in sorted(filenames):
            if f.startswith(".") or (suffixes and not f.endswith(suffixes)):
                continue
            full = os.path.join(dirpath, f)
            if os.path.isfile(full):
                out.append(full)
    return out


def read_bytes(files: list[str], max_bytes: int) -> np.ndarray:
    """The concatenated bytes of ``files`` (in order), at most ``max_bytes`` of them."""
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        try:
            with open(f, "rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError as e:
            raise DataError(f"--data: cannot read {f!r}: {e.strerror or e}") from None
        chunks.append(data)
        total += len(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def bin_dtype(vocab: int):
    """The id type of a ``.bin`` token file for a vocabulary of ``vocab`` ids."""
    return np.uint16 if vocab <= 1 << 16 else np.uint32


@dataclasses.dataclass
class Tokens:
    """A token stream: ``ids`` (a numpy array or memmap), ``vocab`` and where they came from."""

    ids: np.ndarray
    vocab: int
    source: str

    def fingerprint(self) -> int:
        """crc32 of the first and last MiB of ids and the length (identifies the data in a checkpoint)."""
        head, tail = np.ascontiguousarray(self.ids[: 1 << 20]), np.ascontiguousarray(self.ids[-(1 << 20):])
        crc = zlib.crc32(tail.tobytes(), zlib.crc32(head.tobytes()))
        return zlib.crc32(str(len(self.ids)).encode(), crc)


def load_tokens(path: str | None, vocab: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Tokens:
    """The token stream of ``path`` (see the module docstring); :class:`DataError` on a bad source."""
    _check_count("max_bytes", max_bytes)
    if vocab is not None:
        _check_count("vocab", vocab)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str, a path or None, got {type(path).__name__} {path!r}")
    path = None if path is None else os.fspath(path)
    if path is None:
        root = stdlib_dir()
        ids = read_bytes(text_files(root, (".py",)), max_bytes)
        source = f"Python standard library sources in {root}"
    elif not os.path.exists(path):
        raise DataError(f"--data {path!r}: no such file or directory")
    elif os.path.isdir(path):
        files = text_files(path)
        if not files:
            raise DataError(f"--data {path!r}: the directory holds no (non-hidden) files")
        ids = read_bytes(files, max_bytes)
        source = f"{len(files)} files under {path}"
    elif path.endswith(".bin"):
        return _bin_tokens(path, vocab)
    else:
        ids = read_bytes([path], max_bytes)
        source = path
    if vocab not in (None, BYTE_VOCAB):
        raise DataError(f"--vocab must be {BYTE_VOCAB} for byte-level text (--data {path!r}), got {vocab}; "
                        "pre-tokenized ids go in a .bin file")
    if len(ids) == 0:
        raise DataError(f"--data {path!r}: no bytes to read (empty file)")
    return Tokens(ids, BYTE_VOCAB, source)


def _check_count(name: str, value, minimum: int = 1) -> int:
    """An int ``>= minimum`` (``bool`` is not one): ``TypeError`` / ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _bin_tokens(path: str, vocab: int | None) -> Tokens:
    if vocab is None or vocab <= 0:
        raise DataError(f"--vocab must be given (a positive int) for the pre-tokenized file {path!r}, got {vocab}")
    dtype = np.dtype(bin_dtype(vocab))
    size = os.path.getsize(path)
    if size == 0 or size % dtype.itemsize:
        raise DataError(f"--data {path!r}: size {size} bytes is not a positive multiple of {dtype.itemsize} "
                        f"({dtype.name} ids for vocab {vocab})")
    ids = np.memmap(path, dtype=dtype, mode="r")
    step = 1 << 24
    top = max(int(ids[i:i + step].max()) for i in range(0, len(ids), step))
    if top >= vocab:
        raise DataError(f"--data {path!r}: token ids must be < --vocab {vocab}, found id {top}")
    return Tokens(ids, vocab, f"{path} ({len(ids)} {dtype.name} ids)")


def split(tokens: Tokens, val_fraction: float, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the last ``val_fraction`` of the ids held out; each needs ``seq + 1`` ids."""
    _check_count("seq", seq)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise TypeError(f"val_fraction must be a number in (0, 1), got {type(val_fraction).__name__} {val_fraction!r}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = int(len(tokens.ids) * val_fraction)
    train, val = tokens.ids[: len(tokens.ids) - n_val], tokens.ids[len(tokens.ids) - n_val:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq + 1:
            raise DataError(f"{tokens.source}: the {name} split has {len(part)} tokens, fewer than one sequence "
                            f"of {seq} + 1 (use more data, a shorter --seq or another --val-fraction)")
    return train, val


def unigram_counts(ids: np.ndarray, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, dtype=np.int64)
    for i in range(0, len(ids), 1 << 24):
        counts += np.bincount(np.asarray(ids[i:i + (1 << 24)], dtype=np.int64), minlength=vocab)[:vocab]
    return counts


def unigram_entropy(ids: np.ndarray, vocab: int) -> float:
    """Entropy (nats/token) of the ids' unigram distribution."""
    counts = unigram_counts(ids, vocab)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab: int) -> float:
    """Cross entropy (nats/token) of the ids ``val`` under the training ids' unigram
    distribution (add-half smoothed): the loss on ``val`` of the best model that ignores context,
    the baseline a language model must beat (pass the evaluated targets themselves)."""
    p = unigram_counts(train, vocab) + 0.5
    p = p / p.sum()
    q = unigram_counts(val, vocab)
    return float(-(q * np.log(p)).sum() / q.sum())


class BatchLoader:
    """Windows of ``seq + 1`` ids of ``ids`` (stride ``seq``) in a random order per epoch (seeded
    with ``seed`` and the epoch); :meth:`next_batch` gives this data-parallel rank its rows of the
    next global batch of ``batch * dp`` windows. ``position`` counts windows consumed globally."""

    def __init__(self, ids: np.ndarray, seq: int, batch: int, *, dp: int = 1, dp_rank: int = 0, seed: int = 0):
        seq, batch, dp, dp_rank = (_check_count(n, v, m) for n, v, m in (("seq", seq, 1), ("batch", batch, 1),
                                                                          ("dp", dp, 1), ("dp_rank", dp_rank, 0)))
        _check_count("seed", seed, 0)
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank must be in [0, {dp}), got {dp_rank}")
        if not hasattr(ids, "__len__") or getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"ids must be a 1-D array of token ids, got {type(ids).__name__} "
                             f"of shape {getattr(ids, 'shape', None)}")
        self.ids, self.seq, self.batch, self.dp, self.dp_rank, self.seed = ids, seq, batch, dp, dp_rank, seed
        self.windows = (len(ids) - 1) // seq
        if self.windows < 1:
            raise DataError(f"{len(ids)} tokens hold no window of {seq} + 1")
        self.position = 0
        self._perm = (None, None)

    def order(self, epoch: int) -> np.ndarray:
        if self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(self.windows))
        return self._perm[1]

    def rows(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Token and target rows of the windows with these global indices."""
        x = np.stack([np.asarray(self.ids[w * self.seq: w * self.seq + self.seq + 1], dtype=np.int64)
                      for w in indices])
        x = torch.from_numpy(x)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``[batch, seq]`` tokens and next-token targets; advances ``position``."""
        start = self.position + self.dp_rank * self.batch
        picks = [self.order(i // self.windows)[i % self.windows] for i in range(start, start + self.batch)]
        self.position += self.batch * self.dp
        return self.rows(picks)

    def eval_batches(self, n_batches: int):
        """``n_batches`` fixed global batches of windows spread evenly over the ids (the same
        every call): this rank's rows of each."""
        _check_count("n_batches", n_batches)
        per = self.batch * self.dp
        stride = max(1, self.windows // (n_batches * per))
        for b in range(n_batches):
            start = b * per + self.dp_rank * self.batch
            yield self.rows([(i * stride) % self.windows for i in range(start, start + self.batch)])

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
