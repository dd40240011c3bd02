"""MoK's FP8 experts in plain PyTorch, under each recipe of fp8/recipe.py: where each GEMM operand is
quantised, in which direction and format, and what is kept in higher precision. The oracle the FP8
kernels are tested against and the definition of every recipe's numbers; forward and backward
explicit, no autograd. For tensorwise and mxfp8 it is also what runs (fp8/experts.py): the Triton
kernels implement blockwise only; under mxfp8 its GEMMs can run by the block-scaled MMA kernel
(`block_scaled_mma`, kernels/mxfp8.py: Blackwell's) rather than on the dequantised values.

Every GEMM multiplies FP8 operands and sums in fp32 with the scales applied per K block (blockwise,
mxfp8: power-of-two scales on whole K blocks) or to the whole product (tensorwise: cuBLAS's FP8 GEMM).
Either way the sum is, exactly, the product of the dequantised operands: here the operands are
quantised and dequantised (`_Operands`) and multiplied in the compute dtype (fp64 for the oracle:
exact products, as the bf16 reference does in reference.py; fp32 where it runs on a GPU).

An operand quantised "along d" is quantised for a GEMM that reduces over its dimension d:
    blockwise   activations and gradients 1 x 128 blocks along d; weights 128 x 128 tiles (both uses)
    tensorwise  one scale for the whole operand: an expert's rows (x, A, w*A, dO, dh) or weight
                (TE's GroupedLinear: one quantiser per expert split); the same numbers both ways
    mxfp8       1 x 32 blocks along d with E8M0 scales, weights too; an operand used along two
                dimensions is quantised twice from the unquantised values

forward (F = recipe.forward, B = recipe.backward; rows r of expert e, token t_r):
    x_q   = x rows of e, along H (F)                       W13_q = e's fc1 weight along H (F); a glu's
                                                            gate and up as two matrices
    h_r   = x_q @ W13_q^T + b1                              stored in the params dtype
    A_r   = act(h_r);  A_q = A rows of e, along I (F)       W2_q  = e's fc2 weight along I (F)
    y_r   = w_r * (A_q @ W2_q^T + b2)                       rows in the params dtype, summed over k
backward:
    dO_q  = dO rows of e, along H (B)                       W2_q' = e's fc2 weight along H (F)
    dA'_r = dO_q @ W2_q';  d_w_r = <dA'_r, A_q,r> + <dO_q, b2>
    dh_r  = act'(h_r) (w_r dA'_r);  dh_q = dh along fc1's width, per half for a glu (B)
    dx    = sum over k of dh_q @ W13_q'                     W13_q' = e's fc1 weight along fc1's width,
                                                            per half (F); rows in the params dtype
    dW2_e = (dO rows)^T (w A rows), dW13_e = dh^T (x rows): both operands along the expert's rows
            (blocks from its first row, B for gradients, F for activations), quantised from the
            unquantised values (a column-wise copy is never made from a row-wise one)
    db2_e = sum_r w_r dO[t_r], db1_e = sum_r dh_r                unquantised

The routing weight multiplies after fc2 under every recipe (MoK's order; Megatron's TEGroupedMLP
multiplies before), so A's scales are taken without it. A glu's gate and up halves are quantised
apart along fc1's width (W13 for dX, dh), so that blocks line up with the halves when I is not a
multiple of the block (GPT-OSS's 2880 and blockwise's 128); with TE's divisible shapes the blocks are
TE's. Under blockwise and mxfp8 the blocks of x, A and dO belong to one token or row, so the forward
is batch-invariant; tensorwise scales an expert's rows by their common amax, so a token's numbers
depend on the other tokens its expert gets (the recipe's own semantics), never on other experts'.
The blocks along an expert's rows, and tensorwise's per-expert amax, follow that expert's rows in
global token order, so they are the same for any expert-parallel split.
"""

from __future__ import annotations

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily, activation
from mok_plugin.fp8.quantize import (
    dequantize_1d,
    dequantize_2d,
    dequantize_mxfp8,
    dequantize_tensorwise,
    quantize_1d,
    quantize_2d,
    quantize_mxfp8,
    quantize_tensorwise,
)
from mok_plugin.fp8.recipe import FP8Format, FP8Recipe
from mok_plugin.reference import expert_segments, rows_in_tk_order
from mok_plugin.schedule import MoKSchedule, sum_over_k, values_per_row

__all__ = ["FP8ExpertsResult", "moe_experts_fp8_reference"]

FP8ExpertsResult = dict[str, torch.Tensor | None]


