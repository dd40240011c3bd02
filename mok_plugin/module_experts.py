"""Routed experts that are arbitrary modules: MoK's routing, schedule and combine around each
expert's own `nn.Module`, run once per expert over that expert's rows.

For an expert that is none of MoK's families (experts.py): a residual block, a user's custom MLP,
two linears with no activation. MoK still decides everything around the experts, and each expert
module computes its own rows:

    for each expert e with rows, in ascending expert order:
        x_e   = x[row_to_token of e's rows]        [n_e, H], rows in ascending (token, k) order
        z_e   = module_e(x_e)                      [n_e, H] (a tuple's first element, as DeepSpeed's
                                                    Experts takes it)
        y_r   = w_r * z_r                          in fp32 (fp64 for fp64 rows), rounded to x's dtype
    out_t = ((y_(t,0) + y_(t,1)) + ...) + y_(t,K-1)   sum_over_k: fp32, k ascending, rounded once
backward:
    d_z_r = w_r * d_y_r                           fp32, rounded to z's dtype; then the module's own
                                                  autograd gives dx_e and its parameters' gradients
    d_w_r = <d_y_r, z_r>                           fp64, rounded to the routing weights' dtype
    d_x_t = sum_over_k of the token's K row-gradients, k ascending (a dropped pair adds zero)

The gather of token rows is an autograd Function whose backward is that fixed-order sum, not
`x[idx]`'s backward (an index_add, with atomics on CUDA, in which a token's K row-gradients
arrive in any order). Every other index here maps one row to one place (scatter and gather with
unique indices), so no sum depends on an order that could change.

Determinism and expert-parallel invariance: the schedule gives each expert the same rows in the
same order whatever the batch is split into (parallel/dispatch.py sends every rank's rows to the
expert's owner in global token order), so each module is called on the same [n_e, H] tensor and,
if the module itself is deterministic, computes bitwise the same output and gradients; the sums
over k run in the same order on every path. A module that is not deterministic (dropout, a
non-deterministic GPU kernel) stays as it is.

Every expert's parameters get a gradient, zero for an expert that received no row: the stacked
weights of the other backends get one (a gradient of [E, ...] covers every expert), and so do
DeepSpeed's stock experts, which always run on their capacity buffer, so an optimiser steps every
expert alike. And x always gets a gradient (zero where no row used it), so under expert
parallelism every rank runs the exchanges' backward, whatever its modules received.

Cost: one module call per expert with rows, from a Python loop that reads the segment bounds on the
host (like the reference backend); no fusion. Meant for expert modules no fused family computes.

Does not own: routing, the schedule and its row maps (schedule.py), the fused families
(experts.py, reference.py, ops.py), recognising a module as a family (the adapters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mok_plugin.schedule import MoKSchedule, sum_over_k

__all__ = ["MoKModuleExperts", "moe_experts_modules"]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _GatherRows(torch.autograd.Function):
    """x [T, H] -> x[tokens] [n, H]; backward: each token's K row-gradients summed in k order."""

    @staticmethod
    def forward(ctx, x, row_tokens, row_tk, top_k):  # type: ignore[override]
        ctx.save_for_backward(row_tk)
        ctx.shape = (x.shape[0], top_k, x.shape[1])
        return x.index_select(0, row_tokens)

    @staticmethod
    def backward(ctx, d_rows):  # type: ignore[override]
        (row_tk,) = ctx.saved_tensors
        T, K, H = ctx.shape
        # One row per kept (t, k), so this scatter has unique indices; dropped pairs stay zero.
        d_tk = d_rows.new_zeros(T * K, H).index_copy_(0, row_tk, d_rows)
        return sum_over_k(d_tk.view(T, K, H), d_rows.dtype), None, None, None


class _WeightRows(torch.autograd.Function):
    """z [n, H] (rows of kept (t, k)) -> y [T, K, H]: w_tk * z in fp32, rounded; zero rows for
    dropped pairs. Backward: d_z = w * d_y (fp32, rounded), d_w = <d_y, z> (fp64, rounded)."""

    @staticmethod
    def forward(ctx, z, topk_weights, row_tk, out_dtype):  # type: ignore[override]
        T, K = topk_weights.shape
        w = topk_weights.reshape(-1).index_select(0, row_tk)
        y = (z.to(_acc_dtype(z)) * w.unsqueeze(1)).to(out_dtype)
        ctx.save_for_backward(z, w, row_tk)
        ctx.weights_dtype = topk_weights.dtype
        ctx.tk = (T, K)
        return z.new_zeros(T * K, z.shape[1], dtype=out_dtype).index_copy_(0, row_tk, y).view(T, K, z.shape[1])

    @staticmethod
    def backward(ctx, d_y):  # type: ignore[override]
        z, w, row_tk = ctx.saved_tensors
        T, K = ctx.tk
        d_rows = d_y.reshape(T * K, z.shape[1]).index_select(0, row_tk)
        d_z = (d_rows.to(_acc_dtype(z)) * w.unsqueeze(1)).to(z.dtype)
        d_w_rows = (d_rows.double() * z.double()).sum(dim=-1).to(ctx.weights_dtype)
        d_w = d_w_rows.new_zeros(T * K).index_copy_(0, row_tk, d_w_rows).view(T, K)
        return d_z, d_w, None, None


