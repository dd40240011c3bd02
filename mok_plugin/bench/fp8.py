"""Time MoK's blockwise-FP8 experts against its bf16 experts on one GPU (issue 25).

Per shape: forward and forward + backward of the multi-kernel bf16 path (`mok-multi`) and of the FP8
path (`fp8/pipeline.py`, quantisation of x, dO and the weights included; and once more with the
weights' FP8 copies kept across calls, as the layer keeps them within a step), settled, one process; the
FP8 path's kernels by GPU time; each gradient's relative difference from bf16's; whether two FP8
runs are bitwise equal; and each tensor's error against the unquantised float64 experts (taken an
expert at a time, `fp8_errors.py`: whole float64 copies of deepseek-v3's weights would take 90 GB),
for MoK's FP8 and for the separate-cast peer (`moe_experts_fp8_reference(separate_casts=True)`:
every quantised tensor first stored in bf16, as a pipeline of separate quantisation kernels has
it), on the same inputs.

    mok bench fp8 --shapes qwen3-30b-a3b deepseek-v3 --recipe e4m3 --out out/
    mok bench fp8 --shapes qwen3-30b-a3b --sweep      # each FP8 kernel under the tile candidates
    mok bench fp8 --shapes deepseek-v3 --hopper       # the Triton GEMMs against the Gluon ones (fp8_hopper.py)
(`python scripts/bench_fp8.py ...` is the same command.)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from mok_plugin.bench.breakdown import kernel_breakdown, short_kernel_name
from mok_plugin.bench.ceiling import dense_fp8_gemm_tflops, dense_gemm_tflops
from mok_plugin.bench.flops import moe_flops
from mok_plugin.bench.fp8_errors import float64_errors, relative_error
from mok_plugin.bench.providers import PROVIDERS, fwd_bwd, leaves, make_inputs
from mok_plugin.bench.timing import SETTLE_S, time_ms
from mok_plugin.fp8.pipeline import fp8_experts_backward, fp8_experts_forward
from mok_plugin.fp8.recipe import BlockwiseFP8Recipe
from mok_plugin.fp8.weight_copies import FP8WeightCopies
from mok_plugin.kernels import fp8_fc1_hopper, fp8_hopper
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import NAMED_SHAPES, parse_shape

__all__ = ["build_parser", "main"]

GRADIENTS = ("d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj")
NOT_MEASURED = "not measured (out of memory)"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench fp8` (and scripts/bench_fp8.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"],
                        help=f"named ({', '.join(sorted(NAMED_SHAPES))}) or T,H,I,E,K")  # fmt: skip
    parser.add_argument("--recipe", choices=["e4m3", "hybrid"], default="e4m3", help="Megatron's --fp8-format")
    parser.add_argument("--sweep", nargs="*", choices=sorted(SWEEP), metavar="KERNEL",
                        help="instead: time each FP8 kernel (or those named) under the tile candidates of SWEEP "
                             "(fp8_mlp.TILES), checking that each gives the default's bits")  # fmt: skip
    parser.add_argument("--hopper", action="store_true",
                        help="instead: forward + backward (weights kept) with the weight gradients and the row "
                             "GEMMs on the Triton kernels and on the Gluon ones (MOK_HOPPER_FP8_WGRAD, "
                             "MOK_HOPPER_FP8_ROWS), checking that each gives the Triton kernels' bits")  # fmt: skip
    parser.add_argument("--hopper-settings", nargs="+", choices=list(_hopper_settings()), metavar="SETTING",
                        help="with --hopper: only these settings (quoted labels of the table; the Triton kernels "
                             "always run first, as the bits to compare with)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S)
    parser.add_argument("--out", type=Path, default=Path("out"))
    return parser


def _fp8_case(name: str, recipe: BlockwiseFP8Recipe):
    """(shape, inputs, schedule, call, fp8_both) of one shape: the FP8 experts' arguments, and their
    forward + backward as one function of the weight copies to use (None: made in the call)."""
    shape = parse_shape(name)
    inputs = make_inputs(shape, "uniform", 0)
    schedule = build_schedule(inputs["topk_ids"], shape.E)
    call = (inputs["x"], inputs["topk_weights"], inputs["gate_up_proj"], inputs["down_proj"], schedule, recipe)

    def fp8_both(weight_copies: FP8WeightCopies | None = None) -> dict:
        saved: dict = {}
        out = fp8_experts_forward(*call, saved=saved, weight_copies=weight_copies)
        return {"out": out, **fp8_experts_backward(inputs["d_out"], saved)}

    return shape, inputs, schedule, call, fp8_both


def _same_bits(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], v) for k, v in want.items() if v is not None)


def _bench_shape(name: str, recipe: BlockwiseFP8Recipe, iters: int, settle_s: float) -> dict:
    shape, inputs, schedule, call, fp8_both = _fp8_case(name, recipe)
    bf16 = PROVIDERS["mok-multi"](inputs, shape)
    args = leaves(inputs)

    def bf16_forward():
        with torch.no_grad():
            bf16(*args)

    kept = FP8WeightCopies()  # the layer's within a step: the weights quantised and transposed once
    passes = {
        "bf16 forward": bf16_forward,
        "fp8 forward": lambda: fp8_experts_forward(*call),
        "bf16 fwd+bwd": lambda: fwd_bwd(bf16, inputs),
        "fp8 fwd+bwd": fp8_both,
        "fp8 fwd+bwd, weights kept": lambda: fp8_both(kept),
    }
    row: dict = {"shape": name, "dims": list(shape.as_tuple()), "dense GEMM TFLOP/s": _dense_ceilings(settle_s)}
    for label, work in passes.items():
        row[label] = statistics.median(time_ms(work, iters, settle_s=settle_s))
        print(f"{name} {label:<26} {row[label]:8.3f} ms", flush=True)
    with _unless_out_of_memory(row, "fp8 kernels, weights kept"):
        # the path timed as the layer runs in a step; the timed call against its kernels' sum: idle time
        row["fp8 kernels, weights kept"], row["idle, weights kept"] = kernel_breakdown(
            lambda: fp8_both(kept), iters=2, settle_s=settle_s
        )
    # The kept copies are half the weights' bytes again; the checks below made before with them held
    # ran deepseek-v3 out of an 80 GB H100's memory after its timings (session 41), so they go first.
    kept.clear()
    torch.cuda.empty_cache()
    with _unless_out_of_memory(row, "fp8 kernels"):
        row["fp8 kernels"], _ = kernel_breakdown(fp8_both, iters=2, settle_s=settle_s)
    row["fp8 TFLOP/s"] = _fp8_rates(shape, row)
    # The FP8 outputs wait in host memory for both checks: on deepseek-v3 two sets of gradients beside
    # the weights do not fit an 80 GB H100 (session 41).
    got = None
    with _unless_out_of_memory(row, "difference from bf16 and bitwise"):
        got = _on_host(fp8_both())
        row.update(_against_bf16_and_itself(got, fp8_both, lambda: fwd_bwd(bf16, inputs)))
    with _unless_out_of_memory(row, "error against float64"):
        row["error against float64"] = float64_errors(inputs, schedule, recipe, got or _on_host(fp8_both()))
    return row


def _on_host(outputs: dict) -> dict:
    return {name: t.cpu() for name, t in outputs.items() if t is not None}


def _dense_ceilings(settle_s: float) -> dict[str, float | None]:
    """The dense 8192^3 GEMMs' settled TFLOP/s in this process, before the shape's timings: bf16, FP8
    blockwise (the recipe's own, the FP8 kernels' ceiling) and FP8 per tensor (no promotion)."""
    return {
        "bf16": dense_gemm_tflops(settle_s=settle_s),
        "fp8 blockwise": dense_fp8_gemm_tflops(blockwise=True, settle_s=settle_s),
        "fp8 per tensor": dense_fp8_gemm_tflops(blockwise=False, settle_s=settle_s),
    }


# The FP8 kernels' names by what they compute (Gluon on Hopper, else Triton), for their TFLOP/s.
_ROW_GEMMS = ("rows_hopper", "fc1_hopper", "gate_up_fwd", "down_fwd", "down_dgrad_gemm", "gate_up_dgrad")
_WEIGHT_GRADIENTS = ("wgrad",)


def _fp8_rates(shape, row: dict) -> dict[str, float]:
    """TFLOP/s of the layer (fwd+bwd, weights kept) and, from that path's kernel profile where it was
    taken, of the four row GEMMs (two thirds of the FLOPs) and the two weight gradients (one third)."""
    flops = moe_flops(shape, "fwd+bwd")
    rates = {"layer, weights kept": flops / row["fp8 fwd+bwd, weights kept"] / 1e9}
    kernels = row.get("fp8 kernels, weights kept", [])
    for label, names, share in (("row GEMMs", _ROW_GEMMS, 2 / 3), ("weight gradients", _WEIGHT_GRADIENTS, 1 / 3)):
        ms = sum(k["ms"] for k in kernels if any(n in k["kernel"] for n in names))
        if ms:
            rates[label] = share * flops / ms / 1e9
    return rates


@contextlib.contextmanager
def _unless_out_of_memory(row: dict, label: str):
    """Run the block; where it runs out of the GPU's memory, name `label` in the row's "not measured
    (out of memory)" and go on: the shape's timings, taken before, are kept."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        row.setdefault(NOT_MEASURED, []).append(label)
        print(f"{row['shape']}: {label} not measured, out of the GPU's memory ({str(error).split('. ')[0]})",
              flush=True)  # fmt: skip
    gc.collect()  # the failed block's tensors, held by its frames until here
    torch.cuda.empty_cache()


