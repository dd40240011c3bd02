"""Empty work on every path of one process: zero tokens, experts with no rows, all rows on one
expert, through the reference backend and the triton backend's two variants (in Triton's
interpreter on the CPU), with and without a shared expert, with token dropping on and off,
forward and backward. Outputs and gradients match the float64 oracle; every expert that got no
row has an exactly zero weight gradient; with zero tokens every gradient is exactly zero.

The expert-parallel empty cases (a rank with no tokens, a rank whose experts receive no rows)
are in test_parallel_empty.py."""

import pytest
import torch

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.experts import SWIGLU
from mok_plugin.kernels.configs import MoKTileConfig
from mok_plugin.schedule import expert_capacity
from mok_plugin.testing import EXPERT_FAMILIES, assert_close, make_layer_inputs, oracle_kept_pairs, oracle_moe

# On a GPU the triton backend runs compiled; without one, in Triton's interpreter (conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, E = 16, 12, 8
AUX, Z = 1e-2, 1e-3

PATHS = [
    pytest.param("reference", "multi_kernel", id="reference"),
    pytest.param("triton", "multi_kernel", id="multi_kernel"),
    pytest.param("triton", "megakernel", id="megakernel"),
]
# (T, K, selection bias per expert): the bias steers routing (it is used for selection only).
CASES = {
    # Most experts get no row.
    "one_token": (1, 2, {}),
    # Every token picks experts 0 and 5; the other six get nothing.
    "two_experts_take_all": (9, 2, {0: 100.0, 5: 100.0}),
    # Every row on expert 6 (top-1).
    "all_on_one_expert": (9, 1, {6: 100.0}),
}


def _layer(backend: str, variant: str, top_k: int, shared: int, capacity_factor: float | None, family=SWIGLU) -> MoKMoE:
    config = MoKConfig(hidden_size=H, ffn_hidden_size=H if family.kind == "linear" else I, num_experts=E,
                       top_k=top_k, num_shared_experts=shared, score_function="sigmoid", expert_bias=True,
                       aux_loss_coeff=AUX, z_loss_coeff=Z, capacity_factor=capacity_factor, backend=backend,
                       kernel_variant=variant, **family.config_fields())  # fmt: skip
    layer = MoKMoE(config, seed=11, init_std=0.2, device=DEVICE)
    with torch.no_grad():  # biases start at zero: random ones, so that a zero gradient means something
        for name, param in layer.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0.0, 0.5)
    return layer


def _forward_backward(layer: MoKMoE, x: torch.Tensor, probe: torch.Tensor):
    x = x.clone().requires_grad_()
    out, aux = layer(x)
    ((out * probe).sum() + aux).backward()
    return out.detach(), aux.detach(), x.grad


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "dropping"])
@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "shared"])
@pytest.mark.parametrize(("backend", "variant"), PATHS)
def test_zero_tokens(backend, variant, shared, capacity_factor):
    layer = _layer(backend, variant, 2, shared, capacity_factor)
    out, aux, d_x = _forward_backward(layer, torch.randn(0, H, device=DEVICE), torch.randn(0, H, device=DEVICE))
    assert out.shape == (0, H) and d_x.shape == (0, H)
    assert torch.equal(aux.cpu(), torch.zeros(())), "aux loss of no tokens"
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, torch.zeros_like(param)), name
    assert int(layer.last_tokens_per_expert.sum()) == 0 and int(layer.last_num_dropped) == 0


# Families with biases: their bias gradients of no tokens are exactly zero too, on both backends.
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("family", ["gpt_oss", "mlp_gelu_bias", "linear_bias"])
def test_zero_tokens_every_family(family, backend):
    fam = EXPERT_FAMILIES[family]
    layer = _layer(backend, "multi_kernel", 2, 0 if fam.kind == "linear" else 1, None, fam)
    out, aux, d_x = _forward_backward(layer, torch.randn(0, H, device=DEVICE), torch.randn(0, H, device=DEVICE))
    assert out.shape == (0, H) and d_x.shape == (0, H)
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, torch.zeros_like(param)), name


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "dropping"])
@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "shared"])
@pytest.mark.parametrize(("backend", "variant"), PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_empty_experts_match_the_oracle(case, backend, variant, shared, capacity_factor):
    T, K, bias = CASES[case]
    layer = _layer(backend, variant, K, shared, capacity_factor)
    for expert, value in bias.items():
        layer.expert_bias[expert] = value
    x, probe = make_layer_inputs(T, H, seed=12), make_layer_inputs(T, H, seed=13)
    out, aux, d_x = _forward_backward(layer, x.to(DEVICE), probe.to(DEVICE))

    topk_ids = layer.route(x.to(DEVICE)).topk_ids.cpu()
    capacity = None if capacity_factor is None else expert_capacity(T, K, E, capacity_factor)
    kept = oracle_kept_pairs(topk_ids, E, capacity)
    leaves = {name: p.detach().cpu().double().requires_grad_() for name, p in layer.named_parameters()}
    x64 = x.double().requires_grad_()
    want_out, _, want_aux = oracle_moe(
        x64, leaves["router.weight"], leaves["experts.gate_up_proj"], leaves["experts.down_proj"], topk_ids,
        score_function="sigmoid", aux_loss_coeff=AUX, z_loss_coeff=Z, kept=kept,
        shared_gate_up=leaves.get("shared_experts.gate_up_proj"), shared_down=leaves.get("shared_experts.down_proj"),
    )  # fmt: skip
    ((want_out * probe.double()).sum() + want_aux).backward()

    n = T * K
    assert_close(out, want_out, torch.float32, f"{case}: out", n_reduce=K)
    assert_close(aux, want_aux, torch.float32, f"{case}: aux")
    assert_close(d_x, x64.grad, torch.float32, f"{case}: d_x", n_reduce=n)
    for name, param in layer.named_parameters():
        assert_close(param.grad, leaves[name].grad, torch.float32, f"{case}: d_{name}", n_reduce=n)
    # Experts that no kept row reached: exactly zero weight gradients, not merely small ones.
    reached = set(topk_ids[kept].tolist())
    for e in set(range(E)) - reached:
        for name in ("gate_up_proj", "down_proj"):
            grad = getattr(layer.experts, name).grad[e].cpu()
            assert torch.equal(grad, torch.zeros_like(grad)), f"{case}: expert {e} got no row but d_{name} != 0"
    assert int(layer.last_num_dropped) == int((~kept).sum())


@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2", "dW13"])
def test_pre_gathered_weight_gradient_of_no_tokens_is_zero(left_by_token):
    # The weight gradients' pre-gathered path (the pinned one from 4096 columns on, e.g. mixtral's
    # dW13) copies the by-token operand into row order: with no tokens there is nothing to copy
    # from, and every expert's gradient is zero.
    pytest.importorskip("triton", reason="the triton kernels need triton")
    from mok_plugin.kernels.grouped_mlp import expert_wgrad
    from mok_plugin.schedule import build_schedule

    schedule = build_schedule(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), E, tile_m=128)
    by_token = torch.randn(0, H, device=DEVICE)
    by_row = torch.randn(schedule.num_rows, 2 * I, device=DEVICE)
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    d_w = expert_wgrad(left, right, schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert,
                       left_by_token=left_by_token, right_by_token=not left_by_token, segment_align=128,
                       config=MoKTileConfig(32, 32, 32, 4, 1, gather_rows=True))  # fmt: skip
    assert d_w.shape == (E, left.shape[1], right.shape[1])
    assert torch.equal(d_w.cpu(), torch.zeros(d_w.shape))
