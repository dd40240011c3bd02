"""`MoKMoE`: the MoK mixture-of-experts layer as a plain `nn.Module`.

Owns: the parameters (router, routed experts, shared experts, the expert-bias buffer), input
checks, the backend switch (auto | triton | reference), and the per-step statistics
(`last_tokens_per_expert`, `last_num_dropped`). No benchmark hooks: under expert parallelism the
stages are `torch.profiler` ranges (parallel/dispatch.py, PROFILER_RANGES).

Does not own: any math of its own; it calls routing, schedule and a backend's experts function.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch
from torch import nn

from mok_plugin.config import MoKConfig, debug_checks_from_env, triton_interpreter_from_env
from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.parallel.dispatch import moe_experts_expert_parallel
from mok_plugin.reference import moe_experts_reference, shared_expert_forward
from mok_plugin.routing import MoKRouting, route, update_expert_bias
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule, expert_capacity

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


class MoKSharedExperts(nn.Module):
    """The shared experts as one dense MLP of the routed experts' family: `gate_up_proj` [fc1 rows, H]
    (glu: [2Is, H]), `down_proj` [H, Is], and the family's biases `gate_up_bias`, `down_bias`.

    Batch-invariant with both backends, so a token's result does not depend on its batch (and so
    not on the expert-parallel size, since each rank runs this on its own tokens): the reference
    backend computes in fp64 and rounds; the triton backend runs it as one more expert that every
    token picks with weight 1, through the row-tile kernels, which own each row's arithmetic.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device=None,
        family: MoKExpertFamily = SWIGLU,
    ):
        super().__init__()
        self.family = family
        _register_mlp(self, (), hidden_size, intermediate_size, family, dtype, device)
        self.experts_fn = None  # set by MoKMoE: the triton backend's experts function, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


class MoKMoE(nn.Module):
    """A mixture-of-experts layer, deterministic by construction, with experts of `config.expert_family`.

    Parameters: `router.weight` [E, H] (and `router.bias` [E] with `config.router_bias`; both
    replicated on every expert-parallel rank);
    `experts.gate_up_proj` [E_l, 2I, H] (SwiGLU; see MoKExperts for the other families);
    `experts.down_proj` [E_l, H, I]; the family's biases `experts.gate_up_bias`, `experts.down_bias`;
    where E_l = E / ep_size and rank r holds experts [r*E_l, (r+1)*E_l); with shared experts,
    `shared_experts.gate_up_proj` [2Is, H] and `shared_experts.down_proj` [H, Is] (and biases).
    With `config.expert_bias`, the buffer `expert_bias` fp32 [E].

    Args:
        config: the layer's MoKConfig.
        ep_group: the expert-parallel process group, required when config.ep_size > 1; its size
            must equal ep_size. Ranks' tokens form the global batch in rank order.
        device: where the parameters are created.
        init_std: standard deviation of the normal initialisation (Megatron's default 0.02).
        seed: seeds the initialisation; layers built with one seed hold the same weights whatever
            the ep_size (each rank keeps its slice of the full expert tensors).
        experts: this rank's routed experts as modules (module_experts.MoKModuleExperts) instead of
            stacked weights of config.expert_family; they keep their own weights (not initialised
            here) and compute through their `experts_fn`.

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
        experts: nn.Module | None = None,
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
        self.experts = experts
        self.shared_experts = (
            MoKSharedExperts(H, config.shared_intermediate_size, dtype, device, family)
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
        self.init_std = init_std
        self.debug = config.debug_checks or debug_checks_from_env()
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
            self._experts_fn = moe_experts_reference
        if self.shared_experts is not None:
            self.shared_experts.experts_fn = self._experts_fn if self.backend == "triton" else None
        if not isinstance(self.experts, MoKExperts):
            self._experts_fn = self.experts.experts_fn

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._select_backend()
        return module

    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, init_std) weights; the down projections scaled by 1/sqrt(2 * num_layers) are left to callers."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, param in self.named_parameters():
            if name.startswith("experts.") and not isinstance(self.experts, MoKExperts):
                continue  # expert modules keep their own weights
            if name.endswith("bias"):
                with torch.no_grad():
                    param.zero_()  # linear biases (experts', router's) start at zero
            elif name.startswith("experts."):
                # Draw all E experts, keep this rank's slice: the weights do not depend on ep_size.
                full_shape = (self.config.num_experts, *param.shape[1:])
                _init_(param, self.init_std, generator, full_shape, first=self.ep_rank * param.shape[0])
            else:
                _init_(param, self.init_std, generator)

    @property
    def _anchor(self) -> torch.Tensor:
        """The weight whose device and dtype are the layer's: the stacked experts', or the router's
        when the experts are modules (which have no stacked weights)."""
        return self.router.weight if self.experts.down_proj is None else self.experts.down_proj

    @property
    def params_dtype(self) -> torch.dtype:
        return self._anchor.dtype

    def _check_input(self, x: torch.Tensor) -> None:
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route, run the experts, combine.

        Args:
            x: [..., H] in the params dtype, on the parameters' device.
        Returns:
            (output shaped like x, aux_loss fp32 scalar: load-balancing loss + z-loss, zero when
            both coefficients are zero).
        Raises:
            ValueError: mok.backend cannot run where the parameters are (for example "triton" on
                the CPU without TRITON_INTERPRET=1); with debug checks on, non-finite router
                logits (under expert parallelism on every rank alike).
            ValueError / TypeError: wrong last dimension, dtype or device.
        """
        if self._backend_error is not None:
            raise ValueError(self._backend_error)
        self._check_input(x)
        cfg = self.config
        x_TH = x.reshape(-1, cfg.hidden_size)
        T = x_TH.shape[0]

        debug = self.debug
        routing = self.route(x_TH, debug=debug)
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        experts_fn = functools.partial(self._experts_fn, **self.experts.weights())
        capacity = None
        if cfg.capacity_factor is not None:
            # Over the global batch, so that every EP size keeps the same rows.
            capacity = expert_capacity(self._global_tokens(T), cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        if self.ep_group is not None:
            out, num_dropped = moe_experts_expert_parallel(
                x_TH, routing.topk_ids, routing.topk_weights, w13, w2, experts_fn, self.ep_group,
                cfg.num_experts, DEFAULT_TILE_M, None if cfg.ep_exchange == "exact" else cfg.ep_capacity_factor,
                transport=cfg.ep_transport, expert_capacity=capacity,
            )  # fmt: skip
        else:
            schedule = build_schedule(routing.topk_ids, cfg.num_experts, tile_m=DEFAULT_TILE_M, capacity=capacity)
            out = experts_fn(x_TH, routing.topk_weights, w13, w2, schedule)
            num_dropped = schedule.num_dropped
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_TH)

        with torch.no_grad():
            self.last_tokens_per_expert.copy_(routing.tokens_per_expert)
            self.last_num_dropped.copy_(num_dropped)
            if debug and capacity is not None:
                dropped = int(num_dropped)  # host-ok: opt-in debug report
                if dropped:
                    warnings.warn(
                        f"MoK dropped {dropped} routed (token, k) pairs{' at this rank' if self.ep_group else ''} at "
                        f"mok.capacity_factor={cfg.capacity_factor}; raise it or set it to null (dropless)",
                        stacklevel=2,
                    )
        return out.view(x.shape), routing.aux_loss

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

    def route(self, x_TH: torch.Tensor, debug: bool = False) -> MoKRouting:
        """The routing decision for tokens x_TH [T, H]: logits in fp32, then `routing.route`.

        Raises:
            ValueError: with `debug`, when a router logit is NaN or infinite.
        """
        cfg = self.config
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
        )

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
