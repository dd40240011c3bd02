"""The blockwise-FP8 weight gradients on Hopper as a warp-specialised, persistent Gluon kernel.

dW[e] [M, N] = sum over expert e's 128-row blocks kb, ascending, of (left_t[:, kb]^T . right_t[:, kb])
scaled by left's and right's 128 x 1 scales of that block: `fp8_mlp._fp8_wgrad_kernel`'s sums (the
recipe's promotion, one K step a scale block), with the operands as that kernel takes them, quantised
along the schedule's rows and stored transposed (left_t [M, R_pad], right_t [N, R_pad]: K-major, which
is all Hopper's FP8 wgmma takes, and rows TMA reads).

Why a second kernel: the Triton kernel runs near bf16's rate (490 TFLOP/s on qwen3-30b-a3b, commit
d9c430a), because it must scale each K step's product before adding it, so every step waits for its
MMA (`warp_group_dot_wait {pendings = 0}`) and no MMA overlaps the next step's loads or promotion; and
on deepseek-v3 (two K steps an expert) its tiles are mostly pipeline fill and store. Here, as in
`wgrad_hopper.py` (bf16), one loader warp streams both operands through TMA into a ring of stages
running ahead across tiles, and each MMA warpgroup keeps two partial products: it issues step s's
MMA, then waits only for step s - 1's and promotes it (scale and add) while step s's runs. Finished
tiles leave through an asynchronous TMA store. Two schedules (`SCHEDULES`): cooperative (both
warpgroups on one 128 x 128 tile, 64 rows each) and ping-pong (each on alternate 64 x 128 tiles, one's
epilogue under the other's MMAs).

Determinism: each output tile has one owner that adds its expert's blocks in ascending order to one
fp32 accumulator, `acc += partial * left_scale[:, None] * right_scale[None, :]`, the Triton kernel's
expression on the same 128-deep products (the wgmma's default FP8 accumulation, as `tl.dot`'s): meant
to be bitwise that kernel's, which the GPU tests check.

Off unless asked for, `MOK_HOPPER_FP8_WGRAD=cooperative` (or `pingpong`) in the environment: written
and compiled for sm_90 without a GPU (2026-12-04), its results and speed not yet measured on one
(`requested_schedule()`, `usable()`; the Triton kernel otherwise).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from mok_plugin.kernels.launch import cdiv
from mok_plugin.kernels.wgrad_hopper import _num_sms

try:  # Gluon is experimental: absent from older Triton, so this module works without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mok_plugin.kernels.wgrad_hopper import store_tile, tile_of
except ImportError:
    gluon = None

__all__ = ["BLOCK_K", "SCHEDULES", "Schedule", "fp8_wgrad_hopper", "requested_schedule", "stages_for", "usable"]

BLOCK_K = 128  # one K step is one scale block of the recipe
LOADER_WARPS, LOADER_REGS = 1, 24
SHARED_BYTES = 227 * 1024  # Hopper's per-block shared memory
BARRIER_BYTES = 1024  # the ring's and the turns' mbarriers, with room


@dataclass(frozen=True)
class Schedule:
    """How the two MMA warpgroups share the work: one block_m x block_n tile between them
    (cooperative, block_m / 2 rows each) or alternate tiles (ping-pong). A warpgroup holds its
    accumulator and two partial products: 3 x (its rows x block_n) / 128 registers a thread."""

    block_m: int
    block_n: int
    pingpong: bool
    max_regs: int  # the launch's per-thread ceiling (maxnreg), over the loader's warpgroup too

    @property
    def num_warps(self) -> int:
        """The default partition's warps: both MMA warpgroups (cooperative) or one (ping-pong)."""
        return 4 if self.pingpong else 8

    def rows_per_warpgroup(self) -> int:
        return self.block_m if self.pingpong else self.block_m // 2


SCHEDULES = {
    "cooperative": Schedule(block_m=128, block_n=128, pingpong=False, max_regs=168),
    "pingpong": Schedule(block_m=64, block_n=128, pingpong=True, max_regs=168),
}
PINGPONG_MMA_REGS = 232  # the worker MMA warpgroup's (a multiple of 8; 2 x 232 + 24 <= 3 x 168)


