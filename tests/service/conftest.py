"""A real server process for each test, started and stopped with the project's own commands."""

from __future__ import annotations

import re
import select
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import CLI, Server, pool_segments


@pytest.fixture
def server(tmp_path: Path):
    srv = Server(tmp_path / "s.sock")
    yield srv
    srv.stop()
    assert not srv.socket.exists(), "the socket file was left behind"
    assert f"gl-pool-{srv.proc.pid}" not in pool_segments(), "the memory pool was left in /dev/shm"


class Dashboard:
    """`globalloader status --web --port 0` for one test, as its own process; `url` has the token."""

    def __init__(self, socket: Path, log: Path) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "status", "--web", "--port", "0", "--socket", str(socket)],
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 - the child owns it; closed with the process
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        match = re.search(r"(http://127\.0\.0\.1:(\d+))/\?token=([\w-]+)", line)
        if not match:
            self.stop()
            raise AssertionError(f"the dashboard printed no address: {line!r} {log.read_text()}")
        self.url, self.base, self.port, self.token = match.group(0), match.group(1), int(match.group(2)), match.group(3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def dashboard(server, tmp_path: Path):
    board = Dashboard(server.socket, tmp_path / "dashboard.log")
    yield board
    board.stop()
    assert board.proc.returncode in (0, 130), (tmp_path / "dashboard.log").read_text()
