"""Megatron's FP8 flags with MoK (issue 25): --fp8-format e4m3 / hybrid with --fp8-recipe blockwise
select MoK's blockwise FP8 experts, with tensorwise or mxfp8 those recipes (mok.fp8_scaling, MoK's
PyTorch FP8 path); delayed and custom, FP8 parameters and TE's scale options from the environment
are refused naming their flag; --first-last-layers-bf16 keeps those layers unquantised; the schedule's
set_is_first_microbatch() reaches the layer's FP8 weight copies.

Megatron's TransformerConfig asks for Transformer Engine when FP8 meets MoE, and the stock FP8 layer
runs through it: neither is installed here, so the FP8 fields are set after validation (as
test_megatron_verdicts does) and the MoK layer is compared with MoK's FP8 oracle (through the layer:
tests/test_fp8_layer.py) and with the stock layer in bf16's place, within FP8's error."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from test_megatron import H, _config, _fwd_bwd, _stock_and_mok, megatron_world  # noqa: E402, F401

from mok_plugin.compare.stock_cpu import let_stock_fc2_bias_train_at_ep1  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import mok_config_from_megatron  # noqa: E402
from mok_plugin.testing import make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.megatron


def _with_fp8(tc=None, fp8="e4m3", recipe="blockwise", **fields):
    tc = copy.copy(tc or _config())
    for name, value in dict(fp8=fp8, fp8_recipe=recipe, **fields).items():
        object.__setattr__(tc, name, value)
    return tc


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if torch.equal(got, want):  # (an expert no token chose: zeros on both sides)
        return 0.0
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _assert_within_fp8_of_stock_and_repeatable(stock, mok) -> None:
    """MoK's FP8 layer against the stock bf16 layer: output, dX and every gradient within FP8's error
    (and not equal: FP8 ran), and the same bits twice."""
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert 1e-3 < _relative_error(got[0], want[0]) < 0.15 and 1e-3 < _relative_error(got[1], want[1]) < 0.15
    for name, grad in want[2].items():
        assert _relative_error(got[2][name], grad) < 0.15, name
    assert torch.equal(_fwd_bwd(mok, x, probe)[0], got[0])


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.usefixtures("megatron_world")
def test_blockwise_flags_select_moks_fp8_experts(fmt):
    tc = _with_fp8(_config(moe_shared_expert_intermediate_size=24), fmt)
    assert mok_config_from_megatron(tc).fp8 == fmt
    assert mok_config_from_megatron(_config()).fp8 is None
    stock, mok = _stock_and_mok(tc)  # the stock layer runs bf16's math (no Transformer Engine here)
    assert mok.mok.config.fp8 == fmt
    _assert_within_fp8_of_stock_and_repeatable(stock, mok)


@pytest.mark.parametrize("recipe, fmt", [("tensorwise", "hybrid"), ("mxfp8", "e4m3"), ("mxfp8", "hybrid")])
@pytest.mark.usefixtures("megatron_world")
def test_tensorwise_and_mxfp8_flags_select_their_recipe(recipe, fmt):
    # gpt_oss_20b_mb_fp8cs runs hybrid + tensorwise; the MZ and kimi-k2 mxfp8 recipes e4m3 + mxfp8
    tc = _with_fp8(
        _config(moe_shared_expert_intermediate_size=24), fmt, recipe, moe_router_padding_for_quantization=True
    )
    mok_config = mok_config_from_megatron(tc)
    assert (mok_config.fp8, mok_config.fp8_scaling, mok_config.fp8_recipe.scaling) == (fmt, recipe, recipe)
    stock, mok = _stock_and_mok(tc)  # the stock layer runs bf16's math (no Transformer Engine here)
    assert mok.mok.config.fp8_recipe == mok_config.fp8_recipe
    _assert_within_fp8_of_stock_and_repeatable(stock, mok)


def test_a_captured_layer_with_the_pytorch_fp8_path_is_refused():
    # a whole-layer CUDA graph cannot capture the expert loop on the host that tensorwise / mxfp8 run
    for recipe in ("tensorwise", "mxfp8"):
        with pytest.raises(MoKConfigError, match=f"--cuda-graph-impl .*the {recipe} FP8 recipe runs MoK's PyTorch"):
            mok_config_from_megatron(_with_fp8(recipe=recipe, cuda_graph_impl="full_iteration"))
    assert mok_config_from_megatron(_with_fp8(cuda_graph_impl="full_iteration")).fp8_scaling == "blockwise"


REFUSALS = [
    (dict(recipe="delayed"), "--fp8-recipe"),
    (dict(recipe="custom"), "--fp8-recipe"),
    (dict(fp8_param=True), "--fp8-param-gather"),
]


@pytest.mark.parametrize("fields, flag", REFUSALS, ids=[flag.split()[0] for _, flag in REFUSALS])
def test_what_fp8_does_not_cover_is_refused_by_flag(fields, flag):
    with pytest.raises(MoKConfigError, match=flag):
        mok_config_from_megatron(_with_fp8(**fields))


def test_moks_own_fp8_refusals_name_megatrons_flag():
    with pytest.raises(MoKConfigError, match=r"mok.fp8 \(--fp8-format\) runs the multi"):
        mok_config_from_megatron(_with_fp8(), {"kernel_variant": "megakernel"})
    with pytest.raises(MoKConfigError, match=r"mok.fp8_scaling='mxfp8' conflicts with Megatron's setting 'blockwise'"):
        mok_config_from_megatron(_with_fp8(), {"fp8_scaling": "mxfp8"})


@pytest.mark.usefixtures("megatron_world")
def test_biased_experts_run_fp8_too():
    tc = _with_fp8(_config(add_bias_linear=True))
    assert mok_config_from_megatron(tc).fp8 == "e4m3"
    stock, mok = _stock_and_mok(tc)
    let_stock_fc2_bias_train_at_ep1(stock)  # (SequentialMLP's fc2 bias at EP 1 on the CPU)
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    probe = make_layer_inputs(24, H, seed=2).view(12, 2, H)
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert 1e-3 < _relative_error(got[0], want[0]) < 0.15
    assert any("bias" in name for name in want[2])
    for name, grad in want[2].items():  # the experts' biases among them
        assert _relative_error(got[2][name], grad) < 0.15, name


@pytest.mark.parametrize(
    "variable, recipe",
    [("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "blockwise"), ("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "tensorwise")],
)
def test_te_scale_options_from_the_environment_are_refused(monkeypatch, variable, recipe):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(MoKConfigError, match=f"{variable}=1"):
        mok_config_from_megatron(_with_fp8(recipe=recipe))
    mok_config_from_megatron(_with_fp8(recipe="mxfp8"))  # read by its own recipe only


@pytest.mark.usefixtures("megatron_world")
def test_first_and_last_layers_stay_in_bf16():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from mok_plugin.megatron import use_mok

    tc = _with_fp8(_config(num_layers=4), first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                   num_layers_at_end_in_bf16=1)  # fmt: skip
    spec = use_mok(get_moe_module_spec(use_te=False, num_experts=tc.num_moe_experts, moe_grouped_gemm=False))
    formats = [spec(config=tc, layer_number=n).mok.config.fp8 for n in (1, 2, 3, 4)]
    assert formats == [None, "e4m3", "e4m3", None]
    layer = spec(config=tc, layer_number=1)
    layer.set_layer_number(2)  # (Megatron renumbers a layer after building it, e.g. for MTP)
    assert layer.mok.config.fp8 == "e4m3" and layer.mok_config.fp8 == "e4m3"
    # MTP layers: their block asks get_fp8_context without a layer number, so they stay in FP8
    assert spec(config=tc, layer_number=1, is_mtp_layer=True).mok.config.fp8 == "e4m3"


@pytest.mark.usefixtures("megatron_world")
def test_the_schedules_first_microbatch_flag_reaches_the_fp8_weight_copies():
    _, mok = _stock_and_mok(_with_fp8())
    assert mok.mok.is_first_microbatch is None
    mok.set_is_first_microbatch()  # what Megatron's forward_step does before a step's first micro-batch
    assert mok.mok.is_first_microbatch is True
    x = make_layer_inputs(24, H, seed=1).view(12, 2, H)
    mok(x)
    assert mok.mok.is_first_microbatch is False  # the step's later micro-batches reuse the copies
