"""Which stock MoE layer the comparison runs, and why: the report's "stock:" line.

Megatron: where Transformer Engine imports and the run is on a GPU, the stock side is what a
performance-minded launch (`--transformer-impl transformer_engine --moe-grouped-gemm
--moe-permute-fusion`) builds: the MoE builder of Megatron's own TE spec,
`get_gpt_layer_with_transformer_engine_spec(num_experts=E, moe_grouped_gemm=True).submodules.mlp`,
whose experts are TEGroupedMLP (TE's grouped GEMM), with `moe_grouped_gemm=True` and, where TE has
it (Megatron asks for TE 2.1 or later), `moe_permute_fusion=True`. Otherwise it is the local spec's
SequentialMLP (one GEMM per expert and linear), and the report says why TE's path could not run.
DeepSpeed: `deepspeed.moe.layer.MoE`, its only training MoE layer.

The harness then checks what Megatron actually built (`confirm_built`): a TE spec whose TE lacks
the grouped linear falls back to SequentialMLP, and the report names the class that ran.

The PyTorch grouped_mm path (`use_grouped_mm_experts`), trained beside stock and MoK on the same
config: the stand-in for a grouped stock path where the stock side is not one (no TE, no GPU, or
DeepSpeed), for reference where it is. It is Megatron's stock MoELayer (router, aux loss and token
dispatcher as configured for the stock side, including moe_permute_fusion) with its SequentialMLP
experts computed by two `grouped_mm` calls instead of one GEMM per expert:

    h = x_rows @ W1[e]^T (+ b1[e]);  a = act(h) * prob;  y = a @ W2[e]^T (+ b2[e] * prob)

over the same per-expert weights (the stock state dict loads unchanged), the family's activation
written as a PyTorch user writes it (`torch_activation`, the `torch` benchmark provider's). Not a
Megatron option: the report labels it a stand-in. Each forward stacks the experts' weights into
[E, ...] tensors, a copy per step that TE's grouped linear (which takes a list) does not make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mok_plugin.experts import MoKExpertFamily

__all__ = [
    "GROUPED_MM_ERRORS",
    "GroupedMMUnavailable",
    "StockPath",
    "confirm_built",
    "grouped_mm_function",
    "select_stock_path",
    "stock_moe_spec",
    "transformer_engine_capabilities",
    "transformer_engine_status",
    "use_grouped_mm_experts",
]

NO_GROUPED = "so TEGroupedMLP/grouped GEMM cannot run"


@dataclass(frozen=True, slots=True)
class StockPath:
    """The stock layer the harness builds, and the reason for that choice."""

    framework: str  # "megatron" or "deepspeed"
    experts: str  # the experts class: "TEGroupedMLP", "SequentialMLP", or DeepSpeed's "Experts"
    spec: str  # "Transformer Engine spec", "local spec" (Megatron), "" (DeepSpeed)
    grouped_gemm: bool  # moe_grouped_gemm: one grouped GEMM per linear, not one GEMM per expert
    permute_fusion: bool  # moe_permute_fusion: TE's fused token permute / unpermute
    reason: str  # why this path (and, where it is not TE's grouped one, why that could not run)

    @property
    def transformer_engine(self) -> bool:
        """Built from Megatron's Transformer Engine spec."""
        return self.spec == "Transformer Engine spec"

    def config_options(self) -> dict[str, bool]:
        """The TransformerConfig fields this path sets (Megatron)."""
        return {"moe_grouped_gemm": self.grouped_gemm, "moe_permute_fusion": self.permute_fusion}

    def describe(self) -> str:
        """One line: which stock path ran, and why."""
        if self.framework == "deepspeed":
            return f"DeepSpeed deepspeed.moe.layer.MoE ({self.experts}: one expert module at a time) — {self.reason}"
        options = (
            f": moe_grouped_gemm={self.grouped_gemm}, moe_permute_fusion={self.permute_fusion}"
            if self.transformer_engine
            else ""
        )
        return f"Megatron {self.experts} ({self.spec}{options}) — {self.reason}"

    def summary(self) -> dict:
        """The JSON form (the report's "stock_path" block)."""
        return {**dataclasses.asdict(self), "transformer_engine": self.transformer_engine,
                "description": self.describe()}  # fmt: skip


