"""DeepSpeed adapter: `MoE` (a deepspeed.moe.layer.MoE running MoK, with any expert module: a MoK
family runs fused, anything else as itself, see experts.py), `SwiGLUExpert`, the `"mok"` ds_config
block, and `apply(ds_config)` / `revert()` for models written against DeepSpeed's MoE.

Needs deepspeed 0.19 (`pip install 'mok_plugin[deepspeed]'`)."""

from mok_plugin.deepspeed.config import DeepSpeedMoKSettings, read_mok_settings
from mok_plugin.deepspeed.experts import SwiGLUExpert
from mok_plugin.deepspeed.layer import MoE
from mok_plugin.deepspeed.switch import apply, build_moe, revert

__all__ = ["DeepSpeedMoKSettings", "MoE", "SwiGLUExpert", "apply", "build_moe", "read_mok_settings", "revert"]