class _Operands:
    """How `recipe` quantises a GEMM operand, as its dequantised values in the compute dtype; with
    block_scaled_mma (mxfp8 only), also the GEMMs of its quantised values by block-scaled MMA."""

    def __init__(self, recipe: FP8Recipe, dtype: torch.dtype, block_scaled_mma: bool = False) -> None:
        self.recipe, self.dtype = recipe, dtype
        self.block_scaled_mma = block_scaled_mma and recipe.scaling == "mxfp8"

    def mx_product(self, a: torch.Tensor, fa: FP8Format, b: torch.Tensor, fb: FP8Format,
                   halves: int = 1) -> torch.Tensor:  # fmt: skip
        """a [M, K] and b [N, K], each quantised along K (`along(t, fmt, -1)`), multiplied by the
        block-scaled MMA kernel (kernels/mxfp8.py): [M, N] in the compute dtype. halves: K as that many
        equal parts quantised apart (a glu's gate and up: their blocks restart at I), summed in turn."""
        from mok_plugin.kernels.mxfp8 import mx_matmul  # imports Triton, which the oracle does not need

        out = None
        for a_part, b_part in zip(a.chunk(halves, -1), b.chunk(halves, -1), strict=True):
            a_q, a_e = quantize_mxfp8(a_part, fa, -1, self.recipe.block)
            b_q, b_e = quantize_mxfp8(b_part, fb, -1, self.recipe.block)
            out = mx_matmul(a_q, a_e, fa, b_q, b_e, fb, out=out)
        return out.to(self.dtype)

    def along(self, t: torch.Tensor, fmt: FP8Format, dim: int) -> torch.Tensor:
        """t quantised for a GEMM reducing over its dimension `dim` (the module docstring's table)."""
        r = self.recipe
        if r.scaling == "tensorwise":
            return dequantize_tensorwise(*quantize_tensorwise(t, fmt, r.power_of_2_scales), dtype=self.dtype)
        if r.scaling == "mxfp8":
            return dequantize_mxfp8(*quantize_mxfp8(t, fmt, dim, r.block), dim=dim, block=r.block, dtype=self.dtype)
        data, scale_inv = quantize_1d(t, fmt, r.block, dim, r.power_of_2_scales)
        return dequantize_1d(data, scale_inv, block=r.block, dim=dim).to(self.dtype)

    def weight(self, w: torch.Tensor, fmt: FP8Format, dim: int) -> torch.Tensor:
        """One expert's weight [..., N, K] for a GEMM reducing over `dim` (-1: forward, -2: dgrad);
        blockwise's tiles of the last two dimensions serve both."""
        r = self.recipe
        if r.scaling == "blockwise":
            data, scale_inv = quantize_2d(w, fmt, r.block, r.power_of_2_scales)
            return dequantize_2d(data, scale_inv, block=r.block).to(self.dtype)
        return self.along(w, fmt, dim)


def _halves(t: torch.Tensor, gated: bool) -> torch.Tensor:
    """t [..., N1, last] as [..., halves, N1 / halves, last]: a glu's gate and up rows apart."""
    return t.unflatten(-2, (2, -1)) if gated else t.unsqueeze(-3)


def _column_halves(t: torch.Tensor, gated: bool) -> torch.Tensor:
    """t [n, N1] as [n, halves, N1 / halves]: a glu's gate and up columns apart."""
    return t.unflatten(-1, (2, -1)) if gated else t.unsqueeze(-2)


def _activation(h: torch.Tensor, family: MoKExpertFamily, dtype: torch.dtype) -> torch.Tensor:
    """act(h) computed in `dtype` (experts.activation_fp64 for float64)."""
    return activation(h.to(dtype), family)


def _activation_backward(
    h: torch.Tensor, d_a: torch.Tensor, family: MoKExpertFamily, dtype: torch.dtype
) -> torch.Tensor:
    """dL/dh from dL/dA in `dtype`, by autograd (experts.activation_backward_fp64 for float64)."""
    with torch.enable_grad():
        h_c = h.to(dtype).detach().requires_grad_(True)
        (d_h,) = torch.autograd.grad(activation(h_c, family), h_c, d_a.to(dtype))
    return d_h


