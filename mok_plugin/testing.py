"""Shared by tests/ and scripts/: named shapes, seeded inputs, the float64 oracle, tolerances.

Owns: `NAMED_SHAPES` ((T, H, I, E, K) of real models and of minimal cases), `make_layer_inputs`
(seeded, never zeros), `oracle_moe` (a float64, per-token, per-chosen-expert loop written
differently from `reference.py`, so it checks it), the tolerance table and `assert_close`, which
reports max abs error, mean relative error and the first mismatch.

Imports no pytest.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mok_plugin.experts import SWIGLU, MoKExpertFamily

__all__ = [
    "free_port",
    "init_gloo",
    "exit_without_teardown",
    "run_ranks",
    "NAMED_SHAPES",
    "parse_shape",
    "MoEShape",
    "Tolerance",
    "TOLERANCES",
    "assert_close",
    "make_layer_inputs",
    "output_and_grads",
    "EXPERT_FAMILIES",
    "oracle_expert_mlp",
    "oracle_experts",
    "oracle_moe",
    "oracle_kept_pairs",
]


@dataclass(frozen=True, slots=True)
class MoEShape:
    """One MoE layer shape, always in the order (T, H, I, E, K)."""

    T: int
    H: int
    I: int
    E: int
    K: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.T, self.H, self.I, self.E, self.K)


NAMED_SHAPES: dict[str, MoEShape] = {
    # Real models (the benchmark's named shapes).
    "qwen3-30b-a3b": MoEShape(16384, 2048, 768, 128, 8),
    "olmoe": MoEShape(16384, 2048, 1024, 64, 8),
    "mixtral-8x7b": MoEShape(8192, 4096, 14336, 8, 2),
    "deepseek-v3": MoEShape(8192, 7168, 2048, 256, 8),
    # GPT-OSS-120B's expert shape (its MLP is `--expert gpt-oss` in the layer benchmark); H = I = 2880,
    # neither a multiple of 128.
    "gpt-oss-120b": MoEShape(16384, 2880, 2880, 128, 4),
    # Minimal cases for CPU tests and the interpreter.
    "tiny": MoEShape(24, 32, 16, 4, 2),
    "small": MoEShape(64, 64, 48, 8, 2),
}


def parse_shape(text: str) -> MoEShape:
    """A named shape, or "T,H,I,E,K".

    Raises:
        ValueError: neither a name in NAMED_SHAPES nor five comma-separated integers.
    """
    if text in NAMED_SHAPES:
        return NAMED_SHAPES[text]
    try:
        T, H, I, E, K = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected one of {', '.join(NAMED_SHAPES)} or T,H,I,E,K") from None
    return MoEShape(T, H, I, E, K)


@dataclass(frozen=True, slots=True)
class Tolerance:
    """|actual - expected| <= atol * scale * growth + rtol * |expected|, scale = max |expected|.

    `growth` is sqrt(n_reduce / 64) for a quantity that sums n_reduce rounded terms (weight
    gradients over an expert's rows, dX over k): rounding errors of independent terms add like a
    random walk, so the bound grows with the square root of the count, not linearly.
    """

    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: Tolerance(atol=2e-5, rtol=2e-4),
    torch.float16: Tolerance(atol=2e-3, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=5e-2),
}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str, n_reduce: int = 1
) -> None:
    """Raise AssertionError with max abs error, mean relative error and the first mismatch."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    tol = TOLERANCES[dtype]
    a = actual.detach().to(torch.float64).cpu()  # host-ok: test comparison
    b = expected.detach().to(torch.float64).cpu()  # host-ok: test comparison
    if not torch.isfinite(a).all():
        raise AssertionError(f"{name}: non-finite values in the result")
    scale = float(b.abs().max()) if b.numel() else 0.0
    growth = math.sqrt(max(1.0, n_reduce / 64))
    bound = tol.atol * max(scale, 1e-30) * growth + tol.rtol * b.abs()
    err = (a - b).abs()
    bad = err > bound
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        rel = (err / b.abs().clamp_min(scale * 1e-3 + 1e-30)).mean()
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())} of {b.numel()} elements outside tolerance; "
            f"max abs err {float(err.max()):.3e} (scale {scale:.3e}), mean rel err {float(rel):.3e}; "
            f"first at {first}: got {float(a[first]):.6e}, expected {float(b[first]):.6e}"
        )


