"""The dense bf16 GEMM ceiling, measured in the same process as the work it is compared with.

It is the physical limit the layer tables quote as "% of dense GEMM"; see timing.SETTLE_S for why it
is measured both in its first calls after idle and after a settle period.
"""

from __future__ import annotations

import statistics

import torch

from mok_plugin.bench.timing import SETTLE_S, time_ms

__all__ = ["dense_gemm_tflops"]

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
