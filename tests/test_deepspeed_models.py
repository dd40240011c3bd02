"""Real DeepSpeed MoE usages, each as its source builds the layer, run by mok_plugin.deepspeed.MoE.

The usages (sources in RECIPES): DeepSpeedExamples' CIFAR MoE and its PR-MoE variant, and a
Megatron-DeepSpeed GPT-MoE layer (ParallelMLP experts) with k = 1 and k = 2. For each:
  - randomness off (noisy_gate_policy=None, use_rts=False, top2_2nd_expert_sampling=False): MoK's
    layer against deepspeed.moe.layer.MoE with the same weights on fixed inputs, fp32, every tensor
    within 1e-6 of its scale: output, l_aux, exp_counts, input gradient, every parameter gradient.
    Top-1 with dropping and no RTS keeps an implementation-defined set of tied tokens in DeepSpeed
    (sharded_moe.top1gating: torch.topk over the 0/1 mask), so the k = 1 batches are built so that
    every expert gets exactly its capacity (dropping on, nothing dropped: checked). Top-2 dropping
    is deterministic in DeepSpeed (first choices first, then token order), so k = 2 is compared
    with pairs actually dropped (checked);
  - randomness on as the recipe has it: two runs bitwise equal; EP 1, 2, 4 bitwise equal in a
    4-process gloo world (each rank its own tokens, the same full weights sliced per rank).
Then the engine: a tiny model with the Megatron-DeepSpeed-style layer (k = 2, capacity 1.0,
min_capacity 4, dropping on, randomness off) under deepspeed.initialize, ZeRO-1 and ZeRO-2 at
EP 1 and 2 over gloo, stock vs MoK from the same weights: per-step losses within 1e-6, MoK's two
runs bitwise equal.
"""

import dataclasses
import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402
from test_deepspeed import _ds_config, one_rank_world  # noqa: E402
from test_deepspeed_experts import MegatronLinear, ParallelMLP, _forward_backward, _mok_expert_grads  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.deepspeed.gating import deepspeed_capacity  # noqa: E402
from mok_plugin.testing import make_layer_inputs, run_ranks  # noqa: E402

pytestmark = pytest.mark.deepspeed

RANDOM_OFF = dict(noisy_gate_policy=None, use_rts=False, top2_2nd_expert_sampling=False)
GPT_H = 16  # Megatron-DeepSpeed's hidden size, scaled down (ffn_hidden_size = 4H as in its GPT configs)


class GPTMoEMLP(ParallelMLP):
    """Megatron-DeepSpeed's megatron/model/transformer.py ParallelMLP(config, moe=True) for its GPT-MoE
    scripts' defaults: dense_h_to_4h Linear(H, 4H) with skip_bias_add=True, the bias fused into GeLU
    (bias_gelu_fusion, on by default), dense_4h_to_h Linear(4H, H) adding its bias, returning
    (output, None). The stand-in of test_deepspeed_experts.py at other sizes."""

    def __init__(self, hidden_size: int):
        nn.Module.__init__(self)
        self.dense_h_to_4h = MegatronLinear(hidden_size, 4 * hidden_size, True, skip_bias_add=True)
        self.bias_gelu_fusion = True
        self.activation_func = torch.nn.functional.gelu
        self.dense_4h_to_h = MegatronLinear(4 * hidden_size, hidden_size, True, skip_bias_add=False)


@dataclasses.dataclass(frozen=True)
class Recipe:
    hidden: int
    expert: Callable[[], nn.Module]
    kwargs: dict  # MoE's arguments as the source passes them (its defaults otherwise)
    tokens: tuple  # the leading dims of one rank's input
    ep_sizes: tuple  # the EP sizes the 4-rank world checks (num_experts must divide)


# Megatron-DeepSpeed examples_deepspeed/MoE/ds_pretrain_gpt_*MoE*.sh with megatron/model/transformer.py:
# MoE(H, ParallelMLP(config, moe=True), num_experts, ep_size, k=args.topk, capacity_factor=1.0,
# eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_residual=False (--mlp-type standard),
# top2_2nd_expert_sampling=True (its default)); noisy_gate_policy not passed (None), use_rts MoE's default
# (True). 64/128 experts there, 4 here; input [s, b, h].
GPT_MOE = dict(num_experts=4, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True)

