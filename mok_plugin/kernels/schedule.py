"""Schedule kernels behind `mok_plugin.schedule.build_schedule` on the GPU.

Math (R = T*K routed pairs, flat index tk = t*K + k, e = topk_ids[tk]):
    counts[e]        = #{tk : e_tk = e}
    kept[e]          = min(counts[e], capacity)
    offsets[e]       = sum over e' < e of ceil(kept[e'] / TILE_M) * TILE_M
    rank(tk)         = #{tk' < tk : e_tk' = e_tk}
    tk_to_row[tk]    = offsets[e] + rank(tk) if rank(tk) < capacity else -1
    row_to_tk[row]   = tk for every kept pair (padding rows keep the -1 they were filled with)

Tensors: topk_ids int [T*K]; counts int32 [E]; tokens_per_expert int64 [E]; expert_offsets int64
[E+1]; tk_to_row int64 [T*K]; row_to_tk and row_to_token int64 [R_pad]; tile_to_expert int64
[R_pad / TILE_M].

Grids: the histogram runs a program per BLOCK pairs and adds its per-expert counts with integer
atomics (order-free: integer addition commutes). The scatter runs one program per expert, which
owns that expert's offsets, segment, tiles and map entries; it scans the pairs in ascending tk, so
ranks are in (token, k) order by construction. No float arithmetic; nothing here reads the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["schedule_maps"]


@triton.jit
def _expert_histogram_kernel(
    ids_ptr,  # (R,) int
    counts_ptr,  # (E,) int32, zero-filled
    R,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (cdiv(R, BLOCK),). Program b adds the expert histogram of pairs [b*BLOCK, (b+1)*BLOCK)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < R, other=E_POW2).to(tl.int32)
    experts = tl.arange(0, E_POW2)
    # [BLOCK, E_POW2] one-hot summed over the block; padding lanes hold E_POW2 and match nothing.
    hist = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + experts, hist, mask=(experts < E) & (hist > 0))


@triton.jit
def _schedule_scatter_kernel(
    ids_ptr,  # (R,) int
    counts_ptr,  # (E,) int32
    tokens_per_expert_ptr,  # (E,) int64 out
    expert_offsets_ptr,  # (E+1,) int64 out
    tk_to_row_ptr,  # (R,) int64 out
    row_to_tk_ptr,  # (R_pad,) int64, pre-filled with -1
    row_to_token_ptr,  # (R_pad,) int64, pre-filled with -1
    tile_to_expert_ptr,  # (R_pad / TILE_M,) int64, pre-filled with -1
    R,
    capacity,
    K: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (E,). Program e owns expert e's offset, count, tiles and map entries; scans the pairs
    in ascending tk order."""
    e = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0).to(tl.int64)
    kept = tl.minimum(counts, capacity)
    padded = (kept + TILE_M - 1) // TILE_M * TILE_M
    offset = tl.sum(tl.where(experts < e, padded, 0))
    my_kept = tl.sum(tl.where(experts == e, kept, 0))
    my_padded = tl.sum(tl.where(experts == e, padded, 0))
    tl.store(tokens_per_expert_ptr + e, my_kept)
    tl.store(expert_offsets_ptr + e, offset)
    if e == E - 1:
        tl.store(expert_offsets_ptr + E, offset + my_padded)
    for tile in range(offset // TILE_M, (offset + my_padded) // TILE_M):
        tl.store(tile_to_expert_ptr + tile, e.to(tl.int64))

    seen = tl.zeros((), dtype=tl.int64)
    for start in range(0, R, BLOCK):
        tk = start + tl.arange(0, BLOCK).to(tl.int64)
        in_range = tk < R
        ids = tl.load(ids_ptr + tk, mask=in_range, other=-1)
        match = (ids == e) & in_range
        rank = seen + tl.cumsum(match.to(tl.int64), axis=0) - 1
        keep = match & (rank < capacity)
        row = offset + rank
        tl.store(tk_to_row_ptr + tk, tl.where(keep, row, -1), mask=match)
        tl.store(row_to_tk_ptr + row, tk, mask=keep)
        tl.store(row_to_token_ptr + row, tk // K, mask=keep)
        seen += tl.sum(match.to(tl.int64), axis=0)


def schedule_maps(
    topk_ids: torch.Tensor, num_experts: int, tile_m: int, capacity: int | None, num_rows: int
) -> tuple[torch.Tensor, ...]:
    """(tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert, routed_counts).

    Args:
        topk_ids: int [T, K] on a CUDA device (or CPU under TRITON_INTERPRET=1).
        num_experts: E.
        tile_m: segment padding.
        capacity: rows one expert may take, None = unlimited.
        num_rows: R_pad, the static size of the row space (a multiple of tile_m).
    """
    T, K = topk_ids.shape
    R = T * K
    E = num_experts
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    counts = torch.zeros(E, dtype=torch.int32, device=device)
    tokens_per_expert = torch.empty(E, dtype=torch.int64, device=device)
    expert_offsets = torch.empty(E + 1, dtype=torch.int64, device=device)
    tk_to_row = torch.empty(R, dtype=torch.int64, device=device)
    row_to_tk = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    row_to_token = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    tile_to_expert = torch.full((num_rows // tile_m,), -1, dtype=torch.int64, device=device)
    e_pow2 = triton.next_power_of_2(E)
    hist_block = max(16, min(1024, 8192 // e_pow2))  # keeps the [BLOCK, E] one-hot tile small
    if R > 0:
        _expert_histogram_kernel[(triton.cdiv(R, hist_block),)](ids, counts, R, E=E, E_POW2=e_pow2, BLOCK=hist_block)
    cap = R if capacity is None else capacity
    _schedule_scatter_kernel[(E,)](
        ids,
        counts,
        tokens_per_expert,
        expert_offsets,
        tk_to_row,
        row_to_tk,
        row_to_token,
        tile_to_expert,
        R,
        cap,
        K=K,
        E=E,
        E_POW2=e_pow2,
        TILE_M=tile_m,
        BLOCK=1024,
    )
    return tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert, counts
