"""The Megatron-Core adapter on the CPU (gloo): MoKMoELayer against Megatron's stock MoELayer built
from the same TransformerConfig with the same weights (outputs, input, router and expert
gradients, aux loss), checkpoints both ways (state_dict and the sharded distributed-checkpoint
layout), gradients into main_grad, unsupported flags, the --spec path, upcycling a dense model into
MoK's experts (--moe-use-upcycling), EP = 2 in two processes.
Experts other than SwiGLU (activations, clamp, offset, biases): test_megatron_families.py."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402

from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import MoKMoELayer, mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.megatron.checkpoint import _to_stock as to_stock  # noqa: E402
from mok_plugin.testing import assert_close, free_port, make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.megatron

H, I, E = 32, 16, 8


def _init(rank: int = 0, world: int = 1, port: int | None = None, ep: int = 1) -> None:
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)


@pytest.fixture()
def megatron_world():
    _init()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture()
def cpu_gpt_model(monkeypatch):
    """What a whole GPTModel (local spec) needs on the CPU: buffers Megatron makes on
    torch.cuda.current_device() (attention's, the router's) go to the CPU, the attention's
    dropout RNG fork (dropout 0 in these tests) does nothing, and torch.compile'd helpers run eagerly."""
    from megatron.core import tensor_parallel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", contextlib.nullcontext)
    torch.compiler.set_stance("force_eager")
    yield
    torch.compiler.set_stance("default")


def _gpt(cfg: TransformerConfig, seq_length: int, mok: bool):
    """A GPTModel as Megatron's GPT builder makes it, with MoK's layers (`moe_block_spec`) or the stock ones."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from mok_plugin.megatron import moe_block_spec

    spec = dict(transformer_layer_spec=moe_block_spec) if mok else {}
    model_config = GPTModelConfig(transformer=cfg, vocab_size=64, seq_length=seq_length, **spec)
    model = GPTModelBuilder(model_config).build_model(pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    for layer in model.decoder.layers:
        if type(layer.mlp) is MoELayer:
            make_stock_router_cpu_safe(layer.mlp)
    return model


def _gpt_inputs(batch: int, seq_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, position ids, causal attention mask) for a _gpt model."""
    tokens = torch.randint(0, 64, (batch, seq_length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq_length).expand(batch, seq_length)
    return tokens, positions, torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool), diagonal=1)


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=I,
        moe_ffn_hidden_size=I,
        num_moe_experts=E,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        params_dtype=torch.float32,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _stock_and_mok(cfg: TransformerConfig):
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    stock = spec(config=cfg)
    make_stock_router_cpu_safe(stock)
    mok = use_mok(spec)(config=cfg)
    mok.load_state_dict(stock.state_dict())
    return stock, mok


def _fwd_bwd(layer, x, probe, **forward_kwargs):
    x = x.detach().clone().requires_grad_()
    out, bias = layer(x, **forward_kwargs)
    assert bias is None
    (out * probe).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    if isinstance(layer, MoKMoELayer):  # under the stock names, one tensor per expert
        to_stock(layer, grads, "", None)
    return out.detach(), x.grad, {k: v for k, v in grads.items() if v is not None}


NO_AUX = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
ROUTERS = {
    "softmax_post": {},
    "softmax_pre_topk1": dict(moe_router_pre_softmax=True, moe_router_topk=1),
    "sigmoid_scaled_z": dict(
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5, moe_z_loss_coeff=1e-3
    ),
    "group_limited_sigmoid": dict(
        moe_router_score_function="sigmoid",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk=4,
        **NO_AUX,
    ),
    "group_limited_pre_softmax": dict(
        moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4, **NO_AUX
    ),
    "shared_expert": dict(moe_shared_expert_intermediate_size=24),
    "no_aux_loss": NO_AUX,
}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_matches_stock_layer(megatron_world, router):
    cfg = _config(**ROUTERS[router])
    stock, mok = _stock_and_mok(cfg)
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert_close(got[0], want[0], torch.float32, "output")
    assert_close(got[1], want[1], torch.float32, "d_x")
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        if want[2][name] is not None:
            # The router gradient includes the aux loss and z-loss through MoEAuxLossAutoScaler.
            assert_close(got[2][name], want[2][name], torch.float32, f"grad of {name}")


