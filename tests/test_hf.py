"""fusedpar.hf against transformers' own models (tiny configs, random weights, fp32, one process),
and the defaults fixed with it: the ``kernels`` probe, router renormalisation, HF aux loss,
``ignore_index``, ``from_linear``'s layout, ``_extra_state`` tensors, meta-device builds."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from _utils import DEVICE
from _hf import (
    FAMILIES,
    MOE_FAMILIES,
    TOL,
    VOCAB,
    compare_grads,
    hf_model,
    hf_reference,
    tokens_targets,
    train_like_transformers,
)
from fusedpar.hf import config_from_hf, from_hf, load_full_state_dict, to_hf_state_dict
from fusedpar.nn import Transformer, TransformerConfig
from fusedpar.nn.transformer import shard_tokens
from fusedpar.ops.loss.api import vocab_parallel_cross_entropy

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assert_close(actual, expected, msg):
    scale = expected.abs().max().item() + 1e-12
    err = (actual - expected).abs().max().item()
    assert err <= TOL * scale, f"{msg}: off by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_gradients_aux_loss_and_export_match_transformers(family):
    hf = hf_model(family)
    tokens, targets = tokens_targets(1, 2, 8)
    ref_logits, ref_loss, ref_grads = hf_reference(hf, tokens, targets, aux=True)
    model = from_hf(hf, device=DEVICE)
    assert all(p.device.type == DEVICE.type for p in model.parameters())
    logits = model(tokens)
    _assert_close(logits.detach(), ref_logits, f"{family} logits")
    loss = model.loss(logits, targets)
    if family in MOE_FAMILIES:
        loss = loss + model.aux_loss()
    _assert_close(loss.detach(), ref_loss, f"{family} loss (with HF's aux loss)")
    with torch.no_grad():  # the fused head (tied embeddings: the embedding's rows) gives HF's loss too
        fused = model.loss(model(tokens, return_hidden=True), targets)
    _assert_close(fused + (model.aux_loss() if family in MOE_FAMILIES else 0), ref_loss, f"{family} fused loss")
    loss.backward()
    compare_grads(model, ref_grads, family)
    # export: strict load into a fresh HF model gives the same model back
    fresh = hf_model(family, seed=7)
    fresh.load_state_dict(to_hf_state_dict(model), strict=True)
    for (n, a), b in zip(hf.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


def test_yarn_rope_scaling_matches_transformers():
    """YaRN on a grouped-query family: the frequencies and the attention factor on cos / sin
    (here 0.1 ln 4 + 1, no mscale fields) give transformers' logits."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4,
            "beta_fast": 8, "beta_slow": 1}
    hf = hf_model("llama", rope_parameters=yarn)
    tokens, _ = tokens_targets(4, 2, 8)
    model = from_hf(hf, device=DEVICE)
    assert model.config.rope_scaling["rope_type"] == "yarn"
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), "llama with YaRN")


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe"])
def test_from_checkpoint_directory_reads_safetensors(tmp_path, family):
    """save_pretrained's directory (one tensor per expert; GLM-4.5's correction-bias buffers) ->
    from_hf -> the same logits, and to_hf_state_dict loads back strictly, every tensor equal."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    tokens, _ = tokens_targets(2, 1, 8)
    assert all(p.device.type == "cpu" for p in from_hf(str(tmp_path)).parameters())  # the default device
    model = from_hf(str(tmp_path), device=DEVICE)
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), f"{family} from a directory")
    fresh = hf_model(family, seed=7)
    fresh.load_state_dict(to_hf_state_dict(model), strict=True)
    for (n, a), b in zip(hf.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_training_steps_match_transformers(family):
    hf = hf_model(family)
    model = from_hf(hf, device=DEVICE)
    train_like_transformers(hf, model)
    tokens, _ = tokens_targets(20, 2, 8)
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), f"{family} logits after 3 AdamW steps")


def test_config_from_hf_rejects_what_it_does_not_implement():
    assert config_from_hf(transformers.MistralConfig()).sliding_window == 4096  # stock Mistral: kept, see below
    assert config_from_hf(transformers.Qwen2Config(use_sliding_window=False)).sliding_window is None
    with pytest.raises(ValueError, match="rope_type"):
        config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                 "factor": 2.0}))
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(transformers.LlamaConfig(attention_bias=True))
    with pytest.raises(ValueError, match="model_type must be one of"):
        config_from_hf(transformers.GPT2Config())
    c = config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert c.rope_theta == 5e5 and c.rope_scaling is None
    c = config_from_hf(transformers.MixtralConfig())
    assert c.norm_topk_prob is True and c.aux_loss_style == "hf" and c.aux_loss_coef == 1e-3 and c.z_loss_coef == 0


def test_sliding_windows_match_transformers():
    """HF's sliding window W (query i sees keys i - W < j <= i, fusedpar's window=(W - 1, 0)) on
    sequences several windows long: every layer of the mistral family (W = 5), and the layers that
    ``layer_types`` marks in a Qwen2 model whose first layer stays full."""
    hf = hf_model("mistral")
    model = from_hf(hf, device=DEVICE)
    assert model.config.sliding_window == 5 and model.config.attention_config(0).window == (4, 0)
    tokens, _ = tokens_targets(8, 2, 16)
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), "mistral logits, 16 tokens, window 5")
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=3,
                  layer_types=["full_attention", "sliding_attention"])
    model = from_hf(hf, device=DEVICE)
    assert [model.config.attention_config(i).window for i in range(2)] == [None, (2, 0)]
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), "qwen2 logits, one sliding layer")
    with pytest.raises(ValueError, match="sliding_window must be"):
        TransformerConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window is None"):
        TransformerConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8,
                          layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match=r"layer_types\[1\]"):
        TransformerConfig(vocab_size=8, hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=8, sliding_window=4,
                          layer_types=["full_attention", "local"])


def test_kernels_directory_does_not_break_transformers_probe():
    """From the repository root the source dir ``kernels/`` comes first on sys.path, before the PyPI
    ``kernels`` package (Hugging Face's hub kernels) that transformers probes for and, from 5.25,
    depends on and imports: where that package is installed the top-level import gets it, so
    building a transformers model there works; where it is not, the import gets the source dir,
    which has no names and says to import fusedpar.kernels."""
    code = ("import importlib.metadata as md, os, transformers, kernels; "
            "m = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=16, hidden_size=8, "
            "intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)); "
            "import fusedpar.kernels as fk; "
            "assert fk.__file__ == os.path.join(%r, 'kernels', '__init__.py'), fk.__file__; "
            "installed = any(d.metadata['Name'] == 'kernels' for d in md.distributions()); "
            "here = os.path.dirname(kernels.__file__) == os.path.join(%r, 'kernels'); "
            "assert here != installed, (installed, kernels.__file__); "
            "assert transformers.utils.import_utils.is_kernels_available() or not installed; "
            "print('ok', installed)" % (ROOT, ROOT))
    env = dict(os.environ, PYTHONPATH="")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().startswith("ok"), out.stderr[-2000:]


def test_kernels_directory_without_the_pypi_package_has_no_names():
    """With no other ``kernels`` on sys.path (here: the repository root and the standard library
    only) the top-level import gets the source dir: it imports, answers ``__version__`` as absent
    (libraries probe for it) and every other name with an error naming fusedpar.kernels."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path[:] = [{ROOT!r}] + [p for p in sys.path if "packages" not in p]
        import kernels
        assert os.path.dirname(kernels.__file__) == os.path.join({ROOT!r}, "kernels"), kernels.__file__
        assert getattr(kernels, "__version__", None) is None
        try:
            kernels.matmul
        except AttributeError as e:
            print("ok", e)
        """)
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
    assert "import fusedpar.kernels instead" in out.stdout


def test_ignore_index_and_out_of_range_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, VOCAB, generator=g).to(DEVICE).requires_grad_()
    targets = torch.randint(0, VOCAB, (2, 6), generator=g).to(DEVICE)
    targets[0, :3] = -100
    loss = vocab_parallel_cross_entropy(logits, targets)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert logits.grad[0, :3].abs().max() == 0
    targets[1, 0] = VOCAB
    with pytest.raises(ValueError, match=rf"target must hold ids in \[0, {VOCAB}\) or ignore_index=-100, got {VOCAB}"):
        vocab_parallel_cross_entropy(logits, targets)
    targets[1, 0] = -5
    with pytest.raises(ValueError, match="got -5"):
        vocab_parallel_cross_entropy(logits, targets)
    none = vocab_parallel_cross_entropy(logits, targets.clamp(min=0), reduction="none", ignore_index=3)
    assert none.shape == (2, 6) and bool((none[targets.clamp(min=0) == 3] == 0).all())


@pytest.mark.parametrize("family", ["llama31", "mixtral", "gpt_oss", "deepseek_v3"])
def test_causal_lm_loss_equals_the_model_s_own_loss_without_logits(family):
    """Route B's fused loss (fusedpar.hf.causal_lm_loss: decoder hidden states -> the chunked
    linear cross entropy with lm_head's weight) equals the HF model's ``labels=`` loss, the
    aux loss included where the family has one (gpt-oss's too; DeepSeek-V3 has none even with
    output_router_logits), and every gradient; a tied head (llama31) too.
    No [tokens, vocab] tensor is created (the op's memory test covers the chunking)."""
    from _hf import hf_named_reference
    from fusedpar.hf import causal_lm_loss

    tokens, _ = tokens_targets(3, 2, 8)
    tokens[1, 2:5] = tokens[0, :3]
    model = hf_model(family, **({"output_router_logits": True} if family == "deepseek_v3" else {}))
    _, ref_loss, ref_grads, _ = hf_named_reference(model, tokens, aux=True)
    model.zero_grad()
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]
    loss = causal_lm_loss(model, tokens, targets, chunk_tokens=5)  # ragged chunks of the 16 tokens
    _assert_close(loss.detach(), ref_loss, f"{family} loss")
    loss.backward()
    for name, p in model.named_parameters():
        _assert_close(p.grad, ref_grads[name], f"{family} grad {name}")
    with pytest.raises(ValueError, match=r"targets must have input_ids' shape \(2, 8\), got \(2, 7\)"):
        causal_lm_loss(model, tokens, targets[:, 1:])


def test_router_renormalisation_is_a_config_field():
    base = dict(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=8, num_experts=4, top_k=2)
    x = torch.randint(0, 32, (1, 8)).to(DEVICE)
    for norm in (True, False):
        model = Transformer(TransformerConfig(**base, norm_topk_prob=norm), device=DEVICE)
        model(x)
        w = model.layers["0"].mlp.router_output.weights
        assert torch.allclose(w.sum(-1), torch.ones(8, device=DEVICE)) == norm


def test_meta_build_then_load_full_state_dict():
    """A meta-device build materialised on the tests' device from full CPU tensors: the parameters
    and the router's score-correction bias (a checkpoint buffer, which steers the selection)."""
    from fusedpar.nn import checkpoint_buffers

    config = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=4, ffn_hidden_size=8,
                               num_kv_heads=2, qk_norm=True, qkv_bias=True, num_experts=4,
                               shared_expert_ffn_hidden_size=8, score_func="sigmoid", score_correction_bias=True)
    ref = Transformer(config, device=DEVICE)
    with torch.no_grad():
        ref.layers["0"].mlp.router.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    params = {n: p.detach().cpu() for n, p in ref.named_parameters()}
    full = {**params, **{n: b.cpu() for n, b in checkpoint_buffers(ref).items()}}
    meta = Transformer(config, device="meta")
    assert all(t.device.type == "meta" for t in (*meta.parameters(), *meta.buffers()))
    load_full_state_dict(meta, full, device=DEVICE)
    assert all(t.device.type == DEVICE.type for t in (*meta.parameters(), *meta.buffers()))
    x = torch.randint(0, 32, (1, 8)).to(DEVICE)
    torch.testing.assert_close(meta(x), ref(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="no tensor for parameter 'embedding.weight'"):
        load_full_state_dict(Transformer(config, device="meta"), {})
    bias = "layers.0.mlp.router.e_score_correction_bias"
    with pytest.raises(ValueError, match=f"no tensor for buffer '{bias}' \\(on the meta device"):
        load_full_state_dict(Transformer(config, device="meta"), params, strict=False)
    with pytest.raises(ValueError, match=f"no tensor for buffer '{bias}'$"):
        load_full_state_dict(Transformer(config, device=DEVICE), params)  # strict: buffers too
    with pytest.raises(ValueError, match=rf"{bias} must be \(4,\), got \(3,\)"):
        load_full_state_dict(Transformer(config, device="meta"), {**full, bias: torch.zeros(3)})


def test_from_linear_keeps_the_replicated_layout_and_save_pretrained_works(tmp_path):
    from fusedpar.nn import ColumnParallelLinear, RowParallelLinear

    hf = hf_model("llama")
    tokens, _ = tokens_targets(3, 1, 8)
    expect = hf(tokens).logits.detach()
    for layer in hf.model.layers:
        attn = layer.self_attn
        attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj)
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj)
        assert not attn.q_proj.sequence_parallel and not attn.o_proj.sequence_parallel
    _assert_close(hf(tokens).logits.detach(), expect, "HF model with fusedpar linears")
    hf.save_pretrained(tmp_path)  # every state-dict entry a tensor, _extra_state included
    assert os.path.exists(tmp_path / "model.safetensors")


