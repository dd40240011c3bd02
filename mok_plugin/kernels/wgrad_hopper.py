"""The expert weight gradients on Hopper as a warp-specialised, persistent Gluon kernel.

dW[e] [M, N] = sum over expert e's rows r of left[r]^T right[r]: one operand by row (w*A or dh,
contiguous rows in schedule order), the other by token (dO or x, gathered through row_to_token),
as `grouped_mlp.expert_wgrad` computes it with the Triton kernels.

Why a second kernel: with ~256 rows per expert (deepseek-v3) every output tile reduces over only
4-6 K steps, so Triton's kernels spend much of each tile filling their pipeline and storing the
tile (the weight gradients ran at ~55 % of the dense GEMM). Triton 3.6's high-level language does
not warp-specialise on Hopper; its Gluon dialect does. Here a loader warpgroup streams both
operands into a ring of shared-memory stages, running ahead across tile boundaries (the by-row
operand through TMA, the by-token rows gathered with asynchronous copies, so no permuted copy of
them is made), while two MMA warpgroups multiply and hand each finished tile to an asynchronous
TMA store; neither the next tile's loads nor the store wait on the MMAs.

Determinism: each output tile has one owner, which sums its expert's rows BLOCK_K at a time in
ascending order with one fp32 accumulator: the same products in the same order as
`tiles.wgrad_tile`, so the result is bitwise the Triton kernels' (tested on the GPU). The by-token
rows past an expert's count are loaded as zeros (as tiles.py masks them); the by-row operand's
rows up to the next multiple of BLOCK_K are read as they are: the schedule pads segments to a
multiple of BLOCK_K and that operand holds zeros there (as with TMA in tiles.py).

Only on sm_90 with 2-byte operands whose rows start 16-byte aligned; `usable()` says when, and the
caller falls back to the Triton kernels. `MOK_HOPPER_WGRAD=0` in the environment turns it off (to
time the Triton kernels against it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from mok_plugin.kernels.launch import alignment

try:  # Gluon is experimental: absent from older Triton, so this module works without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
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
LOADER_WARPS, LOADER_REGS = 4, 96  # a warpgroup: 128 threads issue the gathered rows' copies
GATHER_ROWS = 16  # rows of the gathered tile per copy instruction batch (bounds the pointer registers)
MAX_REGS = 168  # per thread over the 12 warps that share an SM's 64 K registers


def usable(left: torch.Tensor, right: torch.Tensor, segment_align: int) -> bool:
    """Whether this kernel can compute dW from these operands (else the Triton kernels do)."""
    if not (left.is_cuda and right.is_cuda) or torch.cuda.get_device_capability(left.device) != (9, 0):
        return False
    if left.dtype not in (torch.bfloat16, torch.float16) or right.dtype != left.dtype:
        return False
    if segment_align % BLOCK_K or os.environ.get("MOK_HOPPER_WGRAD", "1") == "0":
        return False
    rows_ok = all(t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 for t in (left, right))
    return gluon is not None and rows_ok


if gluon is not None:

    @gluon.jit
    def _tile_of(t, M, N, BM: gl.constexpr, BN: gl.constexpr):
        """(expert, m0, n0) of output tile t, expert-major: the programs working at one time share
        an expert's rows in L2."""
        tiles_n = gl.cdiv(N, BN)
        per_expert = gl.cdiv(M, BM) * tiles_n
        expert = t // per_expert
        local = t - expert * per_expert
        return expert, (local // tiles_n) * BM, (local % tiles_n) * BN

    @gluon.jit
    def _step_tokens(row_to_token_ptr, r0, end, sub_rows, SUB: gl.constexpr):
        """The token indices of a step's BK = 4 * SUB rows from r0, as four slices (0 past end)."""
        r = r0 + sub_rows
        t0 = gl.load(row_to_token_ptr + r, mask=r < end, other=0)
        t1 = gl.load(row_to_token_ptr + r + SUB, mask=r + SUB < end, other=0)
        t2 = gl.load(row_to_token_ptr + r + 2 * SUB, mask=r + 2 * SUB < end, other=0)
        t3 = gl.load(row_to_token_ptr + r + 3 * SUB, mask=r + 3 * SUB < end, other=0)
        return t0, t1, t2, t3

    @gluon.jit
    def _gather_slice(gathered, j: gl.constexpr, tokens, r0, end, sub_rows, cols_x, col_ok, by_token_ptr, stride_t,
                      SUB: gl.constexpr):  # fmt: skip
        """Slice j (SUB rows) of a stage's gathered block: asynchronous copies of those tokens' rows,
        zero-filled past the expert's rows and the operand's width."""
        row_ok = r0 + j * SUB + sub_rows < end
        src = by_token_ptr + tokens[:, None] * stride_t + cols_x[None, :]
        async_copy.async_copy_global_to_shared(gathered.slice(j * SUB, SUB), src, row_ok[:, None] & col_ok[None, :])

    @gluon.jit
    def _loader(
        row_desc, by_token_ptr, stride_t, width_t, row_to_token_ptr, offsets_ptr, counts_ptr, M, N, num_tiles, bufs,
        bars, LEFT_BY_TOKEN: gl.constexpr, GATHER_LAYOUT: gl.constexpr, SUB: gl.constexpr, ALIGN: gl.constexpr,
    ):  # fmt: skip
        """Fills stage after stage: the by-row block by TMA (its bytes expected on the stage's ready
        barrier), the by-token rows by per-thread asynchronous copies (each thread arrives on the
        same barrier when its copies land; rows past the expert's count are zero-filled)."""
        l_bufs, r_bufs = bufs
        ready, empty = bars
        S: gl.constexpr = l_bufs.type.shape[0]
        BK: gl.constexpr = l_bufs.type.shape[1]
        BM: gl.constexpr = l_bufs.type.shape[2]
        BN: gl.constexpr = r_bufs.type.shape[2]
        BX: gl.constexpr = BM if LEFT_BY_TOKEN else BN  # width of the gathered block
        if ALIGN < 16:  # restated as multiples of ALIGN so that the copies stay 16 bytes wide
            stride_t = stride_t // ALIGN * ALIGN
            width_t = width_t // ALIGN * ALIGN
        sub_rows = gl.arange(0, SUB, layout=gl.SliceLayout(1, GATHER_LAYOUT))
        cols = gl.arange(0, BX, layout=gl.SliceLayout(0, GATHER_LAYOUT))
        gl.static_assert(BK == 4 * SUB, "a step's token indices are carried as four slices")
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = _tile_of(t, M, N, BM, BN)
            x0 = m0 if LEFT_BY_TOKEN else n0
            col_ok = (x0 + cols) < width_t
            start = gl.load(offsets_ptr + expert)
            end = start + gl.load(counts_ptr + expert)
            # Token indices a step ahead: loaded where their copies are issued, one memory latency per
            # step stood in series with the MMAs (the loader was slower than a step's MMA).
            t0, t1, t2, t3 = _step_tokens(row_to_token_ptr, start, end, sub_rows, SUB)
            for s in range(gl.cdiv(end - start, BK)):
                idx = p % S
                mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # the first round passes at once
                mbarrier.expect(ready.index(idx), row_desc.block_type.nbytes)
                r0 = start + s * BK
                row0 = r0.to(gl.int32)  # descriptor coordinates are 32-bit
                if LEFT_BY_TOKEN:
                    tma.async_copy_global_to_shared(row_desc, [row0, n0], ready.index(idx), r_bufs.index(idx))
                    gathered = l_bufs.index(idx)
                else:
                    tma.async_copy_global_to_shared(row_desc, [row0, m0], ready.index(idx), l_bufs.index(idx))
                    gathered = r_bufs.index(idx)
                cols_x = x0 + cols
                _gather_slice(gathered, 0, t0, r0, end, sub_rows, cols_x, col_ok, by_token_ptr, stride_t, SUB)
                _gather_slice(gathered, 1, t1, r0, end, sub_rows, cols_x, col_ok, by_token_ptr, stride_t, SUB)
                _gather_slice(gathered, 2, t2, r0, end, sub_rows, cols_x, col_ok, by_token_ptr, stride_t, SUB)
                _gather_slice(gathered, 3, t3, r0, end, sub_rows, cols_x, col_ok, by_token_ptr, stride_t, SUB)
                async_copy.mbarrier_arrive(ready.index(idx), increment_count=False)
                t0, t1, t2, t3 = _step_tokens(row_to_token_ptr, r0 + BK, end, sub_rows, SUB)
                p += 1

    @gluon.jit
    def _multiplier(out_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, num_warps: gl.constexpr):
        """Multiplies each tile's stages as they fill, frees each stage once its MMA is done, and
        stores each finished tile through TMA without waiting for the store."""
        l_bufs, r_bufs = bufs
        ready, empty = bars
        S: gl.constexpr = l_bufs.type.shape[0]
        BK: gl.constexpr = l_bufs.type.shape[1]
        BM: gl.constexpr = out_desc.block_type.shape[1]  # out_desc: [E, M, N] in [1, BM, BN] blocks
        BN: gl.constexpr = out_desc.block_type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])  # fmt: skip
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = _tile_of(t, M, N, BM, BN)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
            for s in range(steps):
                idx = c % S
                mbarrier.wait(ready.index(idx), (c // S) & 1)
                fence_async_shared()  # the gathered rows were written by the generic proxy; wgmma reads async
                acc = warpgroup_mma(l_bufs.index(idx).permute((1, 0)), r_bufs.index(idx), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))  # the MMA before this one is done: free its stage
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
        row_desc, by_token_ptr, stride_t, width_t, row_to_token_ptr, out_desc, offsets_ptr, counts_ptr, M, N,
        num_tiles, LEFT_BY_TOKEN: gl.constexpr, L_LAYOUT: gl.constexpr, R_LAYOUT: gl.constexpr,
        C_LAYOUT: gl.constexpr, GATHER_LAYOUT: gl.constexpr, SUB: gl.constexpr, ALIGN: gl.constexpr,
        BK: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        dtype: gl.constexpr = row_desc.dtype
        BM: gl.constexpr = out_desc.block_type.shape[1]
        BN: gl.constexpr = out_desc.block_type.shape[2]
        l_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BM], L_LAYOUT)
        r_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], R_LAYOUT)
        c_smem = gl.allocate_shared_memory(dtype, [BM, BN], C_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # ready: the TMA's expect (one arrival) and every loader thread's copies (one each)
            mbarrier.init(ready.index(i), count=1 + LOADER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        bufs = (l_bufs, r_bufs)
        bars = (ready, empty)
        gl.warp_specialize(
            [
                (_multiplier, (out_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars, c_smem, num_warps)),
                (_loader, (row_desc, by_token_ptr, stride_t, width_t, row_to_token_ptr, offsets_ptr, counts_ptr, M, N,
                           num_tiles, bufs, bars, LEFT_BY_TOKEN, GATHER_LAYOUT, SUB, ALIGN)),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )  # fmt: skip


# Cached: Gluon's launch costs ~230 us of host time, of which building these each call was part.
@functools.cache
def _shared_layout(block: tuple[int, ...], element):
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


@functools.cache
def _gather_layout(width: int):
    """Each thread copies 8 contiguous elements (16 bytes); a warp spans a row of `width` or part of it."""
    threads_per_row = min(32, width // 8)
    return gl.BlockedLayout([1, 8], [32 // threads_per_row, threads_per_row], [LOADER_WARPS, 1], [1, 0])


@functools.cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def expert_wgrad_hopper(
    left: torch.Tensor, right: torch.Tensor, d_w: torch.Tensor, row_to_token: torch.Tensor,
    expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, *, left_by_token: bool,
) -> None:  # fmt: skip
    """d_w [E, M, N] = per expert, the sum over its rows of left[r]^T right[r]; the by-token operand
    ([T, M] or [T, N]) is read through row_to_token, the other is [R_pad, N] or [R_pad, M] in
    schedule row order. Call only where `usable(left, right, segment_align)`."""
    E, M, N = d_w.shape
    num_tiles = E * triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    if num_tiles == 0:
        return
    by_token, by_row = (left, right) if left_by_token else (right, left)
    if by_token.shape[0] == 0:  # no tokens, so no rows: every expert's gradient is zero, nothing is read
        by_token = by_token.new_zeros(1, by_token.shape[1])
    element = gl.bfloat16 if left.dtype == torch.bfloat16 else gl.float16
    row_block = (BLOCK_K, BLOCK_N) if left_by_token else (BLOCK_K, BLOCK_M)
    row_desc = TensorDescriptor(by_row, list(by_row.shape), list(by_row.stride()), list(row_block),
                                _shared_layout(row_block, element))  # fmt: skip
    out_block = (1, BLOCK_M, BLOCK_N)
    out_desc = TensorDescriptor(d_w, list(d_w.shape), list(d_w.stride()), list(out_block),
                                _shared_layout(out_block, element))  # fmt: skip
    _wgrad_kernel[(min(num_tiles, _num_sms(d_w.device.index)),)](
        row_desc, by_token, by_token.stride(0), by_token.shape[1], row_to_token, out_desc, expert_offsets,
        tokens_per_expert, M, N, num_tiles, LEFT_BY_TOKEN=left_by_token,
        L_LAYOUT=_shared_layout((BLOCK_K, BLOCK_M), element), R_LAYOUT=_shared_layout((BLOCK_K, BLOCK_N), element),
        C_LAYOUT=_shared_layout((BLOCK_M, BLOCK_N), element),
        GATHER_LAYOUT=_gather_layout(BLOCK_M if left_by_token else BLOCK_N), SUB=GATHER_ROWS,
        ALIGN=alignment(by_token.stride(0), by_token.shape[1]), BK=BLOCK_K, STAGES=STAGES, LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=LOADER_REGS, num_warps=CONSUMER_WARPS, maxnreg=MAX_REGS,
    )  # fmt: skip
