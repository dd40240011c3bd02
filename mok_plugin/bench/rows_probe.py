"""Time fc2's forward and fc1's dgrad alone on one shape: the pinned Triton kernels against the Gluon
row kernel (kernels/rows_hopper.py) under several schedules and tile orders, alternated round by
round in one process, each result compared bitwise with Triton's on the routed rows.

Why: in its first tile order (column blocks fastest) the Gluon kernel took 10-12 % less than Triton's on
qwen3-30b-a3b's two GEMMs but 5-26 % more on the shapes with wider outputs (BENCHMARKS.md, "v47 timed at
the layer"); this probe separated the suspects, the tile order (rows_hopper.GROUP_M) and the ring's depth
(BENCHMARKS.md, "v48"), and times any schedule or order against the Triton kernels.

    mok bench rows --shape deepseek-v3
    mok bench rows --shape 4096,2048,768,128,8 --variant cooperative:1 --variant cooperative:8

A variant is SCHEDULE:GROUP_M with SCHEDULE one of wgrad_hopper.SCHEDULES or coop128sN (a cooperative
128-wide tile with N stages, defined here). One shape a process, as every timing here.
Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from mok_plugin.bench.providers import make_inputs
from mok_plugin.bench.timing import SETTLE_S, time_ms
from mok_plugin.kernels import grouped_mlp as gm
from mok_plugin.kernels import rows_hopper, wgrad_hopper
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule
from mok_plugin.testing import parse_shape

__all__ = ["build_parser", "main"]

# The group size of the tile order around its default 8 (session 58 timed 1, v47's order, and 8 only: qwen3's
# fc1 dgrad was faster at 1, mixtral's fc2 forward slower at 8 than Triton), and a 6-stage 128-wide ring
DEFAULT_VARIANTS = ["cooperative:8", "cooperative:4", "cooperative:16", "coop128s6:8"]


def _register(schedule: str) -> None:
    """Define coop128sN (a 128-wide cooperative tile, N stages) in wgrad_hopper.SCHEDULES for this process."""
    if schedule not in wgrad_hopper.SCHEDULES:
        if not schedule.startswith("coop128s"):
            raise SystemExit(f"unknown schedule {schedule!r}: one of {list(wgrad_hopper.SCHEDULES)} or coop128sN")
        stages = int(schedule.removeprefix("coop128s"))
        wgrad_hopper.SCHEDULES[schedule] = wgrad_hopper.Schedule(block_n=128, stages=stages, pingpong=False)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench rows`."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shape", required=True, help="a named shape or T,H,I,E,K")
    parser.add_argument("--variant", action="append", default=None, metavar="SCHEDULE:GROUP_M",
                        help=f"a Gluon variant (repeatable; default: {' '.join(DEFAULT_VARIANTS)})")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every side, alternated (default 3)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls a side a round (default 20)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("mok bench rows needs a Hopper (sm_90) GPU: the Gluon row kernel runs there only", file=sys.stderr)
        return 2
    variants = args.variant or DEFAULT_VARIANTS
    for v in variants:
        _register(v.split(":")[0])

    shape = parse_shape(args.shape)
    T, H, I, E, K = shape.as_tuple()
    inp = make_inputs(shape, "uniform", 0)
    s = build_schedule(inp["topk_ids"], E, tile_m=DEFAULT_TILE_M)
    rt = (s.row_to_token, s.tile_to_expert, s.tile_m)
    weights = (inp["topk_weights"], s.row_to_tk)
    saved = gm.HOPPER_ROW_GEMMS, gm.HOPPER_ROW_MIN_WAVES, rows_hopper.SCHEDULE, rows_hopper.GROUP_M
    try:
        _as_variant("triton")
        h, a = gm.gate_up_fwd(inp["x"], inp["gate_up_proj"], *rt)
        d_h, _, _ = gm.down_dgrad(inp["d_out"], inp["down_proj"], h, *weights, *rt)
        del h
        gemms = {
            "down_fwd": (2 * T * K * H * I, lambda: gm.down_fwd(a, inp["down_proj"], *weights, *rt)),
            "gate_up_dgrad": (4 * T * K * H * I, lambda: gm.gate_up_dgrad(d_h, inp["gate_up_proj"], *rt)),
        }
        rows = [
            {"shape": args.shape, "kernel": name, **row}
            for name, (flops, fn) in gemms.items()
            for row in _time_gemm(fn, flops, variants, s.row_to_tk >= 0, args.rounds, args.iters)
        ]
    finally:
        gm.HOPPER_ROW_GEMMS, gm.HOPPER_ROW_MIN_WAVES, rows_hopper.SCHEDULE, rows_hopper.GROUP_M = saved
    print(f"{'shape':<24} {'kernel':<14} {'variant':<16} {'ms':>8} {'TFLOP/s':>8} {'/ triton':>8} bitwise")
    for row in rows:
        print(f"{row['shape']:<24} {row['kernel']:<14} {row['variant']:<16} {row['ms']:8.3f} {row['tflops']:8.1f} "
              f"{row['vs_triton']:8.3f} {row['bitwise']}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(row["bitwise"] for row in rows) else 1


def _as_variant(variant: str) -> None:
    """Route both GEMMs to the Triton kernels ("triton") or to the Gluon kernel under SCHEDULE:GROUP_M
    (at any batch: the layer's rule by waves set aside)."""
    if variant == "triton":
        gm.HOPPER_ROW_GEMMS = ()
        return
    schedule, group_m = variant.split(":")
    gm.HOPPER_ROW_GEMMS, gm.HOPPER_ROW_MIN_WAVES = ("down_fwd", "gate_up_dgrad"), 0
    rows_hopper.SCHEDULE, rows_hopper.GROUP_M = schedule, int(group_m)


def _time_gemm(fn, flops: int, variants: list[str], routed: torch.Tensor, rounds: int, iters: int) -> list[dict]:
    """fn's result under every variant compared with Triton's on the routed rows, then the sides timed in
    turn for `rounds` rounds (the first settled): one row per side, the median ms of its calls."""

    def call(variant: str):
        _as_variant(variant)
        return fn()

    expected = call("triton")[routed]
    bitwise = {v: torch.equal(call(v)[routed], expected) for v in variants}
    del expected
    sides = ["triton", *variants]
    samples: dict[str, list[float]] = {v: [] for v in sides}
    for r in range(rounds):
        for v in sides:
            samples[v] += time_ms(lambda v=v: call(v), iters, settle_s=SETTLE_S if r == 0 else 0.3)
    base = statistics.median(samples["triton"])
    rows = []
    for v in sides:
        ms = statistics.median(samples[v])
        rows.append({"variant": v, "ms": ms, "tflops": flops / ms / 1e9, "vs_triton": ms / base,
                     "bitwise": bitwise.get(v, True)})  # fmt: skip
    return rows
