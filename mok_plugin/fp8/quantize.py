"""Blockwise FP8 quantisation in PyTorch: the definition the fused kernels are tested against.

A block is `block` consecutive values along one dimension (1-D: activations and gradients, along the
dimension the consuming GEMM reduces over) or a block x block tile (2-D: weights). Per block:

    amax  = max |x| over the block
    scale = max_fp8 / amax (1 where amax is 0), its mantissa cleared when power_of_2
    data  = x * scale rounded to nearest even on the format's grid (|x * scale| <= max_fp8)
    x    ~= data * scale_inv, scale_inv = 1 / scale

which is Transformer Engine's Float8BlockScaling rule (`recipe.py`). A partial block at a tensor's
edge is a block of the values it has. Scales are fp32; with power-of-2 scales, x * scale and
data * scale_inv are exact, so the only rounding is the cast.
"""

from __future__ import annotations

import torch

from mok_plugin.fp8.recipe import FP8Format

__all__ = ["block_scales", "dequantize_1d", "dequantize_2d", "fp8_round", "quantize_1d", "quantize_2d"]

_FP32_EXPONENT_AND_SIGN = -(1 << 23)  # 0xFF800000 as an int32: clears the 23 mantissa bits


def block_scales(amax: torch.Tensor, fmt: FP8Format, power_of_2: bool = True) -> torch.Tensor:
    """fp32 scales (multiply before the cast) of blocks whose largest magnitude is `amax`."""
    amax = amax.float()
    # full / amax, not fmt.max / amax: torch computes a scalar over a tensor as a reciprocal times the
    # scalar, one rounding more than the IEEE division the kernels (and Transformer Engine) do
    scale = torch.where(amax > 0, torch.full_like(amax, fmt.max) / amax, torch.ones_like(amax))
    # an amax so small that max / amax overflows: the largest finite scale (2^127 once cleared)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    if power_of_2:
        scale = (scale.view(torch.int32) & _FP32_EXPONENT_AND_SIGN).view(torch.float32)
    return scale


def fp8_round(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """fp32: x (clamped to +-fmt.max) rounded to nearest even on the format's grid."""
    return x.float().clamp(-fmt.max, fmt.max).to(fmt.dtype).float()


def quantize_1d(
    x: torch.Tensor, fmt: FP8Format, block: int = 128, dim: int = -1, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data in fmt.dtype, shaped as x; fp32 scale_inv, shaped as x with `dim` of cdiv(size, block)
    blocks): x in 1-D blocks of `block` consecutive values along `dim`."""
    moved = x.movedim(dim, -1).float()
    n = moved.shape[-1]
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(moved, (0, blocks * block - n)).unflatten(-1, (blocks, block))
    scale = block_scales(padded.abs().amax(dim=-1), fmt, power_of_2)
    data = (padded * scale[..., None]).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    data = data.flatten(-2)[..., :n].movedim(-1, dim).contiguous()
    return data, (1.0 / scale).movedim(-1, dim).contiguous()


def dequantize_1d(data: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, dim: int = -1) -> torch.Tensor:
    """fp32 values of quantize_1d's (data, scale_inv)."""
    n = data.shape[dim]
    return data.float() * scale_inv.repeat_interleave(block, dim=dim).narrow(dim, 0, n)


def quantize_2d(
    w: torch.Tensor, fmt: FP8Format, block: int = 128, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data in fmt.dtype, shaped as w; fp32 scale_inv [..., cdiv(rows, block), cdiv(cols, block)]):
    the last two dimensions of w in block x block tiles (weights; a leading dimension is the experts)."""
    rows, cols = w.shape[-2:]
    rb, cb = -(-rows // block), -(-cols // block)
    padded = torch.nn.functional.pad(w.float(), (0, cb * block - cols, 0, rb * block - rows))
    tiles = padded.unflatten(-1, (cb, block)).unflatten(-3, (rb, block))  # [..., rb, block, cb, block]
    scale = block_scales(tiles.abs().amax(dim=(-3, -1)), fmt, power_of_2)  # [..., rb, cb]
    data = (tiles * scale[..., :, None, :, None]).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    data = data.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous()
    return data, 1.0 / scale


def dequantize_2d(data: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 values of quantize_2d's (data, scale_inv)."""
    rows, cols = data.shape[-2:]
    expanded = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return data.float() * expanded[..., :rows, :cols]
