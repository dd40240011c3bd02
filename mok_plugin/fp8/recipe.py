"""What blockwise FP8 means for MoK: the two formats and the recipe that says which tensors use which.

Megatron's `--fp8-recipe blockwise` (Transformer Engine's `Float8BlockScaling`, the scheme DeepSeek-V3
trained with) quantises in blocks of 128: activations and gradients in 1 x 128 blocks along the
dimension a GEMM reduces over, weights in 128 x 128 blocks (the same blocks serve the transposed use
in the backward). Each block has one fp32 scale, by default a power of two: scale = max_fp8 / amax
with its mantissa bits cleared, so the block's largest value lands in [max_fp8 / 2, max_fp8] and never
saturates. `--fp8-format e4m3` uses E4M3 everywhere; `hybrid` keeps E4M3 for activations and weights
and uses E5M2 for the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E5M2", "FP8_FORMATS", "BlockwiseFP8Recipe", "FP8Format"]


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

# Megatron's --fp8-recipe values (0.19) and what MoK does with each.
_MEGATRON_RECIPES = {
    "blockwise": None,
    "delayed": "per-tensor scales from an amax history: MoK implements the blockwise recipe only",
    "tensorwise": "one current scale per tensor: MoK implements the blockwise recipe only",
    "mxfp8": "E8M0 scales per 32 values (Blackwell's block-scaled MMA): MoK implements the blockwise recipe only",
    "custom": "a user's quantiser factory: MoK implements the blockwise recipe only",
}


@dataclass(frozen=True)
class BlockwiseFP8Recipe:
    """Blockwise FP8 scaling: which format each role uses, the block size and the scale rule."""

    forward: FP8Format = E4M3  # activations and weights
    backward: FP8Format = E4M3  # output gradients (E5M2 under Megatron's "hybrid")
    block: int = 128
    power_of_2_scales: bool = True  # Transformer Engine's default (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0)

    def __post_init__(self) -> None:
        if self.block <= 0 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block}: must be a positive power of two")

    @classmethod
    def from_megatron(cls, fp8_format: str, fp8_recipe: str) -> BlockwiseFP8Recipe:
        """The recipe Megatron's --fp8-format / --fp8-recipe ask for.

        Raises:
            ValueError: a format other than e4m3 / hybrid, or a recipe other than blockwise (by name,
                with what it would have needed).
        """
        if fp8_recipe not in _MEGATRON_RECIPES:
            raise ValueError(f"--fp8-recipe {fp8_recipe!r}: unknown (Megatron's are {', '.join(_MEGATRON_RECIPES)})")
        why = _MEGATRON_RECIPES[fp8_recipe]
        if why is not None:
            raise ValueError(f"--fp8-recipe {fp8_recipe}: {why}")
        if fp8_format == "e4m3":
            return cls(forward=E4M3, backward=E4M3)
        if fp8_format == "hybrid":
            return cls(forward=E4M3, backward=E5M2)
        raise ValueError(f"--fp8-format {fp8_format!r}: MoK's blockwise recipe takes e4m3 or hybrid")
