"""NumPy batches as tensors, and pinning for the accelerator.

Batches cross from workers to the consumer as arrays in shared memory and become tensors in the
consumer with `torch.from_numpy` (no copy), so a tensor keeps its segment alive for exactly as
long as it lives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from globalloader._extras import require
from globalloader.dataset.collate import collate as numpy_collate

torch = require("torch", "torch")

# dtype kinds a tensor can hold: bool, signed and unsigned int, float, complex
NUMERIC_KINDS = frozenset("biufc")


def to_tensors(batch: Any) -> Any:
    """Numeric NumPy arrays anywhere in a nested batch -> tensors sharing their memory (other arrays
    stay as they are); containers keep their type (see `_rebuild`). The one walk: the drop-in
    DataLoader's batches take it too."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch) if batch.dtype.kind in NUMERIC_KINDS else batch
    if isinstance(batch, dict):
        return _rebuild(batch, {k: to_tensors(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_tensors(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [to_tensors(v) for v in batch])
    return batch


def collate(samples: list[Any]) -> Any:
    """globalloader's default collate, returning tensors (use in-process; across processes keep NumPy)."""
    return to_tensors(numpy_collate(samples))


def accelerator_available() -> bool:
    """True when pinned host memory can speed up copies to a device (CUDA, XPU...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def pin(batch: Any, device: str = "") -> Any:
    """Pin every tensor of a batch; objects with their own `pin_memory()` method pin themselves."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory(device) if device else batch.pin_memory()
    if isinstance(batch, dict):
        return _rebuild(batch, {k: pin(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pin(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [pin(v, device) for v in batch])
    if hasattr(batch, "pin_memory"):
        return batch.pin_memory()
    return batch


def _rebuild(original: Any, items: Any) -> Any:
    """A container of `original`'s type holding `items` (made from `original`'s own items). A
    subclass whose items are all unchanged is kept as it is (its constructor may take other
    arguments, as `defaultdict`'s does); one that cannot be rebuilt becomes the plain builtin."""
    kind = type(original)
    if kind is type(items):  # a plain dict or list: `items` is it
        return items
    if isinstance(original, dict):
        if all(items[k] is v for k, v in original.items()):
            return original
    elif all(new is old for new, old in zip(items, original, strict=True)):
        return original
    try:
        return kind(items)
    except TypeError:
        return dict(items) if isinstance(items, dict) else list(items)
