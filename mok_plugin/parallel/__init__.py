"""Expert parallelism over torch.distributed (see dispatch.py for the order, barriers and contract)."""

from mok_plugin.parallel.dispatch import moe_experts_expert_parallel

__all__ = ["moe_experts_expert_parallel"]
