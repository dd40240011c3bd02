"""The Megatron adapter's expert MLP options on the CPU (gloo): MoKMoELayer against Megatron's stock
MoELayer (SequentialMLP experts) built from the same TransformerConfig with the same random weights
and biases, for GPT-OSS-like experts (quick-GeGLU, a clamp that binds and 7.0, linear offset 1.0,
--add-bias-linear), Nemotron-like ones (squared ReLU, no GLU) and GELU ones (with and without GLU):
outputs, input, router, expert weight and bias gradients; state dicts both ways (SequentialMLP and
TEGroupedMLP keys, biases, plain fc1) and the sharded layout; how each activation function maps;
and every expert-MLP setting MoK still refuses, by its flag; which experts class the layer reads from
its spec."""

import dataclasses
import functools
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import activations  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer import utils as megatron_utils  # noqa: E402
from test_megatron import _fwd_bwd, assert_same_sharded_layout, megatron_world, te_grouped_mlp_keys  # noqa: E402, F401

from mok_plugin.compare.stock_cpu import let_stock_fc2_bias_train_at_ep1, make_stock_router_cpu_safe  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.megatron

H, I, E = 32, 16, 8
# With x ~ N(0, 1), fc1 weights ~ N(0, 1/H) and biases ~ N(0, 0.25), fc1's outputs are about N(0, 1.25):
# a clamp of 0.5 binds on about half of them (checked in the test), 7.0 on none.
SMALL_CLAMP = 0.5
GPT_OSS = dict(gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0)
# name -> (TransformerConfig fields, MoK's family fields)
FAMILIES = {
    "gpt_oss_clamp_binds": (
        {**GPT_OSS, "activation_func_clamp_value": SMALL_CLAMP},
        dict(expert_kind="glu", expert_activation="quick_gelu", activation_clamp=SMALL_CLAMP, glu_linear_offset=1.0),
    ),
    "gpt_oss_clamp_7": (
        {**GPT_OSS, "activation_func_clamp_value": 7.0},
        dict(expert_kind="glu", expert_activation="quick_gelu", activation_clamp=7.0, glu_linear_offset=1.0),
    ),
    # Megatron's fused quick-GeGLU path (clamp, offset, routing weight in one function).
    "gpt_oss_fused": (
        {**GPT_OSS, "activation_func_clamp_value": SMALL_CLAMP, "bias_activation_fusion": True},
        dict(expert_kind="glu", expert_activation="quick_gelu", activation_clamp=SMALL_CLAMP, glu_linear_offset=1.0),
    ),
    "gpt_oss_shared_expert": (  # the shared expert clamps and offsets too
        {**GPT_OSS, "activation_func_clamp_value": SMALL_CLAMP, "moe_shared_expert_intermediate_size": 24},
        dict(expert_kind="glu", activation_clamp=SMALL_CLAMP, glu_linear_offset=1.0, num_shared_experts=1),
    ),
    "gpt_oss_biases": (
        {**GPT_OSS, "activation_func_clamp_value": SMALL_CLAMP, "add_bias_linear": True},
        dict(expert_kind="glu", activation_clamp=SMALL_CLAMP, expert_fc1_bias=True, expert_fc2_bias=True),
    ),
    "gpt_oss_biases_clamp_7": (
        {**GPT_OSS, "activation_func_clamp_value": 7.0, "add_bias_linear": True},
        dict(expert_kind="glu", activation_clamp=7.0, expert_fc1_bias=True, expert_fc2_bias=True),
    ),
    "nemotron_squared_relu": (
        dict(gated_linear_unit=False, activation_func=activations.squared_relu),
        dict(expert_kind="mlp", expert_activation="squared_relu", expert_fc1_bias=False, expert_fc2_bias=False),
    ),
    "nemotron_shared_expert": (
        dict(gated_linear_unit=False, activation_func=activations.squared_relu, moe_shared_expert_intermediate_size=24),
        dict(expert_kind="mlp", expert_activation="squared_relu", num_shared_experts=1),
    ),
    "geglu": (dict(gated_linear_unit=True, activation_func=F.gelu), dict(expert_kind="glu", expert_activation="gelu")),
    "gelu_mlp": (
        dict(gated_linear_unit=False, activation_func=F.gelu),
        dict(expert_kind="mlp", expert_activation="gelu"),
    ),
    "gelu_mlp_biases": (
        dict(gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True),
        dict(expert_kind="mlp", expert_activation="gelu", expert_fc1_bias=True, expert_fc2_bias=True),
    ),
    "fast_gelu_glu_shared_expert": (
        dict(gated_linear_unit=True, activation_func=activations.fast_gelu, moe_shared_expert_intermediate_size=24),
        dict(expert_kind="glu", expert_activation="gelu_tanh", num_shared_experts=1),
    ),
    "relu_mlp": (dict(gated_linear_unit=False, activation_func=F.relu), dict(expert_activation="relu")),
}


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=I, moe_ffn_hidden_size=I,
        num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True, gradient_accumulation_fusion=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, params_dtype=torch.float32,
    )  # fmt: skip
    fields.update(overrides)
    return TransformerConfig(**fields)


