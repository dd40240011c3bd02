"""Configuration of the MoK layer: one validated, frozen object, and the YAML loader.

Owns: `MoKConfig` (model shape, routing, parallel layout, backend and kernel knobs), `load_config`,
`MoKConfigError`, and the `MOK_PLUGIN_*` environment flags. Every invalid value or combination is
an error that names the field (as `mok.<field>`) and what is allowed; problems across fields are
collected and reported together.

Does not own: topology files for whole training runs (a later issue adds them next to this), or any
tensor code.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["MoKConfig", "MoKConfigError", "load_config", "debug_checks_from_env", "triton_interpreter_from_env"]

ScoreFunction = Literal["softmax", "sigmoid"]
Backend = Literal["auto", "triton", "reference"]
ParamsDtype = Literal["float32", "bfloat16", "float16"]
KernelVariant = Literal["megakernel", "multi_kernel"]


class MoKConfigError(ValueError):
    """An invalid MoK configuration; the message names every offending field."""


def format_validation_error(
    error: ValidationError, header: str, prefix: str = "", allowed: Iterable[str] | None = None
) -> str:
    """Pydantic's error list as `header` and one line per problem, each naming its field as
    `prefix.<field>` (the bare field without a prefix); unknown keys list `allowed` when given.
    The config schemas (MoKConfig, the ds_config "mok" block, run configs) all report this way."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"])
        field = f"{prefix}.{loc}" if prefix and loc else loc or prefix
        if item["type"] == "extra_forbidden":
            lines.append(f"{field}: unknown key" + (f"; allowed keys: {', '.join(sorted(allowed))}" if allowed else ""))
        elif item["type"] == "value_error":
            # Cross-field problems from the models' validators already name their fields.
            lines.append(str(item["ctx"]["error"]) if "ctx" in item else item["msg"])
        else:
            lines.append(f"{field}={item.get('input')!r}: {item['msg']}")
    return f"{header}:\n  " + "\n  ".join(lines)


