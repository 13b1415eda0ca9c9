"""`Loader`: runs a Dataset chain in parallel workers with prefetch and exact mid-epoch resume.

Work is split into tasks (one batch each; chunks of samples for unbatched chains) assigned to
workers round-robin and yielded in task order. A task's output depends only on (chain, epoch,
task), so order and content are the same for any number of workers and either mode, and the
position (epoch, task, offset) is all a resume needs: whatever was prefetched is recomputed.

A position may instead name the samples already consumed this epoch (what a shared-mode run
records, see `execution.shared`); a local run then yields the epoch's order without them.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from typing import Any

import numpy as np

from globalloader.dataset.chain import Dataset
from globalloader.dataset.iterator import check_state, make_state
from globalloader.errors import ArgumentError, ServerGone
from globalloader.execution.shared import SharedRun, SharedSession, remaining_indices
from globalloader.execution.stats import LoaderStats, warn_skipped
from globalloader.execution.workers import InlinePool, ProcessPool, Task, ThreadPool

MODES = ("process", "thread")
ON_ERROR = ("raise", "skip")
SHARE = (False, True, "auto")
Position = tuple[int, int, int, "list[int] | None"]  # epoch, task, offset, consumed


class Loader:
    """Iterate `dataset` with `workers` processes (or threads), `prefetch` tasks in flight.

    Args:
        dataset: a `gl.Dataset` chain (usually ending in `.batch(n)`).
        workers: worker processes/threads; 0 runs everything in the iterating thread.
        mode: "process" (shared-memory transport) or "thread" (for GIL-releasing work).
        prefetch: tasks in flight across all workers (default 2 per worker).
        on_error: "raise" stops at the first bad sample; "skip" drops it, counts it in `stats()`
            and warns at the end of the epoch.
        timeout: seconds a worker may spend on one task before the Loader gives up on it.
        start_method: "fork" (fast start) or "spawn"/"forkserver" (chain sent with cloudpickle).
        share: True feeds this job from the machine's global loader server (started if none
            runs), sharing every read and shared map with the other jobs; "auto" does the same
            but falls back to loading alone (with one warning) if the server goes away.
        server: the server's socket path (default: the user's runtime folder).
        server_memory: the pool size for a server this Loader starts, e.g. "4G".
        name: how this job appears in `globalloader status`.

    Not thread-safe: iterate a Loader from one thread. Workers start at the first iteration and
    persist across epochs until `close()` (or the end of a `with` block).
    """

    def __init__(
        self,
        dataset: Dataset,
        workers: int = 0,
        mode: str = "process",
        prefetch: int | None = None,
        on_error: str = "raise",
        timeout: float = 300.0,
        start_method: str = "fork",
        share: bool | str = False,
        server: str | None = None,
        server_memory: str | int | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise ArgumentError(f"Loader: dataset must be a globalloader.Dataset, got {type(dataset).__name__}")
        if not isinstance(workers, int) or workers < 0:
            raise ArgumentError(f"Loader: workers must be an int >= 0, got {workers!r}")
        if mode not in MODES:
            raise ArgumentError(f"Loader: mode must be one of {MODES}, got {mode!r}")
        if on_error not in ON_ERROR:
            raise ArgumentError(f"Loader: on_error must be one of {ON_ERROR}, got {on_error!r}")
        if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
            raise ArgumentError(f"Loader: prefetch must be an int >= 1, got {prefetch!r}")
        if share not in SHARE:
            raise ArgumentError(f"Loader: share must be one of {SHARE}, got {share!r}")
        self.dataset, self.plan = dataset, dataset.plan
        self.share, self.server, self.server_memory, self.name = share, server, server_memory, name
        self._session: SharedSession | None = None
        self.workers, self.mode, self.on_error = workers, mode, on_error
        self.prefetch = prefetch or max(2, 2 * workers)
        self._timeout, self._start_method = timeout, start_method
        self._pool: Any = None
        self._run: _Run | SharedRun | None = None
        self._position: Position = (0, 0, 0, None)  # where the next iteration starts
        self._stats = LoaderStats()

    # -- epochs and positions ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` at the next iteration (keeps a loaded mid-epoch position of that epoch)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ArgumentError(f"set_epoch: epoch must be an int >= 0, got {epoch!r}")
        if epoch != self._position[0]:
            self._position = (epoch, 0, 0, None)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: loading it into a new Loader yields exactly the remaining items
        (in shared mode: exactly the samples not yet consumed this epoch)."""
        epoch, task, offset, consumed = self._run.position() if self._run is not None else self._position
        state = make_state(self.plan, epoch, task, offset)
        if consumed is not None:
            state["consumed"] = [int(i) for i in consumed]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._abandon_run()
        epoch, task, offset = check_state(self.plan, state)
        self._position = (epoch, task, offset, state.get("consumed"))

    def __len__(self) -> int:
        return len(self.dataset)

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> "_Run | SharedRun":
        self._abandon_run()
        if self._pool is None:
            self._pool = self._start_pool()
        epoch, task, offset, consumed = self._position
        if self.share:
            if consumed is None:  # a local position: the samples it had consumed
                consumed = self.plan.indices(epoch, 0, task * self.plan.task_size + offset).tolist()
            try:
                if self._session is None:
                    self._session = SharedSession(self)
                self._run = SharedRun(self, epoch, consumed)
            except ServerGone as exc:
                self._run = self.fall_back(exc, epoch, consumed)
        else:
            self._run = _Run(self, epoch, task, offset, consumed)
        return self._run

    def fall_back(self, exc: ServerGone, epoch: int, consumed: list[int]) -> "_Run":
        """The server went away: raise, or with share="auto" go on alone from the same position."""
        if self.share != "auto":
            raise exc
        warnings.warn(f"globalloader: {exc}; loading on our own from here (share='auto')", stacklevel=3)
        self.share = False
        if self._session is not None:
            self._session.close()
            self._session = None
        self._run = _Run(self, epoch, 0, 0, consumed)
        return self._run

    def _start_pool(self) -> Any:
        skip = self.on_error == "skip"
        if self.workers == 0:
            return InlinePool(self.plan, skip)
        if self.mode == "thread":
            return ThreadPool(self.plan, skip, self.workers)
        return ProcessPool(self.plan, skip, self.workers, self._start_method, self._timeout)

    def _abandon_run(self) -> None:
        """Stop the current run (if any), keeping its position; drain what is in flight."""
        run, self._run = self._run, None
        if run is not None:
            self._position = run.position()
            run.drain()

    def _finished(self, run: "_Run | SharedRun") -> None:
        self._position = (run.epoch + 1, 0, 0, None)
        self._run = None

    def _broken(self) -> None:
        """A worker failed: the pool cannot be trusted; the next iteration starts a new one."""
        if self._run is not None:
            self._position = self._run.position()
            self._run = None
        self._close_pool()

    # -- reporting and shutdown --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per stage: items, busy seconds; workers' idle time; the consumer's wait; skipped samples."""
        return self._stats.report()

    def _close_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Stop the workers and free shared memory (batches still referenced stay valid)."""
        self._abandon_run()
        self._close_pool()
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A Loader dropped without close(): stop its workers (best effort; never raise here).
        if getattr(self, "_pool", None) is not None:
            try:
                self._close_pool()
            except Exception:
                pass


class _Run:
    """One pass over (the rest of) an epoch; the Loader's iterator."""

    def __init__(self, loader: Loader, epoch: int, task: int, offset: int, consumed: list[int] | None = None) -> None:
        self.loader, self.plan, self.epoch = loader, loader.plan, epoch
        self._pool, self._width = loader._pool, max(1, loader.workers)
        self._next_submit = self._next_result = task
        self._current, self._taken = task, 0
        self._pending: deque[Any] = deque()
        self._exhausted = False
        self._skip_first = offset
        self._skipped: list[tuple[int, str]] = []
        self._reader = self.plan.stream_reader(epoch, task) if self.plan.is_stream else None
        # A position given as consumed samples: run the epoch's order without them.
        self._consumed = consumed
        self._order = None if consumed is None else remaining_indices(self.plan.indices(epoch), consumed)
        self._total = None if self.plan.is_stream else self._count_tasks()
        self._last_yield: float | None = None

    def _count_tasks(self) -> int:
        if self._order is None:
            return self.plan.num_tasks()
        n, batch = len(self._order), self.plan.batch
        return batch.count(n) if batch is not None else -(-n // self.plan.task_size)

    def _indices(self, t: int) -> np.ndarray:
        if self._order is None:
            return self.plan.task_indices(self.epoch, t)
        size = self.plan.task_size
        return self._order[t * size : (t + 1) * size]

    def __iter__(self) -> "_Run":
        return self

    def position(self) -> Position:
        if self._pending:
            task, offset = self._current, self._taken
        elif self._skip_first:  # loaded mid-task, nothing yielded yet
            task, offset = self._current, self._skip_first
        else:
            task, offset = self._next_result, 0
        if self._order is None:
            return (self.epoch, task, offset, None)
        done = self._order[: task * self.plan.task_size + offset].tolist()
        return (self.epoch, 0, 0, list(self._consumed) + done)

    def _submit(self) -> None:
        plan = self.plan
        while not self._exhausted and self._next_submit - self._next_result < self.loader.prefetch:
            t = self._next_submit
            if self._reader is not None:
                items = plan.stream_task(self._reader, t)
                if items is None:
                    self._exhausted = True
                    return
            elif t >= self._total:
                self._exhausted = True
                return
            else:
                items = self._indices(t)
            self._pool.submit(t % self._width, Task(self.epoch, t, items))
            self._next_submit += 1

    def __next__(self) -> Any:
        stats = self.loader._stats
        now = time.perf_counter()
        if self._last_yield is not None:
            stats.consumer_busy(now - self._last_yield)
        while not self._pending:
            self._submit()
            if self._next_result == self._next_submit:
                self._end_epoch()
            t = self._next_result
            try:
                res = self._pool.result(t % self._width)
            except BaseException:
                self.loader._broken()
                raise
            self._next_result += 1
            self._current, self._taken = t, 0
            stats.add_task(res.timer, res.idle, len(res.skipped))
            self._skipped.extend(res.skipped)
            if res.output is not None:
                self._pending.extend([res.output] if self.plan.batch is not None else res.output)
            if self._skip_first:
                for _ in range(min(self._skip_first, len(self._pending))):
                    self._pending.popleft()
                self._taken, self._skip_first = self._skip_first, 0
            self._submit()
        self._taken += 1
        item = self._pending.popleft()
        self._last_yield = time.perf_counter()
        stats.consumer_wait(self._last_yield - now)
        return item

    def _end_epoch(self) -> None:
        warn_skipped(self._skipped, self.epoch)
        self._skipped = []
        if self.loader._run is self:
            self.loader._finished(self)
        raise StopIteration

    def drain(self) -> None:
        """Collect (and drop) results still in flight so the workers' pipes are clean."""
        try:
            while self._next_result < self._next_submit:
                self._pool.result(self._next_result % self._width)
                self._next_result += 1
        except BaseException:
            self.loader._close_pool()
        self._pending.clear()
