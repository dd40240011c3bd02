"""The weight-gradient kernels alone at few rows an expert: the same FLOPs spread over more or fewer
experts, against the time to write dW alone.

At deepseek-v3's 256 rows an expert the weight gradients sit well above both their stores and their
MMAs, FP8's as bf16's (BENCHMARKS.md, "f10-f12 on an H100"): this separates the two. Each row keeps
`--rows` rows in all (so the same FLOPs, 2 * M * N * rows) and splits them evenly over E experts, so
dW's bytes (E * M * N) grow as the rows an expert shrink; "fill" is `dW.fill_` of the same tensor, the
rate at which the GPU writes it with nothing else to do.

    mok bench wgrad-rows                                   # deepseek-v3's dW13: M 7168, N 4096, 32768 rows
    mok bench wgrad-rows --mn 2048,7168 --rows-per-expert 256   # its dW2
    mok bench wgrad-rows --kernels fp8 --out-dtypes bfloat16 float32
    mok bench wgrad-rows --profile --rows-per-expert 256 1024   # kilocycles per tile in each part (Proton)
    mok bench wgrad-rows --ablate promote scales stores         # the time without each part (wrong results)
    mok bench wgrad-rows --ablate scales scale_copies          # ... without the scales' reads, their copies, both
    mok bench wgrad-rows --kernels fp8 --fp8-loops flat tile_by_tile   # the FP8 kernel's two loops, same bits checked
    # kernels: fp8 (fp8_mlp.fp8_wgrad: the Gluon kernel on Hopper), bf16 (wgrad_hopper's Gluon kernel,
    # both schedules)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from mok_plugin.bench import kernel_probes
from mok_plugin.bench.timing import SETTLE_S, time_ms

__all__ = ["build_parser", "even_segments", "fp8_wgrad_call", "main"]

KERNELS = ("fp8", "bf16")
FP8_LOOPS = ("flat", "tile_by_tile")  # fp8_hopper.FLAT_WGRAD forced on and off
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--mn", type=_pair, default=(7168, 4096),
                        help="dW's M,N (default 7168,4096: deepseek-v3's dW13, H by 2I)")  # fmt: skip
    parser.add_argument("--rows", type=int, default=32768, help="rows in all, split over the experts (a multiple of "
                        "every --rows-per-expert)")  # fmt: skip
    parser.add_argument("--rows-per-expert", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="multiples of 128")  # fmt: skip
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--out-dtypes", nargs="+", choices=list(OUT_DTYPES), default=["bfloat16"],
                        help="dW's dtype (the FP8 kernel's; the bf16 kernel writes bf16)")  # fmt: skip
    parser.add_argument("--fp8-loops", nargs="+", choices=FP8_LOOPS, help="the FP8 Gluon kernel's loop(s) to "
                        "time, each a case (default: the kernel's own choice by rows an expert, fp8_hopper.flat_loop); "
                        "with both, their dW is checked bitwise equal")  # fmt: skip
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S)
    parser.add_argument("--out", type=Path, default=Path("out"))
    probes = parser.add_mutually_exclusive_group()
    probes.add_argument("--profile", action="store_true", help="instead: where the FP8 kernel's cycles go, per "
                        "tile, from one launch under Proton's instrumentation (Hopper; kernel_probes.py)")  # fmt: skip
    probes.add_argument("--ablate", nargs="+", choices=list(kernel_probes.ABLATIONS), help="instead: the FP8 "
                        "kernel's time without each part (wrong results, times only; Hopper)")  # fmt: skip
    return parser


def _pair(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected M,N (two integers)") from None
    return m, n


def check_rows(total: int, per_expert: list[int]) -> None:
    """A ValueError naming the value unless every rows-per-expert is a positive multiple of 128 (the
    kernels' K block) dividing `total`."""
    for rows in per_expert:
        if rows <= 0 or rows % 128 or total % rows:
            raise ValueError(f"--rows-per-expert {rows}: needs a positive multiple of 128 dividing --rows {total}")


def even_segments(total: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert offsets [E + 1], rows an expert [E]) of `total` rows split evenly, `rows` an expert."""
    from mok_plugin.schedule import segment_offsets

    counts = torch.full((total // rows,), rows, device="cuda", dtype=torch.int64)
    return segment_offsets(counts, 128), counts


def fp8_wgrad_call(m: int, n: int, total: int, rows: int, out_dtype: torch.dtype = torch.bfloat16):
    """A call of the FP8 weight gradients (`fp8_mlp.fp8_wgrad`, the Gluon kernel on Hopper) on random
    operands in the layer's layout: quantised 128 x 1 along the rows, stored transposed."""
    from mok_plugin.kernels import fp8_mlp

    offsets, counts = even_segments(total, rows)
    g = torch.Generator(device="cuda").manual_seed(0)
    left = (torch.randn(m, total, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    right = (torch.randn(n, total, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    left_s = torch.rand(total // 128, m, device="cuda", generator=g) + 0.5
    right_s = torch.rand(total // 128, n, device="cuda", generator=g) + 0.5
    return lambda: fp8_mlp.fp8_wgrad(left, left_s, right, right_s, offsets, counts, out_dtype=out_dtype)


def with_fp8_loop(call, loop: str):
    """`call` with the FP8 Gluon kernel's loop set to `loop` (one of FP8_LOOPS) for its duration."""
    from mok_plugin.kernels import fp8_hopper

    def looped() -> torch.Tensor:
        kept = fp8_hopper.FLAT_WGRAD
        fp8_hopper.FLAT_WGRAD = loop == "flat"
        try:
            return call()
        finally:
            fp8_hopper.FLAT_WGRAD = kept

    return looped


def _cases(kernels: list[str], out_dtypes: list[str], m: int, n: int, total: int, rows: int,
           fp8_loops: list[str] | None = None):  # fmt: skip
    """(label, out dtype, the call) for each kernel asked for, on operands of `rows` rows an expert; the
    FP8 kernel once per loop in fp8_loops (None: as it is)."""
    from mok_plugin.kernels import wgrad_hopper

    for name in out_dtypes if "fp8" in kernels else []:
        call = fp8_wgrad_call(m, n, total, rows, OUT_DTYPES[name])
        for loop in fp8_loops or [None]:
            label = f"fp8 -> {name}" if loop is None else f"fp8 {loop} -> {name}"
            yield label, OUT_DTYPES[name], call if loop is None else with_fp8_loop(call, loop)
    if "bf16" in kernels and torch.cuda.get_device_capability()[0] != 9:
        print("(the bf16 kernel is Hopper's: not timed on this GPU)")
    elif "bf16" in kernels:  # bf16 rows in schedule order, as the layer's Gluon path reads them
        offsets, counts = even_segments(total, rows)
        g = torch.Generator(device="cuda").manual_seed(0)
        left_rows = torch.randn(total, m, device="cuda", dtype=torch.bfloat16, generator=g)
        right_rows = torch.randn(total, n, device="cuda", dtype=torch.bfloat16, generator=g)
        d_w = torch.empty(total // rows, m, n, device="cuda", dtype=torch.bfloat16)
        for schedule in wgrad_hopper.SCHEDULES:

            def call(schedule: str = schedule) -> torch.Tensor:
                wgrad_hopper.expert_wgrad_hopper(left_rows, right_rows, d_w, offsets, counts, schedule)
                return d_w

            yield f"bf16 {schedule}", torch.bfloat16, call


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Time every case; 0 on success, 2 without a CUDA GPU."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        check_rows(args.rows, args.rows_per_expert)
    except ValueError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        print("mok bench wgrad-rows needs a CUDA GPU", file=sys.stderr)
        return 2
    m, n = args.mn
    if args.profile or args.ablate:
        if torch.cuda.get_device_capability()[0] != 9:
            print("mok bench wgrad-rows --profile/--ablate needs a Hopper GPU (the Gluon FP8 kernel)", file=sys.stderr)
            return 2
        if args.profile:
            return _profile(m, n, args.rows, args.rows_per_expert, args.out)
        return _ablate(m, n, args)
    flop = 2 * m * n * args.rows
    results = []
    print(f"{'E':>5} {'rows/e':>6} {'kernel':<26} {'ms':>8} {'TFLOP/s':>8} {'dW GB':>7} {'fill ms':>8}")
    for rows in args.rows_per_expert:
        experts = args.rows // rows
        fills: dict[torch.dtype, float] = {}
        looped: dict[torch.dtype, list[torch.Tensor]] = {}  # each FP8 loop's dW, to compare
        for label, out, call in _cases(args.kernels, args.out_dtypes, m, n, args.rows, rows, args.fp8_loops):
            ms = statistics.median(time_ms(call, args.iters, settle_s=args.settle_s))
            if args.fp8_loops and label.startswith("fp8 "):
                looped.setdefault(out, []).append(call().clone())
            if out not in fills:  # the write rate of the same dW, once a dtype
                d_w = call()
                fills[out] = statistics.median(time_ms(lambda d_w=d_w: d_w.fill_(1.0), args.iters))
                del d_w
            row = {"experts": experts, "rows per expert": rows, "kernel": label, "ms": ms, "TFLOP/s": flop / ms / 1e9,
                   "dW GB": experts * m * n * out.itemsize / 1e9, "fill ms": fills[out]}  # fmt: skip
            results.append(row)
            print(f"{experts:5d} {rows:6d} {label:<26} {ms:8.3f} {row['TFLOP/s']:8.1f} {row['dW GB']:7.2f} "
                  f"{row['fill ms']:8.3f}")  # fmt: skip
        for out, outputs in looped.items():
            if len(outputs) > 1:
                same = all(torch.equal(outputs[0], other) for other in outputs[1:])
                results.append({"experts": experts, "rows per expert": rows, "fp8 loops bitwise": same})
                print(f"{'':5} {rows:6d} the FP8 loops' dW ({out}): {'the same bits' if same else 'DIFFERENT BITS'}")
        del looped
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_wgrad_rows.json").write_text(json.dumps({"M": m, "N": n, "rows": args.rows,
                                                                "results": results}, indent=2))  # fmt: skip
    return 0


def _profile(m: int, n: int, total: int, rows_per_expert: list[int], out: Path) -> int:
    """Print and save kernel_probes.profile's table."""
    tables = kernel_probes.profile(m, n, total, rows_per_expert, out)
    print(f"{'rows/e':>6} {'warps':<7} {'scope':<16} {'kilocycles':>10}  (an MMA warp's a tile, the loader's a K step)")
    for rows, table in tables.items():
        for role, scopes in sorted(table.items()):
            for scope, value in sorted(scopes.items()):
                print(f"{rows:6d} {role:<7} {scope:<16} {value:10.3f}")
    (out / "bench_wgrad_profile.json").write_text(json.dumps({"M": m, "N": n, "rows": total, "per tile": tables},
                                                             indent=2))  # fmt: skip
    return 0


def _ablate(m: int, n: int, args: argparse.Namespace) -> int:
    """Print and save kernel_probes.ablated_times' table."""
    times = kernel_probes.ablated_times(m, n, args.rows, args.rows_per_expert, args.ablate, args.iters,
                                        args.settle_s)  # fmt: skip
    print(f"{'variant':<36} " + " ".join(f"{rows:>8d}" for rows in args.rows_per_expert) + "  (ms at rows an expert)")
    for label, by_rows in times.items():
        print(f"{label:<36} " + " ".join(f"{by_rows[rows]:8.3f}" for rows in args.rows_per_expert))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_wgrad_ablate.json").write_text(json.dumps({"M": m, "N": n, "rows": args.rows, "ms": times},
                                                            indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
