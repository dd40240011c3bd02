"""`MoKMoELayer`: a Megatron-Core MoELayer whose routing, dispatch, experts and combine are MoK's.

It subclasses `MoELayer`, so Megatron still treats it as an MoE layer (`is_moe_layer`, the
expert-parallel groups, the optimizer's expert parameter groups, aux-loss logging), but it does
not build the stock router, experts or dispatcher: it holds one `mok_plugin.MoKMoE` (`self.mok`)
over Megatron's expert-parallel group and has no math of its own.

Megatron contracts it keeps:
  - forward(hidden_states [S, B, H], ...) -> (output [S, B, H], None);
  - the load-balancing loss and z-loss reach the router through `MoEAuxLossAutoScaler` on the
    output (scaled by Megatron's main-loss backward scale), and are logged like the stock router's;
  - expert parameters carry `allreduce=False` (reduced over expert-data-parallel ranks);
  - with --moe-router-enable-expert-bias, `expert_bias` / `local_tokens_per_expert` sit where
    Megatron's finalize_model_grads looks for them (it updates the bias once per global batch);
  - state_dict / sharded_state_dict use the stock keys (checkpoint.py);
  - with gradient-accumulation fusion, expert weight gradients are added into `main_grad` (fp32)
    by the backward itself, in expert order, and `grad_added_to_main_grad` is set, as Megatron's
    fused linear layers do.
Not supported (an error at build time, naming the flag): see config_map.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mok_plugin.config import MoKConfig
from mok_plugin.layer import MoKMoE
from mok_plugin.megatron.checkpoint import install_state_dict_hooks, megatron_sharded_state_dict
from mok_plugin.megatron.config_map import mok_config_from_megatron

try:
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_default_pg_collection,
        save_to_aux_losses_tracker,
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


class MoKMoELayer(MoELayer):
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
        self.mok_config: MoKConfig = mok_config_from_megatron(
            config,
            _DEFAULT_OVERRIDES if mok_overrides is None else mok_overrides,
            stock_experts=self.stock_experts,
        )
        pg_collection = pg_collection or get_default_pg_collection()
        # BaseMoELayer sets the groups, local expert indices and layer number; MoELayer.__init__
        # would build the stock router, experts and dispatcher, which MoK replaces.
        super(MoELayer, self).__init__(config, layer_number, pg_collection, is_mtp_layer)
        self.submodules = submodules
        self.pg_collection = pg_collection
        self.name = name
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        ep_group = pg_collection.ep if self.mok_config.ep_size > 1 else None
        self.mok = MoKMoE(self.mok_config, ep_group=ep_group, device=device, init_std=config.init_method_std)
        if self.mok_config.expert_bias:
            # Megatron's finalize_model_grads updates expert_bias from these counts once per global batch.
            self.mok.register_buffer(
                "local_tokens_per_expert", torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device)
            )
        for param in self.mok.experts.parameters():
            param.allreduce = False
        install_state_dict_hooks(self)

    @property
    def expert_bias(self) -> torch.Tensor | None:
        return self.mok.expert_bias

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """(output [S, B, H], None). Raises NotImplementedError for padding masks (packed sequences)."""
        if padding_mask is not None:
            raise NotImplementedError(
                "MoKMoELayer does not take a padding_mask yet (packed/THD sequences route every token)"
            )
        if intermediate_tensors is not None:
            raise NotImplementedError("MoKMoELayer does not support intermediate_tensors (fine-grained EP overlap)")
        output, aux_loss = self._run_mok(hidden_states)
        if self.mok_config.aux_loss_coeff > 0 or self.mok_config.z_loss_coeff > 0:
            self._log_aux_loss(aux_loss)
            output = MoEAuxLossAutoScaler.apply(output, aux_loss)
        if self.mok_config.expert_bias and self.training:
            with torch.no_grad():
                self.mok.local_tokens_per_expert += self.mok.last_tokens_per_expert
        return output, None

    def _run_mok(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self.mok.experts
        if not (self.config.gradient_accumulation_fusion and hasattr(experts.down_proj, "main_grad")):
            return self.mok(hidden_states)
        # Route the expert weights through _MainGradAccumulation for this call only. Biases keep
        # ordinary gradients, as in Megatron's fused linear layers (only the weight's goes to main_grad).
        originals = {name: experts._parameters[name] for name in ("gate_up_proj", "down_proj")}
        originals = {name: param for name, param in originals.items() if param is not None}
        try:
            for name, param in originals.items():
                del experts._parameters[name]
                setattr(experts, name, _MainGradAccumulation.apply(param))
            return self.mok(hidden_states)
        finally:
            for name, param in originals.items():
                delattr(experts, name)
                experts._parameters[name] = param

    def _log_aux_loss(self, aux_loss: torch.Tensor) -> None:
        """Log like the stock router: the load-balancing loss before its coefficient. With a z-loss
        too, MoK's single router loss (both terms, scaled) is logged as `mok_router_loss`."""
        if self.layer_number is None:
            return
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        cfg = self.mok_config
        if cfg.z_loss_coeff == 0:
            name, value = "load_balancing_loss", aux_loss.detach() / cfg.aux_loss_coeff
        else:
            name, value = "mok_router_loss", aux_loss.detach()
        save_to_aux_losses_tracker(name, value, self.layer_number, num_layers)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return megatron_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False) -> None:
        """Nothing deferred: MoK computes weight gradients in its backward."""
