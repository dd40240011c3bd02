"""Time each Triton kernel of the layer alone, under candidate tile configs, on the GPU.

Prints per kernel and config: ms (median of --iters), TFLOP/s; and the share of each kernel in
its pass at the default config. Used to choose the pinned table in mok_plugin/kernels/configs.py;
the choices and numbers go to BENCHMARKS.md.

    mok bench tune --shapes qwen3-30b-a3b mixtral-8x7b --out out/
    mok bench tune --kernels wgrad_down --candidates 128x256x64w8s3t 128x128x64w8s4gt
(`python scripts/tune_kernels.py ...` is the same command.)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

from mok_plugin.bench.providers import make_inputs
from mok_plugin.bench.timing import time_ms
from mok_plugin.bench.tuning import parse_tile_config, tile_config_label, tile_config_spec
from mok_plugin.kernels import grouped_mlp as gm
from mok_plugin.kernels.combine import combine_rows
from mok_plugin.kernels.configs import MoKTileConfig, kernel_config, wgrad_config
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule
from mok_plugin.testing import NAMED_SHAPES, parse_shape

__all__ = ["CANDIDATES", "compiled_report", "main"]

KERNELS = ("gate_up_fwd", "down_fwd", "down_dgrad", "gate_up_dgrad", "wgrad_down", "wgrad_gate_up")
# The jit functions whose compiled specialisations are reported (down_dgrad is a GEMM plus an
# elementwise epilogue kernel).
COMPILED = ("_gate_up_fwd_kernel", "_down_fwd_kernel", "_down_dgrad_gemm_kernel", "_down_dgrad_epilogue_kernel",
            "_gate_up_dgrad_kernel", "_expert_wgrad_kernel")  # fmt: skip

CANDIDATES = [
    MoKTileConfig(128, 128, 64, 8, 3),
    MoKTileConfig(128, 128, 64, 8, 4),
    MoKTileConfig(128, 256, 64, 8, 3),
    MoKTileConfig(128, 128, 128, 8, 3),
    MoKTileConfig(128, 64, 64, 4, 4),
    MoKTileConfig(64, 128, 64, 4, 4),
    MoKTileConfig(128, 256, 64, 8, 4),
    MoKTileConfig(128, 64, 64, 8, 4),
    MoKTileConfig(64, 64, 64, 4, 4),
]


def compiled_report(jit_fn) -> list[str]:
    """Registers, spills and shared memory of every compiled specialisation of a Triton kernel
    (from Triton's own cache; empty when this Triton keeps it elsewhere)."""
    lines = []
    try:
        compiled_kernels = [k for caches in jit_fn.device_caches.values() for k in caches[0].values()]
    except (AttributeError, IndexError, TypeError):
        return ["(this Triton keeps its compiled kernels elsewhere)"]
    for compiled in compiled_kernels:
        meta = getattr(compiled, "metadata", None)
        lines.append(
            f"regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')} "
            f"smem {getattr(meta, 'shared', '?')} warps {getattr(meta, 'num_warps', '?')} "
            f"stages {getattr(meta, 'num_stages', '?')}"
        )
    return lines


def _tune_shape(name: str, iters: int, defaults_only: bool = False, only: list[str] | None = None,
                candidates: list[MoKTileConfig] | None = None) -> list[dict]:  # fmt: skip
    results: list[dict] = []
    shape = parse_shape(name)
    T, H, I, E, K = shape.as_tuple()
    inp = make_inputs(shape, "uniform", 0)
    s = build_schedule(inp["topk_ids"], E, tile_m=DEFAULT_TILE_M)
    x, w13, w2, d_out = inp["x"], inp["gate_up_proj"], inp["down_proj"], inp["d_out"]
    weights = (inp["topk_weights"], s.row_to_tk)
    h, a = gm.gate_up_fwd(x, w13, s.row_to_token, s.tile_to_expert, s.tile_m)
    rt = (s.row_to_token, s.tile_to_expert, s.tile_m)
    y = gm.down_fwd(a, w2, *weights, *rt)
    d_h, a2, _ = gm.down_dgrad(d_out, w2, h, *weights, *rt)
    seg = (s.row_to_token, s.expert_offsets, s.tokens_per_expert)
    kernels = {
        # name: (flops, fn(config), default config)
        "gate_up_fwd": (
            2 * T * K * H * 2 * I,
            lambda c: gm.gate_up_fwd(x, w13, *rt, config=c),
            kernel_config("gate_up_fwd", I),
        ),
        "down_fwd": (
            2 * T * K * H * I,
            lambda c: gm.down_fwd(a, w2, *weights, *rt, config=c),
            kernel_config("down_fwd", H),
        ),
        "down_dgrad": (
            2 * T * K * H * I,
            lambda c: gm.down_dgrad(d_out, w2, h, *weights, *rt, config=c),
            kernel_config("down_dgrad", I),
        ),
        "gate_up_dgrad": (
            4 * T * K * H * I,
            lambda c: gm.gate_up_dgrad(d_h, w13, *rt, config=c),
            kernel_config("gate_up_dgrad", H),
        ),
        "wgrad_down": (
            2 * T * K * H * I,
            lambda c: gm.expert_wgrad(
                d_out, a2, *seg, left_by_token=True, right_by_token=False, segment_align=s.tile_m, config=c
            ),
            wgrad_config(I, s.row_to_token.shape[0], E, H * I),
        ),
        "wgrad_gate_up": (
            4 * T * K * H * I,
            lambda c: gm.expert_wgrad(
                d_h, x, *seg, left_by_token=False, right_by_token=True, segment_align=s.tile_m, config=c
            ),
            wgrad_config(2 * I, s.row_to_token.shape[0], E, 2 * I * H),
        ),
    }
    fixed = {
        "schedule": lambda: build_schedule(inp["topk_ids"], E, tile_m=DEFAULT_TILE_M),
        "combine": lambda: combine_rows(y, s.tk_to_row, T, K),
    }
    for kname, fn in fixed.items():
        ms = statistics.median(time_ms(fn, iters))
        results.append({"shape": name, "kernel": kname, "config": "-", "ms": ms, "tflops": 0.0, "default": True})
        print(f"{name:<14} {kname:<14} {'-':<28} {ms:8.3f} ms", flush=True)
    for kname, (flops, fn, default) in kernels.items():
        if only and kname not in only:
            continue
        for cfg in [default] + ([] if defaults_only else [c for c in candidates or CANDIDATES if c != default]):
            if kname == "gate_up_fwd" and cfg.block_n > 128:
                continue  # two accumulators of 128x256 fp32 do not fit the registers
            try:
                ms = statistics.median(time_ms(functools.partial(fn, cfg), iters))
            except Exception as error:  # a config the compiler rejects (shared memory, registers)
                print(f"{name:<14} {kname:<14} {cfg} failed: {type(error).__name__}", flush=True)
                continue
            row = {
                "shape": name,
                "kernel": kname,
                "config": str(cfg),
                "spec": tile_config_spec(cfg),
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "default": cfg == default,
            }
            results.append(row)
            tag = "(default)" if cfg == default else ""
            c = tile_config_label(cfg)
            print(f"{name:<14} {kname:<14} {c:<28} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s {tag}", flush=True)
    return results


def _shape_name(text: str) -> str:
    """A --shapes entry as given, once parse_shape accepts it (argparse reports the ValueError)."""
    parse_shape(text)
    return text


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench tune` (and scripts/tune_kernels.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "mixtral-8x7b"], type=_shape_name,
                        help=f"named ({', '.join(sorted(NAMED_SHAPES))}) or T,H,I,E,K")  # fmt: skip
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--defaults-only", action="store_true", help="time only the pinned configs")
    parser.add_argument("--kernels", nargs="*", choices=KERNELS, default=None, help="only these kernels (default: all)")
    parser.add_argument(
        "--candidates",
        nargs="*",
        type=parse_tile_config,
        default=None,
        help="configs to try instead of the built-in list, e.g. 128x256x64w8s3gt (g: pre-gathered wgrad rows, t: TMA)",
    )
    parser.add_argument("--out", type=Path, default=Path("out"))
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Time the kernels; 0 on success, 2 without a CUDA GPU."""
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        print("mok bench tune (scripts/tune_kernels.py) needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for name in args.shapes:
        results += _tune_shape(name, args.iters, args.defaults_only, args.kernels, args.candidates)
        torch.cuda.empty_cache()
    print("\ncompiled kernels (registers per thread, spills, shared memory bytes):")
    for kernel in (getattr(gm, name) for name in COMPILED):
        for line in compiled_report(kernel):
            print(f"  {kernel.__name__:<24} {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "-".join(args.kernels) if args.kernels else "all"
    (args.out / f"tune_kernels-{tag}.json").write_text(json.dumps(results, indent=2))
    print("\nbest per kernel:")
    for name in args.shapes:
        for kname in KERNELS:
            rows = [r for r in results if r["shape"] == name and r["kernel"] == kname]
            if rows:
                best = min(rows, key=lambda r: r["ms"])
                default = next(r for r in rows if r["default"])
                print(
                    f"{name:<14} {kname:<14} default {default['ms']:7.3f} ms ({default['tflops']:4.0f}) "
                    f"best {best['ms']:7.3f} ms ({best['tflops']:4.0f}) {best['config']}"
                )
    return 0
