"""One pool of worker processes, whatever they run: the Loader's tasks, the DataLoader drop-in's
batches, the shared server's decodes.

A pool owns a worker's whole life, so a fix reaches every front door at once: start (a duplex
pipe each), death (seen at once through its pidfd: one `WorkerError` naming pid and signal or
exit code), timeout (`LoaderTimeoutError`), shared memory (`transport.segments`; released names
go back with the worker's next message), stop (politely, then killed) and parent death (the
worker unlinks its leftovers and exits, even while its task is stuck).

What a worker does is its *body*: `setup(worker)` once in the worker process, then
`run(worker, message)` for every message, replying through `worker.send`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import numpy as np

from globalloader._pids import alive
from globalloader.errors import LoaderTimeoutError, WorkerError
from globalloader.runtime.process import exit_reason, single_threaded_torch, tune_allocator
from globalloader.transport.codec import copy_arrays, decode_tree, encode_tree
from globalloader.transport.names import PREFIX, remove_leftovers, remove_orphans
from globalloader.transport.segments import BatchMessage, BatchReader, BatchWriter

_WATCH_PERIOD = 0.5  # seconds between a worker's checks that its owner is alive
STOP_GRACE = 5.0  # seconds workers get to stop before they are killed
# Batches with fewer array bytes travel inside the message: cheaper than a segment round trip, and
# a loop that keeps many small batches alive holds no mapping (nor file descriptor) per batch.
INLINE_BYTES = 64 << 10

# A batch on its way to the consumer: (None, segment message) or ((encoded tree, array bytes), None).
Packed = tuple[tuple[tuple, bytearray] | None, BatchMessage | None]


class RemoteTraceback(Exception):
    """Carries a worker's traceback text as the cause of the error raised again in the consumer."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def failure(exc: BaseException, fallback: type[Exception]) -> tuple[BaseException, str]:
    """(exception, traceback text) of the exception being handled, to send to the consumer: the
    exception itself when it crosses a pipe, else a `fallback` naming its type and message."""
    tb = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to pickle or unpickle means it cannot cross the pipe
        exc = fallback(f"{type(exc).__name__}: {exc}")
    return exc, tb


def raised_again(exc: BaseException, tb: str) -> BaseException:
    """A worker's exception, ready to raise in the consumer with its traceback text as the cause."""
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return exc


class Worker:
    """The worker's side of its pipe: its index, replies out, messages in, a shared-memory writer."""

    def __init__(self, index: int, conn: Connection, writer: BatchWriter) -> None:
        self.index, self._conn, self.writer = index, conn, writer

    def send(self, reply: Any, packed: Packed | None = None) -> None:
        """Send `reply`. If it cannot be pickled, nothing is sent, `packed` (the batch it carries)
        is taken back, and pickle's error is raised: one of `UNPICKLABLE`."""
        # plain pickle: torch registers reducers with multiprocessing's pickler that would move
        # tensors through file descriptors; here a reply is a few hundred bytes
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            if packed is not None and packed[1] is not None:
                self.writer.take_back(packed[1])
            raise
        self._conn.send_bytes(data)

    def pack(self, batch: Any) -> Packed:
        """`batch` ready to send: its arrays in a shared-memory segment, or inline when small."""
        tree, placed, nbytes = encode_tree(batch)
        if nbytes > INLINE_BYTES:
            return None, self.writer.write(batch)
        data = bytearray(nbytes)
        copy_arrays(data, 0, placed)
        return (tree, data), None

    def receive(self) -> Any:
        """The next message (also mid-task, for a body that converses). EOFError once told to stop."""
        msg = pickle.loads(self._conn.recv_bytes())
        if msg is None:
            raise EOFError
        message, freed = msg
        self.writer.free(freed)
        return message


class Body(Protocol):
    """What a worker runs; the object is handed to each worker process when it starts."""

    def setup(self, worker: Worker) -> None: ...
    def run(self, worker: Worker, message: Any) -> None: ...