def _against_bf16_and_itself(got: dict, fp8_both: Callable[[], dict], bf16_both: Callable[[], list]) -> dict:
    """Each output's relative difference from bf16's, then whether a second FP8 run gives the bits of
    the first (`got`, in host memory); bf16's outputs are let go before that run."""
    want = bf16_both()[:5]
    differences = {name: relative_error(got[name], ref) for name, ref in zip(("out", *GRADIENTS), want, strict=True)}
    del want
    again = fp8_both()
    return {"relative difference from bf16": differences,
            "bitwise": all(torch.equal(again[name].cpu(), t) for name, t in got.items())}  # fmt: skip


def _tiles(bm: int | None, bn: int | None, warps: int, stages: int) -> dict[str, int]:
    tiles = {"num_warps": warps, "num_stages": stages}
    tiles.update({key: value for key, value in (("BLOCK_M", bm), ("BLOCK_N", bn)) if value})
    return tiles


# Candidates per kernel (BLOCK_M, BLOCK_N where the kernel has it, warps, stages); what the H200 gave
# on qwen3-30b-a3b is in BENCHMARKS.md ("FP8 selectable, K-major backward").
SWEEP: dict[str, list[dict[str, int | bool]]] = {
    "gate_up_fwd": [_tiles(128, None, 8, 3), _tiles(64, None, 4, 3), _tiles(64, None, 4, 4), _tiles(128, None, 8, 4)],
    "down_fwd": [_tiles(128, 128, 8, 3), _tiles(128, 256, 8, 3), _tiles(64, 128, 4, 4), _tiles(128, 64, 4, 4)],
    "down_dgrad_gemm": [_tiles(128, 128, 8, 3), _tiles(64, 128, 4, 4), _tiles(128, 64, 4, 4), _tiles(64, 256, 8, 3)],
    # a tile a program in passes (UP_WITH_A: two, else three), or persistent (one pass, the next tile's loads
    # copied under this one's arithmetic)
    "down_dgrad_epilogue": [
        dict(_tiles(None, None, warps, 1), UP_WITH_A=up_with_a, PERSISTENT=False)
        for warps in (16, 8)
        for up_with_a in (False, True)
    ]
    + [dict(_tiles(None, None, warps, 1), UP_WITH_A=True, PERSISTENT=True) for warps in (8, 16)],
    "gate_up_dgrad": [_tiles(128, 128, 8, 3), _tiles(64, 128, 4, 4), _tiles(64, 256, 8, 3), _tiles(128, 256, 8, 3)],
    "wgrad": [_tiles(128, 128, 8, 3), _tiles(256, 128, 8, 3), _tiles(64, 128, 4, 4), _tiles(128, 128, 8, 4)],
}


