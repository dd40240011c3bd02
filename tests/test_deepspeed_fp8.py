"""DeepSpeed's `"mok": {"fp8": ..., "fp8_scaling": ...}` (issue 25): the ds_config's block selects MoK's
FP8 experts (blockwise, or the tensorwise / mxfp8 recipes) for every MoE layer it builds (DeepSpeed's
MoE has no precision option of its own); against the stock layer in bf16's place, within FP8's
error; experts FP8 does not cover are refused when the layer is built, naming mok.fp8."""

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402
from test_deepspeed import E, H, I, _layers, one_rank_world  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.testing import make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def ds_world():
    yield from one_rank_world()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _outputs(layer, x, probe):
    x = x.clone().requires_grad_()
    out, _, _ = layer(x)
    (out * probe).sum().backward()
    return out.detach(), x.grad


def _assert_within_fp8_of_stock_and_repeatable(stock, mok) -> None:
    """MoK's FP8 layer against the stock bf16 layer: output and dX within FP8's error (and not equal:
    FP8 ran), and the same bits twice."""
    x = make_layer_inputs(40, H, seed=1).view(4, 10, H)
    probe = make_layer_inputs(40, H, seed=2).view(4, 10, H)
    want, got = _outputs(stock, x, probe), _outputs(mok, x, probe)
    for name, value, reference in zip(("output", "d_x"), got, want, strict=True):
        assert 1e-3 < _relative_error(value, reference) < 0.15, name
    assert torch.equal(_outputs(mok, x, probe)[0], got[0])


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_the_mok_block_selects_fp8_experts(ds_world, fmt):
    assert mds.read_mok_settings({"mok": {"enabled": True, "fp8": fmt}}).knobs() == {"fp8": fmt}
    stock, bf16 = _layers(2)
    mok = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=2, drop_tokens=False, use_rts=False,
                  top2_2nd_expert_sampling=False, mok_config={"fp8": fmt})  # fmt: skip
    mok.load_state_dict(bf16.state_dict())
    assert mok.mok.config.fp8 == fmt and bf16.mok.config.fp8 is None
    _assert_within_fp8_of_stock_and_repeatable(stock, mok)


@pytest.mark.parametrize("fmt, scaling", [("hybrid", "tensorwise"), ("e4m3", "mxfp8")])
def test_the_mok_block_selects_the_fp8_recipe(ds_world, fmt, scaling):
    block = {"mok": {"enabled": True, "fp8": fmt, "fp8_scaling": scaling}}
    assert mds.read_mok_settings(block).knobs() == {"fp8": fmt, "fp8_scaling": scaling}
    stock, bf16 = _layers(2)
    mok = mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=2, drop_tokens=False, use_rts=False,
                  top2_2nd_expert_sampling=False, mok_config={"fp8": fmt, "fp8_scaling": scaling})  # fmt: skip
    mok.load_state_dict(bf16.state_dict())
    assert mok.mok.config.fp8_recipe.scaling == scaling
    _assert_within_fp8_of_stock_and_repeatable(stock, mok)
    with pytest.raises(MoKConfigError, match=r"mok\.fp8_scaling"):
        mds.read_mok_settings({"mok": {"enabled": True, "fp8": fmt, "fp8_scaling": "delayed"}})


def test_apply_builds_every_layer_with_fp8(ds_world):
    try:
        mds.apply({"mok": {"enabled": True, "fp8": "hybrid"}})
        layer = StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=2, drop_tokens=False)
        assert isinstance(layer, mds.MoE) and layer.mok.config.fp8 == "hybrid"
    finally:
        mds.revert()


def test_fp8_biased_experts_and_what_fp8_does_not_cover(ds_world):
    # A biased GeLU MLP (Megatron-DeepSpeed's experts) runs FP8 too; experts no MoK family computes
    # run as modules, which FP8 cannot quantise: refused when the layer is built.
    torch.manual_seed(0)
    biased_gelu_mlp = nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H))
    layer = mds.MoE(H, biased_gelu_mlp, num_experts=E, k=1, drop_tokens=False, mok_config={"fp8": "e4m3"})
    out, _, _ = layer(make_layer_inputs(40, H, seed=1).view(4, 10, H).requires_grad_())
    out.sum().backward()
    assert layer.mok.config.fp8 == "e4m3" and layer.mok.experts.gate_up_bias.grad is not None
    residual = nn.Sequential(nn.LayerNorm(H), nn.Linear(H, H))
    with pytest.raises(ValueError, match="mok.fp8 quantises MoK's stacked expert weights"):
        mds.MoE(H, residual, num_experts=E, k=1, drop_tokens=False, mok_config={"fp8": "e4m3"})
    with pytest.raises(MoKConfigError, match=r"mok\.fp8='e5m2'"):
        mds.read_mok_settings({"mok": {"enabled": True, "fp8": "e5m2"}})
