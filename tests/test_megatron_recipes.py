"""The recipe matrix (issue 21): every public MoE recipe in tests/megatron_recipes.py, shrunk to CPU
size, against the Megatron adapter.

For each recipe, its TransformerConfig (the recipe's own settings and layout, bf16 as published)
must build, and MoK's verdict on it follows from the recipe's own settings (LATER_OR_REFUSED):
  - the recipe as published is accepted, or refused naming exactly the flags of the settings later
    MoK refuses (the delayed and custom FP8 recipes) or refuses by design (expert TP > 1;
    partial CUDA-graph capture of the MoE layer), and
    nothing else: tensor (with sequence), pipeline and context parallelism and any EP size are accepted;
  - the same recipe at TP = CP = PP = ETP = 1 (its EP kept): the same, less the layout flags;
  - at that layout with EP = 1 on the CPU in fp32, the MoK layer built through the spec (with the
    refused settings switched off) matches the stock MoELayer (outputs, input gradients, router and
    expert gradients, the aux and z losses through the router gradient of a backward with a zero
    probe, the expert-bias token counts), and checkpoints load both ways (state dict and sharded
    layout); with --moe-router-force-load-balancing the stock layer routes by MoK's random logits;
  - through the launch path (the recipe as Megatron flags with --mok, Megatron's own parser and
    config, the GPT block spec that --mok sets), the same MoE settings reach a MoKMoELayer that
    computes bitwise what the spec-path layer computes.

The stock layer on the CPU needs a few stand-ins with no effect on what it computes (its
`_stock_twin`): the allgather dispatcher, SequentialMLP experts, no Transformer Engine fusions,
fp8, CUDA graphs, recompute or overlap. The MoK layer is always built from the recipe's own
settings. Nothing is xfailed: a recipe MoK does not run yet fails, naming the flag.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import activations  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer import transformer_config as megatron_transformer_config  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron_recipes import FFN, LAYOUT_FLAGS, RECIPES, H, Recipe  # noqa: E402
from test_megatron import _fwd_bwd, assert_same_sharded_layout, megatron_world  # noqa: E402, F401
from test_megatron_families import make_stock_cpu_and_random  # noqa: E402

from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import MoKMoELayer, mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.megatron

ACTIVATIONS = {"silu": F.silu, "quick_gelu": quick_gelu, "squared_relu": activations.squared_relu}
IDS = [recipe.name for recipe in RECIPES]
S, B = 8, 2  # sequence length, micro-batch: 16 tokens

# Megatron's TransformerConfig refuses Transformer-Engine-only settings (fused permutation, fp8,
# TE version gates) when TE is not installed: the recipe's config is validated as on a TE machine.
_TE_PERMUTE = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
               "fused_sort_chunks_by_index_with_probs", "fused_unpermute")  # fmt: skip


@contextlib.contextmanager
def _as_if_transformer_engine():
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(megatron_transformer_config, "is_te_min_version", lambda *a, **k: True))
        for name in _TE_PERMUTE:
            stack.enter_context(mock.patch.object(moe_utils, name, object()))
        yield


def reduced_layout(recipe: Recipe, ep: int | None = None) -> dict:
    """The recipe's layout at TP = CP = PP = ETP = 1 (EP kept unless given)."""
    layout = dict(recipe.layout)
    layout.update(
        tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_tensor_parallel_size=1, sequence_parallel=False,
    )  # fmt: skip
    if ep is not None:
        layout["expert_model_parallel_size"] = ep
    return layout


def recipe_fields(recipe: Recipe, layout: dict | None = None) -> dict:
    """TransformerConfig fields: the recipe's MoE settings and layout, shrunk sizes, bf16 as published."""
    layout = recipe.layout if layout is None else layout
    pp = layout.get("pipeline_model_parallel_size", 1)
    vpp = layout.get("virtual_pipeline_model_parallel_size") or 1
    fields = dict(
        num_layers=2 * pp * vpp, hidden_size=H, num_attention_heads=max(4, layout.get("tensor_model_parallel_size", 1)),
        ffn_hidden_size=FFN, activation_func=ACTIVATIONS[recipe.activation], use_cpu_initialization=True,
        gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True,
    )  # fmt: skip
    if pp > 1:
        fields["pipeline_dtype"] = torch.bfloat16
    fields.update(recipe.moe)
    fields.update(layout)
    # EP shrinks with the experts: the largest divisor of the shrunk expert count that divides the recipe's EP
    fields["expert_model_parallel_size"] = math.gcd(layout["expert_model_parallel_size"], recipe.moe["num_moe_experts"])
    return fields


