"""Expert parallelism over torch.distributed (see dispatch.py for the order, barriers and contract)."""

from mok_plugin.parallel.dispatch import PROFILER_RANGES, moe_experts_expert_parallel
from mok_plugin.parallel.symmetric import keep_multicast_off

__all__ = ["PROFILER_RANGES", "keep_multicast_off", "moe_experts_expert_parallel"]
