"""Router math in plain PyTorch: logits -> scores -> top-k, weights, aux losses and z-loss.

Owns: score functions (softmax, sigmoid, sqrtsoftplus), the fixed tie-break top-k (lower expert
index wins), group-limited top-k, the selection-only expert bias, top-k normalisation and scaling,
the Switch-style load-balancing losses at three levels (micro-batch `aux_loss`, per-sequence
`seq_aux_loss`, global-batch `global_aux_loss`), the z-loss, and the expert-bias update helper.

The losses follow Megatron-Core 0.19 (transformer/moe/router.py TopKRouter._apply_aux_loss,
_apply_seq_aux_loss, _apply_global_aux_loss, apply_z_loss; moe_utils.py
compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func, z_loss_func): a load-balancing
loss counts each token's plain top-k of its normalised scores (no groups, no expert bias), which
can differ from the experts the token is routed to.

Does not own: the router weight (the layer holds it), process groups (a `MoKTokenScope` hands in
the reductions as callables), or anything after the expert choice.

Determinism: selection uses a stable descending sort, so exact ties always pick the lower expert
index on every device; every float reduction here is a fixed-shape torch reduction on one device;
token counts cross ranks as int64, whose sums are exact in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import torch

from mok_plugin.config import ScoreFunction

__all__ = [
    "LOSS_NAMES",
    "SCORE_FUNCTIONS",
    "MoKRouting",
    "MoKTokenScope",
    "count_per_expert",
    "route",
    "stable_topk",
    "straight_through",
    "update_expert_bias",
]

SCORE_FUNCTIONS: tuple[str, ...] = get_args(ScoreFunction)
# The router-loss terms, in the order they are summed into MoKRouting.aux_loss.
LOSS_NAMES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")


@dataclass(frozen=True, slots=True)
class MoKRouting:
    """The routing decision for one batch of T tokens."""

    topk_ids: torch.Tensor  # int64 [T, K], experts in descending score order (ties: lower index first)
    topk_weights: torch.Tensor  # fp32 [T, K], differentiable w.r.t. the router logits
    aux_loss: torch.Tensor  # fp32 [], the sum of `losses` in LOSS_NAMES order (zero when there are none)
    tokens_per_expert: torch.Tensor  # int64 [E], routed (token, k) pairs per expert, before any drop
    # name (LOSS_NAMES) -> fp32 [], each enabled term already scaled by its coefficient; differentiable
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    # With a padding mask: int64 [E], the pairs of the tokens that are not padding (what Megatron's
    # expert-bias balancing counts); None without one (then every pair counts: tokens_per_expert).
    unpadded_tokens_per_expert: torch.Tensor | None = None

    @property
    def counted_tokens_per_expert(self) -> torch.Tensor:
        """int64 [E]: the routed pairs that balancing counts (every pair but a padding token's)."""
        return self.tokens_per_expert if self.unpadded_tokens_per_expert is None else self.unpadded_tokens_per_expert


@dataclass(frozen=True, slots=True)
class MoKTokenScope:
    """Where one call's T tokens sit in the batches the load-balancing losses are taken over.

    A micro-batch may be split over several ranks (Megatron: its tensor x context-parallel group,
    sequence shards); `global_aux_loss` counts a whole global batch (Megatron: the tensor x data x
    context-parallel group, over every micro-batch of the step). The reductions come in as
    callables so that this module stays free of process groups. The defaults describe one rank
    holding one sequence.
    """

    # B: the T tokens are ordered [S, B] (Megatron's [S, B, H] flattened), token t in sequence t % B.
    num_sequences: int = 1
    # Ranks whose tokens together form the micro-batch, this one included.
    sequence_ranks: int = 1
    # int64 [N] -> int64 [N]: the sum over those ranks (None: the tensor itself, one rank).
    sum_over_sequence_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Ranks whose tokens together form one micro-batch of the global batch, this one included.
    global_ranks: int = 1
    # int64 [E] this call's counts -> fp32 [E]: counts summed over the global ranks, averaged over
    # the micro-batches of the global batch so far, this one included (None: the counts themselves).
    global_tokens_per_expert: Callable[[torch.Tensor], torch.Tensor] | None = None
    # int64 [N] -> int64 [N]: the sum over the global ranks (None: one rank). Asked only with a
    # padding mask, whose global_aux_loss divides by the global batch's tokens that are not padding.
    sum_over_global_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    def sum_sequence(self, counts: torch.Tensor) -> torch.Tensor:
        return counts if self.sum_over_sequence_ranks is None else self.sum_over_sequence_ranks(counts)

    def global_average(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.float() if self.global_tokens_per_expert is None else self.global_tokens_per_expert(counts)

    def sum_global(self, counts: torch.Tensor) -> torch.Tensor:
        return counts if self.sum_over_global_ranks is None else self.sum_over_global_ranks(counts)


class _StraightThrough(torch.autograd.Function):
    """Forward: `replacement`; backward: the gradient goes to `logits` unchanged (Megatron's RandomSTE)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return replacement.to(logits.dtype).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def straight_through(logits: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
    """`replacement`'s values with `logits`' gradient: routing on random logits for benchmarks
    (--moe-router-force-load-balancing) while the router weight still receives its gradient."""
    return _StraightThrough.apply(logits, replacement)


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


def count_per_expert(topk_ids: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [E]: how many (token, k) pairs chose each expert; with `valid` (bool [T]), only the
    pairs of the tokens it marks.

    Integer adds commute, so the result is exact in any order; unlike `torch.bincount`, the output
    size does not depend on the data, which `torch.compile(fullgraph=True)` needs (and a mask adds
    zeros instead of selecting rows, for the same reason).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    if valid is None:
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts.scatter_add_(0, flat, valid.to(torch.int64).unsqueeze(1).expand_as(topk_ids).reshape(-1))


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
    # expand, then one copy (Tensor.repeat_interleave with an int: 54 us of host on the H200 where
    # ops.py used it, BENCHMARKS.md "Small batches: where the host's time goes")
    return group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp32 [T, E] router scores from fp64 logits (computed in fp64, rounded once)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1).float()
    if score_function == "sigmoid":
        return torch.sigmoid(logits).float()
    if score_function == "sqrtsoftplus":
        # DeepSeek-V4: sqrt(softplus(x)), as Megatron-Core's topk_routing_with_score_function.
        return torch.nn.functional.softplus(logits).sqrt().float()
    raise ValueError(f"score_function={score_function!r}; allowed: {', '.join(map(repr, SCORE_FUNCTIONS))}")


def _switch_loss(
    probs_per_expert: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int | torch.Tensor,
    top_k: int,
    E: int,
    coeff: float,
) -> torch.Tensor:
    """Megatron-Core's switch_load_balancing_loss_func: sum(P * N) * E * coeff / (K * T_total^2);
    T_total a tensor where a padding mask makes it a count of the tokens that are not padding."""
    return (probs_per_expert * tokens_per_expert).sum() * (E * coeff / (top_k * total_tokens * total_tokens))


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
    seq_aux_loss_coeff: float = 0.0,
    global_aux_loss_coeff: float = 0.0,
    scope: MoKTokenScope | None = None,
    padding: torch.Tensor | None = None,
) -> MoKRouting:
    """Choose K experts per token and compute their weights and the router losses.

    The load-balancing losses all take the Switch form E * coeff / (K * T^2) * sum_e P_e * N_e,
    where P_e sums expert e's aux score over this call's tokens (softmax scores; sigmoid and
    sqrtsoftplus scores divided by their sum over E per token) and N_e counts the tokens whose plain
    top-K of those scores holds e (no groups, no expert bias: what Megatron-Core counts), summed
    over the ranks of `scope`:
      aux_loss          N over the micro-batch (this call and scope.sequence_ranks); T its tokens.
      seq_aux_loss      the same per sequence (scope.num_sequences), summed over sequences and
                        divided by their number; T the tokens of one sequence.
      global_aux_loss   N from scope.global_tokens_per_expert (the global batch's running mean);
                        T = this call's tokens x scope.global_ranks.
    The z-loss is z_loss_coeff / scope.sequence_ranks * mean_t logsumexp(logits_t)^2 (each rank
    averages its own tokens; the ranks' terms add up to the micro-batch mean).

    With `padding` (Megatron-Core's `padding_mask` as its router code reads it: True for a padding
    token), padding tokens are routed like any other, and left out of every loss as Megatron leaves
    them out: their aux scores and counts are zero, each T above becomes the count of the tokens
    that are not padding (over the same ranks; seq_aux_loss's per sequence is that count over the
    micro-batch divided by B), the z-loss averages those tokens only (over at least one), and
    `unpadded_tokens_per_expert` counts their pairs.

    Args:
        router_logits: float [T, E] (differentiable); fp64 keeps the router batch-invariant.
        top_k: K.
        score_function: "softmax" (over all E), "sigmoid" or "sqrtsoftplus" (per expert).
        norm_topk_prob: divide the K chosen scores by their sum.
        routed_scaling_factor: multiplies the final weights.
        n_group, topk_group: group-limited routing (both or neither).
        expert_bias: fp32 [E] added to the scores for selection only; the weights never see it.
        aux_loss_coeff, seq_aux_loss_coeff, global_aux_loss_coeff: the three load-balancing
            losses' coefficients (0: the term is not computed).
        z_loss_coeff: the z-loss coefficient.
        scope: where these tokens sit (sequences, ranks); default: one rank, one sequence.
        padding: bool [T], True for a padding token (see above); None: every token counts.
    Returns:
        MoKRouting.
    Raises:
        ValueError: logits not 2-D float, top_k out of range, an unknown score function,
            seq_aux_loss with T not a multiple of scope.num_sequences, or padding not bool [T].
    """
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(
            f"router_logits must be a float [T, E] tensor, got {router_logits.dtype} {tuple(router_logits.shape)}"
        )
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={E}")
    if padding is not None and (padding.dtype != torch.bool or tuple(padding.shape) != (T,)):
        raise ValueError(f"padding must be a bool [T={T}] tensor, got {padding.dtype} {tuple(padding.shape)}")
    valid = None if padding is None else ~padding
    scope = scope or MoKTokenScope()
    B = scope.num_sequences
    if seq_aux_loss_coeff > 0.0 and (B < 1 or T % B != 0):
        raise ValueError(f"seq_aux_loss: T={T} tokens do not split into num_sequences={B} sequences of equal length")
    # Scores in fp64, rounded to fp32: vectorised exp/sigmoid kernels round a value differently
    # depending on its position in the tensor (SIMD body vs tail), so an fp32 score could depend
    # on the batch size; the fp64 result rounded to fp32 does not, in practice.
    logits = router_logits.double()
    scores = _scores(logits, score_function)

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
    unpadded = None if valid is None else count_per_expert(topk_ids, E, valid)

    losses: dict[str, torch.Tensor] = {}
    balancing = (aux_loss_coeff, seq_aux_loss_coeff, global_aux_loss_coeff)
    if T > 0 and any(coeff > 0.0 for coeff in balancing):
        # Megatron-Core's scores_for_aux_loss: softmax scores, or sigmoid/sqrtsoftplus scores
        # normalised per token so that P_e is a distribution.
        probs = scores if score_function == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        if valid is not None:
            probs = probs * valid.unsqueeze(1)
        # Counted from each token's plain top-K of those scores. The softmax selection without bias
        # or groups is that top-K already; elsewhere it can differ (a biased or group-limited
        # choice, or a tie made by the normalisation), so it is taken again.
        if score_function == "softmax" and expert_bias is None and n_group is None:
            aux_ids = topk_ids
            aux_counts = tokens_per_expert if valid is None else unpadded
        else:
            aux_ids = stable_topk(probs.detach(), top_k)
            aux_counts = count_per_expert(aux_ids, E, valid)
        if aux_loss_coeff > 0.0:
            counts = scope.sum_sequence(aux_counts)
            total = T * scope.sequence_ranks if valid is None else _unpadded_tokens(counts, top_k)
            losses["aux_loss"] = _switch_loss(probs.sum(dim=0), counts, total, top_k, E, aux_loss_coeff)
        if seq_aux_loss_coeff > 0.0:
            # Megatron folds the B sequences into the expert dimension: [S, B * E].
            S = T // B
            sequence_of_pick = (torch.arange(T, device=aux_ids.device) % B).unsqueeze(1)
            counts = scope.sum_sequence(count_per_expert(sequence_of_pick * E + aux_ids, B * E, valid))
            total = S * scope.sequence_ranks if valid is None else _unpadded_tokens(counts, top_k * B)
            per_sequence = _switch_loss(probs.reshape(S, B * E).sum(dim=0), counts, total, top_k, E, seq_aux_loss_coeff)
            losses["seq_aux_loss"] = per_sequence / B
        if global_aux_loss_coeff > 0.0:
            counts = scope.global_average(aux_counts)
            total = T * scope.global_ranks if valid is None else _unpadded_tokens(scope.sum_global(aux_counts), top_k)
            losses["global_aux_loss"] = _switch_loss(probs.sum(dim=0), counts, total, top_k, E, global_aux_loss_coeff)
    if z_loss_coeff > 0.0 and T > 0:
        coeff = z_loss_coeff / scope.sequence_ranks
        squares = torch.logsumexp(logits, dim=-1).square()
        if valid is None:
            mean = squares.mean()
        else:  # Megatron's z_loss_func: the tokens that are not padding, over at least one
            mean = (squares * valid).sum() / valid.sum().clamp(min=1)
        losses["z_loss"] = (mean * coeff).float()

    aux_loss = scores.new_zeros(())
    for name in LOSS_NAMES:
        if name in losses:
            aux_loss = aux_loss + losses[name]
    return MoKRouting(topk_ids, topk_weights, aux_loss, tokens_per_expert, losses, unpadded)


def _unpadded_tokens(counts: torch.Tensor, pairs_per_token: int) -> torch.Tensor:
    """fp32 []: the tokens that are not padding behind `counts` (each gave `pairs_per_token` pairs),
    as Megatron's get_tokens_per_expert_and_token_count divides it under a padding mask."""
    return counts.sum() / pairs_per_token


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