class _KeepInGraph(torch.autograd.Function):
    """Passes z through; gives the gathered rows and each of `params` (experts that got no row) a
    zero gradient, so that they are always in the backward graph: the gather's gradient (and under
    expert parallelism the exchange before it, which every rank must join) then runs even when
    no module used its rows, and every expert's parameters get a gradient."""

    @staticmethod
    def forward(ctx, z, x_rows, *params):  # type: ignore[override]
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (x_rows, *params)]
        return z.clone()

    @staticmethod
    def backward(ctx, d_z):  # type: ignore[override]
        return (d_z, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


def _segments(schedule: MoKSchedule) -> list[tuple[int, int, int]]:
    """(expert, first row, row count) of every expert, empty ones included."""
    starts = schedule.expert_offsets[:-1].tolist()  # host-ok: one module call per expert, from the host
    counts = schedule.tokens_per_expert.tolist()  # host-ok: one module call per expert, from the host
    return list(zip(range(len(counts)), starts, counts, strict=True))


def moe_experts_modules(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: Sequence[nn.Module],
    schedule: MoKSchedule,
) -> torch.Tensor:
    """The routed experts' output for every token, each expert computed by its own module.

    Args:
        x: [T, H].
        topk_weights: fp32 [T, K], the routing weight of each (token, k).
        experts: E modules (schedule.num_experts), expert e's called as experts[e](rows [n_e, H])
            and returning [n_e, H] (or a tuple whose first element is that).
        schedule: from `build_schedule` on the same routing.
    Returns:
        [T, H] in x's dtype: sum over k of w_tk * expert_k(x_t), k ascending.
    Raises:
        ValueError: the number of modules is not the schedule's expert count, or a module returns
            another shape (naming the expert).
    """
    if len(experts) != schedule.num_experts:
        raise ValueError(f"{len(experts)} expert modules for a schedule of {schedule.num_experts} experts")
    T, H = x.shape
    segments = _segments(schedule)
    busy = [(e, s, n) for e, s, n in segments if n > 0]
    device = x.device
    rows = [torch.arange(s, s + n, device=device) for _, s, n in busy]
    rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=device)
    row_tk = schedule.row_to_tk.index_select(0, rows)
    x_rows = _GatherRows.apply(x, schedule.row_to_token.index_select(0, rows), row_tk, schedule.top_k)

    outputs = []
    for (e, _, n), x_e in zip(busy, x_rows.split([n for *_, n in busy]) if busy else (), strict=True):
        z = experts[e](x_e)
        if isinstance(z, (tuple, list)):
            z = z[0]
        if not isinstance(z, torch.Tensor) or tuple(z.shape) != (n, H):
            got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ValueError(f"expert {e} ({type(experts[e]).__name__}) returned {got} for rows [{n}, {H}]")
        outputs.append(z)
    idle = [p for e, _, n in segments if n == 0 for p in experts[e].parameters() if p.requires_grad]
    z_rows = _KeepInGraph.apply(torch.cat(outputs) if outputs else x_rows.detach(), x_rows, *idle)
    y = _WeightRows.apply(z_rows, topk_weights, row_tk, x.dtype)
    return sum_over_k(y, x.dtype)


class MoKModuleExperts(nn.Module):
    """A rank's routed experts as modules (`local_experts[i]`), for `MoKMoE(..., experts=...)`.

    The layer passes its experts function stacked weights; these experts have none
    (`gate_up_proj` and `down_proj` are None) and compute with `moe_experts_modules`.
    """

    gate_up_proj = None
    down_proj = None

    def __init__(self, experts: Sequence[nn.Module]):
        super().__init__()
        self.local_experts = nn.ModuleList(experts)

    def weights(self) -> dict[str, torch.Tensor | None]:
        """No extra keyword arguments for the experts function (the weights live in the modules)."""
        return {}

    def experts_fn(self, x, topk_weights, gate_up_proj, down_proj, schedule: MoKSchedule) -> torch.Tensor:
        """A backend experts function's signature (layer.py, parallel/dispatch.py); the stacked
        weights it is passed are None and unused."""
        return moe_experts_modules(x, topk_weights, self.local_experts, schedule)
