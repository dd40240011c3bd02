"""Time the expert-parallel MoK layer per rank: dispatch, experts and combine of the forward, the
backward, bytes sent to other ranks and the bandwidth achieved.

On GPUs, under torchrun (NCCL, one GPU per rank):
    torchrun --nproc-per-node 8 -m mok_plugin.cli bench ep --shape qwen3-30b-a3b --tokens-per-rank 4096
    torchrun --nproc-per-node 8 scripts/bench_ep.py --shape qwen3-30b-a3b --tokens-per-rank 4096   # the same
On the CPU, gloo processes spawned by the command itself (the reference backend; slow, for checks):
    mok bench ep --nprocs 4 --shape 64,256,128,16,4 --tokens-per-rank 64

--transport symmetric_memory pulls the capacity exchange's blocks from peers' NVLink buffers
instead of NCCL's all-to-all (GPUs only). --megatron also times Megatron-Core's stock MoELayer
(alltoall dispatcher, SequentialMLP experts, its own router) with the same EP size, tokens and
shape in the same run; its time is forward and backward only (no stage split).

`--shape` is a named shape or T,H,I,E,K; T is replaced by --tokens-per-rank (tokens on each rank).
Forward and backward are timed with the device synchronised at both ends of each (CUDA events on
GPUs, the host clock on the CPU). The stages come from a second, profiled run of the forward: the
layer opens the torch.profiler ranges mok_plugin.ep.dispatch, .experts and .combine, and a stage's
time is its range's span on the device (on the CPU: the range's host time). Per stage, the slowest
rank of each iteration is taken, then the median over iterations. A table is printed last on rank
0; --out writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.bench.breakdown import range_times
from mok_plugin.bench.timing import slowest_rank_median
from mok_plugin.parallel import keep_multicast_off
from mok_plugin.parallel.dispatch import PROFILER_RANGES
from mok_plugin.testing import NAMED_SHAPES, MoEShape, exit_without_teardown, free_port, make_layer_inputs, parse_shape

__all__ = ["STAGE_RANGES", "PassTimer", "main", "stage_times_per_iteration"]

STAGES = ("forward", "dispatch", "experts", "combine", "backward")
MEGATRON_STAGES = ("forward", "backward")
# The forward's expert-parallel stages, as the layer names its torch.profiler ranges.
STAGE_RANGES = dict(zip(("dispatch", "experts", "combine"), PROFILER_RANGES, strict=True))


class PassTimer:
    """Milliseconds of each named pass, with the device synchronised at both ends (a benchmark may
    sync): CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            self.times[name] = (time.perf_counter() - start) * 1e3
            return
        torch.cuda.synchronize(self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        torch.cuda.synchronize(self.device)
        self.times[name] = begin.elapsed_time(end)


def stage_times_per_iteration(events, iters: int) -> list[dict[str, float]]:
    """Each profiled forward's stage times from a torch.profiler run of `iters` forwards.

    A stage whose range never ran (one rank: no dispatch or combine) is 0. A range opened several
    times per forward is summed per forward.

    Raises:
        ValueError: a range ran a number of times that is not a multiple of iters.
    """
    per_stage = range_times(events, STAGE_RANGES.values())
    result: list[dict[str, float]] = [{} for _ in range(iters)]
    for stage, name in STAGE_RANGES.items():
        times = per_stage[name]
        if len(times) % iters:
            raise ValueError(f"range {name} ran {len(times)} times in {iters} forwards")
        per = len(times) // iters
        for i in range(iters):
            result[i][stage] = sum(times[i * per : (i + 1) * per])
    return result


def profile_stages(layer: torch.nn.Module, x: torch.Tensor, iters: int, device: torch.device,
                   skip: int = 1) -> list[dict[str, float]]:  # fmt: skip
    """The stages of `iters` forwards (with autograd recording, as in training; no backward) under
    torch.profiler, read from the layer's ranges. The first `skip` forwards run under the profiler
    too but are not counted: ranks start their profilers at different moments, and the first
    collective absorbs that (200 ms in a 2-rank gloo run)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(skip + iters):
            out, _ = layer(x.detach().requires_grad_())
            del out
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return stage_times_per_iteration(prof.events(), skip + iters)[skip:]


def sent_bytes(layer: MoKMoE, x: torch.Tensor, exchange: str, capacity_factor: float, world: int) -> int:
    """Bytes this rank sends to other ranks in one forward dispatch (rows + weights + expert ids)."""
    with torch.no_grad():
        routing = layer.route(x)
    E_local = layer.config.num_experts // world
    per_row = x.shape[1] * x.element_size() + 4 + 8
    if exchange == "capacity":
        slots = max(1, -(-int(capacity_factor * routing.topk_ids.numel()) // world))
        return (world - 1) * slots * per_row
    dest = routing.topk_ids.flatten() // E_local
    return int((dest != dist.get_rank()).sum()) * per_row


def run_rank(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict | None:
    """This rank's iteration times (forward, backward, stages) and sent bytes; rank 0 gets every rank's."""
    shape = parse_shape(args.shape)
    T, H, I, E, K = args.tokens_per_rank, shape.H, shape.I, shape.E, shape.K
    cfg = MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=K, ep_size=world,
                    ep_exchange=args.exchange, ep_capacity_factor=args.capacity_factor,
                    ep_transport=args.transport, params_dtype=args.dtype, backend="auto")  # fmt: skip
    layer = MoKMoE(cfg, ep_group=dist.group.WORLD, device=device, seed=0)
    x = make_layer_inputs(T, H, dtype=layer.params_dtype, device=device, seed=rank + 1)
    grad = make_layer_inputs(T, H, dtype=layer.params_dtype, device=device, seed=rank + 101)
    timer = PassTimer(device)
    per_iter = []
    for i in range(args.warmup + args.iters):
        xi = x.detach().requires_grad_()
        with timer("forward"):
            out, aux = layer(xi)
        with timer("backward"):
            out.backward(grad)
        if i >= args.warmup:
            per_iter.append(dict(timer.times))
    del out, aux
    for totals, stages in zip(per_iter, profile_stages(layer, x, args.iters, device), strict=True):
        totals.update(stages)
    nbytes = sent_bytes(layer, x, args.exchange, args.capacity_factor, world)
    mine = {"rank": rank, "iters": per_iter, "bytes": nbytes}
    if args.megatron:
        del layer
        mine["megatron_iters"] = time_megatron_stock(args, shape, world, device, x, grad)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered if rank == 0 else None


def time_megatron_stock(args, shape, world: int, device: torch.device, x, grad) -> list[dict]:
    """Forward and backward times of Megatron-Core's stock MoELayer (EP = world) on x."""
    from megatron.core import parallel_state

    from mok_plugin.bench.providers import build_megatron_moe

    T, H = x.shape
    # alltoall is Megatron's dispatcher for EP > 1; it needs CUDA streams, so the CPU check uses allgather.
    dispatcher = "alltoall" if device.type == "cuda" else "allgather"
    layer = build_megatron_moe(MoEShape(T, H, shape.I, shape.E, shape.K), dispatcher, device, ep_size=world)
    dtype = next(layer.parameters()).dtype  # bf16, as Megatron runs it
    x, grad = x.to(dtype), grad.to(dtype)
    timer, per_iter = PassTimer(device), []
    try:
        for i in range(args.warmup + args.iters):
            xi = x.detach().view(T, 1, H).requires_grad_()
            with timer("forward"):
                out, _ = layer(xi)
            with timer("backward"):
                out.backward(grad.view(T, 1, H))
            if i >= args.warmup:
                per_iter.append(dict(timer.times))
    finally:
        parallel_state.destroy_model_parallel()
    return per_iter


def summarize(gathered: list[dict]) -> dict:
    """Per rank: the median of each stage and the bytes sent; over ranks: slowest rank, then median."""
    per_rank = {}
    for g in gathered:
        per_rank[g["rank"]] = {s: statistics.median(it.get(s, 0.0) for it in g["iters"]) for s in STAGES}
        per_rank[g["rank"]]["bytes"] = g["bytes"]
    summary = {"per_rank": per_rank, "slowest_rank_median": slowest_rank_median([g["iters"] for g in gathered], STAGES)}
    if "megatron_iters" in gathered[0]:
        summary["megatron_slowest_rank_median"] = slowest_rank_median(
            [g["megatron_iters"] for g in gathered], MEGATRON_STAGES
        )
    return summary


def print_table(summary: dict, args: argparse.Namespace, world: int, backend: str) -> None:
    """The per-rank table, slowest rank per iteration then the median, printed last."""
    print(
        f"\nbench_ep: shape {args.shape}, {args.tokens_per_rank} tokens/rank, {world} ranks ({backend}), "
        f"exchange {args.exchange}, transport {args.transport}, dtype {args.dtype}"
    )
    print(
        f"{'rank':>8} {'forward ms':>11} {'dispatch ms':>12} {'experts ms':>11} {'combine ms':>11} "
        f"{'backward ms':>12} {'sent MB':>9} {'dispatch GB/s':>14}"
    )
    for rank, row in sorted(summary["per_rank"].items()):
        gbps = row["bytes"] / (row["dispatch"] * 1e-3) / 1e9 if row["dispatch"] > 0 else 0.0
        print(
            f"{rank:>8} {row['forward']:>11.3f} {row['dispatch']:>12.3f} {row['experts']:>11.3f} "
            f"{row['combine']:>11.3f} {row['backward']:>12.3f} {row['bytes'] / 1e6:>9.2f} {gbps:>14.2f}"
        )
    s = summary["slowest_rank_median"]
    print(
        f"{'max':>8} {s['forward']:>11.3f} {s['dispatch']:>12.3f} {s['experts']:>11.3f} {s['combine']:>11.3f} "
        f"{s['backward']:>12.3f}"
    )
    m = summary.get("megatron_slowest_rank_median")
    if m:
        print(f"{'megatron':>8} {m['forward']:>11.3f} {'':>12} {'':>11} {'':>11} {m['backward']:>12.3f}")
    print("dispatch GB/s = bytes sent to other ranks / dispatch time (the stage also sorts and exchanges metadata)")


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """A gloo process of the CPU run: join the group, run main_rank, leave without teardown."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main_rank(args, rank, world, "gloo", torch.device("cpu"))
    exit_without_teardown()


def main_rank(args, rank: int, world: int, backend: str, device: torch.device) -> None:
    """One rank's whole benchmark: time, gather to rank 0, print and write the JSON there."""
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        gathered = run_rank(args, rank, world, device)
        if rank == 0:
            summary = summarize(gathered)
            print_table(summary, args, world, backend)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "bench_ep.json").write_text(
                    json.dumps(
                        {
                            "args": {k: str(v) for k, v in vars(args).items()},
                            "world": world,
                            "backend": backend,
                            **summary,
                        },
                        indent=2,
                    )
                )
    finally:
        dist.destroy_process_group()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench ep` (and scripts/bench_ep.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shape", default="qwen3-30b-a3b", help=f"named ({', '.join(NAMED_SHAPES)}) or T,H,I,E,K")
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--exchange", choices=["capacity", "exact"], default="capacity")
    parser.add_argument("--capacity-factor", type=float, default=2.0)
    parser.add_argument("--transport", choices=["nccl", "symmetric_memory"], default="nccl")
    parser.add_argument("--megatron", action="store_true", help="also time Megatron-Core's stock MoELayer")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default=None, help="default: bfloat16 on GPUs, float32 on the CPU"
    )
    parser.add_argument("--nprocs", type=int, default=2, help="gloo processes when not under torchrun")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the EP benchmark on this rank (under torchrun) or spawn --nprocs gloo ranks; 0 on success."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    keep_multicast_off()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nprocs
    if args.megatron and world > 1 and not torch.cuda.is_available():
        parser.error("--megatron with more than one rank needs GPUs (Megatron-Core's dispatchers allocate on CUDA)")
    if under_torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        on_gpu = torch.cuda.is_available()
        args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
        if on_gpu:
            torch.cuda.set_device(local)
        device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
        main_rank(args, rank, world, "nccl" if on_gpu else "gloo", device)
        exit_without_teardown()
    args.dtype = args.dtype or "float32"
    mp.spawn(worker, args=(args.nprocs, free_port(), args), nprocs=args.nprocs, join=True)
    return 0
