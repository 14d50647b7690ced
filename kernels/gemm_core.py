"""The GEMM core: the Triton pieces every GEMM kernel of fusedpar is built from.

* :func:`grouped_tile`: the grouped tile order (tutorial 03) of a tile index, what a persistent
  program's tile loop (``tl.range(pid, tiles, programs, flatten=...)``) walks;
* :func:`operand_descriptors`: device-side tensor descriptors (TMA) of A and B, either operand
  contiguous along K or along its other dim;
* :func:`gemm_mainloop`: the K loop of one tile, its operands loaded through those descriptors
  (``TMA``) or through pointers over two-level row views (a gated weight's up half beside the
  gate), 16-bit / fp32 products or e4m3 ones with their scales (``SCALING``: rowwise, promoted to
  fp32 every ``PROMOTE_K``; blockwise, a fresh dot per 128-deep step times the step's scales);
* :func:`gemm_epilogue` (bias, pre-activation store, activation), :func:`gemm_store` (the whole
  epilogue of a GEMM writing ``C``: residual / accumulate, store, e4m3 1x128-tile output) and
  :func:`split_columns` (an accumulator as two column halves: the epilogue subtiled along N).

``_gemm_kernel`` (:mod:`.gemm`), the fp8, grouped and persistent GEMMs and the linear cross
entropy's statistics / logit-gradient kernels are built from them. Which load path a launch takes
is decided on the host (:mod:`.gemm_loads`).
"""
import triton
import triton.language as tl

from .fp8 import rne_for_store, store_e4m3_tiles, to_fp32
from .runtime import apply_activation, apply_up, row_offsets

__all__ = ["gemm_epilogue", "gemm_mainloop", "gemm_store", "grouped_tile", "operand_descriptors", "split_columns"]


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of tile ``pid`` of a ``[M, N]`` output in grouped order (tutorial 03):
    ``GROUP_M`` row blocks side by side walk the column blocks together, so neighbouring tiles
    share B's column blocks in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + ((pid % num_in_group) % group_size), (pid % num_in_group) // group_size


