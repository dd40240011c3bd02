"""A/B one change to the layer in one process: MoK's forward + backward as the code is (A) and with
module attributes set or pinned tile configs replaced (B), alternated round by round on the same
inputs so that both see the same clock drift; each kernel's GPU time from profiles in A B B A B A A B
order (the mean of each side's four, each profile settled as the first round is); the SM clock and
power draw while each side ran (`bench/clocks.py`: a side can read slower because it ran at a lower clock);
eager, each side's host time to issue a call with the GPU busy ahead (`timing.host_issue_ms`: where it
nears the call's time, the host bounds the call; v47's kernels' sum fell while its eager call did not,
BENCHMARKS.md); and whether B gives A's bits.

    mok bench ab --shape deepseek-v3 --set mok_plugin.kernels.grouped_mlp.HOPPER_WGRAD_MIN_WIDTH=8192
    mok bench ab --shape 512,2048,768,128,8 --override wgrad_sweep_few_rows=64x128x64w4s2tp
    mok bench ab --shape qwen3-30b-a3b --set mok_plugin.kernels.configs.SPREAD_MIN_BLOCK_N=128 --rounds 5
    mok bench ab --shape 37,2048,768,128,8 --graphs --set ...     # small batches: the GPU's time, no host

A setting takes effect where its attribute is read: set it on the module that reads it, not on one
that imported the name (HOPPER_WGRAD_MIN_WIDTH above is read in grouped_mlp). Side B is MoK's bf16
multi-kernel layer; the FP8 experts have `mok bench fp8`. Values are Python literals. The results
go to host memory for the bitwise check, so a shape that fits the GPU once fits here. One shape a
process, as every timing here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mok_plugin.bench.breakdown import kernel_breakdown, short_kernel_name
from mok_plugin.bench.clocks import ClockLog, clock_log, describe, running, tagged
from mok_plugin.bench.families import EXPERT_FAMILIES, shapes_it_cannot_take
from mok_plugin.bench.layer import time_graph_replay
from mok_plugin.bench.providers import fwd_bwd, make_inputs, provider_mok, result_names
from mok_plugin.bench.report import run_metadata
from mok_plugin.bench.timing import host_issue_ms, time_ms
from mok_plugin.bench.tuning import Setting, changed, parse_overrides, parse_setting, tile_config_label
from mok_plugin.testing import parse_shape

__all__ = ["Setting", "build_parser", "changed", "main", "parse_setting", "run_ab"]

# The first round and every profile settle this long by default, more than the layer benchmark's
# 1 s (timing.SETTLE_S): the profiles follow a pause (the profiler's start), and an H100 took 2-3 s of work
# from idle to come down to the clock it holds at its 700 W cap (1980 -> 1560 -> 1470 -> 1395 MHz,
# one sample a second). Settled 0.5 s and kept as the lower of two, a null A/B (B the same code)
# read B's kernels 7-19 % slower than A's, whose first profile ran nearest the pause (session 51,
# BENCHMARKS.md, "The A/B's clock").
AB_SETTLE_S = 3.0
# Later rounds settle for less: the work ran back to back just before.
LATER_SETTLE_S = 0.3
# The profiles' sides in order: A B B A B A A B (Thue-Morse) cancels a drift that is linear or
# quadratic in time from each side's mean. Each profile's kernel sum and clock are kept, so an order
# effect shows: on an H100 (session 52) the process's first profile ran 50-160 MHz faster than every
# later one in nine A/Bs and read its kernels' sum 2-10 % low in five (the profiler started once
# beforehand did not change that); with A B B A it had read B's kernels 1-4.6 % slower in null A/Bs.
# So one profile runs first, kept apart ("warm-up"), as the side that ran the last round.
PROFILE_ORDER = "ABBABAAB"


def side_of(label: str) -> str:
    """The side ("A" or "B") of a clock label, a round's ("A") or a profile's ("A profile 3"); the
    warm-up profile's ("warm-up") is a group of its own."""
    return label.split()[0]


