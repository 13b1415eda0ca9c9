"""Sequential in-process iteration of one epoch of a chain, with an exact, resumable position.

The position is (task, offset): the next task to run and, for unbatched chains, how many of its
samples were already yielded. It is what `state_dict()` returns and all a resume needs, because a
task's output is a pure function of (chain, epoch, task); the Loader uses the same position. A
chain with a tail (`dataset.tail`) adds the tail's state, and its offset counts samples fed to it.
An epoch resumed from another rank or world size runs this rank's share of what the old world left
(`dataset.resume`), its position counted in that share.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from globalloader.dataset.plan import Plan
from globalloader.dataset.resume import Base, epoch_order, load_state, make_state
from globalloader.dataset.tail import NEED, Tail
from globalloader.errors import StateError


class DatasetIterator:
    """Iterates one epoch of `plan` in the calling thread; `state_dict()` at any point."""

    def __init__(self, plan: Plan, epoch: int = 0, task: int = 0, offset: int = 0) -> None:
        self.plan, self.epoch = plan, epoch
        self._start(task, offset)

    def _start(self, task: int, offset: int, tail: dict[str, Any] | None = None, base: Base | None = None) -> None:
        self._order = epoch_order(self.plan, self.epoch, base)
        self._next_task = task
        self._current, self._taken = task, 0  # task whose output is pending, items taken from it
        self._pending: deque[Any] = deque()
        self._reader = self.plan.stream_reader(self.epoch, task) if self.plan.is_stream else None
        self._tail = Tail(self.plan.tail, self.plan.seed, self.epoch, tail) if self.plan.grouped else None
        if self._tail is not None:
            self._tail.fed = self._skip = offset
        elif offset and self._fill():
            for _ in range(offset):
                self._pending.popleft()
            self._taken = offset

    def __iter__(self) -> DatasetIterator:
        return self

    def _fill(self) -> bool:
        """Run the next task into `_pending`; False at the end of the epoch."""
        plan = self.plan
        items: np.ndarray | list[tuple[int, Any]] | None
        if self._reader is not None:
            items = plan.stream_task(self._reader, self._next_task)
            if items is None:
                return False
        else:
            tasks = self._order.num_tasks()
            assert tasks is not None, "a random-access chain knows its length"
            if self._next_task >= tasks:
                return False
            items = self._order.task_items(self._next_task)  # None: the task's own indices
        output = plan.run_task(self.epoch, self._next_task, items).output
        if self._tail is not None:
            self._tail.add(output, self._skip)
            self._skip = 0
        else:
            self._pending.extend([output] if plan.batch is not None else output)
        self._current, self._taken = self._next_task, 0
        self._next_task += 1
        return True

    def __next__(self) -> Any:
        tail = self._tail
        while tail is not None:
            item = tail.pop()
            if item is not NEED:
                return item
            if not self._fill() and not tail.flush():
                raise StopIteration
        while not self._pending:
            if not self._fill():
                raise StopIteration
        self._taken += 1
        return self._pending.popleft()

    def state_dict(self) -> dict[str, Any]:
        """Position after the items yielded so far."""
        plan, base = self.plan, self._order.base
        if self._tail is not None:
            return make_state(plan, self.epoch, self._current, self._tail.fed, self._tail.state(), base)
        if self._pending:
            return make_state(plan, self.epoch, self._current, self._taken, base=base)
        return make_state(plan, self.epoch, self._next_task, 0, base=base)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """A state of this chain, or one (or every rank's) from another rank or world size."""
        resume = load_state(self.plan, state)
        if resume.consumed is not None:
            raise StateError("a shared-mode state (a consumed set) loads into a Loader, not a Dataset iterator")
        self.epoch = resume.epoch
        self._start(resume.task, resume.offset, resume.tail, resume.base)
