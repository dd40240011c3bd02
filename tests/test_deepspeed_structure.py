"""The rest of DeepSpeed's MoE layer: Residual-MoE (`use_residual=True`) against the stock layer
with the same weights (output, l_aux, counts, every gradient, fp32 to 1e-6); `use_tutel=True`
accepted and changing nothing; the stock structure code reaches into (`deepspeed_moe.gate.wg`,
`deepspeed_moe.experts.deepspeed_experts[i]`) as views of MoK's weights: reads, writes
(MoE-LLaVA's `.data.copy_`, load_state_dict, assignment), gradients, DeepSpeed's expert tags and
optimizer groups, `has_moe_layers`, state-dict keys and strict loads both ways, and the views after
ZeRO-2 has moved the parameters into its flat buffer."""

import copy
import functools
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe import utils as moe_utils  # noqa: E402
from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402
from test_deepspeed import one_rank_world  # noqa: E402
from test_deepspeed_experts import ParallelMLP, QWenMLP, ResidualBlock, UpFirstGeGLU  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.testing import make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.deepspeed
H, I, E = 16, 24, 4


@pytest.fixture(scope="module", name="ds_world")
def _ds_world():
    yield from one_rank_world()


def close(actual: torch.Tensor, expected: torch.Tensor, name: str, tol: float = 1e-6) -> None:
    """|actual - expected| <= tol * (max |expected| + |expected|), elementwise."""
    assert actual is not None and expected is not None, name
    assert actual.shape == expected.shape, f"{name}: {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, b = actual.detach().double(), expected.detach().double()
    err = (a - b).abs()
    bound = tol * (b.abs().max().clamp_min(1e-30) + b.abs())
    assert bool((err <= bound).all()), f"{name}: max abs err {float(err.max()):.3e}, scale {float(b.abs().max()):.3e}"


def _seq():
    return nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H))


EXPERTS = {
    "linear": lambda: nn.Linear(H, H),  # DeepSpeedExamples' PR-MoE (cifar10_deepspeed.py)
    "gelu_mlp": _seq,
    "swiglu": lambda: mds.SwiGLUExpert(H, I),
    "qwen_w2_gated": lambda: QWenMLP(bias=True),  # each weight is one slice of gate_up_proj
    "megatron_gelu": lambda: ParallelMLP("gelu"),  # returns (output, bias): the residual takes [0]
    "megatron_swiglu": lambda: ParallelMLP("swiglu"),  # fused [gate; up]: one slice of 2I rows
    "up_first_geglu": UpFirstGeGLU,  # [up; gate]: MoK stores the halves swapped (a copy, not a view)
    "residual_block": ResidualBlock,  # no family: runs as itself, its modules are MoK's
}
EXPERT_1 = "deepspeed_moe.experts.deepspeed_experts.1."
QUIET = dict(drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)


def _layers(make, k: int = 1, **kwargs):
    """A stock and a MoK layer with the same random weights (biases included)."""
    torch.manual_seed(0)
    stock = StockMoE(H, make(), num_experts=E, k=k, **QUIET, **kwargs)
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an expert that runs as itself
        mok = mds.MoE(H, make(), num_experts=E, k=k, **QUIET, **kwargs)
    mok.load_state_dict(stock.state_dict(), strict=True)
    return stock, mok


def _by_path(root, name: str):
    return functools.reduce(getattr, name.split("."), root)


# --- use_residual ------------------------------------------------------------------------------


