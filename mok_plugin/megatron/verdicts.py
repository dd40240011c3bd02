"""Every Megatron-Core 0.19 setting the MoE layer reads, and what MoK does with it: one table.

Each TransformerConfig field that Megatron's MoE layer (router, dispatcher, experts, shared
experts, the aux-loss plumbing) reads has exactly one verdict here (mok_plugin/verdicts.py):

  honoured  MoK computes what the stock layer computes with it (tested against the stock layer:
            `tests` names the tests).
  replaced  a choice of how the stock layer computes (kernels, fusions, dispatch backends, memory
            placement) with no effect on its values: MoK's own kernels run instead, and the MoKConfig
            built with and without the setting is the same (tests/test_megatron_verdicts.py checks it).
  refused   set to anything but its default, building the layer is an error naming the flag
            (tests/test_megatron_verdicts.py sets `example` and checks the error names the flag).
  depends   honoured or replaced in some combinations and refused by name in the others, as the
            adapter's code says (config_map.py); `tests` names the tests of each side.

tests/test_megatron_verdicts.py fails when the installed Megatron has a `moe_*` field this table
does not classify, so a new Megatron field cannot be accepted and ignored unnoticed. The table is
the index; config_map.py holds the mapping and refusals themselves. TRAINING_ARGUMENTS and
FORWARD_ARGUMENTS (at the end) give the same verdicts to what the layer meets outside the config.
"""

from __future__ import annotations

from mok_plugin.verdicts import Verdict
from mok_plugin.verdicts import depends as _depends
from mok_plugin.verdicts import honoured as _honoured
from mok_plugin.verdicts import refused as _refused
from mok_plugin.verdicts import replaced as _replaced

__all__ = ["FORWARD_ARGUMENTS", "SHARED_FIELDS", "TRAINING_ARGUMENTS", "VERDICTS", "Verdict"]

_ROUTING = "tests/test_megatron_routing.py"
_OPTIONS = "tests/test_megatron_layer_options.py"
_FAMILIES = "tests/test_megatron_families.py"
_LAYER = "tests/test_megatron.py"
_GRAPHS = "tests/test_megatron_graph_stages.py"
_RECIPES = "tests/test_megatron_recipes.py"
_TP = "tests/test_megatron_tensor_parallel.py"
_OVERLAP_REFUSALS = "tests/test_megatron_ep_overlap.py::test_overlap_refuses_what_its_stages_cannot_do_by_name"


_DISPATCH = "a stock token-dispatcher choice; MoK's own exchange runs instead, with the same values"

