"""The multi-kernel experts' host work, without a GPU: every Triton launch stubbed (counted, not run).

Small batches are bound by the host's time to issue the work (BENCHMARKS.md, "Small batches: where
the host's time goes"), and that time is the launchers' Python, torch's op dispatch, autograd and
Triton's launch path. This benchmark runs the layer's eager forward + backward (the schedule
included, as `mok bench layer`'s mok-multi provider) with the launches replaced by a counter and
the tensors on torch's meta device (shapes, no memory): what is left is MoK's own host work and
torch's dispatch, measured on any machine, and the number of launches a step. Not measured here:
Triton's launch path (~12-25 us a launch on the H200's host), the TMA descriptors (meta tensors
take the pointer path) and CUDA's allocator; `mok bench layer --host-profile` on a GPU sees them.
Ops whose meta implementation is Python (`empty_like`, through torch._prims_common: ~50 us a call
here) cost more than on a GPU, where they are C++.

    mok bench host                              # T = 1, 37, 512 with qwen3-30b-a3b's expert dimensions
    mok bench host --tokens 1 --profile         # + the 30 functions with the most own time (cProfile)
    mok bench host --variant megakernel         # the persistent variant: 3 launches a step
    mok bench host --cuda                       # on a GPU: real launches, `launch`'s direct path against
                                                # Triton's own, alternated in one process
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from mok_plugin.bench.breakdown import host_profile, host_time, print_host_profile
from mok_plugin.testing import MoEShape, parse_shape

__all__ = ["build_parser", "main", "stubbed_launches", "experts_step"]

DEFAULT_DIMS = "2048,768,128,8"  # qwen3-30b-a3b's H, I, E, K


@contextlib.contextmanager
def stubbed_launches() -> Iterator[Counter]:
    """Within: every Triton kernel launch (`kernel[grid](...)`) counts its kernel's name and runs
    nothing, and the launchers pick the GPU's tile configs (TRITON_INTERPRET unset)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import mok_plugin.ops  # noqa: F401 (the kernels decorated under the environment as it is, before the change)

    counts: Counter = Counter()

    def stub(self, grid):
        def launch(*args, **kwargs):
            counts[self.fn.__name__] += 1

        return launch

    saved = {cls: cls.__getitem__ for cls in (JITFunction, InterpretedFunction)}
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        for cls in saved:
            cls.__getitem__ = stub
        yield counts
    finally:
        for cls, getitem in saved.items():
            cls.__getitem__ = getitem
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def experts_step(shape: MoEShape, variant: str = "multi_kernel", device: str = "meta") -> Callable[[], object]:
    """One eager forward + backward of the bias-free SwiGLU experts in `variant` (the schedule
    built by its Triton kernels' launcher, as on a GPU) on tensors of `shape`. On the meta device
    (the default) they have no values, so every (stubbed) launch sees the same sizes whatever the
    routing; on a GPU, random values and uniform top-K routing."""
    from mok_plugin import ops
    from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule

    T, H, I, E, K = shape.as_tuple()
    if device == "meta":  # shapes only: the torch ops dispatch but touch no memory, as on a GPU's host
        make = torch.empty
        ids = torch.empty(T, K, dtype=torch.int64, device=device)
    else:
        make = torch.randn
        ids = torch.rand(T, E, device=device).topk(K, dim=1).indices
    x = make(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    weights = make(T, K, device=device).softmax(-1).requires_grad_()
    w13 = (make(E, 2 * I, H, dtype=torch.bfloat16, device=device) / H**0.5).requires_grad_()
    w2 = (make(E, H, I, dtype=torch.bfloat16, device=device) / I**0.5).requires_grad_()
    d_out = make(T, H, dtype=torch.bfloat16, device=device)

    def step():
        schedule = build_schedule(ids, E, tile_m=DEFAULT_TILE_M, impl="triton")
        out = ops.moe_experts(x, weights, w13, w2, schedule, variant=variant)
        return torch.autograd.grad(out, [x, weights, w13, w2], d_out)

    return step


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench host`."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 37, 512], help="T values (default 1 37 512)")
    parser.add_argument("--variant", choices=["multi_kernel", "megakernel"], default="multi_kernel",
                        help="the experts' kernel variant (default multi_kernel)")  # fmt: skip
    parser.add_argument("--dims", default=DEFAULT_DIMS, help=f"H,I,E,K (default {DEFAULT_DIMS}: qwen3-30b-a3b)")
    parser.add_argument("--steps", type=int, default=1000, help="fwd+bwd calls per timing (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per T; the best is reported (default 5)")
    parser.add_argument("--profile", action="store_true", help="also list the functions with the most own time")
    parser.add_argument("--cuda", action="store_true",
                        help="on the GPU, launches real: the host time with `launch`'s direct path and with Triton's "
                             "own, alternated --repeats times in this process (the host's speed drifts between "
                             "processes)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Print, per T, the launches of one fwd+bwd and its host time; 0 on success."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    try:
        shapes = [parse_shape(f"{tokens},{args.dims}") for tokens in args.tokens]
    except ValueError as error:
        parser.error(str(error))
    if args.cuda:
        if not torch.cuda.is_available():
            parser.error("--cuda needs a CUDA GPU")
        return _compare_launch_paths(shapes, args)
    print(f"{'T':>6} {'launches':>8} {'host us':>9}  launches by kernel (stubbed: counted, not run)")
    with stubbed_launches() as counts:
        for shape in shapes:
            step = experts_step(shape, args.variant)
            step()  # first call: imports and caches
            counts.clear()
            step()
            launches = dict(counts)
            best_ms = min(host_time(step, args.steps) for _ in range(args.repeats))
            by_kernel = ", ".join(f"{name.strip('_')} {n}" for name, n in sorted(launches.items()))
            print(f"{shape.T:>6} {sum(launches.values()):>8} {best_ms * 1e3:>9.1f}  {by_kernel}", flush=True)
            if args.profile:
                profile = host_profile(step, min(args.steps, 200))
                print_host_profile({"shape": f"T = {shape.T}", "routing": "(meta tensors)", "provider": args.variant,
                                    "host_ms": best_ms, "host_profile": profile})  # fmt: skip
    return 0


def _compare_launch_paths(shapes: list[MoEShape], args: argparse.Namespace) -> int:
    """`--cuda`: per T, the host time of a fwd+bwd with `launch`'s direct path and through Triton's
    `kernel[grid]`, in turns; best and median of --repeats timings of --steps calls each."""
    import statistics

    from mok_plugin.kernels.launch import through_triton

    print(f"{'T':>6} {'direct us':>17} {'Triton us':>17} {'saved us':>9}  (best / median of {args.repeats})")
    for shape in shapes:
        step = experts_step(shape, args.variant, device="cuda")
        times: dict[str, list[float]] = {"direct": [], "triton": []}
        for repeat in range(args.repeats + 1):  # the first round warms both paths up, untimed
            for path in times:
                with through_triton() if path == "triton" else contextlib.nullcontext():
                    host_ms = host_time(step, args.steps if repeat else 3)
                if repeat:
                    times[path].append(host_ms * 1e3)
        best = {path: min(values) for path, values in times.items()}
        median = {path: statistics.median(values) for path, values in times.items()}
        print(f"{shape.T:>6} {best['direct']:>8.1f} / {median['direct']:<6.1f} {best['triton']:>8.1f} / "
              f"{median['triton']:<6.1f} {median['triton'] - median['direct']:>9.1f}", flush=True)  # fmt: skip
    return 0
