"""Run configs (mok_plugin.run.topology, run.sections): every file in configs/topologies/ loads,
validates and fits; each kind of impossible layout is rejected with a message naming the field (more
stages than layers, TP or expert TP, a mok block contradicting the model or parallel section, an
exchange over a 0 GB/s link, non-finite values); a file that cannot be read is an error naming it;
`load_config` refuses each of them and points to `load_topology`; the model section's expert MLP
(GPT-OSS's in its configs, SwiGLU without biases in every other, as the models publish them) reaches
the MoKConfig, and its invalid values and combinations are errors naming the `model.` field; the
optional `deepspeed:` section (DeepSpeed's gating) takes DeepSpeed's defaults, is absent from the
configs that do not state it, and its bad values are errors naming `deepspeed.<key>`; the run
package's imports point one way (config <- sections <- planner <- topology <- plan) with no deferred
import; the files are what scripts/make_topology_configs.py writes today."""

import ast
import math
from pathlib import Path

import pytest
import yaml

from mok_plugin import load_topology as load_topology_public
from mok_plugin.config import MoKConfigError, load_config
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.run.planner import memory_per_gpu
from mok_plugin.run.topology import MACHINES, RunConfig, load_topology

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "topologies").glob("*.yaml"))
PACKAGE = ROOT / "mok_plugin"


