"""`Dataset.batch`: group consecutive samples; the unit of work and of transport in the Loader.

A batch whose samples are known per task (no filter or flat_map before it) is collated in the
worker; otherwise it joins the consumer-side tail (`dataset.tail`), cutting batches across tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader.dataset.collate import PadCollate
from globalloader.dataset.collate import collate as default_collate
from globalloader.dataset.fingerprint import fingerprint
from globalloader.errors import ArgumentError, check_int

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


def check_flag(value: Any, what: str) -> bool:
    """A bool argument: `bool("False")` is True, so nothing else is taken for one."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{what} must be True or False, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class BatchOp:
    size: int
    drop_last: bool
    collate: Callable[[list[Any]], Any] = default_collate

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", check_int(self.size, "batch: n", 1))  # np.int64(32) -> 32
        if not callable(self.collate):
            raise ArgumentError(f"batch: collate must be callable, got {type(self.collate).__name__}")

    @classmethod
    def of(cls, n: int, drop_last: bool, collate: Callable[[list[Any]], Any] | None, pad: Any) -> BatchOp:
        if pad is not None and collate is not None:
            raise ArgumentError("batch: pad= pads with the default collate; a custom collate= pads itself")
        chosen = PadCollate(pad) if pad is not None else collate or default_collate
        return cls(n, check_flag(drop_last, "batch: drop_last"), chosen)

    def attach(self, plan: Builder) -> None:
        plan.set_batch(self)

    def count(self, samples: int) -> int:
        """Batches per epoch for `samples` samples."""
        return samples // self.size if self.drop_last else -(-samples // self.size)

    def identity(self, strict: bool) -> tuple[object, ...]:
        fix = "Pass a collate function whose state can be walked, or give it a string `fingerprint` attribute"
        return (self.size, self.drop_last, fingerprint(self.collate, "batch(collate=...)", fix, strict))

    def describe(self) -> tuple[object, ...]:
        return ("batch", self.size, self.drop_last)

    def stage(self, seed: int, epoch: int, position: int) -> BatchStage:
        return BatchStage(self)


class BatchStage:
    """A batch cut in the consumer: samples wait here until `size` of them arrived."""

    def __init__(self, op: BatchOp) -> None:
        self.op, self.buffer = op, list[Any]()

    def feed(self, item: Any) -> list[Any]:
        self.buffer.append(item)
        if len(self.buffer) < self.op.size:
            return []
        batch, self.buffer = self.buffer, []
        return [self.op.collate(batch)]

    def flush(self) -> list[Any]:
        batch, self.buffer = self.buffer, []
        return [self.op.collate(batch)] if batch and not self.op.drop_last else []

    def state(self) -> Any:
        return list(self.buffer)

    def restore(self, state: Any) -> None:
        if len(state) >= self.op.size:
            raise ValueError(f"a partial batch of {len(state)} samples, but batches hold {self.op.size}")
        self.buffer = list(state)

    def held(self) -> list[Any]:
        return list(self.buffer)
