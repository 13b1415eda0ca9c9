"""`Loader`: runs a Dataset chain in parallel workers with prefetch and exact mid-epoch resume.

Work is split into tasks (one batch each; chunks of samples for unbatched chains). Each
iteration is a run: a `LocalRun` computes the epoch with this Loader's workers
(`execution.local`), a `SharedRun` is fed by the machine's global loader server
(`execution.shared`). Both report the same position, so a state_dict taken in either mode
resumes in either mode.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Self

import numpy as np

from globalloader.dataset.chain import Dataset
from globalloader.dataset.resume import Position, epoch_order, load_state, make_state
from globalloader.errors import ArgumentError, check_int
from globalloader.execution import report as input_report
from globalloader.execution.local import LocalRun
from globalloader.execution.run import UNAVAILABLE, EpochRun
from globalloader.execution.shared import SharedRun, SharedSession
from globalloader.execution.stats import LoaderStats
from globalloader.execution.window import WorkerSet
from globalloader.execution.workers import InlineWorkers, ProcessWorkers, ThreadWorkers

MODES = ("process", "thread")
ON_ERROR = ("raise", "skip")
SHARE = (False, True, "auto")


class Loader:
    """Iterate `dataset` with `workers` processes (or threads), `prefetch` tasks in flight.

    Args:
        dataset: a `gl.Dataset` chain (usually ending in `.batch(n)`).
        workers: worker processes/threads; 0 runs everything in the iterating thread.
        mode: "process" (shared-memory transport) or "thread" (for GIL-releasing work).
        prefetch: tasks in flight across all workers (default 2 per worker).
        on_error: "raise" stops at the first bad sample; "skip" drops it, counts it in `stats()`
            and warns at the end of the epoch.
        timeout: seconds any wait may last: a worker on one task, the server on one sample
            (shared mode); past it a named error (WorkerError, LoaderTimeoutError) is raised.
        start_method: "fork" (fast start) or "spawn"/"forkserver" (chain sent with cloudpickle).
        share: True feeds this job from the machine's global loader server (started if none
            runs), sharing every read and shared map with the other jobs; "auto" does the same
            but falls back to loading alone (with one warning) if the server cannot be started
            or goes away. Each epoch's order is then a uniformly random order of this job's set,
            exactly once, that depends on the other jobs' timing (not reproducible from the
            seed); `state_dict()` still resumes exactly.
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
        check_int(workers, "Loader: workers")
        if mode not in MODES:
            raise ArgumentError(f"Loader: mode must be one of {MODES}, got {mode!r}")
        if on_error not in ON_ERROR:
            raise ArgumentError(f"Loader: on_error must be one of {ON_ERROR}, got {on_error!r}")
        if prefetch is not None:
            check_int(prefetch, "Loader: prefetch", 1)
        if not any(share is choice for choice in SHARE):
            raise ArgumentError(f"Loader: share must be one of {SHARE}, got {share!r}")
        seconds = (int, float, np.integer, np.floating)
        if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, seconds) or not 0 < timeout < math.inf:
            raise ArgumentError(f"Loader: timeout must be a finite number of seconds > 0, got {timeout!r}")
        if timeout > threading.TIMEOUT_MAX:  # a thread's wait would raise OverflowError
            raise ArgumentError(f"Loader: timeout must be at most {threading.TIMEOUT_MAX:.0f} seconds, got {timeout!r}")
        if start_method not in multiprocessing.get_all_start_methods():
            raise ArgumentError(
                f"Loader: start_method must be one of {multiprocessing.get_all_start_methods()}, got {start_method!r}"
            )
        for what, value in (("server", server), ("name", name)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ArgumentError(f"Loader: {what} must be a str or None, got {value!r}")
        self.dataset, self.plan = dataset, dataset.plan
        self.share, self.server, self.server_memory, self.name = share, server, server_memory, name
        self._session: SharedSession | None = None
        workers, prefetch = int(workers), None if prefetch is None else int(prefetch)
        self.workers, self.mode, self.on_error = workers, mode, on_error
        self.prefetch = prefetch or max(2, 2 * workers)
        self.timeout, self._start_method = float(timeout), start_method
        self.worker_set: WorkerSet | None = None  # started at the first iteration
        self._run: EpochRun | None = None
        self._position = Position(0)  # where the next iteration starts
        self.statistics = LoaderStats()

    # -- epochs and positions ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` at the next iteration (keeps a loaded mid-epoch position of that epoch)."""
        epoch = check_int(epoch, "set_epoch: epoch")
        if epoch != self._position.epoch:
            self._position = Position(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: loading it into a new Loader yields exactly the remaining items
        (in shared mode: exactly the samples not yet consumed this epoch). Small and JSON-able
        (a shared-mode state lists the samples consumed; a tail's state holds its records)."""
        return make_state(self.plan, self._run.position() if self._run is not None else self._position)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue from `state`: this Loader's own, one taken by another rank or world size of the
        same chain (ranks in lockstep), or the list of every rank's (see docs/elastic.md)."""
        self._abandon_run()
        self._position = load_state(self.plan, state)

    def __len__(self) -> int:
        return len(self.dataset)

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> EpochRun:
        self._abandon_run()
        position = self._position
        epoch, task, offset, consumed, tail, base = position
        if self.share and consumed is None:  # a local position: the samples it had consumed
            consumed = epoch_order(self.plan, epoch, base).indices(0, task * self.plan.task_size + offset).tolist()
            position = Position(epoch, 0, 0, consumed, tail, base)
        if self.share and self._session is None:  # before any worker starts: a bad chain fails here
            try:
                self._session = SharedSession(self.plan, self.server, self.server_memory, self.name, self.timeout)
            except UNAVAILABLE as exc:
                self.fall_back(exc, position)
        if self.worker_set is None:
            self.worker_set = self._start_workers()
        if self._session is not None:
            try:
                self._run = SharedRun(self, self._session, position)
            except UNAVAILABLE as exc:
                self._run = self.fall_back(exc, position)
        else:
            self._run = LocalRun(self, position)
        return self._run

    def fall_back(self, exc: BaseException, position: Position) -> EpochRun:
        """The server is not there: raise, or with share="auto" go on alone from the same position."""
        if self.share != "auto":
            raise exc
        warnings.warn(f"globalloader: {exc}; loading on our own from here (share='auto')", stacklevel=4)
        self.share = False
        if self._session is not None:
            self._session.close()
            self._session = None
        if self.worker_set is None:
            self.worker_set = self._start_workers()
        self._run = LocalRun(self, position._replace(task=0, offset=0, consumed=position.consumed or []))
        return self._run

    def _start_workers(self) -> WorkerSet:
        skip = self.on_error == "skip"
        if self.workers == 0:
            return InlineWorkers(self.plan, skip)
        if self.mode == "thread":
            return ThreadWorkers(self.plan, skip, self.workers, self.timeout)
        return ProcessWorkers(self.plan, skip, self.workers, self._start_method, self.timeout)

    def _abandon_run(self) -> None:
        """Stop the current run (if any), keeping its position; drain what is in flight."""
        run, self._run = self._run, None
        if run is not None:
            self._position = run.position()
            run.drain()

    def finished(self, run: EpochRun) -> None:
        """A run reached the end of its epoch: the next iteration starts the next epoch."""
        if self._run is run:
            self._position = Position(run.epoch + 1)
            self._run = None

    def broken(self) -> None:
        """A worker failed: the workers cannot be trusted; the next iteration starts new ones."""
        if self._run is not None:
            self._position = self._run.position()
            self._run = None
        self._close_workers()

    # -- reporting and shutdown --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per stage: items, busy seconds; workers' idle time; the consumer's wait; skipped samples."""
        return self.statistics.report()

    def report(self, path: str | os.PathLike[str] = "input-report.html") -> Path:
        """Write one self-contained HTML page on this Loader's run so far: throughput over time,
        time per stage, the loop's wait per step, and a diagnosis (input- or compute-bound, and
        how many workers would help). Needs matplotlib (`pip install 'globalloader[report]'`)."""
        return input_report.write(path, self.run_record())

    def run_record(self) -> input_report.RunRecord:
        """What `report()` draws: the loop's timeline and the workers' time per stage."""
        notes = []
        if self.share:
            notes.append(
                "Shared mode: the shared maps ran on the global loader server and are not in this job's "
                "worker time; see `globalloader status --web` for the server's side."
            )
        step = "batch" if self.plan.batch is not None else "sample"
        return input_report.RunRecord.of(self.statistics, self.workers, step, notes)

    def _close_workers(self) -> None:
        worker_set, self.worker_set = self.worker_set, None
        if worker_set is not None:
            worker_set.close()

    def close(self) -> None:
        """Stop the workers and free shared memory (batches still referenced stay valid)."""
        self._abandon_run()
        self._close_workers()
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A Loader dropped without close(): stop its workers (best effort; never raise here).
        if getattr(self, "worker_set", None) is not None:
            with contextlib.suppress(Exception):
                self._close_workers()
