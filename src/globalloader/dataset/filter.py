"""`Dataset.filter`: keep the samples a predicate accepts (in the workers, before batching).

A filtered chain no longer knows how many samples an epoch has, so batches are cut in the
consumer from the samples that remain (`dataset.tail`), exactly resumable like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from globalloader.dataset.map import describe_fn, takes_rng
from globalloader.dataset.seeds import sample_rng

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True)
class FilterOp:
    """`predicate(x)` (or `predicate(x, rng=...)`) -> truthy to keep `x`."""

    predicate: Callable[..., Any]
    name: str
    key: str | None = None
    shared: bool = field(default=False, init=False)
    expands: bool = field(default=True, init=False)
    random: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "random", takes_rng(self.predicate))

    def attach(self, plan: Builder) -> None:
        plan.add_record(self)

    def identity(self, strict: bool = True) -> str:
        return describe_fn("filter", self.predicate, self.name, self.key, strict)

    def apply(self, value: Any, seed: int, epoch: int, index: int, position: int, *sub: int) -> list[Any]:
        if self.random:
            keep = self.predicate(value, rng=sample_rng(seed, epoch, index, position, *sub))
        else:
            keep = self.predicate(value)
        return [value] if keep else []

    def describe(self) -> tuple[object, ...]:
        return ("filter", self.name)