VERDICTS: dict[str, Verdict] = {
    # --- shape and experts ------------------------------------------------------------------------
    "num_moe_experts": _honoured("E", f"{_LAYER}::test_matches_stock_layer"),
    "moe_ffn_hidden_size": _honoured("I of each routed expert", f"{_LAYER}::test_matches_stock_layer"),
    "moe_layer_freq": _honoured(
        "which layers are MoE: Megatron's own block spec places MoK's layer where it would place MoELayer",
        f"{_LAYER}::test_spec_builds_gpt_model_with_mok_layers",
    ),
    "moe_shared_expert_intermediate_size": _depends(
        "the shared expert's size; under TP a multiple of the TP size (stock's split refuses others)",
        f"{_LAYER}::test_matches_stock_layer",
        f"{_TP}::test_shared_expert_size_must_split_over_tp",
    ),
    "moe_shared_expert_gate": _honoured(
        "sigmoid(x . gate_weight) times the shared expert's output",
        f"{_OPTIONS}::test_shared_expert_gate_matches_stock",
    ),
    "moe_shared_expert_overlap": _honoured(
        "a schedule in stock; MoK runs its shared expert on a side stream, bitwise the same as without",
        f"{_OPTIONS}::test_shared_expert_overlap_is_bitwise_the_same",
    ),
    "moe_shared_expert_glu_interleave_size": _replaced(
        "read only by the TE fused shared expert (--use-grouped-gemm-for-shared-expert, refused)", example=32
    ),
    "moe_mlp_glu_interleave_size": _depends(
        "TEGroupedMLP's fc1 row blocks: reordered in checkpoints; refused where the blocks do not divide I",
        f"{_FAMILIES}::test_te_grouped_mlp_interleaved_glu_rows_load_and_round_trip",
    ),
    "moe_grouped_gemm": _replaced("TEGroupedMLP instead of SequentialMLP: the same function"),
    "moe_single_grouped_weight": _refused(
        "TE >= 2.14 stores all experts' fc1/fc2 as one grouped tensor; its checkpoint keys are not converted"
    ),
    "moe_single_grouped_bias": _refused("TE >= 2.14's single grouped bias: checkpoint keys not converted"),
    "moe_apply_probs_on_input": _refused(
        "the routing weight scales the expert's input (a different function through the activation)"
    ),
    "moe_latent_size": _refused("latent projections around the experts are not implemented", example=16),
    "moe_paged_stash": _replaced("where the stock experts keep activations for the backward (memory only)"),
    "moe_paged_stash_page_size": _replaced("paged stash memory layout", example=128),
    "moe_paged_stash_buffer_size_factor_cuda": _replaced("paged stash memory layout", example=1.5),
    "moe_paged_stash_buffer_size_factor_cpu": _replaced("paged stash memory layout", example=0.5),
    # --- routing ----------------------------------------------------------------------------------
    "moe_router_topk": _honoured("K", f"{_LAYER}::test_matches_stock_layer"),
    "moe_router_score_function": _honoured(
        "softmax, sigmoid, sqrtsoftplus", f"{_ROUTING}::test_score_functions_match_stock"
    ),
    "moe_router_pre_softmax": _honoured("softmax before top-k", f"{_LAYER}::test_matches_stock_layer"),
    "moe_router_topk_scaling_factor": _honoured("scales the routing weights", f"{_LAYER}::test_matches_stock_layer"),
    "moe_router_num_groups": _depends(
        "group-limited routing; refused with post-top-k softmax (Megatron ranks groups by logits there)",
        f"{_LAYER}::test_matches_stock_layer",
    ),
    "moe_router_group_topk": _honoured(
        "groups per token (with moe_router_num_groups)", f"{_LAYER}::test_matches_stock_layer"
    ),
    "moe_router_enable_expert_bias": _honoured(
        "selection-only bias, updated by finalize_model_grads", f"{_LAYER}::test_matches_stock_layer"
    ),
    "moe_router_bias_update_rate": _honoured(
        "the expert-bias step (Megatron's finalize_model_grads applies it)",
        f"{_ROUTING}::test_finalize_updates_the_expert_bias_as_stock",
    ),
    "moe_router_dtype": _replaced(
        "stock routes in this dtype; MoK always routes in fp64 rounded to fp32 (batch-invariant)", example="fp64"
    ),
    "moe_router_fusion": _replaced("TE's fused top-k: the same routing"),
    "moe_router_load_balancing_type": _depends(
        "aux_loss, seq_aux_loss, global_aux_loss, none, noaux_tc (no loss, as 0.19's router) and lists of these "
        "honoured; sinkhorn, quantile_balancing refused",
        f"{_ROUTING}::test_balancing_losses_match_stock",
    ),
    "moe_aux_loss_coeff": _honoured(
        "each load-balancing loss's coefficient", f"{_ROUTING}::test_balancing_losses_match_stock"
    ),
    "moe_z_loss_coeff": _honoured("the router z-loss", f"{_LAYER}::test_matches_stock_layer"),
    "moe_router_quantile_balancing_ema": _replaced(
        "read only by the quantile_balancing load-balancing type, which is refused", example=0.5
    ),
    "moe_router_force_load_balancing": _honoured(
        "random N(0, 1) logits with a straight-through gradient, drawn from MoK's counter-based stream (the "
        "distribution, not the CUDA RNG's values; its step a device counter CUDA graphs advance, and a reentrant "
        "recomputation (--recompute-granularity full) draws at its first pass's step)",
        f"{_ROUTING}::test_force_load_balancing",
        f"{_ROUTING}::test_force_load_balancing_under_full_recompute_draws_as_the_forward",
    ),
    "moe_router_force_biased": _refused("a random logit bias from the CUDA RNG tracker (benchmark only)", example=0.1),
    "moe_router_topk_limited_devices": _refused(
        "deprecated in Megatron for moe_router_num_groups / moe_router_group_topk", example=2
    ),
    "moe_input_jitter_eps": _refused("multiplicative input noise from the CUDA RNG (not reproducible)", example=0.01),
    "moe_enable_routing_replay": _refused("routing replay (recorded expert choices) is not implemented"),
    "moe_router_padding_for_quantization": _replaced(
        "zero-weight rows padding each expert to the fp8/fp4 GEMM alignment: no effect on the values"
    ),
    "moe_router_padding_for_fp8": _replaced("the alias of moe_router_padding_for_quantization"),
    "moe_per_layer_logging": _honoured(
        "per-layer aux/z-loss logging: MoK logs through the same tracker",
        f"{_ROUTING}::test_losses_are_logged_as_stock",
    ),
    "moe_grad_scale_func": _honoured(
        "the schedule's aux-loss gradient scale: MoK attaches its losses through MoEAuxLossAutoScaler, which it sets",
        f"{_ROUTING}::test_balancing_losses_match_stock",
    ),
    # --- capacity and dropping ----------------------------------------------------------------------
    "moe_expert_capacity_factor": _depends(
        "token dropping per expert; refused with expert parallelism (MoK counts the global batch)",
        f"{_LAYER}::test_capacity_matches_stock",
    ),
    "moe_token_drop_policy": _depends(
        "position honoured as documented (each expert keeps its first tokens); probs refused",
        f"{_LAYER}::test_capacity_matches_stock",
    ),
    "moe_pad_expert_input_to_capacity": _refused("capacity padding of the expert input is not implemented"),
    "moe_token_dropping": _replaced("unused by Megatron 0.19 ('should remain False')"),
    "moe_expert_rank_capacity_factor": _refused(
        "a per-rank token budget of the hybridep/ncclep dispatchers (drops or traps): not implemented", example=1.5
    ),
    "moe_pad_experts_for_cuda_graph_inference": _refused("inference-time padding for CUDA graphs is not implemented"),
    # --- dispatch backends -------------------------------------------------------------------------------
    "moe_token_dispatcher_type": _replaced(_DISPATCH, example="alltoall"),
    "moe_enable_deepep": _replaced(_DISPATCH),
    "moe_flex_dispatcher_backend": _replaced(_DISPATCH, example="hybridep"),
    "moe_permute_fusion": _replaced("TE's fused permutation: the same rows"),
    "moe_permute_fusion_into_hybridep": _replaced(_DISPATCH),
    "moe_hybridep_pad_uneven_dispatch_inputs": _replaced(_DISPATCH),
    "moe_flex_dispatcher_num_sms": _replaced(_DISPATCH, example=16),
    "moe_deepep_num_sms": _replaced(_DISPATCH, example=16),
    "moe_hybridep_num_sms": _replaced(_DISPATCH, example=16),
    "moe_hybridep_num_blocks_permute": _replaced(_DISPATCH, example=4),
    "moe_hybridep_num_blocks_unpermute": _replaced(_DISPATCH, example=4),
    "moe_hybridep_num_sms_preprocessing": _replaced(_DISPATCH, example=16),
    "moe_ncclep_static_shape": _replaced(_DISPATCH),
    "moe_ncclep_zero_copy": _depends(
        _DISPATCH + "; refused with the EP overlap (its schedule hands the dispatcher's buffers to its backward)",
        _OVERLAP_REFUSALS,
    ),
    # --- memory, recompute -------------------------------------------------------------------------
    "moe_layer_recompute": _honoured(
        "the whole layer recomputed in the backward (as --recompute-modules moe)",
        f"{_OPTIONS}::test_moe_recompute_gives_the_same_gradients",
    ),
}