RECIPES = {
    # DeepSpeedExamples training/cifar/cifar10_deepspeed.py --moe (run_ds_moe.sh): MoE(hidden_size=84,
    # expert=nn.Linear(84, 84), num_experts=2, ep_size=2, use_residual=False, k=1, min_capacity=0,
    # noisy_gate_policy='RSample'); capacity factors, drop_tokens and use_rts are MoE's defaults
    # (1.0, 1.0, True, True). Input: a batch of 16 images' fc2 features [16, 84].
    "cifar_moe": Recipe(
        84,
        lambda: nn.Linear(84, 84),
        dict(num_experts=2, k=1, min_capacity=0, noisy_gate_policy="RSample"),
        (16,),
        (1, 2),
    ),
    # Its PR-MoE variant (run_ds_prmoe.sh: --mlp-type residual, --num-experts 2 4): the 4-expert layer.
    "cifar_prmoe": Recipe(
        84,
        lambda: nn.Linear(84, 84),
        dict(num_experts=4, k=1, min_capacity=0, noisy_gate_policy="RSample", use_residual=True),
        (16,),
        (1, 2, 4),
    ),
    "gpt_moe_top1": Recipe(GPT_H, lambda: GPTMoEMLP(GPT_H), dict(GPT_MOE, k=1), (8, 2), (1, 2, 4)),
    "gpt_moe_top2": Recipe(GPT_H, lambda: GPTMoEMLP(GPT_H), dict(GPT_MOE, k=2), (16, 2), (1, 2, 4)),
}


@pytest.fixture(scope="module")
def ds_world():
    yield from one_rank_world()


