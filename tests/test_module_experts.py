"""Routed experts as modules (mok_plugin.module_experts): modules that compute a MoK family give the
float64 oracle's output and gradients in fp64 and the reference backend's in fp32 (an empty expert,
capacity drops, T = 1, K = 1 to 3); a custom module (a residual block with a LayerNorm) runs bitwise
the same twice; the gather's backward is the fixed-order sum over k (checked bitwise in bf16); an
expert with no row still gets a zero gradient; errors name the expert; MoKMoE with module experts
leaves their weights alone; expert parallelism on 2 gloo processes gives bitwise the
single-process output and gradients, through both exchanges."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.experts import MoKExpertFamily
from mok_plugin.module_experts import MoKModuleExperts, moe_experts_modules
from mok_plugin.reference import moe_experts_reference, shared_expert_forward
from mok_plugin.schedule import build_schedule, sum_over_k
from mok_plugin.testing import (
    assert_close,
    init_gloo,
    make_layer_inputs,
    oracle_experts,
    oracle_kept_pairs,
    run_ranks,
)

H, I = 12, 10


class _FamilyExpert(nn.Module):
    """One expert of a MoK family as a module: the core's dense MLP on its own weights."""

    def __init__(self, family: MoKExpertFamily, gate_up, down, gate_up_bias, down_bias):
        super().__init__()
        self.family = family
        self.gate_up_proj = None if gate_up is None else nn.Parameter(gate_up.clone())
        self.down_proj = nn.Parameter(down.clone())
        self.gate_up_bias = None if gate_up_bias is None else nn.Parameter(gate_up_bias.clone())
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias.clone())

    def forward(self, x):
        return shared_expert_forward(x, self.gate_up_proj, self.down_proj, self.family, self.gate_up_bias,
                                     self.down_bias)  # fmt: skip


class _ResidualBlock(nn.Module):
    """No MoK family: x + fc2(gelu(fc1(layer_norm(x))))."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, I), nn.Linear(I, H)
        with torch.no_grad():  # random norm and biases, never the zeros and ones of the default init
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.3)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _routing(T: int, K: int, E: int, seed: int, used: int | None = None):
    """topk_ids [T, K] of distinct experts among the first `used` (the rest get no token), and
    positive fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(used or E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g) + 0.1
    return ids, weights


def _family_weights(family: MoKExpertFamily, E: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    fc1 = family.fc1_width(I)
    inner = family.intermediate_size(H, I)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

    return (
        None if family.kind == "linear" else rand(E, fc1, H),
        rand(E, H, inner),
        rand(E, fc1) if family.fc1_bias else None,
        rand(E, H) if family.fc2_bias else None,
    )


FAMILIES = {
    "swiglu": MoKExpertFamily(),
    "glu_gelu_biases": MoKExpertFamily(kind="glu", activation="gelu", fc1_bias=True, fc2_bias=True),
    "mlp_relu_bias": MoKExpertFamily(kind="mlp", activation="relu", fc1_bias=True, fc2_bias=True),
    "linear_bias": MoKExpertFamily(kind="linear", fc2_bias=True),
}
ROUTINGS = [
    # (T, K, E, experts used, capacity): why
    pytest.param(20, 2, 5, 4, None, id="top2_empty_expert"),  # expert 4 gets no token
    pytest.param(17, 3, 4, None, 10, id="top3_capacity"),  # rows past 10 of an expert are dropped
    pytest.param(1, 1, 3, None, None, id="T1_top1"),
]


def _run(x, weights, modules, schedule):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    out = moe_experts_modules(x, weights, modules, schedule)
    probe = make_layer_inputs(*out.shape, dtype=out.dtype, seed=9)
    (out * probe).sum().backward()
    return out.detach(), x.grad, weights.grad, probe


@pytest.mark.parametrize("family_name", list(FAMILIES))
@pytest.mark.parametrize("T, K, E, used, capacity", ROUTINGS)
def test_family_modules_match_the_oracle_in_fp64_and_the_reference_in_fp32(family_name, T, K, E, used, capacity):
    family = FAMILIES[family_name]
    ids, w = _routing(T, K, E, seed=1, used=used)
    schedule = build_schedule(ids, E, tile_m=4, capacity=capacity)
    for dtype in (torch.float64, torch.float32):
        weights = _family_weights(family, E, dtype, seed=2)
        modules = [_FamilyExpert(family, *(None if t is None else t[e] for t in weights)) for e in range(E)]
        x = make_layer_inputs(T, H, dtype=dtype, seed=3)
        out, d_x, d_w, probe = _run(x, w, modules, schedule)
        stacked_grads = [None if weights[i] is None else torch.stack([getattr(m, n).grad for m in modules])
                         for i, n in enumerate(("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"))]  # fmt: skip
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, *weights)]
        if dtype == torch.float64:
            kept = oracle_kept_pairs(ids, E, capacity)
            want = oracle_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], kept, family, leaves[4], leaves[5])
        else:
            want = moe_experts_reference(leaves[0], leaves[1], leaves[2], leaves[3], schedule, family, leaves[4],
                                         leaves[5])  # fmt: skip
        (want * probe).sum().backward()
        assert_close(out, want, dtype, f"{dtype} output")
        assert_close(d_x, leaves[0].grad, dtype, f"{dtype} d_x", n_reduce=K)
        assert_close(d_w, leaves[1].grad, torch.float32, f"{dtype} d_topk_weights", n_reduce=H)
        for name, got, leaf in zip(
            ("gate_up", "down", "gate_up_bias", "down_bias"), stacked_grads, leaves[2:], strict=True
        ):
            if leaf is not None:
                assert_close(got, leaf.grad, dtype, f"{dtype} d_{name}", n_reduce=T * K)