def _spec():
    return get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)


def make_stock_cpu_and_random(stock, seed: int = 0) -> torch.Generator:
    """A stock layer made to run on the CPU (its router's gating on the weight's own device, since
    Megatron's moves the router to CUDA; its fc2 bias trained at EP 1) with every parameter random
    (biases too: MoK's start at zero). Returns the generator, for more draws in the same stream."""
    make_stock_router_cpu_safe(stock)
    if stock.config.add_bias_linear:
        let_stock_fc2_bias_train_at_ep1(stock)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(stock.named_parameters()):
            scale = 0.5 if param.dim() == 1 else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return generator


def _stock(cfg: TransformerConfig, seed: int = 0):
    """The stock layer on the CPU with every parameter random (make_stock_cpu_and_random)."""
    stock = _spec()(config=cfg)
    make_stock_cpu_and_random(stock, seed)
    return stock


def _stock_and_mok(cfg: TransformerConfig):
    stock = _stock(cfg)
    mok = use_mok(_spec())(config=cfg)
    mok.load_state_dict(stock.state_dict())
    return stock, mok


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.usefixtures("megatron_world")
def test_family_matches_stock_layer(name):
    fields, family = FAMILIES[name]
    stock, mok = _stock_and_mok(_config(**fields))
    assert {k: getattr(mok.mok_config, k) for k in family} == family
    # The biases are not zero, and the layer computes with every one of them.
    biases = [p for n, p in mok.named_parameters() if n.endswith("bias")]
    assert len(biases) == (3 if fields.get("add_bias_linear") else 0)  # router, fc1, fc2
    assert all(bool((p != 0).all()) for p in biases)
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)
    if mok.mok_config.activation_clamp == SMALL_CLAMP:  # the clamp binds on fc1's outputs
        experts = mok.mok.experts
        h = torch.einsum("th,efh->etf", x.reshape(-1, H), experts.gate_up_proj)
        if experts.gate_up_bias is not None:
            h = h + experts.gate_up_bias[:, None, :]
        gate, up = h.detach().chunk(2, dim=-1)
        assert 0.3 < float(((gate > SMALL_CLAMP) | (up.abs() > SMALL_CLAMP)).float().mean()) < 0.9
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert_close(got[0], want[0], torch.float32, "output")
    assert_close(got[1], want[1], torch.float32, "d_x")
    assert set(got[2]) == set(want[2]) == {n for n, _ in stock.named_parameters()}
    for key in want[2]:
        assert_close(got[2][key], want[2][key], torch.float32, f"grad of {key}")


