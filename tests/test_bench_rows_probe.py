"""`mok bench rows` (mok_plugin/bench/rows_probe.py) without a GPU: each variant routes both row GEMMs
where it says, its bits are compared with Triton's on the routed rows only, the sides are timed in
turn, and the module settings it changes come back; the command refuses without a Hopper GPU."""

import pytest
import torch

from mok_plugin.bench import rows_probe
from mok_plugin.kernels import grouped_mlp, rows_hopper, wgrad_hopper


def test_variants_route_compare_and_time(monkeypatch):
    routed = torch.tensor([True, True, False])
    seen = []

    def gemm():  # Triton's rows; the Gluon variants: the same routed rows, and order 0 one bit off
        seen.append((grouped_mlp.HOPPER_ROW_GEMMS, rows_hopper.SCHEDULE, rows_hopper.GROUP_M))
        out = torch.tensor([1.0, 2.0, float("nan")])  # the padding row: never compared
        if grouped_mlp.HOPPER_ROW_GEMMS and rows_hopper.GROUP_M == 0:
            out[1] = torch.nextafter(out[1], torch.tensor(3.0))
        return out

    times = {"triton": 2.0, "cooperative:8": 1.5, "cooperative:0": 3.0}
    timed = []

    def fake_time_ms(fn, iters, settle_s):
        fn()
        variant = "triton" if not grouped_mlp.HOPPER_ROW_GEMMS else f"{rows_hopper.SCHEDULE}:{rows_hopper.GROUP_M}"
        timed.append((variant, settle_s))
        return [times[variant]] * iters

    monkeypatch.setattr(rows_probe, "time_ms", fake_time_ms)
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROW_GEMMS", ())
    monkeypatch.setattr(rows_hopper, "GROUP_M", rows_hopper.GROUP_M)  # restored after: _time_gemm sets them
    monkeypatch.setattr(rows_hopper, "SCHEDULE", rows_hopper.SCHEDULE)
    rows = rows_probe._time_gemm(gemm, 3e9, ["cooperative:8", "cooperative:0"], routed, rounds=2, iters=4)
    assert [(r["variant"], r["bitwise"], r["vs_triton"]) for r in rows] == [
        ("triton", True, 1.0), ("cooperative:8", True, 0.75), ("cooperative:0", False, 1.5)]  # fmt: skip
    assert rows[1]["tflops"] == pytest.approx(3e9 / 1.5 / 1e9)
    gluon = ("down_fwd", "gate_up_dgrad")
    assert {g for g, _, _ in seen} == {(), gluon}  # Triton's calls: neither GEMM on the Gluon kernel
    assert {(sched, order) for g, sched, order in seen if g} == {("cooperative", 8), ("cooperative", 0)}
    # the sides in turn, the first round settled longer than the next
    assert [v for v, _ in timed] == ["triton", "cooperative:8", "cooperative:0"] * 2
    assert timed[0][1] > timed[3][1]


def test_unknown_schedule_is_refused_and_a_128_wide_ring_defined(monkeypatch):
    monkeypatch.setattr(wgrad_hopper, "SCHEDULES", dict(wgrad_hopper.SCHEDULES))
    rows_probe._register("coop128s6")
    assert wgrad_hopper.SCHEDULES["coop128s6"] == wgrad_hopper.Schedule(block_n=128, stages=6, pingpong=False)
    with pytest.raises(SystemExit, match="unknown schedule 'halves'"):
        rows_probe._register("halves")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_refuses_without_a_hopper_gpu(capsys):
    assert rows_probe.main(["--shape", "tiny"]) == 2
    assert "needs a Hopper (sm_90) GPU" in capsys.readouterr().err
