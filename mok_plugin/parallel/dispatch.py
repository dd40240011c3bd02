"""Expert-parallel dispatch and combine over torch.distributed, in an order that does not depend on
the number of ranks.

Glossary: W ranks in the expert-parallel group; rank r owns the E_l = E / W experts
[r*E_l, (r+1)*E_l). A *pair* is one routed (token, k); a rank's pairs are sent *expert-major*:
sorted by global expert (so by destination rank), then by local (token, k).

What one forward does, on every rank (each stage inside a `torch.profiler.record_function` range,
`mok_plugin.ep.dispatch`, `mok_plugin.ep.experts` and `mok_plugin.ep.combine`, which profilers and
`mok bench ep` read; without a profiler each costs a few microseconds on the host and no
device work):
    1. sort the pairs expert-major and send each pair's token row, routing weight and local expert
       id to the rank that owns the expert (through fixed-size buffers, or sized by exchanged
       counts: see the two exchanges below);
    2. the owner receives blocks in source-rank order, each block expert-major in the source's
       (token, k) order, and runs its local experts on them with the same schedule code as the
       single-process layer: within an expert, rows are in (source rank, local token, k) order,
       which is global token order because the global batch is rank-major;
    3. results go back by the inverse exchange; each source sums its token's K rows in ascending k
       in fp32 and rounds once, exactly as the single-process combine does.
The backward mirrors it: each exchange's gradient goes back through the inverse exchange;
the gradient of the row gather is the same fixed-order sum over k (not an index_add, whose order
and bf16 accumulation would differ from the single-process layer).

Why the result is bitwise the same for every W: each expert sees the same rows in the same order
with the same tile padding, so every per-expert GEMM and weight-gradient reduction adds the same
floats in the same order; the sums over k run on the token's own rank in the same order.

Batch invariance of what runs on each rank's own tokens: the replicated router and the shared
experts work on the rank's batch, and a GEMM library may round a row differently when the batch
size changes. The router computes in fp64 and rounds to fp32; the shared experts run through the
row-tile kernels (triton backend) or in fp64 (reference backend). So they are batch-invariant too.

Two exchanges (`mok.ep_exchange`):
  capacity (default)  every rank sends every rank a fixed-size block of ceil(factor * T * K / W)
                      rows; empty slots carry expert -1 and get no row in the receiver's schedule.
                      No host read, so CUDA graphs can capture it. Needs the same T on every rank,
                      and no rank may send one rank more than its block holds: both are decided
                      from one all-gather of (T, most rows to one rank) with the same device-side
                      assertions on every rank, before any rows move, so every rank stops with the
                      same message (naming mok.ep_capacity_factor for an overflow).
  exact               exchanges the per-rank counts and reads them on the host once per forward
                      (the backward reuses them) to size the exchange exactly; any T per rank,
                      including 0, and ranks whose experts receive no rows.

Errors under expert parallelism: a condition that stops one rank must stop every rank before any of
them enters an exchange the others will not join. The conditions that depend on data (uneven token
counts, a capacity overflow) are decided from gathered values, identically on every rank; the
others (the transport, the group size, CUDA tensors for symmetric memory) depend only on the config
and the shapes that every rank shares, so they raise on every rank alike.
Two transports for the capacity exchange (`mok.ep_transport`): nccl (torch.distributed
all-to-all, any backend) and symmetric_memory (ranks pull blocks from peers' NVLink-mapped buffers,
symmetric.py).

Barriers: every collective here (the capacity check, the counts exchange, the row exchanges) is
joined by every rank of the group in the same order; there is no other barrier.

Caller's contract: every rank of the group calls forward and backward the same number of times, in
the same order; `topk_ids` hold global expert ids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from mok_plugin.parallel.symmetric import symmetric_all_to_all_equal
from mok_plugin.routing import count_per_expert
from mok_plugin.schedule import MoKSchedule, build_schedule, sum_over_k

__all__ = [
    "PROFILER_RANGES",
    "DispatchPlan",
    "exchange_pairs",
    "moe_experts_expert_parallel",
    "prepare_dispatch",
    "return_pairs",
    "run_received_pairs",
    "sum_returned_pairs",
]

#: The profiler ranges around the forward's stages, in the order they run.
PROFILER_RANGES = ("mok_plugin.ep.dispatch", "mok_plugin.ep.experts", "mok_plugin.ep.combine")

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


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows (splits None = equal blocks); the backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, t, send_splits, recv_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        rows = sum(recv_splits) if recv_splits is not None else t.shape[0]
        out = t.new_empty((rows, *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(d_out, recv_splits, send_splits, ctx.group), None, None, None


def _exchange(
    t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of t with uneven splits."""
    return _AllToAll.apply(t, send_splits, recv_splits, group)


