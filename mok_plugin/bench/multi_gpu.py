"""Multi-GPU run of the expert-parallel layer on one host: bitwise topology invariance, then
throughput against Megatron-Core's stock layer.

    mok bench multi-gpu --out out/multi_gpu            # every visible GPU
    mok bench multi-gpu --cpu --nprocs 2 --out out/    # gloo processes, small shapes: a smoke run
(`python scripts/multi_gpu.py ...` is the same command.)

Parts, each a job of its own over this host's GPUs, started by this command:
  1. invariance  tests/test_parallel_multi_gpu.py under pytest (it spawns one process per GPU): the
                 MoK layer at EP = 1, 2, 4, ... up to the GPU count on one global batch; outputs,
                 input gradients and expert weight gradients must be bitwise equal to EP = 1, for
                 capacity over NCCL, exact over NCCL, capacity over symmetric memory. It needs at
                 least 2 CUDA devices and skips otherwise (the gloo EP checks are tests/test_parallel.py).
  2. bench       `mok bench ep` under torchrun at EP = the GPU count for the qwen3-30b-a3b and
                 deepseek-v3 layer shapes with 4096 and 16384 tokens per GPU: per-stage times, bytes,
                 bandwidth, and Megatron-Core's stock alltoall MoELayer in the same run (GPUs only).
                 With --cpu: the "small" shape, 64 tokens per process.
  3. pretrain    scripts/pretrain_gpt.py (Megatron's training loop, mock data) at EP = DP = the GPU
                 count, with Megatron's stock MoE layer (alltoall dispatcher) and with --mok, the
                 same flags and seed otherwise: tokens/s (median over iterations after the first
                 two) and the loss at each iteration (GPUs only).
  4. layouts     pretrain_gpt.py, stock and MoK, under Megatron's parallel layouts: TP 2 with
                 sequence parallelism, PP 2 with virtual stages, the EP-overlap schedule, the
                 distributed optimizer, CP 2 (with Transformer Engine); see megatron_layouts.py
                 (at least 2 GPUs).

NVLink multicast stays off (mok_plugin.parallel.keep_multicast_off, inherited by every job).
Each job's log and JSON go under --out; multi_gpu.json holds everything; a table is printed last;
a job that fails is named in one line with its cause (the full log stays under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from mok_plugin.bench.megatron_layouts import print_layouts, run_layouts
from mok_plugin.parallel import keep_multicast_off

__all__ = ["failure_line", "invariance_rows", "main"]

ROOT = Path(__file__).resolve().parents[2]
INVARIANCE_TEST = ROOT / "tests" / "test_parallel_multi_gpu.py"
GPU_BENCH_SHAPES, GPU_TOKENS_PER_GPU = ["qwen3-30b-a3b", "deepseek-v3"], [4096, 16384]
# The CPU smoke run: the full shapes need tens of GiB per process in fp32 on the CPU.
CPU_BENCH_SHAPES, CPU_TOKENS_PER_GPU = ["small"], [64]
# Part 3's model: a small Qwen3-MoE-like GPT (64 experts, top-8) that Megatron runs without
# Transformer Engine or Apex (local layers; the fused kernels that need them off).
PRETRAIN_SEQ, PRETRAIN_MICRO_BATCH = 2048, 4
PRETRAIN_ARGS = [
    "--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", str(PRETRAIN_SEQ),
    "--max-position-embeddings", str(PRETRAIN_SEQ), "--micro-batch-size", str(PRETRAIN_MICRO_BATCH),
    "--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768", "--ffn-hidden-size", "6144",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "0.001", "--swiglu", "--disable-bias-linear", "--bf16", "--lr", "1e-4",
    "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "32000", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
    "--log-interval", "1", "--seed", "1234", "--eval-iters", "0", "--eval-interval", "1000", "--split", "100,0,0",
]  # fmt: skip


# ------------------------------------------------------------------------------- the driver ----


def failure_line(log_text: str, returncode: int) -> str:
    """One line saying why a job failed: the first exception a rank raised (not torchrun's
    ChildFailedError wrapper), else a kill by signal, else the log's last line."""
    if returncode in (-9, 137) or re.search(r"Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9", log_text):
        return "killed by SIGKILL (out of memory?)"
    for line in log_text.splitlines():
        found = re.search(r"\b([A-Za-z_.]*(?:Error|Exception|Interrupt)): (.*)", line)
        if found and "ChildFailedError" not in found[1]:
            return f"{found[1].rsplit('.', 1)[-1]}: {found[2].strip()}"[:300]
    lines = [line for line in log_text.splitlines() if line.strip()]
    return (lines[-1].strip() if lines else f"exit code {returncode}, no output")[:300]


