"""Finding, starting and stopping the one server per machine (per user)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from globalloader.errors import ArgumentError, ServerGone
from globalloader.service import arena, protocol

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_size(text: str | int) -> int:
    """'512M', '4G', '1.5GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ArgumentError(f"--memory: cannot read {text!r} as a size (examples: 512M, 4G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** "_kmgt".index(unit or "_"))


def connect(path: Path, timeout: float = 2.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def is_running(path: Path) -> bool:
    try:
        connect(path, timeout=1.0).close()
        return True
    except OSError:
        return False


def take_over(path: Path) -> None:
    """Before a server starts at `path`: refuse if one answers; else clear what a crashed one left
    (its socket file and its memory pool)."""
    if is_running(path):
        raise ArgumentError(f"a globalloader server already answers at {path}; `globalloader stop` it first")
    if path.exists():
        path.unlink()
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        names = []
    for name in names:
        match = re.fullmatch(r"gl-pool-(\d+)", name)
        if match and not _alive(int(match.group(1))):
            arena.unlink(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ensure_server(path: Path, memory: str | int | None = None, workers: int | None = None, timeout: float = 20.0) -> None:
    """Start a detached server at `path` unless one answers already; wait until it answers."""
    if is_running(path):
        return
    cmd = [sys.executable, "-m", "globalloader.service.server", "--socket", str(path)]
    if memory is not None:
        cmd += ["--memory", str(memory)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    log = open(protocol.runtime_dir() / "server.log", "ab")
    subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_running(path):
            return
        time.sleep(0.05)
    raise ServerGone(f"started a globalloader server at {path} but it did not answer within {timeout:.0f} s; "
                     f"see {protocol.runtime_dir() / 'server.log'}")


def request(path: Path, *msg: Any) -> tuple:
    """One request/answer exchange with the server (status, stop)."""
    try:
        sock = connect(path)
    except OSError as exc:
        raise ServerGone(f"no globalloader server answers at {path}") from exc
    with sock:
        protocol.send(sock, *msg)
        return protocol.recv(sock)


def stop(path: Path, timeout: float = 10.0) -> bool:
    """Ask the server at `path` to stop; True once it is gone, False if none was running."""
    if not is_running(path):
        return False
    request(path, "stop")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and path.exists():
        time.sleep(0.05)
    return True
