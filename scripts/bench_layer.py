"""Time one MoE layer (forward, backward, forward + backward) on the GPU against its peers.

Providers, all on the same inputs in one process:
  mok-mega       the triton backend, persistent megakernel (one launch per pass), schedule included
  mok-multi      the triton backend, one launch per GEMM, schedule included
  torch          the plain PyTorch path: index gather, grouped_mm gate/up, SwiGLU, grouped_mm down,
                 weighted fixed-order sum over k
  megatron       Megatron-Core's stock MoELayer, when megatron-core is importable (router included)
  liger          Liger-Kernel's fused MoE, when liger-kernel is importable. It autotunes 32 configs
                 for each of its GEMM kernels at every new shape (about 4 minutes per shape on the
                 H200); LIGER_FUSED_MOE_AUTOTUNE=0 runs its one default config instead

Every provider is checked against the reference backend and for bitwise repeatability before it
is timed; a wrong provider is reported and not timed. The dense bf16 GEMM ceiling is measured in
the same run. Each timing follows SETTLE_S seconds of the same work, so that all of them run at the
clock the chip holds under sustained load (its power cap). Router logits and the top-k choice are
the same for every provider and are not timed (the megatron peer includes its own router).

    python scripts/bench_layer.py --shapes qwen3-30b-a3b olmoe --routing uniform --out out/
    python scripts/bench_layer.py --shape 4096,2880,1024,32,4 --routing skewed
    python scripts/bench_layer.py --shapes olmoe --providers mok-multi torch --profile   # time per kernel
    python scripts/bench_layer.py --shapes mixtral-8x7b --providers mok-multi torch --memory  # what sets the peak
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mok_plugin import ops  # noqa: E402
from mok_plugin.kernels.configs import (  # noqa: E402
    PINNED_KERNELS,
    overridden_configs,
    parse_tile_config,
    tile_config_label,
)
from mok_plugin.reference import moe_experts_reference  # noqa: E402
from mok_plugin.routing import count_per_expert  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402
from mok_plugin.testing import NAMED_SHAPES, TOLERANCES, MoEShape, free_port, parse_shape  # noqa: E402

DTYPE = torch.bfloat16


def moe_flops(shape: MoEShape, pass_name: str) -> float:
    """DESIGN.md's convention: forward 6·T·K·H·I, backward 12·T·K·H·I (routed SwiGLU experts only)."""
    per = {"forward": 6, "backward": 12, "fwd+bwd": 18}[pass_name]
    return per * shape.T * shape.K * shape.H * shape.I


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def make_inputs(shape: MoEShape, routing: str, seed: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    T, H, I, E, K = shape.as_tuple()
    if routing == "uniform":
        probs = torch.ones(T, E, device=device)
    else:  # Zipf-like: expert e drawn with probability ~ 1/(e+1)
        probs = (1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32)).expand(T, E)
    topk_ids = torch.multinomial(probs, K, replacement=False, generator=g)
    topk_weights = torch.softmax(torch.randn(T, K, device=device, generator=g), dim=-1)
    return {
        "x": torch.randn(T, H, device=device, generator=g).to(DTYPE),
        "topk_ids": topk_ids,
        "topk_weights": topk_weights,
        "gate_up_proj": (torch.randn(E, 2 * I, H, device=device, generator=g) / H**0.5).to(DTYPE),
        "down_proj": (torch.randn(E, H, I, device=device, generator=g) / I**0.5).to(DTYPE),
        "d_out": torch.randn(T, H, device=device, generator=g).to(DTYPE),
    }


# ------------------------------------------------------------------------------------------------
# Providers: each returns fn(x, topk_weights, gate_up_proj, down_proj) -> out, given the routing
# ------------------------------------------------------------------------------------------------


def _provider_mok(variant: str) -> Callable:
    def provider(inputs: dict, shape: MoEShape) -> Callable:
        ids = inputs["topk_ids"]

        def run(x, w, w13, w2):
            schedule = build_schedule(ids, shape.E, tile_m=DEFAULT_TILE_M)
            return ops.moe_experts(x, w, w13, w2, schedule, variant=variant)

        return run

    return provider


def _grouped_mm():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError("this torch has no grouped_mm")
    return fn


