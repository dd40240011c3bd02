"""What a shape's bytes allow: its FLOP time at the dense GEMM's rate against its memory floor at the
device-copy rate, as the most of the dense rate a forward + backward can reach (no GPU needed).

A fwd+bwd takes at least max(FLOP time, floor time): the expert GEMMs' FLOPs (`flops.moe_flops`) at
the dense bf16 GEMM's rate, and the fewest bytes it moves (`floor.floor_bytes`: every expert's
weights read twice, its weight gradients written once, the activations once) at the copy rate. So
where the floor takes longer than the FLOPs, no kernel reaches FLOP time / floor time of the dense
rate: issue 24's "70 % of dense" is out of reach there at these rates, whatever the kernels do
(BENCHMARKS.md, "What each coarse target asks against the layer's bytes"). "floor / FLOP" is how much
of the FLOP time the traffic needs hidden under it: near 1, nearly all.

    mok bench bound                                       # the named shapes and the issue's class shapes
    mok bench bound --shape 4096,7168,2048,384,8 --dense-tflops 672 --copy-tbps 3.0   # an H100's rates
    mok bench bound --class-grid                          # every shape of a grid over the issue's class

The default rates are the H200's measured ones (BENCHMARKS.md's current table: the settled dense GEMM
653-678 TFLOP/s; device-to-device copies 4.0 TB/s, bytes read plus written, against 4.8 nominal).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from mok_plugin.bench.floor import floor_bytes
from mok_plugin.bench.flops import moe_flops
from mok_plugin.testing import MoEShape, parse_shape

__all__ = ["CLASS_GRID", "Bound", "bound_of", "build_parser", "class_grid", "grid_summary", "main", "rows_needed"]

DENSE_TFLOPS = 660.0  # the H200's settled bf16 dense GEMM
COPY_TBPS = 4.0  # the H200's device-to-device copy rate
TARGET = 0.70  # issue 24's share of dense for its class

DEFAULT_SHAPES = ["qwen3-30b-a3b", "olmoe", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b", "8192,3000,1000,160,6",
                  "4096,7168,2048,256,8", "4096,7168,2048,384,8"]  # fmt: skip

# Issue 24's class (E >= 128, H >= 2048, I >= 768, T >= 4096; H and I not only multiples of 128; E up
# to 384) sampled on a grid: real models' sizes and the benchmark's own shapes' between them.
CLASS_GRID: dict[str, tuple[int, ...]] = {
    "T": (4096, 8192, 16384),
    "H": (2048, 2880, 3000, 4096, 7168),
    "I": (768, 1000, 1536, 2048, 2880),
    "E": (128, 160, 256, 384),
    "K": (4, 6, 8),
}


@dataclass(frozen=True)
class Bound:
    """One shape's FLOP time, memory floor and the share of the dense rate its bytes allow."""

    shape: tuple[int, int, int, int, int]
    gflop: float
    flop_ms: float
    floor_gb: float
    floor_ms: float

    @classmethod
    def of(cls, shape: MoEShape, flops: float, nbytes: float, dense_tflops: float, copy_tbps: float) -> Bound:
        """The bound of `flops` at `dense_tflops` against `nbytes` at `copy_tbps`."""
        return cls(shape.as_tuple(), flops / 1e9, flops / dense_tflops / 1e9, nbytes / 1e9, nbytes / copy_tbps / 1e9)

    @property
    def floor_per_flop(self) -> float:
        """The floor's time over the FLOPs' time: how much traffic must hide under the GEMMs."""
        return self.floor_ms / self.flop_ms

    @property
    def allowed(self) -> float:
        """The most of the dense rate a fwd+bwd can reach: FLOP time / max(FLOP time, floor time)."""
        return self.flop_ms / max(self.flop_ms, self.floor_ms)


def bound_of(shape: MoEShape, dense_tflops: float = DENSE_TFLOPS, copy_tbps: float = COPY_TBPS) -> Bound:
    """`shape`'s bound at these rates, every expert routed to (so for T * K >= E under even routing).

    Raises:
        ValueError: a rate that is not positive.
    """
    if dense_tflops <= 0 or copy_tbps <= 0:
        raise ValueError(f"rates must be positive: {dense_tflops} TFLOP/s, {copy_tbps} TB/s")
    return Bound.of(
        shape, moe_flops(shape, "fwd+bwd"), floor_bytes(shape, used_experts=shape.E), dense_tflops, copy_tbps
    )


def class_grid() -> list[MoEShape]:
    """Every shape of CLASS_GRID."""
    return [MoEShape(*values) for values in itertools.product(*CLASS_GRID.values())]


def _label(shape: tuple[int, ...], names: dict[tuple[int, ...], str]) -> str:
    joined = ",".join(str(v) for v in shape)
    return f"{names[shape]} ({joined})" if shape in names else joined