# The fields outside the moe_* prefix that the MoE layer reads: the test requires a verdict for each.
SHARED_VERDICTS: dict[str, Verdict] = {
    "hidden_size": _honoured("H", f"{_LAYER}::test_matches_stock_layer"),
    "ffn_hidden_size": _honoured("I when moe_ffn_hidden_size is unset", f"{_LAYER}::test_matches_stock_layer"),
    "params_dtype": _depends("fp32, bf16, fp16 honoured; others refused", f"{_LAYER}::test_matches_stock_layer"),
    "init_method_std": _honoured("the init of MoK's parameters", f"{_LAYER}::test_init_std_follows_megatron"),
    "use_cpu_initialization": _honoured("parameters built on the CPU", f"{_LAYER}::test_matches_stock_layer"),
    "gated_linear_unit": _honoured("glu or mlp experts", f"{_FAMILIES}::test_family_matches_stock_layer"),
    "activation_func": _depends(
        "silu, gelu, relu, quick-gelu, squared relu, tanh gelu; others refused",
        f"{_FAMILIES}::test_family_matches_stock_layer",
    ),
    "add_bias_linear": _honoured("fc1, fc2 and router biases", f"{_FAMILIES}::test_family_matches_stock_layer"),
    "activation_func_clamp_value": _honoured("GPT-OSS's clamp", f"{_FAMILIES}::test_family_matches_stock_layer"),
    "glu_linear_offset": _honoured("GPT-OSS's linear offset", f"{_FAMILIES}::test_family_matches_stock_layer"),
    "bias_activation_fusion": _depends(
        "replaced where the fused path is the same function, refused where not",
        f"{_FAMILIES}::test_fusions_with_the_same_function_are_accepted",
    ),
    "use_te_activation_func": _depends(
        "replaced for plain SwiGLU, refused otherwise", f"{_FAMILIES}::test_fusions_with_the_same_function_are_accepted"
    ),
    "use_transformer_engine_op_fuser": _depends(
        "replaced where TE's fused MLP is the same function",
        f"{_FAMILIES}::test_fusions_with_the_same_function_are_accepted",
    ),
    "activation_func_fp8_input_store": _depends(
        "refused with the fused SwiGLU (fp8 input kept for the backward)",
        f"{_FAMILIES}::test_fusions_with_the_same_function_are_accepted",
    ),
    "use_fused_weighted_squared_relu": _replaced("TEGroupedMLP's fused relu(h)^2 * probs: the same function"),
    "use_grouped_gemm_for_shared_expert": _depends(
        "refused with a shared expert (TE's fused shared expert)",
        f"{_FAMILIES}::test_fusions_with_the_same_function_are_accepted",
    ),
    "gradient_accumulation_fusion": _honoured(
        "weight gradients added into main_grad in fp32",
        f"{_LAYER}::test_expert_params_are_marked_and_main_grad_accumulates",
    ),
    "calculate_per_token_loss": _honoured(
        "aux and z-loss scaling", f"{_ROUTING}::test_per_token_loss_scaling_matches_stock"
    ),
    "recompute_granularity": _depends(
        "selective: see recompute_modules; full: Megatron recomputes around the layer",
        f"{_OPTIONS}::test_moe_recompute_gives_the_same_gradients",
    ),
    "recompute_modules": _depends(
        "moe (the layer), moe_act (MoK's default: A is always recomputed), shared_experts; the others are "
        "outside the MoE layer; with the partial MoE CUDA graphs, moe under local graphs and layernorm under TE's "
        "moe_preprocess with the alltoall dispatcher refused",
        f"{_OPTIONS}::test_moe_recompute_gives_the_same_gradients",
        f"{_GRAPHS}::test_what_the_partial_graphs_cannot_take_is_refused_by_name",
    ),
    "cuda_graph_impl": _depends(
        "local / transformer_engine / full_iteration: the whole layer captured, or its start under the partial "
        "scopes (cuda_graph_modules); settings that read the host inside the captured part refused by name",
        f"{_OPTIONS}::test_cuda_graph_settings_refused_by_name",
        f"{_OPTIONS}::test_cuda_graph_settings_accepted",
    ),
    "cuda_graph_modules": _depends(
        "moe_router / moe_preprocess: MoK's routing and its shared experts (not overlapped) in the graph, the "
        "rest resumed eagerly from the graph's outputs, bitwise the layer called whole (graph_stages.py); with "
        "debug checks, local graphs' moe recompute, MoE offloading, or layernorm recompute under TE's moe_preprocess "
        "and the alltoall dispatcher refused",
        f"{_GRAPHS}::test_te_partial_graph_protocol_is_bitwise_the_whole_layer",
        f"{_GRAPHS}::test_local_partial_graph_stages_are_bitwise_the_whole_layer",
        f"{_GRAPHS}::test_what_the_partial_graphs_cannot_take_is_refused_by_name",
    ),
    "inference_cuda_graph_scope": _depends(
        "layer / block (local graphs) capture the whole MoE layer in inference: honoured; a capture of "
        "settings that read the host raises naming them (not refused at build time: training never uses it)",
        "tests/test_layer.py::test_capture_of_a_forward_that_reads_the_host_is_named",
    ),
    "fp8": _depends(
        "e4m3 / hybrid with --fp8-recipe blockwise, tensorwise or mxfp8: MoK's FP8 experts (mok.fp8), routed and "
        "shared, tested against MoK's FP8 oracle and the stock bf16 layer (Transformer Engine, which the stock FP8 "
        "layer needs, is not installed here); with --fp8-param-gather, NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 "
        "(blockwise) or NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1 (tensorwise) refused",
        "tests/test_megatron_fp8.py::test_blockwise_flags_select_moks_fp8_experts",
        "tests/test_megatron_fp8.py::test_tensorwise_and_mxfp8_flags_select_their_recipe",
        "tests/test_megatron_fp8.py::test_what_fp8_does_not_cover_is_refused_by_flag",
    ),
    "fp8_recipe": _depends(
        "with fp8: blockwise (the Triton kernels), tensorwise (Transformer Engine's Float8CurrentScaling: per-expert "
        "current scales) and mxfp8 (MXFP8BlockScaling: E8M0 scales per 32 values) honoured as mok.fp8_scaling, the "
        "last two through MoK's PyTorch FP8 path (the recipe's numbers, not fused kernels; it reads the host, so a "
        "whole-layer CUDA graph is refused with them); delayed (amax history) and custom (a user's quantiser "
        "factory) refused by name",
        "tests/test_megatron_fp8.py::test_tensorwise_and_mxfp8_flags_select_their_recipe",
        "tests/test_megatron_fp8.py::test_what_fp8_does_not_cover_is_refused_by_flag",
        "tests/test_megatron_fp8.py::test_a_captured_layer_with_the_pytorch_fp8_path_is_refused",
        "tests/test_fp8_recipes.py::test_layer_with_each_recipe_is_within_fp8s_margin_and_repeats_bitwise",
    ),
    "fp8_param": _refused(
        "MoK keeps the expert weights in the parameters' dtype and makes their FP8 copies once per step",
        example=True,
    ),
    "first_last_layers_bf16": _honoured(
        "the first / last layers (--num-layers-at-start-in-bf16, --num-layers-at-end-in-bf16) run MoK's experts "
        "unquantised, where get_fp8_context gives no FP8 context",
        "tests/test_megatron_fp8.py::test_first_and_last_layers_stay_in_bf16",
    ),
    "num_layers_at_start_in_bf16": _honoured(
        "read with first_last_layers_bf16 (Megatron's is_first_last_bf16_layer)",
        "tests/test_megatron_fp8.py::test_first_and_last_layers_stay_in_bf16",
    ),
    "num_layers_at_end_in_bf16": _honoured(
        "read with first_last_layers_bf16 (Megatron's is_first_last_bf16_layer)",
        "tests/test_megatron_fp8.py::test_first_and_last_layers_stay_in_bf16",
    ),
    "fp4": _refused("MoK's kernels are bf16/fp16/fp32", example="e2m1"),
    "overlap_moe_expert_parallel_comm": _honoured(
        "the schedule drives MoKMoELayer's stage methods: bitwise the plain layer (MoE activation offload "
        "refused with it)",
        "tests/test_megatron_ep_overlap.py::test_overlap_schedule_plan_is_bitwise_the_plain_layer",
    ),
    "delay_wgrad_compute": _honoured(
        "the routed experts' weight gradients wait for the schedule's backward_dw (wgrad.py), their DDP hooks "
        "with them: bitwise the undelayed backward (the megakernel computes them in its one pass)",
        "tests/test_megatron_ep_overlap.py::test_overlap_schedule_plan_is_bitwise_the_plain_layer",
    ),
    "tensor_model_parallel_size": _honoured(
        "each rank routes its sequence shard; replicated parameters marked sequence-parallel (grads summed over TP)",
        f"{_TP}::test_tensor_parallel_with_sequence_parallel_matches_stock",
    ),
    "expert_tensor_parallel_size": _refused(
        "MoK keeps each expert whole on one rank; the TP > 1 recipes pass --expert-tensor-parallel-size 1",
        example=2,
    ),
    "expert_model_parallel_size": _honoured(
        "MoK's EP size over Megatron's EP group", f"{_LAYER}::test_expert_parallel_two_processes_matches_one"
    ),
    "context_parallel_size": _honoured(
        "aux-loss statistics reduced over TP x CP", f"{_ROUTING}::test_context_parallel_reduces_aux_statistics"
    ),
    "pipeline_model_parallel_size": _honoured(
        "each stage builds its own layers (global layer numbers, the loss tracker's slots)",
        "tests/test_megatron_pipeline.py::test_pipeline_parallel_matches_stock",
    ),
    "sequence_parallel": _depends(
        "the layer takes the sequence shard; training at TP > 1 without it raises stock's error",
        f"{_TP}::test_training_without_sequence_parallelism_raises_stocks_error",
    ),
    "num_layers": _honoured("the aux-loss tracker's layer count", f"{_ROUTING}::test_losses_are_logged_as_stock"),
    "mtp_num_layers": _honoured(
        "MTP layers in the aux-loss tracker's layer count", f"{_ROUTING}::test_losses_are_logged_as_stock"
    ),
    "mtp_use_repeated_layer": _depends("the aux loss of a repeated MTP layer", f"{_ROUTING}::test_repeated_mtp_layer"),
    "init_method": _depends(
        "MoK draws N(0, init_method_std) (Megatron's default init_method_normal); another init_method is refused",
        f"{_LAYER}::test_init_std_follows_megatron",
    ),
    "output_layer_init_method": _depends(
        "fc2 drawn with N(0, init_method_std / sqrt(2 num_layers)) (Megatron's default); another is refused",
        f"{_LAYER}::test_init_std_follows_megatron",
    ),
    "perform_initialization": _honoured(
        "MoK initialises its parameters (it has no lazy init)", f"{_LAYER}::test_init_std_follows_megatron"
    ),
    "bias_dropout_fusion": _replaced(
        "the transformer layer's bias-dropout-add after the MLP: the MoE layer returns no bias"
    ),
    "fp4_recipe": _replaced("read only with fp4, which is refused", example="custom"),
    "transformer_impl": _depends(
        "transformer_engine and local honoured; inference_optimized refused",
        "tests/test_megatron_verdicts.py::test_inference_optimized_layer_is_refused",
    ),
    "inference_moe_token_dispatcher_type": _replaced(
        "read only with transformer_impl inference_optimized (refused)", example="nccl"
    ),
    "inference_grouped_gemm_backend": _replaced(
        "read only with transformer_impl inference_optimized (refused)", example="torch"
    ),
    "inference_moe_disable_fused_quant_kernels": _replaced(
        "read only with transformer_impl inference_optimized (refused)"
    ),
    "fine_grained_activation_offloading": _depends(
        "with offload_modules naming an MoE module (expert_fc1, moe_act, fused_group_mlp): what MoK's layer saves "
        "for the backward waits in host memory (torch's save_on_cpu); refused with the EP overlap and with the "
        "partial MoE CUDA graphs",
        f"{_OPTIONS}::test_moe_activation_offloading_keeps_saved_tensors_in_host_memory",
        _OVERLAP_REFUSALS,
        f"{_GRAPHS}::test_what_the_partial_graphs_cannot_take_is_refused_by_name",
    ),
    "offload_modules": _depends(
        "expert_fc1, moe_act, fused_group_mlp: see fine_grained_activation_offloading; others are outside the layer",
        f"{_OPTIONS}::test_moe_activation_offloading_keeps_saved_tensors_in_host_memory",
        _OVERLAP_REFUSALS,
        f"{_GRAPHS}::test_what_the_partial_graphs_cannot_take_is_refused_by_name",
    ),
    "delay_offload_until_cuda_graph": _replaced("when the stock experts' offloading starts (a schedule choice)"),
    "overlap_dispatch_backward_with_experts_wgrad": _refused(
        "it overlaps the stock dispatcher's backward with TE's deferred expert weight gradients (without the "
        "EP-overlap schedule); MoK's exchange replaces that dispatcher"
    ),
}

