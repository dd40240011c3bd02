"""The Triton backend's entry point: its custom ops, their fakes and the autograd wiring.

Owns: `moe_experts` (same signature as `reference.moe_experts_reference`), the ops, and which
tensors are saved for backward: x, the routing weights, both weights, the schedule and the
pre-activation h [R_pad, N1] (N1 = 2I for a glu expert, I for an mlp; a linear expert's gathered
input rows; at small batches one row per (token, k) pair, below). The down-projection output is
not saved; A = act(h) is recomputed in the backward's dgrad epilogue. The expert family reaches
the kernels as scalars (activation, gated, clamp, offset); the biases as optional tensors, their
gradients from `expert_bias_grad` in fixed row order.

Two kernel variants sit behind the ops; `kernel_variant` picks one.
- multi_kernel (one launch per GEMM): two autograd nodes. `expert_up_fwd` (x -> h, A) and
  `expert_down_fwd` (A -> routed output; h is its input so that its backward, which needs h, hands
  dh back). Autograd runs the down node's backward first and then releases the saved h, so the
  up node's weight gradient (the backward's memory peak) runs without it: mixtral-8x7b's
  h is 0.95 GiB.
- megakernel (one persistent launch per pass): `moe_experts_fwd` / `moe_experts_bwd`, one node;
  bias-free SwiGLU only.
- a linear expert (one H x H linear) is `expert_gather_rows` (x rows in schedule order, its
  backward a k-ordered combine) into the down node, with activation "identity".

The ops are opaque `torch.library.custom_op`s with fake implementations: `torch.compile` with
`fullgraph=True` treats them as single nodes of exact shape, and nothing in them synchronises the
host, so a CUDA graph can capture them. Outside torch.compile `moe_experts` runs the same functions
through plain autograd.Functions (`_autograd`), without the dispatcher's per-call host cost.

Small batches keep h and dh one row per (token, k) pair between the two nodes (`compact_h`): the
schedule's static row bound is mostly padding there (T = 37 with qwen3-30b-a3b's dimensions:
16,640 rows for 296 pairs), and dh's padded rows, alive at dW13's allocation (the backward's
peak), account by their size for MoK's peak above the PyTorch path's there (BENCHMARKS.md, "Small
batches' peak memory"). The kernels store and read them at row row_to_tk[r] (`tiles.h_rows_of`);
dW13 and the fc1 bias gradient read the pairs through row_to_tk. The same products in the same
order: the same bits as the padded layout.

Under `wgrad.deferring(queue)` (Megatron's --delay-wgrad-compute) the multi-kernel nodes' backward
computes dx, dh and the routing-weight gradient and records the weight and bias gradients in the
queue, with the same kernels on the same inputs; the megakernel's single pass computes them at once.

Does not own: kernel math (kernels/), routing or the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily, check_expert_weights
from mok_plugin.kernels.combine import combine_rows, reduce_router_grad
from mok_plugin.kernels.grouped_mlp import (
    down_dgrad,
    down_fwd,
    expert_bias_grad,
    expert_wgrad,
    gate_up_dgrad,
    gate_up_fwd,
    pair_wgrad_hopper,
)
from mok_plugin.kernels.megakernel import backward_megakernel, forward_megakernel
from mok_plugin.kernels.schedule import row_values, schedule_maps
from mok_plugin.schedule import MoKSchedule, gather_rows_or_zeros, max_padded_rows
from mok_plugin.wgrad import note_deferral

__all__ = ["moe_experts", "schedule_maps_op"]


# ---- eager calls: the ops' own functions, without the dispatcher ------------------------------
# A custom op's call passes through the dispatcher's Python layers (its autograd wrapper, argument
# defaults, aliasing checks): on the H200's host about 0.5 ms a call, four calls a layer's forward
# and backward, more than the GPU work at small T (T = 1..512 with qwen3-30b-a3b's dimensions:
# 3.0 ms of host time per fwd+bwd against 1.5 ms of kernels). Outside torch.compile, moe_experts
# runs each op's function in a plain autograd.Function with the op's own setup_context and
# backward (`ctx.eager` tells the backward to call the backward ops' functions the same way);
# under torch.compile it calls the ops, opaque nodes with fakes. Both run the same kernels.

_FUNCTIONS: dict[object, Callable] = {}


def _op(name: str) -> Callable:
    """torch.library.custom_op("mok_plugin::<name>"), its function kept for eager calls."""

    def register(fn: Callable):
        op = torch.library.custom_op(f"mok_plugin::{name}", mutates_args=())(fn)
        _FUNCTIONS[op] = fn
        return op

    return register


def _call(op, eager: bool) -> Callable:
    """The op (under torch.compile) or its function (eager)."""
    return _FUNCTIONS[op] if eager else op


def _autograd(op, setup_context: Callable, backward: Callable) -> Callable:
    """Register op's autograd formula; return the eager twin's `apply`: an autograd.Function that
    runs op's function with the same setup_context and backward."""

    def setup_op(ctx, inputs, output):
        ctx.eager = False
        setup_context(ctx, inputs, output)

    torch.library.register_autograd(op, backward, setup_context=setup_op)
    function = _FUNCTIONS[op]

    class Eager(torch.autograd.Function):
        # forward(ctx, ...), not a separate setup_context: Function.apply would then bind the
        # arguments through inspect.signature on every call.
        @staticmethod
        def forward(ctx, *args):  # type: ignore[override]
            output = function(*args)
            ctx.eager = True
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):  # type: ignore[override]
            return backward(ctx, *grads)

    Eager.__name__ = Eager.__qualname__ = f"Eager_{function.__name__}"
    return Eager.apply


