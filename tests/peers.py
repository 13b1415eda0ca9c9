"""The peers' own writers and readers (Hugging Face datasets, Mosaic Streaming, LitData), run in
the environment `.ci/peers-env` builds (their pins conflict with this one): a format reader is
proved right against the project that defines the format, never against our own idea of it."""

from __future__ import annotations

import os
import pickle
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

ENV = "GLOBALLOADER_PEERS_PYTHON"


def peers_python() -> str:
    """The peers' interpreter; in CI a missing one fails (a skip there would hide a wrong reader)."""
    python = os.environ.get(ENV)
    if python:
        return python
    if os.environ.get("CI"):
        pytest.fail(f"{ENV} is not set: CI builds the peers' environment with .ci/peers-env")
    pytest.skip(f"{ENV} is not set (bash .ci/peers-env .venv-peers builds the peers' environment)")


def run_peer(code: str, workdir: Path, timeout: float = 300, **inputs: Any) -> Any:
    """Run `code` (a script body) under the peers' interpreter in `workdir`.

    `inputs` reach the script as the dict `INPUTS`; whatever it assigns to `OUTPUT` comes back
    (both by pickle). A file, not `-c`: LitData's and Mosaic's workers re-import the main module."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "peer_inputs.pkl").write_bytes(pickle.dumps(inputs))
    script = workdir / "peer_script.py"
    script.write_text(
        "import pickle\n"
        "if __name__ == '__main__':\n"
        "    INPUTS = pickle.load(open('peer_inputs.pkl', 'rb'))\n"
        "    OUTPUT = None\n"
        + textwrap.indent(textwrap.dedent(code), "    ")
        + "\n    pickle.dump(OUTPUT, open('peer_output.pkl', 'wb'))\n"
    )
    done = subprocess.run([peers_python(), script.name], cwd=workdir, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise AssertionError(f"peer script failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return pickle.loads((workdir / "peer_output.pkl").read_bytes())
