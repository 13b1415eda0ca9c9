"""The default collate: a list of samples -> one batch of stacked NumPy arrays.

Dicts collate per key, tuples and lists per position, arrays and numbers stack into one array;
strings, bytes and other objects stay a Python list, so nothing is silently converted or lost.
Tensors of any framework with a `.numpy()` method are stacked as NumPy arrays too (the torch
adapter turns batches back into tensors in the consumer, after shared-memory transport).
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Number
from typing import Any

import numpy as np

from globalloader.errors import ArgumentError


class Stacked:
    """A stack of equal-shaped arrays not yet copied anywhere: the shared-memory transport
    stacks it straight into its segment, saving a full copy of the batch (and the page faults
    of a fresh multi-megabyte buffer) in every worker."""

    __slots__ = ("dtype", "items", "nbytes", "shape")

    def __init__(self, items: list[np.ndarray]) -> None:
        self.items = items
        self.shape = (len(items), *items[0].shape)
        self.dtype = items[0].dtype
        self.nbytes = items[0].nbytes * len(items)

    def stack_into(self, out: np.ndarray) -> None:
        np.stack(self.items, out=out)


def collate(samples: Sequence[Any], deferred: bool = False, pad: Any = None) -> Any:
    """Collate a non-empty list of samples of the same structure (`deferred`: leave array
    stacks as `Stacked` for the transport to fill). `pad`: a value, or {key: value} for some
    keys of dict samples, to pad arrays of different shapes up to the largest in the batch."""
    return _collate(list(samples), "batch", deferred, pad)


class PadCollate:
    """The default collate with padding (`batch(n, pad=...)`); picklable, with a stable identity."""

    def __init__(self, pad: Any) -> None:
        if pad is None or not (isinstance(pad, (int, float, bool, np.generic, dict))):
            raise ArgumentError(f"batch: pad must be a number or a dict of numbers per key, got {pad!r}")
        self.pad = pad
        self.fingerprint = repr(("pad", sorted(pad.items()) if isinstance(pad, dict) else pad))

    def __call__(self, samples: Sequence[Any]) -> Any:
        return _collate(list(samples), "batch", False, self.pad)


def _padded(items: list[np.ndarray], value: Any) -> np.ndarray:
    ndims = {it.ndim for it in items}
    if len(ndims) > 1:
        raise ArgumentError(f"collate: cannot pad arrays of different ranks {sorted(ndims)}")
    shape = tuple(max(sizes) for sizes in zip(*(it.shape for it in items), strict=True))
    out = np.full((len(items), *shape), value, dtype=items[0].dtype)
    for k, it in enumerate(items):
        out[k][tuple(slice(0, d) for d in it.shape)] = it
    return out


def _collate(items: list[Any], where: str, deferred: bool = False, pad: Any = None) -> Any:
    first = items[0]
    if isinstance(first, dict):
        missing = next((it for it in items if not isinstance(it, dict) or it.keys() != first.keys()), None)
        if missing is not None:
            raise ArgumentError(
                f"collate: samples in {where} have different keys: {sorted(first)} vs "
                f"{sorted(missing) if isinstance(missing, dict) else type(missing).__name__}"
            )
        pads = pad if isinstance(pad, dict) else dict.fromkeys(first, pad)
        return {k: _collate([it[k] for it in items], f"{where}[{k!r}]", deferred, pads.get(k)) for k in first}
    if isinstance(first, (tuple, list)) and not isinstance(first, str):
        if any(len(it) != len(first) for it in items):
            raise ArgumentError(f"collate: samples in {where} have different lengths")
        scalar_pad = None if isinstance(pad, dict) else pad
        columns = [_collate([it[j] for it in items], f"{where}[{j}]", deferred, scalar_pad) for j in range(len(first))]
        return tuple(columns) if isinstance(first, tuple) else columns
    if isinstance(first, np.ndarray) and first.dtype != object:
        shapes = {it.shape for it in items}
        if len(shapes) > 1 and pad is not None and not isinstance(pad, dict):
            return _padded(items, pad)
        if len(shapes) > 1:
            raise ArgumentError(
                f"collate: arrays in {where} have different shapes {sorted(shapes)}; "
                "resize them in a map, pad them with batch(n, pad=0), or pass collate="
            )
        return Stacked(items) if deferred and first.nbytes else np.stack(items)
    if isinstance(first, (Number, np.generic)) and not isinstance(first, bool | np.bool_):
        return np.asarray(items)
    if isinstance(first, (bool, np.bool_)):
        return np.asarray(items, dtype=bool)
    if hasattr(first, "numpy") and hasattr(first, "shape"):
        return _collate([it.numpy() for it in items], where, deferred, pad)
    return items
