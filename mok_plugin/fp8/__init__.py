"""Blockwise FP8 for the experts (issue 25): the recipe Megatron's flags select (`recipe`) and the
PyTorch quantisers that define its numbers (`quantize`). The Triton helpers that quantise inside the
kernels are in `mok_plugin/kernels/fp8.py`."""

from mok_plugin.fp8.quantize import block_scales, dequantize_1d, dequantize_2d, fp8_round, quantize_1d, quantize_2d
from mok_plugin.fp8.recipe import E4M3, E5M2, FP8_FORMATS, BlockwiseFP8Recipe, FP8Format

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_FORMATS",
    "BlockwiseFP8Recipe",
    "FP8Format",
    "block_scales",
    "dequantize_1d",
    "dequantize_2d",
    "fp8_round",
    "quantize_1d",
    "quantize_2d",
]
