"""MoK's blockwise-FP8 experts in plain PyTorch: where each GEMM operand is quantised, in which
direction and format, and what is kept in higher precision. The oracle the FP8 kernels are tested
against and the definition of their numbers; forward and backward explicit, no autograd.

Every GEMM multiplies FP8 operands with fp32 block scales and sums in fp32 with the scales applied
per 128-long K block (the recipe's promotion). Because a block's scale multiplies whole K blocks,
that sum is, exactly, the product of the dequantised operands: here the operands are quantised and
dequantised (`_qdq*`) and multiplied in fp64, as the bf16 reference does (reference.py).

forward (F = recipe.forward, B = recipe.backward; rows r of expert e, token t_r):
    x_q   = x, 1 x 128 blocks along H, per token (F)           W_q = each expert's weights, 128 x 128 (F);
                                                                a glu's fc1 as two matrices, gate and up
    h_r   = x_q[t_r] @ W13_q^T + b1                             stored in the params dtype
    A_r   = act(h_r);  A_q = A, 1 x 128 blocks along I (F)
    y_r   = w_r * (A_q @ W2_q^T + b2)                           rows in the params dtype, summed over k
backward:
    dO_q  = dO, 1 x 128 blocks along H, per token (B)
    dA'_r = dO_q[t_r] @ W2_q;  d_w_r = <dA'_r, A_q,r> + <dO_q[t_r], b2>
    dh_r  = act'(h_r) (w_r dA'_r);  dh_q = dh, 1 x 128 blocks along fc1's width, per half for a glu (B)
    dx    = sum over k of dh_q @ W13_q                          rows in the params dtype
    dW2_e = (dO rows)^T (w A rows), dW13_e = dh^T (x rows): both operands in 128 x 1 blocks along the
            expert's rows (its segment from its first row, B for gradients, F for activations),
            quantised from the unquantised values (a column-wise copy is never made from a row-wise one)
    db2_e = sum_r w_r dO[t_r], db1_e = sum_r dh_r                unquantised

A glu's gate and up halves are quantised apart (W13's rows and dh's columns), so that blocks line
up with the halves when I is not a multiple of 128 (GPT-OSS's 2880): dX's K loop then steps through
whole blocks of both operands. The 1 x 128 blocks of x, A and dO belong to one token or row, so
the forward is batch-invariant; the 128-row blocks of the weight gradients follow each expert's
rows in global token order, so they are the same for any expert-parallel split.
"""

from __future__ import annotations

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily, activation_backward_fp64, activation_fp64
from mok_plugin.fp8.quantize import dequantize_1d, dequantize_2d, quantize_1d, quantize_2d
from mok_plugin.fp8.recipe import BlockwiseFP8Recipe, FP8Format
from mok_plugin.reference import expert_segments, rows_in_tk_order
from mok_plugin.schedule import MoKSchedule, sum_over_k, values_per_row

__all__ = ["FP8ExpertsResult", "moe_experts_fp8_reference"]

FP8ExpertsResult = dict[str, torch.Tensor | None]


def _qdq(t: torch.Tensor, fmt: FP8Format, block: int, dim: int, power_of_2: bool) -> torch.Tensor:
    """fp64 values of t quantised in 1-D blocks along dim."""
    return dequantize_1d(*quantize_1d(t, fmt, block, dim, power_of_2), block=block, dim=dim).double()


def _qdq_2d(w: torch.Tensor, fmt: FP8Format, block: int, power_of_2: bool) -> torch.Tensor:
    """fp64 values of w quantised in block x block tiles of its last two dimensions."""
    return dequantize_2d(*quantize_2d(w, fmt, block, power_of_2), block=block).double()


def _halves(t: torch.Tensor, gated: bool) -> torch.Tensor:
    """t [..., N1, last] as [..., halves, N1 / halves, last]: a glu's gate and up rows apart."""
    return t.unflatten(-2, (2, -1)) if gated else t.unsqueeze(-3)


def _qdq_fc1_columns(d_h: torch.Tensor, fmt: FP8Format, block: int, power_of_2: bool, gated: bool) -> torch.Tensor:
    """fp64 values of dh [n, N1] quantised in 1 x block blocks along its columns, per half for a glu."""
    halves = d_h.unflatten(-1, (2, -1)) if gated else d_h.unsqueeze(-2)
    return _qdq(halves, fmt, block, -1, power_of_2).flatten(-2)


