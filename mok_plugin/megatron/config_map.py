"""Megatron-Core TransformerConfig -> MoKConfig: what maps, and what is refused by name.

Owns: `mok_config_from_megatron`, the table of Megatron MoE fields MoK supports, replaces or
refuses, and the split of MoKConfig's fields into MoK-only knobs (`MOK_KNOBS`, which a
--mok-config file or `mok_overrides` set freely) and fields Megatron's flags set (`MEGATRON_SET`,
which an override may repeat but not change). Every refused setting is an error at build time
naming the command-line flag that sets it (Megatron derives its flags from the field names:
`moe_router_fusion` is `--moe-router-fusion`).

The expert MLP, matched to Megatron-Core 0.19's SequentialMLP / TEGroupedMLP / SharedExpertMLP
(MoK's families are in mok_plugin/experts.py):
  --swiglu / --quick-geglu        gated_linear_unit: MoK `expert_kind="glu"` (fc1 rows: gate, then
                                  linear), else "mlp"; activation_func, recognised by identity
                                  (`_activation_name`), is MoK's `expert_activation`.
  --activation-func-clamp-value   gated only (Megatron ignores it otherwise): the gate clamped above,
                                  the linear half to +-c, both after fc1's bias: MoK `activation_clamp`.
  --glu-linear-offset             gated only: added to the (clamped) linear half: `glu_linear_offset`.
  --moe-mlp-glu-interleave-size S   gated only, where TEGroupedMLP stores fc1's rows in blocks of S,
                                  gate and linear alternating (the same GLU): its checkpoint rows are
                                  reordered to MoK's gate-first layout and back (checkpoint.py); S
                                  must divide the expert FFN size. SequentialMLP ignores it.
  add_bias_linear (on unless --disable-bias-linear)   fc1 and fc2 biases on every routed expert
                                  (`expert_fc1_bias`, `expert_fc2_bias`; the routing weight scales
                                  fc2's bias, as `_apply_bias` does), and a bias on the router's
                                  logits, which MoK's router must have too (`router_bias`).
  Fusion switches (bias_activation_fusion, the TE op fuser, TE activation modules, the fused
  weighted squared ReLU) are accepted where the stock layer computes the same function with and
  without them, and refused by name where it does not (see `_expert_fields`).

Routing semantics, matched to Megatron-Core 0.19's TopKRouter:
  softmax, post-top-k (default)   softmax over the K chosen logits = softmax over all E, then the K
                                  chosen renormalised: MoK `norm_topk_prob=True`.
  softmax, --moe-router-pre-softmax   softmax over all E, no renormalisation.
  sigmoid                         renormalised over the K chosen when K > 1.
  group-limited, expert bias, top-k scaling, Switch aux loss (micro-batch), z-loss: same formulas.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.nn.functional as F

from mok_plugin.config import MOK_KNOBS, REMOVED_FIELDS, MoKConfig, MoKConfigError, dtype_name, short_repr

__all__ = ["MEGATRON_SET", "MOK_KNOBS", "mok_config_from_megatron", "megatron_flag"]

# MOK_KNOBS (from config.py): MoKConfig fields Megatron has no setting for, which an override
# (--mok-config) sets freely.
# Every other MoKConfig field comes from Megatron's flags (field -> the flags): an override may only
# repeat Megatron's value, so a MoK file cannot switch on token dropping, add shared experts or
# change a shape or routing choice behind Megatron's back. Together the two cover MoKConfig.
MEGATRON_SET = {
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--moe-ffn-hidden-size",
    "num_experts": "--num-experts",
    "top_k": "--moe-router-topk",
    "num_shared_experts": "--moe-shared-expert-intermediate-size",
    "shared_ffn_hidden_size": "--moe-shared-expert-intermediate-size",
    "score_function": "--moe-router-score-function",
    "norm_topk_prob": "--moe-router-pre-softmax",
    "routed_scaling_factor": "--moe-router-topk-scaling-factor",
    "n_group": "--moe-router-num-groups",
    "topk_group": "--moe-router-group-topk",
    "expert_bias": "--moe-router-enable-expert-bias",
    "expert_bias_update_rate": "--moe-router-bias-update-rate",
    "aux_loss_coeff": "--moe-aux-loss-coeff",
    "z_loss_coeff": "--moe-z-loss-coeff",
    "capacity_factor": "--moe-expert-capacity-factor",
    "ep_size": "--expert-model-parallel-size",
    "params_dtype": "--bf16 / --fp16",
    "expert_kind": "--swiglu / --quick-geglu (gated_linear_unit)",
    "expert_activation": "--swiglu / --quick-geglu / --squared-relu (activation_func)",
    "activation_clamp": "--activation-func-clamp-value",
    "glu_linear_offset": "--glu-linear-offset",
    "expert_fc1_bias": "--disable-bias-linear",
    "expert_fc2_bias": "--disable-bias-linear",
    # --add-bias-linear also gives Megatron's router a bias [E] on its logits (TopKRouter.bias)
    "router_bias": "--disable-bias-linear",
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Fields that Megatron's stock layer uses and MoK replaces with its own kernels: accepted, no effect.
REPLACED = (
    "moe_grouped_gemm",
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_router_dtype",
    "moe_token_dispatcher_type",
    # TEGroupedMLP's fused relu(h)^2 * probs: the same function as the unfused path.
    "use_fused_weighted_squared_relu",
    # Read only by the TE fused shared expert (--use-grouped-gemm-for-shared-expert), refused below.
    "moe_shared_expert_glu_interleave_size",
)
# Expert-MLP implementation switches: replaced where the stock layer computes the same function with
# them as without, refused by name where it does not (`_expert_fields` says which is which).
REPLACED_WHERE_SAME = (
    "bias_activation_fusion",
    "activation_func_fp8_input_store",
    "use_te_activation_func",
    "use_transformer_engine_op_fuser",
    "moe_mlp_glu_interleave_size",
    "use_grouped_gemm_for_shared_expert",
)

# field -> (is it set in a way MoK cannot honour?, why)
_REFUSED: dict[str, tuple[Any, str]] = {
    "moe_input_jitter_eps": (lambda v: v not in (None, 0, 0.0), "input jitter is random noise (not deterministic)"),
    "moe_shared_expert_gate": (bool, "a gated shared expert is not implemented"),
    "moe_shared_expert_overlap": (bool, "MoK runs the shared expert itself; there is no dispatcher to overlap"),
    "moe_apply_probs_on_input": (
        bool,
        "it scales the expert's input by the routing weight, not its output (a different function through the "
        "activation); MoK applies the weight after fc2",
    ),
    "moe_latent_size": (lambda v: v is not None, "latent projections are not implemented"),
    "moe_pad_expert_input_to_capacity": (bool, "MoK pads tiles itself; capacity padding is not implemented"),
    "moe_enable_routing_replay": (bool, "routing replay is not implemented"),
    "overlap_moe_expert_parallel_comm": (bool, "the EP-overlap schedule calls the stock dispatcher's stages"),
    "delay_wgrad_compute": (bool, "MoK computes weight gradients in its own backward"),
    "moe_router_padding_for_quantization": (bool, "fp8/fp4 padding is not implemented"),
    "fp8": (lambda v: v not in (None, False), "MoK's kernels are bf16/fp16/fp32"),
    "fp4": (lambda v: v not in (None, False), "MoK's kernels are bf16/fp16/fp32"),
}


_FLAGS = {
    "num_moe_experts": "--num-experts",
    "gated_linear_unit": "--swiglu / --quick-geglu",
    "activation_func": "--swiglu / --quick-geglu / --squared-relu",
    "add_bias_linear": "--disable-bias-linear",
    "bias_activation_fusion": "--no-bias-swiglu-fusion / --no-bias-gelu-fusion",
}


def megatron_flag(field: str) -> str:
    """The command-line flag of a TransformerConfig field (Megatron builds them this way)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _refuse(field: str, value: Any, why: str) -> str:
    return f"{megatron_flag(field)} ({field}={value!r}): not supported by MoK: {why}"


