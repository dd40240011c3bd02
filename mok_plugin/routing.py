"""Router math in plain PyTorch: logits -> scores -> top-k, weights, aux loss and z-loss.

Owns: score functions (softmax, sigmoid), the fixed tie-break top-k (lower expert index wins),
group-limited top-k, the selection-only expert bias, top-k normalisation and scaling, the
Switch-style load-balancing loss, the z-loss, and the expert-bias update helper.

Does not own: the router weight (the layer holds it) or anything after the expert choice.

Determinism: selection uses a stable descending sort, so exact ties always pick the lower expert
index on every device; every reduction here is a fixed-shape torch reduction on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MoKRouting", "count_per_expert", "route", "stable_topk", "update_expert_bias"]


@dataclass(frozen=True, slots=True)
class MoKRouting:
    """The routing decision for one batch of T tokens."""

    topk_ids: torch.Tensor  # int64 [T, K], experts in descending score order (ties: lower index first)
    topk_weights: torch.Tensor  # fp32 [T, K], differentiable w.r.t. the router logits
    aux_loss: torch.Tensor  # fp32 [], load-balancing loss + z-loss, already scaled by their coefficients
    tokens_per_expert: torch.Tensor  # int64 [E], routed (token, k) pairs per expert, before any drop


def stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row; among equal values the lower index wins.

    `torch.topk` does not promise an order for ties, so this sorts stably instead.

    Args:
        values: float [N, M].
        k: how many to take, 1 <= k <= M.
    Returns:
        int64 [N, k] in descending value order.
    """
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def count_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many (token, k) pairs chose each expert.

    Integer adds commute, so the result is exact in any order; unlike `torch.bincount`, the output
    size does not depend on the data, which `torch.compile(fullgraph=True)` needs.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def _group_limited_mask(selection_scores: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """Bool [T, E]: True for experts inside the token's `topk_group` best groups.

    A group's score is the sum of its best (top_k // topk_group) expert scores, as DeepSeek-V3 and
    Megatron-Core compute it; groups are chosen with the same fixed tie-break as experts.
    """
    T, E = selection_scores.shape
    per_group = selection_scores.view(T, n_group, E // n_group)
    best_in_group = torch.sort(per_group, dim=-1, descending=True, stable=True).values
    group_scores = best_in_group[..., : top_k // topk_group].sum(dim=-1)
    chosen_groups = stable_topk(group_scores, topk_group)
    group_mask = torch.zeros(T, n_group, dtype=torch.bool, device=selection_scores.device)
    group_mask.scatter_(1, chosen_groups, True)
    return group_mask.repeat_interleave(E // n_group, dim=1)


def route(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    score_function: str = "softmax",
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    n_group: int | None = None,
    topk_group: int | None = None,
    expert_bias: torch.Tensor | None = None,
    aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
) -> MoKRouting:
    """Choose K experts per token and compute their weights and the router losses.

    Args:
        router_logits: float [T, E] (differentiable); fp64 keeps the router batch-invariant.
        top_k: K.
        score_function: "softmax" (over all E) or "sigmoid" (per expert).
        norm_topk_prob: divide the K chosen scores by their sum.
        routed_scaling_factor: multiplies the final weights.
        n_group, topk_group: group-limited routing (both or neither).
        expert_bias: fp32 [E] added to the scores for selection only; the weights never see it.
        aux_loss_coeff: Switch load-balancing loss, E * coeff / (K * T^2) * sum_e P_e * N_e, where
            P_e sums the (normalised) scores of expert e over tokens and N_e counts its picks.
        z_loss_coeff: coeff * mean_t logsumexp(logits_t)^2.
    Returns:
        MoKRouting.
    Raises:
        ValueError: logits not 2-D float, or top_k out of range.
    """
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(
            f"router_logits must be a float [T, E] tensor, got {router_logits.dtype} {tuple(router_logits.shape)}"
        )
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={E}")
    # Scores in fp64, rounded to fp32: vectorised exp/sigmoid kernels round a value differently
    # depending on its position in the tensor (SIMD body vs tail), so an fp32 score could depend
    # on the batch size; the fp64 result rounded to fp32 does not, in practice.
    logits = router_logits.double()
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1).float()
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits).float()
    else:
        raise ValueError(f"score_function={score_function!r}; allowed: 'softmax', 'sigmoid'")

    # Selection never carries gradient: it is a discrete choice.
    selection_scores = scores.detach()
    if expert_bias is not None:
        selection_scores = selection_scores + expert_bias.float()
    if n_group is not None and topk_group is not None:
        keep = _group_limited_mask(selection_scores, n_group, topk_group, top_k)
        selection_scores = selection_scores.masked_fill(~keep, float("-inf"))
    topk_ids = stable_topk(selection_scores, top_k)

    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor

    tokens_per_expert = count_per_expert(topk_ids, E)

    aux_loss = scores.new_zeros(())
    if aux_loss_coeff > 0.0 and T > 0:
        # Sigmoid scores are normalised per token so that P_e is a distribution, as in Megatron-Core.
        probs = scores if score_function == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        load = tokens_per_expert.to(torch.float32)
        aux_loss = aux_loss + (E * aux_loss_coeff / (top_k * T * T)) * (probs.sum(dim=0) * load).sum()
    if z_loss_coeff > 0.0 and T > 0:
        aux_loss = aux_loss + z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean().float()

    return MoKRouting(topk_ids, topk_weights, aux_loss, tokens_per_expert)


@torch.no_grad()
def update_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, update_rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3): raise the bias of under-loaded experts.

    bias_e += rate * sign(mean_count - count_e), in place.

    Args:
        expert_bias: fp32 [E], updated in place.
        tokens_per_expert: int [E], counts accumulated since the last update (for example over a
            global batch, after summing across data-parallel ranks).
        update_rate: the step size.
    Returns:
        expert_bias (the same tensor).
    """
    if expert_bias.shape != tokens_per_expert.shape:
        raise ValueError(
            f"expert_bias {tuple(expert_bias.shape)} and tokens_per_expert {tuple(tokens_per_expert.shape)} must match"
        )
    counts = tokens_per_expert.to(torch.float32)
    expert_bias.add_(update_rate * torch.sign(counts.mean() - counts))
    return expert_bias
