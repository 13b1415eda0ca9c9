"""The operator interface: each `Dataset` method appends one operator, and the operator itself
says which stage of the plan it joins (`attach`), so adding one touches no central switch.

Stages, in the order data flows:
- index: select, shuffle, shard (positions -> source indices, vectorized, no buffer; `IndexOp`),
  or over a stream, the buffer shuffle and the strided shard (records in, records out; `StreamOp`);
- record: map, filter, flat_map, run per sample in the workers (`RecordOp`);
- batch: one batch per task, collated in the worker;
- tail: operators whose output spans tasks (pack, bucket_batch, a batch after a filter), run in
  the consumer in order, with their carry-over state in `state_dict()` (`TailOp`).
The plan (`dataset.plan`) checks the order as operators attach, where the user wrote them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from globalloader.sampling.sharding import ShardArgs


class Builder(Protocol):
    """What an operator sees of the plan it joins (`dataset.plan.Plan`)."""

    def stream_seed(self, kind: str) -> int: ...
    def add_index(self, op: IndexOp) -> None: ...
    def add_stream_op(self, op: StreamOp) -> None: ...
    def add_record(self, op: RecordOp) -> None: ...
    def set_cache(self, op: Any) -> None: ...
    def set_batch(self, op: Any) -> None: ...
    def add_tail(self, op: TailOp, name: str) -> None: ...


class IndexOp(Protocol):
    """An operator of a random-access chain's index space (select, shuffle, shard): it maps its
    output positions to its input positions for an epoch, vectorized, without a buffer. All the
    plan knows of one is declared here, and each operator declares it (nothing is probed)."""

    # A position's input changes with the epoch (a shuffle): a chain without one reads the same
    # samples at the same positions every epoch (see `Plan.epoch_dependent`).
    per_epoch: ClassVar[bool]

    def attach(self, plan: Builder) -> None: ...

    def length(self, n: int) -> int:
        """Its output length for an input of `n` positions; an error naming the operator when it
        cannot apply to that input."""
        ...

    def parents(self, positions: npt.NDArray[np.int64], n: int, epoch: int) -> npt.NDArray[np.int64]:
        """The input positions (of an input of `n`) of its output `positions` in `epoch`."""
        ...

    def parents_run(self, start: int, stop: int, n: int, epoch: int) -> npt.NDArray[np.int64]:
        """`parents` of the run of positions [start, stop), a task's: an operator maps a run more
        cheaply than any positions where it can (a permutation's run, a slice of a window)."""
        return self.parents(np.arange(start, stop, dtype=np.int64), n, epoch)

    def shard_args(self) -> ShardArgs | None:
        """This rank's share when the operator splits its input among ranks (a shard); the
        positions before it are the epoch's global order, which an elastic resume splits anew."""
        ...

    def describe(self) -> tuple[object, ...]:
        """Its name and arguments: its part of the chain's identity."""
        ...


class StreamOp(Protocol):
    """An operator of a stream chain (the buffer shuffle, the strided shard): records in, records
    out, in order; a stream has no positions to map."""

    def attach(self, plan: Builder) -> None: ...

    def length(self, n: int | None) -> int | None:
        """Its output length for an input of `n` records (None: not known before reading)."""
        ...

    def apply(self, records: Iterator[Any], epoch: int, length: int | None) -> Iterator[Any]:
        """Its records of `epoch` from the input's `records` (`length` of them, if known)."""
        ...

    def describe(self) -> tuple[object, ...]: ...


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

    def describe(self) -> tuple[object, ...]: ...

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

    def describe(self) -> tuple[object, ...]:
        """Its name and arguments, as the user wrote them."""
        ...
