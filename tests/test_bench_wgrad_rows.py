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
