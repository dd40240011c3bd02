"""The experts' GEMMs in blockwise FP8 (issue 25) over the same row schedule as the bf16 kernels
(grouped_mlp.py); mok_plugin/fp8/reference.py defines their numbers, fp8/pipeline.py chains them.

Math (SB = the recipe's 128; sx, sw, ... the blocks' fp32 scale_inv):
    fp8_gate_up_fwd  h[r] = sum over K blocks kb of (x_q[t_r, kb] . W13_q[e, n, kb]) sx[t_r, kb] sw[e, n // SB, kb]
                     (+ b1), stored in the params dtype; A = act(h) quantised in 1 x SB blocks: A_q, sA
    fp8_down_fwd     y[r] = w_r * (sum over kb of (A_q[r, kb] . W2_q[e, n, kb]) sA[r, kb] sw2[...] + b2)
    fp8_down_dgrad   dA' = dO_q W2_q, then dh = act'(h) (w dA') and w*A quantised in its epilogue, and
                     the router partials <dA', A_q> per I-block
    fp8_gate_up_dgrad  dx rows = dh_q W13_q, the gate half's blocks then the up half's
    fp8_wgrad        dW[e] = sum over e's 128-row blocks of left^T right, scaled per (block, column)

Each K step is one scale block (BLOCK_K = SB): its FP8 product is summed by the MMA in fp32, then
scaled and added to an fp32 accumulator in ascending block order (the recipe's promotion), so every
output has one owner and one fixed order: bitwise repeatable. An fc1 tile is SB columns wide, so
its A columns are exactly one quantisation block and the epilogue quantises them in registers.
Pointer loads; the tiles are TILES's (BENCHMARKS.md, f0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok_plugin.fp8.recipe import FP8Format
from mok_plugin.kernels import fp8_fc1_hopper, fp8_hopper
from mok_plugin.kernels.configs import interpreter_on
from mok_plugin.kernels.fp8 import quantize_block
from mok_plugin.kernels.launch import cdiv, check_tensor, routing_weights_arg
from mok_plugin.kernels.tiles import (
    activation_grad_of_rows,
    bias_router_grad_tile,
    expert_activation,
    routing_weights_of_rows,
    tile_rows,
)

__all__ = [
    "fp8_activation",
    "fp8_block_matmul",
    "fp8_down_dgrad",
    "fp8_down_fwd",
    "fp8_gate_up_dgrad",
    "fp8_gate_up_fwd",
    "fp8_wgrad",
]


@triton.jit
def fp8_block_matmul(
    a_ptr, a_scale_ptr, a_rows, a_row_ok, stride_a, stride_a_scale, w_ptr, w_scale_ptr, stride_w_k, stride_w_n,
    stride_ws_k, stride_ws_n, w_cols, w_scale_cols, w_col_ok, K_DIM, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, acc=None,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] = acc (zeros if None) + the sum over K blocks kb, ascending, of
    (a[a_rows, kb] . w[kb, w_cols]) * sa[a_rows, kb] * sw[kb, w_scale_cols // SCALE_BLOCK], each
    added to it in turn.

    a: FP8 rows (element (r, k) at a_ptr + r * stride_a + k), 1 x SCALE_BLOCK scales (r, kb) at
    a_scale_ptr + r * stride_a_scale + kb. w: one FP8 matrix, element (k, n) at w_ptr + k * stride_w_k
    + n * stride_w_n, SCALE_BLOCK x SCALE_BLOCK scales (kb, nb) at w_scale_ptr + kb * stride_ws_k +
    nb * stride_ws_n; w_scale_cols are w_cols' indices in the matrix the scales tile (a glu's up half
    is tiled from its own first row). Each K step is one scale block: the MMA's fp32 sum of its FP8
    products, scaled, is added to the fp32 accumulator (the recipe's promotion)."""
    if acc is None:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + w_cols[None, :] * stride_w_n
    w_scales = w_scale_ptr + (w_scale_cols // SCALE_BLOCK) * stride_ws_n
    # A tile no wider than a scale block lies in one (its first column a multiple of BLOCK_N, which
    # divides SCALE_BLOCK): one weight scale per K step, so each row's two scales multiply once and the
    # product scales the MMA's sum in one FMA per element, not two multiplies and an add. The same bits
    # with power-of-two scales (every product exact); the sm_90 loop: 64 FMAs a step, was 128 + 64.
    w_scale_one = w_scale_ptr + (tl.min(w_scale_cols, axis=0) // SCALE_BLOCK) * stride_ws_n
    for k0 in range(0, K_DIM, SCALE_BLOCK):
        ks = k0 + tl.arange(0, SCALE_BLOCK)
        k_ok = ks < K_DIM
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=a_row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None] * stride_w_k, mask=k_ok[:, None] & w_col_ok[None, :], other=0.0)
        kb = k0 // SCALE_BLOCK
        a_scale = tl.load(a_scale_ptr + a_rows * stride_a_scale + kb, mask=a_row_ok, other=0.0)
        if BLOCK_N <= SCALE_BLOCK:
            row_scale = a_scale * tl.load(w_scale_one + kb * stride_ws_k)
            acc += tl.dot(a, w) * row_scale[:, None]
        else:
            w_scale = tl.load(w_scales + kb * stride_ws_k, mask=w_col_ok, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    return acc


@triton.jit
def _row_tile(row_to_token_ptr, tile_to_expert_ptr, N, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """(expert, rows, tokens, row_ok, cols, col_ok, pid_m, pid_n) of this program on a grid of
    (R_pad / BLOCK_M) x cdiv(N, BLOCK_N) tiles, column blocks fastest; expert < 0: no work."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_pid_n, tl.program_id(0) % num_pid_n
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, tokens, row_ok, cols, cols < N, pid_m, pid_n


@triton.jit
def _fp8_gate_up_fwd_kernel(
    x_ptr,
    x_scale_ptr,
    w13_ptr,
    w13_scale_ptr,
    b1_ptr,
    h_ptr,
    a_ptr,
    a_scale_ptr,
    row_to_token_ptr,
    tile_to_expert_ptr,
    H,
    I,
    stride_x_t,
    stride_x_scale,
    stride_w_e,
    stride_w_n,
    stride_ws_e,
    stride_ws_half,
    stride_ws_n,
    stride_b1_e,
    stride_h_r,
    stride_a_r,
    stride_a_scale,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,
    OFFSET: tl.constexpr,
    MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXPONENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M * cdiv(I, SCALE_BLOCK),); program (m, n) owns rows m-block of h's gate and
    up columns n-block and of A_q, and A's scale column n."""
    expert, rows, tokens, row_ok, cols, col_ok, pid_m, pid_n = _row_tile(
        row_to_token_ptr, tile_to_expert_ptr, I, TILE_M, BLOCK_M, SCALE_BLOCK
    )
    if expert >= 0:
        w13 = w13_ptr + expert * stride_w_e  # [N1, H]: k (H) contiguous, n = the fc1 row
        w13_scales = w13_scale_ptr + expert * stride_ws_e
        gate = fp8_block_matmul(
            x_ptr, x_scale_ptr, tokens, row_ok, stride_x_t, stride_x_scale, w13, w13_scales, 1, stride_w_n, 1,
            stride_ws_n, cols, cols, col_ok, H, BLOCK_M, SCALE_BLOCK, SCALE_BLOCK,
        )  # fmt: skip
        if b1_ptr is not None:
            gate += tl.load(b1_ptr + expert * stride_b1_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ty = h_ptr.dtype.element_ty
        mask = row_ok[:, None] & col_ok[None, :]
        h_tile = h_ptr + rows[:, None] * stride_h_r + cols[None, :]
        tl.store(h_tile, gate.to(out_ty), mask=mask)
        up = gate
        if GATED:  # the up half: fc1 rows I + n of the same weight, with its own scales (quantised apart)
            up = fp8_block_matmul(
                x_ptr, x_scale_ptr, tokens, row_ok, stride_x_t, stride_x_scale, w13, w13_scales + stride_ws_half, 1,
                stride_w_n, 1, stride_ws_n, cols + I, cols, col_ok, H, BLOCK_M, SCALE_BLOCK, SCALE_BLOCK,
            )  # fmt: skip
            if b1_ptr is not None:
                up += tl.load(b1_ptr + expert * stride_b1_e + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(h_tile + I, up.to(out_ty), mask=mask)
        # A from the rounded h (as the backward recomputes it)
        _store_quantised_activation(
            gate.to(out_ty).to(tl.float32), up.to(out_ty).to(tl.float32), a_ptr, a_scale_ptr, rows, row_ok, cols,
            col_ok, pid_n, stride_a_r, stride_a_scale, ACT, GATED, CLAMP, OFFSET, MAX, MANTISSA_BITS,
            MIN_NORMAL_EXPONENT, POWER_OF_2,
        )  # fmt: skip


@triton.jit
def _store_quantised_activation(
    gate, up, a_ptr, a_scale_ptr, rows, row_ok, cols, col_ok, pid_n, stride_a_r, stride_a_scale, ACT: tl.constexpr,
    GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXPONENT: tl.constexpr, POWER_OF_2: tl.constexpr,
):  # fmt: skip
    """A = act(h) of a tile of fc1's rows and one 128-wide I-block (h's halves in fp32, as stored),
    quantised 1 x 128 (its columns are one block; those past I zeros): A_q and its scale column pid_n."""
    a = expert_activation(gate, up, ACT=ACT, GATED=GATED, CLAMP=CLAMP, OFFSET=OFFSET)
    a = tl.where(col_ok[None, :], a, 0.0)
    a_q, a_scale_inv = quantize_block(a, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2, 1,
                                      STORED=a_ptr.dtype.element_ty)  # fmt: skip
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(a_ptr + rows[:, None] * stride_a_r + cols[None, :], a_q, mask=mask)
    tl.store(a_scale_ptr + rows * stride_a_scale + pid_n, a_scale_inv, mask=row_ok)


@triton.jit
def _fp8_activation_kernel(
    h_ptr, a_ptr, a_scale_ptr, row_to_token_ptr, tile_to_expert_ptr, I, stride_h_r, stride_a_r, stride_a_scale,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, SCALE_BLOCK: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    CLAMP: tl.constexpr, OFFSET: tl.constexpr, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXPONENT: tl.constexpr, POWER_OF_2: tl.constexpr,
):  # fmt: skip
    """_fp8_gate_up_fwd_kernel's grid and A_q, from the h it would store: fc1's forward split in two,
    the GEMM on fp8_hopper's row kernel (MOK_HOPPER_FP8_FC1_SPLIT), then this."""
    expert, rows, tokens, row_ok, cols, col_ok, pid_m, pid_n = _row_tile(
        row_to_token_ptr, tile_to_expert_ptr, I, TILE_M, BLOCK_M, SCALE_BLOCK
    )
    if expert >= 0:
        h_tile = h_ptr + rows[:, None] * stride_h_r + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        gate = tl.load(h_tile, mask=mask, other=0.0).to(tl.float32)
        up = gate
        if GATED:
            up = tl.load(h_tile + I, mask=mask, other=0.0).to(tl.float32)
        _store_quantised_activation(
            gate, up, a_ptr, a_scale_ptr, rows, row_ok, cols, col_ok, pid_n, stride_a_r, stride_a_scale, ACT, GATED,
            CLAMP, OFFSET, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2,
        )  # fmt: skip


@triton.jit
def _fp8_down_fwd_kernel(
    a_ptr,
    a_scale_ptr,
    w2_ptr,
    w2_scale_ptr,
    b2_ptr,
    topk_weights_ptr,
    row_to_tk_ptr,
    y_ptr,
    row_to_token_ptr,
    tile_to_expert_ptr,
    H,
    I,
    stride_a_r,
    stride_a_scale,
    stride_w_e,
    stride_w_h,
    stride_ws_e,
    stride_ws_h,
    stride_b2_e,
    stride_y_r,
    TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """Grid: (R_pad / BLOCK_M * cdiv(H, BLOCK_N),); program (m, n) owns y[m-block, n-block]."""
    expert, rows, tokens, row_ok, cols, col_ok, pid_m, pid_n = _row_tile(
        row_to_token_ptr, tile_to_expert_ptr, H, TILE_M, BLOCK_M, BLOCK_N
    )
    if expert >= 0:
        acc = fp8_block_matmul(  # W2 [H, I]: k (I) contiguous, n = h
            a_ptr, a_scale_ptr, rows, row_ok, stride_a_r, stride_a_scale, w2_ptr + expert * stride_w_e,
            w2_scale_ptr + expert * stride_ws_e, 1, stride_w_h, 1, stride_ws_h, cols, cols, col_ok, I, BLOCK_M, BLOCK_N,
            SCALE_BLOCK,
        )  # fmt: skip
        if b2_ptr is not None:
            acc += tl.load(b2_ptr + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w = routing_weights_of_rows(topk_weights_ptr, row_to_tk_ptr, rows, row_ok)
        y_tile = y_ptr + rows[:, None] * stride_y_r + cols[None, :]
        tl.store(y_tile, (acc * w[:, None]).to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# The compiled kernels' tiles, one entry per kernel: BLOCK_M (a divisor of the schedule's 128-row
# segments), BLOCK_N where the kernel's epilogue does not fix it at the 128-wide quantisation block
# (down_fwd, down_dgrad_gemm, gate_up_dgrad, wgrad), warps and pipeline stages. Under the interpreter: small tiles.
# A tile shape changes no sum's order (each K step is one scale block, added in ascending order), so
# the values are the same bits for every entry; `mok bench fp8 --sweep` times the candidates.
TILES: dict[str, dict[str, int | bool]] = {
    "gate_up_fwd": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3},
    "down_fwd": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    # fc2's dgrad as two kernels: the GEMM (dA' in fp32) and its epilogue (f3; fused, 6.5 ms on qwen3-30b-a3b).
    # Swept on qwen3-30b-a3b (H200): the GEMM 0.63 ms at 64 x 128 w4 s4 against 0.68 at 128 x 128 w8 s3;
    # the epilogue 1.42 ms in 16 warps against 2.66 in 8 (5.00 in 4). Since then (sm_90 compiles, not timed)
    # 7560 -> 5136 instructions a thread in 16 warps (the GPU's FP8 conversion, scales from exponent
    # bits); UP_WITH_A (dh's up half in A's pass: two passes, not three) 4736, both 8 bytes of stack;
    # in 32 warps 3440 (64 registers: two programs an SM's worth of warps)
    "down_dgrad_gemm": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    # A from h when fc1's GEMM runs apart (MOK_HOPPER_FP8_FC1_SPLIT): elementwise, 32 rows of a 128-wide block
    "activation": {"BLOCK_M": 32, "num_warps": 4, "num_stages": 1},
    # the sweep at 4aaa485 (qwen3-30b-a3b, H200): 8 warps with UP_WITH_A 0.98 ms; 16 warps 1.12 (1.08 with it);
    # 32 warps 1.53-1.57; 8 warps without it 1.71. PERSISTENT (session 42, H100, out/probe_ep.py): mixtral
    # 2.21 -> 2.05 ms, qwen3 1.04 -> 0.95, deepseek-v3 1.44 -> 1.40 (in 16 warps slower: 2.93, 1.31, 1.90);
    # UP_WITH_A is then moot (one pass)
    "down_dgrad_epilogue": {"num_warps": 8, "num_stages": 1, "UP_WITH_A": True, "PERSISTENT": True},
    # 64 x 128 in 4 warps, 4 stages: 1.75 ms against 1.88 at 128 x 128, 8 warps (qwen3-30b-a3b, H200)
    "gate_up_dgrad": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    "wgrad": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
}
_INTERPRETED = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def _tiles(kernel: str) -> dict[str, int]:
    """TILES[kernel] compiled, or the interpreter's small tiles (its choices that are not sizes kept)."""
    if not interpreter_on():
        return dict(TILES[kernel])
    return {key: _INTERPRETED.get(key, value) for key, value in TILES[kernel].items()}


# fc2's persistent dgrad epilogue holds a tile's dA' and h in shared memory (the sm_90 compile's 151 KB)
PERSISTENT_EPILOGUE_SHARED_BYTES = 151 * 1024


def _persistent_programs(device: torch.device) -> int | None:
    """Programs of fc2's persistent dgrad epilogue, whose pipelined tile takes most of an SM's shared
    memory: one an SM; a few under the interpreter; None where a program cannot have that much
    (Ada's 99 KB): there the tile-a-program kernel runs."""
    if interpreter_on() or device.type != "cuda":
        return 3
    properties = torch.cuda.get_device_properties(device)
    if properties.shared_memory_per_block_optin < PERSISTENT_EPILOGUE_SHARED_BYTES:
        return None
    return properties.multi_processor_count


def _row_tiles(
    kernel: str, num_rows: int, n_out: int, tile_m: int, block_n: int | None = None
) -> tuple[tuple[int], dict, int]:
    """(grid, launch meta, BLOCK_N) of row-tile kernel `kernel` over (R_pad / BLOCK_M) x cdiv(n_out,
    BLOCK_N) tiles (`_tiles`; block_n: fixed by the kernel's epilogue)."""
    meta = _tiles(kernel)
    meta["BLOCK_M"] = min(meta["BLOCK_M"], tile_m)
    block_n = block_n or meta.pop("BLOCK_N")
    meta.pop("BLOCK_N", None)
    return (num_rows // meta["BLOCK_M"] * cdiv(n_out, block_n),), {"TILE_M": tile_m, **meta}, block_n


def fp8_gate_up_fwd(
    x_q: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor,
    tile_m: int,
    fmt: FP8Format,
    *,
    out_dtype: torch.dtype,
    scale_block: int = 128,
    power_of_2: bool = True,
    gate_up_bias: torch.Tensor | None = None,
    activation: str = "silu",
    gated: bool = True,
    clamp: float | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [R_pad, N1] in out_dtype, A_q [R_pad, I] in fmt.dtype, fp32 A scale_inv [R_pad, cdiv(I, 128)])
    of the gathered rows of x_q ([T, H], 1 x 128 scales) and the experts' W13_q ([E, N1, H], scales
    [E, halves, cdiv(I, 128), cdiv(H, 128)]: a glu's gate and up quantised apart, `quantize_fc1`); A is
    quantised into `fmt`. Padding rows untouched (by the Triton kernel). On Hopper, unless
    `MOK_HOPPER_FP8_ROWS=0`, on x_q's rows copied into row order: where I is a multiple of 128, h by
    fp8_hopper's row GEMM over all N1 columns and A from h by `_fp8_activation_kernel`, else (or with
    `MOK_HOPPER_FP8_FC1_SPLIT=0`) the fused Gluon kernel (fp8_fc1_hopper.py); the same bits."""
    check_tensor("x_q", x_q, 2)
    check_tensor("w13_q", w13_q, 3, x_q.dtype)
    E, N1, H = w13_q.shape
    I = N1 // 2 if gated else N1
    if x_q.shape[1] != H or x_scale_inv.shape != (x_q.shape[0], cdiv(H, scale_block)):
        raise ValueError(f"x_q {tuple(x_q.shape)} / scales {tuple(x_scale_inv.shape)} do not match H={H}")
    num_rows = row_to_token.shape[0]
    h = torch.empty(num_rows, N1, dtype=out_dtype, device=x_q.device)
    a_q = torch.empty(num_rows, I, dtype=fmt.dtype, device=x_q.device)
    a_scale_inv = torch.empty(num_rows, cdiv(I, scale_block), dtype=torch.float32, device=x_q.device)
    # (no tokens: every tile is padding, and the copy of x's rows would have no token 0 to stand in)
    hopper = scale_block == fp8_hopper.BLOCK_K and x_q.shape[0] > 0 and w13_q.is_contiguous()
    if hopper and fp8_hopper.enabled(fp8_hopper.ROWS_SETTING):
        h_halves = (h[:, :I], h[:, I:]) if gated else (h,)
        w13_rows = w13_q.view(E * N1, H)
        split = fp8_hopper.enabled(fp8_fc1_hopper.SPLIT_SETTING) and I % scale_block == 0
        if split and fp8_hopper.usable((x_q, w13_rows), h, tile_m):
            # h as one GEMM over fc1's N1 columns (each 128-column block inside a half, whose scales then
            # lie in order), A from h by its own kernel: no warpgroup holds the gate's and up's sums at once
            x_rows, x_rows_scale = fp8_fc1_hopper.gathered_rows(x_q, x_scale_inv, row_to_token)
            w_scales = w13_scale_inv.reshape(E, N1 // scale_block, -1)
            fp8_hopper.fp8_rows_hopper((x_rows,), x_rows_scale, (w13_rows,), w_scales, h, tile_to_expert, tile_m,
                                       down_bias=gate_up_bias)  # fmt: skip
            fp8_activation(
                h, a_q, a_scale_inv, row_to_token, tile_to_expert, tile_m, fmt, scale_block=scale_block,
                power_of_2=power_of_2, activation=activation, gated=gated, clamp=clamp, offset=offset,
            )  # fmt: skip
            return h, a_q, a_scale_inv
        if fp8_fc1_hopper.usable(x_q, w13_rows, h_halves, a_q, tile_m, activation):
            x_rows, x_rows_scale = fp8_fc1_hopper.gathered_rows(x_q, x_scale_inv, row_to_token)
            fp8_fc1_hopper.fp8_fc1_hopper(
                x_rows, x_rows_scale, w13_q, w13_scale_inv, h, a_q, a_scale_inv, tile_to_expert, tile_m, fmt,
                power_of_2=power_of_2, gate_up_bias=gate_up_bias, activation=activation, gated=gated, clamp=clamp,
                offset=offset,
            )  # fmt: skip
            return h, a_q, a_scale_inv
    grid, meta, _ = _row_tiles("gate_up_fwd", num_rows, I, tile_m, block_n=scale_block)
    if grid[0]:
        _fp8_gate_up_fwd_kernel[grid](
            x_q, x_scale_inv, w13_q, w13_scale_inv, gate_up_bias, h, a_q, a_scale_inv, row_to_token, tile_to_expert,
            H, I, x_q.stride(0), x_scale_inv.stride(0), w13_q.stride(0), w13_q.stride(1), w13_scale_inv.stride(0),
            w13_scale_inv.stride(1), w13_scale_inv.stride(2), 0 if gate_up_bias is None else gate_up_bias.stride(0),
            h.stride(0), a_q.stride(0), a_scale_inv.stride(0), SCALE_BLOCK=scale_block, ACT=activation, GATED=gated,
            CLAMP=clamp, OFFSET=offset, MAX=fmt.max, MANTISSA_BITS=fmt.mantissa_bits,
            MIN_NORMAL_EXPONENT=fmt.min_normal_exponent, POWER_OF_2=power_of_2, **meta,
        )  # fmt: skip
    return h, a_q, a_scale_inv


def fp8_activation(
    h: torch.Tensor, a_q: torch.Tensor, a_scale_inv: torch.Tensor, row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor, tile_m: int, fmt: FP8Format, *, scale_block: int = 128, power_of_2: bool = True,
    activation: str = "silu", gated: bool = True, clamp: float | None = None, offset: float = 0.0,
) -> None:  # fmt: skip
    """A_q [R_pad, I] and its scales [R_pad, cdiv(I, 128)] from fc1's output h [R_pad, N1] (as
    fp8_gate_up_fwd stores it), as fp8_gate_up_fwd computes them: fc1's forward when its GEMM ran
    apart. Padding rows untouched."""
    num_rows, I = a_q.shape
    grid, meta, _ = _row_tiles("activation", num_rows, I, tile_m, block_n=scale_block)
    if grid[0]:
        _fp8_activation_kernel[grid](
            h, a_q, a_scale_inv, row_to_token, tile_to_expert, I, h.stride(0), a_q.stride(0), a_scale_inv.stride(0),
            SCALE_BLOCK=scale_block, ACT=activation, GATED=gated, CLAMP=clamp, OFFSET=offset, MAX=fmt.max,
            MANTISSA_BITS=fmt.mantissa_bits, MIN_NORMAL_EXPONENT=fmt.min_normal_exponent, POWER_OF_2=power_of_2,
            **meta,
        )  # fmt: skip


def fp8_down_fwd(
    a_q: torch.Tensor,
    a_scale_inv: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    row_to_tk: torch.Tensor,
    row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor,
    tile_m: int,
    *,
    out_dtype: torch.dtype,
    scale_block: int = 128,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [R_pad, H] in out_dtype = w_r * (A_q[r] @ W2_q[e]^T, block-scaled, + b2_e), from A_q ([R_pad, I],
    1 x 128 scales) and W2_q ([E, H, I], 128 x 128 scales). On Hopper, unless `MOK_HOPPER_FP8_ROWS=0`, the
    Gluon kernel (fp8_hopper.py)."""
    check_tensor("a_q", a_q, 2)
    check_tensor("w2_q", w2_q, 3, a_q.dtype)
    topk_weights = routing_weights_arg(topk_weights)
    E, H, I = w2_q.shape
    num_rows = row_to_token.shape[0]
    y = torch.empty(num_rows, H, dtype=out_dtype, device=a_q.device)
    operands = fp8_hopper.usable_row_gemm(a_q, w2_q, False, y, tile_m, scale_block)
    if operands is not None:
        rows, weights = operands
        fp8_hopper.fp8_rows_hopper(rows, a_scale_inv, weights, w2_scale_inv, y, tile_to_expert, tile_m,
                                   down_bias=down_bias, routing=(topk_weights, row_to_tk))  # fmt: skip
        return y
    grid, meta, block_n = _row_tiles("down_fwd", num_rows, H, tile_m)
    if grid[0]:
        _fp8_down_fwd_kernel[grid](
            a_q, a_scale_inv, w2_q, w2_scale_inv, down_bias, topk_weights, row_to_tk, y, row_to_token, tile_to_expert,
            H, I, a_q.stride(0), a_scale_inv.stride(0), w2_q.stride(0), w2_q.stride(1), w2_scale_inv.stride(0),
            w2_scale_inv.stride(1), 0 if down_bias is None else down_bias.stride(0), y.stride(0), BLOCK_N=block_n,
            SCALE_BLOCK=scale_block, **meta,
        )  # fmt: skip
    return y


# ----------------------------------------------------------------------------------------------
# Backward. Row blocks are one scale block tall (BLOCK_M = 128 = the segment alignment), so the
# epilogue that produces dh and w*A quantises them both ways: 1 x 128 along the columns (for dX) and
# 128 x 1 along the rows (for the weight gradients), from the fp32 values in registers.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fp8_down_dgrad_gemm_kernel(
    d_out_q, d_out_scale, w2t_ptr, w2t_scale_ptr, d_a_ptr, row_to_token_ptr, tile_to_expert_ptr, H, I, stride_do_t,
    stride_do_scale, stride_w_e, stride_w_i, stride_ws_e, stride_ws_i, stride_da_r, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(I, BLOCK_N),); program (m, n) owns dA'[m-block, n-block] = dO_q W2_q
    over H, from W2's transposed copy W2^T [I, H] (both operands K-major, as Hopper's FP8 MMA takes
    them), stored in fp32 for the epilogue kernel. Padding rows untouched."""
    expert, rows, tokens, row_ok, cols, col_ok, pid_m, pid_n = _row_tile(
        row_to_token_ptr, tile_to_expert_ptr, I, TILE_M, BLOCK_M, BLOCK_N
    )
    if expert >= 0:
        d_a_prime = fp8_block_matmul(  # W2^T [I, H]: k = h (contiguous), n = i
            d_out_q, d_out_scale, tokens, row_ok, stride_do_t, stride_do_scale, w2t_ptr + expert * stride_w_e,
            w2t_scale_ptr + expert * stride_ws_e, 1, stride_w_i, 1, stride_ws_i, cols, cols, col_ok, H, BLOCK_M,
            BLOCK_N, SCALE_BLOCK,
        )  # fmt: skip
        d_a_tile = d_a_ptr + rows[:, None] * stride_da_r + cols[None, :]
        tl.store(d_a_tile, d_a_prime, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fp8_down_dgrad_epilogue_kernel(
    d_a_ptr, h_ptr, topk_weights_ptr, row_to_tk_ptr, row_to_token_ptr, tile_to_expert_ptr, dh_ptr, dh_q_ptr,
    dh_scale_ptr, dh_colt_ptr, dh_col_scale_ptr, wa_colt_ptr, wa_col_scale_ptr, partial_ptr, I, NUM_TILES,
    stride_da_r, stride_h_r, stride_dh_r, stride_dh_scale_r, stride_dh_scale_half, stride_dh_colt,
    stride_dh_col_scale, stride_wa_colt, stride_wa_col_scale, stride_part_r, TILE_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr,
    F_MAX: tl.constexpr, F_MANTISSA: tl.constexpr, F_MIN_EXP: tl.constexpr, B_MAX: tl.constexpr,
    B_MANTISSA: tl.constexpr, B_MIN_EXP: tl.constexpr, POWER_OF_2: tl.constexpr, UP_WITH_A: tl.constexpr,
    PERSISTENT: tl.constexpr, SEGMENT_TILES_POW2: tl.constexpr,
):  # fmt: skip
    """NUM_TILES = R_pad / SCALE_BLOCK * cdiv(I, SCALE_BLOCK) tiles; tile (m, n) is rows m-block, I-block n:
    from dA' (fp32, the GEMM kernel's), dh (gate and up columns n), w*A, and the router partial column
    n. The 128 x 1 copies are stored transposed ([columns, R_pad]), K-major for the weight gradients.
    dh_ptr (with the fc1 bias, else None) also gets dh unquantised, in the params dtype, for its
    gradient. Apart from the GEMM (v10's split for bf16): fused, the epilogue's live tiles spilled.

    Grid (NUM_TILES,), a tile a program in passes that reload its inputs (below); or PERSISTENT: fewer
    programs, each looping over tiles with the next tile's dA' and h copied into shared memory while
    this one computes (Triton's pipeliner, 2 stages), one pass each, up to the last tile in use (the
    schedule's row space ends in unused tiles, a sixth of deepseek-v3's: SEGMENT_TILES_POW2 >= its
    R_pad / TILE_M). The same bits either way."""
    # the tile's operands and outputs, the same for every tile
    operands = (d_a_ptr, h_ptr, topk_weights_ptr, row_to_tk_ptr, row_to_token_ptr, tile_to_expert_ptr, dh_ptr, dh_q_ptr,
                dh_scale_ptr, dh_colt_ptr, dh_col_scale_ptr, wa_colt_ptr, wa_col_scale_ptr, partial_ptr, I, stride_da_r,
                stride_h_r, stride_dh_r, stride_dh_scale_r, stride_dh_scale_half, stride_dh_colt, stride_dh_col_scale,
                stride_wa_colt, stride_wa_col_scale, stride_part_r)  # fmt: skip
    if PERSISTENT:
        i_blocks = tl.cdiv(I, SCALE_BLOCK)
        segments = tl.arange(0, SEGMENT_TILES_POW2)
        num_segments = NUM_TILES // i_blocks // (TILE_M // SCALE_BLOCK)
        experts = tl.load(tile_to_expert_ptr + segments, mask=segments < num_segments, other=-1)
        row_blocks_in_use = tl.max(tl.where(experts >= 0, segments + 1, 0)) * (TILE_M // SCALE_BLOCK)
        for tile in tl.range(tl.program_id(0), row_blocks_in_use * i_blocks, tl.num_programs(0), num_stages=2):
            _fp8_down_dgrad_epilogue_tile(
                tile, *operands, TILE_M, SCALE_BLOCK, ACT, GATED, CLAMP, OFFSET, F_MAX, F_MANTISSA, F_MIN_EXP, B_MAX,
                B_MANTISSA, B_MIN_EXP, POWER_OF_2, UP_WITH_A, ONE_PASS=True,
            )  # fmt: skip
    else:
        pid_m = tl.program_id(0) // tl.cdiv(I, SCALE_BLOCK)
        if tl.load(tile_to_expert_ptr + (pid_m * SCALE_BLOCK) // TILE_M) >= 0:  # else past the schedule's end
            _fp8_down_dgrad_epilogue_tile(
                tl.program_id(0), *operands, TILE_M, SCALE_BLOCK, ACT, GATED, CLAMP, OFFSET, F_MAX, F_MANTISSA,
                F_MIN_EXP, B_MAX, B_MANTISSA, B_MIN_EXP, POWER_OF_2, UP_WITH_A, ONE_PASS=False,
            )  # fmt: skip


@triton.jit
def _fp8_down_dgrad_epilogue_tile(
    tile, d_a_ptr, h_ptr, topk_weights_ptr, row_to_tk_ptr, row_to_token_ptr, tile_to_expert_ptr, dh_ptr, dh_q_ptr,
    dh_scale_ptr, dh_colt_ptr, dh_col_scale_ptr, wa_colt_ptr, wa_col_scale_ptr, partial_ptr, I, stride_da_r,
    stride_h_r, stride_dh_r, stride_dh_scale_r, stride_dh_scale_half, stride_dh_colt, stride_dh_col_scale,
    stride_wa_colt, stride_wa_col_scale, stride_part_r, TILE_M: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr, F_MAX: tl.constexpr,
    F_MANTISSA: tl.constexpr, F_MIN_EXP: tl.constexpr, B_MAX: tl.constexpr, B_MANTISSA: tl.constexpr,
    B_MIN_EXP: tl.constexpr, POWER_OF_2: tl.constexpr, UP_WITH_A: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    """_fp8_down_dgrad_epilogue_kernel's tile `tile` (I-blocks fastest), one pass or several. A tile past
    the schedule's end (its expert < 0) is masked throughout, stores nothing (a persistent loop's
    loads are pipelined only without a branch around them)."""
    num_pid_n = tl.cdiv(I, SCALE_BLOCK)
    pid_m, pid_n = tile // num_pid_n, tile % num_pid_n
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, SCALE_BLOCK)
    cols = pid_n * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    row_ok = row_ok & (expert >= 0)
    col_ok = (cols < I) & (expert >= 0)
    valid = row_ok[:, None] & col_ok[None, :]
    w = routing_weights_of_rows(topk_weights_ptr, row_to_tk_ptr, rows, row_ok)
    dh = (dh_ptr, dh_q_ptr, dh_scale_ptr, dh_colt_ptr, dh_col_scale_ptr, stride_dh_r, stride_dh_scale_r,
          stride_dh_scale_half, stride_dh_colt, stride_dh_col_scale)  # fmt: skip
    # Without ONE_PASS, passes over the tile, each reloading dA' and h (from L2) and computing only
    # what it stores (the compiler drops the rest): with A, dgate and dup live at once the tile spilled.
    # 1. A: the router partial <dA', A_q> over this I-block (A_q as the forward quantised it), and
    #    w * A, 128 x 1 along the rows (dW2), from the unquantised A; with UP_WITH_A (or ONE_PASS),
    #    dh's up columns too, which need A's act(gate) only (one pass fewer, more registers live)
    d_a_prime = tl.load(d_a_ptr + rows[:, None] * stride_da_r + cols[None, :], mask=valid, other=0.0)
    a, d_gate, d_up = activation_grad_of_rows(
        h_ptr, rows, row_ok, cols, col_ok, stride_h_r, I, d_a_prime * w[:, None], ACT, GATED, CLAMP, OFFSET
    )
    a = tl.where(valid, a, 0.0)
    a_q, a_scale_inv = quantize_block(a, F_MAX, F_MANTISSA, F_MIN_EXP, POWER_OF_2, 1)
    tl.store(partial_ptr + rows * stride_part_r + pid_n, tl.sum(d_a_prime * a_q * a_scale_inv[:, None], axis=1),
             mask=row_ok)  # fmt: skip
    q, s = quantize_block(w[:, None] * a, F_MAX, F_MANTISSA, F_MIN_EXP, POWER_OF_2, 0,
                          STORED=wa_colt_ptr.dtype.element_ty)  # fmt: skip
    # the 128 x 1 copies are stored on padding rows too (zeros): the weight gradients read whole blocks
    tl.store(wa_colt_ptr + cols[None, :] * stride_wa_colt + rows[:, None], q, mask=col_ok[None, :])
    tl.store(wa_col_scale_ptr + pid_m * stride_wa_col_scale + cols, s, mask=col_ok)
    if GATED and (UP_WITH_A or ONE_PASS):
        _dh_half_outputs(tl.where(valid, d_up, 0.0), 1, *dh, rows, row_ok, cols, col_ok, pid_m, pid_n, I, B_MAX,
                         B_MANTISSA, B_MIN_EXP, POWER_OF_2)  # fmt: skip
    if ONE_PASS:
        _dh_half_outputs(tl.where(valid, d_gate, 0.0), 0, *dh, rows, row_ok, cols, col_ok, pid_m, pid_n, I,
                         B_MAX, B_MANTISSA, B_MIN_EXP, POWER_OF_2)  # fmt: skip
    else:
        # 2. dh's gate columns (without a gate: dh); 3. its up columns, unless pass 1 stored them
        for half in tl.static_range(2 if GATED and not UP_WITH_A else 1):
            d_a_prime = tl.load(d_a_ptr + rows[:, None] * stride_da_r + cols[None, :], mask=valid, other=0.0)
            _, d_gate, d_up = activation_grad_of_rows(
                h_ptr, rows, row_ok, cols, col_ok, stride_h_r, I, d_a_prime * w[:, None], ACT, GATED, CLAMP,
                OFFSET,
            )  # fmt: skip
            _dh_half_outputs(tl.where(valid, d_gate if half == 0 else d_up, 0.0), half, *dh, rows, row_ok, cols,
                             col_ok, pid_m, pid_n, I, B_MAX, B_MANTISSA, B_MIN_EXP, POWER_OF_2)  # fmt: skip


@triton.jit
def _dh_half_outputs(
    d_h, half, dh_ptr, dh_q_ptr, dh_scale_ptr, dh_colt_ptr, dh_col_scale_ptr, stride_dh_r, stride_dh_scale_r,
    stride_dh_scale_half, stride_dh_colt, stride_dh_col_scale, rows, row_ok, cols, col_ok, pid_m, pid_n, I,
    MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, POWER_OF_2: tl.constexpr,
):  # fmt: skip
    """One half of dh (0: gate columns, 1: up) of the epilogue's tile, zeros outside the valid rows
    and columns: unquantised into dh_ptr (the fc1 bias's gradient; None without one), 1 x 128 along
    the columns (dX) and 128 x 1 along the rows, stored transposed with padding rows' zeros (dW13)."""
    valid = row_ok[:, None] & col_ok[None, :]
    dh_ty = dh_q_ptr.dtype.element_ty
    if dh_ptr is not None:
        tl.store(dh_ptr + rows[:, None] * stride_dh_r + half * I + cols[None, :], d_h.to(dh_ptr.dtype.element_ty),
                 mask=valid)  # fmt: skip
    q, s = quantize_block(d_h, MAX, MANTISSA, MIN_EXP, POWER_OF_2, 1, STORED=dh_ty)
    tl.store(dh_q_ptr + rows[:, None] * stride_dh_r + half * I + cols[None, :], q, mask=valid)
    tl.store(dh_scale_ptr + rows * stride_dh_scale_r + half * stride_dh_scale_half + pid_n, s, mask=row_ok)
    q, s = quantize_block(d_h, MAX, MANTISSA, MIN_EXP, POWER_OF_2, 0, STORED=dh_ty)
    tl.store(dh_colt_ptr + (half * I + cols[None, :]) * stride_dh_colt + rows[:, None], q, mask=col_ok[None, :])
    tl.store(dh_col_scale_ptr + pid_m * stride_dh_col_scale + half * I + cols, s, mask=col_ok)


@triton.jit
def _fp8_gate_up_dgrad_kernel(
    dh_q_ptr, dh_scale_ptr, w13t_ptr, w13t_scale_ptr, dx_ptr, row_to_token_ptr, tile_to_expert_ptr, H, I, stride_dh_r,
    stride_dh_scale_r, stride_dh_scale_half, stride_w_e, stride_w_h, stride_ws_e, stride_ws_half, stride_ws_h,
    stride_dx_r, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M * cdiv(H, BLOCK_N),); program (m, n) owns dx rows[m-block, n-block]:
    dh_q W13_q over fc1's rows, the gate half's blocks then the up half's into one accumulator (as
    fp8_hopper.py's kernel sums them), from W13's transposed copy W13^T [H, N1] (K-major)."""
    expert, rows, tokens, row_ok, cols, col_ok, pid_m, pid_n = _row_tile(
        row_to_token_ptr, tile_to_expert_ptr, H, TILE_M, BLOCK_M, BLOCK_N
    )
    if expert >= 0:
        w13t = w13t_ptr + expert * stride_w_e  # [H, N1]: k = the fc1 row (contiguous), n = h
        w13t_scales = w13t_scale_ptr + expert * stride_ws_e
        acc = fp8_block_matmul(
            dh_q_ptr, dh_scale_ptr, rows, row_ok, stride_dh_r, stride_dh_scale_r, w13t, w13t_scales, 1, stride_w_h, 1,
            stride_ws_h, cols, cols, col_ok, I, BLOCK_M, BLOCK_N, SCALE_BLOCK,
        )  # fmt: skip
        if GATED:  # the up half's blocks added to the same accumulator, after the gate half's
            acc = fp8_block_matmul(
                dh_q_ptr + I, dh_scale_ptr + stride_dh_scale_half, rows, row_ok, stride_dh_r, stride_dh_scale_r,
                w13t + I, w13t_scales + stride_ws_half, 1, stride_w_h, 1, stride_ws_h, cols, cols, col_ok, I, BLOCK_M,
                BLOCK_N, SCALE_BLOCK, acc,
            )  # fmt: skip
        dx_tile = dx_ptr + rows[:, None] * stride_dx_r + cols[None, :]
        tl.store(dx_tile, acc.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fp8_wgrad_kernel(
    left_t, left_scale, right_t, right_scale, d_w_ptr, expert_offsets_ptr, tokens_per_expert_ptr, M_OUT, N_OUT,
    stride_l, stride_ls, stride_r, stride_rs, stride_dw_e, stride_dw_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid: (E * cdiv(M_OUT, BLOCK_M) * cdiv(N_OUT, BLOCK_N),); program (e, m, n) owns dW[e, m-block,
    n-block] = sum over e's 128-row blocks, ascending, of left^T right scaled per (block, column) on
    both sides; zeros for an expert with no rows. Both operands quantised 128 x 1 along the schedule's
    rows (segments start at multiples of 128, so a block is one expert's) and stored transposed,
    [columns, R_pad]: the rows, the reduction, contiguous (K-major)."""
    num_pid_m, num_pid_n = tl.cdiv(M_OUT, BLOCK_M), tl.cdiv(N_OUT, BLOCK_N)
    pid = tl.program_id(0)
    expert = (pid // (num_pid_m * num_pid_n)).to(tl.int64)
    pid_m, pid_n = (pid // num_pid_n) % num_pid_m, pid % num_pid_n
    ms = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = ms < M_OUT, ns < N_OUT
    # Said to Triton: without it the rows' alignment is unknown, so the operands load through registers
    # in one buffer (sm_90 compile: 1 buffer, no async copies); with it, 3 cp.async stages, no spills.
    start = tl.multiple_of(tl.load(expert_offsets_ptr + expert), SCALE_BLOCK)
    end = start + tl.load(tokens_per_expert_ptr + expert)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, SCALE_BLOCK):
        rows = r0 + tl.arange(0, SCALE_BLOCK)
        lhs = tl.load(left_t + ms[:, None] * stride_l + rows[None, :], mask=m_ok[:, None], other=0.0)
        rhs = tl.load(right_t + ns[None, :] * stride_r + rows[:, None], mask=n_ok[None, :], other=0.0)
        block = r0 // SCALE_BLOCK
        l_scale = tl.load(left_scale + block * stride_ls + ms, mask=m_ok, other=0.0)
        r_scale = tl.load(right_scale + block * stride_rs + ns, mask=n_ok, other=0.0)
        acc += tl.dot(lhs, rhs) * l_scale[:, None] * r_scale[None, :]
    d_w = d_w_ptr + expert * stride_dw_e + ms[:, None] * stride_dw_m + ns[None, :]
    tl.store(d_w, acc.to(d_w_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_down_dgrad(
    d_out_q: torch.Tensor, d_out_scale_inv: torch.Tensor, w2t_q: torch.Tensor, w2t_scale_inv: torch.Tensor,
    h: torch.Tensor, topk_weights: torch.Tensor, row_to_tk: torch.Tensor, row_to_token: torch.Tensor,
    tile_to_expert: torch.Tensor, tile_m: int, fwd: FP8Format, bwd: FP8Format, *, scale_block: int = 128,
    power_of_2: bool = True, activation: str = "silu", gated: bool = True, clamp: float | None = None,
    offset: float = 0.0, gate_up_bias: bool = False, down_bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The FP8 backward through fc2 and the activation, from dO_q ([T, H], 1 x 128 scales), W2's
    transposed FP8 copy (`transposed_copy`: [E, I, H], scales [E, cdiv(I, 128), cdiv(H, 128)]) and the
    forward's h: {"dh_q" [R_pad, N1] and "dh_scale_inv" [R_pad, halves, cdiv(I, 128)] (1 x 128 per
    half, `bwd`), "dh_colt" [N1, R_pad] and "dh_col_scale_inv" [R_pad / 128, N1] (128 x 1, stored
    transposed, `bwd`), "wa_colt" [I, R_pad] and "wa_col_scale_inv" [R_pad / 128, I] (w * A, likewise,
    `fwd`), "partial" fp32 [R_pad, cdiv(I, 128)] (the router gradient's per-block sums, for
    combine.reduce_router_grad)}. With gate_up_bias (True: the experts' fc1 has one) also "dh"
    [R_pad, N1], unquantised in h's dtype; with down_bias (b2 [E, H]) one more partial column,
    <dO_q[t_r], b2_e> (`_fp8_bias_router_kernel`). On Hopper, unless `MOK_HOPPER_FP8_ROWS=0`, the
    GEMM by the Gluon row kernel (fp8_hopper.py), on dO_q's rows copied into row order."""
    topk_weights = routing_weights_arg(topk_weights)
    if tile_m % scale_block:
        raise ValueError(f"segments padded to {tile_m} rows: the FP8 backward needs a multiple of {scale_block}")
    E, I, H = w2t_q.shape
    num_rows, n1 = row_to_token.shape[0], h.shape[1]
    halves, blocks = n1 // I, cdiv(I, scale_block)
    dev = h.device
    out = {
        "dh_q": torch.empty(num_rows, n1, dtype=bwd.dtype, device=dev),
        "dh_scale_inv": torch.empty(num_rows, halves, blocks, dtype=torch.float32, device=dev),
        "dh_colt": torch.empty(n1, num_rows, dtype=bwd.dtype, device=dev),
        "dh_col_scale_inv": torch.empty(num_rows // scale_block, n1, dtype=torch.float32, device=dev),
        "wa_colt": torch.empty(I, num_rows, dtype=fwd.dtype, device=dev),
        "wa_col_scale_inv": torch.empty(num_rows // scale_block, I, dtype=torch.float32, device=dev),
        "partial": torch.empty(num_rows, blocks + (down_bias is not None), dtype=torch.float32, device=dev),
    }
    if gate_up_bias:
        out["dh"] = torch.empty(num_rows, n1, dtype=h.dtype, device=dev)
    if num_rows:
        d_a_prime = torch.empty(num_rows, I, dtype=torch.float32, device=dev)  # dA', between the two kernels
        if not _down_dgrad_gemm_on_hopper(d_out_q, d_out_scale_inv, w2t_q, w2t_scale_inv, d_a_prime, row_to_token,
                                          tile_to_expert, tile_m, scale_block):  # fmt: skip
            grid, meta, block_n = _row_tiles("down_dgrad_gemm", num_rows, I, tile_m)
            _fp8_down_dgrad_gemm_kernel[grid](
                d_out_q, d_out_scale_inv, w2t_q, w2t_scale_inv, d_a_prime, row_to_token, tile_to_expert, H, I,
                d_out_q.stride(0), d_out_scale_inv.stride(0), w2t_q.stride(0), w2t_q.stride(1),
                w2t_scale_inv.stride(0), w2t_scale_inv.stride(1), d_a_prime.stride(0), BLOCK_N=block_n,
                SCALE_BLOCK=scale_block, **meta,
            )  # fmt: skip
        num_tiles = num_rows // scale_block * blocks
        epilogue = _tiles("down_dgrad_epilogue")
        persistent_programs = _persistent_programs(dev) if epilogue["PERSISTENT"] else None
        epilogue["PERSISTENT"] = persistent_programs is not None
        programs = num_tiles if persistent_programs is None else min(num_tiles, persistent_programs)
        _fp8_down_dgrad_epilogue_kernel[(programs,)](
            d_a_prime, h, topk_weights, row_to_tk, row_to_token, tile_to_expert, out.get("dh"), out["dh_q"],
            out["dh_scale_inv"], out["dh_colt"], out["dh_col_scale_inv"], out["wa_colt"], out["wa_col_scale_inv"],
            out["partial"], I, num_tiles, d_a_prime.stride(0), h.stride(0), out["dh_q"].stride(0),
            out["dh_scale_inv"].stride(0), out["dh_scale_inv"].stride(1), out["dh_colt"].stride(0),
            out["dh_col_scale_inv"].stride(0), out["wa_colt"].stride(0), out["wa_col_scale_inv"].stride(0),
            out["partial"].stride(0), TILE_M=tile_m,
            SCALE_BLOCK=scale_block, ACT=activation, GATED=gated, CLAMP=clamp, OFFSET=offset, F_MAX=fwd.max,
            F_MANTISSA=fwd.mantissa_bits, F_MIN_EXP=fwd.min_normal_exponent, B_MAX=bwd.max,
            B_MANTISSA=bwd.mantissa_bits, B_MIN_EXP=bwd.min_normal_exponent, POWER_OF_2=power_of_2,
            SEGMENT_TILES_POW2=triton.next_power_of_2(tile_to_expert.shape[0]) if epilogue["PERSISTENT"] else 1,
            **epilogue,
        )  # fmt: skip
    if down_bias is not None and num_rows:
        # 32 rows in 8 warps a program: 128 rows in 4 spilled in an sm_90 compile (255 registers, 1.5 KB
        # of stack a thread; 32 rows in 4: 24 bytes); 32 in 8: 205 registers, none. Not timed on a GPU.
        _fp8_bias_router_kernel[(num_rows // _BIAS_ROUTER_ROWS,)](
            d_out_q, d_out_scale_inv, down_bias, out["partial"], row_to_token, tile_to_expert, H, d_out_q.stride(0),
            d_out_scale_inv.stride(0), down_bias.stride(0), out["partial"].stride(0), blocks, TILE_M=tile_m,
            BLOCK_M=_BIAS_ROUTER_ROWS, SCALE_BLOCK=scale_block, num_warps=8,
        )  # fmt: skip
    return out


def _down_dgrad_gemm_on_hopper(
    d_out_q: torch.Tensor, d_out_scale_inv: torch.Tensor, w2t_q: torch.Tensor, w2t_scale_inv: torch.Tensor,
    d_a_prime: torch.Tensor, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, scale_block: int,
) -> bool:  # fmt: skip
    """dA' = dO_q W2_q (fp8_down_dgrad's GEMM) by the Gluon row kernel, on dO_q's rows copied into row
    order (as fc1's forward copies x_q's), where it can run unless `MOK_HOPPER_FP8_ROWS=0`: whether
    it did. Its padding rows get values of no meaning (the epilogue masks them)."""
    # (no tokens: the copy of dO's rows would have no token 0 to stand in for padding rows)
    operands = None if d_out_q.shape[0] == 0 else fp8_hopper.usable_row_gemm(d_out_q, w2t_q, False, d_a_prime,
                                                                             tile_m, scale_block)  # fmt: skip
    if operands is None:
        return False
    rows, rows_scale = fp8_fc1_hopper.gathered_rows(d_out_q, d_out_scale_inv, row_to_token)
    fp8_hopper.fp8_rows_hopper((rows,), rows_scale, operands[1], w2t_scale_inv, d_a_prime, tile_to_expert, tile_m)
    return True


_BIAS_ROUTER_ROWS = 32


@triton.jit
def _fp8_bias_router_kernel(
    d_out_q, d_out_scale, b2_ptr, partial_ptr, row_to_token_ptr, tile_to_expert_ptr, H, stride_do_t, stride_do_scale,
    stride_b2_e, stride_part_r, slot, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK_M,): the fc2 bias's share of the router gradient, <dO_q[t_r], b2_e> (dO as
    the dgrad read it, quantised), into partial column `slot`: the bf16 path's tile with dO's scales."""
    bias_router_grad_tile(
        tl.program_id(0), d_out_ptr=d_out_q, b2_ptr=b2_ptr, d_w_partial_ptr=partial_ptr,
        row_to_token_ptr=row_to_token_ptr, tile_to_expert_ptr=tile_to_expert_ptr, H=H, stride_d_out_t=stride_do_t,
        stride_b2_e=stride_b2_e, stride_part_r=stride_part_r, slot=slot, TILE_M=TILE_M, BLOCK_M=BLOCK_M,
        BLOCK_N=SCALE_BLOCK, d_out_scale_ptr=d_out_scale, stride_scale_t=stride_do_scale,
    )  # fmt: skip


def fp8_gate_up_dgrad(
    dh_q: torch.Tensor, dh_scale_inv: torch.Tensor, w13t_q: torch.Tensor, w13t_scale_inv: torch.Tensor,
    row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, *, out_dtype: torch.dtype,
    scale_block: int = 128, gated: bool = True,
) -> torch.Tensor:  # fmt: skip
    """dx rows [R_pad, H] in out_dtype = dh_q W13_q, block-scaled (dh 1 x 128 per half; W13's transposed
    FP8 copy [E, H, N1], scales [E, halves, cdiv(H, 128), cdiv(I, 128)]); summed over k by
    combine.combine_rows. On Hopper, unless `MOK_HOPPER_FP8_ROWS=0`, the Gluon kernel
    (fp8_hopper.py)."""
    E, H, N1 = w13t_q.shape
    I = N1 // 2 if gated else N1
    num_rows = row_to_token.shape[0]
    dx = torch.empty(num_rows, H, dtype=out_dtype, device=dh_q.device)
    operands = fp8_hopper.usable_row_gemm(dh_q, w13t_q, gated, dx, tile_m, scale_block)
    if operands is not None:
        fp8_hopper.fp8_rows_hopper(operands[0], dh_scale_inv, operands[1], w13t_scale_inv, dx, tile_to_expert, tile_m)
        return dx
    grid, meta, block_n = _row_tiles("gate_up_dgrad", num_rows, H, tile_m)
    if grid[0]:
        _fp8_gate_up_dgrad_kernel[grid](
            dh_q, dh_scale_inv, w13t_q, w13t_scale_inv, dx, row_to_token, tile_to_expert, H, I, dh_q.stride(0),
            dh_scale_inv.stride(0), dh_scale_inv.stride(1), w13t_q.stride(0), w13t_q.stride(1),
            w13t_scale_inv.stride(0), w13t_scale_inv.stride(1), w13t_scale_inv.stride(2), dx.stride(0), BLOCK_N=block_n,
            SCALE_BLOCK=scale_block, GATED=gated, **meta,
        )  # fmt: skip
    return dx


def fp8_wgrad(
    left_t: torch.Tensor, left_scale_inv: torch.Tensor, right_t: torch.Tensor, right_scale_inv: torch.Tensor,
    expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, *, out_dtype: torch.dtype, scale_block: int = 128,
) -> torch.Tensor:  # fmt: skip
    """dW [E, M, N] in out_dtype, dW[e] = left[e's rows]^T right[e's rows]: both operands quantised
    128 x 1 along the schedule's rows and stored transposed (left_t [M, R_pad], right_t [N, R_pad];
    scales [R_pad / 128, M] and [R_pad / 128, N]). expert_offsets must be multiples of 128 (a
    schedule with tile_m a multiple of 128, which fp8_down_dgrad checks): the kernel relies on it.
    On Hopper, unless `MOK_HOPPER_FP8_WGRAD=0`, the Gluon kernel (fp8_hopper.py)."""
    E = tokens_per_expert.shape[0]
    M, N = left_t.shape[0], right_t.shape[0]
    d_w = torch.empty(E, M, N, dtype=out_dtype, device=left_t.device)
    hopper = scale_block == fp8_hopper.BLOCK_K and fp8_hopper.enabled(fp8_hopper.WGRAD_SETTING)
    if hopper and fp8_hopper.usable((left_t, right_t), d_w.flatten(0, 1), scales=(left_scale_inv, right_scale_inv)):
        fp8_hopper.fp8_wgrad_hopper(left_t, left_scale_inv, right_t, right_scale_inv, d_w, expert_offsets,
                                    tokens_per_expert)  # fmt: skip
        return d_w
    tiles = _tiles("wgrad")
    block_m, block_n = tiles.pop("BLOCK_M"), tiles.pop("BLOCK_N")
    grid = (E * cdiv(M, block_m) * cdiv(N, block_n),)
    if grid[0]:
        _fp8_wgrad_kernel[grid](
            left_t, left_scale_inv, right_t, right_scale_inv, d_w, expert_offsets, tokens_per_expert, M, N,
            left_t.stride(0), left_scale_inv.stride(0), right_t.stride(0), right_scale_inv.stride(0), d_w.stride(0),
            d_w.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, SCALE_BLOCK=scale_block, **tiles,
        )  # fmt: skip
    return d_w
