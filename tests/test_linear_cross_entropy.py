"""Fused linear + vocabulary-parallel cross entropy (:func:`fusedpar.ops.linear_cross_entropy`)
against a float64 torch reference (``F.linear`` + ``F.cross_entropy``, z-loss and soft cap written
out): loss and both gradients with ragged chunks and shapes (vocabulary and tokens not multiples of
the GEMM tiles or the chunk), every option, ``ignore_index`` including all ignored; no
tokens x vocabulary tensor in forward or backward; the fp32 weight-gradient accumulator over many
chunks; one gloo world of 4 for tp2 (two subgroups), tp4, with and without sequence parallelism,
the mean over the sequence-parallel ranks (``data_group``), and ``Transformer.loss`` (fused and
not) at sp2 x tp2 with unevenly ignored tokens against one process.

Tolerances: fp32 against fp64, the :mod:`_utils` defaults (1e-5 of the tensor's RMS); the chunked
sums differ from the one-shot reference only by fp32 rounding.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _utils import DEVICE, INTERPRETED, assert_close
from _world import world_fixture
from fusedpar.ops import linear_cross_entropy, vocab_parallel_cross_entropy
from fusedpar.ops.linear_cross_entropy_library import default_chunk_tokens

world4 = world_fixture(4)

OPTIONS = [
    dict(),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-2),
    dict(softcap=2.0),
    dict(label_smoothing=0.2, z_loss=0.1, softcap=1.5, reduction="sum"),
    dict(reduction="none", softcap=3.0),
]


def reference(h, w, t, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """float64 torch: F.linear + F.cross_entropy; soft cap and z-loss written out."""
    z = F.linear(h.double(), w.double())
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z2, tt = z.reshape(-1, z.shape[-1]), t.reshape(-1)
    loss = F.cross_entropy(z2, tt, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = tt != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.where(valid, torch.logsumexp(z2, -1) ** 2, 0)
    if reduction == "none":
        return loss.view(t.shape)
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()


def _inputs(seed, T=13, H=7, V=11, ignored=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(DEVICE).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g)
    t[list(ignored)] = -100
    return h, w, t.to(DEVICE)


def _check(h, w, t, gen_seed=1, msg="", **opts):
    out = linear_cross_entropy(h, w, t, **opts)
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    opts.pop("chunk_tokens", None)
    ref = reference(hr, wr, t, **opts)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(gen_seed), dtype=torch.float64)
    out.backward(grad.to(out.dtype).to(out.device))
    ref.backward(grad.to(ref.device))  # the reference runs on the inputs' device
    assert_close(out, ref, torch.float32, msg=f"{msg} loss")
    assert_close(h.grad, hr.grad, torch.float32, msg=f"{msg} d_hidden")
    assert_close(w.grad, wr.grad, torch.float32, msg=f"{msg} d_weight")


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_float64_reference(opts):
    h, w, t = _inputs(0)
    _check(h, w, t, chunk_tokens=4, msg=str(opts), **opts)  # 13 tokens: chunks of 4, 4, 4, 1


def test_one_chunk_leading_dims_and_torch_mean():
    h, w, t = _inputs(2, T=12)
    h3 = h.detach().view(3, 4, 7).requires_grad_()
    _check(h3, w, t.view(3, 4), chunk_tokens=64, msg="3-D, one chunk", label_smoothing=0.3)
    plain = F.cross_entropy(F.linear(h, w).double(), t, label_smoothing=0.3)  # torch's own mean
    assert_close(linear_cross_entropy(h, w, t, label_smoothing=0.3, chunk_tokens=5), plain, torch.float32)


def test_every_token_ignored_behaves_as_torch():
    h, w, t = _inputs(3, ignored=range(13))
    mean = linear_cross_entropy(h, w, t, chunk_tokens=4)
    assert torch.isnan(mean) and torch.isnan(F.cross_entropy(F.linear(h, w), t))
    total = linear_cross_entropy(h, w, t, reduction="sum", chunk_tokens=4)
    assert total.item() == 0.0
    total.backward()
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_bad_arguments_raise():
    h, w, t = _inputs(4)
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(h, w, t[:5])
    with pytest.raises(ValueError, match="weight must have shape"):
        linear_cross_entropy(h, w[:, :3], t)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        linear_cross_entropy(h, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be"):
        linear_cross_entropy(h, w, t, softcap=0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        linear_cross_entropy(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"target must hold ids in \[0, 11\)"):
        linear_cross_entropy(h, w, torch.full_like(t, 11))
    with pytest.raises(ValueError, match="reduction must be"):
        linear_cross_entropy(h, w, t, reduction="avg")


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor an op returns, inside the fusedpar custom ops too
    (a mode is off while it handles an op: a fresh one sharing the record runs the op's body).
    In-place ops (``copy_``, ``set_``: their output is their input; under Triton's interpreter the
    kernel launches stage their arguments' storages through them) allocate nothing and are skipped."""

    def __init__(self, numels=None):
        super().__init__()
        self.numels = [] if numels is None else numels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedpar":
            with _Sizes(self.numels):  # the op's CPU kernel (its body) with this mode on
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and not func._schema.is_mutable:
                self.numels.append((o.numel(), str(func)))
        return out


