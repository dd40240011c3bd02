"""`MoKMoELayer`: a Megatron-Core MoELayer whose routing, dispatch, experts and combine are MoK's.

It subclasses `MoELayer`, so Megatron still treats it as an MoE layer (`is_moe_layer`, the
expert-parallel groups, the optimizer's expert parameter groups, aux-loss logging), but it does
not build the stock router, experts or dispatcher: it holds one `mok_plugin.MoKMoE` (`self.mok`)
over Megatron's expert-parallel group and has no math of its own.

Megatron contracts it keeps:
  - forward(hidden_states [S, B, H], ...) -> (output [S, B, H], None);
  - the load-balancing losses (aux_loss, seq_aux_loss, global_aux_loss) and the z-loss reach the
    router through `MoEAuxLossAutoScaler` on the routing weights, as TopKRouter attaches them to its
    probabilities (scaled by Megatron's main-loss backward scale), only in training with gradients
    on, each logged under the stock router's name and groups; their token counts are summed over
    the TP x CP group (global_aux_loss: TP x DP x CP, with `reset_global_aux_loss_tracker` for
    finalize_model_grads), and --calculate-per-token-loss scales them as
    TopKRouter.attach_and_log_load_balancing_loss / apply_z_loss do;
  - expert parameters carry `allreduce=False` (reduced over expert-data-parallel ranks, optimised
    apart) where the stock experts do: with EP > 1 or expert TP != TP;
  - with --moe-router-enable-expert-bias, `expert_bias` / `local_tokens_per_expert` sit where
    Megatron's finalize_model_grads looks for them (it updates the bias once per global batch); the
    counts are taken when gradients are on and are not persistent, as TopKRouter's;
  - --recompute-granularity selective --recompute-modules moe recomputes the whole layer in the
    backward (non-reentrant checkpoint, `_run_mok`), as MoELayer does; moe_act is what MoK's
    experts always do, shared_experts MoK's `shared_expert_recompute` (config_map.py);
  - state_dict / sharded_state_dict use the stock keys (checkpoint.py);
  - tensor parallelism with sequence parallelism (expert TP 1): each rank routes its sequence
    shard; the replicated parameters are marked `sequence_parallel` (their gradients summed over TP);
  - the EP-overlap schedule (--overlap-moe-expert-parallel-comm) calls the stage methods
    (shared_experts_compute ... postprocess) instead of forward: the same MoK stages in the same
    order, so bitwise the same results;
  - the partial CUDA graphs (--cuda-graph-modules moe_router / moe_preprocess, local or
    transformer_engine) capture MoK's routing and resume the layer from the graph's outputs
    (graph_stages.py), bitwise the layer called whole;
  - with gradient-accumulation fusion, expert weight gradients are added into `main_grad` (fp32)
    by the backward itself, in expert order, and `grad_added_to_main_grad` is set, as Megatron's
    fused linear layers do.
Not supported (an error at build time, naming the flag): see config_map.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.profiler import record_function

from mok_plugin.config import MoKConfig
from mok_plugin.layer import MoKForwardStep, MoKMoE, _group_size, _sum_over
from mok_plugin.megatron.checkpoint import install_state_dict_hooks, megatron_sharded_state_dict
from mok_plugin.megatron.config_map import (
    MOE_OFFLOAD_MODULES,
    init_stds,
    mok_config_from_megatron,
    partial_graph_modules,
    selective_recompute_modules,
)
from mok_plugin.megatron.graph_stages import DispatcherStandIn, PartialGraphStages
from mok_plugin.parallel.dispatch import PROFILER_RANGES, exchange_pairs, return_pairs, sum_returned_pairs
from mok_plugin.routing import LOSS_NAMES
from mok_plugin.wgrad import DeferredWeightGrads

try:
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        MoECudaGraphTensorStore,
        get_default_pg_collection,
    )
except ImportError as error:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("mok_plugin.megatron needs megatron-core 0.19 (pip install 'mok_plugin[megatron]')") from error

__all__ = ["MoKMoELayer", "set_default_mok_overrides"]

# MoK-only knobs for layers built through the spec (--spec mok_plugin.megatron moe_block_spec):
# the launcher fills this from --mok-config / --mok-backend.
_DEFAULT_OVERRIDES: dict[str, Any] = {}


def set_default_mok_overrides(overrides: dict[str, Any]) -> None:
    """MoK knobs (MoKConfig fields) applied to every MoKMoELayer built after this call."""
    _DEFAULT_OVERRIDES.clear()
    _DEFAULT_OVERRIDES.update(overrides)


def stock_experts_class(submodules: Any) -> str | None:
    """The experts class a stock MoELayer would build from `submodules` (MoESubmodules):
    "TEGroupedMLP" or "SequentialMLP" (subclasses included), else None."""
    experts = getattr(submodules, "experts", None)
    builder = experts.func if isinstance(experts, functools.partial) else getattr(experts, "module", experts)
    for base in (TEGroupedMLP, SequentialMLP):
        if isinstance(builder, type) and issubclass(builder, base):
            return base.__name__
    return None


class _MainGradAccumulation(torch.autograd.Function):
    """Identity on a weight; its backward adds the gradient into weight.main_grad (fp32) and hands
    Megatron's DDP an empty gradient, as Megatron's fused-wgrad linear layers do."""

    @staticmethod
    def forward(ctx, weight):  # type: ignore[override]
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        weight = ctx.weight
        # MoK's weight gradient (one fixed-order pass per expert, rounded to the params dtype) is
        # added in fp32; the expert order of the stacked tensor is the order of the adds.
        weight.main_grad.add_(grad.to(weight.main_grad.dtype))
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        # Megatron's DDP skips its own add when this is set; it wants a dummy gradient so that its
        # hooks run on the main thread (as in Megatron's fused linear layers).
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(grad) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(grad)


def _used_on_this_stream(*tensors: torch.Tensor | None) -> None:
    """The EP-overlap schedule runs the stages on two CUDA streams: a tensor made on one and used on
    the other must not go back to the allocator before the other's work on it is done."""
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream())


