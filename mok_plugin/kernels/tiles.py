"""Triton device functions that compute one output tile each: the arithmetic of every MoE kernel.

Both variants call these functions: the multi-kernel variant (`grouped_mlp.py`, `combine.py`) from
one kernel per pass and tile kind, the persistent megakernel (`megakernel.py`) from its task list.
So the two run the same arithmetic with the same tile shapes. Nothing here launches anything.

Math, per expert e over its rows r (token t_r, routing weight w_r), with the dimension letters
(T tokens, H hidden, I expert intermediate, E experts, K top-k), written for a glu expert (N1 = 2I
fc1 rows; an mlp has N1 = I and no up half; mok_plugin/experts.py has the families):
    gate_up_tile          h[r] = x[t_r] @ W13_e^T + b1_e  [N1]; A[r] = act(h[r])  [I]
    down_tile             y[r] = w_r * (A[r] @ W2_e^T + b2_e)  [H]
    down_dgrad_block      dA'[r] = dO[t_r] @ W2_e  [I]
    down_dgrad_epilogue   from dA': the router partial <dA', A> per I-block, w_r * A[r] (A recomputed
                          from h), dh[r] = act'(h[r]) (w_r * dA'[r])  [N1]
    gate_up_dgrad_tile    dx[r] = dh[r] @ W13_e  [H]
    wgrad_tile            dW_e = sum over e's rows r of left[r]^T right[r]  (dW2: dO, w*A; dW13: dh, x)
    bias_grad_tile        db_e = sum over e's rows r of scale_r src[r]  (db2: w, dO; db1: dh)
    bias_router_grad_tile the fc2 bias's router partial <dO[t_r], b2_e>
    combine_tile          out[t] = sum over k, ascending, of rows[row(t, k)]
    router_grad_tile      d_w[t, k] = sum over the partial columns j, ascending, of partial[row(t, k), j]

The activation is a constexpr choice of the same tiles (ACT, GATED, CLAMP, OFFSET: `expert_activation`
and its gradient), in the forward and in the backward's recomputation alike.

Tensors: x [T, H], dO [T, H], h [R_pad, 2I], A [R_pad, I], y and dx rows [R_pad, H] in the params
dtype; W13 [E, 2I, H], W2 [E, H, I]; w_R fp32 [R_pad] (0 on padding rows); row_to_token int64
[R_pad] (-1 on padding rows); tile_to_expert int64 [R_pad / TILE_M] (-1 past the last segment);
expert_offsets int64 [E+1], tokens_per_expert int64 [E]; tk_to_row int64 [T*K] (-1: dropped).

Ownership: a row-tile GEMM tile is (row block of BLOCK_M rows, column block); a row block lies
inside one expert segment because segments are padded to TILE_M, a multiple of BLOCK_M. A
weight-gradient tile is (expert, output tile) and loops over that expert's rows in ascending order,
BLOCK_K rows at a time. A combine tile is (token block, column block).

Determinism: every reduction is one loop in a fixed BLOCK_K (or k, or I-block) order with an fp32
accumulator; no split-K, no atomics. Operands that are contiguous (expert weights, schedule-ordered
row buffers) can be read through TMA tensor descriptors (TMA=True); the tiles and the K order are
the same as with pointer loads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), d act / d g) in fp32 for the activations of mok_plugin/experts.py ("identity": g),
    each transcendental (erf, sigmoid, exp) evaluated once for both (relu' = 0 at 0, as autograd).
    The forward takes the first only; the compiler drops the unused derivative."""
    if ACT == "silu":
        s = tl.sigmoid(g)
        out = g * s
        grad = s * (1.0 + g * (1.0 - s))
    elif ACT == "gelu":
        cdf2 = 1.0 + tl.erf(g * 0.7071067811865476)  # 2 * Phi(g)
        out = 0.5 * g * cdf2
        grad = 0.5 * cdf2 + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    elif ACT == "gelu_tanh":
        # 0.5 * (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) * (g + 0.044715 g^3)
        s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        out = g * s
        grad = s + g * 2.0 * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    elif ACT == "quick_gelu":
        s = tl.sigmoid(1.702 * g)
        out = g * s
        grad = s + 1.702 * g * s * (1.0 - s)
    elif ACT == "relu":
        out = tl.maximum(g, 0.0)
        grad = tl.where(g > 0.0, 1.0, 0.0)
    elif ACT == "squared_relu":
        out = tl.maximum(g, 0.0) * tl.maximum(g, 0.0)
        grad = 2.0 * tl.maximum(g, 0.0)
    else:
        out = g
        grad = tl.full(g.shape, 1.0, tl.float32)
    return out, grad


@triton.jit
def expert_activation(gate, up, ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr):
    """A in fp32 from the stored h (fp32 copies): glu act(min(gate, CLAMP)) * (clamp(up, +-CLAMP) + OFFSET),
    or act(gate) when not GATED (up unused). CLAMP None: no clamp. The forward's formula; the backward
    recomputes A with `expert_activation_and_grad`, the same arithmetic."""
    if GATED:
        if CLAMP is not None:
            gate = tl.minimum(gate, CLAMP)
            up = tl.minimum(tl.maximum(up, -CLAMP), CLAMP)
        a = _act_and_grad(gate, ACT)[0] * (up + OFFSET)
    else:
        a = _act_and_grad(gate, ACT)[0]
    return a


