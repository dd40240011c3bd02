"""mok bench bound: each shape's FLOP time against its memory floor, and the class grid (no GPU)."""

from __future__ import annotations

import json

import pytest

from mok_plugin.bench import bound
from mok_plugin.bench.floor import floor_bytes
from mok_plugin.bench.flops import moe_flops
from mok_plugin.testing import MoEShape, parse_shape


def test_the_384_expert_shape_is_held_by_its_bytes_at_the_h200s_rates():
    # BENCHMARKS.md's count (session 52): 8,659 GFLOP, 101.7 GB, 25.43 ms at 4.0 TB/s: 52 % of dense at most
    b = bound.bound_of(parse_shape("4096,7168,2048,384,8"), dense_tflops=660, copy_tbps=4.0)
    assert b.gflop == pytest.approx(8659, abs=1) and b.floor_gb == pytest.approx(101.7, abs=0.05)
    assert b.floor_ms == pytest.approx(25.43, abs=0.01) and b.flop_ms == pytest.approx(13.12, abs=0.01)
    assert b.allowed == pytest.approx(b.flop_ms / b.floor_ms) and b.allowed < 0.53
    assert b.floor_per_flop == pytest.approx(1.94, abs=0.01)


def test_a_shape_whose_flops_outlast_its_bytes_allows_the_whole_dense_rate():
    shape = parse_shape("qwen3-30b-a3b")
    b = bound.bound_of(shape, dense_tflops=500, copy_tbps=2.0)
    assert b.allowed == 1.0 and b.floor_per_flop < 1
    # the rates scale the two times, the counts stay the floor's and the FLOPs'
    assert b.flop_ms == pytest.approx(moe_flops(shape, "fwd+bwd") / 500e12 * 1e3)
    assert b.floor_ms == pytest.approx(floor_bytes(shape, shape.E) / 2.0e12 * 1e3)


def test_a_rate_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="positive"):
        bound.bound_of(MoEShape(8, 64, 32, 4, 2), dense_tflops=0)


def test_below_the_rows_needed_no_grid_shape_reaches_the_target():
    # weights alone give (T K / E) * copy / dense of the dense rate: fewer rows an expert than
    # target * dense / copy is short whatever H and I are, and the activations only add bytes
    needed = bound.rows_needed(0.7, 660, 4.0)
    assert needed == pytest.approx(115.5)
    bounds = [bound.bound_of(shape) for shape in bound.class_grid()]
    assert len(bounds) == 900
    for b in bounds:
        T, _, _, E, K = b.shape
        if T * K / E < needed:
            assert b.allowed < 0.7, b
        if b.allowed < 0.7:
            assert T * K / E < needed * 1.05, b  # the activations move the edge by a few rows at most


def test_the_grid_summary_counts_by_e():
    bounds = [bound.bound_of(shape) for shape in bound.class_grid()]
    lines = bound.grid_summary(bounds, 0.7, 660, 4.0)
    short = sum(b.allowed < 0.7 for b in bounds)
    assert lines[0].startswith(f"{short} of 900 shapes") and "below 115 rows an expert" in lines[0]
    by_e = {int(line.split()[2].rstrip(":")): int(line.split()[3]) for line in lines[1:5]}
    assert sum(by_e.values()) == short and by_e[128] == 0 and by_e[384] > by_e[256] > 0
    assert lines[-1].startswith("  lowest: ") and "rows an expert" in lines[-1]


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bound.json"
    assert bound.main(["--shapes", "deepseek-v3", "--shape", "4096,7168,2048,384,8", "--class-grid",
                       "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "deepseek-v3 (8192,7168,2048,256,8)" in text and "within the bytes" in text
    assert "4096,7168,2048,384,8" in text and "out of reach by the bytes" in text and "of 900 shapes" in text
    data = json.loads(out.read_text())
    assert data["rates"] == {"dense_tflops": 660.0, "copy_tbps": 4.0, "target": 0.7}
    assert [row["shape"] for row in data["shapes"]] == [[8192, 7168, 2048, 256, 8], [4096, 7168, 2048, 384, 8]]
    assert len(data["class_grid"]) == 900 and 0 < data["shapes"][1]["allowed"] < 0.53


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--shape", "1,2,3"], "T,H,I,E,K"), (["--target", "1.5"], "--target 1.5"), (["--copy-tbps", "0"], "positive")],
)
def test_bad_input_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bound.main(argv)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
