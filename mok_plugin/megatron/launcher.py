"""The `--mok*` flags for a Megatron launch, and a launcher for scripts that do not take them.

Flags (added to Megatron's own parser):
  --mok                   run every MoE layer (MTP included) through MoK: sets
                          `--spec mok_plugin.megatron moe_block_spec`
  --mok-config PATH       a YAML file of MoKConfig fields (at the top level or under `mok:`): the
                          MoK-only knobs (backend, kernel_variant, ep_exchange, ep_capacity_factor,
                          ep_transport, debug_checks) freely; any field Megatron's flags set (shape,
                          routing, losses, capacity, shared experts, EP size, dtype) only with the
                          same value, else an error at build time naming the field and the flag
  --mok-backend NAME      auto | triton | reference (overrides the file)
  --mok-deterministic     print (on rank 0) the determinism report: what MoK guarantees and what
                          else in the run is not deterministic; it sets nothing, since MoK's layers
                          are always deterministic

Two ways in:
  - `scripts/pretrain_gpt.py` (a GPT pretraining entry on megatron.training, mock data) calls
    `parse_args_with_mok` itself;
  - `python -m mok_plugin.megatron.launcher path/to/pretrain_gpt.py ARGS` runs a Megatron-LM
    checkout's script unchanged: it wraps `megatron.training.arguments.parse_and_validate_args`
    (which the script imports by name) so the script's parser takes the flags too.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from mok_plugin.config import REMOVED_FIELDS, MoKConfigError, read_yaml, short_repr
from mok_plugin.megatron.config_map import MEGATRON_SET, MOK_KNOBS
from mok_plugin.megatron.layer import set_default_mok_overrides

__all__ = ["add_mok_args", "apply_mok_args", "determinism_report", "parse_args_with_mok", "main"]

SPEC = ["mok_plugin.megatron", "moe_block_spec"]
# The MoKConfig fields a --mok-config file may hold: the check and its error's list both use this.
# The knobs are free; a field Megatron sets must repeat its value (config_map checks it at build).
ACCEPTED_KEYS = (*MOK_KNOBS, *MEGATRON_SET)


def add_mok_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the MoK group to a Megatron parser (usable as an `extra_args_provider`)."""
    group = parser.add_argument_group("MoK", "Mixture-of-Kittens MoE layers (mok_plugin)")
    group.add_argument("--mok", action="store_true", help="Run the MoE layers through MoK.")
    group.add_argument("--mok-config", type=Path, default=None,
                       help="YAML file of MoK knobs (fields Megatron sets must agree with its flags).")  # fmt: skip
    group.add_argument("--mok-backend", choices=["auto", "triton", "reference"], default=None)
    group.add_argument("--mok-deterministic", action="store_true",
                       help="Print the determinism report (MoK layers are always deterministic).")  # fmt: skip
    return parser


def _read_knobs(path: Path) -> dict[str, Any]:
    """The MoKConfig fields of a --mok-config file (unchecked against Megatron: config_map does that)."""
    data = read_yaml(path, "--mok-config") or {}
    if not isinstance(data, dict):
        raise MoKConfigError(f"--mok-config {path}: expected a mapping of MoK fields, got {type(data).__name__}")
    data = data.get("mok", data)  # a file may nest its MoK fields under `mok:`
    if not isinstance(data, dict):
        raise MoKConfigError(f"--mok-config {path}: the 'mok' section must be a mapping, got {type(data).__name__}")
    removed = [key for key in data if key in REMOVED_FIELDS]
    if removed:
        raise MoKConfigError(
            f"--mok-config {path}: " + "; ".join(f"mok.{key}: {REMOVED_FIELDS[key]}" for key in removed)
        )
    unknown = sorted(str(key) for key in data if key not in ACCEPTED_KEYS)
    if unknown:
        raise MoKConfigError(
            f"--mok-config {path}: unknown MoK fields {short_repr(unknown)}; allowed: {sorted(ACCEPTED_KEYS)}"
        )
    return data


