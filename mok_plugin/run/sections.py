"""The parts of a run config that the planner and `RunConfig` both read: the machine table
(`Machine`, `MACHINES`), the model's MoE shape and expert MLP (`ModelShape`) and the parallel
layout (`ParallelLayout`); and DeepSpeed's MoE gating arguments (`DeepSpeedGating`, the optional
`deepspeed:` section, which `mok compare --framework deepspeed` reads and the planner does not).

Each part validates its own fields only. What holds across parts (EP divides the expert slots, the
layout fits the GPU, ...) is `RunConfig`'s job (topology.py), and the arithmetic is the planner's
(planner.py); both import this module, which imports neither, so the three form no import circle.

Machine figures are per GPU: dense (no 2:4 sparsity) bf16 tensor-core rate, HBM that CUDA sees, HBM
bandwidth, NVLink bandwidth per direction (half the bidirectional figure NVIDIA quotes), scale-out
network per direction (the NIC's Gb/s / 8). Each machine names its sources, NVIDIA's datasheets and
reference architectures; `h200-measured` uses what was measured on this project's H200 instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mok_plugin.config import MAX_DIM, MAX_FACTOR
from mok_plugin.experts import FAMILY_FIELDS, ExpertKind, MoKExpertFamily, family_field_problems
from mok_plugin.experts import Activation as ExpertActivation

__all__ = [
    "DEEPSPEED_DEFAULTS",
    "FAMILY_FIELDS",
    "MACHINES",
    "DeepSpeedGating",
    "Machine",
    "ModelShape",
    "ParallelLayout",
]


class Machine(BaseModel):
    """One GPU's rates and its fast-interconnect domain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    gpu: str
    nvlink_domain: int = Field(gt=0, description="GPUs that share NVLink (a node, or an NVL72 rack).")
    hbm_gib: float = Field(gt=0)
    hbm_tb_s: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0, description="Dense bf16 tensor-core rate.")
    fp8_tflops: float = Field(gt=0, description="Dense FP8 tensor-core rate (mok.fp8's expert GEMMs).")
    fp8_speedup: float | None = Field(
        default=None, gt=0,
        description="MoK's FP8 experts' measured speed against its bf16 experts on this GPU (forward + backward, "
                    "the weights' FP8 copies kept as within a step); None where not measured: the planner then "
                    "takes the dense FP8 rate.",
    )  # fmt: skip
    nvlink_gb_s: float = Field(ge=0, description="NVLink bandwidth per GPU, one direction.")
    scale_out_gb_s: float = Field(ge=0, description="Network bandwidth per GPU, one direction.")
    source: str


# Public sources of the figures below. NVIDIA's datasheets quote bf16 with 2:4 sparsity; the dense
# rates are half, as NVIDIA's own cost model (aiconfigurator's system files) lists them.
_AIC = "https://github.com/ai-dynamo/aiconfigurator/blob/main/aic-core/src/aiconfigurator_core/systems/"
_GB300 = (
    "NVIDIA GB300 NVL72 datasheet (https://www.nvidia.com/en-us/data-center/gb300-nvl72/) and 'Inside NVIDIA "
    "Blackwell Ultra' (https://developer.nvidia.com/blog/inside-nvidia-blackwell-ultra-the-chip-powering-the-ai-"
    "factory-era/): 72 GPUs on NVLink 5 at 1.8 TB/s per GPU (900 GB/s per direction), 288 GB HBM3e at 8 TB/s "
    f"(284,208 MiB visible to CUDA); 2,500 TFLOP/s dense bf16 ({_AIC}gb300.yaml), dense FP8 taken as twice "
    "that; one ConnectX-8 at 800 Gb/s per GPU (NVL72 AI factory reference architecture, https://docs.nvidia.com/enterprise-reference-architectures/"
    "nvl72-ai-factory/latest/components.html)"
)
_GB200 = (
    "NVIDIA GB200 NVL72 datasheet (https://www.nvidia.com/en-us/data-center/gb200-nvl72/) and DGX GB200 user "
    "guide (https://docs.nvidia.com/dgx/dgxgb200-user-guide/hardware.html): 72 GPUs on NVLink 5 at 1.8 TB/s per "
    "GPU (900 GB/s per direction), 186 GB HBM3e at 8 TB/s (189,471 MiB visible to CUDA), one ConnectX-7 at "
    f"400 Gb/s per GPU; 2,500 TFLOP/s dense bf16 ({_AIC}gb200.yaml), dense FP8 taken as twice that"
)
_DGX_HOPPER = (
    "8 GPUs per node on NVLink 4, one ConnectX-7 at 400 Gb/s per GPU (DGX BasePOD reference architecture, "
    "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
    "core-components.html)"
)
_H200 = (
    "NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): H200 SXM, 141 GB HBM3e at 4.8 TB/s, "
    "NVLink 900 GB/s (450 GB/s per direction), bf16 1,979 TFLOP/s with sparsity (989 dense, "
    f"{_AIC}h200_sxm.yaml), FP8 3,958 with sparsity (1,979 dense); " + _DGX_HOPPER
)
_H100 = (
    "NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/): H100 SXM, 80 GB HBM3 at 3.35 TB/s, "
    "NVLink 900 GB/s (450 GB/s per direction), bf16 1,979 TFLOP/s with sparsity (989 dense, "
    f"{_AIC}h100_sxm.yaml), FP8 3,958 with sparsity (1,979 dense); " + _DGX_HOPPER
)

