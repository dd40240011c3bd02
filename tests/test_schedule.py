"""Schedule: counts, padded offsets, row maps as exact permutation invariants, (token, k) order
within an expert, capacity drops, empty experts, T = 1, and no host sync (it runs on meta-free
device tensors built only from integer ops); `sum_over_k` adds a token's rows in ascending k in fp32
(fp64 for fp64 rows) and rounds once."""

import itertools

import pytest
import torch

from mok_plugin.schedule import build_schedule, expert_capacity, max_padded_rows, sum_over_k
from mok_plugin.testing import oracle_kept_pairs


def _check_invariants(ids: torch.Tensor, E: int, tile: int, capacity=None):
    s = build_schedule(ids, E, tile_m=tile, capacity=capacity)
    T, K = ids.shape
    kept = oracle_kept_pairs(ids, E, capacity).flatten()
    flat = ids.flatten()
    expected_counts = torch.bincount(flat[kept], minlength=E)
    assert torch.equal(s.tokens_per_expert, expected_counts)
    padded = (expected_counts + tile - 1) // tile * tile
    assert torch.equal(s.expert_offsets, torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)]))
    assert int(s.expert_offsets[-1]) <= s.num_rows and s.num_rows % tile == 0
    assert int(s.num_dropped) == int((~kept).sum())
    # tk_to_row and row_to_tk are inverse on the kept pairs; dropped pairs map to -1.
    for tk in range(T * K):
        row = int(s.tk_to_row[tk])
        if kept[tk]:
            assert int(s.row_to_tk[row]) == tk and int(s.row_to_token[row]) == tk // K
        else:
            assert row == -1
    assert int((s.row_to_tk >= 0).sum()) == int(kept.sum())
    # Each expert's rows: contiguous from its offset, in ascending (token, k) order, then padding.
    for e in range(E):
        start, n = int(s.expert_offsets[e]), int(expected_counts[e])
        seg = s.row_to_tk[start : start + n]
        assert torch.equal(seg, torch.nonzero((flat == e) & kept).flatten())
        assert bool((s.row_to_tk[start + n : int(s.expert_offsets[e + 1])] == -1).all())
        for tile_idx in range(start // tile, int(s.expert_offsets[e + 1]) // tile):
            assert int(s.tile_to_expert[tile_idx]) == e
    assert bool((s.tile_to_expert[int(s.expert_offsets[-1]) // tile :] == -1).all())
    return s


@pytest.mark.parametrize(
    "T, K, E, tile",
    [
        pytest.param(1, 1, 4, 8, id="T1"),  # a single token
        pytest.param(37, 2, 8, 16, id="T_not_tile_multiple"),
        pytest.param(64, 4, 16, 4, id="many_tiles"),
        pytest.param(10, 3, 130, 8, id="more_experts_than_rows"),  # most experts empty
    ],
)
def test_schedule_invariants_random(T, K, E, tile):
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    _check_invariants(ids, E, tile)


def test_all_rows_on_one_expert_and_empty_experts():
    ids = torch.full((50, 1), 3)
    s = _check_invariants(ids, 6, 16)
    assert s.tokens_per_expert.tolist() == [0, 0, 0, 50, 0, 0]


def test_capacity_drops_late_pairs_and_counts_them():
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(30)])
    ids[:20, 0] = 1  # skew onto expert 1 so it overflows
    cap = expert_capacity(30, 2, 4, 1.0)
    s = _check_invariants(ids, 4, 8, capacity=cap)
    assert int(s.num_dropped) > 0
    assert int(s.tokens_per_expert.max()) <= cap


def test_padding_bound_is_tight_when_every_expert_overflows_a_tile_by_one():
    # 8 experts with 17 rows each and a 16-row tile: each pads to 32, the worst case the bound covers.
    ids = torch.arange(8).repeat_interleave(17).view(-1, 1)
    s = _check_invariants(ids, 8, 16)
    assert int(s.expert_offsets[-1]) == s.num_rows == max_padded_rows(136, 8, 16) == 256


def test_bad_arguments():
    with pytest.raises(ValueError, match="integer"):
        build_schedule(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="tile_m=0"):
        build_schedule(torch.zeros(3, 2, dtype=torch.long), 4, tile_m=0)


def _assert_same_schedule(a, b) -> None:
    """Every field of two schedules equal (tensors bitwise)."""
    for field in a.__slots__:
        x, y = getattr(a, field), getattr(b, field)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, field


@pytest.mark.parametrize(
    "T, K, E, tile, capacity, kind",
    [
        pytest.param(37, 2, 8, 16, None, "random", id="T_not_tile_multiple"),
        pytest.param(1, 1, 4, 8, None, "random", id="T1"),
        pytest.param(10, 3, 130, 8, None, "random", id="E_not_power_of_two_most_empty"),
        pytest.param(30, 2, 4, 8, 12, "random", id="capacity"),
        pytest.param(50, 1, 6, 16, None, "one_expert", id="one_expert"),
        pytest.param(700, 2, 5, 32, None, "random", id="pairs_span_several_scan_blocks"),  # R > the 1024 scan block
        pytest.param(1024, 2, 6, 32, None, "random", id="pairs_fill_one_chunk"),  # R = 2048: the one-launch path
        pytest.param(1500, 2, 6, 32, 700, "random", id="pairs_span_several_chunks"),  # R > the 2048-pair chunk
        # Past one chunk, chunks of 256 pairs: ranks carried across many of them, with drops, empty
        # slots, one expert taking every tile, and E_POW2 = 512.
        pytest.param(3000, 4, 130, 16, None, "random", id="many_chunks_most_experts_small"),
        pytest.param(1500, 2, 6, 32, 300, "empty_slots_past_e", id="many_chunks_empty_slots_and_drops"),
        pytest.param(1200, 2, 16, 128, None, "one_expert", id="many_chunks_one_expert"),
        pytest.param(700, 4, 384, 128, None, "random", id="many_chunks_384_experts"),
        pytest.param(2500, 1, 1, 128, None, "random", id="many_chunks_one_expert_in_all"),  # E_POW2 = 1 (layer.py)
        pytest.param(40, 2, 5, 8, None, "empty_slots", id="empty_slots"),  # -1: a slot of an EP buffer
        pytest.param(40, 2, 5, 8, 3, "empty_slots", id="empty_slots_and_drops"),
        pytest.param(40, 2, 5, 8, None, "empty_slots_past_e", id="empty_slots_past_e"),  # ids 6: under E_POW2
        pytest.param(40, 2, 5, 8, 3, "empty_slots_past_e", id="empty_slots_past_e_and_drops"),
        pytest.param(20, 2, 16, 128, None, "one_expert", id="tail_past_one_block"),  # 1920 rows past the end
        pytest.param(0, 2, 4, 8, None, "random", id="no_pairs"),  # an EP rank that receives none
    ],
)
def test_triton_schedule_equals_torch_schedule(T, K, E, tile, capacity, kind, monkeypatch):
    pytest.importorskip("triton", reason="the triton schedule needs triton")
    g = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K).long()
    if kind == "one_expert":
        ids[:] = 3
    if kind == "empty_slots":
        ids[::3] = -1
    if kind == "empty_slots_past_e":  # any id outside [0, E) is an empty slot, also one the histogram has a lane for
        ids[::3] = E + 1
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs in Triton's interpreter
    ids = ids.to(device)
    a = build_schedule(ids, E, tile_m=tile, capacity=capacity, impl="torch")
    fresh = torch.empty  # the one-chunk kernel writes every entry itself: poison what it is given
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: fresh(*args, **kwargs).fill_(7777))
    b = build_schedule(ids, E, tile_m=tile, capacity=capacity, impl="triton")
    monkeypatch.undo()
    _assert_same_schedule(a, b)


