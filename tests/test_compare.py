"""scripts/compare.py end to end on the tiny CPU config, through Megatron's and DeepSpeed's MoE
layers: its JSON holds every field the report promises, the Markdown and the plot are written, and
MoK's two runs are bitwise equal; configs for other machines are refused on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("framework", ["megatron", "deepspeed"])
def test_compare_tiny_config(tmp_path, framework):
    pytest.importorskip({"megatron": "megatron.core", "deepspeed": "deepspeed"}[framework])
    run = subprocess.run(
        [sys.executable, "scripts/compare.py", "--config", "configs/topologies/tiny_cpu.yaml", "--framework",
         framework, "--steps", "4", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MoK / stock tokens/s" in run.stdout and "comparison.md" in run.stdout
    result = json.loads((tmp_path / "comparison.json").read_text())
    assert [(r["variant"], r["repeat"]) for r in result["runs"]] == [("stock", 1), ("stock", 2), ("mok", 1), ("mok", 2)]
    for r in result["runs"]:
        assert len(r["losses"]) == 4 and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0
    assert result["bitwise"] == {"stock": True, "mok": True}  # on the CPU both paths repeat exactly
    stock, mok = result["summary"]["stock"], result["summary"]["mok"]
    assert set(stock) == {"step_ms", "tokens_per_s", "peak_memory_mib", "final_loss"}
    # Same weights and tokens, no drop, no noise: the two layers train the same model.
    assert abs(stock["final_loss"] - mok["final_loss"]) < 1e-3
    assert "CPU" in result["meta"]["mode"] and result["meta"]["framework"] == framework
    assert (tmp_path / "comparison.md").read_text().startswith("# MoK vs stock")
    assert (tmp_path / "comparison.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_refuses_gpu_configs_on_the_cpu(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/compare.py", "--config", "configs/topologies/kimi-k2_gb300-nvl72_ep64.yaml",
         "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2 and "targets gb300-nvl72" in run.stderr
