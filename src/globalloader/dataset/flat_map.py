"""`Dataset.flat_map`: one sample in, any number out (split a document, unbatch, crop many).

The records a sample makes stay together and in order; maps after a flat_map see each of them,
random ones with a generator seeded by (seed, epoch, sample index, position, record number).
"""

from __future__ import annotations

from typing import Any

from globalloader.dataset.map import ExpandingOp
from globalloader.errors import TransformError


class FlatMapOp(ExpandingOp):
    """`fn(x)` (or `fn(x, rng=...)`) returns an iterable of records (a list, a generator)."""

    method = "flat_map"

    def expand(self, value: Any, out: Any) -> list[Any]:
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
            raise TransformError(f"flat_map {self.name!r} must return an iterable of records, got {type(out).__name__}")
        return list(out)
