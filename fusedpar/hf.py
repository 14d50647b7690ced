"""Hugging Face models in and out of :class:`fusedpar.nn.Transformer`.

* :func:`config_from_hf` (from :mod:`fusedpar.hf_config`): a ``transformers`` config (Llama
  2/3/3.1, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5 MoE ``glm4_moe``, OLMo 2,
  Gemma, Gemma 2, Gemma 3 text, DeepSeek-V3 / Kimi K2, gpt-oss) ->
  :class:`~fusedpar.nn.TransformerConfig`; any field value the model does not implement raises
  ``ValueError`` naming it.
* :func:`from_hf`: a ``transformers`` model, or a checkpoint directory (``config.json`` +
  ``*.safetensors``, read file by file), -> a :class:`~fusedpar.nn.Transformer` at any tp / sp / ep
  layout. The model is built on the meta device and every rank materialises only its shards.
* :func:`to_hf_state_dict`: the full tensors under Hugging Face's names (a collective over the
  model's groups), for ``hf_model.load_state_dict(..., strict=True)``.
* :func:`load_full_state_dict`: full tensors (fusedpar names) into a sharded model.
* Route B (keep the HF model): :func:`parallelize` and its helpers, from
  :mod:`fusedpar.hf_parallel` (re-exported here).

``transformers`` is not a dependency of fusedpar: only reading a checkpoint directory's config
imports it.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import torch
from torch import nn

from fusedpar.checkpoint import full_state, placements_of
from fusedpar.hf_config import config_from_hf
from fusedpar.hf_parallel import (
    SUPPORTED_MODEL_TYPES,
    HFMoEBlock,
    causal_lm_loss,
    gather_sequence,
    gpt_oss_experts_from_hf,
    gpt_oss_experts_to_hf,
    gradient_sync_plan,
    parallelize,
    sequence_parallel_loss,
    shard_batch,
)
from fusedpar.nn import ParallelAttention, Transformer, TransformerConfig, checkpoint_buffers

__all__ = ["SUPPORTED_MODEL_TYPES", "HFMoEBlock", "causal_lm_loss", "config_from_hf", "from_hf", "gather_sequence",
           "gradient_sync_plan", "load_full_state_dict", "parallelize", "sequence_parallel_loss", "shard_batch",
           "to_hf_state_dict"]


# ----------------------------------------------------------------------------------------------
# names: fusedpar parameter -> how to build it from Hugging Face tensors
# ----------------------------------------------------------------------------------------------
_ATTN = "model.layers.{i}.self_attn."


def _param_sources(name: str, config: TransformerConfig) -> list[str]:
    """The Hugging Face tensors (in-memory names of transformers 5) concatenated along dim 0 into
    the full fusedpar parameter ``name``."""
    fixed = {"embedding.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"],
             "head.weight": ["lm_head.weight"]}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if parts[0] != "layers":
        raise ValueError(f"no Hugging Face name for parameter {name!r}")
    i, rest = parts[1], ".".join(parts[2:])
    a, m = _ATTN.format(i=i), f"model.layers.{i}.mlp."
    if config.attention == "mla" and rest.startswith("attn."):  # MLAttention's modules carry HF's names
        return [a + rest[len("attn."):]]
    ln = "model.layers.{i}.{name}_layernorm.weight"
    r = m + ("router." if config.router_bias else "gate.")  # gpt-oss's biased router is mlp.router
    table = {
        "norm1.weight": [ln.format(i=i, name="input")],
        "norm2.weight": [ln.format(i=i, name="pre_feedforward" if config.norm_layout == "sandwich"
                                   else "post_attention")],
        "post_attn_norm.weight": [ln.format(i=i, name="post_attention")],
        "post_mlp_norm.weight": [ln.format(i=i, name="post_feedforward")],
        "attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        "attn.qkv.bias": [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
        "attn.proj.weight": [a + "o_proj.weight"], "attn.proj.bias": [a + "o_proj.bias"],
        "attn.q_norm.weight": [a + "q_norm.weight"],
        "attn.k_norm.weight": [a + "k_norm.weight"], "attn.sinks": [a + "sinks"],
        "mlp.fc1.weight": [m + "gate_proj.weight", m + "up_proj.weight"], "mlp.fc2.weight": [m + "down_proj.weight"],
        "mlp.router.weight": [r + "weight"], "mlp.router.bias": [r + "bias"], "mlp.w1": [m + "experts.gate_up_proj"],
        "mlp.router.e_score_correction_bias": [r + "e_score_correction_bias"],
        "mlp.w2": [m + "experts.down_proj"], "mlp.b1": [m + "experts.gate_up_proj_bias"],
        "mlp.b2": [m + "experts.down_proj_bias"],
        "shared_expert.fc1.weight": [m + "{s}.gate_proj.weight", m + "{s}.up_proj.weight"],
        "shared_expert.fc2.weight": [m + "{s}.down_proj.weight"],
        "shared_expert_gate.weight": [m + "shared_expert_gate.weight"],
    }
    if rest not in table:
        raise ValueError(f"no Hugging Face name for parameter {name!r}")
    shared = "shared_expert" if config.shared_expert_gate else "shared_experts"  # Qwen2-MoE / DeepSeek, GLM
    return [s.format(i=i, s=shared) for s in table[rest]]


_GPT_OSS_EXPERTS = {".mlp.w1": "gate_up_proj", ".mlp.b1": "gate_up_proj_bias", ".mlp.w2": "down_proj"}


def _gpt_oss_expert(name: str, config: TransformerConfig) -> str | None:
    """HF's leaf name of gpt-oss expert parameter ``name`` whose layout differs from fusedpar's."""
    if not config.expert_bias:
        return None
    return next((hf for suffix, hf in _GPT_OSS_EXPERTS.items() if name.endswith(suffix)), None)


def _from_hf_layout(name: str, config: TransformerConfig, t: torch.Tensor) -> torch.Tensor:
    """HF's expert tensor ``t`` of parameter ``name`` in fusedpar's layout. gpt-oss (the family
    with expert biases, ``config.expert_bias``) stores ``gate_up_proj [E, H, 2F]`` with the gate and
    up columns interleaved (and its bias ``[E, 2F]`` so), ``down_proj [E, F, H]``; fusedpar's ``w1``
    is ``[E, 2F, H]`` with the gate rows first, ``b1`` ``[E, 2F]`` alike, ``w2`` ``[E, H, F]``. Any
    other parameter or family: ``t`` as it is (:func:`fusedpar.hf_parallel.gpt_oss_experts_from_hf`)."""
    hf_name = _gpt_oss_expert(name, config)
    return t if hf_name is None else gpt_oss_experts_from_hf(hf_name, t)


def _to_hf_layout(name: str, config: TransformerConfig, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_from_hf_layout`: fusedpar's full ``t`` in HF's layout."""
    hf_name = _gpt_oss_expert(name, config)
    return t if hf_name is None else gpt_oss_experts_to_hf(hf_name, t)


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
                         *, device=None, dtype=None, strict: bool = True) -> None:
    """Load full (unsharded) tensors, keyed by ``model``'s parameter names, into a model of any
    parallel layout: each rank keeps its shard (by the placements its modules declare); the
    buffers its modules declare in ``checkpoint_buffers()`` (replicated state: the routers'
    ``e_score_correction_bias``) are loaded whole, under their names, as :func:`from_hf` loads them.
    A model built on the meta device is materialised (on ``device``, default CPU). ``state_dict``
    may be a callable ``name -> full tensor`` (read on demand). ``strict``: every parameter and
    every such buffer must be given (a buffer on the meta device must be given in any case: it
    holds no value to keep)."""
    placements = placements_of(model)
    for name, p in list(model.named_parameters()):
        if callable(state_dict):
            full = state_dict(name)
        elif name in state_dict:
            full = state_dict[name]
        elif strict:
            raise ValueError(f"load_full_state_dict: state_dict has no tensor for parameter {name!r}")
        else:
            continue
        placement = placements[name]
        local = placement.local_from_full(full)
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"load_full_state_dict: {name} must be {placement.full_shape(p.shape)} in full, "
                             f"got {tuple(full.shape)}")
        _set_param(model, name, p, local, device, dtype)
    for name, buf in checkpoint_buffers(model).items():
        if callable(state_dict):
            full = state_dict(name)
        elif name in state_dict:
            full = state_dict[name]
        elif strict or buf.device.type == "meta":
            raise ValueError(f"load_full_state_dict: state_dict has no tensor for buffer {name!r}"
                             + (" (on the meta device: it holds no value to keep)" if buf.device.type == "meta"
                                else ""))
        else:
            continue
        _set_buffer(model, name, buf, full, device, "load_full_state_dict")


