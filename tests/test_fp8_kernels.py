"""The FP8 kernels (kernels/fp8.py, kernels/fp8_mlp.py through fp8/pipeline.py, issue 25) against
MoK's FP8 experts in PyTorch (fp8/reference.py): the same numbers up to the kernels' fp32 sums,
bitwise repeatable, fused families; interpreted on the CPU (fp16 parameters: bf16 tl.dot is wrong
under the interpreter), compiled in bf16 on a GPU."""

import dataclasses
import functools

import pytest
import torch

from mok_plugin.fp8.pipeline import fp8_experts_backward, fp8_experts_forward, fp8_moe_experts
from mok_plugin.fp8.recipe import E4M3, E5M2, BlockwiseFP8Recipe
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.kernels import fp8_hopper
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import EXPERT_FAMILIES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# Against the reference's fp64 sums: interpreted ~1e-5; compiled, the FP8 MMA's own fp32 sums differ
# more and move some bf16 h across a rounding point, and with it an A value across an FP8 one: up to
# 5.3e-3 measured on the H200. An order of magnitude under FP8's own error (5-8 %, test_fp8_reference).
TOLERANCE = 1.5e-2


def _inputs(family, T=40, H=256, I=192, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    fc1 = family.fc1_width(I)
    perms = [torch.randperm(E, generator=g) for _ in range(T)]
    # the first 100 tokens' first choice is expert E-1: one expert with more rows than the others
    ids = torch.stack([torch.cat([p[p == E - 1], p[p != E - 1]]) if t < 100 else p for t, p in enumerate(perms)])[:, :K]
    return {
        "x": torch.randn(T, H, generator=g).to(DEVICE, DTYPE),
        "topk_weights": torch.rand(T, K, generator=g).softmax(-1).to(DEVICE),
        "gate_up_proj": (torch.randn(E, fc1, H, generator=g) / H**0.5).to(DEVICE, DTYPE),
        "down_proj": (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, DTYPE),
        "gate_up_bias": (torch.randn(E, fc1, generator=g) * 0.1).to(DEVICE, DTYPE) if family.fc1_bias else None,
        "down_bias": (torch.randn(E, H, generator=g) * 0.1).to(DEVICE, DTYPE) if family.fc2_bias else None,
        "ids": ids,
        "schedule": build_schedule(ids.to(DEVICE), E),
    }


def _on_cpu(inp):
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
    return {**cpu, "schedule": build_schedule(inp["ids"], inp["gate_up_proj"].shape[0])}


def _run(fn, inp, family, recipe):
    return fn(inp["x"], inp["topk_weights"], inp["gate_up_proj"], inp["down_proj"], inp["schedule"], recipe,
              family=family, gate_up_bias=inp["gate_up_bias"], down_bias=inp["down_bias"])  # fmt: skip


@pytest.mark.parametrize("family", ["swiglu", "gpt_oss", "mlp_gelu_bias", "mlp_squared_relu"])
def test_fp8_forward_kernels_are_the_fp8_reference(family):
    fam = EXPERT_FAMILIES[family]
    recipe = BlockwiseFP8Recipe(E4M3, E4M3)
    inp = _inputs(fam)
    got = _run(fp8_experts_forward, inp, fam, recipe)
    want = _run(moe_experts_fp8_reference, _on_cpu(inp), fam, recipe)["out"]
    err = (got.cpu().double() - want.double()).norm() / want.double().norm()
    assert err < TOLERANCE, f"relative error {err:.2e}"
    assert torch.equal(_run(fp8_experts_forward, inp, fam, recipe), got)  # bitwise repeatable


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.cpu().double() - want.double()).norm() / want.double().norm()).item()


# The backward recomputes A' from the saved h, which the kernels sum in fp32 and the reference in
# fp64: an h within a rounding step of a clamp's edge can land on either side, and that element of dh
# changes by its whole size (a kink, as bench/providers.py says of relu). GPT-OSS's own clamp is 7;
# the families table's 0.25 (there to bind in the forward) puts hundreds of h there at this size, so
# the backward takes GPT-OSS at clamp 4: a few h still clamped (8 of 76,800), almost none at the edge.
BACKWARD_FAMILIES = {**EXPERT_FAMILIES, "gpt_oss_clamp_4": dataclasses.replace(EXPERT_FAMILIES["gpt_oss"], clamp=4.0)}


