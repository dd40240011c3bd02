"""Time DeepSpeed's MoE layer with the MoK option against DeepSpeed's own expert loop, on one device.

Per expert module and shape: stock `deepspeed.moe.layer.MoE` (its gate, then `Experts`, a loop over
`deepspeed_experts` on the [E, capacity, H] buffer) and `mok_plugin.deepspeed.MoE` (MoK's routing,
schedule and combine; the experts fused when the module computes a MoK family, else the generic path,
module_experts.py: the module called once per expert on that expert's rows), built with the same
weights (the MoK layer loads the stock layer's state dict). Expert modules (`--expert`):

    residual   x + fc2(gelu(fc1(layer_norm(x))))   no MoK family: MoK runs it through the generic path
    gelu-mlp   Sequential(Linear, GELU, Linear)     mlp(gelu) + fc1 and fc2 bias: MoK runs it fused
    swiglu     mok_plugin.deepspeed.SwiGLUExpert    SwiGLU, no bias: fused

Both layers run dropless (`drop_tokens=False`; DeepSpeed then sizes its capacity buffer to the
busiest expert, so no token is dropped and both compute the same function), with
`use_rts=False` and `top2_2nd_expert_sampling=False` (no random routing on either side). The only
difference left is the aux loss for k = 2 (MoK counts both choices, DeepSpeed first choices only),
so the check below leaves `l_aux` out of the backward; the timed backward includes it.

Before timing, each case is checked: output, input gradient, router gradient and every expert
parameter's gradient (by its stock name) of the two layers agree within `mok_plugin.testing`'s
tolerance for the dtype. DeepSpeed computes router logits in fp32, MoK in fp64, so at T in the
thousands a token may sit on a near tie and be routed differently; such tokens are counted and left
out of the comparison (and then only output and input gradient are compared). A case that
disagrees is reported and not timed.

Timing as `mok bench layer` does (bench/timing.py): forward (under no_grad), backward (of one
retained forward) and forward + backward, each `--iters` CUDA-event timings after `--settle-s`
seconds of the same work; the backward takes the input's and every parameter's gradient
(torch.autograd.grad, nothing accumulated). Peak MiB: memory allocated above the layers, weights and
inputs during one forward + backward. On the CPU (`--cpu`, or no CUDA GPU) the times are wall-clock
and the default shapes are tiny: a smoke run, not a measurement.

torch.distributed runs as one rank (nccl on CUDA, gloo on the CPU) through deepspeed.init_distributed,
as tests/test_deepspeed.py does; at ep_size 1 neither layer uses an expert-parallel group.

    mok bench generic                                         # T=8192 H=1024 I=4096, E=8 and 64, K=2
    mok bench generic --expert residual --shape 16384,2048,1024,64,4 --out out/
    mok bench generic --cpu --iters 2                         # tiny shapes on the CPU
(`python scripts/bench_generic.py ...` is the same command.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mok_plugin.bench.report import run_metadata
from mok_plugin.bench.timing import SETTLE_S, summarize, time_ms
from mok_plugin.testing import MoEShape, assert_close, free_port, parse_shape

__all__ = ["EXPERT_MODULES", "ResidualBlock", "bench_case", "build_layers", "build_parser", "main", "print_table"]

PASSES = ("forward", "backward", "fwd+bwd")
DEFAULT_SHAPES = ("8192,1024,4096,8,2", "8192,1024,4096,64,2")
TINY_SHAPES = ("64,32,48,4,2", "64,32,48,8,2")
AUX_LOSS_COEFF = 0.01  # the timed backward's weight on l_aux (a typical coefficient)


class ResidualBlock(nn.Module):
    """x + fc2(gelu(fc1(layer_norm(x)))): no MoK family (a LayerNorm's parameters), as in the tests."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.fc1, self.fc2 = nn.Linear(hidden_size, ffn_hidden_size), nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _gelu_mlp(hidden_size: int, ffn_hidden_size: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden_size, ffn_hidden_size), nn.GELU(), nn.Linear(ffn_hidden_size, hidden_size))


def _swiglu(hidden_size: int, ffn_hidden_size: int) -> nn.Module:
    from mok_plugin.deepspeed import SwiGLUExpert

    return SwiGLUExpert(hidden_size, ffn_hidden_size)


# name -> factory(H, I) of the expert module (module docstring)
EXPERT_MODULES: dict[str, Callable[[int, int], nn.Module]] = {
    "residual": ResidualBlock,
    "gelu-mlp": _gelu_mlp,
    "swiglu": _swiglu,
}


@contextlib.contextmanager
def one_rank_world(device: torch.device) -> Iterator[None]:
    """A one-rank torch.distributed world through deepspeed.init_distributed (nccl on CUDA, gloo on
    the CPU); the variables torchrun would set are restored after. Uses an existing one-rank world.

    Raises:
        RuntimeError: torch.distributed already runs with more than one rank.
    """
    import deepspeed
    import torch.distributed as dist

    from mok_plugin.deepspeed.cpu_comm import skip_shared_memory_allreduce

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"mok bench generic runs on one rank; this world has {dist.get_world_size()}")
        yield
        return
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        skip_shared_memory_allreduce()  # its CPU op compiles C++ and leaks /dev/shm
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _init_weights(layer: nn.Module, seed: int) -> None:
    """Distinct experts (DeepSpeed starts them as copies of one): matrices ~ N(0, 1/fan_in), 1-D
    weights (a LayerNorm's) ~ 1 + N(0, 0.01), biases ~ N(0, 0.01), from a seeded generator."""
    device = next(layer.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32)
            if p.dim() >= 2:
                value = noise * p.shape[-1] ** -0.5
            elif name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            p.copy_(value)


