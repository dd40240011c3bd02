"""The dense GEMM ceilings, bf16 and FP8, measured in the same process as the work compared with them.

They are the physical limits the tables quote as "% of dense GEMM"; see timing.SETTLE_S for why
the bf16 one is measured both in its first calls after idle and after a settle period.
"""

from __future__ import annotations

import statistics
import warnings

import torch

from mok_plugin.bench.timing import SETTLE_S, time_ms

__all__ = ["dense_fp8_gemm_tflops", "dense_gemm_tflops"]

_N = 8192  # 8192^3: large enough that the GEMM runs at its steady rate on Hopper


def dense_gemm_tflops(iters: int = 20, settle_s: float = SETTLE_S) -> float:
    """TFLOP/s of a bf16 8192^3 GEMM on the current CUDA device (median of `iters` calls).

    Args:
        iters: timed calls.
        settle_s: seconds of back-to-back calls first (0: the burst rate after idle).
    Returns:
        2 * 8192^3 / median time, in TFLOP/s.
    """
    a = torch.randn(_N, _N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(_N, _N, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(time_ms(lambda: a @ b, iters, settle_s=settle_s))
    return 2 * _N**3 / ms / 1e9


def dense_fp8_gemm_tflops(blockwise: bool, iters: int = 20, settle_s: float = SETTLE_S) -> float | None:
    """TFLOP/s of an e4m3 8192^3 GEMM by torch's scaled matmul (cuBLASLt), bf16 out: `blockwise`, the
    recipe MoK's FP8 follows (A scaled 1 x 128, B 128 x 128, fp32 promotion along K, as DeepSeek-V3
    trains); else one scale per tensor with fast accumulation (no promotion: the fastest scaled FP8
    GEMM, an upper bound). None where this GPU and torch have no such GEMM (blockwise: sm_90 with
    cuBLASLt 12.9 or newer).
    """
    a, b, scales = _scaled_operands(_N, _N, _N, blockwise)
    try:
        _scaled_matmul(a, b, scales, blockwise)
    except (ImportError, RuntimeError, NotImplementedError) as error:
        warnings.warn(f"no {'blockwise' if blockwise else 'per-tensor'} FP8 GEMM here: {error}", stacklevel=2)
        return None
    ms = statistics.median(time_ms(lambda: _scaled_matmul(a, b, scales, blockwise), iters, settle_s=settle_s))
    return 2 * _N**3 / ms / 1e9


def _scaled_operands(M: int, K: int, N: int, blockwise: bool, device: str = "cuda"):
    """(A [M, K] e4m3 row-major, B [K, N] e4m3 column-major, (scale_a, scale_b)) in the layouts the
    scaled matmul takes: blockwise, A's per 1 x 128 ([M, K/128], M-major) and B's per 128 x 128
    ([K/128, N/128] stored N-block-major with K/128 padded to 4); else one fp32 scale each."""
    a = torch.randn(M, K, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device=device).to(torch.float8_e4m3fn).t()
    if not blockwise:
        return a, b, (torch.tensor(1.5, device=device), torch.tensor(0.5, device=device))
    scale_a = torch.rand(K // 128, M, device=device).add_(0.5).t()
    k_blocks = -(-(K // 128) // 4) * 4
    scale_b = torch.rand(N // 128, k_blocks, device=device).add_(0.5).t()
    return a, b, (scale_a, scale_b)


def _scaled_matmul(a: torch.Tensor, b: torch.Tensor, scales: tuple, blockwise: bool) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    if blockwise:
        recipes = (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128)
        return scaled_mm(a, b, scales[0], recipes[0], scales[1], recipes[1], output_dtype=torch.bfloat16)
    return torch._scaled_mm(a, b, scales[0], scales[1], out_dtype=torch.bfloat16, use_fast_accum=True)
