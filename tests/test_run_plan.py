"""The plan command (mok_plugin.run.plan, behind `mok plan` and scripts/plan.py): it prints a plan
with the expert MLP and every rate's source and exits by fit (0 fits, 1 does not), and refuses bad input cleanly: a bad
--efficiency, and every way a config file can fail, as one `error:` line with exit status 2 and no
traceback."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mok_plugin.run import plan

ROOT = Path(__file__).resolve().parents[1]


def test_plan_script_prints_and_exits_by_fit(tmp_path):
    run = subprocess.run([sys.executable, "scripts/plan.py", "configs/topologies/kimi-k2_gb300-nvl72_ep64.yaml",
                          "--json", str(tmp_path / "plan.json")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "-> fits" in run.stdout and "over NVLink at 900 GB/s" in run.stdout and "source:" in run.stdout
    data = yaml.safe_load((ROOT / "configs" / "topologies" / "deepseek-v3_gb300-nvl72_ep64.yaml").read_text())
    data["parallel"].update(ep=72, dp=72, redundant_experts=0)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    run = subprocess.run([sys.executable, "scripts/plan.py", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "does not divide" in run.stderr


def test_plan_states_the_expert_family(tmp_path, capsys):
    config = ROOT / "configs" / "topologies" / "gpt-oss-120b_gb200-nvl72_ep16.yaml"
    assert plan.main([str(config), "--json", str(tmp_path / "plan.json")]) == 0
    # 5760 x 2880 + 2880 x 2880 + 5760 + 2880 = 24,891,840 parameters; 3 x 2880^2 = 24,883,200 MACs per row.
    assert (
        "experts  glu(quick_gelu, clamp 7.0, offset 1.0) + fc1 and fc2 bias: 24.89 M parameters each, first linear "
        "5760 rows, 24.88 M multiply-adds per row" in capsys.readouterr().out
    )
    family = yaml.safe_load((tmp_path / "plan.json").read_text())["expert_family"]
    assert family["expert_activation"] == "quick_gelu" and family["activation_clamp"] == 7.0


def test_plan_runs_as_a_module():
    run = subprocess.run([sys.executable, "-m", "mok_plugin.run.plan", "configs/topologies/tiny_cpu.yaml"],
                         cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0 and "-> fits" in run.stdout, run.stderr


def test_plan_exits_1_when_the_estimate_does_not_fit(monkeypatch, capsys):
    # load_topology refuses a layout that does not fit, so shrink the budget after loading.
    estimate = plan.memory_per_gpu
    monkeypatch.setattr(plan, "memory_per_gpu", lambda run: dataclasses.replace(estimate(run), budget_gib=0.0))
    assert plan.main([str(ROOT / "configs" / "topologies" / "tiny_cpu.yaml")]) == 1
    assert "-> DOES NOT FIT" in capsys.readouterr().out


def test_plan_cites_public_sources_not_project_files(capsys):
    assert plan.main([str(ROOT / "configs" / "topologies" / "deepseek-v3_gb200-nvl72_ep64.yaml")]) == 0
    out = capsys.readouterr().out
    assert "https://www.nvidia.com/en-us/data-center/gb200-nvl72/" in out and "shared/reference" not in out


@pytest.mark.parametrize("value", ["0", "-0.5", "nan", "inf", "1.5", "fast"])
def test_plan_efficiency_must_be_a_fraction(value, capsys):
    with pytest.raises(SystemExit) as info:
        plan.main(["configs/topologies/tiny_cpu.yaml", "--efficiency", value])
    assert info.value.code == 2 and "--efficiency" in capsys.readouterr().err


def test_plan_file_errors_are_one_line_without_traceback(tmp_path, capsys):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe")
    broken = tmp_path / "broken.yaml"
    broken.write_text("machine: [\n")
    for path, problem in ((tmp_path / "missing.yaml", "no such file"), (tmp_path, "is a directory"),
                          (binary, "not UTF-8 text"), (broken, "not valid YAML")):  # fmt: skip
        assert plan.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {problem}"), err
    run = subprocess.run([sys.executable, "scripts/plan.py", str(binary)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "binary.yaml: not UTF-8" in run.stderr