def recipe_config(recipe: Recipe, layout: dict | None = None) -> TransformerConfig:
    with _as_if_transformer_engine():
        return TransformerConfig(**recipe_fields(recipe, layout))


def on_one_cpu(tc: TransformerConfig) -> TransformerConfig:
    """The validated recipe config with fp32 parameters and EP = 1, set after Megatron's checks (it
    validates the EP-comm overlap against bf16 and EP > 1 only): the CPU comparison's config."""
    tc = copy.copy(tc)
    tc.params_dtype, tc.bf16, tc.expert_model_parallel_size = torch.float32, False, 1
    return tc


# What the stock layer on the CPU uses instead: each has no effect on what the stock layer computes
# (fp8 has one, and the stock FP8 layer needs Transformer Engine: MoK's FP8 is compared with its own
# oracle and with the stock bf16 layer in tests/test_fp8_layer.py and tests/test_megatron_fp8.py).
_STOCK_CPU = dict(
    moe_token_dispatcher_type="allgather", moe_flex_dispatcher_backend=None, moe_permute_fusion=False,
    moe_router_fusion=False, moe_grouped_gemm=False, moe_shared_expert_overlap=False,
    overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False, fp8=None, moe_router_padding_for_fp8=False,
    moe_router_padding_for_quantization=False, cuda_graph_impl="none", cuda_graph_scope=None,
    recompute_granularity=None, recompute_modules=None, recompute_method=None, recompute_num_layers=None,
    fine_grained_activation_offloading=False, offload_modules=None, bias_activation_fusion=False,
    params_dtype=torch.float32, bf16=False, pipeline_dtype=None,
)  # fmt: skip


def _stock_twin(recipe: Recipe) -> TransformerConfig:
    fields = recipe_fields(recipe, reduced_layout(recipe, ep=1))
    fields.update({k: v for k, v in _STOCK_CPU.items() if k in fields or v is not None})
    fields = {k: v for k, v in fields.items() if not (k in ("fp8_recipe",) and fields.get("fp8") is None)}
    return TransformerConfig(**fields)


def _flags_named(error: MoKConfigError) -> set[str]:
    """The flags an adapter error names, one per problem line ('  --flag (field=...): ...')."""
    flags = set()
    for line in str(error).splitlines()[1:]:
        match = re.match(r"\s*((?:--[\w-]+)(?: / --[\w-]+)*)", line)
        flags.add(match[1] if match else line.strip()[:80])
    return flags


def _verdict(tc: TransformerConfig, stock_experts: str | None) -> set[str]:
    """The flags MoK refuses for this config (empty: accepted)."""
    try:
        mok_config_from_megatron(tc, stock_experts=stock_experts)
    except MoKConfigError as error:
        return _flags_named(error)
    return set()


def _experts_class(recipe: Recipe) -> str:
    """The experts class the recipe's stock layer builds: grouped GEMM on Transformer Engine (every
    recipe here launches with --transformer-impl transformer_engine) is TEGroupedMLP."""
    return "TEGroupedMLP" if recipe.moe.get("moe_grouped_gemm") else "SequentialMLP"


# --- the recipe's config and MoK's verdict -------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_recipe_config_builds(recipe):
    tc = recipe_config(recipe)
    for key, value in recipe.layout.items():
        if key != "expert_model_parallel_size":
            assert getattr(tc, key) == value, key
    assert (tc.num_moe_experts, tc.moe_router_topk) == (recipe.moe["num_moe_experts"], recipe.moe["moe_router_topk"])


# What MoK refuses by name in these recipes, and why: the settings later issues take, and those it
# refuses by design. A recipe is refused on exactly these flags (the ones its settings match) and
# accepted otherwise; pipeline and context parallelism (and EP, any size) are accepted by the layer.
LATER_OR_REFUSED = [
    # (does the config set it?, the flag MoK names, why)
    (
        lambda tc: (tc.expert_tensor_parallel_size or 1) > 1,
        "--expert-tensor-parallel-size",
        "refused by design: MoK keeps each expert whole on one rank (the TP > 1 recipes pass ETP 1)",
    ),
    (
        lambda tc: (
            tc.fp8 not in (None, False) and str(getattr(tc.fp8_recipe, "value", tc.fp8_recipe)) in ("delayed", "custom")
        ),
        "--fp8-recipe",
        "MoK computes the blockwise, tensorwise and mxfp8 FP8 recipes (mok.fp8, mok.fp8_scaling); delayed (an amax "
        "history) and custom (a user's quantiser factory) are refused",
    ),
]


