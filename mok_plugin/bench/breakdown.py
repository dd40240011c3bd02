"""torch.profiler readers: GPU time per kernel, and device time per named range.

`kernel_breakdown` says where a layer's time goes, kernel by kernel, and where the GPU sat idle
between them (`idle_gaps`); `host_time` how long the host takes to issue it (where that exceeds the
kernels' sum, the host bounds the layer: small batches), and `host_profile` where that host time
goes, function by function (cProfile). `range_times` reads the
`torch.profiler.record_function` ranges the layer opens around its expert-parallel stages
(`mok_plugin.ep.dispatch`, `.experts`, `.combine`), one value per occurrence, so a benchmark gets
per-stage times without a hook in the layer.
"""

from __future__ import annotations

import cProfile
import pstats
import re
import time
from collections.abc import Callable, Iterable

import torch

from mok_plugin.bench.timing import settle

__all__ = [
    "after_mark",
    "host_profile",
    "host_time",
    "idle_gaps",
    "kernel_breakdown",
    "print_breakdown",
    "print_host_profile",
    "short_kernel_name",
    "range_times",
]


def kernel_breakdown(work: Callable[[], object], iters: int = 3, settle_s: float = 0.0) -> tuple[list[dict], dict]:
    """GPU time per call of `work` of each kernel it launches (torch.profiler over `iters` calls,
    after `settle_s` seconds of the same work), most first: where the time goes, kernels timed
    inside the whole; and where the GPU waited between them (`idle_gaps`).

    Returns:
        ([{"kernel": name, "ms": per call, "launches": per call}] largest ms first, idle_gaps' dict).
    """
    from torch.profiler import ProfilerActivity, profile

    # Settled like the timings: after the pause before profiling the clock is back at its idle high
    # (the dense GEMM: ~780 against ~660 TFLOP/s settled), and the kernels' sum would undercut the
    # timed call by up to a fifth. Settled again inside the profile, whose start is such a pause: FP8
    # mixtral-8x7b's profiled span 22.0 -> 23.7 ms with it on an H100, against 24.3-24.9 timed; the
    # rest of that gap is not explained (BENCHMARKS.md, "FP8 against its own ceiling", session 41).
    global _profiled
    if not _profiled:
        # The process's first profile reads low (its clock runs higher than every later one's, for a
        # reason not found: qwen3-30b-a3b's kernels 7.94 against 8.14 ms in the next, session 53),
        # so it is taken once and dropped, as `mok bench ab` drops its warm-up profile.
        _profiled = True
        kernel_breakdown(work, iters, settle_s)
    settle(work, settle_s)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        settle(work, min(settle_s, RESETTLE_S), max_calls=RESETTLE_CALLS)
        # A first profiled call, left out: on the H200 its GPU sat idle up to 0.38 ms between two
        # kernels that the later calls run back to back (the profiler's start; BENCHMARKS.md,
        # "Where the time goes at 6e7755e").
        work()
        torch.cuda.synchronize()
        torch.cuda._sleep(1)  # the mark: the measured calls' kernels start after it
        for _ in range(iters):
            work()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    measured = after_mark(device_events, name=lambda e: e.name, start=lambda e: e.time_range.start)
    if measured is None:  # no mark seen: every call counts, the first one too
        iters += 1
    else:
        device_events = measured
    totals: dict[str, list[float]] = {}
    for event in device_events:
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time / 1000 / iters
        entry[1] += 1
    rows = [{"kernel": name, "ms": ms, "launches": count // iters} for name, (ms, count) in totals.items()]
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in device_events]
    return sorted(rows, key=lambda r: -r["ms"]), idle_gaps(spans, iters)


_profiled = False  # whether this process took its first profile (kernel_breakdown drops that one)

# The settling inside the profile, before the mark: long enough for the clock to come back down
# after the profiler's start (0.3 s of calls took the H200's dense GEMM from 756 to 642 TFLOP/s,
# timing.SETTLE_S), with a cap on the calls so short work does not fill the profile with events.
RESETTLE_S = 0.3
RESETTLE_CALLS = 200

# The kernel `torch.cuda._sleep` launches: kernel_breakdown's mark between a left-out first call and
# the measured ones.
MARK_KERNEL = "spin_kernel"


def after_mark(events: list, name: Callable[[object], str], start: Callable[[object], float]) -> list | None:
    """The events that start after the first MARK_KERNEL event, or None without one."""
    marks = [start(e) for e in events if MARK_KERNEL in name(e)]
    if not marks:
        return None
    return [e for e in events if start(e) > marks[0] and MARK_KERNEL not in name(e)]


def idle_gaps(spans: list[tuple[float, float, str]], iters: int, top: int = 5) -> dict:
    """Where the device sat idle between its kernels: spans are (start us, end us, name) of every
    device event of `iters` calls issued back to back. A kernel's sum can be well under the timed
    call when the GPU waits in between (a synchronisation, a slow launch, an allocation).

    Returns:
        {"span_ms": first start to last end, per call; "idle_ms": time covered by no event, per
        call; "largest": [{"ms": per call, "after": kernel, "before": kernel}] the `top` gaps by
        the pair of kernels around them, summed over the calls}.
    """
    if not spans:
        return {"span_ms": 0.0, "idle_ms": 0.0, "largest": []}
    ordered = sorted(spans)
    busy_until, previous = ordered[0][1], ordered[0][2]
    by_pair: dict[tuple[str, str], float] = {}
    for start, end, name in ordered[1:]:
        if start > busy_until:
            key = (previous, name)
            by_pair[key] = by_pair.get(key, 0.0) + (start - busy_until) / 1000 / iters
        if end > busy_until:
            busy_until, previous = end, name
    largest = sorted(by_pair.items(), key=lambda item: -item[1])[:top]
    return {
        "span_ms": (busy_until - ordered[0][0]) / 1000 / iters,
        "idle_ms": sum(by_pair.values()),
        "largest": [{"ms": ms, "after": after, "before": before} for (after, before), ms in largest],
    }


def host_time(work: Callable[[], object], iters: int = 20) -> float:
    """Host time per call of `work` in ms: `iters` calls issued back to back from an idle GPU,
    without waiting for it (a few thousand kernels fit the launch queue); without CUDA, plain calls."""
    _synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        work()
    host_ms = (time.perf_counter() - start) / iters * 1e3
    _synchronize()
    return host_ms


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_profile(work: Callable[[], object], iters: int = 100, top: int = 30) -> list[dict]:
    """Where the host's time to issue `work` goes: cProfile over `iters` calls issued back to back
    (as `host_time`), the `top` functions by their own time. cProfile adds a few microseconds to
    every Python call, so the numbers rank the host's work rather than time it; `host_time` times it.

    Returns:
        [{"function": "file:line(name)", "calls": per call of work, "own_us": time in the function
        itself per call of work, "cum_us": with what it calls}] largest own time first.
    """
    _synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        work()
    profiler.disable()
    _synchronize()
    rows = [
        {"function": f"{_short_path(path)}:{line}({name})", "calls": calls / iters, "own_us": own / iters * 1e6,
         "cum_us": cum / iters * 1e6}
        for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(profiler).stats.items()  # type: ignore[attr-defined]
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def short_kernel_name(name: str, width: int = 56) -> str:
    """A kernel's name fit to a table column of `width` characters. PyTorch's elementwise kernels are
    C++ templates of several hundred characters that differ only deep inside: they keep their outer
    name and the functor that tells them apart (`at::native::elementwise_kernel<direct_copy_kernel_cuda>`)."""
    if len(name) <= width:
        return name
    outer = name.removeprefix("void ").split("<", 1)[0]
    functor = re.search(r"\w+(?:Functor|_kernel_cuda)\b", name[len(outer) :])
    label = f"{outer}<{functor.group(0)}>" if functor else outer
    return label if len(label) <= width else label[: width - 1] + "…"


def _short_path(path: str) -> str:
    """A source path from its package down (site-packages/torch/... -> torch/...), for a readable table."""
    for marker in ("site-packages/", "mok_plugin/"):
        if marker in path:
            return ("mok_plugin/" if marker == "mok_plugin/" else "") + path.rsplit(marker, 1)[1]
    return path


def print_host_profile(row: dict) -> None:
    """Print a layer-benchmark row's "host_profile" entry (`host_profile`)."""
    print(f"\n{row['shape']} {row['routing']} {row['provider']}: host time per forward + backward by function "
          f"(cProfile, own time; host {row.get('host_ms', float('nan')):.2f} ms unprofiled)")  # fmt: skip
    for r in row["host_profile"]:
        print(f"  {r['own_us']:7.1f} us own {r['cum_us']:8.1f} us cum x{r['calls']:<5g} {r['function'][:100]}")


def print_breakdown(row: dict) -> None:
    """Print a layer-benchmark row's "kernels" entry (kernels of at least 5 us) and, where measured,
    its "idle" entry (the GPU's idle time between kernels, the largest gaps)."""
    kernels = row["kernels"]
    total = sum(k["ms"] for k in kernels)
    host = f"; host {row['host_ms']:.2f} ms" if "host_ms" in row else ""
    print(f"\n{row['shape']} {row['routing']} {row['provider']}: GPU time per forward + backward, by kernel "
          f"(sum {total:.2f} ms; timed fwd+bwd {row['fwd+bwd']['ms']:.2f} ms{host})")  # fmt: skip
    for k in kernels:
        if k["ms"] >= 0.005:
            name = short_kernel_name(k["kernel"], 90)
            print(f"  {k['ms']:7.3f} ms {100 * k['ms'] / total:5.1f}% x{k['launches']:<3} {name}")
    idle = row.get("idle")
    if idle:
        print(f"  idle between kernels {idle['idle_ms']:.3f} ms of a {idle['span_ms']:.2f} ms span per call; largest:")
        for gap in idle["largest"]:
            after, before = short_kernel_name(gap["after"], 50), short_kernel_name(gap["before"], 50)
            print(f"  {gap['ms']:7.3f} ms  after {after}  before {before}")


def range_times(events: Iterable, names: Iterable[str]) -> dict[str, list[float]]:
    """Milliseconds of each occurrence of each named `record_function` range, in start order.

    On a CUDA run a range's time is its span on the device: the profiler's GPU-side copy of the
    range (a "gpu_user_annotation", from its first kernel's start to its last kernel's end). Where
    the profiler recorded no GPU side (a CPU run, or a range that launched no kernel), it is the
    host range's own elapsed time.

    Args:
        events: `prof.events()` of a finished torch.profiler run.
        names: the range names wanted.
    Returns:
        {name: [ms, ...]}, an empty list for a range that never ran.
    """
    wanted = set(names)
    host: dict[str, list[tuple[float, float]]] = {name: [] for name in wanted}
    device: dict[str, list[tuple[float, float]]] = {name: [] for name in wanted}
    for event in events:
        if event.name not in wanted:
            continue
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        span = (event.time_range.start, (event.time_range.end - event.time_range.start) / 1000)
        (device if on_device else host)[event.name].append(span)
    return {
        name: [ms for _, ms in sorted(device[name] if len(device[name]) == len(host[name]) else host[name])]
        for name in wanted
    }
