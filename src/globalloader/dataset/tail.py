"""The consumer side of a chain whose items do not line up with tasks (after a filter,
flat_map, pack or bucket_batch): the tail operators run in order over the records the workers
made, in epoch order, and their carry-over state is part of the position.

Workers return, for each sample of a task, the group of records it made (empty if filtered).
The position is (task, groups of it fed, tail state); the tail state holds each operator's
carry (a partial packed row, filling buckets), the items waiting for each operator and the
outputs made but not yet yielded, so `state_dict()` anywhere resumes exactly, whatever was
prefetched.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from globalloader.errors import GlobalLoaderError, StateError, TransformError

if TYPE_CHECKING:
    from globalloader.dataset.operator import RecordOp, Stage, TailOp

NEED = object()  # `Tail.pop`: feed me the next task's groups


@dataclass(frozen=True)
class TailRecord:
    """A map or filter written after a tail operator: it runs in the consumer on each output,
    random ones seeded by (seed, epoch, output number, position)."""

    op: RecordOp
    position: int

    def identity(self, strict: bool) -> Any:
        return self.op.identity(strict)

    def describe(self) -> tuple[object, ...]:
        return self.op.describe()

    def stage(self, seed: int, epoch: int, position: int) -> RecordStage:
        return RecordStage(self.op, seed, epoch, position)


class RecordStage:
    def __init__(self, op: RecordOp, seed: int, epoch: int, position: int) -> None:
        self.op, self.seed, self.epoch, self.position = op, seed, epoch, position
        self.count = 0

    def feed(self, item: Any) -> list[Any]:
        number, self.count = self.count, self.count + 1
        try:
            out = self.op.apply(item, self.seed, self.epoch, number, self.position)
        except (GlobalLoaderError, ImportError, MemoryError):
            raise
        except Exception as exc:
            raise TransformError(f"{self.op.name!r} failed on item {number}: {type(exc).__name__}: {exc}") from exc
        return out if self.op.expands else [out]

    def flush(self) -> list[Any]:
        return []

    def state(self) -> Any:
        return self.count

    def restore(self, state: Any) -> None:
        if isinstance(state, bool) or not isinstance(state, int) or state < 0:
            raise ValueError(f"an item count must be an int >= 0, got {state!r:.100}")
        self.count = state

    def held(self) -> list[Any]:
        return []


class Tail:
    """Runs the tail operators of one epoch; `add` a task's groups, `pop` the next output.

    Lazily: each operator is fed one item at a time, the latest operator with an item waiting
    first, until an output is made. Items made but not yet fed on wait in the next operator's
    queue, as inputs, not as outputs: a chain of another batch size resuming this state feeds
    them to its own operators, so no output of the old batch size is left over (`absorb`)."""

    def __init__(self, ops: list[TailOp], seed: int, epoch: int, state: dict[str, Any] | None = None) -> None:
        self.stages: list[Stage] = [op.stage(seed, epoch, k) for k, op in enumerate(ops)]
        self.queues: list[deque[Any]] = [deque() for _ in self.stages]  # inputs waiting for each stage
        self.out: deque[Any] = deque()
        self.groups: deque[tuple[int, list[Any]]] = deque()  # (index, records) of the current task
        self.fed = 0  # groups of the current task fed so far
        self.fed_indices: list[int] = []  # indices of the groups fed, for runs that count samples
        self.flushed = False  # the epoch's groups are all in: the stages flush, in order
        self.flushed_stages = 0
        if state is not None:
            try:
                for stage, s in zip(self.stages, state["stages"], strict=True):
                    stage.restore(s)
                for queue, items in zip(self.queues, state["queues"], strict=True):
                    queue.extend(items)
                self.out.extend(state["out"])
                self.flushed, self.flushed_stages = state["flushed"], state["flushed_stages"]  # typed by saved_state
            except (KeyError, TypeError, ValueError) as exc:
                raise StateError(f"the state dict's tail state does not fit this chain: {exc}") from exc
            if not 0 <= self.flushed_stages <= len(self.stages) or (self.flushed_stages and not self.flushed):
                raise StateError(f"the state dict's tail state flushed {self.flushed_stages} operators of {len(ops)}")

    def add(self, groups: list[tuple[int, list[Any]]], skip: int = 0) -> None:
        """The groups of the next task; the first `skip` were fed before a resume."""
        self.groups = deque(groups)
        for _ in range(min(skip, len(self.groups))):
            self.groups.popleft()
        self.fed = skip

    def pop(self) -> Any:
        """The next output, or NEED when the current task's groups are used up."""
        while not self.out:
            if self._step():
                continue
            if not self.groups:
                return NEED
            index, records = self.groups.popleft()
            self.fed += 1
            self.fed_indices.append(index)
            self._into(0).extend(records)
        return self.out.popleft()

    def flush(self) -> bool:
        """End of the epoch: the operators give what they hold (as `pop` goes on); False if that
        was done already."""
        if self.flushed:
            return False
        self.flushed = True
        return True

    def _into(self, k: int) -> deque[Any]:
        """Where the items stage k - 1 makes go: stage k's queue, or the outputs."""
        return self.queues[k] if k < len(self.stages) else self.out

    def _step(self) -> bool:
        """Feed one waiting item to the latest stage that has one, or flush the next stage once
        every item before it went through; False when there is nothing to do."""
        for k in reversed(range(len(self.stages))):
            if self.queues[k]:
                self._into(k + 1).extend(self.stages[k].feed(self.queues[k].popleft()))
                return True
        if self.flushed and self.flushed_stages < len(self.stages):
            k, self.flushed_stages = self.flushed_stages, self.flushed_stages + 1
            self._into(k + 1).extend(self.stages[k].flush())
            return True
        return False

    def absorb(self, other: Tail) -> None:
        """Take over what `other` (an old rank's tail, of another batch size or world) holds: its
        outputs not yet yielded, and what each of its operators held or had waiting, as inputs to
        these operators, which go on filling their rows, batches and buckets."""
        self.out.extend(other.out)
        for k, stage in enumerate(other.stages):
            self.queues[k].extend(stage.held())
            self.queues[k].extend(other.queues[k])

    def holds(self) -> bool:
        """Records are waiting in this tail (made, queued or held by an operator)."""
        return bool(self.out) or any(self.queues) or any(stage.held() for stage in self.stages)

    def state(self) -> dict[str, Any]:
        return {
            "stages": [s.state() for s in self.stages],
            "queues": [list(q) for q in self.queues],
            "out": list(self.out),
            "flushed": self.flushed,
            "flushed_stages": self.flushed_stages,
        }
