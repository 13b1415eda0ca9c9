"""Where a pass is in an epoch: one cursor for every way of running its tasks (in the calling
thread, by a Loader's workers, or fed by the server).

Task outputs arrive in task order; the cursor splits them into items, runs the tail's operators
over them (`dataset.tail`), drops what a resumed position had already yielded and says where the
pass is. A position counts tasks and the items taken from the current one: exact, because a
task's output is a pure function of (chain, epoch, task). A pass whose order is not (shared mode,
`named=True`) names the samples it consumed instead, and so does a local pass resumed from such
a position (the consumed samples, then the epoch's order without them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from globalloader.dataset.plan import Plan
from globalloader.dataset.resume import Position, epoch_order, positional, without
from globalloader.dataset.tail import NEED, Tail

END = object()  # `Cursor.next`: the epoch has no more items


class Cursor:
    """The position of one pass over (the rest of) an epoch of `plan`, from `position`."""

    def __init__(self, plan: Plan, position: Position, named: bool = False) -> None:
        epoch, task, offset, consumed, tail, base = position
        self.plan, self.epoch, self.named = plan, epoch, named
        self.order = epoch_order(plan, epoch, base)
        self.consumed = list(consumed or [])  # samples consumed before this pass (named: and by it)
        # The epoch's source indices still to come, when the position names what was consumed.
        self.left = None if consumed is None and not named else _remaining(self.order.indices(), self.consumed)
        self.next_task = self.collected = task  # the next task to claim; to add its output
        self.current, self.taken = task, 0  # the task whose items are pending, items taken from it
        self.skip = offset  # items of the first task yielded before the resume
        self.pending: deque[Any] = deque()
        self._pending_indices: deque[list[int]] = deque()  # named: the samples of each pending item
        self._reader = plan.stream_reader(epoch, task)
        self._claimed_all = False
        self.tail = Tail(plan.tail, plan.seed, epoch, tail) if plan.grouped else None
        if self.tail is not None:
            self.tail.fed = offset
        self.tasks = None if self._reader is not None else self._count_tasks()

    def _count_tasks(self) -> int:
        if self.left is not None:
            return self.plan.tasks_for(len(self.left))
        total = self.order.num_tasks()
        assert total is not None, "a random-access chain knows its length"
        return total

    def indices(self, task: int) -> np.ndarray | None:
        """Source indices of `task` (None: the task's own positions, mapped by whoever runs it)."""
        if self.left is None:
            return self.order.task_items(task)
        size = self.plan.task_size
        return self.left[task * size : (task + 1) * size]

    def sources(self, task: int) -> np.ndarray:
        """Source indices of `task`, whoever maps them: what a remote source is told to fetch
        ahead (random-access chains: a stream's records come with its tasks)."""
        given = self.indices(task)
        return given if given is not None else positional(self.plan).task_indices(self.epoch, task)

    def claim(self) -> tuple[int, Any] | None:
        """The next task to run and its items ((index, record) pairs of a stream, else `indices`);
        None past the end of the epoch."""
        if self._claimed_all:
            return None
        t = self.next_task
        items: Any
        if self._reader is not None:
            items = self._reader.task(t)
            if items is None:
                self._claimed_all = True
                return None
        else:
            assert self.tasks is not None, "a random-access chain knows its length"
            if t >= self.tasks:
                self._claimed_all = True
                return None
            items = self.indices(t)
        self.next_task += 1
        return t, items

    def add(self, output: Any, indices: list[list[int]] | None = None) -> None:
        """The next task's output (None: every sample of it skipped); when named, `indices` gives
        the samples of each of its items."""
        self.current, self.taken = self.collected, 0
        self.collected += 1
        if self.tail is not None:
            self.tail.add(output, self.skip)
            self.skip = 0
            return
        if output is not None:
            self.pending.extend([output] if self.plan.batch is not None else output)
            if self.named:
                assert indices is not None, "a named pass says which samples each item holds"
                self._pending_indices.extend(indices)
        if self.skip:
            for _ in range(min(self.skip, len(self.pending))):
                self.pending.popleft()
            self.taken, self.skip = self.skip, 0

    def next(self, collect: Callable[[], bool]) -> Any:
        """The next item, or END; `collect()` adds the next task's output and says whether there
        was one."""
        tail = self.tail
        while tail is not None:
            item = tail.pop()
            if self.named:
                self.consumed.extend(tail.fed_indices)
            tail.fed_indices.clear()
            if item is not NEED:
                return item
            if not collect() and not tail.flush():
                return END
        while not self.pending:
            if not collect():
                return END
        self.taken += 1
        if self.named:
            self.consumed.extend(self._pending_indices.popleft())
        return self.pending.popleft()

    def position(self) -> Position:
        """Where a resume continues: after the items yielded so far, whatever was run ahead."""
        tail, base = None if self.tail is None else self.tail.state(), self.order.base
        if self.named:
            return Position(self.epoch, 0, 0, list(self.consumed), tail, base)
        if self.tail is not None:
            task, offset = self.current, self.tail.fed
        elif self.pending:
            task, offset = self.current, self.taken
        elif self.skip:  # loaded mid-task, nothing yielded yet
            task, offset = self.current, self.skip
        else:
            task, offset = self.collected, 0
        if self.left is None:
            return Position(self.epoch, task, offset, None, tail, base)
        done = self.left[: task * self.plan.task_size + offset].tolist()
        return Position(self.epoch, 0, 0, self.consumed + done, tail, base)

    def clear(self) -> None:
        """Drop what is pending (the pass is abandoned; its position was taken)."""
        self.pending.clear()
        if self.tail is not None:
            self.tail.groups.clear()


def _remaining(all_indices: np.ndarray, consumed: list[int]) -> np.ndarray:
    """`all_indices` minus `consumed` as multisets, order kept (pad duplicates count twice)."""
    return all_indices[without(all_indices, consumed)] if consumed else all_indices
