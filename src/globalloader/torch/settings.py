"""What a pass reads of its DataLoader: the arguments it was built with and the flags derived from them.

The iterators and the shared chain take a `LoaderSettings`, not the `DataLoader` class: the
DataLoader imports them, so their importing it back (even for type hints) would be an import
cycle. `DataLoader` has every member, so type checkers accept it wherever this is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from globalloader.execution.stats import LoaderStats


class LoaderSettings(Protocol):
    """The members of `globalloader.torch.DataLoader` that its iterators and shared chain read."""

    dataset: Any
    batch_size: int | None
    sampler: Any
    batch_sampler: Any
    num_workers: int
    collate_fn: Callable[[Any], Any]
    pin_memory: bool
    pin_memory_device: str
    drop_last: bool
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    generator: Any
    prefetch_factor: int | None
    persistent_workers: bool
    in_order: bool
    _dataset_kind_iterable: bool
    _IterableDataset_len_called: int | None  # what len() reported for an iterable dataset, if asked
    statistics: LoaderStats  # the run's time per stage and the loop's clock, over every pass

    @property
    def _auto_collation(self) -> bool: ...

    @property
    def _index_sampler(self) -> Any: ...
