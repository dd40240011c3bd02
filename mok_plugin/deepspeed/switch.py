"""Switching models written against `deepspeed.moe.layer.MoE` to MoK without code changes.

`apply(ds_config)` reads the ds_config's `"mok"` block; when it is enabled, every
`deepspeed.moe.layer.MoE(...)` built afterwards (even through a name imported earlier) is a
`mok_plugin.deepspeed.MoE` with the block's knobs. `revert()` undoes it; both are idempotent.
The source patch in patches/ does the same from inside DeepSpeed: its `MoE.__new__` calls
`new_moe`, which also reads a ds_config named by the MOK_DEEPSPEED_CONFIG environment variable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deepspeed.moe.layer import MoE as StockMoE

from mok_plugin.deepspeed.config import DeepSpeedMoKSettings, read_mok_settings
from mok_plugin.deepspeed.layer import MoE, set_default_knobs

__all__ = ["apply", "build_moe", "new_moe", "revert"]

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
