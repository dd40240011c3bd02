"""DeepSpeed's gates, deterministic: the routing decision of deepspeed.moe.sharded_moe (0.19.8).

Owns, for one rank's T tokens and E experts: which experts each token chooses, which (token, k)
pairs survive the capacity limit, their combine weights, `l_aux` and `exp_counts`, exactly as
DeepSpeed's gates define them, with DeepSpeed's random options drawn from MoK's counter-based
stream (random_stream.py) instead of torch's global generator:

  k = 1   `top1_gating`  = sharded_moe.top1gating    (RSample, use_rts, used_token)
  k = 2   `top2_gating`  = sharded_moe.top2gating    (top2_2nd_expert_sampling)
  k >= 3  `topk_gating`  = sharded_moe.topkgating    (drop_policy 'probs' | 'position')
  `DeepSpeedGate`        = sharded_moe.TopKGate.forward (Jitter, train/eval capacity factor), as
                           MoKMoE.routing_fn.

DeepSpeed's definitions (S = T tokens, p = softmax(logits) [T, E] in the logits' dtype):
  capacity   C = max(ceil(T / E * f), min_capacity), f = capacity_factor * (1, 2, k) for k = 1, 2,
             >= 3, computed in float32 as DeepSpeed's `_capacity` does; drop_tokens=False: C = the
             largest count (nothing is dropped; DeepSpeed also all-reduces it over EP and pads it to
             the TP size, which only sizes its buffers).
  top-1      expert argmax(p) (RSample: argmax(logits + Gumbel)); each expert keeps its C tokens of
             highest priority: used_token[t] * U[t] with use_rts (U uniform), used_token[t] without;
             weight p[t, e] (not renormalised), times used_token[t]; exp_counts and l_aux count
             used_token-weighted first choices before the drop: l_aux = E * sum_e mean_t(p) ce_e.
  top-2      1st expert argmax(p); 2nd argmax over the other experts of logits (+ Gumbel with
             top2_2nd_expert_sampling); kept by position: an expert's 1st choices in token order,
             then its 2nd choices in token order, the first C kept; weights p renormalised over the
             kept pairs (denominator clamped at eps); l_aux = E^2 mean_e(me * ce) with ce from the
             1st choices only; exp_counts count both choices. used_token is ignored (as DeepSpeed).
  top-k      torch.topk(p, k); 'probs': each expert keeps its C pairs of highest p; 'position':
             its first C pairs in token order; weights renormalised over the kept pairs; l_aux =
             E^2 / k mean_e(me * ce), ce from all k choices; used_token is ignored (as DeepSpeed).

Ties (where DeepSpeed's order is implementation-defined, MoK fixes it):
  - torch.argmax returns the first maximal index (documented by PyTorch), so top-1 and top-2's
    choices are already determined; MoK uses argmax as DeepSpeed does.
  - top-k's expert choice (torch.topk over E): MoK takes a stable descending sort, so among equal
    scores the lower expert index wins.
  - Which tokens an expert keeps: DeepSpeed takes torch.topk over tokens of the priority (top-1:
    the 0/1 mask without RTS, so EVERY routed token ties and the kept set is whatever the topk
    kernel returns; with RTS, uniform draws; top-k 'probs': the probabilities). MoK sorts by
    priority descending, then token index ascending: without RTS top-1 keeps each expert's first
    C tokens in token order, and equal priorities keep the lower token index.
  - A chosen pair whose probability underflowed to 0 ties in DeepSpeed with the experts' unchosen
    zeros; MoK always ranks chosen pairs first (only with fewer than C pairs can this differ).

Randomness (`draw_noise`): each draw is keyed by (seed, step, stream, global token index, column),
so it is bitwise repeatable and the same for a token whatever the EP size and whichever tokens
share the batch; the distributions are DeepSpeed's:
  RSample   Gumbel(0, 1) [T, E] added to the logits (training only).
  Jitter    U(1 - 1e-2, 1 + 1e-2) [T, H] multiplying the gate input, low + u * (high - low) in
            float32 as torch's Uniform.rsample (training only).
  use_rts   U(0, 1) [T, E] (k = 1, training and eval, as DeepSpeed).
  top2_2nd_expert_sampling  Gumbel(0, 1) [T, E] added to the logits for the 2nd choice (k = 2,
            training and eval, as DeepSpeed).
The step is the gate's count of training forwards (each training forward draws at the current
count, then advances it); eval forwards draw at the current count from their own streams
("<purpose>/eval/layer=<n>"), so repeated evals route alike. A reentrant activation recomputation
of a training forward draws at that forward's step (mok_plugin/recompute_draws.py).

Does not own: the router weight (MoKMoE holds it), the experts, process groups (an EP group is
passed in only to number the tokens globally: random_stream.token_offset).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mok_plugin.random_stream import global_token_index, gumbel, token_offset, uniform
from mok_plugin.recompute_draws import RecomputeSteps
from mok_plugin.routing import MoKRouting, count_per_expert

__all__ = [
    "JITTER_EPSILON",
    "NOISY_GATE_POLICIES",
    "DeepSpeedGate",
    "DeepSpeedGating",
    "deepspeed_capacity",
    "deepspeed_gating",
    "draw_noise",
    "jitter_factor",
    "top1_gating",
    "top2_gating",
    "topk_gating",
]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
JITTER_EPSILON = 1e-2  # multiplicative_jitter's default, which TopKGate uses


@dataclass(frozen=True, slots=True)
class DeepSpeedGating:
    """DeepSpeed's routing decision for T tokens."""

    topk_ids: torch.Tensor  # int64 [T, K]: chosen experts (k = 2: 1st, 2nd; k >= 3: descending p)
    combine_weights: torch.Tensor  # logits' dtype [T, K], differentiable; 0 where not kept
    kept: torch.Tensor  # bool [T, K]: the pair survives the capacity limit (and used_token)
    l_aux: torch.Tensor  # logits' dtype [], differentiable, unscaled
    exp_counts: torch.Tensor  # [E] as DeepSpeed returns them (int64; top-1 with used_token: its dtype)
    capacity: int | torch.Tensor  # C; dropless: int64 [] this rank's largest count


