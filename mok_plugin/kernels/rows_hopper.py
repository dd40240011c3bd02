"""fc2's forward and fc1's dgrad on Hopper as a warp-specialised, persistent Gluon kernel (v47).

out[r] = A[r] @ B_e for the rows r of expert e, both operands read whole by TMA: A the rows in
schedule order ([R_pad, K]: fc2's forward reads the activation A, fc1's dgrad reads dh), B the
expert's weight flattened to 2-D (W2 [E * H, I], K-major; W13 [E * N1, H], N-major). The gathered-row
GEMMs (fc1's forward, fc2's dgrad: rows of x and dO by token) stay on Triton: TMA cannot gather rows
on Hopper.

Why: these GEMMs are short in K at the named shapes (qwen3-30b-a3b's fc2: I = 768, 12 K steps a
tile), and Triton 3.6 neither warp-specialises nor overlaps a tile's epilogue with the next tile on
Hopper: its row GEMMs ran at 474-589 TFLOP/s against a dense GEMM of ~690 on an H100 (session 54).
Here, as `wgrad_hopper` does for the weight gradients (its ring, accumulate, store and schedules): one
loader warp streams both operands through TMA into a ring of stages, running ahead across tiles, and
the MMA warpgroups hand each finished tile to an asynchronous TMA store; under the ping-pong schedule
one warpgroup's epilogue runs under the other's MMAs.

Determinism: each output tile has one owner that sums K in ascending BLOCK_K steps into one fp32
accumulator, then applies fc2's epilogue with the Triton kernel's expressions (`tiles.down_tile`:
`+ b2[e]`, `* topk_weights[row_to_tk[r]]`), so the result is meant to be bitwise the Triton
kernels' (tests/test_gpu_rows_hopper.py checks it on the GPU). Past K's end both operands' TMA blocks
are zero-filled (A's columns; or B's rows belong to the next expert, multiplied by A's zeros), as in
the Triton kernels' TMA path. Padding rows inside a tile are stored, which the Triton kernels leave
(nothing reads them): zeros with fc2's epilogue, and in fc1's dgrad what dh's padding rows give
(down_dgrad writes zeros there); row blocks of padding (tile_to_expert < 0) are neither computed nor
stored.

Off: `grouped_mlp.HOPPER_ROW_GEMMS` names the GEMMs that take it, where `usable`. On an H100 (sessions
55 and 57, BENCHMARKS.md "v47"): bitwise the Triton kernels in every test and A/B. Under the
cooperative schedule qwen3-30b-a3b's two GEMMs take 10-12 % less than Triton's and its forward +
backward 2.0 % less (2.4 % under graphs), olmoe's 1.3 %; on the shapes with wider outputs (N = H of
2880 to 7168) the two GEMMs take 5-26 % more, and at T = 1 its launch's host path costs 0.7 ms a
step. Those losses were the tile order (v48, session 58, `mok bench rows` on an H100): in the Triton
kernels' grouped order (GROUP_M) both GEMMs together take 4-7 % less than Triton's on deepseek-v3's,
qwen3-30b-a3b's and gpt-oss-120b's dimensions and 1 % more on mixtral-8x7b's, bitwise; at the layer
not yet timed beyond two eager A/Bs within their noise (kernels' sums -3.8 % and -1.6 %). Ping-pong
lost: 2.41 ms there, and 30 % / 88 % over Triton on deepseek-v3's dimensions and gpt-oss-120b, whose
32-45 K steps a tile leave one warpgroup's MMAs waiting on the other's turn (it pays only where tiles
are a few steps, as the weight gradients' are). A first version of fc2's forward alone (8ea86d9,
never merged) was 4-8 % faster than Triton on three shapes (BENCHMARKS.md, "the Gluon row GEMMs").
Since v49 (session 59, not yet timed) it launches through `launch.launch`'s direct path, and the layer
takes it only where its tiles fill a wave of the SMs (`grouped_mlp.HOPPER_ROW_MIN_WAVES`).
"""

from __future__ import annotations

import torch

from mok_plugin.kernels.launch import cdiv, launch, sm_count
from mok_plugin.kernels.wgrad_hopper import (
    BLOCK_K,
    BLOCK_M,
    LOADER_REGS,
    LOADER_WARPS,
    MAX_REGS,
    PINGPONG_MMA_REGS,
    SCHEDULES,
    _layout,
    gl_element,
    gluon,
    gluon_descriptor,
    tma_rows,
)

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from mok_plugin.kernels.wgrad_hopper import accumulate, pingpong_state, ring, store_tile

__all__ = ["SCHEDULE", "row_gemm_hopper", "tile_count", "usable"]