@triton.jit
def operand_descriptors(a_ptr, b_ptr, M, N_w, K, s_am, s_ak, s_bk, s_bn, A_KMAJOR: tl.constexpr,
                        B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tensor descriptors of ``A [M, K]`` and ``B [K, N_w]`` (``N_w``: every row of a gated
    weight, gate and up). ``A_KMAJOR``: A's K stride is 1 (``s_am`` its row stride), else its M
    stride is 1 (``s_ak`` the stride along K: ``matmul_tn``'s ``grad^T``); ``B_KMAJOR``: B is
    ``[N_w, K]`` with row stride ``s_bn`` (an ``nn.Linear`` weight), else ``[K, N_w]`` with row
    stride ``s_bk``. The host checked what TMA needs: base and strides multiples of 16 bytes."""
    if A_KMAJOR:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[s_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[s_ak, 1], block_shape=[BLOCK_K, BLOCK_M])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N_w, K], strides=[s_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N_w], strides=[s_bk, 1], block_shape=[BLOCK_K, BLOCK_N])
    return a_desc, b_desc


@triton.jit
def gemm_mainloop(
    a_ptr, b_ptr, a_rows, b_cols, b_cols_up, m_mask, n_mask, K,
    a_k_inner, s_ak0, s_ak1, b_k_inner, s_bk0, s_bk1,
    A_K_SPLIT: tl.constexpr, B_K_SPLIT: tl.constexpr, GLU: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    a_desc=None, b_desc=None, m0=0, n0=0, glu_offset=0, TMA: tl.constexpr = False, A_KMAJOR: tl.constexpr = True,
    B_KMAJOR: tl.constexpr = True, sa_rows=None, sb_cols=None, sb_up=None, s_sak=0, s_sbk=0,
    SCALING: tl.constexpr = 0, PROMOTE_K: tl.constexpr = None, b_expert=0, up_first=None, up_second=None, s_sbn=0,
    UP_BLOCKS: tl.constexpr = False, B_EXPERTS: tl.constexpr = False,
):
    """fp32 ``A[rows, :] @ B[:, cols]`` of one tile (and of the up columns for gated activations).

    Pointer loads (``TMA`` False): ``a_rows`` / ``b_cols`` / ``b_cols_up`` are int64 offset
    vectors; the contraction index may be two-level (``*_K_SPLIT``). TMA loads: the tile at row
    ``m0``, column ``n0`` (up half ``glu_offset`` further) through :func:`operand_descriptors`'
    ``a_desc`` / ``b_desc``, zero-filled past the tensor's edges (no masks; ``B_EXPERTS``:
    ``b_desc`` is a grouped GEMM's 3-D ``[experts, N, K]`` (``B_KMAJOR``) or ``[experts, K, N]``
    and ``b_expert`` the expert, whose edges then zero-fill too). e4m3 operands
    (``SCALING`` 1, rowwise: ``sa_rows`` / ``sb_cols`` / ``sb_up`` point to the rows' scales; the
    dot accumulates at most ``PROMOTE_K`` products before an fp32 add; 2, blockwise: a fresh dot
    per 128-deep step, times the step's scales ``k0 * s_sak`` / ``k0 * s_sbk`` further;
    ``UP_BLOCKS``: the up half's scales are those of the 128-row block at ``sb_up`` where
    ``up_first``, else of the next block ``s_sbn`` further, if ``up_second``: two scalar loads a
    step rather than a pointer per column, which spilled 64-908 B on sm_90 at an up offset of 72).
    """
    tl.static_assert(SCALING != 2 or BLOCK_K == 128, "blockwise scaling steps K one 128-wide scale block at a time")
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
        if TMA:
            if A_KMAJOR:
                a = a_desc.load([m0, base])
            else:
                a = a_desc.load([base, m0]).T
            if B_KMAJOR and B_EXPERTS:
                b = b_desc.load([b_expert, n0, base]).reshape(BLOCK_N, BLOCK_K).T
            elif B_KMAJOR:
                b = b_desc.load([n0, base]).T
            elif B_EXPERTS:
                b = b_desc.load([b_expert, base, n0]).reshape(BLOCK_K, BLOCK_N)
            else:
                b = b_desc.load([base, n0])
        else:
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
            k_mask = kk < K  # (unused with EVEN_K)
            if EVEN_K:
                a = tl.load(a_ptr + a_off, mask=m_mask[:, None], other=0.0)
                b = tl.load(b_ptr + b_k + b_cols[None, :], mask=n_mask[None, :], other=0.0)
            else:
                a = tl.load(a_ptr + a_off, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptr + b_k + b_cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SCALING == 2:  # a fresh dot per step (promoted every 128), times the step's scales
            sa = tl.load(sa_rows + k0 * s_sak, mask=m_mask, other=0.0)[:, None]
            acc += tl.dot(a, b) * sa * tl.load(sb_cols + k0 * s_sbk, mask=n_mask, other=0.0)[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, max_num_imprecise_acc=PROMOTE_K)
        if GLU:  # the up columns after the gate's dot (unpipelined loads keep one B tile in shared memory)
            if TMA:
                if B_KMAJOR and B_EXPERTS:
                    bu = b_desc.load([b_expert, n0 + glu_offset, base]).reshape(BLOCK_N, BLOCK_K).T
                elif B_KMAJOR:
                    bu = b_desc.load([n0 + glu_offset, base]).T
                elif B_EXPERTS:
                    bu = b_desc.load([b_expert, base, n0 + glu_offset]).reshape(BLOCK_K, BLOCK_N)
                else:
                    bu = b_desc.load([base, n0 + glu_offset])
            elif EVEN_K:
                bu = tl.load(b_ptr + b_k + b_cols_up[None, :], mask=n_mask[None, :], other=0.0)
            else:
                bu = tl.load(b_ptr + b_k + b_cols_up[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                bu = bu.to(tl.float32)
            if SCALING == 2:
                if UP_BLOCKS:
                    sb_u = tl.where(up_first, tl.load(sb_up + k0 * s_sbk),
                                    tl.load(sb_up + s_sbn + k0 * s_sbk, mask=up_second, other=0.0))
                else:
                    sb_u = tl.load(sb_up + k0 * s_sbk, mask=n_mask, other=0.0)
                acc_up += tl.dot(a, bu) * sa * sb_u[None, :]
            else:
                acc_up = tl.dot(a, bu, acc_up, input_precision=INPUT_PRECISION, max_num_imprecise_acc=PROMOTE_K)
    if SCALING == 1:  # rowwise: the fp32 accumulator times the rows' and the columns' scales
        sa = tl.load(sa_rows, mask=m_mask, other=0.0)[:, None]
        acc = acc * sa * tl.load(sb_cols, mask=n_mask, other=0.0)[None, :]
        if GLU:
            acc_up = acc_up * sa * tl.load(sb_up, mask=n_mask, other=0.0)[None, :]
    return acc, acc_up


@triton.jit
def split_columns(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The two column halves ``acc[:, :BLOCK_N // 2]``, ``acc[:, BLOCK_N // 2:]`` of a tile: an
    epilogue run per half holds half the tile's stores and layout conversion at a time."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


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


@triton.jit
def gemm_store(
    acc, acc_up, m_start, n_start, M, N, c_ptr, bias_ptr, r_ptr, aux_ptr, glu_offset,
    c_m_inner, s_cm0, s_cm1, s_cn, r_m_inner, s_rm0, s_rm1, s_rn, s_xm, s_xn,
    q_ptr, s_ptr, q_m_inner, s_qm0, s_qm1, sc_m_inner, s_sm0, s_sm1, n_tiles,
    C_M_SPLIT: tl.constexpr, R_M_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    STORE_AUX: tl.constexpr, ACT: tl.constexpr, GLU: tl.constexpr, FP8_OUT: tl.constexpr, Q_M_SPLIT: tl.constexpr,
    S_M_SPLIT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The epilogue of a ``[BLOCK_M, BLOCK_N]`` tile ``acc`` (``acc_up``: its up half) from row
    ``m_start``, column ``n_start``: :func:`gemm_epilogue`, the residual (or ``C`` itself:
    accumulate) added in fp32, the store of ``C``, and with ``FP8_OUT`` ``C`` as stored per 1x128
    tile, widened again (what ``quantize_e4m3`` of ``C`` loads), into ``q`` / ``s``
    (``n_start`` a multiple of 128)."""
    rm = m_start + tl.arange(0, BLOCK_M)
    rn = n_start + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    out_mask = m_mask[:, None] & n_mask[None, :]
    aux_off = rm.to(tl.int64)[:, None] * s_xm + rn.to(tl.int64)[None, :] * s_xn
    acc = gemm_epilogue(acc, acc_up, rn, n_mask, out_mask, bias_ptr, aux_ptr, aux_off, glu_offset, s_xn,
                        HAS_BIAS, STORE_AUX, ACT, GLU, EMULATE)
    if HAS_RES:
        r_off = row_offsets(rm, r_m_inner, s_rm0, s_rm1, R_M_SPLIT)[:, None] + rn.to(tl.int64)[None, :] * s_rn
        acc += tl.load(r_ptr + r_off, mask=out_mask, other=0.0).to(tl.float32)
    c_off = row_offsets(rm, c_m_inner, s_cm0, s_cm1, C_M_SPLIT)[:, None] + rn.to(tl.int64)[None, :] * s_cn
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + c_off, c, mask=out_mask)
    if FP8_OUT:
        store_e4m3_tiles(tl.where(out_mask, to_fp32(c, EMULATE), 0.0),
                         q_ptr + row_offsets(rm, q_m_inner, s_qm0, s_qm1, Q_M_SPLIT),
                         s_ptr + row_offsets(rm, sc_m_inner, s_sm0, s_sm1, S_M_SPLIT), rn, out_mask, m_mask,
                         n_start // 128, n_tiles, EMULATE, BLOCK_M, BLOCK_N)
