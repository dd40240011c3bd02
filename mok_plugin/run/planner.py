"""Per-GPU estimates for a run config: memory, and the time of one MoE layer.

Reads a run through `PlannedRun` (its model, parallel layout, machine and MoK config), which
`RunConfig` (topology.py) satisfies; it does not import topology.py, whose validation calls these
estimates, so the import runs one way: sections <- planner <- topology.

Every expert count follows the model's expert family (`ModelShape.expert_family`, experts.py): with
F = fc1_width(I) rows of the first linear (2I glu, I mlp, 0 linear) and N its intermediate size (I,
or H for a linear expert), one expert holds
  P(I) = F H + H N (+ F with an fc1 bias) (+ H with an fc2 bias)
parameters (3HI for bias-free SwiGLU, 2HI for a plain MLP, H^2 for a linear expert), and one routed
row's forward GEMMs take M = gemm_macs_per_row(H, I) multiply-adds (3HI glu, 2HI mlp, H^2 linear).

Memory per GPU (bytes), for bf16 weights trained with fp32 gradients and Adam (Megatron's defaults
with the distributed optimizer):
  weights      2 B per parameter held: routed experts (E_slots / ep experts x moe_layers / pp layers,
               P(I) / expert_tp each), shared experts (P(Is) / tp per MoE layer), the rest
               (dense_params / (tp pp))
  gradients    4 B per parameter (fp32 main_grad)
  optimizer    12 B per parameter (fp32 master, Adam m and v), sharded over the parameter's
               data-parallel ranks: dp for dense ones, tp dp / (ep expert_tp) for experts
  activations  per layer and micro-batch of T = seq_length x micro_batch tokens: 34 T H / tp bytes
               for attention and norms with selective recompute (Korthikanti et al., "Reducing
               Activation Recomputation in Large Transformer Models", 2022, arXiv:2205.05198, with
               sequence parallelism; "none" is treated the same, "full" keeps 2 T H), plus MoK's saved
               tensors in an MoE layer: the input (2 T H) and the first linear's output h of the K
               routed rows (2 x T K F: 4 T K I for glu, 2 T K I for mlp, none for a linear expert,
               which keeps its input rows); 1F1B keeps pp micro-batches in flight on the first stage, so
               num_layers / pp x pp layers' worth
  MoK buffers  expert-parallel exchange buffers of one layer: rows x H x 2 B for send and receive,
               dispatch and combine (4 buffers), rows = T K x ep_capacity_factor (capacity exchange)
               or T K (exact); with mok.fp8, the FP8 copies of the experts' weights (routed and shared)
               kept through a step: 1 B per weight and 1 B for its transpose (fp8/weight_copies.py)
It fits when the total is at most 90 % of the GPU's HBM (the rest: allocator slack, NCCL, CUDA
context).

Time of one MoE layer, forward and backward, for one micro-batch on one GPU:
  expert FLOPs  3 passes x 2 FLOPs x T K rows x M / expert_tp (forward 2 M per row, backward twice
                the forward: 18 T K H I for SwiGLU, 12 T K H I for a plain MLP; bias adds and the
                activation are not counted), at `efficiency` x the machine's dense bf16 rate; with
                mok.fp8, that rate times MoK's FP8 speed-up measured on the GPU (`fp8_speedup`: 1.23
                on Hopper today), or the dense FP8 rate where none is measured (the exchange stays
                bf16: MoK quantises after dispatch)
  exchange      dispatch and combine, forward and backward: 4 x T K H x 2 B x (ep - 1) / ep bytes
                sent per GPU, over NVLink when the EP group fits one NVLink domain, else the
                scale-out network (per-direction datasheet rates, run/sections.py); a run whose exchange would
                use a link the machine lacks (0 GB/s) is refused when the run config loads
                (and by `layer_time`), never charged 0 ms
`efficiency` is in (0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from mok_plugin.config import MoKConfig, MoKConfigError
from mok_plugin.experts import MoKExpertFamily
from mok_plugin.run.sections import Machine, ModelShape, ParallelLayout

__all__ = [
    "LayerTime",
    "MemoryEstimate",
    "PlannedRun",
    "exchange_link",
    "expert_params",
    "expert_rate_tflops",
    "layer_time",
    "memory_per_gpu",
]

GIB = 1024**3
BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIMIZER = 2, 4, 12
HBM_USABLE = 0.9


class PlannedRun(Protocol):
    """What the planner reads of a run; `mok_plugin.run.topology.RunConfig` is one."""

    @property
    def model(self) -> ModelShape: ...

    @property
    def parallel(self) -> ParallelLayout: ...

    @property
    def hardware(self) -> Machine: ...

    def mok_config(self) -> MoKConfig: ...


@dataclass(frozen=True)
class MemoryEstimate:
    expert_params: float
    dense_params: float
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    mok_buffers_gib: float
    budget_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.mok_buffers_gib

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.budget_gib


@dataclass(frozen=True)
class LayerTime:
    expert_flops: float
    expert_ms: float
    exchange_bytes: float
    exchange_ms: float
    link: str  # "NVLink", "scale-out" or "none"
    link_gb_s: float


def _tokens(run: PlannedRun) -> int:
    return run.parallel.seq_length * run.parallel.micro_batch


def expert_params(family: MoKExpertFamily, hidden_size: int, ffn_hidden_size: int) -> int:
    """P(I) of the module docstring: the weights and biases of one expert MLP of `family`."""
    H, F = hidden_size, family.fc1_width(ffn_hidden_size)
    weights = F * H + H * family.intermediate_size(H, ffn_hidden_size)
    return weights + (F if family.fc1_bias else 0) + (H if family.fc2_bias else 0)


def memory_per_gpu(run: PlannedRun) -> MemoryEstimate:
    """The memory estimate of the module docstring."""
    p, m, hw = run.parallel, run.model, run.hardware
    family = m.expert_family
    layers_here = m.moe_layers / p.pp
    slots = m.num_experts + p.redundant_experts
    routed = layers_here * slots / p.ep * expert_params(family, m.hidden_size, m.ffn_hidden_size) / p.expert_tp
    has_shared = m.shared_ffn_hidden_size > 0
    shared = layers_here * expert_params(family, m.hidden_size, m.shared_ffn_hidden_size) / p.tp if has_shared else 0
    dense = m.dense_params_b * 1e9 / (p.tp * p.pp) + shared
    expert_dp = max(1, p.tp * p.dp // (p.ep * p.expert_tp))
    T, H, K, I = _tokens(run), m.hidden_size, m.top_k, m.ffn_hidden_size
    per_layer = {"full": 2 * T * H, "selective": 34 * T * H / p.tp, "none": 34 * T * H / p.tp}[p.activation_recompute]
    h_bytes = 2 * T * K * family.fc1_width(I) / p.expert_tp
    moe_saved = 0 if p.activation_recompute == "full" else 2 * T * H + h_bytes
    activations = m.num_layers * per_layer + m.moe_layers * moe_saved
    mok = run.mok_config()
    rows = T * K * (mok.ep_capacity_factor if mok.ep_exchange == "capacity" else 1.0) if p.ep > 1 else 0
    fp8_copies = 2 * (routed + shared) if mok.fp8 is not None else 0
    return MemoryEstimate(
        expert_params=routed,
        dense_params=dense,
        weights_gib=(routed + dense) * BYTES_WEIGHT / GIB,
        grads_gib=(routed + dense) * BYTES_GRAD / GIB,
        optimizer_gib=(routed / expert_dp + dense / p.dp) * BYTES_OPTIMIZER / GIB,
        activations_gib=activations / GIB,
        mok_buffers_gib=(4 * rows * H * 2 + fp8_copies) / GIB,
        budget_gib=HBM_USABLE * hw.hbm_gib,
    )


def exchange_link(run: PlannedRun) -> tuple[str, str, float]:
    """The link the expert exchange uses: (name, the Machine field of its rate, GB/s per direction).

    "none" (rate 0) at EP 1; NVLink when the EP group fits one NVLink domain; else the scale-out
    network.
    """
    p, hw = run.parallel, run.hardware
    if p.ep == 1:
        return "none", "", 0.0
    if p.ep * p.expert_tp <= hw.nvlink_domain:
        return "NVLink", "nvlink_gb_s", hw.nvlink_gb_s
    return "scale-out", "scale_out_gb_s", hw.scale_out_gb_s


def expert_rate_tflops(hw: Machine, fp8: bool) -> float:
    """The rate the expert GEMMs are planned at before `efficiency`: the dense bf16 rate, or with FP8
    the bf16 rate times the measured `fp8_speedup` (the dense FP8 rate where none is measured)."""
    if not fp8:
        return hw.bf16_tflops
    return hw.fp8_tflops if hw.fp8_speedup is None else hw.bf16_tflops * hw.fp8_speedup


def layer_time(run: PlannedRun, efficiency: float = 0.6) -> LayerTime:
    """The MoE-layer time estimate of the module docstring (forward + backward, one micro-batch).

    Raises:
        ValueError: `efficiency` not a finite number in (0, 1].
        MoKConfigError: the exchange would go over a link of 0 GB/s (naming the machine's field).
    """
    if not (isinstance(efficiency, (int, float)) and math.isfinite(efficiency) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency={efficiency!r}: must be a finite fraction of peak in (0, 1]")
    p, m, hw = run.parallel, run.model, run.hardware
    T, H, K, I = _tokens(run), m.hidden_size, m.top_k, m.ffn_hidden_size
    flops = 3 * 2 * T * K * m.expert_family.gemm_macs_per_row(H, I) / p.expert_tp
    rate = expert_rate_tflops(hw, run.mok_config().fp8 is not None)
    expert_ms = flops / (efficiency * rate * 1e12) * 1e3
    exchange = 4 * T * K * H * 2 * (p.ep - 1) / p.ep
    link, rate_field, rate = exchange_link(run)
    if link != "none" and rate <= 0:
        raise MoKConfigError(
            f"parallel.ep={p.ep}: the expert exchange goes over {link}, but machine {hw.name!r} has "
            f"{rate_field}=0 GB/s; its time would be infinite"
        )
    exchange_ms = exchange / (rate * 1e9) * 1e3 if link != "none" else 0.0
    return LayerTime(flops, expert_ms, exchange, exchange_ms, link, rate)
