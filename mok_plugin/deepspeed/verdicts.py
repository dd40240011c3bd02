"""Every argument of DeepSpeed 0.19's MoE layer (`deepspeed.moe.layer.MoE.__init__` and `forward`),
and what mok_plugin.deepspeed.MoE does with it: one table of verdicts (mok_plugin/verdicts.py).

tests/test_deepspeed_verdicts.py fails when the installed DeepSpeed's MoE takes an argument this
table does not classify, checks that every refused argument is an error naming it, and that every
honoured one names tests that exist. The table is the index; layer.py and gating.py do the work.
"""

from __future__ import annotations

from mok_plugin.verdicts import Verdict, depends, honoured, refused

__all__ = ["CONFIG_VERDICTS", "VERDICTS"]

_LAYER = "tests/test_deepspeed.py"
_GATING = "tests/test_deepspeed_gating.py"
_MODELS = "tests/test_deepspeed_models.py"
_STRUCTURE = "tests/test_deepspeed_structure.py"
_EXPERTS = "tests/test_deepspeed_experts.py"
_CONFIG = "tests/test_deepspeed_config.py"

VERDICTS: dict[str, Verdict] = {
    "hidden_size": honoured("H", f"{_LAYER}::test_matches_stock_layer"),
    "expert": honoured(
        "recognised modules run fused, any other as itself (generic path)",
        f"{_EXPERTS}::test_expert_matches_the_stock_layer",
    ),
    "num_experts": honoured("E", f"{_LAYER}::test_matches_stock_layer"),
    "ep_size": honoured(
        "DeepSpeed's expert-parallel group; every EP size gives the same bits",
        f"{_LAYER}::test_engine_zero_stages_and_expert_parallel",
        f"{_GATING}::test_random_gating_with_dropping_is_the_same_on_every_ep_size",
    ),
    "k": honoured(
        "top-1, top-2 and top-k gates as DeepSpeed's", f"{_GATING}::test_gates_match_deepspeed_without_randomness"
    ),
    "capacity_factor": honoured(
        "per rank's tokens, as _capacity", f"{_GATING}::test_gates_match_deepspeed_without_randomness"
    ),
    "eval_capacity_factor": honoured(
        "the factor in eval mode", f"{_GATING}::test_topk_gate_train_eval_factors_and_jitter"
    ),
    "min_capacity": honoured("the capacity's floor", f"{_GATING}::test_capacity_matches_deepspeed"),
    "use_residual": honoured(
        "PR-MoE: the dense MLP and the learned two-way coefficient",
        f"{_STRUCTURE}::test_residual_moe_matches_the_stock_layer",
    ),
    "noisy_gate_policy": depends(
        "None, RSample, Jitter honoured (drawn from the counter-based stream; a reentrant activation recomputation "
        "draws at its first pass's step); any other value refused",
        f"{_GATING}::test_top1_rsample_and_rts",
        f"{_GATING}::test_reentrant_recomputation_draws_as_the_first_pass",
        f"{_GATING}::test_topk_gate_train_eval_factors_and_jitter",
        f"{_LAYER}::test_random_and_unsupported_options_are_errors",
    ),
    "drop_tokens": honoured(
        "DeepSpeed's dropping (or dropless)", f"{_GATING}::test_gates_match_deepspeed_without_randomness"
    ),
    "use_rts": honoured(
        "random token selection from the counter-based stream", f"{_GATING}::test_top1_used_token_and_rts"
    ),
    "use_tutel": honoured(
        "Tutel's kernels for the same dispatch: the same function",
        f"{_STRUCTURE}::test_use_tutel_is_accepted_and_changes_nothing",
    ),
    "enable_expert_tensor_parallelism": refused("expert tensor parallelism is not implemented"),
    "top2_2nd_expert_sampling": honoured(
        "Gumbel sampling of the 2nd expert from the counter-based stream",
        f"{_GATING}::test_top2_second_expert_sampling",
    ),
    # forward's
    "used_token": honoured(
        "the top-1 gate's token mask (ignored for k >= 2, as DeepSpeed)", f"{_GATING}::test_layer_used_token_top1"
    ),
}

# The ds_config's own settings, beside the "mok" block, that touch the MoE layer (read when the block
# is read: config.read_mok_settings). `example` is a block value MoK refuses while "mok" is enabled.
CONFIG_VERDICTS: dict[str, Verdict] = {
    "expert_parallel": refused(
        "AutoEP swaps a Hugging Face model's MoE blocks for its own layers, which MoK does not replace",
        example={"enabled": True},
    ),
    "compile": depends(
        "engine.compile() compiles MoK with the model (the same losses); DeepCompile (deepcompile: true) refused",
        f"{_LAYER}::test_engine_compile_trains_as_the_uncompiled_engine",
        f"{_CONFIG}::test_refused_settings_beside_the_block_name_themselves",
    ),
}
