"""`DataLoader`: torch.utils.data.DataLoader's behaviour, faster, with globalloader's extras.

The constructor, attributes, `len()`, samplers, seeding, worker contract and iterator semantics
are torch's (see `iterators` and `worker`); what differs is underneath: batches come back from
workers through shared memory in one copy (no pickled queue, no per-batch file descriptors), and
the default collate stacks samples straight into that memory. On top: exact mid-pass resume
(`state_dict()` / `load_state_dict()`, see `resume`), a Loader's per-stage figures (`stats()`,
`report()`), `set_epoch()` passed on to a sampler that has one, and `share=True`: the job fed by
the machine's global loader server.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from globalloader.errors import ArgumentError, ArgumentTypeError, StateError
from globalloader.execution import report as input_report
from globalloader.execution.stats import LoaderStats
from globalloader.torch.iterators import InProcessIter, WorkerIter
from globalloader.torch.resume import STATE_KIND, Progress, Resume, check_state, make_state, restore_rng, rng_snapshot
from globalloader.torch.rng import process_rng, set_process_rng
from globalloader.torch.shared import shared_loader
from globalloader.torch.tensors import to_tensors

if TYPE_CHECKING:
    import torch
else:
    from globalloader.torch.tensors import torch

T_co = TypeVar("T_co", covariant=True)

_FIXED_AFTER_INIT = frozenset({"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"})


class _EndlessSampler(torch.utils.data.Sampler):
    """The sampler of an iterable dataset: no indices, only a count of items to take."""

    def __iter__(self) -> Iterator[None]:
        while True:
            yield None


class DataLoader(Generic[T_co]):
    """Drop-in for `torch.utils.data.DataLoader` (same arguments, same order, same results).

    Extra keyword arguments: `share` (False, True or "auto": load through the global loader
    server; map-style datasets with a `fingerprint` attribute, batch_size/shuffle/drop_last/
    collate_fn/num_workers/timeout only) and `server` (its socket path; default: the user's own).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        share: bool | str = False,
        server: str | None = None,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ArgumentError(
                f"num_workers option should be non-negative, got {num_workers!r}; use num_workers=0 "
                "to load in the main process"
            )
        if timeout < 0:
            raise ArgumentError(f"timeout option should be non-negative, got {timeout!r} (0 waits for ever)")
        if num_workers == 0 and prefetch_factor is not None:
            raise ArgumentError(
                "prefetch_factor option could only be specified in multiprocessing: set num_workers > 0, "
                "or leave prefetch_factor=None"
            )
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ArgumentError(f"prefetch_factor option should be >= 1, got {prefetch_factor!r}")
        if persistent_workers and num_workers == 0:
            raise ArgumentError("persistent_workers option needs num_workers > 0")
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if iterable:
            if isinstance(dataset, torch.utils.data.IterDataPipe):
                if shuffle is not None:
                    dataset = torch.utils.data.graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)
            elif shuffle not in (False, None):
                raise ArgumentError(
                    f"DataLoader with IterableDataset: expected unspecified shuffle option, but got "
                    f"shuffle={shuffle}; an iterable dataset shuffles itself"
                )
            if sampler is not None:
                raise ArgumentError(
                    f"DataLoader with IterableDataset: expected unspecified sampler option, but got "
                    f"sampler={sampler}; an iterable dataset decides its own order"
                )
            if batch_sampler is not None:
                raise ArgumentError(
                    f"DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
                    f"batch_sampler={batch_sampler}; use batch_size="
                )
        else:
            shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ArgumentError("sampler option is mutually exclusive with shuffle: shuffle in the sampler")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ArgumentError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
                    "drop_last: the batch sampler decides all of them"
                )
            batch_size, drop_last = None, False
        elif batch_size is None and drop_last:
            raise ArgumentError(
                "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
            )
        if sampler is None:
            if iterable:
                sampler = _EndlessSampler()
            elif shuffle:
                sampler = torch.utils.data.RandomSampler(dataset, generator=generator)
            else:
                sampler = torch.utils.data.SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
        if collate_fn is None:
            auto = batch_sampler is not None
            collate_fn = torch.utils.data.default_collate if auto else torch.utils.data.default_convert

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = 2 if num_workers > 0 and prefetch_factor is None else prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self._dataset_kind_iterable = iterable
        self._IterableDataset_len_called: int | None = None
        self._iterator: Any = None
        self._progress: Progress | None = None  # of the current pass (state_dict)
        self.statistics = LoaderStats()  # every pass's stages and loop clock, for stats() and report()
        self._resume: tuple[Resume, dict[str, Any]] | None = None  # (how, state) for the next iter()
        self._shared = shared_loader(self, share, server) if share else None
        _warn_if_too_many_workers(num_workers)
        object.__setattr__(self, "_initialized", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIXED_AFTER_INIT and getattr(self, "_initialized", False):
            raise ArgumentError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized: "
                "its samplers were built from it; make a new DataLoader instead"
            )
        super().__setattr__(name, value)

    @property
    def multiprocessing_context(self) -> Any:
        return self._multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        if context is not None:
            if self.num_workers == 0:
                raise ArgumentError(
                    f"multiprocessing_context={context!r} can only be used with multi-process loading "
                    f"(num_workers > 0), but got num_workers={self.num_workers}"
                )
            if isinstance(context, str):
                methods = torch.multiprocessing.get_all_start_methods()
                if context not in methods:
                    raise ArgumentError(
                        f"multiprocessing_context option should specify a valid start method in {methods!r}, "
                        f"but got multiprocessing_context={context!r}"
                    )
                context = torch.multiprocessing.get_context(context)
            if not isinstance(context, multiprocessing.context.BaseContext):
                raise ArgumentTypeError(
                    "multiprocessing_context option should be a valid context object or a string specifying "
                    f"the start method, but got multiprocessing_context={context!r}"
                )
        self._multiprocessing_context = context

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        if self._shared is not None:
            return len(self._shared)
        if self._dataset_kind_iterable:
            length = len(self.dataset)
            object.__setattr__(self, "_IterableDataset_len_called", length)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else -(-length // self.batch_size)
            return length
        return len(self._index_sampler)

    def __iter__(self) -> Iterator[T_co]:
        if self._shared is not None:
            return (to_tensors(batch) for batch in self._shared)
        pending, self._resume = self._resume, None
        resume = None
        if pending is not None:
            resume, state = pending
            restore_rng(self, state["rng"])
        progress = Progress(rng_snapshot(self))
        self.statistics.new_pass()
        if self.persistent_workers:  # only with num_workers > 0 (checked when built)
            if resume is not None and self._iterator is not None:
                self.close()  # its workers run another pass: start them from the state's seeds
            if self._iterator is None:
                self._iterator = WorkerIter(self, progress, resume)
            else:
                self._iterator._reset(self, progress)
            iterator: Any = self._iterator
        elif self.num_workers > 0:
            iterator = WorkerIter(self, progress, resume)
        else:
            iterator = InProcessIter(self, progress, resume)
        if pending is not None and pending[1]["process_rng"] is not None:
            # after the pass's own draws: where this process's RNGs stood when the state was taken
            set_process_rng(pending[1]["process_rng"], "process_rng")
        self._progress = progress
        return iterator

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler (e.g. DistributedSampler) which epoch starts; its order depends on it."""
        if self._shared is not None:
            self._shared.set_epoch(epoch)
            return
        samplers: tuple[Any, ...] = (self.sampler, getattr(self.batch_sampler, "sampler", None), self.batch_sampler)
        for sampler in samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                return

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands: load it into a DataLoader built the same way to go on
        from the next batch, with the same order, seeds and in-worker random values.

        Plain data (ints, strs, bools, None, lists and dicts of them): it can be saved as JSON.
        """
        if self._shared is not None:
            return {"kind": STATE_KIND, "shared": self._shared.state_dict()}
        if self._resume is not None:  # loaded, not yet resumed: still the loaded state's position
            return self._resume[1]
        progress = self._progress
        if progress is None:  # no pass yet: the next one starts from the RNGs as they are
            return make_state(self, Progress(rng_snapshot(self)), self._sampler_epoch(), None)
        if not self.in_order and self.num_workers > 0 and progress.batches > 0 and not progress.done:
            raise StateError(
                "state_dict: with in_order=False the batches taken so far are not the first ones of the "
                "pass, so no position can resume it; build the DataLoader with in_order=True to checkpoint mid-pass"
            )
        return make_state(self, progress, self._sampler_epoch(), process_rng())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next `iter()` continue the pass `state` was taken from.

        Refused with a `StateError` if the state is malformed, out of range, or was taken from a
        DataLoader built differently (the message says what differs).
        """
        if self._shared is not None:
            if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
                raise StateError(f"load_state_dict: not a {STATE_KIND} state dict (got {type(state).__name__})")
            if "shared" not in state:
                raise StateError("load_state_dict: this state comes from a DataLoader without share=")
            self._shared.load_state_dict(state["shared"])
            return
        resume = check_state(self, state)
        if state["epoch"] is not None:
            self.set_epoch(state["epoch"])
        self._resume = (resume, state)

    def stats(self) -> dict[str, Any]:
        """What `globalloader.Loader.stats()` gives, over every pass so far: per stage (`fetch`:
        the dataset's samples, `collate`, `transport`: into shared memory) items and busy seconds;
        the workers' tasks, busy and idle seconds; the loop's batches, wait and own time."""
        return self._shared.stats() if self._shared is not None else self.statistics.report()

    def report(self, path: str | os.PathLike[str] = "input-report.html") -> Path:
        """Write one self-contained HTML page on this DataLoader's run so far: throughput over
        time, time per stage, the loop's wait per batch and a diagnosis (see `globalloader.Loader.report`)."""
        if self._shared is not None:
            return self._shared.report(path)
        step = "batch" if self._auto_collation else "sample"
        record = input_report.RunRecord.of(self.statistics, self.num_workers, step)
        return input_report.write(path, record, title="globalloader.torch.DataLoader input report")

    def close(self) -> None:
        """Stop persistent workers now (they also stop when the DataLoader is collected)."""
        if self._iterator is not None:
            self._iterator.close()
            object.__setattr__(self, "_iterator", None)
        if self._shared is not None:
            self._shared.close()

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sampler_epoch(self) -> int | None:
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            epoch = getattr(sampler, "epoch", None)
            if isinstance(epoch, int):
                return epoch
        return None


def _warn_if_too_many_workers(num_workers: int) -> None:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if num_workers > cpus:
        warnings.warn(
            f"DataLoader: num_workers={num_workers} is more than the {cpus} CPUs this process may use; "
            "excessive worker creation might get DataLoader running slow or even freeze, lower num_workers",
            UserWarning,
            stacklevel=3,
        )