def _residual_run(layer, dtype):
    x = make_layer_inputs(40, H, seed=1).view(4, 10, H).to(dtype).requires_grad_()
    probe = make_layer_inputs(40, H, seed=2).view(4, 10, H).to(dtype)
    out, l_aux, counts = layer(x)
    ((out * probe).sum() + l_aux).backward()
    return out, l_aux, counts, x.grad


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("expert", ["linear", "gelu_mlp", "megatron_gelu", "residual_block"])
def test_residual_moe_matches_the_stock_layer(ds_world, expert, k):
    stock, mok = _layers(EXPERTS[expert], k=k, use_residual=True)
    assert mok.use_residual and isinstance(mok.coefficient, nn.Linear) and mok.coefficient.out_features == 2
    assert _by_path(mok, "mlp") is not None and not any(moe_utils.is_moe_param(p) for p in mok.mlp.parameters())
    truth = copy.deepcopy(stock).double()  # the stock layer in fp64, for sums that cancel (below)
    results = [_residual_run(layer, dtype) for layer, dtype in ((stock, torch.float32), (mok, torch.float32))]
    _residual_run(truth, torch.float64)
    for name, got, want in zip(("output", "l_aux", "counts", "d_x"), results[1], results[0], strict=True):
        close(got.to(want.dtype), want, name)
    close(mok.deepspeed_moe.l_aux, stock.deepspeed_moe.l_aux, "deepspeed_moe.l_aux")
    assert torch.equal(mok.deepspeed_moe.exp_counts, stock.deepspeed_moe.exp_counts)
    # Every gradient, read by the stock names through MoK's structure (views of MoK's gradients):
    # within 1e-6 of the stock layer's, or, for a sum over tokens that cancels (coefficient.bias
    # of the residual block at k = 3: terms of about 1, a sum of 0.04), no further from the fp64
    # stock layer than the fp32 stock layer is (twice its error at most) or than an fp32 sum of the
    # 40 tokens' terms may be (40 roundings of terms of about 1: torch 2.14's CPU sum came within
    # 1.6e-7 there, MoK's 8.8e-7).
    stock_grads = {name: p.grad for name, p in stock.named_parameters()}
    assert any(name.startswith("mlp.") for name in stock_grads) and "coefficient.weight" in stock_grads
    for name, want in stock_grads.items():
        got = _by_path(mok, name).grad
        best = _by_path(truth, name).grad
        try:
            close(got, want, name)
        except AssertionError:
            mok_error = float((got.double() - best).abs().max())
            stock_error = float((want.double() - best).abs().max())
            fp32_sum_bound = 40 * torch.finfo(torch.float32).eps
            assert mok_error <= max(2 * stock_error, fp32_sum_bound), (
                f"{name}: MoK {mok_error:.3e} from fp64, stock {stock_error:.3e}"
            )


def test_residual_moe_is_bitwise_repeatable_and_keeps_the_stock_keys(ds_world):
    stock, mok = _layers(EXPERTS["gelu_mlp"], k=2, use_residual=True)
    state = mok.state_dict()
    assert set(state) == set(stock.state_dict()) and len(state) == len(stock.state_dict())
    storages = [value.untyped_storage().data_ptr() for value in state.values()]
    assert len(set(storages)) == len(storages)  # no tensor twice
    x = make_layer_inputs(32, H, seed=3)
    assert torch.equal(mok(x)[0], mok(x)[0])
    fresh = StockMoE(H, _seq(), num_experts=E, k=2, use_residual=True)
    fresh.load_state_dict(mok.state_dict(), strict=True)
    for key, value in stock.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


# --- use_tutel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_use_tutel_is_accepted_and_changes_nothing(ds_world, k):
    stock, plain = _layers(EXPERTS["swiglu"], k=k)
    tutel = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=k, use_tutel=True, **QUIET)
    tutel.load_state_dict(plain.state_dict(), strict=True)
    x = make_layer_inputs(40, H, seed=4)
    outs = []
    for layer in (plain, tutel):
        out, l_aux, counts = layer(x)
        (out.square().sum() + l_aux).backward()
        outs.append([out, l_aux, counts] + [p.grad for p in layer.parameters()])
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.equal(got, want)


# --- the stock structure as views --------------------------------------------------------------

VIEW_CASES = ["linear", "gelu_mlp", "swiglu", "qwen_w2_gated", "megatron_swiglu", "up_first_geglu", "residual_block"]


@pytest.mark.parametrize("expert", VIEW_CASES)
def test_structure_reads_mok_weights(ds_world, expert):
    stock, mok = _layers(EXPERTS[expert])
    experts = mok.deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == E and mok.deepspeed_moe.experts.num_local_experts == E
    assert mok.deepspeed_moe.gate.wg is mok.mok.router and mok.deepspeed_moe.gate.wg.weight.shape == (E, H)
    state = mok.state_dict()
    for name, value in stock.state_dict().items():
        view = _by_path(mok, name)
        assert torch.equal(view, value) and torch.equal(state[name], value), name
        # The same storage as MoK's parameter (except the swapped [up; gate] halves: a copy).
        if not (expert == "up_first_geglu" and name.split(".")[-2] == "proj"):
            mok_storages = {p.untyped_storage().data_ptr() for p in mok.parameters()}
            assert view.untyped_storage().data_ptr() in mok_storages, name
        if "deepspeed_experts" in name:  # DeepSpeed's expert tags, as on the stock expert parameters
            assert moe_utils.is_moe_param(view) and view.group_name == "ep_size_1", name
    # The expert modules keep their class and names; their state dicts are the expert's own.
    for i, module in enumerate(experts):
        assert isinstance(module, type(stock.deepspeed_moe.experts.deepspeed_experts[i]))
        assert list(module.state_dict()) == list(stock.deepspeed_moe.experts.deepspeed_experts[i].state_dict())
    # Strict loads both ways (the stock layer's keys, no more, no fewer).
    fresh = StockMoE(H, EXPERTS[expert](), num_experts=E, k=1)
    fresh.load_state_dict(mok.state_dict(), strict=True)
    for key, value in stock.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    # No parameter and no module of its own: the layer's parameters are MoK's (and mlp/coefficient).
    assert "deepspeed_moe" not in dict(mok.named_modules())
    with pytest.raises(TypeError, match="view of MoK's layer"):
        mok.deepspeed_moe.gate = nn.Linear(H, E)  # MoK would not run it
    assert {id(p) for p in mok.parameters()} == {id(p) for p in mok.mok.parameters()}


