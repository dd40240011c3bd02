"""`mok bench ab` (mok_plugin/bench/ab.py) on the CPU: its settings are checked against the modules
before any GPU work, B's changes are undone whatever happens, the rounds alternate, each kernel's time
is the mean of its side's two settled profiles, the clock log tags the rounds and profiles (not the compile
passes) by side, and the bitwise verdict is B's results against A's."""

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

    profiles = iter([5.0, 7.0, 6.0, 4.0])  # A, B, B, A

    profile_settles = []

    def profiler(fn, iters, settle_s):
        profile_settles.append(settle_s)
        ms = next(profiles)
        return [{"kernel": "k", "ms": ms, "launches": 1}], {}

    result = ab.run_ab(work, b_side, rounds=3, iters=4, settle_s=1.0, timer=timer, profiler=profiler)
    assert [side for side, _ in calls] == ["A", "B", "B", "A", "A", "B"]
    assert [s for _, s in calls] == [1.0, 1.0, ab.LATER_SETTLE_S, ab.LATER_SETTLE_S, ab.LATER_SETTLE_S,
                                     ab.LATER_SETTLE_S]  # fmt: skip
    assert result["a_ms"] == [10.0] * 3 and result["b_ms"] == [20.0] * 3
    assert profile_settles == [1.0] * 4  # each profile settled as the first round (it follows a pause)
    assert result["a_kernels"] == {"k": 4.5} and result["b_kernels"] == {"k": 6.5}  # A B B A: the mean cancels drift
    assert result["bitwise"] == [True, False]
    report = ab.format_report("tiny", "uniform", "X=1", result, ["output", "d_x"])
    assert "B/A 2.000" in report and "B differs on d_x" in report


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
            assert state["b"] == (label == "B")  # tagged inside B's change, not around it
            tags.append(label)
            yield

        def summary(self):
            return {"A": {"sm_mhz": 1755.0, "watts": 612.0, "samples": 9},
                    "B": {"sm_mhz": 1650.0, "watts": 700.0, "samples": 8}}  # fmt: skip

    b_side = flag_side(state)

    result = ab.run_ab(
        lambda: [torch.ones(2)], b_side, rounds=2, iters=2, settle_s=0.0,
        timer=lambda fn, iters, settle_s: [1.0] * iters,
        profiler=lambda fn, iters, settle_s: ([{"kernel": "k", "ms": 1.0, "launches": 1}], {}), clock=StubClock(),
    )  # fmt: skip
    assert tags == ["A", "B", "B", "A", "A", "B", "B", "A"]  # two rounds, then the profiles; no compile pass
    assert result["clocks"]["B"]["sm_mhz"] == 1650.0
    report = ab.format_report("tiny", "uniform", "X=1", result, ["output"])
    assert "A 1755 MHz 612 W (9 samples), B 1650 MHz 700 W (8 samples)" in report
    assert "SM clock" not in ab.format_report("tiny", "uniform", "X=1", dict(result, clocks={}), ["output"])
