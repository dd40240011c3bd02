"""Train the comparison model with the stock MoE layers and with MoK, twice each, from the same
initial weights on the same tokens (a seeded synthetic language, data.py); measure step time,
tokens/s, the layers' peak memory and the losses, and check whether the two runs of each variant
are bitwise equal (losses and final weights).

The stock layer is the one `select_stock_path` picks (stock_path.py: Megatron's Transformer Engine
spec with grouped GEMM where TE imports on a GPU, else the local SequentialMLP), and the result
says which ("stock_path"). With Megatron, the PyTorch grouped_mm path (the stand-in for a grouped
stock path; stock_path.py) is then trained twice the same way ("stand_in"); where this torch
cannot run it, "stand_in" says why instead of giving numbers.

Memory (`peak_memory_mib`), per run:
  - on a GPU: `torch.cuda.max_memory_allocated`, reset before each run (everything the caching
    allocator handed out during that run: weights, gradients, optimizer state, activations);
  - on the CPU: the peak of the bytes held by tensor storages during one training step, counted by
    torch's `MemTracker` (torch.distributed._tools.mem_tracker): the model's parameters and
    gradients and the optimizer's state, registered before the step, plus every tensor an operator
    allocates during it (activations, temporaries). Not the process's resident memory, which is
    mostly the imported libraries. The tracked step is left out of the timing (tracking slows it).
`MEMORY_SOURCES` names each; the report prints the one used.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from mok_plugin.compare.data import make_batches
from mok_plugin.compare.models import VOCAB, build_model
from mok_plugin.compare.stock_path import GROUPED_MM_ERRORS, StockPath, confirm_built, select_stock_path
from mok_plugin.run.topology import RunConfig
from mok_plugin.testing import free_port

__all__ = ["MEMORY_SOURCES", "RunResult", "learning_rate", "memory_source", "run_comparison", "runs_planned"]

VARIANTS = (("stock", 1), ("stock", 2), ("mok", 1), ("mok", 2))
STAND_IN = "grouped_mm"  # the PyTorch grouped_mm stand-in, trained twice after them (Megatron only)
# Adam's step size at the tiny config's hidden size 64: 1e-2, not 1e-3, because with its embeddings
# (std 0.02) the model needs about 10 steps at 1e-2 to leave ln(vocab) (measured: 6.24 -> 3.6 by step
# 10), and 100 at 1e-3. Wider models take it scaled by 64 / hidden_size: at 1e-2 the 4-layer qwen3
# config (hidden 2048, bf16, one H200) diverged, its loss 6.23 -> 2e4 in 10 steps, stock and MoK alike.
BASE_LEARNING_RATE = 1e-2
BASE_HIDDEN_SIZE = 64


def learning_rate(hidden_size: int) -> float:
    """Adam's learning rate for a model of this hidden size (see BASE_LEARNING_RATE)."""
    return BASE_LEARNING_RATE * min(1.0, BASE_HIDDEN_SIZE / hidden_size)


MEMORY_SOURCES = {
    "cuda": "CUDA peak allocated (torch.cuda.max_memory_allocated, reset per run)",
    "cpu": "peak bytes held by tensors in one training step: weights, gradients, optimizer state, "
    "activations (torch MemTracker)",
}


def memory_source(device: torch.device) -> str:
    """What `peak_memory_mib` measures on `device` (a sentence for the report)."""
    return MEMORY_SOURCES["cuda" if device.type == "cuda" else "cpu"]


@dataclass
class RunResult:
    variant: str
    repeat: int
    losses: list[float]  # the language-model cross-entropy at each step
    aux_losses: list[float] | None  # DeepSpeed: the layers' summed l_aux (unscaled) at each step
    step_ms: float
    tokens_per_s: float
    peak_memory_mib: float

    def summary(self) -> dict:
        return asdict(self)


def _init_distributed(framework: str, device: torch.device) -> None:
    if not torch.distributed.is_initialized():
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        if framework == "deepspeed":
            import deepspeed

            from mok_plugin.deepspeed.cpu_comm import skip_shared_memory_allreduce

            skip_shared_memory_allreduce()  # its CPU op compiles C++ and leaks /dev/shm
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


