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

Shared experts (--moe-shared-expert-gate, --moe-shared-expert-overlap), --recompute-modules and
CUDA graphs: `_shared_expert_fields`, `selective_recompute_modules`, `_cuda_graph_problems`.

Routing semantics, matched to Megatron-Core 0.19's TopKRouter (router.py, moe_utils.py):
  softmax, post-top-k (default)   softmax over the K chosen logits = softmax over all E, then the K
                                  chosen renormalised: MoK `norm_topk_prob=True`.
  softmax, --moe-router-pre-softmax   softmax over all E, no renormalisation.
  sigmoid, sqrtsoftplus           per-expert scores (sqrtsoftplus: DeepSeek-V4's sqrt(softplus(x))),
                                  renormalised over the K chosen when K > 1; expert bias with either.
  group-limited, expert bias, top-k scaling, z-loss: same formulas.
  --moe-router-load-balancing-type T --moe-aux-loss-coeff C   T in aux_loss (micro-batch),
                                  seq_aux_loss (per sequence), global_aux_loss (global batch), none,
                                  or a list of these with a list C of as many coefficients: MoK's
                                  `aux_loss_coeff`, `seq_aux_loss_coeff`, `global_aux_loss_coeff`
                                  (0 = off; a type repeated in a list keeps its first coefficient,
                                  as TopKRouter.get_aux_loss_coeff reads it). Every one counts the
                                  plain top-K of the normalised scores, beside groups and expert
                                  bias too. MoKMoELayer sums the counts over the TP x CP group
                                  (aux_loss, seq_aux_loss; --context-parallel-size) or the
                                  TP x DP x CP group with a running mean over the global batch
                                  (global_aux_loss), divides the z-loss coefficient by the TP x CP
                                  size, logs each loss under the stock name, and scales the losses
                                  for --calculate-per-token-loss as the stock router does.
  --moe-router-force-load-balancing   routing by N(0, 1) logits with the gradient straight through,
                                  from MoK's counter-based stream (`_routing_fields` says how it
                                  differs); --moe-router-force-biased refused.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch
import torch.nn.functional as F

from mok_plugin.config import (
    MOK_KNOBS,
    REMOVED_FIELDS,
    MoKConfig,
    MoKConfigError,
    dtype_name,
    host_read_settings,
    short_repr,
)
from mok_plugin.fp8.recipe import fp8_recipe_from_megatron
from mok_plugin.routing import SCORE_FUNCTIONS

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
    "shared_expert_gate": "--moe-shared-expert-gate",
    "shared_expert_overlap": "--moe-shared-expert-overlap",
    "shared_expert_recompute": "--recompute-granularity selective --recompute-modules shared_experts",
    "score_function": "--moe-router-score-function",
    "norm_topk_prob": "--moe-router-pre-softmax",
    "routed_scaling_factor": "--moe-router-topk-scaling-factor",
    "n_group": "--moe-router-num-groups",
    "topk_group": "--moe-router-group-topk",
    "expert_bias": "--moe-router-enable-expert-bias",
    "expert_bias_update_rate": "--moe-router-bias-update-rate",
    "force_load_balancing": "--moe-router-force-load-balancing",
    # each the coefficient of its --moe-router-load-balancing-type (aux_loss, seq_aux_loss, global_aux_loss)
    "aux_loss_coeff": "--moe-aux-loss-coeff",
    "seq_aux_loss_coeff": "--moe-aux-loss-coeff, for seq_aux_loss",
    "global_aux_loss_coeff": "--moe-aux-loss-coeff, for global_aux_loss",
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
    "fp8": "--fp8-format",
    "fp8_scaling": "--fp8-recipe",
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
    # The dispatcher adds zero-weight (token, expert) rows so that each expert's row count is a
    # multiple of the fp8/fp4 GEMM alignment (pad_routing_map); the padded rows' probs are 0, so they
    # add exact zeros to the output and to every gradient, and routing, the counts for the expert
    # bias and the aux loss are all taken before the padding. MoK pads its own tiles. Megatron's
    # config accepts the flag only with --fp8-format / --fp4-format.
    "moe_router_padding_for_quantization",
    "moe_router_padding_for_fp8",  # Megatron's alias of moe_router_padding_for_quantization
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
    "moe_apply_probs_on_input": (
        bool,
        "it scales the expert's input by the routing weight, not its output (a different function through the "
        "activation); MoK applies the weight after fc2",
    ),
    "moe_latent_size": (lambda v: v is not None, "latent projections are not implemented"),
    "moe_pad_expert_input_to_capacity": (bool, "MoK pads tiles itself; capacity padding is not implemented"),
    "moe_enable_routing_replay": (bool, "routing replay is not implemented"),
    "fp4": (lambda v: v not in (None, False), "MoK's kernels are bf16/fp16/fp32"),
    "moe_expert_rank_capacity_factor": (
        lambda v: v is not None,
        "a per-rank token budget of the hybridep/ncclep dispatchers (they drop or trap beyond it); MoK is dropless "
        "unless --moe-expert-capacity-factor is set",
    ),
    "moe_pad_experts_for_cuda_graph_inference": (bool, "inference-time capacity padding for CUDA graphs"),
    "moe_router_topk_limited_devices": (
        lambda v: v not in (None, 0),
        "deprecated in Megatron; use --moe-router-num-groups and --moe-router-group-topk",
    ),
    "moe_single_grouped_weight": (bool, "TE's single grouped expert weight: its checkpoint keys are not converted"),
    "moe_single_grouped_bias": (bool, "TE's single grouped expert bias: its checkpoint keys are not converted"),
    "overlap_dispatch_backward_with_experts_wgrad": (
        bool,
        "it overlaps the stock dispatcher's backward with TE's deferred expert weight gradients; MoK computes "
        "them in its own backward",
    ),
    "transformer_impl": (
        lambda v: v == "inference_optimized",
        "the inference-optimised MoE layer (its own dispatcher and grouped GEMM backend)",
    ),
}
# --offload-modules names of MoE submodules whose activations Megatron's fine-grained offloading moves
# to the host (experts.py). MoK has no such submodules: MoKMoELayer keeps every tensor its layer saves
# for the backward in host memory instead (torch.autograd.graph.save_on_cpu), the same values.
MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")


