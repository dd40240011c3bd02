"""The experts in blockwise FP8 through the Triton kernels (kernels/fp8.py, kernels/fp8_mlp.py), with
the numbers of fp8/reference.py.

forward:  x quantised per token, the weights per 128 x 128 tile (a glu's halves apart), fc1 with A
          quantised in its epilogue, fc2, the bf16 combine.
backward: dO quantised per token; fc2's dgrad with dh (both ways), w*A (128 x 1) and the router
          partials in its epilogue; fc1's dgrad and the combine of dX; x and dO rows quantised
          128 x 1 in schedule order; the two weight gradients over those column-quantised operands.
Every backward GEMM reads its operands K-major (the reduction dimension contiguous), which Hopper's
FP8 MMA requires: the weights' transposed FP8 copies, and the 128 x 1 operands stored transposed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.fp8.recipe import BlockwiseFP8Recipe
from mok_plugin.fp8.weight_copies import FP8WeightCopies
from mok_plugin.kernels.combine import combine_rows, reduce_router_grad
from mok_plugin.kernels.fp8 import (
    quantize_fc1,
    quantize_gathered_columns,
    quantize_rows,
    quantize_weights,
    transposed_copy,
)
from mok_plugin.kernels.fp8_mlp import fp8_down_dgrad, fp8_down_fwd, fp8_gate_up_dgrad, fp8_gate_up_fwd, fp8_wgrad
from mok_plugin.kernels.grouped_mlp import expert_bias_grad
from mok_plugin.schedule import MoKSchedule, values_per_row
from mok_plugin.wgrad import note_deferral

__all__ = ["fp8_experts_backward", "fp8_experts_forward", "fp8_moe_experts"]


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
    saved: dict | None = None,
    weight_copies: FP8WeightCopies | None = None,
) -> torch.Tensor:
    """[T, H] in x's dtype: the routed experts' output under `recipe`. With `saved` (a dict), what
    fp8_experts_backward needs is put in it, and the weights' transposed FP8 copies its dgrads read
    are made with the forward's, in one pass over the weights; with `weight_copies`, the weights' FP8
    copies are taken from it (made there when missing) instead of made for this call alone.

    Raises:
        ValueError: a linear expert (no fc1), or a recipe whose block is not 128 (the kernels' tiles).
    """
    if family.kind == "linear":
        raise ValueError("blockwise FP8 covers glu and mlp experts; a linear expert has no fc1 to quantise")
    if recipe.block != 128:
        raise ValueError(f"the FP8 kernels quantise in blocks of 128, not {recipe.block}")
    fmt, pow2 = recipe.forward, recipe.power_of_2_scales
    x_q, x_s = quantize_rows(x, fmt, power_of_2=pow2)
    copies = FP8WeightCopies() if weight_copies is None else weight_copies
    w13t = w2t = None
    if saved is None:
        w13 = copies.get("w13", lambda: quantize_fc1(gate_up_proj, fmt, family.gated, power_of_2=pow2))
        w2 = copies.get("w2", lambda: quantize_weights(down_proj, fmt, power_of_2=pow2))
    else:  # a backward follows: the transposes its dgrads read, written in the same pass over the weights
        w13, w13t = copies.get_with_derived(
            "w13", lambda: quantize_fc1(gate_up_proj, fmt, family.gated, power_of_2=pow2, with_transpose=True)
        )
        w2, w2t = copies.get_with_derived(
            "w2", lambda: quantize_weights(down_proj, fmt, power_of_2=pow2, with_transpose=True)
        )
    (w13_q, w13_s), (w2_q, w2_s) = w13, w2
    rows = (schedule.row_to_token, schedule.tile_to_expert, schedule.tile_m)
    h, a_q, a_s = fp8_gate_up_fwd(
        x_q, x_s, w13_q, w13_s, *rows, fmt, out_dtype=x.dtype, power_of_2=pow2, gate_up_bias=gate_up_bias,
        activation=family.activation, gated=family.gated, clamp=family.clamp, offset=family.linear_offset,
    )  # fmt: skip
    y = fp8_down_fwd(a_q, a_s, w2_q, w2_s, topk_weights, schedule.row_to_tk, *rows, out_dtype=x.dtype,
                     down_bias=down_bias)  # fmt: skip
    if saved is not None:
        # the transposes too: another forward may clear or replace the kept copies before this backward
        saved.update(x=x, topk_weights=topk_weights, h=h, w13=w13, w2=w2, w13t=w13t, w2t=w2t, schedule=schedule,
                     recipe=recipe, family=family, gate_up_bias=gate_up_bias, down_bias=down_bias,
                     weight_copies=copies)  # fmt: skip
    return combine_rows(y, schedule.tk_to_row, x.shape[0], schedule.top_k)


def fp8_experts_backward(
    d_out: torch.Tensor, saved: dict, defer: Callable[[Callable[[], tuple]], None] | None = None
) -> dict[str, torch.Tensor | None]:
    """{"d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"} (the
    biases' None without them) from what fp8_experts_forward saved. The bias gradients are sums of
    unquantised values (dh; w dO), as fp8/reference.py has them. With `defer`, the weight and bias
    gradients are None and defer(compute) is given the function that computes them, in that order, later.
    """
    x, schedule, recipe, family = saved["x"], saved["schedule"], saved["recipe"], saved["family"]
    b1, b2 = saved["gate_up_bias"], saved["down_bias"]
    fwd, bwd, pow2 = recipe.forward, recipe.backward, recipe.power_of_2_scales
    T, K, dtype = x.shape[0], schedule.top_k, x.dtype
    rows = (schedule.row_to_token, schedule.tile_to_expert, schedule.tile_m)
    d_o_q, d_o_s = quantize_rows(d_out, bwd, power_of_2=pow2)
    # the dgrads reduce over the weights' rows: their transposes, K-major (the same FP8 values), as the
    # forward made them with its copies, else (those kept from a forward without a backward) from the
    # copies this forward used (the kept ones may have been cleared or replaced since)
    copies = saved["weight_copies"]
    w13t = saved.get("w13t") or copies.derived("w13", saved["w13"], transposed_copy)
    w2t = saved.get("w2t") or copies.derived("w2", saved["w2"], transposed_copy)
    down = fp8_down_dgrad(
        d_o_q, d_o_s, *w2t, saved["h"], saved["topk_weights"], schedule.row_to_tk, *rows, fwd, bwd,
        power_of_2=pow2, activation=family.activation, gated=family.gated, clamp=family.clamp,
        offset=family.linear_offset, gate_up_bias=b1 is not None, down_bias=b2,
    )  # fmt: skip
    d_x_rows = fp8_gate_up_dgrad(down["dh_q"], down["dh_scale_inv"], *w13t, *rows, out_dtype=dtype,
                                 gated=family.gated)  # fmt: skip
    grads = {
        "d_x": combine_rows(d_x_rows, schedule.tk_to_row, T, K),
        "d_topk_weights": reduce_router_grad(down["partial"], schedule.tk_to_row, T, K),
    }

    def weight_grads() -> tuple[torch.Tensor | None, ...]:
        segments = (schedule.expert_offsets, schedule.tokens_per_expert)
        d_o_col = quantize_gathered_columns(d_out, schedule.row_to_token, bwd, power_of_2=pow2)
        x_col = quantize_gathered_columns(x, schedule.row_to_token, fwd, power_of_2=pow2)
        d_b1 = d_b2 = None
        if b1 is not None:
            d_b1 = expert_bias_grad(down["dh"], schedule.row_to_token, *segments, by_token=False)
        if b2 is not None:
            w_rows = values_per_row(saved["topk_weights"], schedule.row_to_tk)
            d_b2 = expert_bias_grad(d_out, schedule.row_to_token, *segments, by_token=True, scale=w_rows)
        return (
            fp8_wgrad(down["dh_colt"], down["dh_col_scale_inv"], *x_col, *segments, out_dtype=dtype),
            fp8_wgrad(*d_o_col, down["wa_colt"], down["wa_col_scale_inv"], *segments, out_dtype=dtype),
            d_b1,
            d_b2,
        )

    names = ("d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias")
    if defer is not None:  # --delay-wgrad-compute: computed when the queue runs (wgrad.py), the same kernels
        defer(weight_grads)
        return {**grads, **dict.fromkeys(names)}
    return {**grads, **dict(zip(names, weight_grads(), strict=True))}


class _FP8Experts(torch.autograd.Function):
    """fp8_experts_forward with fp8_experts_backward as its gradient (x, the routing weights, the
    weights and biases)."""

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, schedule, recipe, family,
                weight_copies):  # type: ignore[override]  # fmt: skip
        saved: dict = {}
        out = fp8_experts_forward(x, topk_weights, gate_up_proj, down_proj, schedule, recipe, family, gate_up_bias,
                                  down_bias, saved=saved, weight_copies=weight_copies)  # fmt: skip
        ctx.saved = saved
        ctx.weights_dtype = topk_weights.dtype
        note_deferral(ctx, gate_up_proj, down_proj, gate_up_bias, down_bias)  # --delay-wgrad-compute (wgrad.py)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        defer = None if ctx.deferral is None else functools.partial(ctx.deferral.add, targets=ctx.weights)
        grads = fp8_experts_backward(d_out.contiguous(), ctx.saved, defer)
        ctx.saved = None  # the FP8 copies and h go with the graph
        d_topk = grads["d_topk_weights"].to(ctx.weights_dtype)
        weights = (grads[k] for k in ("d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"))
        return grads["d_x"], d_topk, *weights, None, None, None, None


def fp8_moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    recipe: BlockwiseFP8Recipe,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    weight_copies: FP8WeightCopies | None = None,
) -> torch.Tensor:
    """The routed experts under blockwise FP8, differentiable: the contract of `ops.moe_experts`
    (x [T, H] in the params dtype, fp32 topk_weights [T, K], gate_up_proj [E, N1, H], down_proj
    [E, H, I]; returns [T, H]) with the numbers of fp8/reference.py; the weights' FP8 copies from
    `weight_copies` when given (FP8WeightCopies); with the family's biases gate_up_bias [E, N1] and
    down_bias [E, H].

    Raises:
        ValueError: a linear expert (no fc1 to quantise).
    """
    x, topk_weights = x.contiguous(), topk_weights.float().contiguous()
    b1 = None if gate_up_bias is None else gate_up_bias.contiguous()
    b2 = None if down_bias is None else down_bias.contiguous()
    leaves = (x, topk_weights, gate_up_proj.contiguous(), down_proj.contiguous(), b1, b2)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)):
        # no backward: nothing saved, and no transposed weight copies made for one
        return fp8_experts_forward(*leaves[:4], schedule, recipe, family, b1, b2, weight_copies=weight_copies)
    return _FP8Experts.apply(*leaves, schedule, recipe, family, weight_copies)
