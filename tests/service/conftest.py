"""A real server process for each test, started and stopped with the project's own commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Dashboard, Server, pool_segments


@pytest.fixture
def server(tmp_path: Path):
    srv = Server(tmp_path / "s.sock")
    yield srv
    srv.stop()
    assert not srv.socket.exists(), "the socket file was left behind"
    assert f"gl-pool-{srv.proc.pid}" not in pool_segments(), "the memory pool was left in /dev/shm"


@pytest.fixture
def dashboard(server, tmp_path: Path):
    board = Dashboard(server.socket, tmp_path / "dashboard.log")
    yield board
    board.stop()
    assert board.proc.returncode in (0, 130), (tmp_path / "dashboard.log").read_text()
