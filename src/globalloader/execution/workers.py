"""The Loader's worker sets that run a plan's tasks: persistent processes, threads, or the calling thread.

All sets share one protocol (`execution.window.WorkerSet`): `submit(worker, task)` queues a task
on one worker and `result(worker)` returns that worker's next result, in submission order; the
task window (`execution.window`) assigns tasks round-robin and reads results in task order.
Process workers live across epochs; `runtime.WorkerPool` owns their life and this module gives
them their body.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import threading
import time
import traceback
from collections import deque
from typing import Any, NamedTuple, cast

from globalloader.dataset.cache import MISSING
from globalloader.dataset.plan import Plan, Timer
from globalloader.errors import UNPICKLABLE, LoaderTimeoutError, TransformError, unsendable
from globalloader.runtime.pool import Worker, WorkerPool, failure, raised_again
from globalloader.transport.arena import ArenaId, attach


class Task(NamedTuple):
    epoch: int
    number: int
    items: Any  # source indices (ndarray), (index, record) pairs (see Plan.run_task), or None: the task's own
    first_map: int | None = None  # items are (index, record) pairs whose records went through these maps
    arena: ArenaId | None = None  # items are (index, offset, layout) tickets into this arena


class Result(NamedTuple):
    number: int
    output: Any
    skipped: list[tuple[int, str]]
    timer: Timer  # stage -> [items, busy seconds] since the worker's previous result
    idle: float  # seconds the worker waited for this task


def _run(
    plan: Plan, task: Task, skip_errors: bool, idle: float = 0.0, deferred: bool = False, sendable: bool = False
) -> Result:
    items = task.items  # None: the task's own indices, which the plan computes
    if task.arena is not None:  # global loader tickets: read the shared prefix's output in place
        memory = attach(task.arena)  # items without an offset are computed here from scratch
        items = [(i, MISSING if offset is None else memory.read(offset, layout)) for i, offset, layout in items]
    timer: Timer = {}
    res = plan.run_task(task.epoch, task.number, items, skip_errors, timer, task.first_map, deferred, sendable)
    return Result(task.number, res.output, res.skipped, timer, idle)


class InlineWorkers:
    """workers=0: each task runs in the calling thread when its result is asked for."""

    def __init__(self, plan: Plan, skip_errors: bool) -> None:
        self._plan, self._skip = plan, skip_errors
        self._tasks: deque[Task] = deque()

    def submit(self, worker: int, task: Task) -> None:
        self._tasks.append(task)

    def result(self, worker: int) -> Result:
        return _run(self._plan, self._tasks.popleft(), self._skip)

    def close(self) -> None:
        self._tasks.clear()


class ThreadWorkers:
    """mode="thread": one thread per worker; results are passed by reference (no copies)."""

    def __init__(self, plan: Plan, skip_errors: bool, workers: int, timeout: float) -> None:
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
            try:
                self._outbox[w].put(_run(plan, task, skip_errors, time.perf_counter() - t0))
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
            raise raised_again(*out)
        return out

    def close(self) -> None:
        for box in self._inbox:
            box.put(None)
        for t in self._threads:
            t.join(timeout=5)


class _TaskBody:
    """A process worker's body: run a plan's tasks, write their outputs to shared memory.

    The plan is cloudpickled for spawned workers: lambdas and local functions must reach a fresh
    interpreter; forked workers take it as it is.
    """

    def __init__(self, plan: Plan | bytes, skip_errors: bool) -> None:
        self._plan, self._skip = plan, skip_errors

    def setup(self, worker: Worker) -> None:
        if isinstance(self._plan, bytes):
            self._plan = pickle.loads(self._plan)
        self._idle_since = time.perf_counter()

    def run(self, worker: Worker, task: Task) -> None:
        idle = time.perf_counter() - self._idle_since
        plan = cast(Plan, self._plan)
        try:
            res = _run(plan, task, self._skip, idle, deferred=True)
            try:
                _send(worker, res)
            except UNPICKLABLE as exc:  # pickle's error: the source's or a map's are raised by _run
                if plan.is_stream and task.arena is None:  # a stream's records are not read twice
                    names = ", ".join(repr(m.name) for m in plan.maps)
                    made_by = "the stream's records" + (f" through the maps {names}" if names else "")
                    raise _unsendable(plan, task, exc, made_by) from None
                # The task runs again checking each sample, so the error names the sample and the
                # map that made it (or, with on_error="skip", the sample is skipped as for any
                # failure of its own). Its maps run twice, only here: its records are read again.
                res = _run(plan, task, self._skip, idle, deferred=True, sendable=True)
                try:
                    _send(worker, res)
                except UNPICKLABLE as exc:  # every sample pickles: the batch itself does not
                    made_by = f"map {plan.batch_maps[-1].name!r}" if plan.batch_maps else "the batch's collate"
                    raise _unsendable(plan, task, exc, made_by) from None
        except Exception as exc:  # noqa: BLE001 - whatever the chain raised is sent back to the consumer
            worker.send(failure(exc, TransformError))
        self._idle_since = time.perf_counter()


def _unsendable(plan: Plan, task: Task, exc: BaseException, made_by: str) -> TransformError:
    what = "batch" if plan.batch is not None else "task"
    return TransformError(
        unsendable(
            f"{made_by} returned, for {what} {task.number} of epoch {task.epoch}, a value a worker process cannot send",
            exc,
        )
    )


def _send(worker: Worker, res: Result) -> None:
    """Send a task's result, its output packed (arrays in shared memory); one of `UNPICKLABLE`,
    with nothing sent, if a value in it cannot be pickled."""
    t1 = time.perf_counter()
    packed = None if res.output is None else worker.pack(res.output)
    res.timer["transport"] = [1, time.perf_counter() - t1]
    worker.send(res._replace(output=packed), packed)


class ProcessWorkers:
    """mode="process": persistent worker processes (`runtime.WorkerPool`), batches returned
    through shared memory."""

    def __init__(self, plan: Plan, skip_errors: bool, workers: int, start_method: str, timeout: float) -> None:
        payload: Plan | bytes = plan
        if start_method != "fork":
            import cloudpickle

            payload = cloudpickle.dumps(plan)
        context = mp.get_context(start_method)
        self._pool = WorkerPool(_TaskBody(payload, skip_errors), workers, context, timeout, setting="Loader(timeout=)")
        self._queued: list[deque[Task]] = [deque() for _ in range(workers)]  # sent, no result yet

    def submit(self, worker: int, task: Task) -> None:
        self._queued[worker].append(task)
        running = self._queued[worker][0]
        self._pool.send(worker, task, f" while running task {running.number} of epoch {running.epoch}")

    def result(self, worker: int) -> Result:
        task = self._queued[worker][0]
        out = self._pool.receive(worker, f" while running task {task.number} of epoch {task.epoch}")
        self._queued[worker].popleft()
        if not isinstance(out, Result):
            raise raised_again(*out)
        if out.output is not None:
            out = out._replace(output=self._pool.unpack(worker, out.output))
        return out

    def close(self) -> None:
        self._pool.close()