def test_gather_logits_single_process_is_identity():
    config = config_from_hf(hf_model("llama").config)
    model = Transformer(config, device=DEVICE)
    tokens, targets = tokens_targets(4, 2, 8)
    ids, _ = shard_tokens(tokens, targets, sp_size=1, sp_rank=0, tp_size=1, tp_rank=0)
    logits = model(ids)
    assert torch.equal(model.gather_logits(logits), logits)


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_type must be one of"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "must have 'original_max_position_embeddings'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "must have 'low_freq_factor'"),
    ("aux_loss_style", "mixtral", "aux_loss_style must be 'switch' or 'hf'"),
    ("shared_expert_ffn_hidden_size", -1, "shared_expert_ffn_hidden_size must be an int >= 0"),
    ("rope_theta", 0, "rope_theta must be a positive number"),
])
def test_config_rejects_bad_hf_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8, **{field: value})


def test_hf_aux_loss_style_needs_aux_loss_scale_zero_and_tied_embeddings_need_both_ends():
    config = TransformerConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8,
                               num_experts=2, top_k=1, aux_loss_style="hf", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="aux_loss_scale must be 0"):
        Transformer(config, aux_loss_scale=1.0)
    with pytest.raises(ValueError, match="tie_word_embeddings needs the embedding and the head"):
        Transformer(config, head=False)


