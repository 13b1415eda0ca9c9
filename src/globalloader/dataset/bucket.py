"""`Dataset.bucket_batch`: batch samples of similar length together, to pad little.

Each sample goes to the bucket its `length_fn` value falls in (`boundaries` are the upper
limits, exclusive, of all buckets but the last); a bucket emits a batch when it holds its batch
size. At the end of the epoch the partial buckets are emitted in bucket order (unless
`drop_last`), so every sample is in exactly one batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader.dataset.batch import check_flag
from globalloader.dataset.collate import PadCollate
from globalloader.dataset.collate import collate as default_collate
from globalloader.dataset.map import describe_fn
from globalloader.errors import ArgumentError, GlobalLoaderError, TransformError, check_int

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True)
class BucketBatchOp:
    length_fn: Callable[[Any], int]
    boundaries: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    pad: Any = None
    drop_last: bool = False

    @classmethod
    def of(
        cls, length_fn: Any, boundaries: Sequence[int], batch_size: int | Sequence[int], pad: Any, drop_last: bool
    ) -> BucketBatchOp:
        if not callable(length_fn):
            raise ArgumentError(f"bucket_batch: length_fn must be callable, got {type(length_fn).__name__}")
        listed = isinstance(boundaries, (Sequence, np.ndarray)) and not isinstance(boundaries, str)
        bounds = tuple(boundaries) if listed else ()
        if (
            not bounds
            or any(not isinstance(b, (int, np.integer)) or isinstance(b, bool) for b in bounds)
            or list(bounds) != sorted(set(bounds))
        ):
            raise ArgumentError(f"bucket_batch: boundaries must be a list of increasing ints, got {boundaries!r}")
        bounds = tuple(int(b) for b in bounds)
        if isinstance(batch_size, (int, np.integer)):
            sizes: tuple[int, ...] = (batch_size,) * (len(bounds) + 1)
        elif isinstance(batch_size, Sequence) and not isinstance(batch_size, str):
            sizes = tuple(batch_size)
        else:
            raise ArgumentError(f"bucket_batch: batch_size must be an int or one int per bucket, got {batch_size!r}")
        if len(sizes) != len(bounds) + 1:
            raise ArgumentError(
                f"bucket_batch: {len(bounds)} boundaries make {len(bounds) + 1} buckets; got {len(sizes)} batch sizes"
            )
        sizes = tuple(check_int(size, "bucket_batch: batch_size", 1) for size in sizes)
        return cls(length_fn, bounds, sizes, pad, check_flag(drop_last, "bucket_batch: drop_last"))

    def attach(self, plan: Builder) -> None:
        plan.add_tail(self, "bucket_batch")

    def identity(self, strict: bool) -> tuple[object, ...]:
        name = getattr(self.length_fn, "__name__", "length_fn")
        return (*self.describe(), repr(self.pad), describe_fn("bucket_batch", self.length_fn, name, None, strict))

    def describe(self) -> tuple[object, ...]:
        return ("bucket_batch", self.boundaries, self.batch_sizes, self.drop_last)

    def stage(self, seed: int, epoch: int, position: int) -> BucketStage:
        return BucketStage(self)


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= 80 else text[:77] + "..."


class BucketStage:
    def __init__(self, op: BucketBatchOp) -> None:
        self.op = op
        self.collate = PadCollate(op.pad) if op.pad is not None else default_collate
        self.buckets: list[list[Any]] = [[] for _ in op.batch_sizes]

    def feed(self, item: Any) -> list[Any]:
        try:
            length = self.op.length_fn(item)
        except GlobalLoaderError:
            raise
        except Exception as exc:
            raise TransformError(f"bucket_batch: length_fn failed: {type(exc).__name__}: {exc}") from exc
        number = isinstance(length, (int, float, np.integer, np.floating)) and not isinstance(length, bool)
        if not number or length != length:  # NaN sorts nowhere
            raise TransformError(f"bucket_batch: length_fn must return a number, got {length!r} for {_short(item)}")
        b = bisect.bisect_right(self.op.boundaries, length)
        bucket = self.buckets[b]
        bucket.append(item)
        if len(bucket) < self.op.batch_sizes[b]:
            return []
        self.buckets[b] = []
        return [self.collate(bucket)]

    def flush(self) -> list[Any]:
        out = [] if self.op.drop_last else [self.collate(b) for b in self.buckets if b]
        self.buckets = [[] for _ in self.op.batch_sizes]
        return out

    def state(self) -> Any:
        return [list(b) for b in self.buckets]

    def restore(self, state: Any) -> None:
        buckets = [list(b) for b in state]
        sizes = self.op.batch_sizes
        if len(buckets) != len(sizes) or any(len(b) >= n for b, n in zip(buckets, sizes, strict=True)):
            raise ValueError(f"buckets of {[len(b) for b in buckets]} records, but batches of {self.op.batch_sizes}")
        self.buckets = buckets

    def held(self) -> list[Any]:
        return [item for bucket in self.buckets for item in bucket]
