"""The layer's implementations under test, each a small function, and the check they pass first.

A provider is `provider(inputs, shape, family=SWIGLU) -> run`, where
`run(x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias) -> out` computes the routed
experts of `family` (mok_plugin/experts.py; bench/families.py names them) with the benchmark's
routing (`inputs["topk_ids"]`). A tensor the family does not have is passed as None: gate_up_proj
for a linear expert, a bias the family lacks.
  mok-mega       the triton backend, persistent megakernel (one launch per pass), schedule included;
                 bias-free SwiGLU only (the megakernel computes nothing else)
  mok-multi      the triton backend, one launch per GEMM, schedule included; every family
  torch          the plain PyTorch path: index gather, grouped_mm fc1 (+ bias), the family's
                 activation written as a user would (F.silu, F.gelu, x * sigmoid(1.702 x) with its
                 clamps, ...), grouped_mm fc2 (+ bias), weighted fixed-order sum over k; every family
  megatron       Megatron-Core's stock MoELayer, when megatron-core is importable; bias-free SwiGLU
  liger          Liger-Kernel's fused MoE, when liger-kernel is importable; bias-free SwiGLU
A peer that is not installed, or cannot compute the family, raises ProviderUnavailable, which the
benchmark prints as the reason it skipped it. Every provider is checked against the reference
(`check_provider`) before it is timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mok_plugin import ops
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.reference import moe_experts_reference
from mok_plugin.routing import count_per_expert
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule
from mok_plugin.testing import TOLERANCES, MoEShape, free_port

__all__ = [
    "DTYPE",
    "PROVIDERS",
    "ProviderUnavailable",
    "grouped_mm_function",
    "build_megatron_moe",
    "check",
    "check_provider",
    "fwd_bwd",
    "leaves",
    "make_inputs",
    "megatron_run",
    "provider_liger",
    "provider_megatron",
    "provider_mok",
    "provider_reference",
    "provider_torch",
    "result_names",
    "torch_activation",
]

DTYPE = torch.bfloat16
# A run's arguments, in order; fwd_bwd returns the output, then the gradient of each one the family has.
LEAVES = ("x", "topk_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
# quick_gelu's slope (GPT-OSS's alpha, Megatron's quick_gelu).
QUICK_GELU_ALPHA = 1.702


class ProviderUnavailable(RuntimeError):
    """A peer that cannot run here (not installed, or this torch lacks what it needs); the message
    says why and how to get it."""


# ------------------------------------------------------------------------------------------------
# Inputs and the pass every provider runs
# ------------------------------------------------------------------------------------------------


def make_inputs(
    shape: MoEShape, routing: str, seed: int, device: str = "cuda", family: MoKExpertFamily = SWIGLU
) -> dict[str, torch.Tensor]:
    """Seeded inputs of one benchmark case, bf16 tensors and fp32 routing weights.

    Args:
        shape: (T, H, I, E, K); I = H for a linear expert.
        routing: "uniform", or "skewed" (Zipf-like: expert e drawn with probability ~ 1/(e+1)).
        seed: the generator's seed (on `device`).
        family: the experts' family; SwiGLU's inputs are drawn first and the same for every family
            with a [E, 2I, H] gate_up_proj, so a bias-free SwiGLU case is what it always was.
    Returns:
        {"x": [T, H], "topk_ids": int64 [T, K], "topk_weights": fp32 [T, K], "gate_up_proj": [E, fc1 rows, H]
        (not for a linear expert), "down_proj": [E, H, I], "d_out": [T, H], and the family's biases
        "gate_up_bias": [E, fc1 rows], "down_bias": [E, H] (values of about 0.5, so that a provider
        that drops one fails the check)}.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    T, H, I, E, K = shape.as_tuple()
    fc1 = family.fc1_width(I)
    if routing == "uniform":
        probs = torch.ones(T, E, device=device)
    else:  # Zipf-like: expert e drawn with probability ~ 1/(e+1)
        probs = (1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32)).expand(T, E)
    topk_ids = torch.multinomial(probs, K, replacement=False, generator=g)
    topk_weights = torch.softmax(torch.randn(T, K, device=device, generator=g), dim=-1)
    inputs = {"x": torch.randn(T, H, device=device, generator=g).to(DTYPE), "topk_ids": topk_ids,
              "topk_weights": topk_weights}  # fmt: skip
    if family.kind != "linear":
        inputs["gate_up_proj"] = _expert_weights(E, fc1, H, g, device)
    inner = family.intermediate_size(H, I)
    inputs["down_proj"] = _expert_weights(E, H, inner, g, device)
    inputs["d_out"] = torch.randn(T, H, device=device, generator=g).to(DTYPE)
    if family.fc1_bias:
        inputs["gate_up_bias"] = (0.5 * torch.randn(E, fc1, device=device, generator=g)).to(DTYPE)
    if family.fc2_bias:
        inputs["down_bias"] = (0.5 * torch.randn(E, H, device=device, generator=g)).to(DTYPE)
    return inputs


