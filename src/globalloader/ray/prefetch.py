"""OutputPrefetcher: fetch a trainer's reducer outputs in order, a few ahead, on a thread.

A background thread asks the batch queue for each output's object ref (it exists once the
reducer is submitted) and `ray.get`s it, pulling it to this node and mapping it, while the
trainer works on the current one, so a trainer waits only when the shuffle itself is
behind. Order is fixed (reducer order), so batches are the same for the same seed whichever
reducer finishes first. Before pulling an output it notes whether the output was made on
another node (`pulled`, `pulled_bytes`): reducers are meant to run where their trainer is (an
output lost with a node and being made again lives nowhere when asked, and is not counted).

Ray's failures become this library's errors: a failed task re-raises the task's own
GlobalLoaderError (an unreadable file names the file); a lost owner (the batch queue) or an
output Ray could not re-create after losing a node becomes a WorkerError, and a stall past
`timeout` the Loader's LoaderTimeoutError, so a dead peer or shuffle never hangs a trainer
forever. (An output lost with a node is re-created by Ray from its map tasks first; only when
that fails does the trainer see it.)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions as rex
from ray.experimental import get_object_locations

from globalloader.errors import GlobalLoaderError, LoaderTimeoutError, StateError, WorkerError

_POLL_S = 0.5  # how often a blocked fetch checks whether it was stopped
_LOCATE_S = 2.0  # longest single wait inside the batch queue for an output's ref
_LOCATE_MS = 5000  # longest wait for the owner to say where an output is
_GONE = (
    "the shuffle's batch queue, which ends with rank 0's process, is gone (did rank 0 or its node stop?): "
    "restart every rank from its state_dict()"
)


Locate = Callable[[int, float], tuple[str, Any]]


class OutputPrefetcher:
    """Delivers the value of outputs 0..count-1 in order, up to `depth` fetched ahead.

    `locate(i, wait_s)` returns ("ok", ref) for output i, ("wait", why) if it is not submitted
    after `wait_s`, or ("error", message). `describe(i)` names output i in error messages.
    `timeout` bounds the wait for any one output (None: no bound). `node`: this process's node
    id, to count outputs made elsewhere. Not thread-safe: one consumer calls `next()`;
    `close()` stops the thread and drops what it fetched.
    """

    def __init__(
        self,
        count: int,
        locate: Locate,
        depth: int,
        timeout: float | None,
        describe: Callable[[int], str],
        node: str,
    ) -> None:
        self._count = count
        self._locate = locate
        self._timeout = timeout
        self._describe = describe
        self._ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.wait_s = 0.0  # time the consumer spent blocked in next()
        self.pulled = 0  # outputs made on another node
        self.pulled_bytes = 0
        self._node = node
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
        while not ray.wait([ref], timeout=_poll_wait(deadline), fetch_local=False)[0]:
            self._check_wait(i, deadline)
        self._note_location(ref)
        while True:
            try:
                return ray.get(ref, timeout=_poll_wait(deadline))
            except rex.GetTimeoutError:
                self._check_wait(i, deadline)
            except rex.RayTaskError as exc:
                raise task_error(exc, self._describe(i)) from None
            except (rex.OwnerDiedError, rex.RayActorError) as exc:
                raise WorkerError(f"{self._describe(i)} is lost ({type(exc).__name__}): {_GONE}") from None
            except rex.ObjectLostError as exc:
                raise WorkerError(
                    f"{self._describe(i)} was lost with a node and Ray could not make it again "
                    f"({type(exc).__name__}: its inputs or its retries ran out): restart every rank "
                    "from its state_dict()"
                ) from None

    def _note_location(self, ref: ray.ObjectRef) -> None:
        """Count `ref` as pulled if it lives in other nodes' object stores only (not yet fetched)."""
        try:
            where = get_object_locations([ref], timeout_ms=_LOCATE_MS).get(ref, {})
        except rex.RayError:
            return  # the owner does not answer: the fetch below reports why
        nodes = where.get("node_ids") or []  # none: small enough to travel inline
        if nodes and self._node not in nodes:
            self.pulled += 1
            self.pulled_bytes += int(where.get("object_size") or 0)

    def _check_wait(self, i: int, deadline: float | None) -> None:
        """Raise if the consumer stopped or output `i` is overdue."""
        if self._stop.is_set():
            raise WorkerError("stopped")
        if deadline is not None and time.monotonic() >= deadline:
            raise LoaderTimeoutError(
                f"{self._describe(i)} was not ready after {self._timeout:g} s (timeout=): the "
                "shuffle tasks may lack CPUs (do the trainers reserve them all?) or a "
                "node died; pass a larger timeout= for very large epochs"
            )

    def _find(self, i: int, deadline: float | None) -> ray.ObjectRef:
        return ask_queue(
            lambda wait: self._locate(i, wait),
            _LOCATE_S,
            deadline,
            f"{self._describe(i)} cannot be located",
            lambda why: (
                f"{self._describe(i)} was not started within {self._timeout:g} s (timeout=): {why}; the shuffle "
                "tasks may lack CPUs or a node died; pass a larger timeout= for very large epochs"
            ),
            f"{self._describe(i)}: ",
            self._stop.is_set,
        )

    def _deliver(self, ok: bool, value: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put((ok, value), timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False


def _poll_wait(deadline: float | None, poll: float = _POLL_S) -> float:
    """How long one wait may last: `poll`, or less to end at `deadline`."""
    return poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))


def ask_queue(
    call: Callable[[float], tuple[str, Any]],
    poll: float,
    deadline: float | None,
    gone: str,
    late: Callable[[str], str],
    refused: str = "",
    stopped: Callable[[], bool] = lambda: False,
) -> Any:
    """Ask the batch queue (`call(wait)` -> (status, payload)) until it answers "ok": its payload.
    "error" is a StateError (`refused` + payload); a queue that is gone or a stop is a WorkerError
    (`gone`), the deadline passing a LoaderTimeoutError (`late(why)`); a slow or unreachable queue
    is asked again."""
    while True:
        try:
            status, payload = call(_poll_wait(deadline, poll))
        except rex.GetTimeoutError:
            status, payload = "wait", "the batch queue does not answer"
        except rex.ActorUnavailableError:  # unreachable for now (a busy or failing node): ask again
            status, payload = "wait", "the batch queue is unreachable"
            time.sleep(_POLL_S)
        except rex.RayActorError as exc:
            raise WorkerError(f"{gone} ({type(exc).__name__}): {_GONE}") from None
        if status == "ok":
            return payload
        if status == "error":
            raise StateError(f"{refused}{payload}")
        if stopped():
            raise WorkerError("stopped")
        if deadline is not None and time.monotonic() >= deadline:
            raise LoaderTimeoutError(late(payload))


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
