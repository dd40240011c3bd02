"""The planner (mok_plugin.run.planner): its memory and MoE-layer time arithmetic against
hand-worked cases (NVLink inside the domain, the scale-out network beyond it, no exchange at EP 1);
it refuses an exchange over a link the machine lacks and an efficiency outside (0, 1]."""

import math
from pathlib import Path

import pytest
import yaml

from mok_plugin.config import MoKConfigError
from mok_plugin.run.planner import GIB, layer_time, memory_per_gpu
from mok_plugin.run.topology import MACHINES, RunConfig, load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "configs" / "topologies"


def _base() -> dict:
    return yaml.safe_load((TOPOLOGIES / "deepseek-v3_gb300-nvl72_ep64.yaml").read_text())


def _tiny() -> dict:
    return yaml.safe_load((TOPOLOGIES / "tiny_cpu.yaml").read_text())


def test_memory_arithmetic_by_hand():
    # One GB300, DeepSeek-V3 at EP 64, PP 2, DP 64, 4096 tokens: 4 experts x 29 layers here.
    run = load_topology(TOPOLOGIES / "deepseek-v3_gb300-nvl72_ep64.yaml")
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
    run = load_topology(TOPOLOGIES / "deepseek-v3_gb300-nvl72_ep64.yaml")
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
    assert math.isclose(layer_time(load_topology(TOPOLOGIES / "tiny_cpu.yaml")).exchange_ms, 0.0)


def test_layer_time_refuses_a_link_the_machine_lacks():
    # The CPU machine has no scale-out network (0 GB/s): the planner used to charge 0 ms for it.
    # Loading such a run is refused (tests/test_run_topology.py); layer_time refuses it too
    # (model_copy skips validation, as a hand-built run could).
    valid = RunConfig(**_tiny())
    run = valid.model_copy(update={"parallel": valid.parallel.model_copy(update={"ep": 2, "dp": 2})})
    with pytest.raises(MoKConfigError, match=r"machine 'cpu' has scale_out_gb_s=0 GB/s"):
        layer_time(run)


@pytest.mark.parametrize("efficiency", [0, -0.5, 1.5, math.nan, math.inf])
def test_layer_time_efficiency_in_zero_one(efficiency):
    with pytest.raises(ValueError, match="efficiency"):
        layer_time(load_topology(TOPOLOGIES / "tiny_cpu.yaml"), efficiency)
