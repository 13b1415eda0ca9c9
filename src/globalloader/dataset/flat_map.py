"""`Dataset.flat_map`: one sample in, any number out (split a document, unbatch, crop many).

The records a sample makes stay together and in order; maps after a flat_map see each of them,
random ones with a generator seeded by (seed, epoch, sample index, position, record number).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from globalloader.dataset.map import describe_fn, takes_rng
from globalloader.dataset.seeds import sample_rng
from globalloader.errors import TransformError

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True)
class FlatMapOp:
    """`fn(x)` (or `fn(x, rng=...)`) returns an iterable of records (a list, a generator)."""

    fn: Callable[..., Any]
    name: str
    key: str | None = None
    shared: bool = field(default=False, init=False)
    expands: bool = field(default=True, init=False)
    random: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "random", takes_rng(self.fn))

    def attach(self, plan: Builder) -> None:
        plan.add_record(self)

    def identity(self, strict: bool = True) -> str:
        return describe_fn("flat_map", self.fn, self.name, self.key, strict)

    def apply(self, value: Any, seed: int, epoch: int, index: int, position: int, *sub: int) -> list[Any]:
        out = self.fn(value, rng=sample_rng(seed, epoch, index, position, *sub)) if self.random else self.fn(value)
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
            raise TransformError(f"flat_map {self.name!r} must return an iterable of records, got {type(out).__name__}")
        return list(out)

    def describe(self) -> tuple[object, ...]:
        return ("flat_map", self.name)
