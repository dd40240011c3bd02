"""What FP8 means for MoK's experts: the two formats, and the three recipes Megatron's --fp8-recipe
selects that MoK computes (which tensors are quantised how, in which format).

blockwise (Transformer Engine's `Float8BlockScaling`, the scheme DeepSeek-V3 trained with) quantises
in blocks of 128: activations and gradients in 1 x 128 blocks along the dimension a GEMM reduces
over, weights in 128 x 128 blocks (the same blocks serve the transposed use in the backward). Each
block has one fp32 scale, by default a power of two: scale = max_fp8 / amax with its mantissa bits
cleared, so the block's largest value lands in [max_fp8 / 2, max_fp8] and never saturates. The
Triton kernels (kernels/fp8.py, fp8_mlp.py) implement this recipe.

tensorwise (TE's `Float8CurrentScaling`) gives every tensor one fp32 scale from its own current amax.
Read in TransformerEngine (github NVIDIA/TransformerEngine, main of 2026-08-22):
  - transformer_engine/common/recipe/__init__.py, class Float8CurrentScaling: power-of-two scales off
    unless NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1; amax_epsilon 0.0 for inputs, weights and
    gradients; fp8_format default HYBRID (Megatron passes its --fp8-format).
  - transformer_engine/common/recipe/recipe_common.cuh, compute_scale_from_amax: scale = max_fp8 / amax
    (IEEE division, __fdiv_rn); 1 when amax is 0, inf or NaN; fp32 max when the quotient overflows
    (current_scaling.cu passes std::numeric_limits<float>::max()); scale_inv = 1 / scale.
  - transformer_engine/common/util/vectorized_pointwise.h: data = fp8(x * scale), the cast saturating.
  - transformer_engine/pytorch/module/grouped_linear.py with _split_quantization.py and
    csrc/extensions/cast.cpp (split_quantize, compute_grouped_fp8_current_scaling_amax_and_scale): the
    MoE experts' GroupedLinear quantises its input and grad-output per expert split, one quantiser
    (one amax) per split, and each expert's weight with its own quantiser. A per-tensor scale makes
    the column-wise (transposed) copy the same numbers as the row-wise one.

mxfp8 (TE's `MXFP8BlockScaling`) gives every 32 consecutive values along the GEMM's reduction
dimension one E8M0 (power-of-two) scale, for every operand: activations, weights (1-D blocks: its
enable_2d_quantization is off by default and Megatron does not set it) and gradients; a tensor a
GEMM reads both ways is quantised row-wise and column-wise apart, each from the high-precision values.
Read in TransformerEngine:
  - transformer_engine/common/recipe/__init__.py, class MXFP8BlockScaling (fp8_format default E4M3).
  - transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh: per block, biased exponent
    e = float_to_e8m0(amax * Quantized_Limits<OType>::max_norm_rcp) (fp32 product; max_norm_rcp is
    1.0 / max_norm computed in double and stored as float, common/utils.cuh), then
    data = fp8(x * exp2f_rcp(e)) and the scale stored is e (the value 2^(e - 127)).
  - transformer_engine/common/util/ptx_arch_spec.cuh, float_to_e8m0: Blackwell's
    cvt.rp.satfinite.ue8m0x2.f32 (round up to a power of two), and its emulation elsewhere: the fp32
    exponent field, plus one when the mantissa is not zero, except at exponent 254 (saturated) and for
    a subnormal at most 2^-127 (kept at 0); NaN -> 255, inf -> 254, 0 -> 0.
  - transformer_engine/common/util/ptx.cuh, exp2f_rcp / exp2f: 2^(127 - e) and 2^(e - 127) from bits
    (2^-127 as the subnormal 0x00400000; 255 -> NaN).
  - docs/features/low_precision_training/mxfp8/mxfp8.rst: rowwise and columnwise copies differ and
    are both made from the high-precision tensor.
MoK computes these numbers in PyTorch; with MOK_MXFP8_MMA=1 its GEMMs run by Blackwell's block-scaled
MMA (kernels/mxfp8.py, Triton's tl.dot_scaled), written against the format, not run on Blackwell here.

Megatron builds each recipe from --fp8-format (e4m3 -> Format.E4M3, hybrid -> Format.HYBRID: E4M3
forward, E5M2 gradients) in megatron/core/fp8_utils.py (get_fp8_recipe): Float8CurrentScaling(
fp8_format=...) for tensorwise, MXFP8BlockScaling(fp8_format=...) for mxfp8, Float8BlockScaling(
fp8_format=...) for blockwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "BlockwiseFP8Recipe",
    "FP8Format",
    "FP8Recipe",
    "FP8Scaling",
    "MXFP8Recipe",
    "TensorwiseFP8Recipe",
    "fp8_recipe_from_megatron",
]


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit float format: its torch dtype and where its grid is."""

    name: str
    dtype: torch.dtype
    max: float  # the largest finite value
    mantissa_bits: int
    min_normal_exponent: int  # 2 ** this is the smallest normal; below it the step is fixed

    @property
    def subnormal_step(self) -> float:
        """The grid's spacing below the smallest normal (and its smallest positive value)."""
        return 2.0 ** (self.min_normal_exponent - self.mantissa_bits)