def _in_bf16_if_megatron_says(mok_config: MoKConfig, config, layer_number: int | None) -> MoKConfig:
    """mok_config without FP8 where Megatron runs this layer in bf16 (--first-last-layers-bf16:
    get_fp8_context gives layer `layer_number - 1`, a global index, no FP8 context); unchanged
    elsewhere, and for a layer without a number: an MTP layer's (whose block asks get_fp8_context
    without one, FP8 everywhere) or an unnumbered one."""
    if mok_config.fp8 is None or layer_number is None:
        return mok_config
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    if not is_first_last_bf16_layer(config, layer_number - 1):
        return mok_config
    return mok_config.replace(fp8=None, fp8_scaling="blockwise")  # (the default: no FP8, nothing to scale)


class MoKMoELayer(PartialGraphStages, MoELayer):
    """Megatron-Core MoE layer running MoK. Built like `MoELayer` (the spec's partial passes
    `submodules`, which MoK ignores: its router, experts and shared experts are its own).

    Args:
        config: Megatron's TransformerConfig (its MoE fields are mapped by config_map.py).
        submodules, layer_number, pg_collection, is_mtp_layer, name: as for MoELayer.
        mok_overrides: MoK-only knobs (MoKConfig fields); default: those set with
            `set_default_mok_overrides` (the launcher's --mok-* flags).
    Raises:
        MoKConfigError: a Megatron MoE setting MoK does not support, naming its flag.
    """

    def __init__(
        self,
        config,
        submodules=None,
        layer_number: int | None = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        mok_overrides: dict[str, Any] | None = None,
    ) -> None:
        # The experts class the stock layer would build: some fused paths and TEGroupedMLP's
        # interleaved GLU rows in sharded checkpoints depend on it.
        self.stock_experts: str | None = stock_experts_class(submodules)
        # What Megatron's flags ask for; mok_config, this layer's, is that less FP8 in a bf16 layer.
        self.flags_mok_config: MoKConfig = mok_config_from_megatron(
            config, _DEFAULT_OVERRIDES if mok_overrides is None else mok_overrides, stock_experts=self.stock_experts
        )
        number = None if is_mtp_layer else layer_number
        self.mok_config = _in_bf16_if_megatron_says(self.flags_mok_config, config, number)
        pg_collection = pg_collection or get_default_pg_collection()
        # BaseMoELayer sets the groups, local expert indices and layer number; MoELayer.__init__
        # would build the stock router, experts and dispatcher, which MoK replaces.
        super(MoELayer, self).__init__(config, layer_number, pg_collection, is_mtp_layer)
        self.submodules = submodules
        self.pg_collection = pg_collection
        self.name = name
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        ep_group = pg_collection.ep if self.mok_config.ep_size > 1 else None
        # The router losses' groups, as TopKRouter's: its tp_cp_group and tp_dp_cp_group.
        std, output_std = init_stds(config)  # Megatron's init_method, output_layer_init_method
        self.mok = MoKMoE(
            self.mok_config, ep_group=ep_group, device=device, init_std=std, output_init_std=output_std,
            sequence_group=getattr(pg_collection, "tp_cp", None),
            global_batch_group=getattr(pg_collection, "tp_dp_cp", None),
        )  # fmt: skip
        self.mok.random_stream_layer = layer_number or 0
        # --fine-grained-activation-offloading with --offload-modules expert_fc1 / moe_act /
        # fused_group_mlp: what the layer saves for the backward waits in host memory.
        offloaded = set(getattr(config, "offload_modules", None) or ()) & set(MOE_OFFLOAD_MODULES)
        self.offload_activations = bool(getattr(config, "fine_grained_activation_offloading", False) and offloaded)
        if self.mok_config.expert_bias:
            # Megatron's finalize_model_grads updates expert_bias from these counts once per global batch.
            # Not persistent, as in TopKRouter: checkpoints hold `router.expert_bias` only, so they
            # load strictly both ways between this layer and the stock one.
            self.mok.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
        # --recompute-granularity selective --recompute-modules moe: as MoELayer decides it (with
        # --cuda-graph-impl local the stock layer leaves it to MoETransformerLayer, whose partial
        # graphs recompute the stages, which MoK refuses; so neither recomputes there).
        self.moe_layer_recompute = "moe" in selective_recompute_modules(config) and config.cuda_graph_impl != "local"
        # Megatron's expert linears use the expert groups (EP, ETP, expert DP) only when EP > 1 or
        # ETP != TP, and mark their parameters `allreduce=False` then, as MoK does: DDP reduces
        # them over expert DP, and the optimizer keeps them in a separate (chained) optimizer, whose
        # checkpoint keys carry a `chained_i.` prefix. Otherwise they sit with the dense ones.
        tp = config.tensor_model_parallel_size
        expert_groups = self.mok_config.ep_size > 1 or (config.expert_tensor_parallel_size or tp) != tp
        for name, param in self.mok.named_parameters():
            if name.startswith("experts."):
                param.allreduce = not expert_groups
            else:
                # Replicated over TP (router, shared experts, their gate): under sequence parallelism
                # each TP rank's gradient covers its sequence shard, and finalize_model_grads sums
                # them over TP, as for TopKRouter's weight.
                param.sequence_parallel = config.sequence_parallel
        install_state_dict_hooks(self)
        self._wgrad_hooks: list[Callable[[], None]] = []
        self._defer_weight_grads_as_configured()
        self._overlap_step: MoKForwardStep | None = None  # one forward's state between the EP-overlap stages
        # Megatron's partial CUDA graphs (graph_stages.py) call the layer by stages (fwd_execution_map)
        # or resume it from the graph's outputs (cudagraph_tensor_store), as MoELayer.
        self.partial_graphs = bool(partial_graph_modules(config))
        self.cudagraph_tensor_store = MoECudaGraphTensorStore()
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]
        if getattr(config, "overlap_moe_expert_parallel_comm", False) or self.partial_graphs:
            # With the flex dispatcher the EP-overlap schedule hands the stage's detached probabilities
            # to the dispatcher's communication manager, and the partial graphs carry tensors across
            # as the dispatcher's attributes; MoK's exchange replaces the dispatcher, so a stand-in.
            self.token_dispatcher = DispatcherStandIn()

    @property
    def router(self) -> torch.nn.Module | None:
        """MoK's router (Megatron's partial CUDA graphs list `mlp.router` among the graphed modules)."""
        return self.mok.router if "mok" in self._modules else None

    @router.setter
    def router(self, value) -> None:
        if value is not None:  # BaseMoELayer sets None; MoK's own is self.mok.router
            raise AttributeError("MoKMoELayer.router is MoK's own (self.mok.router)")

    @property
    def expert_bias(self) -> torch.Tensor | None:
        return self.mok.expert_bias

    @property
    def local_tokens_per_expert(self) -> torch.Tensor | None:
        """`self.mok`'s counts: finalize_model_grads (`_update_router_expert_bias`,
        `reset_model_temporary_tensors`) reads them from every module that has `expert_bias`, this
        layer included. It then also meets `self.mok`, which holds the same two tensors: the
        bias gets the same update twice over (copied, not added) and the counts are zeroed twice."""
        return getattr(self.mok, "local_tokens_per_expert", None)

    def _apply(self, fn, recurse=True):
        # Megatron's Float16Module casts the whole model (.bfloat16() / .half()), floating buffers
        # included. TopKRouter keeps its expert_bias in fp32 (_maintain_float32_expert_bias, before
        # every forward, save and load); so does this layer, and its counts too: stock's counter
        # then holds bf16 and rounds counts above 256, where MoK's fp32 counter stays exact.
        module = super()._apply(fn, recurse)
        for name in ("expert_bias", "local_tokens_per_expert"):
            buffer = self.mok._buffers.get(name)
            if buffer is not None and buffer.dtype != torch.float32:
                self.mok._buffers[name] = buffer.float()
        return module

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number
        self.mok.random_stream_layer = layer_number
        number = None if getattr(self, "is_mtp_layer", False) else layer_number
        config = _in_bf16_if_megatron_says(self.flags_mok_config, self.config, number)
        if config != self.mok_config:  # --first-last-layers-bf16 at the new number
            self.mok_config = self.mok.config = config
            self.mok._select_backend()

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """(output [S, B, H], None); under Megatron's partial CUDA graphs, a stage's outputs
        (graph_stages.py). padding_mask [B, S] (True for a padding token, as TopKRouter's code reads
        it): those tokens run through the experts like any other and are left out of the router
        losses and the expert-bias counts, as in the stock layer."""
        if self.partial_graphs:
            staged = self.graph_stage_output(hidden_states, intermediate_tensors, padding_mask)
            if staged is not None:
                return staged
        if intermediate_tensors is not None:
            # Only the partial CUDA-graph scopes moe_router / moe_preprocess pass them.
            raise NotImplementedError(
                "MoKMoELayer: intermediate_tensors without --cuda-graph-modules moe_router / moe_preprocess"
            )
        self._check_forward(hidden_states)
        padding = self._padding_of(hidden_states, padding_mask)
        output, _ = self._run_mok(hidden_states, padding)
        self._count_and_log(self.mok.last_router_losses, self.mok.last_counted_tokens_per_expert)
        return output, None

    @staticmethod
    def _padding_of(hidden_states: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Megatron's padding_mask [B, S] as MoK's padding over the flattened [S x B] tokens: what
        MoELayer.forward (the transpose) and TopKRouter.routing (the flattening) make of it."""
        if padding_mask is None:
            return None
        S, B = hidden_states.shape[:2]
        if tuple(padding_mask.shape) != (B, S):
            raise ValueError(
                f"MoKMoELayer: padding_mask must be [B={B}, S={S}] for hidden_states [S, B, H], "
                f"got {tuple(padding_mask.shape)}"
            )
        return padding_mask.transpose(0, 1).bool().reshape(-1)

    def _check_forward(self, hidden_states: torch.Tensor) -> None:
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            # MoELayer.forward's own check, word for word.
            raise ValueError(
                "During training, performance may degrade if MoE and tensor parallelism"
                "are enabled without also enabling sequence parallelism."
            )

    def _count_and_log(self, losses: dict[str, torch.Tensor], tokens_per_expert: torch.Tensor) -> None:
        """A forward's bookkeeping (once, outside any recompute): the router losses logged, the
        expert-bias counts; after the layer ran, or in the overlap's first stage (where TopKRouter
        does both)."""
        if self._attaching_losses() and losses:
            self._log_router_losses(losses, self._mtp_repeats())
        if self.mok_config.expert_bias and torch.is_grad_enabled():
            # Counted when gradients are on, as TopKRouter._apply_expert_bias does: not in evaluation,
            # and once under full recompute (Megatron's reentrant checkpoint runs the first forward
            # without gradients and the recomputation with). The moe recompute here runs the layer
            # inside `_run_mok` and this line outside it, so once there too.
            with torch.no_grad():
                self.mok.local_tokens_per_expert += tokens_per_expert

    def _attaching_losses(self) -> bool:
        # TopKRouter computes and attaches its losses only when training with gradients on.
        return self.training and torch.is_grad_enabled()

    def _run_mok(self, hidden_states: torch.Tensor, padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, aux_loss) of the MoK layer; under --recompute-modules moe while training, through
        a non-reentrant activation checkpoint: the forward keeps only its input, and the backward
        runs it again (MoK's forward is deterministic, so bitwise the same values) before its own.

        The recomputation starts from the layer's state as the forward found it (every buffer of
        `self.mok`: the per-step statistics, the global aux loss's running counts, which later
        micro-batches may have changed since, and `last_router_losses`) and puts the state back
        afterwards: it computes the same values, and nothing is counted twice. The expert-bias
        counts and the router losses are taken in `forward`, outside the checkpoint, once. Early
        stop is off, so the recomputation always runs the whole forward: under expert parallelism
        every rank makes the same collective calls in the same order."""
        if not (self.moe_layer_recompute and self.training and torch.is_grad_enabled()):
            return self._call_mok(hidden_states, padding)
        mok = self.mok
        seen = []  # the state the forward started from (MoKMoE.forward_state)

        def run(hidden_states: torch.Tensor, padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            if not seen:  # the forward
                seen.append(mok.forward_state())
                return self._call_mok(hidden_states, padding)
            now = mok.forward_state()  # the recomputation, in the backward
            mok.restore_forward_state(seen[0])
            try:
                return self._call_mok(hidden_states, padding)
            finally:
                mok.restore_forward_state(now)

        # (The context manager, not checkpoint's early_stop argument: torch 2.8 has only the former.)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(run, hidden_states, padding, use_reentrant=False)

    def _call_mok(self, hidden_states: torch.Tensor, padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.offload_activations:
            return self._call_mok_on_device(hidden_states, padding)
        with torch.autograd.graph.save_on_cpu(pin_memory=hidden_states.is_cuda):
            return self._call_mok_on_device(hidden_states, padding)

    def _call_mok_on_device(
        self, hidden_states: torch.Tensor, padding: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._defer_weight_grads_as_configured()
        with self._expert_weights_into_main_grad():
            return self.mok(
                hidden_states, num_sequences=hidden_states.shape[1],
                attach_losses=self._loss_attacher(hidden_states, padding), padding=padding,
            )  # fmt: skip

    @contextlib.contextmanager
    def _expert_weights_into_main_grad(self):
        """With --gradient-accumulation-fusion (and DDP's main_grad), route the expert weights through
        _MainGradAccumulation while the block runs. Biases keep ordinary gradients, as in Megatron's
        fused linear layers (only the weight's goes to main_grad)."""
        experts = self.mok.experts
        if not self._fuses_weight_grads() or self.mok.weight_grads is not None:
            yield  # deferred: backward_dw hands the gradients through _MainGradAccumulation
            return
        originals = {name: experts._parameters[name] for name in ("gate_up_proj", "down_proj")}
        originals = {name: param for name, param in originals.items() if param is not None}
        try:
            for name, param in originals.items():
                del experts._parameters[name]
                setattr(experts, name, _MainGradAccumulation.apply(param))
            yield
        finally:
            for name, param in originals.items():
                delattr(experts, name)
                experts._parameters[name] = param

    def _fuses_weight_grads(self) -> bool:
        return bool(self.config.gradient_accumulation_fusion and hasattr(self.mok.experts.down_proj, "main_grad"))

    # --- --delay-wgrad-compute: the routed experts' weight gradients wait for backward_dw ----------

    def _defer_weight_grads_as_configured(self) -> None:
        """Read at construction and at each forward (the config may change after construction, as
        Megatron's own layers read it when they run). The routed experts' parameters are marked
        skip_backward_post_hook, so that Megatron's DDP hands their gradient hooks to
        register_wgrad_accumulation_and_reduce_hooks (run by backward_dw) instead of registering
        them on the gradient accumulators, which autograd runs, without a gradient, in the backward."""
        deferred = bool(getattr(self.config, "delay_wgrad_compute", False))
        if deferred == (self.mok.weight_grads is not None):
            return  # as configured already (every forward but the first after a change)
        for param in self.mok.experts.parameters():
            param.skip_backward_post_hook = deferred
        self.mok.weight_grads = DeferredWeightGrads(deliver=self._deliver_weight_grads) if deferred else None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Megatron's DDP, under --delay-wgrad-compute, gives here the gradient hook of each
        parameter marked skip_backward_post_hook (the routed experts'); backward_dw runs them."""
        self._wgrad_hooks.append(hook)

    def _deliver_weight_grads(self, targets: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Hand deferred gradients to their parameters as the backward would have: through
        _MainGradAccumulation for the expert weights under --gradient-accumulation-fusion, then
        AccumulateGrad and Megatron's DDP hook on it."""
        if self._fuses_weight_grads():
            experts = self.mok.experts
            fused = (experts._parameters.get("gate_up_proj"), experts._parameters.get("down_proj"))
            targets = [_MainGradAccumulation.apply(t) if any(t is w for w in fused) else t for t in targets]
        torch.autograd.backward(targets, grads)

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False) -> None:
        """The deferred weight gradients (--delay-wgrad-compute), as Megatron's schedule calls it on
        the "mlp" node after the routed experts' backward: those of the routed experts, in the order
        their backward recorded them. The shared experts' and the router's are computed in the
        backward itself, so the pre-dispatch node's call (shared_experts=True) has nothing to run."""
        if not routed_experts:
            return
        if self.mok.weight_grads is not None:
            self.mok.weight_grads.run()
        for hook in self._wgrad_hooks:  # DDP's: into main_grad, and the bucket marked ready
            hook()

    def _mtp_repeats(self) -> int:
        cfg = self.config
        if self.is_mtp_layer and cfg.mtp_use_repeated_layer and cfg.mtp_num_layers is not None:
            return cfg.mtp_num_layers
        return 1

    def _loss_attacher(self, hidden_states: torch.Tensor, padding: torch.Tensor | None = None):
        """f(routing weights, router losses) for MoKMoE.begin: the weights carrying the losses into
        the backward, scaled as TopKRouter's attach_and_log_load_balancing_loss (each load-balancing
        loss) and apply_z_loss do, on the routing weights as TopKRouter attaches them to its probs
        (so that Megatron's EP-overlap schedule, which splits the layer into stages, keeps the
        losses' backward in the routing stage); None when no loss is attached (evaluation).

        With --calculate-per-token-loss each loss is multiplied by the tokens TopKRouter counts for
        it (`_per_token_scales`); repeated MTP layers divide the load-balancing losses (not the
        z-loss) by mtp_num_layers. One `MoEAuxLossAutoScaler` on their sum gives each loss the same
        gradient as one per loss."""
        if not self._attaching_losses():
            return None
        repeats = self._mtp_repeats()
        scale = self._per_token_scales(hidden_states, padding) if self.config.calculate_per_token_loss else None

        def attach(weights: torch.Tensor, losses: dict[str, torch.Tensor]) -> torch.Tensor:
            attached = None
            for name in LOSS_NAMES:
                if name in losses:
                    loss = losses[name] if name == "z_loss" or repeats == 1 else losses[name] / repeats
                    if scale is not None:
                        loss = loss * scale(name)
                    attached = loss if attached is None else attached + loss
            return weights if attached is None else MoEAuxLossAutoScaler.apply(weights, attached)

        return attach

    def _per_token_scales(
        self, hidden_states: torch.Tensor, padding: torch.Tensor | None
    ) -> Callable[[str], int | torch.Tensor]:
        """name (LOSS_NAMES) -> what TopKRouter multiplies that loss by under --calculate-per-token-loss
        (Megatron then divides every gradient by the global token count): the tokens it counts for
        the loss x the TP x CP size. Without a padding mask, this rank's S x B for every loss. With
        one, the z-loss counts this rank's tokens that are not padding, and each load-balancing loss
        those of its whole group (TP x CP; TP x DP x CP for the global loss): the "local" count of
        get_tokens_per_expert_and_token_count is read after reduce_from_tensor_model_parallel_region
        summed the counts over the group in place (Megatron-Core 0.19, as Megatron-LM's main still
        does). The group sums are taken when a loss first asks, on every rank alike."""
        mok = self.mok
        size = _group_size(mok.sequence_group)
        if padding is None:
            tokens = hidden_states.shape[0] * hidden_states.shape[1] * size
            return lambda name: tokens
        local = (~padding).sum().reshape(1)
        groups = {"z_loss": None, "aux_loss": mok.sequence_group, "seq_aux_loss": mok.sequence_group,
                  "global_aux_loss": mok.global_batch_group}  # fmt: skip
        scales: dict[str, torch.Tensor] = {}

        def scale(name: str) -> torch.Tensor:
            if name not in scales:
                scales[name] = _sum_over(local, groups[name])[0] * size
            return scales[name]

        return scale

    def _log_router_losses(self, losses: dict[str, torch.Tensor], repeats: int) -> None:
        """Record each loss in Megatron's MoE metrics tracker as the stock router does: the value
        before its coefficient (and per MTP repeat), under the stock name, with the stock groups."""
        if self.layer_number is None:
            return
        cfg, mok_cfg, pg = self.config, self.mok_config, self.pg_collection
        num_layers = cfg.num_layers + (cfg.mtp_num_layers or 0)
        layer_number = self.layer_number + cfg.num_layers if self.is_mtp_layer else self.layer_number
        tracker = get_moe_metrics_tracker()
        tp_cp, tp_dp_cp = getattr(pg, "tp_cp", None), getattr(pg, "tp_dp_cp", None)
        # MoK loss -> (stock name, coefficient, reduce_group, needs_dp_avg)
        balancing = {
            "aux_loss": ("load_balancing_loss", mok_cfg.aux_loss_coeff, tp_cp, True),
            "seq_aux_loss": ("seq_load_balancing_loss", mok_cfg.seq_aux_loss_coeff, tp_cp, True),
            "global_aux_loss": ("global_load_balancing_loss", mok_cfg.global_aux_loss_coeff, tp_dp_cp, False),
        }
        for key, (name, coeff, group, dp_avg) in balancing.items():
            if key in losses:
                value = losses[key].detach() / repeats / coeff
                tracker.record(name, value, layer_number, num_layers, reduce_group=group, needs_dp_avg=dp_avg)
        if "z_loss" in losses:
            # The z-loss coefficient the loss was taken with: divided by the TP x CP size.
            coeff = mok_cfg.z_loss_coeff / _group_size(self.mok.sequence_group)
            value = losses["z_loss"].detach() / repeats / coeff
            tracker.record("z_loss", value, layer_number, num_layers, avg_group=tp_dp_cp)

    # --- Megatron's EP-overlap schedule (--overlap-moe-expert-parallel-comm) -----------------------
    # models/gpt/fine_grained_callables.py calls these instead of forward, one at a time, on a compute
    # and a communication stream, with each stage's inputs detached (and some freed after use), while
    # another micro-batch runs its own stages: route and preprocess, dispatch, the routed experts,
    # combine and postprocess. They run what MoKMoE.forward runs (begin; prepare_dispatch,
    # exchange_pairs, run_received_pairs, return_pairs, sum_returned_pairs, as
    # moe_experts_expert_parallel composes them; finish) in the same order, so the results are
    # bitwise forward's. One forward of this layer runs at a time (the
    # schedule interleaves another micro-batch's backward, which reads only what autograd saved).

    @property
    def shared_experts(self):
        """MoK's shared experts (the schedule's backward_dw wrapper iterates their parameters)."""
        return self.mok.shared_experts if "mok" in self._modules else None

    @shared_experts.setter
    def shared_experts(self, value) -> None:
        if value is not None:  # BaseMoELayer sets None; MoK's own are self.mok.shared_experts
            raise AttributeError("MoKMoELayer.shared_experts is MoK's own (self.mok.shared_experts)")

    def _stage(self):
        if self._overlap_step is None:
            raise RuntimeError("MoKMoELayer: an EP-overlap stage ran before shared_experts_compute began the forward")
        return self._overlap_step

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """The first stage (Megatron calls it before route): route, then issue the shared experts.
        Returns their output [S x B, H] (None without shared experts)."""
        self._check_forward(hidden_states)
        self._defer_weight_grads_as_configured()
        if self.mok.ep_group is None:
            raise RuntimeError(
                "MoKMoELayer's EP-overlap stages need expert parallelism (--expert-model-parallel-size > 1)"
            )
        step = self.mok.begin(hidden_states, hidden_states.shape[1], self._loss_attacher(hidden_states))
        self._count_and_log(step.routing.losses, step.routing.counted_tokens_per_expert)
        self._overlap_step = step
        return step.shared_out

    def route(self, hidden_states: torch.Tensor, padding_mask=None):
        """(routing weights [T, K], expert ids [T, K]) as shared_experts_compute routed (or, after a
        partial CUDA graph's replay, as the graph routed). Megatron's EP-overlap schedule calls this
        without a padding mask (so its stock layer routes without one); one given here would come
        too late for the routing, so it is refused."""
        if padding_mask is not None:
            raise NotImplementedError(
                "MoKMoELayer.route: the EP-overlap stages route in shared_experts_compute, which takes no padding_mask"
            )
        self._resume_overlap_step(hidden_states)
        routing = self._stage().routing
        return routing.topk_weights, routing.topk_ids

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """(rows, weights) in the exchange's send layout."""
        return self.mok.prepare_dispatch(self._stage())

    def dispatch(self, x_send: torch.Tensor, w_send: torch.Tensor):
        """(rows, weights) received from every rank of the expert-parallel group."""
        plan = self._stage().plan
        _used_on_this_stream(plan.order, plan.local_expert, plan.slot, plan.send_counts)
        with record_function(PROFILER_RANGES[0]):  # MoK's EP ranges, as in MoKMoE.forward
            return exchange_pairs(plan, x_send, w_send)

    def routed_experts_compute(self, x_recv: torch.Tensor, w_recv: torch.Tensor):
        """(this rank's experts' result rows, None). The schedule frees x_recv after this stage when
        should_free_input says so; MoK's experts keep their input for the backward, so they get a copy."""
        from megatron.core.models.common.utils import should_free_input

        step = self._stage()
        _used_on_this_stream(step.plan.expert_recv)
        if should_free_input("mlp", True, self.config, self.num_local_experts):
            x_recv = x_recv.clone()
        with self._expert_weights_into_main_grad(), record_function(PROFILER_RANGES[1]):
            y_recv = self.mok.run_received_pairs(step, x_recv, w_recv)
        return y_recv, None

    def combine(self, y_recv: torch.Tensor) -> torch.Tensor:
        """The result rows back at their senders."""
        plan = self._stage().plan
        _used_on_this_stream(plan.slot)
        with record_function(PROFILER_RANGES[2]):
            return return_pairs(plan, y_recv)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None) -> torch.Tensor:
        """The layer's output [S, B, H]: each token's rows summed, plus the shared experts'."""
        step, self._overlap_step = self._stage(), None
        _used_on_this_stream(step.routing.tokens_per_expert, step.num_dropped)  # plan.order: in dispatch
        routed = sum_returned_pairs(step.plan, output, step.x_TH.dtype)
        out, _ = self.mok.finish(step, routed, shared_expert_output)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return megatron_sharded_state_dict(self, prefix, sharded_offsets, metadata)