def test_no_tokens_by_vocabulary_tensor_is_allocated():
    T, V, C, H_ = 64, 40, 8, 6
    h, w, t = _inputs(5, T=T, H=H_, V=V, ignored=(1,))
    if not INTERPRETED:
        # compiled: a first call tunes the GEMMs of these shapes, and Triton's benchmark allocates
        # its own L2-flush buffer (int32 [2^26], 256 MiB) and copies of the accumulated output
        # (restore_value); that is the autotuner's, once per shape, not the op's: record a tuned call
        linear_cross_entropy(h, w, t, chunk_tokens=C, label_smoothing=0.1, z_loss=1e-3, softcap=5.0).backward()
        h.grad = w.grad = None
    with _Sizes() as fused:
        linear_cross_entropy(h, w, t, chunk_tokens=C, label_smoothing=0.1, z_loss=1e-3, softcap=5.0).backward()
    names = {name for _, name in fused.numels}
    assert "aten.mm.default" not in names and "fusedpar.linear_cross_entropy_backward.default" in names, names
    assert {"aten.empty.memory_format", "aten.gather.default"} <= names, names  # the op bodies are recorded
    big = [(n, name) for n, name in fused.numels if n > max(C * V, T * H_, V * H_)]
    assert not big, f"tensors larger than one chunk of logits ({C} x {V}), d_hidden or d_weight: {big}"
    with _Sizes() as plain:  # the materialised path, which the recorder must catch
        vocab_parallel_cross_entropy(F.linear(h, w), t).backward()
    assert max(plain.numels)[0] >= T * V


def test_default_chunk_is_a_whole_number_of_tiles():
    # 256 MiB of fp32 logits hold 523 tokens of a 128k vocabulary: K = 523 for the weight-gradient
    # GEMM left it only 32-deep tiles with masked, unpipelined loads on the GPU; 512 is whole tiles
    assert default_chunk_tokens(8192, 128256) == 512 and default_chunk_tokens(8192, 128256 // 8) == 4096
    assert default_chunk_tokens(300, 128256) == 300  # fewer tokens than a chunk: one chunk of them
    assert default_chunk_tokens(8192, 2 ** 30) == 1 and default_chunk_tokens(0, 100) == 1
    assert default_chunk_tokens(10 ** 6, 300_000) == 128  # 223 tokens fit: rounded down to 128


def test_weight_gradient_accumulates_in_fp32_over_many_chunks():
    """64 chunks of 4 tokens: the fp32 accumulator stays within fp32 tolerance of fp64, where
    summing the same per-chunk contributions in a bf16 accumulator would not (here it is off by
    2.9e-2 of the gradient's RMS, thousands of times the 1e-5 tolerance)."""
    T, H, V, C = 256, 8, 12, 4
    g = torch.Generator().manual_seed(6)
    h = torch.randn(T, H, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g)
    linear_cross_entropy(h, w, t.to(DEVICE), reduction="sum", chunk_tokens=C).backward()
    h64, w64 = h.detach().cpu().double(), w.detach().cpu().double()  # the fp64 reference on the host
    dz = torch.softmax(h64 @ w64.T, -1) - F.one_hot(t, V).double()  # d(sum loss)/dlogits
    ref = dz.T @ h64
    assert_close(w.grad, ref, torch.float32, msg="fp32-accumulated d_weight")
    acc = torch.zeros(V, H, dtype=torch.bfloat16)
    for lo in range(0, T, C):  # what a bf16 accumulator of the same chunks would hold
        acc = (acc.double() + dz[lo:lo + C].T @ h64[lo:lo + C]).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_close(acc.float(), ref, torch.float32, msg="bf16-accumulated d_weight")


@pytest.mark.gpu
def test_bf16_on_gpu():
    h, w, t = _inputs(7, T=300, H=64, V=1000, ignored=(0, 9))
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    out = linear_cross_entropy(hb, wb, t, chunk_tokens=64, z_loss=1e-4)
    out.backward()
    hr, wr = hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    ref = reference(hr, wr, t, z_loss=1e-4)
    ref.backward()
    assert out.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16, msg="bf16 loss")
    assert_close(hb.grad, hr.grad, torch.bfloat16, msg="bf16 d_hidden")
    assert_close(wb.grad, wr.grad, torch.bfloat16, msg="bf16 d_weight")