# mok.fp8 on Hopper (sm_90, the H200's kernels on the H100 too): bf16 time / FP8 time, forward + backward
# with the weights kept, 1.20-1.22 on qwen3-30b-a3b, 1.27-1.29 on mixtral-8x7b, 1.26-1.28 on deepseek-v3
# with the Gluon FP8 kernels' pipelined steps (BENCHMARKS.md, "f14-f15 and a K step's cycles", commit
# 7e6c7b9; 1.13-1.21 at 4aaa485, 0.90-0.93 with the Triton kernels at d9c430a); the smallest of the
# three. On an H100 (c2f2831's kernels, seven rounds): 1.18-1.24 mixtral, 1.20-1.26 qwen3, 1.32-1.37
# deepseek-v3, where cuBLAS's blockwise FP8 GEMM is 1.56-1.65x its bf16 GEMM, not the datasheets' 2x
# (BENCHMARKS.md, "FP8 against its own ceiling"). On the H200 at c2f901e (two rounds, session 42): 1.31
# mixtral, 1.23-1.25 qwen3, 1.31-1.32 deepseek-v3 ("The 1.3x on the H200, two rounds"): the smallest,
# qwen3's, is this. Remeasure when the FP8 kernels change.
HOPPER_FP8_SPEEDUP = 1.23

MACHINES: dict[str, Machine] = {
    m.name: m
    for m in (
        Machine(name="gb300-nvl72", gpu="GB300", nvlink_domain=72, hbm_gib=277.5, hbm_tb_s=8.0, bf16_tflops=2500,
                fp8_tflops=5000, nvlink_gb_s=900, scale_out_gb_s=100, source=_GB300),
        Machine(name="gb200-nvl72", gpu="GB200", nvlink_domain=72, hbm_gib=185.0, hbm_tb_s=8.0, bf16_tflops=2500,
                fp8_tflops=5000, nvlink_gb_s=900, scale_out_gb_s=50, source=_GB200),
        Machine(name="hgx-h200", gpu="H200", nvlink_domain=8, hbm_gib=141.0, hbm_tb_s=4.8, bf16_tflops=989,
                fp8_tflops=1979, fp8_speedup=HOPPER_FP8_SPEEDUP, nvlink_gb_s=450, scale_out_gb_s=50, source=_H200),
        Machine(name="hgx-h100", gpu="H100", nvlink_domain=8, hbm_gib=80.0, hbm_tb_s=3.35, bf16_tflops=989,
                fp8_tflops=1979, fp8_speedup=HOPPER_FP8_SPEEDUP, nvlink_gb_s=450, scale_out_gb_s=50, source=_H100),
        Machine(name="h200-measured", gpu="H200", nvlink_domain=1, hbm_gib=139.8, hbm_tb_s=4.1, bf16_tflops=742,
                fp8_tflops=1190, fp8_speedup=HOPPER_FP8_SPEEDUP, nvlink_gb_s=0, scale_out_gb_s=0,
                source="measured on this project's H200: device copy 4.1 TB/s, dense bf16 GEMM 742 TFLOP/s; dense "
                       "FP8 1.6x that (cuBLASLt's blockwise FP8 GEMM, scaled as mok.fp8 scales, 1.59-1.67x the bf16 "
                       "GEMM in the same processes: 1029-1063 against 623-670 TFLOP/s, BENCHMARKS.md, session 42)"),
        Machine(name="cpu", gpu="CPU", nvlink_domain=1, hbm_gib=16.0, hbm_tb_s=0.02, bf16_tflops=0.1, fp8_tflops=0.1,
                nvlink_gb_s=0, scale_out_gb_s=0, source="a nominal 2-core CPU with 16 GiB for the quickstart (rough)"),
    )
}  # fmt: skip