def run_ab(
    work: Callable[[], list[torch.Tensor]],
    b_side: Callable[[], contextlib.AbstractContextManager],
    rounds: int,
    iters: int,
    settle_s: float,
    profile: bool = True,
    timer: Callable[..., list[float]] = time_ms,
    profiler: Callable[..., tuple[list[dict], dict]] = kernel_breakdown,
    clock: ClockLog | None = None,
    host_timer: Callable[..., list[float]] | None = None,
) -> dict:
    """Time `work` as is (A) and inside `b_side()` (B), rounds of each in A B, B A, A B ... order
    (the median of `iters` calls a round, the first round settled `settle_s` after as long again of
    untimed, unsampled work, so that neither side's clock includes the way down from idle); with
    `profile`, a warm-up profile (kept apart), then profiles in PROFILE_ORDER, each settled
    `settle_s`, each kernel's mean over its side's profiles kept (the order's drift cancels); and B's
    results against A's, bitwise. A running `clock` samples under side "A" or "B" through the
    rounds, under "A profile N" (N counting from 1 in order) through each profile, and under
    "warm-up" through the first. With `host_timer` (eager calls), each side's host time to issue a call
    (`timing.host_issue_ms`), the median of `iters`, after the rounds.

    Returns:
        {"a_ms": [per round], "b_ms": [...], "a_kernels": {kernel: ms}, "b_kernels": {...},
         "profiles": [{"side" ("A", "B" or "warm-up"), "ms" (its kernels' sum), "clock" (its summary
                       entry or None)}, in order],
         "bitwise": [per result tensor: B equal to A], "clocks": {side: summary entry} or {},
         "a_host_ms", "b_host_ms": the host's issue time a call (with host_timer only)}
    """

    @contextlib.contextmanager
    def side(is_b: bool, label: str | None = None, timed: bool = True) -> Iterator[None]:
        with b_side() if is_b else contextlib.nullcontext():
            with tagged(clock if timed else None, label or ("B" if is_b else "A")):
                yield

    first = {}
    for is_b in (False, True):
        with side(is_b, timed=False):  # compiles both sides' kernels before any timing
            first[is_b] = [t.detach().cpu() for t in work()]
    timer(work, 2, settle_s=settle_s)  # down from idle to the loaded clock, sampled under neither side
    times = {False: [], True: []}
    for r in range(rounds):
        for is_b in (False, True) if r % 2 == 0 else (True, False):
            with side(is_b):
                samples = timer(work, iters, settle_s=settle_s if r == 0 else min(settle_s, LATER_SETTLE_S))
            times[is_b].append(statistics.median(samples))
    host = {}
    for is_b in (False, True) if host_timer else ():
        with side(is_b, timed=False):
            host[is_b] = statistics.median(host_timer(work, iters))
    profiled: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    profiles = []
    last_side = "A" if rounds % 2 == 0 else "B"
    order = [("warm-up", last_side)] + [(f"{letter} profile {n}", letter) for n, letter in enumerate(PROFILE_ORDER, 1)]
    order = order if profile else []
    for label, letter in order:
        with side(letter == "B", label):
            rows, _ = profiler(work, iters=3, settle_s=settle_s)
        if label != "warm-up":
            for row in rows:
                profiled[letter == "B"].setdefault(row["kernel"], []).append(row["ms"])
        profiles.append({"side": side_of(label), "ms": sum(row["ms"] for row in rows)})
    summary = clock.summary() if clock else {}
    for (label, _), entry in zip(order, profiles, strict=True):
        entry["clock"] = summary.get(label)
    kernels = {is_b: {name: statistics.fmean(ms) for name, ms in by_name.items()} for is_b, by_name in profiled.items()}
    bitwise = [torch.equal(a, b) for a, b in zip(first[False], first[True], strict=True)]
    hosts = {"a_host_ms": host[False], "b_host_ms": host[True]} if host else {}
    return {"a_ms": times[False], "b_ms": times[True], "a_kernels": kernels[False], "b_kernels": kernels[True],
            "profiles": profiles, "bitwise": bitwise,
            "clocks": clock.summary(group=side_of) if clock else {}, **hosts}  # fmt: skip


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench ab`."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shape", required=True, help="a named shape (qwen3-30b-a3b, deepseek-v3, ...) or T,H,I,E,K")
    parser.add_argument("--expert", choices=list(EXPERT_FAMILIES), default="swiglu", metavar="FAMILY",
                        help="the experts' family (default swiglu)")  # fmt: skip
    parser.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                        help="B sets this module attribute (a Python literal); repeatable")  # fmt: skip
    parser.add_argument("--override", action="append", default=[], metavar="KERNEL=CONFIG",
                        help="B replaces this pinned-table entry (mok bench tune's notation); repeatable")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each side, alternated (default 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls a round (default 10)")
    parser.add_argument(
        "--settle-s", type=float, default=AB_SETTLE_S,
        help=f"seconds of work before the first round and each profile (default {AB_SETTLE_S})",
    )  # fmt: skip
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="time forward + backward replayed from a CUDA graph, captured on each side each round: the GPU's "
        "time without the host's (small batches are host-bound in eager mode)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel profiles")
    parser.add_argument(
        "--no-clock", action="store_true", help="skip sampling the SM clock and power (nvidia-smi every 0.25 s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"))
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the A/B; 0 on success, 2 without a CUDA GPU (the arguments are checked first)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        shape = parse_shape(args.shape)
        settings = [parse_setting(text) for text in args.settings]
        overrides = parse_overrides(args.override)
    except ValueError as error:
        parser.error(str(error))
    if why := shapes_it_cannot_take(args.expert, [(args.shape, shape)]):
        parser.error(why)
    if not settings and not overrides:
        parser.error("nothing to compare: give B at least one --set or --override")
    if args.rounds < 1 or args.iters < 2:
        parser.error("--rounds at least 1 and --iters at least 2")
    if not torch.cuda.is_available():
        print("mok bench ab needs a CUDA GPU", file=sys.stderr)
        return 2
    family = EXPERT_FAMILIES[args.expert]
    b_label = ", ".join([str(s) for s in settings] + [f"{k}={tile_config_label(c)}" for k, c in overrides.items()])
    inputs = make_inputs(shape, args.routing, args.seed, family=family)
    run = provider_mok("multi_kernel")(inputs, shape, family)
    timer, host_timer = time_ms, host_issue_ms
    if args.graphs:  # captured inside each side: which kernels run is decided on the host at capture

        def timer(work, iters, settle_s):
            return time_graph_replay(run, inputs, iters, settle_s)

        host_timer = None  # a replay's host time is the graph launch's

    clock = clock_log(enabled=not args.no_clock)
    with running(clock):
        result = run_ab(lambda: fwd_bwd(run, inputs), lambda: changed(settings, overrides), args.rounds, args.iters,
                        args.settle_s, profile=not args.no_profile, timer=timer, clock=clock,
                        host_timer=host_timer)  # fmt: skip
    timed = "fwd+bwd replayed from a CUDA graph" if args.graphs else "fwd+bwd"
    print(format_report(args.shape, args.routing, b_label, result, result_names(family), timed))
    args.out.mkdir(parents=True, exist_ok=True)
    record = dict(run_metadata(), shape=args.shape, routing=args.routing, expert=args.expert, b=b_label,
                  graphs=args.graphs, **result, results=result_names(family))  # fmt: skip
    (args.out / "bench_ab.json").write_text(json.dumps(record, indent=1))
    return 0


def format_report(
    shape: str, routing: str, b_label: str, result: dict, names: list[str], timed: str = "fwd+bwd"
) -> str:
    """The A/B as the command prints it: both sides' medians and rounds, each kernel's GPU time
    (largest in A first) with the sum, and which results B changes."""
    a, b = statistics.median(result["a_ms"]), statistics.median(result["b_ms"])
    rounds = {side: [round(t, 3) for t in result[f"{side}_ms"]] for side in ("a", "b")}
    lines = [f"{shape} ({routing}), {timed}: A (as is) {a:.3f} ms, B ({b_label}) {b:.3f} ms: B/A {b / a:.3f}",
             f"  rounds A {rounds['a']}  B {rounds['b']}"]  # fmt: skip
    ka, kb = result["a_kernels"], result["b_kernels"]
    if ka or kb:
        lines.append(f"  {'kernel (GPU ms a call, the mean of four profiles)':<56} {'A':>8} {'B':>8} {'B/A':>6}")
        for name in sorted(set(ka) | set(kb), key=lambda n: -ka.get(n, 0.0)):
            x, y = ka.get(name, 0.0), kb.get(name, 0.0)
            lines.append(f"  {short_kernel_name(name):<56} {x:8.3f} {y:8.3f} {y / x if x else float('nan'):6.3f}")
        sa, sb = sum(ka.values()), sum(kb.values())
        lines.append(f"  {'sum':<56} {sa:8.3f} {sb:8.3f} {sb / sa if sa else float('nan'):6.3f}")
    if "a_host_ms" in result:
        lines.append(
            f"  host time to issue a call (GPU kept busy ahead): A {result['a_host_ms']:.3f} ms, "
            f"B {result['b_host_ms']:.3f} ms (a call bounded by the host where this reaches its time)"
        )
    if profiles := result.get("profiles"):
        lines.append("  profiles in order, the kernels' sum (ms) at the mean SM clock: " + ", ".join(
            f"{p['side']} {p['ms']:.3f}" + (f" @ {p['clock']['sm_mhz']:.0f} MHz" if p["clock"] else "")
            for p in profiles))  # fmt: skip
    if clocks := result.get("clocks"):
        sides = ", ".join(f"{label} {describe(entry)}" for label, entry in sorted(clocks.items()))
        lines.append(f"  SM clock and power, the mean while each side ran: {sides}")
    differ = [n for n, same in zip(names, result["bitwise"], strict=True) if not same]
    lines.append(
        f"  bitwise: B differs on {', '.join(differ)}" if differ else "  bitwise: B gives A's bits on every result"
    )
    return "\n".join(lines)
