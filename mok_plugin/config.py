"""Configuration of the MoK layer: one validated, frozen object, and the YAML loader.

Owns: `MoKConfig` (model shape, routing, parallel layout, backend and kernel knobs), `load_config`,
`MoKConfigError`, and the `MOK_PLUGIN_*` environment flags. Every invalid value or combination is
an error that names the field (as `mok.<field>`) and what is allowed; problems across fields are
collected and reported together. Values that validate also run: floats are finite and bounded, and
sizes are bounded so that the buffers built from them stay inside int64 (the bounds below say why).

Does not own: run configs for whole training runs (machine, model, parallel layout:
`mok_plugin.run`, which imports this module, never the reverse), or any tensor code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mok_plugin.experts import FAMILY_FIELDS, ExpertKind, MoKExpertFamily, family_field_problems
from mok_plugin.experts import Activation as ExpertActivation
from mok_plugin.fp8.recipe import FP8Recipe, FP8Scaling, fp8_recipe_from_megatron

__all__ = [
    "MoKConfig",
    "MoKConfigError",
    "MOK_KNOBS",
    "dtype_name",
    "load_config",
    "read_yaml",
    "short_repr",
    "debug_checks_from_env",
    "host_read_settings",
    "triton_interpreter_from_env",
]

ScoreFunction = Literal["softmax", "sigmoid", "sqrtsoftplus"]
Backend = Literal["auto", "triton", "reference"]
ParamsDtype = Literal["float32", "bfloat16", "float16"]
KernelVariant = Literal["megakernel", "multi_kernel"]


# --- bounds ---------------------------------------------------------------------------------------
# Each dimension (H, I, E, K, group and EP counts) is below 2**31: kernels index one dimension with
# int32 offsets, and no model comes near (the largest H in configs/ is 7168, E 384).
MAX_DIM = 2**31 - 1
# The stacked expert weights [E, 2I, H] (and the shared MLP's [2 I_shared, H]) hold at most 2**60
# elements, so their byte sizes in fp32 (2**62), gradients and optimizer states included, stay
# int64 values; DeepSeek-V3's layer holds 2**33.
MAX_WEIGHT_ELEMENTS = 2**60
# Every float knob (capacity factors, routed scaling, loss coefficients, bias update rate) is finite
# and at most 1024: far above any published value (capacity factors 1-2, routed scaling 1-16,
# loss coefficients 1e-4..1e-2, bias update rate 1e-3), above E/K and the EP size of every model in
# configs/ (where more capacity changes nothing), and low enough that ceil(factor * T * K / E) for
# T * K < 2**40 stays below 2**50 (exact in float64) and the fp32 losses and expert bias stay finite.
MAX_FACTOR = 1024.0
# Fields that existed once; passing one is an error that says why it went (not "unknown key").
REMOVED_FIELDS = {
    "deterministic": "this key was removed: MoK is always deterministic (fixed-order kernels, no float "
    "atomics, pinned tile configs), so there is nothing to switch; drop it",
}
# Reprs in error messages are cut to this many characters, so a huge input is never echoed whole.
REPR_LIMIT = 80


# MoKConfig fields that only MoK has: an adapter's MoK settings (Megatron's --mok-config, DeepSpeed's
# mok_config or "mok" block) may set them freely; every other field follows the framework's options.
MOK_KNOBS = (
    "backend",
    "kernel_variant",
    "ep_exchange",
    "ep_capacity_factor",
    "ep_transport",
    "debug_checks",
    "random_seed",
)


def dtype_name(value: Any) -> Any:
    """A torch.dtype as its name (torch.bfloat16 -> "bfloat16"); anything else unchanged. torch is
    looked up, not imported: a value can only be a torch.dtype once torch is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


class MoKConfigError(ValueError):
    """An invalid MoK configuration; the message names every offending field."""