def _expert_weights(E: int, rows: int, cols: int, g: torch.Generator, device: str) -> torch.Tensor:
    """bf16 [E, rows, cols] of N(0, 1 / cols), drawn in fp32 an expert at a time: drawn whole, the
    fp32 draw of 4096,7168,2048,384,8's gate_up_proj alone (42 GiB) did not fit an 80 GB H100."""
    out = torch.empty(E, rows, cols, dtype=DTYPE, device=device)
    for e in range(E):
        out[e] = torch.randn(rows, cols, device=device, generator=g) / cols**0.5
    return out


def leaves(inputs: dict) -> list[torch.Tensor | None]:
    """Fresh leaves of a run's arguments (LEAVES order), requiring grad; None where the family has none."""
    return [None if inputs.get(k) is None else inputs[k].detach().requires_grad_() for k in LEAVES]


def result_names(family: MoKExpertFamily = SWIGLU) -> list[str]:
    """What fwd_bwd returns for `family`: "output", then "d_<leaf>" for each argument it has."""
    absent = {"gate_up_proj"} if family.kind == "linear" else set()
    absent |= {"gate_up_bias"} if not family.fc1_bias else set()
    absent |= {"down_bias"} if not family.fc2_bias else set()
    return ["output"] + [f"d_{k}" for k in LEAVES if k not in absent]


def fwd_bwd(fn: Callable, inputs: dict) -> list[torch.Tensor]:
    """One forward and backward of `fn` on fresh leaves: [out, then the gradient of each leaf the
    inputs hold, in LEAVES order] (for SwiGLU: out, d_x, d_topk_weights, d_gate_up_proj, d_down_proj)."""
    args = leaves(inputs)
    out = fn(*args)
    grads = torch.autograd.grad(out, [a for a in args if a is not None], inputs["d_out"])
    return [out.detach(), *grads]


# At an h within rounding of a kink of the activation (relu at 0, a clamp's edge), an implementation
# that accumulates fp32 and the fp64 reference may take different sides: that one element of dh
# changes by its whole size, and so do the fc1-side gradients built from it (a row of dW1 and of
# dX). Both MoK and the PyTorch path showed it on qwen3-30b-a3b with relu (a few elements of 10^8).
# For those families the fc1-side gradients may have this fraction of elements out of bound.
KINK_OUTLIER_FRACTION = 1e-3
_FC1_SIDE = ("d_x", "d_gate_up_proj", "d_gate_up_bias")


