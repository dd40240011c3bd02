"""The `"mok"` block of a DeepSpeed config: its schema and where it is read from.

    "mok": {
        "enabled": true,                 # false: the stock deepspeed.moe.layer.MoE runs unchanged
        "config": "configs/....yaml",    # optional: a YAML of MoK knobs (a MoKConfig's fields)
        "backend": "auto",               # auto | triton | reference
        "kernel_variant": "multi_kernel",
        "ep_exchange": "exact",          # exact | capacity
        "ep_capacity_factor": 2.0,
        "ep_transport": "nccl"
    }

DeepSpeed keeps unknown top-level keys without checking them, so this module checks the block
itself: unknown keys and bad values are errors naming `mok.<key>`. There is no `deterministic` key
(MoK is always deterministic): passing it, in the block or in the YAML file, is an error that says
so. The YAML file is checked the same way (its keys must be MoKConfig fields), naming the file.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mok_plugin.config import (
    MAX_FACTOR,
    REMOVED_FIELDS,
    MoKConfig,
    MoKConfigError,
    format_validation_error,
    read_yaml,
    short_repr,
)

__all__ = ["DeepSpeedMoKSettings", "read_mok_settings"]


class DeepSpeedMoKSettings(BaseModel):
    """The validated `"mok"` block; `knobs()` are the MoKConfig fields it sets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    config: Path | None = Field(default=None, description="YAML file of MoK knobs (MoKConfig fields).")
    backend: Literal["auto", "triton", "reference"] | None = None
    kernel_variant: Literal["megakernel", "multi_kernel"] | None = None
    ep_exchange: Literal["capacity", "exact"] | None = None
    ep_capacity_factor: float | None = Field(default=None, gt=0, le=MAX_FACTOR, allow_inf_nan=False)
    ep_transport: Literal["nccl", "symmetric_memory"] | None = None

    def knobs(self) -> dict[str, Any]:
        """MoKConfig fields: those of the YAML file, then those set in the block.

        Raises:
            MoKConfigError: the file cannot be read or parsed, is not a mapping, or holds a key that
                is not a MoKConfig field (or a removed one); each names `mok.config` and the file.
        """
        knobs: dict[str, Any] = {}
        if self.config is not None:
            where = f"mok.config={short_repr(str(self.config))}:"
            if not _exists(self.config):
                raise MoKConfigError(f"{where} no such file")
            data = read_yaml(self.config, "mok.config") or {}
            data = data.get("mok", data) if isinstance(data, dict) else data
            if not isinstance(data, dict):
                raise MoKConfigError(f"{where} expected a mapping of MoK knobs, got {type(data).__name__}")
            problems = [f"mok.{key}: {REMOVED_FIELDS[key]}" for key in data if key in REMOVED_FIELDS]
            unknown = sorted(str(k) for k in data if k not in MoKConfig.model_fields and k not in REMOVED_FIELDS)
            if unknown:
                problems.append(f"unknown MoK fields {short_repr(unknown)}; allowed: {sorted(MoKConfig.model_fields)}")
            if problems:
                raise MoKConfigError(f"{where} " + "; ".join(problems))
            knobs.update(data)
        for key in ("backend", "kernel_variant", "ep_exchange", "ep_capacity_factor", "ep_transport"):
            value = getattr(self, key)
            if value is not None:
                knobs[key] = value
        return knobs


def _exists(path: Path) -> bool:
    """Whether `path` names something; False for a name the OS refuses (too long: base64 configs)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _as_dict(ds_config: dict | str | Path) -> dict:
    """A DeepSpeed config as DeepSpeed accepts it: a dict, a JSON file path, or base64 JSON."""
    if isinstance(ds_config, dict):
        return ds_config
    path = Path(ds_config)
    if _exists(path):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
            reason = error.strerror if isinstance(error, OSError) else str(error)[:200]
            raise MoKConfigError(f"DeepSpeed config {path}: cannot read it as JSON: {reason}") from None
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
    config = _as_dict(ds_config)
    if not isinstance(config, dict):
        raise MoKConfigError(f"DeepSpeed config: expected a JSON object, got {type(config).__name__}")
    block = config.get("mok", {})
    if not isinstance(block, dict):
        raise MoKConfigError(f"mok: expected an object, got {type(block).__name__}")
    try:
        return DeepSpeedMoKSettings(**block)
    except ValidationError as error:
        message = format_validation_error(
            error, 'invalid "mok" block in the DeepSpeed config', "mok", DeepSpeedMoKSettings.model_fields
        )
        raise MoKConfigError(message) from None
