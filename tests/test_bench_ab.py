"""`mok bench ab` (mok_plugin/bench/ab.py) on the CPU: its settings are checked against the modules
before any GPU work, B's changes are undone whatever happens, the rounds alternate, each kernel's time
is the mean of its side's settled profiles (A B B A B A A B), the clock log tags the rounds and
profiles (not the compile passes) by side, and the bitwise verdict is B's results against A's."""

import contextlib

import pytest
import torch

from mok_plugin.bench import ab
from mok_plugin.kernels import configs
from mok_plugin.kernels.configs import kernel_config


def flag_side(state: dict):
    """A b_side for run_ab that sets state["b"] while B runs, errors included."""

    @contextlib.contextmanager
    def b_side():
        state["b"] = True
        try:
            yield
        finally:
            state["b"] = False

    return b_side


def test_a_setting_is_parsed_and_checked_against_its_module():
    setting = ab.parse_setting("mok_plugin.kernels.configs.SPREAD_MIN_BLOCK_N = 128")
    assert (setting.module, setting.attr, setting.value) == ("mok_plugin.kernels.configs", "SPREAD_MIN_BLOCK_N", 128)
    assert ab.parse_setting("mok_plugin.kernels.configs.FEW_ROWS_MAX=None").value is None
    assert str(ab.parse_setting("mok_plugin.kernels.configs.HOPPER_WGRAD_MIN_WIDTH=0")).endswith("=0")


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param("SPREAD_MIN_BLOCK_N=128", "expected package.module.ATTR=VALUE", id="no_module"),
        pytest.param("mok_plugin.kernels.configs.SPREAD_MIN_BLOCK_N", "expected", id="no_value"),
        pytest.param("mok_plugin.no_such_module.X=1", "does not import", id="bad_module"),
        pytest.param("mok_plugin.kernels.configs.SPREAD_MIN_BLOK_N=128", "has no attribute", id="typo"),
        pytest.param("mok_plugin.kernels.configs.SPREAD_MIN_BLOCK_N=on", "not a Python literal", id="not_literal"),
    ],
)
def test_a_bad_setting_is_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        ab.parse_setting(text)


def test_b_side_is_undone_on_leaving_it_errors_included():
    settings = [ab.parse_setting("mok_plugin.kernels.configs.SPREAD_MIN_BLOCK_N=128")]
    # (the interpreter's configs keep the table's sweep flag: what this override changes)
    override = {"wgrad_sweep": configs.MoKTileConfig(128, 256, 64, 8, 4, tma=True, sweep=False)}
    before = configs.SPREAD_MIN_BLOCK_N
    assert kernel_config("wgrad_sweep", 1).sweep
    with pytest.raises(RuntimeError), ab.changed(settings, override):
        assert configs.SPREAD_MIN_BLOCK_N == 128
        assert not kernel_config("wgrad_sweep", 1).sweep
        raise RuntimeError("a failing timing")
    assert configs.SPREAD_MIN_BLOCK_N == before
    assert kernel_config("wgrad_sweep", 1).sweep


