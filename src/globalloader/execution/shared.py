"""A Loader epoch fed by the global loader server (`Loader(..., share=True)`).

The chain is split after its last `map(..., shared=True)`: the server reads and runs that prefix
once per sample for every job with the same prefix, into shared memory; this job's own workers
run the rest (random maps, collate) on samples read in place, in tasks of one batch, then the
job releases its references. The joint sampler chooses the order, so it is a uniformly random
order of this job's set that depends on the other jobs' timing: shared mode trades bit-exact
order for sharing. The position is the set of samples already yielded this epoch, which is what
a resume needs ("the rest of the epoch is a uniform order of what remains").

If the server goes away, the run raises ServerGone, or with `share="auto"` warns once and goes
on loading by itself from the same position.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader.dataset.chain import Dataset
from globalloader.errors import ArgumentError, CorruptSampleError, PoolTooSmall, ServerGone
from globalloader.execution.stats import warn_skipped
from globalloader.service.protocol import POOL_TOO_SMALL
from globalloader.execution.workers import Task

if TYPE_CHECKING:
    from globalloader.execution.loader import Loader


class SharedSession:
    """This Loader's registration with the server: one job, re-armed every epoch."""

    def __init__(self, loader: "Loader") -> None:
        import cloudpickle

        from globalloader.service.client import Client
        from globalloader.service.protocol import default_socket

        plan = loader.plan
        if plan.is_stream:
            raise ArgumentError("share=True needs a random-access source; a stream cannot be shared")
        prefix = Dataset(plan.source, tuple(plan.maps[: plan.split])).plan
        self.prefix_fp = prefix.fingerprint
        for op in prefix.maps:
            _by_value_if_local(cloudpickle, op.fn)
        self.client = Client(loader.server or default_socket(), memory=loader.server_memory)
        self._hello = {
            "name": loader.name or f"{os.path.basename(os.sys.argv[0] or 'python')}[{os.getpid()}]",
            "pid": os.getpid(), "prefix_fp": self.prefix_fp, "prefix": cloudpickle.dumps(prefix),
            "seed": plan.seed,
        }
        self.job: int | None = None
        self.arena: str | None = None

    def start_epoch(self, epoch: int, indices: np.ndarray) -> None:
        if self.job is None:
            self.client.send("hello", {**self._hello, "epoch": epoch, "indices": indices})
            msg = self.client.get()
            if msg[0] != "welcome":
                raise ServerGone(f"unexpected answer from the server: {msg!r:.200}")
            self.job, self.arena = msg[1], msg[2]
        else:
            self.client.send("epoch", epoch, indices)

    def close(self) -> None:
        self.client.close()


def _by_value_if_local(cloudpickle: Any, fn: Any) -> None:
    """Ship the user's own modules' code with the chain: the server may not import them (a
    script's folder, a test module), while installed packages it imports like we do."""
    module = sys.modules.get(getattr(fn, "__module__", None) or type(fn).__module__)
    path = getattr(module, "__file__", None) or ""
    installed = any(part in path for part in ("site-packages", "dist-packages", sysconfig.get_paths()["stdlib"]))
    if module is not None and path and not installed and not module.__name__.startswith("globalloader"):
        cloudpickle.register_pickle_by_value(module)


def remaining_indices(all_indices: np.ndarray, consumed: list[int]) -> np.ndarray:
    """`all_indices` minus `consumed` as multisets, order kept (pad duplicates count twice)."""
    if not consumed:  # every epoch start: no per-index Python work
        return all_indices
    left = Counter(consumed)
    keep = np.ones(len(all_indices), dtype=bool)
    for pos, index in enumerate(all_indices.tolist()):
        if left[index]:
            left[index] -= 1
            keep[pos] = False
    return all_indices[keep]


