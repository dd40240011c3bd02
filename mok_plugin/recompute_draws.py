"""The step of a layer's random routing draws under reentrant activation recomputation.

MoK's routing noise (random_stream.py) is keyed by a step that advances with every training call,
so a layer called twice for the same micro-batch draws twice. A reentrant activation checkpoint
(Megatron's --recompute-granularity full, deepspeed.checkpointing.checkpoint, torch's
checkpoint(use_reentrant=True)) does exactly that: its first pass runs the layer under
torch.no_grad(), and the backward runs it again with gradients on to rebuild what it saved. The
frameworks' own noise comes from the torch RNG, which the checkpoint saves and restores around the
recomputation; MoK's counter is not part of that state, so without this the recomputation would
route by new noise and the gradients would belong to another routing than the output.

`RecomputeSteps` pairs the two passes: a training call without gradients queues the step it drew
at; the next training call with gradients takes the oldest queued step instead of a new one (it is
that recomputation: per layer, the backward recomputes the micro-batches in their forward order).
MoK's own non-reentrant recomputation (--recompute-modules moe) runs both passes with gradients and
restores the layer's state itself; it never queues.

A training call without gradients that is never recomputed leaves its step queued, and the next
training call with gradients draws at it: the noise of an earlier call again, each call's forward
and backward still consistent. The queue keeps the latest MAX_QUEUED steps (a pipeline has far fewer
micro-batches of one layer between their forward and backward), so such calls cannot grow it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

__all__ = ["MAX_QUEUED", "RecomputeSteps"]

MAX_QUEUED = 256


class RecomputeSteps[Step]:
    """Which step a training call draws at (module docstring). `take(new_step)`: new_step() returns
    the current step and advances the layer's count."""

    def __init__(self) -> None:
        self._queued: collections.deque = collections.deque(maxlen=MAX_QUEUED)

    def take(self, new_step: Callable[[], Step]) -> Step:
        if not torch.is_grad_enabled():  # a reentrant checkpoint's first pass (or a plain no-grad call)
            step = new_step()
            self._queued.append(step)
            return step
        if self._queued:  # that pass's recomputation
            return self._queued.popleft()
        return new_step()

    def __len__(self) -> int:
        return len(self._queued)
