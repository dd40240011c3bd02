"""Switching models written against `deepspeed.moe.layer.MoE` to MoK without code changes.

`apply(ds_config)` reads the ds_config's `"mok"` block; when it is enabled, every
`deepspeed.moe.layer.MoE(...)` built afterwards (even through a name imported earlier) is a
`mok_plugin.deepspeed.MoE` with the block's knobs. `revert()` undoes it; both are idempotent.
The source patch in patches/ does the same from inside DeepSpeed: its `MoE.__new__` calls
`new_moe`, which also reads a ds_config named by the MOK_DEEPSPEED_CONFIG environment variable.

`check_model(model, ds_config)` names the model's MoE layers that are still DeepSpeed's stock layer
while the ds_config enables MoK (apply() not called before the model was built, and no source patch
with MOK_DEEPSPEED_CONFIG), and warns that the stock layer runs. DeepSpeed has no hook for this: the
engine takes the model without a registration hook torch would call, and reads the ds_config
without looking at the "mok" key. So importing mok_plugin.deepspeed wraps `deepspeed.initialize`
(once; DeepSpeed's own stays at `deepspeed.initialize.__wrapped__`): the wrapper reads the "mok"
block of the config it is given (a bad block is a MoKConfigError there), runs check_model on the
model, then calls DeepSpeed's initialize with the same arguments, and gives the engine it returns
the signal of when the weights change (weight_steps.py). Code that took `initialize` from deepspeed
before importing mok_plugin.deepspeed (`from deepspeed import initialize`) is not checked.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import deepspeed
from deepspeed.moe.layer import MoE as StockMoE
from torch import nn

from mok_plugin.config import short_repr
from mok_plugin.deepspeed.config import DeepSpeedMoKSettings, read_mok_settings
from mok_plugin.deepspeed.layer import MoE, set_default_knobs
from mok_plugin.deepspeed.weight_steps import mark_weight_updates

__all__ = ["apply", "build_moe", "check_model", "new_moe", "revert"]

ENV = "MOK_DEEPSPEED_CONFIG"
_ORIGINAL_NEW = StockMoE.__dict__.get("__new__")  # the source patch's, or none
_state: dict[str, Any] = {"settings": None}


def new_moe(cls: type, stock: type = StockMoE):
    """`__new__` for DeepSpeed's MoE: a MoK layer when the active (or MOK_DEEPSPEED_CONFIG) ds_config
    enables MoK, otherwise the class asked for."""
    settings = _state["settings"]
    if settings is None and os.environ.get(ENV):
        settings = _activate(read_mok_settings(Path(os.environ[ENV])))
    if cls is stock and settings is not None and settings.enabled:
        return object.__new__(MoE)
    return object.__new__(cls)


def _activate(settings: DeepSpeedMoKSettings) -> DeepSpeedMoKSettings:
    _state["settings"] = settings
    set_default_knobs(settings.knobs() if settings.enabled else {})
    return settings


def _patched_new(cls, *args, **kwargs):
    return new_moe(cls)


def apply(ds_config: dict | str | Path) -> bool:
    """Build MoK layers for every DeepSpeed MoE constructed from now on, if the ds_config enables it.

    Returns:
        True when MoK is enabled (the switch is on), False when the block is absent or disabled
        (the stock layer runs unchanged).
    Raises:
        MoKConfigError: a bad `"mok"` block, naming the key.
    """
    settings = _activate(read_mok_settings(ds_config))
    if not settings.enabled:
        revert()
        return False
    StockMoE.__new__ = staticmethod(_patched_new)
    return True


def revert() -> None:
    """DeepSpeed's MoE builds the stock layer again (the source patch's own switch stays).

    Without the source patch, the `__new__` that apply() installed stays in place, inert: CPython
    keeps calling a removed `__new__`'s slot with the constructor's arguments, which
    `object.__new__` refuses, so it cannot simply be deleted."""
    _state["settings"] = None
    set_default_knobs({})
    if _ORIGINAL_NEW is not None:
        StockMoE.__new__ = _ORIGINAL_NEW


def build_moe(ds_config: dict | str | Path | None, **moe_kwargs: Any):
    """A MoE layer for the ds_config: MoK's when its `"mok"` block is enabled, DeepSpeed's otherwise.
    `moe_kwargs` are DeepSpeed MoE constructor arguments (hidden_size, expert, num_experts, ...)."""
    settings = read_mok_settings(ds_config)
    if settings.enabled:
        return MoE(**moe_kwargs, mok_config=settings.knobs())
    return StockMoE(**moe_kwargs)


def check_model(model: nn.Module, ds_config: dict | str | Path | None) -> list[str]:
    """The model's DeepSpeed MoE layers that run the stock layer although the ds_config enables MoK.

    When there are any, warns (UserWarning) that the stock layer runs and how to switch: call
    apply(ds_config) before building the model. Nothing when the block is absent or disabled, or
    every MoE layer is MoK's. `deepspeed.initialize` runs this on its model and config once
    mok_plugin.deepspeed is imported (see the module's docstring).

    Returns:
        The stock layers' names in the model ("" for the model itself).
    Raises:
        MoKConfigError: a bad `"mok"` block, naming the key.
    """
    return _check_model(model, read_mok_settings(ds_config), stacklevel=3)


def _check_model(model: nn.Module, settings: DeepSpeedMoKSettings, stacklevel: int) -> list[str]:
    if not settings.enabled:
        return []
    stock = [
        name for name, module in model.named_modules() if isinstance(module, StockMoE) and not isinstance(module, MoE)
    ]
    if stock:
        warnings.warn(
            f'MoK: the ds_config enables the "mok" block, but {len(stock)} MoE layer(s) of the model '
            f"({short_repr(stock)}) are DeepSpeed's stock deepspeed.moe.layer.MoE: the stock layer runs, not "
            "MoK. Call mok_plugin.deepspeed.apply(ds_config) before building the model (or apply the source "
            "patch, `mok patch apply deepspeed`, and name the ds_config in MOK_DEEPSPEED_CONFIG)",
            UserWarning,
            stacklevel=stacklevel,
        )
    return stock


def _initialize_config(arguments: dict[str, Any]) -> Any:
    """The ds_config deepspeed.initialize would use: `config`, else `config_params`, else the
    `deepspeed_config` of `args` (as DeepSpeed picks it)."""
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    if config is None:
        config = getattr(arguments.get("args"), "deepspeed_config", None)
    return config


def _load_ds_config(config: Any) -> dict | None:
    """The ds_config as DeepSpeed parses it (a dict, an hjson/JSON file, base64); None where DeepSpeed
    cannot parse it either (its initialize reports that)."""
    if isinstance(config, dict):
        return config
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

        loaded = load_ds_config(str(config) if isinstance(config, Path) else config)
    except Exception:  # noqa: BLE001 - not a config DeepSpeed reads: DeepSpeed's own error follows
        return None
    return loaded if isinstance(loaded, dict) else None


def _wrap_initialize() -> None:
    """deepspeed.initialize, checking the model against the config's "mok" block first (once)."""
    original = deepspeed.initialize
    if getattr(original, "_mok_checks_the_model", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # DeepSpeed reports the bad call
            arguments = {}
        model, config = arguments.get("model"), _load_ds_config(_initialize_config(arguments))
        if isinstance(model, nn.Module) and config is not None and "mok" in config:
            _check_model(model, read_mok_settings(config), stacklevel=3)
        result = original(*args, **kwargs)
        mark_weight_updates(result[0])  # FP8 weight copies kept through a step (weight_steps.py)
        return result

    initialize._mok_checks_the_model = True  # type: ignore[attr-defined]
    deepspeed.initialize = initialize


_wrap_initialize()
