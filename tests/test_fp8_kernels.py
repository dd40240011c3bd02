"""The FP8 forward kernels (kernels/fp8_mlp.py through fp8/forward.py, issue 25) against MoK's FP8
experts in PyTorch (fp8/reference.py): the same numbers up to the kernels' fp32 sums, bitwise
repeatable, every fused family; interpreted on the CPU (fp16 parameters: bf16 tl.dot is wrong under
the interpreter), compiled in bf16 on a GPU."""

import pytest
import torch

from mok_plugin.fp8.forward import fp8_experts_forward
from mok_plugin.fp8.recipe import E4M3, BlockwiseFP8Recipe
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import EXPERT_FAMILIES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def _inputs(family, T=40, H=256, I=192, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    fc1 = family.fc1_width(I)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:5, 0] = E - 1  # one expert with more rows than the others
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
    assert err < 5e-3, f"relative error {err:.2e}"
    assert torch.equal(_run(fp8_experts_forward, inp, fam, recipe), got)  # bitwise repeatable
