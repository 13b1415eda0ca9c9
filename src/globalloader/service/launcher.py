"""Finding, starting and stopping the one server per socket.

Exactly one server owns a socket: a server first takes an exclusive lock on `<socket>.lock` and
holds it for its whole life, so of several servers started at once (several `share=True` jobs
starting together) one wins and the others exit before making anything. Only the lock holder
removes a stale socket file or unlinks the socket on exit, so a server never deletes another's.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from globalloader._pids import alive
from globalloader.errors import ArgumentError, ServerGoneError, ServerStartError, ServerTimeoutError
from globalloader.service import protocol
from globalloader.transport.arena import ARENA_PREFIX
from globalloader.transport.names import remove_unheld

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
MIN_MEMORY = 16 << 10  # an arena smaller than 16 KiB holds nothing useful
LOST_RACE = 3  # a server's exit code when another server owns its socket
IDLE_EXIT_S = 60.0  # an auto-started server with no jobs for this long exits ($GLOBALLOADER_IDLE_EXIT)


def parse_size(text: str | int) -> int:
    """'512M', '4G', '1.5GiB' or a byte count -> bytes (at least 16 KiB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ArgumentError(f"--memory: cannot read {text!r} as a size (examples: 512M, 4G)")
        number, unit = float(match.group(1)), match.group(2).lower()
        size = int(number * 1024 ** "_kmgt".index(unit or "_"))
    if size < MIN_MEMORY:
        raise ArgumentError(f"--memory: {text!r} is below the 16K minimum (examples: 512M, 4G)")
    return size


def own_socket(path: Path) -> int | None:
    """Take the exclusive lock that makes this process the server of `path`: its fd (held until
    the process exits), or None if another server holds it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def clear_leftovers(path: Path) -> None:
    """With the lock held: remove what crashed servers left (the socket file, their arenas)."""
    if path.exists() or path.is_symlink():
        path.unlink()
    remove_unheld(ARENA_PREFIX)  # an arena lives as long as its server holds it


def connect(path: Path, timeout: float = 2.0) -> tuple[socket.socket, int]:
    """A connection to the server at `path` and the server's pid, checked to be this user's."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        pid = protocol.check_peer(sock, f"server at {path}")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, pid


def is_running(path: Path) -> bool:
    try:
        connect(path, timeout=1.0)[0].close()
        return True
    except OSError:
        return False


def server_command(path: Path, memory: str | int | None = None, workers: int | None = None) -> list[str]:
    """The command that runs a server at `path` (the server's defaults where None)."""
    cmd = [sys.executable, "-m", "globalloader.service.server", "--socket", str(path)]
    if memory is not None:
        cmd += ["--memory", str(memory)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    return cmd


def ensure_server(path: Path, memory: str | int | None = None, timeout: float = 30.0) -> None:
    """Start a detached server at `path` unless one answers already; wait until one answers.

    Several jobs may do this at once: each starts a candidate, one candidate wins the socket's
    lock and the others exit with LOST_RACE, so every job ends up talking to the same server.
    """
    if is_running(path):
        return
    if memory is not None:
        parse_size(memory)  # a bad size is the caller's error, reported here, not in a log
    cmd = [*server_command(path, memory), "--idle-exit", os.environ.get("GLOBALLOADER_IDLE_EXIT", str(IDLE_EXIT_S))]
    log_path = protocol.runtime_dir() / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_running(path):
            return
        code = proc.poll()
        if code not in (None, 0, LOST_RACE):
            raise ServerStartError(f"the globalloader server for {path} could not start: {_last_line(log_path)}")
        time.sleep(0.05)
    raise ServerStartError(f"no globalloader server answered at {path} within {timeout:.0f} s; see {log_path}")


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def request(path: Path, kind: str, timeout: float = protocol.REQUEST_S) -> tuple:
    """One request/answer exchange with the server (status, stop), bounded by `timeout`."""
    try:
        sock, _ = connect(path, timeout)
    except OSError as exc:
        raise ServerGoneError(f"no globalloader server answers at {path}") from exc
    with sock:
        sock.settimeout(timeout)
        try:
            protocol.send(sock, kind)
            reply = protocol.recv(sock)
        except TimeoutError:
            raise ServerTimeoutError(
                f"the globalloader server at {path} did not answer {kind!r} within "
                f"{timeout:.0f} s (it may be blocked; see its log)"
            ) from None
        except OSError as exc:
            raise ServerGoneError(f"the globalloader server at {path} closed the connection: {exc}") from exc
    if reply[0] == "error":
        raise protocol.make_error(reply[1], reply[2])
    return reply


def status(path: Path, timeout: float = protocol.REQUEST_S) -> dict[str, Any]:
    return request(path, "status", timeout)[1]


def stop(path: Path, timeout: float = protocol.REQUEST_S) -> bool:
    """Ask the server at `path` to stop; True once it is gone, False if none was running."""
    try:
        sock, pid = connect(path, timeout=1.0)
    except OSError:
        return False
    sock.close()
    request(path, "stop", timeout)
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            raise ServerTimeoutError(
                f"the globalloader server at {path} said it stops but still runs after {timeout:.0f} s"
            )
        time.sleep(0.05)
    return True
