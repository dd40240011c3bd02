"""Blockwise-FP8 GEMMs on Hopper as warp-specialised, persistent Gluon kernels (issue 25): the weight
gradients, and the row GEMMs whose operands are contiguous rows (fc2's forward, fc1's dgrad; fc2's
dgrad and fc1's forward on their gathered FP8 rows copied into row order).

Both compute what `fp8_mlp.py`'s Triton kernels compute, from the same operands: every K step is one
128-wide scale block, its FP8 product summed by the MMA in fp32, then scaled and added to an fp32
accumulator in ascending order (the recipe's promotion), with the Triton kernels' expressions:
- weight gradients: dW[e] [M, N] = sum over expert e's 128-row blocks of left_t[:, kb] . right_t[:, kb]^T,
  `acc += partial * left_scale[:, None] * right_scale[None, :]` (`fp8_mlp._fp8_wgrad_kernel`; the
  operands quantised along the schedule's rows and stored transposed, [M or N, R_pad]);
- row GEMMs: out[r] = sum over fc1's halves, then K blocks, of A[r, kb] . B[e, :, kb]^T for row r of
  expert e, `acc += partial * (a_scale * b_scale)[:, None]` (one B scale per 128-column tile:
  `fp8_mlp.fp8_block_matmul`), then fc2's epilogue (`+ b2`, `* w_r`) or none (the dgrads).
So each output has one owner and one order: meant to be bitwise the Triton kernels, which the GPU
tests check. (fc1's dgrad sums both halves into one accumulator in both.)

Why: the Triton kernels run near bf16's rate (440-550 TFLOP/s on qwen3-30b-a3b, commit d9c430a),
because each K step's product must be scaled before it is added, so every step waits for its MMA
(`warp_group_dot_wait {pendings = 0}`) and nothing overlaps it: the program's warps wait for their
MMA, then all promote, then all issue the next. Here, as DeepGEMM does it: one loader warp streams both
operands through TMA into a ring of stages running ahead across tiles, and two MMA warpgroups, in
partitions of their own, each take one half (64 rows) of every 128 x 128 tile. Each issues step s's
MMA before it promotes step s - 1's product (`pipelined_steps`: two sets of product registers), so the
tensor cores work through the promotions; a stage is freed once both have read it. The weight
gradients' stages also bring each step's 128 + 128 scales by TMA, read from the stage before it is
freed (loaded by each warp and spread through shared memory, they cost global loads, a layout
round trip and two warpgroup barriers a step); the row GEMMs load theirs at the step. Finished
halves leave through asynchronous TMA stores; where a weight-gradient tile is only a few K steps (up to
FLAT_MAX_ROWS rows an expert), each warpgroup runs one loop over all its program's steps
(`flat_wgrad_steps`), so that a tile's store runs under the next tile's first MMA (5 % faster at two steps
a tile on an H100, BENCHMARKS.md f28). (The two warpgroups alone do not hide each other's promotion:
they run in step, Proton found on an H100; taking the MMAs in turn was slower, BENCHMARKS.md f14.
A first in-warpgroup overlap swapped its two sets every step; the compiler copied a product still
being written and ptxas serialised every wgmma, C7514: the sets now keep to even and odd steps.)

On by default on Hopper (`usable`); `MOK_HOPPER_FP8_WGRAD=0` / `MOK_HOPPER_FP8_ROWS=0` keep the Triton
kernels (`enabled`). Written without a GPU (2026-12-04); on the H200 (2026-12-05, 4aaa485) bitwise the
Triton kernels (tests/test_fp8_hopper.py) and faster on every shape: forward + backward with the weights
kept 9.16 -> 7.59 ms on qwen3-30b-a3b, 32.72 -> 24.60 on mixtral-8x7b, 45.68 -> 33.73 on deepseek-v3
(with fc1's forward split; BENCHMARKS.md, f6); with the pipelined steps (7e6c7b9, two rounds each)
7.55 -> 7.03, 24.50 -> 23.64, 32.78 -> 31.58 (f15).
"""

from __future__ import annotations

import functools
import os

import torch

from mok_plugin.kernels.launch import cdiv, sm_count

try:  # Gluon is experimental: absent from older Triton, so this module works without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mok_plugin.kernels.wgrad_hopper import store_tile, tile_of
except ImportError:
    gluon = None

__all__ = [
    "BLOCK_K",
    "BLOCK_M",
    "BLOCK_N",
    "ROWS_SETTING",
    "WGRAD_SETTING",
    "enabled",
    "fp8_rows_hopper",
    "fp8_wgrad_hopper",
    "row_gemm_operands",
    "scale_rows_ok",
    "usable_row_gemm",
    "stages_for",
    "usable",
]

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128  # a tile; each MMA warpgroup takes BLOCK_M / 2 of its rows
HALF_M = BLOCK_M // 2
LOADER_WARPS, LOADER_REGS = 1, 24
MAX_REGS = 168  # per thread over the 12 warps (two MMA warpgroups + the loader's) sharing an SM's 64 K
MMA_REGS = 232  # the second MMA warpgroup's (a multiple of 8; 2 x 232 + 24 <= 3 x 168)
WGRAD_MMA_REGS = 240  # the weight gradients' (2 x 240 + 24 = 3 x 168): the flat loop's tile state spilled at 232
SHARED_BYTES = 227 * 1024  # Hopper's per-block shared memory
BARRIER_BYTES = 1024  # the ring's mbarriers, with room
WGRAD_SETTING, ROWS_SETTING = "MOK_HOPPER_FP8_WGRAD", "MOK_HOPPER_FP8_ROWS"
PROGRAMS: int | None = None  # persistent programs a launch (None: one per SM); the tests set a few
# The weight gradients' loop: None chooses by rows an expert (`flat_loop`); True or False forces the flat loop
# (`flat_wgrad_steps`) or the tile-by-tile one (the tests and `mok bench wgrad-rows --fp8-loops` set it)
FLAT_WGRAD: bool | None = None
# The flat loop where the schedule has at most this many rows an expert on average (at most 4 K steps a tile).
# H100, deepseek-v3's dW13 and dW2, flat against tile by tile (BENCHMARKS.md, f28): 256 rows -5.2 %, -5.0 %,
# -2.5 %; 128 and 512 rows -2 to -3 % (one 512 case +6 %, timed first in its process); 1,024 and 2,048 rows
# within +-3 % either way.
FLAT_MAX_ROWS = 512


