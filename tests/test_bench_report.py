"""The run metadata every benchmark JSON carries: the commit a device copy names."""

from __future__ import annotations

import subprocess

import pytest

from mok_plugin.bench import report


def test_commit_is_the_checkouts_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOK_COMMIT", raising=False)
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=report._REPO
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert report.git_commit() == head
    assert report.run_metadata()["commit"] == head


def test_mok_commit_names_the_commit_of_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # A device copy whose .git is stale: the caller names the commit it sent.
    monkeypatch.setenv("MOK_COMMIT", "29306db")
    assert report.git_commit() == "29306db"
    assert report.run_metadata()["commit"] == "29306db"
