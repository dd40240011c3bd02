"""The multi-kernel variant's expert GEMMs: one kernel per pass and tile kind, and their launchers.

Math (see tiles.py for the per-tile formulas):
    gate_up_fwd    h [R_pad, 2I] = x[t_r] @ W13_e^T; A [R_pad, I] = silu(h_gate) * h_up
    down_fwd       y [R_pad, H] = w_r * (A[r] @ W2_e^T)
    down_dgrad     dA' = dO[t_r] @ W2_e (a GEMM into fp32 [R_pad, I]), then an elementwise
                   epilogue kernel: dh [R_pad, 2I], w*A [R_pad, I], router partials fp32 [R_pad, J]
    gate_up_dgrad  dx rows [R_pad, H] = dh[r] @ W13_e
    expert_wgrad   dW_e = sum over e's rows of left[r]^T right[r] (dW2 and dW13)

Grids: every row-tile kernel is a 1-D grid of (row block, column block) tiles in grouped order
(`tiles.grouped_pid`), program p owning tile p; the epilogue kernel a 2-D grid of (row block,
I-block); the weight gradients a 1-D grid over (expert, output tile), expert-major. Tile shapes come
from `configs.py` (never autotuned).

Determinism: every output tile has one owner and every reduction is one K loop in a fixed order
(tiles.py); the router partials go to fixed slots [row, I-block] and are summed in ascending block
order by `combine.py`. No float atomics, no split-K.

Gathers: the row-tile GEMMs gather x and dO rows through pointer loads, so no permuted copy of them
is materialised. The weight gradients with `MoKTileConfig.gather_rows` (pinned for wide operands)
copy their by-token operand into row order first, at most GATHER_CHUNK_BYTES at a time, because a
by-token operand kept their K loop 2 buffers deep. The contiguous operands (expert weights, the
schedule-ordered row buffers) go through TMA tensor descriptors where a config asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl

from mok_plugin.kernels import rows_hopper, wgrad_hopper
from mok_plugin.kernels.configs import (
    HOPPER_WGRAD_MIN_WIDTH,
    HOPPER_WGRAD_REPLACES,
    MoKTileConfig,
    column_tail,
    kernel_config,
    spread_over_sms,
    wgrad_kernel,
)
from mok_plugin.kernels.launch import (
    alignment,
    cdiv,
    check_schedule,
    check_tensor,
    descriptor,
    dot_precision,
    is_size_or_stride,
    launch,
    routing_weights_arg,
    sm_count,
    stages_for,
    tma_ok,
)
from mok_plugin.kernels.schedule import dense_rows
from mok_plugin.kernels.tiles import (
    aligned,
    bias_grad_tile,
    bias_router_grad_tile,
    down_dgrad_block,
    down_dgrad_epilogue,
    down_tile,
    gate_up_dgrad_tile,
    gate_up_tile,
    grouped_pid,
    tile_rows,
    wgrad_sweep,
    wgrad_tile,
)
from mok_plugin.schedule import segment_offsets

__all__ = [
    "gate_up_fwd",
    "down_fwd",
    "down_dgrad",
    "gate_up_dgrad",
    "expert_wgrad",
    "expert_bias_grad",
    "hopper_wgrad_schedule",
    "pair_wgrad_hopper",
    "GATHER_CHUNK_BYTES",
]


# ----------------------------------------------------------------------------------------------
# Kernels: a 1-D grid of tiles in grouped order (the epilogue kernel: a 2-D grid)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_fwd_kernel(
    x_ptr, w13, b1_ptr, h_ptr, a_ptr, row_to_token_ptr, row_to_tk_ptr, tile_to_expert_ptr, NUM_ROWS, COL_TILES,
    FIRST_COL_TILE, H, I, stride_x_t, stride_w_e, stride_w_n, stride_b1_e, stride_h_r, stride_a_r, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr,
    OFFSET: tl.constexpr, H_BY_PAIR: tl.constexpr, JOINED: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M * COL_TILES,), grouped; program p owns gate/up tile p."""
    # sizes and strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    H = aligned(H, ALIGN)
    I = aligned(I, ALIGN)
    stride_x_t = aligned(stride_x_t, ALIGN)
    stride_w_e = aligned(stride_w_e, ALIGN)
    stride_w_n = aligned(stride_w_n, ALIGN)
    stride_b1_e = aligned(stride_b1_e, ALIGN)
    stride_h_r = aligned(stride_h_r, ALIGN)
    stride_a_r = aligned(stride_a_r, ALIGN)
    pid_m, pid_n = grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, COL_TILES, GROUP_M)
    pid_n += FIRST_COL_TILE  # a column-tail launch's tiles follow the full ones (_launch_row_tiles)
    gate_up_tile(
        pid_m, pid_n, x_ptr=x_ptr, w13=w13, b1_ptr=b1_ptr, h_ptr=h_ptr, a_ptr=a_ptr, row_to_token_ptr=row_to_token_ptr,
        row_to_tk_ptr=row_to_tk_ptr, tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I, stride_x_t=stride_x_t,
        stride_w_e=stride_w_e, stride_w_n=stride_w_n, stride_b1_e=stride_b1_e, stride_h_r=stride_h_r,
        stride_a_r=stride_a_r, TILE_M=TILE_M, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION=DOT_PRECISION, TMA=TMA, ACT=ACT, GATED=GATED, CLAMP=CLAMP, OFFSET=OFFSET, H_BY_PAIR=H_BY_PAIR,
        JOINED=JOINED,
    )