CHECKPOINT_FAMILIES = ["gpt_oss_biases", "gelu_mlp_biases", "nemotron_shared_expert", "geglu"]


@pytest.mark.parametrize("name", list(CHECKPOINT_FAMILIES))
@pytest.mark.usefixtures("megatron_world")
def test_checkpoints_round_trip_with_stock(name):
    cfg = _config(**FAMILIES[name][0])
    stock, mok = _stock_and_mok(cfg)
    assert set(mok.state_dict()) == set(stock.state_dict())  # the same keys, with _extra_state
    # stock -> MoK -> a fresh stock layer: every tensor comes back.
    fresh = _spec()(config=cfg)
    fresh.load_state_dict(mok.state_dict())
    for key, value in stock.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(fresh.state_dict()[key], value), key
    # (a plain MLP's fc1 is not split into gate and linear halves; fc1's bias is when it is a GLU)
    assert_same_sharded_layout(stock, mok)
    # Megatron's optimizer finds every parameter (biases too) among the sharded tensors.
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    params = list(mok.parameters())
    assert len(get_param_id_to_sharded_param_map(mok.sharded_state_dict("mlp."), params)) == len(params)


@pytest.mark.parametrize("name", ["gpt_oss_biases", "nemotron_squared_relu"])
@pytest.mark.usefixtures("megatron_world")
def test_loads_te_grouped_mlp_keys(name):
    # TEGroupedMLP writes experts.linear_fc1.weight{i} / .bias{i}: the same tensors, other names.
    stock, mok = _stock_and_mok(_config(**FAMILIES[name][0]))
    te_style = te_grouped_mlp_keys(stock.state_dict())
    other = use_mok(_spec())(config=_config(**FAMILIES[name][0]))
    other.load_state_dict(te_style)
    for key, value in mok.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(other.state_dict()[key], value), key


INTERLEAVE = 4  # --moe-mlp-glu-interleave-size: blocks of 4 of the 2 * I = 32 fc1 rows


