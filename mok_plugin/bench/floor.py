"""The memory floor of a forward + backward: the fewest bytes it must move, and how long they take
at the device-copy rate measured in the same process (issue 24's small-batch target: within 1.2×
of it, the GPU's time replayed from a CUDA graph).

The bytes: every routed-to expert's weights read twice (the forward and the input gradient),
every expert's weight gradients written once (an expert with no rows still gets its zeros), and
x, the output, its gradient and x's gradient once each. At small batches the weight gradients
dominate: qwen3-30b-a3b's dimensions at T = 1 write 1.21 GB of them against 0.15 GB of weights read.
"""

from __future__ import annotations

import statistics

import torch

from mok_plugin.bench.timing import SETTLE_S, time_ms
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.testing import MoEShape

__all__ = ["copy_tbps", "floor_bytes", "routed_experts"]

_COPY_BYTES = 1 << 30  # 1 GiB: large enough that a copy runs at its steady rate


def floor_bytes(shape: MoEShape, used_experts: int, family: MoKExpertFamily = SWIGLU, elem_bytes: int = 2) -> int:
    """The fewest bytes a fwd+bwd moves (module docstring) with `used_experts` experts routed to.

    Raises:
        ValueError: used_experts outside 0..E.
    """
    T, H, I, E, _ = shape.as_tuple()
    if not 0 <= used_experts <= E:
        raise ValueError(f"used_experts={used_experts}: expected 0..{E}")
    fc1 = family.fc1_width(I)
    per_expert = fc1 * H + H * family.intermediate_size(H, I)  # weights, then biases
    per_expert += (fc1 if family.fc1_bias else 0) + (H if family.fc2_bias else 0)
    elements = 2 * used_experts * per_expert + E * per_expert + 4 * T * H
    return elements * elem_bytes


def routed_experts(topk_ids: torch.Tensor) -> int:
    """How many distinct experts the routing sends at least one token to."""
    return int(torch.unique(topk_ids).numel())


def copy_tbps(iters: int = 10, settle_s: float = SETTLE_S) -> float:
    """The current CUDA device's copy rate in TB/s (bytes read plus written, median of `iters`
    device-to-device copies of 1 GiB after `settle_s` of them)."""
    ms = _copy_ms(iters, settle_s)
    torch.cuda.empty_cache()  # the copy's 2 GiB back to the device, not kept for the shapes timed after it
    return 2 * _COPY_BYTES / ms / 1e9


def _copy_ms(iters: int, settle_s: float) -> float:
    src = torch.empty(_COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return statistics.median(time_ms(lambda: dst.copy_(src), iters, settle_s=settle_s))