@triton.jit
def expert_activation_and_grad(
    gate, up, d_a, ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr
):
    """(A, d_gate, d_up) in fp32: `expert_activation` and its gradient given d_a, from one
    evaluation of the activation (the erf GELU's backward is as cheap as its tanh form's); d_up is
    d_gate when not GATED. A clamp passes the gradient where its input lies in the closed range,
    as torch.clamp. A caller that wants A only gets the gradients' arithmetic dropped by the compiler."""
    if GATED:
        gate_c = gate
        up_c = up
        if CLAMP is not None:
            gate_c = tl.minimum(gate, CLAMP)
            up_c = tl.minimum(tl.maximum(up, -CLAMP), CLAMP)
        act, act_grad = _act_and_grad(gate_c, ACT)
        a = act * (up_c + OFFSET)
        d_gate = d_a * act_grad * (up_c + OFFSET)
        d_up = d_a * act
        if CLAMP is not None:
            d_gate = tl.where(gate <= CLAMP, d_gate, 0.0)
            d_up = tl.where((up >= -CLAMP) & (up <= CLAMP), d_up, 0.0)
    else:
        a, act_grad = _act_and_grad(gate, ACT)
        d_gate = d_a * act_grad
        d_up = d_gate
    return a, d_gate, d_up


@triton.jit
def activation_grad_of_rows(
    h_ptr, rows, row_ok, cols, col_ok, stride_h_r, I, d_a, ACT: tl.constexpr, GATED: tl.constexpr,
    CLAMP: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """(A, d_gate, d_up) in fp32 of the saved h's rows and columns `cols` (gate; up at I + cols when
    GATED), given d_a: `expert_activation_and_grad` of a loaded tile (masked: zeros)."""
    mask = row_ok[:, None] & col_ok[None, :]
    h_tile = h_ptr + rows[:, None] * stride_h_r + cols[None, :]
    gate = tl.load(h_tile, mask=mask, other=0.0).to(tl.float32)
    up = gate
    if GATED:
        up = tl.load(h_tile + I, mask=mask, other=0.0).to(tl.float32)
    return expert_activation_and_grad(gate, up, d_a, ACT=ACT, GATED=GATED, CLAMP=CLAMP, OFFSET=OFFSET)


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1-D tile index, GROUP_M row blocks sweeping the columns together, so
    consecutive programs share their rows and their weight panel in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, rows, tokens, row_ok) of row block pid_m; expert < 0 means no work."""
    expert = tl.load(tile_to_expert_ptr + (pid_m * BLOCK_M) // TILE_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(row_to_token_ptr + rows)
    return expert.to(tl.int64), rows, tokens, tokens >= 0


@triton.jit
def aligned(value, ALIGN: tl.constexpr):
    """value, restated as a multiple of ALIGN when ALIGN < 16 (the launcher's `launch.alignment`,
    which divides it): Triton specialises an integer argument on divisibility by 16 only, so a size
    or stride like H = 3000 (a multiple of 8) would otherwise turn 16-byte loads and stores into
    2-byte ones. `value // ALIGN * ALIGN` is value itself, and the compiler knows it divides."""
    if ALIGN < 16:
        value = value // ALIGN * ALIGN
    return value


@triton.jit
def routing_weights_of_rows(topk_weights_ptr, row_to_tk_ptr, rows, row_ok):
    """fp32 [BLOCK_M]: each row's routing weight topk_weights[row_to_tk[row]], 0 on padding rows.
    Read here rather than from a per-row copy: the copy cost a launch and an allocation each pass,
    host time that exceeds the GPU work at small T."""
    tk = tl.load(row_to_tk_ptr + rows, mask=row_ok, other=-1)
    return tl.load(topk_weights_ptr + tk, mask=tk >= 0, other=0.0)


@triton.jit
def h_rows_of(rows, row_ok, row_to_tk_ptr, BY_PAIR: tl.constexpr):
    """Where rows' h (and dh) live: the schedule rows themselves, or with BY_PAIR (small batches,
    h one row per (token, k) pair: ops.compact_h) each row's pair row_to_tk[row], 0 on padding rows
    (which every load and store masks)."""
    if BY_PAIR:
        rows = tl.load(row_to_tk_ptr + rows, mask=row_ok, other=0)
    return rows


@triton.jit
def _weight_block(
    w, expert, stride_w_e, w_row0, k0, n0, ks, cols, k_ok, col_ok, stride_k, stride_n, N_MAJOR: tl.constexpr,
    TMA: tl.constexpr,
):
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
def joined_gate_up_block(w13, expert, n0, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_K, 2 * BLOCK_N] of expert e's fc1 weight, element (k, n): columns n < BLOCK_N the gate
    rows n0 + n, the rest the up rows I + n0 + n - BLOCK_N, in one TMA load. w13 is a descriptor
    over the weight viewed (E * 2, I, H) (half 2e the gate, 2e + 1 the up) with block
    [2, BLOCK_N, BLOCK_K]; rows past I read zeros, so neither half reads the other."""
    block = w13.load([(2 * expert).to(tl.int32), n0, k0])  # descriptor coordinates are 32-bit
    return tl.reshape(block, [2 * BLOCK_N, BLOCK_K]).T


