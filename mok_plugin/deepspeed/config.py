"""The `"mok"` block of a DeepSpeed config: its schema and where it is read from.

    "mok": {
        "enabled": true,                 # false: the stock deepspeed.moe.layer.MoE runs unchanged
        "config": "configs/....yaml",    # optional: a YAML of MoK knobs (a MoKConfig's fields)
        "backend": "auto",               # auto | triton | reference
        "kernel_variant": "multi_kernel",
        "ep_exchange": "exact",          # exact | capacity
        "ep_capacity_factor": 2.0,
        "ep_transport": "nccl",
        "debug_checks": false,
        "random_seed": 0,
        "fp8": null,                     # e4m3 | hybrid: FP8 experts (mok_plugin/fp8)
        "fp8_scaling": "blockwise"       # blockwise | tensorwise | mxfp8: Transformer Engine's recipe of that name
    }

The knob keys are MoKConfig's MOK_KNOBS, `fp8` and `fp8_scaling` (DeepSpeed's MoE has no precision
option of its own, so the block chooses it; DEEPSPEED_KNOBS; tensorwise and mxfp8 run MoK's PyTorch
FP8 path, fp8/experts.py), each with MoKConfig's own type and bounds (the block's
fields are derived from MoKConfig's field definitions, not repeated here), and the block is as strict
as MoKConfig: booleans are only true/false (not 1, "yes", "on" or "true"), numbers are not read from
strings ("2.0"), integers are not floats or booleans, and a knob given as null is an error (leave it
out to keep the layer's value). DeepSpeed keeps unknown top-level keys without checking them, so this
module checks the block itself: unknown keys and bad values are errors naming `mok.<key>`. There is
no `deterministic` key (MoK is always deterministic): passing it, in the block or in the YAML file, is
an error that says so.

The YAML file is read and checked when the block is (enabled or not), not later when a layer is
built: a missing or unreadable file, a key that is not a MoKConfig field, or a value of the wrong type
or out of bounds is an error naming `mok.config` and the file. Checks across fields (for example
ep_transport='symmetric_memory' needs ep_exchange='capacity') need the layer's other fields and run
when the layer is built.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

from mok_plugin.config import (
    MOK_KNOBS,
    REMOVED_FIELDS,
    MoKConfig,
    MoKConfigError,
    format_validation_error,
    read_yaml,
    short_repr,
)

__all__ = ["DEEPSPEED_KNOBS", "DeepSpeedMoKSettings", "read_mok_settings"]

# The MoKConfig fields the "mok" block (and a layer's mok_config) sets freely: MoK's own knobs, and
# fp8 and fp8_scaling, which Megatron's --fp8-format / --fp8-recipe set there but DeepSpeed's MoE has
# no option for. Every other field follows DeepSpeed's arguments.
DEEPSPEED_KNOBS = (*MOK_KNOBS, "fp8", "fp8_scaling")


def _unset_by_default(name: str) -> tuple[Any, FieldInfo]:
    """MoKConfig's field `name` (type, bounds, description) with the default None, meaning "not set":
    the default is not validated, so an explicit null is checked against the field's type (and refused
    where MoKConfig refuses it)."""
    info = MoKConfig.model_fields[name]
    return info.annotation, FieldInfo.merge_field_infos(info, default=None)


# Every MoKConfig field, none required, as strict as MoKConfig: checks the values of a YAML file of
# knobs one by one (MoKConfig's checks across fields need the layer's shape and run at build time).
_MoKFields = create_model(
    "_MoKFields",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{name: _unset_by_default(name) for name in MoKConfig.model_fields},
)


class _MoKBlock(BaseModel):
    """`enabled` and `config`; DeepSpeedMoKSettings adds the knobs (DEEPSPEED_KNOBS) from MoKConfig."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = False
    # Not strict: JSON gives the path as a string (a Path is accepted from Python too).
    config: Path | None = Field(default=None, strict=False, description="YAML file of MoK knobs (MoKConfig fields).")
    _file_knobs: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            message = format_validation_error(
                error, 'invalid "mok" block in the DeepSpeed config', "mok", type(self).model_fields
            )
            raise MoKConfigError(message) from None

    @model_validator(mode="after")
    def _read_the_file(self) -> _MoKBlock:
        if self.config is not None:
            try:
                self._file_knobs = _read_knobs_file(self.config)
            except MoKConfigError as error:  # one line of the block's report: its own lines indented
                raise ValueError(str(error).replace("\n", "\n  ")) from None
        return self

    def knobs(self) -> dict[str, Any]:
        """MoKConfig fields: those of the YAML file (read and checked with the block), then the knobs
        set in the block."""
        knobs = dict(self._file_knobs)
        for key in DEEPSPEED_KNOBS:
            value = getattr(self, key)
            if value is not None:
                knobs[key] = value
        return knobs


