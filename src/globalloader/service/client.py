"""A training job's connection to the server: register, ask for samples, release them, heartbeat.

A reader thread turns the socket into an inbox and a heartbeat thread proves the job is alive.
The server answers every heartbeat, so silence (or a closed socket) means it is gone: `get`
raises ServerGone within `SILENCE_S` seconds instead of waiting forever.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

from globalloader.errors import ServerGone
from globalloader.service import protocol
from globalloader.service.launcher import connect, ensure_server


class Client:
    def __init__(self, path: Path, start: bool = True, memory: str | int | None = None, workers: int | None = None) -> None:
        self.path = Path(path)
        if start:
            ensure_server(self.path, memory, workers)
        try:
            self.sock = connect(self.path)
        except OSError as exc:
            raise ServerGone(f"no globalloader server answers at {self.path}") from exc
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._last_heard = time.monotonic()
        self._gone: str | None = None
        threading.Thread(target=self._read, daemon=True, name="globalloader-client-read").start()
        threading.Thread(target=self._beat, daemon=True, name="globalloader-client-beat").start()

    def _read(self) -> None:
        try:
            while True:
                msg = protocol.recv(self.sock)
                self._last_heard = time.monotonic()
                if msg[0] != "heartbeat":
                    self._inbox.put(msg)
        except (EOFError, OSError) as exc:
            if not self._closed.is_set():
                self._gone = f"the connection to the server at {self.path} closed ({exc})"
                self._inbox.put(("gone",))

    def _beat(self) -> None:
        while not self._closed.wait(protocol.HEARTBEAT_S):
            try:
                self.send("heartbeat")
            except ServerGone:
                return

    def send(self, *msg: Any) -> None:
        try:
            with self._send_lock:
                protocol.send(self.sock, *msg)
        except OSError as exc:
            raise ServerGone(f"the globalloader server at {self.path} is gone: {exc}") from exc

    def get(self, timeout: float | None = None) -> tuple:
        """The next message; ServerGone if the server closed or went silent."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._gone:
                raise ServerGone(self._gone)
            try:
                msg = self._inbox.get(timeout=0.25)
            except queue.Empty:
                if time.monotonic() - self._last_heard > protocol.SILENCE_S:
                    self._gone = f"the globalloader server at {self.path} sent nothing for {protocol.SILENCE_S:.0f} s"
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("no message from the server") from None
                continue
            if msg[0] == "gone":
                raise ServerGone(self._gone or "the globalloader server is gone")
            return msg

    def get_nowait(self) -> tuple | None:
        """The next message if one has arrived, else None."""
        if self._gone:
            raise ServerGone(self._gone)
        try:
            msg = self._inbox.get_nowait()
        except queue.Empty:
            return None
        if msg[0] == "gone":
            raise ServerGone(self._gone or "the globalloader server is gone")
        return msg

    def close(self) -> None:
        if self._closed.is_set():
            return
        try:
            self.send("bye")
        except ServerGone:
            pass
        self._closed.set()
        try:
            self.sock.close()
        except OSError:
            pass