def provider_torch(inputs: dict, shape: MoEShape) -> Callable:
    grouped_mm = _grouped_mm()
    T, H, I, E, K = shape.as_tuple()
    ids = inputs["topk_ids"]

    def run(x, w, w13, w2):
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        offs = torch.cumsum(count_per_expert(flat, E), 0).to(torch.int32)
        h = grouped_mm(x[order // K], w13.transpose(-2, -1), offs=offs)
        a = F.silu(h[:, :I]) * h[:, I:]
        y = grouped_mm(a, w2.transpose(-2, -1), offs=offs) * w.reshape(-1)[order, None].to(x.dtype)
        y_tk = torch.zeros_like(y).index_copy(0, order, y)
        return y_tk.view(T, K, H).sum(dim=1)

    return run


def provider_reference(inputs: dict, shape: MoEShape) -> Callable:
    ids = inputs["topk_ids"]

    def run(x, w, w13, w2):
        return moe_experts_reference(x, w, w13, w2, build_schedule(ids, shape.E))

    return run


def build_megatron_moe(shape: MoEShape, dispatcher: str, device: torch.device, ep_size: int = 1):
    """Megatron-Core's stock MoELayer (local spec: SequentialMLP, no Transformer Engine) for shape,
    with `ep_size`-way expert parallelism over the default process group (a one-rank group is made
    when none exists). Weights are random (std 0.02, seed 0); callers may replace them."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig

    if not dist.is_initialized():
        port = free_port()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep_size)
    T, H, I, E, K = shape.as_tuple()
    on_cpu = device.type == "cpu"
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=I, moe_ffn_hidden_size=I,
        num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=True, params_dtype=DTYPE, moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        gradient_accumulation_fusion=False,
        # On the GPU: allocate there and fill below (Megatron's GPU init needs its RNG tracker).
        use_cpu_initialization=on_cpu, perform_initialization=on_cpu,
    )  # fmt: skip
    builder = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    layer = builder(config=config).to(device)
    if on_cpu:
        from mok_plugin.megatron.stock import make_stock_router_cpu_safe

        make_stock_router_cpu_safe(layer)
    else:
        generator = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.02, generator=generator)
    return layer


def provider_megatron(inputs: dict, shape: MoEShape) -> Callable:
    """Megatron-Core's stock MoELayer with the alltoall dispatcher and SequentialMLP experts.

    Its router is replaced by the benchmark's routing (the same top-k ids and weights as every other
    provider), so the output is checked like theirs and the time excludes the router, as theirs
    does. The expert weights are the benchmark's, passed through `functional_call` so that their
    gradients come back like every provider's.
    """
    try:
        layer = build_megatron_moe(shape, "alltoall", inputs["x"].device)
    except ImportError as error:
        raise RuntimeError("megatron-core is not importable (pip install -e .[megatron])") from error
    return megatron_run(layer, inputs, shape)


def megatron_run(layer, inputs: dict, shape: MoEShape) -> Callable:
    """run(x, w, w13, w2) through a stock MoELayer with the benchmark's routing and weights."""
    T, H, I, E, K = shape.as_tuple()
    ids = inputs["topk_ids"]
    routing: dict = {}

    def fixed_router(hidden, padding_mask=None):
        probs = torch.zeros(T, E, dtype=routing["w"].dtype, device=ids.device).scatter(1, ids, routing["w"])
        return probs, torch.zeros(T, E, dtype=torch.bool, device=ids.device).scatter(1, ids, True)

    layer.router.forward = fixed_router

    def run(x, w, w13, w2):
        routing["w"] = w
        params = {}
        for e in range(E):
            params[f"experts.local_experts.{e}.linear_fc1.weight"] = w13[e]
            params[f"experts.local_experts.{e}.linear_fc2.weight"] = w2[e]
        out, _ = torch.func.functional_call(layer, params, (x.view(T, 1, H),), strict=False)
        return out.view(T, H)

    return run


def provider_liger(inputs: dict, shape: MoEShape) -> Callable:
    """Liger-Kernel's fused MoE (same weight layout: gate_up [E, 2I, H] gate first, down [E, H, I])."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as error:
        raise RuntimeError("liger-kernel is not importable (pip install liger-kernel, or carry its wheel)") from error
    ids = inputs["topk_ids"].to(torch.int32)

    def run(x, w, w13, w2):
        return LigerFusedMoEFunction.apply(x, w13, w2, ids, w)

    return run


PROVIDERS = {
    "mok-mega": _provider_mok("megakernel"),
    "mok-multi": _provider_mok("multi_kernel"),
    "torch": provider_torch,
    "megatron": provider_megatron,
    "liger": provider_liger,
}


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------


def fwd_bwd(fn: Callable, inputs: dict) -> list[torch.Tensor]:
    leaves = [inputs[k].detach().requires_grad_() for k in ("x", "topk_weights", "gate_up_proj", "down_proj")]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, inputs["d_out"])
    return [out.detach(), *grads]


# The H200 holds its 700 W cap by lowering the SM clock under sustained load (1980 MHz after an
# idle spell, mostly 1440-1650 MHz once loaded), so work timed in its first calls after idle runs fast:
# a dense GEMM read 756 TFLOP/s in 20 calls after 1 s idle and 642 after 0.3 s of them, and
# mixtral-8x7b's MoK fwd+bwd 27.4 ms in 3 calls after idle against 30.6 under load (one process,
# 2026-11-30, BENCHMARKS.md). Every timing here therefore first runs its work back to back for
# `settle_s`, so the dense ceiling and each provider are measured at the clock the chip holds while
# training, the same for all of them.
SETTLE_S = 1.0


def time_ms(fn: Callable, iters: int, warmup: int = 3, settle_s: float = 0.0) -> list[float]:
    """CUDA-event times of `iters` calls, each synchronized, after `warmup` calls and then at
    least `settle_s` seconds of calls back to back."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    deadline = time.perf_counter() + settle_s
    while time.perf_counter() < deadline:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def dense_gemm_tflops(iters: int = 20, settle_s: float = SETTLE_S) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = statistics.median(time_ms(lambda: a @ b, iters, settle_s=settle_s))
    return 2 * 8192**3 / ms / 1e9


def summarize(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=10)
    return {"ms": statistics.median(times), "p20": q[1], "p80": q[7]}


NAMES = ["output", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]


def check(results: list[torch.Tensor], expected: list[torch.Tensor], shape: MoEShape) -> str | None:
    """None when every tensor is within the bf16 tolerance of the reference, else what failed.

    Compared in slices along dim 0, so the fp32 temporaries stay small at deepseek-v3 size.
    """
    tol = TOLERANCES[DTYPE]
    rows = max(1, shape.T * shape.K // shape.E)
    growth = {"output": 1, "d_x": 2 * shape.I, "d_topk_weights": shape.H, "d_gate_up_proj": rows, "d_down_proj": rows}
    for name, got, want in zip(NAMES, results, expected, strict=True):
        scale = max(float(want[i : i + 16].abs().max()) for i in range(0, want.shape[0], 16))
        worst = 0.0
        for i in range(0, want.shape[0], 16):
            a, b = got[i : i + 16].float(), want[i : i + 16].float()
            bound = tol.atol * scale * max(1.0, (growth[name] / 64) ** 0.5) + tol.rtol * b.abs()
            if not torch.isfinite(a).all() or ((a - b).abs() > bound).any():
                worst = max(worst, float((a - b).abs().max()))
        if worst:
            return f"{name}: max abs err {worst:.3e} (scale {scale:.3e})"
    return None


def bench_provider(name: str, fn: Callable, inputs: dict, shape: MoEShape, expected: list, iters: int,
                   settle_s: float = SETTLE_S) -> dict:  # fmt: skip
    row: dict = {"provider": name}
    first = fwd_bwd(fn, inputs)
    row["error"] = check(first, expected, shape)
    second = fwd_bwd(fn, inputs)
    row["bitwise"] = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    del first, second
    torch.cuda.empty_cache()
    if row["error"]:
        return row
    leaves = [inputs[k].detach().requires_grad_() for k in ("x", "topk_weights", "gate_up_proj", "down_proj")]

    def forward():
        with torch.no_grad():
            fn(*leaves)

    out_holder: list = []

    def backward():
        torch.autograd.grad(out_holder[0], leaves, inputs["d_out"], retain_graph=True)

    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, inputs)
    row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    row["forward"] = summarize(time_ms(forward, iters, settle_s=settle_s))
    out_holder.append(fn(*leaves))
    row["backward"] = summarize(time_ms(backward, iters, settle_s=settle_s))
    out_holder.clear()
    row["fwd+bwd"] = summarize(time_ms(lambda: fwd_bwd(fn, inputs), iters, settle_s=settle_s))
    return row


def kernel_breakdown(fn: Callable, inputs: dict, iters: int = 3) -> list[dict]:
    """GPU time per forward + backward of each kernel the provider launches (torch.profiler over
    `iters` passes), most first: where the layer's time goes, kernels timed inside the layer."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fwd_bwd(fn, inputs)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time / 1000 / iters
            entry[1] += 1
    rows = [{"kernel": name, "ms": ms, "launches": count // iters} for name, (ms, count) in totals.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def print_breakdown(row: dict) -> None:
    kernels = row["kernels"]
    total = sum(k["ms"] for k in kernels)
    print(f"\n{row['shape']} {row['routing']} {row['provider']}: GPU time per forward + backward, by kernel "
          f"(sum {total:.2f} ms; timed fwd+bwd {row['fwd+bwd']['ms']:.2f} ms)")  # fmt: skip
    for k in kernels:
        if k["ms"] >= 0.005:
            print(f"  {k['ms']:7.3f} ms {100 * k['ms'] / total:5.1f}% x{k['launches']:<3} {k['kernel'][:90]}")


def peak_live_set(trace: list[dict]) -> tuple[int, list[dict]]:
    """From one device's caching-allocator trace (`torch.cuda.memory._snapshot()["device_traces"]`):
    the most bytes live at once among the allocations the trace saw made, and those allocations,
    oldest first, each with the first frame of this project's code that made it ("site")."""
    live: dict[int, dict] = {}
    current = best = 0
    best_live: list[dict] = []
    for event in trace:
        if event["action"] == "alloc":
            frames = event.get("frames") or []
            ours = [f for f in frames if "mok_plugin" in f["filename"] or "scripts" in f["filename"]]
            frame = (ours or frames or [None])[0]
            site = f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}" if frame else "?"
            live[event["addr"]] = {"bytes": event["size"], "site": site}
            current += event["size"]
            if current > best:
                best, best_live = current, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["bytes"]
    return best, best_live


