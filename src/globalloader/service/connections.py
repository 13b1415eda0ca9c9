"""The server's connection I/O: accept clients, frame what they send, queue and send answers.

Every socket is non-blocking and served from the server's one selector, so nothing here needs a
lock. It survives its clients: a malformed or oversized message, a connection that never says
hello, a client that stops reading, a full file table: each ends one connection with a log line.
Whatever serving a client's request raises goes back to that client only (`serving`).

What a message means is not decided here: each checked message goes to the server's `handle`,
and a connection that carried a job is reported to `drop` when it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from globalloader._pids import alive
from globalloader.errors import GlobalLoaderError, ProtocolError, ServerStartError
from globalloader.service import protocol

HOLD_S = 0.008  # the longest a ticket waits at the server for others to share its frame
HOLD_TICKETS = 16  # ... or until this many wait


def log(line: str) -> None:
    print(f"globalloader server: {line}", file=sys.stderr, flush=True)


@dataclass(eq=False)
class Connection:
    """One client socket: a job after its hello, else a one-shot request (status, stop)."""

    sock: socket.socket
    pid: int  # the peer's, from the kernel
    opened: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    framer: protocol.Framer = field(default_factory=protocol.Framer)
    queued: list[tuple] = field(default_factory=list)  # messages not yet framed (see Connections.post_all)
    since: float = 0.0  # when the oldest of them was queued
    urgent: bool = False  # one of them is not a ticket: it goes out at the end of this round
    outbox: bytearray = field(default_factory=bytearray)
    job: Any = None  # the scheduler's job, from its hello until it is dropped
    closing: bool = False  # close once the outbox is sent
    writing: bool = False  # the selector also waits for the socket to take more
    on_event: Any = None  # the selector's callback


class Connections:
    """The listening socket and every client connection, on the server's selector."""

    def __init__(
        self,
        socket_path: Path,
        selector: selectors.BaseSelector,
        handle: Callable[[Connection, tuple], None],
        drop: Callable[[Connection, str | None], None],
    ) -> None:
        """Bind `socket_path` (whose lock the caller holds). `handle` runs each message of a
        client; `drop` hears of a job's connection ending (with why, to log, or None)."""
        self.socket_path = Path(socket_path)
        self._selector = selector
        self._handle, self._drop = handle, drop
        self.connections: dict[socket.socket, Connection] = {}
        self._unposted: dict[socket.socket, Connection] = {}  # connections with queued messages
        self._accept_paused_until = 0.0
        self._listener = self._listen()

    # -- accepting ---------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        path = self.socket_path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise ServerStartError(f"cannot bind {path}: {exc.strerror or exc}") from exc
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, self._accept)
        return sock

    def unregister(self, fileobj: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fileobj)

    def _accept(self, _: Any) -> None:
        try:
            sock, _addr = self._listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log(f"cannot accept a connection ({exc.strerror}); pausing accepts for 1 s")
                self.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + 1.0
            return
        try:
            pid = protocol.check_peer(sock, "client")
        except (ProtocolError, OSError) as exc:
            log(f"refused a connection: {exc}")
            sock.close()
            return
        sock.setblocking(False)
        conn = Connection(sock, pid)
        conn.on_event = lambda mask: self._ready(conn, mask)
        self.connections[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn.on_event)

    # -- reading -----------------------------------------------------------------------------
    def _ready(self, conn: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0 and not conn.closing:
            self._readable(conn)

    def _readable(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(conn, "closed its connection" if conn.job else None)
            return
        conn.last_seen = time.monotonic()
        try:
            messages = conn.framer.feed(data)
        except ProtocolError as exc:
            self.refuse(conn, exc)
            return
        for msg in messages:
            if conn.closing or conn.sock.fileno() < 0:
                return
            self._dispatch(conn, msg)

    def _dispatch(self, conn: Connection, msg: tuple) -> None:
        """Run one message's handler, after checking it may come now."""
        kind = msg[0]
        with self.serving(conn, kind):
            if conn.job is None and kind not in protocol.FIRST:
                raise ProtocolError(f"{kind!r} before 'hello'")
            if conn.job is not None and kind == "hello":
                raise ProtocolError("a second 'hello' on one connection")
            self._handle(conn, msg)

    @contextlib.contextmanager
    def serving(self, conn: Connection, kind: str) -> Iterator[None]:
        """Whatever serving a client's `kind` request raises goes back to that client only."""
        try:
            yield
        except ProtocolError as exc:
            self.refuse(conn, exc)
        except GlobalLoaderError as exc:  # the request cannot be served: say why, end the job
            self._fail(conn, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: the job hears of it, the server and other jobs go on
            where = traceback.extract_tb(exc.__traceback__)[-1]
            log(
                f"error while serving {kind!r}: {type(exc).__name__}: {exc} "
                f"({Path(where.filename).name}:{where.lineno})"
            )
            self.send(conn, "error", "ServerError", f"the server failed on {kind!r}: {type(exc).__name__}: {exc}")
            self.end(conn, "ended after a server error")

    def refuse(self, conn: Connection, exc: ProtocolError) -> None:
        log(f"connection from pid {conn.pid}: {exc}; closed")
        self._fail(conn, exc)

    def _fail(self, conn: Connection, exc: GlobalLoaderError) -> None:
        self.send(conn, "error", protocol.error_name(exc), str(exc))
        self.end(conn, f"failed: {exc}")

    # -- sending -----------------------------------------------------------------------------
    def send(self, conn: Connection, kind: str, *fields: Any) -> None:
        """Queue a message; `post_all` sends what is due, one frame per client."""
        if conn.sock.fileno() < 0:
            return
        if not conn.queued:
            conn.since = time.monotonic()
        conn.queued.append((kind, *fields))
        conn.urgent = conn.urgent or kind not in protocol.BATCHED
        self._unposted[conn.sock] = conn

    def _post(self, conn: Connection) -> None:
        """Frame the queued messages and send what the socket takes; a client whose unread
        backlog passes SEND_LIMIT is dropped."""
        if not conn.queued or conn.sock.fileno() < 0:
            return
        waiting = bool(conn.outbox)  # then the socket is full: the selector flushes when it drains
        conn.outbox += protocol.frame_all(conn.queued)
        conn.queued, conn.urgent = [], False
        if not waiting:
            self._flush(conn)
        if conn.sock.fileno() >= 0 and len(conn.outbox) > protocol.SEND_LIMIT:
            self.close(conn, f"stopped reading ({len(conn.outbox):,} bytes unsent)")

    def post_all(self, settled: Callable[[Connection], bool]) -> float | None:
        """Send what is due, one frame per client; return the seconds until held tickets are
        due (None: nothing held).

        Tickets wait for company (HOLD_TICKETS of them, or HOLD_S), so that a job that asked
        far ahead gets them a few per frame: one send, one wake-up of its reader and one of its
        training thread per few samples, not per sample. They go at once with any other message,
        and when `settled(conn)` says no more are on their way to that client now."""
        now, due = time.monotonic(), None
        for sock, conn in list(self._unposted.items()):
            left = conn.since + HOLD_S - now
            if conn.urgent or left <= 0 or len(conn.queued) >= HOLD_TICKETS or settled(conn):
                del self._unposted[sock]
                self._post(conn)
            else:
                due = left if due is None else min(due, left)
        return due

    def _flush(self, conn: Connection) -> None:
        if conn.sock.fileno() < 0:
            return
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close(conn, "stopped reading (connection broken)")
            return
        del conn.outbox[:sent]
        if not conn.outbox and conn.closing:
            self.close(conn, None)
        elif bool(conn.outbox) != conn.writing:  # ask to hear when it drains only while it is full
            conn.writing = bool(conn.outbox)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self._selector.modify(conn.sock, events, conn.on_event)

    # -- closing -----------------------------------------------------------------------------
    def end(self, conn: Connection, why: str | None) -> None:
        """Close once what is queued for the client is sent (an error, a status)."""
        if conn.job is not None:
            self._drop(conn, why)
        conn.closing = True
        self._post(conn)
        if not conn.outbox:
            self.close(conn, None)

    def close(self, conn: Connection, why: str | None) -> None:
        if conn.job is not None:
            self._drop(conn, why)
        self.connections.pop(conn.sock, None)
        self.unregister(conn.sock)
        conn.sock.close()

    def check(self) -> None:
        """Resume accepting after a full file table; close hello-less connections past HELLO_S;
        close silent jobs' connections whose process is gone."""
        now = time.monotonic()
        if self._accept_paused_until and now > self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        for conn in list(self.connections.values()):
            if conn.job is None:
                if not conn.closing and now - conn.opened > protocol.HELLO_S:
                    log(f"connection from pid {conn.pid} said nothing for {protocol.HELLO_S:.0f} s; closed")
                    self.close(conn, None)
            elif now - conn.last_seen > protocol.SILENT_DEAD_S and not alive(conn.pid):
                self.close(conn, f"is gone (silent {now - conn.last_seen:.0f} s, process ended)")

    def close_listener(self) -> None:
        self.unregister(self._listener)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # ours: we hold the socket's lock

    def close_all(self) -> None:
        """Stop listening (first: nobody new connects to a server going away), send what is
        queued if the sockets take it (a "stopping" answer), close every connection."""
        self.close_listener()
        for conn in list(self.connections.values()):
            self._post(conn)
            if conn.outbox:
                self._flush(conn)
            self.close(conn, None)
