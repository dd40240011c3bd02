"""The expert weight gradients on Hopper as a warp-specialised, persistent Gluon kernel.

dW[e] [M, N] = sum over expert e's rows r of left[r]^T right[r], both operands contiguous rows in
schedule order (the by-token one copied into that order first, `grouped_mlp.expert_wgrad`).

Why a second kernel: with ~256 rows per expert (deepseek-v3) every output tile reduces over only
4-6 K steps, so Triton's kernels spend much of each tile filling their pipeline and storing the
tile (the weight gradients ran at ~55 % of the dense GEMM). Triton 3.6's high-level language does
not warp-specialise on Hopper; its Gluon dialect does. Here one loader warp streams both operands
through TMA into a ring of shared-memory stages, running ahead across tile boundaries, while two
MMA warpgroups multiply and hand each finished tile to an asynchronous TMA store, so neither the
next tile's loads nor the store wait on the MMAs. Two schedules (`SCHEDULES`): cooperative (both
warpgroups on one 128 x 256 tile) and ping-pong (each on alternate 128 x 128 tiles, so that one's
epilogue runs under the other's MMAs: faster where a tile is only a few K steps, as on
deepseek-v3; slower where tiles are long, as on mixtral-8x7b: BENCHMARKS.md).

Determinism: each output tile has one owner, which sums its expert's rows BLOCK_K at a time in
ascending order with one fp32 accumulator: the same products in the same order as
`tiles.wgrad_tile`, so the result is bitwise the Triton kernels' (tested on the GPU). Rows past an
expert's count up to the next multiple of BLOCK_K are read as they are: the schedule pads segments
to a multiple of BLOCK_K and the by-row operand holds zeros there (as with TMA in tiles.py).

The by-token operand comes in already copied into row order because TMA cannot gather rows on
Hopper; gathering them in the kernel with a loader warpgroup's cp.async was slower on every shape
(89fa1b7: the loader waited on each step's token indices; 13e2b36, indices a step ahead: still
15.1 ms on deepseek-v3 against 13.8 + 1.3 of copies): BENCHMARKS.md, "Weight gradients in Gluon"
and "Ping-pong weight gradients".

Only on sm_90 with 2-byte operands whose rows TMA can read; `usable()` says when, and the caller
falls back to the Triton kernels. `MOK_HOPPER_WGRAD=0` in the environment turns it off (to time
the Triton kernels against it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from mok_plugin.kernels.launch import cdiv, sm_count

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

__all__ = [
    "BLOCK_K", "BLOCK_M", "SCHEDULES", "Schedule", "expert_wgrad_hopper", "gluon_descriptor", "tma_rows", "usable",
]  # fmt: skip

BLOCK_M, BLOCK_K = 128, 64
LOADER_WARPS, LOADER_REGS = 1, 24
MAX_REGS = 168  # per thread over the 12 warps (8 + the loader's warpgroup) that share an SM's 64 K


@dataclass(frozen=True)
class Schedule:
    """How the two MMA warpgroups share the work: on one 128 x block_n tile (cooperative, each
    64 rows of it) or on alternate 128 x block_n tiles (ping-pong: one's epilogue under the
    other's MMAs, which pays where a tile is only a few K steps). Either way 128 accumulator
    registers a thread, and the same sums in the same order."""

    block_n: int
    stages: int
    pingpong: bool

    @property
    def num_warps(self) -> int:
        """The launch's warps: the default partition, one MMA warpgroup in ping-pong (the other is a
        worker partition), both in cooperative."""
        return 4 if self.pingpong else 8


SCHEDULES = {
    # 3 x 48 KiB of operand stages + the 64 KiB output tile: 208 KiB of Hopper's 227
    "cooperative": Schedule(block_n=256, stages=3, pingpong=False),
    # 5 x 32 KiB of operand stages + two 32 KiB output tiles: 224 KiB
    "pingpong": Schedule(block_n=128, stages=5, pingpong=True),
}
PINGPONG_MMA_REGS = 240  # a ping-pong warpgroup's: 2 x 240 + 24 (loader) of the 3 warpgroups' 3 x 168


def usable(left: torch.Tensor, right: torch.Tensor, segment_align: int) -> bool:
    """Whether this kernel can compute dW from these row operands (else the Triton kernels do)."""
    if segment_align % BLOCK_K or os.environ.get("MOK_HOPPER_WGRAD", "1") == "0":
        return False
    return tma_rows(left, right)


def tma_rows(*tensors: torch.Tensor) -> bool:
    """Whether Gluon's Hopper kernels can read (and write) these 2-D tensors' rows through TMA
    descriptors: on an sm_90 GPU, all bf16 or all fp16, unit column stride, 16-byte aligned rows
    and base (TensorDescriptor asserts both), and Triton with Gluon."""
    first = tensors[0]
    if gluon is None or not first.is_cuda or torch.cuda.get_device_capability(first.device) != (9, 0):
        return False
    return first.dtype in (torch.bfloat16, torch.float16) and all(
        t.is_cuda and t.dtype == first.dtype and t.stride(-1) == 1 and t.stride(0) * t.element_size() % 16 == 0
        and t.data_ptr() % 16 == 0
        for t in tensors
    )  # fmt: skip


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
    def accumulate(acc, bufs, bars, c, steps, A_K_MAJOR: gl.constexpr = False, B_K_MAJOR: gl.constexpr = False):
        """acc plus one tile's `steps` K steps, read from the ring's positions c, c + 1, ...: async
        wgmma with at most one in flight, each stage freed once the MMA after it is issued. A's
        blocks are [BK, BM] (the weight gradients' left rows) or, A_K_MAJOR, [BM, BK] (a row GEMM's
        rows); B's [BK, BN] or, B_K_MAJOR, [BN, BK] (kernels/rows_hopper.py's W2)."""
        l_bufs, r_bufs = bufs
        ready, empty = bars[0], bars[1]
        S: gl.constexpr = l_bufs.type.shape[0]
        for s in range(steps):
            idx = (c + s) % S
            mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)
            if A_K_MAJOR:
                a = l_bufs.index(idx)
            else:
                a = l_bufs.index(idx).permute((1, 0))
            if B_K_MAJOR:
                b = r_bufs.index(idx).permute((1, 0))
            else:
                b = r_bufs.index(idx)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous stage's MMA is done: free it
            mbarrier.arrive(empty.index((c + s + S - 1) % S), count=1, pred=s > 0)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((c + steps + S - 1) % S), count=1, pred=steps > 0)
        return acc

    @gluon.jit
    def store_tile(out_desc, c_smem, acc, expert, m0, n0):
        """The finished tile to dW by an asynchronous TMA store, once c_smem's previous store has
        left; the store clips the tile at M and N."""
        tma.store_wait(0)
        c_smem.store(acc.to(out_desc.dtype))
        fence_async_shared()
        # the same bytes seen as the descriptor's 3-D block [1, BM, BN]
        block = c_smem._reinterpret(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        tma.async_copy_shared_to_global(out_desc, [expert.to(gl.int32), m0, n0], block)

    @gluon.jit
    def multiplier(out_desc, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, num_warps: gl.constexpr):
        """The cooperative schedule: all consumer warps share each tile's accumulator."""
        BM: gl.constexpr = out_desc.block_type.shape[1]  # out_desc: [E, M, N] in [1, BM, BN] blocks
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = bufs[0].type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = tile_of(t, M, N, BM, BN)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK).to(gl.int32)
            acc = accumulate(gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout), bufs, bars, c, steps)
            store_tile(out_desc, c_smem, acc, expert, m0, n0)
            c += steps
        tma.store_wait(0)

    @gluon.jit
    def pingpong_multiplier(out_desc, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, WHICH: gl.constexpr):
        """The ping-pong schedule: one of two MMA warpgroups that take this program's tiles in turn
        (tile i: warpgroup i % 2), so that one's epilogue runs while the other multiplies. Both walk
        the same ring of stages, each skipping the other's tiles by their step counts. Their main
        loops take turns (`turn` barriers): a stage's ready barrier is waited on by parity, which
        tells phase k from phase k - 2 but not from phase k - 1, so a warpgroup must not wait on a
        position before the other has waited on the position a ring before it (a first version
        without turns let the second warpgroup run ahead and failed on the H200)."""
        turn = bars[2]
        BM: gl.constexpr = out_desc.block_type.shape[1]
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = bufs[0].type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])  # fmt: skip
        c = 0
        i = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = tile_of(t, M, N, BM, BN)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK).to(gl.int32)
            if i % 2 == WHICH:
                # this warpgroup's k-th tile: its main loop follows the other's k-th (WHICH 1) or
                # (k-1)-th (WHICH 0; its first passes at once: a fresh barrier's parity-1 phase counts as done)
                k = i // 2
                mbarrier.wait(turn.index(WHICH), (k & 1) ^ (1 - WHICH))
                acc = accumulate(gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout), bufs, bars, c, steps)
                mbarrier.arrive(turn.index(1 - WHICH), count=1)  # the other's main loop may start
                store_tile(out_desc, c_smem, acc, expert, m0, n0)
            c += steps
            i += 1
        tma.store_wait(0)

    @gluon.jit
    def ring(left_desc, right_desc, STAGES: gl.constexpr):
        """The operands' shared-memory stages and their ready (loaded) and empty (consumed) barriers."""
        dtype: gl.constexpr = left_desc.dtype
        l_bufs = gl.allocate_shared_memory(dtype, [STAGES] + left_desc.block_type.shape, left_desc.layout)
        r_bufs = gl.allocate_shared_memory(dtype, [STAGES] + right_desc.block_type.shape, right_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        return (l_bufs, r_bufs), (ready, empty)

    @gluon.jit
    def _wgrad_kernel(
        left_desc, right_desc, out_desc, offsets_ptr, counts_ptr, M, N, num_tiles, C_LAYOUT: gl.constexpr,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        bufs, bars = ring(left_desc, right_desc, STAGES)
        c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        gl.warp_specialize(
            [
                (multiplier, (out_desc, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, num_warps)),
                (loader, (left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars)),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )

    @gluon.jit
    def pingpong_state(out_desc, bars, C_LAYOUT: gl.constexpr):
        """A ping-pong launch's two output tiles (one a warpgroup) and the ring's barriers with the
        warpgroups' `turn` barriers (see pingpong_multiplier)."""
        c0_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        c1_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        return c0_smem, c1_smem, (bars[0], bars[1], turn)

    @gluon.jit
    def _wgrad_pingpong_kernel(
        left_desc, right_desc, out_desc, offsets_ptr, counts_ptr, M, N, num_tiles, C_LAYOUT: gl.constexpr,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
    ):  # fmt: skip
        bufs, bars = ring(left_desc, right_desc, STAGES)
        c0_smem, c1_smem, turns = pingpong_state(out_desc, bars, C_LAYOUT)
        gl.warp_specialize(
            [
                (pingpong_multiplier, (out_desc, counts_ptr, M, N, num_tiles, bufs, turns, c0_smem, 0)),
                (pingpong_multiplier, (out_desc, counts_ptr, M, N, num_tiles, bufs, turns, c1_smem, 1)),
                (loader, (left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars)),
            ],
            [4, LOADER_WARPS],  # the second MMA warpgroup, the loader
            [MMA_REGS, LOADER_REGS],
        )


# Cached: at ~230 us of host time a launch, building these anew each call was part of it.
@functools.cache
def _layout(block: tuple[int, ...], element):
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def gl_element(dtype: torch.dtype):
    """Gluon's element type of a 2-byte torch dtype these kernels take (bf16, else fp16)."""
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def gluon_descriptor(t: torch.Tensor, block: tuple[int, ...]) -> TensorDescriptor:
    """A Gluon TMA descriptor of the whole of `t` in `block`s, with the shared layout these kernels
    give a block of t's element type (`_layout`)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _layout(block, gl_element(t.dtype)))


def expert_wgrad_hopper(
    left: torch.Tensor, right: torch.Tensor, d_w: torch.Tensor, expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor, schedule: str = "cooperative",
) -> None:  # fmt: skip
    """d_w [E, M, N] (unit column stride, e.g. a column block of a wider one) = per expert, the sum
    over its rows of left[r]^T right[r]; left [R, M] and right [R, N] in schedule row order, under
    one of SCHEDULES. Call only where `usable(left, right, segment_align)`."""
    plan = SCHEDULES[schedule]
    E, M, N = d_w.shape
    num_tiles = E * cdiv(M, BLOCK_M) * cdiv(N, plan.block_n)
    if num_tiles == 0:
        return
    element = gl_element(left.dtype)

    args = (
        gluon_descriptor(left, (BLOCK_K, BLOCK_M)), gluon_descriptor(right, (BLOCK_K, plan.block_n)),
        gluon_descriptor(d_w, (1, BLOCK_M, plan.block_n)),
        expert_offsets, tokens_per_expert, M, N, num_tiles,
    )  # fmt: skip
    common = dict(C_LAYOUT=_layout((BLOCK_M, plan.block_n), element), STAGES=plan.stages,
                  LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, maxnreg=MAX_REGS)  # fmt: skip
    grid = (min(num_tiles, sm_count(d_w.device.index)),)
    if plan.pingpong:
        _wgrad_pingpong_kernel[grid](*args, MMA_REGS=PINGPONG_MMA_REGS, num_warps=plan.num_warps, **common)
    else:
        _wgrad_kernel[grid](*args, num_warps=plan.num_warps, **common)