def moe_experts_fp8_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    recipe: FP8Recipe,
    d_out: torch.Tensor | None = None,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    separate_casts: bool = False,
    compute_dtype: torch.dtype = torch.float64,
    block_scaled_mma: bool = False,
) -> FP8ExpertsResult:
    """The routed experts under `recipe` (module docstring): {"out"}, and with d_out also
    {"d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"}.

    separate_casts: the peer of issue 25, a pipeline whose quantisation kernels are separate from its
    GEMMs and activation (Transformer Engine's): every tensor a quantiser reads was first stored in
    the params dtype, A, w*A, dA' and dh included, where MoK's epilogues quantise the fp32 values.
    compute_dtype: the GEMMs' and the activation's dtype: float64 (the oracle) or float32 (on a GPU at
    run time, where fp64 would cost time and twice the memory); each expert's weights are quantised
    inside the expert loop, so only one expert's dequantised copies exist at a time.
    block_scaled_mma (mxfp8): every GEMM by the block-scaled MMA kernel (kernels/mxfp8.py, Blackwell's)
    from the quantised values and their E8M0 exponents, not by dequantising them: the same products,
    summed in another order (fp32).

    Raises:
        ValueError: a linear expert (no fc1: nothing of it is quantised yet).
    """
    if family.kind == "linear":
        raise ValueError("FP8 covers glu and mlp experts; a linear expert has no fc1 to quantise")
    T, H = x.shape
    K, dtype, gated = schedule.top_k, x.dtype, family.gated
    fwd, bwd = recipe.forward, recipe.backward
    ops = _Operands(recipe, compute_dtype, block_scaled_mma)
    mma = ops.block_scaled_mma
    w_R = values_per_row(topk_weights, schedule.row_to_tk).to(compute_dtype)
    segments = expert_segments(schedule)

    def stored(t: torch.Tensor) -> torch.Tensor:  # what a separate quantisation kernel reads
        return t.to(dtype).to(compute_dtype) if separate_casts else t

    def plus_bias(t: torch.Tensor, b: torch.Tensor | None, e: int) -> torch.Tensor:
        return t if b is None else t + b[e].to(compute_dtype)

    h_R = x.new_zeros(schedule.num_rows, gate_up_proj.shape[1])
    y_R = x.new_zeros(schedule.num_rows, H)
    for e, s, n in segments:
        x_rows = x[schedule.row_to_token[s : s + n]]
        if mma:  # (a weight's mxfp8 blocks are 1 x 32 along its rows: its glu halves change nothing here)
            h = ops.mx_product(x_rows, fwd, gate_up_proj[e], fwd)
        else:
            h = ops.along(x_rows, fwd, -1) @ ops.weight(_halves(gate_up_proj[e], gated), fwd, -1).flatten(-3, -2).t()
        h_R[s : s + n] = plus_bias(h, gate_up_bias, e).to(dtype)
        a = stored(_activation(h_R[s : s + n], family, compute_dtype))
        if mma:
            z = ops.mx_product(a, fwd, down_proj[e], fwd)
        else:
            z = ops.along(a, fwd, -1) @ ops.weight(down_proj[e], fwd, -1).t()
        z = plus_bias(z, down_bias, e)
        y_R[s : s + n] = (w_R[s : s + n, None] * z).to(dtype)
    result: FP8ExpertsResult = {"out": sum_over_k(rows_in_tk_order(y_R, schedule.tk_to_row, T, K), dtype)}
    if d_out is None:
        return result

    d_x_R = x.new_zeros(schedule.num_rows, H)
    d_w_R = w_R.new_zeros(schedule.num_rows)
    d_gate_up, d_down = torch.zeros_like(gate_up_proj), torch.zeros_like(down_proj)
    d_gate_up_bias = None if gate_up_bias is None else torch.zeros_like(gate_up_bias)
    d_down_bias = None if down_bias is None else torch.zeros_like(down_bias)
    for e, s, n in segments:
        tokens = schedule.row_to_token[s : s + n]
        w, h, d_o = w_R[s : s + n, None], h_R[s : s + n], d_out[tokens]
        a = stored(_activation(h, family, compute_dtype))
        a_q = ops.along(a, fwd, -1)
        d_o_q = ops.along(d_o, bwd, -1)
        if mma:
            d_a_prime = stored(ops.mx_product(d_o, bwd, down_proj[e].t(), fwd))
        else:
            d_a_prime = stored(d_o_q @ ops.weight(down_proj[e], fwd, -2))
        d_w = (d_a_prime * a_q).sum(dim=-1)
        if down_bias is not None:
            d_w = d_w + d_o_q @ down_bias[e].to(compute_dtype)
        d_w_R[s : s + n] = d_w
        d_h = stored(_activation_backward(h, w * d_a_prime, family, compute_dtype))
        if mma:
            d_x_R[s : s + n] = ops.mx_product(d_h, bwd, gate_up_proj[e].t(), fwd, halves=1 + gated).to(dtype)
            # weight gradients: both operands along the expert's rows
            d_down[e] = ops.mx_product(d_o.t(), bwd, stored(w * a).t(), fwd).to(dtype)
            d_gate_up[e] = ops.mx_product(d_h.t(), bwd, x[tokens].t(), fwd).to(dtype)
        else:
            d_h_q = ops.along(_column_halves(d_h, gated), bwd, -1).flatten(-2)
            w13_q = ops.weight(_halves(gate_up_proj[e], gated), fwd, -2).flatten(-3, -2)
            d_x_R[s : s + n] = (d_h_q @ w13_q).to(dtype)
            # weight gradients: both operands along the expert's rows
            d_down[e] = (ops.along(d_o, bwd, 0).t() @ ops.along(stored(w * a), fwd, 0)).to(dtype)
            d_gate_up[e] = (ops.along(d_h, bwd, 0).t() @ ops.along(x[tokens], fwd, 0)).to(dtype)
        if down_bias is not None:
            d_down_bias[e] = (w * d_o.to(compute_dtype)).sum(dim=0).to(dtype)
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
