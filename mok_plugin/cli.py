"""The `mok` command: one entry point over the package's commands.

    mok compare --config configs/topologies/tiny_cpu.yaml      stock vs MoK (mok_plugin.compare.cli)
    mok plan ...                                               the run planner (mok_plugin.run.plan)
    mok bench layer|ab|generic|tune|inspect|ep|multi-gpu|ep-overlap|fp8|host|bound|rows|wgrad-rows ...
                                                               benchmarks (mok_plugin.bench)
    mok patch apply|check|revert megatron|deepspeed ...        source patches (mok_plugin.patching)

Each subcommand hands the rest of the command line to its module's `main(argv)`, imported only when
that subcommand runs, so `mok --help` loads neither torch's kernels nor any framework. Also runs as
`python -m mok_plugin.cli ...` (for torchrun: `torchrun ... -m mok_plugin.cli bench ep ...`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

__all__ = ["BENCH_COMMANDS", "COMMANDS", "main"]

# subcommand -> (module whose main(argv) runs it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("mok_plugin.compare.cli", "compare Megatron's or DeepSpeed's stock MoE layers with MoK"),
    "plan": ("mok_plugin.run.plan", "a run config's per-GPU memory and MoE-layer time"),
    "patch": ("mok_plugin.patching", "apply, check or revert the source patches on an installed framework"),
}
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "layer": ("mok_plugin.bench.layer", "time the MoE layer against its peers on one GPU"),
    "ab": ("mok_plugin.bench.ab", "A/B one change (module settings, tile configs) in one process, bits compared"),
    "generic": ("mok_plugin.bench.generic", "time DeepSpeed's MoE layer, stock against MoK (generic path and fused)"),
    "tune": ("mok_plugin.bench.tune", "time each kernel under candidate tile configs on one GPU"),
    "inspect": ("mok_plugin.bench.inspect", "compile the kernels for sm_90 and report their pipelining (no GPU)"),
    "ep": ("mok_plugin.bench.ep", "time the expert-parallel layer per rank and stage"),
    "multi-gpu": ("mok_plugin.bench.multi_gpu", "invariance, EP benchmark and pretraining on this host's GPUs"),
    "ep-overlap": ("mok_plugin.bench.ep_overlap", "Megatron's EP-overlap schedule on one GPU, stock and MoK"),
    "fp8": ("mok_plugin.bench.fp8", "time the blockwise-FP8 experts against the bf16 ones on one GPU"),
    "host": ("mok_plugin.bench.host", "the experts' host work and launches a step, launches stubbed (no GPU)"),
    "bound": ("mok_plugin.bench.bound", "what each shape's bytes allow: FLOP time against its memory floor (no GPU)"),
    "rows": ("mok_plugin.bench.rows_probe", "fc2's forward and fc1's dgrad alone: Triton against the Gluon row kernel"),
    "wgrad-rows": (
        "mok_plugin.bench.wgrad_rows",
        "the weight-gradient kernels alone, few rows an expert",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mok", description="Mixture-of-Kittens for Megatron-Core and DeepSpeed: the package's commands."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    bench = commands.add_parser("bench", help="benchmarks: " + ", ".join(BENCH_COMMANDS))
    which = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, (_, help_text) in BENCH_COMMANDS.items():
        which.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Dispatch `mok COMMAND ...` to its module's main; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    # Parse only the command words; everything after them (including --help) belongs to the subcommand.
    words = 2 if argv[:1] == ["bench"] else 1
    parser.parse_args(argv[:words])
    if argv[0] == "bench":
        module, prog = BENCH_COMMANDS[argv[1]][0], f"mok bench {argv[1]}"
    else:
        module, prog = COMMANDS[argv[0]][0], f"mok {argv[0]}"
    command = importlib.import_module(module).main
    # The package's commands take prog= so their usage line reads "mok bench layer"; others take argv only.
    if "prog" in inspect.signature(command).parameters:
        return command(argv[words:], prog=prog)
    return command(argv[words:])


if __name__ == "__main__":
    raise SystemExit(main())
