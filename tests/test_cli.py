"""The `mok` console command (mok_plugin.cli, registered in setup.cfg): `mok --help` lists every
subcommand; each subcommand's --help reaches its own module's parser (compare, plan, patch, and
bench layer|tune|inspect|ep|multi-gpu); the rest of the command line goes to that module's main
unchanged; the modules are imported only when their subcommand runs; bad commands exit 2."""

import configparser
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mok_plugin import cli

ROOT = Path(__file__).resolve().parents[1]


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_mok_help_lists_every_command(capsys):
    out = _help(capsys, ["--help"])
    assert out.startswith("usage: mok ")
    for command in ("compare", "plan", "bench", "patch"):
        assert command in out
    out = _help(capsys, ["bench", "--help"])
    for benchmark in ("layer", "ab", "tune", "inspect", "ep", "multi-gpu", "fp8", "host", "wgrad-rows"):
        assert benchmark in out


@pytest.mark.parametrize(
    "argv, usage, option",
    [
        pytest.param(["bench", "layer"], "usage: mok bench layer", "--override", id="bench_layer"),
        pytest.param(["bench", "ab"], "usage: mok bench ab", "--set", id="bench_ab"),
        pytest.param(["bench", "tune"], "usage: mok bench tune", "--candidates", id="bench_tune"),
        pytest.param(["bench", "inspect"], "usage: mok bench inspect", "--dump", id="bench_inspect"),
        pytest.param(["bench", "ep"], "usage: mok bench ep", "--tokens-per-rank", id="bench_ep"),
        pytest.param(["bench", "multi-gpu"], "usage: mok bench multi-gpu", "--job-timeout-s", id="bench_multi_gpu"),
        pytest.param(["bench", "fp8"], "usage: mok bench fp8", "--recipe", id="bench_fp8"),
        pytest.param(["bench", "host"], "usage: mok bench host", "--tokens", id="bench_host"),
        pytest.param(["bench", "rows"], "usage: mok bench rows", "--variant", id="bench_rows"),
        pytest.param(["bench", "wgrad-rows"], "usage: mok bench wgrad-rows", "--rows", id="bench_wgrad_rows"),
        pytest.param(["bench", "bound"], "usage: mok bench bound", "--class-grid", id="bench_bound"),
        pytest.param(["patch"], "usage: mok patch", "--target", id="patch"),
    ],
)
def test_subcommand_help_reaches_its_parser(capsys, argv, usage, option):
    out = _help(capsys, [*argv, "--help"])
    assert out.startswith(usage) and option in out


