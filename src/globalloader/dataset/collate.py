"""The default collate: a list of samples -> one batch of stacked NumPy arrays.

Dicts collate per key, tuples and lists per position, arrays and numbers stack into one array;
strings, bytes and other objects stay a Python list, so nothing is silently converted or lost.
Tensors of any framework with a `.numpy()` method are stacked as NumPy arrays too (the torch
adapter turns batches back into tensors in the consumer, after shared-memory transport).
"""

from __future__ import annotations

from numbers import Number
from typing import Any, Sequence

import numpy as np

from globalloader.errors import ArgumentError


def collate(samples: Sequence[Any]) -> Any:
    """Collate a non-empty list of samples of the same structure."""
    return _collate(list(samples), "batch")


def _collate(items: list[Any], where: str) -> Any:
    first = items[0]
    if isinstance(first, dict):
        missing = next((it for it in items if not isinstance(it, dict) or it.keys() != first.keys()), None)
        if missing is not None:
            raise ArgumentError(
                f"collate: samples in {where} have different keys: {sorted(first)} vs "
                f"{sorted(missing) if isinstance(missing, dict) else type(missing).__name__}"
            )
        return {k: _collate([it[k] for it in items], f"{where}[{k!r}]") for k in first}
    if isinstance(first, (tuple, list)) and not isinstance(first, str):
        if any(len(it) != len(first) for it in items):
            raise ArgumentError(f"collate: samples in {where} have different lengths")
        columns = [_collate([it[j] for it in items], f"{where}[{j}]") for j in range(len(first))]
        return tuple(columns) if isinstance(first, tuple) else columns
    if isinstance(first, np.ndarray) and first.dtype != object:
        shapes = {it.shape for it in items}
        if len(shapes) > 1:
            raise ArgumentError(f"collate: arrays in {where} have different shapes {sorted(shapes)}; "
                                "resize them in a map or pass collate=")
        return np.stack(items)
    if isinstance(first, (Number, np.generic)) and not isinstance(first, bool | np.bool_):
        return np.asarray(items)
    if isinstance(first, (bool, np.bool_)):
        return np.asarray(items, dtype=bool)
    if hasattr(first, "numpy") and hasattr(first, "shape"):
        return _collate([it.numpy() for it in items], where)
    return items
