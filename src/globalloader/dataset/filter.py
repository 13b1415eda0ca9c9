"""`Dataset.filter`: keep the samples a predicate accepts (in the workers, before batching).

A filtered chain no longer knows how many samples an epoch has, so batches are cut in the
consumer from the samples that remain (`dataset.tail`), exactly resumable like any other.
"""

from __future__ import annotations

from typing import Any

from globalloader.dataset.map import ExpandingOp


class FilterOp(ExpandingOp):
    """`fn(x)` (or `fn(x, rng=...)`) -> truthy to keep `x`."""

    method = "filter"

    def expand(self, value: Any, out: Any) -> list[Any]:
        return [value] if out else []