def test_bitwise_repeatable(megatron_world):
    _, mok = _stock_and_mok(_config())
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    first, second = _fwd_bwd(mok, x, x), _fwd_bwd(mok, x, x)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def _flat_sharded(sharded) -> dict:
    """Every ShardedTensor / ShardedObject (factories built, nested containers walked), by
    (checkpoint key, global offset): what a distributed checkpoint stores."""
    out = {}
    values = sharded.values() if isinstance(sharded, dict) else sharded
    for value in values:
        if isinstance(value, ShardedTensorFactory):
            value = value.build()
        if isinstance(value, (dict, list, tuple)):
            out.update(_flat_sharded(value))
        else:
            out[(value.key, getattr(value, "global_offset", None))] = value
    return out


def test_checkpoints_round_trip_with_stock(megatron_world):
    cfg = _config(moe_shared_expert_intermediate_size=24)
    stock, mok = _stock_and_mok(cfg)
    assert set(mok.state_dict()) == set(stock.state_dict())  # the same keys, with _extra_state
    # stock -> MoK -> a fresh stock layer: every tensor comes back.
    fresh = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=cfg)
    fresh.load_state_dict(mok.state_dict())
    for key, value in stock.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(fresh.state_dict()[key], value), key
    assert_same_sharded_layout(stock, mok)


def assert_same_sharded_layout(stock, mok) -> None:
    """The distributed-checkpoint layout: same sharded keys, global shapes, offsets, replicas, data."""
    want = _flat_sharded(stock.sharded_state_dict("decoder.layers.0.mlp."))
    got = _flat_sharded(mok.sharded_state_dict("decoder.layers.0.mlp."))
    assert set(got) == set(want)
    for key in want:
        a, b = want[key], got[key]
        assert (getattr(a, "global_shape", None), a.replica_id) == (getattr(b, "global_shape", None), b.replica_id), key
        if isinstance(getattr(a, "data", None), torch.Tensor):
            assert torch.equal(a.data, b.data), key


def te_grouped_mlp_keys(state: dict) -> dict:
    """SequentialMLP's `experts.local_experts.{i}.linear_fc1.weight` keys as TEGroupedMLP names them
    (`experts.linear_fc1.weight{i}`); the same tensors."""
    te_style = {}
    for key, value in state.items():
        if ".local_experts." in key:
            _, rest = key.split(".local_experts.")
            index, fc, leaf = rest.split(".")
            te_style[f"experts.{fc}.{leaf}{index}"] = value
        else:
            te_style[key] = value
    return te_style


def test_loads_te_grouped_mlp_keys(megatron_world):
    _, mok = _stock_and_mok(_config())
    te_style = te_grouped_mlp_keys(mok.state_dict())
    other = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=_config())
    other.load_state_dict(te_style)
    assert torch.equal(other.mok.experts.gate_up_proj, mok.mok.experts.gate_up_proj)


def test_expert_params_are_marked_and_main_grad_accumulates(megatron_world):
    cfg = _config(gradient_accumulation_fusion=True)
    mok = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=cfg)
    experts = list(mok.mok.experts.parameters())
    # At EP 1 and expert TP = TP, Megatron's experts use the dense groups (allreduce stays True).
    stock = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=_config())
    assert {p.allreduce for p in experts} == {getattr(p, "allreduce", True) for p in stock.experts.parameters()}
    assert all(p.allreduce is True for p in experts)
    for p in experts:
        p.main_grad = torch.full_like(p, 0.5, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    reference = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=_config())
    reference.load_state_dict(mok.state_dict())
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    _, _, want = _fwd_bwd(reference, x, x)
    _fwd_bwd(mok, x, x)
    for name, p in zip(("gate_up_proj", "down_proj"), experts, strict=True):
        assert p.grad_added_to_main_grad
        stacked = getattr(reference.mok.experts, name).grad
        assert torch.equal(p.main_grad, 0.5 + stacked.float()), name


