"""Megatron's tensorwise and mxfp8 FP8 recipes in MoK (fp8/recipe.py, quantize.py, reference.py): the
quantisers against plain-Python definitions written from Transformer Engine's source (E8M0's edge
cases: amax exactly max_fp8 * 2^k, zero, tiny, huge, inf, NaN); the experts under each recipe within
FP8's margin of the unquantised float64 experts; the operands quantised along the dimensions TE
quantises them; tensorwise's per-expert scales (an expert's numbers do not depend on other experts'
tokens); the layer with each recipe on the reference backend (the oracle bit for bit, within FP8's
margin of the unquantised layer, the same bits twice), and on the triton backend the PyTorch path,
said once when the layer is built."""

import math
import struct
import warnings

import pytest
import torch
from fp8_cases import E, T, fp8_expert_inputs, train_step

from mok_plugin.config import MoKConfig, MoKConfigError
from mok_plugin.experts import SWIGLU, activation
from mok_plugin.fp8.experts import fp8_experts_function, moe_experts_fp8_reference_autograd
from mok_plugin.fp8.quantize import (
    dequantize_1d,
    dequantize_mxfp8,
    dequantize_tensorwise,
    e8m0_exponents,
    e8m0_values,
    quantize_1d,
    quantize_mxfp8,
    quantize_tensorwise,
)
from mok_plugin.fp8.recipe import E4M3, E5M2, BlockwiseFP8Recipe, FP8Format, MXFP8Recipe, TensorwiseFP8Recipe
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.fp8.weight_copies import FP8WeightCopies
from mok_plugin.layer import MoKMoE
from mok_plugin.reference import moe_experts_reference
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import EXPERT_FAMILIES, make_layer_inputs

FORMATS = pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
RECIPES = {
    "tensorwise_hybrid": TensorwiseFP8Recipe(E4M3, E5M2),  # gpt_oss_20b_mb_fp8cs
    "tensorwise_e4m3": TensorwiseFP8Recipe(E4M3, E4M3),
    "mxfp8_e4m3": MXFP8Recipe(E4M3, E4M3),  # the MZ / kimi-k2 mxfp8 recipes
    "mxfp8_hybrid": MXFP8Recipe(E4M3, E5M2),
}
GRADS = ("d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj")


# --- plain-Python definitions, from TE's source (fp8/recipe.py lists the files) ----------------------


def _f32(v: float) -> float:
    """v rounded to the nearest float32 (a product or quotient of two float32 values in double is exact
    or rounded innocuously, so this is the float32 operation's result)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _e8m0_by_hand(amax: float, fmt: FP8Format) -> int:
    """The least power of two >= fp32(amax * fp32(1 / max)), saturated to [2^-127, 2^127], biased by 127."""
    v = _f32(amax * _f32(1.0 / fmt.max))
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    m, ex = math.frexp(v)  # v = m * 2^ex, m in [0.5, 1)
    return min(max((ex - 1 if m == 0.5 else ex) + 127, 0), 254)


def _fp8_by_hand(v: float, fmt: FP8Format) -> float:
    """v saturated to +-max and rounded half-to-even onto the format's grid."""
    v = max(-fmt.max, min(fmt.max, v))
    if v == 0:
        return 0.0
    exponent = max(math.frexp(abs(v))[1] - 1, fmt.min_normal_exponent)
    step = 2.0 ** (exponent - fmt.mantissa_bits)
    return round(v / step) * step  # round() is half-to-even; v / step is exact


def _mx_by_hand(values: list[float], fmt: FP8Format) -> tuple[int, list[float]]:
    e = _e8m0_by_hand(max(abs(v) for v in values), fmt)
    return e, [_fp8_by_hand(v * 2.0 ** (127 - e), fmt) for v in values]


