"""The worker processes of one DataLoader iterator: start, send tasks, receive batches, stop.

Each worker has a duplex pipe: index batches go out, few-hundred-byte messages come back, and
the batches themselves come through shared memory (`transport.segments`). Segments the consumer has
released travel back to their writer with that worker's next task. A worker that dies is noticed
through its process sentinel within a second and reported as `WorkerDied`, naming its pid and
signal; `close` stops workers politely, kills those that do not stop, and unlinks any segment
left behind.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from globalloader.errors import WorkerError
from globalloader.torch.worker import WorkerSpec, worker_main
from globalloader.transport.names import remove_leftovers
from globalloader.transport.segments import BatchReader

_POLL = 1.0  # seconds between liveness checks while waiting
_STOP_GRACE = 5.0  # seconds workers get to stop before they are killed


class WorkerDied(WorkerError, RuntimeError):
    """A DataLoader worker process ended without being asked to (killed, crashed, exited)."""


class LoaderTimeout(WorkerError, RuntimeError):
    """No batch arrived within the DataLoader's `timeout`."""


class WorkerPool:
    """`num_workers` processes started from `context`, each with its copy of `spec.dataset`."""

    def __init__(
        self,
        spec: WorkerSpec,
        context: Any,
        base_seed: int,
        shared_seed: int | None,
        rng: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """`rng[w]`: the RNG states worker `w` starts its first task from (None: as seeded)."""
        self.owner = os.getpid()  # a forked child inherits this object: only the owner may stop it
        self.prefix = f"gl-{self.owner}-t{id(self) & 0xFFFFFF:x}-"
        self.reader = BatchReader()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.freed: list[deque[str]] = [deque() for _ in range(spec.num_workers)]
        self.stopped: set[int] = set()  # workers told to stop (they may exit without alarm)
        try:
            for w in range(spec.num_workers):
                ours, theirs = context.Pipe(duplex=True)
                proc = context.Process(
                    target=worker_main,
                    args=(
                        spec,
                        theirs,
                        w,
                        base_seed,
                        shared_seed,
                        f"{self.prefix}{w}-",
                        self.owner,
                        None if rng is None else rng[w],
                    ),
                    daemon=True,
                    name=f"globalloader-torch-worker-{w}",
                )
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def send(self, worker: int, op: str, generation: int, number: int, payload: Any) -> None:
        """Queue a task (or a reset) on one worker, with the segments released since its last one."""
        freed, released = [], self.freed[worker]
        while released:
            freed.append(released.popleft())
        try:
            self.conns[worker].send((op, generation, number, payload, freed))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.raise_if_dead()
            raise

    def receive(self, timeout: float) -> tuple[int, tuple]:
        """(worker, reply) for the next reply of any worker; `timeout` <= 0 waits for ever.

        Raises WorkerDied when a worker ended unasked, LoaderTimeout when nothing came in time.
        """
        deadline = time.monotonic() + timeout if timeout > 0 else None
        live = [c for w, c in enumerate(self.conns) if w not in self.stopped]
        while True:
            ready = wait(live, timeout=0)
            if not ready:
                remaining = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
                ready = wait(live, timeout=max(0.0, remaining))
            if ready:
                worker = self.conns.index(ready[0])  # type: ignore[arg-type]
                try:
                    return worker, pickle.loads(self.conns[worker].recv_bytes())
                except (EOFError, OSError) as exc:
                    self.raise_if_dead(wait_for=worker)
                    raise WorkerDied(f"DataLoader worker (pid {self.procs[worker].pid}) closed its pipe") from exc
            self.raise_if_dead()
            if deadline is not None and time.monotonic() >= deadline:
                raise LoaderTimeout(
                    f"DataLoader timed out after {timeout:g} seconds waiting for a batch from "
                    f"{len(live)} worker(s); raise timeout= (0 waits for ever) if the dataset is this slow"
                )

    def raise_if_dead(self, wait_for: int | None = None) -> None:
        """Raise WorkerDied if any worker not told to stop has ended."""
        if wait_for is not None:
            self.procs[wait_for].join(timeout=_POLL)  # its pipe closed: let it finish dying
        for w, proc in enumerate(self.procs):
            if w not in self.stopped and proc.exitcode is not None:
                raise WorkerDied(_death(proc))

    def stop(self, worker: int) -> None:
        """Let one worker go (its iterable is exhausted); it exits cleanly."""
        if worker not in self.stopped:
            self.stopped.add(worker)
            with contextlib.suppress(OSError):
                self.conns[worker].send(None)

    def close(self) -> None:
        """Stop every worker (killing any that has not stopped in a few seconds), unlink leftovers.

        Does nothing in any process but the one that started the pool: a process forked later (a
        worker of another iterator) holds a copy of this object, and its garbage collector may
        finalize that copy; stopping, joining or unlinking from there would reach into the
        owner's workers and shared memory.
        """
        if os.getpid() != self.owner:
            return
        for w in range(len(self.conns)):
            self.stop(w)
        deadline = time.monotonic() + _STOP_GRACE
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=_STOP_GRACE)
        for conn in self.conns:
            conn.close()
        self.reader.close()
        remove_leftovers(self.prefix)


def _death(proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            name = signal.strsignal(-code) or signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"DataLoader worker (pid {proc.pid}) is killed by signal: {name}. The dataset code crashed "
            "the worker (or it was killed, e.g. out of memory); run with num_workers=0 to see where"
        )
    return (
        f"DataLoader worker (pid {proc.pid}) exited unexpectedly with exit code {code}; "
        "run with num_workers=0 to see where"
    )
