"""Schedule kernels behind `mok_plugin.schedule.build_schedule` on the GPU.

Math (R = T*K routed pairs, flat index tk = t*K + k, e = topk_ids[tk]):
    counts[e]        = #{tk : e_tk = e}
    kept[e]          = min(counts[e], capacity)
    offsets[e]       = sum over e' < e of ceil(kept[e'] / TILE_M) * TILE_M
    rank(tk)         = #{tk' < tk : e_tk' = e_tk}
    tk_to_row[tk]    = offsets[e] + rank(tk) if rank(tk) < capacity else -1
    row_to_tk[row]   = tk for every kept pair, -1 on padding rows and rows past the last segment

Tensors: topk_ids int [T*K]; chunk_counts and chunk_prefix int64 [C, E]; totals (routed pairs
per expert, before any capacity) and tokens_per_expert int64 [E]; expert_offsets int64 [E+1];
tk_to_row int64 [T*K]; row_to_tk and row_to_token int64 [R_pad]; tile_to_expert int64
[R_pad / TILE_M].

Grids: three kernels over chunks of 32 to 256 pairs (`chunk_pairs`). The histogram runs a program per chunk and
writes that chunk's per-expert counts; the prefix kernel runs a program per expert, which turns its
column of chunk counts into an exclusive prefix over chunks and its total; the scatter runs a
program per chunk, which derives every expert's offset from the totals, writes its share of the
tiles, and ranks the chunk's pairs within their experts in ascending tk (a running count per
expert plus a cumulative one-hot sum), so rows within an expert are in (token, k) order by
construction. When all pairs fit one chunk of _CHUNK (T*K <= 2048: small batches, bound by host
time) one kernel does all three, a program per expert. No atomics, no float arithmetic; nothing
here reads the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok_plugin.kernels.launch import cdiv, launch, next_power_of_2

__all__ = ["chunk_pairs", "dense_rows", "row_values", "schedule_maps"]


@triton.jit
def _chunk_histogram(ids_ptr, c, R, E_POW2: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """int64 [E_POW2]: the expert histogram of pairs [c*CHUNK, (c+1)*CHUNK)."""
    experts = tl.arange(0, E_POW2)
    hist = tl.zeros((E_POW2,), dtype=tl.int64)
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < R, other=E_POW2).to(tl.int32)
        # [SUB, E_POW2] one-hot summed over the pairs; padding lanes hold E_POW2 and match nothing.
        hist += tl.sum((ids[:, None] == experts[None, :]).to(tl.int64), axis=0)
    return hist


@triton.jit
def _chunk_histogram_kernel(
    ids_ptr,  # (R,) int
    chunk_counts_ptr,  # (C, E) int64 out
    R,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
):
    """Grid: (C,). Program c owns chunk_counts[c, :], the expert histogram of pairs
    [c*CHUNK, (c+1)*CHUNK)."""
    c = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_POW2)
    hist = _chunk_histogram(ids_ptr, c, R, E_POW2=E_POW2, CHUNK=CHUNK, SUB=SUB)
    tl.store(chunk_counts_ptr + c * E + experts, hist, mask=experts < E)


@triton.jit
def _chunk_prefix_kernel(
    chunk_counts_ptr,  # (C, E) int64 per-chunk counts
    chunk_prefix_ptr,  # (C, E) int64 out: exclusive prefix over chunks
    totals_ptr,  # (E,) int64 out: routed pairs of each expert, before any capacity
    C,
    E: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid: (E,). Program e owns column e of chunk_prefix (the exclusive prefix of column e of
    chunk_counts over ascending chunks) and totals[e]; it reads that column only."""
    e = tl.program_id(0)
    mine = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        c_ok = cs < C
        col = tl.load(chunk_counts_ptr + cs * E + e, mask=c_ok, other=0)
        tl.store(chunk_prefix_ptr + cs * E + e, mine + tl.cumsum(col, axis=0) - col, mask=c_ok)
        mine += tl.sum(col, axis=0)
    tl.store(totals_ptr + e, mine)


