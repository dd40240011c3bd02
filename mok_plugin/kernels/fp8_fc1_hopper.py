"""fc1's blockwise-FP8 forward on Hopper as a warp-specialised, persistent Gluon kernel (issue 25): the
third GEMM of `fp8_hopper.py`'s family, with `fp8_mlp._fp8_gate_up_fwd_kernel`'s epilogue.

For each row r of expert e and each 128-wide block n of fc1's I columns: gate = the sum over H's K
blocks of x_q[r] . W13_q[e, n] scaled by x's and the gate weights' scales (+ b1), likewise up from
W13_q[e, I + n] with the up half's own scales; h = (gate, up) stored in the params dtype; A =
act(h as stored) quantised 1 x 128 in registers (its columns are one block), stored as FP8 with its
scales. The same sums, order and expressions as the Triton kernel (its activation and quantisation
functions are imported, `gluon.jit` over their source, as Gluon imports Triton's own), so meant to
be bitwise it, which the GPU tests check.

x_q's rows are gathered by token, which Hopper's TMA cannot do, so the launcher first copies them
into row order (R_pad x H bytes: ~0.1 ms on qwen3-30b-a3b, ~0.03 ms on mixtral-8x7b, transient).
Then as in `fp8_hopper.py`: a TMA loader warp fills a ring of stages (x's 128 rows, and the gate's
and up's 128 weight rows, 48 KiB), two MMA warpgroups in partitions of their own each take 64 rows of
every tile, and per K step run the gate's MMA, promote it, the up's, promote it, free the stage. The
epilogue stores h's gate and up halves and A_q through TMA (clipped at I) and A's scales directly.

With fp8_hopper.py's row GEMMs (`MOK_HOPPER_FP8_ROWS`, on by default on Hopper) where fc1's forward is
not split (`SPLIT_SETTING`, below: on by default, and chosen when I is a multiple of 128). On the H200
(2026-12-05) bitwise the Triton kernel; the split form was faster on every shape timed (BENCHMARKS.md, f6).
"""

from __future__ import annotations

import torch

from mok_plugin.kernels import fp8_hopper
from mok_plugin.kernels.fp8 import quantize_block
from mok_plugin.kernels.fp8_hopper import BLOCK_K, BLOCK_M, BLOCK_N, HALF_M, SHARED_BYTES, gluon
from mok_plugin.kernels.launch import cdiv, sm_count
from mok_plugin.kernels.tiles import expert_activation

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

    from mok_plugin.kernels.fp8_hopper import rows_tile, spread, stage_barriers, stages_of
    from mok_plugin.kernels.wgrad_hopper import store_tile

__all__ = ["SPLIT_SETTING", "fp8_fc1_hopper", "gathered_rows", "stages_for", "usable"]

# With the row GEMMs on: 1 (the default) computes fc1's forward as fp8_hopper's row GEMM over all N1
# columns and A from h apart (fp8_mlp._fp8_activation_kernel) instead of this kernel, whose main loop
# spills; 0 this kernel. `mok bench fp8 --hopper` on the H200 (4aaa485), forward + backward with the
# weights kept: split 7.59 / 24.60 / 33.73 ms against fused 7.92 / 25.42 / 34.90 (qwen3-30b-a3b,
# mixtral-8x7b, deepseek-v3)
SPLIT_SETTING = "MOK_HOPPER_FP8_FC1_SPLIT"

# Each MMA warpgroup holds the gate's and the up's sums and the MMA's product (3 x 64 registers a
# thread): at 232 registers, as fp8_hopper's kernels, the main loop spilled 144 bytes a thread (sm_90
# compile, Triton 3.6), at 240 (2 x 240 + 24 of the 3 x 168) 96.
MMA_REGS = 240