def expected_refusals(tc: TransformerConfig) -> set[str]:
    return {flag for applies, flag, _ in LATER_OR_REFUSED if applies(tc)}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_recipe_layout_verdict(recipe):
    # The recipe as published: refused on exactly the flags of LATER_OR_REFUSED it sets, nothing else.
    tc = recipe_config(recipe)
    named = _verdict(tc, _experts_class(recipe))
    assert named == expected_refusals(tc), (
        f"{recipe.name} ({recipe.source}): expected {sorted(expected_refusals(tc)) or 'accepted'}, "
        f"MoK named {sorted(named) or 'nothing (accepted)'}"
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_recipe_at_tp_cp_pp_1_is_accepted(recipe):
    # At TP = CP = PP = ETP = 1 only later issues' precision and overlap settings (named) remain.
    tc = recipe_config(recipe, reduced_layout(recipe))
    named = _verdict(tc, _experts_class(recipe))
    assert named == expected_refusals(tc), (
        f"{recipe.name} at TP = CP = PP = 1 (EP {recipe.layout['expert_model_parallel_size']}): {named}"
    )


# --- the layer against the stock layer on the CPU ------------------------------------------------


def _moe_spec(recipe: Recipe, num_experts: int):
    """The stock MoE spec on the CPU (SequentialMLP); for a grouped-GEMM recipe, the MoK layer's
    spec names TEGroupedMLP, as the recipe's own TE spec does."""
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    if _experts_class(recipe) == "TEGroupedMLP":
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        submodules = dataclasses.replace(spec.keywords["submodules"],
                                         experts=functools.partial(TEGroupedMLP, submodules=None))  # fmt: skip
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return spec


def _stock_spec(cfg: TransformerConfig):
    return get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)


def _stock_layer(recipe: Recipe, seed: int = 0):
    """The stock layer with every parameter random, and a random expert bias where the recipe has one."""
    cfg = _stock_twin(recipe)
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):  # the router's expert-bias buffers
        stock = _stock_spec(cfg)(config=cfg)
    generator = make_stock_cpu_and_random(stock, seed)
    with torch.no_grad():
        if getattr(stock.router, "expert_bias", None) is not None:
            stock.router.expert_bias.copy_(torch.randn(cfg.num_moe_experts, generator=generator) * 0.1)
    return stock


# The settings of LATER_OR_REFUSED switched off (their values without them), so that the layer
# semantics of every recipe are compared with the stock layer, whatever MoK still refuses; and FP8,
# which the stock layer on the CPU cannot run (tests/test_megatron_fp8.py compares MoK's).
_WITHOUT_LATER = dict(
    fp8=None, moe_router_padding_for_fp8=False, moe_router_padding_for_quantization=False,
    overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False, cuda_graph_impl="none", cuda_graph_scope=None,
)  # fmt: skip


def _mok_layer(recipe: Recipe):
    """The MoK layer through the spec path, from the recipe's own settings (EP 1, fp32; FP8 and those
    MoK refuses switched off: the EP overlap, partial CUDA graphs)."""
    tc = recipe_config(recipe, reduced_layout(recipe))
    tc = on_one_cpu(tc)
    for field, value in _WITHOUT_LATER.items():
        setattr(tc, field, value)
    return use_mok(_moe_spec(recipe, tc.num_moe_experts))(config=tc)


_STOCK_RANDOM_CALLS: list = []  # the stock layer's RandomSTE calls since the run began


@pytest.fixture(autouse=True)
def _stock_draws_moks_random_logits(monkeypatch):
    """--moe-router-force-load-balancing: the stock layer routes by the N(0, 1) logits MoK draws
    (its layer 0, call by call) instead of the CUDA RNG's, so the two compute the same function."""
    from mok_plugin import random_stream

    calls = _STOCK_RANDOM_CALLS

    def mok_draws(ctx, logits):
        rows = logits.reshape(-1, logits.shape[-1])
        tokens = random_stream.global_token_index(rows.shape[0], 0)
        noise = random_stream.normal(0, len(calls), "force_balance/layer=0", tokens, rows.shape[1])
        calls.append(1)
        return noise.to(logits.dtype).view(logits.shape)

    monkeypatch.setattr(moe_utils.RandomSTE, "forward", staticmethod(mok_draws))


def _run(layer, x, probe):
    # each run from the start of the random stream (force load balancing), stock and MoK alike
    _STOCK_RANDOM_CALLS.clear()
    if isinstance(layer, MoKMoELayer):
        layer.mok.random_calls.zero_()
    return _fwd_bwd(layer, x, probe)


