"""The device-side schedule: where each routed (token, k) row lives in expert order.

Owns: `MoKSchedule` and `build_schedule()`, and the row <-> token primitives that both backends and
the expert-parallel path use (`values_per_row`, `sum_over_k`). From `topk_ids` alone, with integer
counts, prefix sums and a stable sort, `build_schedule` lays the R = T*K routed rows out expert by
expert. Each expert's segment starts at a multiple of the GEMM tile `tile_m`, so a tile of rows
never spans two experts; within an expert, rows are in ascending (token, k) order, which fixes the
order of every reduction over an expert's rows (the weight gradients).

Row space: rows are indexed in a buffer of static size `num_rows` (an upper bound of the padded
total, computed from T, K, E and tile_m on the host without looking at data), so nothing here
synchronises the host. Padding rows map to -1.

Capacity: with a capacity of C rows per expert, the rows past C of an expert (in (token, k) order)
are dropped: their `tk_to_row` is -1 and `num_dropped` counts them. Nothing is dropped silently:
the count is on the schedule and the layer reports it.

Does not own: the routing decision, or the experts' math (the only floats moved here are routing
weights placed in row order and, in `sum_over_k`, a token's finished rows added in a fixed order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mok_plugin.routing import count_per_expert

__all__ = [
    "DEFAULT_TILE_M",
    "MoKSchedule",
    "build_schedule",
    "expert_capacity",
    "gather_rows_or_zeros",
    "max_padded_rows",
    "segment_offsets",
    "sum_over_k",
    "values_per_row",
]

#: Rows per GEMM tile that segments are padded to; the kernels' BLOCK_M divides it.
DEFAULT_TILE_M = 128


@dataclass(frozen=True, slots=True)
class MoKSchedule:
    """Where every routed row lives; all tensors are on the device of `topk_ids`."""

    tokens_per_expert: torch.Tensor  # int64 [E], rows each expert computes (after any capacity drop)
    expert_offsets: torch.Tensor  # int64 [E+1], exclusive prefix sum of tile-padded counts
    row_to_tk: torch.Tensor  # int64 [num_rows], t*K + k of the row, -1 for padding
    row_to_token: torch.Tensor  # int64 [num_rows], t of the row, -1 for padding
    tk_to_row: torch.Tensor  # int64 [T*K], row of (t, k), -1 when dropped by capacity
    tile_to_expert: torch.Tensor  # int64 [num_rows // tile_m], expert of each tile, -1 past the end
    num_dropped: torch.Tensor  # int64 [], (token, k) pairs dropped by the capacity limit
    num_tokens: int  # T
    top_k: int  # K
    num_experts: int  # E
    tile_m: int  # segment padding
    num_rows: int  # static size of the row space (an upper bound of expert_offsets[-1])


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows one expert may take: ceil(T*K/E * capacity_factor), at least 1."""
    return max(1, math.ceil(num_tokens * top_k / num_experts * capacity_factor))


def max_padded_rows(num_rows_routed: int, num_experts: int, tile_m: int, capacity: int | None = None) -> int:
    """Static upper bound of the tile-padded row total, from sizes only (no data, no host sync).

    Each expert pads by at most tile_m - 1 rows, and at most min(E, R) experts are non-empty; with a
    capacity C no expert exceeds ceil(C / tile_m) tiles.
    """
    R = num_rows_routed
    tiles = R // tile_m + min(num_experts, R)
    if capacity is not None:
        tiles = min(tiles, num_experts * math.ceil(capacity / tile_m))
    return max(tiles, 1) * tile_m


def segment_offsets(counts: torch.Tensor, align: int) -> torch.Tensor:
    """int64 [E + 1]: where each expert's segment starts when segments are padded to a multiple of
    `align` rows (the schedule's tile_m, or the Hopper weight gradient's 64-row K step for its
    dense copies: `kernels.schedule.dense_rows`), and the end."""
    padded = (counts + align - 1) // align * align
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)])


def values_per_row(values_TK: torch.Tensor, row_to_tk: torch.Tensor) -> torch.Tensor:
    """[num_rows]: values_TK [T, K] placed in row order, 0 on padding rows (also when T = 0)."""
    return gather_rows_or_zeros(values_TK.reshape(-1, 1), row_to_tk).squeeze(1)