def _exchange_ints(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = t.new_empty(sum(recv_splits))
    dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
    return out


def _exchange_equal(t: torch.Tensor, group: dist.ProcessGroup, transport: str = "nccl") -> torch.Tensor:
    """Differentiable all-to-all of W equal blocks of rows, through torch.distributed or by pulling
    from peers' symmetric buffers (symmetric.py)."""
    if transport == "symmetric_memory":
        return symmetric_all_to_all_equal(t, group)
    return _AllToAll.apply(t, None, None, group)


def _check_capacity_exchange(
    num_tokens: int, send_counts: torch.Tensor, slots: int, capacity_factor: float, group: dist.ProcessGroup
) -> None:
    """Decide on every rank alike, before any rank enters the row exchange, whether the capacity
    exchange can run: one all-gather of each rank's (token count, most rows it sends one rank),
    then the same two device-side assertions on every rank. No host read.

    An overflow detected only where it happens would leave the peers waiting in an exchange that
    rank never joins (a transport error, or a hang if that rank catches the error and goes on);
    decided from the gathered values, every rank raises the same message (on the CPU a
    RuntimeError, on a GPU a device-side assertion) and none enters the exchange.
    """
    mine = torch.stack([send_counts.new_tensor(num_tokens), send_counts.max()])
    every = send_counts.new_empty(dist.get_world_size(group), 2)
    dist.all_gather_into_tensor(every.view(-1), mine, group=group)
    torch._assert_async(
        (every[:, 0] == num_tokens).all(),
        "mok.ep_exchange='capacity' needs the same number of tokens on every expert-parallel rank; "
        "use ep_exchange='exact' for ranks with different token counts",
    )
    torch._assert_async(
        (every[:, 1] <= slots).all(),
        f"expert-parallel buffer overflow: a rank routes more than {slots} rows to one rank "
        f"(ceil(mok.ep_capacity_factor={capacity_factor} * T * K / ep_size)); raise mok.ep_capacity_factor "
        "or use mok.ep_exchange='exact' (every rank of the group stops here, before the exchange)",
    )


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
    capacity_factor: float | None = None,
    transport: str = "nccl",
    expert_capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' output for this rank's tokens, with the experts spread over `group`.

    Args:
        x: [T, H] this rank's tokens.
        topk_ids: int [T, K] global expert ids.
        topk_weights: fp32 [T, K].
        gate_up_proj: [E_l, 2I, H] and down_proj: [E_l, H, I], this rank's experts.
        experts_fn: a backend's experts function (reference or triton), run on the received rows.
        group: the expert-parallel process group (W ranks).
        num_experts: E, all ranks together.
        tile_m: the schedule's segment padding.
        capacity_factor: None for the exact-size exchange (one host read of the counts; any T per
            rank); otherwise the capacity exchange: each rank sends each rank at most
            ceil(capacity_factor * T * K / W) rows through fixed-size buffers, with no host read,
            and every rank must have the same T.
        transport: "nccl" (torch.distributed all-to-all, any backend) or "symmetric_memory"
            (pull from peers' NVLink buffers; capacity exchange and CUDA only).
        expert_capacity: rows one expert keeps (token dropping), None = dropless. Each expert keeps
            its first rows in global token order, exactly the rows the single-process layer keeps
            with the same capacity; a dropped pair contributes nothing to its token's sum.
    Returns:
        ([T, H] in x's dtype: sum over k of w_tk * expert_k(x_t), k ascending, int64 scalar: the
        pairs this rank's experts dropped).
    Raises:
        RuntimeError: (capacity exchange) some rank would send more rows to one rank than its
            buffer holds, or ranks have different token counts: raised on every rank of the group
            alike, before the row exchange. On a GPU the check is a device-side assertion, so it
            stops every rank's process instead of raising.
    """
    dispatch_range, experts_range, combine_range = PROFILER_RANGES
    with record_function(dispatch_range):
        plan, x_send, w_send = prepare_dispatch(x, topk_ids, topk_weights, group, num_experts, capacity_factor,
                                                transport)  # fmt: skip
        x_recv, w_recv = exchange_pairs(plan, x_send, w_send)
    with record_function(experts_range):
        y_recv, num_dropped = run_received_pairs(plan, x_recv, w_recv, gate_up_proj, down_proj, experts_fn, tile_m,
                                                 expert_capacity)  # fmt: skip
    with record_function(combine_range):
        return sum_returned_pairs(plan, return_pairs(plan, y_recv), x.dtype), num_dropped


@dataclasses.dataclass
class DispatchPlan:
    """What one forward's exchange needs between its stages (`prepare_dispatch`, `exchange_pairs`,
    `run_received_pairs`, `return_pairs`, `sum_returned_pairs`; `moe_experts_expert_parallel` runs
    them in that order, and so does Megatron's EP-overlap schedule, one stage at a time)."""

    group: dist.ProcessGroup
    num_experts: int
    transport: str
    num_tokens: int  # T
    top_k: int  # K
    order: torch.Tensor  # the pairs' send order (expert-major)
    local_expert: torch.Tensor  # each sent pair's expert on its destination rank
    capacity_factor: float | None = None
    send_splits: list[int] | None = None  # exact exchange: rows to / from each rank
    recv_splits: list[int] | None = None
    slot: torch.Tensor | None = None  # capacity exchange: each pair's slot in the send buffer
    slots: int = 0
    send_counts: torch.Tensor | None = None
    expert_recv: torch.Tensor | None = None  # set by exchange_pairs


def prepare_dispatch(x, topk_ids, topk_weights, group, num_experts, capacity_factor, transport):
    """(plan, rows to send, their routing weights): this rank's pairs in send order, in the exchange's
    send layout (the capacity exchange's fixed-size buffers, or sized by counts exchanged here)."""
    W = dist.get_world_size(group)
    T, K = topk_ids.shape
    R = T * K
    E_local = num_experts // W
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Expert-major send order; stable, so (token, k) order within an expert.
    order = torch.sort(flat, stable=True).indices
    dest = flat[order] // E_local
    plan = DispatchPlan(group, num_experts, transport, T, K, order, flat[order] % E_local, capacity_factor)
    rows = _GatherPairs.apply(x, order, K)
    weights = topk_weights.reshape(-1)[order]
    send_counts = count_per_expert(dest.view(-1, 1), W)
    if capacity_factor is None:
        if transport != "nccl":
            raise ValueError(f"mok.ep_transport={transport!r} needs the capacity exchange (mok.ep_exchange='capacity')")
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        plan.send_splits = send_counts.tolist()  # host-ok: exact-size mode sizes the exchange (module docstring)
        plan.recv_splits = recv_counts.tolist()  # host-ok: exact-size mode sizes the exchange (module docstring)
        return plan, rows, weights
    plan.slots = max(1, math.ceil(capacity_factor * R / W))
    plan.send_counts = send_counts
    rank_in_block = torch.arange(R, device=x.device) - (torch.cumsum(send_counts, 0) - send_counts)[dest]
    # Slot of each pair in the [W * slots] send buffer; empty slots carry expert -1.
    plan.slot = dest * plan.slots + rank_in_block.clamp(max=plan.slots - 1)
    x_send = rows.new_zeros(W * plan.slots, rows.shape[1]).index_copy(0, plan.slot, rows)
    w_send = weights.new_zeros(W * plan.slots).index_copy(0, plan.slot, weights)
    return plan, x_send, w_send


def exchange_pairs(plan: DispatchPlan, x_send: torch.Tensor, w_send: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, weights) received from every rank, in source-rank order; the pairs' local expert ids
    go to plan.expert_recv. The capacity exchange first checks, on every rank alike, that each
    rank's buffers hold what it sends (one all-gather)."""
    group, transport = plan.group, plan.transport
    if plan.capacity_factor is None:
        x_recv = _exchange(x_send, plan.send_splits, plan.recv_splits, group)
        w_recv = _exchange(w_send, plan.send_splits, plan.recv_splits, group)
        plan.expert_recv = _exchange_ints(plan.local_expert, plan.send_splits, plan.recv_splits, group)
        return x_recv, w_recv
    _check_capacity_exchange(plan.num_tokens, plan.send_counts, plan.slots, plan.capacity_factor, group)
    x_recv = _exchange_equal(x_send, group, transport)
    w_recv = _exchange_equal(w_send, group, transport)
    expert_send = torch.full((x_send.shape[0],), -1, dtype=torch.int64, device=x_send.device)
    plan.expert_recv = _exchange_equal(expert_send.index_copy(0, plan.slot, plan.local_expert), group, transport)
    return x_recv, w_recv


def run_received_pairs(plan, x_recv, w_recv, gate_up_proj, down_proj, experts_fn, tile_m, expert_capacity=None):
    """(result rows, int64 scalar: pairs this rank's experts dropped): this rank's experts on the
    received rows, one row per pair (K = 1 locally): the stable schedule keeps source-rank order."""
    schedule = build_schedule(
        plan.expert_recv.view(-1, 1), plan.num_experts // dist.get_world_size(plan.group), tile_m=tile_m,
        capacity=expert_capacity,
    )  # fmt: skip
    return experts_fn(x_recv, w_recv.view(-1, 1), gate_up_proj, down_proj, schedule), schedule.num_dropped


def return_pairs(plan: DispatchPlan, y_recv: torch.Tensor) -> torch.Tensor:
    """The result rows back at their senders, in send order (the inverse exchange)."""
    if plan.capacity_factor is None:
        return _exchange(y_recv, plan.recv_splits, plan.send_splits, plan.group)
    return _exchange_equal(y_recv, plan.group, plan.transport)[plan.slot]


def sum_returned_pairs(plan: DispatchPlan, y_sent_order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in dtype: each token's K rows summed in ascending k in fp32, rounded once."""
    rows = _to_tk_order(y_sent_order, plan.order).view(plan.num_tokens, plan.top_k, y_sent_order.shape[1])
    return sum_over_k(rows, dtype)