def test_a_custom_module_runs_bitwise_the_same_twice():
    E, T, K = 4, 30, 2
    modules = [_ResidualBlock(seed=e) for e in range(E)]
    ids, w = _routing(T, K, E, seed=4)
    schedule = build_schedule(ids, E, tile_m=8)
    x = make_layer_inputs(T, H, seed=5)
    runs = []
    for _ in range(2):
        for m in modules:
            m.zero_grad(set_to_none=True)
        out, d_x, d_w, _ = _run(x, w, modules, schedule)
        runs.append([out, d_x, d_w, *(p.grad.clone() for m in modules for p in m.parameters())])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_the_gather_backward_sums_each_tokens_k_rows_in_order_bitwise():
    # An identity expert: out_t = sum_k w_tk x_t, so d_x_t = sum over k of round(w_tk * dO_t), which
    # sum_over_k adds in k order in fp32 and rounds once; bf16 makes any other order show.
    E, T, K = 3, 16, 3
    ids, w = _routing(T, K, E, seed=6)
    schedule = build_schedule(ids, E, tile_m=4)
    x = make_layer_inputs(T, H, dtype=torch.bfloat16, seed=7)
    _, d_x, _, probe = _run(x, w, [nn.Identity()] * E, schedule)
    rows = (probe.float().unsqueeze(1) * w.unsqueeze(2)).to(torch.bfloat16)
    assert torch.equal(d_x, sum_over_k(rows, torch.bfloat16))


def test_an_expert_with_no_row_gets_a_zero_gradient():
    E = 4
    modules = [_ResidualBlock(seed=e) for e in range(E)]
    ids, w = _routing(10, 2, E, seed=8, used=3)  # expert 3 gets no token
    _run(make_layer_inputs(10, H, seed=9), w, modules, build_schedule(ids, E, tile_m=4))
    for p in modules[3].parameters():
        assert p.grad is not None and not p.grad.any()
    assert all(p.grad.any() for m in modules[:3] for p in m.parameters())


def test_errors_name_the_expert():
    ids, w = _routing(6, 2, 3, seed=10)
    schedule = build_schedule(ids, 3, tile_m=4)
    x = make_layer_inputs(6, H, seed=11)
    with pytest.raises(ValueError, match="2 expert modules for a schedule of 3 experts"):
        moe_experts_modules(x, w, [nn.Identity()] * 2, schedule)
    with pytest.raises(ValueError, match=r"expert 1 \(Linear\) returned \(\d+, 5\) for rows \[\d+, 12\]"):
        moe_experts_modules(x, w, [nn.Identity(), nn.Linear(H, 5), nn.Identity()], schedule)