def build_layers(expert: str, shape: MoEShape, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> tuple[nn.Module, nn.Module, str, str | None]:  # fmt: skip
    """(stock MoE, MoK MoE with the same weights, what MoK computes: a family's description or
    "generic path", why the generic path: the layer's warning's reason, or None when fused)."""
    from deepspeed.moe.layer import MoE as StockMoE

    import mok_plugin.deepspeed as mds

    make = EXPERT_MODULES[expert]
    kwargs = dict(num_experts=shape.E, k=shape.K, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    torch.manual_seed(seed)
    stock = StockMoE(shape.H, make(shape.H, shape.I), **kwargs).to(device=device, dtype=dtype)
    _init_weights(stock, seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mok = mds.MoE(shape.H, make(shape.H, shape.I).to(device=device, dtype=dtype), **kwargs)
    mok.load_state_dict(stock.state_dict())
    if mok.expert_layout is not None:
        return stock, mok, mok.expert_layout.family.describe(), None
    warned = next((str(w.message) for w in caught if "none of MoK's expert families" in str(w.message)), "")
    return stock, mok, "generic path", warned.split("expert families (", 1)[-1].split("); each expert", 1)[0]


def _expert_grads(stock: nn.Module, mok: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{stock parameter name: (MoK's gradient, stock's gradient)} for every expert parameter."""
    pairs = {}
    stock_experts = stock.deepspeed_moe.experts.deepspeed_experts
    for i, stock_expert in enumerate(stock_experts):
        if mok.expert_layout is None:
            ours = {n: p.grad for n, p in mok.mok.experts.local_experts[i].named_parameters()}
        else:
            layout = mok.expert_layout
            ours = layout.to_stock({n: getattr(mok.mok.experts, n).grad[i] for n in layout.mok_names})
        for name, p in stock_expert.named_parameters():
            pairs[f"deepspeed_experts.{i}.{name}"] = (ours[name], p.grad)
    return pairs


def check_layers(stock: nn.Module, mok: nn.Module, x: torch.Tensor, d_out: torch.Tensor, K: int) -> dict:
    """Compare one forward + backward of d_out (no l_aux) of the two layers.

    Returns:
        {"error": None or what disagrees, "rerouted_tokens": tokens the two routers (fp32 vs
        fp64 logits) send to different experts, left out of the comparison}.
    """
    results = []
    for layer in (stock, mok):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        out, _, _ = layer(xi)
        out.backward(d_out)
        results.append((out.detach(), xi.grad))
    (want_out, want_dx), (out, dx) = results
    with torch.no_grad():
        logits32 = F.linear(x.float(), stock.deepspeed_moe.gate.wg.weight.float())
        stock_ids = logits32.topk(K, dim=-1).indices.sort(dim=-1).values
        mok_ids = mok.mok.route(x.reshape(-1, x.shape[-1])).topk_ids.sort(dim=-1).values.to(stock_ids.dtype)
        same = (stock_ids == mok_ids).all(dim=-1)
    rerouted = int((~same).sum())  # host-ok: benchmark check
    dtype = x.dtype
    try:
        assert_close(out[same], want_out[same], dtype, "output")
        assert_close(dx[same], want_dx[same], dtype, "input gradient", n_reduce=K)
        if rerouted == 0:
            rows = max(1, x.shape[0] * K // len(stock.deepspeed_moe.experts.deepspeed_experts))
            assert_close(mok.mok.router.weight.grad, stock.deepspeed_moe.gate.wg.weight.grad, dtype, "router gradient",
                         n_reduce=x.shape[0])  # fmt: skip
            for name, (ours, theirs) in _expert_grads(stock, mok).items():
                assert_close(ours, theirs, dtype, name + " gradient", n_reduce=rows)
        error = None
    except AssertionError as why:
        error = str(why)
    for layer in (stock, mok):
        layer.zero_grad(set_to_none=True)
    return {"error": error, "rerouted_tokens": rerouted}


def _time(fn: Callable[[], object], iters: int, warmup: int, settle_s: float, device: torch.device) -> list[float]:
    """time_ms on CUDA; on the CPU, wall-clock milliseconds of each call after the same warmup and settle."""
    if device.type == "cuda":
        return time_ms(fn, iters, warmup=warmup, settle_s=settle_s)
    for _ in range(warmup):
        fn()
    deadline = time.perf_counter() + settle_s
    while time.perf_counter() < deadline:
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    if len(times) >= 2:
        return summarize(times)
    return {"ms": times[0], "p20": times[0], "p80": times[0]}


def time_layer(
    layer: nn.Module, x: torch.Tensor, d_out: torch.Tensor, iters: int, warmup: int, settle_s: float
) -> dict:
    """{"peak_mib" (None on the CPU), and per pass {"ms", "p20", "p80"}} of one layer."""
    device = x.device
    xi = x.detach().clone().requires_grad_()
    inputs = [xi, *(p for p in layer.parameters() if p.requires_grad)]

    def forward_backward(out_aux=None):
        out, l_aux, _ = out_aux if out_aux is not None else layer(xi)
        aux_grad = torch.full_like(l_aux, AUX_LOSS_COEFF)
        return torch.autograd.grad([out, l_aux], inputs, [d_out, aux_grad], retain_graph=out_aux is not None,
                                   allow_unused=True)  # fmt: skip

    def forward():
        with torch.no_grad():
            layer(xi)

    row: dict = {"peak_mib": None}
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    row["forward"] = _summary(_time(forward, iters, warmup, settle_s, device))
    held = [layer(xi)]  # one forward whose graph every timed backward reuses
    row["backward"] = _summary(_time(lambda: forward_backward(held[0]), iters, warmup, settle_s, device))
    held.clear()
    row["fwd+bwd"] = _summary(_time(forward_backward, iters, warmup, settle_s, device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_case(expert: str, shape: MoEShape, dtype: torch.dtype, device: torch.device, iters: int, warmup: int,
               settle_s: float, seed: int = 0) -> dict:  # fmt: skip
    """One expert module at one shape: build both layers, check them, time them (unless wrong).

    Returns:
        {"expert", "dims", "computes", "why_generic", "error", "rerouted_tokens"} and, when error is None,
        "stock" and "mok" (time_layer's rows) and "stock/mok" per pass (ratio of the medians).
    """
    stock, mok, computes, why = build_layers(expert, shape, dtype, device, seed)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(shape.T, shape.H, generator=generator, device=device).to(dtype)
    d_out = torch.randn(shape.T, shape.H, generator=generator, device=device).to(dtype)
    row = {
        "expert": expert,
        "dims": list(shape.as_tuple()),
        "computes": computes,
        "why_generic": why,
        **check_layers(stock, mok, x, d_out, shape.K),
    }
    if row["error"] is None:
        row["stock"] = time_layer(stock, x, d_out, iters, warmup, settle_s)
        row["mok"] = time_layer(mok, x, d_out, iters, warmup, settle_s)
        row["stock/mok"] = {p: row["stock"][p]["ms"] / row["mok"][p]["ms"] for p in PASSES}
    del stock, mok, x, d_out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    """Per case and pass: stock and MoK ms (median), stock/MoK (above 1: MoK is faster), peak MiB of a
    forward + backward ("-" on the CPU); a case whose check failed prints WRONG and its error."""
    print(f"{'expert':<9} {'MoK computes':<32} {'T,H,I,E,K':<20} {'pass':<8} {'stock ms':>9} {'MoK ms':>9} "
          f"{'stock/MoK':>9} {'stock MiB':>10} {'MoK MiB':>9}")  # fmt: skip
    for row in rows:
        head = f"{row['expert']:<9} {row['computes']:<32} {','.join(map(str, row['dims'])):<20}"
        if row["error"]:
            print(f"{head} WRONG: {row['error']}")
            continue
        for p in PASSES:
            mib = [
                f"{row[side]['peak_mib']:.0f}" if row[side]["peak_mib"] is not None else "-"
                for side in ("stock", "mok")
            ]
            print(f"{head} {p:<8} {row['stock'][p]['ms']:9.3f} {row['mok'][p]['ms']:9.3f} "
                  f"{row['stock/mok'][p]:8.2f}x {mib[0]:>10} {mib[1]:>9}")  # fmt: skip


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench generic` (and scripts/bench_generic.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--expert", nargs="+", choices=list(EXPERT_MODULES), default=["residual", "gelu-mlp"],
                        help="expert modules: residual (MoK's generic path), gelu-mlp and swiglu (fused families); "
                             "default residual gelu-mlp")  # fmt: skip
    parser.add_argument("--shape", action="append", default=None, metavar="T,H,I,E,K",
                        help=f"a shape (repeatable); default {' and '.join(DEFAULT_SHAPES)} on a GPU, "
                             f"{' and '.join(TINY_SHAPES)} with --tiny or on the CPU")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help=f"the tiny default shapes ({' and '.join(TINY_SHAPES)})")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (also without a CUDA GPU): a smoke run")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=None,
                        help=f"seconds of back-to-back calls before each timing (default {SETTLE_S:g} on a GPU, "
                             "0 on the CPU; bench/timing.py says why)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for bench_generic.json")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark; 0 when every case agreed, 1 when one did not (it is reported, not timed)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be at least 1 and --warmup at least 0")
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not args.cpu and not on_gpu:
        print("mok bench generic: no CUDA GPU, running on the CPU (tiny shapes unless --shape)", file=sys.stderr)
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    texts = args.shape or list(TINY_SHAPES if args.tiny or not on_gpu else DEFAULT_SHAPES)
    try:
        shapes = [parse_shape(text) for text in texts]
    except ValueError as error:
        parser.error(str(error))
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    settle_s = args.settle_s if args.settle_s is not None else (SETTLE_S if on_gpu else 0.0)

    rows = []
    with one_rank_world(device):
        for shape in shapes:
            for expert in args.expert:
                t0 = time.time()
                row = bench_case(expert, shape, dtype, device, args.iters, args.warmup, settle_s, args.seed)
                rows.append(row)
                state = f"WRONG: {row['error']}" if row["error"] else f"rerouted tokens {row['rerouted_tokens']}"
                print(f"  {expert} {','.join(map(str, row['dims']))}: done in {time.time() - t0:.1f} s; {state}",
                      flush=True)  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {**run_metadata(), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                "iters": args.iters, "warmup": args.warmup, "settle_s": settle_s,
                "layers": "drop_tokens=False (dropless), use_rts=False, top2_2nd_expert_sampling=False, ep_size=1",
                "aux_loss_coeff_in_timed_backward": AUX_LOSS_COEFF}  # fmt: skip
        path = args.out / "bench_generic.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"details in {path}")
    print()
    print(f"{device.type}, {str(dtype).removeprefix('torch.')}; stock/MoK above 1: MoK is faster")
    print_table(rows)
    return 1 if any(row["error"] for row in rows) else 0
