"""Several ranks on one GPU, over gloo: what the frameworks' collectives need for that.

NCCL refuses two ranks of one communicator on the same GPU, so a one-GPU machine runs multi-rank
launches (DeepSpeed's own MoE tests, Megatron's EP-overlap schedule) with gloo, which moves CUDA
tensors through the host. gloo has CUDA all-reduce, broadcast, all-gather and all-to-all, but its
coalesced all-reduce takes CPU tensors only, and both frameworks coalesce their gradient reductions
(`torch.distributed._coalescing_manager`, `all_reduce_coalesced`). `run_collectives_one_by_one()`
makes that context manager a plain one, so the collectives inside it run one after the other, each
its own gloo call, and `all_reduce_coalesced` one all-reduce per tensor: the same sums.
Synchronous collectives only: an op issued with async_op=True inside the context is not handed to
the yielded handle (both frameworks issue them synchronously unless gradient-reduction overlap is
on, which the one-GPU runs leave off). A test and benchmark aid only; a real launch never calls it.
"""

from __future__ import annotations

import contextlib
import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["run_collectives_one_by_one"]


class _Done:
    """What _coalescing_manager yields, for a caller that waits on it: the ops ran already."""

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops: bool = False):
    yield _Done()


def _all_reduce_each(tensors, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    for tensor in tensors:
        dist.all_reduce(tensor, op=op, group=group)
    return _Done() if async_op else None


def run_collectives_one_by_one() -> None:
    """Replace torch's _coalescing_manager (and the copies modules imported by name) with a plain
    context: for gloo ranks that share a GPU. Call it before the framework builds its model."""
    original = c10d._coalescing_manager
    c10d._coalescing_manager = _one_by_one
    dist._coalescing_manager = _one_by_one
    dist.all_reduce_coalesced = c10d.all_reduce_coalesced = _all_reduce_each
    for module in list(sys.modules.values()):
        if getattr(module, "_coalescing_manager", None) is original:
            module._coalescing_manager = _one_by_one
