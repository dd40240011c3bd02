"""The FP8 experts as a backend's experts function, the one MoKMoE calls (the contract of
`ops.moe_experts`): for the blockwise recipe the Triton kernels (`pipeline.fp8_moe_experts`) or, on
the reference backend, the PyTorch oracle (`reference.moe_experts_fp8_reference`) made
differentiable, so that a layer with mok.fp8 runs on the CPU too and computes the same numbers there.

The tensorwise and mxfp8 recipes run the differentiable oracle on every backend, CUDA included (in
fp32 on a GPU, fp64 on the CPU): the recipe's numbers, not fused kernels (the Triton kernels implement
blockwise only). Under mxfp8 the oracle's GEMMs multiply the dequantised values, unless
MOK_MXFP8_MMA=1 asks for the block-scaled MMA kernel (kernels/mxfp8.py: Blackwell's, emulated
elsewhere) with the quantised values and their E8M0 exponents, as TE's MXFP8 GEMMs do. Opt-in because
that kernel has not run on Blackwell here (module docstring of kernels/mxfp8.py)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch

from mok_plugin.config import triton_interpreter_from_env
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.fp8.recipe import FP8Recipe
from mok_plugin.fp8.reference import moe_experts_fp8_reference
from mok_plugin.fp8.weight_copies import FP8WeightCopies
from mok_plugin.schedule import MoKSchedule
from mok_plugin.wgrad import note_deferral

__all__ = [
    "MXFP8_MMA_SETTING",
    "block_scaled_mma_chosen",
    "fp8_experts_function",
    "moe_experts_fp8_reference_autograd",
    "runs_pytorch_path",
]

MXFP8_MMA_SETTING = "MOK_MXFP8_MMA"


class _FP8ReferenceExperts(torch.autograd.Function):
    """The oracle's output, and its gradients from the oracle again (forward recomputed: it is the
    CPU's reference, where memory matters more than time)."""

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, schedule, recipe, family,  # type: ignore[override]
                compute_dtype, block_scaled_mma):  # fmt: skip
        ctx.save_for_backward(x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
        ctx.schedule, ctx.recipe, ctx.family, ctx.compute_dtype = schedule, recipe, family, compute_dtype
        ctx.block_scaled_mma = block_scaled_mma
        note_deferral(ctx, gate_up_proj, down_proj, gate_up_bias, down_bias)  # --delay-wgrad-compute (wgrad.py)
        with _full_fp32_gemms(compute_dtype):
            return moe_experts_fp8_reference(x, topk_weights, gate_up_proj, down_proj, schedule, recipe, family=family,
                                             gate_up_bias=gate_up_bias, down_bias=down_bias,
                                             compute_dtype=compute_dtype,
                                             block_scaled_mma=block_scaled_mma)["out"]  # fmt: skip

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        x, topk_weights, gate_up_proj, down_proj, b1, b2 = ctx.saved_tensors
        with _full_fp32_gemms(ctx.compute_dtype):
            grads = moe_experts_fp8_reference(x, topk_weights, gate_up_proj, down_proj, ctx.schedule, ctx.recipe,
                                              d_out=d_out, family=ctx.family, gate_up_bias=b1, down_bias=b2,
                                              compute_dtype=ctx.compute_dtype,
                                              block_scaled_mma=ctx.block_scaled_mma)  # fmt: skip
        d_topk = grads["d_topk_weights"].to(topk_weights.dtype)
        weight_grads = tuple(grads[k] for k in ("d_gate_up_proj", "d_down_proj", "d_gate_up_bias", "d_down_bias"))
        if ctx.deferral is not None:  # handed over when the queue runs, as the other backends' are
            ctx.deferral.add(functools.partial(tuple, weight_grads), ctx.weights)
            weight_grads = (None,) * 4
        return grads["d_x"], d_topk, *weight_grads, None, None, None, None, None


@contextlib.contextmanager
def _full_fp32_gemms(compute_dtype: torch.dtype) -> Iterator[None]:
    """fp32 GEMMs without TF32 even where the user turned it on (torch.set_float32_matmul_precision,
    allow_tf32): TF32 keeps 10 of a dequantised operand's 23 mantissa bits (tensorwise's scales are
    not powers of two), where the recipe's FP8 GEMM multiplies the FP8 values exactly and accumulates
    in fp32."""
    if compute_dtype != torch.float32:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def moe_experts_fp8_reference_autograd(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    schedule: MoKSchedule,
    recipe: FP8Recipe,
    family: MoKExpertFamily = SWIGLU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = torch.float64,
) -> torch.Tensor:
    """`moe_experts_fp8_reference`'s output, differentiable (the contract of fp8_moe_experts).
    compute_dtype None: float64 on the CPU, float32 on a GPU (`_runtime_compute_dtype`); mxfp8's GEMMs
    by block-scaled MMA where `block_scaled_mma_chosen`."""
    dtype = _runtime_compute_dtype(x.device) if compute_dtype is None else compute_dtype
    return _FP8ReferenceExperts.apply(x, topk_weights.float(), gate_up_proj, down_proj, gate_up_bias, down_bias,
                                      schedule, recipe, family, dtype,
                                      block_scaled_mma_chosen(recipe, x.device))  # fmt: skip


def block_scaled_mma_chosen(recipe: FP8Recipe, device: torch.device) -> bool:
    """Whether the mxfp8 recipe's GEMMs go to the block-scaled MMA kernel (kernels/mxfp8.py) on
    `device`: where MOK_MXFP8_MMA=1 and Triton runs there (a CUDA GPU: Blackwell's tcgen05 MMA on
    the data-centre Blackwells, emulated by Triton on others; the CPU under Triton's interpreter).
    Unset or 0: never (the fp32 GEMMs of the dequantised values). Opt-in, Blackwell included, until
    the kernel has run there.

    Raises:
        ValueError: MOK_MXFP8_MMA set to anything but 0 or 1.
    """
    setting = os.environ.get(MXFP8_MMA_SETTING, "0")
    if setting not in ("0", "1"):
        raise ValueError(f"{MXFP8_MMA_SETTING}={setting!r}: expected 0 (the default) or 1")
    if recipe.scaling != "mxfp8" or setting == "0":
        return False
    return device.type == "cuda" or triton_interpreter_from_env()


def _runtime_compute_dtype(device: torch.device) -> torch.dtype:
    """fp64 where the oracle is the CPU's reference; fp32 on a GPU, where fp64 GEMMs are slow and every
    dequantised operand twice the size (exact in fp32 for power-of-two scales; tensorwise's fp32
    scale_inv times an FP8 value rounds once, at 2^-24)."""
    return torch.float64 if device.type == "cpu" else torch.float32


def runs_pytorch_path(recipe: FP8Recipe) -> bool:
    """Whether `recipe` runs MoK's PyTorch FP8 path on every backend (no kernels for it)."""
    return recipe.scaling != "blockwise"


def fp8_experts_function(recipe: FP8Recipe, backend: str, weight_copies: FP8WeightCopies) -> Callable:
    """The experts function of `backend` ("triton" or "reference") under `recipe`: called as
    f(x, topk_weights, gate_up_proj, down_proj, schedule, family=, gate_up_bias=, down_bias=). The
    Triton one keeps the weights' FP8 copies in `weight_copies` (the oracle quantises every call).
    tensorwise and mxfp8: the differentiable oracle on either backend (module docstring)."""
    if runs_pytorch_path(recipe):
        return functools.partial(moe_experts_fp8_reference_autograd, recipe=recipe, compute_dtype=None)
    if backend == "triton":
        from mok_plugin.fp8.pipeline import fp8_moe_experts  # imports Triton, which the reference does not need

        return functools.partial(fp8_moe_experts, recipe=recipe, weight_copies=weight_copies)
    return functools.partial(moe_experts_fp8_reference_autograd, recipe=recipe)