@pytest.mark.parametrize("expert", VIEW_CASES)
def test_writes_through_the_views_change_mok(ds_world, expert):
    """MoE-LLaVA's initialisation: a pretrained MLP copied into every expert with `.data.copy_`,
    then checked through each expert's state_dict; the router set through gate.wg. Done the same
    way on both layers, their outputs still agree."""
    stock, mok = _layers(EXPERTS[expert])
    torch.manual_seed(7)
    pretrained = EXPERTS[expert]()
    with torch.no_grad():
        for p in pretrained.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    wanted = pretrained.state_dict()
    centroids = torch.randn(E, H)
    for layer in (stock, mok):
        experts = layer.deepspeed_moe.experts.deepspeed_experts
        for i, module in enumerate(experts):
            if i == 1:
                module.load_state_dict(wanted, strict=True)
                continue
            for name, tensor in wanted.items():
                owner, _, attr = name.rpartition(".")
                if expert == "up_first_geglu" and owner == "proj":  # a copy in MoK: assignment writes it
                    setattr(_by_path(module, owner), attr, nn.Parameter(tensor.clone()))
                else:
                    _by_path(module, name).data.copy_(tensor)
        for module in experts:  # MoE-LLaVA's check
            loaded = module.state_dict()
            assert all(torch.allclose(wanted[key], value) for key, value in loaded.items())
            assert all(torch.allclose(loaded[key], value) for key, value in wanted.items())
        with torch.no_grad():
            layer.deepspeed_moe.gate.wg.weight.copy_(centroids)
    assert torch.equal(mok.mok.router.weight, centroids)
    x = make_layer_inputs(40, H, seed=5)
    close(mok(x)[0], stock(x)[0], "output after the writes")
    # MoK's own tensors hold the writes (its state dict goes through MoK's tensors, not the views).
    for key, value in stock.state_dict().items():
        assert torch.equal(mok.state_dict()[key], value), key


def test_views_carry_gradients_both_ways(ds_world):
    _, mok = _layers(EXPERTS["swiglu"])
    view = mok.deepspeed_moe.experts.deepspeed_experts[2].up_proj.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no non-leaf .grad warning
        assert view.grad is None
    # A forward through a view module reaches MoK's parameters.
    x = make_layer_inputs(8, H, seed=6)
    mok.deepspeed_moe.experts.deepspeed_experts[2](x).sum().backward()
    gate_up = mok.mok.experts.gate_up_proj
    assert gate_up.grad[2].abs().sum() > 0 and gate_up.grad[[0, 1, 3]].abs().sum() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = mok.deepspeed_moe.experts.deepspeed_experts[2].up_proj.weight.grad
    assert torch.equal(got, gate_up.grad[2, I:])
    assert got.untyped_storage().data_ptr() == gate_up.grad.untyped_storage().data_ptr()
    # The views follow the parameters when their storage is replaced (.to(), ZeRO's flat buffer).
    mok.double()
    assert mok.deepspeed_moe.experts.deepspeed_experts[0].down_proj.weight.dtype == torch.float64
    with torch.no_grad():
        mok.mok.experts.down_proj.data = mok.mok.experts.down_proj.data.clone()
        mok.deepspeed_moe.experts.deepspeed_experts[0].down_proj.weight.fill_(0.5)
    assert bool((mok.mok.experts.down_proj[0] == 0.5).all())


