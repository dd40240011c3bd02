"""`mok bench wgrad-rows`: its arguments on any machine (the timing itself needs a GPU)."""

import pytest
import torch

from mok_plugin.bench import wgrad_rows


def test_defaults_are_deepseek_v3s_dw13_with_the_same_rows_in_every_case():
    args = wgrad_rows.build_parser().parse_args([])
    assert args.mn == (7168, 4096) and args.rows == 32768
    assert all(args.rows % rows == 0 and rows % 128 == 0 for rows in args.rows_per_expert)
    assert args.kernels == ["fp8", "bf16"] and args.out_dtypes == ["bfloat16"]


@pytest.mark.parametrize("rows", [200, 0, 384])  # not a multiple of 128; nothing; not dividing 32768
def test_rows_an_expert_the_kernels_cannot_take_are_refused_by_name(capsys, rows):
    with pytest.raises(SystemExit) as exit_info:
        wgrad_rows.main(["--rows-per-expert", "256", str(rows)], prog="mok bench wgrad-rows")
    assert exit_info.value.code == 2
    assert f"--rows-per-expert {rows}" in capsys.readouterr().err


def test_mn_takes_two_integers(capsys):
    assert wgrad_rows.build_parser().parse_args(["--mn", "2048,7168"]).mn == (2048, 7168)
    with pytest.raises(SystemExit):
        wgrad_rows.build_parser().parse_args(["--mn", "2048"])
    assert "expected M,N" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_without_a_gpu_it_says_so_and_returns_2(capsys):
    assert wgrad_rows.main(["--rows-per-expert", "256"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_fp8_loops_are_chosen_by_name_and_default_to_the_kernels_own():
    assert wgrad_rows.build_parser().parse_args([]).fp8_loops is None
    args = wgrad_rows.build_parser().parse_args(["--fp8-loops", "flat", "tile_by_tile"])
    assert args.fp8_loops == ["flat", "tile_by_tile"]
    with pytest.raises(SystemExit):
        wgrad_rows.build_parser().parse_args(["--fp8-loops", "ping_pong"])


@pytest.mark.parametrize("kept", [None, True, False])
def test_each_fp8_loop_is_set_for_its_call_only(monkeypatch, kept):
    from mok_plugin.kernels import fp8_hopper

    monkeypatch.setattr(fp8_hopper, "FLAT_WGRAD", kept)
    seen = []

    def call():
        seen.append(fp8_hopper.FLAT_WGRAD)
        return torch.zeros(1)

    wgrad_rows.with_fp8_loop(call, "flat")()
    wgrad_rows.with_fp8_loop(call, "tile_by_tile")()
    assert seen == [True, False] and fp8_hopper.FLAT_WGRAD is kept

    def failing():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        wgrad_rows.with_fp8_loop(failing, "flat" if not kept else "tile_by_tile")()
    assert fp8_hopper.FLAT_WGRAD is kept
