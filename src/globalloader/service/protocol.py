"""How clients and the server talk: typed, length-prefixed pickles over a Unix socket.

The socket lives in the user's runtime folder with mode 0600 (its folder 0700), and both sides
check the peer's uid (SO_PEERCRED) before unpickling anything it sent: only the same user's
processes are ever trusted, which is what makes running the clients' functions acceptable.
Every message is a tuple `(kind, *fields)`; `MESSAGES` fixes each kind's fields, and `parse`
refuses anything else, so one malformed frame ends one connection, not the server. Sample bytes
never travel here: they stay in the shared-memory arena.

Failures travel as the name of a class in `globalloader.errors` plus a message, so each job
raises the same named error the server met (`raise_error`).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

from globalloader import errors
from globalloader.errors import ProtocolError, ServerGoneError

HEADER = struct.Struct("!I")
MAX_FRAME = 256 << 20  # a hello carries a job's index set: 256 MiB is ~33M indices
SEND_LIMIT = 4 << 20  # bytes queued for one client before it counts as not reading (tickets: ~150 B each)

HEARTBEAT_S = 1.0  # clients send one this often; the server answers each
HELLO_S = 10.0  # a new connection must say what it wants within this
SILENT_DEAD_S = 5.0  # a peer silent this long whose process is gone is gone
STALL_S = 10.0  # a load waiting this long for arena space while nothing is released: the arena is too small
REQUEST_S = 10.0  # deadline of one CLI request (status, stop)

# kind -> field names. Client to server:
MESSAGES: dict[str, tuple[str, ...]] = {
    "hello": ("info",),  # dict: name, pid, prefix_fp, prefix (cloudpickled chain), seed, timeout
    "run": ("run", "epoch", "indices"),  # a pass over `indices` (a set) starts; earlier runs end
    "want": ("run", "count"),  # send `count` more tickets of this run
    "release": ("run", "indices"),  # the job no longer reads these samples
    "end": ("run",),  # the pass is over or abandoned: drop its references and pending tickets
    # From a client: (run, samples consumed, seconds its loop waited, seconds its loop worked); None from the server.
    "heartbeat": ("progress",),
    "bye": (),
    "status": (),  # a one-shot connection: answered with "status", then closed
    "stop": (),
    # Server to client:
    "welcome": ("job", "arena", "capacity"),  # arena: its (name, inode), see transport.arena
    "ticket": ("run", "seq", "index", "offset", "layout"),  # sample `index` is at `offset`
    "failed": ("run", "seq", "index", "error", "message"),  # it could not be loaded
    "error": ("error", "message"),  # the request failed; the connection ends
    "report": ("status",),  # answer to "status"
    "stopping": (),
    "batch": ("messages",),  # a tuple of tickets and failed loads queued by one round of events
}
BATCHED = ("ticket", "failed")  # the messages a "batch" may hold
FIRST = ("hello", "status", "stop")  # what a connection may start with


def runtime_dir() -> Path:
    """`$XDG_RUNTIME_DIR/globalloader` (else a per-user folder in the temp dir), mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        folder = Path(base) / "globalloader"
    else:
        folder = Path(tempfile.gettempdir()) / f"globalloader-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def default_socket() -> Path:
    """The server's socket: `$GLOBALLOADER_SOCKET`, else `server.sock` in the runtime folder."""
    explicit = os.environ.get("GLOBALLOADER_SOCKET")
    return Path(explicit) if explicit else runtime_dir() / "server.sock"


def check_peer(sock: socket.socket, what: str) -> int:
    """The pid of the process at the other end of a Unix socket, after checking it runs as this
    user (else ProtocolError)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise ProtocolError(
            f"the {what} (pid {pid}) runs as uid {uid}, not as this user ({os.getuid()}): "
            "refusing to read its messages; use a socket in a folder only you can write"
        )
    return pid


def frame(kind: str, *fields: Any) -> bytes:
    """One message as bytes on the wire."""
    msg = (kind, *fields)
    _check_fields(msg)
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_FRAME:
        raise ProtocolError(f"message {kind!r} is {len(data):,} bytes, over the {MAX_FRAME:,}-byte limit")
    return HEADER.pack(len(data)) + data


def frame_all(messages: list[tuple]) -> bytes:
    """Messages as bytes on the wire, each run of tickets (and failed loads) in one "batch"
    frame: one pickle and one read per round of tickets, not one each. Other messages keep a
    frame of their own."""
    out = bytearray()
    run: list[tuple] = []
    for msg in [*messages, None]:
        if msg is not None and msg[0] in BATCHED:
            _check_fields(msg)  # here: a batch's frame checks only its own two fields
            run.append(msg)
            continue
        if run:
            out += frame(*run[0]) if len(run) == 1 else frame("batch", tuple(run))
            run = []
        if msg is not None:
            out += frame(*msg)
    return bytes(out)


def parse(payload: bytes) -> tuple:
    """A received frame's message, checked against `MESSAGES` (else ProtocolError)."""
    try:
        msg = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - unpickling a bad frame can raise anything; it ends one connection
        raise ProtocolError(f"a message is not a valid pickle ({type(exc).__name__}: {exc})") from None
    _check_fields(msg)
    if msg[0] == "batch":
        if not isinstance(msg[1], tuple):
            raise ProtocolError("a 'batch' needs a tuple of messages")
        for inner in msg[1]:
            _check_fields(inner)
            if inner[0] not in BATCHED:
                raise ProtocolError(f"a 'batch' holds only {BATCHED}, not {inner[0]!r}")
    return msg


def _check_fields(msg: Any) -> None:
    if not isinstance(msg, tuple) or not msg or not isinstance(msg[0], str) or msg[0] not in MESSAGES:
        raise ProtocolError(f"unknown message {str(msg)[:80]!r}")
    if len(msg) - 1 != len(MESSAGES[msg[0]]):
        raise ProtocolError(f"message {msg[0]!r} needs fields {MESSAGES[msg[0]]}, got {len(msg) - 1}")


def send(sock: socket.socket, kind: str, *fields: Any) -> None:
    """Send one message on a blocking socket."""
    sock.sendall(frame(kind, *fields))


def recv(sock: socket.socket) -> tuple:
    """One whole message from a blocking socket; ServerGoneError when the peer closed it."""
    (size,) = HEADER.unpack(_read_exactly(sock, HEADER.size))
    if size > MAX_FRAME:
        raise ProtocolError(f"the peer announced a {size:,}-byte message, over the {MAX_FRAME:,}-byte limit")
    return parse(_read_exactly(sock, size))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ServerGoneError("the peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class Framer:
    """Splits a non-blocking byte stream into checked messages (the server side of `send`)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        """The whole messages `data` completes; ProtocolError on a bad or oversized frame."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME:
                raise ProtocolError(f"a {size:,}-byte frame is over the {MAX_FRAME:,}-byte limit")
            if len(self._buffer) < HEADER.size + size:
                break
            payload = bytes(self._buffer[HEADER.size : HEADER.size + size])
            del self._buffer[: HEADER.size + size]
            messages.append(parse(payload))
        return messages


def error_name(exc: BaseException) -> str:
    """How an exception travels: its class name when `globalloader.errors` has it."""
    name = type(exc).__name__
    return name if isinstance(getattr(errors, name, None), type) else "ServerError"


def make_error(name: str, message: str) -> errors.GlobalLoaderError:
    """The named error a job raises for a failure the server reported."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.GlobalLoaderError)):
        cls = errors.ServerError
    return cls(message)