class SharedRun:
    """One pass over (the rest of) an epoch with samples from the server."""

    def __init__(self, loader: "Loader", epoch: int, consumed: list[int]) -> None:
        self.loader, self.plan, self.epoch = loader, loader.plan, epoch
        self.consumed = list(consumed)
        self._pool, self._width = loader._pool, max(1, loader.workers)
        todo = remaining_indices(self.plan.indices(epoch), self.consumed)
        unique, counts = np.unique(todo, return_counts=True)
        # The sampler serves a set; the few padding repeats ("pad" sharding) are loaded locally.
        self._extra: deque[int] = deque(np.repeat(unique, counts - 1).tolist())
        self._unserved = self._unique = len(unique)  # tickets not yet asked for; in all
        size = self.plan.task_size
        drop = self.plan.batch is not None and self.plan.batch.drop_last
        self._tasks_total = len(todo) // size if drop else -(-len(todo) // size)
        self._session: SharedSession = loader._session
        self._session.start_epoch(epoch, unique)
        self._window = (loader.prefetch + 1) * size
        self._asked = 0
        self._tickets: dict[int, tuple] = {}  # seq -> ticket, until taken in order
        self._next_seq = 0
        self._ready: deque[tuple] = deque()  # tickets in order, not yet in a task
        self._in_flight: deque[tuple[list[int], list[int]]] = deque()  # (all, shared) indices per task
        self._next_task = 0
        self._pending: deque[Any] = deque()
        self._pending_indices: deque[list[int]] = deque()
        self._skipped: list[tuple[int, str]] = []
        self._fallback: Any = None  # the local run that took over when the server went away
        # Unbatched samples with no map after the split are arena views when no process worker
        # copied them into its transport: they must be copied before their references go.
        self._in_place = (
            self.plan.batch is None
            and self.plan.split == len(self.plan.maps)
            and (loader.mode == "thread" or not loader.workers)
        )

    def __iter__(self) -> "SharedRun":
        return self

    def position(self) -> tuple[int, int, int, list[int]]:
        if self._fallback is not None:
            return self._fallback.position()
        return (self.epoch, 0, 0, list(self.consumed))

    # -- tickets from the server -------------------------------------------------------------
    def _ask(self, need: int) -> None:
        """Have `need` tickets beyond those received asked for (at most `window`): enough for the
        server's workers to load ahead, not so many that the sampler decides long before use."""
        outstanding = self._asked - self._next_seq
        want = min(need, self._window) - outstanding
        want = min(want, self._unserved)
        if want > 0:
            self._session.client.send("want", want)
            self._asked += want
            self._unserved -= want

    def _receive(self, block: bool = True) -> None:
        """Take messages until the next ticket in order is here (or, not blocking, whatever has
        arrived)."""
        client = self._session.client
        while self._next_seq < self._unique and self._next_seq not in self._tickets:
            msg = client.get() if block else client.get_nowait()
            if msg is None:
                break
            if msg[0] in ("ticket", "error"):
                self._tickets[msg[1]] = msg
        while self._next_seq in self._tickets:
            self._ready.append(self._tickets.pop(self._next_seq))
            self._next_seq += 1

    def _take_items(self, block: bool) -> list[tuple] | None:
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
        items: list[tuple] = []
        while len(items) < size:
            if not self._ready and self._next_seq < self._unique:
                self._ask(2 * size - len(items))
                self._receive()
            if self._ready:
                msg = self._ready.popleft()
                if msg[0] == "error":  # the server could not load it; the others go on
                    self._bad(msg[2], msg[3])
                else:
                    items.append(msg[2:])
            elif self._extra:
                items.append((self._extra.popleft(), None, None))
            else:
                break
        return items

    def _bad(self, index: int, message: str) -> None:
        if POOL_TOO_SMALL in message:
            raise PoolTooSmall(message)
        if self.loader.on_error != "skip":
            raise CorruptSampleError(f"the global loader could not load {message}")
        self._skipped.append((index, message))
        self.loader._stats.add_skipped(1)
        self.consumed.append(index)

    # -- running tasks -----------------------------------------------------------------------
    def _submit(self) -> None:
        while len(self._in_flight) < self.loader.prefetch:
            items = self._take_items(block=not self._in_flight)
            if not items:
                return
            t = self._next_task
            self._next_task += 1
            self._pool.submit(t % self._width, Task(self.epoch, t, items, self.plan.split, self._session.arena))
            self._in_flight.append(([i for i, _, _ in items], [i for i, o, _ in items if o is not None]))

    def __next__(self) -> Any:
        if self._fallback is not None:
            return next(self._fallback)
        try:
            return self._next()
        except ServerGone as exc:
            self.drain()
            self._fallback = self.loader.fall_back(exc, self.epoch, self.consumed)
            return next(self._fallback)

    def _next(self) -> Any:
        while not self._pending:
            self._submit()
            if not self._in_flight:
                self._end_epoch()
            t = self._next_task - len(self._in_flight)
            indices, shared = self._in_flight.popleft()
            try:
                res = self._pool.result(t % self._width)
            except BaseException:
                self.loader._broken()
                raise
            self._session.client.send("release", shared)  # the task's output no longer uses them
            self.loader._stats.add_task(res.timer, res.idle, len(res.skipped))
            self._skipped.extend(res.skipped)
            if res.output is None:
                self.consumed.extend(indices)
            elif self.plan.batch is not None:
                self._pending.append(res.output)
                self._pending_indices.append(indices)
            else:
                skipped = {i for i, _ in res.skipped}
                self._pending.extend(_copied(res.output) if self._in_place else res.output)
                self._pending_indices.extend([i] for i in indices if i not in skipped)
        self.consumed.extend(self._pending_indices.popleft())
        return self._pending.popleft()

    def _end_epoch(self) -> None:
        warn_skipped(self._skipped, self.epoch)
        if self.loader._run is self:
            self.loader._finished(self)
        raise StopIteration

    def drain(self) -> None:
        """Collect results still in flight and release their samples."""
        while self._in_flight:
            t = self._next_task - len(self._in_flight)
            _, shared = self._in_flight.popleft()
            try:
                self._pool.result(t % self._width)
                self._session.client.send("release", shared)
            except ServerGone:
                pass
            except BaseException:
                self.loader._close_pool()
                break
        self._pending.clear()


def _copied(samples: list[Any]) -> list[Any]:
    """Unbatched samples read in place must outlive their references: copy their arrays."""
    from globalloader.execution.shm import copy_arrays, decode_tree, encode_tree

    out = []
    for sample in samples:
        tree, placed, nbytes = encode_tree(sample)
        buffer = np.empty(nbytes, np.uint8)
        copy_arrays(buffer, 0, placed)
        out.append(decode_tree(tree, buffer))
    return out
