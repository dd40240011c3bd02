"""mok_plugin: Mixture-of-Kittens, a deterministic fused MoE layer for Megatron-Core and DeepSpeed.

Public API only; importing this module loads no framework and compiles no kernel. `load_topology`
reads a run config (mok_plugin.run); `load_config` reads a MoK layer config.
"""

from mok_plugin.config import MoKConfig, MoKConfigError, load_config
from mok_plugin.layer import MoKMoE
from mok_plugin.run import load_topology

__version__ = "0.1.0"

__all__ = ["MoKConfig", "MoKConfigError", "MoKMoE", "load_config", "load_topology", "__version__"]
