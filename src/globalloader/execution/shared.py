"""A Loader epoch fed by the global loader server (`Loader(..., share=True)`).

The chain is split after its last `map(..., shared=True)`: the server reads and runs that prefix
once per sample for every job with the same prefix, into shared memory; this job's own workers
run the rest (random maps, collate) on samples read in place, in tasks of one batch, then the
job releases its references. The joint sampler chooses the order, so it is a uniformly random
order of this job's set that depends on the other jobs' timing: shared mode trades bit-exact
order for sharing. The position is the set of samples already yielded this epoch, which is what
a resume needs ("the rest of the epoch is a uniform order of what remains").

Each pass is a numbered run on the server: starting a run (or ending one, when a worker dies or
the loop is left) drops every reference and pending ticket of the earlier ones, and the tickets
of an earlier run still on their way are ignored, so no sample is delivered twice or lost.
Anything a consumer may keep is never a view of the server's arena: process workers copy their
output into their own transport, and in-thread output is copied out before its release.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections import deque
from types import ModuleType
from typing import Any

import numpy as np

from globalloader.dataset.chain import Dataset
from globalloader.dataset.cursor import END, Cursor
from globalloader.dataset.resume import Position
from globalloader.errors import SAMPLE_ERRORS, ServerGoneError, SharedPrefixError, StateError
from globalloader.execution.run import UNAVAILABLE, EpochRun, Host
from globalloader.execution.workers import Task
from globalloader.service import protocol
from globalloader.service.client import Client
from globalloader.transport.arena import Arena, ArenaId, hold


class SharedSession:
    """This Loader's registration with the server: one job, one numbered run per pass."""

    def __init__(
        self, plan: Any, server: str | None, memory: str | int | None, name: str | None, timeout: float
    ) -> None:
        import cloudpickle

        plan.check_shareable()
        prefix = Dataset(plan.source, tuple(plan.maps[: plan.split])).plan
        for op in prefix.maps:
            _by_value_if_local(cloudpickle, getattr(op, "fn", None))
        key = prefix.fingerprint  # first: a chain that cannot be keyed or sent fails before any server starts
        try:
            shipped = cloudpickle.dumps(prefix)
        except Exception as exc:
            raise SharedPrefixError(
                f"the shared prefix cannot be sent to the server: {type(exc).__name__}: {exc}; "
                "shared maps must be picklable (no locks, open files or sockets)"
            ) from exc
        hello = {
            "prefix_fp": key,
            "prefix": shipped,
            "name": name or f"{os.path.basename(sys.argv[0] or 'python')}[{os.getpid()}]",
            "seed": plan.seed,
            "timeout": timeout,
        }
        self.timeout = timeout
        self.client = Client(server or protocol.default_socket(), memory=memory)
        try:
            self.client.send("hello", hello)
            msg = self.client.get(timeout, "its welcome")
            self.job, self.arena_id = msg[1], ArenaId(*msg[2])
            self.arena: Arena = hold(self.arena_id)
        except BaseException:
            self.client.close()
            raise
        self._runs = 0
        self._closed = False

    def start_run(self, epoch: int, indices: np.ndarray) -> int:
        run, self._runs = self._runs, self._runs + 1
        self.client.send("heartbeat", self.client.progress)  # the last pass's final count, before it ends
        self.client.progress = (run, 0, *self.client.progress[2:])
        self.client.send("run", run, epoch, indices)
        return run

    def close(self) -> None:
        """Leave the server and unmap its arena (see `Arena.close`: nothing this Loader handed
        out is a view of it, so nothing a user kept loses its memory)."""
        self.client.close()
        if not self._closed:
            self._closed = True
            self.arena.release()


