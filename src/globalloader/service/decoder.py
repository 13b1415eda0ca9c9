"""The server's worker processes: read and run a group's shared prefix, write into the arena.

A load is a short conversation on the worker's pipe: the server sends `load`; the worker runs
the prefix (source read + shared maps), asks the server to `reserve` the bytes it needs, waits
for the offset (the pool may first have to evict, or wait for releases), copies the sample in
and reports `done` with its layout, or `failed` with a one-line reason. Each worker keeps the
prefixes it has been sent, so a chain is unpickled once per worker, not once per sample.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from globalloader.execution.workers import _tune_allocator
from globalloader.service import arena
from globalloader.service.pool import SampleTooLarge
from globalloader.service.protocol import POOL_TOO_SMALL, STALL_S

if TYPE_CHECKING:
    from globalloader.service.server import Server


def _decoder_main(conn: Connection, arena_name: str, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _tune_allocator()
    memory = arena.attach(arena_name)
    prefixes: dict[str, Any] = {}
    backlog: deque[tuple] = deque()  # messages that arrived while waiting for an offset

    def receive() -> tuple | None:
        if backlog:
            return backlog.popleft()
        while not conn.poll(1.0):
            if os.getppid() != parent:
                return None
        try:
            return conn.recv()
        except EOFError:
            return None

    while (msg := receive()) is not None:
        if msg[0] == "prefix":
            try:
                prefixes[msg[1]] = pickle.loads(msg[2])
            except Exception as exc:  # every load of this chain then fails with the reason
                prefixes[msg[1]] = f"the server cannot unpickle this job's shared prefix: {type(exc).__name__}: {exc}"
            continue
        _, fp, index, guess = msg  # guess: (offset, bytes) reserved ahead, or None
        t0 = time.perf_counter()
        try:
            if isinstance(prefixes[fp], str):
                raise RuntimeError(prefixes[fp])
            sample = prefixes[fp].prefix_sample(index)
            layout, placed = arena.encode(sample)
            if guess is not None and layout[0] <= guess[1]:
                memory.write(guess[0], placed)  # the usual case: no round trip to the server
                conn.send(("done", fp, index, layout, time.perf_counter() - t0))
                continue
            conn.send(("reserve", fp, index, layout[0]))
            while True:
                reply = conn.recv()
                if reply[0] in ("at", "abort"):
                    break
                backlog.append(reply)
            if reply[0] == "abort":
                conn.send(("failed", fp, index, reply[1]))
                continue
            memory.write(reply[1], placed)
            conn.send(("done", fp, index, layout, time.perf_counter() - t0))
        except Exception as exc:
            conn.send(("failed", fp, index, f"{type(exc).__name__}: {exc}"))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    prefixes: set[str] = field(default_factory=set)
    loads: list[tuple[str, int]] = field(default_factory=list)  # in flight, oldest first


class DecoderPool:
    """Starts, feeds and watches the decode workers for a `Server`."""

    def __init__(self, size: int, server: "Server") -> None:
        self.size, self._server = size, server
        self._ctx = mp.get_context("fork")
        self._workers = [self._start() for _ in range(size)]
        self._waiting_space: deque[tuple[_Worker, str, int, int]] = deque()
        self._space_progress = time.monotonic()  # last time pool space was granted or released
        self._sizes: dict[str, int] = {}  # largest sample each prefix produced: the next guess
        self.decode_s = 0.0

    def _start(self) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_decoder_main, args=(theirs, self._server.arena.name, os.getpid()),
            daemon=True, name="globalloader-decoder",
        )
        proc.start()
        theirs.close()
        worker = _Worker(proc, ours)
        self._server._selector.register(ours, 1, lambda _: self._message(worker))
        return worker

    def load(self, fp: str, prefix: bytes, index: int) -> None:
        worker = min(self._workers, key=lambda w: len(w.loads))
        if fp not in worker.prefixes:
            worker.conn.send(("prefix", fp, prefix))
            worker.prefixes.add(fp)
        # Reserve the largest size this chain produced so far, so the worker can write without
        # asking; a bigger sample falls back to asking (the guess is given back first).
        size = self._sizes.get(fp)
        offset = None if size is None else self._server.pool.reserve((fp, index), size)
        worker.conn.send(("load", fp, index, None if offset is None else (offset, size)))
        worker.loads.append((fp, index))

    def _message(self, worker: _Worker) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            self._replace(worker, "died")
            return
        kind, fp, index = msg[:3]
        if kind == "reserve":
            self._sizes[fp] = max(self._sizes.get(fp, 0), msg[3])
            if (fp, index) in self._server.pool:
                self._server.pool.abort((fp, index))  # the guess was too small
            self._reserve(worker, fp, index, msg[3])
            return
        worker.loads.remove((fp, index))
        if kind == "done":
            self.decode_s += msg[4]
            self._sizes[fp] = max(self._sizes.get(fp, 0), msg[3][0])
            self._server.pool.shrink((fp, index), msg[3][0])
            self._server.loaded(fp, index, msg[3])
        else:
            if (fp, index) in self._server.pool and not self._server.pool.get((fp, index)).ready:
                self._server.pool.abort((fp, index))
            self._server.failed(fp, index, f"sample {index}: {msg[3]}")

    def _reserve(self, worker: _Worker, fp: str, index: int, nbytes: int) -> None:
        try:
            offset = self._server.pool.reserve((fp, index), nbytes)
        except SampleTooLarge as exc:
            worker.conn.send(("abort", str(exc)))
            return
        if offset is None:
            self._waiting_space.append((worker, fp, index, nbytes))
        else:
            self._space_progress = time.monotonic()
            worker.conn.send(("at", offset))

    def retry_reservations(self, pool: Any) -> None:
        """Space was released: hand it to the loads waiting for it, oldest first."""
        self._space_progress = time.monotonic()
        while self._waiting_space:
            worker, fp, index, nbytes = self._waiting_space[0]
            offset = pool.reserve((fp, index), nbytes)
            if offset is None:
                return
            self._waiting_space.popleft()
            worker.conn.send(("at", offset))

    def check(self) -> None:
        for worker in list(self._workers):
            if not worker.process.is_alive():
                self._replace(worker, f"exited ({worker.process.exitcode})")
        if self._waiting_space and time.monotonic() - self._space_progress > STALL_S:
            self._fail_stalled()

    def _fail_stalled(self) -> None:
        """Nothing was released for STALL_S while a load waits for room: every job holds what it
        has and waits for more, which no release will ever bring. Fail that load loudly."""
        worker, fp, index, nbytes = self._waiting_space.popleft()
        capacity = self._server.pool.capacity
        worker.conn.send(("abort", (
            f"{POOL_TOO_SMALL}: its {capacity:,} bytes are all held by the jobs' batches in "
            f"progress and sample {index} ({nbytes:,} bytes) found no room for {STALL_S:.0f} s; "
            "start the server with more --memory (at least batch size x sample bytes x jobs, "
            "times prefetch + 1 to keep every job busy)"
        )))
        self._space_progress = time.monotonic()

    def _replace(self, worker: _Worker, why: str) -> None:
        """A decode worker died: fail its loads (only the jobs waiting for them see it), restart."""
        if worker not in self._workers:
            return
        self._workers.remove(worker)
        try:
            self._server._selector.unregister(worker.conn)
        except (KeyError, ValueError):
            pass
        worker.conn.close()
        self._waiting_space = deque(w for w in self._waiting_space if w[0] is not worker)
        for fp, index in worker.loads:
            entry = self._server.pool.get((fp, index))
            if entry is not None and not entry.ready:
                self._server.pool.abort((fp, index))
            self._server.failed(fp, index, f"sample {index}: the server's decode worker {why} while loading it")
        self._workers.append(self._start())

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)  # not just close: forked siblings hold copies of our ends
                worker.conn.close()
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=3)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=3)
        self._workers = []


