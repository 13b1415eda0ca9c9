"""The default collate: a list of samples -> one batch of stacked NumPy arrays.

Dicts collate per key, tuples and lists per position, arrays and numbers stack into one array
of their common dtype (NumPy's promotion rules; a mix that would change a value, such as
numbers with text or int64 with uint64, is an `ArgumentError` naming the field); strings, bytes,
other objects and samples of mixed kinds stay a Python list, so nothing is silently converted.
Tensors of any framework with a `.numpy()` method are stacked as NumPy arrays too (the torch
adapter turns batches back into tensors in the consumer, after shared-memory transport).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from numbers import Number
from typing import Any

import numpy as np

from globalloader import _slots
from globalloader.errors import ArgumentError

_INT64_MAX = int(np.iinfo(np.int64).max)


class Stacked:
    """A stack of equal-shaped arrays not yet copied anywhere: the shared-memory transport
    stacks it straight into its segment, saving a full copy of the batch (and the page faults
    of a fresh multi-megabyte buffer) in every worker. `dtype` is the items' common dtype."""

    __slots__ = ("dtype", "items", "nbytes", "shape")

    def __init__(self, items: list[np.ndarray], dtype: np.dtype[Any] | None = None) -> None:
        self.items = items
        self.shape = (len(items), *items[0].shape)
        self.dtype = items[0].dtype if dtype is None else dtype
        self.nbytes = self.dtype.itemsize * len(items) * items[0].size

    def stack_into(self, out: np.ndarray) -> None:
        np.stack(self.items, out=out, casting="safe")


def collate(samples: Sequence[Any], deferred: bool = False, pad: Any = None) -> Any:
    """Collate a non-empty list of samples of the same structure (`deferred`: leave array
    stacks as `Stacked` for the transport to fill). `pad`: a value, or {key: value} for some
    keys of dict samples, to pad arrays of different shapes up to the largest in the batch."""
    return _collate(list(samples), "batch", deferred, pad)


class PadCollate:
    """The default collate with padding (`batch(n, pad=...)`); picklable, with a stable identity."""

    def __init__(self, pad: Any) -> None:
        values = pad.values() if isinstance(pad, dict) else [pad]
        if pad is None or not all(_is_number(v) or isinstance(v, (bool, np.bool_)) for v in values):
            raise ArgumentError(f"batch: pad must be a number or a dict of numbers per key, got {pad!r}")
        self.pad = pad
        self.fingerprint = repr(("pad", sorted(pad.items()) if isinstance(pad, dict) else pad))

    def __call__(self, samples: Sequence[Any]) -> Any:
        return _collate(list(samples), "batch", False, self.pad)


def common_dtype(dtypes: Sequence[np.dtype[Any]], where: str) -> np.dtype[Any]:
    """The dtype that holds every value of `dtypes` by NumPy's promotion rules, or an
    `ArgumentError` naming `where` and two of the types when stacking would change a value:
    numbers with text, or integers that only a float holds together (int64 with uint64)."""
    first = dtypes[0]
    if all(d == first for d in dtypes):
        return first
    kinds = {_kind(d) for d in dtypes}
    categories = {"number" if k == "integer" else k for k in kinds}
    other = next(d for d in dtypes if d != first)
    try:
        out = np.result_type(*dtypes)
    except TypeError as exc:  # DTypePromotionError is a TypeError
        raise ArgumentError(f"collate: {where} mixes {first} and {other}, which have no common type") from exc
    if len(categories) > 1 or (kinds == {"integer"} and _kind(out) != "integer"):
        raise ArgumentError(
            f"collate: {where} mixes {first} and {other}; stacking them would change values "
            f"(NumPy makes them {out}): cast them to one type in a map"
        )
    return out


def check_exact(items: list[np.ndarray], dtype: np.dtype[Any], where: str) -> None:
    """Refuse items that `dtype` does not hold exactly: integers promoted to a float (NumPy's
    rule rounds them beyond 2**53), dates and durations promoted to a finer unit (a date far
    from 1970 overflows nanoseconds and wraps), records whose fields were promoted so."""
    for it in items:
        if it.dtype == dtype or it.dtype.kind not in "iumMV":
            continue  # bool, floats and complex widen exactly; text was checked by kind
        with np.errstate(all="ignore"), warnings.catch_warnings():  # a cast that overflows is what this looks for
            warnings.simplefilter("ignore")
            back = it.astype(dtype).astype(it.dtype)
        same = back.tobytes() == it.tobytes() if it.dtype.names else np.array_equal(back, it, equal_nan=True)
        if not same:
            raise ArgumentError(
                f"collate: {where} mixes {it.dtype} with {dtype}, which cannot hold some of its values "
                "exactly: cast them to one type in a map"
            )