def _tensorwise_by_hand(values: list[float], fmt: FP8Format, power_of_2: bool) -> tuple[float, list[float]]:
    amax = max(abs(v) for v in values)
    if amax == 0:
        scale = 1.0
    else:
        scale = fmt.max / amax  # double, then float32: float32's correctly rounded division
        scale = 3.4028234663852886e38 if scale > 3.4028234663852886e38 else _f32(scale)
    if power_of_2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return _f32(1.0 / scale), [_fp8_by_hand(_f32(v * scale), fmt) for v in values]


# --- quantisers ----------------------------------------------------------------------------------


@FORMATS
def test_e8m0_exponents_are_tes_on_its_edge_cases(fmt):
    tiny = 2.0**-149  # fp32's smallest subnormal
    cases = [
        fmt.max,  # exactly max * 2^0: scale 2^0, nothing wasted (fp32(1/max) * max rounds to 1)
        fmt.max * 2.0**-5,
        fmt.max * 2.0**20,
        _f32(fmt.max * (1 + 2.0**-20)),  # just above: the next power of two
        _f32(fmt.max * (1 - 2.0**-20)),  # just below: the same
        0.0,
        tiny,
        2.0**-126,  # fp32's smallest normal
        fmt.max * 2.0**-127,  # 2^-127 itself, a subnormal product
        fmt.max * 2.0**-126 * 1.5,  # a subnormal product above 2^-127: rounds to 2^-126
        3.0e38,
        float("inf"),
        float("nan"),
        1.0,
        0.3,
    ]
    got = e8m0_exponents(torch.tensor(cases, dtype=torch.float32), fmt).tolist()
    assert got == [_e8m0_by_hand(_f32(a), fmt) for a in cases]
    assert got[:3] == [127, 122, 147]  # hand-checked: amax = max * 2^k gives e = 127 + k
    assert got[3:6] == [128, 127, 0]
    scales = e8m0_values(torch.tensor(got[:-2], dtype=torch.uint8))
    assert scales[:3].tolist() == [1.0, 2.0**-5, 2.0**20] and scales[5].item() == 2.0**-127
    assert torch.isnan(e8m0_values(torch.tensor([255], dtype=torch.uint8))).all()


def _magnitudes(shape, seed) -> torch.Tensor:
    """N(0, 1) values scaled by 2^-30 .. 2^30 per row and column: every block its own exponent."""
    g = torch.Generator().manual_seed(seed)
    rows = 2.0 ** torch.randint(-30, 31, (shape[0], 1), generator=g)
    cols = 2.0 ** torch.randint(-8, 9, (1, shape[1]), generator=g)
    return torch.randn(shape, generator=g) * rows * cols


@FORMATS
@pytest.mark.parametrize("dim", [-1, 0], ids=["rowwise", "columnwise"])
def test_mxfp8_quantiser_is_the_plain_definition(fmt, dim):
    x = _magnitudes((70, 45), seed=1).bfloat16()  # 45, 70: partial last blocks either way
    data, e = quantize_mxfp8(x, fmt, dim=dim)
    assert data.dtype == fmt.dtype and e.dtype == torch.uint8
    assert e.shape == ((70, 2) if dim == -1 else (3, 45))
    lines = x.float() if dim == -1 else x.float().t()
    want_e, want_data = [], []
    for line in lines.tolist():
        blocks = [_mx_by_hand(line[i : i + 32], fmt) for i in range(0, len(line), 32)]
        want_e.append([b[0] for b in blocks])
        want_data.append([v for b in blocks for v in b[1]])
    want_e, want_data = torch.tensor(want_e), torch.tensor(want_data)
    if dim == 0:
        want_e, want_data = want_e.t(), want_data.t()
    assert torch.equal(e.long(), want_e)
    assert torch.equal(data.float(), want_data.float())
    values = dequantize_mxfp8(data, e, dim=dim, dtype=torch.float64)
    block_scale = 2.0 ** (want_e.double() - 127).repeat_interleave(32, dim)[:70, :45]
    assert torch.equal(values, want_data.double() * block_scale)
    # half a step of the grid: relative to the value, or the subnormal step where the block's scale
    # sends it below the format's normals
    half_step = x.double().abs() * 2.0 ** -(fmt.mantissa_bits + 1) + block_scale * fmt.subnormal_step / 2
    assert ((values - x.double()).abs() <= half_step).all()


