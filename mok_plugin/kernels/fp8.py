"""Triton building blocks of blockwise FP8 (mok_plugin/fp8): rounding onto an FP8 grid and the scale
of a block, so that the kernels quantise exactly as `mok_plugin.fp8.quantize` defines.

Why round by hand: a value already on the FP8 grid converts exactly everywhere, but Triton's CPU
interpreter mis-converts fp32 values whose rounding carries into the next power of two (7.89 became
4.0 instead of 8.0 in E4M3). Rounding first with fp32 arithmetic gives the same bits compiled and
interpreted, and the cast that follows has nothing left to round.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["block_scale", "round_to_fp8_grid"]


@triton.jit
def round_to_fp8_grid(v, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXPONENT: tl.constexpr):
    """fp32 v clamped to +-MAX and rounded to nearest even on the FP8 grid (MANTISSA_BITS bits below
    the leading one; a fixed step of 2^(MIN_NORMAL_EXPONENT - MANTISSA_BITS) below the smallest normal).

    |v| + C, where C is the grid step times 2^23, lands in the binade of C, whose fp32 spacing is the
    step: fp32's own round-to-nearest-even does the rounding, and subtracting C is exact."""
    magnitude = tl.minimum(tl.abs(v.to(tl.float32)), MAX)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_NORMAL_EXPONENT)
    c = ((exponent - MANTISSA_BITS + 23 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + c) - c
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def block_scale(amax, MAX: tl.constexpr, POWER_OF_2: tl.constexpr):
    """fp32 scale of blocks whose largest magnitude is amax: MAX / amax (1 where amax is 0, the
    largest finite fp32 where that overflows), its mantissa cleared when POWER_OF_2 (quantize.block_scales)."""
    # IEEE division: the compiled `/` is approximate, and an amax of exactly MAX / 2^k must give 2^k
    nonzero = amax > 0
    scale = tl.where(nonzero, tl.div_rn(tl.full(amax.shape, MAX, tl.float32), tl.where(nonzero, amax, 1.0)), 1.0)
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    if POWER_OF_2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
    return scale
