"""The experts' forward in blockwise FP8 through the Triton kernels (kernels/fp8.py, kernels/fp8_mlp.py):
x quantised per token, the weights per 128 x 128 tile, fc1 with A quantised in its epilogue, fc2, and
the bf16 combine. The numbers are those of fp8/reference.py."""

from __future__ import annotations

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.fp8.recipe import BlockwiseFP8Recipe
from mok_plugin.kernels.combine import combine_rows
from mok_plugin.kernels.fp8 import quantize_fc1, quantize_rows, quantize_weights
from mok_plugin.kernels.fp8_mlp import fp8_down_fwd, fp8_gate_up_fwd
from mok_plugin.schedule import MoKSchedule

__all__ = ["fp8_experts_forward"]


def fp8_experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    recipe: BlockwiseFP8Recipe,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] in x's dtype: the routed experts' output under `recipe` (forward only).

    Raises:
        ValueError: a linear expert (no fc1), or a recipe whose block is not 128 (the kernels' tiles).
    """
    if family.kind == "linear":
        raise ValueError("blockwise FP8 covers glu and mlp experts; a linear expert has no fc1 to quantise")
    if recipe.block != 128:
        raise ValueError(f"the FP8 kernels quantise in blocks of 128, not {recipe.block}")
    fmt, pow2 = recipe.forward, recipe.power_of_2_scales
    x_q, x_s = quantize_rows(x, fmt, power_of_2=pow2)
    w13_q, w13_s = quantize_fc1(gate_up_proj, fmt, family.gated, power_of_2=pow2)
    w2_q, w2_s = quantize_weights(down_proj, fmt, power_of_2=pow2)
    rows = (schedule.row_to_token, schedule.tile_to_expert, schedule.tile_m)
    _h, a_q, a_s = fp8_gate_up_fwd(
        x_q, x_s, w13_q, w13_s, *rows, fmt, out_dtype=x.dtype, power_of_2=pow2, gate_up_bias=gate_up_bias,
        activation=family.activation, gated=family.gated, clamp=family.clamp, offset=family.linear_offset,
    )  # fmt: skip
    y = fp8_down_fwd(a_q, a_s, w2_q, w2_s, topk_weights, schedule.row_to_tk, *rows, out_dtype=x.dtype,
                     down_bias=down_bias)  # fmt: skip
    return combine_rows(y, schedule.tk_to_row, x.shape[0], schedule.top_k)