def _sweep_shape(name: str, recipe: BlockwiseFP8Recipe, settle_s: float, kernels: list[str]) -> list[dict]:
    """Each kernel's (of `kernels`; all of SWEEP when empty) GPU time in a forward + backward under
    each SWEEP candidate (the others at TILES), and whether its results are the default tiles' bits.
    The Triton kernels throughout: on Hopper the Gluon ones (the default there) would stand in for the
    GEMMs swept, and nothing of theirs would be timed."""
    from mok_plugin.kernels import fp8_mlp

    rows = []
    with mock.patch.dict(os.environ, _hopper_settings()["none (Triton)"]):
        both = _fp8_case(name, recipe)[-1]
        want = both()
        for kernel, candidates in SWEEP.items():
            if kernels and kernel not in kernels:
                continue
            default = fp8_mlp.TILES[kernel]
            try:
                for tiles in candidates:
                    fp8_mlp.TILES[kernel] = tiles
                    got = both()
                    same = _same_bits(got, want)
                    breakdown, _ = kernel_breakdown(both, iters=3, settle_s=settle_s)
                    ms = sum(r["ms"] for r in breakdown if kernel in r["kernel"])
                    rows.append({"shape": name, "kernel": kernel, "tiles": tiles, "ms": ms, "same_bits": same,
                                 "default": tiles == default})  # fmt: skip
                    print(f"{name} {kernel:<14} {json.dumps(tiles):<62} {ms:8.3f} ms  same bits {same}", flush=True)
            finally:
                fp8_mlp.TILES[kernel] = default
    return rows


