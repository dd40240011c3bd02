"""Print the per-GPU plan of a run config: its expert MLP, memory, and the time of one MoE layer and
of the MoE layers of one micro-batch, with every rate and its source. The arithmetic is mok_plugin.run.planner's;
the machines' rates and their public sources are in mok_plugin.run.sections.

    mok plan configs/topologies/deepseek-v3_gb300-nvl72_ep64.yaml
    python -m mok_plugin.run.plan CONFIG --efficiency 0.5 --json out/plan.json
    python scripts/plan.py CONFIG            (the same command)

Exit status: 0 when the layout fits, 1 when it does not, 2 for a config that cannot be read or
validated, or bad arguments (an `error: ...` line naming the file or argument, no traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

from mok_plugin.config import MoKConfigError
from mok_plugin.run.planner import HBM_USABLE, expert_params, layer_time, memory_per_gpu
from mok_plugin.run.topology import load_topology

__all__ = ["efficiency", "main"]


def efficiency(text: str) -> float:
    """argparse type: a finite fraction of peak in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a number") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: must be a fraction of peak in (0, 1], for example 0.6")
    return value


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Print the plan of the run config named in argv (default: sys.argv[1:]); `prog` names the
    command in usage and error lines (`mok plan` passes "mok plan").

    Returns:
        The exit status: 0 when the layout fits, 1 when it does not, 2 when the config cannot be
        read or validated or --json cannot be written (an `error: ...` line on stderr). Bad
        arguments exit with status 2 through argparse (SystemExit).
    """
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("config", type=Path)
    parser.add_argument("--efficiency", type=efficiency, default=0.6,
                        help="fraction of dense bf16 peak the experts reach, in (0, 1]")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        run = load_topology(args.config)
        mem, t = memory_per_gpu(run), layer_time(run, args.efficiency)
    except MoKConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    hw, p, m = run.hardware, run.parallel, run.model
    T = p.seq_length * p.micro_batch
    layers_here = m.moe_layers / p.pp
    print(f"{args.config.name}: {m.name} on {hw.name} ({p.world_size} GPUs)")
    slots = m.num_experts + p.redundant_experts
    print(f"  layout   TP {p.tp}  PP {p.pp}  EP {p.ep}  expert-TP {p.expert_tp}  DP {p.dp}  "
          f"seq {p.seq_length} x micro-batch {p.micro_batch}  expert slots {slots}")  # fmt: skip
    family = m.expert_family
    H, I = m.hidden_size, m.ffn_hidden_size
    print(
        f"  experts  {family.describe()}: {expert_params(family, H, I) / 1e6:.2f} M parameters each, first "
        f"linear {family.fc1_width(I)} rows, {family.gemm_macs_per_row(H, I) / 1e6:.2f} M multiply-adds per row"
    )
    print(
        f"  rates    {hw.gpu}: {hw.bf16_tflops:g} TFLOP/s dense bf16 ({hw.fp8_tflops:g} FP8), {hw.hbm_gib:g} GiB "
        f"HBM, NVLink {hw.nvlink_gb_s:g} GB/s/dir in a {hw.nvlink_domain}-GPU domain, scale-out "
        f"{hw.scale_out_gb_s:g} GB/s/dir"
    )
    # Wrapped between words only, so the sources' addresses stay whole (copyable).
    source = textwrap.fill(hw.source, width=110, initial_indent="           source: ", subsequent_indent=" " * 19,
                           break_long_words=False, break_on_hyphens=False)  # fmt: skip
    print(source)
    print("\n  memory per GPU (GiB)")
    for label, value in (("weights (bf16)", mem.weights_gib), ("gradients (fp32)", mem.grads_gib),
                         ("optimizer (Adam fp32, sharded)", mem.optimizer_gib),
                         (f"activations ({p.activation_recompute} recompute)", mem.activations_gib),
                         ("MoK buffers (exchange, FP8 copies)", mem.mok_buffers_gib),
                         ("total", mem.total_gib)):  # fmt: skip
        print(f"    {label:<34} {value:>9.2f}")
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    print(f"    {'usable (' + f'{HBM_USABLE:.0%}' + ' of HBM)':<34} {mem.budget_gib:>9.2f}   -> {verdict}")
    print(f"    parameters here: {mem.expert_params / 1e9:.2f} B routed-expert, {mem.dense_params / 1e9:.2f} B other")
    print(f"\n  one MoE layer, forward + backward, one micro-batch ({T} tokens per GPU, top-{m.top_k})")
    at = f"at {args.efficiency:.0%} of peak"
    precision = "bf16"
    if run.mok_config().fp8 is not None:
        speedup = hw.fp8_speedup
        precision = (f"FP8: {speedup:g}x bf16's speed, as measured on {hw.gpu}" if speedup is not None
                     else "FP8 at the dense FP8 rate: not measured on this GPU")  # fmt: skip
    print(f"    expert GEMMs   {t.expert_flops / 1e12:9.2f} TFLOP   {t.expert_ms:8.2f} ms {at} ({precision})")
    print(f"    exchange       {t.exchange_bytes / 1e9:9.3f} GB      {t.exchange_ms:8.2f} ms over {t.link}"
          + (f" at {t.link_gb_s:g} GB/s" if t.link_gb_s else ""))  # fmt: skip
    per_mb = layers_here * (t.expert_ms + t.exchange_ms)
    print(f"  the {layers_here:g} MoE layers of one pipeline stage: {per_mb:.1f} ms per micro-batch "
          "(expert GEMMs + exchange, not overlapped)")  # fmt: skip
    if args.json:
        memory = {**asdict(mem), "total_gib": mem.total_gib, "fits": mem.fits}
        result = {"config": str(args.config), "expert_family": {"describe": family.describe(), **m.family_fields()},
                  "memory": memory, "moe_layer": asdict(t), "moe_layers_per_microbatch_ms": per_mb}  # fmt: skip
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
        except OSError as error:
            print(f"error: --json {args.json}: cannot write it: {error.strerror or error}", file=sys.stderr)
            return 2
    return 0 if mem.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
