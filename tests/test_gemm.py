"""fusedpar.kernels.matmul / matmul_tn against an fp64 reference (interpreter on CPU, compiled on GPU)."""
import pytest
import torch

from _utils import DEVICE, DTYPES, assert_close, poison, randn
from fusedpar.kernels import ACTIVATIONS, matmul, matmul_reference, matmul_tn
from fusedpar.kernels.runtime import prune_tile_configs
from fusedpar.kernels.gemm import gpu_configs

SHAPES = [(1, 1, 1), (7, 33, 19), (33, 7, 65), (127, 1, 40), (257, 129, 31), (64, 64, 64), (2, 257, 16)]


def _weight(n, k, layout, dtype, g):
    w = randn(n, k, dtype=dtype, generator=g)
    return w if layout == "nk" else w.t().contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matmul_shapes(M, N, K, layout, dtype):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    a = randn(M, K, dtype=dtype, generator=g)
    w = _weight(N, K, layout, dtype, g)
    out = poison((M, N), dtype)
    matmul(a, w, weight_layout=layout, out=out)
    assert_close(out, matmul_reference(a, w, weight_layout=layout), dtype, msg=f"{M}x{N}x{K} {layout}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_epilogue_bias_activation_residual(activation, dtype):
    g = torch.Generator().manual_seed(7)
    M, F, K = 45, 37, 50
    gated = ACTIVATIONS[activation][1]
    n_w = 2 * F if gated else F
    a = randn(M, K, dtype=dtype, generator=g)
    w = randn(n_w, K, dtype=dtype, generator=g, scale=K ** -0.5)
    bias = randn(n_w, dtype=dtype, generator=g)
    res = randn(M, F, dtype=dtype, generator=g)
    pre = poison((M, n_w), dtype)
    out = matmul(a, w, bias, activation=activation, residual=res, preact_out=pre)
    assert out.shape == (M, F)
    assert_close(out, matmul_reference(a, w, bias, activation=activation, residual=res), dtype, msg=activation)
    assert_close(pre, matmul_reference(a, w, bias), dtype, msg=f"{activation} pre-activation")


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_into_fp32(dtype):
    """C += A @ B with fp32 accumulation of the existing values (reduce-scatter epilogue, grad accumulation)."""
    g = torch.Generator().manual_seed(3)
    a = randn(29, 41, dtype=dtype, generator=g)
    w = randn(23, 41, dtype=dtype, generator=g)
    bias = randn(23, dtype=torch.float32, generator=g)
    c = randn(29, 23, dtype=torch.float32, generator=g)
    expected = c.double() + matmul_reference(a, w, bias)
    matmul(a, w, bias, out=c, accumulate=True)
    assert_close(c, expected, dtype)


def test_strided_sequence_chunk_in_place():
    """A reads a [batch, seq-chunk, K] view and C writes a [batch, seq-chunk, N] view, in place."""
    g = torch.Generator().manual_seed(11)
    B, S, K, N, lo, hi = 3, 13, 21, 17, 4, 9
    x = randn(B, S, K, generator=g)
    w = randn(N, K, generator=g)
    y = poison((B, S, N), torch.float32)
    matmul(x[:, lo:hi], w, out=y[:, lo:hi])
    assert_close(y[:, lo:hi], matmul_reference(x[:, lo:hi], w), torch.float32)
    untouched = torch.cat([y[:, :lo], y[:, hi:]], dim=1)
    assert torch.isnan(untouched).all(), "matmul wrote outside its output view"


def test_strided_operands_transposed_and_sliced():
    g = torch.Generator().manual_seed(5)
    a = randn(40, 31, generator=g).t()  # [31, 40] column-major view
    w = randn(50, 70, generator=g)[::2, 5:45]  # [25, 40] with row stride 140
    out_big = poison((31, 60), torch.float32)
    out = out_big[:, 3:53:2]  # [31, 25] with column stride 2
    matmul(a, w, out=out)
    assert_close(out, matmul_reference(a, w), torch.float32)
    assert torch.isnan(out_big[:, 0:3]).all()


def test_3d_output_accumulate_into_chunk():
    g = torch.Generator().manual_seed(13)
    x = randn(2, 10, 19, generator=g)
    w = randn(9, 19, generator=g)
    y = randn(2, 30, 9, generator=g)
    expected = y.double().clone()
    expected[:, 10:20] += matmul_reference(x, w)
    matmul(x, w, out=y[:, 10:20], accumulate=True)
    assert_close(y, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_tn_weight_gradient_over_strided_tokens(dtype):
    """dW = dY^T X with the token dim a [batch, seq-chunk] view of both operands."""
    g = torch.Generator().manual_seed(17)
    B, S, N, K = 3, 11, 19, 26
    dy = randn(B, S, N, dtype=dtype, generator=g)
    x = randn(B, 2 * S + 1, K, dtype=dtype, generator=g)[:, 5 : 5 + S]
    out = poison((N, K), torch.float32)
    matmul_tn(dy, x, out=out)
    expected = dy.double().reshape(-1, N).t() @ x.double().reshape(-1, K)
    assert_close(out, expected, dtype)
    acc = randn(N, K, generator=g)
    expected2 = acc.double() + expected
    matmul_tn(dy, x, out=acc, accumulate=True)
    assert_close(acc, expected2, dtype)


def test_empty_dims():
    a = randn(5, 0)
    w = randn(4, 0)
    b = randn(4)
    assert_close(matmul(a, w, b), b.double().expand(5, 4), torch.float32)
    assert matmul(randn(0, 3), randn(4, 3)).shape == (0, 4)
    out = randn(4, 3)
    assert torch.equal(matmul_tn(randn(0, 4), randn(0, 3), out=out.clone(), accumulate=True), out)


def test_bad_input_errors():
    a, w = randn(8, 16), randn(12, 16)
    with pytest.raises(ValueError, match="inner dimensions differ.*K=16.*K=15"):
        matmul(a, randn(12, 15))
    with pytest.raises(TypeError, match="weight must have the same dtype as a"):
        matmul(a, w.half())
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        matmul(a.double(), w.double())
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        matmul(a.int(), w.int())
    with pytest.raises(ValueError, match=r"out must have shape \(8, 12\), got \(8, 13\)"):
        matmul(a, w, out=torch.empty(8, 13, device=DEVICE))
    with pytest.raises(ValueError, match="a must be 2-D or 3-D, got shape \\(16,\\)"):
        matmul(a[0], w)
    with pytest.raises(ValueError, match="a must be 2-D or 3-D.*4-D"):
        matmul(a.reshape(1, 2, 4, 16), w)
    with pytest.raises(ValueError, match="weight must be 2-D, got shape \\(1, 12, 16\\)"):
        matmul(a, w[None])
    with pytest.raises(ValueError, match="activation must be one of"):
        matmul(a, w, activation="tanh")
    with pytest.raises(ValueError, match="weight_layout must be"):
        matmul(a, w, weight_layout="nn")
    with pytest.raises(ValueError, match="bias must have shape \\(12,\\)"):
        matmul(a, w, randn(11))
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        matmul(a, w, accumulate=True)
    with pytest.raises(ValueError, match="even number of weight output features"):
        matmul(a, randn(13, 16), activation="swiglu")
    with pytest.raises(ValueError, match="same leading"):
        matmul_tn(randn(8, 4), randn(7, 4))
    meta = torch.empty(12, 16, device="meta")
    with pytest.raises(ValueError, match="meta"):
        matmul(a, meta)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        matmul([[1.0]], w)


def test_gpu_config_pruning_by_shared_memory_and_problem_size():
    """The autotuner's candidate list (GPU only) is pruned on the host: checked here on CPU."""
    configs = gpu_configs()

    def smem(c, b_tiles):
        k = c.kwargs
        return (k["BLOCK_M"] * k["BLOCK_K"] + b_tiles * k["BLOCK_K"] * k["BLOCK_N"]) * 2 * c.num_stages

    limit = 160 * 1024
    big = prune_tile_configs(configs, elem_size=2, b_tiles=1, smem_limit=limit, dims={"BLOCK_M": 8192, "BLOCK_N": 8192})
    assert big and all(smem(c, 1) <= limit for c in big)
    assert [c for c in configs if smem(c, 1) <= limit] == big
    gated = prune_tile_configs(configs, elem_size=2, b_tiles=2, smem_limit=limit, dims={"BLOCK_M": 8192, "BLOCK_N": 8192})
    assert all(smem(c, 2) <= limit for c in gated) and len(gated) < len(big)
    narrow = prune_tile_configs(configs, elem_size=2, b_tiles=1, smem_limit=limit, dims={"BLOCK_M": 8192, "BLOCK_N": 40})
    # N=40 rounds up to 64: tiles up to 2 * 64 = 128 wide stay, the 256-wide ones go
    assert any(c.kwargs["BLOCK_N"] == 256 for c in big)
    assert narrow and all(c.kwargs["BLOCK_N"] <= 128 for c in narrow)
    assert [c for c in big if c.kwargs["BLOCK_N"] <= 128] == narrow
    tiny = prune_tile_configs(configs, elem_size=4, b_tiles=2, smem_limit=1024, dims={"BLOCK_M": 1, "BLOCK_N": 1})
    assert len(tiny) == 1 and tiny[0] is min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