def test_the_configs_cover_the_promised_layouts():
    names = {path.stem for path in CONFIGS}
    for model in ("deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "glm-4.5", "gpt-oss-120b"):
        for rack in ("gb300-nvl72", "gb200-nvl72"):
            assert {f"{model}_{rack}_ep{ep}" for ep in (8, 16, 32, 64, 72)} <= names
    assert {"qwen3-30b-a3b_hgx-h200_ep8", "qwen3-30b-a3b_hgx-h100_ep8", "tiny_cpu"} <= names
    assert any(name.endswith("_h200_single") for name in names)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads_and_fits(path):
    # load_config reads MoK layer configs only; a run config's layer config comes from load_topology.
    with pytest.raises(MoKConfigError, match=r"mok_plugin\.run\.load_topology\(path\)\.mok_config\(\)"):
        load_config(path)
    assert load_topology(path).mok_config().num_experts >= 8
    run = load_topology(path)
    assert memory_per_gpu(run).fits
    assert (run.model.num_experts + run.parallel.redundant_experts) % run.parallel.ep == 0
    run.mok_config()  # a valid MoKConfig for one layer


# GPT-OSS's MLP (openai/gpt-oss gpt_oss/torch/model.py: swiglu with alpha 1.702, limit 7.0, (x_linear + 1),
# biases on both MLP linears); every other model in configs/ is bias-free SwiGLU (their config.json files).
GPT_OSS = MoKExpertFamily("glu", "quick_gelu", clamp=7.0, linear_offset=1.0, fc1_bias=True, fc2_bias=True)
# Megatron-DeepSpeed's GPT-MoE: the GPT MLP (ParallelMLP, GeLU, --add-bias-linear's biases on both linears).
GPT_MOE = MoKExpertFamily("mlp", "gelu", fc1_bias=True, fc2_bias=True)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_states_its_models_expert_mlp(path):
    run = load_topology(path)
    want = (
        GPT_OSS
        if run.model.name.startswith("gpt-oss")
        else GPT_MOE
        if run.model.name.startswith("megatron-")
        else SWIGLU
    )
    assert run.model.expert_family == want
    assert run.mok_config().expert_family == want
    assert "expert_kind" in yaml.safe_load(path.read_text())["model"]  # stated, not left to the default


def test_expert_family_fields_default_to_swiglu():
    data = _base()
    for key in ("expert_kind", "expert_activation", "activation_clamp", "glu_linear_offset", "expert_fc1_bias",
                "expert_fc2_bias"):  # fmt: skip
        data["model"].pop(key, None)
    assert RunConfig(**data).mok_config().expert_family == SWIGLU


@pytest.mark.parametrize(
    "model, message",
    [
        (dict(expert_kind="mlp", activation_clamp=7.0), r"model\.activation_clamp=7\.0 applies to glu experts only; "
                                                        r"model\.expert_kind='mlp'"),
        (dict(expert_kind="mlp", glu_linear_offset=1.0), r"model\.glu_linear_offset=1\.0 applies to glu experts only"),
        (dict(expert_kind="linear"), r"model\.expert_kind='linear' .* needs model\.ffn_hidden_size = "
                                     r"model\.hidden_size=64, got 32"),
        (dict(expert_kind="linear", ffn_hidden_size=64, expert_fc1_bias=True),
         r"model\.expert_fc1_bias: a linear expert"),
        (dict(expert_kind="linear", ffn_hidden_size=64, shared_ffn_hidden_size=64),
         r"model\.shared_ffn_hidden_size=64: shared experts are MLPs"),
        (dict(expert_kind="swiglu"), r"model\.expert_kind='swiglu': Input should be 'glu', 'mlp' or 'linear'"),
        (dict(expert_activation="swish"), r"model\.expert_activation='swish': Input should be 'silu'"),
        (dict(expert_fc1_bias="yes"), r"model\.expert_fc1_bias='yes': Input should be a valid boolean"),
        (dict(activation_clamp="7"), r"model\.activation_clamp='7'"),
        (dict(activation_clamp=0.0), r"model\.activation_clamp=0\.0: Input should be greater than 0"),
        (dict(glu_linear_offset=math.nan), r"model\.glu_linear_offset=nan"),
    ],
)  # fmt: skip
def test_invalid_expert_family_names_the_model_field(tmp_path, model, message):
    data = _tiny()
    data["model"].update(model)
    _reject(tmp_path, data, message)


def test_mok_block_contradicting_the_expert_family(tmp_path):
    data = _base()
    data["mok"]["expert_activation"] = "gelu"
    _reject(tmp_path, data, r"mok\.expert_activation='gelu' contradicts model\.expert_activation='silu'")
    data = yaml.safe_load((ROOT / "configs" / "topologies" / "gpt-oss-120b_gb200-nvl72_ep16.yaml").read_text())
    data["mok"]["expert_fc2_bias"] = False
    _reject(tmp_path, data, r"mok\.expert_fc2_bias=False contradicts model\.expert_fc2_bias=True")
    data["mok"].update(expert_fc2_bias=True, activation_clamp=7.0)  # repeating the model is fine
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_topology(path).mok_config().expert_family == GPT_OSS


def test_load_topology_is_public_api():
    assert load_topology_public is load_topology


def test_every_machine_names_a_public_source():
    for machine in MACHINES.values():
        assert machine.source and "shared/reference" not in machine.source, machine.name
        if machine.name not in ("cpu", "h200-measured"):
            assert "https://www.nvidia.com/" in machine.source or "https://docs.nvidia.com/" in machine.source


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(modules imported at module level, modules imported inside a function or class) of a file."""
    tree = ast.parse(path.read_text())
    top = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    top |= {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    nested = [
        node.module or ""
        for outer in tree.body
        if not isinstance(outer, ast.Import | ast.ImportFrom)
        for node in ast.walk(outer)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mok_plugin")
    ]
    return top, nested


def test_imports_point_one_way():
    config_top, config_nested = _imports(PACKAGE / "config.py")
    assert not [m for m in config_top | set(config_nested) if m.startswith("mok_plugin.run")]
    order = ["sections", "planner", "topology", "plan"]  # each may import only those before it
    for i, name in enumerate(order):
        top, nested = _imports(PACKAGE / "run" / f"{name}.py")
        assert not nested, f"run/{name}.py imports {nested} inside a function"
        later = {f"mok_plugin.run.{other}" for other in order[i:]} | {"mok_plugin.run"}
        assert not top & later, f"run/{name}.py imports {top & later}"
    assert not (PACKAGE / "topology.py").exists() and not (PACKAGE / "planner.py").exists()


def _base() -> dict:
    return yaml.safe_load((ROOT / "configs" / "topologies" / "deepseek-v3_gb300-nvl72_ep64.yaml").read_text())


def _tiny() -> dict:
    return yaml.safe_load((ROOT / "configs" / "topologies" / "tiny_cpu.yaml").read_text())


def _reject(tmp_path, data: dict, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(MoKConfigError, match=message):
        load_topology(path)


def test_experts_not_divisible_by_ep(tmp_path):
    data = _base()
    data["parallel"].update(ep=72, dp=72, redundant_experts=0)
    _reject(tmp_path, data, r"parallel.ep=72 does not divide the 256 expert slots")


def test_nvlink_path_larger_than_the_domain(tmp_path):
    data = _base()
    data["machine"] = "hgx-h200"
    data["parallel"].update(ep=16, dp=16, pp=16)
    _reject(tmp_path, data, r"mok.ep_transport='symmetric_memory' needs the EP group in one NVLink domain")


def test_layout_that_does_not_fit_memory(tmp_path):
    data = _base()
    data["parallel"].update(pp=1, ep=8, dp=8)
    _reject(tmp_path, data, r"parallel: the layout does not fit GB300 memory: about \d+")


def test_ep_must_divide_the_ranks_of_a_stage(tmp_path):
    data = _base()
    data["parallel"].update(ep=64, dp=32)
    _reject(tmp_path, data, r"parallel.ep=64 x parallel.expert_tp=1 must divide tp x dp = 32")


def test_unknown_machine_and_keys(tmp_path):
    data = _base()
    data["machine"] = "gb400-nvl144"
    _reject(tmp_path, data, r"machine='gb400-nvl144': unknown; allowed: gb300-nvl72")
    data = _base()
    data["parallel"]["pipeline"] = 2
    _reject(tmp_path, data, r"parallel.pipeline: unknown key")
    data = _base()
    data["mok"]["ep_exchange"] = "eventually"
    _reject(tmp_path, data, r"mok.ep_exchange")


def test_more_pipeline_stages_than_layers(tmp_path):
    data = _tiny()
    data["parallel"].update(pp=3)
    _reject(tmp_path, data, r"parallel\.pp=3 exceeds model\.num_layers=2")
    data = _base()
    data["model"].update(moe_layers=1)
    _reject(tmp_path, data, r"parallel\.pp=2 exceeds model\.moe_layers=1")


def test_tensor_parallelism_the_adapters_refuse(tmp_path):
    data = _base()
    data["parallel"].update(tp=2)
    _reject(tmp_path, data, r"parallel\.tp=2: the comparison runs and the DeepSpeed adapter are TP 1")
    data = _base()
    data["parallel"].update(expert_tp=2, ep=32)
    _reject(tmp_path, data, r"parallel\.expert_tp=2: the adapters refuse expert tensor parallelism")


@pytest.mark.parametrize(
    "key, value, other",
    [
        ("num_experts", 128, r"model\.num_experts=256 \+ parallel\.redundant_experts=0"),
        ("ep_size", 8, r"parallel\.ep=64"),
        ("top_k", 4, r"model\.top_k=8"),
        ("hidden_size", 4096, r"model\.hidden_size=7168"),
        ("ffn_hidden_size", 1024, r"model\.ffn_hidden_size=2048"),
        ("num_shared_experts", 2, r"model\.shared_ffn_hidden_size=2048"),
        ("shared_ffn_hidden_size", 4096, r"model\.shared_ffn_hidden_size=2048"),
    ],
)
def test_mok_block_contradicting_the_model_or_layout(tmp_path, key, value, other):
    data = _base()
    data["mok"][key] = value
    _reject(tmp_path, data, rf"mok\.{key}={value} contradicts {other}")


def test_mok_block_repeating_the_model_is_fine(tmp_path):
    data = _base()
    data["mok"].update(num_experts=256, ep_size=64, top_k=8, hidden_size=7168, shared_ffn_hidden_size=2048)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_topology(path).mok_config().num_experts == 256


def test_exchange_over_a_link_the_machine_lacks(tmp_path):
    # The CPU machine has no scale-out network (0 GB/s): the planner used to charge 0 ms for it.
    # (The planner's own refusal of such a run: tests/test_run_planner.py.)
    data = _tiny()
    data["parallel"].update(ep=2, dp=2)
    _reject(tmp_path, data, r"parallel\.ep=2: the expert exchange goes over scale-out, but machine 'cpu' has "
                            r"scale_out_gb_s=0 GB/s")  # fmt: skip


def test_non_finite_and_huge_values_in_a_run_config(tmp_path):
    data = _base()
    data["mok"]["ep_capacity_factor"] = math.inf
    _reject(tmp_path, data, r"mok\.ep_capacity_factor=inf")
    data = _base()
    data["model"]["dense_params_b"] = math.inf
    _reject(tmp_path, data, r"model\.dense_params_b=inf")
    data = _base()
    data["model"]["hidden_size"] = 2**40
    _reject(tmp_path, data, r"model\.hidden_size=1099511627776")
    data = _base()
    data["machine"] = "x" * 100_000
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(MoKConfigError, match=r"machine='xxx.*\(100002 characters\): unknown") as info:
        load_topology(path)
    assert len(str(info.value)) < 1000


def test_load_topology_names_the_file_for_every_read_failure(tmp_path):
    with pytest.raises(MoKConfigError, match=r"missing\.yaml: no such file"):
        load_topology(tmp_path / "missing.yaml")
    with pytest.raises(MoKConfigError, match=r"is a directory"):
        load_topology(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"machine: cpu\n\xff\xfe\n")
    with pytest.raises(MoKConfigError, match=r"binary\.yaml: not UTF-8 text"):
        load_topology(binary)
    broken = tmp_path / "broken.yaml"
    broken.write_text("machine: cpu\nmodel: {name: [\n")
    with pytest.raises(MoKConfigError, match=r"broken\.yaml: not valid YAML"):
        load_topology(broken)


def test_a_run_config_built_in_code_validates_the_same_way():
    # RunConfig(**data) (not from a file) runs the same checks; the planner estimates it.
    data = _base()
    data["parallel"].update(pp=1, ep=8, dp=8)
    with pytest.raises(ValueError, match=r"parallel: the layout does not fit GB300 memory"):
        RunConfig(**data)


def test_deepspeed_section_is_optional_with_deepspeeds_defaults(tmp_path):
    data = _tiny()
    assert "deepspeed" not in data and RunConfig(**data).deepspeed is None  # the harness keeps its own gating
    data["deepspeed"] = {}
    assert RunConfig(**data).deepspeed.moe_kwargs() == dict(
        capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_rts=True,
        noisy_gate_policy=None, top2_2nd_expert_sampling=True,
    )  # deepspeed.moe.layer.MoE's defaults  # fmt: skip
    data["deepspeed"] = dict(capacity_factor=2, noisy_gate_policy="RSample", drop_tokens=False)
    gating = RunConfig(**data).deepspeed
    assert (gating.capacity_factor, gating.noisy_gate_policy, gating.drop_tokens) == (2.0, "RSample", False)
    # Only the configs that state it have one (no `deepspeed: null` written into the others).
    stated = {path.stem for path in CONFIGS if "deepspeed" in yaml.safe_load(path.read_text())}
    assert stated == {"megatron-deepspeed-gpt-moe_h200_single"}


def test_megatron_deepspeed_gpt_moe_config():
    run = load_topology(ROOT / "configs" / "topologies" / "megatron-deepspeed-gpt-moe_h200_single.yaml")
    assert (run.machine, run.parallel.world_size, run.model.top_k, run.model.hidden_size) == (
        "h200-measured",
        1,
        1,
        2048,
    )
    assert run.model.ffn_hidden_size == 4 * run.model.hidden_size and run.model.expert_family == GPT_MOE
    assert run.deepspeed.moe_kwargs() == dict(capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
                                              drop_tokens=True, use_rts=True, noisy_gate_policy=None,
                                              top2_2nd_expert_sampling=True)  # fmt: skip
    assert memory_per_gpu(run).fits


@pytest.mark.parametrize(
    "section, message",
    [
        (dict(capacity_factor=0.0), r"deepspeed\.capacity_factor=0\.0: Input should be greater than 0"),
        (dict(capacity_factor="1.0"), r"deepspeed\.capacity_factor='1\.0': Input should be a valid number"),
        (dict(eval_capacity_factor=math.inf), r"deepspeed\.eval_capacity_factor=inf"),
        (dict(min_capacity=-1), r"deepspeed\.min_capacity=-1: Input should be greater than or equal to 0"),
        (dict(min_capacity=4.0), r"deepspeed\.min_capacity=4\.0: Input should be a valid integer"),
        (dict(drop_tokens="yes"), r"deepspeed\.drop_tokens='yes': Input should be a valid boolean"),
        (dict(use_rts=1), r"deepspeed\.use_rts=1: Input should be a valid boolean"),
        (dict(noisy_gate_policy="Gumbel"), r"deepspeed\.noisy_gate_policy='Gumbel': Input should be 'RSample' or "
                                           r"'Jitter'"),
        (dict(noisy_gate_policy="None"), r"deepspeed\.noisy_gate_policy='None'"),
        (dict(top2_2nd_expert_sampling="false"), r"deepspeed\.top2_2nd_expert_sampling='false'"),
        (dict(drop_token=True), r"deepspeed\.drop_token: unknown key"),
    ],
)  # fmt: skip
def test_invalid_deepspeed_section_names_the_key(tmp_path, section, message):
    data = _tiny()
    data["deepspeed"] = section
    _reject(tmp_path, data, message)


def test_deepspeed_min_capacity_above_the_micro_batch_at_top1(tmp_path):
    # DeepSpeed's top-1 gate refuses fewer tokens than min_capacity; the tiny config has 2 x 64 tokens.
    data = _tiny()
    data["model"]["top_k"] = 1
    data["mok"]["norm_topk_prob"] = False
    data["deepspeed"] = dict(min_capacity=129)
    _reject(tmp_path, data, r"deepspeed\.min_capacity=129 exceeds the 128 tokens of a micro-batch "
                            r"\(parallel\.seq_length=64 x micro_batch=2\)")  # fmt: skip
    data["deepspeed"] = dict(min_capacity=128)
    assert RunConfig(**data).deepspeed.min_capacity == 128
    data["model"]["top_k"] = 2  # top-2 and top-k gates have no such check
    data["deepspeed"] = dict(min_capacity=129)
    assert RunConfig(**data).deepspeed.min_capacity == 129


def test_config_files_are_what_their_generator_writes(tmp_path, monkeypatch):
    # configs/topologies/ is written by scripts/make_topology_configs.py from run/sections.py's machines
    # (with their sources in each header) and the models' figures: a change to either must regenerate them
    import importlib.util

    script = ROOT / "scripts" / "make_topology_configs.py"
    spec = importlib.util.spec_from_file_location("make_topology_configs", script)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    monkeypatch.setattr(generator, "OUT", tmp_path)
    assert generator.main() == 0
    written = {path.name: path.read_text() for path in tmp_path.glob("*.yaml")}
    assert sorted(written) == [path.name for path in CONFIGS]
    stale = [path.name for path in CONFIGS if path.read_text() != written[path.name]]
    assert not stale, f"regenerate with python scripts/make_topology_configs.py: {stale}"