@triton.jit
def _segments(totals, capacity, E: tl.constexpr, E_POW2: tl.constexpr, TILE_M: tl.constexpr):
    """(routed, kept, padded) int64 [E_POW2] from every expert's routed count: lanes E..E_POW2-1
    (the one-chunk histogram counts empty slots whose id falls there) are no expert's and count 0;
    kept is capped at the capacity, padded rounded up to TILE_M."""
    routed = tl.where(tl.arange(0, E_POW2) < E, totals, 0)
    kept = tl.minimum(routed, capacity)
    return routed, kept, (kept + TILE_M - 1) // TILE_M * TILE_M


@triton.jit
def _expert_layout(
    totals,
    e,
    capacity,
    tokens_per_expert_ptr,
    expert_offsets_ptr,
    tile_to_expert_ptr,
    num_dropped_ptr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE_M: tl.constexpr,
):
    """From every expert's routed count (totals, int64 [E_POW2]): expert e's kept count, offset and
    tiles; the last expert's program also the end offset and the dropped count. Returns (e's offset,
    e's kept count, e's padded length, the end of the last segment)."""
    experts = tl.arange(0, E_POW2)
    totals, kept, padded = _segments(totals, capacity, E=E, E_POW2=E_POW2, TILE_M=TILE_M)
    offset = tl.sum(tl.where(experts < e, padded, 0))
    my_padded = tl.sum(tl.where(experts == e, padded, 0))
    my_kept = tl.sum(tl.where(experts == e, kept, 0))
    end = tl.sum(padded)  # the last segment's end
    tl.store(tokens_per_expert_ptr + e, my_kept)
    tl.store(expert_offsets_ptr + e, offset)
    if e == E - 1:
        tl.store(expert_offsets_ptr + E, end)
        tl.store(num_dropped_ptr, tl.sum(totals - kept))
    for tile in range(offset // TILE_M, (offset + my_padded) // TILE_M):
        tl.store(tile_to_expert_ptr + tile, e.to(tl.int64))
    return offset, my_kept, my_padded, end


@triton.jit
def _chunk_scatter_kernel(
    ids_ptr,  # (R,) int
    chunk_prefix_ptr,  # (C, E) int64: pairs of expert e in chunks before c
    totals_ptr,  # (E,) int64: routed pairs of each expert
    tokens_per_expert_ptr,  # (E,) int64 out
    expert_offsets_ptr,  # (E+1,) int64 out
    num_dropped_ptr,  # () int64 out
    tile_to_expert_ptr,  # (R_pad / TILE_M,) int64, pre-filled with -1
    tk_to_row_ptr,  # (R,) int64 out
    row_to_tk_ptr,  # (R_pad,) int64, pre-filled with -1
    row_to_token_ptr,  # (R_pad,) int64, pre-filled with -1
    R,
    capacity,
    num_tiles,
    K: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid: (C,). Every program derives the experts' kept counts and offsets from the totals;
    program 0 stores them and the dropped count, program c the tiles c*BLOCK_T.. (strided by C)
    and the map entries of chunk c's pairs, ranked within their experts in ascending tk."""
    c = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_POW2)
    is_expert = experts < E
    totals, kept, padded = _segments(
        tl.load(totals_ptr + experts, mask=is_expert, other=0), capacity, E=E, E_POW2=E_POW2, TILE_M=TILE_M
    )
    ends = tl.cumsum(padded, axis=0)  # lanes past E add nothing: their end is the last segment's
    offsets = ends - padded
    end = tl.sum(padded)
    if c == 0:
        tl.store(tokens_per_expert_ptr + experts, kept, mask=is_expert)
        tl.store(expert_offsets_ptr + experts, offsets, mask=is_expert)
        tl.store(expert_offsets_ptr + E, end)
        tl.store(num_dropped_ptr, tl.sum(totals - kept))
    # A tile's expert: the number of segments that end at or before its first row (empty ones
    # included, they end where they start); tiles past the last segment keep their -1.
    for t0 in range(c * BLOCK_T, num_tiles, tl.num_programs(0) * BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        first_row = tiles * TILE_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int64), axis=1)
        tl.store(tile_to_expert_ptr + tiles, owner, mask=first_row < end)
    # Ranks in int32 (a rank is below R); rows in int64.
    seen = tl.load(chunk_prefix_ptr + c * E + experts, mask=is_expert, other=0).to(tl.int32)
    for s0 in range(0, CHUNK, SUB):
        tk = c * CHUNK + s0 + tl.arange(0, SUB).to(tl.int64)
        in_range = tk < R
        ids = tl.load(ids_ptr + tk, mask=in_range, other=-1)
        routed = in_range & (ids >= 0) & (ids < E)  # any other id is an empty slot
        onehot = (ids[:, None] == experts[None, :]) & routed[:, None]
        before = tl.cumsum(onehot.to(tl.int32), axis=0)  # this chunk's pairs of the expert up to tk
        rank = tl.sum(tl.where(onehot, before + seen[None, :], 0), axis=1) - 1
        row = tl.sum(tl.where(onehot, offsets[None, :], 0), axis=1) + rank
        keep = routed & (rank < capacity)
        tl.store(tk_to_row_ptr + tk, tl.where(keep, row, -1), mask=in_range)
        tl.store(row_to_tk_ptr + row, tk, mask=keep)
        tl.store(row_to_token_ptr + row, tk // K, mask=keep)
        seen += tl.sum(onehot.to(tl.int32), axis=0)


@triton.jit
def _scatter_chunk(
    ids_ptr,
    e,
    c,
    seen,
    offset,
    tk_to_row_ptr,
    row_to_tk_ptr,
    row_to_token_ptr,
    R,
    capacity,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The map entries of expert e's pairs in chunk c, whose first pair has rank `seen` in e and
    whose segment starts at row `offset`."""
    for s0 in range(0, CHUNK, BLOCK):
        tk = c * CHUNK + s0 + tl.arange(0, BLOCK).to(tl.int64)
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


@triton.jit
def _schedule_one_chunk_kernel(
    ids_ptr,
    tokens_per_expert_ptr,
    expert_offsets_ptr,
    tk_to_row_ptr,
    row_to_tk_ptr,
    row_to_token_ptr,
    tile_to_expert_ptr,
    num_dropped_ptr,
    R,
    num_rows,
    capacity,
    K: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (E,). The three kernels in one launch when all pairs fit one chunk (R <= CHUNK): program
    e takes the histogram of every pair itself (no chunk counts to exchange), then owns expert e's
    count, offset, tiles and map entries, as the offsets and scatter kernels' program e would. The
    maps are not pre-filled here (one launch less in front of the first GEMM): program e also writes
    the -1s of its segment's padding rows and, the programs taking turns a BLOCK at a time, those
    of the rows and tiles past the last segment and of the empty slots' tk_to_row."""
    e = tl.program_id(0)
    zero = tl.zeros((), dtype=tl.int64)  # chunk 0, and no pairs of e before it (an int64 as in the scatter)
    totals = _chunk_histogram(ids_ptr, zero, R, E_POW2=E_POW2, CHUNK=CHUNK, SUB=SUB)
    offset, kept, padded, end = _expert_layout(
        totals, e, capacity, tokens_per_expert_ptr, expert_offsets_ptr, tile_to_expert_ptr, num_dropped_ptr, E=E,
        E_POW2=E_POW2, TILE_M=TILE_M,
    )  # fmt: skip
    _scatter_chunk(
        ids_ptr, e, zero, zero, offset, tk_to_row_ptr, row_to_tk_ptr, row_to_token_ptr, R, capacity, K=K, CHUNK=CHUNK,
        BLOCK=BLOCK,
    )  # fmt: skip
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    empty = tl.full((BLOCK,), -1, dtype=tl.int64)
    for p0 in range(0, TILE_M, BLOCK):  # e's padding rows
        rows = offset + kept + p0 + lanes
        tl.store(row_to_tk_ptr + rows, empty, mask=rows < offset + padded)
        tl.store(row_to_token_ptr + rows, empty, mask=rows < offset + padded)
    for r0 in range(end + e * BLOCK, num_rows, E * BLOCK):  # rows past the last segment
        rows = r0 + lanes
        tl.store(row_to_tk_ptr + rows, empty, mask=rows < num_rows)
        tl.store(row_to_token_ptr + rows, empty, mask=rows < num_rows)
    for t0 in range(end // TILE_M + e * BLOCK, num_rows // TILE_M, E * BLOCK):  # tiles past it
        tiles = t0 + lanes
        tl.store(tile_to_expert_ptr + tiles, empty, mask=tiles < num_rows // TILE_M)
    for s0 in range(e * BLOCK, R, E * BLOCK):  # slots holding no expert (expert parallelism's)
        tk = s0 + lanes
        ids = tl.load(ids_ptr + tk, mask=tk < R, other=0)
        tl.store(tk_to_row_ptr + tk, empty, mask=(tk < R) & ((ids < 0) | (ids >= E)))


# Pairs the one-launch schedule takes (a program per expert reads them all).
_CHUNK = 2048
# Pairs per chunk above that: a program per chunk in the histogram and the scatter, so that they
# spread over the GPU (64 chunks of 2048 at T*K = 131k left half the SMs idle and each program 16
# times the work: 0.21 ms of qwen3-30b-a3b's schedule on the H200). Each program's chunk is a chain
# of dependent steps, so the chunk shrinks with R until there are _CHUNK_PROGRAMS of them, down to
# _MIN_CHUNK pairs: at T*K = 4096 (16 chunks of 256) the scatter took 0.039 ms, in 128 chunks of
# 32 0.007 (H100; 0.018 at 32,768 pairs in chunks of 64 against 0.042). Below ~512 chunks the
# prefix kernel's column reads stay cheap (2,048 chunks of 64 at 131k pairs: 0.005 -> 0.013 ms).
# Powers of 2: the one-hot tiles step through a chunk SUB pairs at a time.
_MANY_CHUNK = 256
_MIN_CHUNK = 32
_CHUNK_PROGRAMS = 512


def chunk_pairs(num_pairs: int) -> int:
    """Pairs per chunk of the chunked schedule (more than _CHUNK pairs): _MANY_CHUNK, or fewer where
    that leaves under _CHUNK_PROGRAMS chunks, never under _MIN_CHUNK. The maps do not depend on it."""
    return min(_MANY_CHUNK, max(_MIN_CHUNK, next_power_of_2(cdiv(num_pairs, _CHUNK_PROGRAMS))))


def schedule_maps(
    topk_ids: torch.Tensor,
    num_experts: int,
    tile_m: int,
    capacity: int | None,
    num_rows: int,
    one_allocation: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert,
    num_dropped).

    Args:
        topk_ids: int [T, K] on a CUDA device (or CPU under TRITON_INTERPRET=1).
        num_experts: E.
        tile_m: segment padding.
        capacity: rows one expert may take, None = unlimited.
        num_rows: R_pad, the static size of the row space (a multiple of tile_m).
        one_allocation: the maps and scratch as views of one allocation (eager: fewer launches),
            else a buffer each (the compiled graph's op, `ops.schedule_maps_op`: an op's outputs
            may not alias one another).
    """
    T, K = topk_ids.shape
    R = T * K
    E = num_experts
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    one_chunk = R <= _CHUNK
    chunk = chunk_pairs(R)
    C = cdiv(R, chunk)
    # The four maps start at -1 (empty slots match no expert; padding rows and unused tiles stay -1),
    # written by the one-chunk kernel itself, else by a fill; the counts, offsets and dropped count
    # are written whole by the kernels, and so are the chunked path's scratch (chunk counts, their
    # prefix over chunks, the totals).
    sizes = [R, num_rows, num_rows, num_rows // tile_m]
    scratch_sizes = [] if one_chunk else [C * E, C * E, E]
    if not one_allocation:  # at most three more fill launches
        tokens_per_expert = torch.empty(E, dtype=torch.int64, device=device)
        expert_offsets = torch.empty(E + 1, dtype=torch.int64, device=device)
        num_dropped = torch.empty((), dtype=torch.int64, device=device)
        tk_to_row, row_to_tk, row_to_token, tile_to_expert = (
            torch.full((n,), -1, dtype=torch.int64, device=device) for n in sizes
        )
        scratch = [torch.empty(n, dtype=torch.int64, device=device) for n in scratch_sizes]
    else:
        # Eagerly, one allocation and one fill with a view per tensor: with the dropped count from
        # the kernels, 8 launches fewer in front of the first GEMM (host time 0.22 -> 0.10 ms,
        # olmoe, H200), and 3 allocations fewer (~8 us of host each on the H200 at T = 1).
        size = 2 * E + 2 + sum(sizes) + sum(scratch_sizes)
        filled = torch.empty(size, dtype=torch.int64, device=device) if one_chunk else (
            torch.full((size,), -1, dtype=torch.int64, device=device))  # fmt: skip
        tokens_per_expert, expert_offsets, num_dropped, tk_to_row, row_to_tk, row_to_token, tile_to_expert, *scratch = (
            filled.split([E, E + 1, 1, *sizes, *scratch_sizes])
        )
        num_dropped = num_dropped.view(())
    e_pow2 = next_power_of_2(E)
    # the [SUB, E] one-hot tiles kept small, and no wider than a chunk (a wider one would count the next chunk's pairs)
    sub = max(16, min(256, 8192 // e_pow2))
    scatter_sub = min(chunk, max(4, min(64, 2048 // e_pow2)))
    cap = R if capacity is None else capacity
    if one_chunk:  # small batches: one launch instead of three (host time, not GPU time, bounds them)
        launch(_schedule_one_chunk_kernel, (E,),
            ids, tokens_per_expert, expert_offsets, tk_to_row, row_to_tk, row_to_token, tile_to_expert, num_dropped, R,
            num_rows, cap, K=K, E=E, E_POW2=e_pow2, TILE_M=tile_m, CHUNK=_CHUNK, SUB=sub, BLOCK=1024,
        )  # fmt: skip
    else:
        chunk_counts, chunk_prefix, totals = scratch
        launch(_chunk_histogram_kernel, (C,), ids, chunk_counts, R, E=E, E_POW2=e_pow2, CHUNK=chunk,
               SUB=min(sub, chunk))  # fmt: skip
        launch(_chunk_prefix_kernel, (E,), chunk_counts, chunk_prefix, totals, C, E=E, BLOCK_C=1024)
        launch(_chunk_scatter_kernel, (C,),
            ids, chunk_prefix, totals, tokens_per_expert, expert_offsets, num_dropped, tile_to_expert, tk_to_row,
            row_to_tk, row_to_token, R, cap, num_rows // tile_m, K=K, E=E, E_POW2=e_pow2, TILE_M=tile_m,
            CHUNK=chunk, SUB=scatter_sub, BLOCK_T=16,
        )  # fmt: skip
    return tokens_per_expert, expert_offsets, row_to_tk, row_to_token, tk_to_row, tile_to_expert, num_dropped


@triton.jit
def _row_values_kernel(values_ptr, row_to_tk_ptr, out_ptr, num_rows, BLOCK: tl.constexpr):
    """Grid: (cdiv(R_pad, BLOCK),). out[r] = values[row_to_tk[r]], 0 on padding rows."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = r < num_rows
    tk = tl.load(row_to_tk_ptr + r, mask=in_range, other=-1)
    value = tl.load(values_ptr + tk, mask=in_range & (tk >= 0), other=0.0)
    tl.store(out_ptr + r, value.to(tl.float32), mask=in_range)


def row_values(values_TK: torch.Tensor, row_to_tk: torch.Tensor) -> torch.Tensor:
    """fp32 [R_pad]: values_TK [T, K] placed in row order, 0 on padding rows; one launch (what
    `schedule.values_per_row` computes in five torch ops, which cost the host more than the GPU at
    small T)."""
    values = values_TK.reshape(-1).contiguous()
    if values.numel() == 0:  # no pairs (an expert-parallel rank that receives none): all padding
        return torch.zeros(row_to_tk.shape[0], dtype=torch.float32, device=row_to_tk.device)
    out = torch.empty(row_to_tk.shape[0], dtype=torch.float32, device=row_to_tk.device)
    block = 1024
    launch(_row_values_kernel, (cdiv(out.shape[0], block),), values, row_to_tk, out, out.shape[0], BLOCK=block)
    return out


@triton.jit
def _dense_rows_kernel(
    src_ptr, index_ptr, tile_to_expert_ptr, offsets_ptr, dense_offsets_ptr, out_ptr, num_rows, num_dense_rows, N,
    stride_src, stride_out, TILE_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid: (cdiv(R_pad, BLOCK_R), cdiv(N, BLOCK_N)). Schedule row r, local row r - offsets[e] of
    expert e's segment, goes to row dense_offsets[e] + local while local is under the dense
    segment's length: src[index[r]], 0 where index[r] < 0."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(tile_to_expert_ptr + r // TILE_M, mask=r < num_rows, other=-1)
    has_expert = expert >= 0
    expert = tl.where(has_expert, expert, 0)
    local = r - tl.load(offsets_ptr + expert, mask=has_expert, other=0)
    start = tl.load(dense_offsets_ptr + expert, mask=has_expert, other=0)
    keep = has_expert & (local < tl.load(dense_offsets_ptr + expert + 1, mask=has_expert, other=0) - start)
    index = tl.load(index_ptr + r, mask=keep, other=-1).to(tl.int64)
    cols = n[None, :] < N
    rows = tl.load(src_ptr + index[:, None] * stride_src + n[None, :], mask=(index >= 0)[:, None] & cols, other=0.0)
    dest = (start + local).to(tl.int64)
    keep = keep & (dest < num_dense_rows)  # (a bound too small for the segments loses rows, never memory)
    tl.store(out_ptr + dest[:, None] * stride_out + n[None, :], rows, mask=keep[:, None] & cols)


def dense_rows(
    src: torch.Tensor, index: torch.Tensor, tile_to_expert: torch.Tensor, expert_offsets: torch.Tensor,
    dense_offsets: torch.Tensor, num_dense_rows: int, tile_m: int,
) -> torch.Tensor:  # fmt: skip
    """[num_dense_rows, N]: for each schedule row r, src[index[r]] (zeros where index[r] < 0: a
    per-pair tensor through row_to_tk, or x through row_to_token), with each expert's segment moved
    to start at dense_offsets[e] and cut to its length there (`schedule.segment_offsets`; tile_m a multiple of
    the alignment, so that every dense segment lies within the schedule's). Rows past the last
    segment are left unwritten. One launch, no pass to zero the padding rows (torch's masked_fill_
    took 0.9 ms over 4096,7168,2048,384,8's 640 MiB dh)."""
    src = src if src.stride(1) == 1 else src.contiguous()
    out = src.new_empty(num_dense_rows, src.shape[1])
    block_r, block_n = 32, 256
    grid = (cdiv(index.shape[0], block_r), cdiv(src.shape[1], block_n))
    launch(_dense_rows_kernel, grid, src, index, tile_to_expert, expert_offsets, dense_offsets, out, index.shape[0],
           num_dense_rows, src.shape[1], src.stride(0), out.stride(0), TILE_M=tile_m, BLOCK_R=block_r,
           BLOCK_N=block_n)  # fmt: skip
    return out
