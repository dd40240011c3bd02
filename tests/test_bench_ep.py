"""The EP benchmark's stage times without a hook in the layer: they are read from the
torch.profiler ranges the layer opens (mok_plugin.ep.dispatch / .experts / .combine), one value per
forward, in order; a stage that never ran (one rank) is 0; ranges that do not divide into the
forwards are an error. Forward and backward totals come from PassTimer. The end-to-end run on gloo
processes is tests/test_parallel.py::test_bench_ep_runs_and_writes_json."""

import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mok_plugin.bench.breakdown import range_times
from mok_plugin.bench.ep import STAGE_RANGES, PassTimer, profile_stages, stage_times_per_iteration, summarize


class _StagedLayer(torch.nn.Module):
    """Stands in for MoKMoE: opens the layer's stage ranges, each sleeping a known time per call."""

    def __init__(self, seconds: dict[str, float]) -> None:
        super().__init__()
        self.seconds, self.calls = seconds, 0

    def forward(self, x):
        self.calls += 1
        for stage, name in STAGE_RANGES.items():
            if stage in self.seconds:
                with record_function(name):
                    time.sleep(self.seconds[stage] * self.calls)
        return x * 2, torch.zeros(())


def test_stage_times_come_from_the_layer_ranges_in_order():
    # base times of 10 / 30 / 20 ms: a sleep of 4 ms once overran by 4 ms on a loaded 2-core machine (CI's
    # kind), past the tolerance; at these lengths an overrun that large stays inside it
    layer = _StagedLayer({"dispatch": 0.010, "experts": 0.030, "combine": 0.020})
    stages = profile_stages(layer, torch.ones(4, 8), iters=3, device=torch.device("cpu"))
    assert len(stages) == 3 and layer.calls == 4  # one more: the first profiled forward is not counted
    for i, row in enumerate(stages, start=2):  # forward i sleeps i times the base time
        assert set(row) == {"dispatch", "experts", "combine"}
        assert row["dispatch"] == pytest.approx(10 * i, rel=0.5)
        assert row["experts"] >= 30 * i and row["combine"] >= 20 * i
    assert stages[0]["experts"] < stages[1]["experts"] < stages[2]["experts"]


def test_a_stage_that_did_not_run_is_zero():
    # One rank: the layer skips dispatch and combine.
    stages = profile_stages(_StagedLayer({"experts": 0.001}), torch.ones(2, 2), iters=2, device=torch.device("cpu"))
    assert [row["dispatch"] for row in stages] == [0.0, 0.0] and all(row["experts"] > 0 for row in stages)


def test_ranges_that_do_not_match_the_forwards_are_an_error():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function(STAGE_RANGES["dispatch"]):
                pass
    assert len(range_times(prof.events(), [STAGE_RANGES["dispatch"]])[STAGE_RANGES["dispatch"]]) == 3
    with pytest.raises(ValueError, match="ran 3 times in 2 forwards"):
        stage_times_per_iteration(prof.events(), 2)
    # a range opened several times per forward is summed per forward
    assert len(stage_times_per_iteration(prof.events(), 1)) == 1


def test_pass_timer_on_the_cpu():
    timer = PassTimer(torch.device("cpu"))
    with timer("forward"):
        time.sleep(0.01)
    assert timer.times["forward"] >= 10.0


def test_summary_per_rank_and_slowest_rank():
    def it(forward, dispatch):
        return {"forward": forward, "dispatch": dispatch, "experts": 1.0, "combine": 1.0, "backward": 2.0}

    gathered = [
        {"rank": 0, "iters": [it(1.0, 0.2), it(3.0, 0.2), it(2.0, 0.2)], "bytes": 100},
        {"rank": 1, "iters": [it(2.0, 0.1), it(1.0, 0.4), it(5.0, 0.1)], "bytes": 50},
    ]
    summary = summarize(gathered)
    assert summary["per_rank"][0]["forward"] == 2.0 and summary["per_rank"][1]["bytes"] == 50
    assert summary["slowest_rank_median"]["forward"] == 3.0  # max per iteration 2, 3, 5 -> median 3
    assert summary["slowest_rank_median"]["dispatch"] == 0.2
    assert "megatron_slowest_rank_median" not in summary