def _te_grouped_spec_layer(cfg: TransformerConfig):
    """A MoK layer whose spec builds TEGroupedMLP experts (its submodules name the class)."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from mok_plugin.megatron import MoKMoELayer

    return MoKMoELayer(config=cfg, submodules=MoESubmodules(experts=functools.partial(TEGroupedMLP, submodules=None)))


@pytest.mark.usefixtures("megatron_world")
def test_te_grouped_mlp_interleaved_glu_rows_load_and_round_trip():
    # TEGroupedMLP with --moe-mlp-glu-interleave-size stores fc1's rows (weight and bias) in blocks,
    # gate and linear alternating, and de-interleaves fc1's output with _remove_glu_interleaving
    # before its GLU: MoK's gate-first rows are that function applied to the stored rows.
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from mok_plugin.megatron.checkpoint import glu_interleave

    cfg = _config(**FAMILIES["gpt_oss_biases"][0], moe_mlp_glu_interleave_size=INTERLEAVE)
    # the stock tensors under TEGroupedMLP's keys, taken as its interleaved rows
    te_style = te_grouped_mlp_keys(_stock(cfg).state_dict())
    for mok in (_te_grouped_spec_layer(cfg), use_mok(_spec())(config=cfg)):  # TEGroupedMLP's keys say the layout
        mok.load_state_dict(te_style)
        experts = mok.mok.experts
        for i in range(E):
            weight, bias = te_style[f"experts.linear_fc1.weight{i}"], te_style[f"experts.linear_fc1.bias{i}"]
            assert not torch.equal(weight, TEGroupedMLP._remove_glu_interleaving(weight.T, INTERLEAVE).T)
            assert torch.equal(experts.gate_up_proj[i], TEGroupedMLP._remove_glu_interleaving(weight.T, INTERLEAVE).T)
            assert torch.equal(experts.gate_up_bias[i], TEGroupedMLP._remove_glu_interleaving(bias, INTERLEAVE))
            assert torch.equal(experts.down_proj[i], te_style[f"experts.linear_fc2.weight{i}"])
        # Saved under SequentialMLP's keys, gate rows first; interleaved again, the stock tensors exactly.
        saved = mok.state_dict()
        for i in range(E):
            for leaf in ("weight", "bias"):
                stored = te_style[f"experts.linear_fc1.{leaf}{i}"]
                assert torch.equal(glu_interleave(saved[f"experts.local_experts.{i}.linear_fc1.{leaf}"], INTERLEAVE),
                                   stored)  # fmt: skip
    # The sharded tensors: the layer that replaces TEGroupedMLP stores its interleaved rows, as
    # TEGroupedMLP's sharded_state_dict does (same keys), and reads them back gate-first; the one
    # that replaces SequentialMLP (which ignores the setting) stores gate-first rows.
    for mok, interleaved in ((_te_grouped_spec_layer(cfg), True), (use_mok(_spec())(config=cfg), False)):
        mok.load_state_dict(te_style)
        sharded = mok.sharded_state_dict("mlp.")
        for name, leaf in (("gate_up_proj", "weight"), ("gate_up_bias", "bias")):
            factory = sharded[f"mlp.mok.experts.{name}"]
            assert isinstance(factory, ShardedTensorFactory)
            built = factory.build()
            for i in range(E):
                rows = torch.cat([part.data for part in built[i]])
                want = te_style[f"experts.linear_fc1.{leaf}{i}"] if interleaved else getattr(mok.mok.experts, name)[i]
                assert torch.equal(rows, want), (name, i, interleaved)
            merged = factory.merge_fn({i: [part.data for part in parts] for i, parts in built.items()})
            assert torch.equal(merged, getattr(mok.mok.experts, name)), (name, interleaved)


@pytest.mark.usefixtures("megatron_world")
def test_sequential_mlp_ignores_the_glu_interleave_size():
    # SequentialMLP's experts are Megatron's MLP, which never reads moe_mlp_glu_interleave_size: the same
    # layer with and without it; MoK (gate rows first, SequentialMLP's keys) matches it.
    fields = FAMILIES["gpt_oss_biases"][0]
    cfg = _config(**fields, moe_mlp_glu_interleave_size=INTERLEAVE)
    stock, plain = _stock(cfg), _stock(_config(**fields))
    mok = use_mok(_spec())(config=cfg)
    mok.load_state_dict(stock.state_dict())
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)
    want, without, got = _fwd_bwd(stock, x, probe), _fwd_bwd(plain, x, probe), _fwd_bwd(mok, x, probe)
    assert torch.equal(want[0], without[0]) and torch.equal(want[1], without[1])
    assert all(torch.equal(want[2][key], without[2][key]) for key in want[2])
    assert_close(got[0], want[0], torch.float32, "output")
    assert_close(got[1], want[1], torch.float32, "d_x")
    for key in want[2]:
        assert_close(got[2][key], want[2][key], torch.float32, f"grad of {key}")
    for key, value in stock.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mok.state_dict()[key], value), key


@pytest.mark.parametrize("name", ["nemotron_squared_relu", "gpt_oss_biases"])
@pytest.mark.usefixtures("megatron_world")
def test_main_grad_accumulation_with_other_families(name):
    # Weight gradients go into main_grad (fp32); biases keep ordinary gradients, as in Megatron.
    _, reference = _stock_and_mok(_config(**FAMILIES[name][0]))
    mok = use_mok(_spec())(config=_config(**FAMILIES[name][0], gradient_accumulation_fusion=True))
    mok.load_state_dict(reference.state_dict())
    experts = mok.mok.experts
    for param in (experts.gate_up_proj, experts.down_proj):
        param.main_grad = torch.full_like(param, 0.5, dtype=torch.float32)
        param.grad_added_to_main_grad = False
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    _fwd_bwd(reference, x, x)
    _fwd_bwd(mok, x, x)
    for name_ in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
        param, want = getattr(experts, name_), getattr(reference.mok.experts, name_)
        if param is None:
            continue
        if name_.endswith("_proj"):
            assert param.grad_added_to_main_grad and torch.equal(param.main_grad, 0.5 + want.grad.float()), name_
        else:
            assert torch.equal(param.grad, want.grad), name_


def _yaml_squared_relu():
    """The activation --yaml-cfg's `activation_func: squaredrelu` sets: a function defined inside
    megatron's core_transformer_config_from_yaml."""
    from megatron.training.yaml_arguments import core_transformer_config_from_yaml

    base = _config(add_bias_linear=False)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig)}
    fields.update(activation_func="squaredrelu", overlap_p2p_comm=False)
    args = SimpleNamespace(language_model=SimpleNamespace(**fields), model_parallel=SimpleNamespace())
    return core_transformer_config_from_yaml(args).activation_func


