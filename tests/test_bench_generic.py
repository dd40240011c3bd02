"""`mok bench generic` (mok_plugin/bench/generic.py) on the CPU at tiny shapes: stock DeepSpeed MoE
against the MoK option with the same weights, for a residual block (MoK's generic path) and a GeLU
MLP with biases (a fused family); both pass the check, the table prints last and the JSON holds every
pass of both layers (no timing asserts). A case that disagrees is reported and never timed. The
command is wired into `mok bench` and scripts/bench_generic.py."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from mok_plugin import cli  # noqa: E402
from mok_plugin.bench import generic  # noqa: E402

pytestmark = pytest.mark.deepspeed
ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--cpu", "--iters", "2", "--warmup", "1", "--shape", "48,16,24,4,2", "--shape", "48,16,24,8,2"]


@pytest.mark.slow  # about 30 s on 2 cores: a DeepSpeed world and three expert kinds on two shapes
def test_cpu_run_prints_the_table_last_and_writes_json(tmp_path, capsys):
    assert generic.main([*ARGS, "--expert", "residual", "gelu-mlp", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("expert "))
    assert lines[header - 1].startswith("cpu, float32")
    for column in ("stock ms", "MoK ms", "stock/MoK", "stock MiB", "MoK MiB"):
        assert column in lines[header]
    table = lines[header + 1 :]
    assert len(table) == 2 * 2 * 3  # shapes x experts x passes, nothing after the table
    for line in table:
        assert line.split()[0] in ("residual", "gelu-mlp") and "WRONG" not in line
        assert line.split()[-3].endswith("x") and line.split()[-2:] == ["-", "-"]  # no peak MiB on the CPU
    assert sum("generic path" in line for line in table) == 6
    assert sum("mlp(gelu) + fc1 and fc2 bias" in line for line in table) == 6

    report = json.loads((tmp_path / "bench_generic.json").read_text())
    assert report["meta"]["device"] == "cpu" and report["meta"]["dtype"] == "float32"
    assert "drop_tokens=False" in report["meta"]["layers"]
    rows = report["rows"]
    assert [(r["expert"], r["dims"][3]) for r in rows] == [
        ("residual", 4), ("gelu-mlp", 4), ("residual", 8), ("gelu-mlp", 8),
    ]  # fmt: skip
    for row in rows:
        assert row["error"] is None and row["rerouted_tokens"] == 0
        for side in ("stock", "mok"):
            assert all(row[side][p]["ms"] > 0 for p in generic.PASSES)
        assert set(row["stock/mok"]) == set(generic.PASSES)
    residual, gelu = rows[0], rows[1]
    assert residual["computes"] == "generic path" and "parameters outside linear layers" in residual["why_generic"]
    assert gelu["computes"] == "mlp(gelu) + fc1 and fc2 bias" and gelu["why_generic"] is None


def test_a_case_that_disagrees_is_reported_and_not_timed(monkeypatch, capsys):
    build = generic.build_layers

    def off_by_a_little(*args, **kwargs):
        stock, mok, computes, why = build(*args, **kwargs)
        with generic.torch.no_grad():
            mok.mok.experts.local_experts[0].fc2.bias.add_(0.5)
        return stock, mok, computes, why

    def no_timing(*args, **kwargs):
        raise AssertionError("a case that disagrees was timed")

    monkeypatch.setattr(generic, "build_layers", off_by_a_little)
    monkeypatch.setattr(generic, "_time", no_timing)
    assert generic.main([*ARGS[:-2], "--expert", "residual"]) == 1
    out = capsys.readouterr().out
    assert "WRONG: output (torch.float32)" in out.strip().splitlines()[-1]


def test_wired_into_mok_bench_and_scripts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "generic", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mok bench generic") and "--expert" in out and "--cpu" in out
    source = (ROOT / "scripts" / "bench_generic.py").read_text()
    imports = [node for node in ast.parse(source).body if isinstance(node, ast.ImportFrom | ast.Import)]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [("mok_plugin.bench.generic", ["main"])]
    run = subprocess.run([sys.executable, "scripts/bench_generic.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
