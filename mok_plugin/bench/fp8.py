"""Time MoK's blockwise-FP8 experts against its bf16 experts on one GPU (issue 25).

Per shape: forward and forward + backward of the multi-kernel bf16 path (`mok-multi`) and of the FP8
path (`fp8/pipeline.py`, quantisation of x, dO and the weights included), settled, one process; the
FP8 path's kernels by GPU time; each gradient's relative difference from bf16's; whether two FP8
runs are bitwise equal.

    mok bench fp8 --shapes qwen3-30b-a3b deepseek-v3 --recipe e4m3 --out out/
(`python scripts/bench_fp8.py ...` is the same command.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from mok_plugin.bench.breakdown import kernel_breakdown
from mok_plugin.bench.providers import PROVIDERS, fwd_bwd, leaves, make_inputs
from mok_plugin.bench.timing import SETTLE_S, time_ms
from mok_plugin.fp8.pipeline import fp8_experts_backward, fp8_experts_forward
from mok_plugin.fp8.recipe import BlockwiseFP8Recipe
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import NAMED_SHAPES, parse_shape

__all__ = ["build_parser", "main"]

GRADIENTS = ("d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench fp8` (and scripts/bench_fp8.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"],
                        help=f"named ({', '.join(sorted(NAMED_SHAPES))}) or T,H,I,E,K")  # fmt: skip
    parser.add_argument("--recipe", choices=["e4m3", "hybrid"], default="e4m3", help="Megatron's --fp8-format")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S)
    parser.add_argument("--out", type=Path, default=Path("out"))
    return parser


def _bench_shape(name: str, recipe: BlockwiseFP8Recipe, iters: int, settle_s: float) -> dict:
    shape = parse_shape(name)
    inputs = make_inputs(shape, "uniform", 0)
    schedule = build_schedule(inputs["topk_ids"], shape.E)
    bf16 = PROVIDERS["mok-multi"](inputs, shape)
    args = leaves(inputs)
    call = (inputs["x"], inputs["topk_weights"], inputs["gate_up_proj"], inputs["down_proj"], schedule, recipe)

    def bf16_forward():
        with torch.no_grad():
            bf16(*args)

    def fp8_both():
        saved: dict = {}
        out = fp8_experts_forward(*call, saved=saved)
        return {"out": out, **fp8_experts_backward(inputs["d_out"], saved)}

    passes = {
        "bf16 forward": bf16_forward,
        "fp8 forward": lambda: fp8_experts_forward(*call),
        "bf16 fwd+bwd": lambda: fwd_bwd(bf16, inputs),
        "fp8 fwd+bwd": fp8_both,
    }
    row: dict = {"shape": name, "dims": list(shape.as_tuple())}
    for label, work in passes.items():
        row[label] = statistics.median(time_ms(work, iters, settle_s=settle_s))
        print(f"{name} {label:<14} {row[label]:8.3f} ms", flush=True)
    row["fp8 kernels"], _ = kernel_breakdown(fp8_both, iters=2, settle_s=settle_s)
    got, want = fp8_both(), fwd_bwd(bf16, inputs)
    row["relative difference from bf16"] = {
        name: ((got[name].float() - ref.float()).norm() / ref.float().norm()).item()
        for name, ref in zip(("out", *GRADIENTS), want[:5], strict=True)
    }
    again = fp8_both()
    row["bitwise"] = all(torch.equal(again[k], got[k]) for k in got)
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Time the shapes; 0 on success, 2 without a CUDA GPU."""
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        print("mok bench fp8 (scripts/bench_fp8.py) needs a CUDA GPU", file=sys.stderr)
        return 2
    recipe = BlockwiseFP8Recipe.from_megatron(args.recipe, "blockwise")
    rows = []
    for name in args.shapes:
        rows.append(_bench_shape(name, recipe, args.iters, args.settle_s))
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fp8.json").write_text(json.dumps({"recipe": args.recipe, "rows": rows}, indent=2))
    print(f"\n{'shape':<16} {'fwd bf16':>9} {'fwd fp8':>9} {'fwd+bwd bf16':>13} {'fwd+bwd fp8':>12} {'fp8 vs bf16':>11}"
          f"  bitwise  largest difference from bf16")  # fmt: skip
    for row in rows:
        worst = max(row["relative difference from bf16"].items(), key=lambda item: item[1])
        print(f"{row['shape']:<16} {row['bf16 forward']:9.3f} {row['fp8 forward']:9.3f} {row['bf16 fwd+bwd']:13.3f} "
              f"{row['fp8 fwd+bwd']:12.3f} {row['bf16 fwd+bwd'] / row['fp8 fwd+bwd']:10.2f}x  {row['bitwise']!s:<7}  "
              f"{worst[0]} {worst[1]:.4f}")  # fmt: skip
        for kernel in row["fp8 kernels"][:8]:
            print(f"    {kernel['ms']:7.3f} ms x{kernel['launches']:<2} {kernel['kernel'][:70]}")
    print(f"details in {args.out / 'bench_fp8.json'}")
    return 0
