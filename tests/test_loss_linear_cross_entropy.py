"""Fused linear + vocabulary-parallel cross entropy (:func:`fusedpar.ops.linear_cross_entropy`)
against a float64 torch reference (``F.linear`` + ``F.cross_entropy``, z-loss and soft cap written
out): loss and both gradients with ragged vocabulary blocks and shapes (vocabulary and tokens not
multiples of the GEMM tiles or the block), every option, ``ignore_index`` including all ignored; no
tokens x vocabulary tensor in forward or backward, fp32 and fp16; d_weight accumulated in fp32
over all tokens; the epilogue kernels of :mod:`fusedpar.kernels.linear_ce` (per-tile statistics,
the logits' gradient of a vocabulary block) against their float64 oracles, and the oracle against
autograd; one gloo world of 4 for tp2 (two subgroups), tp4, with and without sequence parallelism,
the mean over the sequence-parallel ranks (``data_group``), and ``Transformer.loss`` (fused and
not) at sp2 x tp2 with unevenly ignored tokens against one process.

Tolerances: fp32 against fp64, the :mod:`_utils` defaults (1e-5 of the tensor's RMS): the blocked
sums differ from the one-shot reference only by fp32 rounding; fp16 where a value passes through
an fp16 rounding (each test names why).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _utils import DEVICE, DTYPES, INTERPRETED, assert_close, poison, randn
from _world import world_fixture
from fusedpar.kernels import (linear_ce_dlogits, linear_ce_dlogits_reference, linear_ce_stats,
                              linear_ce_stats_reference)
from fusedpar.kernels.linear_ce import stats_block_n
from fusedpar.ops import linear_cross_entropy, vocab_parallel_cross_entropy
from fusedpar.ops.loss.bodies import VOCAB_ALIGN, default_chunk_tokens, vocab_block

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

    def __init__(self, numels=None, tensors=None):
        super().__init__()
        self.numels = [] if numels is None else numels
        self.tensors = [] if tensors is None else tensors  # (bytes, shape, dtype, op) of the same tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedpar":
            with _Sizes(self.numels, self.tensors):  # the op's CPU kernel (its body) with this mode on
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and not func._schema.is_mutable:
                self.numels.append((o.numel(), str(func)))
                self.tensors.append((o.numel() * o.element_size(), tuple(o.shape), o.dtype, str(func)))
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
    # the op bodies are recorded: the forward's reduction over the logits tiles, the backward's row terms
    assert {"aten.empty.memory_format", "aten.log.default", "aten.where.self"} <= names, names
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_vocabulary_blocks_bound_the_memory(dtype):
    """The backward in vocabulary blocks at a ragged vocabulary (301: blocks of 28 (fp32) / 51
    (fp16), none a multiple of the tiles, the last one shorter) and 40 tokens, every option on:
    the loss and both gradients against float64, and no allocation as large as the logits: the
    largest are one block's gradient (at most the bytes of ``chunk_tokens`` rows of fp32
    logits), the forward's per-tile statistics, the fp32 d_hidden and d_weight.

    Tolerances: the loss is fp32 arithmetic on inputs the float64 reference takes exactly (fp16
    values are exact in fp64): fp32's. The gradients of an fp16 model pass through the block's
    gradient rounded once to fp16 (2^-11 relative), then fp32-accumulated GEMMs and an fp16 output:
    fp16's (2e-3 of the RMS)."""
    T, V, H_, C = 40, 301, 8, 4
    g = torch.Generator().manual_seed(11)
    h = randn(T, H_, dtype=dtype, generator=g).requires_grad_()
    w = randn(V, H_, dtype=dtype, generator=g, scale=0.5).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g)
    t[[0, 17, 39]] = -100
    t = t.to(DEVICE)
    opts = dict(chunk_tokens=C, label_smoothing=0.1, z_loss=1e-3, softcap=4.0, reduction="sum")
    vb = vocab_block(T, V, C, h.element_size())
    assert vb == (28 if dtype == torch.float32 else 51) and V % vb, vb  # ragged blocks: a real loop
    if not INTERPRETED:  # the autotuner's first call allocates its own buffers (see above)
        linear_cross_entropy(h, w, t, **opts).backward()
        h.grad = w.grad = None
    with _Sizes() as rec:
        out = linear_cross_entropy(h, w, t, **opts)
        out.backward()
    blocks = [shape for _, shape, dt, name in rec.tensors if shape == (T, vb) and dt == dtype]
    assert blocks, "the block gradient [T, Vb] was not allocated in the model's dtype"
    budget = max(4 * C * V, 4 * T * H_, V * H_ * h.element_size(), 3 * 4 * T * -(-V // stats_block_n()))
    assert T * V * h.element_size() > 2 * budget  # the logits themselves would be far over it
    big = [(b, shape, name) for b, shape, _, name in rec.tensors if b > budget]
    assert not big, f"allocations over {budget} B (the logits take {T * V * h.element_size()} B): {big}"
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference(hr, wr, t, **{k: v for k, v in opts.items() if k != "chunk_tokens"})
    ref.backward()
    assert_close(out, ref, torch.float32, msg="loss")
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert_close(h.grad, hr.grad, dtype, msg="d_hidden")
    assert_close(w.grad, wr.grad, dtype, msg="d_weight")


def test_vocab_block_sizes():
    # Llama-3 8B head, 8192 tokens, bf16: the default budget (512 rows of fp32 logits, 256 MiB)
    # holds 16032 columns of bf16 dz; 9 blocks of whole 256-column tiles, as even as they can be
    vb = vocab_block(8192, 128256, default_chunk_tokens(8192, 128256), 2)
    assert vb % VOCAB_ALIGN == 0 and vb * 8192 * 2 <= 256 * 2 ** 20 and -(-128256 // vb) == 9, vb
    assert vocab_block(8192, 128256 // 8, default_chunk_tokens(8192, 128256 // 8), 2) == 128256 // 8  # one block
    assert vocab_block(300, 1000, 300, 4) == 1000  # the whole shard fits: one block
    assert vocab_block(13, 11, 4, 4) == 3 and vocab_block(256, 12, 4, 4) == 1  # tiny budgets: at least 1
    for T, V, C, e in [(8192, 128256, 64, 2), (4096, 50257, 100, 4), (1000, 999, 7, 2)]:
        vb = vocab_block(T, V, C, e)
        assert 1 <= vb <= V and vb * T * e <= max(4 * C * V, T * e), (T, V, C, e, vb)
        assert vb < VOCAB_ALIGN or vb % VOCAB_ALIGN == 0, vb


# ----------------------------------------------------------------------------------------------
# the epilogue kernels (fusedpar.kernels.linear_ce) against float64
# ----------------------------------------------------------------------------------------------
def _kernel_inputs(dtype, M=37, N=101, K=40, seed=12):
    """Ragged against the 32-wide interpreter tiles (and 128-wide statistics tiles): 37 rows, 101
    columns (4 tiles, the last of 5), K = 40 (a masked K step); targets in every tile and -1."""
    g = torch.Generator().manual_seed(seed)
    h = randn(M, K, dtype=dtype, generator=g)
    w = randn(N, K, dtype=dtype, generator=g, scale=0.4)
    idx = torch.randint(-1, N, (M,), generator=g)
    idx[:4] = torch.tensor([0, N - 1, min(32, N // 2), -1])  # the first and last column, a tile edge, none
    return h, w, idx.to(DEVICE), g


@pytest.fixture(params=["auto", "pointer"])
def load_path(request):
    """Both GEMM load paths (kernels/gemm_loads.py): "auto" loads these aligned operands by TMA
    (persistent programs, under the interpreter 3 over the 4-8 tiles: the tile loop wraps)."""
    from fusedpar.kernels import gemm_loads
    gemm_loads.set_load_path(request.param)
    yield request.param
    gemm_loads.set_load_path("auto")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,smoothing", [(0.0, False), (2.5, True)], ids=["plain", "softcap-smoothing"])
def test_stats_epilogue_matches_float64(dtype, softcap, smoothing, load_path):
    """log-sum-exp, target logit and logit sum per row, written into a NaN-poisoned column block
    of a wider buffer. Tolerance: fp32's for every dtype: the statistics are fp32 arithmetic on
    the fp32-accumulated products of inputs that the float64 reference takes exactly."""
    from fusedpar.kernels.gemm_loads import last_launch
    h, w, idx, _ = _kernel_inputs(dtype)
    buf = poison((3, 50), torch.float32)
    out = linear_ce_stats(h, w, idx, softcap=softcap, smoothing=smoothing, out=buf[:, 5:42])
    assert last_launch("linear_ce_stats")["loads"] == ("tma" if load_path == "auto" else "pointer")
    ref = linear_ce_stats_reference(h, w, idx, softcap=softcap, smoothing=smoothing)
    assert out.data_ptr() == buf[:, 5:42].data_ptr()
    for i, what in enumerate(("lse", "target logit", "logit sum")):
        assert_close(out[i], ref[i], torch.float32, scale=ref[0].abs().max().item(), msg=f"{dtype} {what}")
    assert torch.isnan(buf[:, :5]).all() and torch.isnan(buf[:, 42:]).all()  # nothing outside the block
    assert (out[1][idx.cpu() < 0] == 0).all() and (smoothing or (out[2] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["plain", "softcap"])
def test_dlogits_epilogue_matches_float64(dtype, softcap, load_path):
    """The gradient of a vocabulary block (columns 30..70 of 101: targets inside, before and
    after it) written into a NaN-poisoned column block of a wider buffer, with the row terms of
    the loss (z-loss scale, label smoothing shift, zero rows: ignored tokens). Tolerance: the
    output's dtype (one rounding of an fp32 value: fp16 2e-3 of the RMS, fp32 1e-5)."""
    h, w, idx, g = _kernel_inputs(dtype, seed=13)
    M = h.shape[0]
    lse = linear_ce_stats_reference(h, w, idx, softcap=softcap)[0].float()
    scale = torch.rand(M, generator=g).to(DEVICE) * 2
    scale[5] = 0.0  # an ignored token: g = 0
    target_coef, shift = scale * 0.9, scale * (0.1 / 101)
    buf = poison((M, 64), dtype)
    out = linear_ce_dlogits(h, w[30:70], idx, lse, scale, target_coef, shift, softcap=softcap, col_offset=30,
                            out=buf[:, 7:47])
    ref = linear_ce_dlogits_reference(h, w[30:70], idx, lse, scale, target_coef, shift, softcap=softcap, col_offset=30)
    assert_close(out, ref, dtype, msg=f"{dtype} softcap={softcap} {load_path}")
    assert torch.isnan(buf[:, :7]).all() and torch.isnan(buf[:, 47:]).all()
    assert (out[5] == 0).all()


def test_dlogits_reference_is_the_loss_gradient():
    """The oracle itself: its formula with the loss's row terms is autograd's gradient of the
    (soft-capped, smoothed, z-lossed) cross entropy, in float64."""
    h, w, idx, g = _kernel_inputs(torch.float64, M=9, N=13, K=5, seed=14)
    idx = idx.clamp(min=0)
    z = (h @ w.T).requires_grad_()
    cap, eps, zl, V = 2.0, 0.2, 0.05, w.shape[0]
    zc = cap * torch.tanh(z / cap)
    lse = torch.logsumexp(zc, -1)
    loss = (1 - eps) * (lse - zc.gather(1, idx[:, None]).squeeze(1)) + eps * (lse - zc.mean(-1)) + zl * lse ** 2
    gl = torch.rand(9, generator=g, dtype=torch.float64).to(DEVICE)
    loss.backward(gl)
    dz = linear_ce_dlogits_reference(h, w, idx, lse.detach(), gl * (1 + 2 * zl * lse.detach()), (1 - eps) * gl,
                                     gl * eps / V, softcap=cap)
    torch.testing.assert_close(dz, z.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_every_epilogue_config(monkeypatch):
    """Every tile config the prune rule keeps for the two epilogue kernels (bf16; K = 256 keeps the
    64-deep tiles, K = 200 only the 32-deep ones), each forced in turn (``FUSEDPAR_TUNE_CONFIGS=#K``),
    against float64: statistics at fp32's tolerance (inputs exact in fp64), the gradient at bf16's
    (one rounding of the output)."""
    from fusedpar.kernels.runtime import clear_tuning_caches, kept_config_count

    cases = [_kernel_inputs(torch.bfloat16, M=93, N=300, K=k, seed=15) for k in (200, 256)]

    def check():
        for h, w, idx, _ in cases:
            ref = linear_ce_stats_reference(h, w, idx, softcap=2.5, smoothing=True)
            out = linear_ce_stats(h, w, idx, softcap=2.5, smoothing=True)
            for i in range(3):
                assert_close(out[i], ref[i], torch.float32, scale=ref[0].abs().max().item(), msg=f"K={h.shape[1]}")
            lse, ones = ref[0].float(), torch.ones(h.shape[0], device=DEVICE)
            terms = (lse, ones, 0.9 * ones, ones * (0.1 / 300))
            dz = linear_ce_dlogits(h, w[40:250], idx, *terms, softcap=2.5, col_offset=40)
            assert_close(dz, linear_ce_dlogits_reference(h, w[40:250], idx, *terms, softcap=2.5, col_offset=40),
                         torch.bfloat16, msg=f"K={h.shape[1]}")

    kernels = ("_ce_stats_kernel", "_ce_dlogits_kernel")
    try:
        monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", "#0")
        clear_tuning_caches()
        check()
        counts = {k: kept_config_count(k) for k in kernels}
        for k in range(1, max(counts.values())):
            monkeypatch.setenv("FUSEDPAR_TUNE_CONFIGS", f"#{k}")
            clear_tuning_caches()
            check()
    finally:
        clear_tuning_caches()  # no later test may inherit a '#K' choice
    assert min(counts.values()) >= 2, counts


def test_epilogue_kernels_reject_bad_arguments():
    h, w, idx, _ = _kernel_inputs(torch.float32, M=6, N=9, K=4)
    lse = torch.zeros(6, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        linear_ce_stats(h, w[:, :3], idx)
    with pytest.raises(ValueError, match=r"target_idx must have shape \(6,\)"):
        linear_ce_stats(h, w, idx[:5])
    with pytest.raises(TypeError, match="target_idx must have dtype"):
        linear_ce_stats(h, w, idx.float())
    with pytest.raises(ValueError, match="softcap must be a number >= 0"):
        linear_ce_stats(h, w, idx, softcap=-1.0)
    with pytest.raises(ValueError, match=r"out must have shape \(3, 6\)"):
        linear_ce_stats(h, w, idx, out=torch.empty(3, 5, device=DEVICE))
    with pytest.raises(TypeError, match="lse must have dtype torch.float32"):
        linear_ce_dlogits(h, w, idx, lse.double(), lse, lse, lse)
    with pytest.raises(ValueError, match=r"shift must have shape \(6,\)"):
        linear_ce_dlogits(h, w, idx, lse, lse, lse, lse[:4])
    with pytest.raises(ValueError, match="scale must be unit-stride"):
        linear_ce_dlogits(h, w, idx, lse, torch.zeros(12, device=DEVICE)[::2], lse, lse)
    with pytest.raises(ValueError, match="col_offset must be an int >= 0"):
        linear_ce_dlogits(h, w, idx, lse, lse, lse, lse, col_offset=-1)
    with pytest.raises(ValueError, match=r"out must have shape \(6, 9\)"):
        linear_ce_dlogits(h, w, idx, lse, lse, lse, lse, out=torch.empty(6, 8, device=DEVICE))


def test_weight_gradient_accumulates_in_fp32_over_many_chunks():
    """256 tokens, chunk_tokens 4 (the backward in 12 vocabulary blocks of one row): d_weight,
    accumulated in fp32 over all the tokens inside each block's GEMM, stays within fp32 tolerance
    of fp64, where summing per-4-token contributions in a bf16 accumulator would not (here it is
    off by 2.9e-2 of the gradient's RMS, thousands of times the 1e-5 tolerance)."""
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