@FORMATS
def test_mxfp8_blocks_at_tes_edges(fmt):
    # a block whose amax is exactly max * 2^3 keeps its largest value at max (no saturation, no
    # bit wasted); an all-zero block gives zeros (not NaN); a tiny block (fp32 subnormals) is finite
    row = torch.randn(32, generator=torch.Generator().manual_seed(2)).abs() * fmt.max * 8 / 4
    row[7] = fmt.max * 8
    zeros, tiny = torch.zeros(32), torch.full((32,), 2.0**-140)
    data, e = quantize_mxfp8(torch.stack([row, zeros, tiny]).clamp(max=fmt.max * 8), fmt)
    assert e[:, 0].tolist() == [130, 0, 0]
    assert data[0, 7].float() == fmt.max and data[1].float().eq(0).all()
    values = dequantize_mxfp8(data, e)
    assert torch.isfinite(values).all() and values[1].eq(0).all()


@FORMATS
@pytest.mark.parametrize("power_of_2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_tensorwise_quantiser_is_the_plain_definition(fmt, power_of_2):
    for x in (
        _magnitudes((9, 40), seed=3)[0:1].bfloat16(),  # one row's magnitudes
        torch.randn(9, 40, generator=torch.Generator().manual_seed(4)) * 1e-3,
        torch.zeros(3, 5),  # amax 0: scale 1 (TE's amax_epsilon is 0)
        torch.full((2, 2), 2.0**-149),  # tiny amax: the quotient overflows, fp32 max instead
    ):
        data, scale_inv = quantize_tensorwise(x, fmt, power_of_2)
        want_scale_inv, want = _tensorwise_by_hand(x.float().flatten().tolist(), fmt, power_of_2)
        assert scale_inv.item() == want_scale_inv
        assert data.float().flatten().tolist() == want
        values = dequantize_tensorwise(data, scale_inv, torch.float64)
        assert torch.isfinite(values).all()
        assert torch.equal(values, data.double() * want_scale_inv)  # exact in float64


# --- the experts under each recipe ---------------------------------------------------------------


def _fp8(inp, recipe, family=SWIGLU, compute_dtype=torch.float64):
    return moe_experts_fp8_reference(inp["x"], inp["topk_weights"], inp["gate_up_proj"], inp["down_proj"],
                                     inp["schedule"], recipe, inp["d_out"], family, inp["gate_up_bias"],
                                     inp["down_bias"], compute_dtype=compute_dtype)  # fmt: skip


def _fp64_unquantised(inp, family):
    names = ("x", "topk_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
    leaves = {k: inp[k].double().requires_grad_() for k in names if inp[k] is not None}
    weights = (leaves["gate_up_proj"], leaves["down_proj"])
    biases = (leaves.get("gate_up_bias"), leaves.get("down_bias"))
    out = moe_experts_reference(leaves["x"], leaves["topk_weights"], *weights, inp["schedule"], family, *biases)
    out.backward(inp["d_out"].double())
    return {"out": out.detach(), **{f"d_{k}": v.grad for k, v in leaves.items()}}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("family", ["swiglu", "glu_gelu_bias", "mlp_gelu_bias"])
@pytest.mark.parametrize("scaling", ["tensorwise", "mxfp8"])
def test_experts_under_each_recipe_are_within_fp8s_margin(scaling, family):
    fam = EXPERT_FAMILIES[family]
    inp = fp8_expert_inputs(fam)
    want = _fp64_unquantised(inp, fam)
    recipe = TensorwiseFP8Recipe if scaling == "tensorwise" else MXFP8Recipe
    e4m3, hybrid = _fp8(inp, recipe(E4M3, E4M3), fam), _fp8(inp, recipe(E4M3, E5M2), fam)
    errors = {name: _relative_error(e4m3[name], want[name]) for name in ("out", *GRADS)}
    # E4M3 keeps 3 mantissa bits: ~2.5 % RMS per operand, two operands a GEMM, up to two GEMMs deep:
    # 5-8 % measured, as blockwise's. A power-of-two scale changes no rounding (x * 2^k rounds as x
    # does) until values fall below the format's normals, so on these inputs mxfp8's numbers are
    # blockwise's; its 32-value blocks differ where a block holds values some 2^14 apart (E4M3)
    assert all(1e-2 < err < 0.1 for err in errors.values()), errors
    assert torch.equal(hybrid["out"], e4m3["out"])  # the forward is E4M3 under both
    for name in GRADS:  # E5M2 gradients: one mantissa bit fewer
        assert errors[name] < _relative_error(hybrid[name], want[name]) < 0.12, name
    for name in ("d_gate_up_bias", "d_down_bias"):  # from unquantised values
        assert (e4m3[name] is None) == (name not in want)
        if name in want:
            assert _relative_error(e4m3[name], want[name]) < (0.1 if name == "d_gate_up_bias" else 0.01), name
    again = _fp8(inp, recipe(E4M3, E5M2), fam)
    assert all(again[k] is None or torch.equal(again[k], hybrid[k]) for k in hybrid)


def _quantised_forward(inp, quantise_x, quantise_w13, quantise_a, quantise_w2):
    """One expert, K = 1, bias-free SwiGLU: the forward over operands quantised as told (float64)."""
    h = (quantise_x(inp["x"]) @ quantise_w13(inp["gate_up_proj"][0]).t()).to(inp["x"].dtype)
    a = quantise_a(activation(h.double(), SWIGLU))
    return (inp["topk_weights"].double() * (a @ quantise_w2(inp["down_proj"][0]).t())).to(inp["x"].dtype)


def test_mxfp8_quantises_each_operand_along_its_gemms_reduction():
    inp = fp8_expert_inputs(tokens=40, top_k=1, ids=torch.zeros(40, 1, dtype=torch.long))
    got = _fp8(inp, MXFP8Recipe())["out"]

    def along(dim):
        return lambda t: dequantize_mxfp8(*quantize_mxfp8(t, E4M3, dim), dim=dim, dtype=torch.float64)

    assert torch.equal(got, _quantised_forward(inp, along(-1), along(-1), along(-1), along(-1)))
    # the weights' other direction (their dgrad's) gives other numbers: the direction is the recipe's
    assert not torch.equal(got, _quantised_forward(inp, along(-1), along(0), along(-1), along(0)))

    def whole(t):
        return dequantize_tensorwise(*quantize_tensorwise(t, E4M3), torch.float64)

    assert torch.equal(_fp8(inp, TensorwiseFP8Recipe(E4M3, E4M3))["out"], _quantised_forward(inp, *[whole] * 4))


def test_tensorwise_scales_are_per_expert_and_mxfp8_is_batch_invariant():
    ids = torch.arange(T).remainder(E)[:, None]  # K = 1: token t on expert t % E
    inp = fp8_expert_inputs(seed=5, top_k=1, ids=ids)
    louder = {**inp, "x": torch.where(ids != 0, inp["x"] * 64, inp["x"]),
              "d_out": torch.where(ids != 0, inp["d_out"] * 64, inp["d_out"])}  # fmt: skip
    on_0 = ids[:, 0] == 0
    tensorwise = TensorwiseFP8Recipe()
    a, b = _fp8(inp, tensorwise), _fp8(louder, tensorwise)
    # expert 0's tokens and weight gradients: the same bits whatever the other experts' tokens are
    assert torch.equal(a["out"][on_0], b["out"][on_0]) and torch.equal(a["d_x"][on_0], b["d_x"][on_0])
    assert torch.equal(a["d_gate_up_proj"][0], b["d_gate_up_proj"][0])
    assert torch.equal(a["d_down_proj"][0], b["d_down_proj"][0])
    # ...but one louder token of expert 0 rescales all of expert 0's rows (one amax per expert)
    one = {**inp, "x": inp["x"].clone()}
    one["x"][0] *= 64
    c = _fp8(one, tensorwise)
    assert not torch.equal(c["out"][on_0][1:], a["out"][on_0][1:])
    # mxfp8's 32-value blocks belong to one token: the louder token changes its own output only
    mx = MXFP8Recipe()
    assert torch.equal(_fp8(one, mx)["out"][1:], _fp8(inp, mx)["out"][1:])


def test_mxfp8_keeps_what_blockwise_flushes_where_a_block_spans_2_to_the_18():
    # Where a 128-value block holds values 2^18 apart, blockwise's one scale pushes the small ones
    # below E4M3's normals (and to zero), while mxfp8's 32-value blocks each get their own scale: the
    # two recipes then give other numbers, mxfp8 the closer ones (on Gaussian data they agree).
    inp = fp8_expert_inputs(seed=8)
    loud = torch.ones(inp["x"].shape[1])
    loud[:32] = 2.0**18  # the first 32 columns of x (its first 128-block)
    x = (inp["x"].float() * loud).bfloat16()
    small = slice(32, 128)
    blockwise = dequantize_1d(*quantize_1d(x, E4M3), dim=-1)
    mx = dequantize_mxfp8(*quantize_mxfp8(x, E4M3, -1), dim=-1)
    exact = x.float()
    assert _relative_error(mx[:, small], exact[:, small]) < 0.05
    assert _relative_error(blockwise[:, small], exact[:, small]) > 0.5
    # Through the experts, with fc1 blind to the loud columns (their weights zero): the output then
    # rests on the small ones, which only mxfp8 kept.
    w13 = inp["gate_up_proj"].clone()
    w13[..., :32] = 0
    wide = {**inp, "x": x, "gate_up_proj": w13}
    want = _fp64_unquantised(wide, SWIGLU)["out"]
    mx_err = _relative_error(_fp8(wide, MXFP8Recipe(E4M3, E4M3))["out"], want)
    assert mx_err < 0.1 < _relative_error(_fp8(wide, BlockwiseFP8Recipe())["out"], want)


def test_fp32_compute_is_within_rounding_of_the_fp64_oracle():
    # what runs on a GPU: the same quantised operands, fp32 GEMMs
    inp = fp8_expert_inputs(seed=6)
    for recipe in RECIPES.values():
        want, got = _fp8(inp, recipe), _fp8(inp, recipe, compute_dtype=torch.float32)
        for name in ("out", *GRADS):
            assert _relative_error(got[name], want[name]) < 5e-3, (recipe, name)


def test_fp32_compute_keeps_tf32_off_and_restores_the_users_setting(monkeypatch):
    # A user's TF32 (torch.set_float32_matmul_precision("high")) would round the dequantised operands
    # to 10 mantissa bits; the PyTorch path turns it off around its GEMMs, forward and backward.
    import mok_plugin.fp8.experts as fp8_experts

    seen = []

    def spy(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return moe_experts_fp8_reference(*args, **kwargs)

    monkeypatch.setattr(fp8_experts, "moe_experts_fp8_reference", spy)
    inp = fp8_expert_inputs(seed=7)
    weights = {k: inp[k].float().requires_grad_() for k in ("x", "gate_up_proj", "down_proj")}
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        out = moe_experts_fp8_reference_autograd(
            weights["x"], inp["topk_weights"], weights["gate_up_proj"], weights["down_proj"], inp["schedule"],
            TensorwiseFP8Recipe(E4M3), compute_dtype=torch.float32,
        )  # fmt: skip
        out.backward(inp["d_out"].float())
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert seen == ["highest", "highest"]


# --- the layer -----------------------------------------------------------------------------------

CFG = dict(hidden_size=256, ffn_hidden_size=192, num_experts=4, top_k=2)


@pytest.mark.parametrize("fmt, scaling", [("hybrid", "tensorwise"), ("e4m3", "mxfp8")])
def test_layer_with_each_recipe_is_within_fp8s_margin_and_repeats_bitwise(fmt, scaling):
    cfg = MoKConfig(**CFG, num_shared_experts=1, fp8=fmt, fp8_scaling=scaling, backend="reference")
    assert cfg.fp8_recipe.scaling == scaling
    x = make_layer_inputs(40, 256, seed=1)
    layer = MoKMoE(cfg, seed=0)
    got = train_step(layer, x)
    # the routed experts are the oracle's, bit for bit
    routing = layer.route(x)
    d_out = torch.randn(got["out"].shape, generator=torch.Generator().manual_seed(5))
    routed = moe_experts_fp8_reference(x, routing.topk_weights.detach(), layer.experts.gate_up_proj.detach(),
                                       layer.experts.down_proj.detach(), build_schedule(routing.topk_ids, E),
                                       cfg.fp8_recipe, d_out)  # fmt: skip
    assert torch.equal(got["experts.gate_up_proj"], routed["d_gate_up_proj"])
    assert torch.equal(got["experts.down_proj"], routed["d_down_proj"])
    unquantised = train_step(MoKMoE(cfg.replace(fp8=None, fp8_scaling="blockwise"), seed=0), x)
    for name, value in got.items():
        assert 1e-3 < _relative_error(value, unquantised[name]) < 0.15, name
    again = train_step(MoKMoE(cfg, seed=0), x)
    assert all(torch.equal(again[name], value) for name, value in got.items())


@pytest.mark.parametrize("scaling", ["tensorwise", "mxfp8"])
def test_triton_backend_runs_the_pytorch_path_and_says_so_once(scaling):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: Triton's interpreter, tests/conftest.py)
    cfg = MoKConfig(**CFG, fp8="e4m3", fp8_scaling=scaling, backend="triton")
    with pytest.warns(UserWarning, match=f"mok.fp8_scaling='{scaling}' runs MoK's PyTorch FP8 path"):
        layer = MoKMoE(cfg, seed=0, device=device)
    assert layer.backend == "triton" and layer._experts_fn.experts_fn.func is moe_experts_fp8_reference_autograd
    function = fp8_experts_function(cfg.fp8_recipe, "triton", FP8WeightCopies())
    assert function.func is moe_experts_fp8_reference_autograd and function.keywords["compute_dtype"] is None
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")  # Python's own filter: the second layer says nothing
        MoKMoE(cfg, seed=0, device=device)
        MoKMoE(cfg, seed=0, device=device).to(device)
    assert len([w for w in shown if "PyTorch FP8 path" in str(w.message)]) == 1


def test_a_captured_pytorch_fp8_path_is_named(monkeypatch):
    # it loops over the experts on the host: under CUDA-graph capture (pretended here) an error naming it
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the PyTorch-path notice)
        layer = MoKMoE(MoKConfig(**CFG, fp8="e4m3", fp8_scaling="mxfp8", backend="triton"), seed=0, device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capturing this layer.*the mxfp8 FP8 recipe runs MoK's PyTorch FP8 path"):
        layer(make_layer_inputs(6, 256, device=device))


def test_fp8_scaling_takes_the_three_recipes_only():
    with pytest.raises(MoKConfigError, match="mok.fp8_scaling"):
        MoKConfig(**CFG, fp8="e4m3", fp8_scaling="delayed")
    assert MoKConfig(**CFG).fp8_recipe is None


def test_fp8_scaling_without_fp8_is_refused_not_ignored():
    with pytest.raises(MoKConfigError, match=r"mok.fp8_scaling='mxfp8' scales FP8 experts, but mok.fp8 is not set"):
        MoKConfig(**CFG, fp8_scaling="mxfp8")
    assert MoKConfig(**CFG, fp8="hybrid", fp8_scaling="mxfp8").fp8_recipe.scaling == "mxfp8"
