"""The `globalloader` command as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "globalloader.cli", *args],
                          capture_output=True, text=True, check=check, timeout=600)


@pytest.mark.timeout(600)
def test_demo_compares_loaders_then_jobs_independent_and_shared():
    out = run("demo", "--images", "48", "--batch-size", "8", "--shared-memory", "64M").stdout
    assert re.search(r"globalloader\s+\d+\.\d", out) and re.search(r"torch DataLoader\s+\d+\.\d", out)
    assert re.search(r"globalloader / torch DataLoader: \d+\.\d\dx", out)
    assert "independent" in out and "shared" in out and "decodes" in out


def test_bad_arguments_are_one_clear_line():
    result = run("serve", "--memory", "lots", check=False)
    assert result.returncode != 0
    assert result.stderr.strip() == "globalloader: --memory: cannot read 'lots' as a size (examples: 512M, 4G)"


def test_stop_without_a_server_says_so(tmp_path):
    assert "no server runs" in run("stop", "--socket", str(tmp_path / "none.sock")).stdout