def _routing_fields(tc: Any, problems: list[str]) -> dict[str, Any]:
    """MoK routing fields from Megatron's router settings; unsupported choices go to problems."""
    K = tc.moe_router_topk
    score = tc.moe_router_score_function
    if score not in ("softmax", "sigmoid"):
        problems.append(_refuse("moe_router_score_function", score, "allowed: softmax, sigmoid"))
    norm = (not tc.moe_router_pre_softmax) if score == "softmax" else K > 1
    if score == "softmax" and K == 1 and not tc.moe_router_pre_softmax:
        # Megatron refuses this too: a softmax over one logit is always 1.
        problems.append(_refuse("moe_router_topk", K, "top-1 softmax routing needs --moe-router-pre-softmax"))
    if tc.moe_router_num_groups and score == "softmax" and not tc.moe_router_pre_softmax:
        # Megatron picks groups by summed *logits* in this mode; MoK sums the scores (as it does
        # for sigmoid and pre-softmax routing, where the two agree).
        problems.append(
            _refuse(
                "moe_router_num_groups",
                tc.moe_router_num_groups,
                "group-limited routing needs --moe-router-score-function sigmoid or --moe-router-pre-softmax",
            )
        )
    balancing = tc.moe_router_load_balancing_type
    balancing = list(balancing) if isinstance(balancing, (list, tuple)) else [balancing]
    coeffs = tc.moe_aux_loss_coeff
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(balancing)
    aux_coeff = 0.0
    for kind, coeff in zip(balancing, coeffs, strict=False):
        if kind == "aux_loss":
            aux_coeff += float(coeff)
        elif kind != "none":
            problems.append(_refuse("moe_router_load_balancing_type", kind, "allowed: aux_loss (micro-batch), none"))
    if aux_coeff > 0 and (tc.moe_router_num_groups or tc.moe_router_enable_expert_bias):
        # Megatron counts each token's plain top-k for the aux loss (no groups, no bias); MoK counts
        # the experts actually chosen. Refused rather than silently different.
        problems.append(
            _refuse(
                "moe_aux_loss_coeff",
                tc.moe_aux_loss_coeff,
                "the aux loss with group-limited routing or expert bias counts experts differently "
                "in Megatron; use --moe-router-load-balancing-type none with these",
            )
        )
    fields: dict[str, Any] = {
        "top_k": K,
        "score_function": score,
        "norm_topk_prob": norm,
        "routed_scaling_factor": float(tc.moe_router_topk_scaling_factor or 1.0),
        "n_group": tc.moe_router_num_groups,
        "topk_group": tc.moe_router_group_topk,
        "expert_bias": bool(tc.moe_router_enable_expert_bias),
        "expert_bias_update_rate": float(tc.moe_router_bias_update_rate),
        "aux_loss_coeff": aux_coeff,
        "z_loss_coeff": float(tc.moe_z_loss_coeff or 0.0),
    }
    return fields