def _table(bounds: list[Bound], names: dict[tuple[int, ...], str], target: float) -> list[str]:
    lines = [f"{'shape (T,H,I,E,K)':<38} {'GFLOP':>7} {'FLOP ms':>8} {'floor GB':>9} {'floor ms':>9} "
             f"{'floor/FLOP':>10} {'bytes allow':>11}  {_percent(target)} of dense"]  # fmt: skip
    for b in bounds:
        verdict = "within the bytes" if b.allowed >= target else "out of reach by the bytes"
        lines.append(f"{_label(b.shape, names):<38} {b.gflop:>7,.0f} {b.flop_ms:>8.2f} {b.floor_gb:>9.1f} "
                     f"{b.floor_ms:>9.2f} {b.floor_per_flop:>10.2f} {_percent(b.allowed):>11}  {verdict}")  # fmt: skip
    return lines


def rows_needed(target: float, dense_tflops: float, copy_tbps: float) -> float:
    """Rows an expert (T * K / E) below which a SwiGLU layer's weights alone hold it under `target`:
    their bytes (18 E H I: read twice, gradients written once) against the FLOPs (18 T K H I) give a
    share of (T K / E) * copy / dense, whatever H and I are; the activations only lower it."""
    return target * dense_tflops / copy_tbps


def grid_summary(bounds: list[Bound], target: float, dense_tflops: float, copy_tbps: float) -> list[str]:
    """How many of the grid's shapes the bytes hold under `target`, by E, with the rows an expert
    (T * K / E) they have: the floor grows with E's weights while the FLOPs grow with the rows."""
    short = [b for b in bounds if b.allowed < target]
    threshold = rows_needed(target, dense_tflops, copy_tbps)
    lines = [f"{len(short)} of {len(bounds)} shapes of the grid: the bytes allow less than {_percent(target)} of "
             f"dense; below {threshold:.0f} rows an expert no shape reaches it at these rates"]  # fmt: skip
    for e in CLASS_GRID["E"]:
        of_e = [b for b in bounds if b.shape[3] == e]
        out = [b for b in of_e if b.allowed < target]
        rows = sorted({b.shape[0] * b.shape[4] // e for b in out})
        where = f" (at {', '.join(str(r) for r in rows)} rows an expert)" if rows else ""
        lines.append(f"  E = {e}: {len(out)} of {len(of_e)}{where}")
    if short:
        low = min(short, key=lambda b: b.allowed)
        T, _, _, E, K = low.shape
        lines.append(f"  lowest: {_percent(low.allowed)} at {T * K // E} rows an expert (T = {T}, K = {K}, E = {E})")
    return lines


def _percent(share: float) -> str:
    return f"{share * 100:.0f} %"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench bound`."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--shapes", nargs="*", default=None, help=f"named shapes or T,H,I,E,K (default: {' '.join(DEFAULT_SHAPES)})"
    )
    parser.add_argument("--shape", action="append", default=[], help="one more T,H,I,E,K (repeatable)")
    parser.add_argument(
        "--class-grid", action="store_true", help="also a grid over issue 24's class: which shapes the bytes hold"
    )
    parser.add_argument(
        "--dense-tflops", type=float, default=DENSE_TFLOPS, help=f"the dense bf16 GEMM's TFLOP/s ({DENSE_TFLOPS:g})"
    )
    parser.add_argument(
        "--copy-tbps", type=float, default=COPY_TBPS, help=f"the copy rate, bytes read + written, TB/s ({COPY_TBPS:g})"
    )
    parser.add_argument("--target", type=float, default=TARGET, help=f"share of dense asked (default {TARGET:g})")
    parser.add_argument("--out", type=Path, default=None, help="also write the bounds as JSON here")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Print the table (and the grid's summary); 0 on success."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not 0 < args.target <= 1:
        parser.error(f"--target {args.target}: expected a share in (0, 1]")
    texts = (DEFAULT_SHAPES if args.shapes is None else args.shapes) + args.shape
    try:
        shapes = [parse_shape(text) for text in texts]
        bounds = [bound_of(shape, args.dense_tflops, args.copy_tbps) for shape in shapes]
        grid = [bound_of(shape, args.dense_tflops, args.copy_tbps) for shape in class_grid()] if args.class_grid else []
    except ValueError as error:
        parser.error(str(error))
    names = {parse_shape(text).as_tuple(): text for text in texts if "," not in text}
    print(f"dense {args.dense_tflops:g} TFLOP/s, bytes at {args.copy_tbps:g} TB/s; the floor: every expert's weights "
          "read twice, its weight gradients written once, the activations once")  # fmt: skip
    print("\n".join(_table(bounds, names, args.target)))
    if grid:
        print("\n".join(grid_summary(grid, args.target, args.dense_tflops, args.copy_tbps)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rates = {"dense_tflops": args.dense_tflops, "copy_tbps": args.copy_tbps, "target": args.target}
        rows = [asdict(b) | {"allowed": b.allowed} for b in bounds]
        grid_rows = [asdict(b) | {"allowed": b.allowed} for b in grid]
        args.out.write_text(json.dumps({"rates": rates, "shapes": rows, "class_grid": grid_rows}, indent=1))
        print(f"json: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
