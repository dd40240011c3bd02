"""The reference backend: the routed experts forward and backward in plain PyTorch.

Owns: `MoKReferenceExperts` (one autograd Function with an explicit backward), `moe_experts_reference`
(its functional entry, with the same signature as the Triton backend's), `swiglu` and
`shared_expert_forward` (the dense shared-expert MLP, plain autograd).

It is the CPU backend and the oracle every kernel is tested against, so it follows the same
fixed orders and rounding points as the kernels (DESIGN.md):

forward, per expert e over its rows r in ascending (token, k) order:
    h_r  = x[token_r] @ W13_e^T                  accumulated in fp64, stored in the params dtype
    A_r  = silu(h_r[:I]) * h_r[I:]                fp64 math on the stored h, stored in the params dtype
    y_r  = w_r * (A_r @ W2_e^T)                   fp64, stored per (token, k) row in the params dtype
    out_t = ((y_(t,0) + y_(t,1)) + ...) + y_(t,K-1)   fp32, k ascending, rounded once
backward (the down-projection output z = A @ W2^T is never saved):
    dA'_r = dO[token_r] @ W2_e                   fp64
    dw_r  = <dA'_r, A_r>                           router-score gradient, fp64 rounded to fp32
    dA_r  = w_r * dA'_r; dh_r = dSwiGLU(h_r, dA_r) stored in the params dtype
    dx_r  = dh_r @ W13_e                           stored per (token, k) row, then summed over k in order
    dW2_e = sum_r (w_r dO[token_r])^T A_r;  dW13_e = sum_r dh_r^T x[token_r]   over the expert's rows

The kernels accumulate in fp32; the reference accumulates in fp64 and rounds at the same points.
That keeps it a tighter oracle and makes it batch-invariant: a CPU GEMM or a vectorised silu may
round a row differently when the number of rows changes (another kernel for one row, a SIMD tail),
and an fp64 result rounded to the params dtype hides that.

Expert segments come from `MoKSchedule`; the per-expert loop reads their bounds on the host, which
is fine for a CPU backend and an oracle (the Triton backend never does).

Does not own: routing, the schedule or the row <-> token primitives it shares with the other paths
(`sum_over_k`, `values_per_row`: schedule.py), or the choice of backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok_plugin.schedule import MoKSchedule, sum_over_k, values_per_row

__all__ = ["moe_experts_reference", "swiglu", "shared_expert_forward"]


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in the reference's accumulation dtype, fp64 (see the module docstring)."""
    return t.double()


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up on [..., 2I] (gate first), computed in fp64 and returned in h's dtype."""
    gate, up = _acc(h).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(h.dtype)