def test_a_tuple_output_gives_its_first_element():
    class Pair(nn.Module):
        def forward(self, x):
            return 2 * x, None  # Megatron-style (output, bias)

    ids, w = _routing(6, 2, 3, seed=12)
    schedule = build_schedule(ids, 3, tile_m=4)
    x = make_layer_inputs(6, H, seed=13)
    assert torch.equal(
        moe_experts_modules(x, w, [Pair()] * 3, schedule), moe_experts_modules(2 * x, w, [nn.Identity()] * 3, schedule)
    )


def _config(E: int, K: int, ep_size: int = 1, exchange: str = "exact") -> MoKConfig:
    # The family fields are unused with module experts; ffn_hidden_size is any valid value.
    return MoKConfig(hidden_size=H, ffn_hidden_size=H, num_experts=E, top_k=K, ep_size=ep_size, ep_exchange=exchange,
                     ep_capacity_factor=float(ep_size), backend="reference")  # fmt: skip


def test_layer_with_module_experts_keeps_their_weights():
    E, K = 4, 2
    modules = [_ResidualBlock(seed=e) for e in range(E)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in modules]
    layer = MoKMoE(_config(E, K), seed=1, experts=MoKModuleExperts(modules))
    for m, state in zip(modules, before, strict=True):
        assert all(torch.equal(m.state_dict()[k], v) for k, v in state.items())
    assert "experts.local_experts.3.norm.weight" in layer.state_dict()
    x = make_layer_inputs(20, H, seed=2)
    out, _ = layer(x)
    routing = layer.route(x)
    schedule = build_schedule(routing.topk_ids, E)
    assert torch.equal(out, moe_experts_modules(x, routing.topk_weights, modules, schedule))


E_EP, K_EP, T_EP = 4, 2, 24
# name: (exchange, tokens per rank, skewed). Skewed: experts 2 and 3 (rank 1's) get no row, so
# rank 1's modules run on nothing and it must still join the exchanges' backward.
EP_CASES = {
    "exact": ("exact", [9, 15], False),
    "exact_rank_without_tokens": ("exact", [0, 24], False),
    "capacity": ("capacity", [12, 12], False),
    "exact_skewed": ("exact", [9, 15], True),
}


def _ep_run(ep_size: int, rank: int, group, case: str) -> dict[str, torch.Tensor]:
    exchange, splits, skewed = EP_CASES[case]
    E_l = E_EP // ep_size
    modules = [_ResidualBlock(seed=e) for e in range(rank * E_l, (rank + 1) * E_l)]
    config = _config(E_EP, K_EP, ep_size, exchange).replace(score_function="sigmoid", expert_bias=skewed)
    layer = MoKMoE(config, ep_group=group, seed=3, init_std=0.3, experts=MoKModuleExperts(modules))
    if skewed:
        layer.expert_bias[2:] = -100.0
    splits = splits if ep_size > 1 else [T_EP]
    start, stop = sum(splits[:rank]), sum(splits[: rank + 1])
    x = make_layer_inputs(T_EP, H, seed=4)[start:stop].clone().requires_grad_()
    out, aux = layer(x)
    ((out * make_layer_inputs(T_EP, H, seed=5)[start:stop]).sum() + aux).backward()
    grads = {f"{rank * E_l + i}.{n}": p.grad for i, m in enumerate(modules) for n, p in m.named_parameters()}
    return {"out": out.detach(), "d_x": x.grad, **grads}


def _ep_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        results = {case: _ep_run(world, rank, dist.group.WORLD, case) for case in EP_CASES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_expert_parallel_is_bitwise_the_single_process(tmp_path):
    run_ranks(_ep_worker, 2, (str(tmp_path),), timeout_s=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for case, (_, _, skewed) in EP_CASES.items():
        want = _ep_run(1, 0, None, case)
        got = {k: v for r in ranks for k, v in r[case].items() if k not in ("out", "d_x")}
        assert torch.equal(torch.cat([r[case]["out"] for r in ranks]), want["out"]), case
        assert torch.equal(torch.cat([r[case]["d_x"] for r in ranks]), want["d_x"]), case
        assert set(got) == set(want) - {"out", "d_x"}
        for name, grad in got.items():
            assert torch.equal(grad, want[name]), f"{case}: {name}"
            assert grad.any() != (skewed and name[0] in "23"), f"{case}: {name}"  # idle experts: zero