ACTIVATIONS = {  # id -> (activation_func, MoK's activation)
    "F.silu": (F.silu, "silu"),
    "F.gelu": (F.gelu, "gelu"),
    "F.relu": (F.relu, "relu"),
    "fused_bias_geglu.quick_gelu": (quick_gelu, "quick_gelu"),
    "activations.quick_gelu": (activations.quick_gelu, "quick_gelu"),
    "activations.squared_relu": (activations.squared_relu, "squared_relu"),
    "activations.fast_gelu": (activations.fast_gelu, "gelu_tanh"),
    "utils.openai_gelu": (megatron_utils.openai_gelu, "gelu_tanh"),
    "gelu_approximate_tanh": (functools.partial(F.gelu, approximate="tanh"), "gelu_tanh"),
    "gelu_approximate_none": (functools.partial(F.gelu, approximate="none"), "gelu"),
    "yaml_squaredrelu": (_yaml_squared_relu, "squared_relu"),
}


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activation_functions_map_by_identity(activation, gated):
    fn, name = ACTIVATIONS[activation]
    fn = _yaml_squared_relu() if fn is _yaml_squared_relu else fn
    cfg = mok_config_from_megatron(_config(activation_func=fn, gated_linear_unit=gated))
    assert (cfg.expert_kind, cfg.expert_activation) == ("glu" if gated else "mlp", name)


def test_clamp_and_offset_apply_to_the_glu_only():
    # Megatron's unfused path clamps and offsets the two GLU halves only; a plain MLP ignores both.
    glu = mok_config_from_megatron(_config(activation_func_clamp_value=3.0, glu_linear_offset=0.5))
    assert (glu.activation_clamp, glu.glu_linear_offset) == (3.0, 0.5)
    plain = _config(gated_linear_unit=False, activation_func=F.gelu, activation_func_clamp_value=3.0,
                    glu_linear_offset=0.5)  # fmt: skip
    assert mok_config_from_megatron(plain).expert_family.describe() == "mlp(gelu)"


def test_fusions_with_the_same_function_are_accepted():
    accepted = [
        dict(bias_activation_fusion=True),  # fused SwiGLU
        dict(**GPT_OSS, activation_func_clamp_value=7.0, bias_activation_fusion=True),  # fused quick-GeGLU
        dict(gated_linear_unit=False, activation_func=activations.squared_relu, use_fused_weighted_squared_relu=True),
        dict(use_te_activation_func=True),  # TE's SwiGLU
        dict(gated_linear_unit=False, activation_func=F.gelu, moe_mlp_glu_interleave_size=32),  # no GLU: no effect
        dict(moe_shared_expert_glu_interleave_size=32),  # read by the TE fused shared expert only
        dict(moe_mlp_glu_interleave_size=4),  # TEGroupedMLP's fc1 row blocks: reordered in checkpoints
    ]
    for fields in accepted:
        mok_config_from_megatron(_config(**fields))
    # TEGroupedMLP's fc1 adds its bias before the fused clamp, as MoK does
    fused = _config(**GPT_OSS, activation_func_clamp_value=7.0, add_bias_linear=True, bias_activation_fusion=True)
    assert mok_config_from_megatron(fused, stock_experts="TEGroupedMLP").expert_fc1_bias


