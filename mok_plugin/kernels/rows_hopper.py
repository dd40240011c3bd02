"""The forward's row GEMMs on Hopper as warp-specialised, persistent Gluon kernels.

fc2 (`down_fwd_hopper`) and fc1's GEMM (`gate_up_fwd_hopper`, SwiGLU-shaped: the gate and up halves
of h; A follows from the rounded h in a separate elementwise kernel, `grouped_mlp.up_activation`,
so its arithmetic is the Triton kernels' own).

y[r, :] = w_r * (A[r] @ W2_e^T) for every row r of row tile m (expert e = tile_to_expert[m]),
w_r = topk_weights[row_to_tk[r]]: `grouped_mlp.down_fwd`'s result, with the weight gradients'
structure (`wgrad_hopper.py`): one loader warp streams A's row block and W2_e's row block by TMA
into a ring of shared-memory stages, running ahead across tiles; two MMA warpgroups share each
128 x 256 tile (async wgmma, one in flight) and hand it to an asynchronous TMA store. Both operands
are contiguous (A in schedule row order, W2 viewed as [E * H, I]), which is why fc2's forward is
the first row GEMM here: fc1's forward and fc2's input gradient gather their rows by token.

Determinism: one owner per output tile, the same BLOCK_K steps in ascending order into one fp32
accumulator, then the same fp32 scaling and one rounding: bitwise `tiles.down_tile` (tests/test_gpu_rows_hopper.py;
not yet run on a GPU). A weight block that runs past the expert's H rows reads the next expert's rows (or TMA's
zeros after the last): they meet only output columns >= H, which the store clips. Padding rows
are written with zeros, where the Triton kernel leaves them unset: nothing reads them.

Only on sm_90, for bf16/fp16 without the fc2 bias, schedule tiles of 128 rows, and rows TMA can
read; `usable()` says when. `MOK_HOPPER_ROWS=0` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from mok_plugin.kernels import wgrad_hopper
from mok_plugin.kernels.launch import alignment
from mok_plugin.kernels.wgrad_hopper import _layout, _num_sms, gluon

if gluon is not None:
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

    from mok_plugin.kernels.wgrad_hopper import accumulate, ring

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "down_fwd_hopper", "gate_up_fwd_hopper", "gate_up_usable", "usable"]

# The Triton kernel's tile (configs.py "down_fwd": 128 x 256 x 64): the same K steps, so the same bits.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
STAGES = 3  # 3 x 48 KiB of operand stages + the 64 KiB output tile: 208 KiB of Hopper's 227
# fc1: the Triton kernel's 128 x 128 x 64 ("gate_up_fwd"), a gate and an up accumulator (128 x 256 of
# fp32 over the two MMA warpgroups); a stage holds x's gathered rows and both weight blocks (48 KiB),
# plus two 32 KiB output tiles (gate, up): 3 stages are 208 KiB.
UP_BLOCK_N = 128
GATHER_SUB = 16  # rows a loader thread's 16-byte copies cover at once: a slice of the row block
GATHER_WARPS, GATHER_REGS = 4, 96  # a loader warpgroup: 128 threads issue the gathered rows' copies


def usable(a: torch.Tensor, down_proj: torch.Tensor, tile_m: int, down_bias: torch.Tensor | None) -> bool:
    """Whether this kernel can compute fc2's forward (else the Triton kernel does): no fc2 bias,
    the schedule's 128-row tiles, and A, W2 and y [R_pad, H] TMA-readable (`tma_rows`)."""
    if os.environ.get("MOK_HOPPER_ROWS", "1") == "0" or down_bias is not None or tile_m != BLOCK_M:
        return False
    y_rows_ok = down_proj.shape[1] * a.element_size() % 16 == 0  # y is allocated [R_pad, H]
    return y_rows_ok and wgrad_hopper.tma_rows(a, down_proj.reshape(-1, down_proj.shape[-1]))


def gate_up_usable(x: torch.Tensor, gate_up_proj: torch.Tensor, tile_m: int, gated: bool, has_bias: bool) -> bool:
    """Whether fc1's GEMM can run here (else the Triton kernel does): gated, no fc1 bias, I a
    multiple of UP_BLOCK_N (a weight block never crosses from the gate half into the up half), x's
    rows 16-byte aligned for the loader's 16-byte copies, W13 TMA-readable (`tma_rows`)."""
    if os.environ.get("MOK_HOPPER_ROWS", "1") == "0" or not gated or has_bias or tile_m != BLOCK_M:
        return False
    if gate_up_proj.shape[1] // 2 % UP_BLOCK_N:
        return False
    return wgrad_hopper.tma_rows(x, gate_up_proj.reshape(-1, gate_up_proj.shape[-1]))