def fits(value: Any, dtype: np.dtype[Any]) -> bool:
    """Whether `dtype` holds `value` (a pad or fill value): exactly for integers and booleans,
    to the nearest float without overflow for floats."""
    if np.iscomplexobj(value) and dtype.kind != "c" and np.imag(value) != 0:
        return False  # the imaginary part would be dropped
    try:
        with np.errstate(all="ignore"):
            stored = np.array(value).astype(dtype, casting="unsafe").item()
    except (OverflowError, ValueError, TypeError):
        return False
    if dtype.kind in "fc" and _is_number(value):
        finite = isinstance(value, (int, np.integer)) or bool(np.isfinite(value))
        return bool(np.isfinite(stored)) == finite and (value == value) == (stored == stored)
    return bool(stored == value)


def _kind(dtype: np.dtype[Any]) -> str:
    """Numbers (bool, integers, floats, complex) promote among themselves; text, bytes, dates
    and others only to their own kind (bytes with text would be decoded)."""
    if dtype.kind in "iu":
        return "integer"
    if dtype.kind in "bfc":
        return "number"
    return {"U": "text", "S": "bytes"}.get(dtype.kind, dtype.kind)


def _plain_array(x: Any) -> bool:
    """An ndarray (or memmap) whose stack keeps every value: a masked array's stack drops its mask."""
    return isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray)


def _is_number(x: Any) -> bool:
    return isinstance(x, (Number, np.number)) and not isinstance(x, (bool, np.bool_))


def _padded(items: list[np.ndarray], value: Any, dtype: np.dtype[Any], where: str) -> np.ndarray:
    ndims = {it.ndim for it in items}
    if len(ndims) > 1:
        raise ArgumentError(f"collate: cannot pad arrays of different ranks {sorted(ndims)} in {where}")
    if not fits(value, dtype):
        raise ArgumentError(f"collate: pad={value!r} does not fit {where}'s dtype {dtype}: pick a value it holds")
    shape = tuple(max(sizes) for sizes in zip(*(it.shape for it in items), strict=True))
    out = np.full((len(items), *shape), value, dtype=dtype)
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
        if any(not isinstance(it, (tuple, list)) or len(it) != len(first) for it in items):
            raise ArgumentError(f"collate: samples in {where} have different lengths or types")
        scalar_pad = None if isinstance(pad, dict) else pad
        columns = [_collate([it[j] for it in items], f"{where}[{j}]", deferred, scalar_pad) for j in range(len(first))]
        return tuple(columns) if isinstance(first, tuple) else columns
    if all((type(it) is np.ndarray or _plain_array(it)) and it.dtype != object for it in items):
        dtype = common_dtype([it.dtype for it in items], where)
        check_exact(items, dtype, where)
        shapes = {it.shape for it in items}
        if len(shapes) > 1 and pad is not None and not isinstance(pad, dict):
            return _padded(items, pad, dtype, where)
        if len(shapes) > 1:
            raise ArgumentError(
                f"collate: arrays in {where} have different shapes {sorted(shapes)}; "
                "resize them in a map, pad them with batch(n, pad=0), or pass collate="
            )
        whole = _slots.taken(items)  # the samples were written in their batch rows already
        if whole is not None:
            return whole
        if deferred and first.size:
            return Stacked(items, dtype)
        return np.stack(items).astype(dtype, copy=False)
    if all(_is_number(it) for it in items):
        values = np.asarray(items)
        if values.dtype == object:  # Python ints beyond 64 bits: no NumPy type holds them
            return items
        python_ints = values.dtype.kind == "f" and all(type(it) is int for it in items)
        if python_ints and min(items) >= 0 and max(items) > _INT64_MAX:
            return np.array(items, dtype=np.uint64)  # NumPy would make them float64
        arrays = [np.asarray(it) for it in items]
        common_dtype([a.dtype for a in arrays], where)  # refuses int64 with uint64
        check_exact(arrays, values.dtype, where)
        return values
    if all(isinstance(it, (bool, np.bool_)) for it in items):
        return np.asarray(items, dtype=bool)
    if all(hasattr(it, "numpy") and hasattr(it, "shape") for it in items):
        try:
            arrays = [_as_numpy(it) for it in items]
        except (TypeError, RuntimeError):  # no NumPy dtype (bfloat16) or needs grad: kept as they are
            return items
        return _collate(arrays, where, deferred, pad)
    return items


def _as_numpy(tensor: Any) -> np.ndarray:
    """A tensor's values as a NumPy array; torch's lazy conjugate and negative views resolved
    first (their `.numpy()` refuses them)."""
    for resolve in ("resolve_conj", "resolve_neg"):
        if hasattr(tensor, resolve):
            tensor = getattr(tensor, resolve)()
    return np.asarray(tensor.numpy())