@triton.jit
def _down_fwd_kernel(
    a, w2, b2_ptr, topk_weights_ptr, row_to_tk_ptr, y_ptr, row_to_token_ptr, tile_to_expert_ptr, NUM_ROWS, COL_TILES,
    FIRST_COL_TILE, H, I, stride_a_r, stride_w_e, stride_w_h, stride_b2_e, stride_y_r, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M * COL_TILES,), grouped; program p owns down tile p."""
    # sizes and strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    H = aligned(H, ALIGN)
    I = aligned(I, ALIGN)
    stride_a_r = aligned(stride_a_r, ALIGN)
    stride_w_e = aligned(stride_w_e, ALIGN)
    stride_w_h = aligned(stride_w_h, ALIGN)
    stride_b2_e = aligned(stride_b2_e, ALIGN)
    stride_y_r = aligned(stride_y_r, ALIGN)
    pid_m, pid_n = grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, COL_TILES, GROUP_M)
    pid_n += FIRST_COL_TILE  # a column-tail launch's tiles follow the full ones (_launch_row_tiles)
    down_tile(
        pid_m, pid_n, a=a, w2=w2, b2_ptr=b2_ptr, topk_weights_ptr=topk_weights_ptr, row_to_tk_ptr=row_to_tk_ptr,
        y_ptr=y_ptr, row_to_token_ptr=row_to_token_ptr,
        tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I, stride_a_r=stride_a_r, stride_w_e=stride_w_e,
        stride_w_h=stride_w_h, stride_b2_e=stride_b2_e, stride_y_r=stride_y_r, TILE_M=TILE_M, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, TMA=TMA,
    )


@triton.jit
def _down_dgrad_gemm_kernel(
    d_out_ptr, w2, d_a_ptr, row_to_token_ptr, tile_to_expert_ptr, NUM_ROWS, COL_TILES, FIRST_COL_TILE, H, I,
    stride_d_out_t, stride_w_e, stride_w_h, stride_d_a_r, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M * COL_TILES,), grouped; program p stores the fp32 dA' tile p
    (rows in use only) for _down_dgrad_epilogue_kernel."""
    # sizes and strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    H = aligned(H, ALIGN)
    I = aligned(I, ALIGN)
    stride_d_out_t = aligned(stride_d_out_t, ALIGN)
    stride_w_e = aligned(stride_w_e, ALIGN)
    stride_w_h = aligned(stride_w_h, ALIGN)
    stride_d_a_r = aligned(stride_d_a_r, ALIGN)
    pid_m, pid_n = grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, COL_TILES, GROUP_M)
    pid_n += FIRST_COL_TILE  # a column-tail launch's tiles follow the full ones (_launch_row_tiles)
    expert, rows, row_ok, cols, col_ok, d_a_prime = down_dgrad_block(
        pid_m, pid_n, d_out_ptr=d_out_ptr, w2=w2, row_to_token_ptr=row_to_token_ptr,
        tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I, stride_d_out_t=stride_d_out_t, stride_w_e=stride_w_e,
        stride_w_h=stride_w_h, TILE_M=TILE_M, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION=DOT_PRECISION, TMA=TMA,
    )
    if expert >= 0:
        d_a_tile = d_a_ptr + rows[:, None] * stride_d_a_r + cols[None, :]
        tl.store(d_a_tile, d_a_prime, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_dgrad_epilogue_kernel(
    d_a_ptr, h_ptr, topk_weights_ptr, row_to_tk_ptr, d_h_ptr, a_weighted_ptr, d_w_partial_ptr, row_to_token_ptr,
    tile_to_expert_ptr, I,
    stride_d_a_r, stride_h_r, stride_a_r, stride_part_r, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr,
    H_BY_PAIR: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M, cdiv(I, BLOCK_N)); program (m, n) runs the down-dgrad epilogue on the
    dA' block (m, n), padding rows reading zeros, with router partial slot n."""
    # sizes and strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    I = aligned(I, ALIGN)
    stride_d_a_r = aligned(stride_d_a_r, ALIGN)
    stride_h_r = aligned(stride_h_r, ALIGN)
    stride_a_r = aligned(stride_a_r, ALIGN)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        d_a_prime = tl.load(
            d_a_ptr + rows[:, None] * stride_d_a_r + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
        )
        down_dgrad_epilogue(
            d_a_prime=d_a_prime, rows=rows, row_ok=row_ok, cols=cols, col_ok=col_ok, slot=pid_n, h_ptr=h_ptr,
            topk_weights_ptr=topk_weights_ptr, row_to_tk_ptr=row_to_tk_ptr, d_h_ptr=d_h_ptr,
            a_weighted_ptr=a_weighted_ptr, d_w_partial_ptr=d_w_partial_ptr,
            I=I, stride_h_r=stride_h_r, stride_a_r=stride_a_r, stride_part_r=stride_part_r,
            OUT_TY=h_ptr.dtype.element_ty, ACT=ACT, GATED=GATED, CLAMP=CLAMP, OFFSET=OFFSET, H_BY_PAIR=H_BY_PAIR,
        )


@triton.jit
def _gate_up_dgrad_kernel(
    d_h, w13, d_x_rows_ptr, row_to_token_ptr, row_to_tk_ptr, tile_to_expert_ptr, NUM_ROWS, COL_TILES, FIRST_COL_TILE, H,
    N1, stride_d_h_r, stride_w_e, stride_w_j, stride_d_x_r, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    H_BY_PAIR: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M * COL_TILES,), grouped; program p owns dx-rows tile p."""
    # sizes and strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    H = aligned(H, ALIGN)
    N1 = aligned(N1, ALIGN)
    stride_d_h_r = aligned(stride_d_h_r, ALIGN)
    stride_w_e = aligned(stride_w_e, ALIGN)
    stride_w_j = aligned(stride_w_j, ALIGN)
    stride_d_x_r = aligned(stride_d_x_r, ALIGN)
    pid_m, pid_n = grouped_pid(tl.program_id(0), NUM_ROWS // BLOCK_M, COL_TILES, GROUP_M)
    pid_n += FIRST_COL_TILE  # a column-tail launch's tiles follow the full ones (_launch_row_tiles)
    gate_up_dgrad_tile(
        pid_m, pid_n, d_h=d_h, w13=w13, d_x_rows_ptr=d_x_rows_ptr, row_to_token_ptr=row_to_token_ptr,
        row_to_tk_ptr=row_to_tk_ptr, tile_to_expert_ptr=tile_to_expert_ptr, H=H, N1=N1, stride_d_h_r=stride_d_h_r,
        stride_w_e=stride_w_e, stride_w_j=stride_w_j, stride_d_x_r=stride_d_x_r, TILE_M=TILE_M, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, TMA=TMA, H_BY_PAIR=H_BY_PAIR,
    )


@triton.jit
def _expert_wgrad_kernel(
    left, right, d_w_ptr, row_to_token_ptr, expert_offsets_ptr, tokens_per_expert_ptr, M_OUT, N_OUT, stride_left,
    stride_right, stride_d_w_e, stride_d_w_m, stride_d_w_n, LEFT_BY_TOKEN: tl.constexpr, RIGHT_BY_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, SWEEP: tl.constexpr, D_W_TRANSPOSED: tl.constexpr,
    ALIGN: tl.constexpr, RIGHT_INDEX_DIVISOR: tl.constexpr, KEEP_ONE_STEP_LEFT: tl.constexpr,
):
    """Grid: (E * cdiv(M_OUT, BLOCK_M) * cdiv(N_OUT, BLOCK_N),), expert-major and grouped within an
    expert, so the programs running together read the same expert's rows. With SWEEP, (E *
    cdiv(M_OUT, BLOCK_M),): a program per (expert, m-block) sweeps its n-blocks (tiles.wgrad_sweep)."""
    # sizes and strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    M_OUT = aligned(M_OUT, ALIGN)
    N_OUT = aligned(N_OUT, ALIGN)
    stride_left = aligned(stride_left, ALIGN)
    stride_right = aligned(stride_right, ALIGN)
    stride_d_w_e = aligned(stride_d_w_e, ALIGN)
    # d_w's unit stride (a constant 1 to the compiler) stays; its other one is restated too: unknown,
    # it turned a 128x256 tile's store into 2-byte stores with a pointer per element (255 registers,
    # spills in the sweep; H = 3000)
    if D_W_TRANSPOSED:
        stride_d_w_n = aligned(stride_d_w_n, ALIGN)
    else:
        stride_d_w_m = aligned(stride_d_w_m, ALIGN)
    num_pid_m = tl.cdiv(M_OUT, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    pid = tl.program_id(0)
    if SWEEP:
        wgrad_sweep(
            pid // num_pid_m, pid % num_pid_m, left=left, right=right, d_w_ptr=d_w_ptr,
            row_to_token_ptr=row_to_token_ptr, expert_offsets_ptr=expert_offsets_ptr,
            tokens_per_expert_ptr=tokens_per_expert_ptr, M_OUT=M_OUT, N_OUT=N_OUT, stride_left=stride_left,
            stride_right=stride_right, stride_d_w_e=stride_d_w_e, stride_d_w_m=stride_d_w_m,
            stride_d_w_n=stride_d_w_n, LEFT_BY_TOKEN=LEFT_BY_TOKEN, RIGHT_BY_TOKEN=RIGHT_BY_TOKEN, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, TMA=TMA,
            RIGHT_INDEX_DIVISOR=RIGHT_INDEX_DIVISOR, KEEP_ONE_STEP_LEFT=KEEP_ONE_STEP_LEFT,
        )
    else:
        pid_m, pid_n = grouped_pid(pid % (num_pid_m * num_pid_n), num_pid_m, num_pid_n, GROUP_M)
        wgrad_tile(
            pid // (num_pid_m * num_pid_n), pid_m, pid_n, left=left, right=right, d_w_ptr=d_w_ptr,
            row_to_token_ptr=row_to_token_ptr, expert_offsets_ptr=expert_offsets_ptr,
            tokens_per_expert_ptr=tokens_per_expert_ptr, M_OUT=M_OUT, N_OUT=N_OUT, stride_left=stride_left,
            stride_right=stride_right, stride_d_w_e=stride_d_w_e, stride_d_w_m=stride_d_w_m,
            stride_d_w_n=stride_d_w_n, LEFT_BY_TOKEN=LEFT_BY_TOKEN, RIGHT_BY_TOKEN=RIGHT_BY_TOKEN, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, TMA=TMA,
            RIGHT_INDEX_DIVISOR=RIGHT_INDEX_DIVISOR,
        )


@triton.jit
def _bias_grad_kernel(
    src, scale_ptr, d_b_ptr, row_to_token_ptr, expert_offsets_ptr, tokens_per_expert_ptr, N, stride_src,
    stride_d_b_e, BY_TOKEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (E, cdiv(N, BLOCK_N)); program (e, n) owns bias-gradient block (e, n)."""
    N = aligned(N, ALIGN)  # sizes and strides restated as multiples of ALIGN (tiles.aligned)
    stride_src = aligned(stride_src, ALIGN)
    stride_d_b_e = aligned(stride_d_b_e, ALIGN)
    bias_grad_tile(
        tl.program_id(0), tl.program_id(1), src=src, scale_ptr=scale_ptr, d_b_ptr=d_b_ptr,
        row_to_token_ptr=row_to_token_ptr, expert_offsets_ptr=expert_offsets_ptr,
        tokens_per_expert_ptr=tokens_per_expert_ptr, N=N, stride_src=stride_src, stride_d_b_e=stride_d_b_e,
        BY_TOKEN=BY_TOKEN, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
    )


