"""The reference backend: the routed experts forward and backward in plain PyTorch.

Owns: `MoKReferenceExperts` (one autograd Function with an explicit backward), `moe_experts_reference`
(its functional entry, with the same signature as the Triton backend's), `swiglu` and
`shared_expert_forward` (the dense shared-expert MLP, plain autograd) and `shared_expert_gate`.

It is the CPU backend and the oracle every kernel is tested against, so it follows the same
fixed orders and rounding points as the kernels (DESIGN.md). Written for a glu expert (experts.py
has the other kinds: an mlp's h has I columns; a linear expert has no fc1 and A is its input row):

forward, per expert e over its rows r in ascending (token, k) order:
    h_r  = x[token_r] @ W13_e^T + b1_e           accumulated in fp64, stored in the params dtype
    A_r  = act(h_r)                               the family's activation, fp64 math, params dtype
    y_r  = w_r * (A_r @ W2_e^T + b2_e)            fp64, stored per (token, k) row in the params dtype
    out_t = ((y_(t,0) + y_(t,1)) + ...) + y_(t,K-1)   fp32, k ascending, rounded once
backward (the down-projection output z = A @ W2^T is never saved):
    dA'_r = dO[token_r] @ W2_e                   fp64
    dw_r  = <dA'_r, A_r> + <dO[token_r], b2_e>     router-score gradient, fp64 rounded to fp32
    dA_r  = w_r * dA'_r; dh_r = act'(h_r) dA_r     stored in the params dtype
    dx_r  = dh_r @ W13_e                           stored per (token, k) row, then summed over k in order
    dW2_e = sum_r (w_r dO[token_r])^T A_r;  dW13_e = sum_r dh_r^T x[token_r]   over the expert's rows
    db2_e = sum_r w_r dO[token_r];          db1_e  = sum_r dh_r

The kernels accumulate in fp32; the reference accumulates in fp64 and rounds at the same points.
That keeps it a tighter oracle and makes it batch-invariant: a CPU GEMM or a vectorised silu may
round a row differently when the number of rows changes (another kernel for one row, a SIMD tail),
and an fp64 result rounded to the params dtype hides that.

Expert segments come from `MoKSchedule`; the per-expert loop reads their bounds on the host, which
is fine for a CPU backend and an oracle (the Triton backend never does).

Does not own: routing, the schedule or the row <-> token primitives it shares with the other paths
(`sum_over_k`, `values_per_row`: schedule.py), the activations' formulas (experts.py), or the
choice of backend.
"""

from __future__ import annotations

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily, activation_backward_fp64, activation_fp64, check_expert_weights
from mok_plugin.schedule import MoKSchedule, sum_over_k, values_per_row
from mok_plugin.wgrad import note_deferral

__all__ = [
    "expert_segments",
    "moe_experts_reference",
    "rows_in_tk_order",
    "shared_expert_forward",
    "shared_expert_gate",
    "swiglu",
]


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in the reference's accumulation dtype, fp64 (see the module docstring)."""
    return t.double()


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up on [..., 2I] (gate first), computed in fp64 and returned in h's dtype."""
    return activation_fp64(h, SWIGLU).to(h.dtype)