BIAS = dict(add_bias_linear=True)
REFUSED = [
    (dict(activation_func=megatron_utils.erf_gelu), "activation_func=.*erf_gelu.*1.41421"),
    (dict(activation_func=lambda x: x), "activation_func=.*<lambda>.*not an activation MoK computes"),
    (dict(activation_func=torch.tanh), r"--swiglu / --quick-geglu / --squared-relu \(activation_func="),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True), "--moe-apply-probs-on-input"),
    (dict(moe_shared_expert_intermediate_size=16, **BIAS), "--disable-bias-linear.*SharedExpertMLP"),
    (dict(gated_linear_unit=False, activation_func=F.gelu, bias_activation_fusion=True, **BIAS),
     "--no-bias-gelu-fusion.*no fused"),
    (dict(bias_activation_fusion=True, activation_func_clamp_value=7.0), "fused SwiGLU ignores"),
    (dict(bias_activation_fusion=True, **BIAS), "SequentialMLP experts have no fused SwiGLU with a bias"),
    (dict(**GPT_OSS, activation_func_clamp_value=7.0, bias_activation_fusion=True, **BIAS),
     "clamps fc1's output before adding its bias"),
    (dict(**GPT_OSS, bias_activation_fusion=True, moe_shared_expert_intermediate_size=16),
     "shared expert has no fused quick-GeGLU"),
    (dict(bias_activation_fusion=True, activation_func_fp8_input_store=True), "--activation-func-fp8-input-store"),
    (dict(activation_func=F.gelu, use_te_activation_func=True), "--use-te-activation-func"),
    (dict(**GPT_OSS, use_transformer_engine_op_fuser=True), "--use-transformer-engine-op-fuser"),
    (dict(moe_mlp_glu_interleave_size=3), r"--moe-mlp-glu-interleave-size \(moe_mlp_glu_interleave_size=3\).*divide"),
    (dict(moe_shared_expert_intermediate_size=16, use_grouped_gemm_for_shared_expert=True),
     "--use-grouped-gemm-for-shared-expert"),
]  # fmt: skip


@pytest.mark.parametrize("fields, match", REFUSED, ids=[m.split(" ")[0][:40] for _, m in REFUSED])
def test_refused_expert_settings_name_their_flag(fields, match):
    with pytest.raises(MoKConfigError, match=match):
        mok_config_from_megatron(_config(**fields))


def test_mok_config_cannot_change_the_expert_family():
    for key, value, flag in [
        ("expert_activation", "silu", "--swiglu / --quick-geglu / --squared-relu (activation_func)"),
        ("activation_clamp", 3.0, "--activation-func-clamp-value"),
        ("expert_fc1_bias", True, "--disable-bias-linear"),
    ]:
        with pytest.raises(MoKConfigError, match=rf"mok\.{key}=.* conflicts .*{re.escape(flag)}"):
            mok_config_from_megatron(_config(**GPT_OSS, activation_func_clamp_value=7.0), {key: value})


def test_the_layer_reads_the_stock_experts_class_from_its_spec():
    # The few fused paths whose result depends on the experts class are decided by what the spec builds.
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mok_plugin.megatron.layer import stock_experts_class

    assert stock_experts_class(_spec().keywords["submodules"]) == "SequentialMLP"
    assert (
        stock_experts_class(MoESubmodules(experts=functools.partial(TEGroupedMLP, submodules=None))) == "TEGroupedMLP"
    )
    assert stock_experts_class(MoESubmodules(experts=ModuleSpec(module=SequentialMLP))) == "SequentialMLP"
    assert stock_experts_class(None) is None
