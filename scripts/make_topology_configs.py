"""Write configs/topologies/*.yaml: the run configs users start from (then validated by
mok_plugin.run.topology.load_topology; tests load every file).

    python scripts/make_topology_configs.py            # rewrites configs/topologies/

For each model and machine the pipeline size is the smallest of 1, 2, 4, 8, 16 whose memory
estimate fits (mok_plugin.run.planner); dp = ep, so one EP group spans the data-parallel ranks of a
pipeline stage and sits in one NVLink domain. Where ep does not divide the experts, redundant
experts fill the slots (as DeepSeek's and TensorRT-LLM's deployments do).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mok_plugin.config import MoKConfigError
from mok_plugin.run.sections import MACHINES
from mok_plugin.run.topology import RunConfig

OUT = Path(__file__).resolve().parents[1] / "configs" / "topologies"

# Where each model's numbers come from: its config.json on Hugging Face (layers, hidden size, expert
# size, experts, top-k, shared experts, score function, top-k normalisation, groups, scaling, aux
# coefficient) and the model's card or technical report.
_HF = "https://huggingface.co/"
SOURCES = {
    "deepseek-v3": f"{_HF}deepseek-ai/DeepSeek-V3 (config.json); DeepSeek-V3 Technical Report, arXiv:2412.19437",
    "kimi-k2": f"{_HF}moonshotai/Kimi-K2-Instruct (config.json, model card); Kimi K2 technical report, "
    "arXiv:2507.20534",
    "qwen3-235b-a22b": f"{_HF}Qwen/Qwen3-235B-A22B (config.json, model card); Qwen3 Technical Report, arXiv:2505.09388",
    "glm-4.5": f"{_HF}zai-org/GLM-4.5 (config.json, model card); GLM-4.5 technical report, arXiv:2508.06471",
    "gpt-oss-120b": f"{_HF}openai/gpt-oss-120b (config.json); gpt-oss-120b & gpt-oss-20b model card, arXiv:2508.10925"
    "; MLP: https://github.com/openai/gpt-oss/blob/main/gpt_oss/torch/model.py (swiglu, swiglu_limit 7.0)",
    "qwen3-30b-a3b": f"{_HF}Qwen/Qwen3-30B-A3B (config.json, model card); Qwen3 Technical Report, arXiv:2505.09388",
    "qwen3-30b-a3b-4-layers": f"{_HF}Qwen/Qwen3-30B-A3B (config.json), four of its 48 layers",
    "megatron-deepspeed-gpt-moe": "Megatron-DeepSpeed's GPT-MoE (https://github.com/deepspeedai/Megatron-DeepSpeed, "
    "examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_MoE128.sh: hidden 2048, FFN 4 x 2048, GeLU MLP with biases, MoE "
    "every other layer, top-1, capacity factor 1.0 train and eval, min capacity 4, token dropping; "
    "megatron/model/transformer.py leaves use_rts at DeepSpeed's default, True); 8 layers (4 MoE) and 16 experts "
    "so that one H200 trains it whole",
}

# dense_params_b: attention, embeddings and dense FFN layers, from the shapes in each config.json
# (routed and shared experts excluded; MTP layers excluded).
MODELS = {
    "deepseek-v3": dict(num_layers=61, moe_layers=58, hidden_size=7168, ffn_hidden_size=2048, num_experts=256,
                        top_k=8, shared_ffn_hidden_size=2048, dense_params_b=14.4),
    "kimi-k2": dict(num_layers=61, moe_layers=60, hidden_size=7168, ffn_hidden_size=2048, num_experts=384, top_k=8,
                    shared_ffn_hidden_size=2048, dense_params_b=9.0),
    "qwen3-235b-a22b": dict(num_layers=94, moe_layers=94, hidden_size=4096, ffn_hidden_size=1536, num_experts=128,
                            top_k=8, dense_params_b=7.9),
    "glm-4.5": dict(num_layers=92, moe_layers=89, hidden_size=5120, ffn_hidden_size=1536, num_experts=160, top_k=8,
                    shared_ffn_hidden_size=1536, dense_params_b=14.6),
    "gpt-oss-120b": dict(num_layers=36, moe_layers=36, hidden_size=2880, ffn_hidden_size=2880, num_experts=128,
                         top_k=4, dense_params_b=2.1, expert_kind="glu", expert_activation="quick_gelu",
                         activation_clamp=7.0, glu_linear_offset=1.0, expert_fc1_bias=True, expert_fc2_bias=True),
    "qwen3-30b-a3b": dict(num_layers=48, moe_layers=48, hidden_size=2048, ffn_hidden_size=768, num_experts=128,
                          top_k=8, dense_params_b=1.2),
    # Four of Qwen3-30B-A3B's layers (its embeddings included): what one H200 trains whole.
    "qwen3-30b-a3b-4-layers": dict(num_layers=4, moe_layers=4, hidden_size=2048, ffn_hidden_size=768,
                                   num_experts=128, top_k=8, dense_params_b=0.7),
    # Megatron-DeepSpeed's 1.3B GPT-MoE layer shape, 8 layers with MoE on every other (4 MoE layers,
    # as many as the qwen3 4-layer config) and 16 experts: 2.1B expert parameters (qwen3's 2.4B).
    # dense: 8 x attention 4H^2, 4 dense MLPs 8H^2, embeddings 50,257 x H.
    "megatron-deepspeed-gpt-moe": dict(num_layers=8, moe_layers=4, hidden_size=2048, ffn_hidden_size=8192,
                                       num_experts=16, top_k=1, dense_params_b=0.44, expert_kind="mlp",
                                       expert_activation="gelu", expert_fc1_bias=True, expert_fc2_bias=True),
}  # fmt: skip
NOTES = {
    "gpt-oss-120b": "experts: GPT-OSS's gated quick-GeLU x*sigmoid(1.702x), clamped at 7.0 (swiglu_limit), linear "
    "offset 1.0, biases on both linears",
    "deepseek-v3": "routing: sigmoid, expert bias, 8 groups / 4, scaling 2.5 (mok knobs below)",
}
ROUTING = {
    "deepseek-v3": dict(score_function="sigmoid", norm_topk_prob=True, expert_bias=True, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5),
    "kimi-k2": dict(score_function="sigmoid", norm_topk_prob=True, expert_bias=True, routed_scaling_factor=2.827),
    "glm-4.5": dict(score_function="sigmoid", norm_topk_prob=True, expert_bias=True, routed_scaling_factor=2.5),
    "qwen3-235b-a22b": dict(norm_topk_prob=True, aux_loss_coeff=0.001),
    "qwen3-30b-a3b": dict(norm_topk_prob=True, aux_loss_coeff=0.001),
    "qwen3-30b-a3b-4-layers": dict(norm_topk_prob=True, aux_loss_coeff=0.001),
    "gpt-oss-120b": dict(norm_topk_prob=True, aux_loss_coeff=0.001),
}  # fmt: skip


def _run(name: str, machine: str, ep: int, pp: int, dp: int, transport: str, seq: int = 4096) -> RunConfig | None:
    model = dict(name=name, source=SOURCES[name], **MODELS[name])
    redundant = (-model["num_experts"]) % ep
    parallel = dict(tp=1, pp=pp, ep=ep, expert_tp=1, dp=dp, seq_length=seq, micro_batch=1,
                    redundant_experts=redundant)  # fmt: skip
    mok = dict(ep_exchange="capacity", ep_capacity_factor=2.0, ep_transport=transport, **ROUTING[name])
    try:
        return RunConfig(machine=machine, model=model, parallel=parallel, mok=mok)
    except (ValueError, MoKConfigError) as error:
        if "does not fit" in str(error):
            return None
        raise


def smallest_fitting(name: str, machine: str, ep: int, dp: int, transport: str, seq: int = 4096) -> RunConfig:
    """The fitting layout with the fewest GPUs (ties: the smaller pipeline), dp a multiple of ep up to 8 ep."""
    candidates = [(pp * dp * scale, pp, dp * scale) for scale in (1, 2, 4, 8) for pp in (1, 2, 4, 8, 16)]
    for _, pp, data_parallel in sorted(candidates):
        run = _run(name, machine, ep, pp, data_parallel, transport, seq)
        if run is not None:
            return run
    raise SystemExit(f"{name} on {machine} at EP {ep}: no layout up to PP 16, DP {8 * dp} fits")


def _command(run: RunConfig, stem: str) -> str:
    """The exact command that runs this config."""
    path = f"configs/topologies/{stem}.yaml"
    if run.machine == "cpu":
        return f"python scripts/compare.py --config {path}   (what bash scripts/main.sh runs)"
    if run.parallel.world_size == 1:
        return f"python scripts/compare.py --config {path}   (on one GPU; scripts/plan.py {path} prints its plan)"
    return f"python scripts/plan.py {path}   (its per-GPU memory and MoE-layer time plan)"


def write(run: RunConfig, stem: str, description: str) -> None:
    # The deepspeed section only where a config has one (no `deepspeed: null` in the others).
    exclude = {"description"} | ({"deepspeed"} if run.deepspeed is None else set())
    data = {"description": description, **run.model_dump(mode="json", exclude=exclude)}
    machine = MACHINES[run.machine]
    lines = [
        f"# {description}",
        f"# Run: {_command(run, stem)}",
        f"# Model: {run.model.source}",
        f"# Machine ({run.machine}): {machine.source}",
        "# Written by scripts/make_topology_configs.py; validated by mok_plugin.run.topology.load_topology.",
    ]
    text = "\n".join(_wrap(line) for line in lines) + "\n"
    (OUT / f"{stem}.yaml").write_text(text + yaml.safe_dump(data, sort_keys=False))


def _wrap(comment: str, width: int = 118) -> str:
    """A long comment line as several `#` lines of at most `width` characters (words kept whole)."""
    import textwrap

    return "\n".join(textwrap.wrap(comment, width=width, subsequent_indent="#   ", break_long_words=False,
                                    break_on_hyphens=False))  # fmt: skip


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.yaml"):
        old.unlink()
    for name in ("deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "glm-4.5", "gpt-oss-120b"):
        for rack in ("gb300-nvl72", "gb200-nvl72"):
            for ep in (8, 16, 32, 64, 72):
                run = smallest_fitting(name, rack, ep, dp=ep, transport="symmetric_memory")
                p = run.parallel
                note = f"; {NOTES[name]}" if name in NOTES else ""
                slots = f", {p.redundant_experts} redundant experts" if p.redundant_experts else ""
                layout = f"EP {ep}{slots}, PP {p.pp}, DP {p.dp} ({p.world_size} GPUs)"
                write(run, f"{name}_{rack}_ep{ep}", f"{name} on {rack}: {layout}{note}")
    for name, machine in (("qwen3-30b-a3b", "hgx-h200"), ("qwen3-30b-a3b", "hgx-h100")):
        run = smallest_fitting(name, machine, 8, dp=8, transport="symmetric_memory")
        write(run, f"{name}_{machine}_ep8", f"{name} on one 8-GPU {machine} node: EP 8, PP {run.parallel.pp}, DP 8")
    single = _run("qwen3-30b-a3b-4-layers", "h200-measured", ep=1, pp=1, dp=1, transport="nccl", seq=2048)
    write(single, "qwen3-30b-a3b-4-layers_h200_single",
          "Four Qwen3-30B-A3B layers on one H200 (this project's device), sequence 2048")  # fmt: skip
    gpt_moe = "megatron-deepspeed-gpt-moe"
    gpt = RunConfig(
        machine="h200-measured", model=dict(name=gpt_moe, source=SOURCES[gpt_moe], **MODELS[gpt_moe]),
        parallel=dict(seq_length=2048, micro_batch=1),
        # top-1 (no normalisation), Megatron-DeepSpeed's --moe-loss-coeff 0.01 (its MoE scripts' MLC)
        mok=dict(ep_exchange="capacity", ep_capacity_factor=2.0, ep_transport="nccl", norm_topk_prob=False,
                 aux_loss_coeff=0.01),
        deepspeed=dict(capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_rts=True,
                       noisy_gate_policy=None),
    )  # fmt: skip
    write(gpt, f"{gpt_moe}_h200_single", "A Megatron-DeepSpeed GPT-MoE-like model on one H200: 4 MoE layers of 16 GeLU "
          "experts, top-1, capacity 1.0, min capacity 4, token dropping, random token selection "
          "(mok compare --framework deepspeed)")  # fmt: skip
    tiny = RunConfig(
        machine="cpu",
        model=dict(name="tiny", num_layers=2, moe_layers=2, hidden_size=64, ffn_hidden_size=32, num_experts=8,
                   top_k=2, dense_params_b=0.0001, source="a made-up model for the quickstart"),
        parallel=dict(seq_length=64, micro_batch=2),
        mok=dict(norm_topk_prob=True, aux_loss_coeff=0.01, backend="reference", params_dtype="float32"),
    )  # fmt: skip
    write(tiny, "tiny_cpu", "A tiny MoE model for the CPU quickstart (the comparison harness's default)")
    print(f"wrote {len(list(OUT.glob('*.yaml')))} configs to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
