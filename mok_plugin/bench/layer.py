"""Time one MoE layer (forward, backward, forward + backward) on the GPU against its peers.

Providers, all on the same inputs in one process (mok_plugin.bench.providers): mok-mega, mok-multi,
torch (grouped_mm), megatron and liger when installed. `--expert` names the expert families to time
(mok_plugin.bench.families: swiglu, gpt-oss, nemotron, glu-gelu, mlp-relu, ...; default swiglu); a
provider that cannot compute a family is skipped for it with the reason printed (mok-mega, megatron
and liger compute bias-free SwiGLU only). TFLOP/s count the family's GEMMs (bench/flops.py). Liger
autotunes 32 configs for each of its GEMM kernels at every new shape (about 4 minutes per shape on
the H200); LIGER_FUSED_MOE_AUTOTUNE=0 runs its one default config instead.

Every provider is checked against the reference backend and for bitwise repeatability before it
is timed; a wrong provider is reported and not timed. The dense bf16 GEMM ceiling and the
device-copy rate are measured in the same run; a row whose bytes hold it under the dense rate (its
memory floor at the copy rate outlasts its FLOPs: bench/bound.py) prints a line against that bound.
Each timing follows SETTLE_S seconds of the same work, so that all of them run at the clock the
chip holds under sustained load (its power cap). Router logits and the top-k choice are
the same for every provider and are not timed (the megatron peer includes its own router).

    mok bench layer --shapes qwen3-30b-a3b olmoe --routing uniform --out out/
    mok bench layer --shape 4096,2880,1024,32,4 --routing skewed
    mok bench layer --shapes olmoe --providers mok-multi torch --profile   # time per kernel
    mok bench layer --shapes mixtral-8x7b --providers mok-multi torch --memory  # what sets the peak
    mok bench layer --shape 1,2048,768,128,8 --providers mok-multi torch --host-profile  # host, by function
    mok bench layer --shape 16384,2880,2880,128,4 --expert gpt-oss swiglu --providers mok-multi torch
(`python scripts/bench_layer.py ...` is the same command.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mok_plugin.bench.bound import Bound
from mok_plugin.bench.breakdown import host_profile, host_time, kernel_breakdown, print_breakdown, print_host_profile
from mok_plugin.bench.ceiling import dense_gemm_tflops
from mok_plugin.bench.clocks import ClockLog, clock_log, describe, running, summary_of, tagged
from mok_plugin.bench.families import EXPERT_FAMILIES, shapes_it_cannot_take
from mok_plugin.bench.floor import copy_tbps, floor_bytes, routed_experts
from mok_plugin.bench.flops import moe_flops
from mok_plugin.bench.memory import memory_breakdown, print_memory
from mok_plugin.bench.providers import PROVIDERS, check_provider, fwd_bwd, leaves, make_inputs, provider_reference
from mok_plugin.bench.report import run_metadata
from mok_plugin.bench.timing import SETTLE_S, summarize, time_ms
from mok_plugin.bench.tuning import changed, parse_overrides, parse_setting, tile_config_label
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.testing import NAMED_SHAPES, MoEShape, parse_shape

__all__ = ["add_rounds", "bench_provider", "build_parser", "main", "time_passes"]

PASSES = ("forward", "backward", "fwd+bwd")
# --graphs: forward + backward captured once in a CUDA graph and replayed (its FLOPs are fwd+bwd's)
GRAPH_PASS = "fwd+bwd graph"
# The clock log's label for the settled dense GEMM (each provider's is "<shape> <family> <routing> <provider>")
DENSE_LABEL = "dense GEMM"


def bench_provider(name: str, fn: Callable, inputs: dict, shape: MoEShape, expected: list, iters: int,
                   settle_s: float = SETTLE_S, family: MoKExpertFamily = SWIGLU,
                   graphs: bool = False, clock: ClockLog | None = None, clock_label: str = "") -> dict:  # fmt: skip
    """Check one provider, then time it: peak memory of a forward + backward, then forward,
    backward and forward + backward, each `iters` CUDA-event timings after `settle_s` of load;
    with `graphs` also forward + backward replayed from a CUDA graph (GRAPH_PASS; "graph_error" says
    why a provider could not be captured). A running `clock` samples under `clock_label` while it is
    timed (not through the check, whose host copies leave the GPU idle: deepseek-v3's read 1923 MHz
    at 184 W so, against ~1500 MHz under load, session 52).

    Returns:
        {"provider", "error", "bitwise"} and, when error is None, "peak_mib", per pass
        {"ms", "p20", "p80"} and "samples" (per pass, every time in ms). A provider with an error is
        not timed (nothing runs on the GPU clock).
    Raises:
        NotImplementedError: the provider does not compute `family` (yet); the caller skips it.
    """
    row: dict = {"provider": name, **check_provider(fn, inputs, shape, expected, family)}
    torch.cuda.empty_cache()
    if row["error"]:
        return row
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, inputs)
    row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    with tagged(clock, clock_label):
        row["samples"] = time_passes(fn, inputs, iters, settle_s)
        if graphs:
            try:
                row["samples"][GRAPH_PASS] = time_graph_replay(fn, inputs, iters, settle_s)
            except RuntimeError as why:  # a provider that reads the host mid-pass, or syncs
                row["graph_error"] = str(why).splitlines()[0][:200]
    torch.cuda.empty_cache()
    row.update({pass_name: summarize(times) for pass_name, times in row["samples"].items()})
    return row


def time_graph_replay(fn: Callable, inputs: dict, iters: int, settle_s: float = SETTLE_S) -> list[float]:
    """CUDA-event times in ms of a forward + backward captured once in a CUDA graph and replayed:
    the GPU's time without the host's, as a training step captured whole (Megatron's CUDA graphs)
    runs it. Small batches are bound by the host in eager mode; this is their floor on the GPU.

    Raises:
        RuntimeError: the provider cannot be captured (torch's capture error).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture requires
        for _ in range(2):
            fwd_bwd(fn, inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd_bwd(fn, inputs)
    try:
        return time_ms(graph.replay, iters, settle_s=settle_s)
    finally:
        del graph  # its memory pool goes with it


def time_passes(fn: Callable, inputs: dict, iters: int, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """{pass: `iters` CUDA-event times in ms} of forward, backward and forward + backward, each
    after `settle_s` of load."""
    args = leaves(inputs)
    present = [a for a in args if a is not None]

    def forward():
        with torch.no_grad():
            fn(*args)

    out_holder: list = []

    def backward():
        torch.autograd.grad(out_holder[0], present, inputs["d_out"], retain_graph=True)

    samples = {"forward": time_ms(forward, iters, settle_s=settle_s)}
    out_holder.append(fn(*args))
    samples["backward"] = time_ms(backward, iters, settle_s=settle_s)
    out_holder.clear()
    samples["fwd+bwd"] = time_ms(lambda: fwd_bwd(fn, inputs), iters, settle_s=settle_s)
    return samples


def add_rounds(timed: list[tuple[dict, Callable]], inputs: dict, rounds: int, iters: int, settle_s: float,
               clock: ClockLog | None = None) -> None:  # fmt: skip
    """Time every (row, provider) `rounds - 1` more times, the providers in turn (A B A B ...), and
    pool each pass's samples (with a clock log, the SM clock too, under the row's "clock_label").
    Small batches are bound by the host's time to issue work, and the H200 host's speed drifts by
    tens of percent over seconds (the PyTorch path at T = 1 read 2.51 and 1.55 ms in two windows of
    one process), so a comparison timed in one window per provider measures the drift; alternated
    rounds give every provider the same mix of windows."""
    for _ in range(rounds - 1):
        for row, fn in timed:
            with tagged(clock, row.get("clock_label", "")):
                for pass_name, times in time_passes(fn, inputs, iters, settle_s).items():
                    row["samples"][pass_name] += times
    for row, _ in timed:
        row.update({pass_name: summarize(times) for pass_name, times in row["samples"].items()})
        row["rounds"] = rounds
        if clock:
            row["clock"] = summary_of(clock, row.get("clock_label", ""))


DEFAULT_SHAPES = ["qwen3-30b-a3b", "olmoe", "mixtral-8x7b", "deepseek-v3"]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench layer` (and scripts/bench_layer.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=None,
        help=f"named shapes: {', '.join(NAMED_SHAPES)} (default, unless --shape is given: {', '.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument("--shape", action="append", default=[], help="extra shape T,H,I,E,K")
    parser.add_argument("--expert", nargs="+", choices=list(EXPERT_FAMILIES), default=["swiglu"], metavar="FAMILY",
                        help="expert families to time, by name (mok_plugin/bench/families.py): "
                             f"{', '.join(EXPERT_FAMILIES)}; default swiglu")  # fmt: skip
    parser.add_argument("--routing", choices=["uniform", "skewed"], nargs="*", default=["uniform"])
    parser.add_argument("--providers", nargs="*", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the providers this many times in turn (A B A B ...) and pool the samples: for "
                             "small batches, whose time is the host's and drifts between windows")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="seconds of back-to-back calls before each timing, so that every provider and the "
                             "dense GEMM run at the clock the chip holds under load (the tables before 2026-11-30 "
                             "timed the dense GEMM in its first calls after idle)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also list each provider's kernels by GPU time per forward + backward (torch.profiler), and the "
        "host's time to issue them",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="also time forward + backward captured once in a CUDA graph and replayed: the GPU's time without "
        "the host's (small batches are host-bound in eager mode), against the memory floor at the device copy "
        "rate measured in the run (mok_plugin/bench/floor.py)",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="also list where each provider's host time goes, function by function (cProfile over --iters "
        "forward + backward calls; small batches are host-bound)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also list the tensors live at each provider's peak, by the line that allocated them",
    )
    parser.add_argument(
        "--no-clock", action="store_true", help="skip sampling the SM clock and power (nvidia-smi every 0.25 s)"
    )
    parser.add_argument("--override", action="append", default=[], metavar="KERNEL=CONFIG",
                        help="time MoK with this pinned-table entry replaced, e.g. wgrad=128x128x64w8s4g "
                             "(mok bench tune's notation); repeatable")  # fmt: skip
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                        help="time MoK with this module attribute set, as mok bench ab's --set, e.g. "
                             "mok_plugin.kernels.grouped_mlp.SWEEP_KEEPS_ONE_STEP_LEFT=False; repeatable")  # fmt: skip
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the layer benchmark; 0 on success, 2 without a CUDA GPU."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.override)
        settings = [parse_setting(text) for text in args.settings]
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    try:
        named = args.shapes if args.shapes is not None else ([] if args.shape else DEFAULT_SHAPES)
        shapes = [(text, parse_shape(text)) for text in [*named, *args.shape]]
    except ValueError as error:
        parser.error(str(error))
    for name in args.expert:
        if why := shapes_it_cannot_take(name, shapes):
            parser.error(why)
    if not torch.cuda.is_available():
        print("mok bench layer (scripts/bench_layer.py) needs a CUDA GPU", file=sys.stderr)
        return 2
    if overrides:
        print("pinned table overridden: " + ", ".join(f"{k}={tile_config_label(c)}" for k, c in overrides.items()))
    if settings:
        print("set: " + ", ".join(map(str, settings)))
    with changed(settings, overrides):
        return _run(args, overrides, shapes)


def _run(args: argparse.Namespace, overrides: dict, shapes: list[tuple[str, MoEShape]]) -> int:
    clock = clock_log(enabled=not args.no_clock)
    with running(clock):
        return _run_clocked(args, overrides, shapes, clock)


def _run_clocked(args: argparse.Namespace, overrides: dict, shapes: list[tuple[str, MoEShape]],
                 clock: ClockLog | None) -> int:  # fmt: skip
    burst = dense_gemm_tflops(settle_s=0.0)  # first, while the clock is still at its idle-time high
    with tagged(clock, DENSE_LABEL):
        gemm = dense_gemm_tflops(settle_s=args.settle_s)
    dense_clock = summary_of(clock, DENSE_LABEL)
    dense_line = (
        f"dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s after {args.settle_s:g} s of load "
        f"({burst:.0f} in its first calls after idle)" + (f", SM clock {describe(dense_clock)}" if dense_clock else "")
    )
    # the floor's rate: the graph rows are held against it, and every row's bytes bound it (bound.py)
    copy = copy_tbps(settle_s=args.settle_s)
    dense_line += f"; device copy {copy:.2f} TB/s"
    print(dense_line, flush=True)
    rows = []
    for shape_name, shape in shapes:
        for expert in args.expert:
            family = EXPERT_FAMILIES[expert]
            for routing in args.routing:
                rows += _bench_case(args, shape_name, shape, expert, family, routing, clock)

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        **run_metadata(),
        "expert_families": {name: EXPERT_FAMILIES[name].config_fields() for name in args.expert},
        "dense_gemm_tflops": gemm,
        "dense_gemm_tflops_first_calls_after_idle": burst,
        "dense_gemm_clock": dense_clock,
        "device_copy_tbps": copy,
        "settle_s": args.settle_s,
        "config_overrides": {k: tile_config_label(c) for k, c in overrides.items()},
        "settings": args.settings,
    }
    (args.out / "bench_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print()
    print_families(args.expert)
    print_table(rows, gemm)
    print_floors(rows, copy)
    print_bounds(rows, gemm, copy)
    for row in rows:
        if "kernels" in row:
            print_breakdown(row)
        if "host_profile" in row:
            print_host_profile(row)
        if "memory" in row:
            print_memory(row)
    print(f"{dense_line}; details in {args.out / 'bench_layer.json'}")
    return 0


def _bench_case(args: argparse.Namespace, shape_name: str, shape: MoEShape, expert: str, family: MoKExpertFamily,
                routing: str, clock: ClockLog | None = None) -> list[dict]:  # fmt: skip
    """The rows of one shape, expert family and routing: every provider that computes the family."""
    rows = []
    timed: list[tuple[dict, Callable]] = []  # the rows with a timing, and their providers, for --rounds
    case = f"{shape_name} {expert} {routing}"
    inputs = make_inputs(shape, routing, args.seed, family=family)
    # in host memory, as each provider's first pass (check_provider): GPU memory for the providers
    expected = [t.cpu() for t in fwd_bwd(provider_reference(inputs, shape, family), inputs)]
    for provider in args.providers:
        t0 = time.time()
        try:
            fn = PROVIDERS[provider](inputs, shape, family)
        except RuntimeError as why:  # ProviderUnavailable: a peer not installed, or not computing this family
            print(f"  {case} {provider}: skipped ({why})", flush=True)
            continue
        label = f"{case} {provider}"
        try:
            # the SM clock while it is timed (add_rounds tags its later rounds too)
            row = bench_provider(provider, fn, inputs, shape, expected, args.iters, args.settle_s, family,
                                 args.graphs, clock, label)  # fmt: skip
        except NotImplementedError as why:  # a family the provider's op does not compute yet
            print(f"  {case} {provider}: skipped (not implemented: {why})", flush=True)
            torch.cuda.empty_cache()
            continue
        if (args.profile or args.host_profile) and not row["error"]:
            work = lambda fn=fn, inputs=inputs: fwd_bwd(fn, inputs)  # noqa: E731
            if args.profile:
                row["kernels"], row["idle"] = kernel_breakdown(work, settle_s=args.settle_s)
            row["host_ms"] = host_time(work)
            if args.host_profile:
                row["host_profile"] = host_profile(work, args.iters)
        if args.memory and not row["error"]:
            row["memory"] = memory_breakdown(lambda fn=fn, inputs=inputs: fwd_bwd(fn, inputs))
        row.update(shape=shape_name, dims=list(shape.as_tuple()), expert=expert, family=family.describe(),
                   routing=routing)  # fmt: skip
        row["floor_bytes"] = floor_bytes(shape, routed_experts(inputs["topk_ids"]), family)
        row["clock_label"], row["clock"] = label, summary_of(clock, label)
        rows.append(row)
        if not row["error"]:
            timed.append((row, fn))
        print(
            f"  {case} {provider}: done in {time.time() - t0:.1f} s"
            + (f", SM clock {describe(row['clock'])}" if row["clock"] else "")
            + (f" WRONG: {row['error']}" if row["error"] else ""),
            flush=True,
        )
        torch.cuda.empty_cache()
    if args.rounds > 1 and timed:
        add_rounds(timed, inputs, args.rounds, args.iters, args.settle_s, clock)
        print(f"  {case}: {args.rounds} rounds of every provider in turn, samples pooled", flush=True)
    del inputs, expected, timed
    torch.cuda.empty_cache()
    return rows


def print_families(names: list[str]) -> None:
    """One line per expert family of the run: its benchmark name and what it computes."""
    for name in names:
        print(f"experts {name}: {EXPERT_FAMILIES[name].describe()}")


def print_floors(rows: list[dict], copy: float) -> None:
    """Each graph-replayed row against its memory floor (floor.py) at the measured copy rate."""
    for row in rows:
        if "floor_bytes" not in row or GRAPH_PASS not in row:
            continue
        ms, floor_ms = row[GRAPH_PASS]["ms"], row["floor_bytes"] / copy / 1e9
        print(
            f"{row['shape']:<16} {row.get('expert', 'swiglu'):<16} {row['routing']:<8} {row['provider']:<10} "
            f"{GRAPH_PASS} {ms:.3f} ms against the floor {floor_ms:.3f} ms ({row['floor_bytes'] / 1e9:.2f} GB at "
            f"{copy:.2f} TB/s): {ms / floor_ms:.2f}x"
        )


def print_bounds(rows: list[dict], gemm: float, copy: float) -> None:
    """Each fwd+bwd row whose bytes hold it under the dense rate (bound.py: its floor at the copy
    rate outlasts its FLOPs at the dense rate) against that bound: how far a kernel could still go."""
    for row in rows:
        if row["error"] or "fwd+bwd" not in row or "floor_bytes" not in row:
            continue
        shape = MoEShape(*row["dims"])
        flops = moe_flops(shape, "fwd+bwd", EXPERT_FAMILIES[row.get("expert", "swiglu")])
        bound = Bound.of(shape, flops, row["floor_bytes"], gemm, copy)
        if bound.allowed >= 1:
            continue
        share = bound.flop_ms / row["fwd+bwd"]["ms"]
        print(
            f"{row['shape']:<16} {row.get('expert', 'swiglu'):<16} {row['routing']:<8} {row['provider']:<10} "
            f"fwd+bwd {100 * share:.0f} % of dense; its bytes allow {100 * bound.allowed:.0f} % "
            f"({bound.floor_gb:.1f} GB at {copy:.2f} TB/s against {bound.flop_ms:.2f} ms of FLOPs): "
            f"{100 * share / bound.allowed:.0f} % of that bound"
        )


def print_table(rows: list[dict], gemm: float) -> None:
    """The layer table: per row and pass ms (p20-p80), TFLOP/s (of the row's expert family's GEMMs),
    % of dense GEMM, peak MiB, the ratio to the torch provider of the same shape, expert family and
    routing, bitwise yes/no. Rows without "expert" (older JSON) are SwiGLU."""
    print(
        f"{'shape':<16} {'expert':<16} {'routing':<8} {'provider':<10} {'pass':<13} {'ms':>8} {'p20-p80':>15} "
        f"{'TFLOP/s':>8} {'%GEMM':>6} {'peak MiB':>9} {'vs torch':>8} {'bitwise':>7}"
    )
    for row in rows:
        expert = row.get("expert", "swiglu")
        head = f"{row['shape']:<16} {expert:<16} {row['routing']:<8} {row['provider']:<10}"
        if row["error"]:
            print(f"{head} WRONG: {row['error']}")
            continue
        shape = MoEShape(*row["dims"])
        torch_row = next(
            (
                r
                for r in rows
                if r["provider"] == "torch"
                and r["shape"] == row["shape"]
                and r.get("expert", "swiglu") == expert
                and r["routing"] == row["routing"]
                and not r["error"]
            ),
            None,
        )
        if "graph_error" in row:
            print(f"{head} {GRAPH_PASS}: not captured ({row['graph_error']})")
        for pass_name in [p for p in (*PASSES, GRAPH_PASS) if p in row]:
            ms = row[pass_name]["ms"]
            flops = moe_flops(shape, "fwd+bwd" if pass_name == GRAPH_PASS else pass_name, EXPERT_FAMILIES[expert])
            tflops = flops / ms / 1e9
            ratio = f"{torch_row[pass_name]['ms'] / ms:.2f}x" if torch_row and pass_name in torch_row else "-"
            print(
                f"{head} {pass_name:<13} {ms:8.2f} {row[pass_name]['p20']:7.2f}-{row[pass_name]['p80']:<7.2f} "
                f"{tflops:8.0f} {100 * tflops / gemm:5.0f}% {row['peak_mib']:9.1f} {ratio:>8} "
                f"{'yes' if row['bitwise'] else 'NO':>7}"
            )
