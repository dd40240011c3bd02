"""Reference backend against the float64 oracle (testing.oracle_moe, a per-token loop written
differently): output, input gradient, every weight gradient, the routing-weight gradient and the
aux loss; for each router variant, with and without shared experts, fp32 and bf16; edge cases: an
expert with no token, every token on one expert, T = 1, T not a multiple of the tile, capacity drops.
"""

import dataclasses

import pytest
import torch

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.reference import moe_experts_reference
from mok_plugin.schedule import build_schedule, expert_capacity
from mok_plugin.testing import (
    EXPERT_FAMILIES,
    assert_close,
    make_layer_inputs,
    oracle_experts,
    oracle_kept_pairs,
    oracle_moe,
)

ROUTER_VARIANTS = {
    "softmax": dict(score_function="softmax"),
    "softmax_norm_scaled": dict(score_function="softmax", norm_topk_prob=True, routed_scaling_factor=2.0),
    "sigmoid_norm": dict(score_function="sigmoid", norm_topk_prob=True),
    "sigmoid_grouped_bias": dict(score_function="sigmoid", n_group=4, topk_group=2, expert_bias=True),
    "aux_and_z_loss": dict(score_function="softmax", aux_loss_coeff=0.01, z_loss_coeff=0.001),
}


def _run_and_compare(cfg: MoKConfig, T: int, seed: int, dtype: torch.dtype, bias: torch.Tensor | None = None):
    layer = MoKMoE(cfg, seed=seed, init_std=0.1)
    if bias is not None:
        layer.expert_bias.copy_(bias)
    _randomise_linear_biases(layer, seed)
    x = make_layer_inputs(T, cfg.hidden_size, dtype=dtype, seed=seed + 1).requires_grad_()
    probe = make_layer_inputs(T, cfg.hidden_size, dtype=torch.float32, seed=seed + 2)
    out, aux = layer(x)
    ((out.float() * probe).sum() + aux).backward()

    routing = layer.route(x.detach())
    capacity = (
        None if cfg.capacity_factor is None else expert_capacity(T, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
    )
    kept = oracle_kept_pairs(routing.topk_ids, cfg.num_experts, capacity)

    def leaf(t):
        return t.detach().double().requires_grad_()

    def maybe_leaf(t):
        return None if t is None else leaf(t)

    x64, wr64 = leaf(x), leaf(layer.router.weight)
    w13, w2 = maybe_leaf(layer.experts.gate_up_proj), leaf(layer.experts.down_proj)
    shared = layer.shared_experts
    s13 = maybe_leaf(shared.gate_up_proj) if shared is not None else None
    s2 = leaf(shared.down_proj) if shared is not None else None
    biases = {
        "gate_up_bias": maybe_leaf(layer.experts.gate_up_bias),
        "down_bias": maybe_leaf(layer.experts.down_bias),
        "shared_gate_up_bias": maybe_leaf(shared.gate_up_bias) if shared is not None else None,
        "shared_down_bias": maybe_leaf(shared.down_bias) if shared is not None else None,
    }
    out64, _, aux64 = oracle_moe(
        x64,
        wr64,
        w13,
        w2,
        routing.topk_ids,
        score_function=cfg.score_function,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        aux_loss_coeff=cfg.aux_loss_coeff,
        z_loss_coeff=cfg.z_loss_coeff,
        kept=kept,
        shared_gate_up=s13,
        shared_down=s2,
        family=cfg.expert_family,
        biases=biases,
    )
    ((out64 * probe.double()).sum() + aux64).backward()

    rows_per_expert = max(1, T * cfg.top_k // cfg.num_experts)
    assert_close(out, out64, dtype, "output")
    assert_close(aux, aux64, torch.float32, "aux_loss")
    assert_close(x.grad, x64.grad, dtype, "d_x", n_reduce=cfg.top_k * cfg.ffn_hidden_size)
    assert_close(layer.router.weight.grad, wr64.grad, dtype, "d_router_weight", n_reduce=T)
    if w13 is not None:
        assert_close(layer.experts.gate_up_proj.grad, w13.grad, dtype, "d_gate_up_proj", n_reduce=rows_per_expert)
    assert_close(layer.experts.down_proj.grad, w2.grad, dtype, "d_down_proj", n_reduce=rows_per_expert)
    if shared is not None:
        if s13 is not None:
            assert_close(shared.gate_up_proj.grad, s13.grad, dtype, "d_shared_gate_up", n_reduce=T)
        assert_close(shared.down_proj.grad, s2.grad, dtype, "d_shared_down", n_reduce=T)
    owners = {"gate_up_bias": layer.experts, "down_bias": layer.experts}
    if shared is not None:
        owners.update(shared_gate_up_bias=shared, shared_down_bias=shared)
    for name, want in biases.items():
        if want is not None:
            got = getattr(owners[name], name.removeprefix("shared_")).grad
            assert_close(
                got, want.grad, dtype, f"d_{name}", n_reduce=T if name.startswith("shared") else rows_per_expert
            )
    return layer, routing


def _randomise_linear_biases(layer: MoKMoE, seed: int) -> None:
    """Fresh random biases (they start at zero, which would test nothing)."""
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("_bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("family", list(EXPERT_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_expert_family_matches_oracle(family, dtype):
    fam = _family_for(family, dtype)
    cfg = MoKConfig(
        hidden_size=32,
        ffn_hidden_size=32 if fam.kind == "linear" else 24,
        num_experts=8,
        top_k=3,
        num_shared_experts=0 if fam.kind == "linear" else 1,
        params_dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
        **fam.config_fields(),
    )
    _run_and_compare(cfg, T=29, seed=5, dtype=dtype)


def _family_for(name: str, dtype: torch.dtype):
    """The test family; in bf16 a clamp is moved out to GPT-OSS's 7.0: an h within bf16's rounding
    of the clamp flips its gradient on or off against the fp64 oracle (fp32 tests the clamp)."""
    fam = EXPERT_FAMILIES[name]
    if dtype == torch.bfloat16 and fam.clamp is not None:
        fam = dataclasses.replace(fam, clamp=7.0)
    return fam


def test_clamped_glu_clamps_the_test_inputs():
    # The gpt_oss test family's clamp must bind on unit-scale h, or the test above checks nothing of it.
    fam = EXPERT_FAMILIES["gpt_oss"]
    assert fam.clamp is not None and fam.clamp < 1.0


@pytest.mark.parametrize("variant", list(ROUTER_VARIANTS))
@pytest.mark.parametrize("shared", [0, 1], ids=["routed_only", "with_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_matches_oracle(variant, shared, dtype):
    cfg = MoKConfig(
        hidden_size=32,
        ffn_hidden_size=24,
        num_experts=8,
        top_k=4,
        num_shared_experts=shared,
        params_dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
        **ROUTER_VARIANTS[variant],
    )
    _run_and_compare(cfg, T=37, seed=11, dtype=dtype)  # 37: not a multiple of the 128-row tile


def test_routing_weight_gradient_of_experts_function():
    # d topk_weights straight from the autograd Function, against autograd through the oracle.
    g = torch.Generator().manual_seed(21)
    T, H, I, E, K = 19, 16, 12, 5, 3
    x = torch.randn(T, H, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_()
    w13 = (0.3 * torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64)).requires_grad_()
    w2 = (0.3 * torch.randn(E, H, I, generator=g, dtype=torch.float64)).requires_grad_()
    probe = torch.randn(T, H, generator=g, dtype=torch.float64)
    out = moe_experts_reference(x, w, w13, w2, build_schedule(ids, E, tile_m=4))
    (out * probe).sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    (oracle_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3]) * probe).sum().backward()
    for name, got, want in zip(["d_x", "d_topk_weights", "d_gate_up", "d_down"], (x, w, w13, w2), leaves, strict=True):
        assert_close(got.grad, want.grad, torch.float64, name)


def _cfg(**kw):
    return MoKConfig(**{**dict(hidden_size=16, ffn_hidden_size=8, num_experts=6, top_k=2), **kw})


def test_expert_with_no_token_gets_zero_gradient():
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, -1e4, 0.0])  # expert 4 is never selected
    layer, routing = _run_and_compare(_cfg(expert_bias=True, score_function="sigmoid"), 21, 3, torch.float32, bias)
    assert int(layer.last_tokens_per_expert[4]) == 0
    assert torch.equal(layer.experts.gate_up_proj.grad[4], torch.zeros_like(layer.experts.gate_up_proj.grad[4]))


def test_every_token_on_one_expert():
    bias = torch.tensor([0.0, 0.0, 1e4, 0.0, 0.0, 0.0])  # expert 2 is everyone's first choice
    layer, _ = _run_and_compare(_cfg(top_k=1, expert_bias=True, score_function="sigmoid"), 40, 4, torch.float32, bias)
    assert layer.last_tokens_per_expert.tolist() == [0, 0, 40, 0, 0, 0]


def test_single_token():
    _run_and_compare(_cfg(num_shared_experts=1), 1, 5, torch.float32)


def test_capacity_drops_are_counted_and_excluded():
    bias = torch.tensor([1e4, 0.0, 0.0, 0.0, 0.0, 0.0])  # all first choices on expert 0: it overflows
    layer, _ = _run_and_compare(
        _cfg(capacity_factor=1.0, expert_bias=True, score_function="sigmoid"), 30, 6, torch.float32, bias
    )
    cap = expert_capacity(30, 2, 6, 1.0)
    assert int(layer.last_tokens_per_expert[0]) == 30  # routed count, before the drop
    assert int(layer.last_num_dropped) == 30 - cap
