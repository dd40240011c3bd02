"""mok.fp8 in the layer (issue 25): MoKMoE with a blockwise FP8 recipe computes MoK's FP8 experts
(fp8/reference.py) for its routed and shared experts, on the reference backend exactly and on the
triton backend within the kernels' tolerance; the weights' FP8 copies are kept across a step's
micro-batches only when Megatron's is_first_microbatch says so; what FP8 does not cover is refused
when the config is built."""

import pytest
import torch
from fp8_cases import train_step

from mok_plugin.config import MoKConfig, MoKConfigError
from mok_plugin.fp8.recipe import E4M3, E5M2
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.fp8.weight_copies import FP8WeightCopies
from mok_plugin.layer import MoKMoE
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import make_layer_inputs

CFG = dict(hidden_size=256, ffn_hidden_size=192, num_experts=4, top_k=2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton interpreted on the CPU takes fp16 (bf16 tl.dot is wrong there); bf16 compiled on a GPU.
DTYPE = "bfloat16" if DEVICE == "cuda" else "float16"
KERNEL_TOLERANCE = 1.5e-2  # the kernels against the oracle (tests/test_fp8_kernels.py says why)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def test_fp8_layer_is_the_fp8_oracle_on_the_layers_routing():
    # Reference backend: the routed experts and the shared expert (one more expert every token takes
    # at weight 1) are MoK's FP8 experts, bit for bit; and not the unquantised layer.
    cfg = MoKConfig(**CFG, num_shared_experts=1, fp8="hybrid", backend="reference")
    layer = MoKMoE(cfg, seed=0)
    x = make_layer_inputs(40, 256, seed=1)
    got = train_step(layer, x)
    routing = layer.route(x)
    recipe, E = cfg.fp8_recipe, cfg.num_experts
    assert (recipe.forward, recipe.backward) == (E4M3, E5M2)
    d_out = torch.randn(got["out"].shape, generator=torch.Generator().manual_seed(5))
    routed = moe_experts_fp8_reference(x, routing.topk_weights.detach(), layer.experts.gate_up_proj.detach(),
                                       layer.experts.down_proj.detach(), build_schedule(routing.topk_ids, E), recipe,
                                       d_out)  # fmt: skip
    shared_mlp = layer.shared_experts
    every_token = build_schedule(torch.zeros(40, 1, dtype=torch.int64), 1)
    shared = moe_experts_fp8_reference(x, torch.ones(40, 1), shared_mlp.gate_up_proj.detach()[None],
                                       shared_mlp.down_proj.detach()[None], every_token, recipe, d_out)  # fmt: skip
    assert torch.equal(got["out"], routed["out"] + shared["out"])
    assert torch.equal(got["experts.gate_up_proj"], routed["d_gate_up_proj"])
    assert torch.equal(got["experts.down_proj"], routed["d_down_proj"])
    assert torch.equal(got["shared_experts.gate_up_proj"], shared["d_gate_up_proj"][0])
    unquantised = train_step(MoKMoE(cfg.replace(fp8=None), seed=0), x)
    for name, value in got.items():
        assert 1e-3 < _relative_error(value, unquantised[name]) < 0.15, name


@pytest.mark.slow  # ~20 s in Triton's interpreter
def test_fp8_layer_triton_backend_is_the_reference_backend():
    cfg = MoKConfig(**CFG, num_shared_experts=1, fp8="e4m3", params_dtype=DTYPE, backend="triton")
    x = make_layer_inputs(40, 256, dtype=getattr(torch, DTYPE), device=DEVICE, seed=1)
    got = train_step(MoKMoE(cfg, seed=0, device=DEVICE), x)
    want = train_step(MoKMoE(cfg.replace(backend="reference"), seed=0), x.cpu())
    for name, value in got.items():
        assert _relative_error(value, want[name]) < KERNEL_TOLERANCE, name
    again = train_step(MoKMoE(cfg, seed=0, device=DEVICE), x)
    assert all(torch.equal(again[name], value) for name, value in got.items())


def test_weight_copies_are_kept_within_a_step_only_when_megatron_says_so():
    # Megatron's set_is_first_microbatch() sets is_first_microbatch True before a step's first
    # micro-batch; the weights then change only between steps (an optimizer writing .data does not
    # bump the parameter's version, so nothing else could tell).
    cfg = MoKConfig(**CFG, fp8="e4m3", params_dtype=DTYPE, backend="triton")
    layer = MoKMoE(cfg, seed=0, device=DEVICE)
    x = make_layer_inputs(8, 256, dtype=getattr(torch, DTYPE), device=DEVICE, seed=1)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return layer(x)[0]

    def optimizer_step() -> None:
        noise = torch.randn(layer.experts.down_proj.shape, generator=torch.Generator().manual_seed(3))
        layer.experts.down_proj.data.add_(0.1 * noise.to(layer.experts.down_proj))

    assert layer.is_first_microbatch is None  # outside Megatron: every forward quantises
    before = forward()
    optimizer_step()
    after = forward()
    assert not torch.equal(after, before)
    layer.is_first_microbatch = True  # step 1, micro-batch 1
    first = forward()
    assert layer.is_first_microbatch is False and torch.equal(first, after)
    optimizer_step()  # (as if between steps, without set_is_first_microbatch: the old copies stay)
    assert torch.equal(forward(), first)
    layer.is_first_microbatch = True  # step 2
    fresh = forward()
    layer.is_first_microbatch = None
    assert torch.equal(fresh, forward()) and not torch.equal(fresh, first)


def test_copies_derived_in_a_backward_come_from_its_own_forwards_weights():
    copies = FP8WeightCopies()
    made: list[str] = []

    def transpose(values, scales):
        made.append(values)
        return (values + "^T", scales)

    w_step1 = copies.get("w13", lambda: ("W1", "s"))
    assert copies.derived("w13", w_step1, transpose) == ("W1^T", "s")
    assert copies.derived("w13", w_step1, transpose) == ("W1^T", "s") and made == ["W1"]  # kept
    copies.clear()
    w_step2 = copies.get("w13", lambda: ("W2", "s"))
    # a backward of step 1 running now gets step 1's transpose, made for it alone, not kept
    assert copies.derived("w13", w_step1, transpose) == ("W1^T", "s")
    assert copies.derived("w13", w_step2, transpose) == ("W2^T", "s") and made == ["W1", "W1", "W2"]


def test_a_copy_made_with_its_derived_copy_keeps_both():
    # a forward with a backward to follow makes the transposes in the same pass (get_with_derived):
    # the backward's derived() finds them; after clear(), both are made again
    copies = FP8WeightCopies()
    made: list[str] = []

    def both(name):
        made.append(name)
        return (name, "s"), (name + "^T", "s")

    w_step1, t_step1 = copies.get_with_derived("w13", lambda: both("W1"))
    assert (w_step1, t_step1) == (("W1", "s"), ("W1^T", "s"))
    assert copies.get_with_derived("w13", lambda: both("W1")) == (w_step1, t_step1) and made == ["W1"]
    assert copies.derived("w13", w_step1, lambda *_: pytest.fail("made again")) == ("W1^T", "s")
    copies.clear()
    assert copies.get_with_derived("w13", lambda: both("W2")) == (("W2", "s"), ("W2^T", "s")) and made == ["W1", "W2"]
    # kept by a forward without a backward (get): no derived copy to give yet
    copies.clear()
    copies.get("w13", lambda: ("W3", "s"))
    assert copies.get_with_derived("w13", lambda: both("W3")) == (("W3", "s"), None) and made == ["W1", "W2"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"expert_kind": "linear", "ffn_hidden_size": 256}, "a linear expert .* has no fc1"),
        ({"kernel_variant": "megakernel"}, "mok.fp8 runs the multi-kernel path"),
        ({"fp8": "e5m2"}, "mok.fp8"),
    ],
)
def test_what_fp8_does_not_cover_is_refused_by_name(fields, message):
    with pytest.raises(MoKConfigError, match=message):
        MoKConfig(**{**CFG, "fp8": "e4m3", **fields})


