"""The planner (mok_plugin.run.planner): its memory and MoE-layer time arithmetic against
hand-worked cases (NVLink inside the domain, the scale-out network beyond it, no exchange at EP 1),
per expert family (GPT-OSS's gated quick-GeLU with both biases; a plain squared-ReLU MLP with an fc2
bias and a shared expert; a linear expert): its weights, saved h and GEMM FLOPs; it refuses an
exchange over a link the machine lacks and an efficiency outside (0, 1]."""

import math
from pathlib import Path

import pytest
import yaml

from mok_plugin.config import MoKConfigError
from mok_plugin.run.planner import GIB, expert_rate_tflops, layer_time, memory_per_gpu
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


def test_gpt_oss_family_by_hand():
    # gpt-oss-120b at EP 16, PP 1, DP 16, 4096 tokens: 128 / 16 = 8 experts x 36 layers = 288 here.
    # One expert: W1 [2I = 5760, 2880] = 16,588,800 + W2 [2880, 2880] = 8,294,400 + b1 5,760 + b2 2,880
    # = 24,891,840 parameters (bias-free SwiGLU: 24,883,200).
    run = load_topology(TOPOLOGIES / "gpt-oss-120b_gb200-nvl72_ep16.yaml")
    assert run.model.expert_family.describe() == "glu(quick_gelu, clamp 7.0, offset 1.0) + fc1 and fc2 bias"
    mem = memory_per_gpu(run)
    assert mem.expert_params == 7_168_849_920  # 288 x 24,891,840
    assert mem.dense_params == pytest.approx(2.1e9)
    assert mem.weights_gib == pytest.approx(2 * (7_168_849_920 + 2.1e9) / GIB)
    assert mem.optimizer_gib == pytest.approx(12 * (7_168_849_920 + 2.1e9 / 16) / GIB)
    # 36 layers x 34 T H, plus per MoE layer the input (2 T H) and h of the 16,384 rows, 5760 bf16
    # columns each (2 x 16,384 x 5760 = 188,743,680 B): 22,083,010,560 B.
    assert mem.activations_gib == pytest.approx(22_083_010_560 / GIB)
    # Forward 2 x 3HI per row (6 x 2880^2 = 49,766,400 FLOPs), backward twice that: 18 HI x 16,384 rows.
    assert layer_time(run).expert_flops == 2_446_118_092_800
    # The same model stated as plain SwiGLU: no biases, the same FLOPs and activations.
    data = yaml.safe_load((TOPOLOGIES / "gpt-oss-120b_gb200-nvl72_ep16.yaml").read_text())
    for key in ("activation_clamp", "glu_linear_offset", "expert_fc1_bias", "expert_fc2_bias", "expert_activation"):
        del data["model"][key]
    swiglu = RunConfig(**data)
    assert memory_per_gpu(swiglu).expert_params == 7_166_361_600  # 288 x 3 x 2880^2
    assert layer_time(swiglu).expert_flops == layer_time(run).expert_flops


def _tiny_family(**model) -> RunConfig:
    data = _tiny()  # H 64, I 32, E 8, K 2, 2 layers (both MoE), T = 64 x 2 = 128, EP 1, PP 1
    data["model"].update(model)
    return RunConfig(**data)


def test_plain_mlp_family_by_hand():
    # Nemotron-style squared-ReLU MLP (not gated) with an fc2 bias and a 48-wide shared expert.
    run = _tiny_family(expert_kind="mlp", expert_activation="squared_relu", expert_fc2_bias=True,
                       shared_ffn_hidden_size=48)  # fmt: skip
    assert run.mok_config().expert_family == run.model.expert_family
    mem = memory_per_gpu(run)
    # One routed expert: W1 [32, 64] 2048 + W2 [64, 32] 2048 + b2 64 = 4160; 8 experts x 2 layers.
    assert mem.expert_params == 66_560
    # The shared MLP: W1 [48, 64] 3072 + W2 [64, 48] 3072 + b2 64 = 6208 per layer, on top of 1e5.
    assert mem.dense_params == pytest.approx(100_000 + 2 * 6208)
    # 2 x 34 T H = 557,056, plus per MoE layer 2 T H = 16,384 and h [256 rows, 32] bf16 = 16,384.
    assert mem.activations_gib == pytest.approx(622_592 / GIB)
    # 2 x 2HI = 8192 FLOPs forward per row, x 3 with the backward, x 256 rows.
    assert layer_time(run).expert_flops == 6_291_456