def _set_param(model: nn.Module, name: str, p: torch.Tensor, local: torch.Tensor, device, dtype) -> None:
    """Replace parameter ``name`` (currently ``p``, maybe on the meta device) by ``local``, in
    ``dtype`` (default: ``p``'s, or ``local``'s for a meta ``p``); attention sinks stay fp32 (the
    attention ops take fp32 sink logits; gpt-oss checkpoints store them in bf16)."""
    target = p.device if p.device.type != "meta" else torch.device(device or "cpu")
    mod_name, _, pname = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if isinstance(mod, ParallelAttention) and pname == "sinks":
        dtype = torch.float32
    new = local.to(device=target, dtype=dtype or (p.dtype if p.device.type != "meta" else local.dtype)).clone()
    setattr(mod, pname, nn.Parameter(new, requires_grad=p.requires_grad))


def _set_buffer(model: nn.Module, name: str, buf: torch.Tensor, full: torch.Tensor, device, owner: str) -> None:
    """Replace the replicated buffer ``name`` (currently ``buf``, maybe on the meta device) by a
    copy of ``full`` in ``buf``'s dtype, on ``buf``'s device (``device``, default CPU, for a meta
    ``buf``)."""
    if tuple(full.shape) != tuple(buf.shape):
        raise ValueError(f"{owner}: {name} must be {tuple(buf.shape)}, got {tuple(full.shape)}")
    mod_name, _, bname = name.rpartition(".")
    target = buf.device if buf.device.type != "meta" else torch.device(device or "cpu")
    mod = model.get_submodule(mod_name) if mod_name else model
    mod.register_buffer(bname, full.to(device=target, dtype=buf.dtype).clone())