@triton.jit
def _bias_router_grad_kernel(
    d_out_ptr, b2_ptr, d_w_partial_ptr, row_to_token_ptr, tile_to_expert_ptr, H, stride_d_out_t, stride_b2_e,
    stride_part_r, slot, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M,); program m writes partial column `slot` of row block m."""
    H = aligned(H, ALIGN)  # sizes and strides restated as multiples of ALIGN (tiles.aligned)
    stride_d_out_t = aligned(stride_d_out_t, ALIGN)
    stride_b2_e = aligned(stride_b2_e, ALIGN)
    bias_router_grad_tile(
        tl.program_id(0), d_out_ptr=d_out_ptr, b2_ptr=b2_ptr, d_w_partial_ptr=d_w_partial_ptr,
        row_to_token_ptr=row_to_token_ptr, tile_to_expert_ptr=tile_to_expert_ptr, H=H, stride_d_out_t=stride_d_out_t,
        stride_b2_e=stride_b2_e, stride_part_r=stride_part_r, slot=slot, TILE_M=TILE_M, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )


# ----------------------------------------------------------------------------------------------
# Launchers: check, allocate, launch. No autograd, no host synchronisation.
# ----------------------------------------------------------------------------------------------


def _row_gemm_config(
    kernel: str, n_out: int, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int,
    config: MoKTileConfig | None,
) -> tuple[MoKTileConfig, int]:
    """(the tile config, R_pad) of a row GEMM: `config` as given, else the pinned one, narrowed on a
    GPU where its launch would leave SMs idle (`spread_over_sms`: small batches)."""
    cfg = config or kernel_config(kernel, n_out)
    num_rows = check_schedule(row_to_token, tile_to_expert, tile_m, cfg.block_m)
    if config is None and row_to_token.is_cuda:
        cfg = spread_over_sms(cfg, num_rows // cfg.block_m, n_out, sm_count(row_to_token.device.index))
    return cfg, num_rows


def _on_hopper_rows(
    kernel: str, config: MoKTileConfig | None, rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, tile_m: int
) -> bool:
    """Whether row GEMM `kernel` runs on rows_hopper's Gluon kernel: named in HOPPER_ROW_GEMMS, no
    config asked for (a given config means the Triton kernel at that tile), the kernel takes it
    (down_fwd reads W2 K-major, gate_up_dgrad W13 N-major), and its tiles fill HOPPER_ROW_MIN_WAVES
    waves of the SMs."""
    return (
        kernel in HOPPER_ROW_GEMMS and config is None
        and rows_hopper.usable(rows, weights, out, tile_m, b_k_major=kernel == "down_fwd")
        and rows_hopper.tile_count(*out.shape) >= HOPPER_ROW_MIN_WAVES * sm_count(out.device.index)
    )  # fmt: skip


def _launch_row_tiles(
    kernel, cfg: MoKTileConfig, num_rows: int, n_out: int, dtype: torch.dtype, tile_m: int,
    by_tile: Callable[[MoKTileConfig], dict], **args,
) -> None:
    """Launch a row-tile kernel over (R_pad / BLOCK_M) x cdiv(n_out, BLOCK_N) tiles with config cfg;
    with SPLIT_COLUMN_TAIL, the last partial column block as a second launch at a narrower tile
    (`configs.column_tail`). by_tile(config): the arguments that depend on the tile (descriptors)."""
    tail = column_tail(cfg, n_out)
    full = n_out // cfg.block_n if tail else cdiv(n_out, cfg.block_n)
    launches = [(cfg, full, 0)]
    if tail:
        launches.append((tail, cdiv(n_out - full * cfg.block_n, tail.block_n), full * cfg.block_n // tail.block_n))
    sizes = [value for name, value in args.items() if is_size_or_stride(name)]  # what the kernels restate
    for tile_cfg, col_tiles, first_col_tile in launches:
        tile_cfg = stages_for(tile_cfg, dtype)
        launch(kernel, (num_rows // tile_cfg.block_m * col_tiles,),
            NUM_ROWS=num_rows, COL_TILES=col_tiles, FIRST_COL_TILE=first_col_tile, TILE_M=tile_m,
            BLOCK_M=tile_cfg.block_m, BLOCK_N=tile_cfg.block_n, BLOCK_K=tile_cfg.block_k, GROUP_M=tile_cfg.group_m,
            DOT_PRECISION=dot_precision(dtype), ALIGN=alignment(*sizes), num_warps=tile_cfg.num_warps,
            num_stages=tile_cfg.num_stages, **by_tile(tile_cfg), **args,
        )  # fmt: skip


def gate_up_fwd(
    x: torch.Tensor, gate_up_proj: torch.Tensor, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor,
    tile_m: int, config: MoKTileConfig | None = None, *, gate_up_bias: torch.Tensor | None = None,
    activation: str = "silu", gated: bool = True, clamp: float | None = None, offset: float = 0.0,
    h_pairs: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R_pad, N1] (+ the fc1 bias) and A [R_pad, I] = the activation of h (params dtype) for the
    gathered rows; N1 = 2I when gated, else I. Padding rows untouched.

    h_pairs: (the schedule's row_to_tk, T * K) to store h one row per (token, k) pair instead,
    [T * K, N1], row r's at row_to_tk[r] (small batches: ops.compact_h); a pair dropped by capacity
    keeps an unwritten row, which nothing reads."""
    check_tensor("x", x, 2)
    check_tensor("gate_up_proj", gate_up_proj, 3, x.dtype)
    E, N1, H = gate_up_proj.shape
    I = N1 // 2 if gated else N1
    if x.shape[1] != H:
        raise ValueError(f"x has H={x.shape[1]} but gate_up_proj has H={H}")
    if gate_up_bias is not None:
        check_tensor("gate_up_bias", gate_up_bias, 2, x.dtype)
    cfg, num_rows = _row_gemm_config("gate_up_fwd" if gated else "mlp_up_fwd", I, row_to_token, tile_to_expert,
                                     tile_m, config)  # fmt: skip
    row_to_tk, h_rows = (None, num_rows) if h_pairs is None else h_pairs
    h = torch.empty(h_rows, N1, dtype=x.dtype, device=x.device)
    a = torch.empty(num_rows, I, dtype=x.dtype, device=x.device)
    tma = tma_ok(cfg, gate_up_proj)
    joined = gate_up_joined(gated, tma)

    def weights(c: MoKTileConfig) -> dict:
        if joined:  # half 2e the gate rows of expert e, 2e + 1 its up rows (tiles.joined_gate_up_block)
            return dict(w13=descriptor(gate_up_proj.view(E * 2, I, H), [2, c.block_n, c.block_k], flatten=False))
        return dict(w13=descriptor(gate_up_proj, [c.block_n, c.block_k]) if tma else gate_up_proj)

    _launch_row_tiles(
        _gate_up_fwd_kernel, cfg, num_rows, I, x.dtype, tile_m, weights, x_ptr=x, b1_ptr=gate_up_bias,
        h_ptr=h, a_ptr=a, row_to_token_ptr=row_to_token, row_to_tk_ptr=row_to_tk, tile_to_expert_ptr=tile_to_expert,
        H=H, I=I, stride_x_t=x.stride(0), stride_w_e=gate_up_proj.stride(0), stride_w_n=gate_up_proj.stride(1),
        stride_b1_e=_stride0(gate_up_bias), stride_h_r=h.stride(0), stride_a_r=a.stride(0), TMA=tma, ACT=activation,
        GATED=gated, CLAMP=clamp, OFFSET=offset, H_BY_PAIR=h_pairs is not None, JOINED=joined,
    )
    return h, a