def test_delayed_weight_grads_reach_main_grad_and_hooks_in_backward_dw(megatron_world):
    """--delay-wgrad-compute (set after construction: Megatron's own checks want the EP overlap):
    the expert weights' gradients wait for backward_dw, then go through the main_grad accumulation;
    the experts' parameters are marked skip_backward_post_hook, so their DDP hooks come through
    register_wgrad_accumulation_and_reduce_hooks (as DistributedDataParallel registers them) and run
    in backward_dw, once, after the gradients; the other parameters' hooks stay on their gradient
    accumulators and run in the backward. The bits are those of the undelayed backward."""
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    cfg = _config(gradient_accumulation_fusion=True)
    cfg.delay_wgrad_compute = True
    mok = use_mok(spec)(config=cfg)
    reference = use_mok(spec)(config=_config())
    reference.load_state_dict(mok.state_dict())
    experts = [mok.mok.experts.gate_up_proj, mok.mok.experts.down_proj]
    seen: list[tuple[str, bool]] = []  # (parameter, did its main_grad hold the gradient already)
    accumulators = []  # kept alive, as DDP keeps its grad_accs
    for name, p in mok.named_parameters():
        p.main_grad = torch.full_like(p, 0.5, dtype=torch.float32)
        p.grad_added_to_main_grad = False

        def hook(*_, name=name, p=p):
            seen.append((name, bool(torch.any(p.main_grad != 0.5))))

        if getattr(p, "skip_backward_post_hook", False):  # what DistributedDataParallel.__init__ does
            mok.register_wgrad_accumulation_and_reduce_hooks(hook)
        else:
            accumulators.append(p.expand_as(p).grad_fn.next_functions[0][0])
            accumulators[-1].register_hook(hook)
    assert [n for n, p in mok.named_parameters() if getattr(p, "skip_backward_post_hook", False)] == [
        "mok.experts.gate_up_proj", "mok.experts.down_proj"
    ]  # fmt: skip
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    _, want_dx, _ = _fwd_bwd(reference, x, x)
    _, got_dx, _ = _fwd_bwd(mok, x, x)
    assert torch.equal(got_dx, want_dx)
    assert seen == [("mok.router.weight", False)] and all(torch.all(p.main_grad == 0.5) for p in experts)
    mok.backward_dw(routed_experts=False, shared_experts=True)  # the pre-dispatch node's call: not the experts'
    assert len(seen) == 1
    mok.backward_dw()
    assert seen[1:] == [("mok.experts.gate_up_proj", True), ("mok.experts.down_proj", True)]
    for name, p in zip(("gate_up_proj", "down_proj"), experts, strict=True):
        assert p.grad_added_to_main_grad, name
        assert torch.equal(p.main_grad, 0.5 + getattr(reference.mok.experts, name).grad.float()), name
    assert len(mok.mok.weight_grads) == 0


UNSUPPORTED = [
    # Routing settings MoK refuses (random logits, sinkhorn, ...): test_megatron_routing.py.
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0), "--moe-router-load-balancing-type"),
    (dict(moe_input_jitter_eps=0.01), "--moe-input-jitter-eps"),
    # An interleave block that does not divide the expert FFN size (16); the other expert-MLP
    # settings MoK refuses are in test_megatron_families.py.
    (dict(moe_mlp_glu_interleave_size=32), "--moe-mlp-glu-interleave-size"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-token-drop-policy"),
    (
        dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", expert_model_parallel_size=2),
        "--moe-expert-capacity-factor",
    ),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "--moe-router-num-groups"),
]


@pytest.mark.parametrize("fields, flag", UNSUPPORTED, ids=[flag for _, flag in UNSUPPORTED])
def test_unsupported_settings_name_their_flag(fields, flag):
    with pytest.raises(MoKConfigError, match=flag):
        mok_config_from_megatron(_config(**fields))


def test_overrides_conflicting_with_megatron_are_errors():
    with pytest.raises(MoKConfigError, match="mok.top_k=4 conflicts"):
        mok_config_from_megatron(_config(), {"top_k": 4})
    assert mok_config_from_megatron(_config(), {"backend": "reference"}).backend == "reference"