def make_layer_inputs(
    T: int, H: int, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> torch.Tensor:
    """x [T, H] ~ N(0, 1) from a seeded CPU generator (the same values on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=generator).to(device=device, dtype=dtype)


def output_and_grads(layer_fn: Callable, x: torch.Tensor) -> list[torch.Tensor]:
    """A MoK layer's (or its torch.compile wrapper's) output for x, then the gradients of
    sum(out²) + aux to x and to the layer's parameters, in that order (the layer's grads reset first)."""
    layer = getattr(layer_fn, "_orig_mod", layer_fn)
    layer.zero_grad(set_to_none=True)
    x_leaf = x.detach().clone().requires_grad_()
    out, aux = layer_fn(x_leaf)
    ((out.float() ** 2).sum() + aux).backward()
    return [out.detach(), x_leaf.grad] + [p.grad.clone() for p in layer.parameters()]


def oracle_kept_pairs(topk_ids: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Bool [T, K]: which (token, k) pairs survive a per-expert capacity, first come first served
    in (token, k) order; a plain Python loop."""
    T, K = topk_ids.shape
    kept = torch.ones(T, K, dtype=torch.bool)
    if capacity is None:
        return kept
    taken = [0] * num_experts
    ids = topk_ids.tolist()  # host-ok: Python-loop oracle
    for t in range(T):
        for k in range(K):
            e = ids[t][k]
            if taken[e] >= capacity:
                kept[t, k] = False
            else:
                taken[e] += 1
    return kept


# One family of each kind and activation, with and without biases; the clamp is small enough that
# unit-scale test inputs cross it (GPT-OSS's 7.0 would never clamp them).
EXPERT_FAMILIES: dict[str, MoKExpertFamily] = {
    "swiglu": MoKExpertFamily(),
    "glu_gelu_bias": MoKExpertFamily("glu", "gelu", fc1_bias=True, fc2_bias=True),
    "glu_gelu_tanh": MoKExpertFamily("glu", "gelu_tanh"),
    "glu_relu": MoKExpertFamily("glu", "relu", fc2_bias=True),
    "gpt_oss": MoKExpertFamily("glu", "quick_gelu", clamp=0.25, linear_offset=1.0, fc1_bias=True, fc2_bias=True),
    "mlp_gelu_bias": MoKExpertFamily("mlp", "gelu", fc1_bias=True, fc2_bias=True),
    "mlp_gelu_tanh": MoKExpertFamily("mlp", "gelu_tanh", fc1_bias=True),
    "mlp_quick_gelu": MoKExpertFamily("mlp", "quick_gelu"),
    "mlp_relu": MoKExpertFamily("mlp", "relu", fc2_bias=True),
    "mlp_squared_relu": MoKExpertFamily("mlp", "squared_relu"),
    "mlp_silu": MoKExpertFamily("mlp", "silu", fc1_bias=True),
    "linear_bias": MoKExpertFamily("linear", fc2_bias=True),
}


def _oracle_activation(g: torch.Tensor, name: str) -> torch.Tensor:
    """The activations written out from their definitions (not experts.py's torch calls)."""
    if name == "silu":
        return g / (1.0 + torch.exp(-g))
    if name == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    if name == "quick_gelu":
        return g / (1.0 + torch.exp(-1.702 * g))
    if name == "relu":
        return torch.where(g > 0, g, torch.zeros_like(g))
    assert name == "squared_relu", name
    return torch.where(g > 0, g * g, torch.zeros_like(g))


