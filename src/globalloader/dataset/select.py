"""`select(indices)`: keep the given positions of the input, in this order (an index operator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from globalloader.dataset.operator import IndexOp
from globalloader.errors import ArgumentError, SampleIndexError

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True, eq=False)
class Select(IndexOp):
    """Keep `indices` (positions of the input, in this order): a job's own index set."""

    indices: npt.NDArray[np.int64]
    per_epoch = False

    @classmethod
    def of(cls, indices: object) -> Select:
        try:
            given = np.asarray(indices if not isinstance(indices, (str, bytes)) else [indices])
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"select: indices must be integers, got {type(indices).__name__}") from exc
        if given.size and (given.dtype.kind not in "iu" or (given.dtype.kind == "u" and given.max() >= 2**63)):
            raise ArgumentError(  # 1.5 -> 1, True -> 1 or "3" -> 3 would select what nobody asked for
                f"select: indices must be integers, got {given.dtype} values such as {given.reshape(-1)[0]!r}"
            )
        if given.ndim > 1:  # [[1, 2], [3, 4]] is not a list of positions: flattening would guess
            raise ArgumentError(f"select: indices must be a flat list of integers, got an array of shape {given.shape}")
        arr = given.astype(np.int64).reshape(-1)
        arr.setflags(write=False)
        return cls(arr)

    def attach(self, plan: Builder) -> None:
        plan.add_index(self)

    def length(self, n: int) -> int:
        bad = (self.indices < 0) | (self.indices >= n)
        if bad.any():
            raise SampleIndexError(
                f"select: index {int(self.indices[bad][0])} is out of range for a dataset of {n} samples"
            )
        return len(self.indices)

    def parents(self, positions: npt.NDArray[np.int64], n: int, epoch: int) -> npt.NDArray[np.int64]:
        return self.indices[positions]

    def parents_run(self, start: int, stop: int, n: int, epoch: int) -> npt.NDArray[np.int64]:
        return self.indices[start:stop].copy()  # a copy: the caller may write to what it gets

    def shard_args(self) -> None:
        return None

    def describe(self) -> tuple[object, ...]:
        return ("select", self.indices)
