"""Running Megatron-Core's stock MoE layer on the CPU, where the comparison harness, the benchmark
peers and the tests need it. Not part of the Megatron adapter: MoK's own layer runs on the CPU as
it is; only the stock layer needs this.
"""

from __future__ import annotations

import torch.nn.functional as F

__all__ = ["make_stock_router_cpu_safe"]


def make_stock_router_cpu_safe(layer) -> None:
    """Let one stock Megatron-Core MoE layer route on the CPU.

    Megatron-Core 0.19's router moves its weight to CUDA in `gating()`; this replaces that method,
    on this layer's router instance only, with the same GEMM on the weight's own device.

    Args:
        layer: a `megatron.core.transformer.moe.moe_layer.MoELayer` (anything with `.router.weight`).
    """
    router = layer.router
    router.gating = lambda hidden: F.linear(hidden, router.weight)