@dataclass
class _Trainer:
    step: Callable[[torch.Tensor], torch.Tensor]  # one training step on int64 [B, S + 1] tokens -> the loss
    state: Callable[[], dict]  # the final weights
    close: Callable[[], None]  # releases the optimizer's buffers
    optimizer: torch.optim.Optimizer  # the torch optimizer that holds the state (for the memory count)


def _trainer(model, framework: str, run: RunConfig) -> _Trainer:
    """The framework's training path over `model`."""
    lr = learning_rate(run.model.hidden_size)
    if framework == "deepspeed":
        import deepspeed

        # ZeRO's gradient buckets default to 5e8 elements (1.9 GiB in fp32) whatever the model's size;
        # at most the model's size here, so that the memory column shows the model, not an empty bucket.
        bucket = min(500_000_000, sum(p.numel() for p in model.parameters()))
        config = {"train_micro_batch_size_per_gpu": run.parallel.micro_batch, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10**9,
                  "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
                  "zero_optimization": {"stage": 1, "reduce_bucket_size": bucket,
                                        "allgather_bucket_size": bucket}}  # fmt: skip
        if next(model.parameters()).is_cuda:
            config["bf16"] = {"enabled": True}  # bf16 weights, fp32 master weights in the optimizer
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

        def ds_step(tokens):
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            return loss

        # ZeRO wraps a torch Adam (.optimizer) over its fp32 partitions; destroy releases its buffers
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        return _Trainer(ds_step, engine.module.state_dict, engine.destroy, inner)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step(tokens):
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        return loss

    return _Trainer(step, model.state_dict, lambda: None, optimizer)


