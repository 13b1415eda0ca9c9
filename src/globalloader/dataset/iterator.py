"""Sequential in-process iteration of one epoch of a chain, with an exact, resumable position.

The tasks run in the calling thread, one at a time, and the position is the `Cursor`'s
(`dataset.cursor`): the state the Loader writes for the same place, so either resumes the other.
"""

from __future__ import annotations

from typing import Any

from globalloader.dataset.cursor import END, Cursor
from globalloader.dataset.plan import Plan
from globalloader.dataset.resume import Position, load_state, make_state
from globalloader.errors import StateError


class DatasetIterator:
    """Iterates one epoch of `plan` in the calling thread; `state_dict()` at any point."""

    def __init__(self, plan: Plan, epoch: int = 0, task: int = 0, offset: int = 0) -> None:
        self.plan, self.epoch = plan, epoch
        self._cursor = Cursor(plan, Position(epoch, task, offset))

    def __iter__(self) -> DatasetIterator:
        return self

    def _run_next_task(self) -> bool:
        claimed = self._cursor.claim()
        if claimed is None:
            return False
        self._cursor.add(self.plan.run_task(self.epoch, *claimed).output)
        return True

    def __next__(self) -> Any:
        item = self._cursor.next(self._run_next_task)
        if item is END:
            raise StopIteration
        return item

    def state_dict(self) -> dict[str, Any]:
        """Position after the items yielded so far."""
        return make_state(self.plan, self._cursor.position())

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """A state of this chain, or one (or every rank's) from another rank or world size."""
        position = load_state(self.plan, state)
        if position.consumed is not None:
            raise StateError("a shared-mode state (a consumed set) loads into a Loader, not a Dataset iterator")
        self.epoch = position.epoch
        self._cursor = Cursor(self.plan, position)
