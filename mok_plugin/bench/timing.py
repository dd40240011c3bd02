"""GPU timing: CUDA events around each call, after a settle period; medians with p20-p80.

What it does not own: what is timed (providers), FLOP counts (flops), reports (layer, ep).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["SETTLE_S", "host_issue_ms", "settle", "slowest_rank_median", "summarize", "time_ms"]

# The H200 holds its 700 W cap by lowering the SM clock under sustained load (1980 MHz after an
# idle spell, mostly 1440-1650 MHz once loaded), so work timed in its first calls after idle runs fast:
# a dense GEMM read 756 TFLOP/s in 20 calls after 1 s idle and 642 after 0.3 s of them, and
# mixtral-8x7b's MoK fwd+bwd 27.4 ms in 3 calls after idle against 30.6 under load (one process,
# 2026-11-30, BENCHMARKS.md). Every timing here therefore first runs its work back to back for
# `settle_s`, so the dense ceiling and each provider are measured at the clock the chip holds while
# training, the same for all of them.
SETTLE_S = 1.0


def settle(fn: Callable[[], object], seconds: float, max_calls: int | None = None) -> None:
    """Call `fn` back to back (each call synchronized) for at least `seconds` (or `max_calls` calls,
    whichever comes first), so what follows runs at the clock the chip holds under load (see
    SETTLE_S); returns at once for 0."""
    torch.cuda.synchronize()
    deadline = time.perf_counter() + seconds
    calls = 0
    while time.perf_counter() < deadline and (max_calls is None or calls < max_calls):
        fn()
        torch.cuda.synchronize()
        calls += 1


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3, settle_s: float = 0.0) -> list[float]:
    """CUDA-event times of `iters` calls, each synchronized, after `warmup` calls and then at
    least `settle_s` seconds of calls back to back.

    Args:
        fn: the work, called with no arguments.
        iters: timed calls.
        warmup: untimed calls first (compilation, allocator growth).
        settle_s: then at least this many seconds of untimed calls (see SETTLE_S).
    Returns:
        Milliseconds of each timed call, in call order.
    """
    for _ in range(warmup):
        fn()
    settle(fn, settle_s)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def host_issue_ms(fn: Callable[[], object], iters: int, cover_s: float = 0.5) -> list[float]:
    """The host's milliseconds to issue each of `iters` calls of `fn`, the GPU kept busy ahead of them
    (a sleep kernel of about `cover_s` queued first) so that no call waits for it: the host's own time
    a call, which bounds an eager call where it reaches the GPU's (and takes in the sleep, where a
    call synchronises). All `iters` calls' launches wait in CUDA's queue behind the sleep: keep iters
    times a call's launches under its ~1,000 pending launches (ten of the layer's ~13-launch calls).
    """
    torch.cuda.synchronize()
    torch.cuda._sleep(int(cover_s * 2e9))  # cycles: cover_s or more at up to 2 GHz
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return times


def summarize(times: list[float]) -> dict[str, float]:
    """{"ms": median, "p20": 20th percentile, "p80": 80th percentile} (Liger's quantiles).

    Raises:
        statistics.StatisticsError: fewer than two times.
    """
    q = statistics.quantiles(times, n=10)
    return {"ms": statistics.median(times), "p20": q[1], "p80": q[7]}


def slowest_rank_median(per_rank: list[list[dict[str, float]]], stages: tuple[str, ...]) -> dict[str, float]:
    """Per stage: the slowest rank of each iteration, then the median over iterations (MoK's
    median_rank_max_latency). A stage a rank did not run counts as 0 (with one rank there is no
    dispatch or combine).

    Args:
        per_rank: for each rank, for each iteration, {stage: ms}; every rank ran the same iterations.
        stages: the stages to report.
    Returns:
        {stage: ms}.
    """
    iters = len(per_rank[0])
    return {s: statistics.median(max(rank[i].get(s, 0.0) for rank in per_rank) for i in range(iters)) for s in stages}
