"""The cross-rank agreement check: the ranks of a group pass the same shapes, dtypes and modes.

A collective op whose ranks disagree on what they pass would exchange buffers of different sizes
or in a different order: gloo aborts one process and leaves the other with garbage, NCCL hangs or
corrupts memory. Every collective op therefore runs its local argument checks inside
:func:`agreed_arguments`, which then calls :func:`check_agreement` once, before the op's first
transfer, with the raw arguments that must agree and the outcome of the local checks (so a rank
whose own arguments fail a check does not leave its peers waiting for it). Each rank hashes the
fields into a fixed-size fingerprint and one small all-gather compares them; on a mismatch every
rank raises the same error naming the field and each rank's value. On NCCL groups the check is
off by default (:func:`set_agreement_check`, ``FUSEDPAR_CHECK_AGREEMENT=1``);
:func:`measure_agreement_cost` measures what it costs."""
from __future__ import annotations

import contextlib
import hashlib
import os
import weakref

import torch
import torch.distributed as dist

from fusedpar.ops.comm.transport import PortableTransport, Transport

AGREEMENT_ENV = "FUSEDPAR_CHECK_AGREEMENT"


#: int64 slots of a fingerprint: the op, one per field (at most ``FINGERPRINT_FIELDS - 2``), the outcome
FINGERPRINT_FIELDS = 16


_TEXT_BYTES = 240  # bytes of one rank's value text in the second exchange


_env = os.environ.get(AGREEMENT_ENV, "")


if _env not in ("", "0", "1"):
    raise ValueError(f"{AGREEMENT_ENV} must be '0', '1' or unset, got {_env!r}")


_setting: bool | None = None if _env == "" else _env == "1"


def set_agreement_check(enabled: bool | None) -> None:
    """Turn the check on (``True``) or off (``False``) for every group, or back to the default
    (``None``: the environment variable, else on where the exchange runs on the CPU (gloo) and
    off where it runs on a GPU (NCCL))."""
    global _setting
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {type(enabled).__name__} {enabled!r}")
    if enabled is None:
        env = os.environ.get(AGREEMENT_ENV, "")
        enabled = None if env not in ("0", "1") else env == "1"
    _setting = enabled
    _passed.clear()  # (kept where the check did not run: it may run now)


def agreement_check_enabled(device: torch.device | str | None = None) -> bool:
    """Whether the check runs for an exchange on ``device`` (see the module docstring)."""
    if _setting is not None:
        return _setting
    return device is None or torch.device(device).type != "cuda"


