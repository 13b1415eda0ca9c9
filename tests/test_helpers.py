"""The suite's helpers: whatever a test did, no server, socket or pool outlives it; batches compare as they should."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from helpers import Server, pool_segments, same, server_pid, stop_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_stuck_auto_started_server_is_killed_and_its_pool_and_socket_removed(tmp_path: Path):
    sock = tmp_path / "auto.sock"
    chain = gl.Dataset(gl.from_sequence(list(range(8)))).map(lambda x: {"x": x}, shared=True)
    with gl.Loader(chain, workers=0, share=True, server=str(sock), server_memory="8M") as loader:
        assert len(list(loader)) == 8
    pid = server_pid(sock)
    assert pid is not None and pid != os.getpid() and f"gl-pool-{pid}" in pool_segments()
    os.kill(pid, signal.SIGSTOP)  # deaf: `globalloader stop` cannot reach it
    stop_server(sock, timeout=3)
    assert not _alive(pid) and not sock.exists() and f"gl-pool-{pid}" not in pool_segments()
    stop_server(sock)  # nothing there any more: a no-op


def test_a_server_object_dropped_without_stop_is_stopped_when_collected(tmp_path: Path):
    srv = Server(tmp_path / "dropped.sock", memory="8M", workers=1)
    pid = srv.proc.pid
    assert server_pid(srv.socket) == pid
    del srv  # as when a failing test unwinds before its own stop()
    gc.collect()
    assert not _alive(pid) and not (tmp_path / "dropped.sock").exists() and f"gl-pool-{pid}" not in pool_segments()


def test_same_takes_nan_for_nan_and_nothing_else() -> None:
    nan = float("nan")
    assert same({"x": np.array([1.0, nan]), "y": [nan, 2]}, {"x": np.array([1.0, nan]), "y": [nan, 2]})
    assert not same(np.array([1.0, nan]), np.array([1.0, 2.0]))
    assert not same(np.array([1.0, nan]), np.array([1.0, nan], dtype=np.float32))
    assert not same([nan], [1.0]) and not same([1.0], [nan])
    assert not same(np.array([1, 2]), np.array([1, 3]))
