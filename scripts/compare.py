"""Compare Megatron's (or DeepSpeed's) stock MoE layers with MoK on one run config: the same small
MoE language model (the config's MoE shape and layer count) trained with each, twice, from the same
weights on the same tokens; prints a table and writes JSON, a Markdown report and a PNG plot.

    python scripts/compare.py --config configs/topologies/tiny_cpu.yaml          # the README's main job
    python scripts/compare.py --config CONFIG --framework deepspeed --steps 20 --out out/compare

On a CPU-only machine it runs configs for the `cpu` machine (the framework's MoE layers in a small
model, fp32) and says so in the report. On a GPU it runs any config whose model fits one GPU.
Megatron's full GPT training loop is scripts/pretrain_gpt.py (see scripts/multi_gpu.py part 3).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mok_plugin.compare import format_table, run_comparison, write_reports  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.topology import load_topology  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/topologies/tiny_cpu.yaml"))
    parser.add_argument("--framework", choices=["megatron", "deepspeed"], default="megatron")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", type=Path, default=Path("out/compare"))
    args = parser.parse_args(argv)
    try:
        run = load_topology(args.config)
    except MoKConfigError as error:
        print(error, file=sys.stderr)
        return 2
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if not on_gpu and run.machine != "cpu":
        parser.error(f"{args.config} targets {run.machine}; on the CPU the harness runs configs for the 'cpu' "
                     "machine (configs/topologies/tiny_cpu.yaml)")  # fmt: skip
    if on_gpu:
        torch.cuda.set_device(device)
    tokens = run.parallel.seq_length * run.parallel.micro_batch
    mode = (f"the config's {run.model.moe_layers} MoE layers ({args.framework}'s stock layer vs MoK) in a small "
            f"language model on one {'GPU' if on_gpu else 'CPU process'}; "
            + ("fp32, the CPU runs no attention or full training loop" if not on_gpu else "bf16"))  # fmt: skip
    print(f"compare: {args.config} with {args.framework}, {args.steps} steps x {tokens} tokens, 4 runs "
          f"(stock twice, MoK twice) on {device.type}")  # fmt: skip
    with tqdm(total=4 * args.steps, unit="step", dynamic_ncols=True) as bar:

        def progress(message: str) -> None:
            bar.set_description(message)
            bar.update(1)

        result = run_comparison(run, args.framework, args.steps, device, progress)
    m = run.model
    result["meta"] = {
        "config": str(args.config), "framework": args.framework, "device": str(device), "steps": args.steps,
        "tokens_per_step": tokens, "mode": mode,
        "model": f"{m.name}: {m.moe_layers} MoE layers, H={m.hidden_size}, I={m.ffn_hidden_size}, "
                 f"E={m.num_experts}, top-{m.top_k}",
        "memory_kind": "peak allocated CUDA memory" if on_gpu else "peak resident memory of the process (RSS)",
    }  # fmt: skip
    print("\n" + format_table(result))
    paths = write_reports(result, args.out)
    print(f"\nreport: {paths['markdown']}\nplot:   {paths['plot']}\njson:   {paths['json']}")
    return 0 if result["bitwise"]["mok"] else 1  # MoK promises bitwise repeatability; the stock path does not


if __name__ == "__main__":
    raise SystemExit(main())
