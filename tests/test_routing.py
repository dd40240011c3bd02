"""Routing: fixed tie-break top-k (exact ties), group-limited selection against a brute-force loop,
selection-only expert bias, normalisation and scaling, aux loss and z-loss values and gradients,
and the expert-bias update."""

import pytest
import torch

from mok_plugin.routing import route, stable_topk, update_expert_bias


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


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_weights_are_scores_of_chosen_experts(score_function):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(20, 8, generator=g)
    r = route(logits, top_k=2, score_function=score_function, norm_topk_prob=True, routed_scaling_factor=2.5)
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
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
