"""mok_plugin: Mixture-of-Kittens, a deterministic fused MoE layer for Megatron-Core and DeepSpeed.

Public API only; importing this module loads no framework and compiles no kernel.
"""

from mok_plugin.config import MoKConfig, MoKConfigError, load_config
from mok_plugin.layer import MoKMoE
from mok_plugin.topology import load_topology

__version__ = "0.1.0"

__all__ = ["MoKConfig", "MoKConfigError", "MoKMoE", "load_config", "load_topology", "__version__"]
