"""Worker pools that run a plan's tasks: persistent processes, threads, or the calling thread.

All pools share one protocol: `submit(worker, task)` queues a task on one worker and
`result(worker)` returns that worker's next result, in submission order. The Loader assigns tasks
round-robin, so reading results worker by worker yields them in task order.

Process workers are started once and live across epochs. Each has a duplex pipe for small
messages; batches come back through shared memory (`execution.shm`). A worker that dies is
noticed through its process sentinel and reported as a WorkerError within a second; a worker
whose parent died exits by itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, cast

from globalloader.dataset.cache import MISSING
from globalloader.dataset.plan import Plan, Timer
from globalloader.errors import LoaderTimeoutError, TransformError, WorkerError
from globalloader.transport.arena import attach
from globalloader.transport.names import PREFIX, remove_leftovers
from globalloader.transport.process import exit_reason, orphaned, single_threaded_torch, tune_allocator
from globalloader.transport.segments import BatchReader, BatchWriter

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext


class Task(NamedTuple):
    epoch: int
    number: int
    items: Any  # source indices (ndarray), (index, record) pairs (see Plan.run_task), or None: the task's own
    first_map: int | None = None  # items are (index, record) pairs whose records went through these maps
    arena: str | None = None  # items are (index, offset, layout) tickets into this arena


class Result(NamedTuple):
    number: int
    output: Any
    skipped: list[tuple[int, str]]
    timer: Timer  # stage -> [items, busy seconds] since the worker's previous result
    idle: float  # seconds the worker waited for this task


class _RemoteTraceback(Exception):
    """Carries a worker's traceback text as the cause of the re-raised error."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def _raise_remote(exc: BaseException, tb: str) -> NoReturn:
    exc.__cause__ = _RemoteTraceback(tb)
    raise exc


def _run(plan: Plan, task: Task, skip_errors: bool, timer: Timer, deferred: bool = False) -> Any:
    items = task.items  # None: the task's own indices, which the plan computes
    if task.arena is not None:  # global loader tickets: read the shared prefix's output in place
        memory = attach(task.arena)  # items without an offset are computed here from scratch
        items = [(i, MISSING if offset is None else memory.read(offset, layout)) for i, offset, layout in items]
    return plan.run_task(task.epoch, task.number, items, skip_errors, timer, task.first_map, deferred)


class InlinePool:
    """workers=0: each task runs in the calling thread when its result is asked for."""

    def __init__(self, plan: Plan, skip_errors: bool) -> None:
        self._plan, self._skip = plan, skip_errors
        self._tasks: deque[Task] = deque()

    def submit(self, worker: int, task: Task) -> None:
        self._tasks.append(task)

    def result(self, worker: int) -> Result:
        task = self._tasks.popleft()
        timer: Timer = {}
        res = _run(self._plan, task, self._skip, timer)
        return Result(task.number, res.output, res.skipped, timer, 0.0)

    def close(self) -> None:
        self._tasks.clear()


class ThreadPool:
    """mode="thread": one thread per worker; results are passed by reference (no copies)."""

    def __init__(self, plan: Plan, skip_errors: bool, workers: int, timeout: float = 300.0) -> None:
        self._timeout = timeout
        self._inbox: list[queue.SimpleQueue[Task | None]] = [queue.SimpleQueue() for _ in range(workers)]
        # a result, or the exception a task raised with its traceback text
        self._outbox: list[queue.SimpleQueue[Result | tuple[BaseException, str]]] = [
            queue.SimpleQueue() for _ in range(workers)
        ]
        self._threads = [
            threading.Thread(target=self._loop, args=(plan, skip_errors, w), daemon=True, name=f"globalloader-{w}")
            for w in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, plan: Plan, skip_errors: bool, w: int) -> None:
        while True:
            t0 = time.perf_counter()
            task = self._inbox[w].get()
            if task is None:
                return
            idle = time.perf_counter() - t0
            timer: Timer = {}
            try:
                res = _run(plan, task, skip_errors, timer)
                self._outbox[w].put(Result(task.number, res.output, res.skipped, timer, idle))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
                self._outbox[w].put((exc, traceback.format_exc()))

    def submit(self, worker: int, task: Task) -> None:
        self._inbox[worker].put(task)

    def result(self, worker: int) -> Result:
        try:
            out = self._outbox[worker].get(timeout=self._timeout)
        except queue.Empty:
            raise LoaderTimeoutError(
                f"worker thread {worker} produced nothing for {self._timeout:.0f} s (Loader(timeout=)); a thread "
                "cannot be stopped, so this Loader's threads may still be busy: close it"
            ) from None
        if isinstance(out, tuple) and not isinstance(out, Result):
            _raise_remote(*out)
        return out

    def close(self) -> None:
        for box in self._inbox:
            box.put(None)
        for t in self._threads:
            t.join(timeout=5)