class MoKConfig(BaseModel):
    """Everything one MoK MoE layer needs to know.

    Shape fields use the dimension letters of DESIGN.md: hidden_size is H, ffn_hidden_size is the
    expert intermediate size I, num_experts is E, top_k is K.

    Raises:
        MoKConfigError: for an unknown key, a wrong type, a value out of range or an impossible
            combination (for example top_k > num_experts); the message names each field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # --- shape -----------------------------------------------------------------------------------
    hidden_size: int = Field(gt=0, description="H, the model width.")
    ffn_hidden_size: int = Field(gt=0, description="I, the intermediate size of one routed expert.")
    num_experts: int = Field(gt=0, description="E, routed experts in the whole layer (all EP ranks).")
    top_k: int = Field(gt=0, description="K, experts chosen per token.")
    num_shared_experts: int = Field(default=0, ge=0, description="Dense SwiGLU experts every token uses.")
    shared_ffn_hidden_size: int | None = Field(
        default=None,
        gt=0,
        description="Total intermediate size of the shared-expert MLP; default num_shared_experts * I.",
    )

    # --- routing ---------------------------------------------------------------------------------
    score_function: ScoreFunction = "softmax"
    norm_topk_prob: bool = Field(default=False, description="Renormalise the K chosen weights to sum to 1.")
    routed_scaling_factor: float = Field(default=1.0, gt=0.0)
    n_group: int | None = Field(default=None, gt=0, description="Expert groups for group-limited routing.")
    topk_group: int | None = Field(default=None, gt=0, description="Groups each token may route into.")
    expert_bias: bool = Field(default=False, description="Aux-loss-free balancing: a bias used only to select.")
    expert_bias_update_rate: float = Field(default=1e-3, ge=0.0)
    aux_loss_coeff: float = Field(default=0.0, ge=0.0, description="Switch-style load-balancing loss.")
    z_loss_coeff: float = Field(default=0.0, ge=0.0, description="Router z-loss.")
    capacity_factor: float | None = Field(
        default=None,
        gt=0.0,
        description="None = dropless; otherwise rows per expert = ceil(T*K/E*factor), T the global batch "
        "(all EP ranks); each expert keeps its first rows in global token order.",
    )

    # --- parallel layout -------------------------------------------------------------------------
    ep_size: int = Field(default=1, gt=0, description="Expert-parallel world size W.")
    ep_exchange: Literal["capacity", "exact"] = Field(
        default="capacity",
        description="capacity: fixed-size buffers, no host sync, same token count on every rank; "
        "exact: buffers sized from exchanged counts (one host sync per layer), any token counts.",
    )
    ep_transport: Literal["nccl", "symmetric_memory"] = Field(
        default="nccl",
        description="nccl: torch.distributed all-to-all (any backend, gloo on the CPU); symmetric_memory: "
        "ranks pull rows from peers' NVLink-mapped buffers (capacity exchange, CUDA, one NVLink domain).",
    )
    ep_capacity_factor: float = Field(
        default=2.0,
        gt=0.0,
        description="capacity exchange: rows each rank may send to each rank = ceil(factor * T * K / W).",
    )

    # --- execution -------------------------------------------------------------------------------
    backend: Backend = "auto"
    kernel_variant: KernelVariant = Field(
        # multi_kernel measured faster on the H200 (BENCHMARKS.md: qwen3-30b-a3b fwd+bwd 11.1 vs 16.3 ms).
        default="multi_kernel",
        description="Triton backend: one persistent launch per pass, or one launch per GEMM (same arithmetic).",
    )
    deterministic: bool = True
    params_dtype: ParamsDtype = "float32"
    debug_checks: bool = Field(default=False, description="Check router logits for NaN/inf (syncs the host).")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise MoKConfigError(
                format_validation_error(error, "invalid MoK config", "mok", MoKConfig.model_fields)
            ) from None

    @model_validator(mode="after")
    def _check_combinations(self) -> MoKConfig:
        problems: list[str] = []
        E, K = self.num_experts, self.top_k
        if K > E:
            problems.append(f"mok.top_k={K} exceeds num_experts={E}; allowed: 1..{E}")
        if self.num_shared_experts == 0 and self.shared_ffn_hidden_size is not None:
            problems.append(
                f"mok.shared_ffn_hidden_size={self.shared_ffn_hidden_size} is set but num_shared_experts=0; "
                "set num_shared_experts >= 1 or drop shared_ffn_hidden_size"
            )
        if (self.n_group is None) != (self.topk_group is None):
            problems.append(
                f"mok.n_group={self.n_group} and mok.topk_group={self.topk_group}: "
                "group-limited routing needs both or neither"
            )
        elif self.n_group is not None and self.topk_group is not None:
            G, Gk = self.n_group, self.topk_group
            if E % G != 0:
                problems.append(f"mok.n_group={G} does not divide num_experts={E}; allowed: a divisor of {E}")
            elif Gk > G:
                problems.append(f"mok.topk_group={Gk} exceeds n_group={G}; allowed: 1..{G}")
            elif K < Gk:
                # Group scores sum the top (K // topk_group) experts of a group, which must be >= 1.
                problems.append(f"mok.topk_group={Gk} exceeds top_k={K}; allowed: 1..{min(G, K)}")
            elif K > Gk * (E // G):
                problems.append(
                    f"mok.top_k={K} exceeds the {Gk * (E // G)} experts in topk_group={Gk} groups "
                    f"of {E // G}; raise topk_group or lower top_k"
                )
        if self.ep_transport == "symmetric_memory" and self.ep_exchange != "capacity":
            problems.append(
                "mok.ep_transport='symmetric_memory' needs mok.ep_exchange='capacity' (fixed-size buffers); "
                f"got ep_exchange={self.ep_exchange!r}"
            )
        if E % self.ep_size != 0:
            problems.append(f"mok.ep_size={self.ep_size} does not divide num_experts={E}; allowed: a divisor of {E}")
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @property
    def shared_intermediate_size(self) -> int:
        """Intermediate size of the shared-expert MLP (0 when there is none)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_ffn_hidden_size or self.num_shared_experts * self.ffn_hidden_size

    @property
    def num_local_experts(self) -> int:
        """Experts held by one expert-parallel rank."""
        return self.num_experts // self.ep_size

    def replace(self, **changes: Any) -> MoKConfig:
        """A validated copy with some fields changed."""
        return MoKConfig(**{**self.model_dump(), **changes})


def load_config(path: str | os.PathLike[str]) -> MoKConfig:
    """Read a YAML file into a validated `MoKConfig`.

    The file is either the config's fields at the top level, a mapping with a `mok:` section
    holding them, or a run config (`machine`, `model`, `parallel`, `mok`: configs/topologies/),
    which is validated whole (mok_plugin.topology) before its MoE layer's config is returned.

    Raises:
        FileNotFoundError: the path does not exist.
        MoKConfigError: the YAML is not a mapping, or a field is invalid (the message names it).
    """
    path = Path(path)
    with path.open() as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as error:
            raise MoKConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise MoKConfigError(f"{path}: expected a mapping of MoK config fields, got {type(data).__name__}")
    if "machine" in data and "parallel" in data:
        # A run config (configs/topologies/): validate the whole run, return one layer's config.
        from mok_plugin.topology import load_topology

        return load_topology(path).mok_config()
    if "mok" in data:
        data = data["mok"]
        if not isinstance(data, dict):
            raise MoKConfigError(f"{path}: the 'mok' section must be a mapping, got {type(data).__name__}")
    try:
        return MoKConfig(**data)
    except MoKConfigError as error:
        raise MoKConfigError(f"{path}: {error}") from None


def debug_checks_from_env() -> bool:
    """`MOK_PLUGIN_DEBUG=1` turns on the debug checks for every layer (they sync the host)."""
    return os.environ.get("MOK_PLUGIN_DEBUG", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_interpreter_from_env() -> bool:
    """`TRITON_INTERPRET=1` (Triton's own switch) lets the triton backend run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