def _row_weights(topk_weights: torch.Tensor, row_to_tk: torch.Tensor) -> torch.Tensor:
    """fp32 [R_pad]: the routing weight of each row, 0 on padding rows (for the fc2 bias gradient;
    the GEMM kernels read the weights through row_to_tk themselves)."""
    return row_values(topk_weights, row_to_tk)


# ---- the schedule under torch.compile -----------------------------------------------------------
# `schedule.build_schedule` calls this op while dynamo traces (eagerly, `schedule_maps` itself).
# Traced into, the schedule's kernels became inductor's Triton-kernel wrappers, whose decomposition
# asserted in inductor's pattern matcher once the token count was symbolic (a layer compiled at a
# second token count; torch 2.11, H200). As an opaque op it is one node at any token count.


@_op("schedule_maps")
def schedule_maps_op(
    topk_ids: torch.Tensor, num_experts: int, tile_m: int, capacity: int | None, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.schedule.schedule_maps`, each map in a buffer of its own (an op's outputs may not
    alias one another). Raises ValueError when num_rows cannot hold the padded rows (the kernels
    would write past the maps)."""
    bound = max_padded_rows(topk_ids.numel(), num_experts, tile_m, capacity)
    if num_rows % tile_m or num_rows < bound:
        raise ValueError(f"num_rows={num_rows} must be a multiple of tile_m={tile_m} and at least {bound}")
    return tuple(schedule_maps(topk_ids, num_experts, tile_m, capacity, num_rows, one_allocation=False))


@schedule_maps_op.register_fake
def _(topk_ids, num_experts, tile_m, capacity, num_rows):
    def maps(*sizes):
        return [topk_ids.new_empty(size, dtype=torch.int64) for size in sizes]

    pairs = topk_ids.shape[0] * topk_ids.shape[1]
    # (tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert, num_dropped)
    return tuple(maps(num_experts, num_experts + 1, num_rows, num_rows, pairs, num_rows // tile_m, ()))


# ---- megakernel variant: one node, one persistent launch per pass ----------------------------


@_op("moe_experts_fwd")
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts forward (megakernel). Returns (out [T, H], h [R_pad, 2I] saved for backward).

    expert_offsets and tokens_per_expert are unused here; they are inputs so that autograd saves
    them for the weight gradients."""
    K = topk_weights.shape[1]
    return forward_megakernel(
        x, gate_up_proj, down_proj, topk_weights, row_to_tk, row_to_token, tile_to_expert, tk_to_row, tile_m, K
    )


@moe_experts_fwd.register_fake
def _(x, topk_weights, gate_up_proj, down_proj, row_to_token, *schedule_and_tile):
    return x.new_empty(x.shape), x.new_empty(row_to_token.shape[0], gate_up_proj.shape[1])


@_op("moe_experts_bwd")
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed experts backward (megakernel). Returns (d_x [T, H], d_topk_weights [T, K], d_gate_up, d_down)."""
    K = topk_weights.shape[1]
    d_x, d_topk_weights, d_gate_up, d_down = backward_megakernel(
        d_out.contiguous(), x, gate_up_proj, down_proj, h, topk_weights, row_to_tk, row_to_token, tile_to_expert,
        tk_to_row,
        expert_offsets, tokens_per_expert, tile_m, K,
    )  # fmt: skip
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
    *tensors, tile_m = inputs
    ctx.tile_m = tile_m
    ctx.save_for_backward(*tensors, output[1])


def _backward(ctx, d_out, _d_h):
    x, topk_weights, gate_up_proj, down_proj, *schedule, h = ctx.saved_tensors
    d_x, d_w, d_gate_up, d_down = _call(moe_experts_bwd, ctx.eager)(
        d_out, x, topk_weights, gate_up_proj, down_proj, h, *schedule, ctx.tile_m
    )
    return d_x, d_w, d_gate_up, d_down, None, None, None, None, None, None, None


_moe_experts_fwd_eager = _autograd(moe_experts_fwd, _setup_context, _backward)


# ---- multi-kernel variant, node 1 of 2: x -> (h, A) -----------------------------------------
# The family travels as scalars (ops take no config objects): activation, gated, clamp, offset.

# h and dh go between the nodes one row per (token, k) pair where the schedule's row bound is at
# least this many times the pairs (see the module docstring): the small batches.
COMPACT_H_MIN_RATIO = 2


def compact_h(num_rows: int, num_pairs: int) -> bool:
    """Whether h and dh travel one row per pair (from sizes only: no host sync)."""
    return num_rows >= COMPACT_H_MIN_RATIO * max(num_pairs, 1)


def _is_compact(h_or_dh: torch.Tensor, row_to_token: torch.Tensor) -> bool:
    return h_or_dh.shape[0] != row_to_token.shape[0]  # R_pad > T * K always (at least one tile more)


@_op("expert_up_fwd")
def expert_up_fwd(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    row_to_token: torch.Tensor,
    row_to_tk: torch.Tensor,
    tk_to_row: torch.Tensor,
    tile_to_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tile_m: int,
    top_k: int,
    activation: str,
    gated: bool,
    clamp: float | None,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [R_pad, N1], or [T * K, N1] one row per pair where `compact_h`; A [R_pad, I]) of the
    gathered x rows (N1 = 2I gated, else I). The schedule tensors that only the backward reads are
    inputs so that autograd saves them; top_k is passed, not derived from tk_to_row's length,
    because T can be 0 (an expert-parallel rank that receives no rows)."""
    pairs = tk_to_row.shape[0]
    return gate_up_fwd(
        x, gate_up_proj, row_to_token, tile_to_expert, tile_m, gate_up_bias=gate_up_bias, activation=activation,
        gated=gated, clamp=clamp, offset=offset,
        h_pairs=(row_to_tk, pairs) if compact_h(row_to_token.shape[0], pairs) else None,
    )  # fmt: skip


@expert_up_fwd.register_fake
def _(x, gate_up_proj, gate_up_bias, row_to_token, row_to_tk, tk_to_row, *schedule_and_family):
    gated = schedule_and_family[-3]
    rows, n1 = row_to_token.shape[0], gate_up_proj.shape[1]
    h_rows = tk_to_row.shape[0] if compact_h(rows, tk_to_row.shape[0]) else rows
    return x.new_empty(h_rows, n1), x.new_empty(rows, n1 // 2 if gated else n1)


@_op("expert_up_bwd")
def expert_up_bwd(
    d_h: torch.Tensor,
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    row_to_token: torch.Tensor,
    row_to_tk: torch.Tensor,
    tk_to_row: torch.Tensor,
    tile_to_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tile_m: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_x [T, H]: each token's K rows summed in k order, d_gate_up [E, N1, H]) from dh (rows,
    or one per pair)."""
    d_x = _up_data_grad(d_h, x, gate_up_proj, row_to_token, row_to_tk, tk_to_row, tile_to_expert, tile_m, top_k)
    return d_x, _up_weight_grad(
        d_h, x, row_to_token, row_to_tk, tile_to_expert, expert_offsets, tokens_per_expert, tile_m, top_k
    )


def _up_data_grad(d_h, x, gate_up_proj, row_to_token, row_to_tk, tk_to_row, tile_to_expert, tile_m: int, top_k: int):
    pair_map = row_to_tk if _is_compact(d_h, row_to_token) else None
    d_rows = gate_up_dgrad(d_h, gate_up_proj, row_to_token, tile_to_expert, tile_m, d_h_row_to_pair=pair_map)
    return combine_rows(d_rows, tk_to_row, x.shape[0], top_k)


def _up_weight_grad(
    d_h, x, row_to_token, row_to_tk, tile_to_expert, expert_offsets, tokens_per_expert, tile_m: int, top_k: int
):
    if _is_compact(d_h, row_to_token):
        # On Hopper, where it fits the memory of the per-pair path below: Gluon's kernel over dh and
        # x copied into row order a column block at a time (4096,7168,2048,384,8: BENCHMARKS.md)
        d_w = pair_wgrad_hopper(
            d_h, x, row_to_token, row_to_tk, tile_to_expert, expert_offsets, tokens_per_expert, tile_m
        )
        if d_w is not None:
            return d_w
        # elsewhere dh one row per pair, read through row_to_tk row by row in the schedule's order, as
        # the padded layout reads it, and x through row_to_tk // top_k (pair t * K + k is token t's):
        # the same rows as a copy of x per pair, without the copy (0.02 ms of the GPU's 1.28 at
        # T = 512, H200) and its allocation
        return expert_wgrad(d_h, x, row_to_tk, expert_offsets, tokens_per_expert, left_by_token=True,
                            right_by_token=True, segment_align=tile_m, right_index_divisor=top_k)  # fmt: skip
    return expert_wgrad(d_h, x, row_to_token, expert_offsets, tokens_per_expert, left_by_token=False,
                        right_by_token=True, segment_align=tile_m)  # fmt: skip


@expert_up_bwd.register_fake
def _(d_h, x, gate_up_proj, *schedule_and_tile):
    return x.new_empty(x.shape), gate_up_proj.new_empty(gate_up_proj.shape)


@_op("expert_bias_grad")
def expert_bias_grad_op(
    src: torch.Tensor,
    scale: torch.Tensor | None,
    row_to_token: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    by_token: bool,
) -> torch.Tensor:
    """[E, N]: per expert, the sum over its rows of scale * src rows, in ascending row order."""
    return expert_bias_grad(src, row_to_token, expert_offsets, tokens_per_expert, by_token=by_token, scale=scale)


@expert_bias_grad_op.register_fake
def _(src, scale, row_to_token, expert_offsets, tokens_per_expert, by_token):
    return src.new_empty(tokens_per_expert.shape[0], src.shape[1])


def _setup_up(ctx, inputs, output):
    x, gate_up_proj, gate_up_bias, *schedule, tile_m, top_k, _act, _gated, _clamp, _offset = inputs
    ctx.tile_m, ctx.top_k, ctx.has_bias = tile_m, top_k, gate_up_bias is not None
    note_deferral(ctx, gate_up_proj, gate_up_bias)
    ctx.save_for_backward(x, gate_up_proj, *schedule)
    # A gets no gradient (the down node returns dh for h instead): leave it None rather than have
    # autograd allocate zeros [R_pad, I] for it at the backward's peak.
    ctx.set_materialize_grads(False)


def _backward_up(ctx, d_h, _d_a):
    x, gate_up_proj, *schedule = ctx.saved_tensors
    row_to_token, row_to_tk, tk_to_row, tile_to_expert, expert_offsets, tokens_per_expert = schedule
    has_bias, tile_m, top_k = ctx.has_bias, ctx.tile_m, ctx.top_k
    if ctx.deferral is not None:  # --delay-wgrad-compute: dW1 (and db1) in backward_dw (wgrad.py)
        d_x = _up_data_grad(d_h, x, gate_up_proj, row_to_token, row_to_tk, tk_to_row, tile_to_expert, tile_m, top_k)

        def weight_grads():
            d_bias = None
            if has_bias:
                d_bias = _up_bias_grad(ctx.eager, d_h, row_to_token, row_to_tk, expert_offsets, tokens_per_expert)
            d_gate_up = _up_weight_grad(d_h, x, row_to_token, row_to_tk, tile_to_expert, expert_offsets,
                                        tokens_per_expert, tile_m, top_k)  # fmt: skip
            return d_gate_up, d_bias

        ctx.deferral.add(weight_grads, ctx.weights)
        return (d_x, None, None) + (None,) * 12
    d_x, d_gate_up = _call(expert_up_bwd, ctx.eager)(d_h, x, gate_up_proj, *schedule, tile_m, top_k)
    d_bias = None
    if has_bias:
        d_bias = _up_bias_grad(ctx.eager, d_h, row_to_token, row_to_tk, expert_offsets, tokens_per_expert)
    return (d_x, d_gate_up, d_bias) + (None,) * 12


def _up_bias_grad(eager: bool, d_h, row_to_token, row_to_tk, expert_offsets, tokens_per_expert):
    """db1 [E, N1]: per expert, the sum over its rows of dh (ascending row order), read through
    row_to_tk when dh is one row per pair."""
    compact = _is_compact(d_h, row_to_token)
    rows_map = row_to_tk if compact else row_to_token
    return _call(expert_bias_grad_op, eager)(d_h, None, rows_map, expert_offsets, tokens_per_expert, compact)


_expert_up_fwd_eager = _autograd(expert_up_fwd, _setup_up, _backward_up)


# ---- a linear expert's input: x -> its rows in schedule order ----------------------------------


@_op("expert_gather_rows")
def expert_gather_rows(
    x: torch.Tensor, row_to_token: torch.Tensor, tk_to_row: torch.Tensor, top_k: int
) -> torch.Tensor:
    """[R_pad, H]: x[row_to_token[r]] per row, zeros on padding rows (a linear expert's A and h).
    Its backward sums each token's K row gradients in k order (`combine_rows`), never an atomic
    scatter."""
    return gather_rows_or_zeros(x, row_to_token)


@expert_gather_rows.register_fake
def _(x, row_to_token, tk_to_row, top_k):
    return x.new_empty(row_to_token.shape[0], x.shape[1])


def _setup_gather(ctx, inputs, output):
    x, _row_to_token, tk_to_row, top_k = inputs
    ctx.num_tokens, ctx.top_k = x.shape[0], top_k
    ctx.save_for_backward(tk_to_row)


def _backward_gather(ctx, d_rows):
    (tk_to_row,) = ctx.saved_tensors
    return combine_rows(d_rows.contiguous(), tk_to_row, ctx.num_tokens, ctx.top_k), None, None, None


_expert_gather_rows_eager = _autograd(expert_gather_rows, _setup_gather, _backward_gather)


# ---- multi-kernel variant, node 2 of 2: A -> routed output (h in, for the backward) ------------


@_op("expert_down_fwd")
def expert_down_fwd(
    h: torch.Tensor,
    a: torch.Tensor,
    topk_weights: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor | None,
    row_to_token: torch.Tensor,
    row_to_tk: torch.Tensor,
    tk_to_row: torch.Tensor,
    tile_to_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tile_m: int,
    activation: str,
    gated: bool,
    clamp: float | None,
    offset: float,
) -> torch.Tensor:
    """out [T, H] = per token, sum over k in order of w_tk * (A[row] W2_e^T + b2_e). h is not read
    here: it is an input so that this node's backward (the activation's gradient needs h) returns
    dh to the up node; the family scalars are for that backward."""
    T, K = topk_weights.shape
    y = down_fwd(a, down_proj, topk_weights, row_to_tk, row_to_token, tile_to_expert, tile_m, down_bias=down_bias)
    return combine_rows(y, tk_to_row, T, K)


@expert_down_fwd.register_fake
def _(h, a, topk_weights, down_proj, *rest):
    return a.new_empty(topk_weights.shape[0], down_proj.shape[1])


@_op("expert_down_bwd")
def expert_down_bwd(
    d_out: torch.Tensor,
    h: torch.Tensor,
    topk_weights: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor | None,
    row_to_token: torch.Tensor,
    row_to_tk: torch.Tensor,
    tk_to_row: torch.Tensor,
    tile_to_expert: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    tile_m: int,
    activation: str,
    gated: bool,
    clamp: float | None,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [R_pad, N1], d_topk_weights [T, K], d_down [E, H, I]): the dgrad GEMM with the router
    partial <dA', A> and the activation's gradient in its epilogue (plus <dO, b2> with the fc2
    bias), then dW2 from the w*A rows it wrote."""
    d_out = d_out.contiguous()
    d_h, d_topk_weights, a_weighted = _down_data_grads(
        d_out, h, topk_weights, down_proj, down_bias, row_to_token, row_to_tk, tk_to_row, tile_to_expert, tile_m,
        activation, gated, clamp, offset,
    )  # fmt: skip
    return d_h, d_topk_weights, _down_weight_grad(d_out, a_weighted, row_to_token, expert_offsets, tokens_per_expert,
                                                  tile_m)  # fmt: skip


def _down_data_grads(d_out, h, topk_weights, down_proj, down_bias, row_to_token, row_to_tk, tk_to_row, tile_to_expert,
                     tile_m: int, activation: str, gated: bool, clamp: float | None, offset: float):  # fmt: skip
    """(dh, d_topk_weights, the w*A rows dW2 is made from) of the down node's backward; dh one row
    per pair where h came so (`compact_h`: the kernels read and write them through row_to_tk)."""
    T, K = topk_weights.shape
    d_h, a_weighted, partial = down_dgrad(
        d_out, down_proj, h, topk_weights, row_to_tk, row_to_token, tile_to_expert, tile_m, down_bias=down_bias,
        activation=activation,
        gated=gated, clamp=clamp, offset=offset,
    )  # fmt: skip
    d_topk_weights = reduce_router_grad(partial, tk_to_row, T, K)
    return d_h, d_topk_weights.to(topk_weights.dtype), a_weighted


def _down_weight_grad(d_out, a_weighted, row_to_token, expert_offsets, tokens_per_expert, tile_m: int):
    return expert_wgrad(d_out, a_weighted, row_to_token, expert_offsets, tokens_per_expert, left_by_token=True,
                        right_by_token=False, segment_align=tile_m)  # fmt: skip


@expert_down_bwd.register_fake
def _(d_out, h, topk_weights, down_proj, *rest):
    return h.new_empty(h.shape), topk_weights.new_empty(topk_weights.shape), down_proj.new_empty(down_proj.shape)


def _setup_down(ctx, inputs, output):
    h, _a, topk_weights, down_proj, down_bias, *schedule, tile_m, act, gated, clamp, offset = inputs
    ctx.tile_m, ctx.family = tile_m, (act, gated, clamp, offset)
    ctx.has_bias = down_bias is not None
    note_deferral(ctx, down_proj, down_bias)
    ctx.save_for_backward(h, topk_weights, down_proj, down_bias, *schedule)


def _backward_down(ctx, d_out):
    h, topk_weights, down_proj, down_bias, *schedule = ctx.saved_tensors
    row_to_token, row_to_tk, tk_to_row, tile_to_expert, expert_offsets, tokens_per_expert = schedule
    d_out, has_bias, tile_m = d_out.contiguous(), ctx.has_bias, ctx.tile_m
    if ctx.deferral is not None:  # --delay-wgrad-compute: dW2 (and db2) in backward_dw (wgrad.py)
        d_h, d_topk_weights, a_weighted = _down_data_grads(
            d_out, h, topk_weights, down_proj, down_bias, row_to_token, row_to_tk, tk_to_row, tile_to_expert, tile_m,
            *ctx.family,
        )  # fmt: skip

        def weight_grads():
            d_down = _down_weight_grad(d_out, a_weighted, row_to_token, expert_offsets, tokens_per_expert, tile_m)
            if not has_bias:
                return d_down, None
            return d_down, _down_bias_grad(ctx.eager, d_out, topk_weights, row_to_tk, row_to_token, expert_offsets,
                                           tokens_per_expert)  # fmt: skip

        ctx.deferral.add(weight_grads, ctx.weights)
        return (d_h, None, d_topk_weights, None, None) + (None,) * 11
    d_h, d_topk_weights, d_down = _call(expert_down_bwd, ctx.eager)(
        d_out, h, topk_weights, down_proj, down_bias, *schedule, tile_m, *ctx.family
    )
    d_bias = None
    if has_bias:
        d_bias = _down_bias_grad(ctx.eager, d_out, topk_weights, row_to_tk, row_to_token, expert_offsets,
                                 tokens_per_expert)  # fmt: skip
    return (d_h, None, d_topk_weights, d_down, d_bias) + (None,) * 11


def _down_bias_grad(eager: bool, d_out, topk_weights, row_to_tk, row_to_token, expert_offsets, tokens_per_expert):
    """db2 [E, H]: per expert, the sum over its rows of w * dO (ascending row order)."""
    w_rows = _row_weights(topk_weights, row_to_tk)
    return _call(expert_bias_grad_op, eager)(d_out, w_rows, row_to_token, expert_offsets, tokens_per_expert, True)


_expert_down_fwd_eager = _autograd(expert_down_fwd, _setup_down, _backward_down)


def moe_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor | None,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    variant: str = "multi_kernel",
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output for every token (Triton backend); same contract as
    `reference.moe_experts_reference`.

    Args:
        x: [T, H] in the params dtype.
        topk_weights: fp32 [T, K].
        gate_up_proj: [E, N1, H] (None for a linear expert); down_proj: [E, H, I].
        schedule: from `build_schedule` with a tile_m that the kernels' BLOCK_M divides.
        variant: "megakernel" (one persistent launch per pass; bias-free SwiGLU only) or
            "multi_kernel" (one launch per GEMM); both run the same tile functions.
        family, gate_up_bias, down_bias: what the experts compute (experts.py).
    Returns:
        [T, H] in x's dtype.
    """
    check_expert_weights(family, gate_up_proj, down_proj, gate_up_bias, down_bias)
    x, topk_weights = x.contiguous(), topk_weights.float().contiguous()
    down_proj = down_proj.contiguous()
    s = schedule
    eager = not torch.compiler.is_compiling()  # the ops' functions directly (see _autograd)
    if _megakernel(variant):
        if not family.is_swiglu:
            raise ValueError(f"kernel_variant='megakernel' computes bias-free SwiGLU only, not {family.describe()}")
        out, _ = (_moe_experts_fwd_eager if eager else moe_experts_fwd)(
            x, topk_weights, gate_up_proj.contiguous(), down_proj, s.row_to_token, s.row_to_tk, s.tk_to_row,
            s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, s.tile_m,
        )  # fmt: skip
        return out
    b1 = None if gate_up_bias is None else gate_up_bias.contiguous()
    b2 = None if down_bias is None else down_bias.contiguous()
    act = (family.activation, family.gated, family.clamp, family.linear_offset)
    if family.kind == "linear":
        h = a = (_expert_gather_rows_eager if eager else expert_gather_rows)(x, s.row_to_token, s.tk_to_row, s.top_k)
        act = ("identity", False, None, 0.0)
    else:
        h, a = (_expert_up_fwd_eager if eager else expert_up_fwd)(
            x, gate_up_proj.contiguous(), b1, s.row_to_token, s.row_to_tk, s.tk_to_row, s.tile_to_expert,
            s.expert_offsets, s.tokens_per_expert, s.tile_m, s.top_k, *act,
        )  # fmt: skip
    return (_expert_down_fwd_eager if eager else expert_down_fwd)(
        h, a, topk_weights, down_proj, b2, s.row_to_token, s.row_to_tk, s.tk_to_row, s.tile_to_expert,
        s.expert_offsets, s.tokens_per_expert, s.tile_m, *act,
    )  # fmt: skip


def _megakernel(variant: str) -> bool:
    if variant not in ("megakernel", "multi_kernel"):
        raise ValueError(f"kernel_variant={variant!r}; allowed: 'megakernel', 'multi_kernel'")
    return variant == "megakernel"
