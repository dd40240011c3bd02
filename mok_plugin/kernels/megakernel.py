"""The persistent megakernel: a whole forward pass, or a whole backward pass, as one launch.

It computes bias-free SwiGLU experts only (its tiles get the SwiGLU constants); the other expert
families run in the multi-kernel variant, and `MoKConfig` refuses kernel_variant='megakernel' for
them by name.

A grid of as many programs as the GPU has multiprocessors takes tasks from a device-side task list
through an integer ticket (`atomic_add` on a counter) until the list is empty. The list is in
dependency order, every producer before its consumers, and a consumer waits on integer readiness
counters that its producers increment when their tile is stored. A claimed task is always running,
so whatever it waits for was claimed earlier by a running program: the wait always ends (no
deadlock, whatever the number of programs; the CPU interpreter, which runs programs one after the
other, simply runs the whole list in the first program).

Forward task list (x, W13, W2 in; out [T, H] and h [R_pad, 2I] out):
    gate/up tiles (row block m, I-block)   -> ready_rows[m] += 1
    down tiles (m, H-block)                 waits ready_rows[m] == I-blocks; -> down_done += 1
    combine tiles (token block, H-block)    waits down_done == number of down tiles
Backward task list (dO in; dX, d_topk_weights, dW13, dW2 out):
    down-dgrad tiles (m, I-block)           -> ready_rows[m] += 1, ready_expert[e] += 1, dgrad_done += 1
    router-gradient tiles (pair block)      waits dgrad_done == number of down-dgrad tiles
    gate/up-dgrad tiles (m, H-block)        waits ready_rows[m]; -> dx_done += 1
    dW2 tiles, then dW13 tiles (e, m, n)    wait ready_expert[e] == e's row blocks * I-blocks
    combine tiles of dX                     waits dx_done == number of gate/up-dgrad tiles

Each task runs the same tile function (tiles.py) as the multi-kernel variant (grouped_mlp.py,
combine.py), so the forward gives bitwise the same output. The backward's tiles differ where one
launch cannot take the multi-kernel configs: the multi-kernel variant runs the down-dgrad GEMM and
its epilogue as two kernels with dA' stored between (a 128x256 GEMM tile, a 32x128 epilogue
block), while a down-dgrad task here runs both in one 128x64 tile (`down_dgrad_tile`); and its
weight gradients gather rows in the loop without TMA. With the interpreter's small tiles (and in
fp32 on a GPU) the two still agree bitwise but for the router gradient, whose per-I-block partials
are summed over other blocks; in bf16 on a GPU the backward agrees to bf16 rounding
(tests/test_gpu_layer.py::test_megakernel_and_multi_kernel_agree).

What it costs today, and what would make it pay: measured on the H200 (BENCHMARKS.md, after the
restructure), fwd+bwd takes 1.5x the multi-kernel variant's time on qwen3-30b-a3b (13.1 vs 8.7 ms)
and mixtral-8x7b (46.1 vs 31.1 ms), 1.6x on deepseek-v3 (74.3 vs 46.3 ms), with a higher peak (3379
vs 1716 MiB on qwen3: every stage's buffers of a pass are allocated up front and live through the
one launch). The causes: every task shares one launch's registers, warps and pipeline depth, so no
tile gets the config it is fastest with (the down-dgrad tile is 128x64 fused, the weight gradients
gather rows in the loop without TMA); and the spin-waits between dependent tasks idle SMs at each
stage boundary. It would pay where launches dominate (small T, where several short kernels each
leave SMs idle) or with producer/consumer warp specialisation that lets each task kind run its own
tile config inside one launch; neither is the case on the named training shapes, so the
multi-kernel variant is the default.

Determinism: the ticket and the counters are integers; they decide which program runs a tile and
when, never the order in which floats are added inside a tile. Every output tile has one owner.

Memory ordering: a producer stores its tile, synchronises its threads, then increments the counter
with release semantics at GPU scope; a consumer reads the counter with acquire semantics before it
loads. Counters live in one int32 buffer zeroed before each launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok_plugin.kernels.configs import interpreter_on, kernel_config
from mok_plugin.kernels.launch import (
    alignment,
    cdiv,
    check_schedule,
    dot_precision,
    routing_weights_arg,
    sm_count,
    stages_for,
)
from mok_plugin.kernels.tiles import (
    aligned,
    combine_tile,
    down_dgrad_tile,
    down_tile,
    gate_up_dgrad_tile,
    gate_up_tile,
    grouped_pid,
    router_grad_tile,
    wgrad_tile,
)

__all__ = ["forward_megakernel", "backward_megakernel"]

_ROUTER_BLOCK = 128


@triton.jit
def _signal(counter_ptr):
    """Publish this program's stores, then count one more finished tile."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until the counter reaches target (acquire: later loads see the producers' stores)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _forward_megakernel(
    x_ptr, w13_ptr, w2_ptr, topk_weights_ptr, row_to_tk_ptr, h_ptr, a_ptr, y_ptr, out_ptr, row_to_token_ptr,
    tile_to_expert_ptr,
    tk_to_row_ptr, counters_ptr, NUM_ROWS, T, H, I, stride_x_t, stride_w13_e, stride_w13_n, stride_w2_e, stride_w2_h,
    stride_h_r, stride_a_r, stride_y_r, stride_out_t, K: tl.constexpr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BN_GATE_UP: tl.constexpr, BN_DOWN: tl.constexpr, GROUP_M: tl.constexpr,
    COMBINE_BM: tl.constexpr, COMBINE_BN: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (number of SMs,). Each program takes tickets until the forward task list is done.

    Arguments:
        counters_ptr: (2 + R_pad / BLOCK_M,) int32 zeroed: [ticket, down_done, ready_rows...]"""
    # sizes and row strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    H, I = aligned(H, ALIGN), aligned(I, ALIGN)
    stride_x_t, stride_out_t = aligned(stride_x_t, ALIGN), aligned(stride_out_t, ALIGN)
    stride_w13_e, stride_w13_n = aligned(stride_w13_e, ALIGN), aligned(stride_w13_n, ALIGN)
    stride_w2_e, stride_w2_h = aligned(stride_w2_e, ALIGN), aligned(stride_w2_h, ALIGN)
    stride_h_r, stride_a_r = aligned(stride_h_r, ALIGN), aligned(stride_a_r, ALIGN)
    stride_y_r = aligned(stride_y_r, ALIGN)
    n_rb = NUM_ROWS // BLOCK_M
    n_i = tl.cdiv(I, BN_GATE_UP)
    n_h = tl.cdiv(H, BN_DOWN)
    n_gate_up = n_rb * n_i
    n_down = n_rb * n_h
    n_comb_n = tl.cdiv(H, COMBINE_BN)
    total = n_gate_up + n_down + tl.cdiv(T, COMBINE_BM) * n_comb_n
    ready_rows_ptr = counters_ptr + 2
    task = tl.atomic_add(counters_ptr, 1)
    while task < total:
        if task < n_gate_up:
            pid_m, pid_n = grouped_pid(task, n_rb, n_i, GROUP_M)
            gate_up_tile(
                pid_m, pid_n, x_ptr=x_ptr, w13=w13_ptr, b1_ptr=None, h_ptr=h_ptr, a_ptr=a_ptr,
                row_to_token_ptr=row_to_token_ptr, row_to_tk_ptr=None, tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I,
                stride_x_t=stride_x_t, stride_w_e=stride_w13_e, stride_w_n=stride_w13_n, stride_b1_e=0,
                stride_h_r=stride_h_r, stride_a_r=stride_a_r, TILE_M=TILE_M, BLOCK_M=BLOCK_M, BLOCK_N=BN_GATE_UP,
                BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, TMA=False, ACT="silu", GATED=True, CLAMP=None,
                OFFSET=0.0, H_BY_PAIR=False,
            )
            _signal(ready_rows_ptr + pid_m)
        elif task < n_gate_up + n_down:
            pid_m, pid_n = grouped_pid(task - n_gate_up, n_rb, n_h, GROUP_M)
            _wait_for(ready_rows_ptr + pid_m, n_i)
            down_tile(
                pid_m, pid_n, a=a_ptr, w2=w2_ptr, b2_ptr=None, topk_weights_ptr=topk_weights_ptr,
                row_to_tk_ptr=row_to_tk_ptr, y_ptr=y_ptr,
                row_to_token_ptr=row_to_token_ptr, tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I,
                stride_a_r=stride_a_r, stride_w_e=stride_w2_e, stride_w_h=stride_w2_h, stride_b2_e=0,
                stride_y_r=stride_y_r,
                TILE_M=TILE_M, BLOCK_M=BLOCK_M, BLOCK_N=BN_DOWN, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
                TMA=False,
            )
            _signal(counters_ptr + 1)
        else:
            t = task - n_gate_up - n_down
            _wait_for(counters_ptr + 1, n_down)
            combine_tile(
                t // n_comb_n, t % n_comb_n, rows_ptr=y_ptr, tk_to_row_ptr=tk_to_row_ptr, out_ptr=out_ptr, T=T, H=H,
                stride_rows_r=stride_y_r, stride_out_t=stride_out_t, K=K, BLOCK_M=COMBINE_BM, BLOCK_N=COMBINE_BN,
            )
        task = tl.atomic_add(counters_ptr, 1)


@triton.jit
def _backward_megakernel(
    d_out_ptr, x_ptr, w13_ptr, w2_ptr, h_ptr, topk_weights_ptr, row_to_tk_ptr, d_h_ptr, a_weighted_ptr, partial_ptr,
    d_x_rows_ptr, d_x_ptr,
    d_topk_ptr, d_w13_ptr, d_w2_ptr, row_to_token_ptr, tile_to_expert_ptr, tk_to_row_ptr, expert_offsets_ptr,
    tokens_per_expert_ptr, counters_ptr, NUM_ROWS, T, H, I, E, stride_d_out_t, stride_x_t, stride_w13_e, stride_w13_n,
    stride_w2_e, stride_w2_h, stride_h_r, stride_a_r, stride_part_r, stride_dxr_r, stride_dx_t, stride_dw13_e,
    stride_dw13_m, stride_dw2_e, stride_dw2_m, K: tl.constexpr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BN_DGRAD: tl.constexpr, BN_DX: tl.constexpr, WG_BM: tl.constexpr, WG_BN: tl.constexpr,
    WG_BK: tl.constexpr, GROUP_M: tl.constexpr, COMBINE_BM: tl.constexpr, COMBINE_BN: tl.constexpr,
    ROUTER_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (number of SMs,). Each program takes tickets until the backward task list is done.

    Arguments:
        counters_ptr: (4 + R_pad / BLOCK_M + E,) int32 zeroed: [ticket, dgrad_done, dx_done, -, rows..., experts...]"""
    # sizes and the bf16 row strides restated as multiples of ALIGN (tiles.aligned); the fp32
    # partials' stride is left as it is
    H, I = aligned(H, ALIGN), aligned(I, ALIGN)
    stride_d_out_t, stride_x_t = aligned(stride_d_out_t, ALIGN), aligned(stride_x_t, ALIGN)
    stride_dx_t = aligned(stride_dx_t, ALIGN)
    stride_w13_e, stride_w13_n = aligned(stride_w13_e, ALIGN), aligned(stride_w13_n, ALIGN)
    stride_w2_e, stride_w2_h = aligned(stride_w2_e, ALIGN), aligned(stride_w2_h, ALIGN)
    stride_h_r, stride_a_r = aligned(stride_h_r, ALIGN), aligned(stride_a_r, ALIGN)
    stride_dxr_r = aligned(stride_dxr_r, ALIGN)
    stride_dw13_e, stride_dw13_m = aligned(stride_dw13_e, ALIGN), aligned(stride_dw13_m, ALIGN)
    stride_dw2_e, stride_dw2_m = aligned(stride_dw2_e, ALIGN), aligned(stride_dw2_m, ALIGN)
    n_rb = NUM_ROWS // BLOCK_M
    n_i = tl.cdiv(I, BN_DGRAD)
    n_dgrad = n_rb * n_i
    n_router = tl.cdiv(T * K, ROUTER_BLOCK)
    n_hx = tl.cdiv(H, BN_DX)
    n_dx = n_rb * n_hx
    w2_m, w2_n = tl.cdiv(H, WG_BM), tl.cdiv(I, WG_BN)
    w13_m, w13_n = tl.cdiv(2 * I, WG_BM), tl.cdiv(H, WG_BN)
    n_w2 = E * w2_m * w2_n
    n_w13 = E * w13_m * w13_n
    n_comb_n = tl.cdiv(H, COMBINE_BN)
    end_dgrad = n_dgrad
    end_router = end_dgrad + n_router
    end_dx = end_router + n_dx
    end_w2 = end_dx + n_w2
    end_w13 = end_w2 + n_w13
    total = end_w13 + tl.cdiv(T, COMBINE_BM) * n_comb_n
    ready_rows_ptr = counters_ptr + 4
    ready_expert_ptr = ready_rows_ptr + n_rb
    task = tl.atomic_add(counters_ptr, 1)
    while task < total:
        if task < end_dgrad:
            pid_m, pid_n = grouped_pid(task, n_rb, n_i, GROUP_M)
            down_dgrad_tile(
                pid_m, pid_n, d_out_ptr=d_out_ptr, w2=w2_ptr, h_ptr=h_ptr, topk_weights_ptr=topk_weights_ptr,
                row_to_tk_ptr=row_to_tk_ptr, d_h_ptr=d_h_ptr,
                a_weighted_ptr=a_weighted_ptr, d_w_partial_ptr=partial_ptr, row_to_token_ptr=row_to_token_ptr,
                tile_to_expert_ptr=tile_to_expert_ptr, H=H, I=I, stride_d_out_t=stride_d_out_t,
                stride_w_e=stride_w2_e, stride_w_h=stride_w2_h, stride_h_r=stride_h_r, stride_a_r=stride_a_r,
                stride_part_r=stride_part_r, TILE_M=TILE_M, BLOCK_M=BLOCK_M, BLOCK_N=BN_DGRAD, BLOCK_K=BLOCK_K,
                DOT_PRECISION=DOT_PRECISION,
            )
            expert = tl.load(tile_to_expert_ptr + (pid_m * BLOCK_M) // TILE_M)
            tl.debug_barrier()
            tl.atomic_add(ready_rows_ptr + pid_m, 1, sem="release", scope="gpu")
            if expert >= 0:
                tl.atomic_add(ready_expert_ptr + expert, 1, sem="release", scope="gpu")
            tl.atomic_add(counters_ptr + 1, 1, sem="release", scope="gpu")
        elif task < end_router:
            _wait_for(counters_ptr + 1, n_dgrad)
            router_grad_tile(
                task - end_dgrad, partial_ptr=partial_ptr, tk_to_row_ptr=tk_to_row_ptr, d_w_ptr=d_topk_ptr, TK=T * K,
                J=n_i, stride_partial_r=stride_part_r, BLOCK_M=ROUTER_BLOCK,
            )
        elif task < end_dx:
            pid_m, pid_n = grouped_pid(task - end_router, n_rb, n_hx, GROUP_M)
            _wait_for(ready_rows_ptr + pid_m, n_i)
            gate_up_dgrad_tile(
                pid_m, pid_n, d_h=d_h_ptr, w13=w13_ptr, d_x_rows_ptr=d_x_rows_ptr, row_to_token_ptr=row_to_token_ptr,
                row_to_tk_ptr=None, tile_to_expert_ptr=tile_to_expert_ptr, H=H, N1=2 * I, stride_d_h_r=stride_h_r,
                stride_w_e=stride_w13_e, stride_w_j=stride_w13_n, stride_d_x_r=stride_dxr_r, TILE_M=TILE_M,
                BLOCK_M=BLOCK_M, BLOCK_N=BN_DX, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, TMA=False,
                H_BY_PAIR=False,
            )
            _signal(counters_ptr + 2)
        elif task < end_w13:
            is_w2 = task < end_w2
            t = tl.where(is_w2, task - end_dx, task - end_w2)
            per_expert = tl.where(is_w2, w2_m * w2_n, w13_m * w13_n)
            expert = t // per_expert
            row_blocks = (tl.load(expert_offsets_ptr + expert + 1) - tl.load(expert_offsets_ptr + expert)) // BLOCK_M
            _wait_for(ready_expert_ptr + expert, row_blocks * n_i)
            if is_w2:
                pid_m, pid_n = grouped_pid(t % per_expert, w2_m, w2_n, GROUP_M)
                wgrad_tile(
                    expert, pid_m, pid_n, left=d_out_ptr, right=a_weighted_ptr, d_w_ptr=d_w2_ptr,
                    row_to_token_ptr=row_to_token_ptr, expert_offsets_ptr=expert_offsets_ptr,
                    tokens_per_expert_ptr=tokens_per_expert_ptr, M_OUT=H, N_OUT=I, stride_left=stride_d_out_t,
                    stride_right=stride_a_r, stride_d_w_e=stride_dw2_e, stride_d_w_m=stride_dw2_m, stride_d_w_n=1,
                    LEFT_BY_TOKEN=True, RIGHT_BY_TOKEN=False, BLOCK_M=WG_BM, BLOCK_N=WG_BN, BLOCK_K=WG_BK,
                    DOT_PRECISION=DOT_PRECISION, TMA=False, RIGHT_INDEX_DIVISOR=1,
                )
            else:
                pid_m, pid_n = grouped_pid(t % per_expert, w13_m, w13_n, GROUP_M)
                wgrad_tile(
                    expert, pid_m, pid_n, left=d_h_ptr, right=x_ptr, d_w_ptr=d_w13_ptr,
                    row_to_token_ptr=row_to_token_ptr, expert_offsets_ptr=expert_offsets_ptr,
                    tokens_per_expert_ptr=tokens_per_expert_ptr, M_OUT=2 * I, N_OUT=H, stride_left=stride_h_r,
                    stride_right=stride_x_t, stride_d_w_e=stride_dw13_e, stride_d_w_m=stride_dw13_m, stride_d_w_n=1,
                    LEFT_BY_TOKEN=False, RIGHT_BY_TOKEN=True, BLOCK_M=WG_BM, BLOCK_N=WG_BN, BLOCK_K=WG_BK,
                    DOT_PRECISION=DOT_PRECISION, TMA=False, RIGHT_INDEX_DIVISOR=1,
                )
        else:
            t = task - end_w13
            _wait_for(counters_ptr + 2, n_dx)
            combine_tile(
                t // n_comb_n, t % n_comb_n, rows_ptr=d_x_rows_ptr, tk_to_row_ptr=tk_to_row_ptr, out_ptr=d_x_ptr, T=T,
                H=H, stride_rows_r=stride_dxr_r, stride_out_t=stride_dx_t, K=K, BLOCK_M=COMBINE_BM,
                BLOCK_N=COMBINE_BN,
            )
        task = tl.atomic_add(counters_ptr, 1)


def _num_programs(device: torch.device) -> int:
    if interpreter_on() or device.type != "cuda":
        return 1  # the interpreter runs programs one after the other: one program runs the whole list
    return sm_count(device.index)


def _same_block(*configs) -> tuple[int, int]:
    block_m = {c.block_m for c in configs}
    block_k = {c.block_k for c in configs}
    if len(block_m) != 1 or len(block_k) != 1:
        raise ValueError(f"megakernel tiles must share BLOCK_M and BLOCK_K, got {configs}")
    return block_m.pop(), block_k.pop()


def forward_launch(H: int, I: int, dtype: torch.dtype) -> dict:
    """The forward megakernel's tile constexprs and launch options (num_warps, num_stages) for
    hidden size H, intermediate size I and data type dtype: what forward_megakernel passes, and what
    tests/test_bench_inspect.py compiles for Hopper to check its shared memory."""
    gu, dn, comb = kernel_config("gate_up_fwd", I), kernel_config("down_fwd", H), kernel_config("combine", H)
    block_m, block_k = _same_block(gu, dn)
    return dict(
        BLOCK_M=block_m, BLOCK_K=block_k, BN_GATE_UP=gu.block_n, BN_DOWN=dn.block_n, GROUP_M=gu.group_m,
        COMBINE_BM=comb.block_m, COMBINE_BN=comb.block_n, DOT_PRECISION=dot_precision(dtype),
        # gate_up_fwd's stages for every task; fp32 unpipelined (its 4 stages asked 288 KiB in fp32)
        num_warps=gu.num_warps, num_stages=stages_for(gu, dtype).num_stages,
    )  # fmt: skip


def backward_launch(H: int, I: int, dtype: torch.dtype) -> dict:
    """The backward megakernel's tile constexprs and launch options, as forward_launch's."""
    dg, dx = kernel_config("megakernel_down_dgrad", I), kernel_config("gate_up_dgrad", H)
    wg, comb = kernel_config("megakernel_wgrad", H), kernel_config("combine", H)  # these tiles never narrow
    block_m, block_k = _same_block(dg, dx)
    return dict(
        BLOCK_M=block_m, BLOCK_K=block_k, BN_DGRAD=dg.block_n, BN_DX=dx.block_n, WG_BM=wg.block_m,
        WG_BN=wg.block_n, WG_BK=wg.block_k, GROUP_M=dg.group_m, COMBINE_BM=comb.block_m, COMBINE_BN=comb.block_n,
        ROUTER_BLOCK=_ROUTER_BLOCK, DOT_PRECISION=dot_precision(dtype),
        # the weight-gradient entry's stages, for every task; fp32 unpipelined (3 deep asked 256 KiB)
        num_warps=dg.num_warps, num_stages=stages_for(wg, dtype).num_stages,
    )  # fmt: skip


def forward_megakernel(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
    row_to_tk: torch.Tensor, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tk_to_row: torch.Tensor,
    tile_m: int, top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H], h [R_pad, 2I]): the routed experts' forward in one persistent launch (topk_weights
    fp32 [T, K], read per row through row_to_tk)."""
    topk_weights = routing_weights_arg(topk_weights)
    T, H = x.shape
    E, I2, _ = gate_up_proj.shape
    I = I2 // 2
    options = forward_launch(H, I, x.dtype)
    block_m = options["BLOCK_M"]
    num_rows = check_schedule(row_to_token, tile_to_expert, tile_m, block_m)
    h = torch.empty(num_rows, I2, dtype=x.dtype, device=x.device)
    a = torch.empty(num_rows, I, dtype=x.dtype, device=x.device)
    y = torch.empty(num_rows, H, dtype=x.dtype, device=x.device)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    counters = torch.zeros(2 + num_rows // block_m, dtype=torch.int32, device=x.device)
    _forward_megakernel[(_num_programs(x.device),)](
        x, gate_up_proj, down_proj, topk_weights, row_to_tk, h, a, y, out, row_to_token, tile_to_expert, tk_to_row,
        counters, num_rows,
        T, H, I, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), down_proj.stride(0),
        down_proj.stride(1), h.stride(0), a.stride(0), y.stride(0), out.stride(0), K=top_k, TILE_M=tile_m,
        ALIGN=alignment(H, I, x.stride(0), out.stride(0), *gate_up_proj.stride()[:2], *down_proj.stride()[:2],
                        h.stride(0), a.stride(0), y.stride(0)),
        **options,
    )  # fmt: skip
    return out, h


def backward_megakernel(
    d_out: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, h: torch.Tensor,
    topk_weights: torch.Tensor, row_to_tk: torch.Tensor, row_to_token: torch.Tensor, tile_to_expert: torch.Tensor,
    tk_to_row: torch.Tensor,
    expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor, tile_m: int, top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_x [T, H], d_topk_weights fp32 [T, K], d_gate_up [E, 2I, H], d_down [E, H, I]) in one
    persistent launch."""
    topk_weights = routing_weights_arg(topk_weights)
    T, H = x.shape
    E, I2, _ = gate_up_proj.shape
    I = I2 // 2
    dev, dt = x.device, x.dtype
    options = backward_launch(H, I, dt)
    block_m = options["BLOCK_M"]
    num_rows = check_schedule(row_to_token, tile_to_expert, tile_m, block_m)
    d_h = torch.empty(num_rows, I2, dtype=dt, device=dev)
    a_weighted = torch.empty(num_rows, I, dtype=dt, device=dev)
    partial = torch.zeros(num_rows, cdiv(I, options["BN_DGRAD"]), dtype=torch.float32, device=dev)
    d_x_rows = torch.empty(num_rows, H, dtype=dt, device=dev)
    d_x = torch.empty(T, H, dtype=dt, device=dev)
    d_topk = torch.empty(T * top_k, dtype=torch.float32, device=dev)
    d_w13 = torch.empty_like(gate_up_proj)
    d_w2 = torch.empty_like(down_proj)
    counters = torch.zeros(4 + num_rows // block_m + E, dtype=torch.int32, device=dev)
    _backward_megakernel[(_num_programs(dev),)](
        d_out, x, gate_up_proj, down_proj, h, topk_weights, row_to_tk, d_h, a_weighted, partial, d_x_rows, d_x, d_topk,
        d_w13, d_w2,
        row_to_token, tile_to_expert, tk_to_row, expert_offsets, tokens_per_expert, counters,
        num_rows, T, H, I, E,
        d_out.stride(0), x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), down_proj.stride(0),
        down_proj.stride(1), h.stride(0), a_weighted.stride(0), partial.stride(0), d_x_rows.stride(0), d_x.stride(0),
        d_w13.stride(0), d_w13.stride(1), d_w2.stride(0), d_w2.stride(1),
        K=top_k, TILE_M=tile_m, **options,
        ALIGN=alignment(H, I, d_out.stride(0), x.stride(0), d_x.stride(0), *gate_up_proj.stride()[:2],
                        *down_proj.stride()[:2], h.stride(0), a_weighted.stride(0), d_x_rows.stride(0),
                        *d_w13.stride()[:2], *d_w2.stride()[:2]),
    )  # fmt: skip
    return d_x, d_topk.view(T, top_k), d_w13, d_w2
