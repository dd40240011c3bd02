"""The README's main job (scripts/demo.py on configs/small.yaml) runs, finds the two runs bitwise
equal and writes its JSON; bench_layer.py refuses to run without a GPU with a clear message."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_main_job(tmp_path):
    out = tmp_path / "demo.json"
    run = subprocess.run(
        [sys.executable, "scripts/demo.py", "--config", "configs/small.yaml", "--tokens", "64", "--iters", "2",
         "--device", "cpu", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "bitwise equal" in run.stdout
    result = json.loads(out.read_text())
    assert result["bitwise"] is True and result["mismatched"] == []
    assert [row["pass"] for row in result["rows"]] == ["forward", "backward*", "fwd+bwd"]
    assert all(row["ms"] > 0 for row in result["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_bench_layer_needs_a_gpu():
    run = subprocess.run([sys.executable, "scripts/bench_layer.py", "--shapes", "tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
