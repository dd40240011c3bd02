"""`mok bench fp8`'s errors against float64, taken an expert at a time (bench/fp8_errors.py), must be
the errors against the whole float64 reference (`moe_experts_reference` on float64 copies), which no
GPU holds for deepseek-v3; an expert without rows counts too (its exact gradients are zeros)."""

import pytest
import torch

from mok_plugin.bench.fp8_errors import TENSORS, float64_errors, relative_error
from mok_plugin.bench.providers import make_inputs
from mok_plugin.fp8.recipe import BlockwiseFP8Recipe
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.reference import moe_experts_reference
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import MoEShape


def _whole_float64_errors(inputs, schedule, results):
    args = [inputs[k].double().requires_grad_() for k in ("x", "topk_weights", "gate_up_proj", "down_proj")]
    out = moe_experts_reference(*args, schedule)
    exact = dict(zip(TENSORS, [out.detach(), *torch.autograd.grad(out, args, inputs["d_out"].double())], strict=True))
    return {
        name: {label: ((result[name].double() - exact[name]).norm() / exact[name].norm()).item()
               for label, result in results.items()}
        for name in TENSORS
    }  # fmt: skip


def test_errors_an_expert_at_a_time_are_the_whole_reference_errors():
    torch.manual_seed(0)
    shape = MoEShape(96, 256, 128, 5, 2)
    inputs = make_inputs(shape, "uniform", 0, device="cpu")
    first = torch.randint(0, 4, (96,))  # expert 4 gets no rows
    inputs["topk_ids"] = torch.stack([first, (first + torch.randint(1, 4, (96,))) % 4], dim=1)
    schedule = build_schedule(inputs["topk_ids"], shape.E)
    recipe = BlockwiseFP8Recipe.from_megatron("e4m3", "blockwise")
    # a stand-in for MoK's FP8 results (the kernels need a GPU): the FP8 oracle in fp32, its expert 4's
    # gradients made nonzero, which the exact zeros must count against
    got = moe_experts_fp8_reference(inputs["x"], inputs["topk_weights"], inputs["gate_up_proj"], inputs["down_proj"],
                                    schedule, recipe, inputs["d_out"], compute_dtype=torch.float32)  # fmt: skip
    got["d_down_proj"][4] = 1.0
    peer = moe_experts_fp8_reference(inputs["x"], inputs["topk_weights"], inputs["gate_up_proj"], inputs["down_proj"],
                                     schedule, recipe, inputs["d_out"], separate_casts=True)  # fmt: skip
    errors = float64_errors(inputs, schedule, recipe, got)
    want = _whole_float64_errors(inputs, schedule, {"mok fp8": got, "separate-cast peer": peer})
    assert list(errors) == list(TENSORS)
    for name in TENSORS:
        assert errors[name] == pytest.approx(want[name], rel=1e-9), name
        assert 1e-4 < errors[name]["separate-cast peer"] < 0.2, name  # FP8's size of error, not zero
    assert errors["d_down_proj"]["mok fp8"] > 2 * errors["d_down_proj"]["separate-cast peer"]  # expert 4 counted


def test_relative_error_in_blocks_of_rows_is_the_whole_norm():
    torch.manual_seed(0)
    want = torch.randn(4, 700, 9)
    got = want + 0.1 * torch.randn_like(want)
    whole = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert relative_error(got, want, rows=64) == pytest.approx(whole, rel=1e-12)
    assert relative_error(got.bfloat16(), want, rows=5000) == pytest.approx(
        ((got.bfloat16().double() - want.double()).norm() / want.double().norm()).item(), rel=1e-12
    )