def stages_for(out_dtype: torch.dtype, gated: bool) -> int:
    """The ring's depth beside the two warpgroups' output buffers (h's half in out_dtype and A_q's in
    FP8, 64 x 128 each), at most 6: a stage holds x's 128 rows and the gate's (and the up's) 128
    weight rows, 1 B an element."""
    stage = (BLOCK_M + (1 + gated) * BLOCK_N) * BLOCK_K
    outputs = 2 * HALF_M * BLOCK_N * (out_dtype.itemsize + 1)
    return min(6, (SHARED_BYTES - 4096 - outputs) // stage)  # 4 KiB: barriers and layout scratch


def usable(x_rows: torch.Tensor, w13_rows: torch.Tensor, h_halves: tuple, a_q: torch.Tensor, tile_m: int,
           activation: str) -> bool:  # fmt: skip
    """Whether this kernel can compute fc1's forward here: fp8_hopper's conditions on the operands and
    outputs (2-D views TMA reads and writes; a_q as an FP8 output), h in bf16 or fp16 (an fp32 h's
    buffers do not fit beside three stages), and an activation Gluon can import (not the linear
    expert's identity, whose derivative is a `tl.full`)."""
    if activation == "identity" or h_halves[0].dtype not in (torch.bfloat16, torch.float16):
        return False
    return fp8_hopper.usable((x_rows, w13_rows, a_q), h_halves[0], tile_m) and all(
        fp8_hopper.usable((x_rows,), h, tile_m) for h in h_halves[1:]
    )


def gathered_rows(x_q: torch.Tensor, x_scale_inv: torch.Tensor, row_to_token: torch.Tensor):
    """(x_q's rows, their scales) in the schedule's row order; a padding row takes token 0's (what it
    yields is never read: downstream, padding rows are masked, or only feed other padding rows)."""
    tokens = row_to_token.clamp(min=0)
    rows = x_q.view(torch.uint8).index_select(0, tokens).view(x_q.dtype)
    return rows, x_scale_inv.index_select(0, tokens)


if gluon is not None:
    g_expert_activation = gluon.jit(expert_activation.fn)
    g_quantize_block = gluon.jit(quantize_block.fn)

    @gluon.jit
    def fc1_loader(x_desc, w_desc, work, I, N1, M, num_tiles, bufs, bars, GATED: gl.constexpr):
        """Each K step's x rows at (m0, k) and the weight rows of the gate (expert * N1 + n0) and of the
        up (expert * N1 + I + n0), from W13_q flattened [E * N1, H], into the ring. A gate block past I
        reads up rows, an up block past N1 the next expert's: columns the stores clip."""
        x_bufs, g_bufs, u_bufs = bufs
        ready, empty = bars[0], bars[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        S: gl.constexpr = x_bufs.type.shape[0]
        nbytes: gl.constexpr = x_desc.block_type.nbytes + (1 + GATED) * w_desc.block_type.nbytes
        p = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0, steps, _ = rows_tile(t, work, M, I, 128, 128, BK)
            for s in range(steps):
                idx = p % S
                mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once
                mbarrier.expect(ready.index(idx), nbytes)
                k = s * BK
                tma.async_copy_global_to_shared(x_desc, [m0, k], ready.index(idx), x_bufs.index(idx))
                tma.async_copy_global_to_shared(w_desc, [expert * N1 + n0, k], ready.index(idx), g_bufs.index(idx))
                if GATED:
                    tma.async_copy_global_to_shared(w_desc, [expert * N1 + I + n0, k], ready.index(idx),
                                                    u_bufs.index(idx))  # fmt: skip
                p += 1

    @gluon.jit
    def fc1_epilogue(gate, up, expert, m0, n0, work, outs, I, M, BIAS: gl.constexpr, GATED: gl.constexpr,
                     ACT: gl.constexpr, CLAMP: gl.constexpr, OFFSET: gl.constexpr, MAX: gl.constexpr,
                     MANTISSA_BITS: gl.constexpr, MIN_NORMAL_EXPONENT: gl.constexpr,
                     POWER_OF_2: gl.constexpr):  # fmt: skip
        """`_fp8_gate_up_fwd_kernel`'s epilogue for one warpgroup's 64 rows: + b1, h's halves stored in
        the params dtype, A from the stored h, quantised 1 x 128 (its columns past I zeros), A_q and
        its scales stored."""
        h_gate_desc, h_up_desc, a_desc, h_smem, a_smem = outs
        b1_ptr, stride_b1_e, a_scale_ptr, stride_as_r = work[6], work[7], work[8], work[9]
        rows_layout: gl.constexpr = gl.SliceLayout(1, gate.type.layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, gate.type.layout)
        num_warps: gl.constexpr = gl.num_warps()
        compact: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        out_ty: gl.constexpr = h_gate_desc.dtype
        if BIAS:
            ns = n0 + gl.arange(0, gate.type.shape[1], layout=compact)
            gate += spread(b1_ptr + expert * stride_b1_e, ns, ns < I, cols_layout).to(gl.float32)[None, :]
            if GATED:
                up += spread(b1_ptr + expert * stride_b1_e + I, ns, ns < I, cols_layout).to(gl.float32)[None, :]
        # h rounded to the params dtype once: stored, and A computed from it (as the backward recomputes
        # it); the fp32 sums are dead from here, which keeps the epilogue's registers in bounds
        gate = gate.to(out_ty)
        up = up.to(out_ty)
        store_tile(h_gate_desc, h_smem, gate, expert * 0, m0, n0)
        if GATED:
            store_tile(h_up_desc, h_smem, up, expert * 0, m0, n0)  # (store_tile waits for the gate's store)
        a = g_expert_activation(gate.to(gl.float32), up.to(gl.float32), ACT=ACT, GATED=GATED, CLAMP=CLAMP,
                                OFFSET=OFFSET)  # fmt: skip
        cols = n0 + gl.arange(0, gate.type.shape[1], layout=cols_layout)
        a = gl.where((cols < I)[None, :], a, 0.0)
        # the scales by IEEE division (the same bits): from exponent bits, Triton 3.6's sm_90 build of this
        # kernel spilled 136 bytes a thread, not 96, more of it among the MMAs
        a_q, a_scale_inv = g_quantize_block(a, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2, 1, False)
        store_tile(a_desc, a_smem, a_q, expert * 0, m0, n0)
        ms = m0 + gl.arange(0, gate.type.shape[0], layout=rows_layout)
        gl.store(a_scale_ptr + ms * stride_as_r + n0 // 128, a_scale_inv, mask=ms < M)

    @gluon.jit
    def fc1_half(work, outs, I, M, num_tiles, bufs, bars, WHICH: gl.constexpr, BIAS: gl.constexpr,
                 GATED: gl.constexpr, ACT: gl.constexpr, CLAMP: gl.constexpr, OFFSET: gl.constexpr,
                 MAX: gl.constexpr, MANTISSA_BITS: gl.constexpr, MIN_NORMAL_EXPONENT: gl.constexpr,
                 POWER_OF_2: gl.constexpr):  # fmt: skip
        """One MMA warpgroup: rows WHICH * 64 ... of every tile. Each K step: the gate's MMA, promoted
        (`row_scale = x_scale * w_scale; acc += partial * row_scale[:, None]`, fp8_block_matmul's),
        then the up's, then the stage freed (the empty barriers count both warpgroups). A step's
        scales are loaded before its stage is waited on."""
        x_bufs, g_bufs, u_bufs = bufs
        ready, empty = bars[0], bars[1]
        S: gl.constexpr = x_bufs.type.shape[0]
        HALF: gl.constexpr = 64
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 128, 32])  # fmt: skip
        x_scale_ptr, stride_xs_r = work[4], work[5]
        w_scale_ptr, stride_ws_e, stride_ws_half, stride_ws_n = work[10], work[11], work[12], work[13]
        partial = gl.zeros((HALF, 128), dtype=gl.float32, layout=acc_layout)
        c = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            expert, m0, n0, steps, _ = rows_tile(t, work, M, I, 128, 128, 128)
            m_half = m0 + WHICH * HALF
            ms = m_half + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
            x_scales = x_scale_ptr + ms * stride_xs_r
            w_scales = w_scale_ptr + expert * stride_ws_e + (n0 // 128) * stride_ws_n
            gate = gl.zeros((HALF, 128), dtype=gl.float32, layout=acc_layout)
            up = gl.zeros((HALF, 128), dtype=gl.float32, layout=acc_layout)
            for s in range(steps):
                idx = (c + s) % S
                x_scale = gl.load(x_scales + s, mask=ms < M, other=0.0)
                gate_scale = gl.load(w_scales + s)
                up_scale = gate_scale
                if GATED:  # (the scales' up half: past the last expert's scales without one)
                    up_scale = gl.load(w_scales + stride_ws_half + s)
                mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)
                x_half = x_bufs.index(idx).slice(WHICH * HALF, HALF)
                partial = warpgroup_mma(x_half, g_bufs.index(idx).permute((1, 0)), partial, use_acc=False)
                row_scale = x_scale * gate_scale
                gate += partial * row_scale[:, None]
                if GATED:
                    partial = warpgroup_mma(x_half, u_bufs.index(idx).permute((1, 0)), partial, use_acc=False)
                    row_scale = x_scale * up_scale
                    up += partial * row_scale[:, None]
                mbarrier.arrive(empty.index(idx), count=1)
            if expert >= 0:
                fc1_epilogue(gate, up, expert, m_half, n0, work, outs, I, M, BIAS, GATED, ACT, CLAMP, OFFSET, MAX,
                             MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2)  # fmt: skip
            c += steps
        tma.store_wait(0)

    @gluon.jit
    def _fp8_fc1_hopper_kernel(
        x_desc, w_desc, h_gate_desc, h_up_desc, a_desc, work, I, N1, M, num_tiles, BIAS: gl.constexpr,
        GATED: gl.constexpr, ACT: gl.constexpr, CLAMP: gl.constexpr, OFFSET: gl.constexpr, MAX: gl.constexpr,
        MANTISSA_BITS: gl.constexpr, MIN_NORMAL_EXPONENT: gl.constexpr, POWER_OF_2: gl.constexpr,
        H_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
        LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr,
    ):  # fmt: skip
        x_bufs = stages_of(x_desc, STAGES)
        g_bufs = stages_of(w_desc, STAGES)
        u_bufs = g_bufs
        if GATED:
            u_bufs = stages_of(w_desc, STAGES)
        ready, empty = stage_barriers(STAGES)
        h0 = gl.allocate_shared_memory(h_gate_desc.dtype, h_gate_desc.block_type.shape[1:], H_LAYOUT)
        a0 = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape[1:], A_LAYOUT)
        h1 = gl.allocate_shared_memory(h_gate_desc.dtype, h_gate_desc.block_type.shape[1:], H_LAYOUT)
        a1 = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape[1:], A_LAYOUT)
        outs0 = (h_gate_desc, h_up_desc, a_desc, h0, a0)  # each warpgroup's h and A_q buffers
        outs1 = (h_gate_desc, h_up_desc, a_desc, h1, a1)
        bufs, bars = (x_bufs, g_bufs, u_bufs), (ready, empty)
        gl.warp_specialize(
            [
                (fc1_half, (work, outs0, I, M, num_tiles, bufs, bars, 0, BIAS, GATED, ACT, CLAMP, OFFSET, MAX,
                            MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2)),  # fmt: skip
                (fc1_half, (work, outs1, I, M, num_tiles, bufs, bars, 1, BIAS, GATED, ACT, CLAMP, OFFSET, MAX,
                            MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2)),  # fmt: skip
                (fc1_loader, (x_desc, w_desc, work, I, N1, M, num_tiles, bufs, bars, GATED)),
            ],
            [4, LOADER_WARPS],  # the second MMA warpgroup, the loader
            [MMA_REGS, LOADER_REGS],
        )