_FLAGS = {
    "num_moe_experts": "--num-experts",
    "gated_linear_unit": "--swiglu / --quick-geglu",
    "activation_func": "--swiglu / --quick-geglu / --squared-relu",
    "add_bias_linear": "--disable-bias-linear",
    "bias_activation_fusion": "--no-bias-swiglu-fusion / --no-bias-gelu-fusion",
    "init_method": "--init-method-std",
    "output_layer_init_method": "--init-method-std",
    "fp8": "--fp8-format",
    "fp8_param": "--fp8-param-gather",
}


def megatron_flag(field: str) -> str:
    """The command-line flag of a TransformerConfig field (Megatron builds them this way)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _refuse(field: str, value: Any, why: str) -> str:
    return f"{megatron_flag(field)} ({field}={value!r}): not supported by MoK: {why}"


# Megatron's load-balancing loss types -> the MoKConfig coefficient that computes each.
_BALANCING_FIELDS = {
    "aux_loss": "aux_loss_coeff",
    "seq_aux_loss": "seq_aux_loss_coeff",
    "global_aux_loss": "global_aux_loss_coeff",
}
_BALANCING_ALLOWED = "allowed: aux_loss, seq_aux_loss, global_aux_loss, none, noaux_tc, or a list of these"
# No load-balancing loss. "noaux_tc" is DeepSeek's name for aux-loss-free top-k with the expert
# bias (--moe-router-enable-expert-bias), which Megatron-Bridge's DeepSeek-V4 provider sets;
# Megatron 0.19's TopKRouter matches no loss type to it, so it routes exactly as with "none".
_NO_BALANCING_LOSS = ("none", "noaux_tc")


def _balancing_fields(tc: Any, problems: list[str]) -> dict[str, float]:
    """MoK's three load-balancing coefficients, read as TopKRouter.get_aux_loss_coeff reads them: a
    single type takes the single --moe-aux-loss-coeff; in a list each type takes the coefficient at
    its first position (Megatron never reads a repeated type's later ones); "none", "noaux_tc" and
    0 switch nothing on."""
    kinds, coeffs = tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff
    fields = dict.fromkeys(_BALANCING_FIELDS.values(), 0.0)
    in_list = isinstance(kinds, (list, tuple))
    if in_list != isinstance(coeffs, (list, tuple)) or (in_list and len(coeffs) != len(kinds)):
        why = "a list of load-balancing types takes a list of as many coefficients, a single type one coefficient"
        problems.append(_refuse("moe_aux_loss_coeff", coeffs, why))
        return fields
    seen: set[str] = set()
    for kind, coeff in zip(kinds, coeffs, strict=True) if in_list else [(kinds, coeffs)]:
        if kind in _BALANCING_FIELDS:
            if kind not in seen:
                fields[_BALANCING_FIELDS[kind]] = float(coeff or 0.0)
            seen.add(kind)
        elif in_list and kind in ("sinkhorn", "quantile_balancing"):
            # TopKRouter compares the whole setting with these names, so inside a list they do nothing.
            why = f"{kind!r} inside a list is ignored by Megatron's router (plain top-k); drop it from the list"
            problems.append(_refuse("moe_router_load_balancing_type", list(kinds), why))
        elif kind not in _NO_BALANCING_LOSS:
            problems.append(_refuse("moe_router_load_balancing_type", kind, _BALANCING_ALLOWED))
    return fields


def _routing_fields(tc: Any, problems: list[str]) -> dict[str, Any]:
    """MoK routing fields from Megatron's router settings; unsupported choices go to problems."""
    K = tc.moe_router_topk
    score = tc.moe_router_score_function
    if score not in SCORE_FUNCTIONS:
        problems.append(_refuse("moe_router_score_function", score, f"allowed: {', '.join(SCORE_FUNCTIONS)}"))
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
                "group-limited routing needs --moe-router-score-function sigmoid/sqrtsoftplus or "
                "--moe-router-pre-softmax",
            )
        )
    # --moe-router-force-load-balancing: Megatron's RandomSTE routes by N(0, 1) logits from the CUDA
    # RNG tracker's expert-parallel stream (seed + 1024 + 100 * EP rank, advancing per draw) with the
    # gradient passed straight through to the real logits. MoK draws the same N(0, 1), i.i.d. per
    # token and expert, from its counter-based stream keyed by (mok.random_seed, layer, call, global
    # token, expert), so a run is bitwise repeatable and the same for every EP size; the values are
    # not Megatron's (the CUDA RNG's), and replicas outside the EP group draw alike (as in Megatron,
    # where expert-data-parallel replicas share the tracker's stream). --moe-router-force-biased
    # adds a bias from the data-parallel stream on top: refused.
    if getattr(tc, "moe_router_force_biased", None) is not None:
        why = "a random logit bias from the CUDA RNG tracker (benchmarks only)"
        problems.append(_refuse("moe_router_force_biased", tc.moe_router_force_biased, why))
    fields: dict[str, Any] = {
        "top_k": K,
        "score_function": score,
        "norm_topk_prob": norm,
        "routed_scaling_factor": float(tc.moe_router_topk_scaling_factor or 1.0),
        "n_group": tc.moe_router_num_groups,
        "topk_group": tc.moe_router_group_topk,
        "expert_bias": bool(tc.moe_router_enable_expert_bias),
        "expert_bias_update_rate": float(tc.moe_router_bias_update_rate),
        "z_loss_coeff": float(tc.moe_z_loss_coeff or 0.0),
        "force_load_balancing": bool(getattr(tc, "moe_router_force_load_balancing", False)),
    }
    fields.update(_balancing_fields(tc, problems))
    # With --recompute-modules moe the stock layer's reentrant checkpoint runs the forward without
    # gradients (no loss, no counts) and takes global_aux_loss in the backward's recomputation. Each
    # stage runs its micro-batches' backwards in their forward order, so the running counts then hold
    # the same micro-batches as at MoK's forward (which counts, and restores them in its recomputation).
    return fields


