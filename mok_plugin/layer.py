"""`MoKMoE`: the MoK mixture-of-experts layer as a plain `nn.Module`.

Owns: the parameters (router, routed experts, shared experts, the expert-bias buffer), input
checks, the backend switch (auto | triton | reference), and the per-step statistics
(`last_tokens_per_expert`, `last_num_dropped`). No benchmark hooks: under expert parallelism the
stages are `torch.profiler` ranges (parallel/dispatch.py, PROFILER_RANGES).

Does not own: any math of its own; it calls routing, schedule and a backend's experts function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from mok_plugin.config import (
    REFERENCE_BACKEND_HOST_LOOP,
    MoKConfig,
    debug_checks_from_env,
    host_read_settings,
    triton_interpreter_from_env,
)
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.fp8.weight_copies import FP8WeightCopies
from mok_plugin.parallel.dispatch import (
    DispatchPlan,
    moe_experts_expert_parallel,
    prepare_dispatch,
    run_received_pairs,
)
from mok_plugin.random_stream import global_token_index, normal, token_offset
from mok_plugin.recompute_draws import RecomputeSteps
from mok_plugin.reference import moe_experts_reference, shared_expert_forward, shared_expert_gate
from mok_plugin.routing import MoKRouting, MoKTokenScope, route, straight_through, update_expert_bias
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule, expert_capacity
from mok_plugin.wgrad import DeferredWeightGrads, deferring

__all__ = ["MoKMoE", "MoKExperts", "MoKSharedExperts", "resolve_backend"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs on `device`: "auto" picks triton on CUDA, reference elsewhere.

    Raises:
        ValueError: an unknown backend, or "triton" where it cannot run.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend={backend!r}; allowed: 'auto', 'triton', 'reference'")
    if backend == "reference":
        return "reference"
    triton_ready = _triton_backend_available()
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_ready else "reference"
    if not triton_ready:
        raise ValueError("backend='triton' needs the triton package (pip install triton; CUDA builds of torch ship it)")
    if device.type != "cuda" and not triton_interpreter_from_env():
        raise ValueError(
            f"backend='triton' needs a CUDA device (got {device.type}); use backend='reference' or 'auto' on the CPU, "
            "or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"
        )
    return "triton"


def _triton_backend_available() -> bool:
    # find_spec looks for the package without importing it: `import mok_plugin` stays cheap.
    return importlib.util.find_spec("triton") is not None


def _init_(
    tensor: torch.Tensor,
    std: float,
    generator: torch.Generator | None,
    full_shape: tuple[int, ...] | None = None,
    first: int = 0,
) -> None:
    """Fill tensor with N(0, std) drawn as a full_shape tensor, from row `first` on.

    Drawn in fp32 on the CPU and cast, so bf16 and fp32 layers built from one seed hold the same
    values, on any device.
    """
    shape = full_shape or tuple(tensor.shape)
    with torch.no_grad():
        values = torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)
        tensor.copy_(values[first : first + tensor.shape[0]].to(tensor.device))


def _group_size(group) -> int:
    """Ranks in a process group; 1 for None (this rank alone)."""
    return 1 if group is None else torch.distributed.get_world_size(group)


def _sum_over(counts: torch.Tensor, group) -> torch.Tensor:
    """int64 counts summed over `group` (a new tensor; the input itself for one rank or None).
    Integer sums are exact, so every rank gets the same bits whatever the reduction order."""
    if _group_size(group) == 1:
        return counts
    total = counts.clone()
    torch.distributed.all_reduce(total, group=group)
    return total


def _check_ep_group(ep_size: int, ep_group) -> tuple[object | None, int]:
    """(group, this rank in it) for ep_size > 1, (None, 0) otherwise; errors name the mismatch."""
    if ep_size == 1:
        if ep_group is not None and torch.distributed.get_world_size(ep_group) != 1:
            raise ValueError(
                f"ep_group has {torch.distributed.get_world_size(ep_group)} ranks but mok.ep_size=1; "
                "set mok.ep_size to the group's size"
            )
        return None, 0
    if ep_group is None:
        raise ValueError(f"mok.ep_size={ep_size} needs ep_group=<a torch.distributed process group of {ep_size} ranks>")
    size = torch.distributed.get_world_size(ep_group)
    if size != ep_size:
        raise ValueError(f"mok.ep_size={ep_size} but ep_group has {size} ranks; they must be equal")
    return ep_group, torch.distributed.get_rank(ep_group)


class MoKExperts(nn.Module):
    """The routed experts' weights, in the shapes `family` computes with (experts.py).

    `gate_up_proj` [E, fc1 rows, H] (glu: 2I rows, gate first; mlp: I; None for a linear expert),
    `down_proj` [E, H, I] ([E, H, H] for a linear expert), and with the family's biases
    `gate_up_bias` [E, fc1 rows] and `down_bias` [E, H] (else None).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        dtype: torch.dtype,
        device=None,
        family: MoKExpertFamily = SWIGLU,
    ):
        super().__init__()
        self.family = family
        _register_mlp(self, (num_experts,), hidden_size, ffn_hidden_size, family, dtype, device)

    def weights(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of a backend's experts function: family, biases."""
        return dict(family=self.family, gate_up_bias=self.gate_up_bias, down_bias=self.down_bias)


def _register_mlp(module: nn.Module, lead: tuple[int, ...], H: int, I: int, family: MoKExpertFamily, dtype, device):
    """gate_up_proj, down_proj, gate_up_bias, down_bias of `family` on module, each shaped lead + its own shape."""
    fc1 = family.fc1_width(I)
    inner = family.intermediate_size(H, I)

    def param(*shape: int, wanted: bool = True) -> nn.Parameter | None:
        return nn.Parameter(torch.empty(*lead, *shape, dtype=dtype, device=device)) if wanted else None

    module.register_parameter("gate_up_proj", param(fc1, H, wanted=family.kind != "linear"))
    module.register_parameter("down_proj", param(H, inner))
    module.register_parameter("gate_up_bias", param(fc1, wanted=family.fc1_bias))
    module.register_parameter("down_bias", param(H, wanted=family.fc2_bias))


@dataclasses.dataclass
class MoKForwardStep:
    """One forward's state between its stages (MoKMoE.begin ... finish)."""

    x_shape: tuple[int, ...]
    x_TH: torch.Tensor
    routing: MoKRouting
    capacity: int | None  # rows one expert keeps; None: dropless
    shared_out: torch.Tensor | None  # the shared experts' output, issued in `begin`
    num_dropped: torch.Tensor | None = None
    plan: DispatchPlan | None = None  # expert parallelism, staged: set by `prepare_dispatch`


class MoKSharedExperts(nn.Module):
    """The shared experts as one dense MLP of the routed experts' family: `gate_up_proj` [fc1 rows, H]
    (glu: [2Is, H]), `down_proj` [H, Is], and the family's biases `gate_up_bias`, `down_bias`; with
    `gate`, `gate_weight` [1, H] and the output times sigmoid(x . gate_weight) per token
    (`reference.shared_expert_gate`, Megatron's --moe-shared-expert-gate).

    Batch-invariant with both backends, so a token's result does not depend on its batch (and so
    not on the expert-parallel size, since each rank runs this on its own tokens): the reference
    backend computes in fp64 and rounds; the triton backend runs it as one more expert that every
    token picks with weight 1, through the row-tile kernels, which own each row's arithmetic.

    With `recompute`, the MLP (and gate) run under a non-reentrant activation checkpoint while
    gradients are on: only the input is kept, and the backward runs the same forward again first.
    Nothing in it is random or batch-dependent, so the recomputed values, and so the gradients, are
    bitwise those of a run without recompute.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device=None,
        family: MoKExpertFamily = SWIGLU,
        gate: bool = False,
        recompute: bool = False,
    ):
        super().__init__()
        self.family = family
        _register_mlp(self, (), hidden_size, intermediate_size, family, dtype, device)
        # Registered after the MLP's weights, so one seed draws the same MLP with and without a gate.
        gate_weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device)) if gate else None
        self.register_parameter("gate_weight", gate_weight)
        self.recompute = recompute
        self.experts_fn = None  # set by MoKMoE: the triton backend's experts function, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype."""
        if self.recompute and torch.is_grad_enabled():
            # Early stop off: the recomputation always runs the whole function (it has no collectives,
            # but the layer's does; one rule for both).
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                return torch.utils.checkpoint.checkpoint(self._gated, x, use_reentrant=False)
        return self._gated(x)

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        out = self._mlp(x)
        if self.gate_weight is None:
            return out
        return out * shared_expert_gate(x, self.gate_weight)  # in x's dtype, as Megatron multiplies

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts_fn is None:
            return shared_expert_forward(
                x, self.gate_up_proj, self.down_proj, self.family, self.gate_up_bias, self.down_bias
            )
        every_token = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
        schedule = build_schedule(every_token, 1, tile_m=DEFAULT_TILE_M)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        return self.experts_fn(
            x, ones, self.gate_up_proj.unsqueeze(0), self.down_proj.unsqueeze(0), schedule, family=self.family,
            gate_up_bias=None if self.gate_up_bias is None else self.gate_up_bias.unsqueeze(0),
            down_bias=None if self.down_bias is None else self.down_bias.unsqueeze(0),
        )  # fmt: skip


# One side stream per CUDA device for the shared experts under `shared_expert_overlap`, shared by
# every layer (layers run one after another), as Megatron's SharedExpertMLP.stream is.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class _EagerUnderCompile:
    """experts_fn, run eagerly when a compiled model calls it: torch.compile breaks the graph around
    it (the rest of the layer stays compiled), and `fullgraph=True` stops with an error whose
    explanation gives `why` (what keeps it out of a graph). Outside torch.compile, experts_fn.
    Pickled and copied as (experts_fn, why), as a layer is: torch's disabled wrapper is a closure."""

    def __init__(self, experts_fn: Callable, why: str) -> None:
        self.experts_fn, self.why = experts_fn, why
        reason = f"MoK runs these experts outside torch.compile: {why}"
        self._disabled = torch.compiler.disable(experts_fn, reason=reason)

    def __call__(self, *args, **kwargs):
        return self._disabled(*args, **kwargs)

    def __reduce__(self):
        return _EagerUnderCompile, (self.experts_fn, self.why)


def _deferring_weight_grads(queue: DeferredWeightGrads, experts_fn, *args, **kwargs) -> torch.Tensor:
    """experts_fn(*args, **kwargs) with its nodes' weight gradients left in queue."""
    with deferring(queue):
        return experts_fn(*args, **kwargs)


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The shared experts' side stream on `device`; None off CUDA, where they run in sequence."""
    if device.type != "cuda":
        return None
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class _ForkToSideStream(torch.autograd.Function):
    """Identity on x, placed where x enters the side stream (called on the current stream).

    Forward: the side stream waits for the current one (x is written), and x's memory is not reused
    before the side stream has read it. Backward (run on the forward's stream, the current one):
    the current stream waits for the side one, whose shared-expert backward wrote d_x, and d_x's
    memory is not reused before the current stream has read it. Autograd's engine also syncs
    gradients that cross streams; the explicit waits make the order hold by construction.
    Off CUDA (side None) both directions are plain identities.
    """

    @staticmethod
    def forward(ctx, x, side):  # type: ignore[override]
        ctx.side = side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(x.device))
            x.record_stream(side)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, d_x):  # type: ignore[override]
        if ctx.side is not None:
            current = torch.cuda.current_stream(d_x.device)
            current.wait_stream(ctx.side)
            d_x.record_stream(current)
        return d_x, None


