"""FP8 results' errors against the unquantised float64 experts, computed one expert at a time.

`mok bench fp8` states each tensor's relative error ||got - exact|| / ||exact|| for MoK's FP8 experts
and for the separate-cast peer (`moe_experts_fp8_reference(separate_casts=True)`), issue 25's
comparison. The exact experts are reference.py's in float64 (`moe_experts_reference` on float64
copies, the same operations in the same order), but taken an expert at a time from the bf16 inputs:
whole float64 copies of the weights and their gradients (6 of them, 90 GB each on deepseek-v3) fit
no GPU, so they used to be measured on qwen3-30b-a3b only. Here only the per-row float64 sums
(out's and d_x's rows, the router gradient) are whole; each expert's weight gradients are compared
as they are made.
"""

from __future__ import annotations

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily, activation_backward_fp64, activation_fp64
from mok_plugin.fp8.recipe import FP8Recipe
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.reference import expert_segments, rows_in_tk_order
from mok_plugin.schedule import MoKSchedule, sum_over_k, values_per_row

__all__ = ["float64_errors", "relative_error"]

TENSORS = ("out", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj")


def relative_error(got: torch.Tensor, want: torch.Tensor, rows: int = 4096) -> float:
    """||got - want|| / ||want||, in fp64, a block of rows at a time (deepseek-v3's gradients are
    7 GiB in fp32: a whole-tensor difference ran the H200 out of memory); a block of a tensor held
    in host memory is moved to the other's GPU first."""
    diff = want_sq = 0.0
    device = want.device if want.is_cuda else got.device
    for g, w in zip(got.flatten(0, -2).split(rows), want.flatten(0, -2).split(rows), strict=True):
        g, w = g.to(device).double(), w.to(device).double()
        diff += (g - w).square().sum().item()
        want_sq += w.square().sum().item()
    return (diff / want_sq) ** 0.5


def float64_errors(
    inputs: dict[str, torch.Tensor], schedule: MoKSchedule, recipe: FP8Recipe, got: dict[str, torch.Tensor],
    family: MoKExpertFamily = SWIGLU,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """{tensor: {"mok fp8": error, "separate-cast peer": error}} for the TENSORS, each relative to the
    unquantised float64 experts on the same inputs (bias-free experts: the bench's).

    Args:
        inputs: the bench's bf16 "x", "topk_weights", "gate_up_proj", "down_proj" and "d_out".
        schedule: from build_schedule on the same routing.
        recipe: the FP8 recipe `got` was computed under (the peer runs under it too).
        got: MoK's FP8 outputs by name; on the GPU or in host memory.
    """
    peer = moe_experts_fp8_reference(
        inputs["x"], inputs["topk_weights"], inputs["gate_up_proj"], inputs["down_proj"], schedule, recipe,
        inputs["d_out"], family, separate_casts=True,
    )  # fmt: skip
    results = {"mok fp8": got, "separate-cast peer": peer}
    weight_sums = {name: dict.fromkeys([*results, "exact"], 0.0) for name in ("d_gate_up_proj", "d_down_proj")}
    exact = {}
    for name, d_weight, e in _exact_experts(inputs, schedule, family, exact):
        sums = weight_sums[name]
        sums["exact"] += d_weight.square().sum().item()
        for label, result in results.items():
            sums[label] += (result[name][e].to(d_weight.device).double() - d_weight).square().sum().item()
    errors = {name: {label: relative_error(result[name], exact[name]) for label, result in results.items()}
              for name in ("out", "d_x", "d_topk_weights")}  # fmt: skip
    for name, sums in weight_sums.items():
        errors[name] = {label: (sums[label] / sums["exact"]) ** 0.5 for label in results}
    return {name: errors[name] for name in TENSORS}


def _exact_experts(inputs: dict[str, torch.Tensor], schedule: MoKSchedule, family: MoKExpertFamily, whole: dict):
    """Yield ("d_gate_up_proj" | "d_down_proj", expert e's float64 gradient, e) for every expert in
    turn, as reference.py computes them in float64; then put the whole float64 "out", "d_x" and
    "d_topk_weights" into `whole`."""
    x, d_out, w13, w2 = inputs["x"], inputs["d_out"], inputs["gate_up_proj"], inputs["down_proj"]
    T, H = x.shape
    K = schedule.top_k
    w_R = values_per_row(inputs["topk_weights"], schedule.row_to_tk).double()
    y_R = x.new_zeros(schedule.num_rows, H, dtype=torch.float64)
    d_x_R = torch.zeros_like(y_R)
    d_w_R = torch.zeros_like(w_R)
    segments = {e: (s, n) for e, s, n in expert_segments(schedule)}
    for e in range(w2.shape[0]):
        if e not in segments:  # no rows: its exact gradients are zeros, which a result must match
            yield "d_down_proj", torch.zeros(w2.shape[1:], dtype=torch.float64, device=x.device), e
            yield "d_gate_up_proj", torch.zeros(w13.shape[1:], dtype=torch.float64, device=x.device), e
            continue
        s, n = segments[e]
        tokens = schedule.row_to_token[s : s + n]
        x_e, d_o, w = x[tokens].double(), d_out[tokens].double(), w_R[s : s + n, None]
        w13_e, w2_e = w13[e].double(), w2[e].double()
        h = x_e @ w13_e.t()
        a = activation_fp64(h, family)
        y_R[s : s + n] = (a @ w2_e.t()) * w
        d_a_prime = d_o @ w2_e
        d_w_R[s : s + n] = (d_a_prime * a).sum(dim=-1)
        d_h = activation_backward_fp64(h, w * d_a_prime, family)
        d_x_R[s : s + n] = d_h @ w13_e
        yield "d_down_proj", (w * d_o).t() @ a, e
        yield "d_gate_up_proj", d_h.t() @ x_e, e
    kept = schedule.tk_to_row >= 0
    whole["out"] = sum_over_k(rows_in_tk_order(y_R, schedule.tk_to_row, T, K), torch.float64)
    whole["d_x"] = sum_over_k(rows_in_tk_order(d_x_R, schedule.tk_to_row, T, K), torch.float64)
    whole["d_topk_weights"] = torch.where(kept, d_w_R[schedule.tk_to_row.clamp(min=0)], 0.0).view(T, K)
