"""What a job process keeps of the servers' pools: the file each server made, never an earlier
one's under the same name, and nothing once its Loaders are closed. Real servers, real /dev/shm."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader.service.launcher import is_running
from helpers import CLI, pool_segments, shm_held, stop_server

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


def scaled(i: int, factor: int) -> dict:
    return {"x": np.full(4, i * factor)}


def batches(socket: Path, factor: int, **loader: object) -> list[dict]:
    """Every batch of a share=True Loader over the server at `socket` (then closed)."""
    ds = gl.Dataset(gl.from_sequence(list(range(6)))).map(functools.partial(scaled, factor=factor), shared=True)
    with gl.Loader(ds.batch(2), share=True, server=str(socket), **loader) as it:
        return list(it)


def rows(batches: list[dict]) -> list[list[int]]:
    """The samples' values, sorted (a shared order depends on the jobs' timing)."""
    return sorted(row.tolist() for batch in batches for row in batch["x"])


def _namespace_command() -> list[str] | None:
    """`unshare` running a command as pid 1 of a new PID namespace (as a sidecar container's
    server is), or None where this machine does not let us make one."""
    if shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        cmd[1:1] = ["--user", "--map-root-user"]
    probe = [*cmd, sys.executable, "-c", "import os; print(os.getpid())"]
    answer = subprocess.run(probe, capture_output=True, text=True)
    return cmd if answer.returncode == 0 and answer.stdout.strip() == "1" else None


def test_a_new_server_as_pid_1_again_never_serves_the_earlier_ones_memory(tmp_path: Path):
    """Two servers, one after the other, each pid 1 of its own PID namespace and so each with the
    pool `gl-pool-1`: a Loader of the same process over the second reads the second's samples."""
    namespace = _namespace_command()
    if namespace is None:
        pytest.skip("this machine does not let a test make a PID namespace (unshare)")
    socket = tmp_path / "s.sock"
    for factor in (1, 1000):
        with open(tmp_path / "server.log", "a") as log:
            proc = subprocess.Popen(
                [*namespace, *CLI, "serve", "--socket", str(socket), "--memory", "16M", "--workers", "1"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while not is_running(socket):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.05)
            assert rows(batches(socket, factor)) == [[i * factor] * 4 for i in range(6)]
            assert "gl-pool-1" in pool_segments(), "the server is not pid 1: nothing was reused"
        finally:
            stop_server(socket)
            proc.wait(timeout=30)
    assert shm_held("gl-pool-1") == (0, 0)


@pytest.mark.parametrize(
    "loader",
    [
        pytest.param({"workers": 0}, id="in-thread"),
        pytest.param({"workers": 2, "mode": "thread"}, id="threads"),
        pytest.param({"workers": 2}, id="processes"),
    ],
)
def test_a_closed_loader_keeps_no_pool_mapped_and_its_batches_keep_their_values(server, loader: dict):
    """Once closed, a Loader leaves this process no descriptor and no mapping of its server's pool
    (rounds of Loaders over new servers piled them up), and the batches kept still read right
    after the server has gone."""
    kept = batches(server.socket, 7, **loader)
    assert shm_held(f"gl-pool-{server.proc.pid}") == (0, 0), "a closed Loader still maps its server's pool"
    server.stop()
    assert rows(kept) == [[i * 7] * 4 for i in range(6)]