def test_config_from_a_config_json_dict_of_older_transformers():
    raw = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "rope_theta": 500000.0, "tie_word_embeddings": True,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    c = config_from_hf(raw, sp_mode="ulysses")
    assert (c.rope_theta, c.rope_scaling["factor"], c.norm_eps, c.tie_word_embeddings, c.sp_mode) == \
        (500000.0, 8.0, 1e-5, True, "ulysses")
    assert c.num_kv_heads == 2 and c.qkv_bias is False and c.qk_norm is False


# --- damaged checkpoints and configs: one clear error naming the file or field (issue #30) --
def _saved(tmp_path, family="llama"):
    hf_model(family).save_pretrained(tmp_path)
    return tmp_path


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


@pytest.mark.parametrize("damage,words", [
    (lambda d: _truncate(d / "model.safetensors", lambda n: n // 2), "must be a readable safetensors file"),
    (lambda d: _truncate(d / "model.safetensors", lambda n: 3), "must be a readable safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "must be a readable safetensors file"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json' must be a readable JSON file"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json' must hold a JSON object, got list"),
], ids=["truncated-half", "truncated-header", "garbage", "config-not-json", "config-not-object"])
def test_damaged_checkpoint_names_the_file(tmp_path, damage, words):
    d = _saved(tmp_path)
    damage(d)
    with pytest.raises(ValueError, match=words) as e:
        from_hf(str(d))
    assert str(d) in str(e.value), str(e.value)


def test_missing_config_names_the_path(tmp_path):
    d = _saved(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json' must exist"):
        from_hf(str(d))


@pytest.mark.parametrize("field", ["num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers",
                                   "intermediate_size"])
def test_config_without_a_required_field_names_it(field):
    raw = hf_model("llama").config.to_dict()
    raw.pop(field)
    with pytest.raises(ValueError, match=f"config_from_hf: the config must have {field} \\(int\\), got none"):
        config_from_hf(raw)
    raw[field] = "four"
    with pytest.raises(ValueError, match=f"config_from_hf: the config's {field} must be an int, got str 'four'"):
        config_from_hf(raw)


def test_checkpoint_missing_a_layer_says_which_tensor_and_how_many_layers(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    d = _saved(tmp_path)
    raw = json.loads((d / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    tensors = {k: v for k, v in load_file(d / "model.safetensors").items()
               if not k.startswith(f"model.layers.{layers - 1}.")}
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"must hold tensor 'model.layers.{layers - 1}\\..*', got none; it holds "
                                         f"{layers - 1} layers") as e:
        from_hf(str(d))
    assert "num_hidden_layers" in str(e.value)
    # a model in memory missing its first layer: the gap is named
    hf = hf_model("llama")
    sd = {k: v for k, v in hf.state_dict().items() if not k.startswith("model.layers.0.")}

    class Holder(torch.nn.Module):  # from_hf reads .config and .state_dict()
        def __init__(self):
            super().__init__()
            self.config = hf.config

        def state_dict(self, *a, **k):
            return sd

    with pytest.raises(ValueError, match=f"it holds {layers - 1} layers .*without \\[0\\]"):
        from_hf(Holder())


def test_parallelize_without_heads_names_the_field():
    from fusedpar.hf import parallelize

    hf = hf_model("llama")
    import types

    hf.config = types.SimpleNamespace(**{**hf.config.to_dict(), "num_attention_heads": None})  # HF would refuse None
    with pytest.raises(ValueError, match=r"parallelize: the config must have num_attention_heads \(int\), got none"):
        parallelize(hf)


def test_fusedpar_checkpoint_of_a_model_with_hugging_face_modules(tmp_path):
    """HF's own modules declare no placement: fusedpar checkpoints refuse to guess, naming the
    parameter, unless told that undeclared parameters are whole on every rank."""
    from fusedpar import checkpoint
    from fusedpar.nn import ColumnParallelLinear, Placement

    hf = hf_model("llama")
    layer = hf.model.layers[0].self_attn
    layer.q_proj = ColumnParallelLinear.from_linear(layer.q_proj)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"parameter 'model\.embed_tokens\.weight' \(in a Embedding module\) has no placement"):
        checkpoint.save(hf, str(tmp_path / "refused"))
    whole = Placement()
    checkpoint.save(hf, str(tmp_path / "ok"), default_placement=whole)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(1.0)
    checkpoint.load(hf, str(tmp_path / "ok"), default_placement=whole)
    for n, p in hf.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_glm4_moe_config_fields_and_partial_rotary_checks():
    c = config_from_hf(transformers.Glm4MoeConfig(n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                                  first_k_dense_replace=3, n_shared_experts=2,
                                                  moe_intermediate_size=64, attention_bias=True, use_qk_norm=True,
                                                  head_dim=128))
    assert (c.score_func, c.n_group, c.topk_group, c.routed_scaling_factor, c.score_correction_bias) == \
        ("sigmoid", 8, 4, 2.5, True)
    assert (c.first_k_dense_replace, c.shared_expert_ffn_hidden_size, c.shared_expert_gate) == (3, 128, False)
    assert (c.qkv_bias, c.qk_norm, c.partial_rotary_factor, c.rotary_dim()) == (True, True, 0.5, 64)
    assert not c.is_moe(2) and c.is_moe(3) and c.aux_loss_coef == c.z_loss_coef == 0.0
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                 "partial_rotary_factor": 0.5}))
    base = dict(vocab_size=8, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=8)
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be a number in \(0, 1\], got 0"):
        TransformerConfig(**base, partial_rotary_factor=0)
    with pytest.raises(ValueError, match="must give an even rotary dim >= 2"):
        TransformerConfig(**base, partial_rotary_factor=0.375)  # int(8 * 0.375) = 3: odd


NEW_FAMILIES = ("olmo2", "gemma", "gemma2", "gemma3", "gpt_oss")


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_directory_round_trip_and_training_steps_match_transformers(family, tmp_path):
    """OLMo 2, the Gemma families and gpt-oss (stacked expert tensors, gate / up interleaved):
    loaded from a safetensors directory with HF's logits, exported back (strict, bit-equal), and 3
    AdamW steps (the head fused into the loss: Gemma 2's final softcap inside
    linear_cross_entropy; gpt-oss with HF's aux loss) leave every weight as transformers' own
    steps do."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    model = from_hf(str(tmp_path), device=DEVICE)
    tokens, _ = tokens_targets(2, 2, 8)
    _assert_close(model(tokens).detach(), hf(tokens).logits.detach(), f"{family} logits from a directory")
    exported = to_hf_state_dict(model)
    fresh = hf_model(family, seed=7)
    fresh.load_state_dict(exported, strict=True)
    for (n, a), b in zip(hf.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    train_like_transformers(hf, model)
    trained = to_hf_state_dict(model)
    for name, p in hf.state_dict().items():  # every weight after 3 steps (lr 1e-2: all moved by ~3e-2)
        _assert_close(trained[name], p, f"{family} {name} after 3 AdamW steps")


def test_layer_types_default_when_a_config_dict_has_none():
    """An older config.json read as a dict has no ``layer_types``: transformers' default pattern
    applies (Gemma 2 alternates, sliding first; Gemma 3 makes every ``sliding_window_pattern``-th
    layer global) so the windows and Gemma 3's local RoPE base are kept, as from the config object."""
    for cls, extra in ((transformers.Gemma2Config, {}), (transformers.Gemma3TextConfig, {"sliding_window_pattern": 3})):
        hf_config = cls(num_hidden_layers=6, sliding_window=16, **extra)
        raw = hf_config.to_dict()
        raw.pop("layer_types")
        if "sliding_window_pattern" in extra:
            raw["sliding_window_pattern"] = 3
        a, b = config_from_hf(hf_config), config_from_hf(raw)
        windows = [b.attention_config(i).window for i in range(6)]
        assert windows == [a.attention_config(i).window for i in range(6)], cls.__name__
        assert windows.count(None) == (3 if cls is transformers.Gemma2Config else 2) and (15, 0) in windows
        assert a.layer_rope_theta == b.layer_rope_theta, cls.__name__


def test_new_family_fields_that_fusedpar_does_not_implement_are_named():
    stock = config_from_hf(transformers.Gemma2Config())  # stock Gemma 2 caps the attention logits at 50
    assert (stock.attn_logit_softcapping, stock.final_logit_softcap, stock.sliding_window) == (50.0, 30.0, 4096)
    assert stock.layer_types[:2] == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="hidden_activation='gelu'"):
        config_from_hf(transformers.Gemma3TextConfig(hidden_activation="gelu"))
    with pytest.raises(ValueError, match="attention_bias=True"):
        config_from_hf(transformers.Olmo2Config(attention_bias=True))
    with pytest.raises(ValueError, match="rope_parameters\\['full_attention'\\]"):
        config_from_hf(transformers.Gemma3TextConfig(rope_parameters={
            "full_attention": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    c = config_from_hf(transformers.Gemma3TextConfig(num_hidden_layers=7))  # stock: 5 sliding layers, then a global one
    assert c.layer_rope_theta == (1e4,) * 5 + (1e6, 1e4) and c.sliding_window == 4096 and c.final_logit_softcap is None
    assert c.softmax_scale == 256 ** -0.5 and c.embed_scale == 2304 ** 0.5 and c.activation == "geglu"
    raw = {"model_type": "gemma3_text", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 4, "rms_norm_eps": 1e-6,
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 4, "rope_theta": 5e5,
           "rope_local_base_freq": 100.0, "layer_types": ["sliding_attention", "full_attention"],
           "sliding_window": 8}  # a config.json of transformers 4: the local base as rope_local_base_freq
    assert config_from_hf(raw).layer_rope_theta == (100.0, 5e5)
    with pytest.raises(ValueError, match="rope_scaling"):  # transformers 4 put Gemma 3's global scaling there
        config_from_hf(dict(raw, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}))
    gemma_json = dict(raw, model_type="gemma", hidden_act="gelu")  # Gemma 1's config.json: the tanh GELU meant
    assert config_from_hf(gemma_json).activation == "geglu"
    for field, value, match in (("norm_layout", "mid", "norm_layout must be one of"),
                                ("norm_offset", 0.5, "norm_offset must be 0.0 or 1.0"),
                                ("qk_norm_scope", "row", "qk_norm_scope must be one of"),
                                ("layer_rope_theta", (1.0, 2.0), "must have num_layers=1 entries, got 2"),
                                ("pad_token_id", 8, "pad_token_id must be")):
        with pytest.raises(ValueError, match=match):
            TransformerConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=8,
                              **{field: value})


def test_a_fused_softcap_other_than_the_model_s_is_refused():
    """Transformer.loss refuses a fused softcap other than the model's final one."""
    model = from_hf(hf_model("gemma2"), device=DEVICE)
    tokens, targets = tokens_targets(1, 1, 8)
    with pytest.raises(ValueError, match=r"softcap must be config.final_logit_softcap=3.0 .* got 5.0"):
        model.loss(model(tokens, return_hidden=True), targets, softcap=5.0)