def gate_up_joined(gated: bool, tma: bool) -> bool:
    """Whether fc1's forward loads the gate and up blocks together into one accumulator
    (JOIN_GATE_UP): a gated family whose weights go through TMA."""
    return JOIN_GATE_UP and gated and tma


def _stride0(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.stride(0)


def down_fwd(
    a: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor, row_to_tk: torch.Tensor,
    row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, config: MoKTileConfig | None = None, *,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [R_pad, H] = w_r * (A[r] @ W2_e^T + b2_e) in the params dtype, w_r = topk_weights[row_to_tk[r]]
    (fp32 [T, K])."""
    check_tensor("a", a, 2)
    check_tensor("down_proj", down_proj, 3, a.dtype)
    topk_weights = routing_weights_arg(topk_weights)
    if down_bias is not None:
        check_tensor("down_bias", down_bias, 2, a.dtype)
    E, H, I = down_proj.shape
    cfg, num_rows = _row_gemm_config("down_fwd", H, row_to_token, tile_to_expert, tile_m, config)
    y = torch.empty(num_rows, H, dtype=a.dtype, device=a.device)
    if _on_hopper_rows("down_fwd", config, a, down_proj, y, tile_m):
        rows_hopper.row_gemm_hopper(a, down_proj, y, tile_to_expert, tile_m, b_k_major=True, down_bias=down_bias,
                                    routing=(topk_weights, row_to_tk))  # fmt: skip
        return y
    tma = tma_ok(cfg, a, down_proj)
    _launch_row_tiles(
        _down_fwd_kernel, cfg, num_rows, H, a.dtype, tile_m,
        lambda c: dict(w2=descriptor(down_proj, [c.block_n, c.block_k]) if tma else down_proj),
        a=descriptor(a, [cfg.block_m, cfg.block_k]) if tma else a, b2_ptr=down_bias,
        topk_weights_ptr=topk_weights, row_to_tk_ptr=row_to_tk, y_ptr=y, row_to_token_ptr=row_to_token,
        tile_to_expert_ptr=tile_to_expert, H=H, I=I,
        stride_a_r=a.stride(0), stride_w_e=down_proj.stride(0), stride_w_h=down_proj.stride(1),
        stride_b2_e=_stride0(down_bias), stride_y_r=y.stride(0), TMA=tma,
    )
    return y


def down_dgrad(
    d_out: torch.Tensor, down_proj: torch.Tensor, h: torch.Tensor, topk_weights: torch.Tensor, row_to_tk: torch.Tensor,
    row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, config: MoKTileConfig | None = None, *,
    down_bias: torch.Tensor | None = None, activation: str = "silu", gated: bool = True, clamp: float | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [R_pad, N1], w_r * A [R_pad, I], router partials fp32 [R_pad, J], set on routed rows only).

    h is the saved pre-activation [R_pad, N1] (N1 = 2I when gated, else I; for a linear expert the
    gathered input rows with activation "identity"), or [T * K, N1] one row per (token, k) pair
    (`gate_up_fwd`'s h_pairs), and then dh is too (padding rows have none). Two launches: a plain GEMM stores
    dA' = dO[t_r] @ W2_e in fp32, then an elementwise epilogue kernel fills dh, w*A and the router
    partials from it (kept apart, the GEMM keeps a plain epilogue and takes a 128x256 tile; fused,
    the epilogue's registers held it to 128x64). dA' is freed on return. Padding rows of every
    active row block hold zeros in dh and w*A. With the fc2 bias, a third launch writes each row's
    <dO, b2_e> into the last partial column (J = I-blocks + 1).
    """
    check_tensor("d_out", d_out, 2)
    check_tensor("down_proj", down_proj, 3, d_out.dtype)
    check_tensor("h", h, 2, d_out.dtype)
    num_pairs = topk_weights.numel()
    topk_weights = routing_weights_arg(topk_weights)
    if down_bias is not None:
        check_tensor("down_bias", down_bias, 2, d_out.dtype)
    E, H, I = down_proj.shape
    cfg, num_rows = _row_gemm_config("down_dgrad", I, row_to_token, tile_to_expert, tile_m, config)
    epi = kernel_config("down_dgrad_epilogue", I)
    h_by_pair = h.shape[0] != num_rows
    if h_by_pair and h.shape[0] != num_pairs:
        raise ValueError(f"h has {h.shape[0]} rows: neither the schedule's {num_rows} nor one per pair ({num_pairs})")
    d_h = torch.empty(h.shape[0], h.shape[1], dtype=d_out.dtype, device=d_out.device)
    a = torch.empty(num_rows, I, dtype=d_out.dtype, device=d_out.device)
    i_blocks = cdiv(I, epi.block_n)
    # Written for every routed row (all that reduce_router_grad reads); padding rows' entries are
    # left unset, which saved a fill launch (host time at small T).
    partial = torch.empty(num_rows, i_blocks + (down_bias is not None), dtype=torch.float32, device=d_out.device)
    d_a = torch.empty(num_rows, I, dtype=torch.float32, device=d_out.device)
    tma = tma_ok(cfg, down_proj)
    _launch_row_tiles(
        _down_dgrad_gemm_kernel, cfg, num_rows, I, d_out.dtype, tile_m,
        lambda c: dict(w2=descriptor(down_proj, [c.block_k, c.block_n]) if tma else down_proj), d_out_ptr=d_out,
        d_a_ptr=d_a, row_to_token_ptr=row_to_token, tile_to_expert_ptr=tile_to_expert, H=H, I=I,
        stride_d_out_t=d_out.stride(0), stride_w_e=down_proj.stride(0), stride_w_h=down_proj.stride(1),
        stride_d_a_r=d_a.stride(0), TMA=tma,
    )
    block_m = min(epi.block_m, cfg.block_m)
    if tile_m % block_m:
        raise ValueError(f"down_dgrad epilogue BLOCK_M={block_m} must divide the schedule's tile_m={tile_m}")
    launch(_down_dgrad_epilogue_kernel, (num_rows // block_m, i_blocks),
        d_a_ptr=d_a, h_ptr=h, topk_weights_ptr=topk_weights, row_to_tk_ptr=row_to_tk, d_h_ptr=d_h, a_weighted_ptr=a,
        d_w_partial_ptr=partial,
        row_to_token_ptr=row_to_token, tile_to_expert_ptr=tile_to_expert, I=I, stride_d_a_r=d_a.stride(0),
        stride_h_r=h.stride(0), stride_a_r=a.stride(0), stride_part_r=partial.stride(0), TILE_M=tile_m,
        BLOCK_M=block_m, BLOCK_N=epi.block_n, ACT=activation, GATED=gated, CLAMP=clamp, OFFSET=offset,
        H_BY_PAIR=h_by_pair, ALIGN=alignment(I, d_a.stride(0), h.stride(0), a.stride(0)), num_warps=epi.num_warps,
    )
    if down_bias is not None:
        launch(_bias_router_grad_kernel, (num_rows // block_m,),
            d_out, down_bias, partial, row_to_token, tile_to_expert, H, d_out.stride(0), down_bias.stride(0),
            partial.stride(0), i_blocks, TILE_M=tile_m, BLOCK_M=block_m, BLOCK_N=epi.block_n,
            ALIGN=alignment(H, d_out.stride(0), down_bias.stride(0)), num_warps=epi.num_warps,
        )
    return d_h, a, partial


def gate_up_dgrad(
    d_h: torch.Tensor, gate_up_proj: torch.Tensor, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor,
    tile_m: int, config: MoKTileConfig | None = None, *, d_h_row_to_pair: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx rows [R_pad, H] = dh[r] @ W13_e in the params dtype (dh [R_pad, N1], W13 [E, N1, H]).
    d_h_row_to_pair: the schedule's row_to_tk when dh is one row per (token, k) pair ([T * K, N1]:
    row r's at row_to_tk[r], read by pointer loads)."""
    check_tensor("d_h", d_h, 2)
    check_tensor("gate_up_proj", gate_up_proj, 3, d_h.dtype)
    E, N1, H = gate_up_proj.shape
    cfg, num_rows = _row_gemm_config("gate_up_dgrad", H, row_to_token, tile_to_expert, tile_m, config)
    d_x_rows = torch.empty(num_rows, H, dtype=d_h.dtype, device=d_h.device)
    by_pair = d_h_row_to_pair is not None
    if not by_pair and _on_hopper_rows("gate_up_dgrad", config, d_h, gate_up_proj, d_x_rows, tile_m):
        rows_hopper.row_gemm_hopper(d_h, gate_up_proj, d_x_rows, tile_to_expert, tile_m, b_k_major=False)
        return d_x_rows
    tma = tma_ok(cfg, gate_up_proj) if by_pair else tma_ok(cfg, d_h, gate_up_proj)
    _launch_row_tiles(
        _gate_up_dgrad_kernel, cfg, num_rows, H, d_h.dtype, tile_m,
        lambda c: dict(w13=descriptor(gate_up_proj, [c.block_k, c.block_n]) if tma else gate_up_proj),
        d_h=descriptor(d_h, [cfg.block_m, cfg.block_k]) if tma and not by_pair else d_h, d_x_rows_ptr=d_x_rows,
        row_to_token_ptr=row_to_token, row_to_tk_ptr=d_h_row_to_pair, tile_to_expert_ptr=tile_to_expert, H=H, N1=N1,
        stride_d_h_r=d_h.stride(0), stride_w_e=gate_up_proj.stride(0), stride_w_j=gate_up_proj.stride(1),
        stride_d_x_r=d_x_rows.stride(0), TMA=tma, H_BY_PAIR=by_pair,
    )
    return d_x_rows


def expert_wgrad(
    left: torch.Tensor, right: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor,
    tokens_per_expert: torch.Tensor, *, left_by_token: bool, right_by_token: bool, segment_align: int = 1,
    config: MoKTileConfig | None = None, right_index_divisor: int = 1,
) -> torch.Tensor:
    """dW [E, M, N] = per expert, sum over its rows of left[row]^T right[row] (rows in order).

    A "by token" operand is indexed through row_to_token (x or dO); otherwise by row (w*A or dh).
    segment_align: what every expert segment's start and padded length are a multiple of (the
    schedule's tile_m). TMA reads a by-row operand BLOCK_K rows at a time, so it is used only when
    segment_align is a multiple of BLOCK_K, and then the padding rows must hold finite values
    (down_dgrad writes zeros there). right_index_divisor, with both operands by token: right's row
    is the map's entry divided by it (dW13 of per-pair dh through row_to_tk, and x [T, H] with top_k:
    pair t * K + k reads token t's row, no copy of x per pair).

    Raises:
        ValueError: right_index_divisor under 1, or not 1 without both operands by token.
    """
    if right_index_divisor < 1 or (right_index_divisor != 1 and not (left_by_token and right_by_token)):
        raise ValueError(
            f"right_index_divisor={right_index_divisor}: expected 1, or any positive divisor with both operands "
            "by token"
        )
    check_tensor("left", left, 2)
    check_tensor("right", right, 2, left.dtype)
    check_tensor("expert_offsets", expert_offsets, 1, torch.int64)
    check_tensor("tokens_per_expert", tokens_per_expert, 1, torch.int64)
    E = tokens_per_expert.shape[0]
    M, N = left.shape[1], right.shape[1]
    by_row_width = N if left_by_token else M
    entry = wgrad_kernel(by_row_width, row_to_token.shape[0] // max(E, 1), M * N)  # the table's choice for this shape
    d_w = torch.empty(E, M, N, dtype=left.dtype, device=left.device)
    by_row, by_token = (right, left) if left_by_token else (left, right)
    schedule = None
    if config is None and left_by_token != right_by_token:
        schedule = hopper_wgrad_schedule(entry, by_row, by_token, segment_align)
    if schedule is not None:
        block = wgrad_hopper.BLOCK_M if left_by_token else wgrad_hopper.SCHEDULES[schedule].block_n
        for lhs, rhs, d_w_block in _pre_gathered_blocks(left, right, d_w, row_to_token, left_by_token, block):
            wgrad_hopper.expert_wgrad_hopper(lhs, rhs, d_w_block, expert_offsets, tokens_per_expert, schedule)
            del lhs, rhs  # before the next block's copy: one copy at a time
        return d_w
    cfg = stages_for(config or kernel_config(entry, by_row_width), left.dtype)
    if right_by_token and not left_by_token and not cfg.gather_rows:
        # dW = (right^T left)^T: rows gathered in the K loop are faster as the left operand (dW13
        # on olmoe: 2.41 ms with x as the right, 2.10 swapped); the transposed store is once a tile.
        _launch_wgrad(
            right, left, d_w.transpose(1, 2), row_to_token, expert_offsets, tokens_per_expert, True, False,
            segment_align, cfg,
        )
        return d_w
    if not (cfg.gather_rows and left_by_token != right_by_token):
        _launch_wgrad(
            left, right, d_w, row_to_token, expert_offsets, tokens_per_expert, left_by_token, right_by_token,
            segment_align, cfg, right_index_divisor,
        )
        return d_w
    block = cfg.block_m if left_by_token else cfg.block_n
    for lhs, rhs, d_w_block in _pre_gathered_blocks(left, right, d_w, row_to_token, left_by_token, block):
        _launch_wgrad(
            lhs, rhs, d_w_block, row_to_token, expert_offsets, tokens_per_expert, False, False, segment_align, cfg
        )
        del lhs, rhs  # before the next block's copy: one copy at a time
    return d_w


def hopper_wgrad_schedule(entry: str, by_row: torch.Tensor, by_token: torch.Tensor, segment_align: int) -> str | None:
    """Which of wgrad_hopper.SCHEDULES computes the weight gradient of a by-row operand (w*A or dh)
    and a by-token one (x or dO), in place of the table's Triton kernel `entry` (`wgrad_kernel`);
    None where the Triton kernel stays (not Hopper, a narrow by-row operand, or an entry Gluon does
    not beat)."""
    if (
        entry in HOPPER_WGRAD_REPLACES
        and by_row.shape[1] >= HOPPER_WGRAD_MIN_WIDTH
        and wgrad_hopper.usable(by_row, by_token, segment_align)
    ):
        return HOPPER_WGRAD_REPLACES[entry]
    return None


def pair_wgrad_hopper(
    d_h: torch.Tensor, x: torch.Tensor, row_to_token: torch.Tensor, row_to_tk: torch.Tensor,
    tile_to_expert: torch.Tensor, expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, tile_m: int,
) -> torch.Tensor | None:  # fmt: skip
    """dW13 [E, N1, H] of per-pair dh [T * K, N1] (ops.compact_h) and x [T, H] on Gluon's kernel, or
    None where the Triton kernel that reads both by pair stays: not on Hopper, no tokens, or copies
    that would not fit the memory below.

    TMA reads rows in order, so dh (zeros on padding rows) and x (token 0 there, as the padded layout
    reads) are copied into row order, each a
    column block at a time (`dense_rows`), in a layout of their own whose segments are padded to the
    kernel's 64-row K step rather than the schedule's tile_m (4096,7168,2048,384,8: 57k rows, not
    82k): the same rows in the same K steps, so the same bits as the padded layout. The two copies
    alive at once hold no more than a copy of x per pair would (T * K x H; the Triton kernel that
    stays elsewhere reads x through row_to_tk // K without one), and a copy's blocks are wide enough
    to pay (`pair_column_blocks`)."""
    num_experts, num_pairs = tokens_per_expert.shape[0], d_h.shape[0]
    align = wgrad_hopper.BLOCK_K
    if x.shape[0] == 0 or num_pairs == 0 or tile_m % align or d_h.shape[1] % 8 or x.shape[1] % 8:
        return None  # (the copies' blocks must keep TMA's 16-byte rows whatever d_h's and x's strides)
    entry = wgrad_kernel(d_h.shape[1], row_to_token.shape[0] // max(num_experts, 1), d_h.shape[1] * x.shape[1])
    schedule = hopper_wgrad_schedule(entry, d_h, x, tile_m)  # the padded layout's choice (expert_wgrad)
    if schedule is None:
        return None
    # Σ ceil(count / align) * align at most; each dense segment lies within the schedule's (whose
    # row count also knows a capacity)
    num_rows = min((num_pairs // align + min(num_experts, num_pairs)) * align, row_to_token.shape[0])
    x_pairs_bytes = num_pairs * x.shape[1] * x.element_size()
    plan = pair_column_blocks(num_rows * x.element_size(), d_h.shape[1], x.shape[1], x_pairs_bytes)
    if plan is None:
        return None
    dh_width, x_width = plan
    offsets = segment_offsets(tokens_per_expert, align)

    def rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return dense_rows(src, index, tile_to_expert, expert_offsets, offsets, num_rows, tile_m)

    d_w = x.new_empty(num_experts, d_h.shape[1], x.shape[1])
    order = row_to_token.clamp(min=0)  # x's padding rows read token 0, as in the padded layout (signed zeros too)
    for m0 in range(0, d_h.shape[1], dh_width):
        dh_rows = rows(d_h[:, m0 : m0 + dh_width], row_to_tk)
        for c0 in range(0, x.shape[1], x_width):
            x_rows = rows(x[:, c0 : c0 + x_width], order)
            d_w_block = d_w[:, m0 : m0 + dh_width, c0 : c0 + x_width]
            wgrad_hopper.expert_wgrad_hopper(dh_rows, x_rows, d_w_block, offsets, tokens_per_expert, schedule)
            del x_rows  # before the next block's copy
        del dh_rows
    return d_w


# dh in at most two blocks (x is gathered once per dh block); x blocks of at least 768 columns.
# Measured with the copies in the schedule's layout (128-row segments): 4096,7168,2048,384,8's
# (2048, 768) blocks took it from 38.44 to 35.28 ms, deepseek-v3's dimensions at T = 4096 (2048,
# 1536) from 31.31 to 27.51, but at T = 2048 (2048, 256) from 23.30 to 24.37. In the 64-row layout:
# (2048, 2048) 34.89 ms, and at T = 2048 (2048, 1536) 22.72 and, with 384 experts, (2048, 768)
# 33.15 -> 32.04 (BENCHMARKS.md, "dW13 of per-pair dh on Hopper").
PAIR_MAX_DH_BLOCKS = 2
PAIR_MIN_X_BLOCK = 768


def pair_column_blocks(bytes_per_col: int, dh_cols: int, x_cols: int, budget: int) -> tuple[int, int] | None:
    """(dh block width, x block width), multiples of 128 but where a whole side fits, whose gathered
    copies (bytes_per_col a column) hold at most `budget` bytes together: the fewest dh blocks (at
    most PAIR_MAX_DH_BLOCKS), then the widest x blocks; None where none fits."""
    for count in range(1, PAIR_MAX_DH_BLOCKS + 1):
        dh_width = min(dh_cols, cdiv(cdiv(dh_cols, count), 128) * 128)
        x_fit = (budget - dh_width * bytes_per_col) // bytes_per_col
        x_width = x_cols if x_fit >= x_cols else x_fit // 128 * 128
        if x_width >= min(x_cols, PAIR_MIN_X_BLOCK):
            return dh_width, x_width
    return None


def _pre_gathered_blocks(
    left: torch.Tensor, right: torch.Tensor, d_w: torch.Tensor, row_to_token: torch.Tensor, left_by_token: bool,
    block: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(left, right, d_w block) per column block of the by-token operand, whose block is copied into
    schedule row order, so that both operands are contiguous (`gather_column_blocks`: blocks of a
    multiple of `block` columns, at most GATHER_CHUNK_BYTES a copy). A padding row copies token 0,
    which meets the other operand's zero padding row; each block's weight gradient is a slice of
    d_w with the same row sums, so the result is bitwise the same whatever the blocks. The caller
    drops its references before asking for the next block, so one copy is alive at a time. With no
    tokens (an expert-parallel rank that received none) the one block is zeros, so that every
    expert's gradient is zero (token 0 of an empty tensor does not exist)."""
    by_token = left if left_by_token else right
    if by_token.shape[0] == 0:
        blocks = [(0, by_token.shape[1])]
        order = None
    else:
        order = row_to_token.clamp(min=0)
        blocks = gather_column_blocks(by_token.shape[1], order.shape[0] * by_token.element_size(), block)
    for c0, c1 in blocks:
        if order is None:
            rows = by_token.new_zeros(row_to_token.shape[0], by_token.shape[1])
        else:
            rows = by_token[:, c0:c1].index_select(0, order)
        if left_by_token:
            yield rows, right, d_w[:, c0:c1]
        else:
            yield left, rows, d_w[:, :, c0:c1]
        del rows  # this frame's reference, before the next block's copy


# The most bytes a pre-gathered weight-gradient operand holds at once (see expert_wgrad). dW13's
# copy of x is live at the backward's peak: 128 MiB (two blocks on mixtral-8x7b) keeps that peak
# under torch's path, 256 MiB put it 0.34 MiB over; the extra re-read of the other operand was not
# measurable (mixtral 31.13 vs 31.24 ms, deepseek-v3 46.23 vs 46.43 in one process; BENCHMARKS.md).
GATHER_CHUNK_BYTES = 128 * 2**20


def gather_column_blocks(num_cols: int, bytes_per_col: int, block: int) -> list[tuple[int, int]]:
    """[c0, c1) column ranges of about equal width, each a multiple of block (but the last), whose
    gathered copies hold at most GATHER_CHUNK_BYTES (at least one block each)."""
    count = max(1, cdiv(num_cols * bytes_per_col, GATHER_CHUNK_BYTES))
    width = max(block, cdiv(cdiv(num_cols, count), block) * block)
    return [(c0, min(c0 + width, num_cols)) for c0 in range(0, num_cols, width)]


def _launch_wgrad(
    left: torch.Tensor, right: torch.Tensor, d_w: torch.Tensor, row_to_token: torch.Tensor,
    expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, left_by_token: bool, right_by_token: bool,
    segment_align: int, cfg: MoKTileConfig, right_index_divisor: int = 1,
) -> None:
    """One weight-gradient launch into d_w [E, M, N] (any strides); a by-token right operand's rows
    through row_to_token // right_index_divisor."""
    E, M, N = d_w.shape
    transposed = d_w.stride(2) != 1  # dW13's swapped launch writes a transposed view
    grid = (E * cdiv(M, cfg.block_m) * (1 if cfg.sweep else cdiv(N, cfg.block_n)),)
    by_row = [t for t, by_token in ((left, left_by_token), (right, right_by_token)) if not by_token]
    tma = bool(by_row) and segment_align % cfg.block_k == 0 and tma_ok(cfg, *by_row)
    launch(_expert_wgrad_kernel, grid,
        descriptor(left, [cfg.block_k, cfg.block_m]) if tma and not left_by_token else left,
        descriptor(right, [cfg.block_k, cfg.block_n]) if tma and not right_by_token else right, d_w, row_to_token,
        expert_offsets, tokens_per_expert, M, N, left.stride(0), right.stride(0), d_w.stride(0), d_w.stride(1),
        d_w.stride(2), LEFT_BY_TOKEN=left_by_token, RIGHT_BY_TOKEN=right_by_token, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, DOT_PRECISION=dot_precision(left.dtype),
        TMA=tma, SWEEP=cfg.sweep, D_W_TRANSPOSED=transposed, RIGHT_INDEX_DIVISOR=right_index_divisor,
        KEEP_ONE_STEP_LEFT=cfg.sweep and SWEEP_KEEPS_ONE_STEP_LEFT,
        ALIGN=alignment(M, N, left.stride(0), right.stride(0), d_w.stride(0), d_w.stride(2 if transposed else 1)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# The sweep (tiles.wgrad_sweep) loads an expert's left tile once for all of a program's tiles where
# the expert's rows fit one K step (the small batches), instead of once a tile: the same products.
# Timed (v38, H100, `mok bench ab --graphs --set ...=False` is the way back): fwd+bwd 1.2 / 2.4 /
# 1.3 % faster at T = 1 / 37 / 512, the weight gradients 5-7 % at T = 37 and 512; same bits.
SWEEP_KEEPS_ONE_STEP_LEFT = True

# fc1's forward on a gated family with TMA: one accumulator of twice the width over the gate and up
# blocks of a single TMA load (tiles.joined_gate_up_block), instead of two that each read the x tile.
# Timed (v44, H100, `mok bench ab --set mok_plugin.kernels.grouped_mlp.JOIN_GATE_UP=False` is the way
# back): gate_up_fwd 6-7 % faster on qwen3-30b-a3b, olmoe and gpt-oss-120b, 0-1.5 % slower on
# deepseek-v3, within 3 % elsewhere; the same bits.
JOIN_GATE_UP = True

# The row GEMMs whose operands are whole rows, fc2's forward ("down_fwd") and fc1's dgrad of dh per row
# ("gate_up_dgrad"), that run on the persistent, warp-specialised Gluon kernel on Hopper (v47,
# kernels/rows_hopper.py) where it takes them and no config is given; the same bits as the Triton
# kernels. Off: timed on an H100 (session 57, BENCHMARKS.md "v47 timed at the layer on seven shapes"),
# fwd+bwd -2.0 % on qwen3-30b-a3b and -1.3 % on olmoe (output width 2048), +1 to +6 % on the four wider
# shapes, +1.9 % at qwen3's dimensions at T = 4096 and +34 % at T = 1 (a Gluon launch's host path).
# `mok bench ab --set "mok_plugin.kernels.grouped_mlp.HOPPER_ROW_GEMMS=('down_fwd','gate_up_dgrad')"`.
HOPPER_ROW_GEMMS: tuple[str, ...] = ()
# Below this many waves of the SMs in the Gluon kernel's tiles (128 x 256; R_pad's row blocks, padding
# included) those GEMMs stay on the Triton kernels, whose tiles narrow to spread over the SMs
# (`spread_over_sms`, v33): at T = 1 with qwen3-30b-a3b's dimensions fc2's forward is 8 row blocks x 8
# column blocks, 64 tiles for 132 SMs, where v47 took the step from 2.03 to 2.73 ms on an H100 (session
# 57). 0: the Gluon kernel at any batch (the GPU tests' small shapes).
HOPPER_ROW_MIN_WAVES = 1

# Rows per step and columns per program of the bias gradients: a [32, 128] fp32 block per step.
_BIAS_GRAD_BLOCK = (32, 128)


def expert_bias_grad(
    src: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor,
    *, by_token: bool, scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """d_b [E, N] in src's dtype = per expert, sum over its rows r of scale[r] * src[row r] (rows in
    ascending order, fp32). src is [T, N] indexed through row_to_token when by_token (db2: dO with
    the routing weights as scale), else [R_pad, N] (db1: dh)."""
    check_tensor("src", src, 2)
    check_tensor("expert_offsets", expert_offsets, 1, torch.int64)
    check_tensor("tokens_per_expert", tokens_per_expert, 1, torch.int64)
    if scale is not None:
        check_tensor("scale", scale, 1, torch.float32)
    E, N = tokens_per_expert.shape[0], src.shape[1]
    d_b = torch.empty(E, N, dtype=src.dtype, device=src.device)
    if E == 0 or N == 0:
        return d_b
    block_k, block_n = _BIAS_GRAD_BLOCK
    launch(_bias_grad_kernel, (E, cdiv(N, block_n)),
        src, scale, d_b, row_to_token, expert_offsets, tokens_per_expert, N, src.stride(0), d_b.stride(0),
        BY_TOKEN=by_token, BLOCK_K=block_k, BLOCK_N=block_n, ALIGN=alignment(N, src.stride(0), d_b.stride(0)),
        num_warps=4,
    )
    return d_b