# ----------------------------------------------------------------------------------------------
# one gloo world of 4: tp2 (subgroups {0,1}, {2,3}) and tp4, sequence parallel or not
# ----------------------------------------------------------------------------------------------
B, S, H, V = 2, 12, 5, 24  # 24 tokens, chunks of 5; vocab shards of 12 / 8 / 6 rows
_GROUPS = {}


def _groups():
    import torch.distributed as dist

    if not _GROUPS:  # every rank creates every group, in the same order
        _GROUPS["tp2"] = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _GROUPS["sp2"] = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _GROUPS["tp3"] = [dist.new_group([0, 1, 2]), dist.new_group([3])]
    r = dist.get_rank()
    return _GROUPS["tp2"][r // 2], _GROUPS["sp2"][r % 2]



def _world_inputs():
    g = torch.Generator().manual_seed(8)
    h = torch.randn(B, S, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    t = torch.randint(0, V, (B, S), generator=g)
    t[0, :5] = -100  # uneven: the first sequence-parallel half of row 0 is mostly ignored
    t[1, 7] = -100
    return h, w, t


def _tp_case(rank, size, opts, ref):
    tp2, _ = _groups()
    tp3 = _GROUPS["tp3"][0 if rank < 3 else 1]  # ranks 0-2 a tp group of 3, rank 3 alone (tp 1)
    h, w, t = _world_inputs()
    done = 0
    layouts = (("tp2", tp2, 2, rank % 2), ("tp3" if rank < 3 else "tp1", tp3, 3 if rank < 3 else 1, rank % 3),
               ("tp4", None, 4, rank))
    for name, group, P, r in layouts:
        n, v = S // P, V // P
        for sp in (False, True):
            hl = (h[:, r * n:(r + 1) * n] if sp else h).clone().requires_grad_()
            wl = w[r * v:(r + 1) * v].clone().requires_grad_()
            out = linear_cross_entropy(hl, wl, t, group=group, sequence_parallel=sp, chunk_tokens=5, **opts)
            loss, dh, dw = ref
            out.backward(torch.ones_like(out) if out.dim() else None)
            msg = f"{name} sp={sp} {opts}"
            assert_close(out, loss, torch.float32, msg=f"{msg} loss")
            assert_close(hl.grad, dh[:, r * n:(r + 1) * n] if sp else dh, torch.float32, msg=f"{msg} d_hidden")
            assert_close(wl.grad, dw[r * v:(r + 1) * v], torch.float32, msg=f"{msg} d_weight")
            done += 1
    return done


@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss=1e-2, softcap=2.0, reduction="none")],
                         ids=["mean", "options-none"])
def test_tensor_parallel_matches_one_process(world4, opts):
    h, w, t = _world_inputs()
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    loss = reference(hr, wr, t, **opts)
    loss.backward(torch.ones_like(loss) if loss.dim() else None)
    assert world4.run(_tp_case, opts, (loss.detach(), hr.grad, wr.grad)) == [6] * 4


