"""`mok bench host`: the multi-kernel experts' launches a step and their host time, launches stubbed
(no GPU). The launch counts are a guard: a change that adds a launch to the small-batch step (whose
time is the host's, BENCHMARKS.md) shows here first."""

import os

import pytest

pytest.importorskip("triton")

from mok_plugin.bench import host  # noqa: E402
from mok_plugin.testing import MoEShape  # noqa: E402

# One fwd+bwd of the bias-free SwiGLU experts at T = 1 (the schedule in one launch).
SMALL_STEP = {
    "_schedule_one_chunk_kernel": 1,
    "_gate_up_fwd_kernel": 1,
    "_down_fwd_kernel": 1,
    "_combine_rows_kernel": 2,  # the forward's output, the backward's dx
    "_down_dgrad_gemm_kernel": 1,
    "_down_dgrad_epilogue_kernel": 1,
    "_reduce_router_grad_kernel": 1,
    "_expert_wgrad_kernel": 2,  # dW2, dW13
    "_gate_up_dgrad_kernel": 1,
}


def test_a_small_step_launches_eleven_kernels_and_the_schedule_takes_three_past_one_chunk():
    with host.stubbed_launches() as counts:
        host.experts_step(MoEShape(1, 2048, 768, 128, 8))()
        assert dict(counts) == SMALL_STEP
        counts.clear()
        host.experts_step(MoEShape(512, 2048, 768, 128, 8))()  # 4096 pairs: past the one-launch 2048
    large = dict(SMALL_STEP, _chunk_histogram_kernel=1, _chunk_prefix_kernel=1, _chunk_scatter_kernel=1)
    del large["_schedule_one_chunk_kernel"]
    assert dict(counts) == large


def test_the_megakernel_step_is_three_launches():
    with host.stubbed_launches() as counts:
        host.experts_step(MoEShape(1, 256, 128, 16, 4), "megakernel")()
    assert dict(counts) == {"_schedule_one_chunk_kernel": 1, "_forward_megakernel": 1, "_backward_megakernel": 1}


def test_the_stub_is_undone_on_exit_and_the_interpreter_switch_restored():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    before = (JITFunction.__getitem__, InterpretedFunction.__getitem__, os.environ.get("TRITON_INTERPRET"))
    with pytest.raises(RuntimeError, match="inside"):
        with host.stubbed_launches():
            assert "TRITON_INTERPRET" not in os.environ  # the launchers pick the GPU's tiles
            raise RuntimeError("inside")
    assert (JITFunction.__getitem__, InterpretedFunction.__getitem__, os.environ.get("TRITON_INTERPRET")) == before


def test_the_command_prints_a_row_per_token_count(capsys):
    assert host.main(["--tokens", "1", "37", "--steps", "2", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row[0], row[1]) for row in rows] == [("1", "11"), ("37", "11")]
    assert all(float(row[2]) > 0 for row in rows)
    with pytest.raises(SystemExit):
        host.main(["--steps", "0"])


def test_the_launch_paths_are_compared_on_a_gpu_only(capsys):
    import torch

    if torch.cuda.is_available():
        assert host.main(["--cuda", "--tokens", "1", "--steps", "2", "--repeats", "1"]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        assert [row[0] for row in rows] == ["1"]
    else:
        with pytest.raises(SystemExit):
            host.main(["--cuda"])
        assert "--cuda needs a CUDA GPU" in capsys.readouterr().err