def test_spec_builds_gpt_model_with_mok_layers(megatron_world):
    # What `--spec mok_plugin.megatron moe_block_spec` does in a stock launch: Megatron's GPT
    # builder calls the function with its GPTModelConfig; MoE layers (MTP too) come out as MoK.
    cfg = _config(num_layers=2, mtp_num_layers=1, transformer_impl="local", moe_layer_freq=[0, 1])
    model = _gpt(cfg, 16, mok=True)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoKMoELayer"]
    mtp_moe = [m for name, m in model.named_modules() if name.startswith("mtp.") and isinstance(m, MoELayer)]
    assert mtp_moe and all(isinstance(m, MoKMoELayer) for m in mtp_moe)
    # The whole model's distributed checkpoint (the block renames keys after its layers built
    # them) stores the same tensors under the same keys as the stock model's.
    stock = _gpt(cfg, 16, mok=False)
    want, got = _flat_sharded(stock.sharded_state_dict()), _flat_sharded(model.sharded_state_dict())
    assert set(got) == set(want)
    expert_keys = {key for key, _ in got if key.endswith("experts.experts.linear_fc1.weight")}
    assert expert_keys == {"decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                           "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"}  # fmt: skip


# --- --moe-use-upcycling: a dense model's MLPs copied into every expert -----------------------------

UPCYCLING = {
    # Megatron's own upcycling test's layer (granularity 1): the MoE model computes the dense one.
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu, moe_router_topk=2, granularity=1),
    # SwiGLU experts of half the dense width ("granular" upcycling): each dense MLP split in two.
    "swiglu_granular": dict(moe_router_topk=2, granularity=2),
}


@pytest.mark.parametrize("case", list(UPCYCLING))
@pytest.mark.usefixtures("megatron_world", "cpu_gpt_model")
def test_upcycling_fills_mok_experts_as_stock(case):
    from megatron.core.transformer.moe import upcycling_utils

    fields = dict(UPCYCLING[case])
    granularity = fields.pop("granularity")
    common = dict(num_layers=2, transformer_impl="local", attention_dropout=0.0, hidden_dropout=0.0,
                  ffn_hidden_size=32, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)  # fmt: skip
    activation = {k: fields[k] for k in ("gated_linear_unit", "activation_func") if k in fields}
    dense_cfg = _config(**common, **activation, num_moe_experts=None, moe_ffn_hidden_size=None, moe_router_topk=None)
    moe_cfg = _config(**common, **fields, num_moe_experts=4, moe_ffn_hidden_size=32 // granularity)
    dense, stock, mok = _gpt(dense_cfg, 8, mok=False), _gpt(moe_cfg, 8, mok=False), _gpt(moe_cfg, 8, mok=True)
    assert type(mok.decoder.layers[0].mlp) is MoKMoELayer
    logits = {}
    for name, model in (("dense", dense), ("stock", stock), ("mok", mok)):
        if model is not dense:
            model.load_state_dict(upcycling_utils.upcycle_state_dict([model], [dense])["model"], strict=True)
        model.eval()
        with torch.no_grad():
            logits[name] = model(*_gpt_inputs(2, 8))
    assert_close(logits["mok"], logits["stock"], torch.float32, name="MoK against the stock layer, upcycled")
    if granularity == 1:
        assert_close(logits["mok"], logits["dense"], torch.float32, name="MoK against the dense model")


@pytest.mark.usefixtures("megatron_world")
def test_moe_block_spec_builds_the_dense_model_of_upcycling(monkeypatch):
    # Megatron's training clears --num-experts while it builds the dense model to upcycle from.
    import argparse

    from megatron.training import global_vars
    from megatron.training.models.gpt import GPTModelConfig, default_layer_spec

    from mok_plugin.megatron import moe_block_spec

    dense_cfg = _config(num_moe_experts=None, moe_ffn_hidden_size=None, moe_router_topk=None, transformer_impl="local",
                        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)  # fmt: skip
    dense = GPTModelConfig(transformer=dense_cfg, vocab_size=64, seq_length=8)
    with pytest.raises(ValueError, match="needs an MoE model"):
        moe_block_spec(dense)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(moe_use_upcycling=True, num_experts=None))
    assert str(moe_block_spec(dense)) == str(default_layer_spec(dense, None))


# --- EP = 2 in two gloo processes against EP = 1 ------------------------------------------------