def _capacity_fields(tc: Any, problems: list[str]) -> dict[str, Any]:
    """Token dropping at EP 1 with --moe-token-drop-policy position: each expert keeps its first
    ceil(T * K / E * factor) tokens in token order, "tokens at the end of each batch dropped" as
    Megatron documents it. (Megatron's apply_router_token_dropping picks them with torch.topk over
    the 0/1 routing map, whose order among ties is implementation-defined: on the CPU it can keep a
    later token over an earlier one; tests/test_megatron.py::test_capacity_matches_stock compares
    with the stock layer under a position-ordered top-k.) The probs policy is refused."""
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


# --- shared experts, recompute, CUDA graphs ---------------------------------------------------------


def selective_recompute_modules(tc: Any) -> set[str]:
    """--recompute-modules when --recompute-granularity is selective, else empty."""
    if getattr(tc, "recompute_granularity", None) != "selective":
        return set()
    return set(getattr(tc, "recompute_modules", None) or ())


def _shared_expert_fields(tc: Any) -> dict[str, Any]:
    """MoK's shared-expert switches from Megatron's (called only when the layer has shared experts).

    --moe-shared-expert-gate       gate_weight [1, H]; output times sigmoid(x . gate_weight)
                                   (SharedExpertMLP.forward): `shared_expert_gate`.
    --moe-shared-expert-overlap    stock: the shared expert runs on a side stream inside the
                                   dispatcher, a schedule with no effect on the values. MoK: its
                                   shared experts run on a side stream while the routed experts run,
                                   bitwise the same as without: `shared_expert_overlap`.
    --recompute-modules shared_experts   (selective) the shared expert under an activation
                                   checkpoint: `shared_expert_recompute`. Megatron refuses it with
                                   the overlap.
    """
    return {
        "shared_expert_gate": bool(tc.moe_shared_expert_gate),
        "shared_expert_overlap": bool(tc.moe_shared_expert_overlap),
        "shared_expert_recompute": "shared_experts" in selective_recompute_modules(tc),
    }