def test_optimizer_groups_and_engine_detection(ds_world):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(H, H)
            self.moe = mds.MoE(H, _seq(), num_experts=E, k=1, use_residual=True, **QUIET)

    model = Model()
    assert moe_utils.has_moe_layers(model) == (True, E)
    params = list(model.parameters())
    expert_ids = {id(p) for p in model.moe.mok.experts.parameters()}
    assert len({id(p) for p in params}) == len(params)
    groups = moe_utils.split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in params)  # each parameter exactly once
    moe_groups = [g for g in groups if moe_utils.is_moe_param_group(g)]
    assert {id(p) for g in moe_groups for p in g["params"]} == expert_ids
    assert all(g["name"] == "ep_size_1" for g in moe_groups)
    dense = {id(p) for g in groups if not moe_utils.is_moe_param_group(g) for p in g["params"]}
    assert {id(model.moe.mok.router.weight), id(model.moe.coefficient.weight)} <= dense
    assert {id(p) for p in model.moe.mlp.parameters()} <= dense
    optimizer = torch.optim.Adam(groups)
    assert len([p for g in optimizer.param_groups for p in g["params"]]) == len(params)
    out, l_aux, _ = model.moe(torch.tanh(model.proj(make_layer_inputs(16, H, seed=8))))
    (out.square().mean() + l_aux).backward()
    shared, expert_grads = moe_utils.split_params_grads_into_shared_and_expert_params(params)
    assert len(expert_grads) == len(expert_ids) and len(shared) == len(params) - len(expert_ids)


def test_views_after_zero2_flattened_the_parameters(ds_world):
    """deepspeed.initialize with ZeRO-2 moves every parameter's storage into its flat buffer; the
    views read (and write) the moved storage; a step's update shows through them."""
    torch.manual_seed(0)
    layer = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=1, use_residual=True, **QUIET)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip
    built_at = layer.mok.experts.gate_up_proj.untyped_storage().data_ptr()
    engine, *_ = deepspeed.initialize(model=layer, config=config, model_parameters=layer.parameters())
    assert layer.mok.experts.gate_up_proj.untyped_storage().data_ptr() != built_at  # moved by ZeRO
    view = lambda: engine.module.deepspeed_moe.experts.deepspeed_experts[1].gate_proj.weight  # noqa: E731
    before = view().clone()
    assert torch.equal(view(), layer.mok.experts.gate_up_proj[1, :I])
    out, l_aux, _ = engine(make_layer_inputs(16, H, seed=9, device=engine.device))  # on the GPU the engine moved it
    engine.backward(out.square().mean() + l_aux)
    engine.step()
    assert not torch.equal(view(), before) and torch.equal(view(), layer.mok.experts.gate_up_proj[1, :I])
    assert view().untyped_storage().data_ptr() == layer.mok.experts.gate_up_proj.untyped_storage().data_ptr()


def test_residual_and_structure_with_module_experts_swap_nothing(ds_world):
    """Expert modules that run as themselves: deepspeed_experts is MoK's ModuleList itself."""
    _, mok = _layers(EXPERTS["residual_block"], use_residual=True)
    assert mok.deepspeed_moe.experts.deepspeed_experts is mok.mok.experts.local_experts
    assert F.softmax(mok.coefficient(make_layer_inputs(4, H, seed=1)), dim=-1).shape == (4, 2)


@pytest.mark.parametrize("expert", ["swiglu", "linear", "residual_block"])
def test_copies_and_pickles_keep_their_own_views(ds_world, expert):
    """deepcopy and torch.save(model): the copy's structure views the copy's weights."""
    _, mok = _layers(EXPERTS[expert], use_residual=True)
    buffer = io.BytesIO()
    torch.save(mok, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(mok), torch.load(buffer, weights_only=False)):
        assert copied.deepspeed_moe.gate.wg is copied.mok.router
        module = copied.deepspeed_moe.experts.deepspeed_experts[1]
        assert list(module.state_dict()) == list(mok.deepspeed_moe.experts.deepspeed_experts[1].state_dict())
        x = make_layer_inputs(16, H, seed=10)
        assert torch.equal(copied(x)[0], mok(x)[0])
        with torch.no_grad():
            for tensor in module.state_dict(keep_vars=True).values():
                tensor.data.zero_()  # the copy's weights only
        assert torch.equal(
            copied.state_dict()[EXPERT_1 + next(iter(module.state_dict()))].abs().sum(), torch.tensor(0.0)
        )
        assert mok.state_dict()[EXPERT_1 + next(iter(module.state_dict()))].abs().sum() > 0
