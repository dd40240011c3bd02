"""The Triton backend's entry point: custom ops `mok_plugin::moe_experts_fwd` / `_bwd`, their fakes
and the autograd wiring.

Owns: `moe_experts` (same signature as `reference.moe_experts_reference`), the two ops, and which
tensors are saved for backward: x, the routing weights, both weights, the schedule and the
pre-activation h [R_pad, 2I]. The down-projection output is not saved; A = SwiGLU(h) is recomputed
in the backward's dgrad epilogue.

Two kernel variants sit behind the ops: the persistent megakernel (one launch per pass) and the
multi-kernel one (one launch per GEMM); `kernel_variant` picks one.

The ops are opaque `torch.library.custom_op`s with fake implementations: `torch.compile` with
`fullgraph=True` treats them as single nodes of exact shape, and nothing in them synchronises the
host, so a CUDA graph can capture them.

Does not own: kernel math (kernels/), routing or the schedule.
"""

from __future__ import annotations

import torch

from mok_plugin.kernels.combine import combine_rows, reduce_router_grad
from mok_plugin.kernels.grouped_mlp import down_dgrad, down_fwd, expert_wgrad, gate_up_dgrad, gate_up_fwd
from mok_plugin.kernels.megakernel import backward_megakernel, forward_megakernel
from mok_plugin.schedule import MoKSchedule, values_per_row

__all__ = ["moe_experts"]


def _row_weights(topk_weights: torch.Tensor, row_to_tk: torch.Tensor) -> torch.Tensor:
    """fp32 [R_pad]: the routing weight of each row, 0 on padding rows."""
    return values_per_row(topk_weights, row_to_tk).float().contiguous()