# How each --recompute-modules value that touches the MoE layer is honoured (selective granularity):
#   moe             the whole MoKMoELayer forward runs under a non-reentrant activation checkpoint
#                   (megatron/layer.py), as MoELayer does, and not with --cuda-graph-impl local,
#                   where stock MoELayer does not either.
#   moe_act         stock: the expert activation is recomputed in the backward instead of saved.
#                   MoK always does this: both backends save the pre-activation h only and recompute
#                   A = act(h) in the backward (reference.py; ops.py, in the dgrad epilogue), so
#                   there is nothing to switch.
#   shared_experts  `_shared_expert_fields`.
# --recompute-granularity full recomputes whole transformer layers in Megatron's block, around the
# layer; MoK's forward is deterministic, so the recomputation gives the same values (the
# force-balancing draw's step too: mok_plugin/recompute_draws.py).


def _module_names(modules: Any) -> set[str]:
    modules = modules if isinstance(modules, (list, tuple)) else [modules] if modules else []
    return {str(getattr(module, "name", module)) for module in modules}


def partial_graph_modules(tc: Any) -> set[str]:
    """{"moe_router"} and / or "moe_preprocess" when Megatron captures the start of the MoE layer in
    per-layer CUDA graphs (--cuda-graph-impl local or transformer_engine; graph_stages.py); else empty."""
    if (getattr(tc, "cuda_graph_impl", "none") or "none") not in ("local", "transformer_engine"):
        return set()
    return _graph_module_names(tc) & {"moe_router", "moe_preprocess"}


def _graph_module_names(tc: Any) -> set[str]:
    """--cuda-graph-modules and its deprecated name --cuda-graph-scope, as names."""
    return _module_names(getattr(tc, "cuda_graph_modules", None)) | _module_names(getattr(tc, "cuda_graph_scope", None))