SHARED_FIELDS = tuple(SHARED_VERDICTS)
VERDICTS.update(SHARED_VERDICTS)


# What the MoE layer meets outside TransformerConfig, with the same verdict kinds: megatron.training's
# arguments that act on the layer without a config field (by their argparse name), and the arguments
# of MoELayer.forward. tests/test_megatron_verdicts.py checks that each name exists in the installed
# Megatron and that the tests named do.
TRAINING_ARGUMENTS: dict[str, Verdict] = {
    "moe_use_upcycling": _honoured(
        "the dense model Megatron builds first gets the stock spec; upcycling_utils fills MoK's experts under "
        "SequentialMLP's keys (spec.py)",
        f"{_LAYER}::test_upcycling_fills_mok_experts_as_stock",
        f"{_LAYER}::test_moe_block_spec_builds_the_dense_model_of_upcycling",
    ),
    "moe_upcycling_granularity": _honoured(
        "each dense MLP split into that many experts, as upcycling_utils splits it",
        f"{_LAYER}::test_upcycling_fills_mok_experts_as_stock",
    ),
}

FORWARD_ARGUMENTS: dict[str, Verdict] = {
    "padding_mask": _depends(
        "[B, S], True for padding as TopKRouter's code reads it: the tokens run through the experts and stay out of "
        "every router loss and the expert-bias counts (the layer's forward, the partial graphs' route stage); "
        "refused by MoKMoELayer.route, the EP-overlap stage, whose routing ran before it (Megatron passes none)",
        f"{_ROUTING}::test_padding_mask_matches_stock",
        f"{_ROUTING}::test_padding_mask_leaves_padding_out_of_the_expert_bias_counts",
        f"{_ROUTING}::test_gpt_model_hands_its_padding_mask_to_mok",
        f"{_OPTIONS}::test_moe_recompute_with_a_padding_mask_gives_the_same_gradients",
        f"{_ROUTING}::test_the_ep_overlap_route_refuses_a_padding_mask",
    ),
}
