"""Pull-based exchange over NVLink through `torch.distributed._symmetric_memory`.

Glossary: W ranks of one NVLink domain; every rank holds a *symmetric buffer* of the same size,
mapped into every peer's address space; a rank *pulls* a block by reading a peer's buffer directly
(the copy runs on the reading GPU, over NVLink; no NCCL call, no send/receive pairing). This is the
pull-based dispatch of upstream MoK, without its NVLink multicast.

The exchange is the capacity exchange's equal-block all-to-all: rank r's input holds W blocks of S
rows, block d for rank d; rank r's output block s is rank s's block r. Its adjoint is itself, so the
backward is the same pull applied to the gradient.

Barriers (both on the buffer's signal pad, GPU-side, channel 0):
  1. after each rank copies its input into its own buffer: no peer reads before the data is there;
  2. after each rank has pulled its blocks: no rank overwrites its buffer while a peer still reads.

Host synchronisation: the first rendezvous of a workspace is host-blocking (it maps the peers'
memory); it happens once per (group, device, dtype) and again only when a larger exchange needs a
larger buffer, which all ranks do together because the capacity exchange has the same size on
every rank. Steady state: none.

Multicast: never used. `keep_multicast_off()` sets the variables that switch it off before the first
rendezvous, as the machines here require; nothing calls cuMulticastCreate.

Caller's contract: CUDA tensors; every rank of the group calls with the same shape and dtype, in the
same order; the group fits in one NVLink domain.

Status: written against torch 2.11's API; exercised on one GPU by tests/test_gpu_parallel.py and on
two H200s by `mok bench multi-gpu` (EP 2 bitwise equal to EP 1; BENCHMARKS.md, "Multi-GPU"). Not yet
timed, and not yet run on 4 or 8 GPUs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["keep_multicast_off", "symmetric_all_to_all_equal"]

# NVLink multicast stays off on the machines here: a program that uses it can take a shared host's
# GPUs out of service. These switch it off in NCCL, PyTorch's symmetric memory and NVSHMEM.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off() -> None:
    """Set the variables that keep NVLink multicast off, for this process and those it starts."""
    os.environ.update(MULTICAST_OFF_ENV)


_WORKSPACES: dict[tuple[str, str, torch.dtype], tuple[torch.Tensor, object]] = {}


def _workspace(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, numel: int):
    """(buffer, handle) of a symmetric buffer of at least numel elements, cached per group/device/dtype."""
    import torch.distributed._symmetric_memory as symm_mem

    keep_multicast_off()
    key = (group.group_name, str(device), dtype)
    cached = _WORKSPACES.get(key)
    if cached is not None and cached[0].numel() >= numel:
        return cached
    # Grow to a power of two so that a run of slowly growing exchanges rendezvouses rarely.
    capacity = 1 << max(0, (numel - 1).bit_length())
    buffer = symm_mem.empty(capacity, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buffer, group)
    _WORKSPACES[key] = (buffer, handle)
    return buffer, handle


def _pull_blocks(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    W = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if t.shape[0] % W:
        raise ValueError(f"symmetric all-to-all needs rows divisible by the group size {W}, got {t.shape[0]}")
    block = t.shape[0] // W
    buffer, handle = _workspace(group, t.device, t.dtype, t.numel())
    buffer[: t.numel()].view(t.shape).copy_(t)
    handle.barrier(channel=0)
    out = torch.empty_like(t)
    for src in range(W):
        peer = handle.get_buffer(src, (t.numel(),), t.dtype).view(t.shape)
        out[src * block : (src + 1) * block].copy_(peer[rank * block : (rank + 1) * block])
    handle.barrier(channel=0)
    return out


class _SymmetricAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):  # type: ignore[override]
        ctx.group = group
        return _pull_blocks(t.contiguous(), group)

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        return _pull_blocks(d_out.contiguous(), ctx.group), None


def symmetric_all_to_all_equal(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-block all-to-all of the rows of t by pulling from peers' symmetric buffers; differentiable.

    Args:
        t: CUDA tensor [W * S, ...]; block d (rows d*S .. (d+1)*S) is for rank d.
        group: the expert-parallel group, inside one NVLink domain.
    Returns:
        [W * S, ...]: block s is what rank s sent to this rank.
    Raises:
        ValueError: t is not on a CUDA device, or its rows do not split into W blocks.
    """
    if not t.is_cuda:
        raise ValueError(
            f"mok.ep_transport='symmetric_memory' needs CUDA tensors (got {t.device}); use ep_transport='nccl' "
            "(any torch.distributed backend, gloo on the CPU)"
        )
    return _SymmetricAllToAll.apply(t, group)