class _JoinFromSideStream(torch.autograd.Function):
    """Identity on the shared experts' output y, taking it back to the current stream.

    Forward (on the current stream): the current stream waits for the side one (y is written), and
    y's memory, allocated on the side stream, is not reused before the current stream has read it.
    Backward (on the current stream): the side stream waits for the current one, which wrote d_y,
    before the shared experts' backward (on the side stream, where their forward ran) reads it.
    """

    @staticmethod
    def forward(ctx, y, side):  # type: ignore[override]
        ctx.side = side
        if side is not None:
            current = torch.cuda.current_stream(y.device)
            current.wait_stream(side)
            y.record_stream(current)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, d_y):  # type: ignore[override]
        if ctx.side is not None:
            ctx.side.wait_stream(torch.cuda.current_stream(d_y.device))
            d_y.record_stream(ctx.side)
        return d_y, None


class MoKMoE(nn.Module):
    """A mixture-of-experts layer, deterministic by construction, with experts of `config.expert_family`.

    Parameters: `router.weight` [E, H] (and `router.bias` [E] with `config.router_bias`; both
    replicated on every expert-parallel rank);
    `experts.gate_up_proj` [E_l, 2I, H] (SwiGLU; see MoKExperts for the other families);
    `experts.down_proj` [E_l, H, I]; the family's biases `experts.gate_up_bias`, `experts.down_bias`;
    where E_l = E / ep_size and rank r holds experts [r*E_l, (r+1)*E_l); with shared experts,
    `shared_experts.gate_up_proj` [2Is, H] and `shared_experts.down_proj` [H, Is] (and biases), and
    with `config.shared_expert_gate` `shared_experts.gate_weight` [1, H]. With
    `config.shared_expert_overlap` the shared experts run on a side CUDA stream while the routed
    experts run (the same bits as without; on the CPU they run in sequence).
    With `config.expert_bias`, the buffer `expert_bias` fp32 [E].

    Args:
        config: the layer's MoKConfig.
        ep_group: the expert-parallel process group, required when config.ep_size > 1; its size
            must equal ep_size. Ranks' tokens form the global batch in rank order.
        device: where the parameters are created.
        init_std: standard deviation of the normal initialisation (Megatron's default 0.02).
        output_init_std: that of the down projections (routed and shared experts' fc2); default
            init_std (Megatron's default: init_std / sqrt(2 * num_layers)).
        seed: seeds the initialisation; layers built with one seed hold the same weights whatever
            the ep_size (each rank keeps its slice of the full expert tensors).
        experts: this rank's routed experts as modules (module_experts.MoKModuleExperts) instead of
            stacked weights of config.expert_family; they keep their own weights (not initialised
            here) and compute through their `experts_fn`.
        sequence_group: the ranks whose tokens together form each micro-batch (sequence shards:
            Megatron's tensor x context-parallel group); the load-balancing losses sum their token
            counts over it and the z-loss coefficient is divided by its size. None: this rank alone.
        global_batch_group: the ranks whose tokens together form the global batch (Megatron's
            tensor x data x context-parallel group), over which `global_aux_loss` sums its counts.
            None: this rank alone.

    With `config.global_aux_loss_coeff`, the non-persistent buffers `global_tokens_per_expert`
    int64 [E] and `ga_steps` int64 [] (Megatron's names) hold the global batch's counts so far; each
    training forward with gradients on adds to them, and `reset_global_aux_loss_tracker()` (which
    Megatron's finalize_model_grads calls after every step) clears them.

    Raises:
        ValueError: ep_size > 1 without an ep_group, or a group of another size.
    """

    def __init__(
        self,
        config: MoKConfig,
        *,
        ep_group: torch.distributed.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        init_std: float = 0.02,
        seed: int | None = None,
        output_init_std: float | None = None,
        experts: nn.Module | None = None,
        sequence_group: torch.distributed.ProcessGroup | None = None,
        global_batch_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.ep_group, self.ep_rank = _check_ep_group(config.ep_size, ep_group)
        self.config = config
        dtype = _DTYPES[config.params_dtype]
        H, I, E = config.hidden_size, config.ffn_hidden_size, config.num_experts
        self.router = nn.Linear(H, E, bias=config.router_bias, dtype=dtype, device=device)
        family = config.expert_family
        if experts is None:
            experts = MoKExperts(config.num_local_experts, H, I, dtype, device, family)
        elif config.fp8 is not None:
            raise ValueError("mok.fp8 quantises MoK's stacked expert weights; experts given as modules compute "
                             "through their own experts_fn")  # fmt: skip
        self.experts = experts
        self.shared_experts = (
            MoKSharedExperts(
                H,
                config.shared_intermediate_size,
                dtype,
                device,
                family,
                gate=config.shared_expert_gate,
                recompute=config.shared_expert_recompute,
            )
            if config.num_shared_experts
            else None
        )
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        self.register_buffer(
            "last_tokens_per_expert", torch.zeros(E, dtype=torch.int64, device=device), persistent=False
        )
        # (token, k) pairs dropped by capacity in the last forward; under EP, by this rank's experts.
        self.register_buffer("last_num_dropped", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.sequence_group, self.global_batch_group = sequence_group, global_batch_group
        # The terms of the last forward's aux_loss (routing.LOSS_NAMES -> fp32 [], in the graph).
        self.last_router_losses: dict[str, torch.Tensor] = {}
        # The last forward's routed pairs per expert that balancing counts: a padding token's are left
        # out (MoKRouting.counted_tokens_per_expert); int64 [E], None before the first forward.
        self.last_counted_tokens_per_expert: torch.Tensor | None = None
        if config.global_aux_loss_coeff > 0:
            # int64, unlike Megatron's fp32: sums of counts stay exact (and independent of the order
            # of addition) past 2**24; below that the fp32 mean is the same bits. Never converted
            # by .to(dtype) or Megatron's Float16Module, which cast floating buffers only.
            zeros = functools.partial(torch.zeros, dtype=torch.int64, device=device)
            self.register_buffer("global_tokens_per_expert", zeros(E), persistent=False)
            self.register_buffer("ga_steps", zeros(()), persistent=False)
        else:
            self.global_tokens_per_expert = self.ga_steps = None
        # The counter-based random stream of --moe-router-force-load-balancing: this layer's name in
        # it (MoKMoELayer sets Megatron's layer number) and its calls so far (the stream's step). The
        # count is a device buffer advanced in place: a CUDA graph that captured a draw then draws
        # anew on every replay, as the eager layer does (a host int would be frozen into the graph).
        self.random_stream_layer = 0
        self.register_buffer("random_calls", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.recompute_steps: RecomputeSteps[torch.Tensor] = RecomputeSteps()  # reentrant recomputation's draws
        # Extension point: when set, `route` calls routing_fn(x_TH, router.weight, router.bias,
        # training=self.training) -> MoKRouting instead of routing.route (a framework's own gate, e.g.
        # mok_plugin.deepspeed.gating.DeepSpeedGate). Pairs it drops keep their expert at weight 0
        # (without expert parallelism, topk_ids may also hold -1: an empty slot, no row).
        self.routing_fn = None
        self.init_std = init_std
        self.output_init_std = init_std if output_init_std is None else output_init_std
        self.debug = config.debug_checks or debug_checks_from_env()
        # Set (a DeferredWeightGrads) for Megatron's --delay-wgrad-compute: the routed experts'
        # backward then leaves their weight gradients in it, for `weight_grads.run()` (wgrad.py).
        self.weight_grads: DeferredWeightGrads | None = None
        # mok.fp8: the experts' FP8 weight copies, kept between the forwards of one step when Megatron's
        # schedule says which micro-batch is a step's first (set_is_first_microbatch sets this True on
        # every module that has it, as on Transformer Engine's); None, its default: quantised every forward.
        self.fp8_weight_copies = {"routed": FP8WeightCopies(), "shared": FP8WeightCopies()}
        self.is_first_microbatch: bool | None = None
        self.reset_parameters(seed)
        self._select_backend()

    def _select_backend(self) -> None:
        # Chosen when the parameters' device is known (here and after .to()/.cuda()), never in
        # forward, so torch.compile traces no import machinery. A backend that cannot run where
        # the parameters are now is an error at the first forward, not here: a layer built on the
        # CPU with backend="triton" and then moved with .to("cuda") is the usual PyTorch order.
        device = self._anchor.device
        self._backend_error = None
        try:
            self.backend = resolve_backend(self.config.backend, device) if device.type != "meta" else "reference"
        except ValueError as error:
            self.backend = "unavailable"
            self._backend_error = f"mok.backend={self.config.backend!r} cannot run on {device}: {error}"
        if self.backend == "triton":
            from mok_plugin import ops

            self._experts_fn = functools.partial(ops.moe_experts, variant=self.config.kernel_variant)
        else:
            self._experts_fn = _EagerUnderCompile(moe_experts_reference, REFERENCE_BACKEND_HOST_LOOP)
        if self.shared_experts is not None:
            self.shared_experts.experts_fn = self._experts_fn if self.backend == "triton" else None
        if not isinstance(self.experts, MoKExperts):
            self._experts_fn = self.experts.experts_fn
        for copies in self.fp8_weight_copies.values():
            copies.clear()  # made from the weights where they were (.to() moves or casts them)
        recipe = self.config.fp8_recipe
        if recipe is not None and self.backend != "unavailable":
            from mok_plugin.fp8.experts import fp8_experts_function, runs_pytorch_path

            if self.backend == "triton" and runs_pytorch_path(recipe):
                warnings.warn(
                    f"mok.fp8_scaling={recipe.scaling!r} runs MoK's PyTorch FP8 path (fp8/reference.py): the "
                    "recipe's numbers, not fused kernels (MoK's Triton FP8 kernels implement blockwise only; "
                    "MOK_MXFP8_MMA=1: mxfp8's GEMMs by Blackwell's block-scaled MMA, kernels/mxfp8.py)",
                    stacklevel=1,  # always this line: Python's default filter shows it once per process
                )
            # The shared experts too, as one more expert (Megatron runs every linear layer under its recipe).
            copies = self.fp8_weight_copies
            why = "mok.fp8's experts keep the weights' FP8 copies between micro-batches in Python state"
            self._experts_fn = _EagerUnderCompile(fp8_experts_function(recipe, self.backend, copies["routed"]), why)
            if self.shared_experts is not None:
                self.shared_experts.experts_fn = _EagerUnderCompile(
                    fp8_experts_function(recipe, self.backend, copies["shared"]), why
                )

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._select_backend()
        return module

    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, init_std) weights and router bias, Normal(0, output_init_std) down projections,
        zero expert biases: Megatron's init_method / output_layer_init_method placement."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, param in self.named_parameters():
            if name.startswith("experts.") and not isinstance(self.experts, MoKExperts):
                continue  # expert modules keep their own weights
            std = self.output_init_std if name.endswith("down_proj") else self.init_std
            if name.endswith("bias") and name != "router.bias":
                with torch.no_grad():
                    param.zero_()  # the experts' linear biases start at zero; the router's is drawn (TopKRouter)
            elif name.startswith("experts."):
                # Draw all E experts, keep this rank's slice: the weights do not depend on ep_size.
                full_shape = (self.config.num_experts, *param.shape[1:])
                _init_(param, std, generator, full_shape, first=self.ep_rank * param.shape[0])
            else:
                _init_(param, std, generator)

    @property
    def _anchor(self) -> torch.Tensor:
        """The weight whose device and dtype are the layer's: the stacked experts', or the router's
        when the experts are modules (which have no stacked weights)."""
        return self.router.weight if self.experts.down_proj is None else self.experts.down_proj

    @property
    def params_dtype(self) -> torch.dtype:
        return self._anchor.dtype

    def check_input(self, x: torch.Tensor) -> None:
        H = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be hidden_size={H}")
        if x.dtype != self.params_dtype:
            raise TypeError(
                f"x has dtype {x.dtype} but the layer's parameters are {self.params_dtype} "
                f"(mok.params_dtype={self.config.params_dtype}); cast x or the layer"
            )
        if x.device != self._anchor.device:
            raise ValueError(f"x is on {x.device} but the layer's parameters are on {self._anchor.device}")

    def forward(
        self,
        x: torch.Tensor,
        *,
        num_sequences: int | None = None,
        attach_losses: Callable[[torch.Tensor, dict], torch.Tensor] | None = None,
        padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route, run the experts, combine.

        Args:
            x: [..., H] in the params dtype, on the parameters' device.
            num_sequences: B, how x's tokens form sequences for `seq_aux_loss`: x flattened to
                [T, H] is [S, B] sequence-major (Megatron's [S, B, H]), token t in sequence t % B.
                Required with config.seq_aux_loss_coeff > 0.
            attach_losses: f(routing weights [T, K], router losses) -> the weights to route with
                (for example the weights carrying the losses into the backward, as Megatron's
                MoEAuxLossAutoScaler does); see `begin`.
            padding: bool [T] over x's tokens flattened, True for a padding token: computed like
                any other, left out of the router losses and of the counted pairs
                (`routing.route`'s `padding`; Megatron's padding_mask).
        Returns:
            (output shaped like x, aux_loss fp32 scalar: the load-balancing losses + z-loss, zero
            when every coefficient is zero; its terms are in `last_router_losses`).
        Raises:
            ValueError: mok.backend cannot run where the parameters are (for example "triton" on
                the CPU without TRITON_INTERPRET=1); with debug checks on, non-finite router
                logits (under expert parallelism on every rank alike).
            ValueError / TypeError: wrong last dimension, dtype or device.
        """
        step = self.begin(x, num_sequences=num_sequences, attach_losses=attach_losses, padding=padding)
        return self.finish(step, self.run_routed_experts(step), step.shared_out)

    def run_routed_experts(self, step: MoKForwardStep) -> torch.Tensor:
        """The routed experts' output [T, H] for a step (dispatch, experts, combine); the pairs
        dropped go to step.num_dropped."""
        routing, cfg = step.routing, self.config
        experts_fn, w13, w2 = self._experts_call()
        if self.ep_group is not None:
            # The dispatch stages below, composed (MoKMoELayer's EP-overlap methods run them one by one).
            out, step.num_dropped = moe_experts_expert_parallel(
                step.x_TH, routing.topk_ids, routing.topk_weights, w13, w2, experts_fn, self.ep_group,
                cfg.num_experts, DEFAULT_TILE_M, self._exchange_capacity_factor, transport=cfg.ep_transport,
                expert_capacity=step.capacity,
            )  # fmt: skip
        else:
            schedule = build_schedule(routing.topk_ids, cfg.num_experts, tile_m=DEFAULT_TILE_M, capacity=step.capacity)
            out = experts_fn(step.x_TH, routing.topk_weights, w13, w2, schedule)
            step.num_dropped = schedule.num_dropped
        return out

    def _experts_call(self):
        """(the backend's experts function bound to the expert weights and biases, w13, w2)."""
        experts = self.experts
        bound = functools.partial(self._experts_fn, **experts.weights())
        if self.weight_grads is not None:
            bound = functools.partial(_deferring_weight_grads, self.weight_grads, bound)
        return bound, experts.gate_up_proj, experts.down_proj

    @property
    def _exchange_capacity_factor(self) -> float | None:
        """The EP exchange's buffer factor; None for the exact exchange (sized by counts)."""
        return None if self.config.ep_exchange == "exact" else self.config.ep_capacity_factor

    # --- the forward's stages: `forward` runs begin, the expert-parallel exchange and finish (the
    # exchange's stages composed by moe_experts_expert_parallel); Megatron's EP-overlap schedule runs
    # the same one at a time through MoKMoELayer's stage methods, with the two below.

    def begin(
        self,
        x: torch.Tensor,
        num_sequences: int | None = None,
        attach_losses: Callable[[torch.Tensor, dict], torch.Tensor] | None = None,
        padding: torch.Tensor | None = None,
    ) -> MoKForwardStep:
        """The first stage: check x, route (`last_router_losses` set), size the expert capacity and
        issue the shared experts. The shared experts are issued after routing and before the routed
        experts, with or without overlap: the backward then runs its nodes in the same order either
        way, and x's gradient sums its parts (routed, shared, router) in the same order: the same
        bits. attach_losses(weights, losses) runs on the routing weights before anything uses them."""
        self.prepare_forward(x)
        self._check_not_captured_with_host_reads()
        routing = self.route_step(x, num_sequences, attach_losses, padding)
        shared_out = self.start_shared_experts(x) if self.shared_experts is not None else None
        return self._step(x, routing, shared_out)

    def prepare_forward(self, x: torch.Tensor) -> None:
        """What every forward checks and refreshes on the host before it runs (a CUDA graph that
        replays the routing does not run it: `resume` calls it again, once per forward)."""
        if self._backend_error is not None:
            raise ValueError(self._backend_error)
        self.check_input(x)
        if self.weight_grads is not None and len(self.weight_grads) and torch.is_grad_enabled():
            # Nothing may be lost: a backward whose weight gradients were deferred must have them
            # computed (backward_dw) before the layer trains on.
            raise RuntimeError(
                f"MoK: the weight gradients of {len(self.weight_grads)} expert backward pass(es) were deferred "
                "(--delay-wgrad-compute) and never computed: the schedule must call the layer's backward_dw()"
            )
        self._refresh_fp8_weight_copies()

    def route_step(
        self,
        x: torch.Tensor,
        num_sequences: int | None = None,
        attach_losses: Callable[[torch.Tensor, dict], torch.Tensor] | None = None,
        padding: torch.Tensor | None = None,
    ) -> MoKRouting:
        """Route x (`last_router_losses` and `last_counted_tokens_per_expert` set; attach_losses
        applied to the weights). Reads nothing on the host (unless debug checks are on): Megatron's
        partial CUDA graphs capture it alone."""
        routing = self.route(x.reshape(-1, self.config.hidden_size), debug=self.debug, num_sequences=num_sequences,
                             padding=padding)  # fmt: skip
        self.last_router_losses = routing.losses
        self.last_counted_tokens_per_expert = routing.counted_tokens_per_expert
        if attach_losses is not None:
            routing = dataclasses.replace(routing, topk_weights=attach_losses(routing.topk_weights, routing.losses))
        return routing

    def start_shared_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, H], issued (on the side stream with shared_expert_overlap)."""
        return self._start_shared_experts(x.reshape(-1, self.config.hidden_size))

    def resume(self, x: torch.Tensor, routing: MoKRouting, shared_out: torch.Tensor | None) -> MoKForwardStep:
        """The step of a forward routed by `route_step` in a CUDA graph replayed before this call: the
        host's per-forward work (`prepare_forward`, which the replay skipped) and the step."""
        self.prepare_forward(x)
        return self._step(x, routing, shared_out)

    def _step(self, x: torch.Tensor, routing: MoKRouting, shared_out: torch.Tensor | None) -> MoKForwardStep:
        """The forward's step; its expert capacity may read the host (the exact EP exchange's token count)."""
        cfg = self.config
        x_TH = x.reshape(-1, cfg.hidden_size)
        capacity = None
        if cfg.capacity_factor is not None:
            # Over the global batch, so that every EP size keeps the same rows.
            capacity = expert_capacity(self._global_tokens(x_TH.shape[0]), cfg.top_k, cfg.num_experts,
                                       cfg.capacity_factor)  # fmt: skip
        return MoKForwardStep(tuple(x.shape), x_TH, routing, capacity, shared_out)

    def _refresh_fp8_weight_copies(self) -> None:
        """Drop the FP8 weight copies unless this forward is a later micro-batch of the step whose first
        made them (is_first_microbatch False: Megatron set it True before the step's first forward)."""
        if self.is_first_microbatch is not False:
            for copies in self.fp8_weight_copies.values():
                copies.clear()
        if self.is_first_microbatch:
            self.is_first_microbatch = False

    def _check_not_captured_with_host_reads(self) -> None:
        """A clear error instead of CUDA's when a graph captures a forward that reads the host: through
        Megatron's local graphs in inference (--inference-cuda-graph-scope, not known at build time to
        be used) or a user's torch.cuda.graph. Training captures are refused at build time."""
        if torch.compiler.is_compiling() or not torch.cuda.is_available():
            return  # (compiled: dynamo would break the graph on the capture query)
        if not torch.cuda.is_current_stream_capturing():
            return
        reads = host_read_settings(exact_ep_exchange=self.ep_group is not None and self.config.ep_exchange == "exact",
                                   reference_backend=self.backend == "reference", debug=self.debug,
                                   fp8_scaling=self.config.fp8_scaling if self.config.fp8 else None)  # fmt: skip
        if reads:
            raise RuntimeError("MoK: a CUDA graph is capturing this layer, whose settings read the host: "
                               + "; ".join(reads))  # fmt: skip

    def prepare_dispatch(self, step: MoKForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism: (rows, weights) in the exchange's send layout; the plan goes to step.plan."""
        cfg = self.config
        step.plan, x_send, w_send = prepare_dispatch(
            step.x_TH, step.routing.topk_ids, step.routing.topk_weights, self.ep_group, cfg.num_experts,
            self._exchange_capacity_factor, cfg.ep_transport,
        )  # fmt: skip
        return x_send, w_send

    def run_received_pairs(self, step: MoKForwardStep, x_recv: torch.Tensor, w_recv: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: this rank's experts' result rows (the pairs dropped go to step.num_dropped)."""
        experts_fn, w13, w2 = self._experts_call()
        y_recv, step.num_dropped = run_received_pairs(step.plan, x_recv, w_recv, w13, w2, experts_fn, DEFAULT_TILE_M,
                                                      step.capacity)  # fmt: skip
        return y_recv

    def finish(
        self, step: MoKForwardStep, routed_out: torch.Tensor, shared_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage: (routed + shared output shaped like x, aux_loss); the step's statistics."""
        self.record_step(step)
        return self.add_shared(routed_out, shared_out).view(step.x_shape), step.routing.aux_loss

    def add_shared(self, routed_out: torch.Tensor, shared_out: torch.Tensor | None) -> torch.Tensor:
        """routed + shared experts' output (taken from the side stream with shared_expert_overlap)."""
        return routed_out if shared_out is None else routed_out + self._finish_shared_experts(shared_out)

    def record_step(self, step: MoKForwardStep) -> None:
        """The step's statistics (last_tokens_per_expert, last_num_dropped; the debug drop warning)."""
        cfg, routing = self.config, step.routing
        with torch.no_grad():
            self.last_tokens_per_expert.copy_(routing.tokens_per_expert)
            self.last_num_dropped.copy_(step.num_dropped)
            if self.debug and step.capacity is not None:
                dropped = int(step.num_dropped)  # host-ok: opt-in debug report
                if dropped:
                    warnings.warn(
                        f"MoK dropped {dropped} routed (token, k) pairs{' at this rank' if self.ep_group else ''} at "
                        f"mok.capacity_factor={cfg.capacity_factor}; raise it or set it to null (dropless)",
                        stacklevel=2,
                    )

    def _shared_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        return _side_stream(device) if self.config.shared_expert_overlap else None

    def _start_shared_experts(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, H]; with `shared_expert_overlap` on a CUDA device, issued on
        the side stream (`_side_stream`) so that it runs while the routed experts run on the current
        one. Its result is taken back with `_finish_shared_experts`.

        The fork and join nodes are in the graph with and without overlap (plain identities
        without): the autograd graph is then the same either way, so the backward sums every
        gradient in the same order (x's gradient from the shared MLP and its gate first, then with
        the routed experts' and the router's) and the bits agree; only the streams differ."""
        side = self._shared_stream(x_TH.device)
        x_side = _ForkToSideStream.apply(x_TH, side)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            return self.shared_experts(x_side)

    def _finish_shared_experts(self, shared_out: torch.Tensor) -> torch.Tensor:
        """`shared_out` usable on the current stream (the current stream waits for the side one)."""
        return _JoinFromSideStream.apply(shared_out, self._shared_stream(shared_out.device))

    def _global_tokens(self, num_tokens: int) -> int:
        """Tokens in the global batch: this rank's times the EP size under the capacity exchange
        (equal counts, checked on the device); summed over the group, one host read, under the
        exact exchange (which reads counts on the host anyway)."""
        if self.ep_group is None:
            return num_tokens
        if self.config.ep_exchange == "capacity":
            return num_tokens * self.config.ep_size
        total = torch.tensor([num_tokens], dtype=torch.int64, device=self._anchor.device)
        torch.distributed.all_reduce(total, group=self.ep_group)
        return int(total)  # host-ok: exact exchange, sized on the host (parallel/dispatch.py)

    def route(
        self, x_TH: torch.Tensor, debug: bool = False, num_sequences: int | None = None,
        padding: torch.Tensor | None = None,
    ) -> MoKRouting:  # fmt: skip
        """The routing decision for tokens x_TH [T, H]: logits in fp64, then `routing.route`, with
        the token counts of the load-balancing losses summed over `sequence_group` /
        `global_batch_group` (int64: exact in any order, so the same bits on every rank); or
        `self.routing_fn`'s decision when it is set (see __init__; `debug` does not apply then).

        Args:
            x_TH: [T, H].
            debug: check the logits (syncs the host).
            num_sequences: B for `seq_aux_loss` (see `forward`).
            padding: bool [T], True for a padding token (see `forward`).
        Raises:
            ValueError: with `debug`, when a router logit is NaN or infinite; seq_aux_loss without
                num_sequences, or T not a multiple of it; padding not bool [T], or given with a
                `routing_fn`.
        """
        cfg = self.config
        if self.routing_fn is not None:
            if padding is not None:
                raise ValueError("MoK: a padding mask needs MoK's own router, not a routing_fn")
            return self.routing_fn(x_TH, self.router.weight, self.router.bias, training=self.training)
        # A GEMM's result for one row may depend on how many rows share the call (BLAS and cuBLAS
        # pick kernels by shape), which would make routing depend on the batch and on ep_size.
        # Computing in fp64 (and the scores too, in `route`) hides those last-bit differences; a
        # fixed-order router kernel would be the exact fix.
        bias = self.router.bias
        router_logits = torch.nn.functional.linear(
            x_TH.double(), self.router.weight.double(), None if bias is None else bias.double()
        )
        if debug:
            self._check_finite_logits(router_logits)
        if cfg.force_load_balancing:
            router_logits = straight_through(router_logits, self._random_logits(x_TH.shape[0]))
        if cfg.seq_aux_loss_coeff > 0 and num_sequences is None:
            raise ValueError(
                f"mok.seq_aux_loss_coeff={cfg.seq_aux_loss_coeff} needs the sequences: call the layer with "
                "num_sequences=B for x [S, B, H] (sequence-major)"
            )
        scope = MoKTokenScope(
            num_sequences=num_sequences or 1,
            sequence_ranks=_group_size(self.sequence_group),
            sum_over_sequence_ranks=functools.partial(_sum_over, group=self.sequence_group),
            global_ranks=_group_size(self.global_batch_group),
            global_tokens_per_expert=self._global_tokens_per_expert if cfg.global_aux_loss_coeff > 0 else None,
            sum_over_global_ranks=functools.partial(_sum_over, group=self.global_batch_group),
        )
        return route(
            router_logits,
            top_k=cfg.top_k,
            score_function=cfg.score_function,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            expert_bias=self.expert_bias,
            aux_loss_coeff=cfg.aux_loss_coeff,
            z_loss_coeff=cfg.z_loss_coeff,
            seq_aux_loss_coeff=cfg.seq_aux_loss_coeff,
            global_aux_loss_coeff=cfg.global_aux_loss_coeff,
            scope=scope,
            padding=padding,
        )

    def _global_tokens_per_expert(self, counts: torch.Tensor) -> torch.Tensor:
        """fp32 [E]: global_aux_loss's counts, as Megatron's TopKRouter._apply_global_aux_loss takes
        them: this micro-batch's int64 [E] counts summed over `global_batch_group`, added to the
        step's running sum, divided by the micro-batches so far. Only a training forward with
        gradients on adds to the buffers (Megatron computes the loss only then); any other forward
        counts itself with them without storing."""
        counts = _sum_over(counts, self.global_batch_group)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.global_tokens_per_expert += counts
                self.ga_steps += 1
            return self.global_tokens_per_expert.float() / self.ga_steps.float()
        return (self.global_tokens_per_expert + counts).float() / (self.ga_steps + 1).float()

    def forward_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What a forward reads and advances besides its input: every buffer (the per-step
        statistics, the global aux loss's running counts, the expert-bias counts, the random
        stream's call count) and the last router losses. An activation recomputation restores the
        state its forward started from (`restore_forward_state`), so it computes the same values and
        counts nothing twice."""
        buffers = {name: buffer.clone() for name, buffer in self.named_buffers()}
        return buffers, self.last_router_losses

    @torch.no_grad()
    def restore_forward_state(self, state: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
        """Put back a `forward_state()`."""
        buffers = dict(self.named_buffers())
        for name, value in state[0].items():
            buffers[name].copy_(value)
        self.last_router_losses = state[1]

    @torch.no_grad()
    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new global batch for global_aux_loss (Megatron's finalize_model_grads calls this
        on every module that has it, after each step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def _random_logits(self, num_tokens: int) -> torch.Tensor:
        """fp64 [T, E] N(0, 1) logits for force_load_balancing: each token's draw keyed by (random_seed,
        this layer, this call, its index in the global batch, expert), so a run repeats bitwise and
        every EP size draws the same logits for the same token (Megatron's RandomSTE draws them from
        the CUDA RNG, per EP rank and call order)."""
        if self.ep_group is not None and self.config.ep_exchange == "capacity":
            offset = self.ep_rank * num_tokens  # equal token counts on every rank: no exchange needed
        else:
            offset = token_offset(num_tokens, self.ep_group, self._anchor.device)
        tokens = global_token_index(num_tokens, offset, device=self._anchor.device)
        stream = f"force_balance/layer={self.random_stream_layer}"
        noise = normal(self.config.random_seed, self._draw_step(), stream, tokens, self.config.num_experts)
        return noise.double()

    def _draw_step(self) -> torch.Tensor:
        """This call's step of the force-balancing stream: the count so far, then advanced; in training
        through `recompute_steps`, so that a reentrant recomputation draws as its first pass did."""

        def new_step() -> torch.Tensor:
            step = self.random_calls.clone()
            with torch.no_grad():
                self.random_calls += 1
            return step

        return self.recompute_steps.take(new_step) if self.training else new_step()

    def _check_finite_logits(self, router_logits: torch.Tensor) -> None:
        """Debug check (syncs the host). Under expert parallelism every rank learns which ranks
        have non-finite logits and all raise the same error, so no rank is left waiting in the
        exchange for one that stopped."""
        bad_tokens = (~torch.isfinite(router_logits)).any(dim=-1)
        bad_count = bad_tokens.sum().view(1)
        bad_ranks: list[int] = [0] if bool(bad_count) else []  # host-ok: opt-in debug check
        if self.ep_group is not None:
            every = bad_count.new_empty(self.config.ep_size)
            torch.distributed.all_gather_into_tensor(every, bad_count, group=self.ep_group)
            bad_ranks = every.nonzero()[:, 0].tolist()  # host-ok: opt-in debug check
        if not bad_ranks:
            return
        mine = bad_tokens.nonzero()[:5, 0].tolist()  # host-ok: opt-in debug check
        where = f" on expert-parallel rank(s) {bad_ranks}, this rank's" if self.ep_group is not None else ""
        raise ValueError(f"non-finite router logits{where} for tokens {mine} (first 5); check the layer input")

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step from `tokens_per_expert` (default: the last forward's counts).

        Raises:
            RuntimeError: the layer was built without `mok.expert_bias`.
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs mok.expert_bias=true")
        counts = self.last_tokens_per_expert if tokens_per_expert is None else tokens_per_expert
        update_expert_bias(self.expert_bias, counts, self.config.expert_bias_update_rate)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"H={c.hidden_size}, I={c.ffn_hidden_size}, E={c.num_experts}, K={c.top_k}, "
            f"experts={c.expert_family.describe() if isinstance(self.experts, MoKExperts) else 'modules'}, "
            f"shared={c.num_shared_experts}, score={c.score_function}, backend={self.backend}, dtype={c.params_dtype}"
        )
