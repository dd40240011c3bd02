"""Blockwise FP8 for the experts (issue 25): the recipe Megatron's flags select (`recipe`), the
PyTorch quantisers that define its numbers (`quantize`), MoK's FP8 experts in PyTorch (`reference`,
the oracle) and through the Triton kernels (`pipeline`: `fp8_moe_experts`, differentiable), the
layer's experts function for either backend (`experts`) and the weights' FP8 copies kept for a step
(`weight_copies`). The kernels are in `mok_plugin/kernels/fp8.py` and `fp8_mlp.py`. Selected by
MoKConfig.fp8 (Megatron: --fp8-format e4m3 / hybrid --fp8-recipe blockwise)."""

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
