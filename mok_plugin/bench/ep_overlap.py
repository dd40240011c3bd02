"""Megatron's EP-overlap schedule on one GPU: scripts/pretrain_gpt.py, stock and MoK, with and
without --overlap-moe-expert-parallel-comm (and --delay-wgrad-compute with it).

    mok bench ep-overlap --out out/ep_overlap
(`python scripts/ep_overlap.py ...` is the same command.)

Megatron runs the overlap only with expert parallelism > 1, and NCCL refuses two ranks on one GPU,
so the EP = 2 ranks here share GPU 0 over gloo (which moves CUDA tensors through the host): each
rank is started by this command with RANK, WORLD_SIZE and LOCAL_RANK = 0 (Megatron binds the GPU
by LOCAL_RANK) and `--distributed-backend gloo`, its gradient all-reduces one bucket at a time
(mok_plugin.parallel.gloo_cuda: gloo coalesces CPU tensors only). That runs every code path of the combined 1F1B
schedule (the stage methods, the communication stream, the deferred weight gradients) as a
multi-GPU launch would. The tokens/s are those of two ranks time-sharing one GPU with host-side
all-to-alls: they compare stock with MoK and plain with overlap here, not with a real EP launch.

The model is small (so that gloo's exchange stays short): 2 layers, H 1024, 16 experts top-2,
sequence 1024, micro-batch 2, 4 micro-batches per rank (the schedule overlaps one micro-batch's
dispatch and combine with another's experts). The --delay-wgrad-compute variants need Transformer
Engine (Megatron's argument checks allow the flag with its layers only) and are skipped without it.
Each variant's log goes under --out; a table of tokens/s and first/last losses is printed last,
ep_overlap.json holds every iteration.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mok_plugin.parallel import keep_multicast_off

__all__ = ["VARIANTS", "main", "rank_env"]

ROOT = Path(__file__).resolve().parents[2]
RANKS, SEQ, MICRO_BATCH, MICRO_BATCHES = 2, 1024, 2, 4
MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MICRO_BATCH),
    "--global-batch-size", str(MICRO_BATCH * MICRO_BATCHES * RANKS),
    "--num-experts", "16", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--ffn-hidden-size", "2048",
    "--expert-model-parallel-size", str(RANKS), "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.001", "--swiglu",
    "--disable-bias-linear", "--bf16", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--log-interval", "1", "--seed", "1234",
    "--eval-iters", "0", "--eval-interval", "1000", "--split", "100,0,0", "--distributed-backend", "gloo",
]  # fmt: skip
OVERLAP = ["--overlap-moe-expert-parallel-comm"]
# Megatron's argument checks allow --delay-wgrad-compute with Transformer Engine's layers only.
DELAYED_WGRAD = ["--delay-wgrad-compute", "--transformer-impl", "transformer_engine"]
# name -> the flags beyond MODEL_ARGS
VARIANTS: dict[str, list[str]] = {
    "stock": [],
    "stock_overlap": OVERLAP,
    "stock_overlap_dw": [*OVERLAP, *DELAYED_WGRAD],
    "mok": ["--mok"],
    "mok_overlap": [*OVERLAP, "--mok"],
    "mok_overlap_dw": [*OVERLAP, *DELAYED_WGRAD, "--mok"],
}


def why_not(name: str) -> str | None:
    """Why a variant cannot run here (None: it can)."""
    if "--delay-wgrad-compute" in VARIANTS[name] and importlib.util.find_spec("transformer_engine") is None:
        return "Megatron allows --delay-wgrad-compute with Transformer Engine only (not installed)"
    return None


def rank_env(rank: int, port: int) -> dict[str, str]:
    """The environment of one rank: every rank on GPU 0 (LOCAL_RANK 0), multicast off."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(RANKS),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")  # fmt: skip
    return env