def _sp_mean_case(rank, size, ref):
    """tp2 x sp2: each sp rank holds half of every sequence (contiguous), unevenly ignored; with
    ``data_group`` the mean covers both halves and the sp-averaged gradients are the full ones."""
    import torch.distributed as dist

    tp2, sp2 = _groups()
    h, w, t = _world_inputs()
    s, r = rank // 2, rank % 2  # sp rank, tp rank
    hs, ts = h[:, s * S // 2:(s + 1) * S // 2], t[:, s * S // 2:(s + 1) * S // 2]
    n, v = S // 4, V // 2
    hl = hs[:, r * n:(r + 1) * n].clone().requires_grad_()
    wl = w[r * v:(r + 1) * v].clone().requires_grad_()
    out = linear_cross_entropy(hl, wl, ts, group=tp2, sequence_parallel=True, chunk_tokens=4, data_group=sp2)
    out.backward()
    dw = wl.grad.clone()
    dist.all_reduce(dw, group=sp2)  # what sync_gradients does: the mean over the data ranks
    loss, dh, dw_ref = ref
    assert_close(out, loss, torch.float32, msg="mean over the sp ranks")
    assert_close(hl.grad / 2, dh[:, s * S // 2:(s + 1) * S // 2][:, r * n:(r + 1) * n], torch.float32, msg="d_hidden")
    assert_close(dw / 2, dw_ref[r * v:(r + 1) * v], torch.float32, msg="d_weight")
    # without the data group each sp rank reports its own mean: not the whole sequence's
    own = linear_cross_entropy(hl.detach(), wl.detach(), ts, group=tp2, sequence_parallel=True)
    return abs(own.item() - loss.item())


def test_mean_over_sequence_parallel_ranks_with_uneven_ignored_tokens(world4):
    h, w, t = _world_inputs()
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    loss = reference(hr, wr, t)
    loss.backward()
    off = world4.run(_sp_mean_case, (loss.detach(), hr.grad, wr.grad))
    assert min(off) > 1e-2, off  # the per-rank means really differ from the global one here


def _transformer_case(rank, size, ref_loss, ref_grads):
    from _compose import compare_grads, local_batch, tiny_config

    from fusedpar.nn import Transformer
    from fusedpar.parallel import build_parallel_state, sync_gradients

    state = build_parallel_state(sp=2, tp=2)
    tokens, targets = ref_batch()
    ids, tgt = local_batch(tokens, targets, state)
    out = {}
    for fused in (False, True):
        model = Transformer(tiny_config(num_layers=1, tie_word_embeddings=fused), tp_group=state.tp_group,
                            sp_group=state.sp_group, ep_group=state.ep_group)
        loss = model.loss(model(ids, return_hidden=fused), tgt)
        loss.backward()
        sync_gradients(model.named_parameters(), state, model.gradient_sync_plan())
        assert_close(loss, ref_loss[fused], torch.float32, msg=f"fused={fused} loss (sp2 x tp2, uneven -100)")
        out[fused] = compare_grads(model, ref_grads[fused], f"fused={fused}")
    return out


def ref_batch():
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 32, (2, 8), generator=g)
    targets = torch.randint(0, 32, (2, 8), generator=g)
    targets[0, :5] = -100  # zigzag over sp2: rank 0 holds positions 0,1,6,7, rank 1 2..5
    return tokens, targets


def test_transformer_loss_is_the_whole_sequence_mean_at_sp2(world4):
    """``Transformer.loss`` (logits, and fused from hidden states with tied embeddings) at sp2 x tp2
    with unevenly ignored tokens: loss on every rank and gradients after ``sync_gradients`` equal
    the one-process model's."""
    from _compose import tiny_config

    from fusedpar.nn import Transformer

    ref_loss, ref_grads = {}, {}
    tokens, targets = ref_batch()
    for fused in (False, True):
        model = Transformer(tiny_config(num_layers=1, tie_word_embeddings=fused))
        ref_loss[fused] = model.loss(model(tokens, return_hidden=fused), targets)
        ref_loss[fused].backward()
        ref_loss[fused] = ref_loss[fused].detach()
        ref_grads[fused] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    unfused = Transformer(tiny_config(num_layers=1))
    plain = F.cross_entropy(unfused(tokens).reshape(-1, 32), targets.reshape(-1))  # HF's / torch's mean
    assert_close(ref_loss[False], plain.detach(), torch.float32)
    out = world4.run(_transformer_case, ref_loss, ref_grads)
    assert all(set(o) == {False, True} and min(o.values()) > 5 for o in out), out