@triton.jit
def column_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(acc[:, :BLOCK_N], acc[:, BLOCK_N:]) of a [BLOCK_M, 2 * BLOCK_N] tile."""
    return tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))


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
    a, a_row0, a_rows, a_row_ok, stride_a, w, expert, stride_w_e, w_row0, stride_w_k, stride_w_n, n0, cols, col_ok,
    K_DIM, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_N_MAJOR: tl.constexpr, A_TMA: tl.constexpr, W_TMA: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = a[rows, :] @ W_e[:, cols], reducing over K in ascending BLOCK_K steps.

    Arguments:
        a: [*, K_DIM] rows of the left operand (row stride stride_a, unit column stride); a descriptor if A_TMA
        a_row0: first row of the tile (A_TMA: the rows are a_row0 .. a_row0 + BLOCK_M)
        a_rows: int64 [BLOCK_M] which rows of a this tile reads (pointer mode)
        a_row_ok: bool [BLOCK_M]
        w: expert weights (see _weight_block), a descriptor if W_TMA
        n0: first output column
        cols: int64 [BLOCK_N]: n0 + arange(BLOCK_N)
        col_ok: bool [BLOCK_N]"""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K_DIM
        a_blk = _row_block(a, a_row0, a_rows, a_row_ok, stride_a, k0, ks, k_ok, TMA=A_TMA)
        w_blk = _weight_block(
            w, expert, stride_w_e, w_row0, k0, n0, ks, cols, k_ok, col_ok, stride_w_k, stride_w_n, N_MAJOR=W_N_MAJOR,
            TMA=W_TMA,
        )
        acc = tl.dot(a_blk, w_blk, acc, input_precision=DOT_PRECISION)
    return acc


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def gate_up_tile(
    pid_m, pid_n, x_ptr, w13, b1_ptr, h_ptr, a_ptr, row_to_token_ptr, row_to_tk_ptr, tile_to_expert_ptr, H, I,
    stride_x_t, stride_w_e, stride_w_n, stride_b1_e, stride_h_r, stride_a_r, TILE_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr,
    H_BY_PAIR: tl.constexpr, JOINED: tl.constexpr = False,
):
    """h[rows, n-block] (+ b1) of the gate and of the up half (GATED; else the one fc1 half), and
    A[rows, n-block] = the family's activation of the rounded h; reduces over H in ascending BLOCK_K
    order. Nothing for a row block past the last segment.

    JOINED (GATED with TMA): one [BLOCK_M, 2 * BLOCK_N] accumulator over the gate block and the up
    block loaded together (`joined_gate_up_block`), one wgmma of twice the width a K step instead
    of two that each read the x tile; every element sums the same products in the same order.

    Arguments:
        x_ptr: (T, H) params dtype
        w13: (E, N1, H), N1 = 2I if GATED else I; with TMA a descriptor over it viewed (E * N1, H),
            with JOINED one viewed (E * 2, I, H) whose block is [2, BLOCK_N, BLOCK_K]
        b1_ptr: (E, N1) fc1 bias, or None
        h_ptr: (R_pad, N1) out; with H_BY_PAIR (T * K, N1), row row_to_tk[r] (`h_rows_of`)
        a_ptr: (R_pad, I) out
        row_to_token_ptr: (R_pad,) int64
        row_to_tk_ptr: (R_pad,) int64 (read with H_BY_PAIR only)
        tile_to_expert_ptr: (R_pad / TILE_M,) int64"""
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        n1 = 2 * I if GATED else I
        gate_row0 = expert * n1  # the expert's first fc1 row in the (E * N1, H) view
        if JOINED:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                xa = _row_block(x_ptr, 0, tokens, row_ok, stride_x_t, k0, ks, ks < H, TMA=False)  # by token
                acc = tl.dot(xa, joined_gate_up_block(w13, expert, n0, k0, BLOCK_N, BLOCK_K), acc,
                             input_precision=DOT_PRECISION)  # fmt: skip
            acc_gate, acc_up = column_halves(acc, BLOCK_M, BLOCK_N)
        else:
            acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < H
                xa = _row_block(x_ptr, 0, tokens, row_ok, stride_x_t, k0, ks, k_ok, TMA=False)  # by token
                wg = _weight_block(
                    w13, expert, stride_w_e, gate_row0, k0, n0, ks, cols, k_ok, col_ok, 1, stride_w_n, N_MAJOR=True,
                    TMA=TMA,
                )
                acc_gate = tl.dot(xa, wg, acc_gate, input_precision=DOT_PRECISION)
                if GATED:
                    # The up half: output columns I + n of the same weight.
                    wu = _weight_block(
                        w13, expert, stride_w_e, gate_row0, k0, n0 + I, ks, cols + I, k_ok, col_ok, 1, stride_w_n,
                        N_MAJOR=True, TMA=TMA,
                    )
                    acc_up = tl.dot(xa, wu, acc_up, input_precision=DOT_PRECISION)
        if b1_ptr is not None:
            b1 = b1_ptr + expert * stride_b1_e + cols
            acc_gate += tl.load(b1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b1 + I, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ty = h_ptr.dtype.element_ty
        gate = acc_gate.to(out_ty)
        up = acc_up.to(out_ty)
        mask = row_ok[:, None] & col_ok[None, :]
        h_rows = h_rows_of(rows, row_ok, row_to_tk_ptr, H_BY_PAIR)
        h_tile = h_ptr + h_rows[:, None] * stride_h_r + cols[None, :]
        tl.store(h_tile, gate, mask=mask)
        if GATED:
            tl.store(h_tile + I, up, mask=mask)
        # A from the rounded h, exactly as the backward recomputes it.
        a = expert_activation(gate.to(tl.float32), up.to(tl.float32), ACT=ACT, GATED=GATED, CLAMP=CLAMP, OFFSET=OFFSET)
        tl.store(a_ptr + rows[:, None] * stride_a_r + cols[None, :], a.to(out_ty), mask=mask)


@triton.jit
def down_tile(
    pid_m, pid_n, a, w2, b2_ptr, topk_weights_ptr, row_to_tk_ptr, y_ptr, row_to_token_ptr, tile_to_expert_ptr, H, I,
    stride_a_r,
    stride_w_e, stride_w_h, stride_b2_e, stride_y_r, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """y[rows, n-block]: reduces over I in ascending BLOCK_K order, adds the fc2 bias, then scales
    each row by its routing weight in fp32 (the weight scales the bias too).

    Arguments:
        a: (R_pad, I); with TMA a descriptor over it
        w2: (E, H, I); with TMA a descriptor over it viewed (E * H, I)
        b2_ptr: (E, H) fc2 bias, or None
        topk_weights_ptr: (T * K,) fp32 routing weights
        row_to_tk_ptr: (R_pad,) int64, -1 on padding rows
        y_ptr: (R_pad, H) out
        row_to_token_ptr: (R_pad,) int64
        tile_to_expert_ptr: (R_pad / TILE_M,) int64"""
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        acc = _row_tile_matmul(
            a=a, a_row0=pid_m * BLOCK_M, a_rows=rows, a_row_ok=row_ok, stride_a=stride_a_r, w=w2, expert=expert,
            stride_w_e=stride_w_e, w_row0=expert * H, stride_w_k=1, stride_w_n=stride_w_h, n0=n0, cols=cols,
            col_ok=col_ok, K_DIM=I, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
            W_N_MAJOR=True, A_TMA=TMA, W_TMA=TMA,
        )
        if b2_ptr is not None:
            acc += tl.load(b2_ptr + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w = routing_weights_of_rows(topk_weights_ptr, row_to_tk_ptr, rows, row_ok)
        y = acc * w[:, None]
        y_tile = y_ptr + rows[:, None] * stride_y_r + cols[None, :]
        tl.store(y_tile, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def down_dgrad_block(
    pid_m, pid_n, d_out_ptr, w2, row_to_token_ptr, tile_to_expert_ptr, H, I, stride_d_out_t, stride_w_e, stride_w_h,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """(expert, rows, row_ok, cols, col_ok, dA') of tile (pid_m, pid_n): fp32 dA'[rows, n-block] =
    dO[tokens] @ W2_e[:, n-block], the dO rows gathered by token (pointer loads), reduced over H in
    ascending BLOCK_K order. A row block past the last segment (expert < 0) computes nothing and
    gets zeros; its caller stores nothing for it.

    Arguments:
        d_out_ptr: (T, H)
        w2: (E, H, I); with TMA a descriptor over it viewed (E * H, I)
        row_to_token_ptr: (R_pad,) int64
        tile_to_expert_ptr: (R_pad / TILE_M,) int64"""
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    n0 = pid_n * BLOCK_N
    cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    d_a_prime = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert >= 0:
        d_a_prime = _row_tile_matmul(
            a=d_out_ptr, a_row0=0, a_rows=tokens, a_row_ok=row_ok, stride_a=stride_d_out_t, w=w2, expert=expert,
            stride_w_e=stride_w_e, w_row0=expert * H, stride_w_k=stride_w_h, stride_w_n=1, n0=n0, cols=cols,
            col_ok=col_ok, K_DIM=H, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
            W_N_MAJOR=False, A_TMA=False, W_TMA=TMA,
        )
    return expert, rows, row_ok, cols, col_ok, d_a_prime


@triton.jit
def down_dgrad_epilogue(
    d_a_prime, rows, row_ok, cols, col_ok, slot, h_ptr, topk_weights_ptr, row_to_tk_ptr, d_h_ptr, a_weighted_ptr,
    d_w_partial_ptr, I, stride_h_r, stride_a_r, stride_part_r, OUT_TY: tl.constexpr, ACT: tl.constexpr,
    GATED: tl.constexpr, CLAMP: tl.constexpr, OFFSET: tl.constexpr, H_BY_PAIR: tl.constexpr,
):
    """From dA'[rows, cols] (fp32): the router partial <dA', A> into column `slot`, w*A, and dh of
    the gate and up columns (GATED; else of the one fc1 half; for a linear expert, h is its input
    and ACT "identity", so dh is w * dA'). Padding rows of an active row block store zeros in dh
    and w*A: the weight-gradient GEMMs may read them whole (through TMA) and must find finite values there.
    With H_BY_PAIR, h and dh are one row per (token, k) pair (`h_rows_of`): padding rows have no dh
    row (dW13 then reads dh through row_to_tk, kept pairs only).

    The row sum <dA', A> is reduced in the order of dA's register layout, so a fused tile (an MMA
    accumulator, the megakernel) and the epilogue kernel (a loaded block, the multi-kernel variant)
    round it differently; dh and w*A are elementwise and the same either way.

    Arguments:
        d_a_prime: fp32 [BLOCK_M, BLOCK_N] dA' of the block
        rows: int64 [BLOCK_M]
        row_ok: bool [BLOCK_M]
        cols: int64 [BLOCK_N] I columns
        col_ok: bool [BLOCK_N]
        slot: the router partial column this block writes
        h_ptr: (R_pad, N1) saved pre-activation, N1 = 2I if GATED else I ((T * K, N1) with H_BY_PAIR)
        topk_weights_ptr: (T * K,) fp32 routing weights
        row_to_tk_ptr: (R_pad,) int64
        d_h_ptr: (R_pad, N1) out ((T * K, N1) with H_BY_PAIR)
        a_weighted_ptr: (R_pad, I) out: w_r * A[r], the right operand of the down weight gradient
        d_w_partial_ptr: (R_pad, J) fp32 out: <dA', A> per I-block"""
    w = routing_weights_of_rows(topk_weights_ptr, row_to_tk_ptr, rows, row_ok)
    h_rows = h_rows_of(rows, row_ok, row_to_tk_ptr, H_BY_PAIR)
    a, d_gate, d_up = activation_grad_of_rows(
        h_ptr, h_rows, row_ok, cols, col_ok, stride_h_r, I, d_a_prime * w[:, None], ACT=ACT, GATED=GATED,
        CLAMP=CLAMP, OFFSET=OFFSET,
    )
    # A exactly as the forward stored it
    a = a.to(OUT_TY).to(tl.float32)
    partial = tl.sum(d_a_prime * a, axis=1)
    tl.store(d_w_partial_ptr + rows * stride_part_r + slot, partial, mask=row_ok)
    # Weighting A here keeps the weight-gradient GEMM a plain one (no register pass over its operand).
    a_w = (a * w[:, None]).to(OUT_TY)
    col_mask = col_ok[None, :]  # every row: padding rows store the zeros they computed
    tl.store(a_weighted_ptr + rows[:, None] * stride_a_r + cols[None, :], a_w, mask=col_mask)
    d_h_mask = col_mask
    if H_BY_PAIR:
        d_h_mask = row_ok[:, None] & col_ok[None, :]  # a padding row has no pair
    d_h_tile = d_h_ptr + h_rows[:, None] * stride_h_r + cols[None, :]
    tl.store(d_h_tile, d_gate.to(OUT_TY), mask=d_h_mask)
    if GATED:
        tl.store(d_h_tile + I, d_up.to(OUT_TY), mask=d_h_mask)


@triton.jit
def down_dgrad_tile(
    pid_m, pid_n, d_out_ptr, w2, h_ptr, topk_weights_ptr, row_to_tk_ptr, d_h_ptr, a_weighted_ptr, d_w_partial_ptr,
    row_to_token_ptr,
    tile_to_expert_ptr, H, I, stride_d_out_t, stride_w_e, stride_w_h, stride_h_r, stride_a_r, stride_part_r,
    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dA'[rows, n-block] and its epilogue in one tile (the megakernel's down-dgrad task, SwiGLU; the
    multi-kernel variant runs the same two functions as two kernels, with dA' stored between).

    Arguments:
        d_out_ptr: (T, H)
        w2: (E, H, I)
        h_ptr: (R_pad, 2I)
        topk_weights_ptr: (T * K,) fp32
        row_to_tk_ptr: (R_pad,) int64
        d_h_ptr: (R_pad, 2I) out
        a_weighted_ptr: (R_pad, I) out
        d_w_partial_ptr: (R_pad, cdiv(I, BLOCK_N)) fp32 out
        row_to_token_ptr: (R_pad,) int64
        tile_to_expert_ptr: (R_pad / TILE_M,) int64"""
    expert, rows, row_ok, cols, col_ok, d_a_prime = down_dgrad_block(
        pid_m, pid_n, d_out_ptr=d_out_ptr, w2=w2, row_to_token_ptr=row_to_token_ptr,
        tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I, stride_d_out_t=stride_d_out_t, stride_w_e=stride_w_e,
        stride_w_h=stride_w_h, TILE_M=TILE_M, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION=DOT_PRECISION, TMA=False,
    )
    if expert >= 0:
        down_dgrad_epilogue(
            d_a_prime=d_a_prime, rows=rows, row_ok=row_ok, cols=cols, col_ok=col_ok, slot=pid_n, h_ptr=h_ptr,
            topk_weights_ptr=topk_weights_ptr, row_to_tk_ptr=row_to_tk_ptr, d_h_ptr=d_h_ptr,
            a_weighted_ptr=a_weighted_ptr, d_w_partial_ptr=d_w_partial_ptr,
            I=I, stride_h_r=stride_h_r, stride_a_r=stride_a_r, stride_part_r=stride_part_r,
            OUT_TY=d_out_ptr.dtype.element_ty, ACT="silu", GATED=True, CLAMP=None, OFFSET=0.0, H_BY_PAIR=False,
        )


@triton.jit
def gate_up_dgrad_tile(
    pid_m, pid_n, d_h, w13, d_x_rows_ptr, row_to_token_ptr, row_to_tk_ptr, tile_to_expert_ptr, H, N1, stride_d_h_r,
    stride_w_e, stride_w_j, stride_d_x_r, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, H_BY_PAIR: tl.constexpr,
):
    """dx[rows, n-block]; reduces over the N1 fc1 rows (2I for a glu) in ascending BLOCK_K order.

    Arguments:
        d_h: (R_pad, N1); with TMA a descriptor over it. With H_BY_PAIR (T * K, N1), read by pointer
            at row row_to_tk[r] (`h_rows_of`); TMA then applies to w13 only
        w13: (E, N1, H); with TMA a descriptor over it viewed (E * N1, H)
        d_x_rows_ptr: (R_pad, H) out
        row_to_token_ptr: (R_pad,) int64
        row_to_tk_ptr: (R_pad,) int64 (read with H_BY_PAIR only)
        tile_to_expert_ptr: (R_pad / TILE_M,) int64"""
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        n0 = pid_n * BLOCK_N
        cols = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        acc = _row_tile_matmul(
            a=d_h, a_row0=pid_m * BLOCK_M, a_rows=h_rows_of(rows, row_ok, row_to_tk_ptr, H_BY_PAIR), a_row_ok=row_ok,
            stride_a=stride_d_h_r, w=w13, expert=expert, stride_w_e=stride_w_e, w_row0=expert * N1,
            stride_w_k=stride_w_j, stride_w_n=1, n0=n0, cols=cols, col_ok=col_ok, K_DIM=N1, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, W_N_MAJOR=False,
            A_TMA=TMA and not H_BY_PAIR, W_TMA=TMA,
        )
        d_x_tile = d_x_rows_ptr + rows[:, None] * stride_d_x_r + cols[None, :]
        tl.store(d_x_tile, acc.to(d_x_rows_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _divided(index, DIVISOR: tl.constexpr):
    """index // DIVISOR; index itself (no division emitted) when DIVISOR is 1."""
    if DIVISOR != 1:
        index = index // DIVISOR
    return index


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
def wgrad_tile(
    expert, pid_m, pid_n, left, right, d_w_ptr, row_to_token_ptr, expert_offsets_ptr, tokens_per_expert_ptr, M_OUT,
    N_OUT, stride_left, stride_right, stride_d_w_e, stride_d_w_m, stride_d_w_n, LEFT_BY_TOKEN: tl.constexpr,
    RIGHT_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, RIGHT_INDEX_DIVISOR: tl.constexpr,
):
    """dW_e[m-block, n-block] = sum over e's rows r of left[r, m-block]^T right[r, n-block], in
    ascending row order, BLOCK_K rows per step; an expert with no rows writes zeros. With TMA the
    by-row operand is read through a descriptor, which needs the segment's padding rows to hold
    zeros up to the next multiple of BLOCK_K (the down-dgrad epilogue writes them).

    Arguments:
        left: rows of the left operand: (T, M_OUT) when LEFT_BY_TOKEN, else (R_pad, M_OUT) (a descriptor with TMA)
        right: rows of the right operand: (T, N_OUT) when RIGHT_BY_TOKEN, else (R_pad, N_OUT) (likewise)
        d_w_ptr: (E, M_OUT, N_OUT) out, any strides (a transposed view when the launcher swapped operands)
        row_to_token_ptr: (R_pad,) int64, the by-token operands' row of each schedule row
        expert_offsets_ptr: (E+1,) int64
        tokens_per_expert_ptr: (E,) int64
        RIGHT_INDEX_DIVISOR: a by-token right operand's row is the index map's entry divided by this:
            1, or top_k where the map is row_to_tk and right is x (pair t * K + k is token t's row)"""
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
        lhs = _wgrad_operand(left, rows, tokens, r_ok, r0, m0, ms, m_ok, stride_left, BY_TOKEN=LEFT_BY_TOKEN, TMA=TMA)
        rhs = _wgrad_operand(
            right, rows, _divided(tokens, RIGHT_INDEX_DIVISOR), r_ok, r0, n0, ns, n_ok, stride_right,
            BY_TOKEN=RIGHT_BY_TOKEN, TMA=TMA,
        )
        acc = tl.dot(tl.trans(lhs), rhs, acc, input_precision=DOT_PRECISION)
        tokens = next_tokens
    d_w_tile = d_w_ptr + expert * stride_d_w_e + ms[:, None] * stride_d_w_m + ns[None, :] * stride_d_w_n
    tl.store(d_w_tile, acc.to(d_w_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def wgrad_sweep(
    expert, pid_m, left, right, d_w_ptr, row_to_token_ptr, expert_offsets_ptr, tokens_per_expert_ptr, M_OUT, N_OUT,
    stride_left, stride_right, stride_d_w_e, stride_d_w_m, stride_d_w_n, LEFT_BY_TOKEN: tl.constexpr,
    RIGHT_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, RIGHT_INDEX_DIVISOR: tl.constexpr,
    KEEP_ONE_STEP_LEFT: tl.constexpr,
):
    """wgrad_tile for every n-block of one (expert, m-block), as one loop over (n-block, K step):
    the loads of a tile's first steps are issued while the tile before it multiplies its last ones
    and stores, where a program per tile refills its pipeline for every tile (4-6 K steps a tile
    on deepseek-v3). Each tile sums the same products in the same order as wgrad_tile: bitwise the
    same. With KEEP_ONE_STEP_LEFT, an expert whose rows fit one K step (small batches) loads its
    left tile once for all n-blocks instead of once a tile (the same product, a third of the loads
    fewer at qwen3-30b-a3b's T = 512). Arguments as wgrad_tile's."""
    expert = expert.to(tl.int64)
    ms = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M_OUT
    d_w_rows = d_w_ptr + expert * stride_d_w_e + ms[:, None] * stride_d_w_m
    start = tl.load(expert_offsets_ptr + expert)
    end = start + tl.load(tokens_per_expert_ptr + expert)
    steps = tl.cdiv(end - start, BLOCK_K).to(tl.int32)  # descriptor coordinates are int32
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if steps == 0:  # an expert with no rows: zeros
        for pid_n in range(0, num_pid_n):
            ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # pid_n a Python int when interpreted
            mask = m_ok[:, None] & (ns < N_OUT)[None, :]
            tl.store(d_w_rows + ns[None, :] * stride_d_w_n, acc.to(d_w_ptr.dtype.element_ty), mask=mask)
    elif KEEP_ONE_STEP_LEFT and steps == 1:
        rows = start + tl.arange(0, BLOCK_K)
        r_ok = rows < end
        tokens = tl.load(row_to_token_ptr + rows, mask=r_ok, other=0)
        lhs = _wgrad_operand(
            left, rows, tokens, r_ok, start, pid_m * BLOCK_M, ms, m_ok, stride_left, BY_TOKEN=LEFT_BY_TOKEN, TMA=TMA
        )
        right_tokens = _divided(tokens, RIGHT_INDEX_DIVISOR)
        for pid_n in range(0, num_pid_n):
            n0 = pid_n * BLOCK_N
            ns = n0 + tl.arange(0, BLOCK_N).to(tl.int64)  # pid_n a Python int when interpreted
            n_ok = ns < N_OUT
            rhs = _wgrad_operand(
                right, rows, right_tokens, r_ok, start, n0, ns, n_ok, stride_right, BY_TOKEN=RIGHT_BY_TOKEN, TMA=TMA
            )
            tile = tl.dot(tl.trans(lhs), rhs, acc, input_precision=DOT_PRECISION)  # acc: zeros, never updated
            mask = m_ok[:, None] & n_ok[None, :]
            tl.store(d_w_rows + ns[None, :] * stride_d_w_n, tile.to(d_w_ptr.dtype.element_ty), mask=mask)
    else:
        # token indices a step ahead, as in wgrad_tile; after a tile's last step, the next tile's first
        first = start + tl.arange(0, BLOCK_K)
        tokens = tl.load(row_to_token_ptr + first, mask=first < end, other=0)
        for i in range(0, num_pid_n * steps):
            pid_n = i // steps
            step = i - pid_n * steps
            n0 = pid_n * BLOCK_N
            ns = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
            n_ok = ns < N_OUT
            r0 = start + step * BLOCK_K
            rows = r0 + tl.arange(0, BLOCK_K)
            r_ok = rows < end
            next_rows = tl.where(step == steps - 1, start, r0 + BLOCK_K) + tl.arange(0, BLOCK_K)
            next_tokens = tl.load(row_to_token_ptr + next_rows, mask=next_rows < end, other=0)
            lhs = _wgrad_operand(
                left, rows, tokens, r_ok, r0, pid_m * BLOCK_M, ms, m_ok, stride_left, BY_TOKEN=LEFT_BY_TOKEN, TMA=TMA
            )
            rhs = _wgrad_operand(
                right, rows, _divided(tokens, RIGHT_INDEX_DIVISOR), r_ok, r0, n0, ns, n_ok, stride_right,
                BY_TOKEN=RIGHT_BY_TOKEN, TMA=TMA,
            )
            acc = tl.dot(tl.trans(lhs), rhs, acc, input_precision=DOT_PRECISION)
            if step == steps - 1:
                mask = m_ok[:, None] & n_ok[None, :]
                tl.store(d_w_rows + ns[None, :] * stride_d_w_n, acc.to(d_w_ptr.dtype.element_ty), mask=mask)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            tokens = next_tokens


@triton.jit
def bias_grad_tile(
    expert, pid_n, src, scale_ptr, d_b_ptr, row_to_token_ptr, expert_offsets_ptr, tokens_per_expert_ptr, N,
    stride_src, stride_d_b_e, BY_TOKEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """d_b[e, n-block] = sum over e's rows r of scale[r] * src[r] (scale None: 1), in ascending row
    order BLOCK_K rows per step (the weight gradients' order), fp32; zeros for an expert with no rows.

    Arguments:
        src: (T, N) when BY_TOKEN (indexed through row_to_token), else (R_pad, N)
        scale_ptr: (R_pad,) fp32 or None
        d_b_ptr: (E, N) out"""
    expert = expert.to(tl.int64)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    start = tl.load(expert_offsets_ptr + expert)
    end = start + tl.load(tokens_per_expert_ptr + expert)
    # Row i of the block accumulates rows i, i + BLOCK_K, ... elementwise; one sum over the block's
    # rows at the end (a fixed order, and no cross-row reduction per step).
    acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        r_ok = rows < end
        src_rows = rows
        if BY_TOKEN:
            src_rows = tl.load(row_to_token_ptr + rows, mask=r_ok, other=0)
        mask = r_ok[:, None] & col_ok[None, :]
        vals = tl.load(src + src_rows[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if scale_ptr is not None:
            vals = vals * tl.load(scale_ptr + rows, mask=r_ok, other=0.0)[:, None]
        acc2 += vals
    acc = tl.sum(acc2, axis=0)
    tl.store(d_b_ptr + expert * stride_d_b_e + cols, acc.to(d_b_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def bias_router_grad_tile(
    pid_m, d_out_ptr, b2_ptr, d_w_partial_ptr, row_to_token_ptr, tile_to_expert_ptr, H, stride_d_out_t, stride_b2_e,
    stride_part_r, slot, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, d_out_scale_ptr=None,
    stride_scale_t=0,
):
    """The fc2 bias's share of the router gradient, <dO[t_r], b2_e>, into partial column `slot` of
    row block pid_m: column n of the block accumulates columns n, n + BLOCK_N, ... in ascending
    order, then one sum over the block's columns; fp32. With d_out_scale_ptr, dO is FP8 with one
    scale per token and BLOCK_N columns (the FP8 backward's 1 x 128 blocks), applied before b2.

    Arguments:
        d_out_ptr: (T, H)
        b2_ptr: (E, H)
        d_w_partial_ptr: (R_pad, J) fp32
        d_out_scale_ptr: (T, cdiv(H, BLOCK_N)) fp32 or None"""
    expert, rows, tokens, row_ok = tile_rows(pid_m, row_to_token_ptr, tile_to_expert_ptr, TILE_M, BLOCK_M)
    if expert >= 0:
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # one sum over the columns at the end
        for n0 in range(0, H, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < H
            mask = row_ok[:, None] & col_ok[None, :]
            d_o = tl.load(d_out_ptr + tokens[:, None] * stride_d_out_t + cols[None, :], mask=mask, other=0.0)
            d_o = d_o.to(tl.float32)
            if d_out_scale_ptr is not None:
                scale = tl.load(d_out_scale_ptr + tokens * stride_scale_t + n0 // BLOCK_N, mask=row_ok, other=0.0)
                d_o = d_o * scale[:, None]
            b2 = tl.load(b2_ptr + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc2 += d_o * b2[None, :]
        acc = tl.sum(acc2, axis=1)
        tl.store(d_w_partial_ptr + rows * stride_part_r + slot, acc, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Back to token order
# ----------------------------------------------------------------------------------------------


@triton.jit
def combine_tile(
    pid_t, pid_n, rows_ptr, tk_to_row_ptr, out_ptr, T, H, stride_rows_r, stride_out_t, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t-block, n-block]: each token's K rows summed in ascending k, fp32, rounded once.

    Arguments:
        rows_ptr: (R_pad, H) params dtype
        tk_to_row_ptr: (T*K,) int64
        out_ptr: (T, H) out"""
    tokens = pid_t.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = tokens < T
    c_ok = cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(tk_to_row_ptr + tokens * K + k, mask=t_ok, other=-1)
        ok = row >= 0
        vals = tl.load(
            rows_ptr + row[:, None] * stride_rows_r + cols[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0
        )
        acc += vals.to(tl.float32)
    out_tile = out_ptr + tokens[:, None] * stride_out_t + cols[None, :]
    tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def router_grad_tile(
    pid, partial_ptr, tk_to_row_ptr, d_w_ptr, TK, J, stride_partial_r, BLOCK_M: tl.constexpr,
):
    """d_w[tk-block]: the J partials of each pair's row summed in ascending order; 0 if dropped.

    Arguments:
        partial_ptr: (R_pad, J) fp32
        tk_to_row_ptr: (T*K,) int64
        d_w_ptr: (T*K,) fp32 out"""
    tk = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tk_ok = tk < TK
    row = tl.load(tk_to_row_ptr + tk, mask=tk_ok, other=-1)
    ok = row >= 0
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in range(J):
        acc += tl.load(partial_ptr + row * stride_partial_r + j, mask=ok, other=0.0)
    tl.store(d_w_ptr + tk, acc, mask=tk_ok)
