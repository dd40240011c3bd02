"""Routing: fixed tie-break top-k (exact ties), group-limited selection against a brute-force loop,
selection-only expert bias, normalisation and scaling (softmax, sigmoid, sqrtsoftplus), aux loss and
z-loss values and gradients, the per-sequence and global-batch load-balancing losses against
per-sequence / per-micro-batch loops, their token counts (plain top-K of the normalised scores, not
the biased or group-limited choice), the rank reductions of a MoKTokenScope, padding tokens left
out of every loss, and the expert-bias update."""

import pytest
import torch
import torch.nn.functional as F

from mok_plugin.routing import LOSS_NAMES, MoKTokenScope, route, stable_topk, update_expert_bias


def _naive_topk(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]


def test_exact_ties_pick_lower_expert_index():
    # Every expert has the same logit: the choice must be 0..K-1, in that order, on every token.
    logits = torch.zeros(5, 8)
    r = route(logits, top_k=3)
    assert torch.equal(r.topk_ids, torch.tensor([[0, 1, 2]] * 5))
    # Partial ties: experts 6 and 2 tie at the top, 5 and 1 tie next.
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.0, 0.0, 1.0, 3.0, 0.0]])
    assert route(logits, top_k=4).topk_ids.tolist() == [[2, 6, 1, 5]]


def test_stable_topk_matches_naive_on_random_with_ties():
    g = torch.Generator().manual_seed(1)
    values = torch.randint(0, 4, (50, 16), generator=g).float()  # many exact ties
    got = stable_topk(values, 5).tolist()
    assert got == [_naive_topk(row, 5) for row in values.tolist()]


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(logits, -1)
    return torch.sigmoid(logits) if score_function == "sigmoid" else F.softplus(logits).sqrt()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_weights_are_scores_of_chosen_experts(score_function):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(20, 8, generator=g)
    r = route(logits, top_k=2, score_function=score_function, norm_topk_prob=True, routed_scaling_factor=2.5)
    scores = _scores(logits, score_function)
    expected = scores.gather(1, r.topk_ids)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(r.topk_weights, expected)
    assert r.topk_ids.tolist() == [_naive_topk(row, 2) for row in scores.tolist()]


def test_expert_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    r = route(logits, top_k=1, score_function="sigmoid", expert_bias=bias)
    assert r.topk_ids.tolist() == [[3]]
    torch.testing.assert_close(r.topk_weights, torch.sigmoid(torch.tensor([[-1.0]])))