class _SafetensorsDir:
    """Tensors of a checkpoint directory by name, each file opened once (``model.safetensors`` or
    ``model.safetensors.index.json``'s shards); tensors are read only when asked for."""

    def __init__(self, path: str):
        from safetensors import safe_open  # installed with transformers / huggingface_hub

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json(index, "from_hf").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"from_hf: {index!r} must hold a weight_map object, got {type(weight_map).__name__}")
            self.where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise ValueError(f"from_hf: {path!r} has neither model.safetensors nor model.safetensors.index.json")
            with _safetensors_errors(single):
                with safe_open(single, "pt") as f:
                    self.where = {k: single for k in f.keys()}
        self.open = lambda file: safe_open(file, "pt")
        self.files: dict[str, object] = {}

    def close(self):
        for f in self.files.values():
            f.__exit__(None, None, None)
        self.files.clear()

    def __contains__(self, name):
        return name in self.where

    def keys(self):
        return self.where.keys()

    def _file(self, name):
        file = self.where[name]
        if file not in self.files:
            with _safetensors_errors(file):
                self.files[file] = self.open(file).__enter__()
        return self.files[file]

    def __getitem__(self, name):
        f = self._file(name)
        with _safetensors_errors(self.where[name], name):
            return f.get_tensor(name)

    def rows(self, name, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (dim 0) of tensor ``name``, reading only those."""
        f = self._file(name)
        with _safetensors_errors(self.where[name], name):
            return f.get_slice(name)[lo:hi]


class _safetensors_errors:
    """Turn a safetensors / OS error on ``file`` (truncated, damaged, unreadable) into a
    ``ValueError`` naming the file (and the tensor being read)."""

    def __init__(self, file: str, tensor: str | None = None):
        self.file, self.tensor = file, tensor

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, ValueError) and "from_hf" in str(exc):
            return False
        what = f" (reading tensor {self.tensor!r})" if self.tensor else ""
        raise ValueError(f"from_hf: {self.file!r} must be a readable safetensors file{what}, got "
                         f"{type(exc).__name__}: {exc}") from exc


def read_json(path: str, owner: str) -> dict:
    """A JSON object from ``path``; a missing, unreadable or malformed file raises naming it."""
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{owner}: {path!r} must exist, got no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{owner}: {path!r} must be a readable JSON file, got {type(e).__name__}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{owner}: {path!r} must hold a JSON object, got {type(value).__name__}")
    return value


def _rows(source, name: str, lo: int, hi: int) -> torch.Tensor:
    return source.rows(name, lo, hi) if isinstance(source, _SafetensorsDir) else source[name][lo:hi]


def _hf_tensor(source, name: str, experts: tuple[int, int] | None = None) -> torch.Tensor:
    """A Hugging Face tensor by its transformers-5 name; stacks the per-expert tensors of
    checkpoints saved with one tensor per expert (Mixtral ``block_sparse_moe.experts.j.w1/w3/w2``,
    Qwen-MoE ``mlp.experts.j.gate_proj/up_proj/down_proj``). ``experts=(lo, hi)``: of a stacked
    expert tensor only experts ``lo..hi-1`` are read (rows of the fused tensor, or those experts'
    tensors)."""
    if name in source:
        return source[name] if experts is None else _rows(source, name, *experts)
    if ".mlp.experts." in name:
        layer = name.split(".mlp.")[0]
        fused_gate_up = name.endswith("gate_up_proj")
        for mlp, gate, up, down in ((".block_sparse_moe.experts.", "w1", "w3", "w2"),
                                    (".mlp.experts.", "gate_proj", "up_proj", "down_proj")):
            if f"{layer}{mlp}0.{gate}.weight" in source:
                out, j = [], 0 if experts is None else experts[0]
                while f"{layer}{mlp}{j}.{gate}.weight" in source and (experts is None or j < experts[1]):
                    e = f"{layer}{mlp}{j}."
                    out.append(torch.cat([source[e + gate + ".weight"], source[e + up + ".weight"]])
                               if fused_gate_up else source[e + down + ".weight"])
                    j += 1
                return torch.stack(out)
    if name.endswith(".mlp.gate.weight") and name.replace(".mlp.", ".block_sparse_moe.") in source:
        return source[name.replace(".mlp.", ".block_sparse_moe.")]
    raise ValueError(f"from_hf: the checkpoint must hold tensor {name!r}, got none; {_layers_held(source)}")


def _layers_held(source) -> str:
    """How many decoder layers a checkpoint's tensor names cover (for a missing-tensor message)."""
    layers = sorted({int(k.split(".")[2]) for k in source.keys()
                     if k.startswith("model.layers.") and k.split(".")[2].isdigit()})
    if not layers:
        return "it holds no model.layers.* tensors"
    gaps = sorted(set(range(layers[-1] + 1)) - set(layers))
    return (f"it holds {len(layers)} layers (model.layers.{layers[0]}..{layers[-1]}"
            + (f", without {gaps}" if gaps else "") + "): does config.json's num_hidden_layers match the checkpoint?")


def _full_param(source, name: str, config: TransformerConfig, dim: int) -> torch.Tensor:
    """The full parameter ``name``: its Hugging Face tensors (its sections) joined along ``dim``."""
    parts = [_hf_tensor(source, s) for s in _param_sources(name, config)]
    return _from_hf_layout(name, config, parts[0]) if len(parts) == 1 else torch.cat(parts, dim=dim)


@torch.no_grad()
def _load_from_source(model: Transformer, source, device, dtype) -> None:
    """Materialise every parameter of the meta-device ``model`` from ``source``: this rank's
    shard of each full tensor; expert weights (split over ep) read expert by expert, only this
    rank's experts (a checkpoint directory is never read whole on every rank)."""
    placements = placements_of(model)
    for name, p in list(model.named_parameters()):
        placement = placements[name]
        if placement.role == "ep":  # only this rank's experts are read
            (src,) = _param_sources(name, model.config)
            local = _from_hf_layout(name, model.config,
                                    _hf_tensor(source, src, experts=placement.block_range(p.shape[placement.dim])))
        else:
            local = placement.local_from_full(_full_param(source, name, model.config, placement.dim))
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"from_hf: {name} must be {tuple(p.shape)} on this rank, got {tuple(local.shape)}")
        _set_param(model, name, p, local, device, dtype)
    for name, buf in checkpoint_buffers(model).items():  # replicated state (the routers' correction bias)
        (src,) = _param_sources(name, model.config)
        full = _hf_tensor(source, src)
        if tuple(full.shape) != tuple(buf.shape):
            raise ValueError(f"from_hf: {src} must be {tuple(buf.shape)}, got {tuple(full.shape)}")
        _set_buffer(model, name, buf, full, device, "from_hf")