def run_variant(name: str, iters: int, out: Path, port: int, timeout_s: float) -> dict:
    """Both ranks of one variant; the last rank's log holds Megatron's iteration lines."""
    from mok_plugin.bench.multi_gpu import _iteration_log, failure_line

    command = [sys.executable, "-m", __name__, "--as-rank", str(ROOT / "scripts" / "pretrain_gpt.py"), *MODEL_ARGS,
               "--train-iters", str(iters), *VARIANTS[name]]  # fmt: skip
    logs = [out / f"{name}_rank{rank}.log" for rank in range(RANKS)]
    start = time.perf_counter()
    handles = [log.open("w") for log in logs]
    procs = [subprocess.Popen(command, cwd=ROOT, stdout=h, stderr=subprocess.STDOUT, env=rank_env(r, port))
             for r, h in enumerate(handles)]  # fmt: skip
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - start))))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            codes.append(124)
    for handle in handles:
        handle.close()
    seconds = time.perf_counter() - start
    code = next((c for c in codes if c != 0), 0)
    iterations = _iteration_log(logs[-1].read_text())
    if code != 0 or not iterations:
        failed_log = next((log for log, c in zip(logs, codes, strict=True) if c != 0), logs[-1])
        cause = failure_line(failed_log.read_text(), code)
        if code == 124:  # killed here: the log's last lines are whatever it printed before
            cause = f"ran past --job-timeout-s {timeout_s:.0f}"
        print(f"  {name} FAILED: {cause} (log: {failed_log})", flush=True)
        return {"status": "failed", "cause": cause, "seconds": seconds}
    steady = [it["ms"] for it in iterations if it["iteration"] > 2] or [it["ms"] for it in iterations]
    step_ms = statistics.median(steady)
    tokens = SEQ * MICRO_BATCH * MICRO_BATCHES * RANKS
    print(f"  {name}: ran in {seconds:.0f} s", flush=True)
    return {"status": "ran", "step_ms": step_ms, "tokens_per_s": tokens / (step_ms / 1e3), "iterations": iterations,
            "seconds": seconds}  # fmt: skip


def print_table(results: dict) -> None:
    print(f"\nEP-overlap schedule on one GPU (EP {RANKS} ranks sharing it over gloo), scripts/pretrain_gpt.py")
    print(f"{'variant':<18} {'step ms':>9} {'tokens/s':>9} {'first loss':>11} {'last loss':>10}")
    for name, r in results.items():
        if r["status"] != "ran":
            print(f"{name:<18} {r['status']}: {r.get('cause', '')}")
            continue
        losses = [it["loss"] for it in r["iterations"]]
        print(f"{name:<18} {r['step_ms']:>9.1f} {r['tokens_per_s']:>9.0f} {losses[0]:>11.5f} {losses[-1]:>10.5f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mok bench ep-overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/ep_overlap"), help="logs and ep_overlap.json")
    parser.add_argument("--iters", type=int, default=10, help="training iterations per variant (default 10)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which runs (default: all six)")  # fmt: skip
    parser.add_argument("--port", type=int, default=29533, help="the ranks' rendezvous port")
    parser.add_argument("--job-timeout-s", type=float, default=300.0, help="one variant's limit (default 300)")
    return parser.parse_args(argv)


def as_rank(script_and_args: list[str]) -> None:
    """One rank: the script run as __main__ with gloo's collectives made to take CUDA tensors."""
    from mok_plugin.parallel.gloo_cuda import run_collectives_one_by_one

    run_collectives_one_by_one()
    sys.argv = list(script_and_args)
    runpy.run_path(script_and_args[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-rank"]:
        as_rank(argv[1:])
        return 0
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("mok bench ep-overlap needs a CUDA GPU (Megatron's training loop runs on CUDA only)", file=sys.stderr)
        return 2
    keep_multicast_off()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for index, name in enumerate(args.variants):
        if (cause := why_not(name)) is not None:
            print(f"ep-overlap: {name} skipped: {cause}", flush=True)
            results[name] = {"status": "skipped", "cause": cause}
            continue
        print(f"ep-overlap: {name} ({index + 1}/{len(args.variants)}), {args.iters} iterations ...", flush=True)
        # A fresh port per variant: the last one's sockets may linger in TIME_WAIT.
        results[name] = run_variant(name, args.iters, args.out, args.port + index, args.job_timeout_s)
    (args.out / "ep_overlap.json").write_text(json.dumps({"model_args": MODEL_ARGS, "variants": results}, indent=1))
    print_table(results)
    return 0 if all(r["status"] != "failed" for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
