"""The Megatron launch paths on the CPU: the --mok* flags (parsed by Megatron's own parser), the
launcher running an unmodified Megatron script, the determinism report, and the source patch
(applied to a copy of the installed megatron-core, a layer built through `--moe-token-dispatcher-type
mok`, then reverted)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import launcher  # noqa: E402
from mok_plugin.megatron.layer import _DEFAULT_OVERRIDES  # noqa: E402

pytestmark = pytest.mark.megatron
ROOT = Path(__file__).resolve().parents[1]
MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--ffn-hidden-size", "64",
              "--swiglu", "--disable-bias-linear", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--transformer-impl", "local",
              "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--moe-layer-freq", "[0,1]",
              "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion",
              "--no-persist-layer-norm", "--moe-router-load-balancing-type", "none"]  # fmt: skip


def _parse(argv):
    from megatron.training.arguments import parse_args

    old = sys.argv
    sys.argv = ["pretrain", *argv]
    try:
        return parse_args(launcher.add_mok_args)
    finally:
        sys.argv = old


def test_flags_parse_and_set_the_spec_and_knobs(tmp_path):
    knobs = tmp_path / "mok.yaml"
    knobs.write_text("mok:\n  kernel_variant: megakernel\n  ep_exchange: capacity\n  ep_capacity_factor: 3.0\n")
    args = _parse(["--mok", "--mok-config", str(knobs), "--mok-backend", "reference", "--mok-deterministic",
                   *MODEL_ARGS])  # fmt: skip
    assert launcher.apply_mok_args(args) == {"kernel_variant": "megakernel", "ep_exchange": "capacity",
                                             "ep_capacity_factor": 3.0, "backend": "reference",
                                             "deterministic": True}  # fmt: skip
    assert args.spec == ["mok_plugin.megatron", "moe_block_spec"]
    assert _DEFAULT_OVERRIDES["backend"] == "reference"
    report = launcher.determinism_report(args)
    assert any("--deterministic-mode" in line for line in report)


def test_flag_errors(tmp_path):
    with pytest.raises(MoKConfigError, match="--mok-backend given without --mok"):
        launcher.apply_mok_args(_parse(["--mok-backend", "triton", *MODEL_ARGS]))
    with pytest.raises(MoKConfigError, match="cannot be combined with --spec"):
        launcher.apply_mok_args(_parse(["--mok", "--spec", "my.module", "my_spec", *MODEL_ARGS]))
    bad = tmp_path / "bad.yaml"
    bad.write_text("kernel_varient: megakernel\n")
    with pytest.raises(MoKConfigError, match="unknown MoK fields \\['kernel_varient'\\]"):
        launcher.apply_mok_args(_parse(["--mok", "--mok-config", str(bad), *MODEL_ARGS]))
    with pytest.raises(SystemExit):  # argparse: a backend that does not exist
        _parse(["--mok", "--mok-backend", "cuda", *MODEL_ARGS])


def _run_entry(command, env=None):
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("MLPS="))
    return json.loads(line[len("MLPS=") :]), run.stdout


def test_launcher_runs_an_unmodified_megatron_script():
    script = "tests/data/stock_entry.py"
    stock, _ = _run_entry([sys.executable, script, *MODEL_ARGS])
    assert set(stock.values()) == {"MLP", "MoELayer"}
    mok, out = _run_entry([sys.executable, "-m", "mok_plugin.megatron.launcher", script, "--mok",
                           "--mok-deterministic", *MODEL_ARGS])  # fmt: skip
    assert {k: v.replace("MoKMoELayer", "MoELayer") for k, v in mok.items()} == stock
    assert sum(v == "MoKMoELayer" for v in mok.values()) == 2  # decoder layer 2 and the MTP layer
    assert "MoK determinism report" in out


def test_source_patch_on_a_copy_of_the_installed_package(tmp_path):
    import megatron.core

    shutil.copytree(Path(megatron.core.__file__).parents[1], tmp_path / "megatron")
    patches = [sys.executable, "scripts/patches.py"]
    check = subprocess.run([*patches, "check", "megatron", "--target", str(tmp_path)], cwd=ROOT)
    assert check.returncode == 1  # not applied yet
    for _ in range(2):  # idempotent
        assert subprocess.run([*patches, "apply", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 0
    assert subprocess.run([*patches, "check", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    args = [a for a in MODEL_ARGS if a != "--use-cpu-initialization"] + ["--use-cpu-initialization"]
    mlps, _ = _run_entry([sys.executable, "tests/data/stock_entry.py", "--moe-token-dispatcher-type", "mok", *args],
                         env=env)  # fmt: skip
    assert sorted(mlps.values()) == ["MLP", "MoKMoELayer", "MoKMoELayer"]
    assert subprocess.run([*patches, "revert", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 0
    assert subprocess.run([*patches, "check", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 1