def _ep_worker(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port, ep=world)
    try:
        cfg = _config(expert_model_parallel_size=world, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        layer = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=cfg)
        full = torch.load(out + ".weights.pt")
        E_l = E // world
        with torch.no_grad():
            layer.mok.router.weight.copy_(full["router"])
            layer.mok.experts.gate_up_proj.copy_(full["w13"][rank * E_l : (rank + 1) * E_l])
            layer.mok.experts.down_proj.copy_(full["w2"][rank * E_l : (rank + 1) * E_l])
        # Rank-major global batch: rank r holds sequence positions [6r, 6r + 6) of the [12, 2] batch.
        rows = slice(6 * rank, 6 * rank + 6)
        x = make_layer_inputs(24, H, seed=1).view(12, 2, H)[rows]
        probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)[rows]
        out_, d_x, _ = _fwd_bwd(layer, x, probe)
        result = {
            "out": out_,
            "d_x": d_x,
            "w13": layer.mok.experts.gate_up_proj.grad,
            "w2": layer.mok.experts.down_proj.grad,
        }
        torch.save(result, f"{out}.{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_two_processes_matches_one(megatron_world, tmp_path):
    # EP = 1 here; EP = 2 over two spawned processes on Megatron's expert-parallel group. MoK's
    # order does not depend on the EP size, so outputs and gradients are bitwise equal.
    cfg = _config(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    layer = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=cfg)
    full = {
        "router": layer.mok.router.weight.detach(),
        "w13": layer.mok.experts.gate_up_proj.detach(),
        "w2": layer.mok.experts.down_proj.detach(),
    }
    torch.save(full, str(tmp_path / "ep") + ".weights.pt")
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)
    want_out, want_dx, _ = _fwd_bwd(layer, x, probe)
    mp.spawn(_ep_worker, args=(2, free_port(), str(tmp_path / "ep")), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"ep.{r}.pt") for r in range(2)]
    assert torch.equal(torch.cat([p["out"] for p in parts]), want_out)
    assert torch.equal(torch.cat([p["d_x"] for p in parts]), want_dx)
    assert torch.equal(torch.cat([p["w13"] for p in parts]), layer.mok.experts.gate_up_proj.grad)
    assert torch.equal(torch.cat([p["w2"] for p in parts]), layer.mok.experts.down_proj.grad)


def test_optimizer_finds_every_parameter_in_the_sharded_state_dict(megatron_world):
    # Megatron's optimizer maps its states to the model's sharded tensors by parameter identity.
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    _, mok = _stock_and_mok(_config(moe_shared_expert_intermediate_size=24))
    params = list(mok.parameters())
    assert len(get_param_id_to_sharded_param_map(mok.sharded_state_dict("mlp."), params)) == len(params)


_DIST_CKPT_FAMILIES = {
    "swiglu_shared": dict(moe_shared_expert_intermediate_size=24),
    "squared_relu_shared": dict(gated_linear_unit=False, activation_func=squared_relu,
                                moe_shared_expert_intermediate_size=24),
    "quick_geglu_biases": pytest.param(
        dict(activation_func=quick_gelu, activation_func_clamp_value=7.0, glu_linear_offset=1.0, add_bias_linear=True),
    ),
}  # fmt: skip


def torch_dist_on_the_cpu(set_attribute=setattr) -> None:
    """Megatron's torch_dist format on a machine without CUDA: its writer calls torch.cuda.synchronize()
    before copying tensors (nothing to wait for on the CPU) and the stock router puts buffers on
    torch.cuda.current_device(). Both become CPU stand-ins (set through set_attribute, e.g. a
    monkeypatch's setattr); with CUDA nothing changes."""
    if not torch.cuda.is_available():
        set_attribute(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        set_attribute(torch.cuda, "current_device", lambda: "cpu")


def stock_to_mok_to_stock(cfg: TransformerConfig, directory) -> None:
    """Megatron's own dist_checkpointing (torch_dist format) saves a stock layer with every tensor
    random; MoK loads it, saves its own; a fresh stock layer loads that: every weight (and bias)
    comes back. Collective: every rank of the world calls it with the same directory."""
    from megatron.core import dist_checkpointing, tensor_parallel

    if not cfg.use_cpu_initialization:
        tensor_parallel.model_parallel_cuda_manual_seed(123)  # Megatron's GPU initialisation draws from it
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    stock, mok, fresh = spec(config=cfg), use_mok(spec)(config=cfg), spec(config=cfg)
    torch.manual_seed(123)  # the same draws on every rank: replicated tensors are equal across ranks
    with torch.no_grad():  # every tensor random (Megatron starts biases at zero)
        for param in stock.parameters():
            param.normal_()
    saved = {name: os.path.join(str(directory), name) for name in ("stock", "mok")}
    for path in saved.values():
        os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(stock.sharded_state_dict(), saved["stock"])
    mok.load_state_dict(dist_checkpointing.load(mok.sharded_state_dict(), saved["stock"]))
    stock_sd = stock.state_dict()
    for key, value in mok.state_dict().items():
        if isinstance(value, torch.Tensor):
            # .cpu(): the stock router weight stays on the CPU until used
            assert torch.equal(value.cpu(), stock_sd[key].cpu()), key
    dist_checkpointing.save(mok.sharded_state_dict(), saved["mok"])
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), saved["mok"]))
    for key, value in fresh.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value.cpu(), stock_sd[key].cpu()), key