class _Recorder(types.ModuleType):
    """A stand-in module whose main records the argv it gets (and takes no prog, like a plain main)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: list[list[str]] = []

    def main(self, argv):
        self.calls.append(argv)
        return 7


@pytest.mark.parametrize(
    "command, module",
    [("compare", "mok_plugin.compare.cli"), ("plan", "mok_plugin.run.plan")],
)
def test_compare_and_plan_hand_their_arguments_on(monkeypatch, command, module):
    # Monkeypatched: the test checks the dispatch, whatever state the other engineers' modules are in.
    fake = _Recorder(module)
    monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main([command, "--config", "x.yaml", "--help"]) == 7
    assert fake.calls == [["--config", "x.yaml", "--help"]]


@pytest.mark.parametrize(
    "argv, option",
    [(["compare", "--help"], "--framework"), (["plan", "--help"], "--efficiency")],
    ids=["compare", "plan"],
)
def test_compare_and_plan_help_reach_their_parsers(capsys, argv, option):
    pytest.importorskip(cli.COMMANDS[argv[0]][0], reason="that module is not written yet")
    assert option in _help(capsys, argv)


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["bench"], ["bench", "nonsense"]], ids=repr)
def test_bad_commands_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "usage: mok" in capsys.readouterr().err


def test_mok_help_imports_no_command_module():
    # Lazy: the subcommands' modules (and the kernels, frameworks behind them) load only when used.
    code = (
        "import sys, contextlib, io\n"
        "from mok_plugin import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--help'])\n"
        "loaded = [m for m in sys.modules if m == 'mok_plugin.run.plan' or m.startswith(('mok_plugin.bench', "
        "'mok_plugin.compare', 'mok_plugin.patching', 'megatron', 'deepspeed'))]\n"
        "print(loaded)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]


def test_console_script_is_registered():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["options.entry_points"]["console_scripts"].split() == ["mok", "=", "mok_plugin.cli:main"]


def test_bench_fp8_hopper_settings_are_the_tables_labels(capsys):
    # `--hopper-settings` takes the labels of `--hopper`'s table (quoted) and refuses any other by name
    from mok_plugin.bench import fp8

    parser = fp8.build_parser()
    labels = list(fp8._hopper_settings())
    assert parser.parse_args(["--hopper", "--hopper-settings", labels[-1]]).hopper_settings == [labels[-1]]
    with pytest.raises(SystemExit):
        parser.parse_args(["--hopper", "--hopper-settings", "ahead"])
    assert "invalid choice: 'ahead'" in capsys.readouterr().err


@pytest.fixture
def cuda_stood_in(monkeypatch):
    """`mok bench fp8` past its GPU check on this CPU (its timing is stood in for by each test)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_bench_fp8_skips_a_shape_that_does_not_fit_and_times_the_rest(monkeypatch, tmp_path, capsys, cuda_stood_in):
    # the shape that runs out of the GPU's memory is named and skipped, the others are reported, and
    # the exit status says one was left out (no GPU here: the timing itself is stood in for)
    from mok_plugin.bench import fp8

    def bench_shape(name, recipe, iters, settle_s):
        if name == "deepseek-v3":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB. GPU 0 has ...")
        timings = dict.fromkeys(["bf16 forward", "fp8 forward", "bf16 fwd+bwd", "fp8 fwd+bwd"], 2.0)
        return {"shape": name, **timings, "fp8 fwd+bwd, weights kept": 1.5, "bitwise": True, "fp8 kernels": [],
                "relative difference from bf16": {"d_x": 0.01}, "fp8 TFLOP/s": {"layer, weights kept": 900.0},
                "dense GEMM TFLOP/s": {"bf16": 650.0, "fp8 blockwise": None, "fp8 per tensor": 1300.0}}  # fmt: skip

    monkeypatch.setattr(fp8, "_bench_shape", bench_shape)
    status = fp8.main(["--shapes", "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 1
    assert "deepseek-v3: skipped, it does not fit this GPU's memory (CUDA out of memory)" in out
    assert "not timed (out of the GPU's memory): deepseek-v3" in out
    saved = json.loads((tmp_path / "bench_fp8.json").read_text())
    assert [row["shape"] for row in saved["rows"]] == ["mixtral-8x7b", "qwen3-30b-a3b"]
    assert saved["out_of_memory"] == ["deepseek-v3"]
    assert sum(line.startswith(("mixtral-8x7b ", "qwen3-30b-a3b ")) for line in out.splitlines()) == 2
    # no blockwise FP8 GEMM measured (None): the rate without a share, the ceiling named as not measured
    assert "layer, weights kept 900; dense 8192^3: bf16 650, fp8 blockwise not measured, fp8 per tensor 1300" in out


def test_bench_fp8_keeps_the_timings_of_a_shape_whose_checks_do_not_fit(monkeypatch, tmp_path, capsys, cuda_stood_in):
    # deepseek-v3 on an 80 GB H100 (session 41): timed, then out of memory in a check after the timings;
    # the timings are reported, each check that did not fit is named, the others are measured
    from mok_plugin.bench import fp8
    from mok_plugin.testing import parse_shape

    torch.manual_seed(0)
    names = ("out", *fp8.GRADIENTS)
    bf16_tensors = [torch.randn(8, 4) for _ in names]
    fp8_tensors = {name: t + 0.01 * torch.randn_like(t) for name, t in zip(names, bf16_tensors, strict=True)}

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB.")

    fp8_case = (parse_shape("qwen3-30b-a3b"), {}, None, (), lambda weight_copies=None: dict(fp8_tensors))
    monkeypatch.setattr(fp8, "_fp8_case", lambda name, recipe: fp8_case)
    monkeypatch.setitem(fp8.PROVIDERS, "mok-multi", lambda inputs, shape: None)
    monkeypatch.setattr(fp8, "leaves", lambda inputs: [])
    monkeypatch.setattr(fp8, "time_ms", lambda work, iters, settle_s: [2.0])
    monkeypatch.setattr(fp8, "fwd_bwd", lambda provider, inputs: bf16_tensors)
    monkeypatch.setattr(fp8, "kernel_breakdown", out_of_memory)
    monkeypatch.setattr(fp8, "float64_errors", out_of_memory)
    ceilings = {"bf16": 650.0, "fp8 blockwise": 1200.0, "fp8 per tensor": 1300.0}
    monkeypatch.setattr(fp8, "_dense_ceilings", lambda settle_s: ceilings)
    status = fp8.main(["--shapes", "qwen3-30b-a3b", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 1
    (row,) = json.loads((tmp_path / "bench_fp8.json").read_text())["rows"]
    assert row["fp8 fwd+bwd, weights kept"] == 2.0 and row["bitwise"] is True
    assert row["not measured (out of memory)"] == ["fp8 kernels, weights kept", "fp8 kernels", "error against float64"]
    want = {name: (fp8_tensors[name] - t).norm() / t.norm() for name, t in zip(names, bf16_tensors, strict=True)}
    assert row["relative difference from bf16"] == pytest.approx({k: v.item() for k, v in want.items()})
    assert "qwen3-30b-a3b: fp8 kernels not measured, out of the GPU's memory (CUDA out of memory)" in out
    # 18 T K H I FLOPs in the 2 ms stood in for; no kernel profile, so no rates of the GEMMs
    layer = 18 * 16384 * 8 * 2048 * 768 / 2.0 / 1e9
    assert row["fp8 TFLOP/s"] == pytest.approx({"layer, weights kept": layer})
    assert f"layer, weights kept {layer:.0f} ({layer / 1200:.0%}); dense 8192^3: bf16 650, fp8 blockwise 1200" in out
    checks = "fp8 kernels, weights kept, fp8 kernels, error against float64"
    assert f"not measured (out of the GPU's memory): {checks}" in out
    assert f"timed, but not every check fitted the GPU's memory: qwen3-30b-a3b ({checks})" in out


def test_bench_fp8_hopper_and_sweep_skip_a_shape_that_does_not_fit(monkeypatch, tmp_path, capsys, cuda_stood_in):
    from mok_plugin.bench import fp8

    def shape_rows(name, *args):
        if name == "deepseek-v3":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB.")
        return [{"shape": name, "setting": "both", "fwd+bwd ms": 2.0, "wgrad ms": 1.0, "rows ms": 0.5,
                 "same_bits": True}]  # fmt: skip

    monkeypatch.setattr(fp8, "_hopper_shape", shape_rows)
    monkeypatch.setattr(fp8, "_sweep_shape", shape_rows)
    for mode, saved_as in ((["--hopper"], "bench_fp8_hopper.json"), (["--sweep"], "bench_fp8_sweep.json")):
        status = fp8.main([*mode, "--shapes", "deepseek-v3", "qwen3-30b-a3b", "--out", str(tmp_path)])
        out = capsys.readouterr().out
        assert status == 1, mode
        assert "deepseek-v3: skipped, it does not fit this GPU's memory" in out
        assert "not timed (out of the GPU's memory): deepseek-v3" in out
        assert [row["shape"] for row in json.loads((tmp_path / saved_as).read_text())] == ["qwen3-30b-a3b"]


def test_bench_fp8_rates_of_the_row_gemms_and_weight_gradients():
    # two thirds of a SwiGLU layer's fwd+bwd FLOPs in the four row GEMMs, a third in the weight gradients;
    # the other kernels (the weights' quantisation here) count in neither
    from mok_plugin.bench import fp8
    from mok_plugin.testing import parse_shape

    shape = parse_shape("mixtral-8x7b")
    times = {"_fp8_rows_hopper_kernel": 12.0, "_fp8_wgrad_hopper_kernel": 6.0, "_fp8_gate_up_fwd_kernel": 1.0,
             "_quantize_tiles_kernel": 3.0}  # fmt: skip
    kernels = [{"kernel": name, "ms": ms} for name, ms in times.items()]
    rates = fp8._fp8_rates(shape, {"fp8 fwd+bwd, weights kept": 24.0, "fp8 kernels, weights kept": kernels})
    tkhi = 8192 * 2 * 4096 * 14336
    assert rates == pytest.approx({"layer, weights kept": 18 * tkhi / 24.0 / 1e9, "row GEMMs": 12 * tkhi / 13.0 / 1e9,
                                   "weight gradients": 6 * tkhi / 6.0 / 1e9})  # fmt: skip