def _hopper_settings() -> dict[str, dict[str, str]]:
    """The environments `--hopper` compares: the Triton kernels, then the Gluon weight gradients, row
    GEMMs and both, and both with fc1's forward split (its GEMM on the row kernel, A apart; the default)."""
    wgrad, rows, split = fp8_hopper.WGRAD_SETTING, fp8_hopper.ROWS_SETTING, fp8_fc1_hopper.SPLIT_SETTING
    return {
        "none (Triton)": {wgrad: "0", rows: "0", split: "0"},
        "weight gradients": {wgrad: "1", rows: "0", split: "0"},
        "row GEMMs": {wgrad: "0", rows: "1", split: "0"},
        "both": {wgrad: "1", rows: "1", split: "0"},
        "both, fc1 split": {wgrad: "1", rows: "1", split: "1"},
    }


def _hopper_shape(
    name: str, recipe: BlockwiseFP8Recipe, iters: int, settle_s: float, labels: list[str] | None = None
) -> list[dict]:
    """Forward + backward with the weights' FP8 copies kept (as within a step), in each environment of
    `_hopper_settings` (or of those labelled, after the Triton kernels'): the call's time, the GPU time of
    the weight gradients and of the row GEMMs the Gluon kernels replace (fc2's forward and dgrad GEMM,
    fc1's dgrad and forward), and whether every result is the Triton kernels' bits."""
    both = _fp8_case(name, recipe)[-1]
    kept = FP8WeightCopies()
    rows, want = [], None
    settings = _hopper_settings()
    triton_first = next(iter(settings))
    chosen = [triton_first, *(label for label in labels or settings if label != triton_first)]
    for label, environment in ((label, settings[label]) for label in chosen):
        with mock.patch.dict(os.environ, environment):
            got = both(kept)
            want = got if want is None else want
            ms = statistics.median(time_ms(lambda: both(kept), iters, settle_s=settle_s))
            breakdown, _ = kernel_breakdown(lambda: both(kept), iters=3, settle_s=settle_s)
        rows.append({
            "shape": name, "setting": label, "fwd+bwd ms": ms, "same_bits": _same_bits(got, want),
            "wgrad ms": sum(r["ms"] for r in breakdown if "wgrad" in r["kernel"]),
            "rows ms": sum(r["ms"] for r in breakdown if any(k in r["kernel"] for k in _ROW_KERNELS)),
            "kernels": breakdown[:10],
        })  # fmt: skip
        print(f"{name} {label:<22} fwd+bwd {ms:8.3f} ms, same bits {rows[-1]['same_bits']}", flush=True)
    return rows