def _router_grads(layer, x) -> dict:
    """Gradients of a backward with a zero probe: only the aux and z losses reach the router."""
    layer.zero_grad(set_to_none=True)
    _, _, grads = _run(layer, x, torch.zeros_like(x))
    return {k: v for k, v in grads.items() if "router" in k}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.usefixtures("megatron_world")
def test_recipe_layer_matches_stock(recipe):
    stock = _stock_layer(recipe)
    mok = _mok_layer(recipe)
    assert isinstance(mok, MoKMoELayer)
    mok.load_state_dict(stock.state_dict())
    x = make_layer_inputs(S * B, H, seed=1).view(S, B, H)
    probe = make_layer_inputs(S * B, H, seed=2).view(S, B, H)
    want, got = _run(stock, x, probe), _run(mok, x, probe)
    assert_close(got[0], want[0], torch.float32, "output")
    assert_close(got[1], want[1], torch.float32, "d_x")
    assert set(got[2]) == set(want[2]) == {n for n, p in stock.named_parameters() if p.requires_grad}
    for key in want[2]:
        assert_close(got[2][key], want[2][key], torch.float32, f"grad of {key}")
    if recipe.moe.get("moe_router_enable_expert_bias"):
        # the token counts Megatron's finalize_model_grads updates the expert bias from
        want_counts = stock.router.local_tokens_per_expert
        assert torch.equal(mok.mok.local_tokens_per_expert, want_counts)
    # the aux and z losses alone: their gradients into the router
    want_router, got_router = _router_grads(stock, x), _router_grads(mok, x)
    assert set(got_router) == set(want_router)
    for key in want_router:
        assert_close(got_router[key], want_router[key], torch.float32, f"aux/z-loss grad of {key}")


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.usefixtures("megatron_world")
def test_recipe_checkpoints_round_trip_with_stock(recipe):
    stock = _stock_layer(recipe)
    mok = _mok_layer(recipe)
    assert set(mok.state_dict()) == set(stock.state_dict())
    mok.load_state_dict(stock.state_dict())
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        fresh = _stock_spec(stock.config)(config=stock.config)
    fresh.load_state_dict(mok.state_dict())
    for key, value in stock.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(fresh.state_dict()[key], value), key
    assert_same_sharded_layout(stock, mok)


# --- the launch path -----------------------------------------------------------------------------

# TransformerConfig fields whose flag is not `--` + the field name with dashes, by value.
_BOOL_FLAGS_FALSE = {
    "add_bias_linear": "--disable-bias-linear",
    "moe_permute_fusion": None,  # store_true flags: False is the default
}


def _activation_flags(recipe: Recipe) -> list[str]:
    gated = recipe.moe.get("gated_linear_unit")
    if recipe.activation == "silu" and gated:
        flags = ["--swiglu"]
    elif recipe.activation == "quick_gelu" and gated:
        flags = ["--quick-geglu"]
    elif recipe.activation == "squared_relu" and not gated:
        flags = ["--squared-relu"]
    else:
        raise AssertionError(f"no flags for {recipe.activation} (gated={gated})")
    if not recipe.moe.get("bias_activation_fusion", False):
        flags.append("--no-bias-swiglu-fusion" if flags[0] == "--swiglu" else "--no-bias-gelu-fusion")
    return flags


_NOT_FLAGS = {"gated_linear_unit", "bias_activation_fusion", "multi_latent_attention", "cuda_graph_impl",
              "cuda_graph_scope", "fine_grained_activation_offloading", "offload_modules", "recompute_granularity",
              "recompute_modules", "recompute_method", "recompute_num_layers",
              "fp8", "fp8_recipe", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization",
              "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "moe_flex_dispatcher_backend",
              "moe_token_dispatcher_type", "mtp_num_layers", "calculate_per_token_loss", "moe_grouped_gemm",
              "moe_permute_fusion", "moe_router_fusion"}  # fmt: skip


def recipe_flags(recipe: Recipe) -> list[str]:
    """The recipe's MoE-layer settings as the Megatron flags a launch passes (the layer's math only:
    scheduling, precision and dispatcher flags need a GPU launch and are checked on the config)."""
    flags = _activation_flags(recipe)
    for key, value in recipe.moe.items():
        if key in _NOT_FLAGS or value is None:
            continue
        if key == "add_bias_linear" and value is True:  # Megatron's default
            continue
        if key == "moe_router_load_balancing_type" and value == "noaux_tc":
            value = "none"  # DeepSeek-V4's type: 0.19's parser refuses it, its router ignores it (as none)
        if key in _BOOL_FLAGS_FALSE and value is False:
            if _BOOL_FLAGS_FALSE[key]:
                flags.append(_BOOL_FLAGS_FALSE[key])
            continue
        flag = "--" + key.replace("_", "-")
        if key == "num_moe_experts":
            flag = "--num-experts"
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        elif key == "moe_layer_freq":
            flags += [flag, "[" + ",".join(map(str, value)) + "]"]
        else:
            flags += [flag, str(value)]
    return flags


