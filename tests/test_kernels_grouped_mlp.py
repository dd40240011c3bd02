"""The multi-kernel variant's expert GEMMs (kernels/grouped_mlp.py) against the reference backend
at small shapes: forward and every gradient (x, routing weights, both expert weights) over the
crafted cases of triton_cases.py (T = 1, empty experts, every row on one expert, skewed routing,
H and I not multiples of the block), capacity drops, each config variant of the tiles (pointer
loads, TMA descriptors, pre-gathered weight-gradient rows), the weight gradients' column blocks,
and down_dgrad's GEMM + epilogue kernels against a float64 computation.

Without CUDA this runs in Triton's CPU interpreter in fp32 and fp16, through the same kernels
(and the same down_dgrad path) the GPU runs; with CUDA the same tests run compiled.
"""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import CASES, DEVICE, DTYPES, GRADIENT_NAMES, compare_with_reference, crafted_routing  # noqa: E402

from mok_plugin.kernels import configs, grouped_mlp  # noqa: E402
from mok_plugin.kernels.configs import MoKTileConfig, kernel_config  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule, values_per_row  # noqa: E402
from mok_plugin.testing import EXPERT_FAMILIES, assert_close  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, I, E, K, kind, capacity", CASES)
def test_kernels_match_reference(T, H, I, E, K, kind, capacity, dtype):
    compare_with_reference(T, H, I, E, K, kind, dtype, capacity=capacity, variant="multi_kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, H, I, E, K, kind",
    [
        pytest.param(90, 48, 40, 5, 2, "skewed", id="aligned"),  # every operand can back a descriptor
        pytest.param(70, 64, 24, 4, 3, "uniform", id="I_not_block_multiple"),  # TMA zero fill at the edges
        pytest.param(50, 36, 24, 6, 2, "uniform", id="H_rows_unaligned"),  # fp16 rows of 72 bytes: pointer fallback
    ],
)
@pytest.mark.slow
def test_tile_variants_match_reference(T, H, I, E, K, kind, dtype, monkeypatch):
    # Every config variant (TMA descriptors, pre-gathered weight-gradient rows) computes the same
    # tiles in the same K order; TMA reads the weight gradients' padding rows whole (they must hold
    # zeros). compare_with_reference checks each against the reference and for bitwise
    # repeatability; here also against the pointer path, to rounding (numpy's matmul in the
    # interpreter rounds a transposed operand differently).
    configs = {
        "pointer loads": lambda name, n_out: kernel_config(name, n_out),
        "TMA": lambda name, n_out: replace(kernel_config(name, n_out), tma=True),
        "pre-gathered wgrad rows": lambda name, n_out: replace(kernel_config(name, n_out), gather_rows=True),
        "pre-gathered wgrad rows, TMA": lambda name, n_out: replace(
            kernel_config(name, n_out), gather_rows=True, tma=True
        ),
    }
    results = {}
    for label, config in configs.items():
        monkeypatch.setattr(grouped_mlp, "kernel_config", config)
        results[label] = compare_with_reference(T, H, I, E, K, kind, dtype, seed=7, variant="multi_kernel")
    for label, got in results.items():
        for name, a, b in zip(GRADIENT_NAMES, results["pointer loads"], got, strict=True):
            assert_close(b, a, dtype, f"{name} ({label} vs pointer loads)")


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2_like", "dW13_like"])
def test_wgrad_gathered_in_column_blocks_is_bitwise_unchanged(left_by_token, tma, monkeypatch):
    # The pre-gathered operand is copied a column block at a time to bound its memory; each block's
    # sums run over the same rows in the same order, so any block count gives the same bits.
    T, H, I, E, K = 70, 72, 40, 5, 2
    g = torch.Generator().manual_seed(11)
    schedule = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    rows = schedule.row_to_token.shape[0]
    by_token = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    by_row = torch.randn(rows, I, generator=g).to(DEVICE, torch.float16)
    by_row[schedule.row_to_token < 0] = 0  # the zero padding rows down_dgrad writes
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    segments = (schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert)
    cfg = MoKTileConfig(32, 32, 32, 4, 2, tma=tma, gather_rows=True)  # small blocks, compiled or interpreted

    def wgrad():
        return grouped_mlp.expert_wgrad(
            left,
            right,
            *segments,
            left_by_token=left_by_token,
            right_by_token=not left_by_token,
            segment_align=schedule.tile_m,
            config=cfg,
        )

    whole = wgrad()
    block = cfg.block_m if left_by_token else cfg.block_n
    monkeypatch.setattr(grouped_mlp, "GATHER_CHUNK_BYTES", rows * 2 * block)  # one block per copy
    assert len(grouped_mlp.gather_column_blocks(H, rows * 2, block)) == 3  # 32 + 32 + 8 columns
    assert torch.equal(wgrad(), whole)
    # and against the sum it stands for, per expert over its rows
    tokens = schedule.row_to_token.clamp(min=0)
    gathered = torch.where((schedule.row_to_token >= 0)[:, None], by_token[tokens].float(), 0.0)
    lhs, rhs = (gathered, by_row.float()) if left_by_token else (by_row.float(), gathered)
    starts = schedule.expert_offsets.tolist()[:E]
    want = torch.stack(
        [lhs[s : s + n].T @ rhs[s : s + n] for s, n in zip(starts, schedule.tokens_per_expert.tolist(), strict=True)]
    )
    assert_close(whole, want, torch.float16, "dW", n_reduce=T * K // E)


@pytest.mark.parametrize(
    "sweep, keep_one_step_left", [(False, False), (True, False), (True, True)],
    ids=["per_tile", "sweep", "sweep_one_step_left_kept"],
)  # fmt: skip
def test_wgrad_reads_x_through_the_pair_map_divided_by_top_k(sweep, keep_one_step_left, monkeypatch):
    # dW13 of per-pair dh (ops.compact_h): x [T, H] read through row_to_tk // K gives the bits of a
    # copy of x per pair read through row_to_tk (pair t * K + k is token t's), and the per-expert sum
    monkeypatch.setattr(grouped_mlp, "SWEEP_KEEPS_ONE_STEP_LEFT", keep_one_step_left)
    T, H, I, E, K = 70, 72, 40, 10, 3
    g = torch.Generator().manual_seed(23)
    schedule = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    d_h = torch.randn(T * K, I, generator=g).to(DEVICE, torch.float16)
    x = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    x_pairs = x.repeat_interleave(K, dim=0)
    segments = (schedule.row_to_tk, schedule.expert_offsets, schedule.tokens_per_expert)
    cfg = MoKTileConfig(32, 32, 32, 4, 2, sweep=sweep)

    def wgrad(right, divisor):
        return grouped_mlp.expert_wgrad(
            d_h, right, *segments, left_by_token=True, right_by_token=True, segment_align=schedule.tile_m,
            config=cfg, right_index_divisor=divisor,
        )  # fmt: skip

    got = wgrad(x, K)
    assert torch.equal(got, wgrad(x_pairs, 1))
    assert torch.equal(wgrad(x, K), got)
    pairs = schedule.row_to_tk.clamp(min=0)
    real = (schedule.row_to_tk >= 0)[:, None]
    lhs = torch.where(real, d_h[pairs].float(), 0.0)
    rhs = torch.where(real, x[pairs // K].float(), 0.0)
    starts = schedule.expert_offsets.tolist()[:E]
    want = torch.stack(
        [lhs[s : s + n].T @ rhs[s : s + n] for s, n in zip(starts, schedule.tokens_per_expert.tolist(), strict=True)]
    )
    assert_close(got, want, torch.float16, "dW13", n_reduce=T * K // E)


def test_wgrad_index_divisor_needs_both_operands_by_token():
    rows, segments = torch.zeros(4, 8), (torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                                         torch.zeros(2, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="right_index_divisor=2: expected 1, or any positive divisor with both"):
        grouped_mlp.expert_wgrad(rows, rows, *segments, left_by_token=False, right_by_token=True, right_index_divisor=2)
    with pytest.raises(ValueError, match="right_index_divisor=0"):
        grouped_mlp.expert_wgrad(rows, rows, *segments, left_by_token=True, right_by_token=True, right_index_divisor=0)


@pytest.mark.parametrize(
    "gather_rows, tma", [(False, False), (False, True), (True, True)], ids=["in_loop", "in_loop_tma", "pre_gathered"]
)
@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2_like", "dW13_like"])
@pytest.mark.parametrize("keep_one_step_left", [False, True], ids=["left_a_tile", "one_step_left_kept"])
def test_wgrad_sweep_is_bitwise_the_per_tile_kernel(left_by_token, gather_rows, tma, keep_one_step_left, monkeypatch):
    # A program sweeping its row block's tiles (config sweep) sums each tile's products in the same
    # order as a program per tile: the same bits, also for empty experts (zeros), for partial K
    # steps (segments of 1-70 rows against BLOCK_K 32), for tiles past the edge (H 72 against 32-wide
    # blocks) and for the transposed store of dW13's swapped launch; and so it does with the left
    # tile of a one-step expert loaded once for all its tiles.
    monkeypatch.setattr(grouped_mlp, "SWEEP_KEEPS_ONE_STEP_LEFT", keep_one_step_left)
    T, H, I, E, K = 70, 72, 40, 10, 2
    g = torch.Generator().manual_seed(5)
    schedule = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    counts = schedule.tokens_per_expert
    assert (counts == 0).any() and (counts > 32).any() and ((counts > 0) & (counts <= 32)).any()
    by_token = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    by_row = torch.randn(schedule.row_to_token.shape[0], I, generator=g).to(DEVICE, torch.float16)
    by_row[schedule.row_to_token < 0] = 0  # the zero padding rows down_dgrad writes
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    segments = (schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert)
    cfg = MoKTileConfig(32, 32, 32, 4, 2, tma=tma, gather_rows=gather_rows)

    def wgrad(config):
        return grouped_mlp.expert_wgrad(
            left, right, *segments, left_by_token=left_by_token, right_by_token=not left_by_token,
            segment_align=schedule.tile_m, config=config,
        )  # fmt: skip

    per_tile = wgrad(cfg)
    swept = wgrad(replace(cfg, sweep=True))
    assert torch.equal(swept, per_tile)
    assert torch.equal(wgrad(replace(cfg, sweep=True)), swept)
    empty = schedule.tokens_per_expert == 0
    assert swept[empty].eq(0).all() and swept[~empty].ne(0).any(dim=(1, 2)).all()


# The weight-gradient entries differ in tile shape, warps and stages, never in BLOCK_K, and
# configs.wgrad_kernel picks one by rows per expert, which differs between expert-parallel ranks: so
# every entry must give the same bits. On the GPU the pinned entries themselves; interpreted, small
# tiles of the same variety (their BLOCK_M and BLOCK_N differ, the loop structures too).
_PINNED_WGRAD = ("wgrad", "wgrad_in_loop", "wgrad_sweep", "wgrad_sweep_few_rows")
_INTERPRETED_WGRAD = (
    MoKTileConfig(32, 32, 32, 4, 1, tma=True, gather_rows=True), MoKTileConfig(32, 16, 32, 4, 1),
    MoKTileConfig(16, 32, 32, 4, 1, tma=True, sweep=True), MoKTileConfig(32, 32, 32, 4, 1, sweep=True),
)  # fmt: skip


@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2_like", "dW13_like"])
def test_every_weight_gradient_entry_gives_the_same_bits(left_by_token, monkeypatch):
    on_gpu = DEVICE == "cuda"
    T, H, I, E, K = (512, 384, 256, 16, 2) if on_gpu else (70, 72, 40, 10, 2)
    g = torch.Generator().manual_seed(11)
    schedule = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    assert (schedule.tokens_per_expert == 0).any()
    dtype = torch.bfloat16 if on_gpu else torch.float16
    by_token = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    by_row = torch.randn(schedule.row_to_token.shape[0], I, generator=g).to(DEVICE, dtype)
    by_row[schedule.row_to_token < 0] = 0  # the zero padding rows the kernels write
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    segments = (schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert)
    if on_gpu:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        configs = [kernel_config(name, I) for name in _PINNED_WGRAD]
    else:
        configs = list(_INTERPRETED_WGRAD)
    assert len({(c.block_m, c.block_n, c.num_warps, c.sweep) for c in configs}) == len(configs)
    assert len({c.block_k for c in configs}) == 1
    results = [
        grouped_mlp.expert_wgrad(left, right, *segments, left_by_token=left_by_token, right_by_token=not left_by_token,
                                 segment_align=schedule.tile_m, config=cfg)
        for cfg in configs
    ]  # fmt: skip
    for cfg, result in zip(configs[1:], results[1:], strict=True):
        assert torch.equal(result, results[0]), f"{cfg} differs from {configs[0]}"
    assert results[0].float().abs().sum() > 0


@pytest.mark.parametrize(
    "left_by_token, gather_rows, transposed",
    [(True, False, False), (False, False, True), (True, True, False), (False, True, False)],
    ids=["dW2", "dW13_swapped", "dW2_pre_gathered", "dW13_pre_gathered"],
)
def test_weight_gradient_launch_passes_the_alignment_of_its_sizes_and_strides(
    left_by_token, gather_rows, transposed, monkeypatch
):
    # H = 3000, I = 1000 (multiples of 8, not 16): ALIGN 8, and which inner stride of dW is the
    # non-unit one (restated in the kernel); the unit stride must not pull ALIGN down to 1, which
    # left the stores 2 bytes wide (8192, 3000, 1000, 160, 6: 13.99 ms against 8.52).
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))

    monkeypatch.setattr(grouped_mlp, "_expert_wgrad_kernel", Recorder())
    H, I, E, T = 3000, 1000, 3, 5
    schedule = build_schedule(torch.tensor([[0], [1], [1], [2], [0]]), E, tile_m=DEFAULT_TILE_M)
    by_token = torch.zeros(T, H, dtype=torch.float16)
    by_row = torch.zeros(schedule.row_to_token.shape[0], I, dtype=torch.float16)
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    grouped_mlp.expert_wgrad(
        left, right, schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert,
        left_by_token=left_by_token, right_by_token=not left_by_token, segment_align=schedule.tile_m,
        config=MoKTileConfig(128, 256, 64, 8, 3, gather_rows=gather_rows),
    )  # fmt: skip
    assert launches
    for _, kwargs in launches:
        assert kwargs["ALIGN"] == 8 and kwargs["D_W_TRANSPOSED"] == transposed, kwargs


def test_down_dgrad_launches_pass_the_alignment_of_their_sizes_and_strides(monkeypatch):
    # H = 3000, I = 1000: ALIGN 8 for the GEMM and the epilogue kernel; the router partials' row
    # stride (odd here: a column per I-block and the fc2 bias's) is no operand's row pitch.
    launches = {}

    def recorder(name):
        class Recorder:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.setdefault(name, kwargs)

        return Recorder()

    for kernel in ("_down_dgrad_gemm_kernel", "_down_dgrad_epilogue_kernel", "_bias_router_grad_kernel"):
        monkeypatch.setattr(grouped_mlp, kernel, recorder(kernel))
    H, I, E, T = 3000, 1000, 3, 5
    schedule = build_schedule(torch.tensor([[0], [1], [1], [2], [0]]), E, tile_m=DEFAULT_TILE_M)
    rows = schedule.row_to_token.shape[0]
    grouped_mlp.down_dgrad(
        torch.zeros(T, H, dtype=torch.float16), torch.zeros(E, H, I, dtype=torch.float16),
        torch.zeros(rows, 2 * I, dtype=torch.float16), torch.ones(T, 1), schedule.row_to_tk, schedule.row_to_token,
        schedule.tile_to_expert, schedule.tile_m, MoKTileConfig(128, 128, 64, 8, 3),
        down_bias=torch.zeros(E, H, dtype=torch.float16),
    )  # fmt: skip
    assert set(launches) == {"_down_dgrad_gemm_kernel", "_down_dgrad_epilogue_kernel", "_bias_router_grad_kernel"}
    assert launches["_down_dgrad_gemm_kernel"]["ALIGN"] == 8
    assert launches["_down_dgrad_epilogue_kernel"]["ALIGN"] == 8
    assert launches["_down_dgrad_epilogue_kernel"]["stride_part_r"] % 2 == 1  # odd, and not counted


GPU_BF16 = [pytest.param(torch.bfloat16, id="bf16")] if DEVICE == "cuda" else []
# (T, H, I): small, and the GPU's tiles whole (I = 320: the last 128-wide block half past I);
# the second is slow in the interpreter
SMALL_AND_TILES = [
    pytest.param(50, 48, 72, id="small"),
    pytest.param(300, 256, 320, id="tiles", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family", ["swiglu", "glu_gelu_bias", "gpt_oss"])
@pytest.mark.parametrize("dtype", DTYPES + GPU_BF16)
@pytest.mark.parametrize("T, H, I", SMALL_AND_TILES)
def test_gate_up_joined_is_bitwise_two_accumulators(family, dtype, T, H, I, monkeypatch):
    # fc1's forward with the gate and up blocks in one load and one accumulator (JOIN_GATE_UP) sums
    # every element's products in the order of the two-accumulator kernel: the same bits, also
    # where I is not a multiple of the block (the last block's rows past I read zeros in each half).
    fam = EXPERT_FAMILIES[family]
    E, K = 5, 2
    g = torch.Generator().manual_seed(11)
    s = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    b1 = torch.randn(E, 2 * I, generator=g).to(DEVICE, dtype) if fam.fc1_bias else None
    config = replace(kernel_config("gate_up_fwd", I), tma=True)
    joined_flags = []
    launch_row_tiles = grouped_mlp._launch_row_tiles
    monkeypatch.setattr(grouped_mlp, "_launch_row_tiles",
                        lambda *a, **kw: joined_flags.append(kw["JOINED"]) or launch_row_tiles(*a, **kw))  # fmt: skip
    results = {}
    for joined in (True, False):
        monkeypatch.setattr(grouped_mlp, "JOIN_GATE_UP", joined)
        results[joined] = grouped_mlp.gate_up_fwd(
            x, w13, s.row_to_token, s.tile_to_expert, s.tile_m, config, gate_up_bias=b1,
            activation=fam.activation, clamp=fam.clamp, offset=fam.linear_offset,
        )  # fmt: skip
    assert joined_flags == [True, False]
    used = s.row_to_token >= 0
    for name, a, b in zip(["h", "A"], results[True], results[False], strict=True):
        assert torch.equal(a[used], b[used]), name
    assert results[True][1][used].abs().sum() > 0  # not a vacuous comparison


def _layer_inputs(T, H, I, E, K, dtype, seed):
    """A skewed schedule, x, W13, W2, dO and fp32 routing weights for the row GEMMs, seeded."""
    g = torch.Generator().manual_seed(seed)
    s = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    d_out = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    return s, x, w13, w2, d_out, torch.rand(T, K, generator=g).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES + GPU_BF16)
@pytest.mark.parametrize(
    "T, H, I",
    [
        pytest.param(  # the interpreter's 32-wide tiles: 8 columns past the full blocks (none full on the GPU's)
            50, 72, 40, id="small", marks=pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's tile widths")
        ),
        pytest.param(  # the GPU's pinned tiles: 576 = 2 x 256 + 64, 320 = 2 x 128 + 64 = 256 + 64
            300, 576, 320, id="tiles", marks=pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's tile widths")
        ),
    ],
)
def test_column_tail_launched_apart_gives_the_same_bits(dtype, T, H, I, monkeypatch):
    # SPLIT_COLUMN_TAIL: each row GEMM's last, partial column block as a second launch at a narrower
    # tile. Every output sums its BLOCK_K steps in the same order at any tile width: the same bits
    # in all four row GEMMs, and each of them did split.
    E, K = 5, 2
    s, x, w13, w2, d_out, topk_weights = _layer_inputs(T, H, I, E, K, dtype, seed=13)
    tails = []
    column_tail = grouped_mlp.column_tail
    monkeypatch.setattr(grouped_mlp, "column_tail", lambda cfg, n: tails.append(column_tail(cfg, n)) or tails[-1])
    results = {}
    for split in (False, True):
        monkeypatch.setattr(configs, "SPLIT_COLUMN_TAIL", split)
        h, a = grouped_mlp.gate_up_fwd(x, w13, s.row_to_token, s.tile_to_expert, s.tile_m,
                                       kernel_config("gate_up_fwd", I))  # fmt: skip
        y = grouped_mlp.down_fwd(a, w2, topk_weights, s.row_to_tk, s.row_to_token, s.tile_to_expert, s.tile_m,
                                 kernel_config("down_fwd", H))  # fmt: skip
        d_h, a_w, _ = grouped_mlp.down_dgrad(d_out, w2, h, topk_weights, s.row_to_tk, s.row_to_token,
                                             s.tile_to_expert, s.tile_m, kernel_config("down_dgrad", I))  # fmt: skip
        d_x = grouped_mlp.gate_up_dgrad(d_h, w13, s.row_to_token, s.tile_to_expert, s.tile_m,
                                        kernel_config("gate_up_dgrad", H))  # fmt: skip
        results[split] = dict(h=h, a=a, y=y, d_h=d_h, a_w=a_w, d_x=d_x)
    assert [tail is not None for tail in tails] == [False] * 4 + [True] * 4, tails
    used = s.row_to_token >= 0
    for name, value in results[True].items():
        assert torch.equal(value[used], results[False][name][used]), name
    assert results[True]["d_x"][used].abs().sum() > 0  # not a vacuous comparison


def test_column_tail_only_where_it_narrows_the_last_block(monkeypatch):
    monkeypatch.setattr(configs, "SPLIT_COLUMN_TAIL", True)
    wide, half = MoKTileConfig(128, 256, 64, 8, 3), MoKTileConfig(128, 128, 64, 8, 4, tma=True)
    assert configs.column_tail(wide, 2880).block_n == 64  # gpt-oss-120b: 11 x 256 + 64
    assert configs.column_tail(half, 2880).block_n == 64  # 22 x 128 + 64
    assert configs.column_tail(wide, 2944).block_n == 128  # 11 x 256 + 128
    assert configs.column_tail(half, 2880) == replace(half, block_n=64)  # the rest of the config kept
    assert configs.column_tail(wide, 3000) is None  # 184 columns left: a 256-wide block either way
    assert configs.column_tail(wide, 2048) is None  # no partial block
    assert configs.column_tail(wide, 100) is None  # no full block: the one launch narrows already
    monkeypatch.setattr(configs, "SPLIT_COLUMN_TAIL", False)
    assert configs.column_tail(wide, 2880) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_down_dgrad_matches_float64(dtype):
    # down_dgrad is a GEMM into an fp32 dA' and an epilogue kernel; the same two launches the GPU
    # runs. Against float64: dh = dSwiGLU(h, w * dA'), w*A, and the router partials <dA', A> per
    # I-block of the epilogue's width, in their slots; padding rows hold zeros in dh and w*A (the
    # weight gradients' TMA reads them whole).
    T, H, I, E, K = 50, 48, 72, 5, 2  # I = 72: three epilogue blocks of 32 in the interpreter, the last partial
    s, x, w13, w2, d_out, topk_weights = _layer_inputs(T, H, I, E, K, dtype, seed=6)
    w_rows = values_per_row(topk_weights, s.row_to_tk)  # the weight the kernel must read for each row
    h, _ = grouped_mlp.gate_up_fwd(x, w13, s.row_to_token, s.tile_to_expert, s.tile_m)
    routed = (topk_weights, s.row_to_tk, s.row_to_token, s.tile_to_expert, s.tile_m)
    d_h, a_w, partial = grouped_mlp.down_dgrad(d_out, w2, h, *routed)

    used = s.row_to_token >= 0
    rows = used.nonzero().flatten()
    tokens = s.row_to_token[rows]
    experts = torch.repeat_interleave(torch.arange(E, device=DEVICE), s.tokens_per_expert)
    assert torch.equal(experts, torch.bucketize(rows, s.expert_offsets[1:], right=True))
    d_a_prime = torch.einsum("rh,rhi->ri", d_out[tokens].double(), w2[experts].double())
    gate, up = h[rows, :I].double(), h[rows, I:].double()
    sig = torch.sigmoid(gate)
    a = (gate * sig * up).to(dtype).double()  # A as the forward stored it
    w = w_rows[rows].double()[:, None]
    want_d_h = torch.cat([w * d_a_prime * up * sig * (1 + gate * (1 - sig)), w * d_a_prime * gate * sig], dim=1)
    assert_close(d_h[rows], want_d_h, dtype, "dh", n_reduce=H)
    assert_close(a_w[rows], a * w, dtype, "w*A")
    width = kernel_config("down_dgrad_epilogue", I).block_n
    assert partial.shape == (s.num_rows, -(-I // width))
    want_partial = torch.zeros(len(rows), partial.shape[1], dtype=torch.float64, device=DEVICE)
    for j in range(partial.shape[1]):
        want_partial[:, j] = (d_a_prime[:, j * width : (j + 1) * width] * a[:, j * width : (j + 1) * width]).sum(1)
    assert_close(partial[rows], want_partial, dtype, "router partials", n_reduce=H * width)
    padding = ~used & (torch.arange(s.num_rows, device=DEVICE) < s.expert_offsets[-1])  # inside active segments
    assert padding.any() and not d_h[padding].any() and not a_w[padding].any()
    again = grouped_mlp.down_dgrad(d_out, w2, h, *routed)
    for name, first, second in zip(["dh", "w*A"], (d_h, a_w), again[:2], strict=True):
        assert torch.equal(first, second), name
    assert torch.equal(partial[rows], again[2][rows]), "partials"  # set on routed rows only


def test_gather_column_blocks_cover_the_columns_once():
    from mok_plugin.kernels.grouped_mlp import GATHER_CHUNK_BYTES, gather_column_blocks

    assert gather_column_blocks(2048, 1000, 128) == [(0, 2048)]  # small enough: one copy
    bytes_per_col = GATHER_CHUNK_BYTES // 900  # 2048 columns would need 3 copies
    blocks = gather_column_blocks(2048, bytes_per_col, 128)
    assert blocks == [(0, 768), (768, 1536), (1536, 2048)]
    assert all((c1 - c0) * bytes_per_col <= GATHER_CHUNK_BYTES for c0, c1 in blocks)
    # a single block wider than the budget is still one block, never an empty range
    assert gather_column_blocks(100, GATHER_CHUNK_BYTES, 64) == [(0, 64), (64, 100)]


def test_launchers_name_a_bad_argument():
    T, H, I, E, K = 8, 32, 16, 2, 2
    s = build_schedule(torch.randint(0, E, (T, K)).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    x, w13 = torch.randn(T, H).to(DEVICE), torch.randn(E, 2 * I, H).to(DEVICE)
    with pytest.raises(TypeError, match="gate_up_proj must be torch.float32"):
        grouped_mlp.gate_up_fwd(x, w13.half(), s.row_to_token, s.tile_to_expert, s.tile_m)
    with pytest.raises(ValueError, match="x has H=16 but gate_up_proj has H=32"):
        grouped_mlp.gate_up_fwd(x[:, :16].contiguous(), w13, s.row_to_token, s.tile_to_expert, s.tile_m)
    with pytest.raises(ValueError, match="schedule tile_m=48 must be a multiple of BLOCK_M"):
        grouped_mlp.gate_up_fwd(x, w13, s.row_to_token, s.tile_to_expert, 48)


# Every expert family (testing.EXPERT_FAMILIES: each kind, each activation, the clamped GPT-OSS
# GLU, biases on either linear) through the same kernels: against the reference, the float64
# oracle and a second run (bitwise). A linear expert's I is H.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(EXPERT_FAMILIES))
def test_every_expert_family_matches_reference_and_oracle(family, dtype):
    fam = EXPERT_FAMILIES[family]
    T, H, I, E, K = 45, 40, 24, 5, 2  # H and I not block multiples; skewed: empty experts
    compare_with_reference(
        T,
        H,
        H if fam.kind == "linear" else I,
        E,
        K,
        "skewed",
        dtype,
        seed=3,
        variant="multi_kernel",
        family=fam,
        oracle=True,
    )


@pytest.mark.parametrize("family", ["gpt_oss", "mlp_squared_relu", "linear_bias"])
@pytest.mark.parametrize("T, H, I, E, K, kind, capacity", CASES)
@pytest.mark.slow  # the fast set has every family on one case (above); this sweeps the crafted cases
def test_families_on_every_crafted_case(family, T, H, I, E, K, kind, capacity):
    fam = EXPERT_FAMILIES[family]
    compare_with_reference(
        T,
        H,
        H if fam.kind == "linear" else I,
        E,
        K,
        kind,
        torch.float32,
        capacity=capacity,
        variant="multi_kernel",
        family=fam,
    )
