"""The mxfp8 recipe's GEMMs by block-scaled MMA (issue 25): out = A_q B_q^T over K, where A [M, K]
and B [N, K] hold E4M3 or E5M2 values and every 32 consecutive values along K share one E8M0 scale
(a biased power-of-two exponent, uint8 [M or N, cdiv(K, 32)]), as `fp8.quantize.quantize_mxfp8`
makes them (Transformer Engine's MXFP8BlockScaling, the OCP Microscaling format v1.0).

Written against Triton's `tl.dot_scaled` (the documented operands: lhs [M, K] with lhs_scale
[M, K / 32], rhs [K, N] with rhs_scale [N, K / 32], E8M0 scales as uint8), which Triton lowers to
Blackwell's block-scaled MMA (tcgen05.mma with scale factors, sm_100) and emulates elsewhere by
scaling the operands into bf16 for an ordinary MMA (Hopper) or in NumPy (its interpreter). This
project has no Blackwell GPU: the kernel is tested on the CPU (Triton's interpreter; on the H200,
through the emulation, its tests are in the GPU suite, not yet run) against the float64 product of
the dequantised operands, and compiled for
sm_100 on the CPU, where its PTX must hold the block-scaled MMA; it has not run on Blackwell, so
the mxfp8 recipe's GEMMs take it only where MOK_MXFP8_MMA=1 asks (fp8/experts.py's
`block_scaled_mma_chosen`).

Each product of two FP8 values scaled by powers of two is exact in fp32 (4 + 4 significant bits);
the K blocks are summed in ascending order into an fp32 accumulator, so a result is the same every
run. It is not the PyTorch path's fp32 GEMM bit for bit (another order of the same sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok_plugin.fp8.recipe import FP8_FORMATS, FP8Format, MXFP8Recipe
from mok_plugin.kernels.configs import interpreter_on
from mok_plugin.kernels.launch import cdiv

__all__ = ["MX_BLOCK", "mx_matmul"]

MX_BLOCK = MXFP8Recipe.block  # values along K per E8M0 scale (the format's, and dot_scaled's)
TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
_INTERPRETED = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}  # few programs


@triton.jit
def _mx_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, M, N, K, stride_a_m, stride_a_k, stride_as_m, stride_as_k,
    stride_b_n, stride_b_k, stride_bs_n, stride_bs_k, stride_out_m, A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); program (m, n) owns out[m-block, n-block] (fp32),
    summed over K in BLOCK_K steps, ascending (plus out's values where ACCUMULATE). Past K the values
    load as 0 with exponent 0 (2^-127): they add nothing."""
    SCALES: tl.constexpr = BLOCK_K // 32
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: offsets past 2^31 elements
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kb = k0 // 32 + tl.arange(0, SCALES)
        a = tl.load(a_ptr + rows[:, None] * stride_a_m + ks[None, :] * stride_a_k,
                    mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + cols[None, :] * stride_b_n + ks[:, None] * stride_b_k,
                    mask=col_ok[None, :] & (ks < K)[:, None], other=0.0)  # fmt: skip
        scale_ok = (kb * 32 < K)[None, :]
        a_scale = tl.load(a_scale_ptr + rows[:, None] * stride_as_m + kb[None, :] * stride_as_k,
                          mask=row_ok[:, None] & scale_ok, other=0)  # fmt: skip
        b_scale = tl.load(b_scale_ptr + cols[:, None] * stride_bs_n + kb[None, :] * stride_bs_k,
                          mask=col_ok[:, None] & scale_ok, other=0)  # fmt: skip
        acc = tl.dot_scaled(a, a_scale, A_FORMAT, b, b_scale, B_FORMAT, acc)
    out = out_ptr + rows[:, None] * stride_out_m + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0)
    tl.store(out, acc, mask=mask)


def mx_matmul(
    a: torch.Tensor, a_exponents: torch.Tensor, a_format: FP8Format, b: torch.Tensor, b_exponents: torch.Tensor,
    b_format: FP8Format, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """A_q B_q^T in fp32, [M, N]: a [M, K] and b [N, K] in their FP8 formats (any strides), each with
    uint8 E8M0 exponents [M or N, cdiv(K, 32)] along K (`quantize_mxfp8(t, fmt, dim=-1)`'s). With
    `out` (fp32 [M, N], unit column stride) the product is added to it, in place, and returned: a
    glu's two halves, whose blocks restart at each half, as two GEMMs into one sum.

    Raises:
        ValueError: shapes, dtypes or formats that do not fit together.
    """
    (M, K), (N, k_b) = a.shape, b.shape
    blocks = cdiv(K, MX_BLOCK)
    if k_b != K or a_exponents.shape != (M, blocks) or b_exponents.shape != (N, blocks):
        raise ValueError(f"mx_matmul: A {tuple(a.shape)} with exponents {tuple(a_exponents.shape)} and B "
                         f"{tuple(b.shape)} with {tuple(b_exponents.shape)}: expected [M, K], [M, "
                         f"cdiv(K, {MX_BLOCK})], [N, K] and [N, cdiv(K, {MX_BLOCK})]")  # fmt: skip
    for name, t, fmt in (("A", a, a_format), ("B", b, b_format)):
        if t.dtype != fmt.dtype or fmt.name not in FP8_FORMATS:
            raise ValueError(f"mx_matmul: {name} is {t.dtype}, expected {fmt.name}'s {fmt.dtype} (E4M3 or E5M2)")
    if a_exponents.dtype != torch.uint8 or b_exponents.dtype != torch.uint8:
        raise ValueError("mx_matmul: the E8M0 exponents must be uint8")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32, device=a.device)
        accumulate = False
    elif out.shape != (M, N) or out.dtype != torch.float32 or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"mx_matmul: out must be fp32 [{M}, {N}] with unit column stride")
    else:
        accumulate = True
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out if accumulate else out.zero_()
    meta = dict(_INTERPRETED if interpreter_on() else TILES)
    grid = (cdiv(M, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"]))
    _mx_matmul_kernel[grid](
        a, a_exponents, b, b_exponents, out, M, N, K, a.stride(0), a.stride(1), a_exponents.stride(0),
        a_exponents.stride(1), b.stride(0), b.stride(1), b_exponents.stride(0), b_exponents.stride(1), out.stride(0),
        A_FORMAT=a_format.name, B_FORMAT=b_format.name, ACCUMULATE=accumulate, **meta,  # dot_scaled's names too
    )  # fmt: skip
    return out