def check(
    results: list[torch.Tensor], expected: list[torch.Tensor], shape: MoEShape, family: MoKExpertFamily = SWIGLU
) -> str | None:
    """None when every tensor is within the bf16 tolerance of the reference, else what failed.

    Compared in slices along dim 0, each of `expected` brought to its result's device (the
    reference may wait in host memory), so the fp32 temporaries stay small at deepseek-v3 size. The
    bound grows with the square root of the length of the sum behind each tensor. For a family
    with a kink (relu, a clamp), the fc1-side gradients may have KINK_OUTLIER_FRACTION of their
    elements out of bound.
    """
    tol = TOLERANCES[DTYPE]
    rows = max(1, shape.T * shape.K // shape.E)
    fc1 = family.fc1_width(shape.I) or shape.H
    growth = {"output": 1, "d_x": fc1, "d_topk_weights": shape.H, "d_gate_up_proj": rows, "d_down_proj": rows,
              "d_gate_up_bias": rows, "d_down_bias": rows}  # fmt: skip
    kinked = family.kind != "linear" and (family.activation == "relu" or family.clamp is not None)
    for name, got, want in zip(result_names(family), results, expected, strict=True):
        scale = max(float(want[i : i + 16].to(got.device).abs().max()) for i in range(0, want.shape[0], 16))
        worst, outside = 0.0, 0
        for i in range(0, want.shape[0], 16):
            a, b = got[i : i + 16].float(), want[i : i + 16].to(got.device).float()
            bound = tol.atol * scale * max(1.0, (growth[name] / 64) ** 0.5) + tol.rtol * b.abs()
            if not torch.isfinite(a).all():
                return f"{name}: non-finite values"
            bad = (a - b).abs() > bound
            if bad.any():
                outside += int(bad.sum())
                worst = max(worst, float((a - b).abs().max()))
        allowed = int(KINK_OUTLIER_FRACTION * want.numel()) if kinked and name in _FC1_SIDE else 0
        if outside > allowed:
            count = f"{outside} of {want.numel()} elements out of bound"
            return f"{name}: max abs err {worst:.3e} (scale {scale:.3e}), {count}"
    return None


def check_provider(
    fn: Callable, inputs: dict, shape: MoEShape, expected: list[torch.Tensor], family: MoKExpertFamily = SWIGLU
) -> dict:
    """The check before any timing: two forward + backward passes, the first against the
    reference (`expected`, from fwd_bwd of provider_reference), the second against the first.

    Returns:
        {"error": None or what was wrong, "bitwise": the two passes are bitwise equal}.
    """
    first = fwd_bwd(fn, inputs)
    error = check(first, expected, shape, family)
    # The first pass waits in host memory while the second runs: on deepseek-v3 the reference's
    # results, both passes' (21 GB each) and the weights did not fit an 80 GB H100 (session 52).
    first = [t.cpu() for t in first]
    second = fwd_bwd(fn, inputs)
    # 16 leading slices at a time, each brought back to the second's device: torch.equal's temporary
    # for a whole weight gradient of the largest shapes (10.5 GiB for 4096,7168,2048,384,8) does not
    # fit beside the reference's and the second pass's.
    bitwise = all(
        torch.equal(a[i : i + 16].to(b.device), b[i : i + 16])
        for a, b in zip(first, second, strict=True)
        for i in range(0, max(1, a.shape[0]), 16)
    )
    return {"error": error, "bitwise": bitwise}


# ------------------------------------------------------------------------------------------------
# Providers: each returns fn(x, topk_weights, gate_up_proj, down_proj, gate_up_bias, down_bias) -> out,
# given the routing and the family
# ------------------------------------------------------------------------------------------------


def _swiglu_only(peer: str, family: MoKExpertFamily) -> None:
    """Raise ProviderUnavailable unless `family` is bias-free SwiGLU, all that `peer` computes here."""
    if not family.is_swiglu:
        raise ProviderUnavailable(f"{peer} computes bias-free SwiGLU experts only, not {family.describe()}")


def provider_mok(variant: str) -> Callable:
    """The triton backend's experts op as a provider; variant "megakernel" (bias-free SwiGLU only,
    as MoKConfig allows it) or "multi_kernel" (every family: the family and its biases go to the op)."""

    def provider(inputs: dict, shape: MoEShape, family: MoKExpertFamily = SWIGLU) -> Callable:
        if variant == "megakernel":
            _swiglu_only("the megakernel (mok-mega)", family)
        ids = inputs["topk_ids"]

        def run(x, w, w13, w2, b1=None, b2=None):
            schedule = build_schedule(ids, shape.E, tile_m=DEFAULT_TILE_M)
            return ops.moe_experts(
                x, w, w13, w2, schedule, variant=variant, family=family, gate_up_bias=b1, down_bias=b2
            )

        return run

    return provider


def grouped_mm_function() -> Callable:
    """torch's grouped GEMM: `torch.nn.functional.grouped_mm`, or `torch._grouped_mm` before it was public.

    Raises:
        ProviderUnavailable: this torch has neither.
    """
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise ProviderUnavailable(
            f"torch {torch.__version__} has no grouped_mm (torch.nn.functional.grouped_mm or torch._grouped_mm)"
        )
    return fn


def torch_activation(h: torch.Tensor, family: MoKExpertFamily) -> torch.Tensor:
    """The family's activation of h [rows, fc1 rows], as a PyTorch user writes it (in h's dtype).

    Written from the models' own definitions, not from mok_plugin.experts, so that the torch
    provider's check against the reference compares two independent implementations.
    """
    if family.kind == "linear":
        return h

    def act(g: torch.Tensor) -> torch.Tensor:
        if family.activation == "silu":
            return F.silu(g)
        if family.activation == "gelu":
            return F.gelu(g)
        if family.activation == "gelu_tanh":
            return F.gelu(g, approximate="tanh")
        if family.activation == "quick_gelu":
            return g * torch.sigmoid(QUICK_GELU_ALPHA * g)
        if family.activation == "relu":
            return F.relu(g)
        return torch.square(F.relu(g))  # squared_relu

    if family.kind == "mlp":
        return act(h)
    gate, up = h.chunk(2, dim=-1)  # gate rows first
    if family.clamp is not None:  # GPT-OSS: x_glu.clamp(max=limit), x_linear.clamp(-limit, limit)
        gate = gate.clamp(max=family.clamp)
        up = up.clamp(min=-family.clamp, max=family.clamp)
    return act(gate) * (up + family.linear_offset)


def provider_torch(inputs: dict, shape: MoEShape, family: MoKExpertFamily = SWIGLU) -> Callable:
    """The PyTorch path: index gather, grouped_mm fc1 (+ its bias), the family's activation,
    grouped_mm fc2 (+ its bias), times the routing weight, summed over k in order."""
    grouped_mm = grouped_mm_function()
    T, H, I, E, K = shape.as_tuple()
    ids = inputs["topk_ids"]

    def run(x, w, w13, w2, b1=None, b2=None):
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        expert_of_row = flat[order]
        offs = torch.cumsum(count_per_expert(flat, E), 0).to(torch.int32)
        x_rows = x[order // K]
        if family.kind == "linear":
            h = x_rows
        else:
            h = grouped_mm(x_rows, w13.transpose(-2, -1), offs=offs)
            if b1 is not None:
                h = h + b1[expert_of_row]
        y = grouped_mm(torch_activation(h, family), w2.transpose(-2, -1), offs=offs)
        if b2 is not None:
            y = y + b2[expert_of_row]
        y = y * w.reshape(-1)[order, None].to(x.dtype)
        y_tk = torch.zeros_like(y).index_copy(0, order, y)
        return y_tk.view(T, K, H).sum(dim=1)

    return run


def provider_reference(inputs: dict, shape: MoEShape, family: MoKExpertFamily = SWIGLU) -> Callable:
    """The reference backend: the oracle every provider is checked against."""
    ids = inputs["topk_ids"]

    def run(x, w, w13, w2, b1=None, b2=None):
        schedule = build_schedule(ids, shape.E)
        return moe_experts_reference(x, w, w13, w2, schedule, family=family, gate_up_bias=b1, down_bias=b2)

    return run


def build_megatron_moe(shape: MoEShape, dispatcher: str, device: torch.device, ep_size: int = 1):
    """Megatron-Core's stock MoELayer (local spec: SequentialMLP, no Transformer Engine) for shape,
    with `ep_size`-way expert parallelism over the default process group (a one-rank group is made
    when none exists). Weights are random (std 0.02, seed 0); callers may replace them.

    Raises:
        ImportError: megatron-core is not installed.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig

    if not dist.is_initialized():
        port = free_port()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep_size)
    T, H, I, E, K = shape.as_tuple()
    on_cpu = device.type == "cpu"
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=8, ffn_hidden_size=I, moe_ffn_hidden_size=I,
        num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=True, params_dtype=DTYPE, moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        gradient_accumulation_fusion=False,
        # On the GPU: allocate there and fill below (Megatron's GPU init needs its RNG tracker).
        use_cpu_initialization=on_cpu, perform_initialization=on_cpu,
    )  # fmt: skip
    builder = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    layer = builder(config=config).to(device)
    if on_cpu:
        from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe

        make_stock_router_cpu_safe(layer)
    else:
        generator = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.02, generator=generator)
    return layer


def provider_megatron(inputs: dict, shape: MoEShape, family: MoKExpertFamily = SWIGLU) -> Callable:
    """Megatron-Core's stock MoELayer with the alltoall dispatcher and SequentialMLP experts; built
    here for bias-free SwiGLU only (`build_megatron_moe`), so other families are unavailable.

    Its router is replaced by the benchmark's routing (the same top-k ids and weights as every other
    provider), so the output is checked like theirs and the time excludes the router, as theirs
    does. The expert weights are the benchmark's, passed through `functional_call` so that their
    gradients come back like every provider's.
    """
    _swiglu_only("the megatron peer (built with gated_linear_unit, silu and no bias)", family)
    try:
        layer = build_megatron_moe(shape, "alltoall", inputs["x"].device)
    except ImportError as error:
        raise ProviderUnavailable("megatron-core is not importable (pip install -e .[megatron])") from error
    return megatron_run(layer, inputs, shape)


def megatron_run(layer, inputs: dict, shape: MoEShape) -> Callable:
    """run(x, w, w13, w2) through a stock MoELayer with the benchmark's routing and weights."""
    T, H, I, E, K = shape.as_tuple()
    ids = inputs["topk_ids"]
    routing: dict = {}

    def fixed_router(hidden, padding_mask=None):
        probs = torch.zeros(T, E, dtype=routing["w"].dtype, device=ids.device).scatter(1, ids, routing["w"])
        return probs, torch.zeros(T, E, dtype=torch.bool, device=ids.device).scatter(1, ids, True)

    layer.router.forward = fixed_router

    def run(x, w, w13, w2, b1=None, b2=None):
        routing["w"] = w
        params = {}
        for e in range(E):
            params[f"experts.local_experts.{e}.linear_fc1.weight"] = w13[e]
            params[f"experts.local_experts.{e}.linear_fc2.weight"] = w2[e]
        out, _ = torch.func.functional_call(layer, params, (x.view(T, 1, H),), strict=False)
        return out.view(T, H)

    return run


def provider_liger(inputs: dict, shape: MoEShape, family: MoKExpertFamily = SWIGLU) -> Callable:
    """Liger-Kernel's fused MoE (same weight layout: gate_up [E, 2I, H] gate first, down [E, H, I]);
    bias-free SwiGLU only.

    It autotunes 32 configs for each of its GEMM kernels at every new shape (about 4 minutes per
    shape on the H200); LIGER_FUSED_MOE_AUTOTUNE=0 runs its one default config instead.
    """
    _swiglu_only("Liger's fused MoE", family)
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as error:
        raise ProviderUnavailable(
            "liger-kernel is not importable (pip install liger-kernel, or carry its wheel)"
        ) from error
    ids = inputs["topk_ids"].to(torch.int32)

    def run(x, w, w13, w2, b1=None, b2=None):
        return LigerFusedMoEFunction.apply(x, w13, w2, ids, w)

    return run


PROVIDERS: dict[str, Callable] = {
    "mok-mega": provider_mok("megakernel"),
    "mok-multi": provider_mok("multi_kernel"),
    "torch": provider_torch,
    "megatron": provider_megatron,
    "liger": provider_liger,
}