def apply_mok_args(args: argparse.Namespace) -> dict[str, Any]:
    """Act on the parsed --mok* flags: set the spec and the MoK knobs. Returns the knobs.

    --mok-deterministic sets no knob (MoK's layers are always deterministic); parse_args_with_mok
    prints the determinism report for it.

    Raises:
        MoKConfigError: --mok with another --spec, a --mok-* flag without --mok, or a bad file.
    """
    mok_only = [flag for flag, value in (("--mok-config", args.mok_config), ("--mok-backend", args.mok_backend),
                                         ("--mok-deterministic", args.mok_deterministic)) if value]  # fmt: skip
    if not args.mok:
        if mok_only:
            raise MoKConfigError(f"{', '.join(mok_only)} given without --mok")
        return {}
    if args.spec and list(args.spec) != SPEC:
        raise MoKConfigError(f"--mok sets --spec {' '.join(SPEC)}; it cannot be combined with --spec {args.spec}")
    args.spec = list(SPEC)
    knobs = _read_knobs(args.mok_config) if args.mok_config else {}
    if args.mok_backend:
        knobs["backend"] = args.mok_backend
    set_default_mok_overrides(knobs)
    return knobs


def determinism_report(args: argparse.Namespace) -> list[str]:
    """What MoK makes deterministic, and what else in this Megatron run is not (by the flags)."""
    lines = ["MoK layers: deterministic (fixed-order kernels, no float atomics, EP-size invariant)"]
    if not getattr(args, "deterministic_mode", False):
        lines.append(
            "not covered: the rest of the model (attention, dense GEMMs, embedding and loss backward, "
            "gradient all-reduce); pass --deterministic-mode for Megatron's own deterministic settings"
        )
    if getattr(args, "cross_entropy_loss_fusion", False):
        lines.append("not deterministic: --cross-entropy-loss-fusion (a fused kernel with atomics)")
    if getattr(args, "tp_comm_overlap", False):
        lines.append("not deterministic: --tp-comm-overlap")
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        lines.append(
            "depends on Transformer Engine: its fused attention backward is deterministic only with "
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (--deterministic-mode sets it)"
        )
    if os.environ.get("NCCL_ALGO") in (None, "", "Tree"):
        lines.append("not pinned: NCCL_ALGO (reductions of dense gradients); --deterministic-mode sets Ring")
    return lines


def parse_args_with_mok(parse_and_validate_args, extra_args_provider=None, **kwargs) -> argparse.Namespace:
    """Megatron's parse_and_validate_args with the MoK flags added (composed with any other provider)."""

    def provider(parser):
        parser = add_mok_args(parser)
        return extra_args_provider(parser) if extra_args_provider else parser

    args = parse_and_validate_args(extra_args_provider=provider, **kwargs)
    apply_mok_args(args)
    if args.mok and args.mok_deterministic and args.rank == 0:
        print("MoK determinism report:\n  " + "\n  ".join(determinism_report(args)), flush=True)
    return args


def main(argv: list[str] | None = None) -> int:
    """`python -m mok_plugin.megatron.launcher SCRIPT ARGS`: run a Megatron script with the MoK flags."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    script, rest = Path(argv[0]), argv[1:]
    if not script.is_file():
        print(f"mok launcher: {script}: no such script", file=sys.stderr)
        return 2
    from megatron.training import arguments

    stock = arguments.parse_and_validate_args

    def parse_and_validate_args(extra_args_provider=None, **kwargs):
        return parse_args_with_mok(stock, extra_args_provider, **kwargs)

    arguments.parse_and_validate_args = parse_and_validate_args
    sys.argv = [str(script), *rest]
    # What `python script.py` does, so the script's own imports (megatron.training, ...) resolve from
    # its checkout; this runs the user's Megatron-LM script, it does not reach into this repository.
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
