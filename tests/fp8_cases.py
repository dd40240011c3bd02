"""Shared inputs of the FP8 tests: a small experts problem (I = 192: one and a half 128-blocks, six
MX blocks; 96 tokens, so an expert's rows end inside a block) and one training step of a layer."""

from __future__ import annotations

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.layer import MoKMoE
from mok_plugin.schedule import build_schedule

T, H, I, E, K = 96, 256, 192, 4, 2


def fp8_expert_inputs(
    family: MoKExpertFamily = SWIGLU,
    seed: int = 0,
    tokens: int = T,
    top_k: int = K,
    experts: int = E,
    ids: torch.Tensor | None = None,
) -> dict:
    """Fresh random bf16 experts' operands and a schedule: each token picks top_k distinct experts of
    the first `experts` (or the given ids) of E."""
    g = torch.Generator().manual_seed(seed)
    fc1 = family.fc1_width(I)
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return {
        "ids": ids,
        "x": torch.randn(tokens, H, generator=g).bfloat16(),
        "topk_weights": torch.rand(tokens, top_k, generator=g).softmax(-1),
        "gate_up_proj": (torch.randn(E, fc1, H, generator=g) / H**0.5).bfloat16(),
        "down_proj": (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16(),
        "gate_up_bias": (torch.randn(E, fc1, generator=g) * 0.1).bfloat16() if family.fc1_bias else None,
        "down_bias": (torch.randn(E, H, generator=g) * 0.1).bfloat16() if family.fc2_bias else None,
        "d_out": torch.randn(tokens, H, generator=g).bfloat16(),
        "schedule": build_schedule(ids, E),
    }


def train_step(layer: MoKMoE, x: torch.Tensor, seed: int = 5) -> dict[str, torch.Tensor]:
    """The output, dX and every parameter's gradient of one forward and backward (a random probe)."""
    x = x.clone().requires_grad_()
    out, aux = layer(x)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    (out * d_out).sum().add(aux).backward()
    grads = {"out": out.detach(), "d_x": x.grad}
    grads.update({name: p.grad for name, p in layer.named_parameters()})
    return grads
