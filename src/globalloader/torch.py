"""PyTorch adapters: tensors out, torch datasets in, and a drop-in `DataLoader`.

Batches cross from workers to the consumer as NumPy arrays in shared memory and become tensors
in the consumer with `torch.from_numpy` (no copy), so the transport stays fast and a tensor keeps
its shared-memory segment alive for exactly as long as it lives.

Switching a training script is one line:

    from globalloader.torch import DataLoader   # was: from torch.utils.data import DataLoader
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from globalloader._extras import require
from globalloader.dataset.chain import Dataset
from globalloader.dataset.collate import collate as numpy_collate
from globalloader.dataset.fingerprint import digest
from globalloader.errors import ArgumentError
from globalloader.execution.loader import Loader

torch = require("torch", "torch")


def to_tensors(batch: Any) -> Any:
    """NumPy arrays anywhere in a nested batch -> tensors sharing their memory."""
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch) if batch.dtype != object else batch
    if isinstance(batch, dict):
        return {k: to_tensors(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_tensors(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_tensors(v) for v in batch)
    return batch


def collate(samples: list[Any]) -> Any:
    """The default collate, returning tensors (use in-process; across processes keep NumPy)."""
    return to_tensors(numpy_collate(samples))


class TorchSource:
    """A map-style `torch.utils.data.Dataset` as a globalloader source (items returned as-is)."""

    def __init__(self, dataset: Any) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ArgumentError(
                f"dataset must be a map-style torch Dataset (len() and [i]), got {type(dataset).__name__}"
            )
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    @property
    def fingerprint(self) -> str:
        fp = getattr(self.dataset, "fingerprint", None)
        return fp if isinstance(fp, str) else digest(type(self.dataset).__qualname__, len(self.dataset))


class IterableDataset(torch.utils.data.IterableDataset):
    """A Loader as a torch IterableDataset (use with `torch.utils.data.DataLoader(batch_size=None)`,
    or iterate it directly); yields tensors."""

    def __init__(self, loader: Loader) -> None:
        super().__init__()
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return (to_tensors(batch) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class DataLoader:
    """`torch.utils.data.DataLoader`'s common arguments, backed by a globalloader Loader.

    Differences that help: workers persist across epochs, batches travel through shared memory,
    order depends only on `seed` and the epoch (`set_epoch`), and `state_dict()` resumes exactly
    mid-epoch. `sampler`, `batch_sampler` and `worker_init_fn` are not supported (an error says
    so); `pin_memory` and `persistent_workers` are accepted (workers always persist).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool = False,
        num_workers: int = 0,
        drop_last: bool = False,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int | None = None,
        mode: str = "process",
        on_error: str = "raise",
        pin_memory: bool = False,
        persistent_workers: bool = True,
        timeout: float = 300.0,
        sampler: Any = None,
        batch_sampler: Any = None,
        worker_init_fn: Any = None,
    ) -> None:
        for name, value in (("sampler", sampler), ("batch_sampler", batch_sampler), ("worker_init_fn", worker_init_fn)):
            if value is not None:
                raise ArgumentError(f"DataLoader: {name} is not supported; use shuffle=/seed= and Dataset.shard()")
        chain = Dataset(TorchSource(dataset))
        if shuffle:
            chain = chain.shuffle(seed)
        if batch_size is not None:
            chain = chain.batch(batch_size, drop_last=drop_last, collate=collate_fn or numpy_collate)
        elif collate_fn is not None:
            chain = chain.map(collate_fn)
        prefetch = None if prefetch_factor is None else max(1, prefetch_factor * max(1, num_workers))
        self.loader = Loader(chain, workers=num_workers, mode=mode, prefetch=prefetch, on_error=on_error, timeout=timeout)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            batch = to_tensors(batch)
            yield _pin(batch) if self.pin_memory else batch

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        return self.loader.stats()

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pin(v) for v in batch)
    return batch
