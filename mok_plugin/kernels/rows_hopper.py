"""fc2's forward on Hopper as a warp-specialised, persistent Gluon kernel (the row GEMMs' first).

y[r, :] = w_r * (A[r] @ W2_e^T) for every row r of row tile m (expert e = tile_to_expert[m]),
w_r = topk_weights[row_to_tk[r]]: `grouped_mlp.down_fwd`'s result, with the weight gradients'
structure (`wgrad_hopper.py`): one loader warp streams A's row block and W2_e's row block by TMA
into a ring of shared-memory stages, running ahead across tiles; two MMA warpgroups share each
128 x 256 tile (async wgmma, one in flight) and hand it to an asynchronous TMA store. Both operands
are contiguous (A in schedule row order, W2 viewed as [E * H, I]), which is why fc2's forward is
the first row GEMM here: fc1's forward and fc2's input gradient gather their rows by token.

Determinism: one owner per output tile, the same BLOCK_K steps in ascending order into one fp32
accumulator, then the same fp32 scaling and one rounding: bitwise `tiles.down_tile` (tested on the
GPU). A weight block that runs past the expert's H rows reads the next expert's rows (or TMA's
zeros after the last): they meet only output columns >= H, which the store clips. Padding rows
are written (as w_r = 0 times whatever A holds there), where the Triton kernel leaves them unset:
nothing reads them.

Only on sm_90, for bf16/fp16 without the fc2 bias, schedule tiles of 128 rows, and rows TMA can
read; `usable()` says when. `MOK_HOPPER_ROWS=0` turns it off.
"""

from __future__ import annotations

import os

import torch
import triton

from mok_plugin.kernels import wgrad_hopper
from mok_plugin.kernels.wgrad_hopper import _layout, _num_sms, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mok_plugin.kernels.wgrad_hopper import accumulate, ring

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "down_fwd_hopper", "usable"]

# The Triton kernel's tile (configs.py "down_fwd": 128 x 256 x 64): the same K steps, so the same bits.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
STAGES = 3  # 3 x 48 KiB of operand stages + the 64 KiB output tile: 208 KiB of Hopper's 227


def usable(a: torch.Tensor, down_proj: torch.Tensor, tile_m: int, down_bias: torch.Tensor | None) -> bool:
    """Whether this kernel can compute fc2's forward (else the Triton kernel does)."""
    if os.environ.get("MOK_HOPPER_ROWS", "1") == "0" or down_bias is not None or tile_m != BLOCK_M:
        return False
    if not wgrad_hopper.usable(a, a, BLOCK_K):  # sm_90, 2-byte, TMA-readable rows, Gluon present
        return False
    w = down_proj.reshape(-1, down_proj.shape[-1])
    return w.dtype == a.dtype and w.stride(1) == 1 and w.stride(0) * w.element_size() % 16 == 0


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
                y = acc * gl.expand_dims(w, 1)
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