# the row GEMMs the Gluon kernels replace, by kernel name (Triton's, and the Gluon ones'), the copies of x's
# and dO's rows fc1's forward and fc2's dgrad need (torch's index_select: indexSelect...Index kernels, or
# vectorized_gather_kernel in torch 2.11) and A from h when fc1 is split
_ROW_KERNELS = ("_fp8_down_fwd_kernel", "_fp8_gate_up_dgrad_kernel", "_fp8_gate_up_fwd_kernel",
                "_fp8_down_dgrad_gemm_kernel",
                "_fp8_rows_hopper_kernel", "_fp8_fc1_hopper_kernel", "_fp8_activation_kernel",
                "indexSelect", "gather_kernel")  # fmt: skip


def _shapes_that_fit(names: list[str], bench: Callable[[str], list[dict]], path: Path,
                     document: Callable[[list[dict], list[str]], object] = lambda rows, _: rows,
                     ) -> tuple[list[dict], list[str]]:  # fmt: skip
    """(bench(name)'s rows for each shape in turn, the shapes skipped): one that runs out of the GPU's
    memory (deepseek-v3 on an 80 GB H100, say) is named and skipped, as the next may fit. `document`
    (rows, skipped) is written to `path` as JSON after each shape, so that a later shape's failure
    loses none of the earlier ones."""
    rows: list[dict] = []
    too_large: list[str] = []
    for name in names:
        try:
            rows += bench(name)
        except torch.OutOfMemoryError as error:
            too_large.append(name)
            print(f"{name}: skipped, it does not fit this GPU's memory ({str(error).split('. ')[0]})", flush=True)
        gc.collect()  # the failed shape's tensors, should a reference cycle hold them
        torch.cuda.empty_cache()
        path.write_text(json.dumps(document(rows, too_large), indent=2))
    return rows, too_large


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Time the shapes; 0 on success, 1 where a shape, or one of its checks after the timings, did
    not fit the GPU's memory (the rest is timed and reported), 2 without a CUDA GPU."""
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        print("mok bench fp8 (scripts/bench_fp8.py) needs a CUDA GPU", file=sys.stderr)
        return 2
    recipe = BlockwiseFP8Recipe.from_megatron(args.recipe, "blockwise")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hopper:
        rows, too_large = _shapes_that_fit(
            args.shapes, lambda name: _hopper_shape(name, recipe, args.iters, args.settle_s, args.hopper_settings),
            args.out / "bench_fp8_hopper.json")  # fmt: skip
        print(f"\n{'shape':<16} {'Gluon kernels':<22} {'fwd+bwd ms':>10} {'wgrad ms':>9} {'rows ms':>8}  same bits")
        for row in rows:
            print(f"{row['shape']:<16} {row['setting']:<22} {row['fwd+bwd ms']:10.3f} {row['wgrad ms']:9.3f} "
                  f"{row['rows ms']:8.3f}  {row['same_bits']}")  # fmt: skip
    elif args.sweep is not None:
        rows, too_large = _shapes_that_fit(
            args.shapes, lambda name: _sweep_shape(name, recipe, args.settle_s, args.sweep),
            args.out / "bench_fp8_sweep.json")  # fmt: skip
        print(f"details in {args.out / 'bench_fp8_sweep.json'}")
    else:
        rows, too_large = _shapes_that_fit(
            args.shapes, lambda name: [_bench_shape(name, recipe, args.iters, args.settle_s)],
            args.out / "bench_fp8.json",
            lambda rows, skipped: {"recipe": args.recipe, "rows": rows, "out_of_memory": skipped})  # fmt: skip
        _print_table(rows, args.out)
    if too_large:
        print(f"not timed (out of the GPU's memory): {', '.join(too_large)}")
    partly = [f"{row['shape']} ({', '.join(row[NOT_MEASURED])})" for row in rows if row.get(NOT_MEASURED)]
    if partly:
        print(f"timed, but not every check fitted the GPU's memory: {'; '.join(partly)}")
    return 1 if too_large or partly else 0