def test_linear_family_by_hand():
    # One H x H linear per expert (I = H = 64) with its bias: no h is saved (its input is x).
    run = _tiny_family(expert_kind="linear", ffn_hidden_size=64, expert_fc2_bias=True)
    mem = memory_per_gpu(run)
    assert mem.expert_params == 16 * (64 * 64 + 64)  # 8 experts x 2 layers
    assert mem.activations_gib == pytest.approx((2 * 34 * 128 * 64 + 2 * 2 * 128 * 64) / GIB)
    assert layer_time(run).expert_flops == 3 * 2 * 256 * 64 * 64


@pytest.mark.parametrize("efficiency", [0, -0.5, 1.5, math.nan, math.inf])
def test_layer_time_efficiency_in_zero_one(efficiency):
    with pytest.raises(ValueError, match="efficiency"):
        layer_time(load_topology(TOPOLOGIES / "tiny_cpu.yaml"), efficiency)


def test_fp8_experts_take_the_fp8_rate_and_keep_weight_copies():
    # mok.fp8: the expert GEMMs at the machine's dense FP8 rate (twice bf16 on the GB300), the
    # exchange unchanged (bf16 rows: MoK quantises after dispatch), and 2 B per expert weight for the
    # FP8 copies and their transposes, kept through a step.
    data = _base()
    bf16 = RunConfig(**data)
    data["mok"]["fp8"] = "e4m3"
    fp8 = RunConfig(**data)
    t_bf16, t_fp8 = layer_time(bf16, efficiency=0.5), layer_time(fp8, efficiency=0.5)
    assert t_fp8.expert_ms == pytest.approx(t_bf16.expert_ms / 2) and t_fp8.exchange_ms == t_bf16.exchange_ms
    assert MACHINES["gb300-nvl72"].fp8_tflops == 2 * MACHINES["gb300-nvl72"].bf16_tflops
    m_bf16, m_fp8 = memory_per_gpu(bf16), memory_per_gpu(fp8)
    shared = 29 * 3 * 7168 * 2048
    assert m_fp8.mok_buffers_gib - m_bf16.mok_buffers_gib == pytest.approx(2 * (m_bf16.expert_params + shared) / GIB)


def test_fp8_on_hopper_takes_the_measured_speed_not_the_fp8_peak():
    # MoK's FP8 experts measured on the H200 run at 1.20-1.29x bf16's speed (BENCHMARKS.md), far from the
    # datasheet's 2x: a plan on a Hopper machine takes the measured speed, not the FP8 peak.
    data = yaml.safe_load((TOPOLOGIES / "qwen3-30b-a3b_hgx-h200_ep8.yaml").read_text())
    data["mok"].pop("fp8", None)
    bf16 = RunConfig(**data)
    data["mok"]["fp8"] = "e4m3"
    t_bf16, t_fp8 = layer_time(bf16), layer_time(RunConfig(**data))
    speedup = MACHINES["hgx-h200"].fp8_speedup
    assert speedup is not None and 1 < speedup < 2
    assert t_fp8.expert_ms == pytest.approx(t_bf16.expert_ms / speedup)
    assert expert_rate_tflops(MACHINES["hgx-h200"], fp8=True) < MACHINES["hgx-h200"].fp8_tflops
    # Blackwell: not measured, the dense FP8 rate
    assert MACHINES["gb300-nvl72"].fp8_speedup is None
    assert expert_rate_tflops(MACHINES["gb300-nvl72"], fp8=True) == MACHINES["gb300-nvl72"].fp8_tflops
