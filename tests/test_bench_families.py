"""The layer benchmark per expert family, without a GPU: the name table (bench/families.py), the
FLOP count per family (hand-worked), the plain-PyTorch provider computing every family against the
reference (and its activations against the float64 definitions, GPT-OSS's clamps included), a
provider that drops a bias failing the check, the MoK provider handing the family and the biases to
the op, the peers that compute bias-free SwiGLU only skipped with their reason, `--expert` on the
command line, and the family in the printed table."""

import math

import pytest
import torch

from mok_plugin.bench import layer, providers
from mok_plugin.bench.families import EXPERT_FAMILIES, expert_family
from mok_plugin.bench.flops import moe_flops
from mok_plugin.experts import ACTIVATIONS, SWIGLU, MoKExpertFamily, activation_fp64
from mok_plugin.reference import moe_experts_reference
from mok_plugin.testing import MoEShape

SHAPE = MoEShape(32, 64, 32, 4, 2)
SQUARE = MoEShape(32, 64, 64, 4, 2)  # a linear expert is H x H
GPT_OSS = MoKExpertFamily("glu", "quick_gelu", clamp=7.0, linear_offset=1.0, fc1_bias=True, fc2_bias=True)


def _shape(family: MoKExpertFamily) -> MoEShape:
    return SQUARE if family.kind == "linear" else SHAPE


def test_family_names():
    assert EXPERT_FAMILIES["swiglu"] == SWIGLU
    assert EXPERT_FAMILIES["gpt-oss"] == GPT_OSS
    assert EXPERT_FAMILIES["nemotron"] == EXPERT_FAMILIES["mlp-squared-relu"] == MoKExpertFamily("mlp", "squared_relu")
    assert EXPERT_FAMILIES["glu-gelu"] == MoKExpertFamily("glu", "gelu")
    for activation in ACTIVATIONS:
        assert EXPERT_FAMILIES[f"mlp-{activation.replace('_', '-')}"] == MoKExpertFamily("mlp", activation)
    assert "glu-silu" not in EXPERT_FAMILIES  # that is swiglu
    with pytest.raises(ValueError, match=r"unknown expert family 'swish'; known: swiglu, swiglu-bias, gpt-oss"):
        expert_family("swish")


def test_flops_per_family_by_hand():
    # T K = 20 rows, H 6, I 5: forward GEMMs are 2 FLOPs x 20 rows x (3HI = 90 | 2HI = 60) multiply-adds.
    shape = MoEShape(10, 6, 5, 3, 2)
    passes = ("forward", "backward", "fwd+bwd")
    assert [moe_flops(shape, p, EXPERT_FAMILIES["swiglu"]) for p in passes] == [3600, 7200, 10800]
    assert [moe_flops(shape, p, EXPERT_FAMILIES["gpt-oss"]) for p in passes] == [3600, 7200, 10800]  # no bias adds
    assert [moe_flops(shape, p, EXPERT_FAMILIES["mlp-gelu"]) for p in passes] == [2400, 4800, 7200]
    # A linear expert (I = H = 6): 2 x 20 x 36.
    assert [moe_flops(MoEShape(10, 6, 6, 3, 2), p, EXPERT_FAMILIES["linear"]) for p in passes] == [1440, 2880, 4320]


@pytest.mark.parametrize("name", list(EXPERT_FAMILIES))
def test_torch_provider_computes_every_family(name):
    family = EXPERT_FAMILIES[name]
    shape = _shape(family)
    inputs = providers.make_inputs(shape, "skewed", 0, device="cpu", family=family)
    assert ("gate_up_bias" in inputs, "down_bias" in inputs) == (family.fc1_bias, family.fc2_bias)
    expected = providers.fwd_bwd(providers.provider_reference(inputs, shape, family), inputs)
    assert len(expected) == len(providers.result_names(family))
    result = providers.check_provider(providers.provider_torch(inputs, shape, family), inputs, shape, expected, family)
    assert result == {"error": None, "bitwise": True}