def _swiglu_backward(h: torch.Tensor, d_a: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. h = [gate, up] of silu(gate) * up, given fp64 d_a; fp64 result."""
    gate, up = _acc(h).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_gate = d_a * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_up = d_a * (gate * sig)
    return torch.cat([d_gate, d_up], dim=-1)


def _rows_in_tk_order(rows_RH: torch.Tensor, tk_to_row: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """[num_rows, H] in expert order -> [T, K, H] in token order; dropped (t, k) give zero rows."""
    kept = (tk_to_row >= 0).unsqueeze(-1)
    gathered = rows_RH[tk_to_row.clamp(min=0)]
    return torch.where(kept, gathered, torch.zeros((), dtype=rows_RH.dtype, device=rows_RH.device)).view(
        T, K, rows_RH.shape[1]
    )


def _segments(schedule: MoKSchedule) -> list[tuple[int, int, int]]:
    """(expert, first row, row count) of every non-empty expert segment."""
    starts = schedule.expert_offsets[:-1].tolist()  # host-ok: reference backend loops on the host
    counts = schedule.tokens_per_expert.tolist()  # host-ok: reference backend loops on the host
    return [(e, s, n) for e, (s, n) in enumerate(zip(starts, counts, strict=True)) if n > 0]


class MoKReferenceExperts(torch.autograd.Function):
    """Routed experts with an explicit backward in the fixed orders of the module docstring."""

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, schedule: MoKSchedule):  # type: ignore[override]
        T, H = x.shape
        K = schedule.top_k
        dtype = x.dtype
        row_to_token = schedule.row_to_token
        w_R = _acc(values_per_row(topk_weights, schedule.row_to_tk))

        I2 = gate_up_proj.shape[1]
        h_R = x.new_zeros(schedule.num_rows, I2)
        y_R = x.new_zeros(schedule.num_rows, H)
        for e, s, n in _segments(schedule):
            x_e = _acc(x[row_to_token[s : s + n]])
            h = (x_e @ _acc(gate_up_proj[e]).t()).to(dtype)
            a = swiglu(h)
            y = (_acc(a) @ _acc(down_proj[e]).t()) * w_R[s : s + n, None]
            h_R[s : s + n] = h
            y_R[s : s + n] = y.to(dtype)
        out = sum_over_k(_rows_in_tk_order(y_R, schedule.tk_to_row, T, K), dtype)

        ctx.save_for_backward(x, w_R, gate_up_proj, down_proj, h_R)
        ctx.schedule = schedule
        ctx.weights_dtype = topk_weights.dtype
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        x, w_R, gate_up_proj, down_proj, h_R = ctx.saved_tensors
        schedule: MoKSchedule = ctx.schedule
        T, H = x.shape
        K = schedule.top_k
        dtype = x.dtype
        d_out = d_out.contiguous()
        row_to_token = schedule.row_to_token

        d_x_R = x.new_zeros(schedule.num_rows, H)
        d_w_R = w_R.new_zeros(schedule.num_rows)
        d_gate_up = torch.zeros_like(gate_up_proj)
        d_down = torch.zeros_like(down_proj)
        for e, s, n in _segments(schedule):
            tokens = row_to_token[s : s + n]
            x_e = _acc(x[tokens])
            d_o = _acc(d_out[tokens])
            h = h_R[s : s + n]
            a = _acc(swiglu(h))
            w = w_R[s : s + n, None]
            d_a_prime = d_o @ _acc(down_proj[e])
            d_w_R[s : s + n] = (d_a_prime * a).sum(dim=-1)
            d_h = _swiglu_backward(h, w * d_a_prime).to(dtype)
            d_x_R[s : s + n] = (_acc(d_h) @ _acc(gate_up_proj[e])).to(dtype)
            d_down[e] = ((w * d_o).t() @ a).to(dtype)
            d_gate_up[e] = (_acc(d_h).t() @ x_e).to(dtype)

        d_x = sum_over_k(_rows_in_tk_order(d_x_R, schedule.tk_to_row, T, K), dtype)
        kept = schedule.tk_to_row >= 0
        d_topk_weights = torch.where(kept, d_w_R[schedule.tk_to_row.clamp(min=0)], 0.0).view(T, K)
        return d_x, d_topk_weights.to(ctx.weights_dtype), d_gate_up, d_down, None


def moe_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
) -> torch.Tensor:
    """The routed experts' output for every token (reference backend).

    Args:
        x: [T, H] in the params dtype.
        topk_weights: fp32 [T, K], the routing weight of each (token, k).
        gate_up_proj: [E, 2I, H], gate rows first.
        down_proj: [E, H, I].
        schedule: from `build_schedule` on the same routing.
    Returns:
        [T, H] in x's dtype: sum over k of w_tk * expert_k(x_t), k ascending.
    """
    return MoKReferenceExperts.apply(x, topk_weights, gate_up_proj, down_proj, schedule)


def shared_expert_forward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP applied to every token (plain autograd), batch-invariant.

    Computed in fp64 and rounded at the same points (h, A, output) as the params-dtype path: a GEMM
    library may round a row differently when the number of rows changes, and vectorised silu
    differs between a tensor's SIMD body and its tail; fp64 rounded back hides both, so a token's
    result does not depend on its batch (which expert parallelism needs, since each rank runs this
    on its own tokens). The triton backend runs shared experts through its row-tile kernels instead.

    Args:
        x: [T, H].
        gate_up_proj: [2Is, H], gate rows first.
        down_proj: [H, Is].
    Returns:
        [T, H] in x's dtype.
    """
    h = F.linear(x.double(), gate_up_proj.double()).to(x.dtype)
    return F.linear(_acc(swiglu(h)), down_proj.double()).to(x.dtype)
