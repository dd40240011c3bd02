"""The expert weight gradients on Hopper as a warp-specialised, persistent Gluon kernel.

dW[e] [M, N] = sum over expert e's rows r of left[r]^T right[r], both operands contiguous rows in
schedule order (the by-token one copied into that order first, `grouped_mlp.expert_wgrad`).

Why a second kernel: with ~256 rows per expert (deepseek-v3) every output tile reduces over only
4-6 K steps, so Triton's kernels spend much of each tile filling their pipeline and storing the
tile (the weight gradients ran at ~55 % of the dense GEMM). Triton 3.6's high-level language does
not warp-specialise on Hopper; its Gluon dialect does. Here one loader warp streams both operands
through TMA into a ring of shared-memory stages, running ahead across tile boundaries, while the
MMA warps multiply and hand each finished tile to an asynchronous TMA store, so neither the next
tile's loads nor the store wait on the MMAs.

Determinism: each output tile has one owner, which sums its expert's rows BLOCK_K at a time in
ascending order with one fp32 accumulator: the same products in the same order as
`tiles.wgrad_tile`, so the result is bitwise the Triton kernels' (tested on the GPU). Rows past an
expert's count up to the next multiple of BLOCK_K are read as they are: the schedule pads segments
to a multiple of BLOCK_K and the by-row operand holds zeros there (as with TMA in tiles.py).

The by-token operand comes in already copied into row order because TMA cannot gather rows on
Hopper; gathering them in the kernel with a loader warpgroup's cp.async was slower on every shape
(the loader waits on each step's token indices), and a ping-pong of two MMA warpgroups (one's
epilogue under the other's MMAs) failed to launch at larger shapes: BENCHMARKS.md, "Weight
gradients in Gluon"; their fixes, not yet run on a GPU, are on branches wip/gluon-wgrad-gather and
wip/gluon-wgrad-pingpong (commits 13e2b36, 5788411).

Only on sm_90 with 2-byte operands whose rows TMA can read; `usable()` says when, and the caller
falls back to the Triton kernels. `MOK_HOPPER_WGRAD=0` in the environment turns it off (to time
the Triton kernels against it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

try:  # Gluon is experimental: absent from older Triton, so this module works without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    gluon = None

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "expert_wgrad_hopper", "usable"]

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
STAGES = 3  # 3 x 48 KiB of operands + the 64 KiB output tile: 208 KiB of Hopper's 227
CONSUMER_WARPS = 8  # two warpgroups own the 128 x 256 fp32 accumulator (128 registers a thread)
LOADER_WARPS, LOADER_REGS = 1, 24
MAX_REGS = 168  # per thread over the 12 warps (8 + the loader's warpgroup) that share an SM's 64 K


def usable(left: torch.Tensor, right: torch.Tensor, segment_align: int) -> bool:
    """Whether this kernel can compute dW from these row operands (else the Triton kernels do)."""
    if not (left.is_cuda and right.is_cuda) or torch.cuda.get_device_capability(left.device) != (9, 0):
        return False
    if left.dtype not in (torch.bfloat16, torch.float16) or right.dtype != left.dtype:
        return False
    if segment_align % BLOCK_K or os.environ.get("MOK_HOPPER_WGRAD", "1") == "0":
        return False
    return gluon is not None and all(
        t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 for t in (left, right)
    )


if gluon is not None:

    @gluon.jit
    def tile_of(t, M, N, BM: gl.constexpr, BN: gl.constexpr):
        """(expert, m0, n0) of output tile t, expert-major: consecutive programs share the expert's
        rows in L2."""
        tiles_n = gl.cdiv(N, BN)
        per_expert = gl.cdiv(M, BM) * tiles_n
        expert = t // per_expert
        local = t - expert * per_expert
        return expert, (local // tiles_n) * BM, (local % tiles_n) * BN

    @gluon.jit
    def loader(left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars):
        l_bufs, r_bufs = bufs
        ready, empty = bars
        BM: gl.constexpr = left_desc.block_type.shape[1]
        BK: gl.constexpr = left_desc.block_type.shape[0]
        BN: gl.constexpr = right_desc.block_type.shape[1]
        S: gl.constexpr = l_bufs.type.shape[0]
        nbytes: gl.constexpr = left_desc.block_type.nbytes + right_desc.block_type.nbytes
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = tile_of(t, M, N, BM, BN)
            start = gl.load(offsets_ptr + expert)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK)
            for s in range(steps):
                idx = p % S
                mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once
                mbarrier.expect(ready.index(idx), nbytes)
                row = (start + s * BK).to(gl.int32)
                tma.async_copy_global_to_shared(left_desc, [row, m0], ready.index(idx), l_bufs.index(idx))
                tma.async_copy_global_to_shared(right_desc, [row, n0], ready.index(idx), r_bufs.index(idx))
                p += 1

    @gluon.jit
    def multiplier(out_desc, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, num_warps: gl.constexpr):
        l_bufs, r_bufs = bufs
        ready, empty = bars
        BM: gl.constexpr = out_desc.block_type.shape[1]  # out_desc: [E, M, N] in [1, BM, BN] blocks
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = l_bufs.type.shape[1]
        S: gl.constexpr = l_bufs.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = tile_of(t, M, N, BM, BN)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
            for s in range(steps):
                idx = c % S
                mbarrier.wait(ready.index(idx), (c // S) & 1)
                acc = warpgroup_mma(l_bufs.index(idx).permute((1, 0)), r_bufs.index(idx), acc, is_async=True)
                # at most this MMA in flight: the previous stage's buffers are free again
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(empty.index((c + S - 1) % S), count=1, pred=s > 0)
                c += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((c + S - 1) % S), count=1, pred=steps > 0)
            tma.store_wait(0)  # the previous tile's store has left c_smem
            c_smem.store(acc.to(out_desc.dtype))
            fence_async_shared()
            # the same bytes seen as the descriptor's 3-D block: TMA clips the tile at M and N
            block = c_smem._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
            tma.async_copy_shared_to_global(out_desc, [expert.to(gl.int32), m0, n0], block)
        tma.store_wait(0)

    @gluon.jit
    def _wgrad_kernel(
        left_desc, right_desc, out_desc, offsets_ptr, counts_ptr, M, N, num_tiles, C_LAYOUT: gl.constexpr,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        dtype: gl.constexpr = left_desc.dtype
        l_bufs = gl.allocate_shared_memory(dtype, [STAGES] + left_desc.block_type.shape, left_desc.layout)
        r_bufs = gl.allocate_shared_memory(dtype, [STAGES] + right_desc.block_type.shape, right_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        bufs = (l_bufs, r_bufs)
        bars = (ready, empty)
        gl.warp_specialize(
            [
                (multiplier, (out_desc, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, num_warps)),
                (loader, (left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars)),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )


# Cached: at ~230 us of host time a launch, building these anew each call was part of it.
@functools.cache
def _layout(block: tuple[int, ...], element):
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


@functools.cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def expert_wgrad_hopper(
    left: torch.Tensor, right: torch.Tensor, d_w: torch.Tensor, expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
) -> None:  # fmt: skip
    """d_w [E, M, N] (unit column stride, e.g. a column block of a wider one) = per expert, the sum
    over its rows of left[r]^T right[r]; left [R, M] and right [R, N] in schedule row order. Call
    only where `usable(left, right, segment_align)`."""
    E, M, N = d_w.shape
    num_tiles = E * triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    if num_tiles == 0:
        return
    element = gl.bfloat16 if left.dtype == torch.bfloat16 else gl.float16

    def desc(t: torch.Tensor, block: tuple[int, ...]):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _layout(block, element))

    left_desc = desc(left, (BLOCK_K, BLOCK_M))
    right_desc = desc(right, (BLOCK_K, BLOCK_N))
    out_desc = desc(d_w, (1, BLOCK_M, BLOCK_N))
    programs = min(num_tiles, _num_sms(d_w.device.index))
    _wgrad_kernel[(programs,)](
        left_desc, right_desc, out_desc, expert_offsets, tokens_per_expert, M, N, num_tiles,
        C_LAYOUT=_layout((BLOCK_M, BLOCK_N), element), STAGES=STAGES, LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=LOADER_REGS, num_warps=CONSUMER_WARPS, maxnreg=MAX_REGS,
    )  # fmt: skip