class ModelShape(BaseModel):
    """The MoE part of a model (its shape and what each expert computes), and the size of everything else.

    The expert MLP is stated with MoKConfig's field names (`expert_kind`, `expert_activation`,
    `activation_clamp`, `glu_linear_offset`, `expert_fc1_bias`, `expert_fc2_bias`; formulas in
    mok_plugin/experts.py); the default is bias-free SwiGLU. GPT-OSS, for example, states
    `expert_activation: quick_gelu`, `activation_clamp: 7.0`, `glu_linear_offset: 1.0` and both biases.
    Those fields are strict (a choice from the list, no "yes" for a bool, no "7" for a float) and
    checked together: a clamp or offset on a non-glu expert, a linear expert that is not H x H, has
    an fc1 bias or shared experts is an error naming the `model.` fields.

    `source` names where the shape comes from: the model's own publication, for example its
    `config.json` on Hugging Face (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct,
    Qwen/Qwen3-235B-A22B, Qwen/Qwen3-30B-A3B, zai-org/GLM-4.5, openai/gpt-oss-120b) or its technical
    report (DeepSeek-V3: arXiv:2412.19437).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # Sizes have MoKConfig's bound (config.MAX_DIM): the planner multiplies them.
    num_layers: int = Field(gt=0, le=MAX_DIM)
    moe_layers: int = Field(gt=0, le=MAX_DIM)
    hidden_size: int = Field(gt=0, le=MAX_DIM)
    ffn_hidden_size: int = Field(gt=0, le=MAX_DIM, description="One routed expert's intermediate size.")
    num_experts: int = Field(gt=0, le=MAX_DIM)
    top_k: int = Field(gt=0, le=MAX_DIM)
    shared_ffn_hidden_size: int = Field(
        default=0, ge=0, le=MAX_DIM, description="Total shared-expert intermediate size."
    )
    # The expert MLP (routed and shared experts alike), as MoKConfig states it.
    expert_kind: ExpertKind = Field(
        default="glu", description="glu (gated, fc1 has 2I rows), mlp (fc1 has I rows) or linear (H x H)."
    )
    expert_activation: ExpertActivation = Field(default="silu", description="silu + glu is SwiGLU.")
    activation_clamp: float | None = Field(
        default=None, gt=0.0, le=MAX_FACTOR, allow_inf_nan=False, strict=True,
        description="glu only (GPT-OSS's swiglu_limit, 7.0): the gate clamped above, the linear half to +-this.",
    )  # fmt: skip
    glu_linear_offset: float = Field(
        default=0.0, ge=-MAX_FACTOR, le=MAX_FACTOR, allow_inf_nan=False, strict=True,
        description="glu only (GPT-OSS: 1.0): added to the linear half.",
    )  # fmt: skip
    expert_fc1_bias: bool = Field(default=False, strict=True, description="The first expert linear has a bias.")
    expert_fc2_bias: bool = Field(default=False, strict=True, description="The second expert linear has a bias.")
    dense_params_b: float = Field(
        ge=0,
        le=1e6,  # a million billion: far above any model, and finite arithmetic in the planner
        allow_inf_nan=False,
        description="Billions of parameters outside routed and shared experts (attention, embeddings, dense FFN).",
    )
    source: str = ""

    @model_validator(mode="after")
    def _check_expert_family(self) -> ModelShape:
        problems = family_field_problems(
            self.family_fields(),
            "model",
            self.hidden_size,
            self.ffn_hidden_size,
            f"shared_ffn_hidden_size={self.shared_ffn_hidden_size}" if self.shared_ffn_hidden_size else None,
        )
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def family_fields(self) -> dict[str, Any]:
        """The MoKConfig fields of the expert MLP, as this section states them."""
        return {name: getattr(self, name) for name in FAMILY_FIELDS}

    @property
    def expert_family(self) -> MoKExpertFamily:
        """What each expert computes (mok_plugin/experts.py), as MoKConfig.expert_family gives it."""
        return MoKExpertFamily.from_config_fields(self.family_fields())


class ParallelLayout(BaseModel):
    """How the run's GPUs are split: tensor, pipeline, expert, expert-tensor and data parallelism."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(default=1, gt=0, le=MAX_DIM)
    pp: int = Field(default=1, gt=0, le=MAX_DIM)
    ep: int = Field(default=1, gt=0, le=MAX_DIM)
    expert_tp: int = Field(default=1, gt=0, le=MAX_DIM)
    dp: int = Field(default=1, gt=0, le=MAX_DIM)
    seq_length: int = Field(gt=0, le=MAX_DIM)
    micro_batch: int = Field(default=1, gt=0, le=MAX_DIM)
    redundant_experts: int = Field(
        default=0, ge=0, le=MAX_DIM, description="Extra expert slots so that EP divides them."
    )
    activation_recompute: Literal["none", "selective", "full"] = "selective"

    @property
    def world_size(self) -> int:
        """GPUs in the run: tp x pp x dp (expert parallelism splits the data-parallel ranks)."""
        return self.tp * self.pp * self.dp


