"""mok_plugin.bench.tuning: the short tile-config notation the benchmark commands take and print
(round trip, rejected forms), and the in-process override of the pinned table a benchmark uses to
time a candidate (inside the block only, restored on errors, unknown kernels refused)."""

import pytest

from mok_plugin.bench.tuning import overridden_configs, parse_tile_config, tile_config_label, tile_config_spec
from mok_plugin.kernels.configs import PINNED_KERNELS, MoKTileConfig, kernel_config


@pytest.mark.parametrize(
    "spec, expected, label",
    [
        pytest.param("128x256x64w8s3", MoKTileConfig(128, 256, 64, 8, 3), "128x256x64 w8 s3", id="plain"),
        pytest.param("128x128x64w8s4t", MoKTileConfig(128, 128, 64, 8, 4, tma=True), "128x128x64 w8 s4 tma",
                     id="tma"),
        pytest.param("64x128x32w4s2g", MoKTileConfig(64, 128, 32, 4, 2, gather_rows=True), "64x128x32 w4 s2 gather",
                     id="gather"),
        pytest.param("128x128x64w8s4gt", MoKTileConfig(128, 128, 64, 8, 4, tma=True, gather_rows=True),
                     "128x128x64 w8 s4 gather tma", id="gather_tma"),
    ],
)  # fmt: skip
def test_parse_and_label(spec, expected, label):
    assert parse_tile_config(spec) == expected
    assert tile_config_label(expected) == label
    assert tile_config_spec(expected) == spec  # the form the commands print reads back


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "128x256w8s3",
        "128x256x64w8",
        "128x256x64w8s3tg",  # the flags in the other order
        "128x256x64w8s3e",  # the separate down_dgrad epilogue is the only path now: no flag
        "128x256x64w8s3te",
        "128x128x64w8s4t/2",  # two accumulators are gone with it
        "128x256x64w8s3/x",
    ],
)
def test_parse_rejects_other_forms(spec):
    with pytest.raises(ValueError, match="expected like"):
        parse_tile_config(spec)


def test_every_pinned_config_round_trips(monkeypatch):
    # What `mok bench tune` prints for the pinned table reads back to the same config.
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pinned table, not the interpreter's small tiles
    for kernel in PINNED_KERNELS:
        cfg = kernel_config(kernel, 4096)
        parsed = parse_tile_config(tile_config_spec(cfg))
        assert (parsed.block_m, parsed.block_n, parsed.block_k, parsed.num_warps, parsed.num_stages) == (
            cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
        )  # fmt: skip
        assert (parsed.tma, parsed.gather_rows) == (cfg.tma, cfg.gather_rows)


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
    with overridden_configs({}):  # no override: the table as pinned
        assert kernel_config("wgrad", 4096) == pinned


def test_override_rejects_unknown_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pinned = kernel_config("wgrad", 4096)
    assert "wgrad" in PINNED_KERNELS
    with (
        pytest.raises(KeyError, match="no pinned config"),
        overridden_configs({"wgrad": parse_tile_config("64x64x64w4s2"), "wgrad_fast": MoKTileConfig(1, 1, 1, 1, 1)}),
    ):
        pass
    assert kernel_config("wgrad", 4096) == pinned  # nothing was replaced