def oracle_expert_mlp(
    x_t: torch.Tensor,
    w1: torch.Tensor | None,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    family: MoKExpertFamily = SWIGLU,
) -> torch.Tensor:
    """One expert on one token x_t [H]: fc1, the family's activation, fc2 (experts.py's formulas)."""
    if family.kind == "linear":
        a = x_t
    else:
        h = w1 @ x_t + (b1 if b1 is not None else 0.0)
        if family.kind == "mlp":
            a = _oracle_activation(h, family.activation)
        else:
            gate, up = h[: h.shape[0] // 2], h[h.shape[0] // 2 :]
            if family.clamp is not None:
                gate = torch.minimum(gate, torch.full_like(gate, family.clamp))
                up = torch.maximum(
                    torch.minimum(up, torch.full_like(up, family.clamp)), torch.full_like(up, -family.clamp)
                )
            a = _oracle_activation(gate, family.activation) * (up + family.linear_offset)
    return w2 @ a + (b2 if b2 is not None else 0.0)


def oracle_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor | None,
    down_proj: torch.Tensor,
    kept: torch.Tensor | None = None,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k w_tk * expert_e(x_t) (`oracle_expert_mlp`), one token and one chosen expert at a time.

    Dropped pairs (kept False) contribute nothing. Float64 in, float64 out; autograd gives the
    gradients of x, topk_weights, the weights and the biases.
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    ids = topk_ids.tolist()  # host-ok: Python-loop oracle
    kept_list = kept.tolist() if kept is not None else [[True] * K for _ in range(T)]  # host-ok: oracle
    outputs = []
    for t in range(T):
        y = torch.zeros(H, dtype=x.dtype)
        for k in range(K):
            if kept_list[t][k]:
                e = ids[t][k]
                y = y + topk_weights[t, k] * oracle_expert_mlp(
                    x[t],
                    None if gate_up_proj is None else gate_up_proj[e],
                    down_proj[e],
                    None if gate_up_bias is None else gate_up_bias[e],
                    None if down_bias is None else down_bias[e],
                    family,
                )
        outputs.append(y)
    return torch.stack(outputs)


def oracle_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    score_function: str = "softmax",
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
    kept: torch.Tensor | None = None,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    family: MoKExpertFamily = SWIGLU,
    biases: dict[str, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE layer in float64, one token at a time.

    The expert choice `topk_ids` is taken as given (selection is discrete and tested apart); the
    weights are recomputed from the logits here, so their gradient reaches the router weight.
    Pass float64 leaf tensors with requires_grad to get gradients by autograd. `biases` maps
    gate_up_bias, down_bias, shared_gate_up_bias, shared_down_bias to tensors (absent: none).

    Returns:
        (output [T, H], topk_weights [T, K], aux_loss []) in float64.
    """
    T, H = x.shape
    E = down_proj.shape[0]
    K = topk_ids.shape[1]
    ids = topk_ids.tolist()  # host-ok: Python-loop oracle
    weights, lse = [], []
    for t in range(T):
        logits = router_weight @ x[t]
        lse.append(torch.logsumexp(logits, dim=0))
        if score_function == "softmax":
            scores = torch.exp(logits - logits.max()) / torch.exp(logits - logits.max()).sum()
        else:
            scores = 1.0 / (1.0 + torch.exp(-logits))
        chosen = torch.stack([scores[e] for e in ids[t]])
        if norm_topk_prob:
            chosen = chosen / chosen.sum()
        weights.append(chosen * routed_scaling_factor)
    topk_weights = torch.stack(weights)
    b = biases or {}
    out = oracle_experts(
        x, topk_ids, topk_weights, gate_up_proj, down_proj, kept, family, b.get("gate_up_bias"), b.get("down_bias")
    )
    if shared_down is not None:
        shared = [
            oracle_expert_mlp(x[t], shared_gate_up, shared_down, b.get("shared_gate_up_bias"),
                              b.get("shared_down_bias"), family)
            for t in range(T)
        ]  # fmt: skip
        out = out + torch.stack(shared)

    aux = torch.zeros((), dtype=x.dtype)
    if aux_loss_coeff > 0:
        logits_all = x @ router_weight.t()
        probs = torch.softmax(logits_all, dim=-1) if score_function == "softmax" else torch.sigmoid(logits_all)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        # The loss counts each token's plain top-K of these scores (no expert bias, no groups), as
        # Megatron-Core does: not the experts `topk_ids` chose. Ties: the lower index.
        plain = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :K].tolist()  # host-ok
        for e in range(E):
            picked = sum(row.count(e) for row in plain)
            aux = aux + aux_loss_coeff * E * (picked / (T * K)) * probs[:, e].mean()
    if z_loss_coeff > 0:
        aux = aux + z_loss_coeff * torch.stack(lse).square().mean()
    return out, topk_weights, aux


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a local torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    """Join a gloo process group of `world` ranks on 127.0.0.1:port; a collective that waits
    longer than timeout_s raises instead of hanging."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def exit_without_teardown() -> None:
    """Leave a spawned rank's process once everything it reports is written (flushed here) and its
    work is done, skipping C++ teardown: a gloo rank whose process group is destroyed at interpreter
    exit can abort ("terminate called without an active exception") while another rank is still
    closing, failing a run that passed. The rank's own child processes are ended first: `os._exit`
    skips the exit handlers that would, and Megatron's torch_dist checkpoint save starts one (a
    multiprocessing Manager for its write results) that would otherwise outlive the run."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_then_exit(rank: int, fn: Callable[..., None], *args) -> None:
    """fn(rank, *args), then `exit_without_teardown`; an exception in fn propagates as before (the
    spawn reports it). When fn's module brought DeepSpeed in, its CPU shared-memory all-reduce is
    switched off first (see mok_plugin.deepspeed.cpu_comm: it leaks /dev/shm)."""
    if "deepspeed" in sys.modules:
        from mok_plugin.deepspeed.cpu_comm import skip_shared_memory_allreduce

        skip_shared_memory_allreduce()
    fn(rank, *args)
    exit_without_teardown()


def run_ranks(fn: Callable[..., None], world: int, args: tuple = (), timeout_s: float = 300.0) -> None:
    """Run fn(rank, world, port, *args) in `world` spawned processes (port: free, for init_gloo).

    Raises:
        TimeoutError: some rank was still running after timeout_s (a hang fails instead of
            stalling the caller); every rank still alive is killed first.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
    """
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _run_then_exit, args=(fn, world, free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"ranks {alive} of {world} still running after {timeout_s:.0f} s (a hang?)")
