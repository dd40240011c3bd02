"""Compare Megatron's (or DeepSpeed's) stock MoE layers with MoK on one run config: the same small
MoE language model (the config's MoE shape and layer count) trained with each, twice, from the same
weights on the same tokens of a seeded synthetic language; prints a table and writes JSON, a
Markdown report, a PNG plot and a log of the frameworks' own messages.

    mok compare --config configs/topologies/tiny_cpu.yaml        # = scripts/compare.py, the main job
    mok compare --config CONFIG --framework deepspeed --steps 20 --out out/compare/ds-20
    mok compare --config CONFIG --fp8 e4m3 --steps 200    # MoK's experts in blockwise FP8
    mok compare --config CONFIG --fp8 hybrid --fp8-scaling tensorwise   # ... or another FP8 recipe
    mok compare --config CONFIG --fp8 e4m3 --steps 200 --micro-batch 8   # ... 8 sequences a step

The output folder defaults to out/compare/<framework>, so a Megatron and a DeepSpeed run do not
overwrite each other. The console shows the progress bar and the table only: the frameworks'
warnings and log lines (Transformer Engine, Apex, absl, DeepSpeed's op build, ...) go to
compare.log in the output folder, and the last lines say how many there were and where.

The table's first line says which stock layer ran and why (Megatron: Transformer Engine's grouped
GEMM, TEGroupedMLP, where TE imports on a GPU, else SequentialMLP; stock_path.py), and with Megatron
a `grouped_mm*` row shows the PyTorch grouped_mm path on the same config, the stand-in for a
grouped stock path (or why it could not run).

On a CPU-only machine it runs configs for the `cpu` machine (the framework's MoE layers in a small
model, fp32) and says so in the report. On a GPU it runs any config whose model fits one GPU.
Megatron's full GPT training loop is scripts/pretrain_gpt.py (`mok bench multi-gpu` runs it, part 3).
Exit status: 0, or 1 when MoK's two runs differ (MoK promises bitwise repeatability; the stock
layers do not), or 2 for a bad config or option.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["main"]

LOG_NAME = "compare.log"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mok compare", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("configs/topologies/tiny_cpu.yaml"),
        help="a run config (configs/topologies/*.yaml); on the CPU, one for the 'cpu' machine",
    )
    parser.add_argument("--framework", choices=["megatron", "deepspeed"], default="megatron")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (at least 2; default 10)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: out/compare/<framework>)")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=None, metavar="N",
                        help="sequences a step (the config's parallel.micro_batch; tokens a step: N x "
                             "seq_length)")  # fmt: skip
    parser.add_argument("--fp8", choices=["e4m3", "hybrid"], default=None,
                        help="MoK's experts in blockwise FP8 (the config's mok.fp8; Megatron's --fp8-format with "
                             "--fp8-recipe blockwise): the report then gives its losses' distance from the stock "
                             "layer's bf16 ones")  # fmt: skip
    parser.add_argument("--fp8-scaling", choices=["blockwise", "tensorwise", "mxfp8"], default=None,
                        help="with --fp8: the FP8 recipe (the config's mok.fp8_scaling; Megatron's --fp8-recipe); "
                             "tensorwise and mxfp8 run MoK's PyTorch FP8 path, slow")  # fmt: skip
    return parser


@contextlib.contextmanager
def _framework_output_to(log_path: Path) -> Iterator[tuple[TextIO, Counter]]:
    """Send file descriptors 1 and 2 to `log_path` for the duration: Python's print, warnings and
    logging, and also output from C++ and from subprocesses (DeepSpeed's compiler). Yields a console
    stream on the original stderr (for the progress bar) and a Counter of Python warning categories."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    counts: Counter = Counter()
    show = warnings.showwarning

    def count_and_show(message, category, filename, lineno, file=None, line=None):
        counts[category.__name__] += 1
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = count_and_show
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield console, counts
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            console.close()
            warnings.showwarning = show


def _deepspeed_op_is_built() -> bool:
    """Whether DeepSpeed's CPU communication op (deepspeed_shm_comm) is already in torch's extension cache."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "deepspeed_shm_comm.so").exists()
    except Exception:  # a private torch helper: if it moved, say the build may happen
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns the exit status (see the module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: at least 2 (the first step is left out of the timing)")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch={args.micro_batch}: at least 1 sequence a step")
    if args.fp8_scaling is not None and args.fp8 is None:
        parser.error(f"--fp8-scaling {args.fp8_scaling}: needs --fp8 (e4m3 or hybrid), whose recipe it chooses")
    import torch
    from tqdm import tqdm

    from mok_plugin.compare.harness import memory_source, run_comparison, runs_planned
    from mok_plugin.compare.models import check_framework, deepspeed_gating, describe_gating, random_options
    from mok_plugin.compare.report import format_table, write_reports
    from mok_plugin.config import MoKConfigError
    from mok_plugin.run.topology import load_topology

    try:
        run = load_topology(args.config)
        # the options' overrides validated as the config's own values are (memory fit, DeepSpeed's
        # capacity against the tokens a step): a model_copy would skip that
        fields = run.model_dump()
        if args.fp8 is not None:
            scaling = {} if args.fp8_scaling is None else {"fp8_scaling": args.fp8_scaling}
            fields["mok"] = {**fields["mok"], "fp8": args.fp8, **scaling}
        if args.micro_batch is not None:
            fields["parallel"] = {**fields["parallel"], "micro_batch": args.micro_batch}
        run = type(run).model_validate(fields)
        check_framework(run, args.framework)
    except (MoKConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device auto or cpu)")
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if not on_gpu and run.machine != "cpu":
        parser.error(f"{args.config} targets {run.machine}; on the CPU the harness runs configs for the 'cpu' "
                     "machine (configs/topologies/tiny_cpu.yaml)")  # fmt: skip
    if on_gpu:
        torch.cuda.set_device(device)
    out_dir = args.out if args.out is not None else Path("out/compare") / args.framework
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / LOG_NAME
    tokens = run.parallel.seq_length * run.parallel.micro_batch
    mode = (f"the config's {run.model.moe_layers} MoE layers ({args.framework}'s stock layer vs MoK) in a small "
            f"language model on one {'GPU' if on_gpu else 'CPU process'}; "
            + ("fp32, the CPU runs no attention or full training loop" if not on_gpu else "bf16"))  # fmt: skip
    runs = runs_planned(args.framework, fp8=run.mok_config().fp8 is not None)
    which = "stock, MoK and the PyTorch grouped_mm path, twice each" if runs > 4 else "stock twice, MoK twice"
    print(f"compare: {args.config} with {args.framework}, {args.steps} steps x {tokens} tokens, {runs} runs "
          f"({which}) on {device.type}")  # fmt: skip
    if args.framework == "deepspeed" and not on_gpu and not _deepspeed_op_is_built():
        print("DeepSpeed compiles its C++ communication op (deepspeed_shm_comm) first: about 30 s at 0 %, once "
              "(cached in ~/.cache/torch_extensions)")  # fmt: skip
    try:
        with _framework_output_to(log_path) as (console, warning_counts):
            with tqdm(total=runs * args.steps, unit="step", dynamic_ncols=True, file=console) as bar:

                def progress(message: str) -> None:
                    bar.set_description(message)
                    bar.update(1)

                result = run_comparison(run, args.framework, args.steps, device, progress)
                if not result["stand_in"]["ran"]:  # its runs were skipped; the report says why
                    bar.set_description(f"{result['stand_in']['name']}: not run")
                bar.update(bar.total - bar.n)
    except BaseException:
        print(f"\nthe comparison failed; the frameworks' output is in {log_path}", file=sys.stderr)
        raise
    m, cfg = run.model, run.mok_config()
    result["meta"] = {
        "config": str(args.config), "framework": args.framework, "device": str(device), "steps": args.steps,
        "tokens_per_step": tokens, "mode": mode,
        "model": f"{m.name}: {m.moe_layers} MoE layers, H={m.hidden_size}, I={m.ffn_hidden_size}, "
                 f"E={m.num_experts}, top-{m.top_k}, experts {cfg.expert_family.describe()}",
        "top_k": m.top_k, "aux_loss_coeff": cfg.aux_loss_coeff, "memory_kind": memory_source(device),
        "log": str(log_path), "random_routing": [], "fp8": cfg.fp8,
        "fp8_scaling": cfg.fp8_scaling if cfg.fp8 is not None else None,
    }  # fmt: skip
    if args.framework == "deepspeed":  # the gating both layers ran: the config's deepspeed section or the harness's
        gating = deepspeed_gating(run)
        result["meta"]["model"] += f"; DeepSpeed gating: {describe_gating(gating, m.top_k)}"
        result["meta"].update(deepspeed=gating.model_dump(), random_routing=random_options(gating, m.top_k))
    print("\n" + format_table(result))
    paths = write_reports(result, out_dir)
    lines = sum(1 for _ in log_path.open(errors="replace"))
    kinds = ", ".join(f"{n} {name}" for name, n in warning_counts.most_common()) or "no Python warnings"
    print(f"\nreport: {paths['markdown']}\nplot:   {paths['plot']}\njson:   {paths['json']}")
    print(f"log:    {log_path} (the frameworks' messages: {lines} lines; {kinds})")
    return 0 if result["bitwise"]["mok"] else 1
