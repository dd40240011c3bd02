"""Public Megatron MoE recipes as data, shrunk to CPU size (issue 21: the recipe matrix).

Each `Recipe` keeps, as Megatron-Core 0.19 TransformerConfig field values, every setting of its
source that touches the MoE layer (routing, losses, experts, shared expert, fusions, dispatcher,
recompute, CUDA graphs, precision) and its parallel layout, with only the sizes shrunk: hidden 32,
a few experts (group counts and top-k kept where they fit: E a multiple of the group count, top-k
as published), tiny FFN sizes. Settings the recipe leaves unset keep TransformerConfig's defaults
(a Bridge recipe's defaults come from its model bridge, which the comment names).

Sources (read, not copied):
  MZ  = yanring/Megatron-MoE-ModelZoo @ e8650517d60d71ab73fc6b3b0388cac4ba435181 (2026-05-16):
        model_configs/benchmarking/<Model>.yaml (the model and MoE flags), runtime_configs/
        benchmarking/runtime.conf (default TP PP EP CP VPP), best_practice/*/*.sh (the launch line:
        layout overrides and extra flags), sbatch_benchmarking.sh (what PR=fp8/mxfp8 and
        A2A_OVERLAP=1 add).
  MB  = megatron-bridge 0.6.2 (PyPI wheel): megatron/bridge/recipes/<path>::<function> (layout
        and recipe overrides) over megatron/bridge/models/<model>_bridge.py (the model provider
        the recipe starts from, with the HF config's routing numbers through CONFIG_MAPPING).

This module holds data only (no pytest, no megatron import): tests/test_megatron_recipes.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MZ = "yanring/Megatron-MoE-ModelZoo@e8650517d60d71ab73fc6b3b0388cac4ba435181"
MB = "megatron-bridge==0.6.2"

# The layout fields (TransformerConfig names) every recipe states, and the flags that set them.
LAYOUT_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
}

H = 32  # hidden size of every shrunk recipe
FFN = 32  # dense FFN size (dense layers are not built; TransformerConfig wants one)


@dataclass(frozen=True)
class Recipe:
    """One public recipe: `moe` are its MoE-layer settings (TransformerConfig fields, sizes shrunk),
    `layout` its parallel layout (TP, PP, VPP, CP, EP, ETP, sequence parallel)."""

    name: str
    model: str
    source: str  # repository@commit or package==version, then path::function or the launch line
    moe: dict[str, Any]
    layout: dict[str, Any]
    activation: str = "silu"  # silu | quick_gelu | squared_relu (resolved to Megatron's callable by the test)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # recipe settings with no 0.19.2 field (kept for the record)


def _layout(tp=1, pp=1, ep=1, cp=1, etp=1, vpp=None, sp=None) -> dict[str, Any]:
    return dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # Megatron's validate_args switches sequence parallelism off at TP = 1 (TransformerConfig refuses it)
        sequence_parallel=bool(sp if sp is not None else True) and tp > 1,
    )


# Settings shared by the ModelZoo YAMLs' "Add MoE args" and training args (every model there):
# --disable-bias-linear, --swiglu, --moe-grouped-gemm true, --moe-permute-fusion true.
_MZ_COMMON = dict(
    add_bias_linear=False, gated_linear_unit=True, moe_grouped_gemm=True, moe_permute_fusion=True,
    moe_token_dispatcher_type="alltoall",
)  # fmt: skip
# sbatch_benchmarking.sh: PR=fp8 adds --fp8-recipe blockwise --fp8-format e4m3 --moe-router-padding-for-fp8;
# PR=mxfp8 adds --fp8-recipe mxfp8 --fp8-format e4m3 --moe-router-padding-for-quantization;
# A2A_OVERLAP=1 adds --delay-wgrad-compute --overlap-moe-expert-parallel-comm.
_MZ_FP8 = dict(fp8="e4m3", fp8_recipe="blockwise", moe_router_padding_for_fp8=True)
_MZ_MXFP8 = dict(fp8="e4m3", fp8_recipe="mxfp8", moe_router_padding_for_quantization=True)
_A2A_OVERLAP = dict(delay_wgrad_compute=True, overlap_moe_expert_parallel_comm=True)

# DeepSeek-V3 model YAML's MoE args (E 256 -> 32: 8 groups of 4; top-8 of 4 groups kept).
_MZ_DSV3 = dict(
    _MZ_COMMON, num_moe_experts=32, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
    moe_router_load_balancing_type="seq_aux_loss", moe_router_topk=8, moe_aux_loss_coeff=1e-4,
    moe_router_group_topk=4, moe_router_num_groups=8, moe_router_topk_scaling_factor=2.5,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
    moe_router_dtype="fp32", moe_router_fusion=True, moe_token_dispatcher_type="flex",
    moe_layer_freq=[0, 1], mtp_num_layers=1, multi_latent_attention=True,
)  # fmt: skip
# Qwen3 YAMLs' MoE args (E 128 -> 16, top-8 kept).
_MZ_QWEN3 = dict(
    _MZ_COMMON, num_moe_experts=16, moe_ffn_hidden_size=16, moe_router_load_balancing_type="aux_loss",
    moe_router_topk=8, moe_router_pre_softmax=False, moe_aux_loss_coeff=1e-3, moe_router_dtype="fp32",
    moe_router_fusion=True,
)  # fmt: skip

# Model bridges (MB models/...): what each provider_bridge sets for the MoE layer, then the HF
# config's numbers (n_routed_experts, num_experts_per_tok, n_group, topk_group, routed_scaling_factor,
# scoring_func) shrunk.
_MB_DSV2 = dict(  # models/deepseek/deepseek_v2_bridge.py (moe_aux_loss_coeff not set: 0.0)
    multi_latent_attention=True,
    gated_linear_unit=True, add_bias_linear=False, moe_grouped_gemm=True, moe_router_pre_softmax=True,
    moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="seq_aux_loss",
    moe_shared_expert_overlap=True, moe_router_dtype="fp32", moe_permute_fusion=True,
)  # fmt: skip
_MB_DSV3 = dict(  # models/deepseek/deepseek_v3_bridge.py (Moonlight is a DeepseekV3ForCausalLM too)
    multi_latent_attention=True,
    gated_linear_unit=True, add_bias_linear=False, moe_grouped_gemm=True, moe_router_pre_softmax=True,
    moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
    moe_shared_expert_overlap=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_dtype="fp32", moe_permute_fusion=True, bias_activation_fusion=True, moe_layer_freq=[0, 1],
)  # fmt: skip
_MB_KIMI = dict(  # models/kimi/kimi_bridge.py (+ HF scoring_func sigmoid, n_group 1, topk_group 1, 2.827)
    multi_latent_attention=True,
    gated_linear_unit=True, add_bias_linear=False, moe_grouped_gemm=True, moe_router_pre_softmax=True,
    moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="seq_aux_loss",
    moe_shared_expert_overlap=True, moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
    moe_permute_fusion=True, bias_activation_fusion=True, moe_aux_loss_coeff=1e-3,
    moe_router_score_function="sigmoid", moe_router_num_groups=1, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.827, num_moe_experts=16, moe_router_topk=8, moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1],
)  # fmt: skip
_MB_GLM45 = dict(  # models/glm/glm45_bridge.py (+ HF n_group 1, topk_group 1, one shared expert)
    gated_linear_unit=True, add_bias_linear=False, moe_shared_expert_overlap=True,
    moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="seq_aux_loss",
    moe_router_pre_softmax=False, moe_grouped_gemm=True, moe_router_score_function="sigmoid",
    moe_permute_fusion=True, moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
    moe_router_bias_update_rate=0.0, moe_aux_loss_coeff=1e-3, bias_activation_fusion=True,
    moe_router_num_groups=1, moe_router_group_topk=1, moe_router_topk=8, num_moe_experts=16,
    moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1],
)  # fmt: skip
_MB_GPT_OSS = dict(  # models/gpt_oss/gpt_oss_bridge.py (HF: 32 / 128 experts, top-4; biases everywhere)
    gated_linear_unit=True, add_bias_linear=True, moe_router_pre_softmax=False, moe_grouped_gemm=True,
    moe_token_dispatcher_type="alltoall", moe_permute_fusion=True, moe_router_load_balancing_type="none",
    bias_activation_fusion=True, activation_func_clamp_value=7.0, glu_linear_offset=1.0, moe_router_topk=4,
    moe_ffn_hidden_size=16, calculate_per_token_loss=True, moe_shared_expert_overlap=False,
)  # fmt: skip
_MB_QWEN3_NEXT = dict(  # models/qwen/qwen3_next_bridge.py (HF 512 experts -> 16, top-10, shared 512)
    gated_linear_unit=True, add_bias_linear=False, moe_grouped_gemm=True,
    moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-3, moe_router_pre_softmax=False,
    moe_token_dispatcher_type="alltoall", moe_permute_fusion=True, moe_shared_expert_gate=True,
    moe_router_dtype="fp32", moe_shared_expert_intermediate_size=16, num_moe_experts=16, moe_router_topk=10,
    moe_ffn_hidden_size=16,
)  # fmt: skip

RECIPES: list[Recipe] = [
    # --- Megatron MoE ModelZoo --------------------------------------------------------------------
    Recipe(
        "mixtral_8x7b_mz", "Mixtral-8x7B",
        # MZ model_configs/benchmarking/Mixtral-8x7B.yaml; runtime.conf [Mixtral-8x7B]: TP1 PP4 EP8 CP1 VPP8
        f"{MZ}: model_configs/benchmarking/Mixtral-8x7B.yaml + runtime_configs/benchmarking/runtime.conf",
        dict(_MZ_COMMON, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
        _layout(tp=1, pp=4, ep=8, vpp=8, sp=True),
    ),
    Recipe(
        "mixtral_8x22b_mz_force_balance", "Mixtral-8x22B",
        # MZ best_practice/mixtral/run_mixtral_8x22B.sh line 2 (--moe-router-force-load-balancing);
        # runtime.conf [Mixtral-8x22B]: TP2 PP8 EP8 CP1 VPP7
        f"{MZ}: best_practice/mixtral/run_mixtral_8x22B.sh (force load balancing) + Mixtral-8x22B.yaml",
        dict(_MZ_COMMON, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_router_fusion=True,
             moe_router_force_load_balancing=True),
        _layout(tp=2, pp=8, ep=8, vpp=7, sp=True),
    ),
    Recipe(
        "qwen3_30b_a3b_mz", "Qwen3-30B-A3B",
        # MZ best_practice/qwen3/run_30b.sh line 1: PP=1 VPP=1 TP=1 EP=8 --moe-router-force-load-balancing
        f"{MZ}: best_practice/qwen3/run_30b.sh (line 1) + model_configs/benchmarking/Qwen3-30B-A3B.yaml",
        dict(_MZ_QWEN3, moe_router_force_load_balancing=True),
        _layout(tp=1, pp=1, ep=8, sp=True),
    ),
    Recipe(
        "qwen3_30b_a3b_mz_recompute", "Qwen3-30B-A3B",
        # MZ best_practice/qwen3/run_30b.sh line 3: TP1 PP1 EP8, force balancing, selective recompute moe_act layernorm
        f"{MZ}: best_practice/qwen3/run_30b.sh (line 3) + model_configs/benchmarking/Qwen3-30B-A3B.yaml",
        dict(_MZ_QWEN3, moe_router_force_load_balancing=True, recompute_granularity="selective",
             recompute_modules=["moe_act", "layernorm"]),
        _layout(tp=1, pp=1, ep=8, sp=True),
    ),
    Recipe(
        "qwen3_235b_a22b_mz_h100_a2a_overlap", "Qwen3-235B-A22B",
        # MZ best_practice/qwen3/run_h100_235b.sh: DISPATCHER=deepep A2A_OVERLAP=1 TP=2 PP=8 VPP=4 EP=32,
        # recompute moe_act layernorm, force balancing, TE CUDA graphs with scope moe_router moe_preprocess
        f"{MZ}: best_practice/qwen3/run_h100_235b.sh + model_configs/benchmarking/Qwen3-235B-A22B.yaml",
        dict(_MZ_QWEN3, **_A2A_OVERLAP, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
             moe_router_force_load_balancing=True, recompute_granularity="selective",
             recompute_modules=["moe_act", "layernorm"], cuda_graph_impl="transformer_engine",
             cuda_graph_scope=["moe_router", "moe_preprocess"]),
        _layout(tp=2, pp=8, ep=32, vpp=4, sp=True),
    ),
    Recipe(
        "qwen3_235b_a22b_mz_cp4", "Qwen3-235B-A22B",
        # MZ best_practice/qwen3/run_235b.sh: PP=8 VPP=4 TP=4 EP=8 CP=4 SEQ_LEN=65536 PR=bf16, recompute layernorm moe
        f"{MZ}: best_practice/qwen3/run_235b.sh (CP=4 line) + model_configs/benchmarking/Qwen3-235B-A22B.yaml",
        dict(_MZ_QWEN3, recompute_granularity="selective", recompute_modules=["layernorm", "moe"]),
        _layout(tp=4, pp=8, ep=8, cp=4, vpp=4, sp=True),
    ),
    Recipe(
        "qwen3_next_80b_mz", "Qwen3-Next-80B-A3B",
        # MZ best_practice/qwen3/run_next_80b.sh: PP=4 VPP=3 TP=1 EP=32 CP=1, recompute moe_act shared_experts
        # layernorm, force balancing; YAML: 512 experts top-10, shared expert 512 with gate, flex + DeepEP, MTP 1
        f"{MZ}: best_practice/qwen3/run_next_80b.sh + model_configs/benchmarking/Qwen3-Next-80B-A3B.yaml",
        dict(_MZ_COMMON, num_moe_experts=16, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
             moe_shared_expert_gate=True, moe_router_load_balancing_type="aux_loss", moe_router_topk=10,
             moe_router_pre_softmax=False, moe_aux_loss_coeff=1e-3, moe_token_dispatcher_type="flex",
             moe_flex_dispatcher_backend="deepep", moe_router_dtype="fp32", moe_router_fusion=True, mtp_num_layers=1,
             moe_router_force_load_balancing=True, recompute_granularity="selective",
             recompute_modules=["moe_act", "shared_experts", "layernorm"]),
        _layout(tp=1, pp=4, ep=32, vpp=3, sp=True),
    ),
    Recipe(
        "qwen2_57b_a14b_mz", "Qwen2-57B-A14B",
        # MZ model_configs/benchmarking/Qwen2-57B-A14B.yaml (runtime.conf has no Qwen2 row: the layout is
        # the user's; tested at TP = PP = CP = 1, EP 8)
        f"{MZ}: model_configs/benchmarking/Qwen2-57B-A14B.yaml",
        dict(_MZ_COMMON, num_moe_experts=16, moe_router_topk=8, moe_router_pre_softmax=True,
             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True),
        _layout(tp=1, pp=1, ep=8, sp=True),
        notes="layout not in the source (no runtime.conf row)",
    ),
    Recipe(
        "deepseek_v2_lite_mz", "DeepSeek-V2-Lite",
        # MZ model_configs/benchmarking/DeepSeek-V2-Lite.yaml; runtime.conf [DeepSeek-V2-Lite]: TP1 PP1 EP8 CP1
        f"{MZ}: model_configs/benchmarking/DeepSeek-V2-Lite.yaml + runtime_configs/benchmarking/runtime.conf",
        dict(_MZ_COMMON, multi_latent_attention=True, num_moe_experts=8, moe_layer_freq=[0, 1], moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_load_balancing_type="seq_aux_loss", moe_router_topk=6,
             moe_router_pre_softmax=True, moe_aux_loss_coeff=1e-3, moe_router_topk_scaling_factor=1.0,
             moe_router_dtype="fp32"),
        _layout(tp=1, pp=1, ep=8, sp=True),
    ),
    Recipe(
        "deepseek_v2_mz", "DeepSeek-V2",
        # MZ model_configs/benchmarking/DeepSeek-V2.yaml; runtime.conf [DeepSeek-V2]: TP1 PP16 EP8 VPP2 (first/last 2)
        f"{MZ}: model_configs/benchmarking/DeepSeek-V2.yaml + runtime_configs/benchmarking/runtime.conf",
        dict(_MZ_COMMON, multi_latent_attention=True, num_moe_experts=32, moe_layer_freq=[0, 1], moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_load_balancing_type="seq_aux_loss", moe_router_topk=6,
             moe_router_pre_softmax=True, moe_aux_loss_coeff=1e-3, moe_router_group_topk=3, moe_router_num_groups=8,
             moe_shared_expert_overlap=True, moe_router_topk_scaling_factor=16.0, moe_router_dtype="fp32",
             recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        _layout(tp=1, pp=16, ep=8, vpp=2, sp=True),
    ),
    Recipe(
        "deepseek_v3_mz_gb200_mxfp8", "DeepSeek-V3",
        # MZ best_practice/deepseek-v3/run_deepseek_v3_gb200.sh: PR=mxfp8 TP=1 PP=4 EP=64 VPP=4, recompute mlp,
        # TE CUDA graphs with scope attn moe_router moe_preprocess, MTP 1, force balancing
        f"{MZ}: best_practice/deepseek-v3/run_deepseek_v3_gb200.sh + model_configs/benchmarking/DeepSeek-V3.yaml",
        dict(_MZ_DSV3, **_MZ_MXFP8, recompute_granularity="selective", recompute_modules=["mlp"],
             cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "moe_router", "moe_preprocess"],
             moe_router_force_load_balancing=True),
        _layout(tp=1, pp=4, ep=64, vpp=4, sp=True),
    ),
    Recipe(
        "deepseek_v3_mz_h100_fp8_a2a", "DeepSeek-V3",
        # MZ best_practice/deepseek-v3/run_deepseek_v3_h100.sh line 1: A2A_OVERLAP=1 PP=8 VPP=4 TP=2 EP=64 PR=fp8,
        # recompute mla_up_proj mlp, MTP 1
        f"{MZ}: best_practice/deepseek-v3/run_deepseek_v3_h100.sh (line 1)"
        " + model_configs/benchmarking/DeepSeek-V3.yaml",
        dict(_MZ_DSV3, **_MZ_FP8, **_A2A_OVERLAP, recompute_granularity="selective",
             recompute_modules=["mla_up_proj", "mlp"]),
        _layout(tp=2, pp=8, ep=64, vpp=4, sp=True),
    ),
    Recipe(
        "kimi_k2_mz_gb200", "Kimi-K2",
        # MZ best_practice/kimi-k2/run_kimi_k2_gb200_128k_G128.sh: PP=2 TP=16 EP=64 CP=1 PR=mxfp8, recompute
        # mla_up_proj mlp layernorm moe_act, activation offloading of expert_fc1, force balancing; YAML: 384
        # experts top-8, seq_aux_loss coefficient 0, sigmoid, groups 1/1, scaling 2.827, expert bias
        f"{MZ}: best_practice/kimi-k2/run_kimi_k2_gb200_128k_G128.sh + model_configs/benchmarking/Kimi-K2.yaml",
        dict(_MZ_COMMON, **_MZ_MXFP8, multi_latent_attention=True, num_moe_experts=16, moe_layer_freq=[0, 1],
             moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=16, moe_router_load_balancing_type="seq_aux_loss", moe_router_topk=8,
             moe_aux_loss_coeff=0.0, moe_router_group_topk=1, moe_router_num_groups=1,
             moe_router_topk_scaling_factor=2.827, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3, moe_router_dtype="fp32",
             moe_router_fusion=True, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
             recompute_granularity="selective", recompute_modules=["mla_up_proj", "mlp", "layernorm", "moe_act"],
             fine_grained_activation_offloading=True, offload_modules=["expert_fc1"],
             moe_router_force_load_balancing=True),
        _layout(tp=16, pp=2, ep=64, sp=True),
    ),
    # --- Megatron Bridge 0.6.2 --------------------------------------------------------------------
    Recipe(
        "deepseek_v2_lite_mb", "DeepSeek-V2-Lite",
        # MB recipes/deepseek/h100/deepseek_v2.py::deepseek_v2_lite_pretrain_8gpu_h100_bf16_config (TP1 PP1 EP8,
        # full recompute) over models/deepseek/deepseek_v2_bridge.py; HF: 64 experts top-6, 2 shared, groups 1/1
        f"{MB}: megatron/bridge/recipes/deepseek/h100/deepseek_v2.py::deepseek_v2_lite_pretrain_8gpu_h100_bf16_config",
        dict(_MB_DSV2, num_moe_experts=8, moe_router_topk=6, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_num_groups=1, moe_router_group_topk=1,
             moe_router_topk_scaling_factor=1.0, moe_layer_freq=[0, 1], moe_router_fusion=False,
             recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        _layout(tp=1, pp=1, ep=8, sp=False),
    ),
    Recipe(
        "deepseek_v2_mb", "DeepSeek-V2",
        # MB recipes/deepseek/h100/deepseek_v2.py::deepseek_v2_pretrain_128gpu_h100_bf16_config (TP1 PP4 EP32);
        # HF: 160 experts top-6, groups 8/3, scaling 16
        f"{MB}: megatron/bridge/recipes/deepseek/h100/deepseek_v2.py::deepseek_v2_pretrain_128gpu_h100_bf16_config",
        dict(_MB_DSV2, num_moe_experts=32, moe_router_topk=6, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_num_groups=8, moe_router_group_topk=3,
             moe_router_topk_scaling_factor=16.0, moe_layer_freq=[0, 1], moe_router_fusion=False,
             recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        _layout(tp=1, pp=4, ep=32, sp=False),
    ),
    Recipe(
        "deepseek_v3_mb", "DeepSeek-V3",
        # MB recipes/deepseek/h100/deepseek_v3.py::deepseek_v3_pretrain_1024gpu_h100_bf16_config (TP2 PP16 EP64 SP,
        # MTP 1) over models/deepseek/deepseek_v3_bridge.py; HF: 256 experts top-8, groups 8/4, scaling 2.5
        f"{MB}: megatron/bridge/recipes/deepseek/h100/deepseek_v3.py::deepseek_v3_pretrain_1024gpu_h100_bf16_config",
        dict(_MB_DSV3, num_moe_experts=32, moe_router_topk=8, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=16, moe_router_num_groups=8, moe_router_group_topk=4,
             moe_router_topk_scaling_factor=2.5, moe_router_fusion=False, mtp_num_layers=1),
        _layout(tp=2, pp=16, ep=64, sp=True),
    ),
    Recipe(
        "deepseek_v4_flash_mb", "DeepSeek-V4-Flash",
        # MB recipes/deepseek/h100/deepseek_v4.py::deepseek_v4_flash_pretrain_32gpu_h100_bf16_config (TP1 PP4 EP8,
        # recompute moe_act mhc, alltoall) over models/deepseek/deepseek_v4_bridge.py: sqrtsoftplus, expert bias,
        # top-6, scaling 1.5, SwiGLU clamp 10, load balancing "noaux_tc" (no such type in 0.19.2: no aux loss there)
        f"{MB}: megatron/bridge/recipes/deepseek/h100/deepseek_v4.py"
        "::deepseek_v4_flash_pretrain_32gpu_h100_bf16_config",
        dict(gated_linear_unit=True, add_bias_linear=False, moe_grouped_gemm=True, moe_router_pre_softmax=False,
             moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="noaux_tc",
             moe_shared_expert_overlap=True, moe_router_score_function="sqrtsoftplus",
             moe_router_enable_expert_bias=True, moe_router_dtype="fp32", moe_permute_fusion=True,
             moe_aux_loss_coeff=0.0, moe_router_topk=6, moe_router_topk_scaling_factor=1.5,
             activation_func_clamp_value=10.0, num_moe_experts=16, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=16, recompute_granularity="selective",
             recompute_modules=["moe_act"]),
        _layout(tp=1, pp=4, ep=8, sp=False),
        extra=dict(moe_n_hash_layers=3, moe_flex_dispatcher_num_sms=16, recompute_modules=["moe_act", "mhc"]),
        notes="hash-routed first layers (moe_n_hash_layers) and recompute module 'mhc' have no 0.19.2 value",
    ),
    Recipe(
        "kimi_k2_mb", "Kimi-K2",
        # MB recipes/kimi/h100/kimi_k2.py::kimi_k2_pretrain_512gpu_h100_bf16_config (TP2 PP16 EP32 SP, selective
        # recompute) over models/kimi/kimi_bridge.py
        f"{MB}: megatron/bridge/recipes/kimi/h100/kimi_k2.py::kimi_k2_pretrain_512gpu_h100_bf16_config",
        dict(_MB_KIMI, moe_router_fusion=False, recompute_granularity="selective"),
        _layout(tp=2, pp=16, ep=32, sp=True),
    ),
    Recipe(
        "moonlight_16b_mb_8gpu", "Moonlight-16B-A3B",
        # MB recipes/moonlight/h100/moonlight_16b.py::moonlight_16b_pretrain_8gpu_h100_bf16_config (TP2 PP1 EP8 SP)
        # over the DeepSeek-V3 bridge; HF: 64 experts top-6, 2 shared, groups 1/1, scaling 2.446
        f"{MB}: megatron/bridge/recipes/moonlight/h100/moonlight_16b.py::moonlight_16b_pretrain_8gpu_h100_bf16_config",
        dict(_MB_DSV3, num_moe_experts=16, moe_router_topk=6, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_num_groups=1, moe_router_group_topk=1,
             moe_router_topk_scaling_factor=2.446, moe_router_fusion=False),
        _layout(tp=2, pp=1, ep=8, sp=True),
    ),
    Recipe(
        "moonlight_16b_mb_16gpu_ep_overlap", "Moonlight-16B-A3B",
        # MB recipes/moonlight/h100/moonlight_16b.py::moonlight_16b_pretrain_16gpu_h100_bf16_config (TP1 PP1 EP8:
        # flex/hybridep dispatcher, router fusion, EP-comm overlap with delayed wgrad, no shared-expert overlap)
        f"{MB}: megatron/bridge/recipes/moonlight/h100/moonlight_16b.py::moonlight_16b_pretrain_16gpu_h100_bf16_config",
        dict(_MB_DSV3, num_moe_experts=16, moe_router_topk=6, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_num_groups=1, moe_router_group_topk=1,
             moe_router_topk_scaling_factor=2.446, moe_router_fusion=True, moe_token_dispatcher_type="flex",
             moe_flex_dispatcher_backend="hybridep", moe_shared_expert_overlap=False, **_A2A_OVERLAP),
        _layout(tp=1, pp=1, ep=8, sp=False),
    ),
    Recipe(
        "glm45_355b_mb", "GLM-4.5 (355B)",
        # MB recipes/glm/h100/glm45.py::glm45_355b_pretrain_128gpu_h100_bf16_config (TP2 PP8 EP16 SP) over
        # models/glm/glm45_bridge.py; HF: 160 experts top-8, one shared expert, scaling 2.5
        f"{MB}: megatron/bridge/recipes/glm/h100/glm45.py::glm45_355b_pretrain_128gpu_h100_bf16_config",
        dict(_MB_GLM45, moe_router_topk_scaling_factor=2.5, moe_router_fusion=False),
        _layout(tp=2, pp=8, ep=16, sp=True),
    ),
    Recipe(
        "glm45_air_106b_mb", "GLM-4.5-Air (106B)",
        # MB recipes/glm/h100/glm45.py::glm45_air_106b_pretrain_32gpu_h100_bf16_config (TP1 PP4 EP8 SP);
        # HF: 128 experts top-8, scaling 1.0
        f"{MB}: megatron/bridge/recipes/glm/h100/glm45.py::glm45_air_106b_pretrain_32gpu_h100_bf16_config",
        dict(_MB_GLM45, moe_router_topk_scaling_factor=1.0, moe_router_fusion=False),
        _layout(tp=1, pp=4, ep=8, sp=True),
    ),
    Recipe(
        "gpt_oss_20b_mb", "GPT-OSS-20B",
        # MB recipes/gpt_oss/h100/gpt_oss.py::gpt_oss_20b_pretrain_16gpu_h100_bf16_config (TP2 PP4 EP4 SP,
        # calculate_per_token_loss) over models/gpt_oss/gpt_oss_bridge.py (quick-GeGLU, clamp 7, offset 1, biases)
        f"{MB}: megatron/bridge/recipes/gpt_oss/h100/gpt_oss.py::gpt_oss_20b_pretrain_16gpu_h100_bf16_config",
        dict(_MB_GPT_OSS, num_moe_experts=8, moe_router_fusion=False),
        _layout(tp=2, pp=4, ep=4, sp=True),
        activation="quick_gelu",
    ),
    Recipe(
        "gpt_oss_120b_mb", "GPT-OSS-120B",
        # MB recipes/gpt_oss/h100/gpt_oss.py::gpt_oss_120b_pretrain_64gpu_h100_bf16_config (TP2 PP4 EP16 SP)
        f"{MB}: megatron/bridge/recipes/gpt_oss/h100/gpt_oss.py::gpt_oss_120b_pretrain_64gpu_h100_bf16_config",
        dict(_MB_GPT_OSS, num_moe_experts=16, moe_router_fusion=False),
        _layout(tp=2, pp=4, ep=16, sp=True),
        activation="quick_gelu",
    ),
    Recipe(
        "gpt_oss_20b_mb_fp8cs", "GPT-OSS-20B",
        # MB recipes/gpt_oss/h100/gpt_oss.py::gpt_oss_20b_pretrain_16gpu_h100_fp8cs_config (TP1 PP1 EP8, fp8
        # current scaling through bf16_with_fp8_current_scaling_mixed)
        f"{MB}: megatron/bridge/recipes/gpt_oss/h100/gpt_oss.py::gpt_oss_20b_pretrain_16gpu_h100_fp8cs_config",
        dict(_MB_GPT_OSS, num_moe_experts=8, moe_router_fusion=False, fp8="hybrid", fp8_recipe="tensorwise"),
        _layout(tp=1, pp=1, ep=8, sp=False),
        activation="quick_gelu",
    ),
    Recipe(
        "olmoe_7b_mb", "OLMoE-1B-7B",
        # MB recipes/olmoe/h100/olmoe_7b.py::olmoe_7b_pretrain_8gpu_h100_bf16_config (TP1 PP1 EP8, selective
        # recompute) over models/olmoe/olmoe_provider.py::OlMoEModelProvider (64 experts top-8, seq_aux_loss 1e-2,
        # pre-softmax)
        f"{MB}: megatron/bridge/recipes/olmoe/h100/olmoe_7b.py::olmoe_7b_pretrain_8gpu_h100_bf16_config",
        dict(gated_linear_unit=True, add_bias_linear=False, num_moe_experts=16, moe_router_topk=8,
             moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
             moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2, moe_router_pre_softmax=True,
             moe_grouped_gemm=True, moe_router_score_function="softmax", moe_permute_fusion=True,
             moe_router_dtype="fp32", moe_router_fusion=False, moe_shared_expert_overlap=False,
             recompute_granularity="selective"),
        _layout(tp=1, pp=1, ep=8, sp=False),
    ),
    Recipe(
        "nemotron_3_nano_mb", "Nemotron-3-Nano (30B-A3B)",
        # MB recipes/nemotronh/h100/nemotron_3_nano.py::nemotron_3_nano_pretrain_8gpu_h100_bf16_config (TP1 PP1 EP8;
        # squared ReLU experts, sigmoid + expert bias, groups 1/1, scaling 2.5, seq_aux_loss 1e-4, flex/hybridep,
        # TE CUDA graphs of attn and mamba, recompute moe layernorm, shared-expert overlap switched off)
        f"{MB}: megatron/bridge/recipes/nemotronh/h100/nemotron_3_nano.py"
        "::nemotron_3_nano_pretrain_8gpu_h100_bf16_config",
        dict(gated_linear_unit=False, add_bias_linear=False, num_moe_experts=16, moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=32, moe_router_topk=6, moe_router_topk_scaling_factor=2.5,
             moe_router_num_groups=1, moe_router_group_topk=1, moe_aux_loss_coeff=1e-4,
             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_router_load_balancing_type="seq_aux_loss", moe_router_dtype="fp32", moe_grouped_gemm=True,
             moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", moe_permute_fusion=True,
             moe_router_fusion=False, moe_shared_expert_overlap=False, cuda_graph_impl="transformer_engine",
             cuda_graph_scope=["attn", "mamba"], recompute_granularity="selective",
             recompute_modules=["moe", "layernorm"]),
        _layout(tp=1, pp=1, ep=8, sp=False),
        activation="squared_relu",
    ),
    Recipe(
        "qwen3_next_80b_mb", "Qwen3-Next-80B-A3B",
        # MB recipes/qwen/h100/qwen3_next.py::qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config (TP1 PP4 EP8,
        # recompute layernorm moe moe_act, no shared-expert overlap) over models/qwen/qwen3_next_bridge.py
        f"{MB}: megatron/bridge/recipes/qwen/h100/qwen3_next.py::qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config",
        dict(_MB_QWEN3_NEXT, moe_router_fusion=False, moe_shared_expert_overlap=False,
             recompute_granularity="selective", recompute_modules=["layernorm", "moe", "moe_act"]),
        _layout(tp=1, pp=4, ep=8, sp=False),
    ),
]  # fmt: skip

RECIPES_BY_NAME = {recipe.name: recipe for recipe in RECIPES}
assert len(RECIPES_BY_NAME) == len(RECIPES), "recipe names must be unique"
