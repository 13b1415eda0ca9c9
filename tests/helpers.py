"""Shared test helpers: the save/restore/compare check run against every operator and the Loader."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def same(a: Any, b: Any) -> bool:
    """Deep equality for batches: dicts, sequences, NumPy arrays and tensors (dtype and shape too)."""
    if type(a).__module__ == "torch" and type(b).__module__ == "torch":
        a, b = a.numpy(), b.numpy()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            and a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_resume(make: Callable[[], Any], at: int) -> list[Any]:
    """Take `at` items, save state, and check a fresh object loaded with it yields exactly the
    rest of an uninterrupted run. `make()` returns a DatasetIterator or a Loader. Returns the
    uninterrupted run."""
    first = make()
    full = list(iter(first))
    obj = make()
    it = iter(obj)
    head = [next(it) for _ in range(at)]
    state = obj.state_dict()
    assert same(head, full[:at]), "the interrupted run differs from the uninterrupted one"
    fresh = make()
    fresh.load_state_dict(state)
    rest = list(iter(fresh))
    assert same(rest, full[at:]), f"resume after {at} of {len(full)} items does not continue exactly"
    for o in (first, obj, fresh):
        if hasattr(o, "close"):
            o.close()
    return full