def describe(value) -> str:
    """The text of one field: a tensor by shape and dtype, a dtype or a mode by value."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {value.dtype}"
    if isinstance(value, Transport):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _fingerprint(op: str, texts: list, outcome: str) -> list:
    """``[op, field 1, ..., 0 padding, outcome of the local checks]`` hashed."""
    fp = [_hash(op)] + [_hash(f"{name}={text}") for name, text in texts]
    return fp + [0] * (FINGERPRINT_FIELDS - 1 - len(fp)) + [_hash(outcome)]


def _gather(dims: list, t: torch.Tensor) -> torch.Tensor:
    """``[ranks, n]``: every rank's 1-D ``t``, gathered over each transport of ``dims`` in turn
    (one all-gather per dimension; the first dimension varies fastest)."""
    for _, transport in dims:
        out = torch.empty(transport.size * t.numel(), dtype=t.dtype, device=t.device)
        transport.all_gather_into(out, t.contiguous()).wait()
        t = out
    return t.view(-1, t.numel() // _ranks(dims))


def _ranks(dims: list) -> int:
    n = 1
    for _, transport in dims:
        n *= transport.size
    return n


def _labels(dims: list) -> list:
    """The name of every row of :func:`_gather` (``"rank 1"``, or ``"ring rank 0, ulysses rank 1"``)."""
    if len(dims) == 1:
        return [f"rank {r}" for r in range(dims[0][1].size)]
    labels = [""]
    for name, transport in dims:
        labels = [f"{name} rank {r}" + (f", {lab}" if lab else "") for r in range(transport.size) for lab in labels]
    return labels


def _texts_of(dims: list, text: str, device) -> list:
    """Every rank's ``text`` (truncated to ``_TEXT_BYTES``), by fixed-size all-gathers."""
    raw = text.encode()[:_TEXT_BYTES]
    buf = torch.zeros(_TEXT_BYTES + 1, dtype=torch.uint8)
    buf[0] = len(raw)
    if raw:
        buf[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = _gather(dims, buf.to(device)).cpu()
    return [bytes(row[1:1 + int(row[0])].tolist()).decode(errors="replace") for row in rows]


def _exchange_dims(transport, group) -> list:
    """``[(name, PortableTransport)]``: the dimensions the exchange runs over (empty: no check).
    ``transport``: a :class:`Transport`, a name or None (then a portable transport over ``group``),
    or ``{dim name: (transport, group)}``."""
    pairs = transport.items() if isinstance(transport, dict) else [("", (transport, group))]
    dims = []
    for name, (t, g) in pairs:
        if not isinstance(t, Transport):
            try:
                t = PortableTransport(g)
            except Exception:  # noqa: BLE001 - a bad group: the op's own checks name it
                continue
        if t.size > 1 and isinstance(t, PortableTransport):
            dims.append((name, t))
    return dims


def _exchange_device(transport: PortableTransport) -> torch.device:
    """Where a group's collectives run: the current GPU for an NCCL-only group, else the CPU."""
    backend = str(dist.get_backend(transport.group))
    if "gloo" not in backend and "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_agreement(transport, op: str, fields: dict, *, group=None, device=None, error=None) -> None:
    """Raise the same ``ValueError`` on every rank of the group unless every rank passed
    ``fields`` (``{name: value}``, in a fixed order; see :func:`describe`) to ``op`` and every
    rank's local checks ended alike (``error``: the exception they raised on this rank, or None).

    transport: the op's :class:`Transport`; a transport name or None (the exchange then runs on a
    portable transport over ``group``); or ``{dim name: (transport, group)}`` for an op over a 2-D
    mesh (hybrid attention: the check covers every rank of the mesh, one all-gather per
    dimension). ``device``: where the exchange runs; default the current GPU for an NCCL group,
    else the CPU (which also decides whether the check is on, see the module docstring). A collective:
    every rank of the group calls it at the same point. Returns when the ranks agree (the
    caller then raises ``error`` itself, the same on every rank)."""
    dims = _exchange_dims(transport, group)
    if not dims:
        return
    device = _exchange_device(dims[0][1]) if device is None else torch.device(device)
    if not agreement_check_enabled(device):
        return
    if len(fields) > FINGERPRINT_FIELDS - 2:
        raise ValueError(f"check_agreement: fields must be at most {FINGERPRINT_FIELDS - 2}, got {len(fields)}")
    texts = [(name, describe(value)) for name, value in fields.items()]
    outcome = "valid" if error is None else f"{type(error).__name__}: {error}"
    fp = torch.tensor(_fingerprint(op, texts, outcome), dtype=torch.int64, device=device)
    rows = _gather(dims, fp).tolist()  # the one host read
    differ = [i for i in range(FINGERPRINT_FIELDS) if any(row[i] != rows[0][i] for row in rows)]
    if differ:
        _raise_disagreement(dims, op, texts, outcome, differ, device)


def _raise_disagreement(dims, op, texts, outcome, differ, device):
    labels = _labels(dims)
    if differ[0] == 0:
        ops = _texts_of(dims, op, device)
        raise ValueError("the op must be the same on every rank of the group (the ranks must call the same "
                         f"collectives in the same order), got {_by_rank(labels, ops)}")
    if differ[0] == FINGERPRINT_FIELDS - 1:
        outcomes = _texts_of(dims, outcome, device)
        raise ValueError(f"{op}: the arguments of every rank must pass its checks (a rank cannot go on alone), got "
                         f"{_by_rank(labels, outcomes)}")
    name, text = texts[differ[0] - 1]
    values = _texts_of(dims, text, device)
    more = [texts[i - 1][0] for i in differ[1:] if i < FINGERPRINT_FIELDS - 1]
    also = f" (also differing: {', '.join(more)})" if more else ""
    raise ValueError(f"{op}: {name} must be the same on every rank of the group, got {_by_rank(labels, values)}"
                     + also)


@contextlib.contextmanager
def agreed_arguments(op: str, transport, group, fields: dict, device=None):
    """``with agreed_arguments(op, transport, group, fields): <the op's local checks>``: runs the
    checks, then :func:`check_agreement` with their outcome. Ranks that passed different
    ``fields``, or whose checks ended differently (only one rank's ``causal`` is a string), all
    raise one ``ValueError``; ranks that agree and all failed the same check raise that check's
    own error; otherwise the op goes on. ``fields`` are the raw arguments (before any check).
    Under ``torch.compile`` the checks run while the graph is traced and the exchange is skipped
    (a traced graph holds no host read)."""
    if torch.compiler.is_compiling():
        yield
        return
    try:
        yield
    except Exception as exc:
        check_agreement(transport, op, fields, group=group, device=device, error=exc)
        raise
    check_agreement(transport, op, fields, group=group, device=device)


#: calls whose checks passed without an exchange (:func:`checks_passed`): key -> what the checks derived
_passed: dict = {}
_PASSED_LIMIT = 256


def _call_key(op: str, transport, group, tensors, scalars):
    """A call's key in :data:`_passed`: the op; the transport, and the group (the default group
    itself for None: a later one may have another size or backend), both by weak reference (equal
    while alive, never equal to a new one once dead); each tensor's type, shape,
    dtype and device (what argument checks read); the other arguments with their types (a check
    that takes ``1`` refuses ``True``, which equals it). None where the checks must run: under
    ``torch.compile`` (they are traced), or an argument that is not a tensor where one goes."""
    if torch.compiler.is_compiling():
        return None
    try:
        described = tuple(None if t is None else (type(t), t.shape, t.dtype, t.device) for t in tensors)
    except AttributeError:
        return None
    if group is None and not isinstance(transport, Transport) and dist.is_available():
        group = dist.group.WORLD
    try:  # (a kept call holds neither alive: a transport's buffers, a destroyed group)
        transport = weakref.ref(transport) if isinstance(transport, Transport) else transport
        group = None if group is None else weakref.ref(group)
    except TypeError:  # (a group= that is not a process group: the checks name it)
        return None
    return op, transport, group, described, scalars, tuple(map(type, scalars))


def checks_passed(op: str, transport, group, tensors: tuple, scalars: tuple, checks):
    """What ``checks()`` returns -- an op's argument checks, in :func:`agreed_arguments` when the
    op communicates, returning what they derive (a normalised dim, the transport id, ...) -- or,
    without running them, what it returned for an earlier call alike: the same ``op``,
    ``transport`` and ``group``, ``tensors`` of the same types, shapes, dtypes and devices and
    ``scalars`` equal and of the same types (everything the checks read: they read no values of a
    tensor). A call is kept only where the agreement check exchanged nothing (a transport that is
    not over torch.distributed, a group of one, the check off: NCCL's default): a call that does
    exchange is a collective every rank must make, so it runs every time; turning the check on or
    off (:func:`set_agreement_check`) forgets every kept call. The checks of a call whose
    arguments cannot be hashed run every time. Saves the checks' host time (~14 us for a
    tensor-parallel GEMM op) on every call after the first."""
    key = _call_key(op, transport, group, tensors, scalars)
    try:
        found = None if key is None else _passed.get(key)
    except TypeError:  # (an argument that cannot be hashed)
        key = found = None
    if found is not None:
        return found
    found = checks()
    if key is not None and not _exchanges(transport, group):
        if len(_passed) >= _PASSED_LIMIT:
            _passed.clear()
        _passed[key] = found
    return found


def _exchanges(transport, group) -> bool:
    """Whether :func:`check_agreement` runs an exchange for ``transport`` / ``group`` now."""
    dims = _exchange_dims(transport, group)
    return bool(dims) and agreement_check_enabled(_exchange_device(dims[0][1]))


def _by_rank(labels: list, values: list) -> str:
    """``"rank 0: a; rank 1: b"``: each rank's value, in rank order."""
    return "; ".join(f"{lab}: {v}" for lab, v in zip(labels, values))


def _cost_worker(rank: int, size: int, port: int, calls: int, rounds: int) -> None:
    """One rank of :func:`measure_agreement_cost`: times ``check_agreement`` on a TP op's fields
    and a bare all-gather of a fingerprint, interleaved in rounds (median of the rounds)."""
    import statistics
    import time

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    t = PortableTransport()
    fields = dict(x=torch.randn(2, 64, 256), weight=torch.randn(512, 256), bias=None, gather_dim=1,
                  activation="none", partial_dtype=torch.float32, save_gathered_input=True, transport=None)
    fp = torch.zeros(FINGERPRINT_FIELDS, dtype=torch.int64)
    out = torch.empty(size * FINGERPRINT_FIELDS, dtype=torch.int64)
    fns = {"check_agreement": lambda: check_agreement(t, "all_gather_matmul", fields, device="cpu"),
           "bare 128-byte all-gather": lambda: t.all_gather_into(out, fp).wait()}
    times = {name: [] for name in fns}
    for _ in range(rounds + 1):  # the first round warms up
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    if rank == 0:
        text = ", ".join(f"{k} {statistics.median(v[1:]) * 1e6:.0f} us/call" for k, v in times.items())
        print(f"{size} gloo ranks on CPU (median of {rounds} rounds of {calls} calls): {text}", flush=True)
    dist.destroy_process_group()


def measure_agreement_cost(sizes=(2, 3), calls: int = 100, rounds: int = 5, port: int = 29400) -> None:
    """Print the CPU cost of one :func:`check_agreement` next to a bare all-gather of the same
    fingerprint, on ``sizes`` gloo ranks spawned on this machine (localhost ports ``port + size``)."""
    import torch.multiprocessing as mp

    for size in sizes:
        mp.spawn(_cost_worker, args=(size, port + size, calls, rounds), nprocs=size)
