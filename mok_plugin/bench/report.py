"""Run metadata every benchmark JSON carries: GPU, torch / Triton / Python versions, git commit, time
(the fields Liger's benchmark CSV keeps)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

__all__ = ["git_commit", "run_metadata"]

_REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """MOK_COMMIT where set, else HEAD of the checkout this package runs from, or "unknown" (no git, or
    not a checkout). MOK_COMMIT is for copies whose .git is not the source's: a device machine that
    receives the working tree may hold a stale .git, whose HEAD would name the wrong commit."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=_REPO)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return run.stdout.strip()


def run_metadata() -> dict:
    """{"gpu", "torch", "python", "commit", "time" (UTC, ISO 8601), "triton" when importable}."""
    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta
