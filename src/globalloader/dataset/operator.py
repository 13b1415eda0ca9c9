"""The operator interface: each `Dataset` method appends one operator, and the operator itself
says which stage of the plan it joins (`attach`), so adding one touches no central switch.

Stages, in the order data flows:
- index: select, shuffle, shard (positions -> source indices, vectorized, no buffer);
- record: map, filter, flat_map, run per sample in the workers (`RecordOp`);
- batch: one batch per task, collated in the worker;
- tail: operators whose output spans tasks (pack, bucket_batch, a batch after a filter), run in
  the consumer in order, with their carry-over state in `state_dict()` (`TailOp`).
The plan (`dataset.plan`) checks the order as operators attach, where the user wrote them.
"""

from __future__ import annotations

from typing import Any, Protocol


class Builder(Protocol):
    """What an operator sees of the plan it joins (`dataset.plan.Plan`)."""

    def stream_seed(self, kind: str) -> int: ...
    def add_index(self, op: Any) -> None: ...
    def add_stream_op(self, op: Any) -> None: ...
    def add_record(self, op: RecordOp) -> None: ...
    def set_cache(self, op: Any) -> None: ...
    def set_batch(self, op: Any) -> None: ...
    def add_tail(self, op: TailOp, name: str) -> None: ...


class RecordOp(Protocol):
    """A per-sample operator. `apply` returns the new value, or for an `expands` operator the
    list of values (none to drop the sample, several to make more)."""

    @property
    def name(self) -> str: ...
    @property
    def shared(self) -> bool: ...
    @property
    def random(self) -> bool: ...
    @property
    def expands(self) -> bool: ...

    def identity(self, strict: bool = True) -> str: ...

    def apply(self, value: Any, seed: int, epoch: int, index: int, position: int, *sub: int) -> Any: ...


class Stage(Protocol):
    """One tail operator's state over an epoch."""

    def feed(self, item: Any) -> list[Any]: ...

    def flush(self) -> list[Any]: ...

    def state(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def held(self) -> list[Any]:
        """What the stage holds, as the inputs it was fed: a chain of another world or batch size
        feeds them to its own stage, which goes on filling its row, batch or bucket."""
        ...


class TailOp(Protocol):
    def stage(self, seed: int, epoch: int, position: int) -> Stage: ...

    def identity(self, strict: bool) -> Any: ...