def test_fp8_refuses_experts_given_as_modules():
    from mok_plugin.module_experts import MoKModuleExperts

    experts = MoKModuleExperts([torch.nn.Linear(256, 256) for _ in range(4)])
    with pytest.raises(ValueError, match="mok.fp8 quantises MoK's stacked expert weights"):
        MoKMoE(MoKConfig(**CFG, fp8="e4m3"), experts=experts)


@pytest.mark.parametrize(
    "backend",
    ["reference", pytest.param("triton", marks=pytest.mark.slow)],  # triton: ~15 s interpreted
)
def test_deferred_weight_gradients_are_the_same_bits(backend):
    # --delay-wgrad-compute: the experts' weight gradients wait for the queue's run(), then are those
    # of the undelayed backward.
    from mok_plugin.wgrad import DeferredWeightGrads

    cfg = MoKConfig(**CFG, fp8="e4m3", params_dtype=DTYPE, backend=backend)
    device = DEVICE if backend == "triton" else "cpu"
    x = make_layer_inputs(40, 256, dtype=getattr(torch, DTYPE), device=device, seed=1)
    want = train_step(MoKMoE(cfg, seed=0, device=device), x)
    layer = MoKMoE(cfg, seed=0, device=device)
    layer.weight_grads = DeferredWeightGrads()
    got = train_step(layer, x)
    assert got["experts.gate_up_proj"] is None and got["experts.down_proj"] is None and len(layer.weight_grads) == 1
    layer.weight_grads.run()
    for name, param in layer.named_parameters():
        assert torch.equal(param.grad, want[name]), name
