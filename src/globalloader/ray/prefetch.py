"""OutputPrefetcher: fetch a trainer's reducer outputs in order, a few ahead, on a thread.

A background thread asks the batch queue for each output's object ref (it exists once the
reducer is submitted) and `ray.get`s it, pulling it to this node and mapping it, while the
trainer works on the current one, so a trainer waits only when the shuffle itself is
behind. Order is fixed (reducer order), so batches are the same for the same seed whichever
reducer finishes first. Ray's failures become this library's errors: a failed task re-raises
the task's own GlobalLoaderError (an unreadable file names the file), a lost owner or a stall
past `timeout` becomes a WorkerError, so a dead peer or shuffle never hangs a trainer forever.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions as rex

from globalloader.errors import GlobalLoaderError, StateError, WorkerError

_POLL_S = 0.5  # how often a blocked fetch checks whether it was stopped
_LOCATE_S = 2.0  # longest single wait inside the batch queue for an output's ref


Locate = Callable[[int, float], tuple[str, Any]]


class OutputPrefetcher:
    """Delivers the value of outputs 0..count-1 in order, up to `depth` fetched ahead.

    `locate(i, wait_s)` returns ("ok", ref) for output i, ("wait", why) if it is not submitted
    after `wait_s`, or ("error", message). `describe(i)` names output i in error messages.
    `timeout` bounds the wait for any one output (None: no bound). Not thread-safe: one
    consumer calls `next()`; `close()` stops the thread and drops what it fetched.
    """

    def __init__(
        self, count: int, locate: Locate, depth: int, timeout: float | None, describe: Callable[[int], str]
    ) -> None:
        self._count = count
        self._locate = locate
        self._timeout = timeout
        self._describe = describe
        self._ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.wait_s = 0.0  # time the consumer spent blocked in next()
        self._thread = threading.Thread(target=self._run, name="globalloader-ray-prefetch", daemon=True)
        self._thread.start()

    def next(self) -> Any:
        """The next output (blocks until it is fetched); raises what fetching it raised."""
        start = time.perf_counter()
        ok, value = self._ready.get()
        self.wait_s += time.perf_counter() - start
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break

    def _run(self) -> None:
        for i in range(self._count):
            if self._stop.is_set():
                return
            try:
                value = self._fetch(i)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
                self._deliver(False, exc)
                return
            if not self._deliver(True, value):
                return

    def _fetch(self, i: int) -> Any:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        ref = self._find(i, deadline)
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            try:
                return ray.get(ref, timeout=max(wait, 0.0))
            except rex.GetTimeoutError:
                if self._stop.is_set():
                    raise WorkerError("stopped") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerError(
                        f"{self._describe(i)} was not ready after {self._timeout:.0f} s: the "
                        "shuffle tasks may lack CPUs (do the trainers reserve them all?) or a "
                        "node died; pass a larger timeout= for very large epochs"
                    ) from None
            except rex.RayTaskError as exc:
                raise task_error(exc, self._describe(i)) from None
            except (rex.OwnerDiedError, rex.ObjectLostError, rex.RayActorError) as exc:
                raise WorkerError(
                    f"{self._describe(i)} is lost: the shuffle's batch queue, which lives in "
                    f"rank 0's process, is gone (did rank 0 stop?): {type(exc).__name__}"
                ) from None

    def _find(self, i: int, deadline: float | None) -> ray.ObjectRef:
        while True:
            wait = _LOCATE_S if deadline is None else max(0.0, min(_LOCATE_S, deadline - time.monotonic()))
            try:
                status, payload = self._locate(i, wait)
            except rex.GetTimeoutError:
                status, payload = "wait", "the batch queue does not answer"
            except rex.RayActorError as exc:
                raise WorkerError(
                    f"{self._describe(i)} cannot be located: the shuffle's batch "
                    "queue, which lives in rank 0's process, is gone (did rank 0 "
                    f"stop?): {type(exc).__name__}"
                ) from None
            if status == "ok":
                return payload
            if status == "error":
                raise StateError(f"{self._describe(i)}: {payload}")
            if self._stop.is_set():
                raise WorkerError("stopped")
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkerError(
                    f"{self._describe(i)} was not started within "
                    f"{self._timeout:.0f} s: {payload}; the shuffle tasks may "
                    "lack CPUs or a node died; pass a larger timeout= for very "
                    "large epochs"
                )

    def _deliver(self, ok: bool, value: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put((ok, value), timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False


def task_error(exc: BaseException, what: str) -> Exception:
    """The error a failed shuffle task should raise in the trainer.

    A GlobalLoaderError raised inside the task (SourceError naming a file, ...) comes back as
    the same class and message; anything else becomes a WorkerError that says what failed.
    """
    cause: Any = exc
    while isinstance(cause, rex.RayTaskError) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    if isinstance(cause, GlobalLoaderError):
        # `cause` is the task's own exception; were it Ray's wrapper of it, whose text starts
        # with the remote traceback, its message is the last line.
        message = str(cause).splitlines()[-1] if isinstance(cause, rex.RayError) else str(cause)
        return type(cause)(message)
    return WorkerError(f"{what}: a shuffle task failed: {type(cause).__name__}: {cause}")
