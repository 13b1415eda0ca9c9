"""torch's `default_collate`, with array stacks left for the shared-memory transport to fill.

In a worker, `torch.utils.data.default_collate` stacks a batch into a fresh shared-memory tensor
that a pickled queue then hands over by file descriptor. Here the common leaves (tensors and
NumPy arrays of one shape and dtype, Python and NumPy numbers) become `Stacked` arrays that the
transport stacks straight into its segment: one copy per batch. Anything else (dict or list
subclasses, unequal shapes, nested or non-CPU tensors, unknown types) goes to torch's own
`default_collate`, so results and errors are torch's. The consumer turns the numeric arrays back
into tensors (`tensors.to_tensors`), giving exactly the types `default_collate` gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from globalloader.dataset.collate import Stacked
from globalloader.torch.tensors import NUMERIC_KINDS, torch

_NUMBERS = {float: np.float64, int: np.int64, bool: np.bool_}


def stack_collate(samples: list[Any]) -> Any:
    """`default_collate(samples)` with equal-shaped arrays left as `Stacked` (worker side)."""
    elem = samples[0]
    kind = type(elem)
    if kind is torch.Tensor:
        arrays = _tensor_arrays(samples)
        return torch.utils.data.default_collate(samples) if arrays is None else _stack(arrays)
    if kind is np.ndarray or kind is np.memmap:
        if elem.dtype.kind in NUMERIC_KINDS and all(
            type(s) is kind and s.dtype == elem.dtype and s.shape == elem.shape for s in samples
        ):
            return _stack(samples)
    elif kind in _NUMBERS:
        if all(type(s) is kind for s in samples):
            try:
                return np.array(samples, dtype=_NUMBERS[kind])
            except OverflowError:
                pass  # ints beyond int64: torch says what is wrong
    elif isinstance(elem, np.generic) and elem.dtype.kind in NUMERIC_KINDS:
        if all(type(s) is kind for s in samples):
            return np.array(samples)
    elif kind is str or kind is bytes:
        return samples
    elif kind is dict:
        if all(type(s) is dict and s.keys() == elem.keys() for s in samples):
            return {key: stack_collate([s[key] for s in samples]) for key in elem}
    elif isinstance(elem, tuple) and hasattr(kind, "_fields"):
        if all(type(s) is kind for s in samples):
            return kind(*(stack_collate(list(column)) for column in zip(*samples, strict=True)))
    elif (kind is tuple or kind is list) and all(type(s) is kind and len(s) == len(elem) for s in samples):
        return [stack_collate(list(column)) for column in zip(*samples, strict=True)]
    return torch.utils.data.default_collate(samples)


def _tensor_arrays(samples: list[Any]) -> list[np.ndarray] | None:
    """NumPy views of equal plain CPU tensors, or None when torch must stack them itself."""
    first = samples[0]
    if first.device.type != "cpu" or first.layout != torch.strided or first.is_nested:
        return None
    shape, dtype = first.shape, first.dtype
    arrays = []
    for s in samples:
        if (
            type(s) is not torch.Tensor
            or s.shape != shape
            or s.dtype != dtype
            or s.requires_grad
            or s.device.type != "cpu"
            or s.is_conj()
            or s.is_neg()
        ):
            return None
        try:
            arrays.append(s.numpy())
        except (TypeError, RuntimeError):
            return None  # no NumPy dtype (bfloat16...)
    return arrays


def _stack(arrays: list[np.ndarray]) -> Any:
    """A lazy stack, or a real one when empty (the transport sends empty arrays inline)."""
    stacked = Stacked(arrays)
    return stacked if stacked.nbytes else np.stack(arrays)