class DeepSpeedGating(BaseModel):
    """The optional `deepspeed:` section: the gating arguments of DeepSpeed's `MoE(...)`
    (deepspeed.moe.layer.MoE), with DeepSpeed's defaults for the keys it leaves out.

    `mok compare --framework deepspeed` gives them to the stock layer and to
    mok_plugin.deepspeed.MoE alike. Without the section the harness keeps its own setting
    (dropless, no random routing; mok_plugin/compare/models.py), so that existing configs train as before.
    They are DeepSpeed constructor arguments, not MoKConfig knobs (MoK's `capacity_factor` is
    another rule, ceil(T*K/E*f), and None is dropless), hence their own section; and they are not the
    model's shape, which Megatron and the planner read too. Strict: a number for a factor (no
    "1.0"), a bool for a switch (no "yes"), `null`, RSample or Jitter for the noisy gate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    capacity_factor: float = Field(
        default=1.0, gt=0.0, le=MAX_FACTOR, allow_inf_nan=False, strict=True,
        description="Training: per expert max(ceil(T / E * factor * (1, 2, k at k = 1, 2, >= 3)), min_capacity).",
    )  # fmt: skip
    eval_capacity_factor: float = Field(
        default=1.0, gt=0.0, le=MAX_FACTOR, allow_inf_nan=False, strict=True,
        description="The same in eval mode.",
    )  # fmt: skip
    min_capacity: int = Field(
        default=4, ge=0, le=MAX_DIM, strict=True,
        description="The least capacity per expert (top-1: at most the tokens per micro-batch, DeepSpeed asserts).",
    )  # fmt: skip
    drop_tokens: bool = Field(default=True, strict=True, description="False: dropless (no capacity limit).")
    use_rts: bool = Field(
        default=True, strict=True, description="Top-1: random token selection, which tokens an expert keeps."
    )
    noisy_gate_policy: Literal["RSample", "Jitter"] | None = Field(
        default=None, description="RSample (top-1: Gumbel noise on the choice) or Jitter (multiplicative input noise)."
    )
    top2_2nd_expert_sampling: bool = Field(
        default=True, strict=True, description="Top-2: the second expert drawn with Gumbel noise on the logits."
    )

    def moe_kwargs(self) -> dict[str, Any]:
        """The arguments of deepspeed.moe.layer.MoE (and mok_plugin.deepspeed.MoE) this section sets."""
        return self.model_dump()


DEEPSPEED_DEFAULTS = DeepSpeedGating()  # DeepSpeed's own defaults (deepspeed.moe.layer.MoE's signature)