def rows_in_tk_order(rows_RH: torch.Tensor, tk_to_row: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """[num_rows, H] in expert order -> [T, K, H] in token order; dropped (t, k) give zero rows."""
    kept = (tk_to_row >= 0).unsqueeze(-1)
    gathered = rows_RH[tk_to_row.clamp(min=0)]
    return torch.where(kept, gathered, torch.zeros((), dtype=rows_RH.dtype, device=rows_RH.device)).view(
        T, K, rows_RH.shape[1]
    )


def expert_segments(schedule: MoKSchedule) -> list[tuple[int, int, int]]:
    """(expert, first row, row count) of every non-empty expert segment."""
    starts = schedule.expert_offsets[:-1].tolist()  # host-ok: reference backend loops on the host
    counts = schedule.tokens_per_expert.tolist()  # host-ok: reference backend loops on the host
    return [(e, s, n) for e, (s, n) in enumerate(zip(starts, counts, strict=True)) if n > 0]


class MoKReferenceExperts(torch.autograd.Function):
    """Routed experts with an explicit backward in the fixed orders of the module docstring."""

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, schedule, family):  # type: ignore[override]
        T, H = x.shape
        K = schedule.top_k
        dtype = x.dtype
        row_to_token = schedule.row_to_token
        w_R = _acc(values_per_row(topk_weights, schedule.row_to_tk))

        h_R = x.new_zeros(schedule.num_rows, family.fc1_width(down_proj.shape[2]))
        y_R = x.new_zeros(schedule.num_rows, H)
        for e, s, n in expert_segments(schedule):
            x_e = x[row_to_token[s : s + n]]
            h = _fc1(x_e, gate_up_proj, gate_up_bias, e, family)
            a = _activation(h, family)
            y = _linear(a, down_proj[e], down_bias, e) * w_R[s : s + n, None]
            if family.kind != "linear":
                h_R[s : s + n] = h
            y_R[s : s + n] = y.to(dtype)
        out = sum_over_k(rows_in_tk_order(y_R, schedule.tk_to_row, T, K), dtype)

        ctx.save_for_backward(x, w_R, gate_up_proj, down_proj, gate_up_bias, down_bias, h_R)
        ctx.schedule = schedule
        ctx.family = family
        ctx.weights_dtype = topk_weights.dtype
        note_deferral(ctx, gate_up_proj, down_proj, gate_up_bias, down_bias)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        x, w_R, gate_up_proj, down_proj, gate_up_bias, down_bias, h_R = ctx.saved_tensors
        schedule: MoKSchedule = ctx.schedule
        family: MoKExpertFamily = ctx.family
        d_out = d_out.contiguous()
        d_x, d_topk_weights, d_h_R = _data_grads(d_out, x, w_R, gate_up_proj, down_proj, down_bias, h_R, schedule,
                                                 family)  # fmt: skip
        d_topk_weights = d_topk_weights.to(ctx.weights_dtype)

        def weight_grads():
            return _weight_grads(d_out, x, w_R, gate_up_proj, down_proj, gate_up_bias, down_bias, h_R, d_h_R,
                                 schedule, family)  # fmt: skip

        if ctx.deferral is not None:  # --delay-wgrad-compute: in backward_dw (wgrad.py)
            ctx.deferral.add(weight_grads, ctx.weights)
            return d_x, d_topk_weights, None, None, None, None, None, None
        return (d_x, d_topk_weights, *weight_grads(), None, None)


def _data_grads(d_out, x, w_R, gate_up_proj, down_proj, down_bias, h_R, schedule: MoKSchedule,
                family: MoKExpertFamily):  # fmt: skip
    """(d_x [T, H], d_topk_weights [T, K] fp32, dh per row [num_rows, fc1 rows] in the params dtype)."""
    T, H = x.shape
    K = schedule.top_k
    dtype = x.dtype
    row_to_token = schedule.row_to_token
    d_x_R = x.new_zeros(schedule.num_rows, H)
    d_w_R = w_R.new_zeros(schedule.num_rows)
    d_h_R = None if family.kind == "linear" else x.new_zeros(schedule.num_rows, h_R.shape[1])
    for e, s, n in expert_segments(schedule):
        tokens = row_to_token[s : s + n]
        d_o = _acc(d_out[tokens])
        h = x[tokens] if family.kind == "linear" else h_R[s : s + n]
        a = _acc(_activation(h, family))
        d_a_prime = d_o @ _acc(down_proj[e])
        # dL/dw = <dO, A W2^T + b2>: the second bias is inside the routing weight.
        d_w = (d_a_prime * a).sum(dim=-1)
        if down_bias is not None:
            d_w = d_w + d_o @ _acc(down_bias[e])
        d_w_R[s : s + n] = d_w
        d_h = activation_backward_fp64(h, w_R[s : s + n, None] * d_a_prime, family).to(dtype)
        if family.kind == "linear":
            d_x_R[s : s + n] = d_h
        else:
            d_h_R[s : s + n] = d_h
            d_x_R[s : s + n] = (_acc(d_h) @ _acc(gate_up_proj[e])).to(dtype)
    d_x = sum_over_k(rows_in_tk_order(d_x_R, schedule.tk_to_row, T, K), dtype)
    kept = schedule.tk_to_row >= 0
    d_topk_weights = torch.where(kept, d_w_R[schedule.tk_to_row.clamp(min=0)], 0.0).view(T, K)
    return d_x, d_topk_weights, d_h_R