_BASE_ARGS = ["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length", str(S),
              "--max-position-embeddings", str(S), "--micro-batch-size", str(B), "--global-batch-size", str(B),
              "--ffn-hidden-size", str(FFN), "--train-iters", "1", "--lr", "1e-4", "--mock-data",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--transformer-impl", "local",
              "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--position-embedding-type", "rope",
              "--no-rope-fusion", "--no-persist-layer-norm", "--moe-token-dispatcher-type", "alltoall"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.usefixtures("megatron_world")
def test_recipe_through_the_launcher(recipe):
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args
    from megatron.training.models.gpt import GPTModelConfig
    from test_megatron_launch import _parse

    from mok_plugin.megatron import launcher

    argv = ["--mok", "--mok-backend", "reference", *_BASE_ARGS, *recipe_flags(recipe)]
    if "moe_layer_freq" not in recipe.moe:
        argv += ["--moe-layer-freq", "[0,1]"]
    try:
        args = _parse(argv)
        launcher.apply_mok_args(args)
        assert args.spec == launcher.SPEC
        validate_args(args, {"tokenizer_type": "NullTokenizer"})
        tc = core_transformer_config_from_args(args)
        # the flags gave the recipe's MoE settings
        want = recipe_config(recipe, reduced_layout(recipe))
        for key in recipe.moe:
            if key not in _NOT_FLAGS and key not in ("moe_token_dispatcher_type", "moe_layer_freq", "mtp_num_layers"):
                expected = getattr(want, key)
                expected = "none" if expected == "noaux_tc" else expected  # as recipe_flags passes it
                assert getattr(tc, key) == expected, key
        # the block spec --mok sets builds MoK's layer
        from mok_plugin.megatron import moe_block_spec

        tc.params_dtype = torch.float32
        block = moe_block_spec(GPTModelConfig(transformer=tc, vocab_size=128, seq_length=S))
        mlps = [layer.submodules.mlp for layer in block.layer_specs]
        moe_specs = [m for m in mlps if getattr(m, "func", getattr(m, "module", None)) is MoKMoELayer]
        assert moe_specs, f"no MoKMoELayer in the block spec: {mlps}"
        builder = moe_specs[0]
        submodules = builder.keywords["submodules"] if hasattr(builder, "keywords") else builder.submodules
        if _experts_class(recipe) == "TEGroupedMLP":  # the recipe launches on TE: its experts are TEGroupedMLP
            from megatron.core.transformer.moe.experts import TEGroupedMLP

            submodules = dataclasses.replace(submodules, experts=functools.partial(TEGroupedMLP, submodules=None))
        layer = MoKMoELayer(config=tc, submodules=submodules)
    finally:
        launcher.set_default_mok_overrides({})
    assert isinstance(layer, MoKMoELayer)
    reference = _mok_layer(recipe)
    layer.load_state_dict(reference.state_dict())
    x = make_layer_inputs(S * B, H, seed=1).view(S, B, H)
    probe = make_layer_inputs(S * B, H, seed=2).view(S, B, H)
    got, want = _run(layer, x, probe), _run(reference, x, probe)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_matrix_covers_the_models_and_states_its_sources():
    models = {recipe.model.split(" ")[0] for recipe in RECIPES}
    for name in ("Mixtral-8x7B", "Mixtral-8x22B", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Qwen3-Next-80B-A3B",
                 "Qwen2-57B-A14B", "DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "DeepSeek-V4-Flash", "Kimi-K2",
                 "Moonlight-16B-A3B", "GLM-4.5", "GLM-4.5-Air", "GPT-OSS-20B", "GPT-OSS-120B", "OLMoE-1B-7B",
                 "Nemotron-3-Nano"):  # fmt: skip
        assert name in models, name
    for recipe in RECIPES:
        assert re.search(r"@[0-9a-f]{40}|==\d", recipe.source), recipe.name
        assert set(LAYOUT_FLAGS) <= set(recipe.layout) | {"expert_tensor_parallel_size"}, recipe.name