def _worker_main(body: Body, conn: Connection, index: int, prefix: str, owner: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    # A SIGTERM handler the owner installed (Lightning logs and goes on) must not keep a worker
    # alive: multiprocessing ends daemonic workers at exit with SIGTERM and then waits for them.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    single_threaded_torch()  # before any torch op: the parent's thread pool did not survive the fork
    _exit_with_owner(owner, prefix)
    tune_allocator()
    worker = Worker(index, conn, BatchWriter(prefix))
    try:
        body.setup(worker)
        while True:
            body.run(worker, worker.receive())
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        return
    finally:
        worker.writer.close()


def _exit_with_owner(owner: int, prefix: str) -> None:
    """The one parent-death policy: a thread that ends this process once the pool's owner has died
    (or this process was re-parented), whatever the main thread is doing, after unlinking the
    segments it wrote that nobody will read. A thread, not PR_SET_PDEATHSIG: that fires when the
    *thread* that started the worker exits, and cannot clean up."""
    parent = os.getppid()
    try:  # readable the moment the owner ends: the worker goes at once (it may hold the owner's locks)
        owner_fd = [os.pidfd_open(owner)]
    except ProcessLookupError:
        owner_fd = []  # already gone
    except (AttributeError, OSError):  # before Linux 5.3: poll
        owner_fd = [-1]

    def watch() -> None:
        while owner_fd and os.getppid() == parent and alive(owner):
            if owner_fd[0] < 0:
                time.sleep(_WATCH_PERIOD)
            elif select.select(owner_fd, [], [], _WATCH_PERIOD)[0]:
                break
        remove_leftovers(prefix)
        os._exit(1)

    threading.Thread(target=watch, name="globalloader-watchdog", daemon=True).start()


class WorkerPool:
    """`n` processes started from `context` (a multiprocessing context), each running `body`.

    `timeout`: seconds `receive` waits for a reply (<= 0: for ever). `name` starts every error
    message ("worker", "DataLoader worker"); `setting` is what the user raises for slow work.
    Only the process that made the pool may stop it: a process forked later holds a copy.
    """

    def __init__(
        self, body: Body, n: int, context: Any, timeout: float, name: str = "worker", setting: str = "timeout="
    ) -> None:
        self.owner = os.getpid()
        self.prefix = f"{PREFIX}{self.owner}-{id(self) & 0xFFFFFF:x}-"
        remove_orphans()  # what jobs killed whole with their workers left in /dev/shm
        self.timeout, self.name, self._setting = timeout, name, setting
        self._body, self._context = body, context
        self.reader = BatchReader()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._ends: list[int] = []  # readable once worker w has ended (see _end_of)
        self.stopped: set[int] = set()  # told to stop: they may end without alarm
        self._freed: list[deque[str]] = [deque() for _ in range(n)]  # segments released, not yet sent back
        self._prefixes: list[str] = []  # worker w's segment names start with _prefixes[w]
        self._starts = 0
        self._closed = False
        try:
            for w in range(n):
                self._start(w)
        except BaseException:
            self.close()
            raise

    def _start(self, w: int) -> None:
        ours, theirs = self._context.Pipe(duplex=True)
        prefix = f"{self.prefix}{self._starts}-"  # never reused, even by a restarted worker
        self._starts += 1
        args = (self._body, theirs, w, prefix, self.owner)
        proc = self._context.Process(target=_worker_main, args=args, daemon=True, name=f"globalloader-{w}")
        proc.start()
        theirs.close()
        if w < len(self.conns):
            self.conns[w], self.procs[w], self._prefixes[w], self._ends[w] = ours, proc, prefix, _end_of(proc)
        else:
            self.conns.append(ours)
            self.procs.append(proc)
            self._prefixes.append(prefix)
            self._ends.append(_end_of(proc))
        self._freed[w].clear()

    def send(self, w: int, message: Any, doing: str = "") -> None:
        """Queue `message` on worker `w`, with the segments released since its last one."""
        freed, released = [], self._freed[w]
        while released:
            freed.append(released.popleft())
        try:
            self.conns[w].send_bytes(pickle.dumps((message, freed), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise self._died(w, doing) from None

    def receive(self, w: int, doing: str = "") -> Any:
        """Worker `w`'s next reply. `doing` (" while running task 3") ends the error messages."""
        conn = self.conns[w]
        if not conn.poll():  # the common case when results are ahead: no selector, no deadline
            self._wait([w], doing)
        return self.read(w, doing)

    def receive_any(self, doing: str = "") -> tuple[int, Any]:
        """(worker, reply) for the next reply of any worker not told to stop."""
        w = self._wait([w for w in range(len(self.conns)) if w not in self.stopped], doing)
        return w, self.read(w, doing)

    def _wait(self, workers: list[int], doing: str) -> int:
        """The first of `workers` with a reply; WorkerError if one ends first, LoaderTimeoutError
        once `timeout` passed."""
        if not workers:  # nothing could ever come: an error, not a wait for ever
            raise WorkerError(f"{self.name}: every worker was told to stop{doing}")
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        conns = {self.conns[w]: w for w in workers}
        ends = {self._ends[w]: w for w in workers}
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*conns, *ends], timeout=remaining)
            for obj in ready:
                if obj in conns:
                    return conns[obj]
            for obj in ready:  # no reply, and a worker ended
                if isinstance(obj, int):
                    raise self._died(ends[obj], doing)
            if deadline is not None and time.monotonic() >= deadline:
                pids = ", ".join(str(self.procs[w].pid) for w in workers)
                raise LoaderTimeoutError(
                    f"{self.name} (pid {pids}) timed out after {self.timeout:g} seconds{doing}; "
                    f"raise {self._setting} if the work is this slow"
                )

    def read(self, w: int, doing: str = "") -> Any:
        """Worker `w`'s next reply when its pipe is known to be readable (an event loop's selector
        said so): no poll, no deadline; WorkerError if it is readable because the worker died."""
        try:
            return pickle.loads(self.conns[w].recv_bytes())
        except (EOFError, OSError):
            raise self._died(w, doing) from None

    def _died(self, w: int, doing: str) -> WorkerError:
        proc = self.procs[w]
        proc.join(timeout=1.0)  # its pipe closed: let it finish dying
        return WorkerError(f"{self.name} (pid {proc.pid}) {exit_reason(proc.exitcode)}{doing}")

    def exited(self, w: int) -> str | None:
        """How worker `w` ended ("is killed by signal: ..."), or None while it runs."""
        code = self.procs[w].exitcode
        return None if code is None else exit_reason(code)

    def unpack(self, w: int, packed: Packed) -> Any:
        """The batch worker `w` packed; a segment goes back to `w` once its arrays are freed."""
        inline, message = packed
        if message is not None:
            return self.reader.read(message, self._freed[w].append)
        tree, data = inline  # type: ignore[misc]
        return decode_tree(tree, np.frombuffer(data, np.uint8))

    def discard(self, w: int, packed: Packed) -> None:
        """Drop a batch without unpacking it; a segment goes back to `w` at once."""
        if packed[1] is not None:
            name = self.reader.discard(packed[1])
            if name is not None:
                self._freed[w].append(name)

    def stop(self, w: int) -> None:
        """Let worker `w` go: it exits after its current message."""
        if w not in self.stopped:
            self.stopped.add(w)
            with contextlib.suppress(OSError):
                self.conns[w].send_bytes(pickle.dumps(None))

    def kill(self, w: int) -> None:
        """End worker `w` now (a stuck task); its death is then no surprise."""
        self.stopped.add(w)
        proc = self.procs[w]
        if proc.exitcode is None:
            proc.kill()
        proc.join(timeout=STOP_GRACE)

    def restart(self, w: int) -> None:
        """Kill worker `w` (if it runs), unlink what it left, start a fresh one in its place."""
        self.kill(w)
        self.conns[w].close()
        _close_end(self.procs[w], self._ends[w])
        remove_leftovers(self._prefixes[w])  # batches it wrote that nobody read
        self.stopped.discard(w)
        self._start(w)

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every worker, kill those still running after `grace` seconds, unlink leftovers."""
        if os.getpid() != self.owner or self._closed:
            return
        self._closed = True
        for w in range(len(self.conns)):
            self.stop(w)  # not just closing our end: workers forked later hold copies of it
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=STOP_GRACE)
        for conn in self.conns:
            conn.close()
        for proc, end in zip(self.procs, self._ends, strict=True):
            _close_end(proc, end)
        self.reader.close()
        remove_leftovers(self.prefix)


def _end_of(proc: Any) -> int:
    """A descriptor readable once `proc` has ended: its pidfd, or else its sentinel. The sentinel
    is a pipe, held open by any child the worker forked (the dataset's own processes), so only
    the pidfd tells the worker's own death while such a child lives."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # before Linux 5.3
        return int(proc.sentinel)


def _close_end(proc: Any, end: int) -> None:
    if end != proc.sentinel:
        os.close(end)