def _capacity_fields(tc: Any, problems: list[str]) -> dict[str, Any]:
    factor = tc.moe_expert_capacity_factor
    if factor is None or factor < 0:
        return {}
    if tc.expert_model_parallel_size > 1:
        problems.append(
            _refuse(
                "moe_expert_capacity_factor",
                factor,
                "with expert parallelism MoK's capacity counts the global batch at each expert, Megatron's "
                "each rank's own tokens; drop the flag (dropless) or run EP 1",
            )  # fmt: skip
        )
    if tc.moe_token_drop_policy != "position":
        problems.append(
            _refuse(
                "moe_token_drop_policy",
                tc.moe_token_drop_policy,
                "MoK drops by position (token order) only; pass --moe-token-drop-policy position",
            )
        )
    return {"capacity_factor": float(factor)}


# --- the expert MLP ------------------------------------------------------------------------------


def _activation_table() -> list[tuple[Any, str]]:
    """(callable, MoK activation) for the activation functions Megatron-Core 0.19 sets, each the very
    object its flags, configs and model providers use (recognised by identity, never by name)."""
    from megatron.core import activations
    from megatron.core.fusions import fused_bias_geglu
    from megatron.core.transformer import utils

    return [
        (F.silu, "silu"),  # --swiglu
        (F.gelu, "gelu"),  # TransformerConfig's default: the erf GELU
        (F.relu, "relu"),
        (fused_bias_geglu.quick_gelu, "quick_gelu"),  # --quick-geglu: x * sigmoid(1.702 x)
        (activations.quick_gelu, "quick_gelu"),  # the same formula
        (activations.squared_relu, "squared_relu"),  # --squared-relu: relu(x)^2
        # 0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2))): sqrt(2/pi) to 10 digits (3.6e-12
        # relative), the tanh GELU to far below fp32 rounding.
        (activations.fast_gelu, "gelu_tanh"),
        (utils.openai_gelu, "gelu_tanh"),  # the same with sqrt(2/pi) to 16 digits
        (utils.gelu_impl, "gelu_tanh"),
    ]