def stages_for(out_dtype: torch.dtype, rows: bool = True) -> int:
    """The ring's depth: as many FP8 operand stages (a 128-row A block and a 128-row B block of 128
    bytes each, and for the weight gradients their step's 128 + 128 fp32 scales) as fit beside the two
    warpgroups' output halves in Hopper's shared memory, at most 8."""
    stage = (BLOCK_M + BLOCK_N) * BLOCK_K + (0 if rows else (BLOCK_M + BLOCK_N) * 4)  # one byte an FP8 element
    return min(8, (SHARED_BYTES - BARRIER_BYTES - BLOCK_M * BLOCK_N * out_dtype.itemsize) // stage)


def enabled(setting: str) -> bool:
    """Whether environment variable `setting` leaves its choice on: unset or 1. WGRAD_SETTING and
    ROWS_SETTING: the Gluon kernels (on Hopper, where `usable`), 0 for the Triton ones; fp8_fc1_hopper's
    SPLIT_SETTING: fc1's forward split (row GEMM, then A), 0 for its fused Gluon kernel. A ValueError
    names the setting otherwise. On by default since the H200 measured them bitwise the Triton kernels
    and faster on every shape (BENCHMARKS.md, f6)."""
    value = os.environ.get(setting, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{setting}={value!r}: expected 1 (the default) or 0 (see the README's environment table)")
    return value == "1"


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read or write this 2-D tensor's rows: unit column stride, 16-byte aligned
    row stride and base."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def scale_rows_ok(scales: torch.Tensor) -> bool:
    """Whether TMA can bring the weight gradients' scales ([R_pad / 128, M or N] fp32) with each stage,
    a [1, 128] block of one row: fp32, 2-D, rows TMA reads (else the Triton kernel computes dW)."""
    return scales.dtype == torch.float32 and scales.dim() == 2 and _tma_ok(scales)


def usable(operands: tuple[torch.Tensor, ...], out: torch.Tensor, tile_m: int = BLOCK_M, scales: tuple = ()) -> bool:
    """Whether these kernels can take these FP8 operands (2-D views, as the launchers describe them),
    this output ([rows, N] or dW's [E * M, N]), for the row GEMMs the schedule's tile_m (a multiple of
    BLOCK_M, so that a tile's rows are one expert's) and for the weight gradients the operands' fp32
    scales (brought with each stage): on an sm_90 GPU with Gluon, all of them rows TMA reads and
    writes (else the Triton kernels compute it)."""
    if gluon is None or not out.is_cuda or torch.cuda.get_device_capability(out.device) != (9, 0):
        return False
    fp8_ok = all(t.is_cuda and t.dtype in _FP8 and t.dim() == 2 and _tma_ok(t) for t in operands)
    scales_ok = all(s.is_cuda and scale_rows_ok(s) for s in scales)
    return fp8_ok and scales_ok and out.dtype in _OUT and out.dim() == 2 and _tma_ok(out) and tile_m % BLOCK_M == 0


def row_gemm_operands(rows: torch.Tensor, weights: torch.Tensor, gated: bool) -> tuple[tuple, tuple] | None:
    """(A's halves, B's halves) of a row GEMM as the kernel takes them, 2-D views: the rows [R, K] (or
    fc1's two column halves of [R, 2K]) and the weights [E, N, K] (or [E, N, 2K]) as [E * N, K]; None
    where the weights are not contiguous (the Triton kernel takes them)."""
    if not weights.is_contiguous():
        return None
    E, N, width = weights.shape
    flat = weights.view(E * N, width)
    if not gated:
        return (rows,), (flat,)
    k = width // 2
    return (rows[:, :k], rows[:, k:]), (flat[:, :k], flat[:, k:])


def usable_row_gemm(rows: torch.Tensor, weights: torch.Tensor, gated: bool, out: torch.Tensor, tile_m: int,
                    scale_block: int) -> tuple[tuple, tuple] | None:  # fmt: skip
    """`row_gemm_operands(rows, weights, gated)` where the Gluon row kernel takes this GEMM: its scale
    blocks BLOCK_K wide, the row GEMMs on (ROWS_SETTING) and `usable` with `out` and tile_m; else None
    (the Triton kernel computes it)."""
    if scale_block != BLOCK_K or not enabled(ROWS_SETTING):
        return None
    operands = row_gemm_operands(rows, weights, gated)
    if operands is None or not usable(operands[0] + operands[1], out, tile_m):
        return None
    return operands


if gluon is not None:

    @gluon.jit
    def wgrad_tile(t, work, M, N, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """(expert, m0, n0, K steps, first row) of weight-gradient tile t, expert-major: consecutive
        programs share the expert's rows in L2. Every tile is stored, zeros for an expert with no rows."""
        offsets_ptr, counts_ptr = work[0], work[1]
        expert, m0, n0 = tile_of(t, M, N, BM, BN)
        first_row = gl.load(offsets_ptr + expert).to(gl.int32)
        steps = gl.cdiv(gl.load(counts_ptr + expert), BK).to(gl.int32)
        return expert, m0, n0, steps, first_row

    @gluon.jit
    def rows_tile(t, work, M, N, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """(expert, m0, n0, K steps, 0) of row tile t, column blocks fastest (the rows' A in L2);
        expert < 0 (padding): no steps and no store. work starts (tile_to_expert, K steps a half,
        halves, tile_m) (fp8_fc1_hopper.py's too)."""
        tile_to_expert_ptr, k_steps, halves, tile_m = work[0], work[1], work[2], work[3]
        tiles_n = gl.cdiv(N, BN)
        m0 = (t // tiles_n) * BM
        expert = gl.load(tile_to_expert_ptr + m0 // tile_m).to(gl.int32)
        steps = gl.where(expert >= 0, k_steps * halves, 0)
        return expert, m0, (t % tiles_n) * BN, steps, 0

    @gluon.jit
    def tile_work(t, work, M, N, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, ROWS: gl.constexpr):
        if ROWS:
            work_of_tile = rows_tile(t, work, M, N, BM, BN, BK)
        else:
            work_of_tile = wgrad_tile(t, work, M, N, BM, BN, BK)
        return work_of_tile

    @gluon.jit
    def loader(a_descs, b_descs, work, M, N, num_tiles, bufs, bars, ROWS: gl.constexpr):
        """Both operands' K steps for every tile of this program, in order, into the ring. Weight
        gradients: A = left_t at (m0, row), B = right_t at (n0, row). Row GEMMs: A = the rows at
        (m0, k), B = the expert's weight, flattened [E * N, K], at (expert * N + n0, k) (a block past N
        reads the next expert's rows into output columns the store clips), from the descriptors of
        the step's half (fc1's gate, then its up); for the weight gradients also the step's scales of
        both (a_descs[1] and b_descs[1]: [R_pad / 128, M or N] at (row block, m0 or n0))."""
        a_bufs, b_bufs = bufs[0], bufs[1]
        ready, empty = bars[0], bars[1]
        BM: gl.constexpr = a_descs[0].block_type.shape[0]
        BN: gl.constexpr = b_descs[0].block_type.shape[0]
        BK: gl.constexpr = a_descs[0].block_type.shape[1]
        S: gl.constexpr = a_bufs.type.shape[0]
        SCALES: gl.constexpr = 1 - ROWS  # a stage brings its scales (weight gradients)
        nbytes: gl.constexpr = (a_descs[0].block_type.nbytes + b_descs[0].block_type.nbytes
                                + SCALES * (a_descs[1].block_type.nbytes + b_descs[1].block_type.nbytes))  # fmt: skip
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0, steps, first_row = tile_work(t, work, M, N, BM, BN, BK, ROWS)
            for s in range(steps):
                idx = p % S
                mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once
                mbarrier.expect(ready.index(idx), nbytes)
                if ROWS:
                    k_steps = work[1]
                    k = (s % k_steps) * BK
                    b_row = expert * N + n0
                    if s < k_steps:
                        tma.async_copy_global_to_shared(a_descs[0], [m0, k], ready.index(idx), a_bufs.index(idx))
                        tma.async_copy_global_to_shared(b_descs[0], [b_row, k], ready.index(idx), b_bufs.index(idx))
                    else:
                        tma.async_copy_global_to_shared(a_descs[1], [m0, k], ready.index(idx), a_bufs.index(idx))
                        tma.async_copy_global_to_shared(b_descs[1], [b_row, k], ready.index(idx), b_bufs.index(idx))
                else:
                    row = first_row + s * BK
                    tma.async_copy_global_to_shared(a_descs[0], [m0, row], ready.index(idx), a_bufs.index(idx))
                    tma.async_copy_global_to_shared(b_descs[0], [n0, row], ready.index(idx), b_bufs.index(idx))
                    block = row // BK
                    tma.async_copy_global_to_shared(a_descs[1], [block, m0], ready.index(idx), bufs[2].index(idx))
                    tma.async_copy_global_to_shared(b_descs[1], [block, n0], ready.index(idx), bufs[3].index(idx))
                p += 1

    @gluon.jit
    def tile_scales(acc, expert, m0, n0, first_row, work, M, N, ROWS: gl.constexpr):
        """What a tile's steps read their scales through, computed once a tile: the rows' scale pointers
        in the accumulator's row slice (two a thread), the rest scalars (row GEMMs); nothing for the
        weight gradients, whose scales come with each stage."""
        BK: gl.constexpr = 128
        if ROWS:
            # a_scale [rows, halves, K blocks] per row; b_scale [E, halves, N blocks, K blocks], one per step
            ms = m0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
            a_scale_ptr, stride_as_r, stride_as_half = work[4], work[5], work[6]
            b_scale_ptr, stride_bs_e, stride_bs_half, stride_bs_n = work[7], work[8], work[9], work[10]
            tile_ptr = b_scale_ptr + expert * stride_bs_e + (n0 // BK) * stride_bs_n
            scales = (a_scale_ptr + ms * stride_as_r, ms < M, tile_ptr, stride_as_half, stride_bs_half)
        else:
            scales = ()
        return scales

    @gluon.jit
    def step_scales(s, scales, work, ROWS: gl.constexpr):
        """Step s's scales, issued before its stage is waited on so that their latency runs under the
        wait: the rows' (in the row slice) times B's one (row GEMMs); nothing for the weight gradients
        (their stage brings them: `stage_freed`). (Loaded a step ahead and multiplied only in `promote`,
        four values a thread carried instead of two, the H200's row GEMMs were 1-7 % slower: f16.)"""
        if ROWS:
            rows_ptrs, rows_ok = scales[0], scales[1]
            tile_ptr, stride_as_half, stride_bs_half, k_steps = scales[2], scales[3], scales[4], work[1]
            second_half = s >= k_steps
            kb = gl.where(second_half, s - k_steps, s)
            a_scale = gl.load(rows_ptrs + gl.where(second_half, stride_as_half, 0) + kb, mask=rows_ok, other=0.0)
            b_scale = gl.load(tile_ptr + gl.where(second_half, stride_bs_half, 0) + kb)
            values = a_scale * b_scale
        else:
            values = ()
        return values

    @gluon.jit
    def no_scales(scales, ROWS: gl.constexpr):
        """Values shaped as `step_scales`' for the step before the first, which nothing promotes."""
        if ROWS:
            values = gl.zeros_like(scales[0], dtype=gl.float32)
        else:
            values = ()
        return values

    @gluon.jit
    def stage_freed(values, empty, idx, stage_scales, HALF: gl.constexpr, WHICH: gl.constexpr, layout: gl.constexpr,
                    ROWS: gl.constexpr):  # fmt: skip
        """A step's scales for `promote` once its MMA is done, and its stage idx freed: the weight
        gradients' read from the stage first (this warpgroup's 64 rows' and the 128 columns', each
        thread those of its accumulator's rows and columns); the row GEMMs' `values` as loaded."""
        if not ROWS:
            values = (stage_scales[0].index(idx).slice(WHICH * HALF, HALF).load(gl.SliceLayout(1, layout)),
                      stage_scales[1].index(idx).load(gl.SliceLayout(0, layout)))  # fmt: skip
        mbarrier.arrive(empty.index(idx), count=1)
        return values

    @gluon.jit
    def promote(acc, partial, values, ROWS: gl.constexpr):
        """acc plus a step's product scaled as the Triton kernels scale it: `partial * row_scale[:, None]`
        with row_scale = a_scale * b_scale (row GEMMs: `step_scales`' values), `partial * l[:, None] *
        r[None, :]` (weight gradients, the scales in the accumulator's row and column slices)."""
        if ROWS:
            acc += partial * values[:, None]
        else:
            l_scale, r_scale = values
            acc += partial * l_scale[:, None] * r_scale[None, :]
        return acc

    @gluon.jit
    def spread(scale_ptr, offsets, mask, layout: gl.constexpr):
        """Values at scale_ptr + offsets (zeros where not `mask`), loaded one element a thread and then
        spread to `layout` (one of the accumulator's slices)."""
        values = gl.load(scale_ptr + offsets, mask=mask, other=0.0)
        return gl.convert_layout(values, layout)

    @gluon.jit
    def finish_half(out_desc, c_smem, acc, expert, m0, n0, epilogue, M, N, ROWS: gl.constexpr,
                    BIAS: gl.constexpr, ROUTING: gl.constexpr):  # fmt: skip
        """A warpgroup's half of a tile through fc2's epilogue where asked (`+ b2[expert]`,
        `* topk_weights[row_to_tk[r]]`, as `fp8_mlp._fp8_down_fwd_kernel`), then out by wgrad_hopper's
        asynchronous TMA store, which clips at the output's edges. Row tiles of padding (expert < 0)
        are neither computed nor stored; padding rows inside a real tile are written, with values of
        no meaning (the Triton kernels leave them; nothing reads them)."""
        if ROWS:
            if expert >= 0:
                num_warps: gl.constexpr = gl.num_warps()
                compact: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
                if BIAS:
                    bias_ptr, stride_bias_e = epilogue[0], epilogue[1]
                    ns = n0 + gl.arange(0, acc.type.shape[1], layout=compact)
                    b2 = spread(bias_ptr + expert * stride_bias_e, ns, ns < N, gl.SliceLayout(0, acc.type.layout))
                    acc += b2.to(gl.float32)[None, :]
                if ROUTING:
                    topk_weights_ptr, row_to_tk_ptr = epilogue[2], epilogue[3]
                    ms = m0 + gl.arange(0, acc.type.shape[0], layout=compact)
                    tk = gl.load(row_to_tk_ptr + ms, mask=ms < M, other=-1)
                    w = spread(topk_weights_ptr, tk, tk >= 0, gl.SliceLayout(1, acc.type.layout))
                    acc = acc * w[:, None]
                store_tile(out_desc, c_smem, acc, expert * 0, m0, n0)  # out_desc: the rows as [1, R, N]
        else:
            store_tile(out_desc, c_smem, acc, expert, m0, n0)  # out_desc: dW [E, M, N], clipped at each M

    @gluon.jit
    def mma_of(a_bufs, b_bufs, ready, c, s, registers, WHICH: gl.constexpr):
        """Step s's MMA of this warpgroup's half, issued once its stage is in (asynchronous: a token)."""
        S: gl.constexpr = a_bufs.type.shape[0]
        HALF: gl.constexpr = registers.type.shape[0]
        idx = (c + s) % S
        mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)
        return warpgroup_mma(a_bufs.index(idx).slice(WHICH * HALF, HALF), b_bufs.index(idx).permute((1, 0)),
                             registers, use_acc=False, is_async=True)  # fmt: skip

    @gluon.jit
    def pipelined_steps(acc, products, bufs, stage_scales, ready, empty, c, steps, scales, work, WHICH: gl.constexpr,
                        ROWS: gl.constexpr):  # fmt: skip
        """(acc, products) after a tile's steps, step s's MMA issued before step s - 1's product is
        promoted, so that the warpgroup's ~128 scaling instructions a thread run under an MMA (waited on
        after each MMA, a step took ~1,300 cycles on an H100, the MMAs ~500 of them). `products`: two
        sets of registers, for even steps and odd ones, two steps an iteration and kept across tiles: a
        set that changed places every step, or shared a first value with acc, would be copied while an
        MMA writes it, and ptxas would serialise every wgmma (C7514, C7515). Step 2q - 1's MMA runs into
        iteration q. The sums and their order are those of one step at a time: the same bits."""
        a_bufs, b_bufs = bufs[0], bufs[1]
        S: gl.constexpr = a_bufs.type.shape[0]
        HALF: gl.constexpr = acc.type.shape[0]
        layout: gl.constexpr = acc.type.layout
        even, odd_done = products
        odd = warpgroup_mma_init(odd_done)
        odd_values = no_scales(scales, ROWS)
        pairs = steps // 2
        for q in range(pairs):
            s = 2 * q
            even_values = step_scales(s, scales, work, ROWS)
            even_mma = mma_of(a_bufs, b_bufs, ready, c, s, even, WHICH)
            odd_done = warpgroup_mma_wait(1, deps=[odd])  # step s - 1's (at q = 0: nothing to wait for)
            if q > 0:
                values = stage_freed(odd_values, empty, (c + s - 1) % S, stage_scales, HALF, WHICH, layout, ROWS)
                acc = promote(acc, odd_done, values, ROWS)
            odd_values = step_scales(s + 1, scales, work, ROWS)
            odd = mma_of(a_bufs, b_bufs, ready, c, s + 1, odd_done, WHICH)
            even = warpgroup_mma_wait(1, deps=[even_mma])  # step s's
            values = stage_freed(even_values, empty, (c + s) % S, stage_scales, HALF, WHICH, layout, ROWS)
            acc = promote(acc, even, values, ROWS)
        if steps % 2 == 1:  # the last step, on the even set
            s = steps - 1
            even_values = step_scales(s, scales, work, ROWS)
            even_mma = mma_of(a_bufs, b_bufs, ready, c, s, even, WHICH)
            odd_done = warpgroup_mma_wait(1, deps=[odd])
            if pairs > 0:
                values = stage_freed(odd_values, empty, (c + s - 1) % S, stage_scales, HALF, WHICH, layout, ROWS)
                acc = promote(acc, odd_done, values, ROWS)
            even = warpgroup_mma_wait(0, deps=[even_mma])
            values = stage_freed(even_values, empty, (c + s) % S, stage_scales, HALF, WHICH, layout, ROWS)
            acc = promote(acc, even, values, ROWS)
        else:
            odd_done = warpgroup_mma_wait(0, deps=[odd])
            if pairs > 0:
                values = stage_freed(odd_values, empty, (c + steps - 1) % S, stage_scales, HALF, WHICH, layout, ROWS)
                acc = promote(acc, odd_done, values, ROWS)
        return acc, (even, odd_done)

    @gluon.jit
    def program_steps(work, M, N, num_tiles, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """The K steps of all of this program's weight-gradient tiles (every num_programs-th from its
        id), from the experts' row counts: what `flat_wgrad_steps` runs over."""
        counts_ptr = work[1]
        per_expert = gl.cdiv(M, BM) * gl.cdiv(N, BN)
        experts = num_tiles // per_expert
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        LANES: gl.constexpr = 32 * gl.num_warps()
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        total = 0
        for e0 in range(0, experts, LANES):
            e = e0 + gl.arange(0, LANES, layout=lanes)
            steps = ((gl.load(counts_ptr + e, mask=e < experts, other=0) + BK - 1) // BK).to(gl.int32)
            first = e * per_expert  # the expert's tiles: [first, first + per_expert); this program's among them:
            mine = (first + per_expert - pid + programs - 1) // programs - (first - pid + programs - 1) // programs
            total += gl.sum(mine * steps, axis=0)
        return total

    @gluon.jit
    def tile_steps(t, work, M, N, num_tiles, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """`wgrad_tile`'s (expert, m0, n0, K steps) of tile t, and no steps past the last tile."""
        expert, m0, n0, steps, _ = wgrad_tile(gl.minimum(t, num_tiles - 1), work, M, N, BM, BN, BK)
        return expert, m0, n0, gl.where(t < num_tiles, steps, 0)

    @gluon.jit
    def nonempty_tile(t, acc, out_desc, c_smem, work, M, N, num_tiles, BK: gl.constexpr, WHICH: gl.constexpr):
        """(t, expert, m0, n0, K steps) of the first of this program's tiles from t on that has K steps;
        the tiles of experts without rows passed on the way are stored as zeros (acc: zeros here). Past
        the program's last tile: t >= num_tiles and no steps."""
        HALF: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        expert, m0, n0, steps = tile_steps(t, work, M, N, num_tiles, 2 * HALF, BN, BK)
        while (t < num_tiles) & (steps == 0):
            finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, (), M, N, False, False, False)
            t += gl.num_programs(0)
            expert, m0, n0, steps = tile_steps(t, work, M, N, num_tiles, 2 * HALF, BN, BK)
        return t, expert, m0, n0, steps

    @gluon.jit
    def promote_step(acc, product, g, tile, ctx, WHICH: gl.constexpr):
        """(acc, *tile) after step g: its product promoted into acc with its scales, read from its stage
        before the stage is freed; then, where g is its tile's last step (tile: t, expert, m0, n0 and that
        step's global index), the tile stored, acc zeros again and the next tile with steps taken up
        (`nonempty_tile`), all while the next step's MMA, already issued, computes. ctx: (stage_scales,
        empty, out_desc, c_smem, work, M, N, num_tiles, BK)."""
        stage_scales, empty, out_desc, c_smem, work, M, N, num_tiles, BK = ctx
        S: gl.constexpr = stage_scales[0].type.shape[0]
        HALF: gl.constexpr = acc.type.shape[0]
        layout: gl.constexpr = acc.type.layout
        values = stage_freed((), empty, g % S, stage_scales, HALF, WHICH, layout, False)
        acc = promote(acc, product, values, False)
        t, expert, m0, n0, last = tile
        if g == last:
            finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, (), M, N, False, False, False)
            acc = gl.zeros_like(acc)
            t, expert, m0, n0, steps = nonempty_tile(t + gl.num_programs(0), acc, out_desc, c_smem, work, M, N,
                                                     num_tiles, BK, WHICH)  # fmt: skip
            last += steps
        return acc, t, expert, m0, n0, last

    @gluon.jit
    def flat_wgrad_steps(acc, products, bufs, stage_scales, ready, empty, out_desc, c_smem, work, M, N, num_tiles,
                         WHICH: gl.constexpr):  # fmt: skip
        """A weight-gradient warpgroup's work as one pipelined loop over all its program's K steps, tile
        boundaries inside it: as `pipelined_steps` (step g's MMA issued before step g - 1's promotion,
        even and odd register sets), but a tile's last promotion and its store run under the next tile's
        first MMA instead of with the tensor cores idle (at deepseek-v3's two K steps a tile, the tile's
        epilogue and work were ~1.2 of its ~2.7 kilocycles: BENCHMARKS.md, f14-f15). The same products
        promoted in the same order into one accumulator a tile: the same bits."""
        a_bufs, b_bufs = bufs[0], bufs[1]
        HALF: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        ctx = (stage_scales, empty, out_desc, c_smem, work, M, N, num_tiles, BK)
        total = program_steps(work, M, N, num_tiles, 2 * HALF, BN, BK)
        t, expert, m0, n0, steps = nonempty_tile(gl.program_id(0), acc, out_desc, c_smem, work, M, N, num_tiles,
                                                 BK, WHICH)  # fmt: skip
        last = steps - 1  # the global index of the tile's last step
        even, odd_done = products
        odd = warpgroup_mma_init(odd_done)
        pairs = total // 2
        for q in range(pairs):
            g = 2 * q
            even_mma = mma_of(a_bufs, b_bufs, ready, 0, g, even, WHICH)
            odd_done = warpgroup_mma_wait(1, deps=[odd])  # step g - 1's (at q = 0: nothing to wait for)
            if q > 0:
                acc, t, expert, m0, n0, last = promote_step(acc, odd_done, g - 1, (t, expert, m0, n0, last), ctx, WHICH)
            odd = mma_of(a_bufs, b_bufs, ready, 0, g + 1, odd_done, WHICH)
            even = warpgroup_mma_wait(1, deps=[even_mma])  # step g's
            acc, t, expert, m0, n0, last = promote_step(acc, even, g, (t, expert, m0, n0, last), ctx, WHICH)
        if total % 2 == 1:  # the last step, on the even set
            g = total - 1
            even_mma = mma_of(a_bufs, b_bufs, ready, 0, g, even, WHICH)
            odd_done = warpgroup_mma_wait(1, deps=[odd])
            if pairs > 0:
                acc, t, expert, m0, n0, last = promote_step(acc, odd_done, g - 1, (t, expert, m0, n0, last), ctx, WHICH)
            even = warpgroup_mma_wait(0, deps=[even_mma])
            acc, t, expert, m0, n0, last = promote_step(acc, even, g, (t, expert, m0, n0, last), ctx, WHICH)
        else:
            odd_done = warpgroup_mma_wait(0, deps=[odd])
            if pairs > 0:
                acc, t, expert, m0, n0, last = promote_step(acc, odd_done, total - 1, (t, expert, m0, n0, last), ctx,
                                                            WHICH)  # fmt: skip
        return acc, (even, odd_done)

    @gluon.jit
    def half_multiplier(out_desc, work, epilogue, M, N, num_tiles, bufs, bars, c_smem, ROWS: gl.constexpr,
                        BIAS: gl.constexpr, ROUTING: gl.constexpr, WHICH: gl.constexpr,
                        FLAT: gl.constexpr):  # fmt: skip
        """One MMA warpgroup: half WHICH (rows WHICH * 64 ...) of every tile of this program, tile by tile
        (`tile_by_tile`: the row GEMMs, and the weight gradients unless FLAT) or, for the weight gradients
        with FLAT, all the program's K steps in one loop (`flat_wgrad_steps`)."""
        ready, empty = bars[0], bars[1]
        HALF: gl.constexpr = c_smem.type.shape[0]
        BN: gl.constexpr = c_smem.type.shape[1]
        BM: gl.constexpr = 2 * HALF
        S: gl.constexpr = bufs[0].type.shape[0]
        if ROWS:
            stage_scales = ()
        else:  # the stages' scales as rows of 128 (their [1, 128] TMA blocks are unswizzled)
            flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # a stage's; the ring one more rank
            stage_scales = (bufs[2]._reinterpret(gl.float32, [S, BM], flat),
                            bufs[3]._reinterpret(gl.float32, [S, BN], flat))  # fmt: skip
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 32])  # fmt: skip
        # the two sets of product registers: first values of their own, not acc's zeros (the MMAs
        # overwrite them: use_acc=False)
        products = (gl.full((HALF, BN), 1.0, gl.float32, layout=acc_layout),
                    gl.full((HALF, BN), 2.0, gl.float32, layout=acc_layout))  # fmt: skip
        if FLAT:  # the weight gradients: all the program's steps in one loop
            acc = gl.zeros((HALF, BN), dtype=gl.float32, layout=acc_layout)
            # once, in a loop the compiler cannot count: product registers that die at the end of straight-line
            # code had ptxas serialise every wgmma (C7515); carried around a loop, they do not
            for _once in range(gl.program_id(0) // gl.num_programs(0) + 1):
                acc, products = flat_wgrad_steps(acc, products, bufs, stage_scales, ready, empty, out_desc, c_smem,
                                                 work, M, N, num_tiles, WHICH)  # fmt: skip
        else:
            tile_by_tile(products, bufs, stage_scales, bars, out_desc, c_smem, work, epilogue, M, N, num_tiles, ROWS,
                         BIAS, ROUTING, WHICH)  # fmt: skip
        tma.store_wait(0)

    @gluon.jit
    def tile_by_tile(products, bufs, stage_scales, bars, out_desc, c_smem, work, epilogue, M, N, num_tiles,
                     ROWS: gl.constexpr, BIAS: gl.constexpr, ROUTING: gl.constexpr, WHICH: gl.constexpr):  # fmt: skip
        """A warpgroup's tiles one at a time: each tile's K steps by `pipelined_steps`, then out by
        `finish_half`. (The next tile's work loaded under this tile's steps was slower on an H100 at one K
        step a tile, 5.7 -> 7.2 ms, and no faster at more: ptxas moves the loaded scalars to uniform
        registers at once, R2UR, which waits for the load.)"""
        ready, empty = bars[0], bars[1]
        HALF: gl.constexpr = c_smem.type.shape[0]
        BN: gl.constexpr = c_smem.type.shape[1]
        BM: gl.constexpr = 2 * HALF
        BK: gl.constexpr = bufs[0].type.shape[2]
        acc_layout: gl.constexpr = products[0].type.layout
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0, steps, first_row = tile_work(t, work, M, N, BM, BN, BK, ROWS)
            acc = gl.zeros((HALF, BN), dtype=gl.float32, layout=acc_layout)
            scales = tile_scales(acc, expert, m0 + WHICH * HALF, n0, first_row, work, M, N, ROWS)
            acc, products = pipelined_steps(acc, products, bufs, stage_scales, ready, empty, c, steps, scales, work,
                                            WHICH, ROWS)  # fmt: skip
            finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, epilogue, M, N, ROWS, BIAS, ROUTING)
            c += steps

    @gluon.jit
    def stages_of(desc, STAGES: gl.constexpr):
        """A ring of STAGES shared-memory buffers for `desc`'s blocks."""
        return gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)

    @gluon.jit
    def stage_barriers(STAGES: gl.constexpr):
        """The ring's ready (loaded: the loader's expected bytes) and empty (consumed) barriers; a stage
        is freed once both MMA warpgroups have read it."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        return ready, empty

    @gluon.jit
    def kernel_body(
        a0_desc, a1_desc, b0_desc, b1_desc, out_desc, work, epilogue, M, N, num_tiles, ROWS: gl.constexpr,
        BIAS: gl.constexpr, ROUTING: gl.constexpr, C_LAYOUT: gl.constexpr, STAGES: gl.constexpr,
        LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr, FLAT: gl.constexpr = False,
    ):  # fmt: skip
        # a1_desc, b1_desc: fc1's second halves (row GEMMs), or both operands' scales (weight gradients)
        if ROWS:
            bufs = (stages_of(a0_desc, STAGES), stages_of(b0_desc, STAGES))
        else:
            bufs = (stages_of(a0_desc, STAGES), stages_of(b0_desc, STAGES), stages_of(a1_desc, STAGES),
                    stages_of(b1_desc, STAGES))  # fmt: skip
        ready, empty = stage_barriers(STAGES)
        c0_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        c1_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        bars = (ready, empty)
        gl.warp_specialize(
            [
                (
                    half_multiplier,
                    (out_desc, work, epilogue, M, N, num_tiles, bufs, bars, c0_smem, ROWS, BIAS, ROUTING, 0, FLAT),
                ),
                (
                    half_multiplier,
                    (out_desc, work, epilogue, M, N, num_tiles, bufs, bars, c1_smem, ROWS, BIAS, ROUTING, 1, FLAT),
                ),
                (loader, ((a0_desc, a1_desc), (b0_desc, b1_desc), work, M, N, num_tiles, bufs, bars, ROWS)),
            ],
            [4, LOADER_WARPS],  # the second MMA warpgroup, the loader
            [MMA_REGS, LOADER_REGS],
        )

    # One launchable kernel per kind, so that a profile names what ran (the same body).

    @gluon.jit
    def _fp8_wgrad_hopper_kernel(a0_desc, a1_desc, b0_desc, b1_desc, out_desc, work, epilogue, M, N, num_tiles,
                                 BIAS: gl.constexpr, ROUTING: gl.constexpr, C_LAYOUT: gl.constexpr,
                                 STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
                                 MMA_REGS: gl.constexpr, FLAT: gl.constexpr):  # fmt: skip
        kernel_body(a0_desc, a1_desc, b0_desc, b1_desc, out_desc, work, epilogue, M, N, num_tiles, False, BIAS,
                    ROUTING, C_LAYOUT, STAGES, LOADER_WARPS, LOADER_REGS, MMA_REGS, FLAT)  # fmt: skip

    @gluon.jit
    def _fp8_rows_hopper_kernel(a0_desc, a1_desc, b0_desc, b1_desc, out_desc, work, epilogue, M, N, num_tiles,
                                BIAS: gl.constexpr, ROUTING: gl.constexpr, C_LAYOUT: gl.constexpr,
                                STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
                                MMA_REGS: gl.constexpr):  # fmt: skip
        kernel_body(a0_desc, a1_desc, b0_desc, b1_desc, out_desc, work, epilogue, M, N, num_tiles, True, BIAS,
                    ROUTING, C_LAYOUT, STAGES, LOADER_WARPS, LOADER_REGS, MMA_REGS)  # fmt: skip

    GL_DTYPES = {
        torch.float8_e4m3fn: gl.float8e4nv,
        torch.float8_e5m2: gl.float8e5,
        torch.bfloat16: gl.bfloat16,
        torch.float16: gl.float16,
        torch.float32: gl.float32,
    }


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA shared layout of a TMA block of this torch dtype (cached: these were host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


def flat_loop(rows: int, experts: int) -> bool:
    """Whether the weight gradients over `rows` schedule rows (R_pad) and `experts` experts take the flat
    loop: FLAT_WGRAD where set, else at most FLAT_MAX_ROWS rows an expert on average. Both loops give
    the same bits (tests/test_fp8_hopper.py), so ranks that choose differently still agree."""
    if FLAT_WGRAD is not None:
        return FLAT_WGRAD
    return rows <= FLAT_MAX_ROWS * experts


def kernel_arguments(out_dtype: torch.dtype, rows: bool, bias: bool = False, routing: bool = False,
                     flat: bool = False) -> tuple[object, dict]:  # fmt: skip
    """(the Gluon kernel, its constexprs) for this output dtype and kind (row GEMM or weight gradient;
    fc2's epilogue's parts; the weight gradients' loop, flat or tile by tile): what the launchers pass,
    and what `mok bench inspect` compiles for sm_90 without a GPU."""
    constexprs = {
        "BIAS": bias,
        "ROUTING": routing,
        "C_LAYOUT": shared_layout((HALF_M, BLOCK_N), out_dtype),
        "STAGES": stages_for(out_dtype, rows),
        "LOADER_WARPS": LOADER_WARPS,
        "LOADER_REGS": LOADER_REGS,
        "MMA_REGS": MMA_REGS if rows else WGRAD_MMA_REGS,
    }
    if not rows:
        constexprs["FLAT"] = flat
    return (_fp8_rows_hopper_kernel if rows else _fp8_wgrad_hopper_kernel), constexprs


def _descriptor(t: torch.Tensor, block: tuple[int, ...]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), shared_layout(block, t.dtype))


def _launch(a: tuple, b: tuple, out: torch.Tensor, work: tuple, epilogue: tuple, M: int, N: int, num_tiles: int,
            rows: bool, bias: bool = False, routing: bool = False, scales: tuple = (),
            flat: bool = False) -> None:  # fmt: skip
    """One persistent launch over num_tiles tiles: a and b the one or two (fc1's halves) 2-D operand
    views, out the 3-D output (dW [E, M, N], or the rows as [1, R, N]); the weight gradients' scales
    (A's, B's) in the second halves' places, each step's row of them a [1, 128] block, and their loop."""
    if num_tiles == 0:
        return
    a_descs = [_descriptor(t, (BLOCK_M, BLOCK_K)) for t in a]
    b_descs = [_descriptor(t, (BLOCK_N, BLOCK_K)) for t in b]
    if scales:
        a_descs.append(_descriptor(scales[0], (1, BLOCK_M)))
        b_descs.append(_descriptor(scales[1], (1, BLOCK_N)))
    kernel, constexprs = kernel_arguments(out.dtype, rows, bias, routing, flat)
    grid = (min(num_tiles, PROGRAMS or sm_count(out.device.index)),)
    kernel[grid](
        a_descs[0], a_descs[-1], b_descs[0], b_descs[-1], _descriptor(out, (1, HALF_M, BLOCK_N)), work, epilogue,
        M, N, num_tiles, num_warps=4, maxnreg=MAX_REGS, **constexprs,
    )  # fmt: skip


def fp8_wgrad_hopper(
    left_t: torch.Tensor, left_scale_inv: torch.Tensor, right_t: torch.Tensor, right_scale_inv: torch.Tensor,
    d_w: torch.Tensor, expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor,
) -> None:  # fmt: skip
    """d_w [E, M, N] (contiguous) = `fp8_mlp.fp8_wgrad`'s sums from the same operands (left_t [M, R_pad],
    right_t [N, R_pad], scales [R_pad / 128, M] and [R_pad / 128, N], expert offsets multiples of 128).
    Call only where `usable((left_t, right_t), d_w.flatten(0, 1), scales=(left_scale_inv, right_scale_inv))`."""
    E, M, N = d_w.shape
    _launch((left_t,), (right_t,), d_w, (expert_offsets, tokens_per_expert), (), M, N,
            E * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), rows=False, scales=(left_scale_inv, right_scale_inv),
            flat=flat_loop(left_t.shape[1], E))  # fmt: skip


def fp8_rows_hopper(
    a_halves: tuple[torch.Tensor, ...], a_scale_inv: torch.Tensor, b_halves: tuple[torch.Tensor, ...],
    b_scale_inv: torch.Tensor, out: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int,
    down_bias: torch.Tensor | None = None, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:  # fmt: skip
    """out [R_pad, N] = for each row r of expert e (tile_to_expert per tile_m rows), the sum over halves
    h, then K blocks kb, of a_halves[h][r, kb] . B_h[e, :, kb]^T, scaled by a_scale_inv[r, h, kb] and
    b_scale_inv[e, h, n // 128, kb]: `fp8_mlp.fp8_down_fwd`'s sums (one half: A_q [R_pad, I] and W2_q)
    and `fp8_gate_up_dgrad`'s (fc1's two halves of dh_q and of W13's transposed copy), from
    `row_gemm_operands`. a_scale_inv [R_pad, halves, K blocks] and b_scale_inv [E, halves, N blocks, K
    blocks] (either may lack the halves' dimension). With down_bias (b2 [E, N]) and routing
    (topk_weights [T, K] fp32, row_to_tk), fc2's epilogue: (acc + b2[e]) * topk_weights[row_to_tk[r]].
    Padding tiles are left as they are; padding rows inside a tile get values of no meaning. Call only
    where `usable(a_halves + b_halves, out, tile_m)`."""
    R, N = out.shape
    if R == 0 or N == 0:
        return
    halves, k_steps = len(a_halves), cdiv(a_halves[0].shape[1], BLOCK_K)
    a_s = a_scale_inv.reshape(R, halves, -1)
    b_s = b_scale_inv.reshape(b_scale_inv.shape[0], halves, *b_scale_inv.shape[-2:])
    work = (tile_to_expert, k_steps, halves, tile_m, a_s, a_s.stride(0), a_s.stride(1), b_s, b_s.stride(0),
            b_s.stride(1), b_s.stride(2))  # fmt: skip
    topk, row_to_tk = routing if routing is not None else (out, out)  # not read without the epilogue
    epilogue = (down_bias if down_bias is not None else out, 0 if down_bias is None else down_bias.stride(0), topk,
                row_to_tk)  # fmt: skip
    _launch(a_halves, b_halves, out.unsqueeze(0), work, epilogue, R, N, R // BLOCK_M * cdiv(N, BLOCK_N), rows=True,
            bias=down_bias is not None, routing=routing is not None)  # fmt: skip
