"""Train the comparison model with the stock MoE layers and with MoK, twice each, from the same
initial weights on the same tokens; measure step time, tokens/s, peak memory and losses, and
check whether the two runs of each variant are bitwise equal (losses and final weights).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from mok_plugin.compare.models import VOCAB, build_model
from mok_plugin.testing import free_port
from mok_plugin.topology import RunConfig

__all__ = ["RunResult", "run_comparison"]

VARIANTS = (("stock", 1), ("stock", 2), ("mok", 1), ("mok", 2))


@dataclass
class RunResult:
    variant: str
    repeat: int
    losses: list[float]
    step_ms: float
    tokens_per_s: float
    peak_memory_mib: float

    def summary(self) -> dict:
        return asdict(self)


def _rss_mib() -> float:
    """Resident memory of this process (Linux /proc), MiB: the CPU's stand-in for peak allocation."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _init_distributed(framework: str, device: torch.device) -> None:
    if not torch.distributed.is_initialized():
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        if framework == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend)
        else:
            torch.distributed.init_process_group(backend, rank=0, world_size=1)
    if framework == "megatron":
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        if device.type == "cuda":  # Megatron initialises expert weights under its CUDA RNG tracker
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)


def _trainer(model, framework: str, run: RunConfig) -> tuple[Callable, Callable, Callable]:
    """(step(tokens) -> loss, state() -> final weights, close()) for the framework's training path."""
    if framework == "deepspeed":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": run.parallel.micro_batch, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 1}}  # fmt: skip
        if next(model.parameters()).is_cuda:
            config["bf16"] = {"enabled": True}  # bf16 weights, fp32 master weights in the optimizer
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

        def ds_step(tokens):
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            return loss

        return ds_step, engine.module.state_dict, engine.destroy  # destroy releases the optimizer's buffers
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(tokens):
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        return loss

    return step, model.state_dict, lambda: None


def run_comparison(run: RunConfig, framework: str, steps: int, device: torch.device,
                   progress: Callable[[str], None] | None = None) -> dict:  # fmt: skip
    """Stock twice and MoK twice; returns {"runs": [...], "bitwise": {...}, "summary": {...}}."""
    _init_distributed(framework, device)
    # host-ok: the initial weights are kept on the CPU, once, outside the timed steps
    init_state = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                  for k, v in build_model(run, framework, "stock", device).state_dict().items()}  # fmt: skip
    B, S = run.parallel.micro_batch, run.parallel.seq_length
    results: list[RunResult] = []
    first_state: dict[str, dict] = {}  # the first run's final weights per variant, on the CPU
    bitwise: dict[str, bool] = {}
    for variant, repeat in VARIANTS:
        model = build_model(run, framework, variant, device)
        model.load_state_dict(init_state)  # MoK's state dict speaks the stock keys
        step, final_state, close = _trainer(model, framework, run)
        generator = torch.Generator().manual_seed(1234)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        losses, times, peak = [], [], _rss_mib()
        for i in range(steps):
            tokens = torch.randint(0, VOCAB, (B, S + 1), generator=generator).to(device)
            start = time.perf_counter()
            loss = step(tokens)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # host-ok: the harness times each step
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
            peak = max(peak, _rss_mib())
            if progress:
                progress(f"{variant} run {repeat}: step {i + 1}/{steps}, loss {losses[-1]:.4f}")
        steady = statistics.median(times[1:] or times)
        memory = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak
        results.append(RunResult(variant, repeat, losses, steady * 1e3, B * S / steady, memory))
        # host-ok: after the timed steps. A copy, since on the CPU a plain move would alias weights
        # that close() may release or reuse.
        state = {k: v.detach().to("cpu", copy=True) for k, v in final_state().items() if isinstance(v, torch.Tensor)}
        if variant not in first_state:
            first_state[variant] = state
        else:
            bitwise[variant] = results[-2].losses == losses and _equal_states(first_state.pop(variant), state)
        close()
        del model, step, final_state, close, state  # free this run's model and optimizer before the next one
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"runs": [r.summary() for r in results], "bitwise": bitwise, "summary": _summary(results)}


def _equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _summary(results: list[RunResult]) -> dict[str, dict]:
    out = {}
    for variant in ("stock", "mok"):
        rs = [r for r in results if r.variant == variant]
        out[variant] = {
            "step_ms": statistics.median(r.step_ms for r in rs),
            "tokens_per_s": statistics.median(r.tokens_per_s for r in rs),
            "peak_memory_mib": max(r.peak_memory_mib for r in rs),
            "final_loss": rs[0].losses[-1],
        }
    return out
