"""Part 4 of `mok bench multi-gpu`: Megatron's parallel layouts on one host's GPUs, stock and MoK.

Each layout runs scripts/pretrain_gpt.py (Megatron's training loop, mock data, part 3's model) with
Megatron's stock MoE layer and with --mok, the same flags and seed otherwise, and reports tokens/s
and the losses of every iteration (the two runs start from different weights: MoK draws its own;
what must agree is how training goes, and that every layout trains):

  tp2_sp        --tensor-model-parallel-size 2 --sequence-parallel, expert TP 1, EP = the rest
  pp2_vpp2      --pipeline-model-parallel-size 2, two virtual stages of one layer each
  ep_overlap    --overlap-moe-expert-parallel-comm (Megatron's combined 1F1B; MoK's stage methods)
  dist_optim    --use-distributed-optimizer, torch_dist checkpoints on
  cp2           --context-parallel-size 2 (Megatron's attention needs Transformer Engine for it:
                skipped without TE)

A layout whose parallel sizes the GPU count does not allow is skipped, saying why. The whole
part needs at least 2 GPUs (Megatron's training loop needs CUDA).
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

__all__ = ["LAYOUTS", "layout_flags", "run_layouts"]

# name -> (flags, GPUs the layout's model-parallel part takes: TP x PP x CP)
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "tp2_sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"], 2),
    "pp2_vpp2": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "ep_overlap": (["--overlap-moe-expert-parallel-comm"], 1),
    "dist_optim": (["--use-distributed-optimizer"], 1),
    "cp2": (["--context-parallel-size", "2", "--transformer-impl", "transformer_engine"], 2),
}


def layout_flags(name: str, nprocs: int, micro_batch: int) -> list[str] | str:
    """The layout's flags at this GPU count (EP: the data-parallel ranks, as Megatron's expert grid
    with expert TP 1 allows), or why it cannot run here."""
    flags, model_parallel = LAYOUTS[name]
    if nprocs < 2 or nprocs % model_parallel:
        return f"needs a GPU count divisible by {model_parallel} and at least 2 (have {nprocs})"
    if name == "cp2" and importlib.util.find_spec("transformer_engine") is None:
        return "context parallelism needs Transformer Engine's attention (not installed)"
    data_parallel = nprocs // model_parallel
    ep = nprocs if name == "tp2_sp" else data_parallel  # ETP 1: EP may span the TP ranks
    if name == "ep_overlap" and ep < 2:
        return "the EP overlap needs expert parallelism > 1"
    return [*flags, "--expert-model-parallel-size", str(ep), "--global-batch-size", str(micro_batch * data_parallel)]


def run_layouts(args, nprocs: int, out: Path) -> dict:
    """Every layout, stock then MoK; {"status", "layouts": {name: {...}}}."""
    from mok_plugin.bench.multi_gpu import (
        PRETRAIN_ARGS,
        PRETRAIN_MICRO_BATCH,
        PRETRAIN_SEQ,
        ROOT,
        _iteration_log,
        _report_failure,
        _torchrun,
    )

    results: dict = {}
    for name in LAYOUTS:
        flags = layout_flags(name, nprocs, PRETRAIN_MICRO_BATCH)
        if isinstance(flags, str):
            results[name] = {"status": "skipped", "cause": flags}
            continue
        results[name] = {"status": "ran", "flags": flags}
        for variant, extra in (("stock", []), ("mok", ["--mok"])):
            print(f"part 4: layout {name}, {variant} ...", flush=True)
            log = out / f"layout_{name}_{variant}.log"
            command = [*PRETRAIN_ARGS, *flags, "--train-iters", str(args.pretrain_iters), *extra]
            code, _ = _torchrun(nprocs, [str(ROOT / "scripts" / "pretrain_gpt.py"), *command], log, args.job_timeout_s)
            iterations = _iteration_log(log.read_text())
            if code != 0 or not iterations:
                results[name] = {"status": "failed", "cause": _report_failure(f"layout {name} ({variant})", log, code)}
                break
            steady = [it["ms"] for it in iterations if it["iteration"] > 2] or [it["ms"] for it in iterations]
            global_batch = int(flags[flags.index("--global-batch-size") + 1])
            results[name][variant] = {
                "losses": [it["loss"] for it in iterations],
                "tokens_per_s": PRETRAIN_SEQ * global_batch / (statistics.median(steady) / 1e3),
            }
    failed = any(r["status"] == "failed" for r in results.values())
    return {"status": "failed" if failed else "ran", "layouts": results}


def print_layouts(part: dict) -> None:
    """Part 4's table."""
    print(f"\n4. Megatron parallel layouts (scripts/pretrain_gpt.py), stock vs MoK: {part['status']}")
    print(f"{'layout':<12} {'stock tok/s':>12} {'MoK tok/s':>10} {'stock loss':>11} {'MoK loss':>9}  (first -> last)")
    for name, r in part.get("layouts", {}).items():
        if r["status"] != "ran":
            print(f"{name:<12} {r['status']}: {r.get('cause', '')}")
            continue
        s, m = r["stock"], r["mok"]
        stock_losses = f"{s['losses'][0]:.2f}->{s['losses'][-1]:.2f}"
        mok_losses = f"{m['losses'][0]:.2f}->{m['losses'][-1]:.2f}"
        print(f"{name:<12} {s['tokens_per_s']:>12.0f} {m['tokens_per_s']:>10.0f} {stock_losses:>11} {mok_losses:>9}")
