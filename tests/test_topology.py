"""Run configs and the planner: every file in configs/topologies/ loads and validates; each kind of
impossible layout is rejected with a message naming the field (more stages than layers, TP or
expert TP, a mok block contradicting the model or parallel section, an exchange over a 0 GB/s
link, non-finite values); a file that cannot be read is an error naming it; the planner's
arithmetic against hand-worked cases; scripts/plan.py prints a plan and refuses bad input cleanly."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mok_plugin.config import MoKConfigError, load_config
from mok_plugin.planner import GIB, layer_time, memory_per_gpu
from mok_plugin.topology import MACHINES, RunConfig, load_topology

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "topologies").glob("*.yaml"))
sys.path.insert(0, str(ROOT / "scripts"))
import plan  # noqa: E402


def test_the_configs_cover_the_promised_layouts():
    names = {path.stem for path in CONFIGS}
    for model in ("deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "glm-4.5", "gpt-oss-120b"):
        for rack in ("gb300-nvl72", "gb200-nvl72"):
            assert {f"{model}_{rack}_ep{ep}" for ep in (8, 16, 32, 64, 72)} <= names
    assert {"qwen3-30b-a3b_hgx-h200_ep8", "qwen3-30b-a3b_hgx-h100_ep8", "tiny_cpu"} <= names
    assert any(name.endswith("_h200_single") for name in names)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads_and_fits(path):
    assert load_config(path).num_experts >= 8  # mok_plugin.load_config validates the whole run
    run = load_topology(path)
    assert memory_per_gpu(run).fits
    assert (run.model.num_experts + run.parallel.redundant_experts) % run.parallel.ep == 0
    run.mok_config()  # a valid MoKConfig for one layer


def _base() -> dict:
    return yaml.safe_load((ROOT / "configs" / "topologies" / "deepseek-v3_gb300-nvl72_ep64.yaml").read_text())


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


def test_memory_arithmetic_by_hand():
    # One GB300, DeepSeek-V3 at EP 64, PP 2, DP 64, 4096 tokens: 4 experts x 29 layers here.
    run = load_topology(ROOT / "configs" / "topologies" / "deepseek-v3_gb300-nvl72_ep64.yaml")
    mem = memory_per_gpu(run)
    per_expert = 3 * 7168 * 2048
    assert mem.expert_params == pytest.approx(4 * 29 * per_expert)
    shared = 29 * 3 * 7168 * 2048
    assert mem.dense_params == pytest.approx(14.4e9 / 2 + shared)
    total = mem.expert_params + mem.dense_params
    assert mem.weights_gib == pytest.approx(2 * total / GIB)
    assert mem.grads_gib == pytest.approx(4 * total / GIB)
    # Experts shard their optimizer over tp*dp/ep = 1 rank, the rest over dp = 64.
    assert mem.optimizer_gib == pytest.approx(12 * (mem.expert_params + mem.dense_params / 64) / GIB)
    T, H, K, I = 4096, 7168, 8, 2048
    assert mem.activations_gib == pytest.approx((61 * 34 * T * H + 58 * (2 * T * H + 4 * T * K * I)) / GIB)
    assert mem.mok_buffers_gib == pytest.approx(4 * (T * K * 2.0) * H * 2 / GIB)
    assert mem.budget_gib == pytest.approx(0.9 * MACHINES["gb300-nvl72"].hbm_gib)


def test_layer_time_by_hand():
    run = load_topology(ROOT / "configs" / "topologies" / "deepseek-v3_gb300-nvl72_ep64.yaml")
    t = layer_time(run, efficiency=0.5)
    flops = 3 * 2 * 4096 * 8 * 3 * 7168 * 2048
    assert t.expert_flops == pytest.approx(flops)
    assert t.expert_ms == pytest.approx(flops / (0.5 * 2500e12) * 1e3)
    sent = 4 * 4096 * 8 * 7168 * 2 * 63 / 64
    assert (t.exchange_bytes, t.link) == (pytest.approx(sent), "NVLink")
    assert t.exchange_ms == pytest.approx(sent / 900e9 * 1e3)
    # EP beyond the NVLink domain goes over the scale-out network.
    data = _base()
    data["mok"]["ep_transport"] = "nccl"
    data["machine"] = "hgx-h200"
    data["parallel"].update(ep=16, dp=16, pp=16, seq_length=2048)
    far = layer_time(RunConfig(**data))
    assert far.link == "scale-out" and far.exchange_ms == pytest.approx(far.exchange_bytes / 50e9 * 1e3)
    assert math.isclose(layer_time(load_topology(ROOT / "configs/topologies/tiny_cpu.yaml")).exchange_ms, 0.0)


def test_plan_script_prints_and_exits_by_fit(tmp_path):
    run = subprocess.run([sys.executable, "scripts/plan.py", "configs/topologies/kimi-k2_gb300-nvl72_ep64.yaml",
                          "--json", str(tmp_path / "plan.json")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "-> fits" in run.stdout and "over NVLink at 900 GB/s" in run.stdout and "source:" in run.stdout
    data = _base()
    data["parallel"].update(ep=72, dp=72, redundant_experts=0)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    run = subprocess.run([sys.executable, "scripts/plan.py", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "does not divide" in run.stderr


def _tiny() -> dict:
    return yaml.safe_load((ROOT / "configs" / "topologies" / "tiny_cpu.yaml").read_text())


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
    _reject(tmp_path, data, r"parallel\.tp=2: the adapters refuse tensor parallelism")
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
    data = _tiny()
    data["parallel"].update(ep=2, dp=2)
    _reject(tmp_path, data, r"parallel\.ep=2: the expert exchange goes over scale-out, but machine 'cpu' has "
                            r"scale_out_gb_s=0 GB/s")  # fmt: skip
    # layer_time refuses it too (model_copy skips validation, as a hand-built run could).
    valid = RunConfig(**_tiny())
    run = valid.model_copy(update={"parallel": valid.parallel.model_copy(update={"ep": 2, "dp": 2})})
    with pytest.raises(MoKConfigError, match=r"machine 'cpu' has scale_out_gb_s=0 GB/s"):
        layer_time(run)


@pytest.mark.parametrize("efficiency", [0, -0.5, 1.5, math.nan, math.inf])
def test_layer_time_efficiency_in_zero_one(efficiency):
    with pytest.raises(ValueError, match="efficiency"):
        layer_time(load_topology(ROOT / "configs" / "topologies" / "tiny_cpu.yaml"), efficiency)


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


@pytest.mark.parametrize("value", ["0", "-0.5", "nan", "inf", "1.5", "fast"])
def test_plan_efficiency_must_be_a_fraction(value, capsys):
    with pytest.raises(SystemExit) as info:
        plan.main(["configs/topologies/tiny_cpu.yaml", "--efficiency", value])
    assert info.value.code == 2 and "--efficiency" in capsys.readouterr().err


def test_plan_file_errors_are_one_line_without_traceback(tmp_path, capsys):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe")
    broken = tmp_path / "broken.yaml"
    broken.write_text("machine: [\n")
    for path, problem in ((tmp_path / "missing.yaml", "no such file"), (tmp_path, "is a directory"),
                          (binary, "not UTF-8 text"), (broken, "not valid YAML")):  # fmt: skip
        assert plan.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {problem}"), err
    run = subprocess.run([sys.executable, "scripts/plan.py", str(binary)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "binary.yaml: not UTF-8" in run.stderr