SCHEDULE = "cooperative"  # one of wgrad_hopper.SCHEDULES (ping-pong: see the module docstring)
# The tile order: 8 row blocks sweep the columns together, the Triton row GEMMs' order (their GROUP_M);
# 1, column blocks fastest, which v47 had (0 in session 58's runs): on an H100 (session 58, `mok bench
# rows`) fc1's dgrad took 12.03 ms in that order against 8.17 in this one on deepseek-v3's dimensions
# (Triton's 8.75), 4.78 against 3.93 on gpt-oss-120b's (Triton's 4.26).
GROUP_M = 8


def usable(rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, tile_m: int, b_k_major: bool) -> bool:
    """Whether the kernel takes this GEMM: rows [R_pad, K] and out [R_pad, N] TMA can read and write,
    weights [E, N, K] (b_k_major) or [E, K, N] contiguous (read flattened to 2-D, an expert every N or
    K rows: the sizes must agree), the schedule's row blocks whole tiles."""
    n, k = weights.shape[1:] if b_k_major else weights.shape[:0:-1]
    sizes_agree = rows.shape[0] == out.shape[0] and rows.shape[1] == k and out.shape[1] == n
    return (
        sizes_agree and weights.is_contiguous() and tile_m % BLOCK_M == 0
        and tma_rows(rows, weights.flatten(0, 1), out)
    )  # fmt: skip


def tile_count(num_rows: int, n: int, schedule: str | None = None) -> int:
    """The output tiles of a launch over num_rows rows (R_pad: row blocks of padding included) and n
    columns under `schedule` (default SCHEDULE)."""
    return num_rows // BLOCK_M * cdiv(n, SCHEDULES[schedule or SCHEDULE].block_n)