def gather_rows_or_zeros(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[len(index), N]: src[index[r]] for each r, zeros where index[r] < 0: rows of per-pair
    tensors [T * K, N] placed in row order through row_to_tk, or of x [T, H] through row_to_token
    (also when src has no rows: a trailing zero row serves every negative index)."""
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])
    return padded.index_select(0, torch.where(index >= 0, index, src.shape[0]))


def sum_over_k(rows_TKH: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Each token's K rows summed in a fixed order, as the kernels' combine sums them.

    ((r0 + r1) + r2) + ... in fp32 (fp64 for fp64 rows), rounded once to out_dtype. The reference
    backend's combine and its dX, and the expert-parallel combine and its row-gather gradient, all
    sum this way, so every path adds a token's rows in the same order with the same rounding.

    Args:
        rows_TKH: [T, K, H], the rows of each token in ascending k.
        out_dtype: the result's dtype.
    Returns:
        [T, H] in out_dtype.
    """
    acc_dtype = torch.float64 if rows_TKH.dtype == torch.float64 else torch.float32
    acc = rows_TKH[:, 0].to(acc_dtype)
    for k in range(1, rows_TKH.shape[1]):
        acc = acc + rows_TKH[:, k].to(acc_dtype)
    return acc.to(out_dtype)


def build_schedule(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    tile_m: int = DEFAULT_TILE_M,
    capacity: int | None = None,
    impl: str = "auto",
) -> MoKSchedule:
    """Lay out the routed rows expert by expert, on the device, without synchronising the host.

    Args:
        topk_ids: int [T, K], expert of each (token, k); a value outside [0, E) marks an empty
            slot (expert parallelism's fixed-size buffers): it gets no row and is not counted.
        num_experts: E.
        tile_m: segments start at multiples of this.
        capacity: rows one expert may take; None = dropless.
        impl: "torch" (sort and prefix sums in PyTorch ops), "triton" (two kernels, from
            kernels/schedule.py), or "auto": triton on a CUDA device, torch elsewhere. Both give
            bitwise the same schedule.
    Returns:
        MoKSchedule.
    Raises:
        ValueError: topk_ids is not a 2-D integer tensor, tile_m / capacity is not positive, or
            impl is unknown.
    """
    if topk_ids.dim() != 2 or topk_ids.is_floating_point() or topk_ids.is_complex():
        raise ValueError(f"topk_ids must be an integer [T, K] tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tile_m <= 0:
        raise ValueError(f"tile_m={tile_m} must be positive")
    if capacity is not None and capacity <= 0:
        raise ValueError(f"capacity={capacity} must be positive")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl={impl!r}; allowed: 'auto', 'torch', 'triton'")
    T, K = topk_ids.shape
    E = num_experts
    R = T * K
    num_rows = max_padded_rows(R, E, tile_m, capacity)
    # Imported here so that `import mok_plugin` does not import triton.
    kernels = impl == "triton" or (impl == "auto" and topk_ids.is_cuda)
    if kernels and torch.compiler.is_compiling():
        from mok_plugin.ops import schedule_maps_op as maps_fn  # one opaque node (its comment says why)
    elif kernels:
        from mok_plugin.kernels.schedule import schedule_maps as maps_fn
    else:
        maps_fn = _schedule_maps_torch
    tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert, num_dropped = maps_fn(
        topk_ids, E, tile_m, capacity, num_rows
    )
    return MoKSchedule(
        tokens_per_expert=tokens_per_expert,
        expert_offsets=expert_offsets,
        row_to_tk=row_to_tk,
        row_to_token=row_to_token,
        tk_to_row=tk_to_row,
        tile_to_expert=tile_to_expert,
        num_dropped=num_dropped,
        num_tokens=T,
        top_k=K,
        num_experts=E,
        tile_m=tile_m,
        num_rows=num_rows,
    )


def _schedule_maps_torch(
    topk_ids: torch.Tensor, num_experts: int, tile_m: int, capacity: int | None, num_rows: int
) -> tuple[torch.Tensor, ...]:
    """The schedule with PyTorch ops: a stable sort by expert, counts and prefix sums.

    Returns (tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert,
    num_dropped), as `kernels.schedule.schedule_maps` does.
    """
    T, K = topk_ids.shape
    E = num_experts
    R = T * K
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Empty slots (ids outside [0, E)) go to an extra bin E, sorted last, and get no row.
    flat = torch.where((flat >= 0) & (flat < E), flat, E)

    # Stable sort by expert: within an expert the tk indices stay ascending.
    sorted_experts, sorted_tk = torch.sort(flat, stable=True)
    bin_counts = count_per_expert(flat, E + 1)
    bin_starts = torch.cumsum(bin_counts, 0) - bin_counts
    rank_in_expert = torch.arange(R, device=device) - bin_starts[sorted_experts]
    routed_counts = bin_counts[:E]

    kept = sorted_experts < E
    if capacity is not None:
        kept = kept & (rank_in_expert < capacity)
        tokens_per_expert = routed_counts.clamp(max=capacity)
    else:
        tokens_per_expert = routed_counts

    expert_offsets = segment_offsets(tokens_per_expert, tile_m)  # [E + 1]: the empty bin E reads the end (never kept)

    # Dropped pairs all write into one scratch slot past the end, which is cut off afterwards.
    rows = torch.where(kept, expert_offsets[sorted_experts] + rank_in_expert, num_rows)
    row_to_tk = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    row_to_tk[rows] = torch.where(kept, sorted_tk, -1)
    row_to_tk = row_to_tk[:num_rows]
    tk_to_row = torch.empty(R, dtype=torch.int64, device=device)
    tk_to_row[sorted_tk] = torch.where(kept, rows, -1)
    row_to_token = torch.where(row_to_tk >= 0, row_to_tk // max(K, 1), -1)

    tile_starts = torch.arange(0, num_rows, tile_m, device=device)
    tile_to_expert = torch.searchsorted(expert_offsets[1:], tile_starts, right=True)
    tile_to_expert = torch.where(tile_to_expert < E, tile_to_expert, -1)

    num_dropped = (sorted_experts < E).sum() - tokens_per_expert.sum()
    return tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert, num_dropped