if gluon is not None:

    @gluon.jit
    def row_loader(a_desc, w_desc, tile_to_expert_ptr, H, K_DIM, num_tiles, bufs, bars):
        l_bufs, r_bufs = bufs
        ready, empty = bars
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        S: gl.constexpr = l_bufs.type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
        tiles_n = gl.cdiv(H, BN)
        steps = gl.cdiv(K_DIM, BK)
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            m_tile = t // tiles_n
            expert = gl.load(tile_to_expert_ptr + m_tile).to(gl.int32)
            if expert >= 0:  # row tiles past the last segment: no work
                w_row = expert * H + (t % tiles_n) * BN
                for s in range(steps):
                    idx = p % S
                    mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once
                    mbarrier.expect(ready.index(idx), nbytes)
                    tma.async_copy_global_to_shared(a_desc, [m_tile * BM, s * BK], ready.index(idx), l_bufs.index(idx))
                    tma.async_copy_global_to_shared(w_desc, [w_row, s * BK], ready.index(idx), r_bufs.index(idx))
                    p += 1

    @gluon.jit
    def down_multiplier(
        y_desc, tile_to_expert_ptr, topk_weights_ptr, row_to_tk_ptr, H, K_DIM, num_tiles, bufs, bars, c_smem,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        BM: gl.constexpr = y_desc.block_type.shape[0]
        BN: gl.constexpr = y_desc.block_type.shape[1]
        BK: gl.constexpr = bufs[0].type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        tiles_n = gl.cdiv(H, BN)
        steps = gl.cdiv(K_DIM, BK)
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            m_tile = t // tiles_n
            expert = gl.load(tile_to_expert_ptr + m_tile)
            if expert >= 0:
                zeros = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
                acc = accumulate(zeros, bufs, bars, c, steps, K_INNER=True)
                c += steps
                # each row's routing weight, 0 on padding rows (tiles.routing_weights_of_rows)
                rows = m_tile.to(gl.int64) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
                tk = gl.load(row_to_tk_ptr + rows)
                w = gl.load(topk_weights_ptr + tk, mask=tk >= 0, other=0.0)
                # padding rows get zeros, not 0 * whatever A's unwritten rows hold (NaN stays NaN)
                y = gl.where(gl.expand_dims(tk >= 0, 1), acc * gl.expand_dims(w, 1), 0.0)
                tma.store_wait(0)  # the previous tile's store has left c_smem
                c_smem.store(y.to(y_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(y_desc, [m_tile * BM, (t % tiles_n) * BN], c_smem)
        tma.store_wait(0)

    @gluon.jit
    def _down_fwd_gluon_kernel(
        a_desc, w_desc, y_desc, tile_to_expert_ptr, topk_weights_ptr, row_to_tk_ptr, H, K_DIM, num_tiles,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        bufs, bars = ring(a_desc, w_desc, STAGES)
        c_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
        gl.warp_specialize(
            [
                (down_multiplier, (y_desc, tile_to_expert_ptr, topk_weights_ptr, row_to_tk_ptr, H, K_DIM, num_tiles,
                                   bufs, bars, c_smem, num_warps)),  # fmt: skip
                (row_loader, (a_desc, w_desc, tile_to_expert_ptr, H, K_DIM, num_tiles, bufs, bars)),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )


if gluon is not None:

    @gluon.jit
    def tile_tokens(row_to_token_ptr, r0, sub_rows, SUB: gl.constexpr):
        """The token of each row of the 128-row block from r0 (-1 on padding rows), as eight slices of
        SUB rows: held in registers over the tile's K loop, so that no step waits on an index load."""
        p = row_to_token_ptr + r0 + sub_rows
        return (gl.load(p), gl.load(p + SUB), gl.load(p + 2 * SUB), gl.load(p + 3 * SUB), gl.load(p + 4 * SUB),
                gl.load(p + 5 * SUB), gl.load(p + 6 * SUB), gl.load(p + 7 * SUB))  # fmt: skip

    @gluon.jit
    def gather_slice(x_block, j: gl.constexpr, tokens, x_ptr, stride_x, ks, k_ok, SUB: gl.constexpr):
        """Slice j (SUB rows) of a stage's x block: asynchronous 16-byte copies of those tokens' rows
        at columns ks, zero-filled on padding rows and past H."""
        src = x_ptr + gl.expand_dims(tokens, 1) * stride_x + gl.expand_dims(ks, 0)
        mask = gl.expand_dims(tokens >= 0, 1) & gl.expand_dims(k_ok, 0)
        async_copy.async_copy_global_to_shared(x_block.slice(j * SUB, SUB), src, mask)

    @gluon.jit
    def gather_loader(
        x_ptr, stride_x, w_desc, row_to_token_ptr, tile_to_expert_ptr, H, I, num_tiles, bufs, bars,
        GATHER_LAYOUT: gl.constexpr, SUB: gl.constexpr, ALIGN: gl.constexpr,
    ):  # fmt: skip
        """Fills stage after stage: the gate and up weight blocks by TMA (their bytes expected on the
        stage's ready barrier), x's rows gathered by token through per-thread asynchronous copies
        (each thread arrives on the same barrier once its copies land)."""
        x_bufs, g_bufs, u_bufs = bufs
        ready, empty = bars
        S: gl.constexpr = x_bufs.type.shape[0]
        BM: gl.constexpr = x_bufs.type.shape[1]
        BK: gl.constexpr = x_bufs.type.shape[2]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        gl.static_assert(BM == 8 * SUB, "a tile's tokens are carried as eight slices")
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes
        if ALIGN < 16:  # restated as multiples of ALIGN so that the copies stay 16 bytes wide
            stride_x = stride_x // ALIGN * ALIGN
            H = H // ALIGN * ALIGN
        sub_rows = gl.arange(0, SUB, layout=gl.SliceLayout(1, GATHER_LAYOUT))
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, GATHER_LAYOUT))
        tiles_n = gl.cdiv(I, BN)
        steps = gl.cdiv(H, BK)
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            m_tile = t // tiles_n
            expert = gl.load(tile_to_expert_ptr + m_tile).to(gl.int32)
            if expert >= 0:
                gate_row = expert * 2 * I + (t % tiles_n) * BN
                t0, t1, t2, t3, t4, t5, t6, t7 = tile_tokens(row_to_token_ptr, m_tile.to(gl.int64) * BM, sub_rows, SUB)
                for s in range(steps):
                    idx = p % S
                    mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once
                    mbarrier.expect(ready.index(idx), nbytes)
                    tma.async_copy_global_to_shared(w_desc, [gate_row, s * BK], ready.index(idx), g_bufs.index(idx))
                    tma.async_copy_global_to_shared(w_desc, [gate_row + I, s * BK], ready.index(idx), u_bufs.index(idx))
                    ks = s * BK + cols
                    k_ok = ks < H
                    x_block = x_bufs.index(idx)
                    gather_slice(x_block, 0, t0, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 1, t1, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 2, t2, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 3, t3, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 4, t4, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 5, t5, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 6, t6, x_ptr, stride_x, ks, k_ok, SUB)
                    gather_slice(x_block, 7, t7, x_ptr, stride_x, ks, k_ok, SUB)
                    async_copy.mbarrier_arrive(ready.index(idx), increment_count=False)
                    p += 1

    @gluon.jit
    def up_multiplier(h_desc, tile_to_expert_ptr, H, I, num_tiles, bufs, bars, c_smem, num_warps: gl.constexpr):
        """Both halves' accumulators over the same gathered x block (two async wgmma a step, the
        previous step's pair done before its stage is freed); h's gate and up tiles stored by TMA."""
        x_bufs, g_bufs, u_bufs = bufs
        ready, empty = bars
        g_smem, u_smem = c_smem
        S: gl.constexpr = x_bufs.type.shape[0]
        BM: gl.constexpr = x_bufs.type.shape[1]
        BK: gl.constexpr = x_bufs.type.shape[2]
        BN: gl.constexpr = h_desc.block_type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        tiles_n = gl.cdiv(I, BN)
        steps = gl.cdiv(H, BK)
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            m_tile = t // tiles_n
            expert = gl.load(tile_to_expert_ptr + m_tile)
            if expert >= 0:
                acc_g = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
                acc_u = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
                for s in range(steps):
                    idx = (c + s) % S
                    mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)
                    fence_async_shared()  # x's rows came through the generic proxy; wgmma reads async
                    x_block = x_bufs.index(idx)
                    acc_g = warpgroup_mma(x_block, g_bufs.index(idx).permute((1, 0)), acc_g, is_async=True)
                    acc_u = warpgroup_mma(x_block, u_bufs.index(idx).permute((1, 0)), acc_u, is_async=True)
                    acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))  # the previous step's pair is done
                    mbarrier.arrive(empty.index((c + s + S - 1) % S), count=1, pred=s > 0)
                acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
                mbarrier.arrive(empty.index((c + steps + S - 1) % S), count=1, pred=steps > 0)
                c += steps
                n0 = (t % tiles_n) * BN
                tma.store_wait(0)  # the previous tile's two stores have left g_smem and u_smem
                g_smem.store(acc_g.to(h_desc.dtype))
                u_smem.store(acc_u.to(h_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(h_desc, [m_tile * BM, n0], g_smem)
                tma.async_copy_shared_to_global(h_desc, [m_tile * BM, I + n0], u_smem)
        tma.store_wait(0)

    @gluon.jit
    def _gate_up_fwd_gluon_kernel(
        x_ptr, stride_x, w_desc, h_desc, row_to_token_ptr, tile_to_expert_ptr, H, I, num_tiles,
        X_LAYOUT: gl.constexpr, GATHER_LAYOUT: gl.constexpr, SUB: gl.constexpr, ALIGN: gl.constexpr,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        dtype: gl.constexpr = w_desc.dtype
        BM: gl.constexpr = h_desc.block_type.shape[0]
        BK: gl.constexpr = w_desc.block_type.shape[1]
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], X_LAYOUT)
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        g_smem = gl.allocate_shared_memory(dtype, h_desc.block_type.shape, h_desc.layout)
        u_smem = gl.allocate_shared_memory(dtype, h_desc.block_type.shape, h_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # ready: the TMA's expect (one arrival) and every loader thread's copies (one each)
            mbarrier.init(ready.index(i), count=1 + LOADER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        bufs = (x_bufs, g_bufs, u_bufs)
        bars = (ready, empty)
        gl.warp_specialize(
            [
                (up_multiplier, (h_desc, tile_to_expert_ptr, H, I, num_tiles, bufs, bars, (g_smem, u_smem), num_warps)),
                (gather_loader, (x_ptr, stride_x, w_desc, row_to_token_ptr, tile_to_expert_ptr, H, I, num_tiles, bufs,
                                 bars, GATHER_LAYOUT, SUB, ALIGN)),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )  # fmt: skip


@functools.cache
def _gather_layout():
    """A loader thread copies 8 contiguous elements (16 bytes); 8 threads span a 64-column row."""
    return gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])


def gate_up_fwd_hopper(
    x: torch.Tensor, gate_up_proj: torch.Tensor, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor,
    h: torch.Tensor,
) -> None:  # fmt: skip
    """h [R_pad, 2I] = x[t_r] @ W13_e^T, gate half then up half, in x's dtype (padding rows of the
    active row tiles get zeros: their x rows are read as zeros); x [T, H], gate_up_proj [E, 2I, H].
    Call only where `gate_up_usable()`."""
    E, N1, H = gate_up_proj.shape
    I = N1 // 2
    num_tiles = tile_to_expert.shape[0] * (I // UP_BLOCK_N)
    if num_tiles == 0:
        return
    if x.shape[0] == 0:  # no tokens, so every row is padding: the copies read nothing, but need a pointer
        x = x.new_zeros(1, H)
    element = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16

    def desc(t: torch.Tensor, block: tuple[int, int]):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _layout(block, element))

    w = gate_up_proj.reshape(E * N1, H)
    _gate_up_fwd_gluon_kernel[(min(num_tiles, _num_sms(x.device.index)),)](
        x, x.stride(0), desc(w, (UP_BLOCK_N, BLOCK_K)), desc(h, (BLOCK_M, UP_BLOCK_N)), row_to_token,
        tile_to_expert, H, I, num_tiles, X_LAYOUT=_layout((BLOCK_M, BLOCK_K), element), GATHER_LAYOUT=_gather_layout(),
        SUB=GATHER_SUB, ALIGN=alignment(H, x.stride(0)), STAGES=STAGES, LOADER_WARPS=GATHER_WARPS,
        LOADER_REGS=GATHER_REGS, num_warps=8, maxnreg=wgrad_hopper.MAX_REGS,
    )  # fmt: skip


def down_fwd_hopper(
    a: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor, row_to_tk: torch.Tensor,
    tile_to_expert: torch.Tensor, y: torch.Tensor,
) -> None:  # fmt: skip
    """y [R_pad, H] = w_r * (A[r] @ W2_e^T) in A's dtype (see the module); a [R_pad, I] in schedule
    row order, down_proj [E, H, I], topk_weights fp32 flat [T * K]. Call only where `usable()`."""
    E, H, I = down_proj.shape
    num_tiles = tile_to_expert.shape[0] * triton.cdiv(H, BLOCK_N)
    if num_tiles == 0 or H == 0:
        return
    element = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16

    def desc(t: torch.Tensor, block: tuple[int, int]):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _layout(block, element))

    w = down_proj.reshape(E * H, I)
    _down_fwd_gluon_kernel[(min(num_tiles, _num_sms(a.device.index)),)](
        desc(a, (BLOCK_M, BLOCK_K)), desc(w, (BLOCK_N, BLOCK_K)), desc(y, (BLOCK_M, BLOCK_N)), tile_to_expert,
        topk_weights, row_to_tk, H, I, num_tiles, STAGES=STAGES, LOADER_WARPS=wgrad_hopper.LOADER_WARPS,
        LOADER_REGS=wgrad_hopper.LOADER_REGS, num_warps=8, maxnreg=wgrad_hopper.MAX_REGS,
    )  # fmt: skip