@torch.library.custom_op("mok_plugin::moe_experts_fwd", mutates_args=())
def moe_experts_fwd(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    row_to_token: torch.Tensor,
    row_to_tk: torch.Tensor,
    tk_to_row: torch.Tensor,
    tile_to_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tile_m: int,
    megakernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts forward. Returns (out [T, H], h [R_pad, 2I] saved for backward).

    expert_offsets and tokens_per_expert are unused here; they are inputs so that autograd saves
    them for the weight gradients."""
    T, K = topk_weights.shape
    w_rows = _row_weights(topk_weights, row_to_tk)
    if megakernel:
        return forward_megakernel(
            x, gate_up_proj, down_proj, w_rows, row_to_token, tile_to_expert, tk_to_row, tile_m, K
        )
    h, a = gate_up_fwd(x, gate_up_proj, row_to_token, tile_to_expert, tile_m)
    y = down_fwd(a, down_proj, w_rows, row_to_token, tile_to_expert, tile_m)
    return combine_rows(y, tk_to_row, T, K), h


@moe_experts_fwd.register_fake
def _(x, topk_weights, gate_up_proj, down_proj, row_to_token, *schedule_and_tile):
    out = x.new_empty(x.shape)
    h = x.new_empty(row_to_token.shape[0], gate_up_proj.shape[1])
    return out, h


@torch.library.custom_op("mok_plugin::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(
    d_out: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    h: torch.Tensor,
    row_to_token: torch.Tensor,
    row_to_tk: torch.Tensor,
    tk_to_row: torch.Tensor,
    tile_to_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tile_m: int,
    megakernel: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed experts backward. Returns (d_x [T, H], d_topk_weights fp32 [T, K], d_gate_up, d_down)."""
    T, K = topk_weights.shape
    d_out = d_out.contiguous()
    w_rows = _row_weights(topk_weights, row_to_tk)
    if megakernel:
        d_x, d_topk_weights, d_gate_up, d_down = backward_megakernel(
            d_out, x, gate_up_proj, down_proj, h, w_rows, row_to_token, tile_to_expert, tk_to_row, expert_offsets,
            tokens_per_expert, tile_m, K,
        )  # fmt: skip
        return d_x, d_topk_weights.to(topk_weights.dtype), d_gate_up, d_down
    d_h, a_weighted, partial = down_dgrad(d_out, down_proj, h, w_rows, row_to_token, tile_to_expert, tile_m)
    d_topk_weights = reduce_router_grad(partial, tk_to_row, T, K)
    del partial
    segments = (row_to_token, expert_offsets, tokens_per_expert)
    down = {"left_by_token": True, "right_by_token": False, "segment_align": tile_m}
    # The order only moves the peak (every output is computed the same way). Usually the w*A rows
    # [R_pad, I] are smaller than dW2 [E, H, I]: then dX and dW13 go first and dh [R_pad, 2I] is
    # freed before dW2 is allocated (deepseek-v3: -0.5 GB). Otherwise dW2 first frees w*A early.
    down_first = row_to_token.shape[0] > down_proj.shape[0] * down_proj.shape[1]
    if down_first:
        d_down = expert_wgrad(d_out, a_weighted, *segments, **down)
        del a_weighted
    d_x = combine_rows(gate_up_dgrad(d_h, gate_up_proj, row_to_token, tile_to_expert, tile_m), tk_to_row, T, K)
    d_gate_up = expert_wgrad(d_h, x, *segments, left_by_token=False, right_by_token=True, segment_align=tile_m)
    del d_h
    if not down_first:
        d_down = expert_wgrad(d_out, a_weighted, *segments, **down)
    return d_x, d_topk_weights.to(topk_weights.dtype), d_gate_up, d_down


@moe_experts_bwd.register_fake
def _(d_out, x, topk_weights, gate_up_proj, down_proj, h, *schedule_and_tile):
    return (
        x.new_empty(x.shape),
        topk_weights.new_empty(topk_weights.shape),
        gate_up_proj.new_empty(gate_up_proj.shape),
        down_proj.new_empty(down_proj.shape),
    )


def _setup_context(ctx, inputs, output):
    *tensors, tile_m, megakernel = inputs
    ctx.tile_m = tile_m
    ctx.megakernel = megakernel
    ctx.save_for_backward(*tensors, output[1])


def _backward(ctx, d_out, _d_h):
    x, topk_weights, gate_up_proj, down_proj, *schedule, h = ctx.saved_tensors
    d_x, d_w, d_gate_up, d_down = moe_experts_bwd(
        d_out, x, topk_weights, gate_up_proj, down_proj, h, *schedule, ctx.tile_m, ctx.megakernel
    )
    return d_x, d_w, d_gate_up, d_down, None, None, None, None, None, None, None, None


torch.library.register_autograd("mok_plugin::moe_experts_fwd", _backward, setup_context=_setup_context)


def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    variant: str = "multi_kernel",
) -> torch.Tensor:
    """The routed experts' output for every token (Triton backend); same contract as
    `reference.moe_experts_reference`.

    Args:
        x: [T, H] in the params dtype.
        topk_weights: fp32 [T, K].
        gate_up_proj: [E, 2I, H]; down_proj: [E, H, I].
        schedule: from `build_schedule` with a tile_m that the kernels' BLOCK_M divides.
        variant: "megakernel" (one persistent launch per pass) or "multi_kernel" (one launch per
            GEMM); both run the same tile functions.
    Returns:
        [T, H] in x's dtype.
    """
    out, _ = moe_experts_fwd(
        x.contiguous(),
        topk_weights.float().contiguous(),
        gate_up_proj.contiguous(),
        down_proj.contiguous(),
        schedule.row_to_token,
        schedule.row_to_tk,
        schedule.tk_to_row,
        schedule.tile_to_expert,
        schedule.expert_offsets,
        schedule.tokens_per_expert,
        schedule.tile_m,
        _megakernel(variant),
    )
    return out


def _megakernel(variant: str) -> bool:
    if variant not in ("megakernel", "multi_kernel"):
        raise ValueError(f"kernel_variant={variant!r}; allowed: 'megakernel', 'multi_kernel'")
    return variant == "megakernel"