def test_rounds_alternate_profiles_are_settled_and_averaged_and_bits_compare_b_with_a():
    state = {"b": False}
    calls = []

    b_side = flag_side(state)

    def work():
        # B changes the second result only
        return [torch.ones(3), torch.full((2,), 2.0 if state["b"] else 1.0)]

    def timer(fn, iters, settle_s):
        calls.append(("B" if state["b"] else "A", settle_s))
        return [20.0 if state["b"] else 10.0] * iters

    profiles = iter([1.0, 5.0, 7.0, 6.0, 4.0, 8.0, 3.0, 2.0, 9.0])  # warm-up, then A B B A B A A B

    profile_settles = []

    def profiler(fn, iters, settle_s):
        profile_settles.append((settle_s, "B" if state["b"] else "A"))
        ms = next(profiles)
        return [{"kernel": "k", "ms": ms, "launches": 1}, {"kernel": "j", "ms": 1.0, "launches": 1}], {}

    result = ab.run_ab(work, b_side, rounds=3, iters=4, settle_s=1.0, timer=timer, profiler=profiler)
    # first an untimed settle from idle (A's code: nothing is compared), then the rounds
    assert [side for side, _ in calls] == ["A", "A", "B", "B", "A", "A", "B"]
    assert [s for _, s in calls] == [1.0, 1.0, 1.0, ab.LATER_SETTLE_S, ab.LATER_SETTLE_S, ab.LATER_SETTLE_S,
                                     ab.LATER_SETTLE_S]  # fmt: skip
    assert result["a_ms"] == [10.0] * 3 and result["b_ms"] == [20.0] * 3
    # each profile settled as the first round (it follows a pause); the warm-up as the last round's side
    assert profile_settles == [(1.0, side) for side in "BABBABAAB"]
    # A B B A B A A B: each side's mean cancels a linear or quadratic drift
    assert result["a_kernels"] == {"k": 3.5, "j": 1.0} and result["b_kernels"] == {"k": 7.5, "j": 1.0}
    assert [(p["side"], p["ms"], p["clock"]) for p in result["profiles"]] == [("warm-up", 2.0, None),
        ("A", 6.0, None), ("B", 8.0, None), ("B", 7.0, None), ("A", 5.0, None),
        ("B", 9.0, None), ("A", 4.0, None), ("A", 3.0, None), ("B", 10.0, None)]  # fmt: skip
    assert result["bitwise"] == [True, False]
    report = ab.format_report("tiny", "uniform", "X=1", result, ["output", "d_x"])
    assert "B/A 2.000" in report and "B differs on d_x" in report
    assert "the mean SM clock: warm-up 2.000, A 6.000, B 8.000, B 7.000," in report  # the warm-up counts for neither


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["--shape", "tiny"], "nothing to compare", id="no_change"),
        pytest.param(["--shape", "tiny", "--override", "no_such_kernel=128x128x64w8s3"], "unknown kernel", id="kernel"),
        pytest.param(["--shape", "tiny", "--set", "mok_plugin.kernels.configs.NOPE=1"], "has no attribute", id="attr"),
        pytest.param(
            ["--shape", "7,8", "--set", "mok_plugin.kernels.configs.FEW_ROWS_MAX=1"], "expected one of", id="shape"
        ),
        pytest.param(
            ["--shape", "tiny", "--expert", "linear", "--set", "mok_plugin.kernels.configs.FEW_ROWS_MAX=1"],
            "needs I = H",
            id="linear_not_square",
        ),
    ],
)
def test_bad_arguments_fail_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert ab.main(["--shape", "tiny", "--set", "mok_plugin.kernels.configs.FEW_ROWS_MAX=1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_ab_tags_its_rounds_and_profiles_by_side_and_reports_the_clocks():
    state = {"b": False}
    tags = []

    class StubClock:
        @contextlib.contextmanager
        def side(self, label):
            assert state["b"] == (ab.side_of(label) == "B")  # tagged inside B's change, not around it
            tags.append(label)
            yield

        def summary(self, group=None):
            per_label = {"A": (1755.0, 612.0), "B": (1650.0, 700.0), "A profile 1": (1500.0, 690.0)}
            later = list(enumerate("ABBABAAB", start=1))[1:]
            per_label |= {f"{letter} profile {n}": (1400.0 + n, 700.0) for n, letter in later}
            merged = {}
            for label, (mhz, watts) in per_label.items():
                merged.setdefault(group(label) if group else label, []).append((mhz, watts))
            return {label: {"sm_mhz": sum(m for m, _ in r) / len(r), "watts": sum(w for _, w in r) / len(r),
                            "samples": len(r)} for label, r in merged.items()}  # fmt: skip

    b_side = flag_side(state)

    result = ab.run_ab(
        lambda: [torch.ones(2)], b_side, rounds=2, iters=2, settle_s=0.0,
        timer=lambda fn, iters, settle_s: [1.0] * iters,
        profiler=lambda fn, iters, settle_s: ([{"kernel": "k", "ms": 1.0, "launches": 1}], {}), clock=StubClock(),
    )  # fmt: skip
    # two rounds, then the profiles, each under its own label; no compile pass, no settle from idle
    profiles = [f"{letter} profile {n}" for n, letter in enumerate("ABBABAAB", start=1)]
    assert tags == ["A", "B", "B", "A", "warm-up"] + profiles
    assert result["profiles"][1]["clock"]["sm_mhz"] == 1500.0  # each profile's own clock
    assert result["profiles"][8]["clock"]["sm_mhz"] == 1408.0 and result["profiles"][0]["clock"] is None
    assert result["clocks"]["A"]["samples"] == 5  # a side's rounds and profiles together
    report = ab.format_report("tiny", "uniform", "X=1", result, ["output"])
    assert "A 1.000 @ 1500 MHz, B 1.000 @ 1402 MHz" in report
    a, b = result["clocks"]["A"], result["clocks"]["B"]
    assert f"A {a['sm_mhz']:.0f} MHz {a['watts']:.0f} W (5 samples), B {b['sm_mhz']:.0f} MHz" in report
    assert "SM clock and power" not in ab.format_report("tiny", "uniform", "X=1", dict(result, clocks={}), ["output"])


def test_host_issue_time_per_side_where_asked():
    # With a host timer (eager calls), each side's median host time to issue a call, measured under
    # that side after the rounds, and a report line; without one (graph replays), neither.
    state = {"b": False}
    sides = []

    def host_timer(fn, iters):
        sides.append(("B" if state["b"] else "A", iters))
        return [3.0, 1.0, 2.0] if state["b"] else [0.5, 0.4, 0.6]

    common = dict(rounds=1, iters=3, settle_s=0.0, timer=lambda fn, iters, settle_s: [1.0] * iters, profile=False)
    result = ab.run_ab(lambda: [torch.ones(2)], flag_side(state), host_timer=host_timer, **common)
    assert sides == [("A", 3), ("B", 3)]
    assert result["a_host_ms"] == 0.5 and result["b_host_ms"] == 2.0
    assert "host time to issue a call (GPU kept busy ahead): A 0.500 ms, B 2.000 ms" in ab.format_report(
        "tiny", "uniform", "X=1", result, ["output"]
    )
    plain = ab.run_ab(lambda: [torch.ones(2)], flag_side(state), **common)
    assert "a_host_ms" not in plain and "host time" not in ab.format_report("tiny", "uniform", "X=1", plain, ["output"])