def _weight_grads(d_out, x, w_R, gate_up_proj, down_proj, gate_up_bias, down_bias, h_R, d_h_R, schedule: MoKSchedule,
                  family: MoKExpertFamily):  # fmt: skip
    """(d_gate_up, d_down, d_gate_up_bias, d_down_bias), None where the expert has no such tensor."""
    dtype = x.dtype
    row_to_token = schedule.row_to_token
    d_gate_up = None if gate_up_proj is None else torch.zeros_like(gate_up_proj)
    d_down = torch.zeros_like(down_proj)
    d_gate_up_bias = None if gate_up_bias is None else torch.zeros_like(gate_up_bias)
    d_down_bias = None if down_bias is None else torch.zeros_like(down_bias)
    for e, s, n in expert_segments(schedule):
        tokens = row_to_token[s : s + n]
        x_e = x[tokens]
        w_d_o = w_R[s : s + n, None] * _acc(d_out[tokens])
        h = x_e if family.kind == "linear" else h_R[s : s + n]
        d_down[e] = (w_d_o.t() @ _acc(_activation(h, family))).to(dtype)
        if down_bias is not None:
            d_down_bias[e] = w_d_o.sum(dim=0).to(dtype)
        if family.kind != "linear":
            d_h = _acc(d_h_R[s : s + n])
            d_gate_up[e] = (d_h.t() @ _acc(x_e)).to(dtype)
            if gate_up_bias is not None:
                d_gate_up_bias[e] = d_h.sum(dim=0).to(dtype)
    return d_gate_up, d_down, d_gate_up_bias, d_down_bias


def _linear(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, e: int | None) -> torch.Tensor:
    """fp64 a @ weight^T (+ bias[e], or bias itself when e is None)."""
    out = _acc(a) @ _acc(weight).t()
    if bias is not None:
        out = out + _acc(bias if e is None else bias[e])
    return out


def _fc1(x_e, gate_up_proj, gate_up_bias, e, family: MoKExpertFamily) -> torch.Tensor:
    """h of the rows x_e in the params dtype (x_e itself for a linear expert, which has no fc1)."""
    if family.kind == "linear":
        return x_e
    weight = gate_up_proj if e is None else gate_up_proj[e]
    return _linear(x_e, weight, gate_up_bias, e).to(x_e.dtype)


def _activation(h: torch.Tensor, family: MoKExpertFamily) -> torch.Tensor:
    """A = the family's activation of the stored h, in fp64 math, rounded to h's dtype."""
    return activation_fp64(h, family).to(h.dtype)


def moe_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor | None,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output for every token (reference backend).

    Args:
        x: [T, H] in the params dtype.
        topk_weights: fp32 [T, K], the routing weight of each (token, k).
        gate_up_proj: [E, fc1 rows, H] (glu: gate rows first); None for a linear expert.
        down_proj: [E, H, I] ([E, H, H] for a linear expert).
        schedule: from `build_schedule` on the same routing.
        family: what each expert computes (experts.py); bias-free SwiGLU by default.
        gate_up_bias: [E, fc1 rows] when family.fc1_bias; down_bias: [E, H] when family.fc2_bias.
    Returns:
        [T, H] in x's dtype: sum over k of w_tk * expert_k(x_t), k ascending.
    """
    check_expert_weights(family, gate_up_proj, down_proj, gate_up_bias, down_bias)
    return MoKReferenceExperts.apply(x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, schedule,
                                     family)  # fmt: skip


def shared_expert_forward(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor | None,
    down_proj: torch.Tensor,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense shared-expert MLP of `family` applied to every token (plain autograd), batch-invariant.

    Computed in fp64 and rounded at the same points (h, A, output) as the params-dtype path: a GEMM
    library may round a row differently when the number of rows changes, and vectorised silu
    differs between a tensor's SIMD body and its tail; fp64 rounded back hides both, so a token's
    result does not depend on its batch (which expert parallelism needs, since each rank runs this
    on its own tokens). The triton backend runs shared experts through its row-tile kernels instead.

    Args:
        x: [T, H].
        gate_up_proj: [fc1 rows, H] (glu: [2Is, H], gate rows first); None for a linear expert.
        down_proj: [H, Is].
        family, gate_up_bias [fc1 rows], down_bias [H]: as for `moe_experts_reference`.
    Returns:
        [T, H] in x's dtype.
    """
    check_expert_weights(family, gate_up_proj, down_proj, gate_up_bias, down_bias, stacked=False)
    a = _activation(_fc1(x, gate_up_proj, gate_up_bias, None, family), family)
    return _linear(a, down_proj, down_bias, None).to(x.dtype)


def shared_expert_gate(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The shared experts' gate (Qwen3-Next): sigmoid(x . gate_weight), per token (plain autograd).

    Megatron's SharedExpertMLP computes `sigmoid(F.linear(x, gate_weight))` in the params dtype and
    multiplies the shared output by it; this rounds at the same points (the logit, the gate) but
    computes each in fp64, so a token's gate does not depend on its batch (see
    `shared_expert_forward`). The caller multiplies in x's dtype, as Megatron does.

    Args:
        x: [T, H].
        gate_weight: [1, H], in x's dtype.
    Returns:
        [T, 1] in x's dtype.
    """
    logits = torch.nn.functional.linear(_acc(x), _acc(gate_weight)).to(x.dtype)
    return torch.sigmoid(_acc(logits)).to(x.dtype)
