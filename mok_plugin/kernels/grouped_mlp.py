"""Grouped SwiGLU expert GEMMs over the schedule's row tiles, forward and backward.

Math, per expert e over its rows r (token t_r, routing weight w_r), with the dimension letters of
DESIGN.md:
    gate_up_fwd    h[r] = x[t_r] @ W13_e^T  [2I]; A[r] = silu(h_gate) * h_up  [I]
    down_fwd       y[r] = w_r * (A[r] @ W2_e^T)  [H]
    down_dgrad     dA'[r] = dO[t_r] @ W2_e  [I]; partial <dA', A> per I-block (router gradient);
                   dh[r] = dSwiGLU(h[r], w_r * dA'[r])  [2I]; w_r * A[r] (A recomputed from h) stored
    gate_up_dgrad  dx[r] = dh[r] @ W13_e  [H]
    wgrad          dW2_e = sum_r dO[t_r]^T (w_r A[r]);  dW13_e = sum_r dh[r]^T x[t_r]

Tensors: x [T, H], dO [T, H], h [R_pad, 2I], A [R_pad, I], y and dx [R_pad, H] in the params
dtype; W13 [E, 2I, H], W2 [E, H, I]; w_R fp32 [R_pad] (0 on padding rows); row_to_token int64
[R_pad] (-1 on padding rows); tile_to_expert int64 [R_pad / TILE_M] (-1 past the last segment);
expert_offsets int64 [E+1], tokens_per_expert int64 [E].

Grids and ownership: each `_*_tile` device function computes one output tile, and both the
standalone kernels here and the persistent megakernel (megakernel.py) call them, so the two
variants run the same arithmetic. A row-tile GEMM tile is (row block of BLOCK_M rows, column
block); a row block lies inside one expert segment because segments are padded to TILE_M, a
multiple of BLOCK_M. A weight-gradient tile is (expert, output tile) and loops over that expert's
rows in ascending order, BLOCK_K rows at a time.

Determinism: every output tile has exactly one owner; every reduction is one K-loop in a fixed
BLOCK_K order with an fp32 accumulator (no split-K, no atomics); the router-gradient partials go to
fixed slots [row, I-block] and are summed in ascending block order by `combine.py`. Tile shapes come
from `configs.py` (never autotuned). The row-tile GEMMs gather x and dO rows through pointer loads,
so no permuted copy of them is materialised. The weight gradients are the exception: with
`MoKTileConfig.gather_rows` (pinned) they copy their by-token operand into row order first, at most
GATHER_CHUNK_BYTES at a time, because a by-token operand kept their K loop 2 buffers deep. The
contiguous operands (expert weights, the schedule-ordered row buffers, down_dgrad's epilogue
tiles) go through TMA tensor descriptors where a config asks for it (`MoKTileConfig.tma`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mok_plugin.kernels.configs import MoKTileConfig, interpreter_on, kernel_config, wgrad_kernel

__all__ = ["gate_up_fwd", "down_fwd", "down_dgrad", "gate_up_dgrad", "expert_wgrad"]


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would default to tf32 on the GPU; tests in fp32 need the full-precision path.
    return "ieee" if dtype == torch.float32 else "tf32"


def _metadata(name: str):
    def launch_metadata(grid, kernel, args):
        shape = {k: args[k] for k in ("K_DIM", "N_OUT") if k in args}
        return {"name": f"{name} {shape}"}

    return launch_metadata


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in fp32; the one formula both the forward and the backward use."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1-D tile index, GROUP_M row blocks sweeping the columns together, so
    consecutive programs share their rows and their weight panel in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, rows, tokens, row_ok) of row block pid_m; expert < 0 means no work."""
    expert = tl.load(tile_to_expert_ptr + (pid_m * BLOCK_M) // TILE_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(row_to_token_ptr + rows)
    return expert.to(tl.int64), rows, tokens, tokens >= 0


@triton.jit
def _weight_block(w, expert, stride_w_e, w_row0, k0, n0, ks, cols, k_ok, col_ok, stride_k, stride_n,
                  N_MAJOR: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_N] of expert weight e, element (k, n).

    Pointer mode: (k, n) of expert e at w + e * stride_w_e + k * stride_k + n * stride_n, masked.
    TMA mode: w is a tensor descriptor over the weight viewed 2-D ([E * rows, cols]), expert e's
    rows starting at w_row0; N_MAJOR when those rows are the output columns n (block
    [BLOCK_N, BLOCK_K], transposed here), else the reduction index k. A block that runs past the
    expert reads the next expert's rows: past K they meet the zero columns of the left operand,
    past N they land in output columns nobody stores; past the tensor, TMA fills zeros.
    """
    if TMA:
        if N_MAJOR:
            block = w.load([(w_row0 + n0).to(tl.int32), k0]).T  # descriptor coordinates are 32-bit
        else:
            block = w.load([(w_row0 + k0).to(tl.int32), n0])
    else:
        block = tl.load(
            w + expert * stride_w_e + ks[:, None] * stride_k + cols[None, :] * stride_n,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
    return block


@triton.jit
def _row_block(a, row0, a_rows, a_row_ok, stride_a, k0, ks, k_ok, TMA: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of a row-major operand: rows a_rows (pointer mode, masked) or, through a
    tensor descriptor, the contiguous rows from row0 (TMA mode; rows past the tensor read zeros)."""
    if TMA:
        block = a.load([row0.to(tl.int32), k0])
    else:
        block = tl.load(a + a_rows[:, None] * stride_a + ks[None, :], mask=a_row_ok[:, None] & k_ok[None, :], other=0.0)
    return block


@triton.jit
def _row_tile_matmul(
    a,  # [*, K_DIM] rows of the left operand (row stride stride_a, unit column stride); a descriptor if A_TMA
    a_row0,  # first row of the tile (A_TMA: the rows are a_row0 .. a_row0 + BLOCK_M)
    a_rows,  # int64 [BLOCK_M] which rows of a this tile reads (pointer mode)
    a_row_ok,  # bool [BLOCK_M]
    stride_a,
    w,  # expert weights (see _weight_block), a descriptor if W_TMA
    expert,
    stride_w_e,
    w_row0,
    stride_w_k,
    stride_w_n,
    n0,  # first output column
    cols,  # int64 [BLOCK_N]: n0 + arange(BLOCK_N)
    col_ok,  # bool [BLOCK_N]
    K_DIM,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    W_N_MAJOR: tl.constexpr,
    A_TMA: tl.constexpr,
    W_TMA: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = a[rows, :] @ W_e[:, cols], reducing over K in ascending BLOCK_K steps."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K_DIM
        a_blk = _row_block(a, a_row0, a_rows, a_row_ok, stride_a, k0, ks, k_ok, A_TMA)
        w_blk = _weight_block(w, expert, stride_w_e, w_row0, k0, n0, ks, cols, k_ok, col_ok, stride_w_k, stride_w_n,
                              W_N_MAJOR, W_TMA)  # fmt: skip
        acc = tl.dot(a_blk, w_blk, acc, input_precision=DOT_PRECISION)
    return acc


# ----------------------------------------------------------------------------------------------
# Tiles: one output tile each; shared by the kernels below and by megakernel.py
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_tile(
    pid_m,
    pid_n,
    x_ptr,  # (T, H) params dtype
    w13,  # (E, 2I, H); with TMA a descriptor over it viewed (E * 2I, H)
    h_ptr,  # (R_pad, 2I) out
    a_ptr,  # (R_pad, I) out
    row_to_token_ptr,  # (R_pad,) int64
    tile_to_expert_ptr,  # (R_pad / TILE_M,) int64
    K_DIM,  # H
    N_OUT,  # I
    stride_x_t,
    stride_w_e,
    stride_w_n,
    stride_h_r,
    stride_a_r,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """h[rows, n-block] of the gate and of the up half, and A[rows, n-block]; reduces over H in
    ascending BLOCK_K order. Nothing for a row block past the last segment."""
    expert, rows, tokens, row_ok = _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        gate_row0 = expert * 2 * N_OUT  # the expert's first gate row in the (E * 2I, H) view
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_DIM, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K_DIM
            xa = tl.load(
                x_ptr + tokens[:, None] * stride_x_t + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            wg = _weight_block(w13, expert, stride_w_e, gate_row0, k0, n0, ks, cols, k_ok, col_ok, 1, stride_w_n,
                               True, TMA)  # fmt: skip
            # The up half: output columns I + n of the same weight.
            wu = _weight_block(w13, expert, stride_w_e, gate_row0, k0, n0 + N_OUT, ks, cols + N_OUT, k_ok, col_ok, 1,
                               stride_w_n, True, TMA)  # fmt: skip
            acc_gate = tl.dot(xa, wg, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(xa, wu, acc_up, input_precision=DOT_PRECISION)
        out_ty = h_ptr.dtype.element_ty
        gate = acc_gate.to(out_ty)
        up = acc_up.to(out_ty)
        mask = row_ok[:, None] & col_ok[None, :]
        h_tile = h_ptr + rows[:, None] * stride_h_r + cols[None, :]
        tl.store(h_tile, gate, mask=mask)
        tl.store(h_tile + N_OUT, up, mask=mask)
        # A from the rounded h, exactly as the backward recomputes it.
        a = _silu_mul(gate.to(tl.float32), up.to(tl.float32))
        tl.store(a_ptr + rows[:, None] * stride_a_r + cols[None, :], a.to(out_ty), mask=mask)


@triton.jit
def _down_tile(
    pid_m,
    pid_n,
    a,  # (R_pad, I); with TMA a descriptor over it
    w2,  # (E, H, I); with TMA a descriptor over it viewed (E * H, I)
    w_rows_ptr,  # (R_pad,) fp32 routing weight per row
    y_ptr,  # (R_pad, H) out
    row_to_token_ptr,  # (R_pad,) int64
    tile_to_expert_ptr,  # (R_pad / TILE_M,) int64
    K_DIM,  # I
    N_OUT,  # H
    stride_a_r,
    stride_w_e,
    stride_w_h,
    stride_y_r,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """y[rows, n-block]: reduces over I in ascending BLOCK_K order, then scales each row by its
    routing weight in fp32."""
    expert, rows, tokens, row_ok = _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        acc = _row_tile_matmul(
            a, pid_m * BLOCK_M, rows, row_ok, stride_a_r, w2, expert, stride_w_e, expert * N_OUT, 1, stride_w_h,
            n0, cols, col_ok, K_DIM, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, True, TMA, TMA,
        )  # fmt: skip
        w = tl.load(w_rows_ptr + rows, mask=row_ok, other=0.0)
        y = acc * w[:, None]
        tl.store(
            y_ptr + rows[:, None] * stride_y_r + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _down_dgrad_epilogue(
    d_a_prime, rows, row_ok, cols, col_ok, slot, slot_ok, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr,
    d_w_partial_ptr, N_OUT, stride_h_r, stride_a_r, stride_part_r, OUT_TY: tl.constexpr,
):  # fmt: skip
    """From dA'[rows, cols] (fp32): the router partial <dA', A> into column `slot` (when slot_ok: the
    block has columns inside I), w*A, and dh of the gate and up columns. Padding rows of an active
    row block store zeros in dh and w*A: the weight-gradient GEMMs may read them whole (through
    TMA) and must find finite values there.

    The row sum <dA', A> is reduced in the order of dA's register layout, so a fused tile (an MMA
    accumulator) and the separate epilogue kernel (a loaded block) round it differently; dh and
    w*A are elementwise and the same either way."""
    mask = row_ok[:, None] & col_ok[None, :]
    h_tile = h_ptr + rows[:, None] * stride_h_r + cols[None, :]
    gate = tl.load(h_tile, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_tile + N_OUT, mask=mask, other=0.0).to(tl.float32)
    a = _silu_mul(gate, up).to(OUT_TY).to(tl.float32)  # A exactly as the forward stored it
    partial = tl.sum(d_a_prime * a, axis=1)
    tl.store(d_w_partial_ptr + rows * stride_part_r + slot, partial, mask=row_ok & slot_ok)
    w = tl.load(w_rows_ptr + rows, mask=row_ok, other=0.0)
    # Weighting A here keeps the weight-gradient GEMM a plain one (no register pass over its operand).
    a_w = (a * w[:, None]).to(OUT_TY)
    col_mask = col_ok[None, :]  # every row: padding rows store the zeros they computed
    tl.store(a_weighted_ptr + rows[:, None] * stride_a_r + cols[None, :], a_w, mask=col_mask)
    d_a = d_a_prime * w[:, None]
    sig = tl.sigmoid(gate)
    d_gate = (d_a * up * (sig * (1.0 + gate * (1.0 - sig)))).to(OUT_TY)
    d_up = (d_a * (gate * sig)).to(OUT_TY)
    d_h_tile = d_h_ptr + rows[:, None] * stride_h_r + cols[None, :]
    tl.store(d_h_tile, d_gate, mask=col_mask)
    tl.store(d_h_tile + N_OUT, d_up, mask=col_mask)


@triton.jit
def _down_dgrad_tile(
    pid_m,
    pid_n,
    d_out_ptr,  # (T, H)
    w2,  # (E, H, I); with TMA a descriptor over it viewed (E * H, I)
    h_ptr,  # (R_pad, 2I) saved pre-activation
    w_rows_ptr,  # (R_pad,) fp32
    d_h_ptr,  # (R_pad, 2I) out
    a_weighted_ptr,  # (R_pad, I) out: w_r * A[r], the right operand of the down weight gradient
    d_w_partial_ptr,  # (R_pad, cdiv(I, BLOCK_N)) fp32 out: <dA', A> per I-block of BLOCK_N columns
    row_to_token_ptr,  # (R_pad,) int64
    tile_to_expert_ptr,  # (R_pad / TILE_M,) int64
    K_DIM,  # H
    N_OUT,  # I
    stride_d_out_t,
    stride_w_e,
    stride_w_h,
    stride_h_r,
    stride_a_r,
    stride_part_r,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    PAIR: tl.constexpr,
):
    """dA'[rows, n-block] (reduced over H in ascending BLOCK_K order) and its epilogue. PAIR: the
    tile owns two adjacent I-blocks (2 * pid_n and 2 * pid_n + 1) with one accumulator each, so
    the gathered dO rows are loaded once for both while the heavy epilogue (h loads, dSwiGLU) runs
    on one BLOCK_N-wide accumulator at a time and stays within the registers."""
    expert, rows, tokens, row_ok = _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        blk = pid_n * 2 if PAIR else pid_n
        n0 = blk * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        w_row0 = expert * K_DIM
        out_ty: tl.constexpr = d_out_ptr.dtype.element_ty
        if PAIR:
            n1 = n0 + BLOCK_N
            cols1 = cols + BLOCK_N
            col1_ok = cols1 < N_OUT
            acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K_DIM, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K_DIM
                d_o = _row_block(d_out_ptr, 0, tokens, row_ok, stride_d_out_t, k0, ks, k_ok, False)
                w0 = _weight_block(w2, expert, stride_w_e, w_row0, k0, n0, ks, cols, k_ok, col_ok, stride_w_h, 1,
                                   False, TMA)  # fmt: skip
                w1 = _weight_block(w2, expert, stride_w_e, w_row0, k0, n1, ks, cols1, k_ok, col1_ok, stride_w_h, 1,
                                   False, TMA)  # fmt: skip
                acc0 = tl.dot(d_o, w0, acc0, input_precision=DOT_PRECISION)
                acc1 = tl.dot(d_o, w1, acc1, input_precision=DOT_PRECISION)
            _down_dgrad_epilogue(
                acc0, rows, row_ok, cols, col_ok, blk, True, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr,
                d_w_partial_ptr, N_OUT, stride_h_r, stride_a_r, stride_part_r, out_ty,
            )  # fmt: skip
            _down_dgrad_epilogue(
                acc1, rows, row_ok, cols1, col1_ok, blk + 1, n1 < N_OUT, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr,
                d_w_partial_ptr, N_OUT, stride_h_r, stride_a_r, stride_part_r, out_ty,
            )  # fmt: skip
        else:
            d_a_prime = _row_tile_matmul(
                d_out_ptr, 0, tokens, row_ok, stride_d_out_t, w2, expert, stride_w_e, w_row0, stride_w_h, 1,
                n0, cols, col_ok, K_DIM, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, False, False, TMA,
            )  # fmt: skip
            _down_dgrad_epilogue(
                d_a_prime, rows, row_ok, cols, col_ok, blk, True, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr,
                d_w_partial_ptr, N_OUT, stride_h_r, stride_a_r, stride_part_r, out_ty,
            )  # fmt: skip


@triton.jit
def _gate_up_dgrad_tile(
    pid_m,
    pid_n,
    d_h,  # (R_pad, 2I); with TMA a descriptor over it
    w13,  # (E, 2I, H); with TMA a descriptor over it viewed (E * 2I, H)
    d_x_rows_ptr,  # (R_pad, H) out
    row_to_token_ptr,  # (R_pad,) int64
    tile_to_expert_ptr,  # (R_pad / TILE_M,) int64
    K_DIM,  # 2I
    N_OUT,  # H
    stride_d_h_r,
    stride_w_e,
    stride_w_j,
    stride_d_x_r,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """dx[rows, n-block]; reduces over 2I in ascending BLOCK_K order."""
    expert, rows, tokens, row_ok = _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        acc = _row_tile_matmul(
            d_h, pid_m * BLOCK_M, rows, row_ok, stride_d_h_r, w13, expert, stride_w_e, expert * K_DIM, stride_w_j, 1,
            n0, cols, col_ok, K_DIM, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, False, TMA, TMA,
        )  # fmt: skip
        tl.store(
            d_x_rows_ptr + rows[:, None] * stride_d_x_r + cols[None, :],
            acc.to(d_x_rows_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _wgrad_operand(src, rows, tokens, r_ok, r0, col0, cols, col_ok, stride, BY_TOKEN: tl.constexpr, TMA: tl.constexpr):
    """[BLOCK_K, len(cols)] rows of a weight-gradient operand: gathered by token (always pointer
    loads, masked), or the contiguous schedule rows r0.. (a tensor descriptor when TMA; rows past
    the segment are its zero padding rows)."""
    if TMA and not BY_TOKEN:
        block = src.load([r0.to(tl.int32), col0])
    else:
        src_rows = tokens if BY_TOKEN else rows
        mask = r_ok[:, None] & col_ok[None, :]
        block = tl.load(src + src_rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    return block


@triton.jit
def _wgrad_tile(
    expert,
    pid_m,
    pid_n,
    left,  # rows of the left operand: (T, M_OUT) when LEFT_BY_TOKEN, else (R_pad, M_OUT) (a descriptor with TMA)
    right,  # rows of the right operand: (T, N_OUT) when RIGHT_BY_TOKEN, else (R_pad, N_OUT) (likewise)
    d_w_ptr,  # (E, M_OUT, N_OUT) out, any strides (a transposed view when the launcher swapped operands)
    row_to_token_ptr,  # (R_pad,) int64
    expert_offsets_ptr,  # (E+1,) int64
    tokens_per_expert_ptr,  # (E,) int64
    M_OUT,
    N_OUT,
    stride_left,
    stride_right,
    stride_d_w_e,
    stride_d_w_m,
    stride_d_w_n,
    LEFT_BY_TOKEN: tl.constexpr,
    RIGHT_BY_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """dW_e[m-block, n-block] = sum over e's rows r of left[r, m-block]^T right[r, n-block], in
    ascending row order, BLOCK_K rows per step; an expert with no rows writes zeros. With TMA the
    by-row operand is read through a descriptor, which needs the segment's padding rows to hold
    zeros up to the next multiple of BLOCK_K (down_dgrad writes them)."""
    expert = expert.to(tl.int64)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    ms = m0.to(tl.int64) + tl.arange(0, BLOCK_M)
    ns = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
    m_ok = ms < M_OUT
    n_ok = ns < N_OUT
    start = tl.load(expert_offsets_ptr + expert)
    end = start + tl.load(tokens_per_expert_ptr + expert)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Token indices are loaded one step ahead: a gathered load whose address came from a load in
    # the same iteration held the software pipeline to 2 buffers whatever num_stages said.
    first = start + tl.arange(0, BLOCK_K)
    tokens = tl.load(row_to_token_ptr + first, mask=first < end, other=0)
    for step in range(0, tl.cdiv(end - start, BLOCK_K)):
        r0 = start + step * BLOCK_K  # a tensor also under the interpreter (descriptor coordinates need .to)
        rows = r0 + tl.arange(0, BLOCK_K)
        r_ok = rows < end
        next_rows = rows + BLOCK_K
        next_tokens = tl.load(row_to_token_ptr + next_rows, mask=next_rows < end, other=0)
        # Both tiles load row-major ([rows, cols], cols contiguous); the transpose is left to the
        # MMA's operand layout (measured faster than loading the left tile transposed).
        lhs = _wgrad_operand(left, rows, tokens, r_ok, r0, m0, ms, m_ok, stride_left, LEFT_BY_TOKEN, TMA)
        rhs = _wgrad_operand(right, rows, tokens, r_ok, r0, n0, ns, n_ok, stride_right, RIGHT_BY_TOKEN, TMA)
        acc = tl.dot(tl.trans(lhs), rhs, acc, input_precision=DOT_PRECISION)
        tokens = next_tokens
    tl.store(
        d_w_ptr + expert * stride_d_w_e + ms[:, None] * stride_d_w_m + ns[None, :] * stride_d_w_n,
        acc.to(d_w_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


# ----------------------------------------------------------------------------------------------
# Kernels (the multi-kernel variant): a 1-D grid of tiles in grouped order
# ----------------------------------------------------------------------------------------------


@triton.jit(launch_metadata=_metadata("mok_gate_up_fwd"))
def _gate_up_fwd_kernel(
    x_ptr, w13_ptr, h_ptr, a_ptr, row_to_token_ptr, tile_to_expert_ptr, NUM_ROWS, K_DIM, N_OUT,
    stride_x_t, stride_w_e, stride_w_n, stride_h_r, stride_a_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(I, BLOCK_N),), grouped; program p owns gate/up tile p."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, tl.cdiv(N_OUT, BLOCK_N), GROUP_M)
    _gate_up_tile(
        pid_m, pid_n, x_ptr, w13_ptr, h_ptr, a_ptr, row_to_token_ptr, tile_to_expert_ptr, K_DIM, N_OUT,
        stride_x_t, stride_w_e, stride_w_n, stride_h_r, stride_a_r, TILE_M, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
        TMA,
    )  # fmt: skip


@triton.jit(launch_metadata=_metadata("mok_down_fwd"))
def _down_fwd_kernel(
    a_ptr, w2_ptr, w_rows_ptr, y_ptr, row_to_token_ptr, tile_to_expert_ptr, NUM_ROWS, K_DIM, N_OUT,
    stride_a_r, stride_w_e, stride_w_h, stride_y_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(H, BLOCK_N),), grouped; program p owns down tile p."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, tl.cdiv(N_OUT, BLOCK_N), GROUP_M)
    _down_tile(
        pid_m, pid_n, a_ptr, w2_ptr, w_rows_ptr, y_ptr, row_to_token_ptr, tile_to_expert_ptr, K_DIM, N_OUT,
        stride_a_r, stride_w_e, stride_w_h, stride_y_r, TILE_M, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA,
    )  # fmt: skip


@triton.jit(launch_metadata=_metadata("mok_down_dgrad"))
def _down_dgrad_kernel(
    d_out_ptr, w2_ptr, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr, d_w_partial_ptr, row_to_token_ptr,
    tile_to_expert_ptr, NUM_ROWS, K_DIM, N_OUT,
    stride_d_out_t, stride_w_e, stride_w_h, stride_h_r, stride_a_r, stride_part_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, PAIR: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(I, BLOCK_N * (2 if PAIR else 1)),), grouped; program p owns
    down-dgrad tile p."""
    tile_n = BLOCK_N * 2 if PAIR else BLOCK_N
    pid_m, pid_n = _grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, tl.cdiv(N_OUT, tile_n), GROUP_M)
    _down_dgrad_tile(
        pid_m, pid_n, d_out_ptr, w2_ptr, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr, d_w_partial_ptr,
        row_to_token_ptr, tile_to_expert_ptr, K_DIM, N_OUT, stride_d_out_t, stride_w_e, stride_w_h, stride_h_r,
        stride_a_r, stride_part_r, TILE_M, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA, PAIR,
    )  # fmt: skip


@triton.jit(launch_metadata=_metadata("mok_down_dgrad_gemm"))
def _down_dgrad_gemm_kernel(
    d_out_ptr, w2_ptr, d_a_ptr, row_to_token_ptr, tile_to_expert_ptr, NUM_ROWS, K_DIM, N_OUT,
    stride_d_out_t, stride_w_e, stride_w_h, stride_d_a_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(I, BLOCK_N),), grouped; program p stores the fp32 dA' tile p
    (rows in use only) for _down_dgrad_epilogue_kernel."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, tl.cdiv(N_OUT, BLOCK_N), GROUP_M)
    expert, rows, tokens, row_ok = _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        d_a_prime = _row_tile_matmul(
            d_out_ptr, 0, tokens, row_ok, stride_d_out_t, w2_ptr, expert, stride_w_e, expert * K_DIM, stride_w_h, 1,
            n0, cols, col_ok, K_DIM, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, False, False, TMA,
        )  # fmt: skip
        tl.store(
            d_a_ptr + rows[:, None] * stride_d_a_r + cols[None, :], d_a_prime, mask=row_ok[:, None] & col_ok[None, :]
        )


@triton.jit(launch_metadata=_metadata("mok_down_dgrad_epilogue"))
def _down_dgrad_epilogue_kernel(
    d_a_ptr, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr, d_w_partial_ptr, row_to_token_ptr, tile_to_expert_ptr,
    N_OUT, stride_d_a_r, stride_h_r, stride_a_r, stride_part_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M, cdiv(I, BLOCK_N)); program (m, n) runs down_dgrad's epilogue on the
    dA' block (m, n), padding rows reading zeros, with router partial slot n."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, rows, tokens, row_ok = _tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        d_a_prime = tl.load(d_a_ptr + rows[:, None] * stride_d_a_r + cols[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        _down_dgrad_epilogue(
            d_a_prime, rows, row_ok, cols, col_ok, pid_n, True, h_ptr, w_rows_ptr, d_h_ptr, a_weighted_ptr,
            d_w_partial_ptr, N_OUT, stride_h_r, stride_a_r, stride_part_r, h_ptr.dtype.element_ty,
        )  # fmt: skip


@triton.jit(launch_metadata=_metadata("mok_gate_up_dgrad"))
def _gate_up_dgrad_kernel(
    d_h_ptr, w13_ptr, d_x_rows_ptr, row_to_token_ptr, tile_to_expert_ptr, NUM_ROWS, K_DIM, N_OUT,
    stride_d_h_r, stride_w_e, stride_w_j, stride_d_x_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(H, BLOCK_N),), grouped; program p owns dx-rows tile p."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, tl.cdiv(N_OUT, BLOCK_N), GROUP_M)
    _gate_up_dgrad_tile(
        pid_m, pid_n, d_h_ptr, w13_ptr, d_x_rows_ptr, row_to_token_ptr, tile_to_expert_ptr, K_DIM, N_OUT,
        stride_d_h_r, stride_w_e, stride_w_j, stride_d_x_r, TILE_M, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA,
    )  # fmt: skip


@triton.jit(launch_metadata=_metadata("mok_expert_wgrad"))
def _expert_wgrad_kernel(
    left_ptr, right_ptr, d_w_ptr, row_to_token_ptr, expert_offsets_ptr, tokens_per_expert_ptr, M_OUT, N_OUT,
    stride_left, stride_right, stride_d_w_e, stride_d_w_m, stride_d_w_n,
    LEFT_BY_TOKEN: tl.constexpr, RIGHT_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Grid: (E * cdiv(M_OUT, BLOCK_M) * cdiv(N_OUT, BLOCK_N),), expert-major and grouped within an
    expert, so the programs running together read the same expert's rows."""
    num_pid_m = tl.cdiv(M_OUT, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_pid(pid % (num_pid_m * num_pid_n), num_pid_m, num_pid_n, GROUP_M)
    _wgrad_tile(
        pid // (num_pid_m * num_pid_n), pid_m, pid_n, left_ptr, right_ptr, d_w_ptr, row_to_token_ptr,
        expert_offsets_ptr, tokens_per_expert_ptr, M_OUT, N_OUT, stride_left, stride_right, stride_d_w_e,
        stride_d_w_m, stride_d_w_n, LEFT_BY_TOKEN, RIGHT_BY_TOKEN, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launchers: check, allocate, launch. No autograd, no host synchronisation.
# ----------------------------------------------------------------------------------------------


def _check(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_schedule(row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, cfg: MoKTileConfig,
                    max_split_n: int = 1) -> int:  # fmt: skip
    if not 1 <= cfg.split_n <= max_split_n or cfg.block_n % cfg.split_n:
        raise ValueError(
            f"this kernel splits its tile into at most {max_split_n} accumulators, got split_n={cfg.split_n}"
        )
    _check("row_to_token", row_to_token, 1, torch.int64)
    _check("tile_to_expert", tile_to_expert, 1, torch.int64)
    num_rows = row_to_token.shape[0]
    if tile_m % cfg.block_m != 0 or num_rows % tile_m != 0 or tile_to_expert.shape[0] != num_rows // tile_m:
        raise ValueError(
            f"schedule tile_m={tile_m} must be a multiple of BLOCK_M={cfg.block_m} and divide num_rows={num_rows}, "
            f"with one tile_to_expert entry per tile (got {tile_to_expert.shape[0]})"
        )
    return num_rows


def _tma_ok(cfg: MoKTileConfig, *tensors: torch.Tensor) -> bool:
    """Whether cfg asks for TMA and every tensor's shape can back a descriptor (unit column stride,
    row strides of a multiple of 16 bytes) on a GPU with the copy engine (Hopper or newer) or under
    Triton's interpreter. Shapes and the device decide, never the data pointer, so the choice is
    the same in every process; `_descriptor` copies a tensor whose start is not 16-byte aligned."""
    if not cfg.tma:
        return False
    if not interpreter_on() and (not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9):
        return False
    return all(t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def _descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A TMA descriptor over t viewed 2-D (a stacked weight [E, rows, cols] becomes [E * rows, cols])."""
    if t.data_ptr() % 16:
        t = t.clone()  # TMA needs a 16-byte aligned start; a fresh allocation has one
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), block_shape)


def _stages_for(cfg: MoKTileConfig, dtype: torch.dtype) -> MoKTileConfig:
    """cfg for inputs of `dtype`. The pinned stages are sized for 2-byte inputs; fp32 tiles take
    twice the shared memory, which no longer fits Hopper's 227 KiB at the pinned depth (gate_up_dgrad
    would ask for 384 KiB), so fp32 (tests, checks) runs unpipelined. Tiles and K order stay, so the
    results are the same as at any depth."""
    return replace(cfg, num_stages=1) if dtype.itemsize > 2 else cfg


def _launch_row_tiles(kernel, cfg: MoKTileConfig, num_rows: int, n_out: int, dtype: torch.dtype, tile_m: int, *args,
                      tma: bool = False, **constexprs):  # fmt: skip
    """Launch a row-tile kernel over (R_pad / BLOCK_M) x cdiv(n_out, block_n) tiles with config cfg;
    the kernel's BLOCK_N is one of the tile's cfg.split_n accumulators."""
    cfg = _stages_for(cfg, dtype)
    grid = (num_rows // cfg.block_m * triton.cdiv(n_out, cfg.block_n),)
    kernel[grid](
        *args,
        TILE_M=tile_m,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n // cfg.split_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        DOT_PRECISION=_dot_precision(dtype),
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **constexprs,
    )


def gate_up_fwd(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor,
    tile_m: int,
    config: MoKTileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R_pad, 2I] and A [R_pad, I] (params dtype) for the gathered rows; padding rows untouched."""
    _check("x", x, 2)
    _check("gate_up_proj", gate_up_proj, 3, x.dtype)
    E, I2, H = gate_up_proj.shape
    I = I2 // 2
    if x.shape[1] != H:
        raise ValueError(f"x has H={x.shape[1]} but gate_up_proj has H={H}")
    cfg = config or kernel_config("gate_up_fwd", I)
    num_rows = _check_schedule(row_to_token, tile_to_expert, tile_m, cfg)
    h = torch.empty(num_rows, I2, dtype=x.dtype, device=x.device)
    a = torch.empty(num_rows, I, dtype=x.dtype, device=x.device)
    tma = _tma_ok(cfg, gate_up_proj)
    w13 = _descriptor(gate_up_proj, [cfg.block_n, cfg.block_k]) if tma else gate_up_proj
    _launch_row_tiles(
        _gate_up_fwd_kernel, cfg, num_rows, I, x.dtype, tile_m,
        x, w13, h, a, row_to_token, tile_to_expert, num_rows, H, I, x.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), h.stride(0), a.stride(0), tma=tma,
    )  # fmt: skip
    return h, a


def down_fwd(
    a: torch.Tensor,
    down_proj: torch.Tensor,
    w_rows: torch.Tensor,
    row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor,
    tile_m: int,
    config: MoKTileConfig | None = None,
) -> torch.Tensor:
    """y [R_pad, H] = w_r * (A[r] @ W2_e^T) in the params dtype."""
    _check("a", a, 2)
    _check("down_proj", down_proj, 3, a.dtype)
    _check("w_rows", w_rows, 1, torch.float32)
    E, H, I = down_proj.shape
    cfg = config or kernel_config("down_fwd", H)
    num_rows = _check_schedule(row_to_token, tile_to_expert, tile_m, cfg)
    y = torch.empty(num_rows, H, dtype=a.dtype, device=a.device)
    tma = _tma_ok(cfg, a, down_proj)
    a_in = _descriptor(a, [cfg.block_m, cfg.block_k]) if tma else a
    w2 = _descriptor(down_proj, [cfg.block_n, cfg.block_k]) if tma else down_proj
    _launch_row_tiles(
        _down_fwd_kernel, cfg, num_rows, H, a.dtype, tile_m,
        a_in, w2, w_rows, y, row_to_token, tile_to_expert, num_rows, I, H, a.stride(0), down_proj.stride(0),
        down_proj.stride(1), y.stride(0), tma=tma,
    )  # fmt: skip
    return y


def down_dgrad(
    d_out: torch.Tensor,
    down_proj: torch.Tensor,
    h: torch.Tensor,
    w_rows: torch.Tensor,
    row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor,
    tile_m: int,
    config: MoKTileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [R_pad, 2I], w_r * A [R_pad, I], router partials fp32 [R_pad, cdiv(I, BLOCK_N)])."""
    _check("d_out", d_out, 2)
    _check("down_proj", down_proj, 3, d_out.dtype)
    _check("h", h, 2, d_out.dtype)
    E, H, I = down_proj.shape
    cfg = config or kernel_config("down_dgrad", I)
    num_rows = _check_schedule(row_to_token, tile_to_expert, tile_m, cfg, max_split_n=1 if cfg.split_epilogue else 2)
    # One router partial per I-block of the epilogue's width (an accumulator's, or the epilogue kernel's).
    n_blocks = triton.cdiv(I, EPILOGUE_BLOCK_N if cfg.split_epilogue else cfg.block_n // cfg.split_n)
    d_h = torch.empty(num_rows, 2 * I, dtype=d_out.dtype, device=d_out.device)
    a = torch.empty(num_rows, I, dtype=d_out.dtype, device=d_out.device)
    partial = torch.zeros(num_rows, n_blocks, dtype=torch.float32, device=d_out.device)
    if cfg.split_epilogue:
        _down_dgrad_split(d_out, down_proj, h, w_rows, row_to_token, tile_to_expert, tile_m, cfg, d_h, a, partial)
        return d_h, a, partial
    tma = _tma_ok(cfg, down_proj)
    w2 = _descriptor(down_proj, [cfg.block_k, cfg.block_n // cfg.split_n]) if tma else down_proj
    _launch_row_tiles(
        _down_dgrad_kernel, cfg, num_rows, I, d_out.dtype, tile_m,
        d_out, w2, h, w_rows, d_h, a, partial, row_to_token, tile_to_expert, num_rows, H, I,
        d_out.stride(0), down_proj.stride(0), down_proj.stride(1), h.stride(0), a.stride(0), partial.stride(0),
        tma=tma, PAIR=cfg.split_n == 2,
    )  # fmt: skip
    return d_h, a, partial


# down_dgrad's separate epilogue kernel: a program's block (its router partials are BLOCK_N
# columns wide) and warps. Measured alone on the H200 (qwen3 / olmoe / mixtral / deepseek-v3):
# 32x128 in 8 warps 0.49 / 0.66 / 1.06 / 0.73 ms, 3.0-3.9 TB/s; 32x64 in 4 warps 0.56 / 0.73 /
# 1.10 / 0.84; 16x64, 64x64 and 64x128 in between or slower. (128 rows in 8 warps took 234
# registers, one program per SM.)
EPILOGUE_BLOCK_N = 128
EPILOGUE_BLOCK_M = 32
EPILOGUE_WARPS = 8


def _down_dgrad_split(d_out: torch.Tensor, down_proj: torch.Tensor, h: torch.Tensor, w_rows: torch.Tensor,
                      row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, cfg: MoKTileConfig,
                      d_h: torch.Tensor, a: torch.Tensor, partial: torch.Tensor) -> None:  # fmt: skip
    """down_dgrad as a plain GEMM into an fp32 dA' [R_pad, I] and an elementwise epilogue kernel
    that fills d_h, a (w*A) and partial from it; dA' is freed on return."""
    E, H, I = down_proj.shape
    num_rows = row_to_token.shape[0]
    gemm = replace(cfg, split_n=1)
    d_a = torch.empty(num_rows, I, dtype=torch.float32, device=d_out.device)
    tma = _tma_ok(gemm, down_proj)
    w2 = _descriptor(down_proj, [gemm.block_k, gemm.block_n]) if tma else down_proj
    _launch_row_tiles(
        _down_dgrad_gemm_kernel, gemm, num_rows, I, d_out.dtype, tile_m,
        d_out, w2, d_a, row_to_token, tile_to_expert, num_rows, H, I, d_out.stride(0), down_proj.stride(0),
        down_proj.stride(1), d_a.stride(0), tma=tma,
    )  # fmt: skip
    block_m = min(EPILOGUE_BLOCK_M, cfg.block_m)  # divides tile_m, as cfg.block_m does
    grid = (num_rows // block_m, triton.cdiv(I, EPILOGUE_BLOCK_N))
    _down_dgrad_epilogue_kernel[grid](
        d_a, h, w_rows, d_h, a, partial, row_to_token, tile_to_expert, I, d_a.stride(0), h.stride(0), a.stride(0),
        partial.stride(0), TILE_M=tile_m, BLOCK_M=block_m, BLOCK_N=EPILOGUE_BLOCK_N, num_warps=EPILOGUE_WARPS,
    )  # fmt: skip


def gate_up_dgrad(
    d_h: torch.Tensor,
    gate_up_proj: torch.Tensor,
    row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor,
    tile_m: int,
    config: MoKTileConfig | None = None,
) -> torch.Tensor:
    """dx rows [R_pad, H] = dh[r] @ W13_e in the params dtype."""
    _check("d_h", d_h, 2)
    _check("gate_up_proj", gate_up_proj, 3, d_h.dtype)
    E, I2, H = gate_up_proj.shape
    cfg = config or kernel_config("gate_up_dgrad", H)
    num_rows = _check_schedule(row_to_token, tile_to_expert, tile_m, cfg)
    d_x_rows = torch.empty(num_rows, H, dtype=d_h.dtype, device=d_h.device)
    tma = _tma_ok(cfg, d_h, gate_up_proj)
    d_h_in = _descriptor(d_h, [cfg.block_m, cfg.block_k]) if tma else d_h
    w13 = _descriptor(gate_up_proj, [cfg.block_k, cfg.block_n]) if tma else gate_up_proj
    _launch_row_tiles(
        _gate_up_dgrad_kernel, cfg, num_rows, H, d_h.dtype, tile_m,
        d_h_in, w13, d_x_rows, row_to_token, tile_to_expert, num_rows, I2, H, d_h.stride(0),
        gate_up_proj.stride(0), gate_up_proj.stride(1), d_x_rows.stride(0), tma=tma,
    )  # fmt: skip
    return d_x_rows


def expert_wgrad(
    left: torch.Tensor,
    right: torch.Tensor,
    row_to_token: torch.Tensor,
    expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    left_by_token: bool,
    right_by_token: bool,
    segment_align: int = 1,
    config: MoKTileConfig | None = None,
) -> torch.Tensor:
    """dW [E, M, N] = per expert, sum over its rows of left[row]^T right[row] (rows in order).

    A "by token" operand is indexed through row_to_token (x or dO); otherwise by row (w*A or dh).
    segment_align: what every expert segment's start and padded length are a multiple of (the
    schedule's tile_m). TMA reads a by-row operand BLOCK_K rows at a time, so it is used only when
    segment_align is a multiple of BLOCK_K, and then the padding rows must hold finite values
    (down_dgrad writes zeros there).
    """
    _check("left", left, 2)
    _check("right", right, 2, left.dtype)
    _check("expert_offsets", expert_offsets, 1, torch.int64)
    _check("tokens_per_expert", tokens_per_expert, 1, torch.int64)
    E = tokens_per_expert.shape[0]
    M, N = left.shape[1], right.shape[1]
    by_row_width = N if left_by_token else M
    cfg = config or kernel_config(wgrad_kernel(by_row_width), by_row_width)
    cfg = _stages_for(cfg, left.dtype)
    d_w = torch.empty(E, M, N, dtype=left.dtype, device=left.device)
    if right_by_token and not left_by_token and not cfg.gather_rows:
        # dW = (right^T left)^T: rows gathered in the K loop are faster as the left operand (dW13
        # on olmoe: 2.41 ms with x as the right, 2.10 swapped); the transposed store is once a tile.
        _launch_wgrad(right, left, d_w.transpose(1, 2), row_to_token, expert_offsets, tokens_per_expert, True, False,
                      segment_align, cfg)  # fmt: skip
        return d_w
    if not (cfg.gather_rows and left_by_token != right_by_token):
        _launch_wgrad(left, right, d_w, row_to_token, expert_offsets, tokens_per_expert, left_by_token, right_by_token,
                      segment_align, cfg)  # fmt: skip
        return d_w
    # Pre-gathered rows: the by-token operand copied into schedule row order (a padding row copies
    # token 0, which meets the other operand's zero padding row), so that both operands are
    # contiguous and the K loop pipelines num_stages deep. The copy is made a column block at a
    # time, each block's weight gradient is a slice of d_w with the same row sums, so the result is
    # bitwise the same whatever the blocks, and the copy adds at most GATHER_CHUNK_BYTES to the peak.
    by_token = left if left_by_token else right
    if by_token.shape[0] == 0:
        # No tokens, so no rows (an expert-parallel rank that received none): every expert's
        # gradient is zero, and the copy below would index token 0 of an empty tensor.
        return d_w.zero_()
    order = row_to_token.clamp(min=0)
    block = cfg.block_m if left_by_token else cfg.block_n
    for c0, c1 in gather_column_blocks(by_token.shape[1], order.shape[0] * by_token.element_size(), block):
        rows = by_token[:, c0:c1].index_select(0, order)
        if left_by_token:
            _launch_wgrad(rows, right, d_w[:, c0:c1], row_to_token, expert_offsets, tokens_per_expert, False, False,
                          segment_align, cfg)  # fmt: skip
        else:
            _launch_wgrad(left, rows, d_w[:, :, c0:c1], row_to_token, expert_offsets, tokens_per_expert, False, False,
                          segment_align, cfg)  # fmt: skip
        del rows
    return d_w


# The most bytes a pre-gathered weight-gradient operand holds at once (see expert_wgrad). dW13's
# copy of x is live at the backward's peak: 128 MiB (two blocks on mixtral-8x7b) keeps that peak
# under torch's path, 256 MiB put it 0.34 MiB over; the extra re-read of the other operand was not
# measurable (mixtral 31.13 vs 31.24 ms, deepseek-v3 46.23 vs 46.43 in one process; BENCHMARKS.md).
GATHER_CHUNK_BYTES = 128 * 2**20


def gather_column_blocks(num_cols: int, bytes_per_col: int, block: int) -> list[tuple[int, int]]:
    """[c0, c1) column ranges of about equal width, each a multiple of block (but the last), whose
    gathered copies hold at most GATHER_CHUNK_BYTES (at least one block each)."""
    count = max(1, triton.cdiv(num_cols * bytes_per_col, GATHER_CHUNK_BYTES))
    width = max(block, triton.cdiv(triton.cdiv(num_cols, count), block) * block)
    return [(c0, min(c0 + width, num_cols)) for c0 in range(0, num_cols, width)]


def _launch_wgrad(left: torch.Tensor, right: torch.Tensor, d_w: torch.Tensor, row_to_token: torch.Tensor,
                  expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, left_by_token: bool,
                  right_by_token: bool, segment_align: int, cfg: MoKTileConfig) -> None:  # fmt: skip
    """One weight-gradient launch into d_w [E, M, N] (any strides)."""
    E, M, N = d_w.shape
    grid = (E * triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    by_row = [t for t, by_token in ((left, left_by_token), (right, right_by_token)) if not by_token]
    tma = bool(by_row) and segment_align % cfg.block_k == 0 and _tma_ok(cfg, *by_row)
    _expert_wgrad_kernel[grid](
        _descriptor(left, [cfg.block_k, cfg.block_m]) if tma and not left_by_token else left,
        _descriptor(right, [cfg.block_k, cfg.block_n]) if tma and not right_by_token else right,
        d_w,
        row_to_token,
        expert_offsets,
        tokens_per_expert,
        M,
        N,
        left.stride(0),
        right.stride(0),
        d_w.stride(0),
        d_w.stride(1),
        d_w.stride(2),
        LEFT_BY_TOKEN=left_by_token,
        RIGHT_BY_TOKEN=right_by_token,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        DOT_PRECISION=_dot_precision(left.dtype),
        TMA=tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
