"""The thin commands in scripts/: each only calls a package main (no sys.path edits) and answers
--help; bench_layer.py refuses to run without a GPU with a clear message; patches.py --target checks
the version of the package it is pointed at (mok_plugin.patching). The benchmark library itself is
tested in tests/test_bench_*.py."""

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

from mok_plugin import patching

ROOT = pathlib.Path(__file__).resolve().parents[1]
# script -> the package module whose main it calls
THIN_SCRIPTS = {
    "bench_layer.py": "mok_plugin.bench.layer",
    "tune_kernels.py": "mok_plugin.bench.tune",
    "inspect_kernels.py": "mok_plugin.bench.inspect",
    "bench_ep.py": "mok_plugin.bench.ep",
    "multi_gpu.py": "mok_plugin.bench.multi_gpu",
    "bench_generic.py": "mok_plugin.bench.generic",
    "bench_fp8.py": "mok_plugin.bench.fp8",
    "patches.py": "mok_plugin.patching",
}


@pytest.mark.parametrize("script, module", THIN_SCRIPTS.items(), ids=list(THIN_SCRIPTS))
def test_script_is_thin(script, module):
    source = (ROOT / "scripts" / script).read_text()
    assert "sys.path" not in source
    imports = [node for node in ast.parse(source).body if isinstance(node, ast.ImportFrom | ast.Import)]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [(module, ["main"])]
    run = subprocess.run([sys.executable, f"scripts/{script}", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_bench_layer_needs_a_gpu():
    run = subprocess.run([sys.executable, "scripts/bench_layer.py", "--shapes", "tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


def test_bench_layer_refuses_a_bad_override():
    run = subprocess.run([sys.executable, "scripts/bench_layer.py", "--override", "wgrad=128x128x64w8s4e"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "--override KERNEL=CONFIG" in run.stderr and "expected like" in run.stderr


MEGATRON_0_18_1 = "MAJOR = 0\nMINOR = 18\nPATCH = 1\nPRE_RELEASE = ''\n"


@pytest.mark.parametrize(
    "framework, files, found",
    [
        pytest.param("megatron", {"megatron/core/package_info.py": MEGATRON_0_18_1}, "megatron-core 0.18.1",
                     id="megatron_version_file"),
        pytest.param("deepspeed", {"deepspeed/git_version_info_installed.py": "version='0.18.4'\n"},
                     "deepspeed 0.18.4", id="deepspeed_version_file"),
        pytest.param("megatron", {"megatron/core/__init__.py": "", "megatron_core-0.20.0.dist-info/METADATA":
                     "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n"}, "megatron-core 0.20.0",
                     id="megatron_dist_info"),
    ],
)  # fmt: skip
def test_patches_target_of_another_version_is_refused(tmp_path, framework, files, found):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for action in ("apply", "check", "revert"):
        assert patching.main([action, framework, "--target", str(tmp_path)]) == 2
    run = subprocess.run([sys.executable, "scripts/patches.py", "apply", framework, "--target", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and found in run.stderr and "these patches are for 0.19.x" in run.stderr


def test_patches_target_without_a_version_is_refused(tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    run = subprocess.run([sys.executable, "scripts/patches.py", "apply", "megatron", "--target", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "cannot tell which megatron-core version" in run.stderr


def test_patch_files_are_found_from_the_package():
    for patch_set in patching.PATCH_SETS.values():
        for name in patch_set.files:
            assert (patching.PATCH_DIR / name).is_file(), name
