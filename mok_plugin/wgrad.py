"""Deferred expert weight gradients (Megatron's --delay-wgrad-compute).

Megatron's EP-overlap schedule runs a layer's expert backward in two calls: the backward node
computes only what flows on (the input and routing-weight gradients, so the dispatch's backward
all-to-all can start), and `backward_dw()` computes the weight gradients afterwards, beside that
communication. MoK splits its expert backward the same way: while a `DeferredWeightGrads` queue is
active (`deferring(queue)`) the experts' autograd nodes record, in their backward, a closure that
computes the weight (and bias) gradients from what the data-gradient pass already made, instead of
computing them; `queue.run()` computes them in the order they were recorded and hands each to its
parameter through autograd (`torch.autograd.backward` on the parameter: AccumulateGrad runs as it
would have in the backward; Megatron's DDP hooks for these parameters are run by the Megatron
layer's backward_dw after it). The kernels and their inputs are the same either way, so the
gradients are the same bits.

Only leaf weights can wait: a weight that reached the experts through other autograd nodes (a
cast, a view) would have had those nodes run, with no gradient, in the backward. The nodes ask
`note_deferral(ctx, *weights)`, which gives no queue then, and they compute the weight gradients at once.

Does not own: which backward computes what (ops.py, reference.py); when `run` is called (the
Megatron layer's `backward_dw`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["DeferredWeightGrads", "deferring", "note_deferral"]

Deliver = Callable[[list[torch.Tensor], list[torch.Tensor]], None]


def _backward_into(targets: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    torch.autograd.backward(targets, grads)


class DeferredWeightGrads:
    """Weight-gradient computations recorded by the backward, run later by `run()`.

    deliver(targets, grads) hands the computed gradients to their parameters; by default through
    autograd from the parameters themselves (the Megatron layer routes its fused-accumulation
    weights through the node that adds into main_grad)."""

    def __init__(self, deliver: Deliver = _backward_into) -> None:
        self._pending: list[tuple[Callable[[], Sequence[torch.Tensor | None]], tuple[torch.Tensor | None, ...]]] = []
        self._deliver = deliver
        self.completed = 0  # computations run so far (what a test or a profile reads)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, compute: Callable[[], Sequence[torch.Tensor | None]], targets: tuple[torch.Tensor | None, ...]):
        """Record compute() -> one gradient (or None) per target, to run in `run()`."""
        self._pending.append((compute, targets))

    def run(self) -> None:
        """Compute every recorded weight gradient, oldest first, and hand each to its parameter."""
        pending, self._pending = self._pending, []
        for compute, targets in pending:
            grads = compute()
            pairs = [(t, g) for t, g in zip(targets, grads, strict=True) if t is not None and g is not None]
            if pairs:
                self._deliver([t for t, _ in pairs], [g for _, g in pairs])
            self.completed += 1


_active: DeferredWeightGrads | None = None


@contextlib.contextmanager
def deferring(queue: DeferredWeightGrads | None) -> Iterator[None]:
    """Autograd nodes made inside record their weight gradients into queue (None: compute them)."""
    global _active
    previous, _active = _active, queue
    try:
        yield
    finally:
        _active = previous


def note_deferral(ctx, *weights: torch.Tensor | None) -> None:
    """Called by an experts node when autograd records it (in its forward): ctx.deferral is the
    active queue if every weight that needs a gradient is a leaf, else None (see the module
    docstring); ctx.weights are the weights its backward's gradients then go to."""
    needing = [w for w in weights if w is not None and w.requires_grad]
    leaves = bool(needing) and all(w.grad_fn is None for w in needing)
    ctx.deferral = _active if leaves else None
    ctx.weights = weights if ctx.deferral is not None else None