def _by_value_if_local(cloudpickle: Any, fn: Any) -> None:
    """Ship the user's own modules with the chain, by value: the server may not import them (a
    script's folder, a test module), and a module the map reads (`cfg.SIZE`) must reach it as
    this job sees it, not as its file says. Installed packages it imports like we do."""
    fn = getattr(fn, "func", fn)  # functools.partial
    code = getattr(fn, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    candidates = [sys.modules.get(getattr(fn, "__module__", None) or type(fn).__module__)]
    candidates += [v for k, v in getattr(fn, "__globals__", {}).items() if k in names and isinstance(v, ModuleType)]
    for module in candidates:
        path = getattr(module, "__file__", None) or ""
        installed = any(part in path for part in ("site-packages", "dist-packages", sysconfig.get_paths()["stdlib"]))
        if module is not None and path and not installed and not module.__name__.startswith("globalloader"):
            cloudpickle.register_pickle_by_value(module)


class SharedRun(EpochRun):
    """One pass over (the rest of) an epoch with samples from the server."""

    def __init__(self, host: Host, session: SharedSession, position: Position) -> None:
        super().__init__(host, position.epoch)
        self._cursor = cursor = Cursor(self.plan, position, named=True)  # its position: the samples consumed
        self._session, self._client = session, session.client
        assert cursor.left is not None and cursor.tasks is not None, "a named cursor knows what is left"
        unique, counts = np.unique(cursor.left, return_counts=True)
        # The sampler serves a set; the few padding repeats ("pad" sharding) are loaded locally.
        self._extra: deque[int] = deque(np.repeat(unique, counts - 1).tolist())
        self._unserved = self._unique = len(unique)  # tickets not yet asked for; in all
        self._tasks_total = cursor.tasks
        self.run = session.start_run(self.epoch, unique)
        self._window = (host.prefetch + 1) * self.plan.task_size
        self._asked = 0
        self._tickets: dict[int, tuple[Any, ...]] = {}  # seq -> ticket, until taken in order
        self._next_seq = 0
        self._ready: deque[tuple[Any, ...]] = deque()  # tickets in order, not yet in a task
        self._next_task = 0
        self._ended = False
        self._failed: BaseException | None = None
        self._fallback: EpochRun | None = None  # the local run that took over (share="auto")
        # Output computed in this process may hold views of the arena; a process worker's never does.
        self._copy_out = host.mode == "thread" or not host.workers

    def position(self) -> Position:
        if self._fallback is not None:
            return self._fallback.position()
        return self._cursor.position()

    # -- tickets from the server -------------------------------------------------------------
    def _ask(self, need: int) -> None:
        """Have `need` tickets beyond those received asked for (at most `window`): enough for the
        server's workers to load ahead, not so many that the sampler decides long before use."""
        outstanding = self._asked - self._next_seq
        want = min(min(need, self._window) - outstanding, self._unserved)
        if want > 0:
            self._client.send("want", self.run, want)
            self._asked += want
            self._unserved -= want

    def _receive(self, block: bool = True) -> None:
        """Take messages until the next ticket in order is here (or, not blocking, whatever has
        arrived). Messages of earlier runs are stale and dropped."""
        while self._next_seq < self._unique and self._next_seq not in self._tickets:
            msg: tuple[Any, ...] | None
            if block:  # the server fails a load at `timeout` itself, naming the sample: give it time to
                msg = self._client.get(
                    self.host.timeout + 5, f"the next sample ({self._next_seq} of {self._unique} received)"
                )
            else:
                msg = self._client.get_nowait()
            if msg is None:
                break
            if msg[0] in ("ticket", "failed") and msg[1] == self.run:
                self._tickets[msg[2]] = msg
        while self._next_seq in self._tickets:
            self._ready.append(self._tickets.pop(self._next_seq))
            self._next_seq += 1

    def _take_items(self, block: bool) -> list[tuple[Any, ...]] | None:
        """(index, offset, layout) items of the next task (offset None: computed locally).

        Not blocking (tasks are in flight), it takes a task only if its tickets are all here:
        waiting for more while holding references would keep this job from collecting, and so
        releasing, the tasks it already runs; with a small pool that could starve every job.
        """
        if self._next_task >= self._tasks_total:
            return None
        size = self.plan.task_size
        self._ask(self._window)  # keep the prefetch window of tickets drawn and loading
        self._receive(block=False)
        more_coming = self._next_seq < self._unique
        if not block and more_coming and len(self._ready) < size:
            return None
        items: list[tuple[Any, ...]] = []
        while len(items) < size:
            if not self._ready and self._next_seq < self._unique:
                self._ask(2 * size - len(items))
                self._receive()
            if self._ready:
                msg = self._ready.popleft()
                if msg[0] == "failed":  # the server could not load it
                    self._bad(msg[3], msg[4], msg[5])
                else:
                    items.append(msg[3:6])
            elif self._extra:
                items.append((self._extra.popleft(), None, None))
            else:
                break
        return items

    def _bad(self, index: int, error: str, message: str) -> None:
        exc = protocol.make_error(error, f"the global loader could not load {message}")
        if self.host.on_error != "skip" or not isinstance(exc, SAMPLE_ERRORS):
            raise exc  # infrastructure faults are never skipped
        self._skipped.append((index, message))
        self.host.statistics.add_skipped(1)
        self._cursor.consumed.append(index)

    # -- running tasks -----------------------------------------------------------------------
    def _submit(self) -> None:
        while not self._task_window.full():
            items = self._take_items(block=not self._task_window)
            if not items:
                return
            t = self._next_task
            self._next_task += 1
            self._submit_task(Task(self.epoch, t, items, self.plan.split, self._session.arena_id))

    def _next(self) -> Any:
        if self._fallback is not None:
            return self._fallback._next()
        if self._failed is not None:
            raise StateError(
                f"this pass ended with {type(self._failed).__name__}: {self._failed}; "
                "iterate the Loader again to go on from where it stopped"
            ) from self._failed
        try:
            return self._next_item()
        except StopIteration:
            raise
        except UNAVAILABLE as exc:
            self.drain()
            self._fallback = self.host.fall_back(exc, self.position())  # or raises
            return self._fallback._next()
        except BaseException as exc:
            self._failed = exc
            self._end_run()
            raise

    def _collect(self) -> bool:
        """Add the next task's output to the cursor, its shared samples released; False at the end."""
        self._submit()
        if not self._task_window:
            return False
        task, res = self._result()
        indices = [i for i, _, _ in task.items]
        shared = [i for i, offset, _ in task.items if offset is not None]
        output = res.output
        if self._copy_out and output is not None:
            output = _detach(output, self._session.arena)  # before the release below
        self._client.send("release", self.run, shared)
        if output is None:  # every sample of the task skipped
            self._cursor.consumed.extend(indices)
        elif self.plan.batch is not None or self.plan.grouped:
            self._cursor.add(output, [indices])
        else:
            skipped = {i for i, _ in res.skipped}
            self._cursor.add(output, [[i] for i in indices if i not in skipped])
        return True

    def _next_item(self) -> Any:
        item = self._cursor.next(self._collect)
        if item is END:
            self._end_run()
            self._end_epoch()
        self._report_progress()
        return item

    def _report_progress(self) -> None:
        """What the next heartbeat tells the server: consumed samples and the loop's clock."""
        self._client.progress = (self.run, len(self._cursor.consumed), *self.host.statistics.loop_seconds())

    def _end_run(self) -> None:
        """Tell the server this run holds nothing any more (after its tasks were collected)."""
        if not self._ended:
            self._ended = True
            with contextlib.suppress(ServerGoneError):  # the server is gone: it holds nothing of ours either
                self._client.send("end", self.run)

    def drain(self) -> None:
        """Collect results still in flight, then end the run (releasing everything it held)."""
        if self._fallback is not None:
            self._fallback.drain()
        self._drain_window()
        self._cursor.clear()
        self._end_run()


def _detach(value: Any, arena: Arena) -> Any:
    """`value` with every array that is a view of the arena replaced by a copy."""
    if isinstance(value, np.ndarray):
        return value.copy() if value.size and arena.holds(value) else value
    if isinstance(value, dict):
        return {k: _detach(v, arena) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_detach(v, arena) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v, arena) for v in value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.numel() and value.device.type == "cpu":
        return value.clone() if arena.holds(value.numpy()) else value
    return value
