"""The GEMM's shared Triton pieces: the grouped tile order, the K main loop over two-level row
views (a gated weight's up half beside the gate) and the epilogue (bias, pre-activation store,
activation). ``_gemm_kernel`` (:mod:`.gemm`), the persistent GEMM, the fp8 GEMM's epilogue and the
linear cross entropy's statistics / logit-gradient kernels are built from them.
"""
import triton
import triton.language as tl

from .fp8 import rne_for_store
from .runtime import apply_activation, apply_up

__all__ = ["gemm_epilogue", "gemm_mainloop", "grouped_tile"]


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` over a ``[M, N]`` output in grouped order (tutorial 03):
    ``GROUP_M`` row blocks side by side walk the column blocks together, so neighbouring programs
    share B's column blocks in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + ((pid % num_in_group) % group_size), (pid % num_in_group) // group_size


@triton.jit
def gemm_mainloop(
    a_ptr, b_ptr, a_rows, b_cols, b_cols_up, m_mask, n_mask, K,
    a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1,
    A_K_SPLIT: tl.constexpr, B_K_SPLIT: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 ``A[rows, :] @ B[:, cols]`` of one tile (and of the up columns for gated activations).

    ``a_rows`` / ``b_cols`` / ``b_cols_up`` are int64 offset vectors; the contraction index may be
    two-level (``*_K_SPLIT``). Shared by every GEMM kernel of fusedpar.kernels.
    """
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dead code unless GLU
    # A two-level contraction index k lives at (k // inner) * s0 + (k % inner) * s1. Per element
    # that division is done once, for rk (loop invariant); a step divides only its scalar base
    # k0 * BLOCK_K, and k = base + rk follows with one carry: (base % inner) + (rk % inner) <
    # 2 * inner. The offsets stay functions of k0 (no loop-carried vectors), so the loads still
    # pipeline. Offsets are written out rather than via row_offsets: under the interpreter every
    # nested jit call re-patches triton.language (~ms each), and this loop is the hot path.
    if A_K_SPLIT:
        a_q0 = rk // a_k_inner
        a_r0 = rk % a_k_inner
    if B_K_SPLIT:
        b_q0 = rk // b_k_inner
        b_r0 = rk % b_k_inner
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        base = k0 * BLOCK_K
        kk = base + rk
        kk64 = kk.to(tl.int64)
        if A_K_SPLIT:
            a_r = base % a_k_inner + a_r0
            a_wrap = a_r >= a_k_inner
            a_q = (base // a_k_inner + a_q0 + a_wrap.to(tl.int32)).to(tl.int64)
            a_r = tl.where(a_wrap, a_r - a_k_inner, a_r).to(tl.int64)
            a_off = a_rows[:, None] + (a_q * s_ak0 + a_r * s_ak1)[None, :]
        else:
            a_off = a_rows[:, None] + (kk64 * s_ak1)[None, :]
        if B_K_SPLIT:
            b_r = base % b_k_inner + b_r0
            b_wrap = b_r >= b_k_inner
            b_q = (base // b_k_inner + b_q0 + b_wrap.to(tl.int32)).to(tl.int64)
            b_r = tl.where(b_wrap, b_r - b_k_inner, b_r).to(tl.int64)
            b_k = (b_q * s_bk0 + b_r * s_bk1)[:, None]
        else:
            b_k = (kk64 * s_bk1)[:, None]
        if EVEN_K:
            a = tl.load(a_ptr + a_off, mask=m_mask[:, None], other=0.0)
            b = tl.load(b_ptr + b_k + b_cols[None, :], mask=n_mask[None, :], other=0.0)
        else:
            k_mask = kk < K
            a = tl.load(a_ptr + a_off, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptr + b_k + b_cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if GLU:
            if EVEN_K:
                bu = tl.load(b_ptr + b_k + b_cols_up[None, :], mask=n_mask[None, :], other=0.0)
            else:
                bu = tl.load(b_ptr + b_k + b_cols_up[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                bu = bu.to(tl.float32)
            acc_up = tl.dot(a, bu, acc_up, input_precision=INPUT_PRECISION)
    return acc, acc_up


@triton.jit
def gemm_epilogue(
    acc, acc_up, rn, n_mask, out_mask, bias_ptr, aux_ptr, aux_off, glu_offset, s_xn,
    HAS_BIAS: tl.constexpr, STORE_AUX: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr, EMULATE: tl.constexpr,
):
    """Bias, optional store of the pre-activation values (``aux_off``: their int64 offsets, the up
    half ``glu_offset`` columns further; ``EMULATE``: rounded to nearest even first, as a GPU's
    bf16 cast does and the interpreter's does not), activation (gated or not). Returns the fp32 tile."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(bias_ptr + rn + glu_offset, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if STORE_AUX:
        pre, pre_up = acc, acc_up
        if EMULATE:
            pre, pre_up = rne_for_store(acc, aux_ptr), rne_for_store(acc_up, aux_ptr)
        tl.store(aux_ptr + aux_off, pre.to(aux_ptr.dtype.element_ty), mask=out_mask)
        if GLU:
            tl.store(aux_ptr + aux_off + glu_offset.to(tl.int64) * s_xn, pre_up.to(aux_ptr.dtype.element_ty),
                     mask=out_mask)
    acc = apply_activation(acc, ACT)
    if GLU:
        if ACT == 4:
            acc = acc * apply_up(acc_up, ACT)
        else:
            acc = acc * acc_up
    return acc
