"""A training job's connection to the server: register, ask for samples, release them, heartbeat.

A reader thread turns the socket into an inbox (a list of messages per read: the server sends a
round of tickets as one frame) and a heartbeat thread tells the server the job's progress. Every
wait has a deadline: `get(timeout)` raises ServerGoneError as soon as the connection closes or
the server's process is gone, and LoaderTimeoutError when nothing arrives in time from a server
that is alive but stuck; one merely slow to answer (a long load, a busy machine) is not dead.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from globalloader._pids import alive
from globalloader.errors import GlobalLoaderError, LoaderTimeoutError, ServerGoneError, ServerStartError
from globalloader.service import protocol
from globalloader.service.launcher import connect, ensure_server


class Client:
    def __init__(self, path: str | Path, memory: str | int | None = None) -> None:
        """Connect to the server at `path`, started first (with `memory`) unless one answers."""
        self.path = Path(path)
        ensure_server(self.path, memory)
        try:
            self.sock, self.server_pid = connect(self.path)
        except OSError as exc:
            raise ServerStartError(f"no globalloader server answers at {self.path}") from exc
        self._inbox: queue.SimpleQueue[list[tuple]] = queue.SimpleQueue()
        self._taken: deque[tuple] = deque()  # messages of the last lists taken from the inbox, in order
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._gone: GlobalLoaderError | None = None
        # (run, samples consumed, seconds the loop waited, seconds it worked): sent with heartbeats
        self.progress: tuple[int, int, float, float] = (-1, 0, 0.0, 0.0)
        threading.Thread(target=self._read, daemon=True, name="globalloader-client-read").start()
        threading.Thread(target=self._beat, daemon=True, name="globalloader-client-beat").start()

    def _read(self) -> None:
        framer = protocol.Framer()
        try:
            while data := self.sock.recv(1 << 20):
                messages = []
                for msg in framer.feed(data):
                    if msg[0] == "batch":
                        messages.extend(msg[1])
                    elif msg[0] != "heartbeat":
                        messages.append(msg)
                if messages:
                    self._inbox.put(messages)
            raise ServerGoneError("the server closed the connection")
        except (GlobalLoaderError, OSError) as exc:
            if not self._closed.is_set():
                self._gone = exc if not isinstance(exc, OSError) else ServerGoneError(str(exc))
                self._inbox.put([("gone",)])

    def _beat(self) -> None:
        while not self._closed.wait(protocol.HEARTBEAT_S):
            try:
                self.send("heartbeat", self.progress)
            except ServerGoneError:
                return

    def send(self, kind: str, *fields: Any) -> None:
        try:
            with self._send_lock:
                protocol.send(self.sock, kind, *fields)
        except OSError as exc:
            raise ServerGoneError(f"the globalloader server at {self.path} is gone: {exc}") from exc

    def get(self, timeout: float, waiting_for: str) -> tuple:
        """The next message within `timeout` seconds (<= 0: no deadline).

        Raises the error the server reported, ServerGoneError if it closed or died, and
        LoaderTimeoutError if it is alive but sent nothing in time.
        """
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while not self._taken:
            try:
                self._taken.extend(self._inbox.get(timeout=0.5))
            except queue.Empty:
                if not alive(self.server_pid):
                    raise ServerGoneError(
                        f"the globalloader server at {self.path} (pid {self.server_pid}) died"
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise LoaderTimeoutError(
                        f"the globalloader server at {self.path} sent nothing for {timeout:.0f} s while this "
                        f"job waited for {waiting_for} (Loader(timeout=)); see `globalloader status` and its log"
                    ) from None
        return self._check(self._taken.popleft())

    def get_nowait(self) -> tuple | None:
        """The next message if one has arrived, else None."""
        if not self._taken:
            try:
                self._taken.extend(self._inbox.get_nowait())
            except queue.Empty:
                return None
        return self._check(self._taken.popleft())

    def _check(self, msg: tuple) -> tuple:
        if msg[0] == "gone":
            self._taken.appendleft(msg)  # every later call fails the same way
            raise self._gone or ServerGoneError(f"the globalloader server at {self.path} is gone")
        if msg[0] == "error":
            raise protocol.make_error(msg[1], msg[2])
        return msg

    def close(self) -> None:
        if self._closed.is_set():
            return
        with contextlib.suppress(ServerGoneError):
            self.send("heartbeat", self.progress)  # the last progress, for `status`
            self.send("bye")
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()
