"""Run configs: a model's MoE shape, a parallel layout, MoK's knobs and the machine, validated.

A file in configs/topologies/ holds one run:

    machine: gb300-nvl72            # a name from MACHINES
    model: {name: deepseek-v3, num_layers: 61, moe_layers: 58, hidden_size: 7168, ...}
                                    # and the expert MLP (expert_kind, expert_activation, ...; SwiGLU
                                    # without biases unless stated)
    parallel: {tp: 1, pp: 4, ep: 64, expert_tp: 1, dp: 64, seq_length: 4096, micro_batch: 1}
    mok: {ep_exchange: capacity, ep_transport: symmetric_memory, ...}   # MoKConfig knobs
    deepspeed: {capacity_factor: 1.0, min_capacity: 4, drop_tokens: true, ...}
                                    # optional: DeepSpeed's MoE(...) gating arguments, for
                                    # `mok compare --framework deepspeed` (sections.DeepSpeedGating)

`load_topology(path)` validates it and rejects what cannot run, each error naming its field:
experts not divisible by EP (unless `redundant_experts` makes them so), a world size the layout
does not factor, more pipeline stages than (MoE) layers, tensor or expert-tensor parallelism (both
adapters refuse them), a `mok:` field that contradicts the model or parallel section (the
layer and the planner would disagree), the NVLink symmetric-memory path over more GPUs than one
NVLink domain, an expert exchange over a link the machine does not have (0 GB/s), and a layout
whose memory does not fit the GPU (estimated by `mok_plugin.run.planner`). A file that cannot be
read or parsed is an error naming the file. The model section states the expert MLP with
MoKConfig's field names (run/sections.py, `ModelShape`); like the shape, it reaches the MoKConfig
from there, and a `mok:` block that says otherwise is a contradiction. The optional `deepspeed:`
section holds DeepSpeed's gating arguments (DeepSpeed's defaults for the keys it leaves out); a
top-1 run whose `deepspeed.min_capacity` exceeds the tokens of a micro-batch is refused (DeepSpeed's
top-1 gate asserts on it). The planner does not read it (it models MoK's dropless exchange).

The parts of a run (`Machine` and the `MACHINES` table with each figure's public source,
`ModelShape`, `ParallelLayout`) live in sections.py, which the planner reads too; they are
re-exported here. `mok_plugin.load_config` reads MoK layer configs only and refuses a run config:
`load_topology(path).mok_config()` is one MoE layer's config of a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mok_plugin.config import MoKConfig, MoKConfigError, format_validation_error, read_yaml, short_repr
from mok_plugin.run.planner import exchange_link, memory_per_gpu
from mok_plugin.run.sections import MACHINES, DeepSpeedGating, Machine, ModelShape, ParallelLayout

__all__ = ["MACHINES", "DeepSpeedGating", "Machine", "ModelShape", "ParallelLayout", "RunConfig", "load_topology"]


class RunConfig(BaseModel):
    """A validated run: see the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    machine: str
    model: ModelShape
    parallel: ParallelLayout
    mok: dict[str, Any] = Field(default_factory=dict)
    deepspeed: DeepSpeedGating | None = None  # None: no section (the harness keeps its own setting)
    description: str = ""

    @property
    def hardware(self) -> Machine:
        """The machine's rates (from MACHINES)."""
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
            **{key: (value, f"model.{key}={value!r}") for key, value in m.family_fields().items()},
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
                f"parallel.tp={p.tp}: the comparison runs and the DeepSpeed adapter are TP 1 (Megatron's adapter "
                "takes --tensor-model-parallel-size > 1 with sequence parallelism through its own flags); use tp: 1"
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
        tokens = p.seq_length * p.micro_batch
        if self.deepspeed is not None and m.top_k == 1 and self.deepspeed.min_capacity > tokens:
            problems.append(
                f"deepspeed.min_capacity={self.deepspeed.min_capacity} exceeds the {tokens} tokens of a micro-batch "
                f"(parallel.seq_length={p.seq_length} x micro_batch={p.micro_batch}): DeepSpeed's top-1 gate refuses "
                "it; lower min_capacity (0 is allowed) or raise the batch"
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
        raise MoKConfigError(f"{path}: expected a mapping with machine, model, parallel, mok (and deepspeed)")
    try:
        return RunConfig(**{str(key): value for key, value in data.items()})
    except ValidationError as error:
        raise MoKConfigError(format_validation_error(error, f"invalid run config {path}")) from None