def _assert_close(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-6, scale: float | None = None):
    """max |got - want| <= rel * scale, scale max |want| unless given (fp32 tensors, compared in fp64)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    if scale is None:
        scale = float(want.double().abs().max()) if want.numel() else 0.0
    assert err <= rel * scale, f"{name}: max abs err {err:.3e} > {rel:g} x scale {scale:.3e}"


def _layers(name: str, random: bool = False):
    """(stock, MoK) layers of a recipe with the same random weights (biases included)."""
    recipe = RECIPES[name]
    kwargs = recipe.kwargs if random else {**recipe.kwargs, **RANDOM_OFF}
    torch.manual_seed(0)
    stock = StockMoE(recipe.hidden, recipe.expert(), **kwargs)
    with torch.no_grad():  # distinct experts (DeepSpeed starts them as copies of one), random biases
        for p in stock.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    mok = mds.MoE(recipe.hidden, recipe.expert(), **kwargs, mok_config={"backend": "reference"})
    mok.load_state_dict(stock.state_dict())
    return stock, mok


def _balanced_tokens(router_weight: torch.Tensor, tokens: tuple, seed: int) -> torch.Tensor:
    """Top-1 inputs where every expert is the argmax of exactly T / E tokens (by a margin of 1e-3 in
    the logits, so fp32 and MoK's fp64 router agree), in the order drawn."""
    E, H = router_weight.shape
    T = int(torch.tensor(tokens).prod())
    pool = make_layer_inputs(8 * T * E, H, seed=seed)
    logits = (pool.double() @ router_weight.double().t()).float()
    top2 = logits.topk(2, dim=1)
    chosen, counts = [], [0] * E
    for t in range(pool.shape[0]):
        e = int(top2.indices[t, 0])
        if float(top2.values[t, 0] - top2.values[t, 1]) > 1e-3 and counts[e] < T // E:
            chosen.append(t)
            counts[e] += 1
    assert counts == [T // E] * E, counts
    return pool[chosen].view(*tokens, H)


def _inputs(name: str, router_weight: torch.Tensor, seed: int) -> torch.Tensor:
    recipe = RECIPES[name]
    if recipe.kwargs["k"] == 1:
        return _balanced_tokens(router_weight, recipe.tokens, seed)
    return make_layer_inputs(int(torch.tensor(recipe.tokens).prod()), recipe.hidden, seed=seed).view(
        *recipe.tokens, recipe.hidden
    )


def _mok_grads_under_stock_names(mok) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in mok.named_parameters():
        if name == "mok.router.weight":
            grads["deepspeed_moe.gate.wg.weight"] = param.grad
        elif not name.startswith("mok."):  # use_residual's mlp and coefficient
            grads[name] = param.grad
    grads.update(_mok_expert_grads(mok))
    return grads


def _coefficient_bias_scale(stock, x, probe) -> float:
    """PR-MoE's coefficient.bias gradient is a sum over tokens of d(coefficient logits)[t], whose two
    columns are each other's negatives (softmax over 2) and cancel heavily: its fp32 rounding is
    relative to the terms summed, not to the sum (stock in fp32 is itself ~6e-6 of the sum away from
    stock in fp64). The scale: the largest column sum of |d logits[t]| (the terms), from the stock layer."""
    saved = []

    def keep_logits_grad(module, inputs, logits):
        logits.register_hook(saved.append)

    handle = stock.coefficient.register_forward_hook(keep_logits_grad)
    try:
        stock.zero_grad()
        _forward_backward(stock, x, probe)
    finally:
        handle.remove()
    return float(saved[0].reshape(-1, 2).abs().sum(0).max())


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_matches_the_stock_layer_without_randomness(ds_world, name):
    recipe = RECIPES[name]
    stock, mok = _layers(name)
    assert mok.expert_layout is not None  # a MoK family computes these experts (fused), not the module path
    x = _inputs(name, stock.deepspeed_moe.gate.wg.weight.detach(), seed=1)
    probe = make_layer_inputs(x[..., 0].numel(), recipe.hidden, seed=2).view_as(x)
    want_out, want_aux, want_counts, want_dx = _forward_backward(stock, x, probe)
    out, aux, counts, dx = _forward_backward(mok, x, probe)

    gating = mok.mok.routing_fn.last
    T, E, k = x[..., 0].numel(), recipe.kwargs["num_experts"], recipe.kwargs["k"]
    capacity = deepspeed_capacity(T, E, recipe.kwargs.get("capacity_factor", 1.0) * k, recipe.kwargs["min_capacity"])
    assert int(gating.capacity) == capacity
    if k == 1:  # every expert exactly full: dropping is on, nothing is dropped (see the module docstring)
        assert torch.equal(want_counts, torch.full((E,), capacity)) and bool(gating.kept.all())
    else:  # DeepSpeed's position-based dropping: deterministic, compared with drops happening
        assert int((~gating.kept).sum()) > 0, "the case must drop pairs"
        assert int(want_counts.max()) > capacity

    _assert_close(out, want_out, "output")
    _assert_close(aux, want_aux, "l_aux")
    assert counts.dtype == want_counts.dtype and torch.equal(counts, want_counts)
    _assert_close(dx, want_dx, "d_x")
    stock_grads = {n: p.grad.clone() for n, p in stock.named_parameters()}
    mok_grads = _mok_grads_under_stock_names(mok)
    assert set(mok_grads) == set(stock_grads)  # every parameter, biases and residual parts included
    scales = {"coefficient.bias": _coefficient_bias_scale(stock, x, probe)} if recipe.kwargs.get("use_residual") else {}
    for key, want in stock_grads.items():
        _assert_close(mok_grads[key], want, key, scale=scales.get(key))


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_randomness_is_bitwise_repeatable(ds_world, name):
    recipe = RECIPES[name]
    runs = []
    for _ in range(2):
        _, mok = _layers(name, random=True)
        mok.mok.routing_fn.layer = 0  # the stream's layer number (otherwise the build order)
        x = make_layer_inputs(int(torch.tensor(recipe.tokens).prod()), recipe.hidden, seed=3)
        x = x.view(*recipe.tokens, recipe.hidden)
        got, routes = [], []
        for step in range(3):  # two training forwards on the same input, then an eval forward
            mok.train(step < 2)
            got += list(_forward_backward(mok, x, x))
            routes.append((mok.mok.routing_fn.last.topk_ids, mok.mok.routing_fn.last.kept))
        got += [p.grad for p in mok.parameters()]
        runs.append(got)
        # The draws advance per training forward: the same input routes differently at step 0 and 1.
        assert not (torch.equal(routes[0][0], routes[1][0]) and torch.equal(routes[0][1], routes[1][1]))
    differ = [i for i, (a, b) in enumerate(zip(*runs, strict=True)) if not torch.equal(a, b)]
    assert not differ, f"{name}: items {differ} differ between two runs"


# --- EP 1, 2, 4 with the recipes' randomness: one 4-rank gloo world --------------------------------


def _ep_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Each recipe (its randomness on) at each of its ep_sizes, every rank with its own tokens and the
    same full weights (this rank's slice of the experts): outputs, d_x, l_aux and counts of two
    training steps and one eval step, and the gradients of every parameter that is not an expert's."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, recipe in RECIPES.items():
        E = recipe.kwargs["num_experts"]
        for ep_size in recipe.ep_sizes:
            torch.manual_seed(0)
            layer = mds.MoE(recipe.hidden, recipe.expert(), ep_size=ep_size, **recipe.kwargs,
                            mok_config={"backend": "reference"})  # fmt: skip
            layer.mok.routing_fn.layer = 0  # each layout's layer is the first of its model (its random stream)
            generator = torch.Generator().manual_seed(7)
            local = E // ep_size
            with torch.no_grad():
                for pname, param in sorted(layer.named_parameters()):
                    expert = pname.startswith("mok.experts.")
                    full = torch.randn((E, *param.shape[1:]) if expert else param.shape, generator=generator) * 0.3
                    lo = (rank % ep_size) * local
                    param.copy_(full[lo : lo + local] if expert else full)
            got = []
            T = int(torch.tensor(recipe.tokens).prod())
            for step in range(3):
                layer.train(step < 2)
                x = make_layer_inputs(T, recipe.hidden, seed=1000 * step + rank).view(*recipe.tokens, recipe.hidden)
                x.requires_grad_()
                out, l_aux, counts = layer(x)
                (out.square().sum() + l_aux).backward()
                got += [out.detach(), x.grad, l_aux.detach(), counts]
            got += [p.grad for n, p in sorted(layer.named_parameters()) if not n.startswith("mok.experts.")]
            results[(name, ep_size)] = got
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_recipes_with_randomness_are_the_same_on_every_ep_size(tmp_path):
    run_ranks(_ep_worker, 4, args=(str(tmp_path),))
    for rank in range(4):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, recipe in RECIPES.items():
            want = results[(name, 1)]
            for ep_size in recipe.ep_sizes[1:]:
                got = results[(name, ep_size)]
                differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not torch.equal(a, b)]
                # items: (output, d_x, l_aux, counts) per step (two training, one eval), then the
                # non-expert gradients (router; mlp and coefficient for PR-MoE) in name order
                assert not differ, f"{name} at ep_size {ep_size}, rank {rank}: items {differ} differ from ep_size 1"


# --- the engine: Megatron-DeepSpeed-style layer, ZeRO-1 / ZeRO-2, EP 1 / 2 -------------------------


class TinyGPTMoEModel(nn.Module):
    """proj -> the GPT-MoE layer (k = 2, capacity 1.0, min_capacity 4, dropping, randomness off) -> head;
    loss + 0.01 l_aux (Megatron-DeepSpeed's default --moe-loss-coeff)."""

    def __init__(self, moe_cls, ep_size: int):
        super().__init__()
        self.proj = nn.Linear(GPT_H, GPT_H)
        self.moe = moe_cls(GPT_H, GPTMoEMLP(GPT_H), ep_size=ep_size, **{**GPT_MOE, "k": 2, **RANDOM_OFF})
        self.head = nn.Linear(GPT_H, 1)

    def forward(self, x):
        out, l_aux, _ = self.moe(torch.tanh(self.proj(x)))
        return self.head(out).pow(2).mean() + 0.01 * l_aux


ENGINE_LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (ZeRO stage, ep_size)


def _train_gpt(moe_cls, stage: int, ep_size: int, rank: int, init_state: dict, steps: int = 3):
    torch.manual_seed(0)
    model = TinyGPTMoEModel(moe_cls, ep_size)
    model.load_state_dict(init_state)
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config(stage), model_parameters=model.parameters())
    losses, dropped = [], 0
    for step in range(steps):
        x = make_layer_inputs(8 * 2, GPT_H, seed=100 * step + rank).view(8, 2, GPT_H)  # [s, b, h]
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if moe_cls is mds.MoE:
            dropped += int((~engine.module.moe.mok.routing_fn.last.kept).sum())
    return engine, losses, dropped


def _engine_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for stage, ep_size in ENGINE_LAYOUTS:
        torch.manual_seed(0)
        init = TinyGPTMoEModel(StockMoE, ep_size).state_dict()  # per rank: its local experts
        shared, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(100 + rank)
        with torch.no_grad():  # distinct experts (per rank too) and random biases, not zeros
            init = {k: v + 0.3 * torch.randn(v.shape, generator=own if "deepspeed_experts" in k else shared)
                    for k, v in init.items()}  # fmt: skip
        _, stock_losses, _ = _train_gpt(StockMoE, stage, ep_size, rank, init)
        mok1, mok_losses, dropped = _train_gpt(mds.MoE, stage, ep_size, rank, init)
        mok2, mok_losses2, _ = _train_gpt(mds.MoE, stage, ep_size, rank, init)
        results[(stage, ep_size)] = {
            "stock": stock_losses, "mok": mok_losses, "mok2": mok_losses2, "dropped": dropped,
            "mok_weights": {k: v.clone() for k, v in mok1.module.state_dict().items()},
            "mok2_weights": {k: v.clone() for k, v in mok2.module.state_dict().items()},
        }  # fmt: skip
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.distributed
def test_engine_trains_the_gpt_moe_layer_like_stock(tmp_path):
    run_ranks(_engine_worker, 2, args=(str(tmp_path),))
    dropped = 0
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for (stage, ep_size), r in results.items():
            where = f"ZeRO-{stage}, ep_size {ep_size}, rank {rank}"
            # Same weights, same data, dropping deterministic: the losses agree with the stock layer.
            _assert_close(torch.tensor(r["mok"], dtype=torch.float64), torch.tensor(r["stock"], dtype=torch.float64),
                          f"losses ({where}): mok {r['mok']} stock {r['stock']}")  # fmt: skip
            assert r["mok"] == r["mok2"], where  # two MoK runs: bitwise losses and weights
            for key, value in r["mok_weights"].items():
                assert torch.equal(r["mok2_weights"][key], value), f"{key} ({where})"
            dropped += r["dropped"]
    assert dropped > 0, "the runs must drop pairs"