def transformer_engine_status() -> tuple[str | None, str]:
    """(TE's version, "") when Transformer Engine and its PyTorch extension import, else (None, why)."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (what Megatron's TE modules build on)
    except Exception as error:  # ImportError, or an OSError / RuntimeError from its CUDA libraries
        message = (str(error).strip().splitlines() or [""])[0]
        return None, message if isinstance(error, ImportError) and message else f"{type(error).__name__}: {message}"
    return str(getattr(transformer_engine, "__version__", "(version unknown)")), ""


def transformer_engine_capabilities() -> dict[str, bool]:
    """What Megatron-Core finds in the installed Transformer Engine: "grouped_linear" (the
    TEColumnParallelGroupedLinear that TEGroupedMLP needs) and "permute_fusion" (the fused
    permute / unpermute that moe_permute_fusion needs). Call only where TE imports."""
    from megatron.core.extensions import transformer_engine as megatron_te
    from megatron.core.transformer.moe import moe_utils

    fused = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
             "fused_sort_chunks_by_index_with_probs", "fused_unpermute")  # fmt: skip
    return {
        "grouped_linear": bool(megatron_te.HAVE_TE) and megatron_te.TEColumnParallelGroupedLinear is not None,
        "permute_fusion": bool(megatron_te.HAVE_TE) and all(getattr(moe_utils, n, None) is not None for n in fused),
    }


def _local(reason: str) -> StockPath:
    return StockPath("megatron", "SequentialMLP", "local spec", False, False, reason)


def select_stock_path(framework: str, device: torch.device) -> StockPath:
    """The stock layer for `framework` on `device` (see the module docstring)."""
    if framework == "deepspeed":
        return StockPath("deepspeed", "Experts", "", False, False,
                         "DeepSpeed's only training MoE layer; it has no grouped-GEMM expert path")  # fmt: skip
    version, why = transformer_engine_status()
    on_gpu = device.type == "cuda"
    if version is None:
        cpu = "" if on_gpu else " and this run is on the CPU"
        return _local(f"Transformer Engine not importable ({why}){cpu}, {NO_GROUPED}")
    if not on_gpu:
        return _local(f"Transformer Engine {version} imports, but this run is on the CPU, {NO_GROUPED} (CUDA only)")
    capabilities = transformer_engine_capabilities()
    if not capabilities["grouped_linear"]:
        return _local(f"Transformer Engine {version} has no grouped linear for Megatron "
                      f"(TEColumnParallelGroupedLinear), {NO_GROUPED}")  # fmt: skip
    fusion = capabilities["permute_fusion"]
    reason = f"Transformer Engine {version} imports and a GPU is present: Megatron's TE spec with TE's grouped GEMM"
    reason += " and fused permutation" if fusion else "; this TE has no fused permutation (Megatron asks for 2.1+)"
    return StockPath("megatron", "TEGroupedMLP", "Transformer Engine spec", True, fusion, reason)


def stock_moe_spec(num_experts: int, transformer_engine: bool):
    """The MoELayer builder (a partial of MoELayer) of Megatron's own spec: with
    `transformer_engine`, the MLP of `get_gpt_layer_with_transformer_engine_spec(num_experts=E,
    moe_grouped_gemm=True)` (TEGroupedMLP experts); else the local spec's (SequentialMLP)."""
    if transformer_engine:
        from megatron.core.models.gpt import gpt_layer_specs

        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True
        )
        return layer_spec.submodules.mlp
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)


def confirm_built(path: StockPath, experts: torch.nn.Module) -> StockPath:
    """`path`, corrected to the experts class Megatron actually built (`experts`: a stock layer's
    `.experts`) where it differs; DeepSpeed's is left as it is."""
    built = type(experts).__name__
    if path.framework != "megatron" or built == path.experts:
        return path
    return dataclasses.replace(path, experts=built, grouped_gemm=built == "TEGroupedMLP",
                               reason=f"{path.reason}; Megatron built {built}, not {path.experts}")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The PyTorch grouped_mm stand-in
# ------------------------------------------------------------------------------------------------


class GroupedMMUnavailable(RuntimeError):
    """This torch cannot run the grouped_mm stand-in; the message says why."""


# What torch raises where grouped_mm exists but cannot run these tensors (a device or dtype without
# a kernel, strides it does not accept); the harness reports the message in the stand-in's row.
GROUPED_MM_ERRORS = (GroupedMMUnavailable, RuntimeError, NotImplementedError, TypeError)


def grouped_mm_function() -> Callable:
    """torch's grouped GEMM: `torch.nn.functional.grouped_mm`, or `torch._grouped_mm` before it was public.

    Raises:
        GroupedMMUnavailable: this torch has neither.
    """
    from mok_plugin.bench.providers import ProviderUnavailable
    from mok_plugin.bench.providers import grouped_mm_function as lookup

    try:
        return lookup()
    except ProviderUnavailable as error:
        raise GroupedMMUnavailable(str(error)) from None


def use_grouped_mm_experts(layer, family: MoKExpertFamily) -> None:
    """Make one stock Megatron MoELayer's SequentialMLP experts run as two grouped_mm calls (this
    instance only; its parameters and state-dict keys stay SequentialMLP's).

    Args:
        layer: a stock `MoELayer` whose `.experts` is SequentialMLP (local spec), EP = 1.
        family: the experts' family, as Megatron's flags make them compute it (`check_framework_family`).
    Raises:
        GroupedMMUnavailable: this torch has no grouped_mm.
    """
    from mok_plugin.bench.providers import torch_activation

    grouped_mm = grouped_mm_function()
    experts = layer.experts.local_experts
    num_experts = len(experts)

    def forward(hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **unused):
        """hidden [R, H] in expert order, tokens_per_expert int [E] (on any device), probs fp32 [R]
        -> ([R, H], None), as SequentialMLP.forward."""
        counts = tokens_per_expert.to(device=hidden.device, dtype=torch.int64)
        offsets = counts.cumsum(0).to(torch.int32)
        scale = probs.unsqueeze(-1)
        rows = None
        if family.fc1_bias or family.fc2_bias:  # the expert of each row, for its bias (no host sync)
            index = torch.arange(num_experts, device=hidden.device)
            rows = torch.repeat_interleave(index, counts, output_size=hidden.shape[0])
        w1 = torch.stack([e.linear_fc1.weight for e in experts])  # [E, fc1 rows, H]
        h = grouped_mm(hidden, w1.transpose(-2, -1), offs=offsets)
        if family.fc1_bias:
            h = h + torch.stack([e.linear_fc1.bias for e in experts])[rows]
        a = (torch_activation(h, family) * scale).to(h.dtype)  # Megatron's experts scale before fc2
        w2 = torch.stack([e.linear_fc2.weight for e in experts])  # [E, H, I]
        y = grouped_mm(a, w2.transpose(-2, -1), offs=offsets)
        if family.fc2_bias:  # Megatron adds an expert's fc2 bias times the routing weight
            y = y + (torch.stack([e.linear_fc2.bias for e in experts])[rows] * scale).to(y.dtype)
        return y, None

    layer.experts.forward = forward
