"""Megatron-Core adapter: `MoKMoELayer` (a MoELayer running MoK), `moe_block_spec` for
`--spec mok_plugin.megatron moe_block_spec`, and the TransformerConfig -> MoKConfig mapping.

Needs megatron-core 0.19 (`pip install 'mok_plugin[megatron]'`)."""

from mok_plugin.megatron.config_map import mok_config_from_megatron
from mok_plugin.megatron.layer import MoKMoELayer, set_default_mok_overrides
from mok_plugin.megatron.spec import moe_block_spec, use_mok

__all__ = ["MoKMoELayer", "moe_block_spec", "mok_config_from_megatron", "set_default_mok_overrides", "use_mok"]