# E4M3 "fn": no infinities, 448 = 1.75 * 2^8 its largest; E5M2 keeps IEEE infinities, 57344 = 1.75 * 2^15.
E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14)
FP8_FORMATS = {f.name: f for f in (E4M3, E5M2)}

FP8Scaling = Literal["blockwise", "tensorwise", "mxfp8"]

# Megatron's --fp8-recipe values (0.19) and what MoK does with each: None computes it, a string says why not.
_MEGATRON_RECIPES = {
    "blockwise": None,
    "tensorwise": None,
    "mxfp8": None,
    "delayed": "per-tensor scales from an amax history kept across steps: MoK's recipes scale from the "
    "current values only (blockwise, tensorwise, mxfp8)",
    "custom": "a user's quantiser factory (--fp8-quantizer-factory) has no PyTorch definition MoK could "
    "compute; MoK's recipes are blockwise, tensorwise and mxfp8",
}


def _formats(fp8_format: str) -> tuple[FP8Format, FP8Format]:
    """(forward, backward) formats of Megatron's --fp8-format."""
    if fp8_format == "e4m3":
        return E4M3, E4M3
    if fp8_format == "hybrid":
        return E4M3, E5M2
    raise ValueError(f"--fp8-format {fp8_format!r}: MoK's FP8 recipes take e4m3 or hybrid")


@dataclass(frozen=True)
class BlockwiseFP8Recipe:
    """Blockwise FP8 scaling: which format each role uses, the block size and the scale rule."""

    scaling: ClassVar[str] = "blockwise"
    forward: FP8Format = E4M3  # activations and weights
    backward: FP8Format = E4M3  # output gradients (E5M2 under Megatron's "hybrid")
    block: int = 128
    power_of_2_scales: bool = True  # Transformer Engine's default (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0)

    def __post_init__(self) -> None:
        if self.block <= 0 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block}: must be a positive power of two")

    @classmethod
    def from_megatron(cls, fp8_format: str, fp8_recipe: str) -> FP8Recipe:
        """The recipe Megatron's --fp8-format / --fp8-recipe ask for (kept here for its callers; the
        recipe named, whichever class it is: `fp8_recipe_from_megatron`)."""
        return fp8_recipe_from_megatron(fp8_format, fp8_recipe)


@dataclass(frozen=True)
class TensorwiseFP8Recipe:
    """Per-tensor current scaling (TE's Float8CurrentScaling): one fp32 scale per tensor from its own
    amax, for the experts one per expert (its rows, its weights). Defaults are TE's (HYBRID)."""

    scaling: ClassVar[str] = "tensorwise"
    forward: FP8Format = E4M3  # activations and weights
    backward: FP8Format = E5M2  # output gradients
    power_of_2_scales: bool = False  # TE's default (NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=0)


@dataclass(frozen=True)
class MXFP8Recipe:
    """MXFP8 (TE's MXFP8BlockScaling): one E8M0 scale per 32 values along each GEMM's reduction
    dimension, every operand. Defaults are TE's (E4M3 both ways)."""

    scaling: ClassVar[str] = "mxfp8"
    block: ClassVar[int] = 32  # fixed by the MX format (OCP Microscaling) and Blackwell's MMA
    forward: FP8Format = E4M3
    backward: FP8Format = E4M3


FP8Recipe = BlockwiseFP8Recipe | TensorwiseFP8Recipe | MXFP8Recipe
FP8_RECIPES: dict[str, type[FP8Recipe]] = {r.scaling: r for r in (BlockwiseFP8Recipe, TensorwiseFP8Recipe, MXFP8Recipe)}


def fp8_recipe_from_megatron(fp8_format: str, fp8_recipe: str) -> FP8Recipe:
    """The recipe Megatron's --fp8-format / --fp8-recipe ask for.

    Raises:
        ValueError: a recipe MoK refuses (delayed, custom: by name, with why) or does not know, or a
            format other than e4m3 / hybrid. The message starts with the flag at fault.
    """
    if fp8_recipe not in _MEGATRON_RECIPES:
        raise ValueError(f"--fp8-recipe {fp8_recipe!r}: unknown (Megatron's are {', '.join(_MEGATRON_RECIPES)})")
    why = _MEGATRON_RECIPES[fp8_recipe]
    if why is not None:
        raise ValueError(f"--fp8-recipe {fp8_recipe}: {why}")
    forward, backward = _formats(fp8_format)
    return FP8_RECIPES[fp8_recipe](forward=forward, backward=backward)