def test_chunks_shrink_with_the_pairs_until_there_are_enough_programs():
    # 512 chunks where the pairs allow, of 32 to 256 pairs, a power of 2 (the one-hot tiles' steps)
    pytest.importorskip("triton", reason="the triton schedule needs triton")
    from mok_plugin.kernels.schedule import chunk_pairs

    assert [chunk_pairs(r) for r in (2049, 4096, 16385, 32768, 131072, 10**7)] == [32, 32, 64, 64, 256, 256]


@pytest.mark.parametrize("chunk", [16, 64, 256])
@pytest.mark.parametrize(
    "T, K, E, tile, capacity",
    [(1500, 2, 6, 32, 300), (700, 4, 384, 128, None), (2500, 1, 1, 128, None), (3000, 4, 130, 16, None)],
    ids=["drops", "384_experts", "one_expert_in_all", "130_experts"],
)
def test_triton_schedule_in_smaller_chunks_gives_the_same_maps(T, K, E, tile, capacity, chunk, monkeypatch):
    # the chunked path at chunk sizes other than these pairs' own (32): the one-hot tiles' SUB capped at
    # the chunk (at E = 1 the histogram's 256 and the scatter's 64 would read the next chunk's pairs too)
    pytest.importorskip("triton", reason="the triton schedule needs triton")
    from mok_plugin.kernels import schedule as schedule_kernels

    g = torch.Generator().manual_seed(T + E + chunk)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids = ids.to("cuda" if torch.cuda.is_available() else "cpu")
    a = build_schedule(ids, E, tile_m=tile, capacity=capacity, impl="torch")
    monkeypatch.setattr(schedule_kernels, "chunk_pairs", lambda num_pairs: chunk)
    b = build_schedule(ids, E, tile_m=tile, capacity=capacity, impl="triton")
    _assert_same_schedule(a, b)