def _run_job(command: list[str], log: Path, timeout_s: float, env: dict | None = None) -> tuple[int, float]:
    """Run command from the repository root, its output to log. (exit code; 124 on timeout, seconds)"""
    start = time.perf_counter()
    with log.open("w") as handle:
        handle.write("$ " + " ".join(command) + "\n")
        handle.flush()
        try:
            code = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                  env=env or os.environ, timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            handle.write(f"\nTimeoutError: the job ran past {timeout_s:.0f} s and was stopped\n")
            code = 124
    return code, time.perf_counter() - start


def _torchrun(nprocs: int, target: list[str], log: Path, timeout_s: float, env: dict | None = None
              ) -> tuple[int, float]:  # fmt: skip
    """target (a script and its arguments, or -m module ...) under torchrun with nprocs processes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
               *target]  # fmt: skip
    return _run_job(command, log, timeout_s, env)


def _report_failure(name: str, log: Path, code: int) -> str:
    line = failure_line(log.read_text(), code)
    print(f"  {name} FAILED: {line} (log: {log})", flush=True)
    return line


def invariance_rows(junit_xml: str) -> list[dict]:
    """pytest's JUnit XML -> [{"test", "outcome": passed|failed|skipped, "message"}]."""
    rows = []
    for case in ET.fromstring(junit_xml).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = (child.get("message") or "").splitlines()[0] if child.get("message") else ""
        rows.append({"test": case.get("name"), "outcome": outcome, "message": message})
    return rows


def run_invariance(args, nprocs: int, out: Path, on_gpu: bool) -> dict:
    """Part 1: tests/test_parallel_multi_gpu.py under pytest; its cases as table rows."""
    log, xml = out / "invariance.log", out / "invariance.xml"
    print(f"part 1: invariance, {INVARIANCE_TEST.relative_to(ROOT)} on {nprocs} {'GPUs' if on_gpu else 'CPU'} ...",
          flush=True)  # fmt: skip
    env = dict(os.environ)
    if on_gpu:  # the test uses every visible device: show it the first nprocs
        visible = env.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[:nprocs])
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INVARIANCE_TEST),
               f"--junitxml={xml}"]  # fmt: skip
    code, seconds = _run_job(command, log, args.job_timeout_s, env)
    rows = invariance_rows(xml.read_text()) if xml.exists() else []
    if code not in (0, 5) or not rows or any(r["outcome"] == "failed" for r in rows):
        return {"status": "failed", "cause": _report_failure("invariance", log, code), "rows": rows, "log": str(log)}
    if all(r["outcome"] == "skipped" for r in rows):
        reason = rows[0]["message"] or "skipped"
        print(f"  skipped: {reason}", flush=True)
        return {"status": "skipped", "cause": reason, "rows": rows, "log": str(log)}
    print(f"  passed in {seconds:.0f} s", flush=True)
    return {"status": "passed", "rows": rows, "log": str(log)}


