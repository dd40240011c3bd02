"""The clock log of `mok bench ab` and `mok bench layer` (mok_plugin/bench/clocks.py) on the CPU: samples
are kept under the side that ran at both ends of their query, nvidia-smi's answer is parsed and its
failures cost a sample, not the benchmark, and a log that got nothing says so."""

import subprocess
import threading
import time
import types

import pytest
import torch

from mok_plugin.bench import clocks


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the sampler took no sample in time"
        time.sleep(0.001)


def test_samples_are_kept_by_side_and_dropped_between_sides():
    current = {"reading": (1500.0, 600.0)}
    log = clocks.ClockLog(lambda: current["reading"], period_s=0.001)

    def count(label):
        return log.summary().get(label, {}).get("samples", 0)

    with log.running():
        time.sleep(0.02)  # no side: nothing kept
        assert log.summary() == {}
        with log.side("A"):
            wait_for(lambda: count("A") >= 3)
        current["reading"] = (1400.0, 700.0)  # changed between sides, so no A sample can read it
        with log.side("B"):
            wait_for(lambda: count("B") >= 3)
    summary = log.summary()
    assert set(summary) == {"A", "B"}
    assert (summary["A"]["sm_mhz"], summary["A"]["watts"]) == (1500.0, 600.0)
    assert (summary["B"]["sm_mhz"], summary["B"]["watts"]) == (1400.0, 700.0)


def test_a_sample_whose_side_changed_during_its_query_is_dropped():
    started, release = threading.Event(), threading.Event()

    def read():
        if not started.is_set():  # the first query is held until the side has changed
            started.set()
            release.wait(10)
        return 1000.0, 100.0

    log = clocks.ClockLog(read, period_s=0.001)
    with log.running():
        with log.side("A"):
            assert started.wait(10)
        with log.side("B"):
            release.set()
            wait_for(lambda: log.summary().get("B", {}).get("samples", 0) >= 1)
    assert "A" not in log.summary()


def test_without_nvidia_smi_there_is_no_reader(monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    assert clocks.nvidia_smi_reader("0") is None


@pytest.mark.parametrize(
    "stdout, error, expected",
    [
        pytest.param("1755, 612.34\n", None, (1755.0, 612.34), id="parsed"),
        pytest.param("[N/A], 612.34\n", None, None, id="not_a_number"),
        pytest.param("", None, None, id="empty"),
        pytest.param("", subprocess.CalledProcessError(9, "nvidia-smi"), None, id="failed"),
        pytest.param("", subprocess.TimeoutExpired("nvidia-smi", 5), None, id="timed_out"),
    ],
)
def test_nvidia_smi_answers_are_parsed_and_failures_cost_one_sample(monkeypatch, stdout, error, expected):
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        if error is not None:
            raise error
        return types.SimpleNamespace(stdout=stdout)

    monkeypatch.setattr(clocks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(clocks.subprocess, "run", run)
    read = clocks.nvidia_smi_reader("00000000:19:00.0")
    assert read() == expected
    assert calls[0][:3] == ["/usr/bin/nvidia-smi", "-i", "00000000:19:00.0"]
    assert "--query-gpu=clocks.sm,power.draw" in calls[0]


def test_the_gpu_is_named_by_its_pci_bus_id_where_torch_gives_one(monkeypatch):
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert clocks.gpu_selector() == "00000000:19:00.0"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace())
    assert clocks.gpu_selector() == "3"


def test_a_clock_log_is_made_only_where_asked_for_and_nvidia_smi_answers(monkeypatch, capsys):
    monkeypatch.setattr(clocks, "gpu_selector", lambda: "0")
    assert clocks.clock_log(enabled=False) is None
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    assert clocks.clock_log() is None
    assert "no nvidia-smi" in capsys.readouterr().err  # asked for and absent: said, not silent
    monkeypatch.setattr(clocks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert isinstance(clocks.clock_log(), clocks.ClockLog)
    assert clocks.describe({"sm_mhz": 1404.4, "watts": 686.2, "samples": 20}) == "1404 MHz 686 W (20 samples)"
    assert clocks.describe(None) == ""


def test_a_log_whose_queries_all_failed_says_so(capsys):
    log = clocks.ClockLog(lambda: None, period_s=0.001)
    with log.running(), log.side("A"):
        wait_for(lambda: log.failed_reads >= 2)
    assert log.summary() == {}
    assert "nvidia-smi answered none of" in capsys.readouterr().err