def moe_experts_fp8_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    recipe: BlockwiseFP8Recipe,
    d_out: torch.Tensor | None = None,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    separate_casts: bool = False,
) -> FP8ExpertsResult:
    """The routed experts under blockwise FP8 (module docstring): {"out"}, and with d_out also
    {"d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"}.

    separate_casts: the peer of issue 25, a pipeline whose quantisation kernels are separate from its
    GEMMs and activation (Transformer Engine's): every tensor a quantiser reads was first stored in
    the params dtype, A, w*A, dA' and dh included, where MoK's epilogues quantise the fp32 values.

    Raises:
        ValueError: a linear expert (no fc1: nothing of it is quantised yet).
    """
    if family.kind == "linear":
        raise ValueError("blockwise FP8 covers glu and mlp experts; a linear expert has no fc1 to quantise")
    T, H = x.shape
    K, dtype, block, pow2 = schedule.top_k, x.dtype, recipe.block, recipe.power_of_2_scales
    fwd, bwd = recipe.forward, recipe.backward
    w_R = values_per_row(topk_weights, schedule.row_to_tk).double()
    x_q = _qdq(x, fwd, block, -1, pow2)
    w13_q = _qdq_2d(_halves(gate_up_proj, family.gated), fwd, block, pow2).flatten(-3, -2)
    w2_q = _qdq_2d(down_proj, fwd, block, pow2)
    segments = expert_segments(schedule)

    def stored(t: torch.Tensor) -> torch.Tensor:  # what a separate quantisation kernel reads
        return t.to(dtype).double() if separate_casts else t

    h_R = x.new_zeros(schedule.num_rows, gate_up_proj.shape[1])
    y_R = x.new_zeros(schedule.num_rows, H)
    for e, s, n in segments:
        tokens = schedule.row_to_token[s : s + n]
        h = x_q[tokens] @ w13_q[e].t()
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].double()
        h_R[s : s + n] = h.to(dtype)
        a_q = _qdq(stored(activation_fp64(h_R[s : s + n], family)), fwd, block, -1, pow2)
        z = a_q @ w2_q[e].t()
        if down_bias is not None:
            z = z + down_bias[e].double()
        y_R[s : s + n] = (w_R[s : s + n, None] * z).to(dtype)
    result: FP8ExpertsResult = {"out": sum_over_k(rows_in_tk_order(y_R, schedule.tk_to_row, T, K), dtype)}
    if d_out is None:
        return result

    d_o_q = _qdq(d_out, bwd, block, -1, pow2)
    d_x_R = x.new_zeros(schedule.num_rows, H)
    d_w_R = w_R.new_zeros(schedule.num_rows)
    d_gate_up, d_down = torch.zeros_like(gate_up_proj), torch.zeros_like(down_proj)
    d_gate_up_bias = None if gate_up_bias is None else torch.zeros_like(gate_up_bias)
    d_down_bias = None if down_bias is None else torch.zeros_like(down_bias)
    for e, s, n in segments:
        tokens = schedule.row_to_token[s : s + n]
        w = w_R[s : s + n, None]
        h = h_R[s : s + n]
        a = stored(activation_fp64(h, family))
        a_q = _qdq(a, fwd, block, -1, pow2)
        d_a_prime = stored(d_o_q[tokens] @ w2_q[e])
        d_w = (d_a_prime * a_q).sum(dim=-1)
        if down_bias is not None:
            d_w = d_w + d_o_q[tokens] @ down_bias[e].double()
        d_w_R[s : s + n] = d_w
        d_h = stored(activation_backward_fp64(h, w * d_a_prime, family))
        d_x_R[s : s + n] = (_qdq_fc1_columns(d_h, bwd, block, pow2, family.gated) @ w13_q[e]).to(dtype)
        # weight gradients: both operands in 128-row blocks along the expert's rows
        d_o_rows = d_out[tokens].double()
        d_down[e] = (_qdq(d_o_rows, bwd, block, 0, pow2).t() @ _qdq(stored(w * a), fwd, block, 0, pow2)).to(dtype)
        d_gate_up[e] = (_qdq(d_h, bwd, block, 0, pow2).t() @ _qdq(x[tokens], fwd, block, 0, pow2)).to(dtype)
        if down_bias is not None:
            d_down_bias[e] = (w * d_o_rows).sum(dim=0).to(dtype)
        if gate_up_bias is not None:
            d_gate_up_bias[e] = d_h.sum(dim=0).to(dtype)
    kept = schedule.tk_to_row >= 0
    result.update(
        d_x=sum_over_k(rows_in_tk_order(d_x_R, schedule.tk_to_row, T, K), dtype),
        d_topk_weights=torch.where(kept, d_w_R[schedule.tk_to_row.clamp(min=0)], 0.0).view(T, K).to(torch.float32),
        d_gate_up_proj=d_gate_up,
        d_down_proj=d_down,
        d_gate_up_bias=d_gate_up_bias,
        d_down_bias=d_down_bias,
    )
    return result