def short_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """`repr(value)`, cut to about `limit` characters (with the full length said) for error messages."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str limit, or a container holding one
        if isinstance(value, int):
            return f"<int of about {int(value.bit_length() * 0.30103) + 1} digits>"
        return f"<{type(value).__name__}, repr too long>"
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({len(text)} characters)"


def _cut(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def read_yaml(path: str | os.PathLike[str], what: str = "") -> Any:
    """The parsed YAML of a file; every way reading it can fail is one MoKConfigError naming the file.

    Args:
        path: the file.
        what: how to name it in messages (for example "--mok-config"); the path follows.
    Raises:
        MoKConfigError: a missing file, a directory, no permission, any other OS error, text that is
            not UTF-8, YAML that does not parse (or nests too deeply, or holds an integer too long).
    """
    name = f"{what} {_cut(str(path), 200)}" if what else _cut(str(path), 200)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MoKConfigError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise MoKConfigError(f"{name}: is a directory, not a YAML file") from None
    except PermissionError:
        raise MoKConfigError(f"{name}: permission denied") from None
    except UnicodeDecodeError as error:
        raise MoKConfigError(f"{name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise MoKConfigError(f"{name}: cannot be read: {error.strerror or error}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise MoKConfigError(f"{name}: not valid YAML: {_cut(str(error))}") from None
    except RecursionError:
        raise MoKConfigError(f"{name}: not valid YAML: nested too deeply") from None
    except ValueError as error:  # PyYAML's int() of a number longer than Python's digit limit
        raise MoKConfigError(f"{name}: not valid YAML: {_cut(str(error))}") from None


def format_validation_error(
    error: ValidationError, header: str, prefix: str = "", allowed: Iterable[str] | None = None
) -> str:
    """Pydantic's error list as `header` and one line per problem, each naming its field as
    `prefix.<field>` (the bare field without a prefix); unknown keys list `allowed` when given, and
    a key of REMOVED_FIELDS says why it was removed. Inputs are shown cut to REPR_LIMIT characters.
    The config schemas (MoKConfig, the ds_config "mok" block, run configs) all report this way."""
    lines = []
    for item in error.errors():
        loc = _cut(".".join(str(part) for part in item["loc"]), REPR_LIMIT)
        field = f"{prefix}.{loc}" if prefix and loc else loc or prefix
        if item["type"] == "extra_forbidden":
            key = item["loc"][-1] if item["loc"] else ""
            # Removed fields were top-level fields of the config; deeper keys are plain unknown keys.
            if len(item["loc"]) == 1 and key in REMOVED_FIELDS:
                lines.append(f"{field}: {REMOVED_FIELDS[key]}")
                continue
            allowed_keys = sorted(set(allowed or ()) - set(REMOVED_FIELDS))
            lines.append(f"{field}: unknown key" + (f"; allowed keys: {', '.join(allowed_keys)}" if allowed else ""))
        elif item["type"] == "missing":
            lines.append(f"{field}: required, missing")  # its "input" is the whole enclosing mapping
        elif item["type"] == "value_error":
            # Cross-field problems from the models' validators already name their fields.
            lines.append(str(item["ctx"]["error"]) if "ctx" in item else item["msg"])
        else:
            lines.append(f"{field}={short_repr(item.get('input'))}: {item['msg']}")
    return f"{header}:\n  " + "\n  ".join(lines)


class MoKConfig(BaseModel):
    """Everything one MoK MoE layer needs to know.

    Shape fields use the dimension letters of DESIGN.md: hidden_size is H, ffn_hidden_size is the
    expert intermediate size I, num_experts is E, top_k is K.

    Floats are finite and at most MAX_FACTOR (1024); every size is at most MAX_DIM (2**31 - 1) and
    the expert weights at most MAX_WEIGHT_ELEMENTS (2**60). `params_dtype` takes a name or a
    torch.dtype and stores the name.

    Raises:
        MoKConfigError: for an unknown key, a removed one (`deterministic`: MoK is always
            deterministic), a wrong type, a value out of range or an impossible combination (for
            example top_k > num_experts); the message names each field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # --- shape -----------------------------------------------------------------------------------
    hidden_size: int = Field(gt=0, le=MAX_DIM, description="H, the model width.")
    ffn_hidden_size: int = Field(gt=0, le=MAX_DIM, description="I, the intermediate size of one routed expert.")
    num_experts: int = Field(gt=0, le=MAX_DIM, description="E, routed experts in the whole layer (all EP ranks).")
    top_k: int = Field(gt=0, le=MAX_DIM, description="K, experts chosen per token.")
    num_shared_experts: int = Field(default=0, ge=0, le=MAX_DIM, description="Dense SwiGLU experts every token uses.")
    shared_ffn_hidden_size: int | None = Field(
        default=None,
        gt=0,
        le=MAX_DIM,
        description="Total intermediate size of the shared-expert MLP; default num_shared_experts * I.",
    )
    shared_expert_gate: bool = Field(
        default=False,
        description="Qwen3-Next: the shared experts' output times sigmoid(x . gate_weight), gate_weight [1, H].",
    )
    shared_expert_overlap: bool = Field(
        default=False,
        description="Run the shared experts on a side CUDA stream, concurrently with the routed experts (in "
        "sequence on the CPU); the same bits either way.",
    )
    shared_expert_recompute: bool = Field(
        default=False,
        description="Recompute the shared experts in the backward instead of saving their activations.",
    )

    # --- expert family (mok_plugin/experts.py has the formulas) -----------------------------------
    expert_kind: ExpertKind = Field(
        default="glu",
        description="glu: gated, fc1 has 2I rows (gate first); mlp: fc1 has I rows; linear: one H x H linear "
        "per expert (ffn_hidden_size = hidden_size), no activation.",
    )
    expert_activation: ExpertActivation = Field(
        default="silu", description="The experts' activation (glu and mlp); silu + glu is SwiGLU."
    )
    activation_clamp: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="glu only (GPT-OSS): the gate clamped above at this value, the linear half to +-this value.",
    )
    glu_linear_offset: float = Field(
        default=0.0,
        ge=-MAX_FACTOR,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="glu only (GPT-OSS: 1.0): added to the linear half before the product.",
    )
    expert_fc1_bias: bool = Field(default=False, description="The experts' first linear has a bias [E, fc1 rows].")
    expert_fc2_bias: bool = Field(
        default=False, description="The experts' second linear has a bias [E, H], scaled by the routing weight."
    )

    # --- routing ---------------------------------------------------------------------------------
    score_function: ScoreFunction = Field(
        default="softmax",
        description="softmax over the E logits; sigmoid or sqrtsoftplus (DeepSeek-V4: sqrt(softplus(x))) per expert.",
    )
    norm_topk_prob: bool = Field(default=False, description="Renormalise the K chosen weights to sum to 1.")
    routed_scaling_factor: float = Field(default=1.0, gt=0.0, le=MAX_FACTOR, allow_inf_nan=False)
    n_group: int | None = Field(default=None, gt=0, le=MAX_DIM, description="Expert groups for group-limited routing.")
    topk_group: int | None = Field(default=None, gt=0, le=MAX_DIM, description="Groups each token may route into.")
    router_bias: bool = Field(
        default=False, description="A trained bias [E] on the router logits (Megatron --add-bias-linear)."
    )
    expert_bias: bool = Field(default=False, description="Aux-loss-free balancing: a bias used only to select.")
    expert_bias_update_rate: float = Field(default=1e-3, ge=0.0, le=MAX_FACTOR, allow_inf_nan=False)
    force_load_balancing: bool = Field(
        default=False,
        description="Benchmarks (Megatron --moe-router-force-load-balancing): route by random N(0, 1) logits, "
        "the router's own logits getting their gradient straight through; drawn from MoK's counter-based "
        "stream (random_seed, layer, call, global token, expert), so a run is bitwise repeatable.",
    )
    # The three load-balancing losses (routing.py has the formulas): any of them, each with its own
    # coefficient (0 = off), are summed into the layer's aux loss. Each counts the tokens' plain top-K
    # of the normalised scores (no groups, no expert bias), as Megatron-Core does.
    aux_loss_coeff: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="Switch-style load-balancing loss over the micro-batch (Megatron's aux_loss).",
    )
    seq_aux_loss_coeff: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="The same loss per sequence, averaged over the sequences (DeepSeek-V2/V3; Megatron's "
        "seq_aux_loss); the layer's input says how tokens form sequences.",
    )
    global_aux_loss_coeff: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="The same loss with token counts over the global batch (Megatron's global_aux_loss): a "
        "running mean over the step's micro-batches, kept until reset_global_aux_loss_tracker().",
    )
    z_loss_coeff: float = Field(default=0.0, ge=0.0, le=MAX_FACTOR, allow_inf_nan=False, description="Router z-loss.")
    capacity_factor: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="None = dropless; otherwise rows per expert = ceil(T*K/E*factor), T the global batch "
        "(all EP ranks); each expert keeps its first rows in global token order.",
    )

    # --- parallel layout -------------------------------------------------------------------------
    ep_size: int = Field(default=1, gt=0, le=MAX_DIM, description="Expert-parallel world size W.")
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
        le=MAX_FACTOR,
        allow_inf_nan=False,
        description="capacity exchange: rows each rank may send to each rank = ceil(factor * T * K / W).",
    )

    # --- execution -------------------------------------------------------------------------------
    backend: Backend = "auto"
    kernel_variant: KernelVariant = Field(
        # multi_kernel is the faster variant on the H200 (BENCHMARKS.md's current table: forward + backward
        # 1.44-1.50x faster than the megakernel on qwen3-30b-a3b, olmoe and mixtral-8x7b).
        default="multi_kernel",
        description="Triton backend: one persistent launch per pass, or one launch per GEMM (same arithmetic).",
    )
    fp8: Literal["e4m3", "hybrid"] | None = Field(
        default=None,
        description="FP8 routed (and shared) experts (mok_plugin/fp8, fp32 accumulation; scaled as fp8_scaling "
        "says, by default blockwise: 1 x 128 activation and gradient blocks, 128 x 128 weight blocks): e4m3 "
        "everywhere, or hybrid (E5M2 gradients), as Megatron's --fp8-format; None: the experts compute in the "
        "params dtype.",
    )
    fp8_scaling: FP8Scaling = Field(
        default="blockwise",
        description="How mok.fp8 scales (read only with mok.fp8; Megatron's --fp8-recipe): blockwise (the Triton "
        "kernels), tensorwise (Transformer Engine's Float8CurrentScaling: one scale per expert's rows and weights) "
        "or mxfp8 (MXFP8BlockScaling: E8M0 scales per 32 values); the last two run MoK's PyTorch FP8 path "
        "(fp8/reference.py) on every backend: the recipe's numbers, not fused kernels.",
    )
    # MoK is deterministic by construction, so there is no `deterministic` switch (REMOVED_FIELDS).
    params_dtype: ParamsDtype = Field(
        default="float32", description="The parameters' dtype, by name; a torch.dtype is accepted and stored by name."
    )
    debug_checks: bool = Field(default=False, description="Check router logits for NaN/inf (syncs the host).")
    random_seed: int = Field(
        default=0,
        ge=0,
        lt=2**63,
        description="Seed of MoK's counter-based random streams (mok_plugin/random_stream.py), used by the "
        "random routing options only.",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise MoKConfigError(
                format_validation_error(error, "invalid MoK config", "mok", MoKConfig.model_fields)
            ) from None

    @field_validator("params_dtype", mode="before")
    @classmethod
    def _dtype_by_name(cls, value: Any) -> Any:
        return dtype_name(value)

    @model_validator(mode="after")
    def _check_combinations(self) -> MoKConfig:
        problems: list[str] = []
        E, K, H, I = self.num_experts, self.top_k, self.hidden_size, self.ffn_hidden_size
        if K > E:
            problems.append(f"mok.top_k={K} exceeds num_experts={E}; allowed: 1..{E}")
        if E * 2 * I * H > MAX_WEIGHT_ELEMENTS:
            problems.append(
                f"mok.num_experts={E} x 2 x mok.ffn_hidden_size={I} x mok.hidden_size={H} = {E * 2 * I * H} "
                f"expert weight elements exceeds 2**60 (their byte sizes must stay int64 values)"
            )
        shared = self.shared_intermediate_size
        if shared > MAX_DIM:
            problems.append(
                f"mok.num_shared_experts={self.num_shared_experts} x mok.ffn_hidden_size={I} = {shared} "
                f"exceeds {MAX_DIM}; set mok.shared_ffn_hidden_size or fewer shared experts"
            )
        elif 2 * shared * H > MAX_WEIGHT_ELEMENTS:
            problems.append(
                f"the shared-expert MLP, 2 x {shared} (mok.shared_ffn_hidden_size, or num_shared_experts x "
                f"ffn_hidden_size) x mok.hidden_size={H} elements, exceeds 2**60 elements"
            )
        if self.num_shared_experts == 0 and self.shared_ffn_hidden_size is not None:
            problems.append(
                f"mok.shared_ffn_hidden_size={self.shared_ffn_hidden_size} is set but num_shared_experts=0; "
                "set num_shared_experts >= 1 or drop shared_ffn_hidden_size"
            )
        if self.num_shared_experts == 0:
            for name in ("shared_expert_gate", "shared_expert_overlap", "shared_expert_recompute"):
                if getattr(self, name):
                    problems.append(f"mok.{name}=True needs shared experts (num_shared_experts >= 1); got 0")
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
        problems += self._family_problems()
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def _family_problems(self) -> list[str]:
        fields = {name: getattr(self, name) for name in FAMILY_FIELDS}
        problems = family_field_problems(
            fields,
            "mok",
            self.hidden_size,
            self.ffn_hidden_size,
            f"num_shared_experts={self.num_shared_experts}" if self.num_shared_experts else None,
        )
        if self.kernel_variant == "megakernel" and not self.expert_family.is_swiglu:
            problems.append(
                f"mok.kernel_variant='megakernel' computes bias-free SwiGLU experts only, not "
                f"{self.expert_family.describe()}; use kernel_variant='multi_kernel'"
            )
        if self.fp8 is not None:
            problems += self._fp8_problems()
        elif self.fp8_scaling != "blockwise":  # nothing accepted and ignored
            problems.append(f"mok.fp8_scaling={self.fp8_scaling!r} scales FP8 experts, but mok.fp8 is not set "
                            "(e4m3 or hybrid); set both, or neither")  # fmt: skip
        return problems

    def _fp8_problems(self) -> list[str]:
        family = self.expert_family
        problems = []
        if family.kind == "linear":
            problems.append("mok.fp8 covers glu and mlp experts; a linear expert (expert_kind='linear') has no fc1")
        if self.kernel_variant == "megakernel":
            problems.append("mok.fp8 runs the multi-kernel path; set mok.kernel_variant='multi_kernel'")
        return problems

    @property
    def shared_intermediate_size(self) -> int:
        """Intermediate size of the shared-expert MLP (0 when there is none)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_ffn_hidden_size or self.num_shared_experts * self.ffn_hidden_size

    @property
    def expert_family(self) -> MoKExpertFamily:
        """What each expert computes (experts.py), from the expert_* fields."""
        return MoKExpertFamily.from_config_fields({name: getattr(self, name) for name in FAMILY_FIELDS})

    @property
    def fp8_recipe(self) -> FP8Recipe | None:
        """The FP8 recipe `fp8` and `fp8_scaling` select (None: no FP8)."""
        if self.fp8 is None:
            return None
        return fp8_recipe_from_megatron(self.fp8, self.fp8_scaling)

    @property
    def num_local_experts(self) -> int:
        """Experts held by one expert-parallel rank."""
        return self.num_experts // self.ep_size

    def replace(self, **changes: Any) -> MoKConfig:
        """A validated copy with some fields changed."""
        return MoKConfig(**{**self.model_dump(), **changes})


# Top-level keys of a run config (configs/topologies/) that a MoK layer config never has: such a file
# is refused with a pointer to the run-config loader instead of being read as a layer config.
_RUN_CONFIG_KEYS = ("model", "parallel")


def load_config(path: str | os.PathLike[str]) -> MoKConfig:
    """Read a MoK layer config (YAML) into a validated `MoKConfig`.

    The file holds the config's fields at the top level, or a mapping with a `mok:` section holding
    them (other top-level keys are then not read). A run config (machine, model, parallel, mok:
    configs/topologies/) is not a layer config: `mok_plugin.run.load_topology(path).mok_config()`
    gives one MoE layer's config of a run.

    Raises:
        MoKConfigError: naming the file: it cannot be read (missing, a directory, no permission,
            not UTF-8), it is not valid YAML or not a mapping, it is a run config (its top level
            has `model` or `parallel`), or a field is invalid (named too).
    """
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise MoKConfigError(f"{path}: expected a mapping of MoK config fields, got {type(data).__name__}")
    run_keys = [key for key in _RUN_CONFIG_KEYS if key in data]
    if run_keys:
        raise MoKConfigError(
            f"{path}: a run config (top-level {', '.join(run_keys)}), not a MoK layer config; "
            "use mok_plugin.run.load_topology(path).mok_config() for one MoE layer's config of the run"
        )
    if "mok" in data:
        data = data["mok"]
        if not isinstance(data, dict):
            raise MoKConfigError(f"{path}: the 'mok' section must be a mapping, got {type(data).__name__}")
    try:
        return MoKConfig(**{str(key): value for key, value in data.items()})
    except MoKConfigError as error:
        raise MoKConfigError(f"{path}: {error}") from None


# Why the reference backend's experts cannot be captured in a CUDA graph or traced by torch.compile.
REFERENCE_BACKEND_HOST_LOOP = (
    "the reference backend loops over the experts on the host (set mok backend: auto or triton)"
)


def host_read_settings(
    *, exact_ep_exchange: bool, reference_backend: bool, debug: bool, fp8_scaling: str | None = None
) -> list[str]:
    """The settings of a layer that make its forward read the host, each with what to set instead
    (a CUDA graph cannot capture such a forward). Empty when it reads nothing. fp8_scaling: the
    layer's mok.fp8_scaling when it runs FP8 (None: no FP8); all but blockwise run MoK's PyTorch FP8
    path, on every backend (fp8/experts.py)."""
    reads = []
    if exact_ep_exchange:
        reads.append("the exact expert-parallel exchange sizes its buffers from counts read on the host (set mok "
                     "ep_exchange: capacity)")  # fmt: skip
    if reference_backend:
        reads.append(REFERENCE_BACKEND_HOST_LOOP)
    if debug:
        reads.append("debug checks read the router logits on the host (mok debug_checks, MOK_PLUGIN_DEBUG)")
    if fp8_scaling not in (None, "blockwise") and not reference_backend:
        reads.append(f"the {fp8_scaling} FP8 recipe runs MoK's PyTorch FP8 path, which loops over the experts on the "
                     "host (mok fp8_scaling: blockwise)")  # fmt: skip
    return reads


def debug_checks_from_env() -> bool:
    """`MOK_PLUGIN_DEBUG=1` turns on the debug checks for every layer (they sync the host)."""
    return os.environ.get("MOK_PLUGIN_DEBUG", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_interpreter_from_env() -> bool:
    """`TRITON_INTERPRET=1` (Triton's own switch; true, on, yes as Triton reads them) lets the triton
    backend run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")
