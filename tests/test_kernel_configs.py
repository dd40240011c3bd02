"""The pinned kernel-config table (kernels/configs.py): lookup, the shape rules (row-tile GEMMs
narrow BLOCK_N for narrow outputs and for launches with fewer programs than SMs; weight-gradient,
megakernel and epilogue tiles never change), the choice between the four weight-gradient entries,
the interpreter's small tiles, and the in-process swap a benchmark uses (mok_plugin.bench.tuning
builds its overrides on it)."""

from dataclasses import replace

import pytest

from mok_plugin.kernels.configs import (
    FEW_ROWS_MAX,
    FEW_ROWS_MAX_OUTPUT,
    PINNED_KERNELS,
    PRE_GATHER_MIN_WIDTH,
    SPREAD_MIN_BLOCK_N,
    SWEEP_MAX_ROWS,
    MoKTileConfig,
    interpreter_on,
    kernel_config,
    spread_over_sms,
    swap_pinned,
    wgrad_kernel,
)


@pytest.fixture
def pinned_table(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pinned table, not the interpreter's small tiles


def test_swap_pinned_returns_what_it_replaced(pinned_table):
    before, down_fwd = kernel_config("wgrad", 4096), kernel_config("down_fwd", 4096)
    candidate = MoKTileConfig(128, 256, 64, 8, 4, gather_rows=True)
    previous = swap_pinned({"wgrad": candidate})
    try:
        assert previous == {"wgrad": before}
        assert kernel_config("wgrad", 4096) == candidate
        assert kernel_config("down_fwd", 4096) == down_fwd  # the other entries stay
    finally:
        swap_pinned(previous)
    assert kernel_config("wgrad", 4096) == before


def test_swap_pinned_rejects_unknown_kernels_and_changes_nothing(pinned_table):
    before = kernel_config("wgrad", 4096)
    with pytest.raises(KeyError, match="no pinned config for \\['wgrad_fast'\\]"):
        swap_pinned({"wgrad": MoKTileConfig(1, 1, 1, 1, 1), "wgrad_fast": MoKTileConfig(1, 1, 1, 1, 1)})
    assert kernel_config("wgrad", 4096) == before


def test_unknown_kernel_is_a_key_error(pinned_table):
    with pytest.raises(KeyError):
        kernel_config("down_dgrad_fused", 64)


def test_row_tiles_narrow_for_narrow_outputs_only(pinned_table):
    wide = kernel_config("down_fwd", 4096)
    assert wide.block_n == 256
    assert kernel_config("down_fwd", 100).block_n == 128  # the next power of two
    assert kernel_config("down_fwd", 8).block_n == 64  # never below 64
    assert kernel_config("down_fwd", 100).block_m == wide.block_m  # rows and K order stay
    assert kernel_config("down_fwd", 100).block_k == wide.block_k


@pytest.mark.parametrize("kernel", ["megakernel_down_dgrad", "megakernel_wgrad", "down_dgrad_epilogue", "combine"])
def test_fixed_tiles_never_narrow(pinned_table, kernel):
    # The router partials are as wide as the epilogue's (or the megakernel's) I-block: a fixed
    # width keeps the router gradient's summation order the same for every I.
    assert kernel_config(kernel, 8) == kernel_config(kernel, 1 << 16)


def test_megakernel_tiles_share_rows_and_k_steps(pinned_table):
    # One launch runs every task kind, so they must agree on BLOCK_M and BLOCK_K (megakernel.py).
    dgrad, dx = kernel_config("megakernel_down_dgrad", 768), kernel_config("gate_up_dgrad", 2048)
    assert (dgrad.block_m, dgrad.block_k) == (dx.block_m, dx.block_k)
    up, down = kernel_config("gate_up_fwd", 768), kernel_config("down_fwd", 2048)
    assert (up.block_m, up.block_k) == (down.block_m, down.block_k)


def test_interpreter_uses_small_tiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for kernel in PINNED_KERNELS:
        cfg = kernel_config(kernel, 4096)
        assert cfg.block_m <= 32 and cfg.block_n <= 32 and cfg.num_stages == 1, kernel


def test_weight_gradients_copy_their_gathered_rows_only_for_wide_by_row_operands(pinned_table):
    # The copy costs the same at any width while the GEMM grows with it: narrow shapes (qwen3's
    # I = 768, olmoe's 2I = 2048) gather in the K loop, wide ones (mixtral's I = 14336) copy first.
    many, small = SWEEP_MAX_ROWS + 1, 2048 * 768  # qwen3's dW2: 2048 x 768 per expert
    assert wgrad_kernel(768, many, small) == wgrad_kernel(PRE_GATHER_MIN_WIDTH - 1, many, small) == "wgrad_in_loop"
    assert wgrad_kernel(PRE_GATHER_MIN_WIDTH, many, small) == wgrad_kernel(14336, many, 4096 * 14336) == "wgrad"
    # Experts with few rows each (deepseek-v3: 383 schedule rows an expert) sweep, at any width, in
    # smaller tiles at the fewest (small batches: 130-160 rows an expert at T = 37-512 on qwen3) when
    # each expert's gradient is small; large ones (4096,7168,2048,384,8: 213 rows) keep the sweep's tiles
    assert wgrad_kernel(768, SWEEP_MAX_ROWS, small) == wgrad_kernel(14336, FEW_ROWS_MAX + 1, small) == "wgrad_sweep"
    assert wgrad_kernel(768, FEW_ROWS_MAX, small) == wgrad_kernel(2048, 128, 1536 * 2048) == "wgrad_sweep_few_rows"
    assert wgrad_kernel(2048, 213, 7168 * 2048) == wgrad_kernel(7168, 213, FEW_ROWS_MAX_OUTPUT) == "wgrad_sweep"
    few, swept = kernel_config("wgrad_sweep_few_rows", 4096), kernel_config("wgrad_sweep", 4096)
    assert few.sweep and swept.sweep and not kernel_config("wgrad", 4096).sweep
    assert few.block_k == swept.block_k and few.block_m * few.block_n < swept.block_m * swept.block_n
    assert not kernel_config("wgrad_in_loop", 768).gather_rows
    assert kernel_config("wgrad", 14336).gather_rows
    # weight-gradient tiles are not narrowed by the output width
    assert kernel_config("wgrad_in_loop", 64) == kernel_config("wgrad_in_loop", 4096)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", "Y", "0", "false", "off", "no", "", "2", "t"])
def test_interpreter_on_reads_the_setting_as_triton_does(monkeypatch, value):
    # The FP8 kernels round by the GPU's conversion unless interpreted (kernels/fp8.py): a value Triton
    # reads as true but MoK did not would send the interpreter down the conversion, which it mis-rounds
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_on() == triton.knobs.runtime.interpret


def test_spread_over_sms_narrows_only_launches_that_leave_sms_idle(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pinned table, not the interpreter's small tiles
    down_fwd = kernel_config("down_fwd", 2048)  # 128 x 256
    # T = 1, top-8: 8 row blocks x 8 column tiles = 64 programs on 132 SMs -> 128 (16 tiles), then 64 wide
    assert spread_over_sms(down_fwd, 8, 2048, 132).block_n == 64
    assert spread_over_sms(down_fwd, 8, 2048, 100).block_n == 128  # 8 x 16 = 128 programs: enough
    spread = spread_over_sms(down_fwd, 2, 2048, 132)
    assert spread.block_n == SPREAD_MIN_BLOCK_N  # never narrower, however few the programs
    assert replace(spread, block_n=256) == down_fwd  # only the width changes
    assert spread_over_sms(down_fwd, 130, 2048, 132) == down_fwd  # a full launch keeps its tile
    assert spread_over_sms(down_fwd, 0, 2048, 132) == down_fwd  # nothing to launch
    gate_up = kernel_config("gate_up_fwd", 768)  # 128 x 128: 8 x 6 = 48 programs -> 96 at 64 wide
    assert spread_over_sms(gate_up, 8, 768, 132).block_n == 64
