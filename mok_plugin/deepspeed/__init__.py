"""DeepSpeed adapter: `MoE` (a deepspeed.moe.layer.MoE running MoK, with any expert module: a MoK
family runs fused, anything else as itself, see experts.py), `SwiGLUExpert`, the `"mok"` ds_config
block, `apply(ds_config)` / `revert()` for models written against DeepSpeed's MoE, and
`check_model(model, ds_config)`, which warns when the ds_config enables MoK but the model's MoE
layers are still DeepSpeed's stock layer.

Importing this package wraps `deepspeed.initialize` (once, documented in switch.py; DeepSpeed's own
is `deepspeed.initialize.__wrapped__`): before calling DeepSpeed's, it reads the config's "mok" block
and runs check_model on the model, so that a ds_config enabling MoK with a model built before
apply() (or without it) warns that the stock layer runs. Nothing else in DeepSpeed changes.

Needs deepspeed 0.19 (`pip install 'mok_plugin[deepspeed]'`)."""

from mok_plugin.deepspeed.config import DEEPSPEED_KNOBS, DeepSpeedMoKSettings, read_mok_settings
from mok_plugin.deepspeed.experts import SwiGLUExpert
from mok_plugin.deepspeed.layer import MoE
from mok_plugin.deepspeed.switch import apply, build_moe, check_model, revert

__all__ = [
    "DEEPSPEED_KNOBS",
    "DeepSpeedMoKSettings",
    "MoE",
    "SwiGLUExpert",
    "apply",
    "build_moe",
    "check_model",
    "read_mok_settings",
    "revert",
]
