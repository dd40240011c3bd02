"""Running Megatron-Core's stock MoE layer where the comparison harness, the benchmark peers and
the tests need it: on the CPU (its router's gating), and with biases at EP = 1. Not part of the
Megatron adapter: MoK's own layer needs none of this; only the stock layer does.
"""

from __future__ import annotations

import torch.nn.functional as F

__all__ = ["make_stock_router_cpu_safe", "let_stock_fc2_bias_train_at_ep1"]


def make_stock_router_cpu_safe(layer) -> None:
    """Let one stock Megatron-Core MoE layer route on the CPU.

    Megatron-Core 0.19's router moves its weight to CUDA in `gating()`; this replaces that method,
    on this layer's router instance only, with the same GEMM (its bias included, with
    --add-bias-linear) on the weight's own device.

    Args:
        layer: a `megatron.core.transformer.moe.moe_layer.MoELayer` (anything with `.router.weight`).
    """
    router = layer.router
    router.gating = lambda hidden: F.linear(hidden, router.weight, router.bias)


def let_stock_fc2_bias_train_at_ep1(layer) -> None:
    """Let a stock layer with --add-bias-linear train at EP = TP = 1 (on any device).

    There each SequentialMLP expert's fc2 "all-reduces" by returning its input, and MLP then adds
    the scaled bias into that output in place, which autograd forbids (Megatron-Core 0.19 fails at
    EP = 1). Skipping the one-rank reduce, as fc2 does under EP > 1, changes no value.

    Args:
        layer: a stock MoELayer whose experts are SequentialMLP.
    """
    for expert in layer.experts.local_experts:
        expert.linear_fc2.explicit_expert_comm = True
