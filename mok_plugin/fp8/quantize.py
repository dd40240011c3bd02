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

Per tensor (Float8CurrentScaling, `quantize_tensorwise`): the same rule with one block, the whole
tensor given (the experts quantise each expert's rows and weights apart), power-of-2 off by default;
scale_inv = 1 / scale rounded once (TE's __frcp_rn), so dequantise in the precision the GEMM works in.

MXFP8 (MXFP8BlockScaling, `quantize_mxfp8`): blocks of 32 along one dimension, each with an E8M0
scale, a biased exponent e (uint8) meaning 2^(e - 127):

    e    = float_to_e8m0(amax * fp32(1 / max_fp8))   the fp32 product rounded up to a power of two
    data = x * 2^(127 - e) rounded to nearest even on the format's grid, saturating

bit for bit Transformer Engine's cast (recipe.py lists the files). A partial block is a block of the
values it has (the same as TE's zero padding: zeros change no amax).
"""

from __future__ import annotations

import torch

from mok_plugin.fp8.recipe import FP8Format

__all__ = [
    "block_scales",
    "dequantize_1d",
    "dequantize_2d",
    "dequantize_mxfp8",
    "dequantize_tensorwise",
    "e8m0_exponents",
    "e8m0_values",
    "fp8_round",
    "quantize_1d",
    "quantize_2d",
    "quantize_mxfp8",
    "quantize_tensorwise",
]

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


def quantize_tensorwise(x: torch.Tensor, fmt: FP8Format, power_of_2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(data in fmt.dtype, shaped as x; fp32 scale_inv, a 0-d tensor): all of x under one scale from its
    own amax (TE's Float8CurrentScaling quantiser; amax_epsilon 0, so an all-zero x gets scale 1)."""
    values = x.float()
    scale = block_scales(values.abs().amax(), fmt, power_of_2)
    data = (values * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return data, torch.ones_like(scale) / scale  # correctly rounded, as TE's __frcp_rn


def dequantize_tensorwise(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """quantize_tensorwise's values in `dtype`: in float64 exactly the FP8 value times the fp32 scale_inv,
    what a GEMM that applies the scale after its products computes (cuBLAS's FP8 GEMM)."""
    return data.to(dtype) * scale_inv.to(dtype)


_E8M0_NAN = 255
_E8M0_MAX = 254  # 2^127, where a saturating conversion stops
_FP32_MIN_E8M0_SUBNORMAL = 0x400000  # the mantissa of 2^-127 as an fp32 subnormal


def _e8m0_reciprocal(fmt: FP8Format) -> torch.Tensor:
    """TE's Quantized_Limits<OType>::max_norm_rcp: 1.0 / max_norm in double, stored as a float."""
    return torch.tensor(1.0 / fmt.max, dtype=torch.float32)


def e8m0_exponents(amax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """uint8 biased exponents e (scale 2^(e - 127)) of blocks whose largest magnitude is `amax`:
    TE's float_to_e8m0(amax * max_norm_rcp), rounding the fp32 product up to a power of two."""
    value = amax.float() * _e8m0_reciprocal(fmt).to(amax.device)
    bits = value.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != _E8M0_MAX)
    round_up &= ~((exponent == 0) & (mantissa <= _FP32_MIN_E8M0_SUBNORMAL))  # at most 2^-127: stays 2^-127
    e = exponent + round_up.int()
    e = torch.where(torch.isinf(value), _E8M0_MAX, e)
    e = torch.where(torch.isnan(value), _E8M0_NAN, e)
    return e.to(torch.uint8)


def _power_of_two(exponent_field: torch.Tensor) -> torch.Tensor:
    """fp32 2^(f - 127) for an int32 exponent field f in [0, 254]: 2^-127 (f = 0) as the subnormal."""
    bits = torch.where(exponent_field == 0, _FP32_MIN_E8M0_SUBNORMAL, exponent_field << 23)
    return bits.to(torch.int32).view(torch.float32)


def e8m0_values(e: torch.Tensor) -> torch.Tensor:
    """fp32 scales 2^(e - 127) of biased E8M0 exponents (255: NaN): TE's exp2f (ptx.cuh)."""
    e = e.to(torch.int32)
    return torch.where(e == _E8M0_NAN, torch.nan, _power_of_two(e.clamp(max=_E8M0_MAX)))


def _e8m0_quantising_factors(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^(127 - e), what the values are multiplied by before the cast (255: NaN): TE's exp2f_rcp."""
    e = e.to(torch.int32)
    return torch.where(e == _E8M0_NAN, torch.nan, _power_of_two(_E8M0_MAX - e.clamp(max=_E8M0_MAX)))


def _blocks_along(x: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """fp32 x with `dim` moved last and split into blocks: [..., cdiv(n, block), block], zero padded."""
    moved = x.movedim(dim, -1).float()
    n = moved.shape[-1]
    blocks = -(-n // block)
    return torch.nn.functional.pad(moved, (0, blocks * block - n)).unflatten(-1, (blocks, block))


def quantize_mxfp8(
    x: torch.Tensor, fmt: FP8Format, dim: int = -1, block: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data in fmt.dtype, shaped as x; uint8 E8M0 exponents, shaped as x with `dim` of cdiv(size, 32)
    blocks): x in 1-D blocks of 32 consecutive values along `dim` (row-wise for dim=-1, column-wise for
    dim=0), each scaled by a power of two (module docstring)."""
    n = x.shape[dim]
    blocks = _blocks_along(x, block, dim)
    e = e8m0_exponents(blocks.abs().amax(dim=-1), fmt)
    scaled = blocks * _e8m0_quantising_factors(e)[..., None]
    data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).flatten(-2)[..., :n]
    return data.movedim(-1, dim).contiguous(), e.movedim(-1, dim).contiguous()


def dequantize_mxfp8(
    data: torch.Tensor, e: torch.Tensor, dim: int = -1, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """quantize_mxfp8's values in `dtype` (exact in fp32 and fp64 but for results below fp32's normals)."""
    n = data.shape[dim]
    scale = e8m0_values(e).to(dtype).repeat_interleave(block, dim=dim).narrow(dim, 0, n)
    return data.to(dtype) * scale