def stages_for(plan: Schedule, out_dtype: torch.dtype) -> int:
    """The ring's depth: as many FP8 operand stages as fit beside the output tiles (one per MMA
    warpgroup in ping-pong) in Hopper's shared memory, at most 8."""
    stage = (plan.block_m + plan.block_n) * BLOCK_K  # one byte an FP8 element
    out_tiles = (2 if plan.pingpong else 1) * plan.block_m * plan.block_n * torch.empty((), dtype=out_dtype).itemsize
    return min(8, (SHARED_BYTES - BARRIER_BYTES - out_tiles) // stage)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def requested_schedule() -> str | None:
    """The schedule `MOK_HOPPER_FP8_WGRAD` asks for (one of SCHEDULES), or None: unset or 0, the
    Triton kernel. A ValueError names the setting when it is neither."""
    value = os.environ.get("MOK_HOPPER_FP8_WGRAD", "0")
    if value == "0":
        return None
    if value not in SCHEDULES:
        raise ValueError(f"MOK_HOPPER_FP8_WGRAD={value!r}: expected 0 (off) or one of {', '.join(SCHEDULES)}")
    return value


def usable(left_t: torch.Tensor, right_t: torch.Tensor, d_w: torch.Tensor) -> bool:
    """Whether this kernel can compute these weight gradients (else the Triton kernel does): on an
    sm_90 GPU with Gluon, FP8 operands whose rows TMA reads (unit column stride, 16-byte aligned rows
    and base) and a contiguous dW whose rows TMA writes."""
    if gluon is None or not left_t.is_cuda or torch.cuda.get_device_capability(left_t.device) != (9, 0):
        return False
    operands_ok = all(
        t.is_cuda and t.dtype in _FP8 and t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (left_t, right_t)
    )
    out_ok = d_w.dtype in (torch.bfloat16, torch.float16, torch.float32) and d_w.is_contiguous()
    return operands_ok and out_ok and (d_w.shape[-1] * d_w.element_size()) % 16 == 0 and d_w.data_ptr() % 16 == 0


if gluon is not None:

    @gluon.jit
    def loader(left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars):
        """Both operands' K steps for every tile of this program, in order, into the ring."""
        l_bufs, r_bufs = bufs
        ready, empty = bars[0], bars[1]
        BM: gl.constexpr = left_desc.block_type.shape[0]
        BN: gl.constexpr = right_desc.block_type.shape[0]
        BK: gl.constexpr = left_desc.block_type.shape[1]
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
                tma.async_copy_global_to_shared(left_desc, [m0, row], ready.index(idx), l_bufs.index(idx))
                tma.async_copy_global_to_shared(right_desc, [n0, row], ready.index(idx), r_bufs.index(idx))
                p += 1

    @gluon.jit
    def block_scales(scale_ptr, stride, block, first, size, valid, SIZE: gl.constexpr, layout: gl.constexpr):
        """One K block's scales of columns first .. first + SIZE - 1 (zeros past `size`, or all zeros where
        not `valid`), in `layout`: loaded one element a thread, then spread to the accumulator's
        slice, so that neither the values' addresses nor a second set of them hold registers."""
        num_warps: gl.constexpr = gl.num_warps()
        compact: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        cols = first + gl.arange(0, SIZE, layout=compact)
        values = gl.load(scale_ptr + block * stride + cols, mask=(cols < size) & valid, other=0.0)
        return gl.convert_layout(values, layout)

    @gluon.jit
    def promoted_sum(acc, bufs, bars, c, steps, first_block, scales, m0, n0, M, N):
        """acc plus one tile's `steps` promoted K steps, read from the ring's positions c, c + 1, ...:
        step s's MMA is issued before step s - 1's product is scaled and added, so that promotion runs
        under an MMA; each stage is freed once its MMA is done. A step's scales are loaded while its
        MMA is waited on."""
        l_bufs, r_bufs = bufs
        ready, empty = bars[0], bars[1]
        l_scale_ptr, r_scale_ptr, stride_ls, stride_rs = scales
        S: gl.constexpr = l_bufs.type.shape[0]
        BM: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
        previous = gl.zeros_like(acc)  # step s - 1's product; zeros, scaled by zeros, before the first
        for s in range(steps):
            idx = (c + s) % S
            mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)
            # a fresh accumulator, not read (use_acc=False): a zeros tensor kept across steps would hold registers
            current = warpgroup_mma(l_bufs.index(idx), r_bufs.index(idx).permute((1, 0)), gl.zeros_like(acc),
                                    use_acc=False, is_async=True)  # fmt: skip
            l_scale = block_scales(l_scale_ptr, stride_ls, first_block + s - 1, m0, M, s > 0, BM, rows_layout)
            r_scale = block_scales(r_scale_ptr, stride_rs, first_block + s - 1, n0, N, s > 0, BN, cols_layout)
            # step s - 1's MMA done (step s's may still run): free its stage, promote its product
            current, previous = warpgroup_mma_wait(1, deps=(current, previous))
            mbarrier.arrive(empty.index((c + s + S - 1) % S), count=1, pred=s > 0)
            acc += previous * l_scale[:, None] * r_scale[None, :]
            previous = current
        l_scale = block_scales(l_scale_ptr, stride_ls, first_block + steps - 1, m0, M, steps > 0, BM, rows_layout)
        r_scale = block_scales(r_scale_ptr, stride_rs, first_block + steps - 1, n0, N, steps > 0, BN, cols_layout)
        previous = warpgroup_mma_wait(0, deps=(previous,))
        mbarrier.arrive(empty.index((c + steps + S - 1) % S), count=1, pred=steps > 0)
        acc += previous * l_scale[:, None] * r_scale[None, :]
        return acc

    @gluon.jit
    def multiplier(out_desc, counts_ptr, offsets_ptr, scales, M, N, num_tiles, bufs, bars, c_smem,
                   num_warps: gl.constexpr):  # fmt: skip
        """The cooperative schedule: all the default partition's warps share each tile."""
        BM: gl.constexpr = out_desc.block_type.shape[1]  # out_desc: [E, M, N] in [1, BM, BN] blocks
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = bufs[0].type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32]
        )
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = tile_of(t, M, N, BM, BN)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK).to(gl.int32)
            first_block = (gl.load(offsets_ptr + expert) // BK).to(gl.int32)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
            acc = promoted_sum(acc, bufs, bars, c, steps, first_block, scales, m0, n0, M, N)
            store_tile(out_desc, c_smem, acc, expert, m0, n0)
            c += steps
        tma.store_wait(0)

    @gluon.jit
    def pingpong_multiplier(out_desc, counts_ptr, offsets_ptr, scales, M, N, num_tiles, bufs, bars, c_smem,
                            WHICH: gl.constexpr):  # fmt: skip
        """The ping-pong schedule: one of two MMA warpgroups taking this program's tiles in turn (tile i:
        warpgroup i % 2), their main loops alternating on `turn` barriers as in wgrad_hopper.py's (a
        stage's ready barrier is waited on by parity, which tells phase k from k - 2 but not k - 1)."""
        turn = bars[2]
        BM: gl.constexpr = out_desc.block_type.shape[1]
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = bufs[0].type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 32])  # fmt: skip
        c = 0
        i = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = tile_of(t, M, N, BM, BN)
            steps = gl.cdiv(gl.load(counts_ptr + expert), BK).to(gl.int32)
            if i % 2 == WHICH:
                k = i // 2
                mbarrier.wait(turn.index(WHICH), (k & 1) ^ (1 - WHICH))
                first_block = (gl.load(offsets_ptr + expert) // BK).to(gl.int32)
                acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
                acc = promoted_sum(acc, bufs, bars, c, steps, first_block, scales, m0, n0, M, N)
                mbarrier.arrive(turn.index(1 - WHICH), count=1)  # the other's main loop may start
                store_tile(out_desc, c_smem, acc, expert, m0, n0)
            c += steps
            i += 1
        tma.store_wait(0)

    @gluon.jit
    def ring(left_desc, right_desc, STAGES: gl.constexpr):
        """The operands' shared-memory stages and their ready (loaded) and empty (consumed) barriers."""
        l_bufs = gl.allocate_shared_memory(left_desc.dtype, [STAGES] + left_desc.block_type.shape, left_desc.layout)
        r_bufs = gl.allocate_shared_memory(right_desc.dtype, [STAGES] + right_desc.block_type.shape,
                                           right_desc.layout)  # fmt: skip
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        return (l_bufs, r_bufs), (ready, empty)

    @gluon.jit
    def _fp8_wgrad_hopper_kernel(
        left_desc, right_desc, out_desc, left_scale_ptr, right_scale_ptr, offsets_ptr, counts_ptr, M, N, num_tiles,
        stride_ls, stride_rs, C_LAYOUT: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
        LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        bufs, bars = ring(left_desc, right_desc, STAGES)
        c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        scales = (left_scale_ptr, right_scale_ptr, stride_ls, stride_rs)
        gl.warp_specialize(
            [
                (multiplier, (out_desc, counts_ptr, offsets_ptr, scales, M, N, num_tiles, bufs, bars, c_smem,
                              num_warps)),  # fmt: skip
                (loader, (left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars)),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )

    @gluon.jit
    def _fp8_wgrad_hopper_pingpong_kernel(
        left_desc, right_desc, out_desc, left_scale_ptr, right_scale_ptr, offsets_ptr, counts_ptr, M, N, num_tiles,
        stride_ls, stride_rs, C_LAYOUT: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
        LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
    ):  # fmt: skip
        bufs, bars = ring(left_desc, right_desc, STAGES)
        c0_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        c1_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        turns = (bars[0], bars[1], turn)
        scales = (left_scale_ptr, right_scale_ptr, stride_ls, stride_rs)
        gl.warp_specialize(
            [
                (pingpong_multiplier, (out_desc, counts_ptr, offsets_ptr, scales, M, N, num_tiles, bufs, turns,
                                       c0_smem, 0)),  # fmt: skip
                (pingpong_multiplier, (out_desc, counts_ptr, offsets_ptr, scales, M, N, num_tiles, bufs, turns,
                                       c1_smem, 1)),  # fmt: skip
                (loader, (left_desc, right_desc, offsets_ptr, counts_ptr, M, N, num_tiles, bufs, bars)),
            ],
            [4, LOADER_WARPS],  # the second MMA warpgroup, the loader
            [MMA_REGS, LOADER_REGS],
        )

    GL_DTYPES = {
        torch.float8_e4m3fn: gl.float8e4nv,
        torch.float8_e5m2: gl.float8e5,
        torch.bfloat16: gl.bfloat16,
        torch.float16: gl.float16,
        torch.float32: gl.float32,
    }


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared layout of a TMA block of this torch dtype (cached: built per call, these
    were host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


def kernel_arguments(plan: Schedule, out_dtype: torch.dtype) -> tuple[object, dict]:
    """(the Gluon kernel, its constexprs) for this schedule and dW dtype: what the launcher passes,
    and what `mok bench inspect` compiles for sm_90 without a GPU."""
    constexprs = {
        "C_LAYOUT": shared_layout((plan.block_m, plan.block_n), out_dtype),
        "STAGES": stages_for(plan, out_dtype),
        "LOADER_WARPS": LOADER_WARPS,
        "LOADER_REGS": LOADER_REGS,
    }
    if plan.pingpong:
        return _fp8_wgrad_hopper_pingpong_kernel, constexprs | {"MMA_REGS": PINGPONG_MMA_REGS}
    return _fp8_wgrad_hopper_kernel, constexprs


def fp8_wgrad_hopper(
    left_t: torch.Tensor, left_scale_inv: torch.Tensor, right_t: torch.Tensor, right_scale_inv: torch.Tensor,
    d_w: torch.Tensor, expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, schedule: str = "cooperative",
) -> None:  # fmt: skip
    """d_w [E, M, N] = `fp8_mlp.fp8_wgrad`'s sums from the same operands (left_t [M, R_pad], right_t
    [N, R_pad], scales [R_pad / 128, M] and [R_pad / 128, N], expert offsets multiples of 128), under
    one of SCHEDULES. Call only where `usable(left_t, right_t, d_w)`."""
    plan = SCHEDULES[schedule]
    E, M, N = d_w.shape
    num_tiles = E * cdiv(M, plan.block_m) * cdiv(N, plan.block_n)
    if num_tiles == 0:
        return

    def desc(t: torch.Tensor, block: tuple[int, ...]):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), shared_layout(block, t.dtype))

    kernel, constexprs = kernel_arguments(plan, d_w.dtype)
    grid = (min(num_tiles, _num_sms(d_w.device.index)),)
    kernel[grid](
        desc(left_t, (plan.block_m, BLOCK_K)), desc(right_t, (plan.block_n, BLOCK_K)),
        desc(d_w, (1, plan.block_m, plan.block_n)), left_scale_inv, right_scale_inv, expert_offsets, tokens_per_expert,
        M, N, num_tiles, left_scale_inv.stride(0), right_scale_inv.stride(0), num_warps=plan.num_warps,
        maxnreg=plan.max_regs, **constexprs,
    )  # fmt: skip
