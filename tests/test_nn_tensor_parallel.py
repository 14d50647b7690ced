"""fusedpar.nn tensor-parallel modules on gloo worlds (2 and 4 ranks).

Oracles: the single-process nn.Linear / MLP (fp64 copy of the same weights), and PyTorch's own
DTensor tensor-parallel plan (parallelize_module with ColwiseParallel / RowwiseParallel on a
gloo DeviceMesh) on the same weights. Tolerances: tests/_utils.py per dtype (fp32 here; fp16 runs
in the ops tests), DTensor comparisons at fp32 ieee level (both sides fp32 GEMMs, different order).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from _utils import DEVICE, assert_close
from _world import rank_rng, world_fixture
from fusedpar.nn import ColumnParallelLinear, ParallelMLP, RowParallelLinear, merge_shards
from fusedpar.nn.linear import encode_shard_meta, shard_meta

world2 = world_fixture(2)
# tp=4 runs the light subset of modules_vs_reference in test_tensor_parallel_ops.py's world of 4 (one fewer
# world to start: a spawned rank's imports cost more than the cases themselves)


def _chunk(t, dim, rank, size):
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def _gated_rows(t, rank, size):
    gate, up = t.chunk(2, 0)
    return torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)])


class _RefMLP(nn.Module):
    def __init__(self, h, f, activation, bias):
        super().__init__()
        self.activation = activation
        gated = activation == "swiglu"
        self.fc1 = nn.Linear(h, 2 * f if gated else f, bias=bias)
        self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        y = self.fc1(x)
        if self.activation == "swiglu":
            g, u = y.chunk(2, dim=-1)
            y = nn.functional.silu(g) * u
        else:
            y = nn.functional.gelu(y, approximate="tanh")
        return self.fc2(y)


def _grads64(module, x, grad):
    ref = {k: v.detach().double().requires_grad_(True) for k, v in module.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    y = torch.func.functional_call(module, ref, (x64,))
    y.backward(grad.double())
    return y.detach(), x64.grad, {k: v.grad for k, v in ref.items()}


# ----------------------------------------------------------------------------------------------
# initialisation independent of tp; from_linear; state_dict; extra_repr; errors
# ----------------------------------------------------------------------------------------------
def _init_and_state(rank, size):
    torch.manual_seed(123)
    full = nn.Linear(12, 8 * size)
    torch.manual_seed(123)
    col = ColumnParallelLinear(12, 8 * size)
    torch.testing.assert_close(col.weight, _chunk(full.weight, 0, rank, size), rtol=0, atol=0)
    torch.testing.assert_close(col.bias, _chunk(full.bias, 0, rank, size), rtol=0, atol=0)
    assert col.weight.shape == (8, 12) and "tp=" in repr(col)

    torch.manual_seed(7)
    full_r = nn.Linear(4 * size, 9)
    torch.manual_seed(7)
    row = RowParallelLinear(4 * size, 9)
    torch.testing.assert_close(row.weight, _chunk(full_r.weight, 1, rank, size), rtol=0, atol=0)
    torch.testing.assert_close(row.bias, full_r.bias, rtol=0, atol=0)

    torch.manual_seed(5)
    ref = _RefMLP(10, 4 * size, "swiglu", bias=False)
    torch.manual_seed(5)
    mlp = ParallelMLP(10, 4 * size)
    torch.testing.assert_close(mlp.fc1.weight, _gated_rows(ref.fc1.weight, rank, size), rtol=0, atol=0)
    torch.testing.assert_close(mlp.fc2.weight, _chunk(ref.fc2.weight, 1, rank, size), rtol=0, atol=0)
    assert mlp.fc1.bias is None and mlp.fc2.bias is None

    # unequal sections ([q; k; v]-like): every rank holds its block of each section
    full_s = nn.Linear(10, 7 * size)
    secs = (4 * size, 2 * size, size)
    sectioned = ColumnParallelLinear.from_linear(full_s, sections=secs)
    blocks = [_chunk(part, 0, rank, size) for part in full_s.weight.detach().split(secs)]
    torch.testing.assert_close(sectioned.weight, torch.cat(blocks), rtol=0, atol=0)

    # state_dict: the local shard + metadata; every rank's dicts reassemble the full weights
    for mod, full_w, full_b in [(col, full.weight, full.bias), (row, full_r.weight, full_r.bias),
                                (mlp.fc1, ref.fc1.weight, None), (sectioned, full_s.weight, full_s.bias)]:
        sd = mod.state_dict()
        assert isinstance(sd["_extra_state"], torch.Tensor)  # every entry a tensor (HF save_pretrained)
        meta = shard_meta(sd["_extra_state"])
        assert meta["tp_rank"] == rank and meta["tp_size"] == size and meta["full_shape"] == list(full_w.shape)
        every = [None] * size
        dist.all_gather_object(every, sd)
        merged = merge_shards(every[::-1])
        torch.testing.assert_close(merged["weight"], full_w.detach(), rtol=0, atol=0)
        if full_b is not None:
            torch.testing.assert_close(merged["bias"], full_b.detach(), rtol=0, atol=0)
        mod.load_state_dict(sd)
        for wrong in (dict(meta, tp_rank=(rank + 1) % size), encode_shard_meta(dict(meta, tp_rank=(rank + 1) % size))):
            with pytest.raises(ValueError, match="does not belong to this rank"):
                mod.load_state_dict(dict(sd, _extra_state=wrong))

    # bad configuration: clear errors on every rank
    with pytest.raises(ValueError, match=r"out_features=\d+ must be divisible"):
        ColumnParallelLinear(8, 7 * size + 1)
    with pytest.raises(ValueError, match="in_features=.* must be divisible"):
        RowParallelLinear(4 * size + 1, 8)
    with pytest.raises(ValueError, match="activation must be one of"):
        ParallelMLP(8, 4 * size, activation="tanh")
    with pytest.raises(ValueError, match=r"sections must add up to out_features=8, got \(4, 2\)"):
        ColumnParallelLinear(8, 8, sections=(4, 2))
    with pytest.raises(ValueError, match=r"every section of sections=\(5, 3\).* must be divisible"):
        ColumnParallelLinear(8, 8, sections=(5, 3))
    with pytest.raises(ValueError, match=r"sections must be None with a gated activation"):
        ColumnParallelLinear(8, 8, activation="swiglu", sections=(4, 4))
    with pytest.raises(ValueError, match="must be divisible by the group size"):
        RowParallelLinear(4 * size, 8)(torch.randn(2, 2 * size + 1, 4))
    return True


def test_init_state_dict_errors(world2):
    assert all(world2.run(_init_and_state))


# ----------------------------------------------------------------------------------------------
# modules against the single-process fp64 reference
# ----------------------------------------------------------------------------------------------
def modules_vs_reference(rank, size, seed, light=False):
    torch.manual_seed(seed)  # the nn.Linear references below must be the same layer on every rank
    g = rank_rng(seed)
    B, S, H = 2, 3 * size, 10
    dtype = torch.float32
    column_cases = [(True, False, True), (False, True, False), (False, False, True)]
    for sp, gather_output, bias in column_cases[:1 if light else 3]:
        lin = nn.Linear(H, 6 * size, bias=bias)
        X = torch.randn(B, S, H, generator=g)
        G = torch.randn(B, S, 6 * size, generator=g)
        y_ref, dX, dP = _grads64(lin, X, G)
        col = ColumnParallelLinear.from_linear(lin, sequence_parallel=sp, gather_output=gather_output)
        x = (_chunk(X, 1, rank, size) if sp else X).clone().requires_grad_(True)
        y = col(x)
        y.backward(G if gather_output else _chunk(G, -1, rank, size))
        tag = f"column sp={sp} gather={gather_output}"
        assert_close(y, y_ref if gather_output else _chunk(y_ref, -1, rank, size), dtype, msg=tag)
        assert_close(x.grad, _chunk(dX, 1, rank, size) if sp else dX, dtype, msg=f"{tag} dx")
        assert_close(col.weight.grad, _chunk(dP["weight"], 0, rank, size), dtype, msg=f"{tag} dW")
        if bias:
            assert_close(col.bias.grad, _chunk(dP["bias"], 0, rank, size), dtype, msg=f"{tag} db")

    for sp, parallel_in, bias in [(True, True, True), (False, True, True), (True, False, False)][:1 if light else 3]:
        lin = nn.Linear(4 * size, 7, bias=bias)
        X = torch.randn(B, S, 4 * size, generator=g)
        G = torch.randn(B, S, 7, generator=g)
        y_ref, dX, dP = _grads64(lin, X, G)
        row = RowParallelLinear.from_linear(lin, sequence_parallel=sp, input_is_parallel=parallel_in)
        x = (_chunk(X, -1, rank, size) if parallel_in else X).clone().requires_grad_(True)
        y = row(x)
        y.backward(_chunk(G, 1, rank, size) if sp else G)
        tag = f"row sp={sp} input_is_parallel={parallel_in}"
        assert_close(y, _chunk(y_ref, 1, rank, size) if sp else y_ref, dtype, msg=tag)
        assert_close(x.grad, _chunk(dX, -1, rank, size) if parallel_in else dX, dtype, msg=f"{tag} dx")
        assert_close(row.weight.grad, _chunk(dP["weight"], 1, rank, size), dtype, msg=f"{tag} dW")
        if bias:
            assert_close(row.bias.grad, dP["bias"], dtype, msg=f"{tag} db (full on every rank)")

    for activation, sp, bias in [("swiglu", True, False), ("gelu", False, True)][:1 if light else 2]:
        torch.manual_seed(seed)
        ref = _RefMLP(H, 4 * size, activation, bias)
        torch.manual_seed(seed)
        mlp = ParallelMLP(H, 4 * size, activation=activation, sequence_parallel=sp, bias=bias,
                          save_gathered_input=not bias)
        X = torch.randn(B, S, H, generator=g)
        G = torch.randn(B, S, H, generator=g)
        y_ref, dX, dP = _grads64(ref, X, G)
        x = (_chunk(X, 1, rank, size) if sp else X).clone().requires_grad_(True)
        y = mlp(x)
        y.backward(_chunk(G, 1, rank, size) if sp else G)
        tag = f"mlp {activation} sp={sp}"
        fc1 = _gated_rows if activation == "swiglu" else (lambda t, r, s: _chunk(t, 0, r, s))
        assert_close(y, _chunk(y_ref, 1, rank, size) if sp else y_ref, dtype, msg=tag)
        assert_close(x.grad, _chunk(dX, 1, rank, size) if sp else dX, dtype, msg=f"{tag} dx")
        assert_close(mlp.fc1.weight.grad, fc1(dP["fc1.weight"], rank, size), dtype, msg=f"{tag} dW1")
        assert_close(mlp.fc2.weight.grad, _chunk(dP["fc2.weight"], 1, rank, size), dtype, msg=f"{tag} dW2")
        if bias:
            assert_close(mlp.fc1.bias.grad, fc1(dP["fc1.bias"], rank, size), dtype, msg=f"{tag} db1")
            assert_close(mlp.fc2.bias.grad, dP["fc2.bias"], dtype, msg=f"{tag} db2")
    return True


def test_modules_vs_reference_world2(world2):
    assert all(world2.run(modules_vs_reference, seed=2))


# ----------------------------------------------------------------------------------------------
# against PyTorch's DTensor tensor-parallel plan on the same weights
# ----------------------------------------------------------------------------------------------
def _vs_dtensor(rank, size, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (size,))
    g = rank_rng(seed)
    B, S, H, F = 2, 2 * size, 9, 3 * size
    for sp in (False, True):
        torch.manual_seed(seed)
        ref = _RefMLP(H, F, "gelu", bias=True)
        torch.manual_seed(seed)
        ours = ParallelMLP(H, F, activation="gelu", sequence_parallel=sp, bias=True)
        plan = ({"fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))}
                if sp else {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        theirs = parallelize_module(ref, mesh, plan)
        X = torch.randn(B, S, H, generator=g)
        G = torch.randn(B, S, H, generator=g)
        x_in = _chunk(X, 1, rank, size) if sp else X
        g_out = _chunk(G, 1, rank, size) if sp else G
        xa = x_in.clone().requires_grad_(True)
        xb = x_in.clone().requires_grad_(True)
        ya, yb = ours(xa), theirs(xb)
        ya.backward(g_out)
        yb.backward(g_out)
        tag = f"vs DTensor sp={sp}"
        assert_close(ya, yb, torch.float32, msg=tag)
        assert_close(xa.grad, xb.grad, torch.float32, msg=f"{tag} dx")
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            mine = ours.get_parameter(name)
            full = theirs.get_parameter(name).grad.full_tensor()
            if name == "fc2.weight":
                want = _chunk(full, 1, rank, size)
            elif name == "fc2.bias":
                want = full
            else:
                want = _chunk(full, 0, rank, size)
            torch.testing.assert_close(mine, _expected_param(theirs.get_parameter(name), name, rank, size),
                                       rtol=0, atol=0)
            assert_close(mine.grad, want, torch.float32, msg=f"{tag} grad {name}")
    return True


def _expected_param(p, name, rank, size):
    full = p.full_tensor().detach()
    if name == "fc2.weight":
        return _chunk(full, 1, rank, size)
    if name == "fc2.bias":
        return full
    return _chunk(full, 0, rank, size)


def test_modules_match_dtensor_tp_plan(world2):
    assert all(world2.run(_vs_dtensor, seed=9))


def test_modules_without_process_group():
    """No process group: tp=1, the plain fused GEMMs, same numbers as the nn.Linear reference."""
    torch.manual_seed(0)
    ref = _RefMLP(6, 5, "swiglu", bias=False).to(DEVICE)
    torch.manual_seed(0)
    mlp = ParallelMLP(6, 5, device=DEVICE)
    x = torch.randn(2, 3, 6, device=DEVICE, requires_grad=True)
    G = torch.randn(2, 3, 6, device=DEVICE)
    y_ref, dX, dP = _grads64(ref, x, G)
    y = mlp(x)
    y.backward(G)
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, dX, torch.float32)
    assert_close(mlp.fc1.weight.grad, dP["fc1.weight"], torch.float32)
    assert_close(mlp.fc2.weight.grad, dP["fc2.weight"], torch.float32)


# ----------------------------------------------------------------------------------------------
# RMSNorm over features split across the ranks (OLMo 2's q / k norm under tp)
# ----------------------------------------------------------------------------------------------
def _sharded_norm_case(rank, size, x, w, dy, dtype, offset):
    from fusedpar.nn import RMSNorm

    H = x.shape[-1]
    n = H // size
    norm = RMSNorm(H, 1e-5, offset=offset, feature_group=dist.group.WORLD, dtype=dtype)
    assert norm.placements()["weight"].role == "tp" and norm.weight.shape == (n,)
    with torch.no_grad():
        norm.weight.copy_(w[rank * n:(rank + 1) * n])
    xl = x[..., rank * n:(rank + 1) * n].to(dtype).requires_grad_(True)
    y = norm(xl)
    y.backward(dy[..., rank * n:(rank + 1) * n].to(dtype))
    with pytest.raises(ValueError, match="takes no residual"):
        norm(xl, residual=xl)
    return y.detach(), xl.grad, norm.weight.grad


@pytest.mark.parametrize("dtype,offset", [(torch.float32, 0.0), (torch.bfloat16, 1.0)])
def test_rms_norm_over_features_split_across_ranks(world2, dtype, offset):
    """Every rank holds half of each row's 2 x 10 features (odd rows, 3 x 7 tokens): the output,
    the input gradient and this rank's slice of the weight gradient equal the fp64 norm of the
    whole rows (the statistics are reduced over the ranks). bf16 inputs: the kernels' fp32 math
    rounded once to bf16 (tests/_utils.py tolerances)."""
    g = torch.Generator().manual_seed(31)
    x, dy = torch.randn(3, 7, 20, generator=g), torch.randn(3, 7, 20, generator=g)
    w = torch.randn(20, generator=g)
    x, dy, w = (t.to(dtype).float() for t in (x, dy, w))  # values the dtype holds exactly
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * (w64 + offset)
    y64.backward(dy.double())
    for rank, (y, dx, dw) in enumerate(world2.run(_sharded_norm_case, x, w, dy, dtype, offset)):
        cols = slice(rank * 10, (rank + 1) * 10)
        assert_close(y, y64.detach()[..., cols], dtype, msg=f"rank {rank} output")
        assert_close(dx, x64.grad[..., cols], dtype, msg=f"rank {rank} input grad")
        assert_close(dw, w64.grad[cols], dtype, msg=f"rank {rank} weight grad")


# ----------------------------------------------------------------------------------------------
# fp8: the layers' option, enable_fp8, the model switch (the ops are tested in test_tensor_parallel_ops.py)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_mlp_is_fp8_linear_at_one_rank(recipe):
    """``ParallelMLP(fp8=...)`` without a process group is ``fc2(act(fc1(x)))`` with fp8_linear
    for both layers: output and every gradient (the ops' own equality at one rank is bit for bit,
    test_tensor_parallel_ops.py; the activation's formula differs from the reference's by rounding)."""
    from fusedpar.kernels.runtime import activation_reference
    from fusedpar.ops import fp8_linear

    torch.manual_seed(0)
    mlp = ParallelMLP(40, 24, activation="swiglu", bias=True, fp8=recipe, fp8_grad_high_precision=True)
    x = torch.randn(2, 3, 40, device=DEVICE, requires_grad=True)
    G = torch.randn(2, 3, 40, device=DEVICE)
    params = [p.detach().clone().requires_grad_(True) for p in mlp.parameters()]
    xr = x.detach().clone().requires_grad_(True)
    h = activation_reference(fp8_linear(xr, params[0], params[1], recipe=recipe, grad_high_precision=True), "swiglu")
    y_ref = fp8_linear(h, params[2], params[3], recipe=recipe, grad_high_precision=True)
    y_ref.backward(G)
    y = mlp(x)
    y.backward(G)
    assert_close(y, y_ref, torch.float32, msg="y")
    assert_close(x.grad, xr.grad, torch.float32, msg="dx")
    for p, r in zip(mlp.parameters(), params):
        assert_close(p.grad, r.grad, torch.float32, msg="parameter gradient")
    assert f"fp8={recipe!r}, fp8_grad_high_precision=True" in repr(mlp.fc1) and "fp8=" in repr(mlp.fc2)


def test_fp8_is_a_compute_format_only():
    """``TransformerConfig(fp8=...)``: the blocks' tensor-parallel projections run fp8 (the head
    does not), while the parameters, their placements, ``state_dict`` (extra state included) and
    the gradient sync plan are those of the high-precision model; enable_fp8 switches a module
    tree on and off; bad values are refused by name."""
    from fusedpar.nn import Transformer, TransformerConfig
    from fusedpar.nn.linear import enable_fp8

    kw = dict(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=16, num_experts=2, top_k=1,
              moe_every=2, shared_expert_ffn_hidden_size=8)
    plain, fp8 = (Transformer(TransformerConfig(**kw, fp8=r), seed=3) for r in (None, "blockwise"))
    linears = {n: m.fp8 for n, m in fp8.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    assert linears == {"layers.0.attn.qkv": "blockwise", "layers.0.attn.proj": "blockwise",
                       "layers.0.mlp.fc1": "blockwise", "layers.0.mlp.fc2": "blockwise",
                       "layers.1.attn.qkv": "blockwise", "layers.1.attn.proj": "blockwise",
                       "layers.1.shared_expert.fc1": "blockwise", "layers.1.shared_expert.fc2": "blockwise",
                       "head": None}
    a, b = plain.state_dict(), fp8.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain.placements() == fp8.placements() and plain.gradient_sync_plan() == fp8.gradient_sync_plan()
    assert fp8.layers["1"].mlp.fp8 == "blockwise" and plain.layers["1"].mlp.fp8 is None  # the MoE experts
    enable_fp8(plain, "rowwise", grad_high_precision=True)
    assert plain.layers["0"].mlp.fc2.fp8 == "rowwise" and plain.layers["0"].mlp.fc2.fp8_grad_high_precision
    assert plain.layers["1"].mlp.fp8 == "rowwise" and plain.layers["1"].mlp.fp8_grad_high_precision
    enable_fp8(plain, None)
    assert all(m.fp8 is None for m in plain.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    assert plain.layers["1"].mlp.fp8 is None
    with pytest.raises(ValueError, match=r"TransformerConfig.fp8 must be one of \(None, 'rowwise', 'blockwise'\), "
                                         r"got 'tensorwise'"):
        TransformerConfig(**kw, fp8="tensorwise")
    with pytest.raises(TypeError, match="TransformerConfig.fp8_grad_high_precision must be a bool, got int"):
        TransformerConfig(**kw, fp8_grad_high_precision=1)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: fp8 must be one of \(None, 'rowwise', 'blockwise'\), "
                                         r"got 'e5m2'"):
        ColumnParallelLinear(8, 8, fp8="e5m2")
    with pytest.raises(ValueError, match=r"enable_fp8: recipe must be one of"):
        enable_fp8(plain, "row")


def test_fp8_on_a_gpu_without_fp8_tensor_cores_names_device_and_option(monkeypatch):
    """A layer with fp8 on meets a tensor on a GPU of compute capability 8.0 (simulated: the
    capability and the name are what the check reads): ``FP8UnsupportedError`` naming the device,
    its capability, the recipe and the option (the model's switch and the layers' argument)."""
    from types import SimpleNamespace

    import fusedpar.kernels.fp8 as fp8_kernels
    from fusedpar.kernels.fp8 import FP8UnsupportedError
    from fusedpar.nn import Transformer, TransformerConfig

    monkeypatch.setattr(fp8_kernels, "device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    model = Transformer(TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                                          ffn_hidden_size=16, fp8="rowwise"))
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(FP8UnsupportedError) as e:
        model.layers["0"].mlp.fc1.check_fp8_device(on_gpu)
    for words in ("NVIDIA A100-SXM4-80GB has compute capability 8.0", ">= 8.9",
                  "leave fp8='rowwise' (TransformerConfig.fp8 or the fp8= of the fusedpar.nn linear layers) off"):
        assert words in str(e.value), str(e.value)
    model.head.check_fp8_device(on_gpu)  # the head stays in high precision: nothing to refuse


def test_fp8_with_kv_heads_replicated_over_tp_is_refused(world2):
    assert world2.run(_fp8_replicated_kv_heads) == [True, True]


def _fp8_replicated_kv_heads(rank, size):
    from fusedpar.nn import TransformerBlock, TransformerConfig

    config = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=16,
                               num_kv_heads=1, fp8="rowwise")
    solo = [dist.new_group([r]) for r in range(size)][rank]  # sequence parallelism off: tp over the world
    with pytest.raises(ValueError, match=r"fp8='rowwise' \(TransformerConfig.fp8\) needs num_kv_heads divisible "
                                         r"by the tensor-parallel size .* got 1 kv heads at tp 2"):
        TransformerBlock(config.block_config(0), sp_group=solo)
    return True


def _fp8_fsdp2(rank, size, config, tokens, targets, ref_loss, ref_grads):
    from _compose import compare_grads, data_mean, fsdp2_step, local_batch
    from fusedpar.nn import Transformer
    from fusedpar.parallel import build_parallel_state

    state = build_parallel_state(dp=size)
    ids, tgt = local_batch(tokens, targets, state)
    model = Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group)
    loss, grads = fsdp2_step(model, state, ids, tgt)
    assert_close(data_mean(loss, state), ref_loss.reshape(1), torch.float32, msg="FSDP2 fp8 loss")
    return compare_grads(model, ref_grads, "FSDP2 fp8", grads=grads)


def test_fp8_model_under_fsdp2_matches_one_process(world2):
    """fp8 is a compute format: FSDP2 (``fully_shard`` over dp2, each block and the root) over a
    model with ``fp8="rowwise"`` matches the one-process fp8 model on the whole batch, loss and
    every gradient (with the high-precision weight gradient every quantisation group is one token,
    the same whatever the data split; the rest is the order of fp32 sums)."""
    from _compose import batch, reference, tiny_config

    config = tiny_config(num_layers=1, fp8="rowwise", fp8_grad_high_precision=True)
    tokens, targets = batch(5, 4, 8, config.vocab_size)
    out = world2.run(_fp8_fsdp2, config, tokens, targets, *reference(config, tokens, targets))
    assert out[0] == out[1] > 5, out