def kernel_arguments(out_dtype: torch.dtype, fmt_dtype: torch.dtype, bias: bool, gated: bool, activation: str,
                     clamp: float | None, offset: float, fmt, power_of_2: bool) -> tuple[object, dict]:  # fmt: skip
    """(the Gluon kernel, its constexprs): what the launcher passes, and what `mok bench inspect`
    compiles for sm_90 without a GPU. fmt: the recipe's FP8Format for A."""
    constexprs = {
        "BIAS": bias,
        "GATED": gated,
        "ACT": activation,
        "CLAMP": clamp,
        "OFFSET": offset,
        "MAX": fmt.max,
        "MANTISSA_BITS": fmt.mantissa_bits,
        "MIN_NORMAL_EXPONENT": fmt.min_normal_exponent,
        "POWER_OF_2": power_of_2,
        "H_LAYOUT": fp8_hopper.shared_layout((HALF_M, BLOCK_N), out_dtype),
        "A_LAYOUT": fp8_hopper.shared_layout((HALF_M, BLOCK_N), fmt_dtype),
        "STAGES": stages_for(out_dtype, gated),
        "LOADER_WARPS": fp8_hopper.LOADER_WARPS,
        "LOADER_REGS": fp8_hopper.LOADER_REGS,
        "MMA_REGS": MMA_REGS,
    }
    return _fp8_fc1_hopper_kernel, constexprs


