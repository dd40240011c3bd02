"""Multi-GPU run of the expert-parallel layer on one host: bitwise topology invariance, then
throughput against Megatron-Core's stock layer.

    python scripts/multi_gpu.py --out out/multi_gpu            # every visible GPU (torchrun jobs)
    python scripts/multi_gpu.py --cpu --nprocs 2 --out out/    # gloo processes: a smoke run

Parts, each one torchrun job (or several) over this host's GPUs, started by this script:
  1. invariance  the MoK layer at EP = 1, 2, 4, ... up to the GPU count on one global batch; outputs,
                 input gradients and expert weight gradients must be bitwise equal to EP = 1, for
                 each exchange/transport: capacity over NCCL, exact over NCCL, capacity over
                 symmetric memory (GPUs only).
  2. bench       scripts/bench_ep.py at EP = the GPU count for the qwen3-30b-a3b and deepseek-v3
                 layer shapes with 4096 and 16384 tokens per GPU: per-stage times, bytes, bandwidth,
                 and Megatron-Core's stock alltoall MoELayer in the same run (GPUs only).
  3. pretrain    scripts/pretrain_gpt.py (Megatron's training loop, mock data) at EP = DP = the GPU
                 count, with Megatron's stock MoE layer (alltoall dispatcher) and with --mok, the
                 same flags and seed otherwise: tokens/s (median over iterations after the first
                 two) and the loss at each iteration (GPUs only).

NVLink multicast stays off (mok_plugin.parallel.keep_multicast_off, passed to every job).
Each job's log and JSON go under --out; multi_gpu.json holds everything; a table is printed last.
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
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mok_plugin import MoKConfig, MoKMoE  # noqa: E402
from mok_plugin.parallel import keep_multicast_off  # noqa: E402
from mok_plugin.testing import make_layer_inputs  # noqa: E402

# (name, top_k, skewed): skewed sends every first choice to expert 0 (on rank 0).
INVARIANCE_CASES = [("top8_uniform", 8, False), ("top2_skewed", 2, True), ("top1_uniform", 1, False)]
# (transport, exchange)
INVARIANCE_PATHS_GPU = [("nccl", "capacity"), ("nccl", "exact"), ("symmetric_memory", "capacity")]
INVARIANCE_PATHS_CPU = [("nccl", "capacity"), ("nccl", "exact")]
COMPARED = ("out", "d_x", "d_gate_up_proj", "d_down_proj")
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


# ---------------------------------------------------------------- part 1, one torchrun rank ----


def _run_invariance_case(shape, case, path, ep: int, group, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's share of one EP = ep run of the layer: outputs and gradients, on the CPU."""
    T, H, I, E = shape
    name, top_k, skewed = case
    transport, exchange = path
    rank = dist.get_rank(group)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=top_k, num_shared_experts=1,
                       score_function="sigmoid", expert_bias=skewed, params_dtype=dtype, ep_size=ep,
                       ep_exchange=exchange, ep_transport=transport, ep_capacity_factor=float(ep))  # fmt: skip
    layer = MoKMoE(config, ep_group=group, device=device, seed=3, init_std=0.05)
    if skewed:
        with torch.no_grad():
            layer.expert_bias[0] = 100.0
    rows = slice(rank * T // ep, (rank + 1) * T // ep)
    x = make_layer_inputs(T, H, dtype=layer.params_dtype, device=device, seed=4)[rows].clone().requires_grad_()
    probe = make_layer_inputs(T, H, device=device, seed=5)[rows]
    out, aux = layer(x)
    ((out.float() * probe).sum() + aux).backward()
    result = {"out": out, "d_x": x.grad, "d_gate_up_proj": layer.experts.gate_up_proj.grad,
              "d_down_proj": layer.experts.down_proj.grad}  # fmt: skip
    return {k: v.detach().cpu() for k, v in result.items()}


def _assemble(shares: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rank-major concatenation: tokens for out/d_x, experts for the weight gradients."""
    return {k: torch.cat([share[k] for share in shares]) for k in COMPARED}


def ep_sizes(world: int, num_experts: int) -> list[int]:
    """1, 2, 4, ... up to world, keeping those that divide the expert count."""
    sizes, ep = [], 1
    while ep <= world:
        if num_experts % ep == 0:
            sizes.append(ep)
        ep *= 2
    return sizes


def invariance_worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    shape = tuple(int(v) for v in args.invariance_shape.split(","))
    sizes = ep_sizes(world, shape[3])
    groups = {ep: dist.new_group(list(range(ep))) for ep in sizes}  # every rank joins every new_group
    rows = []
    try:
        for path in INVARIANCE_PATHS_GPU if on_gpu else INVARIANCE_PATHS_CPU:
            for case in INVARIANCE_CASES:
                expected = None
                for ep in sizes:
                    start = time.perf_counter()
                    share = _run_invariance_case(shape, case, path, ep, groups[ep], device) if rank < ep else None
                    shares: list | None = [None] * world if rank == 0 else None
                    dist.gather_object(share, shares, dst=0)
                    if rank != 0:
                        continue
                    got = _assemble(shares[:ep])
                    if expected is None:
                        expected = got
                    equal = {k: bool(torch.equal(got[k], expected[k])) for k in COMPARED}
                    row = {"transport": path[0], "exchange": path[1], "case": case[0], "ep": ep,
                           "bitwise": all(equal.values()), "equal": equal,
                           "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
                    rows.append(row)
                    print(f"[invariance] {path[0]}/{path[1]} {case[0]} EP={ep}: "
                          f"{'bitwise equal' if row['bitwise'] else 'DIFFERS ' + str(equal)}", flush=True)  # fmt: skip
        if rank == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            result = {"shape": shape, "world": world, "device": str(device), "rows": rows}
            (Path(args.out) / "invariance.json").write_text(json.dumps(result, indent=2))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- the driver ----


def _torchrun(nprocs: int, script: Path, script_args: list[str], log: Path) -> tuple[int, float]:
    """Run script under torchrun with nprocs processes; its output goes to log. (exit code, seconds)"""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
               str(script), *script_args]  # fmt: skip
    start = time.perf_counter()
    with log.open("w") as handle:
        handle.write("$ " + " ".join(command) + "\n")
        handle.flush()
        code = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=os.environ).returncode
    return code, time.perf_counter() - start


def _report_failure(name: str, log: Path) -> None:
    print(f"  {name} FAILED; last lines of {log}:")
    print("    " + "\n    ".join(log.read_text().splitlines()[-25:]))


def run_invariance(args, nprocs: int, out: Path) -> dict:
    log = out / "invariance.log"
    print(f"part 1: invariance, EP = {ep_sizes(nprocs, int(args.invariance_shape.split(',')[3]))} ...", flush=True)
    job_args = ["--part", "invariance", "--out", str(out), "--invariance-shape", args.invariance_shape]
    code, seconds = _torchrun(nprocs, Path(__file__), job_args + (["--cpu"] if args.cpu else []), log)
    if code != 0:
        _report_failure("invariance", log)
        return {"status": "failed", "log": str(log)}
    result = json.loads((out / "invariance.json").read_text())
    result["status"] = "passed" if all(r["bitwise"] for r in result["rows"]) else "differs"
    print(f"  {result['status']} in {seconds:.0f} s", flush=True)
    return result


def run_bench(args, nprocs: int, out: Path, on_gpu: bool) -> list[dict]:
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
            code, seconds = _torchrun(nprocs, ROOT / "scripts" / "bench_ep.py", bench_args, out / f"{name}.log")
            row = {"shape": shape, "tokens_per_gpu": tokens, "ep": nprocs, "status": "failed"}
            if code == 0:
                row.update(json.loads((job_out / "bench_ep.json").read_text()), status="ran")
                print(f"  ran in {seconds:.0f} s", flush=True)
            else:
                _report_failure(name, out / f"{name}.log")
            results.append(row)
    return results


def _iteration_log(log_text: str) -> list[dict]:
    """Megatron's per-iteration log lines -> [{iteration, ms, loss}]."""
    pattern = re.compile(
        r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: ([\dEe.+-]+)"
    )
    return [{"iteration": int(m[1]), "ms": float(m[2]), "loss": float(m[3])} for m in pattern.finditer(log_text)]


def run_pretrain(args, nprocs: int, out: Path) -> dict:
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
        code, seconds = _torchrun(nprocs, ROOT / "scripts" / "pretrain_gpt.py", command, log)
        iterations = _iteration_log(log.read_text())
        if code != 0 or not iterations:
            _report_failure(f"pretrain ({variant})", log)
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
        code, _ = _torchrun(nprocs, ROOT / "scripts" / "pretrain_gpt.py", command, log)
        iterations = _iteration_log(log.read_text())
        if code != 0 or not iterations:
            _report_failure(f"checkpoint {name}", log)
            result["status"] = "failed"
            break
        result[name] = {it["iteration"]: it["loss"] for it in iterations}
    if result["status"] == "ran":
        stock3, mok3 = result["stock_resume"][3], result["mok_resume"][3]
        result["iteration3"] = {"stock": stock3, "mok": mok3, "abs_diff": abs(stock3 - mok3)}
    return result


def print_table(result: dict) -> None:
    print(f"\nmulti_gpu: {result['nprocs']} x {result['device']}, {result['date']}")
    inv = result["invariance"]
    print(f"\n1. topology invariance (shape T,H,I,E = {result['invariance_shape']}): {inv['status']}")
    if "rows" in inv:
        print(f"{'transport/exchange':<28} {'case':<14} {'EP':>3}  bitwise vs EP=1")
        for r in inv["rows"]:
            print(f"{r['transport'] + '/' + r['exchange']:<28} {r['case']:<14} {r['ep']:>3}  "
                  f"{'yes' if r['bitwise'] else 'NO ' + str(r['equal'])}")  # fmt: skip
    print("\n2. layer at EP = GPU count (ms: slowest rank, median over iterations; fwd+bwd)")
    print(f"{'shape':<16} {'tok/GPU':>8} {'dispatch':>9} {'experts':>8} {'combine':>8} {'MoK fwd':>8} "
          f"{'MoK bwd':>8} {'sent MB':>8} {'GB/s':>7} {'Megatron':>9} {'speedup':>8}")  # fmt: skip
    for r in result["bench"]:
        if r["status"] != "ran":
            print(f"{r['shape']:<16} {r['tokens_per_gpu']:>8}  failed")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/multi_gpu"))
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (a smoke run)")
    parser.add_argument("--nprocs", type=int, default=None, help="default: the GPU count (2 with --cpu)")
    parser.add_argument("--invariance-shape", default="4096,1024,512,64", help="T,H,I,E of part 1 (global T)")
    parser.add_argument("--bench-shapes", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"])
    parser.add_argument("--tokens-per-gpu", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--pretrain-iters", type=int, default=10)
    parser.add_argument("--skip", nargs="*", default=[], choices=["invariance", "bench", "pretrain", "checkpoint"])
    parser.add_argument("--part", choices=["invariance"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    keep_multicast_off()
    if args.part == "invariance":
        invariance_worker(args)
        return 0
    on_gpu = torch.cuda.is_available() and not args.cpu
    nprocs = args.nprocs or (torch.cuda.device_count() if on_gpu else 2)
    if on_gpu and nprocs > torch.cuda.device_count():
        parser.error(f"--nprocs {nprocs} is more than the {torch.cuda.device_count()} visible GPUs")
    if not on_gpu and not args.cpu:
        parser.error("no CUDA GPU here; pass --cpu for a smoke run with gloo processes")
    if nprocs < 2:
        print("warning: one rank only: EP = 1 is all that can run; the invariance check compares nothing")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "nprocs": nprocs,
        "device": torch.cuda.get_device_name(0) if on_gpu else "CPU (gloo)",
        "date": time.strftime("%Y-%m-%d"),
        "invariance_shape": args.invariance_shape,
        "invariance": {"status": "skipped"},
        "bench": [],
        "pretrain": {"status": "skipped"},
    }
    if "invariance" not in args.skip:
        result["invariance"] = run_invariance(args, nprocs, args.out)
    if "bench" not in args.skip:
        result["bench"] = run_bench(args, nprocs, args.out, on_gpu)
    if "pretrain" not in args.skip:
        if on_gpu:
            result["pretrain"] = run_pretrain(args, nprocs, args.out)
        else:
            result["pretrain"] = {"status": "not run: Megatron's training loop needs GPUs"}
    if "checkpoint" not in args.skip and on_gpu:
        result["checkpoint"] = run_checkpoint_check(args, nprocs, args.out)
    (args.out / "multi_gpu.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    failed = (
        result["invariance"]["status"] in ("failed", "differs")
        or any(r["status"] != "ran" for r in result["bench"])
        or result["pretrain"]["status"] == "failed"
        or result.get("checkpoint", {}).get("status") == "failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