def _fp32(value: float) -> float:
    """value rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def deepspeed_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """sharded_moe._capacity on the host: max(ceil(T / E * factor), min_capacity).

    DeepSpeed multiplies the Python float T / E by a float32 tensor of the factor, so the product
    is rounded to float32 before the ceil; so is it here (a float32 product of two float32 values
    is the exact product rounded once). Callers pass the factor DeepSpeed passes: capacity_factor
    for k = 1, capacity_factor * 2 for k = 2, capacity_factor * k for k >= 3.
    """
    product = _fp32(_fp32(num_tokens / num_experts) * _fp32(capacity_factor))
    return max(math.ceil(product), int(min_capacity))


def _rank_within_expert(expert: torch.Tensor, num_experts: int, priority: torch.Tensor | None) -> torch.Tensor:
    """int64 [N]: each entry's position among the entries of its expert, ordered by priority
    descending, then by entry index ascending (both sorts stable). expert int64 [N], E = none."""
    N = expert.shape[0]
    order = torch.arange(N, device=expert.device)
    if priority is not None:
        order = torch.sort(priority.detach(), descending=True, stable=True).indices
    by_expert = torch.sort(expert[order], stable=True)
    order = order[by_expert.indices]
    counts = count_per_expert(expert.view(-1, 1), num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(N, device=expert.device) - starts[by_expert.values]
    return rank


def _dropless_capacity(exp_counts: torch.Tensor) -> torch.Tensor:
    return exp_counts.max() if exp_counts.numel() else exp_counts.new_zeros(())


def top1_gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    *,
    drop_tokens: bool = True,
    rsample_noise: torch.Tensor | None = None,
    rts_uniform: torch.Tensor | None = None,
) -> DeepSpeedGating:
    """sharded_moe.top1gating (see the module docstring).

    Args:
        logits: float32 or float64 [T, E]; everything is computed in this dtype.
        capacity_factor, min_capacity: DeepSpeed's (the train or eval factor, as TopKGate picks).
        used_token: [T] mask (0/1; DeepSpeed multiplies by it), or None.
        drop_tokens: False: dropless.
        rsample_noise: [T, E] Gumbel noise (noisy_gate_policy 'RSample' in training), or None.
        rts_uniform: [T, E] U(0, 1) priorities (use_rts), or None: keep in token order.
    Returns:
        DeepSpeedGating with K = 1.
    Raises:
        ValueError: T < min_capacity (DeepSpeed's assertion).
    """
    T, E = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = logits + rsample_noise.to(logits.dtype) if rsample_noise is not None else gates
    ids = torch.argmax(chooser, dim=1)
    mask1 = F.one_hot(ids, num_classes=E)
    if used_token is not None:
        mask1 = used_token.view(-1, 1) * mask1
    exp_counts = mask1.sum(dim=0).detach()
    me = gates.mean(dim=0)
    ce = mask1.to(logits.dtype).mean(dim=0)
    l_aux = (me * ce).sum() * E
    if T < min_capacity:
        raise ValueError(
            "No. of tokens (batch-size) should be greater than min_capacity. Either set min_capacity to 0 or "
            f"increase your batch size (DeepSpeed's top-1 gate; T={T}, min_capacity={min_capacity})"
        )
    m = torch.ones(T, dtype=logits.dtype, device=logits.device) if used_token is None else used_token.to(logits.dtype)
    routed = m != 0
    if drop_tokens:
        capacity: int | torch.Tensor = deepspeed_capacity(T, E, capacity_factor, min_capacity)
        priority = None
        if rts_uniform is not None:
            priority = m * rts_uniform.to(logits.dtype).gather(1, ids.view(-1, 1)).view(-1)
        elif used_token is not None:
            priority = m
        rank = _rank_within_expert(torch.where(routed, ids, E), E, priority)
        kept = routed & (rank < capacity)
    else:
        capacity = _dropless_capacity(exp_counts)
        kept = routed
    weights = gates.gather(1, ids.view(-1, 1)).view(-1) * m
    weights = torch.where(kept, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    return DeepSpeedGating(ids.view(-1, 1), weights.view(-1, 1), kept.view(-1, 1), l_aux, exp_counts, capacity)


def top2_gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    drop_tokens: bool = True,
    second_noise: torch.Tensor | None = None,
) -> DeepSpeedGating:
    """sharded_moe.top2gating (see the module docstring).

    Args:
        logits: float32 or float64 [T, E] (not modified; DeepSpeed adds the noise in place).
        capacity_factor, min_capacity: DeepSpeed's; the capacity uses 2 * capacity_factor.
        drop_tokens: False: dropless.
        second_noise: [T, E] Gumbel noise for the 2nd choice (top2_2nd_expert_sampling), or None.
    Returns:
        DeepSpeedGating with K = 2 (1st, 2nd choice).
    """
    T, E = logits.shape
    gates = F.softmax(logits, dim=1)
    ids1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(ids1, num_classes=E)
    chooser = logits.detach() if second_noise is None else logits.detach() + second_noise.to(logits.dtype)
    ids2 = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(ids2, num_classes=E)
    me = gates.mean(dim=0)
    ce = mask1.to(logits.dtype).mean(dim=0)
    l_aux = (me * ce).mean() * E * E
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity: int | torch.Tensor = deepspeed_capacity(T, E, capacity_factor * 2, min_capacity)
        count1 = count_per_expert(ids1.view(-1, 1), E)
        rank1 = _rank_within_expert(ids1, E, None)
        rank2 = _rank_within_expert(ids2, E, None) + count1[ids2]  # after all 1st choices (pre-drop)
        kept = torch.stack([rank1 < capacity, rank2 < capacity], dim=1)
    else:
        capacity = _dropless_capacity(exp_counts)
        kept = torch.ones(T, 2, dtype=torch.bool, device=logits.device)
    ids = torch.stack([ids1, ids2], dim=1)
    g = torch.where(kept, gates.gather(1, ids), torch.zeros((), dtype=gates.dtype, device=gates.device))
    denom = torch.clamp(g[:, 0] + g[:, 1], min=torch.finfo(g.dtype).eps)
    return DeepSpeedGating(ids, g / denom.unsqueeze(1), kept, l_aux, exp_counts, capacity)


def topk_gating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    *,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> DeepSpeedGating:
    """sharded_moe.topkgating (see the module docstring); no randomness.

    Args:
        logits: float32 or float64 [T, E].
        k: K, 1 <= K <= E.
        capacity_factor, min_capacity: DeepSpeed's; the capacity uses k * capacity_factor.
        drop_tokens: False: dropless.
        drop_policy: 'probs' (DeepSpeed MoE's, not exposed by it) or 'position'.
    Returns:
        DeepSpeedGating with K = k, experts in descending p (ties: lower index first).
    Raises:
        ValueError: an unknown drop_policy.
    """
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"Invalid drop_policy: {drop_policy}")
    T, E = logits.shape
    gates = F.softmax(logits, dim=1)
    ids = torch.sort(gates.detach(), dim=1, descending=True, stable=True).indices[:, :k]
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, ids, True)
    exp_counts = mask.sum(dim=0).detach()
    me = gates.mean(dim=0)
    ce = mask.to(logits.dtype).mean(dim=0)
    l_aux = (me * ce).mean() * E * E / k
    g = gates.gather(1, ids)
    if drop_tokens:
        capacity: int | torch.Tensor = deepspeed_capacity(T, E, capacity_factor * k, min_capacity)
        # Pairs token-major: within an expert, index order is token order (one pair per token).
        rank = _rank_within_expert(ids.reshape(-1), E, g.reshape(-1) if drop_policy == "probs" else None)
        kept = (rank < capacity).view(T, k)
    else:
        capacity = _dropless_capacity(exp_counts)
        kept = torch.ones(T, k, dtype=torch.bool, device=logits.device)
    g = torch.where(kept, g, torch.zeros((), dtype=g.dtype, device=g.device))
    total = g[:, 0]
    for j in range(1, k):  # a fixed order: the choices in descending p
        total = total + g[:, j]
    denom = torch.clamp(total, min=torch.finfo(g.dtype).eps)
    return DeepSpeedGating(ids, g / denom.unsqueeze(1), kept, l_aux, exp_counts, capacity)


def deepspeed_gating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    *,
    used_token: torch.Tensor | None = None,
    drop_tokens: bool = True,
    rsample_noise: torch.Tensor | None = None,
    rts_uniform: torch.Tensor | None = None,
    second_noise: torch.Tensor | None = None,
) -> DeepSpeedGating:
    """The gate TopKGate picks for k: top1_gating, top2_gating or topk_gating ('probs').

    used_token, rsample_noise and rts_uniform reach top-1 only, second_noise top-2 only (as in
    DeepSpeed, where the other gates do not take them).
    """
    if k == 1:
        return top1_gating(
            logits, capacity_factor, min_capacity, used_token,
            drop_tokens=drop_tokens, rsample_noise=rsample_noise, rts_uniform=rts_uniform,
        )  # fmt: skip
    if k == 2:
        return top2_gating(logits, capacity_factor, min_capacity, drop_tokens=drop_tokens, second_noise=second_noise)
    return topk_gating(logits, k, capacity_factor, min_capacity, drop_tokens=drop_tokens)


def jitter_factor(u: torch.Tensor, epsilon: float = JITTER_EPSILON) -> torch.Tensor:
    """float32: U(1 - eps, 1 + eps) from u ~ U(0, 1), as torch's Uniform(low, high).rsample maps its
    draw (low + u * (high - low), float32 tensors), which multiplicative_jitter uses."""
    low = torch.tensor(1.0 - epsilon, dtype=torch.float32, device=u.device)
    high = torch.tensor(1.0 + epsilon, dtype=torch.float32, device=u.device)
    return low + u.to(torch.float32) * (high - low)


def _stream(purpose: str, layer: int, training: bool) -> str:
    return f"{purpose}/layer={layer}" if training else f"{purpose}/eval/layer={layer}"


def draw_noise(
    purpose: str,
    seed: int,
    step: int,
    layer: int,
    token_index: torch.Tensor,
    columns: int,
    *,
    training: bool = True,
) -> torch.Tensor:
    """MoK's draw for one of DeepSpeed's random options, float32 [T, columns].

    Args:
        purpose: "rsample" (Gumbel, columns E), "jitter" (the U(1 - 1e-2, 1 + 1e-2) factor, columns
            H), "rts" (U(0, 1), columns E) or "top2_sampling" (Gumbel, columns E).
        seed: MoKConfig.random_seed.
        step: the gate's training-forward count.
        layer: the layer's number in the stream (DeepSpeedGate.layer).
        token_index: int64 [T] global token indices (`token_offset` + local index).
        columns: E or H.
        training: eval draws come from separate streams.
    Raises:
        ValueError: an unknown purpose.
    """
    stream = _stream(purpose, layer, training)
    if purpose in ("rsample", "top2_sampling"):
        return gumbel(seed, step, stream, token_index, columns)
    if purpose == "rts":
        return uniform(seed, step, stream, token_index, columns)
    if purpose == "jitter":
        return jitter_factor(uniform(seed, step, stream, token_index, columns))
    raise ValueError(f"purpose={purpose!r}; allowed: 'rsample', 'jitter', 'rts', 'top2_sampling'")


class DeepSpeedGate:
    """TopKGate.forward as a MoKMoE.routing_fn: logits from the gate input and the router weight,
    then `deepspeed_gating` with MoK's draws; returns a MoKRouting.

    MoKRouting: `topk_ids` the chosen experts, dropped pairs included with weight 0: they are
    computed and add exact zeros to the output and to every gradient (the router's too: the weight
    is a constant 0), and every EP size computes the same rows, so that EP 1, 2, 4 agree bitwise.
    (Against a run that skips them, an expert's weight-gradient sum may round differently in the
    last bit; a non-finite expert output would turn 0 * y into NaN.)
    `topk_weights` fp32 (0 for dropped pairs), `aux_loss` DeepSpeed's l_aux (also as
    losses["aux_loss"]), `tokens_per_expert` exp_counts as int64.

    Attributes:
        step: training forwards so far (the random stream's step); set it to resume a run.
        used_token: the next call's used_token (mok_plugin.deepspeed.MoE.forward sets it), or None.
        last: the last call's DeepSpeedGating (exp_counts in DeepSpeed's dtype, capacity).
        logits_dtype: float64 (MoK's batch-invariant router) or float32 (DeepSpeed's arithmetic).

    Activation recomputation (deepspeed.checkpointing, reentrant): the recomputed training forward
    draws at its first pass's step (`recompute_steps`, mok_plugin/recompute_draws.py), as
    DeepSpeed's checkpointing restores the torch RNG for its own noise.
    """

    def __init__(
        self,
        *,
        k: int,
        num_experts: int,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        seed: int = 0,
        layer: int = 0,
        token_group=None,
        logits_dtype: torch.dtype = torch.float64,
    ) -> None:
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy!r}; allowed: {NOISY_GATE_POLICIES}")
        self.k, self.num_experts = k, num_experts
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        # () -> the process group whose ranks' tokens are numbered one after another (the
        # data-parallel group: EP groups lie inside it, so the numbering does not depend on the EP
        # size; tensor-parallel replicas share their data-parallel rank), or None: this rank alone.
        self.seed, self.layer, self.token_group = seed, layer, token_group
        self.logits_dtype = logits_dtype
        self.step = 0
        self.recompute_steps: RecomputeSteps[int] = RecomputeSteps()  # reentrant recomputation's draws
        self.used_token: torch.Tensor | None = None
        self.last: DeepSpeedGating | None = None

    def _new_step(self) -> int:
        step, self.step = self.step, self.step + 1
        return step

    def _purposes(self, training: bool) -> tuple[str, ...]:
        purposes = []
        if training and self.noisy_gate_policy == "Jitter":
            purposes.append("jitter")
        if self.k == 1 and training and self.noisy_gate_policy == "RSample":
            purposes.append("rsample")
        if self.k == 1 and self.use_rts and self.drop_tokens:
            purposes.append("rts")  # DeepSpeed draws it dropless too, where it changes nothing
        if self.k == 2 and self.top2_2nd_expert_sampling:
            purposes.append("top2_sampling")
        return tuple(purposes)

    def __call__(
        self, x_TH: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, training: bool = False
    ) -> MoKRouting:
        """x_TH [T, H] the gate input, weight [E, H] (bias [E]) the router: the routing decision."""
        T, H = x_TH.shape
        E = self.num_experts
        step = self.recompute_steps.take(self._new_step) if training else self.step
        purposes = self._purposes(training)
        noise: dict[str, torch.Tensor] = {}
        if purposes:
            group = self.token_group() if self.token_group is not None else None
            tokens = global_token_index(T, token_offset(T, group, x_TH.device), device=x_TH.device)
            for purpose in purposes:
                columns = H if purpose == "jitter" else E
                noise[purpose] = draw_noise(purpose, self.seed, step, self.layer, tokens, columns, training=training)
        dtype = self.logits_dtype
        x = x_TH.to(dtype)
        if "jitter" in noise:
            x = x * noise["jitter"].to(dtype)
        logits = F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))
        used_token, self.used_token = self.used_token, None
        result = deepspeed_gating(
            logits,
            self.k,
            self.capacity_factor if training else self.eval_capacity_factor,
            self.min_capacity,
            used_token=used_token,
            drop_tokens=self.drop_tokens,
            rsample_noise=noise.get("rsample"),
            rts_uniform=noise.get("rts"),
            second_noise=noise.get("top2_sampling"),
        )
        self.last = result
        ids = result.topk_ids
        l_aux = result.l_aux.float()
        return MoKRouting(
            ids, result.combine_weights.float(), l_aux, result.exp_counts.to(torch.int64), {"aux_loss": l_aux}
        )
