"""Save and load models with ``torch.distributed.checkpoint`` (DCP) at *any* parallel layout.

How every parameter sits in the full tensor comes from the placements its modules declare
(:mod:`fusedpar.nn.placement`); nothing here knows a module type. DCP checkpoints store every
sharded parameter as a DTensor over a one-dimensional mesh of its group with placement
``Shard(dim)``, one per section when it has several (the ``[gate; up]`` rows of a gated weight,
the ``[q; k; v]`` rows of a fused attention projection, stored as ``<name>.section<c>`` at every
tp degree, so keys never depend on the layout), so the files hold full logical tensors: a model
built at another tp or ep degree loads them by building its own DTensors, and DCP reads each
rank's slice. Replicated tensors are written once (DCP deduplicates identical chunks). Buffers
that modules declare in ``checkpoint_buffers()`` (:func:`~fusedpar.nn.placement.checkpoint_buffers`:
the MoE router's ``e_score_correction_bias``) are saved and loaded beside the parameters, replicated.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
import weakref
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fusedpar.nn.placement import Placement, checkpoint_buffers, parameter_placements
from fusedpar.ops import comm


def placements_of(model: nn.Module, default: Placement | None = None) -> dict[str, Placement]:
    """:func:`~fusedpar.nn.placement.parameter_placements` of ``model``, computed once per model
    object and ``default``: a parameter no module declares gets ``default`` (e.g. the Hugging Face
    modules of a model :func:`fusedpar.hf.parallelize` made parallel: ``Placement()``, whole on
    every rank), or without one raises ``ValueError`` naming it."""
    per_default = _PLACEMENTS.setdefault(model, {})
    if default not in per_default:
        per_default[default] = parameter_placements(model, default=default)
    return per_default[default]


_PLACEMENTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def full_state(model: nn.Module, *, grads: bool = False,
               default_placement: Placement | None = None) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as the full tensor, gathered over its group; a
    collective: every rank of every group must call it (same model structure).
    ``default_placement``: see :func:`placements_of`."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            raise ValueError(f"parameter {name!r} has no gradient")
        out[name] = placements_of(model, default_placement)[name].full_from_local(t)
    return out


# ----------------------------------------------------------------------------------------------
# torch.distributed.checkpoint
# ----------------------------------------------------------------------------------------------
# group object -> {device type -> DeviceMesh}. Keyed by the group itself, weakly: an entry lives
# exactly as long as its group, so a new group can never be handed the mesh of a destroyed one
# (an id() key can: CPython reuses the address of a freed object for the next one).
_MESHES: "weakref.WeakKeyDictionary[object, dict[str, object]]" = weakref.WeakKeyDictionary()


def group_mesh(group, device_type: str):
    """The one-dimensional ``DeviceMesh`` over process group ``group`` (resolved: not ``None``)
    on ``device_type``, built once per group object."""
    from torch.distributed.device_mesh import DeviceMesh

    per_device = _MESHES.setdefault(group, {})
    if device_type not in per_device:
        per_device[device_type] = DeviceMesh.from_group(group, device_type)
    return per_device[device_type]


def dcp_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor] | None = None,
                   default_placement: Placement | None = None) -> dict[str, torch.Tensor]:
    """Parameters as DTensors (sharded ones) or plain tensors (replicated ones), all *views* of
    the model's parameters: ``dcp.save`` writes them, ``dcp.load`` fills them in place. A fused
    parameter is one entry per section (``<name>.section<c>``) at every tp degree.
    ``tensors`` (parameter name -> a tensor shaped like that parameter, e.g. fp32 master weights
    or an optimizer moment) replaces the parameters; its keys must be parameter names."""
    from torch.distributed.tensor import DTensor, Shard

    sd = {}
    placements = placements_of(model, default_placement)
    source = {n: p.data for n, p in model.named_parameters()} if tensors is None else tensors
    for name, local in source.items():
        if name not in placements:
            raise ValueError(f"tensors must be keyed by parameter names of the model, got {name!r}")
        placement, local = placements[name], local.detach()
        pieces = placement.dcp_pieces(local)  # a block several ranks hold: each writes its share
        for c, piece in enumerate(pieces):
            key = name if len(pieces) == 1 else f"{name}.section{c}"
            if placement.sharded:
                mesh = group_mesh(comm.resolve_group(placement.group), local.device.type)
                sd[key] = DTensor.from_local(piece, mesh, [Shard(placement.dim)], run_check=False)
            else:
                sd[key] = piece
    return sd


# ----------------------------------------------------------------------------------------------
# optimizer state, laid out like the parameters
# ----------------------------------------------------------------------------------------------
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an Adam / AdamW optimizer that has not stepped yet (zero moments, step
    0), as its first step would, so a checkpoint can be loaded into it in place."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"optimizer must be torch.optim.Adam or AdamW to be checkpointed, got "
                        f"{type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            st["step"] = torch.tensor(0.0, dtype=torch.float32,
                                      device=p.device if group.get("capturable") or group.get("fused") else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                         params: Mapping[str, torch.Tensor] | None = None,
                         default_placement: Placement | None = None) -> dict[str, torch.Tensor]:
    """``"<param name>.<state key>"`` -> views of ``optimizer``'s state: tensors shaped like the
    parameter sharded as it is (so the state reshards with the model), scalars replicated.
    ``params`` maps names to the tensors the optimizer updates (default: the model's parameters)."""
    init_optimizer_state(optimizer)
    source = dict(model.named_parameters()) if params is None else params
    sd = {}
    for name, p in source.items():
        st = optimizer.state.get(p)
        if st is None:
            raise ValueError(f"optimizer must update every parameter of the model, parameter {name!r} is not among its "
                             "params")
        for k, v in st.items():
            if v.shape == p.shape and v.dim() > 0:
                for sub, view in dcp_state_dict(model, {name: v}, default_placement).items():
                    sd[f"{sub}.{k}" if sub == name else f"{name}.{k}.{sub[len(name) + 1:]}"] = view
            else:
                sd[f"{name}.{k}"] = v
    return sd


def full_state_dict(model: nn.Module, *, optimizer=None, params=None, extra=None, default_placement=None) -> dict:
    """The flat DCP state dict :func:`save` writes: ``model.*`` (``params`` or the parameters, and
    the buffers modules declare in ``checkpoint_buffers()``, replicated), ``optim.*`` (with
    ``optimizer``), ``extra.*``."""
    sd = {f"model.{k}": v for k, v in dcp_state_dict(model, params, default_placement).items()}
    sd.update({f"model.{k}": v for k, v in checkpoint_buffers(model).items()})
    if optimizer is not None:
        sd.update({f"optim.{k}": v for k, v in
                   optimizer_state_dict(model, optimizer, params, default_placement).items()})
    for k, v in (extra or {}).items():
        sd[f"extra.{k}"] = v
    return sd


# ----------------------------------------------------------------------------------------------
# save / load with DCP: completion marker, per-chunk checksums, fusedpar errors
# ----------------------------------------------------------------------------------------------
MARKER = "fusedpar_complete.json"
FORMAT_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint that cannot be saved or loaded as asked (missing, incomplete, damaged, or of
    another model); the message names the path and, where one is at fault, the key."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint that does not fit the request: a key missing, a shape that differs,
    or (strict) saved model/optimizer keys the model does not have."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    """Every rank's ``obj`` (just ``[obj]`` without a process group)."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _agree(path: str, problem: str | None, error=CheckpointError) -> None:
    """Raise ``error`` on every rank when any rank found a problem."""
    problems = _gather(problem)
    for r, p in enumerate(problems):
        if p is not None:
            where = f" (seen by rank {r})" if len(problems) > 1 else ""
            raise error(f"checkpoint {path}: {p}{where}")


def _crc_range(path: str, offset: int, length: int) -> int:
    crc, left = 0, length
    with open(path, "rb") as f:
        f.seek(offset)
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                raise CheckpointError(f"{path}: {length} bytes at offset {offset} expected, the file ends before")
            crc, left = zlib.crc32(block, crc), left - len(block)
    return crc


def _chunk_table(path: str) -> list[tuple[str, str, int, int]]:
    """``(chunk name, file, offset, length)`` of every stored chunk, from DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    rows = []
    for index, info in md.storage_data.items():
        name = f"{index.fqn}@{list(index.offset) if index.offset is not None else []}"
        rows.append((name, info.relative_path, int(info.offset), int(info.length)))
    return sorted(rows)


def _write_marker(path: str) -> None:
    """Checksum every chunk (spread over the ranks) and write the completion marker (rank 0)."""
    rank, world = _world()
    rows = _chunk_table(path) if rank == 0 else None
    if world > 1:
        holder = [rows]
        dist.broadcast_object_list(holder, src=0)
        rows = holder[0]
    mine = {name: [f, off, n, _crc_range(os.path.join(path, f), off, n)] for name, f, off, n in rows[rank::world]}
    chunks = {}
    for part in _gather(mine):
        chunks.update(part)
    if rank == 0:
        manifest = {"format": FORMAT_VERSION, "world_size": world, "chunks": chunks,
                    "metadata_crc32": _crc_range(os.path.join(path, ".metadata"), 0,
                                                 os.path.getsize(os.path.join(path, ".metadata")))}
        tmp = os.path.join(path, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MARKER))
    if world > 1:
        dist.barrier()


def save(model: nn.Module, path: str, extra: Mapping[str, torch.Tensor] | None = None, *,
         optimizer: torch.optim.Optimizer | None = None, params: Mapping[str, torch.Tensor] | None = None,
         default_placement: Placement | None = None) -> None:
    """Save ``model`` (any parallel layout; ``params`` instead of its parameters, e.g. fp32 master
    weights), ``optimizer``'s state laid out like the parameters, and ``extra`` tensors with DCP
    into directory ``path``; collective. ``default_placement``: the placement of parameters no
    module declares (:func:`placements_of`; without it they raise). The completion marker (with a crc32 of every stored chunk
    and of DCP's metadata) is written last: a save interrupted before it is never loaded."""
    import torch.distributed.checkpoint as dcp

    rank, world = _world()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        for stale in (MARKER, MARKER + ".tmp"):
            if os.path.exists(os.path.join(path, stale)):
                os.remove(os.path.join(path, stale))
    if world > 1:
        dist.barrier()
    try:
        dcp.save(full_state_dict(model, optimizer=optimizer, params=params, extra=extra,
                                 default_placement=default_placement), checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"checkpoint {path}: saving failed: {_first_line(e)}") from e
    _write_marker(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip() and "CheckpointException ranks" not in ln]
    return f"{type(e).__name__}: {lines[0].strip() if lines else text}"


def read_manifest(path: str) -> dict:
    """The completion marker of checkpoint ``path`` (its format, world size and checksums);
    :class:`CheckpointError` when the path is missing, incomplete or the marker unreadable."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(f"checkpoint {path}: incomplete, no {MARKER} (the save was interrupted, or this is "
                              "not a fusedpar checkpoint)")
    try:
        with open(marker) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT_VERSION or not isinstance(manifest.get("chunks"), dict):
            raise ValueError(f"format must be {FORMAT_VERSION} with a chunk table, got {manifest.get('format')!r}")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is unreadable ({e})") from e
    return manifest


def _metadata_problem(path: str, manifest: dict):
    """``(problem or None, DCP metadata or None)``: the metadata file checked against its crc32."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        return f"{meta} is missing", None
    crc = _crc_range(meta, 0, os.path.getsize(meta))
    if crc != manifest.get("metadata_crc32"):
        return f"{meta}: crc32 {crc:08x}, saved {manifest.get('metadata_crc32')}: the file changed on disk", None
    try:
        return None, FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any reader failure is a damaged checkpoint
        return f"{meta} is unreadable: {_first_line(e)}", None


def _request_problem(sd: dict, metadata) -> str | None:
    """The first requested key missing from the checkpoint or stored with another shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    for key, value in sd.items():
        if key not in saved:
            near = sorted(k for k in saved if k.split(".")[0] == key.split(".")[0])[:3]
            return f"key {key!r} is not in the checkpoint (saved keys of its kind include {near})"
        if isinstance(value, torch.Tensor):
            md = saved[key]
            found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "a non-tensor object"
            if found != tuple(value.shape):
                return (f"key {key!r}: expected shape {tuple(value.shape)}, found {found} "
                        "(a checkpoint of another model size?)")
    return None


def _unexpected_problem(requested: list, metadata) -> str | None:
    """Saved model/optimizer keys that no rank asked for (a checkpoint of another model)."""
    asked = set().union(*requested)
    extra = sorted(k for k in metadata.state_dict_metadata if k.split(".")[0] in ("model", "optim") and k not in asked)
    if extra:
        return f"the checkpoint holds {len(extra)} keys this model does not have, e.g. {extra[:3]}"
    return None


def _checksum_problem(path: str, manifest: dict) -> str | None:
    """This rank's share of the chunks checked against their crc32 (bytes changed on disk)."""
    rank, world = _world()
    for name, (fname, off, n, saved) in sorted(manifest["chunks"].items())[rank::world]:
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            return f"key {name.split('@')[0]!r}: its data file {fpath} is missing"
        try:
            crc = _crc_range(fpath, off, n)
        except CheckpointError as e:
            return f"key {name.split('@')[0]!r}: {e} (a truncated file)"
        if crc != saved:
            return (f"key {name.split('@')[0]!r} (chunk at offset {name.split('@')[1]}) in {fpath}: crc32 {crc:08x}, "
                    f"saved {saved:08x}: the bytes changed on disk")
    return None


def load(model: nn.Module, path: str, extra: Mapping[str, torch.Tensor] | None = None, *,
         optimizer: torch.optim.Optimizer | None = None, params: Mapping[str, torch.Tensor] | None = None,
         optional: tuple[str, ...] = (), strict: bool = True, default_placement: Placement | None = None) -> set[str]:
    """Load a checkpoint written by :func:`save` at any layout into ``model`` (or ``params``),
    ``optimizer`` and ``extra`` in place; collective. Extra keys named in ``optional`` are loaded
    only when saved; returns the extra keys loaded. Before any byte is loaded the request is checked
    on every rank — marker present, DCP metadata and every chunk matching their crc32, each key
    saved with the expected global shape and (``strict``) no saved model/optimizer key left over —
    and any problem raises the same :class:`CheckpointError` on every rank
    (:class:`CheckpointMismatchError` for an intact checkpoint that does not fit).
    ``default_placement``: as in :func:`save`."""
    import torch.distributed.checkpoint as dcp

    problem, metadata, manifest = None, None, None
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        problem = str(e).removeprefix(f"checkpoint {path}: ")
    if problem is None:
        problem, metadata = _metadata_problem(path, manifest)
    _agree(path, problem)
    saved = metadata.state_dict_metadata
    extra = {k: v for k, v in (extra or {}).items() if k not in optional or f"extra.{k}" in saved}
    sd = full_state_dict(model, optimizer=optimizer, params=params, extra=extra, default_placement=default_placement)
    _agree(path, _request_problem(sd, metadata), CheckpointMismatchError)
    if strict:
        _agree(path, _unexpected_problem(_gather(sorted(sd)), metadata), CheckpointMismatchError)
    _agree(path, _checksum_problem(path, manifest))
    try:
        dcp.load(sd, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"checkpoint {path}: loading failed: {_first_line(e)}") from e
    _refill_replicas(model, optimizer, params, default_placement)
    return set(extra)


def _refill_replicas(model, optimizer, params, default_placement) -> None:
    """DCP filled each rank's share of a block several ranks hold (:meth:`Placement.dcp_pieces`):
    rebuild those blocks, of the parameters and of the optimizer state shaped like them."""
    placements = placements_of(model, default_placement)
    for name, p in (dict(model.named_parameters()) if params is None else params).items():
        placement = placements[name]
        if placement.replicas is None or not placement.sharded:
            continue
        placement.refill_replicas(p.detach())
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                placement.refill_replicas(v)


# ----------------------------------------------------------------------------------------------
# a directory of step checkpoints: atomic publication, keep the last K, resume from the latest
# ----------------------------------------------------------------------------------------------
class CheckpointManager:
    """Checkpoints ``<directory>/step_<8 digits>``: each is written under a hidden temporary name
    and renamed into place only once complete (marker written), so a crash never leaves a
    checkpoint that looks complete; after each save only the newest ``keep`` remain.
    :meth:`resume` loads the newest that loads cleanly, reporting (``log``, rank 0) and skipping
    any that is incomplete or damaged; an intact one of another model raises
    :class:`CheckpointMismatchError` (falling back would silently restart training). A shared
    filesystem across ranks is assumed."""

    PATTERN = re.compile(r"^step_(\d{8})$")

    def __init__(self, directory: str, keep: int = 2, log=print):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self.directory, self.keep, self.log = directory, keep, log

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    def _say(self, msg: str) -> None:
        if _world()[0] == 0:
            self.log(msg)

    def checkpoints(self) -> list[tuple[int, str, bool]]:
        """``(step, path, complete)`` of every ``step_*`` entry, oldest first (as rank 0 sees it)."""
        rank, world = _world()
        found = self._listing() if rank == 0 and os.path.isdir(self.directory) else []
        if world > 1:
            holder = [found]
            dist.broadcast_object_list(holder, src=0)
            found = holder[0]
        return found

    def save(self, step: int, model: nn.Module, **kwargs) -> str:
        """:func:`save` into ``step_<step>`` atomically, then prune to the last ``keep``; collective."""
        rank, world = _world()
        final, tmp = self.path(step), os.path.join(self.directory, f".partial-step_{step:08d}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        save(model, tmp, **kwargs)
        if rank == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            complete = [p for _, p, ok in self._listing() if ok]
            for old in complete[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        if world > 1:
            dist.barrier()
        return final

    def _listing(self):
        names = sorted(n for n in os.listdir(self.directory) if self.PATTERN.match(n))
        return [(int(n[5:]), os.path.join(self.directory, n), os.path.isfile(os.path.join(self.directory, n, MARKER)))
                for n in names]

    def resume(self, model: nn.Module, **kwargs) -> tuple[int | None, set[str]]:
        """Load the newest checkpoint that loads cleanly (:func:`load` with ``kwargs``); returns
        its step and the extra keys loaded, or ``(None, set())`` when there is none. Incomplete or
        damaged ones are skipped with a message naming the path and the reason."""
        for step, path, complete in reversed(self.checkpoints()):
            if not complete:
                self._say(f"[checkpoint] skipping {path}: incomplete (no {MARKER}; an interrupted save)")
                continue
            try:
                loaded = load(model, path, **kwargs)
            except CheckpointMismatchError as e:
                raise CheckpointMismatchError(f"{e}; it is intact, so it is not skipped: resume with the model it "
                                              "was saved from, or use another checkpoint directory") from e
            except CheckpointError as e:
                self._say(f"[checkpoint] skipping {path}: {e}")
                continue
            self._say(f"[checkpoint] resumed from {path} (step {step})")
            return step, loaded
        return None, set()
