"""Expert-parallel dispatch and combine over torch.distributed, in an order that does not depend on
the number of ranks.

Glossary: W ranks in the expert-parallel group; rank r owns the E_l = E / W experts
[r*E_l, (r+1)*E_l). A *pair* is one routed (token, k); a rank's pairs are sent *expert-major*:
sorted by global expert (so by destination rank), then by local (token, k).

What one forward does, on every rank:
    1. count pairs per destination rank and exchange the counts (all_to_all_single on [W] ints);
    2. read the counts on the host (the one synchronisation of the layer, see below) to size the
       exchange, and send each pair's token row, routing weight and local expert id to its owner;
    3. the owner receives blocks in source-rank order, each block expert-major in the source's
       (token, k) order, and runs its local experts on them with the same schedule code as the
       single-process layer: within an expert, rows are in (source rank, local token, k) order,
       which is global token order because the global batch is rank-major;
    4. results go back by the inverse exchange; each source sums its token's K rows in ascending k
       in fp32 and rounds once, exactly as the single-process combine does.
The backward mirrors it through the differentiable `torch.distributed.nn.functional` collectives;
the gradient of the row gather is the same fixed-order sum over k (not an index_add, whose order
and bf16 accumulation would differ from the single-process layer).

Why the result is bitwise the same for every W: each expert sees the same rows in the same order
with the same tile padding, so every per-expert GEMM and weight-gradient reduction adds the same
floats in the same order; the sums over k run on the token's own rank in the same order.

Known gap: the shared experts (a dense SwiGLU on each rank's own tokens) and the replicated router
are plain GEMMs over the rank's batch; a GEMM library may round a row differently when the batch
size changes. The router computes in fp64 and rounds to fp32, which hides that in practice; the
shared experts do not yet, so with shared experts the layer is topology-invariant only as far as
the dense GEMM is batch-invariant.

Barriers and host synchronisation: the counts exchange is a collective every rank joins; this
exact-size mode reads the counts on the host once per forward (and the backward reuses them), which
CUDA graphs cannot capture. A capacity-bounded mode with fixed-size buffers, which needs no host
read, is still to come.

Caller's contract: every rank of the group calls forward and backward the same number of times, in
the same order; `topk_ids` hold global expert ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from mok_plugin.reference import sum_over_k
from mok_plugin.routing import count_per_expert
from mok_plugin.schedule import MoKSchedule, build_schedule

__all__ = ["moe_experts_expert_parallel"]

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, MoKSchedule], torch.Tensor]


class _GatherPairs(torch.autograd.Function):
    """x [T, H] -> rows [R, H] in send order; backward sums each token's K rows in ascending k."""

    @staticmethod
    def forward(ctx, x, order, top_k):  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.shape = (x.shape[0], top_k, x.shape[1])
        return x[order // top_k]

    @staticmethod
    def backward(ctx, d_rows):  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return sum_over_k(_to_tk_order(d_rows, order).view(ctx.shape), d_rows.dtype), None, None


def _to_tk_order(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in send order -> rows in (token, k) order (order[i] is the tk of send row i)."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _exchange(
    t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of t with uneven splits."""
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    return dist_fn.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)


def _exchange_ints(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = t.new_empty(sum(recv_splits))
    dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
    return out


def moe_experts_expert_parallel(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    experts_fn: ExpertsFn,
    group: dist.ProcessGroup,
    num_experts: int,
    tile_m: int,
) -> torch.Tensor:
    """The routed experts' output for this rank's tokens, with the experts spread over `group`.

    Args:
        x: [T, H] this rank's tokens (T may differ between ranks, and may be 0).
        topk_ids: int [T, K] global expert ids.
        topk_weights: fp32 [T, K].
        gate_up_proj: [E_l, 2I, H] and down_proj: [E_l, H, I], this rank's experts.
        experts_fn: a backend's experts function (reference or triton), run on the received rows.
        group: the expert-parallel process group (W ranks).
        num_experts: E, all ranks together.
        tile_m: the schedule's segment padding.
    Returns:
        [T, H] in x's dtype: sum over k of w_tk * expert_k(x_t), k ascending.
    """
    W = dist.get_world_size(group)
    T, K = topk_ids.shape
    E_local = num_experts // W
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Expert-major send order; stable, so (token, k) order within an expert.
    order = torch.sort(flat, stable=True).indices
    send_counts = count_per_expert(flat.view(-1, 1) // E_local, W)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.tolist()  # host-ok: exact-size mode sizes the exchange (module docstring)
    recv_splits = recv_counts.tolist()  # host-ok: exact-size mode sizes the exchange (module docstring)

    x_recv = _exchange(_GatherPairs.apply(x, order, K), send_splits, recv_splits, group)
    w_recv = _exchange(topk_weights.reshape(-1)[order], send_splits, recv_splits, group)
    expert_recv = _exchange_ints(flat[order] % E_local, send_splits, recv_splits, group)

    # One row per received pair (K = 1 locally): the stable schedule keeps source-rank order.
    schedule = build_schedule(expert_recv.view(-1, 1), E_local, tile_m=tile_m)
    y_recv = experts_fn(x_recv, w_recv.view(-1, 1), gate_up_proj, down_proj, schedule)

    y_back = _exchange(y_recv, recv_splits, send_splits, group)
    return sum_over_k(_to_tk_order(y_back, order).view(T, K, y_back.shape[1]), x.dtype)