def _tracked_step(trainer: _Trainer, model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """One training step under MemTracker; returns the peak bytes held by tensors on the tokens' device."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    # Tensors that exist before the step are invisible unless registered: the weights (and any
    # gradients), the optimizer's state, and its parameters and their gradients (under ZeRO, fp32
    # partitions that are not the model's weights). Storages are counted once however many views.
    external = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    external += [p.grad for p in external if p.grad is not None]
    tracker.track_external(model, trainer.optimizer, *external)
    with tracker:
        trainer.step(tokens)
    peak = tracker.get_tracker_snapshot("peak")
    return int(peak.get(tokens.device, {}).get("Total", 0))


def runs_planned(framework: str, fp8: bool = False) -> int:
    """How many training runs `run_comparison` makes: stock and MoK twice each, with Megatron the
    grouped_mm stand-in twice, and with MoK in FP8 one more MoK run in bf16 (its reference)."""
    return len(VARIANTS) + (2 if framework == "megatron" else 0) + (1 if fp8 else 0)


def run_comparison(run: RunConfig, framework: str, steps: int, device: torch.device,
                   progress: Callable[[str], None] | None = None) -> dict:  # fmt: skip
    """Stock twice and MoK twice (and, with Megatron, the grouped_mm stand-in twice). With the run's
    mok.fp8, MoK's runs are FP8 and one more MoK run in bf16 gives their reference: MoK is
    deterministic, so the two differ by FP8 alone (the stock layer's runs also differ from each other).

    Args:
        progress: called after each training step with a message (`runs_planned` x steps calls at
            most; fewer where the stand-in cannot run).
    Returns:
        {"runs": [...], "bitwise": {...}, "summary": {...}, "data": {...}, "stock_path": {...},
        "stand_in": {...}}, and with FP8 "fp8_reference": the bf16 MoK run's summary.
    """
    _init_distributed(framework, device)
    stock_path = select_stock_path(framework, device)
    initial = build_model(run, framework, "stock", device, stock_path)
    stock_path = confirm_built(stock_path, _stock_experts(initial, framework))
    # host-ok: the initial weights are kept on the CPU, once, outside the timed steps
    init_state = _portable_state(initial.state_dict())
    del initial
    B, S = run.parallel.micro_batch, run.parallel.seq_length
    batches = make_batches(VOCAB, steps, B, S + 1)  # drawn once, on the CPU: every run sees the same tokens
    train = functools.partial(_train, run=run, framework=framework, device=device, stock_path=stock_path,
                              init_state=init_state, batches=batches, progress=progress)  # fmt: skip
    results: list[RunResult] = []
    first_state: dict[str, dict] = {}  # the first run's final weights per variant, on the CPU
    bitwise: dict[str, bool] = {}
    for variant, repeat in VARIANTS:
        result, state = train(variant, repeat)
        results.append(result)
        if variant not in first_state:
            first_state[variant] = state
        else:
            bitwise[variant] = results[-2].losses == result.losses and _equal_states(first_state.pop(variant), state)
    result = {
        "runs": [r.summary() for r in results],
        "bitwise": bitwise,
        "summary": _summary(results, B * S),
        "data": _data_summary(learning_rate(run.model.hidden_size)),
        "stock_path": stock_path.summary(),
        "stand_in": _stand_in(train, framework, stock_path, B * S),
    }
    if run.mok_config().fp8 is not None:
        bf16 = run.model_copy(update={"mok": {k: v for k, v in run.mok.items() if k not in ("fp8", "fp8_scaling")}})
        reference, _ = train("mok", 1, run=bf16)
        result["fp8_reference"] = dataclasses.replace(reference, variant="mok bf16").summary()
    return result


def _train(variant: str, repeat: int, *, run: RunConfig, framework: str, device: torch.device,
           stock_path: StockPath, init_state: dict, batches: list[torch.Tensor],
           progress: Callable[[str], None] | None) -> tuple[RunResult, dict]:  # fmt: skip
    """One training run of `variant` from `init_state`; returns its result and final weights (on the CPU)."""
    steps = len(batches)
    B, S = batches[0].shape[0], batches[0].shape[1] - 1
    # On the CPU one step (the second, once the optimizer's state exists) is measured for memory
    # and left out of the timing; the first step is left out too (first-call costs).
    tracked = min(1, steps - 1) if device.type == "cpu" else None
    model = build_model(run, framework, variant, device, stock_path)
    _load_weights(model, init_state)  # MoK's state dict speaks the stock keys
    trainer = _trainer(model, framework, run)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, aux_losses, times, peak_bytes = [], [], [], 0
    try:
        for i in range(steps):
            tokens = batches[i].to(device)
            if i == tracked:
                peak_bytes = _tracked_step(trainer, model, tokens)
            else:
                start = time.perf_counter()
                trainer.step(tokens)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # host-ok: the harness times each step
                times.append((i, time.perf_counter() - start))
            losses.append(float(model.last_lm_loss))
            if model.last_aux_loss is not None:
                aux_losses.append(float(model.last_aux_loss))
            if progress:
                progress(f"{variant} run {repeat}: step {i + 1}/{steps}, loss {losses[-1]:.4f}")
        steady = statistics.median([t for i, t in times if i > 0] or [t for _, t in times] or [float("nan")])
        if device.type == "cuda":
            peak_bytes = torch.cuda.max_memory_allocated(device)
        result = RunResult(variant, repeat, losses, aux_losses or None, steady * 1e3, B * S / steady,
                           peak_bytes / 2**20)  # fmt: skip
        # host-ok: after the timed steps. A copy, since on the CPU a plain move would alias weights
        # that close() may release or reuse. Transformer Engine's _extra_state (fp8 metadata) is no weight.
        state = {k: v.detach().to("cpu", copy=True) for k, v in trainer.state().items()
                 if isinstance(v, torch.Tensor) and not k.endswith(_EXTRA_STATE)}  # fmt: skip
    finally:
        trainer.close()
        del model, trainer  # free this run's model and optimizer before the next one
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result, state


def _stand_in(train: Callable, framework: str, stock_path: StockPath, tokens_per_step: int) -> dict:
    """The grouped_mm stand-in's block: trained twice (`train`) where it can run, else why not."""
    if stock_path.grouped_gemm:
        label = f"the PyTorch grouped_mm path, for reference (the stock side already runs {stock_path.experts})"
    elif framework == "megatron":
        label = "stand-in for a grouped stock path (TEGroupedMLP did not run; the stock line says why)"
    else:
        label = "stand-in for a grouped stock path (DeepSpeed has none)"
    out: dict = {
        "name": STAND_IN,
        "role": "reference" if stock_path.grouped_gemm else "stand-in",
        "label": label,
        "what": ("Megatron's stock router and token dispatcher with the experts run as two torch grouped_mm "
                 "calls over the same weights (not a Megatron option)"),
        "ran": False, "reason": None, "runs": [], "bitwise": None, "summary": None,
    }  # fmt: skip
    if framework != "megatron":
        out["reason"] = ("it is Megatron's MoE layer with grouped_mm experts, so it runs with --framework "
                         "megatron only")  # fmt: skip
        return out
    results, states = [], []
    for repeat in (1, 2):
        try:
            result, state = train(STAND_IN, repeat)
        except GROUPED_MM_ERRORS as error:
            message = (str(error).strip().splitlines() or [type(error).__name__])[0]
            out["reason"] = f"torch {torch.__version__} cannot run grouped_mm here ({message})"
            return out
        results.append(result)
        states.append(state)
    out.update(ran=True, runs=[r.summary() for r in results],
               bitwise=results[0].losses == results[1].losses and _equal_states(*states),
               summary=_variant_summary(results, tokens_per_step))  # fmt: skip
    return out


_EXTRA_STATE = "_extra_state"
# Transformer Engine's grouped linears name expert i's weight `weight{i}`; SequentialMLP's experts
# `local_experts.{i}.<linear>.weight`. The harness keeps the initial weights under the latter.
_TE_EXPERT_KEY = re.compile(r"experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def _sequential_key(key: str) -> str:
    """A state-dict key under SequentialMLP's names (TEGroupedMLP's expert keys renamed)."""
    return _TE_EXPERT_KEY.sub(r"experts.local_experts.\3.\1.\2", key)


def _portable_state(state: dict) -> dict:
    """The initial weights, on the CPU, under SequentialMLP's keys and without `_extra_state`
    entries, so that every variant (TE spec, local spec, MoK) can load them."""
    return {_sequential_key(k): v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in state.items() if not k.endswith(_EXTRA_STATE)}  # fmt: skip


def _load_weights(model: torch.nn.Module, state: dict) -> None:
    """Load `state` (`_portable_state`) into `model` strictly: under the model's own expert keys
    where they are TEGroupedMLP's, and with the model's own `_extra_state` entries."""
    full = dict(state)
    for key, value in model.state_dict().items():
        if key.endswith(_EXTRA_STATE):
            full[key] = value
        elif key not in full and _sequential_key(key) in full:
            full[key] = full.pop(_sequential_key(key))
    model.load_state_dict(full)


def _stock_experts(model: torch.nn.Module, framework: str) -> torch.nn.Module:
    """The experts module of the stock model's first MoE layer."""
    layer = model.moes[0]
    return layer.experts if framework == "megatron" else layer.deepspeed_moe.experts


def _data_summary(lr: float) -> dict:
    from mok_plugin.compare.data import ALPHABET, SUCCESSORS, BigramLanguage, uniform_loss

    return {
        "kind": f"a seeded random bigram language: {ALPHABET} of the {VOCAB} token ids, {SUCCESSORS} successors each",
        "uniform_loss": uniform_loss(VOCAB),
        "entropy": BigramLanguage.make(VOCAB).entropy,
        "learning_rate": lr,
    }


def _equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _summary(results: list[RunResult], tokens_per_step: int) -> dict[str, dict]:
    return {v: _variant_summary([r for r in results if r.variant == v], tokens_per_step) for v in ("stock", "mok")}


def _variant_summary(rs: list[RunResult], tokens_per_step: int) -> dict:
    step_ms = statistics.median(r.step_ms for r in rs)
    return {
        "step_ms": step_ms,
        "tokens_per_s": tokens_per_step / (step_ms / 1e3),  # from the same step time, so the columns agree
        "peak_memory_mib": max(r.peak_memory_mib for r in rs),
        "first_loss": rs[0].losses[0],
        "final_loss": rs[0].losses[-1],
    }