def from_hf(hf_model_or_path, *, tp_group=None, sp_group=None, ep_group=None, ulysses_group=None,
            ring_group=None, device=None, dtype=None, **config_overrides) -> Transformer:
    """A :class:`~fusedpar.nn.Transformer` holding a Hugging Face model's weights, sharded over the
    given groups (``None`` = the default group of that dimension, i.e. the whole world when
    ``torch.distributed`` is initialised, else one process; pass the groups of a
    :class:`~fusedpar.parallel.ParallelState` or ``torch.distributed.new_group([rank])`` for a
    dimension of size 1). ``hf_model_or_path``: a ``transformers`` causal-LM model or a checkpoint
    directory. Built on the meta device; each rank materialises only its shards, on ``device``
    (default CPU) in ``dtype`` (default: the checkpoint's). ``config_overrides``: see
    :func:`config_from_hf` (e.g. ``sp_mode="ulysses"``)."""
    if isinstance(hf_model_or_path, (str, os.PathLike)):
        path = os.fspath(hf_model_or_path)
        raw = read_json(os.path.join(path, "config.json"), "from_hf")
        try:
            from transformers import AutoConfig  # normalises older config formats when installed
            # never the directory's own Python (a Kimi K2 directory ships configuration_deepseek.py)
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except ImportError:
            hf_config = raw
        except (ValueError, KeyError):  # a model type transformers does not know: config_from_hf names it
            hf_config = raw
        source = _SafetensorsDir(path)
    else:
        hf_config = hf_model_or_path.config
        source = dict(hf_model_or_path.state_dict())
    config = config_from_hf(hf_config, **config_overrides)
    model = Transformer(config, tp_group=tp_group, sp_group=sp_group, ep_group=ep_group,
                        ulysses_group=ulysses_group, ring_group=ring_group, device="meta")
    try:
        _load_from_source(model, source, device, dtype)
    finally:
        if isinstance(source, _SafetensorsDir):
            source.close()
    return model


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as a full tensor under its Hugging Face (transformers 5) name,
    e.g. for ``hf_model.load_state_dict(sd, strict=True)``. A collective over the model's tp / ep
    groups: call it on every rank. Tied embeddings appear under both names, as in Hugging Face."""
    if not isinstance(model, Transformer):
        raise TypeError(f"to_hf_state_dict needs a fusedpar.nn.Transformer, got {type(model).__name__}")
    full = full_state(model)
    placements = placements_of(model)
    out = {}
    for name, t in full.items():
        sources = _param_sources(name, model.config)
        pl = placements[name]  # a fused parameter's sections are the Hugging Face tensors
        for src, piece in zip(sources, torch.split(t, pl.full_sections(t.shape[pl.dim], 1), dim=pl.dim)):
            out[src] = _to_hf_layout(name, model.config, piece).clone()
    for name, buf in checkpoint_buffers(model).items():  # replicated: identical on every rank
        (src,) = _param_sources(name, model.config)
        out[src] = buf.detach().clone()
    if model.config.tie_word_embeddings and "embedding.weight" in full:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