def _process_main(plan: Any, skip_errors: bool, conn: Connection, prefix: str, parent: int) -> None:
    """A worker process: run tasks from `conn`, write outputs to shared memory, send messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    # A SIGTERM handler the consumer installed (Lightning logs and goes on) must not keep a worker
    # alive: multiprocessing ends daemonic workers at exit with SIGTERM and then waits for them.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    tune_allocator()
    single_threaded_torch()
    if isinstance(plan, bytes):
        plan = pickle.loads(plan)
    writer = BatchWriter(prefix)
    try:
        while True:
            t0 = time.perf_counter()
            while not conn.poll(1.0):
                if orphaned(parent):
                    return
            msg = conn.recv()
            if msg is None:
                return
            task, freed = msg
            writer.free(freed)
            idle = time.perf_counter() - t0
            timer: Timer = {}
            try:
                res = _run(plan, task, skip_errors, timer, deferred=True)
                t1 = time.perf_counter()
                payload = None if res.output is None else writer.write(res.output)
                timer["transport"] = [1, time.perf_counter() - t1]
                conn.send(Result(task.number, payload, res.skipped, timer, idle))
            except Exception as exc:  # noqa: BLE001 - whatever the chain raised is sent back to the consumer
                tb = traceback.format_exc()
                try:
                    pickle.dumps(exc)
                except Exception:  # noqa: BLE001 - any failure to pickle means it cannot cross the pipe
                    exc = TransformError(f"{type(exc).__name__}: {exc}")
                conn.send((exc, tb))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        writer.close()


class ProcessPool:
    """mode="process": persistent worker processes, batches returned through shared memory."""

    def __init__(self, plan: Plan, skip_errors: bool, workers: int, start_method: str, timeout: float) -> None:
        # every start method's context has Process; typeshed's BaseContext (any `str`) does not declare it
        ctx = cast("ForkContext | SpawnContext | ForkServerContext", mp.get_context(start_method))
        self._timeout = timeout
        self._reader = BatchReader()
        self._prefix = f"{PREFIX}{os.getpid()}-{id(self) & 0xFFFFFF:x}-"
        self._freed: list[deque[str]] = [deque() for _ in range(workers)]  # segments the consumer released
        self._queued: list[deque[Task]] = [deque() for _ in range(workers)]  # sent, no result yet
        payload: Any = plan
        if start_method != "fork":
            import cloudpickle  # lambdas and local functions must reach a fresh interpreter

            payload = cloudpickle.dumps(plan)
        self._conns, self._procs = [], []
        for w in range(workers):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_process_main,
                args=(payload, skip_errors, theirs, f"{self._prefix}{w}-", os.getpid()),
                daemon=True,
                name=f"globalloader-worker-{w}",
            )
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    def submit(self, worker: int, task: Task) -> None:
        freed, dq = [], self._freed[worker]
        while dq:
            freed.append(dq.popleft())
        self._queued[worker].append(task)
        try:
            self._conns[worker].send((task, freed))
        except (BrokenPipeError, OSError):
            self._raise_dead(worker)

    def result(self, worker: int) -> Result:
        conn, proc = self._conns[worker], self._procs[worker]
        deadline = time.monotonic() + self._timeout
        while not conn.poll():
            wait([conn, proc.sentinel], timeout=1.0)
            if not conn.poll() and not proc.is_alive():
                self._raise_dead(worker)
            if time.monotonic() > deadline:
                raise LoaderTimeoutError(
                    f"worker {worker} (pid {proc.pid}) sent nothing for {self._timeout:.0f} s "
                    f"while running task {self._queued[worker][0].number}: raise Loader(timeout=) "
                    "for slow chains"
                )
        try:
            out = conn.recv()
        except (EOFError, OSError):
            self._raise_dead(worker)
        self._queued[worker].popleft()
        if not isinstance(out, Result):
            _raise_remote(*out)
        if out.output is not None:
            release = self._freed[worker].append
            out = out._replace(output=self._reader.read(out.output, release))
        return out

    def _raise_dead(self, worker: int) -> None:
        proc, queued = self._procs[worker], self._queued[worker]
        task = queued[0] if queued else None
        proc.join(timeout=1.0)
        where = f" while running task {task.number} of epoch {task.epoch}" if task else ""
        raise WorkerError(f"worker {worker} (pid {proc.pid}) {exit_reason(proc.exitcode)}{where}")

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._reader.close()
        remove_leftovers(self._prefix)