@pytest.mark.parametrize("name", [n for n in EXPERT_FAMILIES if n != "linear"])
def test_torch_activation_is_the_definition(name):
    # Against experts.activation_fp64 in float64, with values well past GPT-OSS's clamp of 7.
    family = EXPERT_FAMILIES[name]
    h = 6 * torch.randn(200, family.fc1_width(16), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(providers.torch_activation(h, family), activation_fp64(h, family), rtol=1e-12, atol=0)


def test_gpt_oss_activation_by_hand():
    # gate 10 -> 7, up -9 -> -7: 7 sigmoid(1.702 x 7) (-7 + 1); gate -2, up 3: -2 sigmoid(-3.404) (3 + 1).
    h = torch.tensor([[10.0, -9.0], [-2.0, 3.0]], dtype=torch.float64)
    want = torch.tensor([[7 / (1 + math.exp(-11.914)) * -6], [-2 / (1 + math.exp(3.404)) * 4]], dtype=torch.float64)
    torch.testing.assert_close(providers.torch_activation(h, GPT_OSS), want)


@pytest.mark.parametrize("bias", ["gate_up_bias", "down_bias"])
def test_a_provider_that_drops_a_bias_fails_the_check(bias):
    inputs = providers.make_inputs(SHAPE, "uniform", 0, device="cpu", family=GPT_OSS)
    expected = providers.fwd_bwd(providers.provider_reference(inputs, SHAPE, GPT_OSS), inputs)
    run = providers.provider_torch(inputs, SHAPE, GPT_OSS)
    index = providers.LEAVES.index(bias)

    def without_bias(*tensors):
        tensors = list(tensors)
        tensors[index] = tensors[index] * 0
        return run(*tensors)

    assert providers.check_provider(without_bias, inputs, SHAPE, expected, GPT_OSS)["error"].startswith("output:")


def test_mok_provider_hands_the_family_and_biases_to_the_op(monkeypatch):
    # The triton op is replaced by the reference (same signature), recording what reaches it.
    seen = []

    def fake_op(x, w, w13, w2, schedule, variant, family, gate_up_bias, down_bias):
        seen.append((variant, family, gate_up_bias.shape, down_bias.shape))
        return moe_experts_reference(x, w, w13, w2, schedule, family=family, gate_up_bias=gate_up_bias,
                                     down_bias=down_bias)  # fmt: skip

    monkeypatch.setattr(providers.ops, "moe_experts", fake_op)
    inputs = providers.make_inputs(SHAPE, "uniform", 0, device="cpu", family=GPT_OSS)
    expected = providers.fwd_bwd(providers.provider_reference(inputs, SHAPE, GPT_OSS), inputs)
    run = providers.PROVIDERS["mok-multi"](inputs, SHAPE, GPT_OSS)
    assert providers.check_provider(run, inputs, SHAPE, expected, GPT_OSS)["error"] is None
    assert seen[0] == ("multi_kernel", GPT_OSS, (4, 64), (4, 64))  # gate_up_bias [E, 2I], down_bias [E, H]


@pytest.mark.parametrize(
    "provider, reason",
    [
        ("mok-mega", r"the megakernel \(mok-mega\) computes bias-free SwiGLU experts only, not mlp\(squared_relu\)"),
        ("megatron", r"the megatron peer .* computes bias-free SwiGLU experts only"),
        ("liger", r"Liger's fused MoE computes bias-free SwiGLU experts only"),
    ],
)
def test_swiglu_only_peers_are_unavailable_for_other_families(provider, reason):
    family = EXPERT_FAMILIES["nemotron"]
    inputs = providers.make_inputs(SHAPE, "uniform", 0, device="cpu", family=family)
    with pytest.raises(providers.ProviderUnavailable, match=reason):
        providers.PROVIDERS[provider](inputs, SHAPE, family)


def test_layer_case_skips_what_cannot_run_the_family(monkeypatch, capsys):
    # One case of `mok bench layer --expert gpt-oss` on the CPU, timing stubbed: mok-mega and liger
    # cannot compute it (skipped at construction), mok-multi's op raises NotImplementedError
    # (skipped with its message), torch runs and its row names the family.
    cpu_inputs = providers.make_inputs
    monkeypatch.setattr(layer, "make_inputs", lambda *a, **k: cpu_inputs(*a, device="cpu", **k))

    def fake_bench(name, fn, inputs, shape, expected, iters, settle_s, family, *_clock):
        if name == "mok-multi":
            raise NotImplementedError(f"the triton backend does not compute {family.describe()} experts yet")
        return {"provider": name, **providers.check_provider(fn, inputs, shape, expected, family)}

    monkeypatch.setattr(layer, "bench_provider", fake_bench)
    # the command line's defaults (so that a new option needs no edit here), then this case's values
    args = layer.build_parser().parse_args(["--iters", "1", "--settle-s", "0"])
    args.providers = ["mok-mega", "mok-multi", "torch", "liger"]
    rows = layer._bench_case(args, "small", SHAPE, "gpt-oss", GPT_OSS, "uniform")
    out = capsys.readouterr().out
    assert "small gpt-oss uniform mok-mega: skipped (the megakernel (mok-mega) computes bias-free SwiGLU" in out
    assert "small gpt-oss uniform mok-multi: skipped (not implemented: the triton backend does not compute" in out
    assert "small gpt-oss uniform liger: skipped (Liger's fused MoE computes bias-free SwiGLU" in out
    assert [(r["provider"], r["expert"], r["error"]) for r in rows] == [("torch", "gpt-oss", None)]
    assert rows[0]["family"] == "glu(quick_gelu, clamp 7.0, offset 1.0) + fc1 and fc2 bias"


def test_expert_option(capsys):
    parser = layer.build_parser()
    assert parser.parse_args([]).expert == ["swiglu"]
    assert parser.parse_args(["--expert", "gpt-oss", "mlp-relu"]).expert == ["gpt-oss", "mlp-relu"]
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--expert", "swish"])
    assert info.value.code == 2 and "invalid choice: 'swish'" in capsys.readouterr().err
    # A linear expert needs I = H: refused before anything runs (on any machine).
    with pytest.raises(SystemExit) as info:
        layer.main(["--expert", "linear", "--shapes", "olmoe"])
    assert info.value.code == 2 and "--expert linear: one H x H linear per expert needs I = H; not in olmoe" in (
        capsys.readouterr().err
    )


def test_table_prints_the_family_and_counts_its_flops(capsys):
    # A plain MLP at T 16384, H 2048, I 1024, K 8: 4 T K H I = 1.0995e12 FLOPs forward, in 1 ms 1100 TFLOP/s
    # (SwiGLU's count would say 1649).
    timing = {"ms": 1.0, "p20": 0.9, "p80": 1.1}
    row = {"provider": "torch", "error": None, "bitwise": True, "peak_mib": 1.0, "shape": "olmoe",
           "dims": [16384, 2048, 1024, 64, 8], "expert": "nemotron", "routing": "uniform", "forward": timing,
           "backward": timing, "fwd+bwd": timing}  # fmt: skip
    layer.print_families(["nemotron", "gpt-oss"])
    layer.print_table([row], gemm=2000.0)
    out = capsys.readouterr().out
    assert "experts nemotron: mlp(squared_relu)" in out
    assert "experts gpt-oss: glu(quick_gelu, clamp 7.0, offset 1.0) + fc1 and fc2 bias" in out
    assert out.splitlines()[2].split()[:2] == ["shape", "expert"]
    forward = next(line for line in out.splitlines() if " forward " in line).split()
    assert forward[:5] == ["olmoe", "nemotron", "uniform", "torch", "forward"] and forward[7] == "1100"


@pytest.mark.parametrize(
    "outliers, family, passes",
    [
        (1, MoKExpertFamily("mlp", "relu"), True),  # one element across a kink: allowed for relu
        (1, MoKExpertFamily("mlp", "gelu"), False),  # gelu has no kink: nothing is allowed
        (400, MoKExpertFamily("mlp", "relu"), False),  # more than KINK_OUTLIER_FRACTION: a real error
    ],
)
def test_check_allows_a_few_kink_outliers_only_for_kinked_families(outliers, family, passes):
    shape = MoEShape(64, 32, 64, 4, 2)
    g = torch.Generator().manual_seed(0)
    names = providers.result_names(family)
    sizes = {"output": (64, 32), "d_x": (64, 32), "d_topk_weights": (64, 2), "d_gate_up_proj": (4, 64, 32),
             "d_down_proj": (4, 32, 64)}  # fmt: skip
    expected = [torch.randn(sizes[n], generator=g) for n in names]
    got = [t.clone() for t in expected]
    flat = got[names.index("d_gate_up_proj")].view(-1)
    flat[:outliers] += 10.0
    assert (providers.check(got, expected, shape, family) is None) == passes
