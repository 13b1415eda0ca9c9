"""`Dataset.batch`: group consecutive samples; the unit of work and of transport in the Loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from globalloader.dataset.collate import collate as default_collate
from globalloader.errors import ArgumentError


@dataclass(frozen=True)
class BatchOp:
    size: int
    drop_last: bool
    collate: Callable[[list[Any]], Any] = default_collate

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ArgumentError(f"batch: n must be an int >= 1, got {self.size!r}")
        if not callable(self.collate):
            raise ArgumentError(f"batch: collate must be callable, got {type(self.collate).__name__}")

    def count(self, samples: int) -> int:
        """Batches per epoch for `samples` samples."""
        return samples // self.size if self.drop_last else -(-samples // self.size)