DeepSpeedMoKSettings = create_model(
    "DeepSpeedMoKSettings",
    __base__=_MoKBlock,
    __module__=__name__,
    __doc__="""The validated `"mok"` block; `knobs()` are the MoKConfig fields it sets.

    Fields: `enabled`, `config` and the knobs DEEPSPEED_KNOBS, each a MoKConfig field (same type, bounds and
    strictness) whose default None means "not set".

    Raises:
        MoKConfigError: an unknown key, a removed one, a value of the wrong type or out of bounds,
            naming `mok.<key>`; a YAML file that cannot be read or holds a bad knob, naming
            `mok.config` and the file.
    """,
    **{name: _unset_by_default(name) for name in DEEPSPEED_KNOBS},
)


def _read_knobs_file(path: Path) -> dict[str, Any]:
    """The MoK knobs of the YAML file `path` (at the top level or under `mok:`), each value checked
    against its MoKConfig field.

    Raises:
        MoKConfigError: naming `mok.config` and the file: it is missing or cannot be read or parsed,
            is not a mapping, holds a key that is not a MoKConfig field (or a removed one), or a value
            that MoKConfig's field refuses.
    """
    where = f"mok.config={short_repr(str(path), limit=4096)}:"  # the whole path (PATH_MAX), not 80 characters of it
    if not _exists(path):
        raise MoKConfigError(f"{where} no such file")
    data = read_yaml(path, "mok.config") or {}
    data = data.get("mok", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise MoKConfigError(f"{where} expected a mapping of MoK knobs, got {type(data).__name__}")
    problems = [f"mok.{key}: {REMOVED_FIELDS[key]}" for key in data if key in REMOVED_FIELDS]
    unknown = sorted(str(k) for k in data if k not in MoKConfig.model_fields and k not in REMOVED_FIELDS)
    if unknown:
        problems.append(f"unknown MoK fields {short_repr(unknown)}; allowed: {sorted(MoKConfig.model_fields)}")
    if problems:
        raise MoKConfigError(f"{where} " + "; ".join(problems))
    try:
        _MoKFields(**data)
    except ValidationError as error:
        raise MoKConfigError(format_validation_error(error, f"{where} invalid MoK knobs", "mok")) from None
    return dict(data)


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
    """The `"mok"` block of a DeepSpeed config (disabled when absent), its YAML file read and checked.

    Raises:
        MoKConfigError: an unknown key or a bad value in the block, naming `mok.<key>`; a YAML file
            that is missing, unreadable or holds a bad knob, naming `mok.config` and the file; the
            block enabled beside a setting MoK refuses (`_refuse_beside_mok`: AutoEP, DeepCompile).
    """
    if ds_config is None:
        return DeepSpeedMoKSettings()
    config = _as_dict(ds_config)
    if not isinstance(config, dict):
        raise MoKConfigError(f"DeepSpeed config: expected a JSON object, got {type(config).__name__}")
    block = config.get("mok", {})
    if not isinstance(block, dict):
        raise MoKConfigError(f"mok: expected an object, got {type(block).__name__}")
    settings = DeepSpeedMoKSettings(**{str(key): value for key, value in block.items()})
    if settings.enabled:
        _refuse_beside_mok(config)
    return settings


def _refuse_beside_mok(config: dict) -> None:
    """The ds_config settings beside an enabled "mok" block that MoK refuses by name (their verdicts:
    deepspeed/verdicts.py's CONFIG_VERDICTS), each read as DeepSpeed reads it (`.get` with its default)."""
    autoep = config.get("expert_parallel")
    if isinstance(autoep, dict) and autoep.get("enabled", False):
        raise MoKConfigError(
            "mok.enabled=True with expert_parallel.enabled=True (DeepSpeed's AutoEP): inside deepspeed.initialize "
            "AutoEP replaces the model's Hugging Face MoE blocks with its own AutoEPMoELayer, which MoK does not "
            "replace, so MoK would not run. MoK replaces deepspeed.moe.layer.MoE (its ep_size sets expert "
            'parallelism); disable one of the two blocks ("enabled": false)'
        )
    compile_block = config.get("compile")
    if isinstance(compile_block, dict) and compile_block.get("deepcompile", False):
        raise MoKConfigError(
            "mok.enabled=True with compile.deepcompile=True: DeepCompile's graph passes over MoK's layer are "
            "untested, so MoK refuses them; engine.compile() without DeepCompile compiles MoK (tested)"
        )