def fp8_fc1_hopper(
    x_rows: torch.Tensor, x_rows_scale_inv: torch.Tensor, w13_q: torch.Tensor, w13_scale_inv: torch.Tensor,
    h: torch.Tensor, a_q: torch.Tensor, a_scale_inv: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, fmt, *,
    power_of_2: bool, gate_up_bias: torch.Tensor | None, activation: str, gated: bool, clamp: float | None,
    offset: float,
) -> None:  # fmt: skip
    """h [R_pad, N1], A_q [R_pad, I] and A's scales [R_pad, cdiv(I, 128)] = `fp8_mlp.fp8_gate_up_fwd`'s,
    from x's rows in row order (`gathered_rows`: [R_pad, H] and their scales [R_pad, cdiv(H, 128)]) and
    W13_q [E, N1, H] (contiguous; scales [E, halves, cdiv(I, 128), cdiv(H, 128)]). Padding tiles are
    left as they are; padding rows inside a tile get values of no meaning. Call only where `usable`."""
    R, H = x_rows.shape
    E, N1, _ = w13_q.shape
    I = a_q.shape[1]
    num_tiles = R // BLOCK_M * cdiv(I, BLOCK_N)
    if num_tiles == 0:
        return
    w_s = w13_scale_inv.reshape(E, 1 + gated, *w13_scale_inv.shape[-2:])
    bias = (gate_up_bias, gate_up_bias.stride(0)) if gate_up_bias is not None else (a_scale_inv, 0)  # unread without
    # its first four as fp8_hopper's row GEMMs' (rows_tile: tile_to_expert, K steps, one "half", tile_m)
    work = (tile_to_expert, cdiv(H, BLOCK_K), 1, tile_m, x_rows_scale_inv, x_rows_scale_inv.stride(0), *bias,
            a_scale_inv, a_scale_inv.stride(0), w_s, w_s.stride(0), w_s.stride(1), w_s.stride(2))  # fmt: skip
    halves = (h[:, :I], h[:, I:]) if gated else (h,)
    desc = fp8_hopper._descriptor
    out_block = (1, HALF_M, BLOCK_N)
    kernel, constexprs = kernel_arguments(h.dtype, a_q.dtype, gate_up_bias is not None, gated, activation, clamp,
                                          offset, fmt, power_of_2)  # fmt: skip
    grid = (min(num_tiles, fp8_hopper.PROGRAMS or sm_count(h.device.index)),)
    kernel[grid](
        desc(x_rows, (BLOCK_M, BLOCK_K)), desc(w13_q.view(E * N1, H), (BLOCK_N, BLOCK_K)),
        desc(halves[0].unsqueeze(0), out_block), desc(halves[-1].unsqueeze(0), out_block),
        desc(a_q.unsqueeze(0), out_block), work, I, N1, R, num_tiles, num_warps=4,
        maxnreg=fp8_hopper.MAX_REGS, **constexprs,
    )  # fmt: skip
