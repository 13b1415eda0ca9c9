"""The README's examples run as written, and CI runs the README's test command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import pool_segments, stop_server

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
# Examples that start Ray or a server; the rest are quick.
HEAVY = {i for i, text in enumerate(EXAMPLES) if "share=True" in text or "ray.init" in text}


def test_readme_has_examples():
    assert len(EXAMPLES) >= 4 and HEAVY


@pytest.fixture
def example_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The example's working folder, with a PATH on which no `globalloader` command is found (as
    when the virtual environment is not activated); afterwards, pass or fail, every server
    whose socket is in the folder is stopped and its pool is gone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "cache"))
    path = os.environ.get("PATH", "").split(os.pathsep)
    monkeypatch.setenv("PATH", os.pathsep.join(d for d in path if not (Path(d) / "globalloader").exists()))
    assert shutil.which("globalloader") is None
    yield tmp_path
    stopped = [stop_server(sock) for sock in tmp_path.rglob("*.sock")]
    assert not list(tmp_path.rglob("*.sock")), "a server's socket was left behind"
    assert not {f"gl-pool-{pid}" for pid in stopped if pid} & pool_segments(), "a server's pool was left behind"


def _params() -> list:
    marks = (pytest.mark.slow, pytest.mark.integration)
    return [pytest.param(i, marks=marks if i in HEAVY else ()) for i in range(len(EXAMPLES))]


@pytest.mark.parametrize("index", _params())
def test_example_runs_as_written(index, example_dir):
    """Each example in a fresh interpreter, as a user runs it: one that starts Ray must not leave
    threads behind in the process where the next one forks its workers."""
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLES[index]], cwd=example_dir, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README example {index + 1} failed:\n{done.stdout}\n{done.stderr}"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.DOTALL)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_the_fast_run_is_given_under_the_test_command():
    after = README.split("python -m pytest -q\n```", 1)[1]
    assert after.lstrip().splitlines()[0].endswith('`python -m pytest -q -m "not slow and not integration"`.')