if gluon is not None:

    @gluon.jit
    def row_tile(t, tile_to_expert_ptr, N, tile_m, num_tiles, BM: gl.constexpr, BN: gl.constexpr,
                 GROUP_M: gl.constexpr):  # fmt: skip
        """(expert, m0, n0) of row tile t; expert < 0: a row block of padding. GROUP_M row blocks sweep the
        columns together (`tiles.grouped_pid`, the Triton kernels' order); GROUP_M 1 walks column blocks
        fastest, v47's order."""
        tiles_n = gl.cdiv(N, BN)
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        group_size = gl.minimum(num_tiles // tiles_n - first_m, GROUP_M)
        pid_m = first_m + (t % per_group) % group_size
        pid_n = (t % per_group) // group_size
        m0 = pid_m * BM
        expert = gl.load(tile_to_expert_ptr + m0 // tile_m).to(gl.int32)
        return expert, m0, pid_n * BN

    @gluon.jit
    def rows_loader(a_desc, b_desc, tile_to_expert_ptr, N, K, tile_m, num_tiles, bufs, bars, BN: gl.constexpr,
                    B_K_MAJOR: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
        """Every K step of this program's tiles into the ring: A at (m0, k), B at (e * N + n0, k)
        (K-major) or (e * K + k, n0) (N-major); a block past N or K reads the next expert's rows,
        which the store clips or A's zero-filled columns cancel."""
        a_bufs, b_bufs = bufs
        ready, empty = bars[0], bars[1]
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        S: gl.constexpr = a_bufs.type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        k_steps = gl.cdiv(K, BK)
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = row_tile(t, tile_to_expert_ptr, N, tile_m, num_tiles, BM, BN, GROUP_M)
            steps = gl.where(expert >= 0, k_steps, 0)
            for s in range(steps):
                idx = p % S
                mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once
                mbarrier.expect(ready.index(idx), nbytes)
                k = s * BK
                tma.async_copy_global_to_shared(a_desc, [m0, k], ready.index(idx), a_bufs.index(idx))
                if B_K_MAJOR:
                    tma.async_copy_global_to_shared(b_desc, [expert * N + n0, k], ready.index(idx), b_bufs.index(idx))
                else:
                    tma.async_copy_global_to_shared(b_desc, [expert * K + k, n0], ready.index(idx), b_bufs.index(idx))
                p += 1

    @gluon.jit
    def finish_tile(out_desc, c_smem, acc, expert, m0, n0, epilogue, M, N, BIAS: gl.constexpr,
                    ROUTING: gl.constexpr):  # fmt: skip
        """fc2's epilogue where asked, as `tiles.down_tile` computes it (`acc += b2[e]`, then `acc *
        w_r`; padding rows, row_to_tk < 0, to zeros), then out by an asynchronous TMA store that
        clips at R and N."""
        num_warps: gl.constexpr = gl.num_warps()
        compact: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        layout: gl.constexpr = acc.type.layout
        if BIAS:
            bias_ptr, stride_bias_e = epilogue[0], epilogue[1]
            ns = n0 + gl.arange(0, acc.type.shape[1], layout=compact)
            b2 = gl.load(bias_ptr + expert * stride_bias_e + ns, mask=ns < N, other=0.0)
            acc += gl.convert_layout(b2, gl.SliceLayout(0, layout)).to(gl.float32)[None, :]
        if ROUTING:
            topk_weights_ptr, row_to_tk_ptr = epilogue[2], epilogue[3]
            ms = m0 + gl.arange(0, acc.type.shape[0], layout=compact)
            tk = gl.load(row_to_tk_ptr + ms, mask=ms < M, other=-1)
            w = gl.convert_layout(gl.load(topk_weights_ptr + tk, mask=tk >= 0, other=0.0), gl.SliceLayout(1, layout))
            routed = gl.convert_layout(tk.to(gl.int32), gl.SliceLayout(1, layout)) >= 0
            acc = gl.where(routed[:, None], acc * w[:, None], 0.0)
        store_tile(out_desc, c_smem, acc, expert * 0, m0, n0)  # out_desc: the rows as [1, R, N]

    @gluon.jit
    def rows_multiplier(out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, bufs, bars, c_smem,
                        B_K_MAJOR: gl.constexpr, BIAS: gl.constexpr, ROUTING: gl.constexpr, GROUP_M: gl.constexpr,
                        num_warps: gl.constexpr):  # fmt: skip
        """The cooperative schedule: all MMA warps on each tile's accumulator."""
        BM: gl.constexpr = out_desc.block_type.shape[1]  # out_desc: [1, R, N] in [1, BM, BN] blocks
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = bufs[0].type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        k_steps = gl.cdiv(K, BK)
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = row_tile(t, tile_to_expert_ptr, N, tile_m, num_tiles, BM, BN, GROUP_M)
            if expert >= 0:
                acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
                acc = accumulate(acc, bufs, bars, c, k_steps, True, B_K_MAJOR)
                finish_tile(out_desc, c_smem, acc, expert, m0, n0, epilogue, M, N, BIAS, ROUTING)
                c += k_steps
        tma.store_wait(0)

    @gluon.jit
    def rows_pingpong_multiplier(out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, bufs, bars, c_smem,
                                 B_K_MAJOR: gl.constexpr, BIAS: gl.constexpr, ROUTING: gl.constexpr,
                                 GROUP_M: gl.constexpr, WHICH: gl.constexpr):  # fmt: skip
        """The ping-pong schedule: one of two MMA warpgroups taking this program's non-padding tiles in
        turn (wgrad_hopper.pingpong_multiplier: main loops taking turns on the `turn` barriers, since
        a stage's ready barrier is waited on by parity)."""
        turn = bars[2]
        BM: gl.constexpr = out_desc.block_type.shape[1]
        BN: gl.constexpr = out_desc.block_type.shape[2]
        BK: gl.constexpr = bufs[0].type.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])  # fmt: skip
        k_steps = gl.cdiv(K, BK)
        c = 0
        i = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0 = row_tile(t, tile_to_expert_ptr, N, tile_m, num_tiles, BM, BN, GROUP_M)
            if expert >= 0:
                if i % 2 == WHICH:
                    k = i // 2
                    mbarrier.wait(turn.index(WHICH), (k & 1) ^ (1 - WHICH))
                    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
                    acc = accumulate(acc, bufs, bars, c, k_steps, True, B_K_MAJOR)
                    mbarrier.arrive(turn.index(1 - WHICH), count=1)  # the other's main loop may start
                    finish_tile(out_desc, c_smem, acc, expert, m0, n0, epilogue, M, N, BIAS, ROUTING)
                c += k_steps
                i += 1
        tma.store_wait(0)

    @gluon.jit
    def _rows_kernel(
        a_desc, b_desc, out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, B_K_MAJOR: gl.constexpr,
        BIAS: gl.constexpr, ROUTING: gl.constexpr, GROUP_M: gl.constexpr, C_LAYOUT: gl.constexpr,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        BN: gl.constexpr = out_desc.block_type.shape[2]
        bufs, bars = ring(a_desc, b_desc, STAGES)  # wgrad_hopper's: descriptors' blocks
        c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape[1:], C_LAYOUT)
        gl.warp_specialize(
            [
                (rows_multiplier, (out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, bufs, bars,
                                   c_smem, B_K_MAJOR, BIAS, ROUTING, GROUP_M, num_warps)),
                (rows_loader, (a_desc, b_desc, tile_to_expert_ptr, N, K, tile_m, num_tiles, bufs, bars, BN,
                               B_K_MAJOR, GROUP_M)),
            ],  # fmt: skip
            [LOADER_WARPS],
            [LOADER_REGS],
        )

    @gluon.jit
    def _rows_pingpong_kernel(
        a_desc, b_desc, out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, B_K_MAJOR: gl.constexpr,
        BIAS: gl.constexpr, ROUTING: gl.constexpr, GROUP_M: gl.constexpr, C_LAYOUT: gl.constexpr,
        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
    ):  # fmt: skip
        BN: gl.constexpr = out_desc.block_type.shape[2]
        bufs, bars = ring(a_desc, b_desc, STAGES)  # wgrad_hopper's: descriptors' blocks
        c0_smem, c1_smem, turns = pingpong_state(out_desc, bars, C_LAYOUT)
        gl.warp_specialize(
            [
                (rows_pingpong_multiplier, (out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, bufs,
                                            turns, c0_smem, B_K_MAJOR, BIAS, ROUTING, GROUP_M, 0)),
                (rows_pingpong_multiplier, (out_desc, tile_to_expert_ptr, epilogue, M, N, K, tile_m, num_tiles, bufs,
                                            turns, c1_smem, B_K_MAJOR, BIAS, ROUTING, GROUP_M, 1)),
                (rows_loader, (a_desc, b_desc, tile_to_expert_ptr, N, K, tile_m, num_tiles, bufs, bars, BN,
                               B_K_MAJOR, GROUP_M)),
            ],  # fmt: skip
            [4, LOADER_WARPS],  # the second MMA warpgroup, the loader
            [MMA_REGS, LOADER_REGS],
        )


def kernel_arguments(dtype: torch.dtype, schedule: str, b_k_major: bool, bias: bool, routing: bool) -> tuple:
    """(the Gluon kernel, its constexprs, the schedule's plan) for this operand dtype, schedule and
    epilogue: what `row_gemm_hopper` launches and what `mok bench inspect` compiles without a GPU."""
    plan = SCHEDULES[schedule]
    element = gl_element(dtype)
    constexprs = dict(B_K_MAJOR=b_k_major, BIAS=bias, ROUTING=routing, GROUP_M=GROUP_M, STAGES=plan.stages,
                      C_LAYOUT=_layout((BLOCK_M, plan.block_n), element), LOADER_WARPS=LOADER_WARPS,
                      LOADER_REGS=LOADER_REGS)  # fmt: skip
    if plan.pingpong:
        return _rows_pingpong_kernel, constexprs | {"MMA_REGS": PINGPONG_MMA_REGS}, plan
    return _rows_kernel, constexprs, plan


def row_gemm_hopper(
    rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, *,
    b_k_major: bool, down_bias: torch.Tensor | None = None, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    schedule: str | None = None,
) -> None:  # fmt: skip
    """out [R_pad, N] = rows[r] @ B_e for the rows r of expert e (tile_to_expert per tile_m rows):
    weights [E, N, K] read as B_e^T (b_k_major: W2) or [E, K, N] as B_e (W13); with down_bias (b2
    [E, N]) and routing (topk_weights fp32, row_to_tk), fc2's epilogue (acc + b2[e]) * w_r. Row blocks
    of padding are left as they are; padding rows in a tile are stored (zeros with routing). Call only
    where `usable`."""
    R, N = out.shape
    K = rows.shape[1]
    if R == 0 or N == 0:
        return
    kernel, constexprs, plan = kernel_arguments(rows.dtype, schedule or SCHEDULE, b_k_major, down_bias is not None,
                                                routing is not None)  # fmt: skip
    flat = weights.flatten(0, 1)
    b_block = (plan.block_n, BLOCK_K) if b_k_major else (BLOCK_K, plan.block_n)
    topk, row_to_tk = routing if routing is not None else (out, out)  # not read without the epilogue
    epilogue = (down_bias if down_bias is not None else out, 0 if down_bias is None else down_bias.stride(0), topk,
                row_to_tk)  # fmt: skip
    num_tiles = tile_count(R, N, schedule)
    grid = (min(num_tiles, sm_count(out.device.index)),)
    launch(
        kernel, grid, gluon_descriptor(rows, (BLOCK_M, BLOCK_K)), gluon_descriptor(flat, b_block),
        gluon_descriptor(out.unsqueeze(0), (1, BLOCK_M, plan.block_n)),
        tile_to_expert, epilogue, R, N, K, tile_m, num_tiles, num_warps=plan.num_warps, maxnreg=MAX_REGS,
        **constexprs,
    )  # fmt: skip
