"""The pinned kernel-config table's helpers: the short config notation the scripts take, and the
in-process override a benchmark uses to time a candidate table."""

import pytest

from mok_plugin.kernels.configs import (
    PINNED_KERNELS,
    PRE_GATHER_MIN_WIDTH,
    MoKTileConfig,
    kernel_config,
    overridden_configs,
    parse_tile_config,
    tile_config_label,
    tile_config_spec,
    wgrad_kernel,
)


@pytest.mark.parametrize(
    "spec, expected, label",
    [
        ("128x256x64w8s3", MoKTileConfig(128, 256, 64, 8, 3), "128x256x64 w8 s3"),
        ("128x128x64w8s4t/2", MoKTileConfig(128, 128, 64, 8, 4, tma=True, split_n=2), "128x128x64 w8 s4 tma /2"),
        ("64x128x32w4s2g", MoKTileConfig(64, 128, 32, 4, 2, gather_rows=True), "64x128x32 w4 s2 gather"),
        (
            "128x128x64w8s4gt",
            MoKTileConfig(128, 128, 64, 8, 4, tma=True, gather_rows=True),
            "128x128x64 w8 s4 gather tma",
        ),
        (
            "128x256x64w8s3te",
            MoKTileConfig(128, 256, 64, 8, 3, tma=True, split_epilogue=True),
            "128x256x64 w8 s3 tma split-epilogue",
        ),
    ],
)
def test_parse_and_label(spec, expected, label):
    assert parse_tile_config(spec) == expected
    assert tile_config_label(expected) == label
    assert tile_config_spec(expected) == spec  # the form the scripts print reads back


@pytest.mark.parametrize(
    "spec", ["", "128x256w8s3", "128x256x64w8", "128x256x64w8s3tg", "128x256x64w8s3et", "128x256x64w8s3/x"]
)
def test_parse_rejects_other_forms(spec):
    with pytest.raises(ValueError, match="expected like"):
        parse_tile_config(spec)


def test_override_applies_inside_the_block_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pinned table, not the interpreter's small tiles
    pinned, down_fwd = kernel_config("wgrad", 4096), kernel_config("down_fwd", 4096)
    candidate = parse_tile_config("128x256x64w8s4g")
    assert candidate != pinned
    with overridden_configs({"wgrad": candidate}):
        assert kernel_config("wgrad", 4096) == candidate
        assert kernel_config("down_fwd", 4096) == down_fwd  # the other entries stay
    assert kernel_config("wgrad", 4096) == pinned
    with pytest.raises(RuntimeError), overridden_configs({"wgrad": candidate}):
        raise RuntimeError("the table is restored on errors too")
    assert kernel_config("wgrad", 4096) == pinned


def test_override_rejects_unknown_kernels():
    assert "wgrad" in PINNED_KERNELS
    with (
        pytest.raises(KeyError, match="no pinned config"),
        overridden_configs({"wgrad_fast": MoKTileConfig(1, 1, 1, 1, 1)}),
    ):
        pass


def test_weight_gradients_copy_their_gathered_rows_only_for_wide_by_row_operands(monkeypatch):
    # The copy costs the same at any width while the GEMM grows with it: narrow shapes (qwen3's
    # I = 768, olmoe's 2I = 2048) gather in the K loop, wide ones (mixtral's I = 14336) copy first.
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pinned table, not the interpreter's small tiles
    assert wgrad_kernel(768) == wgrad_kernel(PRE_GATHER_MIN_WIDTH - 1) == "wgrad_in_loop"
    assert wgrad_kernel(PRE_GATHER_MIN_WIDTH) == wgrad_kernel(14336) == "wgrad"
    assert not kernel_config("wgrad_in_loop", 768).gather_rows
    assert kernel_config("wgrad", 14336).gather_rows
    # weight-gradient tiles are not narrowed by the output width
    assert kernel_config("wgrad_in_loop", 64) == kernel_config("wgrad_in_loop", 4096)