@pytest.mark.parametrize("fields", list(_DIST_CKPT_FAMILIES.values()), ids=list(_DIST_CKPT_FAMILIES))
def test_distributed_checkpoint_stock_to_mok_to_stock(megatron_world, tmp_path, fields, monkeypatch):
    torch_dist_on_the_cpu(monkeypatch.setattr)
    stock_to_mok_to_stock(_config(**fields, use_cpu_initialization=not torch.cuda.is_available()), tmp_path)


def _stable_topk(values, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties broken by the lower index (a stable sort)."""
    order = torch.sort(values, dim=dim, descending=largest, stable=True)
    return order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)


def test_capacity_matches_stock(megatron_world, monkeypatch):
    # --moe-expert-capacity-factor with --moe-token-drop-policy position at EP 1. Megatron documents
    # "tokens at the end of each batch will be dropped"; its apply_router_token_dropping takes
    # torch.topk over the 0/1 routing map, whose order among the tied ones is implementation-defined
    # (on the CPU it can keep a later token over an earlier one). MoK keeps each expert's first
    # tokens, as documented; the stock layer is run with a top-k that breaks ties by position.
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(moe_utils.torch, "topk", _stable_topk)
    cfg = _config(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position")
    stock, mok = _stock_and_mok(cfg)
    x = make_layer_inputs(24, H, seed=3).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=4).view(12, 2, H)
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert int(mok.mok.last_num_dropped) > 0, "the case must drop tokens to test dropping"
    assert_close(got[0], want[0], torch.float32, "output")
    assert_close(got[1], want[1], torch.float32, "d_x")
    for name, grad in want[2].items():
        assert_close(got[2][name], grad, torch.float32, f"grad of {name}")


def test_init_std_follows_megatron(megatron_world):
    # init_method (router, fc1) and output_layer_init_method (fc2: std / sqrt(2 num_layers)) as
    # Megatron draws them; the stock layer's weights have the same spread, key by key.
    cfg = _config(hidden_size=128, ffn_hidden_size=128, moe_ffn_hidden_size=128, num_layers=4, init_method_std=0.05,
                  moe_shared_expert_intermediate_size=128)  # fmt: skip
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    stock, mok = spec(config=cfg), use_mok(spec)(config=cfg)
    assert mok.mok.output_init_std == pytest.approx(0.05 / 8**0.5)
    stock_sd, mok_sd = stock.state_dict(), mok.state_dict()
    for key, value in mok_sd.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1000:
            std = 0.05 / 8**0.5 if "linear_fc2" in key else 0.05
            # A sample std of n normal draws is within 5 standard errors (std / sqrt(2n)) of std;
            # the stock layer's draws (from torch's global generator) are held to the same bound.
            bound = 5 * std / (2 * value.numel()) ** 0.5
            assert abs(value.float().std().item() - std) <= bound, key
            assert abs(stock_sd[key].float().std().item() - std) <= bound, f"stock {key}"
    # Another init callable is refused by name (not drawn as if it were a normal).
    with pytest.raises(MoKConfigError, match="--init-method-std"):
        mok_config_from_megatron(_config(init_method=torch.nn.init.xavier_uniform_))
    # Without initialisation (weights from a checkpoint) any callable is fine.
    mok_config_from_megatron(_config(init_method=torch.nn.init.xavier_uniform_, perform_initialization=False))