@pytest.mark.parametrize(
    "T, K, E, tile, capacity, dtype",
    [(37, 2, 8, 16, None, torch.float32), (30, 2, 4, 8, 12, torch.float32), (0, 2, 4, 8, None, torch.float32),
     (1500, 2, 6, 32, None, torch.bfloat16)],
    ids=["random", "capacity_drops", "no_pairs", "several_blocks_bf16"],
)  # fmt: skip
def test_row_values_kernel_equals_values_per_row(T, K, E, tile, capacity, dtype):
    # The Triton backend's one-launch gather of the routing weights into row order: bitwise the
    # torch expression, 0 on padding rows and for pairs dropped by capacity.
    pytest.importorskip("triton", reason="the kernel needs triton")
    from mok_plugin.kernels.schedule import row_values
    from mok_plugin.schedule import values_per_row

    g = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K).long()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs in Triton's interpreter
    s = build_schedule(ids.to(device), E, tile_m=tile, capacity=capacity)
    weights = (torch.rand(T, K, generator=g) + 0.5).to(dtype).to(device)
    got = row_values(weights, s.row_to_tk)
    assert got.dtype == torch.float32 and torch.equal(got, values_per_row(weights, s.row_to_tk).float())
    assert (got[s.row_to_tk < 0] == 0).all() and (got[s.row_to_tk >= 0] > 0).all()


