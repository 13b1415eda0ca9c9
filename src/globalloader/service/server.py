"""The global loader server: one per socket (per machine and user), many training jobs as clients.

A `Server` is two parts on one selector in one thread: the connection I/O (`connections`:
accept, frame, queue and send) and the scheduler (`scheduler`: jobs, groups, draws, loads),
with the sample store in a shared-memory arena and the decode workers (`decoder`). The main loop
waits for events (client sockets, worker pipes), runs them, lets the jobs that asked draw, and
sends what is due, one frame per client (tickets wait a few milliseconds for company). A
failure while serving a job is sent to that job as a named error; the server and the other
jobs go on.
"""

from __future__ import annotations

import argparse
import math
import os
import selectors
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from globalloader.errors import GlobalLoaderError, ServerStartError
from globalloader.service import launcher, protocol
from globalloader.service.connections import Connection, Connections, log
from globalloader.service.decoder import Decoders
from globalloader.service.scheduler import Scheduler
from globalloader.storage import import_clients
from globalloader.storage.cache import ObjectCache, default_root
from globalloader.transport import arena

CHECK_S = 0.25  # how often liveness, deadlines and idleness are checked


class Server:
    """The connection I/O and the scheduler on one selector, over one arena and its decoders."""

    def __init__(self, socket_path: Path, memory: int, workers: int, idle_exit: float = 0.0) -> None:
        """Bind `socket_path` (whose lock the caller holds), then make the arena and workers."""
        self.socket_path = Path(socket_path)
        self.idle_exit = idle_exit
        # Before the decode workers fork (none, nor a restarted one, imports them on its first
        # remote load) and before the socket answers (a job connecting finds the server ready).
        import_clients()
        self._selector = selectors.DefaultSelector()
        self.io = Connections(self.socket_path, self._selector, self._handle, self._drop)
        try:
            self.arena = arena.create(memory)
        except BaseException:
            self.io.close_listener()
            raise
        self._running = True
        self.started = time.time()
        self.scheduler = Scheduler(
            self.io,
            self.arena.id,
            memory,
            lambda events: Decoders(workers, self.arena.id, events, self._register_pipe, self.io.unregister),
        )

    def _register_pipe(self, conn: Any, callback: Callable[[], None]) -> None:
        self._selector.register(conn, selectors.EVENT_READ, lambda _: callback())

    def _handle(self, conn: Connection, msg: tuple) -> None:
        kind = msg[0]
        if kind == "status":
            self.io.send(conn, "report", self.status())
            self.io.end(conn, None)
        elif kind == "stop":
            self.io.send(conn, "stopping")
            self._running = False
        else:
            self.scheduler.handle(conn, msg)

    def _drop(self, conn: Connection, why: str | None) -> None:
        self.scheduler.drop(conn.job, why)

    def status(self) -> dict[str, Any]:
        scheduler, decoders = self.scheduler, self.scheduler.decoders
        requests, decodes = scheduler.requests, scheduler.decodes
        report: dict[str, Any] = {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "jobs": [scheduler.job_status(job) for job in scheduler.jobs.values()],
            "finished": scheduler.finished,
            "pool": scheduler.store.stats(),
            "requests": requests,
            "decodes": decodes,
            "decodes_saved": requests - decodes,
            "workers": decoders.size,
            "worker_restarts": decoders.restarts,
            "decode_s": round(decoders.decode_s, 3),
            "space_requests": decoders.space_requests,
        }
        cache = _object_cache_status()
        if cache is not None:
            report["cache"] = cache
        return report

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_running", False))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_running", False))
        last_check = time.monotonic()
        timeout = CHECK_S
        try:
            while self._running:
                for key, mask in self._selector.select(timeout=timeout):
                    try:
                        key.data(mask)
                    except Exception as exc:  # noqa: BLE001 - never let one event end the server
                        log(f"internal error: {type(exc).__name__}: {exc}")
                        traceback.print_exc(file=sys.stderr)
                now = time.monotonic()
                if now - last_check > CHECK_S:
                    last_check = now
                    self._check(now)
                self.scheduler.draw()
                self.scheduler.decoders.send()
                due = self.io.post_all(self.scheduler.settled)
                timeout = CHECK_S if due is None else min(CHECK_S, due)
        finally:
            self.close()

    def _check(self, now: float) -> None:
        """Connections, decode workers and idleness, every CHECK_S."""
        self.io.check()
        self.scheduler.sample_rates()
        self.scheduler.decoders.check()
        if self.idle_exit and not self.scheduler.jobs and now - self.scheduler.idle_since > self.idle_exit:
            log(f"no jobs for {self.idle_exit:.0f} s; exiting")
            self._running = False

    def close(self) -> None:
        self.io.close_all()
        self.scheduler.decoders.close()
        self.arena.close()


def _object_cache_status() -> dict[str, Any] | None:
    """The machine's object cache (bytes downloaded, hits, size...) when its folder exists: one
    read of its counters' record, never a walk of the folder."""
    try:
        root = default_root(create=False)
        if not root.is_dir():
            return None
        return dict(ObjectCache(root).status())
    except GlobalLoaderError as exc:  # a locked record, a bad GLOBALLOADER_CACHE_LIMIT, a folder refused
        return {"error": str(exc)}


def main(argv: list[str] | None = None) -> int:
    """Run a server in this process (what `globalloader serve` and auto-start call)."""
    parser = argparse.ArgumentParser(prog="globalloader serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--memory", default="2G", help="buffer pool size in /dev/shm, e.g. 512M, 4G")
    parser.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 2), help="decode workers")
    parser.add_argument(
        "--socket", help="socket path (default: $GLOBALLOADER_SOCKET, else server.sock in the user's runtime folder)"
    )
    parser.add_argument(
        "--idle-exit", type=float, default=0.0, help="exit after this many seconds with no jobs (0: never)"
    )
    args = parser.parse_args(argv)
    path = Path(args.socket) if args.socket else protocol.default_socket()
    memory = launcher.parse_size(args.memory)
    if args.workers < 1:
        raise ServerStartError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.idle_exit < math.inf:
        raise ServerStartError(f"--idle-exit must be a number of seconds >= 0 (0: never), got {args.idle_exit}")
    lock = launcher.own_socket(path)
    if lock is None:
        log(f"another server owns {path}; exiting")
        return launcher.LOST_RACE
    launcher.clear_leftovers(path)
    server = Server(path, memory, args.workers, args.idle_exit)
    log(f"pid {os.getpid()}, socket {path}, pool {args.memory}, {args.workers} workers")
    server.serve_forever()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GlobalLoaderError as exc:  # started detached by a Loader: one line in the log
        cause = f" (cause: {exc.__cause__})" if exc.__cause__ else ""
        sys.exit(f"globalloader server: {exc}{cause}")
