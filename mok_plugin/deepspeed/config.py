"""The `"mok"` block of a DeepSpeed config: its schema and where it is read from.

    "mok": {
        "enabled": true,                 # false: the stock deepspeed.moe.layer.MoE runs unchanged
        "config": "configs/....yaml",    # optional: a YAML of MoK knobs (a MoKConfig's fields)
        "deterministic": true,
        "backend": "auto",               # auto | triton | reference
        "kernel_variant": "multi_kernel",
        "ep_exchange": "exact",          # exact | capacity
        "ep_capacity_factor": 2.0,
        "ep_transport": "nccl"
    }

DeepSpeed keeps unknown top-level keys without checking them, so this module checks the block
itself: unknown keys and bad values are errors naming `mok.<key>`.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mok_plugin.config import MoKConfigError, format_validation_error

__all__ = ["DeepSpeedMoKSettings", "read_mok_settings"]


class DeepSpeedMoKSettings(BaseModel):
    """The validated `"mok"` block; `knobs()` are the MoKConfig fields it sets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    config: Path | None = Field(default=None, description="YAML file of MoK knobs (MoKConfig fields).")
    deterministic: bool = True
    backend: Literal["auto", "triton", "reference"] | None = None
    kernel_variant: Literal["megakernel", "multi_kernel"] | None = None
    ep_exchange: Literal["capacity", "exact"] | None = None
    ep_capacity_factor: float | None = Field(default=None, gt=0)
    ep_transport: Literal["nccl", "symmetric_memory"] | None = None

    def knobs(self) -> dict[str, Any]:
        """MoKConfig fields: those of the YAML file, then those set in the block."""
        knobs: dict[str, Any] = {}
        if self.config is not None:
            if not self.config.is_file():
                raise MoKConfigError(f"mok.config={str(self.config)!r}: no such file")
            data = yaml.safe_load(self.config.read_text()) or {}
            knobs.update(data.get("mok", data) if isinstance(data, dict) else {})
        for key in ("deterministic", "backend", "kernel_variant", "ep_exchange", "ep_capacity_factor", "ep_transport"):
            value = getattr(self, key)
            if value is not None:
                knobs[key] = value
        return knobs


def _as_dict(ds_config: dict | str | Path) -> dict:
    """A DeepSpeed config as DeepSpeed accepts it: a dict, a JSON file path, or base64 JSON."""
    if isinstance(ds_config, dict):
        return ds_config
    path = Path(ds_config)
    if path.is_file():
        return json.loads(path.read_text())
    try:
        return json.loads(base64.urlsafe_b64decode(str(ds_config)).decode())
    except Exception as error:  # noqa: BLE001 - any decoding failure means "not a config"
        raise MoKConfigError(
            f"DeepSpeed config {str(ds_config)[:80]!r}: not a dict, a JSON file or base64 JSON"
        ) from error


def read_mok_settings(ds_config: dict | str | Path | None) -> DeepSpeedMoKSettings:
    """The `"mok"` block of a DeepSpeed config (disabled when absent).

    Raises:
        MoKConfigError: an unknown key or a bad value in the block, naming `mok.<key>`.
    """
    if ds_config is None:
        return DeepSpeedMoKSettings()
    block = _as_dict(ds_config).get("mok", {})
    if not isinstance(block, dict):
        raise MoKConfigError(f"mok: expected an object, got {type(block).__name__}")
    try:
        return DeepSpeedMoKSettings(**block)
    except ValidationError as error:
        message = format_validation_error(
            error, 'invalid "mok" block in the DeepSpeed config', "mok", DeepSpeedMoKSettings.model_fields
        )
        raise MoKConfigError(message) from None
