"""FP8 for the experts (issue 25): the recipes Megatron's flags select (`recipe`: blockwise,
tensorwise, mxfp8), the PyTorch quantisers that define their numbers (`quantize`), MoK's FP8 experts
in PyTorch (`reference`, the oracle, and what tensorwise and mxfp8 run) and through the Triton
kernels (`pipeline`: `fp8_moe_experts`, differentiable, blockwise only), the layer's experts function
for either backend (`experts`) and the weights' FP8 copies kept for a step (`weight_copies`). The
kernels are in `mok_plugin/kernels/fp8.py` and `fp8_mlp.py`. Selected by MoKConfig.fp8 and
fp8_scaling (Megatron: --fp8-format e4m3 / hybrid, --fp8-recipe blockwise / tensorwise / mxfp8)."""

from mok_plugin.fp8.quantize import (
    block_scales,
    dequantize_1d,
    dequantize_2d,
    dequantize_mxfp8,
    dequantize_tensorwise,
    e8m0_exponents,
    e8m0_values,
    fp8_round,
    quantize_1d,
    quantize_2d,
    quantize_mxfp8,
    quantize_tensorwise,
)
from mok_plugin.fp8.recipe import (
    E4M3,
    E5M2,
    FP8_FORMATS,
    FP8_RECIPES,
    BlockwiseFP8Recipe,
    FP8Format,
    FP8Recipe,
    MXFP8Recipe,
    TensorwiseFP8Recipe,
    fp8_recipe_from_megatron,
)

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "BlockwiseFP8Recipe",
    "FP8Format",
    "FP8Recipe",
    "MXFP8Recipe",
    "TensorwiseFP8Recipe",
    "block_scales",
    "dequantize_1d",
    "dequantize_2d",
    "dequantize_mxfp8",
    "dequantize_tensorwise",
    "e8m0_exponents",
    "e8m0_values",
    "fp8_recipe_from_megatron",
    "fp8_round",
    "quantize_1d",
    "quantize_2d",
    "quantize_mxfp8",
    "quantize_tensorwise",
]
