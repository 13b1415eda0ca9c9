"""A torch map-style dataset as a globalloader source, and a Loader as a torch IterableDataset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from globalloader.errors import ArgumentError
from globalloader.execution.loader import Loader
from globalloader.sources.base import declared_fingerprint
from globalloader.torch.tensors import to_tensors

if TYPE_CHECKING:
    import torch
else:
    from globalloader.torch.tensors import torch


class TorchSource:
    """A map-style `torch.utils.data.Dataset` as a globalloader source (items returned as-is).

    Its `fingerprint` (the key under which `share=True` jobs share decoded samples) is the
    dataset's own `fingerprint` attribute, a str naming its content. A dataset without one has
    no fingerprint here: nothing derived from its class or length could tell two such datasets
    apart, so sharing it is refused rather than risking another job's samples.
    """

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
        fp = declared_fingerprint(self.dataset)
        if not fp:
            raise AttributeError(missing_fingerprint(self.dataset))
        return fp


def missing_fingerprint(dataset: Any) -> str:
    """Why a dataset cannot be shared, and how to make it shareable."""
    return (
        f"{type(dataset).__name__} has no `fingerprint` attribute, so share=True cannot tell its "
        "samples from another dataset's: give it one, a str that changes whenever its content does "
        "(e.g. self.fingerprint = f'{root}:{mtime}')"
    )


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