# 12-16 s each interpreted: three in the fast set, the rest marked slow
@pytest.mark.parametrize(
    "family, hybrid",
    [
        ("swiglu", False),
        ("mlp_squared_relu", True),
        pytest.param("swiglu", True, marks=pytest.mark.slow),
        pytest.param("glu_gelu_tanh", False, marks=pytest.mark.slow),
        pytest.param("glu_gelu_tanh", True, marks=pytest.mark.slow),
        pytest.param("mlp_squared_relu", False, marks=pytest.mark.slow),
        ("gpt_oss_clamp_4", False),  # both biases, the clamp and the offset
        pytest.param("mlp_gelu_bias", True, marks=pytest.mark.slow),
    ],
)
def test_fp8_backward_kernels_are_the_fp8_reference(family, hybrid):
    # dX, the router gradient and both weight gradients (and the biases'); I = 192 (a partial 128-block
    # in each half), one expert with two 128-row blocks (its weight gradients sum two promoted blocks)
    fam = BACKWARD_FAMILIES[family]
    recipe = BlockwiseFP8Recipe(E4M3, E5M2 if hybrid else E4M3)
    inp = _inputs(fam, T=200)
    assert inp["schedule"].tokens_per_expert.max() > 128
    d_out = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, DTYPE)
    saved: dict = {}
    _run(functools.partial(fp8_experts_forward, saved=saved), inp, fam, recipe)
    got = fp8_experts_backward(d_out, saved)
    want = _run(functools.partial(moe_experts_fp8_reference, d_out=d_out.cpu()), _on_cpu(inp), fam, recipe)
    names = ["d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]
    names += ["d_gate_up_bias"] * fam.fc1_bias + ["d_down_bias"] * fam.fc2_bias
    for name in names:
        err = _relative_error(got[name], want[name])
        assert err < TOLERANCE, f"{name}: relative error {err:.2e}"
    assert {name for name, value in got.items() if value is not None} == set(names)
    again = fp8_experts_backward(d_out, saved)
    assert all(torch.equal(again[name], got[name]) for name in names)  # bitwise repeatable


def test_fp8_experts_op_differentiates_through_the_fp8_backward():
    # The autograd entry: torch.autograd.grad gives the FP8 backward's gradients (the reference's,
    # within the kernels' tolerance), for x, the routing weights and both weights.
    fam = EXPERT_FAMILIES["swiglu"]
    recipe = BlockwiseFP8Recipe()
    inp = _inputs(fam)
    leaves = [inp[k].clone().requires_grad_() for k in ("x", "topk_weights", "gate_up_proj", "down_proj")]
    out = fp8_moe_experts(*leaves, inp["schedule"], recipe, fam)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    grads = torch.autograd.grad(out, leaves, d_out)
    cpu = _on_cpu(inp)
    want = moe_experts_fp8_reference(cpu["x"], cpu["topk_weights"], cpu["gate_up_proj"], cpu["down_proj"],
                                     cpu["schedule"], recipe, d_out.cpu(), fam)  # fmt: skip
    assert _relative_error(out, want["out"]) < TOLERANCE
    for name, grad in zip(("d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"), grads, strict=True):
        assert grad.shape == want[name].shape and _relative_error(grad, want[name]) < TOLERANCE, name


def test_fp8_experts_without_a_backward_make_no_transposed_copies():
    # Under no_grad (or frozen inputs) the op runs the forward alone: the same output as with grad,
    # and the kept copies hold the forward's FP8 weights only; a training step after it makes the
    # transposes in its backward and gets the same gradients as a step whose forward made them.
    from mok_plugin.fp8.weight_copies import FP8WeightCopies

    fam = EXPERT_FAMILIES["swiglu"]
    recipe = BlockwiseFP8Recipe()
    inp = _inputs(fam)
    leaves = [inp[k].clone().requires_grad_() for k in ("x", "topk_weights", "gate_up_proj", "down_proj")]
    d_out = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    results = []
    for evaluate_first in (False, True):
        copies = FP8WeightCopies()
        if evaluate_first:
            with torch.no_grad():
                evaluated = fp8_moe_experts(*leaves, inp["schedule"], recipe, fam, weight_copies=copies)
            assert "w13" in copies and "w13 derived" not in copies and "w2 derived" not in copies
        out = fp8_moe_experts(*leaves, inp["schedule"], recipe, fam, weight_copies=copies)
        assert ("w13 derived" in copies) is not evaluate_first  # made with the forward's copies
        results.append((out, *torch.autograd.grad(out, leaves, d_out)))
        assert "w13 derived" in copies and "w2 derived" in copies
    assert not evaluated.requires_grad and torch.equal(evaluated, results[0][0])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    # grad mode on but nothing to differentiate (frozen inputs): the forward alone too
    copies = FP8WeightCopies()
    frozen = fp8_moe_experts(*(t.detach() for t in leaves), inp["schedule"], recipe, fam, weight_copies=copies)
    assert frozen.grad_fn is None and torch.equal(frozen, results[0][0]) and "w13 derived" not in copies


def test_a_backward_uses_the_transposes_its_forward_made(monkeypatch):
    # Two forwards before the first one's backward (pipeline parallelism's 1F1B), the kept copies
    # cleared in between (no micro-batch signal): each backward reads the transposes its own forward
    # wrote, none made again, and its gradients are those of a forward + backward alone
    from mok_plugin.fp8 import pipeline
    from mok_plugin.fp8.weight_copies import FP8WeightCopies

    fam = EXPERT_FAMILIES["swiglu"]
    recipe = BlockwiseFP8Recipe()
    first, second = _inputs(fam, seed=1), _inputs(fam, seed=2)
    d_out = torch.randn(first["x"].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    alone: dict = {}
    _run(functools.partial(fp8_experts_forward, saved=alone), first, fam, recipe)
    want = fp8_experts_backward(d_out, alone)
    copies, saved = FP8WeightCopies(), [{}, {}]
    for inputs, kept in zip((first, second), saved, strict=True):
        copies.clear()
        _run(functools.partial(fp8_experts_forward, saved=kept, weight_copies=copies), inputs, fam, recipe)
    monkeypatch.setattr(pipeline, "transposed_copy", lambda *a: pytest.fail("transposed again"))
    got = fp8_experts_backward(d_out, saved[0])
    assert all(torch.equal(got[name], value) for name, value in want.items() if value is not None)


@pytest.mark.parametrize("family", ["swiglu", "gpt_oss_clamp_4", "mlp_gelu_bias"])
def test_fc2_dgrad_epilogue_passes_give_the_same_bits(monkeypatch, family):
    # UP_WITH_A (dh's up half in A's pass: two passes over the tile, not three) and PERSISTENT (one
    # pass a tile, programs looping over tiles) are choices of speed for the sweep: every output of the
    # backward bit for bit the three-pass kernel's, with a gate (and GPT-OSS's biases, clamp and
    # offset) and without
    from mok_plugin.kernels import fp8_mlp

    fam = BACKWARD_FAMILIES[family]
    recipe = BlockwiseFP8Recipe(E4M3, E5M2)
    inp = _inputs(fam, T=40)
    d_out = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, DTYPE)
    results = []
    for up_with_a, persistent in ((False, False), (True, False), (True, True)):
        tiles = {"num_warps": 16, "num_stages": 1, "UP_WITH_A": up_with_a, "PERSISTENT": persistent}
        monkeypatch.setitem(fp8_mlp.TILES, "down_dgrad_epilogue", tiles)
        saved: dict = {}
        _run(functools.partial(fp8_experts_forward, saved=saved), inp, fam, recipe)
        results.append(fp8_experts_backward(d_out, saved))
    for other in results[1:]:
        for name, value in results[0].items():
            assert (value is None and other[name] is None) or torch.equal(value, other[name]), name


def test_persistent_epilogue_runs_only_where_its_shared_memory_fits(monkeypatch):
    # one program an SM where a program may take the pipelined tile's shared memory (Hopper: 227 KB);
    # on Ada's 99 KB the tile-a-program kernel instead (None), not a launch that fails
    from types import SimpleNamespace

    from mok_plugin.kernels import fp8_mlp

    properties = SimpleNamespace(shared_memory_per_block_optin=99 * 1024, multi_processor_count=132)
    monkeypatch.setattr(fp8_mlp, "interpreter_on", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    assert fp8_mlp._persistent_programs(torch.device("cuda", 0)) is None
    properties.shared_memory_per_block_optin = 227 * 1024
    assert fp8_mlp._persistent_programs(torch.device("cuda", 0)) == 132


@pytest.mark.parametrize("family, fmt", [("swiglu", E4M3), ("gpt_oss_clamp_4", E5M2), ("mlp_gelu_bias", E4M3)])
def test_activation_from_h_is_fc1s_own(monkeypatch, family, fmt):
    # fc1's forward split in two (MOK_HOPPER_FP8_FC1_SPLIT: the GEMM on the Gluon row kernel, then A):
    # A_q and its scales from the h that fc1's fused Triton kernel stored are that kernel's, bit for bit
    # (on Hopper the split itself is the default: the Triton kernels asked for, so that the reference is
    # the fused kernel, not fp8_activation again)
    monkeypatch.setenv(fp8_hopper.ROWS_SETTING, "0")
    from mok_plugin.kernels.fp8 import quantize_fc1, quantize_rows
    from mok_plugin.kernels.fp8_mlp import fp8_activation, fp8_gate_up_fwd

    fam = BACKWARD_FAMILIES[family]
    inp = _inputs(fam, T=60, I=256)
    sched = inp["schedule"]
    x_q, x_s = quantize_rows(inp["x"], E4M3)
    w13_q, w13_s = quantize_fc1(inp["gate_up_proj"], E4M3, fam.gated)
    kwargs = {"activation": fam.activation, "gated": fam.gated, "clamp": fam.clamp, "offset": fam.linear_offset}
    h, a_q, a_s = fp8_gate_up_fwd(x_q, x_s, w13_q, w13_s, sched.row_to_token, sched.tile_to_expert, sched.tile_m, fmt,
                                  out_dtype=DTYPE, gate_up_bias=inp["gate_up_bias"], **kwargs)  # fmt: skip
    again_q, again_s = torch.full_like(a_q, float("nan")), torch.full_like(a_s, float("nan"))
    fp8_activation(h, again_q, again_s, sched.row_to_token, sched.tile_to_expert, sched.tile_m, fmt, **kwargs)
    valid = sched.row_to_token >= 0
    assert torch.equal(again_q[valid].view(torch.uint8), a_q[valid].view(torch.uint8))
    assert torch.equal(again_s[valid], a_s[valid])