def _rates_line(row: dict) -> str:
    """TFLOP/s of the layer and its GEMMs, and the dense ceilings of the same process."""
    dense = row["dense GEMM TFLOP/s"]
    fp8_dense = dense["fp8 blockwise"]

    def rate(label: str) -> str:
        value = row["fp8 TFLOP/s"][label]
        return f"{label} {value:.0f}" + (f" ({value / fp8_dense:.0%})" if fp8_dense else "")

    ceilings = ", ".join(f"{k} {'not measured' if v is None else f'{v:.0f}'}" for k, v in dense.items())
    return (f"TFLOP/s (% of the FP8 blockwise dense GEMM): {', '.join(map(rate, row['fp8 TFLOP/s']))}; "
            f"dense 8192^3: {ceilings}")  # fmt: skip


def _print_table(rows: list[dict], out: Path) -> None:
    """The default timing's table: each shape's times, bitwise, its FP8 kernels and errors."""
    print(f"\n{'shape':<16} {'fwd bf16':>9} {'fwd fp8':>9} {'fwd+bwd bf16':>13} {'fwd+bwd fp8':>12} {'fp8 vs bf16':>11}"
          f" {'weights kept':>13}  bitwise  largest difference from bf16")  # fmt: skip
    for row in rows:
        kept = row["fp8 fwd+bwd, weights kept"]
        differences = row.get("relative difference from bf16")
        worst = "not measured"
        if differences:
            worst = "{} {:.4f}".format(*max(differences.items(), key=lambda item: item[1]))
        print(f"{row['shape']:<16} {row['bf16 forward']:9.3f} {row['fp8 forward']:9.3f} {row['bf16 fwd+bwd']:13.3f} "
              f"{row['fp8 fwd+bwd']:12.3f} {row['bf16 fwd+bwd'] / row['fp8 fwd+bwd']:10.2f}x {kept:13.3f}  "
              f"{row.get('bitwise', 'not measured')!s:<7}  {worst}")  # fmt: skip
        print("    " + _rates_line(row))
        kernels, idle = row.get("fp8 kernels, weights kept", []), row.get("idle, weights kept")
        if idle:
            print(f"    weights kept, profiled: kernels {sum(k['ms'] for k in kernels):.3f} ms, GPU idle "
                  f"{idle['idle_ms']:.3f} ms in a span of {idle['span_ms']:.3f} ms")  # fmt: skip
        for kernel in kernels[:8]:
            print(f"    {kernel['ms']:7.3f} ms x{kernel['launches']:<2} {short_kernel_name(kernel['kernel'], 70)}")
        if row.get(NOT_MEASURED):
            print(f"    not measured (out of the GPU's memory): {', '.join(row[NOT_MEASURED])}")
        errors = row.get("error against float64")
        if errors is None:  # named among the checks not measured
            continue
        each = [f"{name} {e['mok fp8']:.4f} (peer {e['separate-cast peer']:.4f})" for name, e in errors.items()]
        print("    error against float64 (relative, per tensor): " + ", ".join(each))
    print(f"details in {out / 'bench_fp8.json'}")
