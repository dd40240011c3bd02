"""The FP8 copies of a layer's expert weights, kept between the forwards of one training step.

Megatron quantises a step's weights once: its schedule calls set_is_first_microbatch() before a
step's first micro-batch, which sets `is_first_microbatch` True on every module that has the
attribute (Transformer Engine's linear layers reuse their FP8 weights until it is set again). MoKMoE
has the attribute and keeps one FP8WeightCopies per weight set; no torch or Triton import here, so
the layer holds them whatever its backend.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FP8WeightCopies"]

Copy = tuple  # (fp8 values, fp32 scales)


class FP8WeightCopies:
    """The FP8 copies of one set of expert weights, kept while the weights stay the same: "w13" and
    "w2" (made by the forward) and copies derived from them, their transposes (made with them by a
    forward that a backward follows, else by the first backward that needs them). `clear()` whenever
    the weights may have changed."""

    def __init__(self) -> None:
        self._copies: dict[str, Copy] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._copies

    def clear(self) -> None:
        self._copies.clear()

    def get(self, name: str, make: Callable[[], Copy]) -> Copy:
        """The copy called `name`, made by make() if not kept yet."""
        if name not in self._copies:
            self._copies[name] = make()
        return self._copies[name]

    def get_with_derived(self, name: str, make: Callable[[], tuple[Copy, Copy]]) -> tuple[Copy, Copy | None]:
        """(the copy called `name`, the copy derived from it or None where it was kept without one):
        when not kept yet, make() gives both (one pass over the weights), and both are kept."""
        if name not in self._copies:
            self._copies[name], self._copies[f"{name} derived"] = make()
        return self._copies[name], self._copies.get(f"{name} derived")

    def derived(self, name: str, source: Copy, make: Callable[..., Copy]) -> Copy:
        """make(*source), for `source` what get(name) (or get_with_derived) gave a forward: kept beside
        it while it is still the kept copy; made for this call alone once it is not (cleared or replaced
        since), so a backward never takes a copy derived from other weights than its forward's."""
        if self._copies.get(name) is not source:
            return make(*source)
        return self.get(f"{name} derived", lambda: make(*source))