def test_group_limited_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    T, E, G, Gk, K = 40, 16, 4, 2, 4
    logits = torch.randn(T, E, generator=g)
    r = route(logits, top_k=K, score_function="sigmoid", n_group=G, topk_group=Gk)
    scores = torch.sigmoid(logits).tolist()
    per = E // G
    for t in range(T):
        group_score = [sum(sorted(scores[t][i * per : (i + 1) * per], reverse=True)[: K // Gk]) for i in range(G)]
        groups = _naive_topk(group_score, Gk)
        allowed = [e for e in range(E) if e // per in groups]
        masked = [scores[t][e] if e in allowed else float("-inf") for e in range(E)]
        assert r.topk_ids[t].tolist() == _naive_topk(masked, K), f"token {t}"


def test_aux_and_z_loss_values_and_gradients():
    g = torch.Generator().manual_seed(4)
    T, E, K = 12, 6, 2
    logits = torch.randn(T, E, generator=g, dtype=torch.float64).float().requires_grad_()
    r = route(logits, top_k=K, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    probs = torch.softmax(logits.detach().double(), -1)
    counts = torch.bincount(r.topk_ids.flatten(), minlength=E).double()
    aux = 0.01 * E * sum((counts[e] / (T * K)) * probs[:, e].mean() for e in range(E))
    z = 0.001 * torch.logsumexp(logits.detach().double(), -1).pow(2).mean()
    torch.testing.assert_close(r.aux_loss.double(), aux + z, rtol=1e-5, atol=1e-8)
    r.aux_loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert torch.equal(r.tokens_per_expert, counts.long())


def test_aux_loss_is_zero_without_coefficients():
    r = route(torch.randn(4, 4), top_k=2)
    assert r.aux_loss.item() == 0.0 and r.aux_loss.dim() == 0


def test_update_expert_bias_raises_underloaded():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 0, 5, 5]), 0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    with pytest.raises(ValueError, match="must match"):
        update_expert_bias(bias, torch.tensor([1, 2]), 0.1)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="top_k=5 must be in 1..num_experts=4"):
        route(torch.randn(3, 4), top_k=5)
    with pytest.raises(ValueError, match="score_function='tanh'"):
        route(torch.randn(3, 4), top_k=1, score_function="tanh")
    with pytest.raises(ValueError, match=r"float \[T, E\]"):
        route(torch.ones(3, 4, dtype=torch.long), top_k=1)


# --- the load-balancing losses: Megatron-Core's forms, written as loops -------------------------


def _aux_probs(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """float64 scores_for_aux_loss: softmax, or the per-expert scores normalised per token."""
    scores = _scores(logits.double(), score_function)
    return scores if score_function == "softmax" else scores / scores.sum(-1, keepdim=True)


def _switch(probs: torch.Tensor, picks: list[list[int]], E: int, K: int, coeff: float, T_total: int) -> float:
    """E * coeff / (K * T_total^2) * sum_e (sum of probs of e) * (picks of e), as a loop."""
    counts = [sum(row.count(e) for row in picks) for e in range(E)]
    return E * coeff / (K * T_total**2) * sum(float(probs[:, e].sum()) * counts[e] for e in range(E))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_seq_aux_loss_is_the_mean_of_per_sequence_losses(score_function):
    g = torch.Generator().manual_seed(5)
    S, B, E, K = 6, 3, 8, 2
    logits = torch.randn(S * B, E, generator=g)
    r = route(logits, top_k=K, score_function=score_function, norm_topk_prob=True, seq_aux_loss_coeff=0.01,
              scope=MoKTokenScope(num_sequences=B))  # fmt: skip
    probs = _aux_probs(logits, score_function)
    want = 0.0
    for b in range(B):
        rows = list(range(b, S * B, B))  # tokens are [S, B] sequence-major: sequence b is t % B == b
        picks = [_naive_topk(probs[t].tolist(), K) for t in rows]
        want += _switch(probs[rows], picks, E, K, 0.01, S) / B
    assert set(r.losses) == {"seq_aux_loss"}
    assert r.losses["seq_aux_loss"].item() == pytest.approx(want, rel=1e-5)
    assert torch.equal(r.aux_loss, r.losses["seq_aux_loss"])


def test_seq_aux_loss_needs_whole_sequences():
    with pytest.raises(ValueError, match="num_sequences=4"):
        route(torch.randn(6, 4), top_k=1, seq_aux_loss_coeff=0.1, scope=MoKTokenScope(num_sequences=4))


def test_aux_loss_counts_plain_topk_not_the_biased_or_grouped_choice():
    # Megatron counts each token's plain top-K of its normalised scores, whatever picks the experts.
    g = torch.Generator().manual_seed(6)
    T, E, K = 16, 8, 2
    logits = torch.randn(T, E, generator=g)
    bias = torch.zeros(E)
    bias[7] = 10.0  # every token picks expert 7
    kwargs = dict(top_k=K, score_function="sigmoid", norm_topk_prob=True, aux_loss_coeff=0.01)
    plain = route(logits, **kwargs)
    biased = route(logits, expert_bias=bias, **kwargs)
    grouped = route(logits, n_group=4, topk_group=1, **kwargs)
    assert (biased.topk_ids == 7).any(dim=1).all() and not torch.equal(biased.topk_ids, plain.topk_ids)
    assert torch.equal(biased.losses["aux_loss"], plain.losses["aux_loss"])
    assert torch.equal(grouped.losses["aux_loss"], plain.losses["aux_loss"])
    probs = _aux_probs(logits, "sigmoid")
    want = _switch(probs, [_naive_topk(row, K) for row in probs.tolist()], E, K, 0.01, T)
    assert plain.losses["aux_loss"].item() == pytest.approx(want, rel=1e-5)
    # tokens_per_expert still counts the experts actually chosen.
    assert biased.tokens_per_expert[7] == T


def test_global_aux_loss_takes_counts_from_the_scope():
    g = torch.Generator().manual_seed(7)
    T, E, K = 10, 4, 2
    logits = torch.randn(T, E, generator=g)
    seen = []
    averaged = torch.tensor([3.0, 5.0, 7.0, 5.0])

    def global_counts(counts):
        seen.append(counts.clone())
        return averaged

    scope = MoKTokenScope(global_ranks=3, global_tokens_per_expert=global_counts)
    r = route(logits, top_k=K, aux_loss_coeff=0.0, global_aux_loss_coeff=0.02, scope=scope)
    probs = torch.softmax(logits.double(), -1)
    assert torch.equal(seen[0], torch.bincount(r.topk_ids.flatten(), minlength=E))
    want = E * 0.02 / (K * (3 * T) ** 2) * float((probs.sum(0) * averaged.double()).sum())
    assert r.losses["global_aux_loss"].item() == pytest.approx(want, rel=1e-5)
    assert set(r.losses) == {"global_aux_loss"}  # coefficient 0: no aux_loss term


def test_sequence_ranks_sum_counts_and_share_the_z_loss():
    # Two ranks holding halves of the micro-batch: counts summed over both, T counted over both,
    # and the z-loss coefficient halved so that the ranks' terms add up to the micro-batch mean.
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(12, 6, generator=g)
    halves = logits[:6], logits[6:]
    kwargs = dict(top_k=2, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.03, z_loss_coeff=1e-3)
    whole = route(logits, scope=MoKTokenScope(num_sequences=2), **kwargs)
    counts = [route(h, top_k=2).tokens_per_expert for h in halves]
    seq_counts = []
    for h in halves:
        ids = route(h, top_k=2).topk_ids
        seq = (torch.arange(6) % 2).unsqueeze(1) * 6 + ids
        seq_counts.append(torch.bincount(seq.flatten(), minlength=12))

    def total(c):  # what an all-reduce over the two ranks returns: [E] counts, or [B * E] per sequence
        return counts[0] + counts[1] if c.numel() == 6 else seq_counts[0] + seq_counts[1]

    scope = MoKTokenScope(num_sequences=2, sequence_ranks=2, sum_over_sequence_ranks=total)
    parts = [route(h, scope=scope, **kwargs) for h in halves]
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        summed = parts[0].losses[name].double() + parts[1].losses[name].double()
        assert summed.item() == pytest.approx(whole.losses[name].item(), rel=1e-5), name


def test_losses_sum_in_fixed_order_and_zero_coefficients_are_off():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 4, generator=g, dtype=torch.float64).float().requires_grad_()
    r = route(logits, top_k=2, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.0, global_aux_loss_coeff=0.02,
              z_loss_coeff=1e-3)  # fmt: skip
    assert list(r.losses) == ["aux_loss", "global_aux_loss", "z_loss"]
    want = torch.zeros(())
    for name in LOSS_NAMES:
        if name in r.losses:
            want = want + r.losses[name]
    assert torch.equal(r.aux_loss, want)
    r.aux_loss.backward()
    assert logits.grad.abs().sum() > 0
    again = route(logits.detach(), top_k=2, aux_loss_coeff=0.01, global_aux_loss_coeff=0.02, z_loss_coeff=1e-3)
    assert torch.equal(again.aux_loss, r.aux_loss.detach())  # bitwise repeatable


def test_sqrtsoftplus_with_expert_bias_selects_biased_weights_unbiased():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    r = route(logits, top_k=2, score_function="sqrtsoftplus", norm_topk_prob=True, expert_bias=bias)
    assert r.topk_ids.tolist() == [[3, 0]]
    scores = F.softplus(logits.double()).sqrt()[0, [3, 0]]
    torch.testing.assert_close(r.topk_weights.double(), (scores / scores.sum()).unsqueeze(0), rtol=1e-6, atol=0)


LOSSES = dict(aux_loss_coeff=0.01, seq_aux_loss_coeff=0.02, global_aux_loss_coeff=0.005, z_loss_coeff=1e-3)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_padding_tokens_stay_out_of_every_loss(score_function):
    # Megatron's padding mask (True = padding): the padding tokens are routed, and nothing of theirs
    # reaches a loss, so changing their logits leaves every loss unchanged; the others' count.
    g = torch.Generator().manual_seed(4)
    T, E, B = 12, 8, 2
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    padding = torch.rand(T, generator=g) < 0.4
    kwargs = dict(top_k=2, score_function=score_function, scope=MoKTokenScope(num_sequences=B), **LOSSES)
    masked = route(logits, padding=padding, **kwargs)
    moved = route(torch.where(padding[:, None], -logits, logits), padding=padding, **kwargs)
    assert set(masked.losses) == set(LOSS_NAMES)
    for name in LOSS_NAMES:
        assert torch.equal(masked.losses[name], moved.losses[name]), name
    plain = route(logits, **kwargs)
    for name in LOSS_NAMES:
        assert not torch.equal(masked.losses[name], plain.losses[name]), name
    # Routed like any other token; only the non-padding tokens' pairs are counted.
    assert torch.equal(masked.topk_ids, plain.topk_ids) and torch.equal(masked.topk_weights, plain.topk_weights)
    assert int(masked.counted_tokens_per_expert.sum()) == 2 * int((~padding).sum())
    assert torch.equal(plain.counted_tokens_per_expert, plain.tokens_per_expert)


def test_a_mask_without_padding_changes_nothing():
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kwargs = dict(top_k=2, scope=MoKTokenScope(num_sequences=2), **LOSSES)
    unmasked, masked = route(logits, **kwargs), route(logits, padding=torch.zeros(12, dtype=torch.bool), **kwargs)
    for name in LOSS_NAMES:
        torch.testing.assert_close(masked.losses[name], unmasked.losses[name], rtol=1e-6, atol=0)


def test_padding_must_be_bool_per_token():
    logits = torch.randn(6, 4)
    for bad in (torch.zeros(6), torch.zeros(5, dtype=torch.bool), torch.zeros(6, 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match="padding must be a bool"):
            route(logits, top_k=2, padding=bad)
