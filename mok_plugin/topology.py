"""Run configs: a model's MoE shape, a parallel layout, MoK's knobs and the machine, validated.

A file in configs/topologies/ holds one run:

    machine: gb300-nvl72            # a name from MACHINES
    model: {name: deepseek-v3, num_layers: 61, moe_layers: 58, hidden_size: 7168, ...}
    parallel: {tp: 1, pp: 4, ep: 64, expert_tp: 1, dp: 64, seq_length: 4096, micro_batch: 1}
    mok: {ep_exchange: capacity, ep_transport: symmetric_memory, ...}   # MoKConfig knobs

`load_topology(path)` validates it and rejects what cannot run, each error naming its field:
experts not divisible by EP (unless `redundant_experts` makes them so), a world size the layout
does not factor, more pipeline stages than (MoE) layers, tensor or expert-tensor parallelism (both
adapters refuse them today), a `mok:` field that contradicts the model or parallel section (the
layer and the planner would disagree), the NVLink symmetric-memory path over more GPUs than one
NVLink domain, an expert exchange over a link the machine does not have (0 GB/s), and a layout
whose memory does not fit the GPU (estimated by `mok_plugin.planner`). A file that cannot be read
or parsed is an error naming the file.

Machine figures are datasheet values (dense bf16 TFLOP/s, HBM, NVLink per direction, scale-out
per direction), each with its source; `h200-measured` uses what was measured on this project's
H200 (BENCHMARKS.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mok_plugin.config import MAX_DIM, MoKConfig, MoKConfigError, format_validation_error, read_yaml, short_repr

__all__ = ["MACHINES", "Machine", "ModelShape", "ParallelLayout", "RunConfig", "load_topology"]

_DATASHEETS = "shared/reference/topologies-and-models.md (NVIDIA datasheets, tables 1-2)"


class Machine(BaseModel):
    """One GPU's rates and its fast-interconnect domain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    gpu: str
    nvlink_domain: int = Field(gt=0, description="GPUs that share NVLink (a node, or an NVL72 rack).")
    hbm_gib: float = Field(gt=0)
    hbm_tb_s: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0, description="Dense bf16 tensor-core rate.")
    nvlink_gb_s: float = Field(ge=0, description="NVLink bandwidth per GPU, one direction.")
    scale_out_gb_s: float = Field(ge=0, description="Network bandwidth per GPU, one direction.")
    source: str


MACHINES: dict[str, Machine] = {
    m.name: m
    for m in (
        Machine(name="gb300-nvl72", gpu="GB300", nvlink_domain=72, hbm_gib=277.5, hbm_tb_s=8.0, bf16_tflops=2500,
                nvlink_gb_s=900, scale_out_gb_s=100, source=_DATASHEETS),
        Machine(name="gb200-nvl72", gpu="GB200", nvlink_domain=72, hbm_gib=185.0, hbm_tb_s=8.0, bf16_tflops=2500,
                nvlink_gb_s=900, scale_out_gb_s=50, source=_DATASHEETS),
        Machine(name="hgx-h200", gpu="H200", nvlink_domain=8, hbm_gib=141.0, hbm_tb_s=4.8, bf16_tflops=989,
                nvlink_gb_s=450, scale_out_gb_s=50, source=_DATASHEETS),
        Machine(name="hgx-h100", gpu="H100", nvlink_domain=8, hbm_gib=80.0, hbm_tb_s=3.35, bf16_tflops=989,
                nvlink_gb_s=450, scale_out_gb_s=50, source=_DATASHEETS),
        Machine(name="h200-measured", gpu="H200", nvlink_domain=1, hbm_gib=139.8, hbm_tb_s=4.1, bf16_tflops=742,
                nvlink_gb_s=0, scale_out_gb_s=0,
                source="measured on this project's H200: device copy 4.1 TB/s, dense bf16 GEMM 742 TFLOP/s"),
        Machine(name="cpu", gpu="CPU", nvlink_domain=1, hbm_gib=16.0, hbm_tb_s=0.02, bf16_tflops=0.1, nvlink_gb_s=0,
                scale_out_gb_s=0, source="a nominal 2-core CPU with 16 GiB for the quickstart (rough)"),
    )
}  # fmt: skip