def memory_breakdown(fn: Callable, inputs: dict) -> dict:
    """The tensors live at the peak of one forward + backward (torch.cuda.memory history; the inputs
    and anything allocated before the call are not counted): what sets the peak MiB column."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        fwd_bwd(fn, inputs)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = peak_live_set(trace)
    return {"peak_bytes": peak, "live": live}


def print_memory(row: dict) -> None:
    memory = row["memory"]
    print(f"\n{row['shape']} {row['routing']} {row['provider']}: tensors live at the peak of one forward + backward "
          f"({memory['peak_bytes'] / 2**20:.2f} MiB)")  # fmt: skip
    for tensor in memory["live"]:
        if tensor["bytes"] >= 2**16:
            print(f"  {tensor['bytes'] / 2**20:10.2f} MiB  {tensor['site']}")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=["qwen3-30b-a3b", "olmoe", "mixtral-8x7b", "deepseek-v3"],
        help=f"named shapes: {', '.join(NAMED_SHAPES)}",
    )
    parser.add_argument("--shape", action="append", default=[], help="extra shape T,H,I,E,K")
    parser.add_argument("--routing", choices=["uniform", "skewed"], nargs="*", default=["uniform"])
    parser.add_argument("--providers", nargs="*", default=list(PROVIDERS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="seconds of back-to-back calls before each timing, so that every provider and the "
                             "dense GEMM run at the clock the chip holds under load (the tables before 2026-11-30 "
                             "timed the dense GEMM in its first calls after idle)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also list each provider's kernels by GPU time per forward + backward (torch.profiler)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also list the tensors live at each provider's peak, by the line that allocated them",
    )
    parser.add_argument("--override", action="append", default=[], metavar="KERNEL=CONFIG",
                        help="time MoK with this pinned-table entry replaced, e.g. wgrad=128x128x64w8s4g "
                             "(tune_kernels.py's notation); repeatable")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        overrides = {kernel: parse_tile_config(spec) for kernel, spec in (o.split("=", 1) for o in args.override)}
    except ValueError as error:
        parser.error(f"--override KERNEL=CONFIG: {error}")
    if set(overrides) - set(PINNED_KERNELS):
        parser.error(f"--override: unknown kernel in {sorted(overrides)}; kernels: {', '.join(PINNED_KERNELS)}")
    if not torch.cuda.is_available():
        print("bench_layer.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if overrides:
        print("pinned table overridden: " + ", ".join(f"{k}={tile_config_label(c)}" for k, c in overrides.items()))
    with overridden_configs(overrides):
        return _run(args, overrides)


def _run(args: argparse.Namespace, overrides: dict) -> int:

    shapes = [(text, parse_shape(text)) for text in [*args.shapes, *args.shape]]
    burst = dense_gemm_tflops(settle_s=0.0)  # first, while the clock is still at its idle-time high
    gemm = dense_gemm_tflops(settle_s=args.settle_s)
    dense_line = (
        f"dense bf16 GEMM 8192^3: {gemm:.0f} TFLOP/s after {args.settle_s:g} s of load "
        f"({burst:.0f} in its first calls after idle)"
    )
    print(dense_line, flush=True)
    rows = []
    for shape_name, shape in shapes:
        for routing in args.routing:
            inputs = make_inputs(shape, routing, args.seed)
            expected = fwd_bwd(provider_reference(inputs, shape), inputs)
            for provider in args.providers:
                t0 = time.time()
                try:
                    fn = PROVIDERS[provider](inputs, shape)
                except RuntimeError as why:
                    print(f"  {shape_name} {routing} {provider}: skipped ({why})", flush=True)
                    continue
                row = bench_provider(provider, fn, inputs, shape, expected, args.iters, args.settle_s)
                if args.profile and not row["error"]:
                    row["kernels"] = kernel_breakdown(fn, inputs)
                if args.memory and not row["error"]:
                    row["memory"] = memory_breakdown(fn, inputs)
                row.update(shape=shape_name, dims=list(shape.as_tuple()), routing=routing)
                rows.append(row)
                print(
                    f"  {shape_name} {routing} {provider}: done in {time.time() - t0:.1f} s"
                    + (f" WRONG: {row['error']}" if row["error"] else ""),
                    flush=True,
                )
                torch.cuda.empty_cache()
            del inputs, expected
            torch.cuda.empty_cache()

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dense_gemm_tflops": gemm,
        "dense_gemm_tflops_first_calls_after_idle": burst,
        "settle_s": args.settle_s,
        "config_overrides": {k: tile_config_label(c) for k, c in overrides.items()},
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    (args.out / "bench_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    print()
    print(
        f"{'shape':<16} {'routing':<8} {'provider':<10} {'pass':<8} {'ms':>8} {'p20-p80':>15} {'TFLOP/s':>8} "
        f"{'%GEMM':>6} {'peak MiB':>9} {'vs torch':>8} {'bitwise':>7}"
    )
    for row in rows:
        if row["error"]:
            print(f"{row['shape']:<16} {row['routing']:<8} {row['provider']:<10} WRONG: {row['error']}")
            continue
        shape = MoEShape(*row["dims"])
        torch_row = next(
            (
                r
                for r in rows
                if r["provider"] == "torch"
                and r["shape"] == row["shape"]
                and r["routing"] == row["routing"]
                and not r["error"]
            ),
            None,
        )
        for pass_name in ("forward", "backward", "fwd+bwd"):
            ms = row[pass_name]["ms"]
            tflops = moe_flops(shape, pass_name) / ms / 1e9
            ratio = f"{torch_row[pass_name]['ms'] / ms:.2f}x" if torch_row else "-"
            print(
                f"{row['shape']:<16} {row['routing']:<8} {row['provider']:<10} {pass_name:<8} {ms:8.2f} "
                f"{row[pass_name]['p20']:7.2f}-{row[pass_name]['p80']:<7.2f} {tflops:8.0f} {100 * tflops / gemm:5.0f}% "
                f"{row['peak_mib']:9.1f} {ratio:>8} {'yes' if row['bitwise'] else 'NO':>7}"
            )
    for row in rows:
        if "kernels" in row:
            print_breakdown(row)
        if "memory" in row:
            print_memory(row)
    print(f"{dense_line}; details in {args.out / 'bench_layer.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