def megatron_activation(name: str) -> Any:
    """The callable Megatron's flags set for MoK activation `name` (the first of `_activation_table`)."""
    return next(fn for fn, mok_name in _activation_table() if mok_name == name)


# Functions that megatron defines inside another function (a new object per call), by
# (module, qualified name): --yaml-cfg's `activation_func: squaredrelu` is torch.pow(F.relu(x), 2).
_LOCAL_ACTIVATIONS = {
    ("megatron.training.yaml_arguments", "core_transformer_config_from_yaml.<locals>.squared_relu"): "squared_relu",
}


def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_callable_name(fn.func)}, {short_repr(fn.keywords)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{getattr(fn, '__module__', None) or '?'}.{name}" if name else short_repr(fn)


def _activation_name(fn: Any) -> str | None:
    """MoK's name for Megatron's activation_func, or None when MoK does not compute it."""
    for known, name in _activation_table():
        if fn is known:
            return name
    if isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args and set(fn.keywords) <= {"approximate"}:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(fn.keywords.get("approximate", "none"))
    return _LOCAL_ACTIVATIONS.get((getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)))


def _fusion_problem(
    family: str, swiglu: bool, fused_qgeglu: bool, clamp: float | None, bias: bool, shared: bool, grouped: bool
) -> str | None:
    """Why Megatron's bias_activation_fusion path is not the function MoK computes, or None.

    Routed experts take their routing weight with the activation (a per-token scale); there
    Megatron fuses SwiGLU and quick-GeGLU only and raises for every other activation. TEGroupedMLP's
    fc1 adds its bias itself; SequentialMLP's hands it to the fused activation.
    """
    off = "pass --no-bias-swiglu-fusion" if swiglu else "pass --no-bias-gelu-fusion"
    if not (swiglu or fused_qgeglu):
        return f"Megatron's experts have no fused {family} (the stock layer raises); {off}"
    if swiglu and clamp is not None:
        return f"the fused SwiGLU ignores --activation-func-clamp-value (the unfused path applies it); {off}"
    if swiglu and bias and not grouped:
        return f"SequentialMLP experts have no fused SwiGLU with a bias (the stock layer raises); {off}"
    if fused_qgeglu and bias and clamp is not None and not grouped:
        return (
            "SequentialMLP experts' fused quick-GeGLU clamps fc1's output before adding its bias (TEGroupedMLP "
            f"and the unfused path clamp after, as MoK does); {off}"
        )
    if fused_qgeglu and shared:
        return f"Megatron's shared expert has no fused quick-GeGLU (the stock layer raises); {off}"
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _expert_fields(tc: Any, problems: list[str], stock_experts: str | None) -> dict[str, Any]:
    """MoK's expert family (experts.py) from Megatron's MLP settings; what the stock layer does not
    compute as one function goes to problems. stock_experts: the class the stock layer would build
    ("TEGroupedMLP", "SequentialMLP", or None when unknown), where the stock result depends on it."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    fn = tc.activation_func
    gated = bool(tc.gated_linear_unit)
    activation = _activation_name(fn)
    if activation is None:
        why = "not an activation MoK computes; allowed: F.silu, F.gelu, F.relu, quick_gelu, squared_relu, fast_gelu, "
        why += "openai_gelu, partial(F.gelu, approximate='tanh')"
        if getattr(fn, "__name__", None) == "erf_gelu":
            why = "Megatron's erf_gelu divides by 1.41421, not sqrt(2): not exactly F.gelu; use F.gelu"
        problems.append(_refuse("activation_func", _callable_name(fn), why))
    # Megatron clamps and offsets the GLU halves only; without a GLU both have no effect there either.
    clamp = tc.activation_func_clamp_value if gated else None
    offset = float(tc.glu_linear_offset or 0.0) if gated else 0.0
    bias = bool(tc.add_bias_linear)
    shared = bool(tc.moe_shared_expert_intermediate_size)
    swiglu, fused_qgeglu = gated and fn is F.silu, gated and fn is quick_gelu
    grouped = stock_experts == "TEGroupedMLP"
    family = f"{'gated ' if gated else ''}{activation or _callable_name(fn)}"
    interleave, ffn = tc.moe_mlp_glu_interleave_size, tc.moe_ffn_hidden_size or tc.ffn_hidden_size

    fusion_problem = _fusion_problem(family, swiglu, fused_qgeglu, clamp, bias, shared, grouped)
    # (refused?, field, why)
    checks = [
        (bias and shared, "add_bias_linear", "Megatron's shared expert has no biases (SharedExpertMLP asserts it)"),
        (tc.bias_activation_fusion and fusion_problem, "bias_activation_fusion", fusion_problem),
        (
            tc.bias_activation_fusion and tc.activation_func_fp8_input_store,
            "activation_func_fp8_input_store",
            "the fused SwiGLU keeps its input in fp8 for the backward (other gradients); MoK keeps the parameters' "
            "dtype",
        ),
        (
            tc.use_te_activation_func and not (swiglu and clamp is None and not offset),
            "use_te_activation_func",
            "Transformer Engine's activation modules compute their own functions (GELU with the tanh "
            "approximation) and ignore the clamp and the linear offset",
        ),
        (
            tc.use_transformer_engine_op_fuser
            and not ((swiglu and clamp is None) or (activation == "squared_relu" and not gated)),
            "use_transformer_engine_op_fuser",
            f"Transformer Engine's fused grouped MLP for {family} applies its own clamp and linear offset (or none), "
            "not Megatron's settings",
        ),
        (
            # TEGroupedMLP stores fc1's rows in blocks of S, gate and linear alternating, and reorders
            # them before its GLU (the same function); checkpoint.py reorders the rows to MoK's
            # gate-first layout. TEGroupedMLP's reshape needs S to divide the expert FFN size.
            gated and interleave is not None and not (_positive_int(interleave) and ffn % interleave == 0),
            "moe_mlp_glu_interleave_size",
            f"the gate/linear row blocks must evenly divide the expert FFN size ({ffn}, --moe-ffn-hidden-size)",
        ),
        (
            shared and tc.use_grouped_gemm_for_shared_expert,
            "use_grouped_gemm_for_shared_expert",
            "Transformer Engine's fused shared expert (fp8/fp4 recipes, block-interleaved rows) is not implemented",
        ),
    ]
    problems.extend(_refuse(field, getattr(tc, field), why) for refused, field, why in checks if refused)
    fields: dict[str, Any] = {
        "expert_kind": "glu" if gated else "mlp",
        "expert_activation": activation or "silu",
        "activation_clamp": clamp,
        "glu_linear_offset": offset,
        "expert_fc1_bias": bias,
        "expert_fc2_bias": bias,
        "router_bias": bias,
    }
    return fields


def mok_config_from_megatron(
    tc: Any, overrides: dict[str, Any] | None = None, stock_experts: str | None = None
) -> MoKConfig:
    """The MoKConfig that runs the MoE layer Megatron's TransformerConfig `tc` describes.

    Args:
        tc: a megatron.core TransformerConfig with num_moe_experts set.
        overrides: MoKConfig fields, for example from --mok-config: the MoK-only knobs
            (MOK_KNOBS: backend, kernel_variant, ep_exchange, ep_capacity_factor, ep_transport,
            debug_checks) freely; a field Megatron sets (MEGATRON_SET: shape, routing, losses,
            capacity, shared experts, EP size, dtype, expert family) only with Megatron's value.
        stock_experts: the experts class the stock layer would build ("TEGroupedMLP" or
            "SequentialMLP"; MoKMoELayer reads it from its spec), for the few fused paths whose
            result depends on it; None (unknown) refuses those.
    Returns:
        The validated MoKConfig; ep_size is the expert-model-parallel size.
    Raises:
        MoKConfigError: every unsupported Megatron setting, each naming its flag, and every
            conflicting (naming the mok field and the flag), unknown or removed override, together.
    """
    problems: list[str] = []
    if not tc.num_moe_experts:
        problems.append(f"{megatron_flag('num_moe_experts')} is not set: MoK replaces MoE layers only")
    for field, (is_refused, why) in _REFUSED.items():
        value = getattr(tc, field, None)
        if value is not None and is_refused(value):
            problems.append(_refuse(field, value, why))
    etp = tc.expert_tensor_parallel_size or tc.tensor_model_parallel_size
    if etp != 1:
        problems.append(_refuse("expert_tensor_parallel_size", etp, "expert tensor parallelism is not implemented"))
    if tc.tensor_model_parallel_size != 1:
        problems.append(
            _refuse(
                "tensor_model_parallel_size",
                tc.tensor_model_parallel_size,
                "the MoK layer takes the full hidden state on each rank (TP = 1)",
            )
        )
    if tc.params_dtype not in _DTYPE_NAMES:
        problems.append(_refuse("params_dtype", tc.params_dtype, "allowed: float32, bfloat16, float16"))

    derived: dict[str, Any] = {
        "hidden_size": tc.hidden_size,
        "ffn_hidden_size": tc.moe_ffn_hidden_size or tc.ffn_hidden_size,
        "num_experts": tc.num_moe_experts or 1,
        "ep_size": tc.expert_model_parallel_size,
        # Stock Megatron sizes its exchange from exchanged counts; so does MoK by default here
        # (one host read per layer); the capacity exchange is an opt-in override.
        "ep_exchange": "exact",
        "params_dtype": _DTYPE_NAMES.get(tc.params_dtype, "float32"),
    }
    derived.update(_routing_fields(tc, problems))
    derived.update(_capacity_fields(tc, problems))
    derived.update(_expert_fields(tc, problems, stock_experts))
    if tc.moe_shared_expert_intermediate_size:
        derived.update(num_shared_experts=1, shared_ffn_hidden_size=tc.moe_shared_expert_intermediate_size)

    # What Megatron sets for every MEGATRON_SET field; those it leaves unset keep MoK's defaults
    # (dropless, no shared experts), which an override must not change either.
    megatron_values = {field: derived.get(field, MoKConfig.model_fields[field].default) for field in MEGATRON_SET}
    for key, value in (overrides or {}).items():
        if key in MEGATRON_SET:
            value = dtype_name(value)  # MoKConfig takes a dtype or its name
            if value != megatron_values[key]:
                problems.append(
                    f"mok.{key}={short_repr(value)} conflicts with Megatron's setting {megatron_values[key]!r} "
                    f"({MEGATRON_SET[key]}); set it through Megatron's flags, or drop it from the MoK config"
                )
        elif key in MOK_KNOBS:
            derived[key] = value
        elif key in REMOVED_FIELDS:
            problems.append(f"mok.{key}: {REMOVED_FIELDS[key]}")
        else:
            problems.append(
                f"mok.{str(key)[:80]}: unknown MoK field; allowed: {', '.join(sorted((*MOK_KNOBS, *MEGATRON_SET)))}"
            )
    if problems:
        raise MoKConfigError("cannot run this Megatron MoE layer with MoK:\n  " + "\n  ".join(problems))
    try:
        return MoKConfig(**derived)
    except MoKConfigError as error:
        # A Megatron value out of MoK's bounds (say --moe-aux-loss-coeff 2000): name the flag too.
        def with_flag(match: re.Match) -> str:
            flag = MEGATRON_SET.get(match[1])
            return f"{match[0]} ({flag})" if flag else match[0]

        raise MoKConfigError(re.sub(r"mok\.(\w+)", with_flag, str(error))) from None
