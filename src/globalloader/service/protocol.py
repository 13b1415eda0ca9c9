"""How clients and the server talk: length-prefixed pickles over a Unix socket owned by the user.

The socket lives in the user's runtime folder with mode 0600 (its folder 0700): only the same
user can connect, which is what makes unpickling messages (and running the clients' functions)
acceptable. Messages are small tuples `(kind, *fields)`; sample bytes never travel here, they
stay in the shared-memory arena.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("!I")

HEARTBEAT_S = 1.0  # clients send one this often
SILENCE_S = 5.0  # a peer silent this long is gone
STALL_S = 10.0  # a load waiting this long for pool space while nothing is released: pool too small
POOL_TOO_SMALL = "the server's memory pool is too small"  # starts the error sent for a stall


def runtime_dir() -> Path:
    """`$XDG_RUNTIME_DIR/globalloader` (else a per-user folder in the temp dir), mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "globalloader" if base and os.path.isdir(base) else Path(tempfile.gettempdir()) / f"globalloader-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def default_socket() -> Path:
    """The server's socket: `$GLOBALLOADER_SOCKET`, else `server.sock` in the runtime folder."""
    explicit = os.environ.get("GLOBALLOADER_SOCKET")
    return Path(explicit) if explicit else runtime_dir() / "server.sock"


def send(sock: socket.socket, *msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> tuple:
    """One whole message (blocking); EOFError when the peer closed the socket."""
    (size,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    return pickle.loads(_read_exactly(sock, size))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class Framer:
    """Splits a non-blocking byte stream into messages (the server side of `send`)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + size:
                break
            payload = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
            del self._buffer[: _HEADER.size + size]
            messages.append(pickle.loads(payload))
        return messages