class ModelShape(BaseModel):
    """The MoE part of a model, and the size of everything else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # Sizes have MoKConfig's bound (config.MAX_DIM): the planner multiplies them.
    num_layers: int = Field(gt=0, le=MAX_DIM)
    moe_layers: int = Field(gt=0, le=MAX_DIM)
    hidden_size: int = Field(gt=0, le=MAX_DIM)
    ffn_hidden_size: int = Field(gt=0, le=MAX_DIM, description="One routed expert's intermediate size.")
    num_experts: int = Field(gt=0, le=MAX_DIM)
    top_k: int = Field(gt=0, le=MAX_DIM)
    shared_ffn_hidden_size: int = Field(
        default=0, ge=0, le=MAX_DIM, description="Total shared-expert intermediate size."
    )
    dense_params_b: float = Field(
        ge=0,
        le=1e6,  # a million billion: far above any model, and finite arithmetic in the planner
        allow_inf_nan=False,
        description="Billions of parameters outside routed and shared experts (attention, embeddings, dense FFN).",
    )
    source: str = ""


class ParallelLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(default=1, gt=0, le=MAX_DIM)
    pp: int = Field(default=1, gt=0, le=MAX_DIM)
    ep: int = Field(default=1, gt=0, le=MAX_DIM)
    expert_tp: int = Field(default=1, gt=0, le=MAX_DIM)
    dp: int = Field(default=1, gt=0, le=MAX_DIM)
    seq_length: int = Field(gt=0, le=MAX_DIM)
    micro_batch: int = Field(default=1, gt=0, le=MAX_DIM)
    redundant_experts: int = Field(
        default=0, ge=0, le=MAX_DIM, description="Extra expert slots so that EP divides them."
    )
    activation_recompute: Literal["none", "selective", "full"] = "selective"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class RunConfig(BaseModel):
    """A validated run: see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    machine: str
    model: ModelShape
    parallel: ParallelLayout
    mok: dict[str, Any] = Field(default_factory=dict)
    description: str = ""

    @property
    def hardware(self) -> Machine:
        return MACHINES[self.machine]

    def _from_sections(self) -> dict[str, tuple[Any, str]]:
        """MoKConfig fields the model and parallel sections decide: {field: (value, which fields)}."""
        m, p = self.model, self.parallel
        slots = f"model.num_experts={m.num_experts} + parallel.redundant_experts={p.redundant_experts}"
        shared = f"model.shared_ffn_hidden_size={m.shared_ffn_hidden_size}"
        return {
            "hidden_size": (m.hidden_size, f"model.hidden_size={m.hidden_size}"),
            "ffn_hidden_size": (m.ffn_hidden_size, f"model.ffn_hidden_size={m.ffn_hidden_size}"),
            "num_experts": (m.num_experts + p.redundant_experts, slots),
            "top_k": (m.top_k, f"model.top_k={m.top_k}"),
            "num_shared_experts": (1 if m.shared_ffn_hidden_size else 0, shared),
            "shared_ffn_hidden_size": (m.shared_ffn_hidden_size or None, shared),
            "ep_size": (p.ep, f"parallel.ep={p.ep}"),
        }

    def mok_config(self) -> MoKConfig:
        """The MoKConfig of one MoE layer of this run (one rank's view: ep_size = parallel.ep).

        Raises:
            MoKConfigError: a `mok:` field that contradicts the model or parallel section, naming
                both, or an invalid MoK field.
        """
        contradictions = self._contradictions()
        if contradictions:
            raise MoKConfigError("\n  ".join(contradictions))
        shape = {key: value for key, (value, _) in self._from_sections().items()}
        return MoKConfig(**{"params_dtype": "bfloat16", **shape, **self.mok})

    def _contradictions(self) -> list[str]:
        return [
            f"mok.{key}={short_repr(self.mok[key])} contradicts {source} (= {value!r}); set it in the model or "
            "parallel section only"
            for key, (value, source) in self._from_sections().items()
            if key in self.mok and self.mok[key] != value
        ]

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        from mok_plugin.planner import exchange_link, memory_per_gpu  # the planner imports this module

        problems: list[str] = []
        if self.machine not in MACHINES:
            raise ValueError(f"machine={short_repr(self.machine)}: unknown; allowed: {', '.join(MACHINES)}")
        p, m, hw = self.parallel, self.model, self.hardware
        slots = m.num_experts + p.redundant_experts
        if slots % p.ep:
            problems.append(
                f"parallel.ep={p.ep} does not divide the {slots} expert slots (model.num_experts={m.num_experts} + "
                f"parallel.redundant_experts={p.redundant_experts}); add redundant experts or change ep"
            )
        if m.top_k > m.num_experts:
            problems.append(f"model.top_k={m.top_k} exceeds model.num_experts={m.num_experts}")
        if m.moe_layers > m.num_layers:
            problems.append(f"model.moe_layers={m.moe_layers} exceeds model.num_layers={m.num_layers}")
        if p.pp > m.num_layers:
            problems.append(
                f"parallel.pp={p.pp} exceeds model.num_layers={m.num_layers}: every pipeline stage needs a layer"
            )
        elif p.pp > m.moe_layers:
            problems.append(
                f"parallel.pp={p.pp} exceeds model.moe_layers={m.moe_layers}: the planner spreads the MoE layers "
                "evenly over the stages (moe_layers / pp each), so every stage needs one"
            )
        if p.tp > 1:
            problems.append(
                f"parallel.tp={p.tp}: the adapters refuse tensor parallelism (the MoK layer takes the full hidden "
                "state on each rank; Megatron --tensor-model-parallel-size must be 1); use tp: 1"
            )
        if p.expert_tp > 1:
            problems.append(
                f"parallel.expert_tp={p.expert_tp}: the adapters refuse expert tensor parallelism (Megatron "
                "--expert-tensor-parallel-size, DeepSpeed enable_expert_tensor_parallelism); use expert_tp: 1"
            )
        if (p.tp * p.dp) % (p.ep * p.expert_tp):
            problems.append(
                f"parallel.ep={p.ep} x parallel.expert_tp={p.expert_tp} must divide tp x dp = {p.tp * p.dp} "
                "(the ranks of one pipeline stage)"
            )
        if self.mok.get("ep_transport") == "symmetric_memory" and p.ep * p.expert_tp > hw.nvlink_domain:
            problems.append(
                f"mok.ep_transport='symmetric_memory' needs the EP group in one NVLink domain: parallel.ep={p.ep} x "
                f"expert_tp={p.expert_tp} > {hw.nvlink_domain} GPUs of {hw.name}; use ep_transport='nccl'"
            )
        link, rate_field, rate = exchange_link(self)
        if link != "none" and rate <= 0:
            problems.append(
                f"parallel.ep={p.ep}: the expert exchange goes over {link}, but machine {hw.name!r} has "
                f"{rate_field}={rate:g} GB/s (no such link); use ep: 1 on this machine, or a machine with {link}"
            )
        problems += self._contradictions()
        if not problems:
            try:
                self.mok_config()
            except MoKConfigError as error:
                problems.append(str(error))
        if not problems:
            memory = memory_per_gpu(self)
            if memory.total_gib > memory.budget_gib:
                problems.append(
                    f"parallel: the layout does not fit {hw.gpu} memory: about {memory.total_gib:.1f} GiB per GPU "
                    f"(weights {memory.weights_gib:.1f}, gradients {memory.grads_gib:.1f}, optimizer "
                    f"{memory.optimizer_gib:.1f}, activations {memory.activations_gib:.1f}, MoK buffers "
                    f"{memory.mok_buffers_gib:.1f}) > {memory.budget_gib:.1f} GiB usable; raise pp, ep or dp, "
                    "or lower micro_batch / seq_length"
                )
        if problems:
            raise ValueError("\n  ".join(problems))
        return self


def load_topology(path: str | Path) -> RunConfig:
    """Read and validate a run config (YAML).

    Raises:
        MoKConfigError: naming the file, and each offending field; also when the file cannot be
            read (missing, a directory, no permission, not UTF-8) or is not valid YAML.
    """
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise MoKConfigError(f"{path}: expected a mapping with machine, model, parallel, mok")
    try:
        return RunConfig(**{str(key): value for key, value in data.items()})
    except ValidationError as error:
        raise MoKConfigError(format_validation_error(error, f"invalid run config {path}")) from None