def run_bench(args, nprocs: int, out: Path, on_gpu: bool) -> list[dict]:
    """Part 2: `mok bench ep` under torchrun on the named shapes (small ones with --cpu)."""
    results = []
    for shape in args.bench_shapes:
        for tokens in args.tokens_per_gpu:
            name = f"bench_{shape.replace(',', 'x')}_{tokens}"
            job_out = out / name
            print(f"part 2: {name} (EP = {nprocs}) ...", flush=True)
            bench_args = ["--shape", shape, "--tokens-per-rank", str(tokens), "--out", str(job_out),
                          "--iters", str(args.iters)]  # fmt: skip
            if on_gpu:
                bench_args.append("--megatron")
            target = ["-m", "mok_plugin.cli", "bench", "ep", *bench_args]
            # A CPU run stays on gloo and the CPU even where GPUs are present.
            env = None if on_gpu else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
            code, seconds = _torchrun(nprocs, target, out / f"{name}.log", args.job_timeout_s, env)
            row = {"shape": shape, "tokens_per_gpu": tokens, "ep": nprocs, "status": "failed"}
            if code == 0:
                row.update(json.loads((job_out / "bench_ep.json").read_text()), status="ran")
                print(f"  ran in {seconds:.0f} s", flush=True)
            else:
                row["cause"] = _report_failure(name, out / f"{name}.log", code)
            results.append(row)
    return results


def _iteration_log(log_text: str) -> list[dict]:
    """Megatron's per-iteration log lines -> [{iteration, ms, loss}]."""
    pattern = re.compile(
        r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: ([\dEe.+-]+)"
    )
    return [{"iteration": int(m[1]), "ms": float(m[2]), "loss": float(m[3])} for m in pattern.finditer(log_text)]


def run_pretrain(args, nprocs: int, out: Path) -> dict:
    """Part 3: scripts/pretrain_gpt.py with the stock layer and with --mok; tokens/s and losses."""
    rows = {}
    for variant, extra in (("stock", []), ("mok", ["--mok"])):
        log = out / f"pretrain_{variant}.log"
        print(
            f"part 3: pretrain_gpt.py, {variant}, EP = DP = {nprocs}, {args.pretrain_iters} iterations ...", flush=True
        )
        layout = [
            "--expert-model-parallel-size",
            str(nprocs),
            "--global-batch-size",
            str(PRETRAIN_MICRO_BATCH * nprocs),
        ]
        command = [*PRETRAIN_ARGS, *layout, "--train-iters", str(args.pretrain_iters), *extra]
        code, seconds = _torchrun(nprocs, [str(ROOT / "scripts" / "pretrain_gpt.py"), *command], log,
                                  args.job_timeout_s)  # fmt: skip
        iterations = _iteration_log(log.read_text())
        if code != 0 or not iterations:
            _report_failure(f"pretrain ({variant})", log, code)
            rows[variant] = {"status": "failed", "log": str(log)}
            continue
        steady = [it["ms"] for it in iterations if it["iteration"] > 2] or [it["ms"] for it in iterations]
        step_ms = statistics.median(steady)
        tokens_per_s = PRETRAIN_SEQ * PRETRAIN_MICRO_BATCH * nprocs / (step_ms / 1e3)
        rows[variant] = {"status": "ran", "iterations": iterations, "step_ms": step_ms, "tokens_per_s": tokens_per_s,
                         "step1_loss": iterations[0]["loss"]}  # fmt: skip
        print(f"  ran in {seconds:.0f} s", flush=True)
    failed = any(r["status"] != "ran" for r in rows.values())
    return {"status": "failed" if failed else "ran", "ep": nprocs, **rows}


