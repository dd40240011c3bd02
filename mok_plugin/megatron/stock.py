"""Running Megatron-Core's stock MoE layer on the CPU, where the comparisons and tests need it."""

from __future__ import annotations

import torch.nn.functional as F

__all__ = ["make_stock_router_cpu_safe"]


def make_stock_router_cpu_safe(layer) -> None:
    """Megatron's stock router moves its weight to CUDA in gating(); give it the same GEMM on the CPU."""
    router = layer.router
    router.gating = lambda hidden: F.linear(hidden, router.weight)
