"""Layer specs: swap Megatron's MoELayer for MoKMoELayer, in any spec tree.

`moe_block_spec` is what a stock launch names with `--spec mok_plugin.megatron moe_block_spec`:
Megatron 0.19's GPT builder calls it with the GPTModelConfig (and vp_stage) and uses the block
spec it returns. Megatron derives the multi-token-prediction (MTP) spec separately, from its own
layer specs, so `moe_block_spec` also wraps that derivation (`megatron.training.models.gpt.
mtp_block_spec`) to swap the MoE layers of MTP blocks too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from mok_plugin.megatron.layer import MoKMoELayer

__all__ = ["moe_block_spec", "use_mok"]


def _is_stock_moe(obj: Any) -> bool:
    return obj is MoELayer


def use_mok(spec: Any, _seen: dict[int, Any] | None = None) -> Any:
    """Replace every MoELayer builder in a spec tree (ModuleSpec, TransformerBlockSubmodules,
    partials, lists) by the same builder of MoKMoELayer, in place where the tree is mutable.
    Returns the (possibly new) root. Shared sub-specs are visited once."""
    seen = {} if _seen is None else _seen
    if id(spec) in seen:
        return seen[id(spec)]
    result = spec
    if isinstance(spec, functools.partial):
        if _is_stock_moe(spec.func):
            result = functools.partial(MoKMoELayer, *spec.args, **spec.keywords)
        else:
            keywords = {k: use_mok(v, seen) for k, v in spec.keywords.items()}
            result = functools.partial(spec.func, *spec.args, **keywords)
    elif isinstance(spec, ModuleSpec):
        if _is_stock_moe(spec.module):
            spec.module = MoKMoELayer
        if spec.submodules is not None:
            spec.submodules = use_mok(spec.submodules, seen)
    elif _is_stock_moe(spec):
        result = MoKMoELayer
    elif isinstance(spec, list):
        spec[:] = [use_mok(item, seen) for item in spec]
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            new = use_mok(value, seen)
            if new is not value:
                setattr(spec, field.name, new)
    seen[id(spec)] = result
    return result


def _install_mtp_swap() -> None:
    """Make Megatron's MTP spec derivation return MoK MoE layers too (idempotent)."""
    from megatron.training.models import gpt

    if getattr(gpt.mtp_block_spec, "_mok_wrapped", False):
        return
    stock = gpt.mtp_block_spec

    @functools.wraps(stock)
    def mtp_block_spec(*args, **kwargs):
        spec = stock(*args, **kwargs)
        return None if spec is None else use_mok(spec)

    mtp_block_spec._mok_wrapped = True
    gpt.mtp_block_spec = mtp_block_spec


def _install_upcycling_support() -> None:
    """Let Megatron's upcycling (--moe-use-upcycling: a dense checkpoint's MLPs copied into every
    expert) fill MoK layers (idempotent). upcycling_utils names the MoE state dict's expert keys
    after the class of the module it finds as the layer's "experts", SequentialMLP or TEGroupedMLP,
    and refuses any other; MoK's layer loads SequentialMLP's keys, so for a MoK layer it finds that
    class."""
    from megatron.core.transformer.moe import upcycling_utils
    from megatron.core.transformer.moe.experts import SequentialMLP

    stock = upcycling_utils._find_submodule
    if getattr(stock, "_mok_wrapped", False):
        return
    keys_of = SequentialMLP.__new__(SequentialMLP)  # read by an isinstance check only

    @functools.wraps(stock)
    def _find_submodule(model, submodule_name):
        if submodule_name == "experts" and isinstance(model, MoKMoELayer):
            return keys_of
        return stock(model, submodule_name)

    _find_submodule._mok_wrapped = True
    upcycling_utils._find_submodule = _find_submodule


def _upcycling_dense_model() -> bool:
    """Whether Megatron's training is building the dense model of --moe-use-upcycling (it clears
    --num-experts for that build, then restores it)."""
    from megatron.training import global_vars

    args = global_vars._GLOBAL_ARGS  # (get_args() asserts they were parsed: not in a bare build)
    return bool(getattr(args, "moe_use_upcycling", False)) and not args.num_experts


def moe_block_spec(model_config: Any, vp_stage: int | None = None) -> Any:
    """The stock GPT block spec for `model_config` (a megatron.training GPTModelConfig) with every
    MoE layer (MTP layers included) running MoK. Use as `--spec mok_plugin.megatron moe_block_spec`.
    Under --moe-use-upcycling, the dense model Megatron builds first (no experts) gets the stock
    spec, and the dense weights are then upcycled into MoK's experts.

    Raises:
        ValueError: the model has no MoE layers (`--num-experts` is not set).
    """
    from megatron.training.models.gpt import default_layer_spec

    if not model_config.transformer.num_moe_experts:
        if _upcycling_dense_model():
            return default_layer_spec(model_config, vp_stage)
        raise ValueError("--spec mok_plugin.megatron moe_block_spec needs an MoE model: set --num-experts")
    _install_mtp_swap()
    _install_upcycling_support()
    return use_mok(default_layer_spec(model_config, vp_stage))