@pytest.mark.parametrize(
    "T, K, E, tile, align, capacity, width, dtype",
    [(37, 2, 8, 16, 8, None, 300, torch.float32), (30, 2, 4, 16, 4, 12, 64, torch.float16),
     (600, 3, 6, 32, 8, None, 40, torch.bfloat16), (50, 2, 6, 16, 16, None, 24, torch.float32),
     (90, 2, 5, 128, 64, None, 16, torch.float32)],
    ids=["two_column_blocks", "capacity_drops", "several_row_blocks_bf16", "align_is_the_tile",
         "as_on_hopper_empty_expert_and_slots"],
)  # fmt: skip
def test_dense_rows_kernel_moves_each_segment(T, K, E, tile, align, capacity, width, dtype, monkeypatch):
    # Per-pair dh and x placed in row order for the Hopper weight gradient (grouped_mlp.pair_wgrad_hopper),
    # each expert's segment cut to a multiple of `align` rows and moved to segment_offsets' offsets:
    # bitwise the torch gather's rows, zeros on padding rows and for pairs dropped by capacity, and
    # nothing written past the last segment.
    pytest.importorskip("triton", reason="the kernel needs triton")
    from mok_plugin.kernels.schedule import dense_rows
    from mok_plugin.schedule import gather_rows_or_zeros, segment_offsets

    g = torch.Generator().manual_seed(T + width)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if tile == 128:  # the last expert empty, and some empty slots (-1: an expert-parallel rank's others)
        ids = torch.where(ids == E - 1, -1, ids)
        assert (ids == -1).any()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs in Triton's interpreter
    s = build_schedule(ids.to(device), E, tile_m=tile, capacity=capacity)
    pairs = (torch.randn(T * K, width, generator=g) + 3).to(dtype).to(device)  # never 0: a row left out shows
    x = (torch.randn(T, width, generator=g) - 3).to(dtype).to(device)
    offsets = segment_offsets(s.tokens_per_expert, align)
    counts = s.tokens_per_expert.tolist()
    assert offsets.tolist() == [0] + list(itertools.accumulate(-(-c // align) * align for c in counts))
    num_rows = (T * K // align + min(E, T * K)) * align
    assert offsets[-1] <= num_rows
    fresh = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: fresh(self, *a, **k).fill_(7))
    for src, index in ((pairs, s.row_to_tk), (x, s.row_to_token)):
        got = dense_rows(src, index, s.tile_to_expert, s.expert_offsets, offsets, num_rows, tile)
        again = dense_rows(src, index, s.tile_to_expert, s.expert_offsets, offsets, num_rows, tile)
        want = gather_rows_or_zeros(src, index)
        for e in range(E):
            start, end = offsets[e].item(), offsets[e + 1].item()
            first = s.expert_offsets[e].item()
            assert torch.equal(got[start:end], want[first : first + end - start]), e
            assert (got[start : start + counts[e]] != 0).all() and (got[start + counts[e] : end] == 0).all()
        assert torch.equal(got[: offsets[-1]], again[: offsets[-1]])  # bitwise repeatable
        assert (got[offsets[-1] :] == 7).all()  # rows past the last segment left as they were


def test_unknown_impl():
    with pytest.raises(ValueError, match="impl='cuda'"):
        build_schedule(torch.zeros(3, 2, dtype=torch.long), 4, impl="cuda")


def test_empty_slots_get_no_row_and_are_not_dropped():
    ids = torch.tensor([[0, -1], [1, 0], [-1, -1], [1, 1]])
    s = build_schedule(ids, 2, tile_m=4)
    assert s.tokens_per_expert.tolist() == [2, 3]
    assert int(s.num_dropped) == 0
    assert s.tk_to_row.tolist() == [0, -1, 4, 1, -1, -1, 5, 6]


def test_sum_over_k_adds_in_ascending_k_in_fp32_and_rounds_once():
    # fp32 is not associative: ((1e8 + 1) - 1e8) is 0, (1e8 - 1e8) + 1 would be 1.
    rows = torch.tensor([[[1e8], [1.0], [-1e8]]], dtype=torch.float32)
    assert torch.equal(sum_over_k(rows, torch.float32), torch.zeros(1, 1))
    # bf16 rows, one rounding: 1 + 2**-8 + 2**-8 is 1 + 2**-7 (exact in bf16); summed in bf16 it is 1.
    rows = torch.tensor([[[1.0], [2**-8], [2**-8]]], dtype=torch.bfloat16)
    assert torch.equal(sum_over_k(rows, torch.bfloat16), torch.tensor([[1 + 2**-7]], dtype=torch.bfloat16))
    # fp64 rows accumulate in fp64: 1 + 2**-30 survives (it would not in fp32).
    rows = torch.tensor([[[1.0], [2**-30]]], dtype=torch.float64)
    assert torch.equal(sum_over_k(rows, torch.float64), torch.tensor([[1 + 2**-30]], dtype=torch.float64))