def _cuda_graph_problems(tc: Any, derived: dict[str, Any]) -> list[str]:
    """Why Megatron's CUDA-graph settings cannot run this MoK layer (empty when they can).

    --cuda-graph-modules (--cuda-graph-scope, its deprecated name) moe_router / moe_preprocess, with
    --cuda-graph-impl local or transformer_engine, capture the start of the MoE layer and resume it
    eagerly (graph_stages.py): MoK's routing and its shared experts (not overlapped) go in the
    graph, the rest runs eagerly, so only the debug checks' host reads are in the way there. The
    other values call the layer as usual: it is captured whole (an empty module list, `moe` (only
    with pad-to-capacity, which MoK refuses), or --cuda-graph-impl full_iteration) or runs eagerly.
    A captured layer must not read anything on the host: refused, naming the setting, where MoK
    would (the exact EP exchange, the reference backend, debug checks, the tensorwise and mxfp8 FP8
    recipes' PyTorch path).
    """
    impl = getattr(tc, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        return []
    partial = partial_graph_modules(tc)
    if partial:
        return _partial_graph_problems(tc, derived, impl, partial)
    modules = _graph_module_names(tc)
    problems = []
    per_layer = impl in ("local", "transformer_engine")
    captured = impl == "full_iteration" or (per_layer and (not modules or "moe" in modules))
    if captured:
        host_reads = host_read_settings(
            exact_ep_exchange=derived.get("ep_size", 1) > 1 and derived.get("ep_exchange") == "exact",
            reference_backend=derived.get("backend") == "reference", debug=bool(derived.get("debug_checks")),
            fp8_scaling=derived.get("fp8_scaling"),  # (set only with --fp8-format)
        )  # fmt: skip
        if host_reads:
            problems.append(
                f"--cuda-graph-impl ({impl}, capturing the MoE layer): not supported by MoK with these settings: "
                + "; ".join(host_reads)
            )
    return problems


def _partial_graph_problems(tc: Any, derived: dict[str, Any], impl: str, partial: set[str]) -> list[str]:
    """What MoK cannot do under the partial MoE graphs (graph_stages.py), by flag."""
    flag = f"--cuda-graph-modules {' '.join(sorted(partial))} with --cuda-graph-impl {impl}"
    problems = []
    if derived.get("debug_checks"):
        problems.append(f"{flag}: not supported by MoK with debug checks, which read the router logits on the host "
                        "inside the graph (mok debug_checks, MOK_PLUGIN_DEBUG)")  # fmt: skip
    recompute = selective_recompute_modules(tc)
    if "moe" in recompute:
        problems.append(f"--recompute-modules moe with {flag}: not supported by MoK: its moe recomputation "
                        "wraps the whole layer, which the graphs split (moe_act: MoK default)")  # fmt: skip
    offloaded = set(getattr(tc, "offload_modules", None) or ()) & set(MOE_OFFLOAD_MODULES)
    if getattr(tc, "fine_grained_activation_offloading", False) and offloaded:
        problems.append(f"--offload-modules {' '.join(sorted(offloaded))} with {flag}: not supported by MoK: it "
                        "offloads the whole layer's saved tensors, which these graphs split into stages")  # fmt: skip
    if impl == "transformer_engine" and "moe_preprocess" in partial and "layernorm" in recompute:
        # Megatron then recomputes the pre-MLP layer norm and frees its output when the graph is
        # captured (TransformerLayer: can_recompute_pre_mlp_layernorm_for_cudagraph, with alltoall):
        # MoK's graph returns that output itself (it has no permutation), which the eager part reads.
        if tc.moe_token_dispatcher_type == "alltoall":
            problems.append(f"--recompute-modules layernorm with {flag} and --moe-token-dispatcher-type alltoall: "
                            "not supported by MoK: Megatron frees the pre-MLP layer norm's output inside the graph, "
                            "which MoK's graph returns to the eager experts (use the flex dispatcher, or recompute "
                            "without layernorm)")  # fmt: skip
    return problems


def normal_init_std(init_method: Any) -> float | None:
    """The std of a Megatron init callable that draws N(0, std) (init_method_normal,
    scaled_init_method_normal: partial(torch.nn.init.normal_, mean=0.0, std=...)), else None."""
    if not (isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_):
        return None
    if init_method.args or init_method.keywords.get("mean", 0.0) != 0.0 or set(init_method.keywords) - {"mean", "std"}:
        return None
    return float(init_method.keywords.get("std", 1.0))


def init_stds(tc: Any) -> tuple[float, float]:
    """(std of init_method, std of output_layer_init_method): what MoKMoE draws its weights with
    (router, fc1, shared gate: the first; fc2 of routed and shared experts: the second)."""
    std = normal_init_std(tc.init_method)
    out_std = normal_init_std(tc.output_layer_init_method)
    return (tc.init_method_std if std is None else std), (tc.init_method_std if out_std is None else out_std)


def _ep_overlap_problems(tc: Any) -> list[str]:
    """--overlap-moe-expert-parallel-comm drives MoKMoELayer through its stage methods (layer.py):
    Megatron checks the rest (EP > 1, bf16/fp16, no moe recompute, alltoall or flex); this is
    MoK's own limits there."""
    if not getattr(tc, "overlap_moe_expert_parallel_comm", False):
        return []
    problems = []
    if getattr(tc, "moe_ncclep_zero_copy", False):
        why = ("with the EP overlap the schedule hands the NCCL-EP dispatcher's zero-copy buffers to its backward; "
               "MoK's exchange replaces that dispatcher")  # fmt: skip
        problems.append(_refuse("moe_ncclep_zero_copy", True, why))
    offloaded = set(tc.offload_modules or ()) & set(MOE_OFFLOAD_MODULES)
    if getattr(tc, "fine_grained_activation_offloading", False) and offloaded:
        why = "MoK offloads the whole layer's saved tensors, which the EP overlap's separate stages do not allow"
        problems.append(_refuse("offload_modules", sorted(offloaded), why))
    return problems


def _fp8_fields(tc: Any, problems: list[str]) -> dict[str, Any]:
    """--fp8-format e4m3 / hybrid with --fp8-recipe blockwise, tensorwise or mxfp8: MoK's FP8 experts
    (mok.fp8, mok.fp8_scaling) with Transformer Engine's numbers for that recipe (fp8/recipe.py:
    Float8BlockScaling with its power-of-two scales, Float8CurrentScaling, MXFP8BlockScaling).
    delayed and custom, FP8 parameters and the scale options TE reads from the environment are
    refused by name. Which layers run FP8 (--first-last-layers-bf16) is the layer's to say:
    MoKMoELayer knows its number."""
    if getattr(tc, "fp8_param", False):
        why = "MoK keeps the expert weights in the parameters' dtype and makes their FP8 copies once per step"
        problems.append(_refuse("fp8_param", True, why))
    if tc.fp8 in (None, False):
        return {}
    try:
        recipe = fp8_recipe_from_megatron(tc.fp8, str(getattr(tc.fp8_recipe, "value", tc.fp8_recipe)))
    except ValueError as error:
        field = "fp8" if str(error).startswith("--fp8-format") else "fp8_recipe"
        problems.append(_refuse(field, getattr(tc, field), str(error).split(": ", 1)[1]))
        return {}
    for variable, scaling, why in _TE_SCALE_ENVIRONMENT:
        if recipe.scaling == scaling and os.environ.get(variable, "0") == "1":
            problems.append(f"{variable}=1 ({why}): not supported by MoK: its {scaling} recipe takes Transformer "
                            "Engine's default scales")  # fmt: skip
    return {"fp8": tc.fp8, "fp8_scaling": recipe.scaling}


# Transformer Engine's recipes read these at import (common/recipe/__init__.py); MoK computes the defaults.
_TE_SCALE_ENVIRONMENT = (
    ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "blockwise", "fp32 block scales"),
    ("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "tensorwise", "power-of-two current scales"),
)


def _init_problems(tc: Any) -> list[str]:
    """MoK draws every weight from N(0, std) (deterministically, the same for any EP size); an init
    callable of another kind (MuP-scaled ones are normals too) is refused by name."""
    if not getattr(tc, "perform_initialization", True):
        return []  # Megatron skips initialisation (the weights come from a checkpoint)
    problems = []
    for field in ("init_method", "output_layer_init_method"):
        if normal_init_std(getattr(tc, field)) is None:
            why = "MoK draws its weights from N(0, std); this init callable is not one (Megatron's "
            why += "init_method_normal / scaled_init_method_normal are)"
            problems.append(_refuse(field, _callable_name(getattr(tc, field)), why))
    return problems


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
    # TP > 1 is honoured (each rank routes its own sequence shard; MoKMoELayer marks the replicated
    # parameters sequence-parallel). Megatron sets ETP to TP when it is not given: the recipes that
    # run TP > 1 all pass --expert-tensor-parallel-size 1, which MoK needs (each expert whole on one
    # rank: split experts would add a reduction per expert and shrink its GEMMs by the TP size).
    etp = tc.expert_tensor_parallel_size or tc.tensor_model_parallel_size
    if etp != 1:
        problems.append(
            _refuse(
                "expert_tensor_parallel_size",
                etp,
                "MoK keeps each expert whole on one rank; with --tensor-model-parallel-size > 1 pass "
                "--expert-tensor-parallel-size 1 (what the public recipes run)",
            )
        )
    shared, tp = tc.moe_shared_expert_intermediate_size, tc.tensor_model_parallel_size
    if shared and tp > 1 and shared % tp:
        # Stock's TP-split shared expert refuses it too; MoK's checkpoints write stock's TP parts.
        problems.append(_refuse("moe_shared_expert_intermediate_size", shared,
                                f"the shared expert's checkpoints are split over TP: it must be a multiple of "
                                f"--tensor-model-parallel-size {tp}"))  # fmt: skip
    problems += _init_problems(tc)
    problems += _ep_overlap_problems(tc)
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
    derived.update(_fp8_fields(tc, problems))
    if tc.moe_shared_expert_intermediate_size:
        derived.update(num_shared_experts=1, shared_ffn_hidden_size=tc.moe_shared_expert_intermediate_size)
        derived.update(_shared_expert_fields(tc))

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
    problems.extend(_cuda_graph_problems(tc, derived))
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