def run_checkpoint_check(args, nprocs: int, out: Path) -> dict:
    """Stock saves (torch_dist) after 2 iterations; MoK and stock each resume from it for one
    iteration (same weights, same data: the iteration-3 losses must agree to bf16 rounding); then
    stock resumes from the checkpoint MoK saved (MoK -> stock)."""
    base = [*PRETRAIN_ARGS, "--expert-model-parallel-size", str(nprocs), "--global-batch-size",
            str(PRETRAIN_MICRO_BATCH * nprocs), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--ckpt-format", "torch_dist", "--save-interval", "1000", "--lr-decay-iters", "100"]  # fmt: skip
    stock_ckpt, mok_ckpt = out / "ckpt_stock", out / "ckpt_mok"
    resume = ["--no-load-optim", "--no-load-rng"]
    steps = [
        ("stock_save", [*base, "--train-iters", "2", "--save", str(stock_ckpt)]),
        ("mok_resume", [*base, "--train-iters", "3", "--load", str(stock_ckpt), *resume, "--save", str(mok_ckpt),
                        "--mok"]),
        ("stock_resume", [*base, "--train-iters", "3", "--load", str(stock_ckpt), *resume]),
        ("stock_from_mok", [*base, "--train-iters", "4", "--load", str(mok_ckpt), *resume]),
    ]  # fmt: skip
    result: dict = {"status": "ran"}
    for name, command in steps:
        log = out / f"checkpoint_{name}.log"
        print(f"part 3b: checkpoint {name} ...", flush=True)
        code, _ = _torchrun(nprocs, [str(ROOT / "scripts" / "pretrain_gpt.py"), *command], log, args.job_timeout_s)
        iterations = _iteration_log(log.read_text())
        if code != 0 or not iterations:
            _report_failure(f"checkpoint {name}", log, code)
            result["status"] = "failed"
            break
        result[name] = {it["iteration"]: it["loss"] for it in iterations}
    if result["status"] == "ran":
        stock3, mok3 = result["stock_resume"][3], result["mok_resume"][3]
        result["iteration3"] = {"stock": stock3, "mok": mok3, "abs_diff": abs(stock3 - mok3)}
    return result


def print_table(result: dict) -> None:
    """Every part's result in one table, printed last."""
    print(f"\nmulti_gpu: {result['nprocs']} x {result['device']}, {result['date']}")
    inv = result["invariance"]
    print(f"\n1. topology invariance (EP sizes bitwise equal to EP = 1): {inv['status']}"
          + (f" ({inv['cause']})" if inv.get("cause") else ""))  # fmt: skip
    for r in inv.get("rows", []) if inv["status"] != "skipped" else []:
        print(f"  {r['test']:<60} {r['outcome']}" + (f": {r['message']}" if r["message"] else ""))
    print("\n2. layer at EP = GPU count (ms: slowest rank, median over iterations; fwd+bwd)")
    print(f"{'shape':<16} {'tok/GPU':>8} {'dispatch':>9} {'experts':>8} {'combine':>8} {'MoK fwd':>8} "
          f"{'MoK bwd':>8} {'sent MB':>8} {'GB/s':>7} {'Megatron':>9} {'speedup':>8}")  # fmt: skip
    for r in result["bench"]:
        if r["status"] != "ran":
            print(f"{r['shape']:<16} {r['tokens_per_gpu']:>8}  failed: {r.get('cause', '')}")
            continue
        s = r["slowest_rank_median"]
        sent = max(v["bytes"] for v in r["per_rank"].values())
        gbps = sent / (s["dispatch"] * 1e-3) / 1e9 if s["dispatch"] > 0 else 0.0
        mok = s["forward"] + s["backward"]
        m = r.get("megatron_slowest_rank_median")
        meg = m["forward"] + m["backward"] if m else None
        print(f"{r['shape']:<16} {r['tokens_per_gpu']:>8} {s['dispatch']:>9.2f} {s['experts']:>8.2f} "
              f"{s['combine']:>8.2f} {s['forward']:>8.2f} {s['backward']:>8.2f} {sent / 1e6:>8.1f} {gbps:>7.1f} "
              f"{(f'{meg:.2f}' if meg else '-'):>9} {(f'{meg / mok:.2f}x' if meg else '-'):>8}")  # fmt: skip
    pre = result["pretrain"]
    print(f"\n3. Megatron GPT pretraining (scripts/pretrain_gpt.py), stock vs MoK: {pre['status']}")
    if pre["status"] in ("ran", "failed"):
        print(f"{'variant':<8} {'step ms':>9} {'tokens/s':>10} {'step-1 loss':>12}  losses")
        for variant in ("stock", "mok"):
            r = pre.get(variant, {})
            if r.get("status") != "ran":
                print(f"{variant:<8} failed")
                continue
            losses = " ".join(f"{it['loss']:.4f}" for it in r["iterations"])
            print(f"{variant:<8} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} {r['step1_loss']:>12.4f}  {losses}")
    ckpt = result.get("checkpoint", {"status": "skipped"})
    print(f"\n3b. checkpoints (torch_dist), stock -> MoK -> stock: {ckpt['status']}")
    if "iteration3" in ckpt:
        i3 = ckpt["iteration3"]
        print(
            f"  iteration-3 loss after resuming the stock checkpoint: stock {i3['stock']:.6f}, MoK {i3['mok']:.6f} "
            f"(|diff| {i3['abs_diff']:.2e}); stock resumed from MoK's checkpoint: "
            f"iteration-4 loss {ckpt['stock_from_mok'][4]:.6f}"
        )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench multi-gpu` (and scripts/multi_gpu.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", type=Path, default=Path("out/multi_gpu"))
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU, small shapes (a smoke run)")
    parser.add_argument("--nprocs", type=int, default=None, help="default: the GPU count (2 with --cpu)")
    parser.add_argument(
        "--bench-shapes",
        nargs="+",
        default=None,
        help=f"default: {' '.join(GPU_BENCH_SHAPES)} ({' '.join(CPU_BENCH_SHAPES)} with --cpu)",
    )
    parser.add_argument("--tokens-per-gpu", nargs="+", type=int, default=None,
                        help=f"default: {' '.join(map(str, GPU_TOKENS_PER_GPU))} "
                             f"({' '.join(map(str, CPU_TOKENS_PER_GPU))} with --cpu)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--pretrain-iters", type=int, default=10)
    parser.add_argument("--job-timeout-s", type=float, default=1800.0, help="stop a job that runs longer")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["invariance", "bench", "pretrain", "checkpoint", "layouts"]
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the parts; 0 when every part that ran passed, 1 otherwise."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    keep_multicast_off()
    on_gpu = torch.cuda.is_available() and not args.cpu
    nprocs = args.nprocs or (torch.cuda.device_count() if on_gpu else 2)
    if on_gpu and nprocs > torch.cuda.device_count():
        parser.error(f"--nprocs {nprocs} is more than the {torch.cuda.device_count()} visible GPUs")
    if not on_gpu and not args.cpu:
        parser.error("no CUDA GPU here; pass --cpu for a smoke run with gloo processes")
    args.bench_shapes = args.bench_shapes or (GPU_BENCH_SHAPES if on_gpu else CPU_BENCH_SHAPES)
    args.tokens_per_gpu = args.tokens_per_gpu or (GPU_TOKENS_PER_GPU if on_gpu else CPU_TOKENS_PER_GPU)
    if nprocs < 2:
        print("warning: one rank only: EP = 1 is all that can run; the invariance check compares nothing")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "nprocs": nprocs,
        "device": torch.cuda.get_device_name(0) if on_gpu else "CPU (gloo)",
        "date": time.strftime("%Y-%m-%d"),
        "invariance": {"status": "skipped"},
        "bench": [],
        "pretrain": {"status": "skipped"},
    }
    if "invariance" not in args.skip:
        result["invariance"] = run_invariance(args, nprocs, args.out, on_gpu)
    if "bench" not in args.skip:
        result["bench"] = run_bench(args, nprocs, args.out, on_gpu)
    if "pretrain" not in args.skip:
        if on_gpu:
            result["pretrain"] = run_pretrain(args, nprocs, args.out)
        else:
            result["pretrain"] = {"status": "not run: Megatron's training loop needs GPUs"}
    if "checkpoint" not in args.skip and on_gpu:
        result["checkpoint"] = run_checkpoint_check(args, nprocs, args.out)
    if "layouts" not in args.skip and on_gpu and nprocs >= 2:
        result["layouts"] = run_layouts(args, nprocs, args.out)
    (args.out / "multi_gpu.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    if "layouts" in result:
        print_layouts(result["layouts"])
    failed = (
        result["invariance"]["status"] == "failed"
        or any(r["status"] != "ran" for r in result["bench"])
        or result["pretrain"]["status"] == "failed"
        or result.get("checkpoint", {}).get("status") == "failed"
        or result.get("layouts", {}).get("status") == "failed"
    )
    return 1 if failed else 0
