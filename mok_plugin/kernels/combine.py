"""Fixed-order sums back into token order: the combine (forward output, backward dX) and the
router-score gradient.

Math:
    combine_rows         out[t] = ((rows[row(t,0)] + rows[row(t,1)]) + ...) + rows[row(t,K-1)]
    reduce_router_grad   d_w[t, k] = sum over I-blocks j, ascending, of partial[row(t,k), j]

Tensors: rows [R_pad, H] params dtype (y for the forward, dx rows for the backward); tk_to_row
int64 [T*K] (-1 for a pair dropped by capacity, which adds nothing); partial fp32 [R_pad, J];
out [T, H] params dtype; d_w fp32 [T, K].

Grids: combine_rows runs a program per (block of BLOCK_M tokens, block of BLOCK_N columns), which
owns those outputs; reduce_router_grad a program per block of BLOCK_M (token, k) pairs. The tile
functions (tiles.py) are shared with the persistent megakernel (megakernel.py).

Determinism: each output has one owner; the sum over k and over I-blocks runs in ascending order
in fp32 and is rounded once; no atomics. The weighting by the routing weight happens upstream (in
the down-projection epilogue), so this one kernel serves forward and backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok_plugin.kernels.configs import kernel_config
from mok_plugin.kernels.launch import alignment, cdiv, launch
from mok_plugin.kernels.tiles import aligned, combine_tile, router_grad_tile

__all__ = ["combine_rows", "reduce_router_grad"]


@triton.jit
def _combine_rows_kernel(
    rows_ptr, tk_to_row_ptr, out_ptr, T, H, stride_rows_r, stride_out_t, K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_M), cdiv(H, BLOCK_N)). Program (m, n) owns out[m-block, n-block]."""
    # H and the strides restated as multiples of ALIGN, so that loads vectorise (tiles.aligned)
    H = aligned(H, ALIGN)
    stride_rows_r = aligned(stride_rows_r, ALIGN)
    stride_out_t = aligned(stride_out_t, ALIGN)
    combine_tile(
        tl.program_id(0), tl.program_id(1), rows_ptr=rows_ptr, tk_to_row_ptr=tk_to_row_ptr, out_ptr=out_ptr, T=T, H=H,
        stride_rows_r=stride_rows_r, stride_out_t=stride_out_t, K=K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )


@triton.jit
def _reduce_router_grad_kernel(partial_ptr, tk_to_row_ptr, d_w_ptr, TK, J, stride_partial_r, BLOCK_M: tl.constexpr):
    """Grid: (cdiv(T*K, BLOCK_M),). Program m owns d_w[m-block]."""
    router_grad_tile(
        tl.program_id(0), partial_ptr=partial_ptr, tk_to_row_ptr=tk_to_row_ptr, d_w_ptr=d_w_ptr, TK=TK, J=J,
        stride_partial_r=stride_partial_r, BLOCK_M=BLOCK_M,
    )


def combine_rows(rows: torch.Tensor, tk_to_row: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T, H] in rows' dtype: each token's K rows summed in ascending k (fp32, rounded once).

    Args:
        rows: [R_pad, H], contiguous.
        tk_to_row: int64 [T*K]; -1 entries add nothing.
        num_tokens, top_k: T and K.
    """
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous [R_pad, H] tensor, got {tuple(rows.shape)}")
    if tk_to_row.dtype != torch.int64 or tk_to_row.shape != (num_tokens * top_k,):
        raise ValueError(
            f"tk_to_row must be int64 [{num_tokens * top_k}], got {tk_to_row.dtype} {tuple(tk_to_row.shape)}"
        )
    H = rows.shape[1]
    out = torch.empty(num_tokens, H, dtype=rows.dtype, device=rows.device)
    if num_tokens == 0:
        return out
    cfg = kernel_config("combine", H)
    grid = (cdiv(num_tokens, cfg.block_m), cdiv(H, cfg.block_n))
    launch(_combine_rows_kernel, grid,
        rows, tk_to_row, out, num_tokens, H, rows.stride(0), out.stride(0), K=top_k, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, ALIGN=alignment(H, rows.stride(0), out.stride(0)), num_warps=cfg.num_warps,
    )
    return out


def reduce_router_grad(partial: torch.Tensor, tk_to_row: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """fp32 [T, K]: the router-score gradient of each (token, k) from its row's partials."""
    if partial.dim() != 2 or partial.dtype != torch.float32 or not partial.is_contiguous():
        raise ValueError(
            f"partial must be a contiguous fp32 [R_pad, J] tensor, got {partial.dtype} {tuple(partial.shape)}"
        )
    TK = num_tokens * top_k
    d_w = torch.empty(TK, dtype=torch.float32, device=partial.device)
    if TK == 0:
        return d_w.view(num_tokens, top_k)
    block = 128
    launch(_reduce_router_grad_kernel, (cdiv(TK, block),),
        partial, tk_to_row, d_w, TK, partial.shape[1], partial.stride(0), BLOCK_M=block, num_warps=4,
    )
    return d_w.view(num_tokens, top_k)
