"""The gradient of the grouped GEMM's per-expert bias (:func:`grouped_bias_grad`), deterministic.

``out[e] = sum_{g % E == e} sum of grad[offsets[g] .. offsets[g+1]]``: one program per (expert,
column block) walks that expert's groups in order and their rows in ``BLOCK_M`` tiles, summing
in fp32. The order of every addition is fixed by the offsets and the (constant) block sizes, so
the result is bit-identical from run to run (an ``index_add_`` / atomic scatter is not on a GPU).
The offsets are read on the device (no host sync); tail rows past ``offsets[G]`` count for no
expert. Addresses are formed in 64 bits.

Layers: ``@triton.jit`` kernel -> launcher (validate, allocate, launch) -> float64 reference.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .checks import check_float_tensor, check_int, output_buffer
from .grouped_gemm import as_group_offsets
from .launch import launch_kernel
from .runtime import cdiv, on_device

_BLOCK_M, _BLOCK_N = 32, 64  # fixed (never autotuned): the summation order must not change


@triton.jit
def _grouped_bias_grad_kernel(grad_ptr, offsets_ptr, out_ptr, G, E, N, s_gm, s_gn, s_oe, s_on,
                              ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    e = tl.program_id(0)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cmask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for grp in range(e, G, E):
        lo = tl.load(offsets_ptr + grp).to(tl.int64)
        hi = tl.load(offsets_ptr + grp + 1).to(tl.int64)
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
            mask = (rows < hi)[:, None] & cmask[None, :]
            tile = tl.load(grad_ptr + rows[:, None] * s_gm + cols[None, :] * s_gn, mask=mask, other=0.0)
            acc += tl.sum(tile.to(tl.float32), axis=0)
    ptrs = out_ptr + e.to(tl.int64) * s_oe + cols * s_on
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=cmask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def grouped_bias_grad(grad: torch.Tensor, offsets, num_experts: int, *, out: torch.Tensor | None = None,
                      accumulate: bool = False, check_offsets: bool = True) -> torch.Tensor:
    """The gradient of :func:`~fusedpar.kernels.grouped_matmul`'s ``bias``: ``out[e] (+)=
    sum_{g % E == e} sum of grad[rows_g]`` (``grad``: the pre-activation's gradient ``[M, N]``, any
    strides; tail rows count for no expert; experts without rows get zeros), ``[E, N]`` summed in
    fp32 (``accumulate=True``: ``out``'s values included), stored in ``out``'s dtype (fp32 when
    allocated here). Deterministic (see the module docstring); no host sync."""
    check_float_tensor("grad", grad, dims=(2,))
    check_int("num_experts", num_experts, min_value=1)
    if accumulate and out is None:
        raise ValueError("accumulate=True needs out= (the tensor to accumulate into)")
    M, N = grad.shape
    offsets = as_group_offsets(offsets, M, grad.device, check=check_offsets)
    out = output_buffer("out", out, (num_experts, N), grad.device, torch.float32)
    if N == 0:
        return out
    grid = (num_experts, cdiv(N, _BLOCK_N))
    with on_device(grad.device):
        launch_kernel(
            _grouped_bias_grad_kernel, grid,
            (grad, offsets, out, offsets.numel() - 1, num_experts, N, grad.stride(0), grad.stride(1), out.stride(0),
             out.stride(1)),
            dict(ACCUMULATE=bool(accumulate), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N))
    return out


def grouped_bias_grad_reference(grad: torch.Tensor, offsets, num_experts: int) -> torch.Tensor:
    """float64 oracle of :func:`grouped_bias_grad` (plain torch, a loop over the groups)."""
    offs = [int(v) for v in offsets]
    g64 = grad.detach().double().cpu()
    out = torch.zeros(num_experts, grad.shape[1], dtype=torch.float64)
    for grp in range(len(offs) - 1):
        out[grp % num_experts] += g64[offs[grp]:offs[grp + 1]].sum(0)
    return out
