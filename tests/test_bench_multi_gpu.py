"""`mok bench multi-gpu` (scripts/multi_gpu.py): the CPU smoke run finishes in seconds on small
shapes (the invariance test skips there with its reason; the EP benchmark runs at EP = 2 on gloo);
a failed job is named in one line with its cause, not torchrun's trace; pytest's JUnit XML is read
per test."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mok_plugin.bench.multi_gpu import failure_line, invariance_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_cpu_smoke_run_uses_small_shapes(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/multi_gpu.py", "--cpu", "--nprocs", "2", "--iters", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "multi_gpu.json").read_text())
    invariance = result["invariance"]
    assert invariance["status"] == "skipped" and "2 CUDA devices" in invariance["cause"]
    assert len(invariance["rows"]) == 9  # 3 transports/exchanges x 3 routings, each reported
    (bench,) = result["bench"]
    assert (bench["shape"], bench["tokens_per_gpu"], bench["ep"]) == ("small", 64, 2)
    assert bench["status"] == "ran" and set(bench["per_rank"]) == {"0", "1"}
    assert bench["slowest_rank_median"]["dispatch"] > 0 and bench["per_rank"]["0"]["bytes"] > 0
    assert "needs at least 2 CUDA devices" in run.stdout


TORCHRUN_TRACE = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "mok_plugin/bench/ep.py", line 130, in run_rank
[rank1]: mok_plugin.config.MoKConfigError: mok.num_experts=7 is not divisible by mok.ep_size=2
E1202 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""


@pytest.mark.parametrize(
    "log, code, expected",
    [
        pytest.param(TORCHRUN_TRACE, 1, "MoKConfigError: mok.num_experts=7 is not divisible by mok.ep_size=2",
                     id="rank_exception_not_torchrun_wrapper"),
        pytest.param("...\nexitcode  : -9 (pid: 12)\nSignal 9 (SIGKILL) received by PID 12\n", 1,
                     "killed by SIGKILL (out of memory?)", id="oom_kill"),
        pytest.param("", -9, "killed by SIGKILL (out of memory?)", id="killed_itself"),
        pytest.param("step 1\nstep 2\n\n", 3, "step 2", id="last_line"),
        pytest.param("", 3, "exit code 3, no output", id="no_output"),
    ],
)  # fmt: skip
def test_failure_is_one_line(log, code, expected):
    line = failure_line(log, code)
    assert line == expected and "\n" not in line


def test_invariance_rows_from_junit_xml():
    xml = """<testsuites><testsuite>
      <testcase name="test_a[x]"/>
      <testcase name="test_a[y]">
        <failure message="AssertionError: differs from EP = 1: {2: ['d_x']}&#10;more"/>
      </testcase>
      <testcase name="test_a[z]"><skipped message="needs at least 2 CUDA devices"/></testcase>
    </testsuite></testsuites>"""
    assert invariance_rows(xml) == [
        {"test": "test_a[x]", "outcome": "passed", "message": ""},
        {"test": "test_a[y]", "outcome": "failed", "message": "AssertionError: differs from EP = 1: {2: ['d_x']}"},
        {"test": "test_a[z]", "outcome": "skipped", "message": "needs at least 2 CUDA devices"},
    ]


def test_layout_flags_fit_the_gpu_count():
    from mok_plugin.bench.megatron_layouts import LAYOUTS, layout_flags

    def sizes(flags: list[str]) -> dict[str, int]:
        return {f: int(flags[flags.index(f) + 1]) for f in ("--expert-model-parallel-size", "--global-batch-size")}

    # 4 GPUs: TP 2 (expert TP 1) lets EP span all 4; PP 2 leaves 2 data-parallel ranks; micro-batch 4.
    assert sizes(layout_flags("tp2_sp", 4, 4)) == {"--expert-model-parallel-size": 4, "--global-batch-size": 8}
    assert sizes(layout_flags("pp2_vpp2", 4, 4)) == {"--expert-model-parallel-size": 2, "--global-batch-size": 8}
    assert sizes(layout_flags("ep_overlap", 4, 4)) == {"--expert-model-parallel-size": 4, "--global-batch-size": 16}
    assert "--sequence-parallel" in layout_flags("tp2_sp", 2, 4)
    # What cannot run says why, in words.
    assert "at least 2" in layout_flags("dist_optim", 1, 4)
    assert "divisible by 2" in layout_flags("tp2_sp", 3, 4)
    assert set(LAYOUTS) == {"tp2_sp", "pp2_vpp2", "ep_overlap", "dist_optim", "cp2"}
