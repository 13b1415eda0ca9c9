"""The iterators `DataLoader.__iter__` returns: in the main process, or over a worker pool.

Both follow torch's iterator contract: each pass draws a base seed from the loader's generator
(or torch's global RNG) and then iterates the loader's sampler or batch sampler in the main
process; a sample's error is raised for its own batch and the pass can go on; an iterable
dataset's length, once asked for, warns when more batches come than it announced.

With workers, task `i` goes to worker `i mod num_workers` (skipping workers whose iterable is
exhausted), `prefetch_factor` tasks per worker are in flight, and batches are yielded in task
order (or as they come with `in_order=False`).

Each iterator records where it stands (`position`) and the RNG states its pass started from, so
a DataLoader can resume the pass exactly: restore those states, draw the same seeds, skip the
batches already delivered (map-style: without loading them).
"""

from __future__ import annotations

import itertools
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader.execution.timeline import StepTimeline
from globalloader.torch.collate import as_torch_batch
from globalloader.torch.pool import WorkerPool
from globalloader.torch.tensors import pin, torch
from globalloader.torch.worker import BATCH, EXHAUSTED, FAILED, INLINE, Fetcher, WorkerSpec
from globalloader.transport.codec import decode_tree

if TYPE_CHECKING:
    from globalloader.torch.settings import LoaderSettings


def _draw_seed(generator: Any) -> int:
    """A 64-bit seed from `generator` (None: torch's global RNG), drawn as torch's DataLoader does."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def _samplers(loader: LoaderSettings) -> list[Any]:
    """The loader's sampler objects (batch sampler first), for their generators and epochs."""
    found: list[Any] = []
    for obj in (loader.batch_sampler, loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if obj is not None and all(obj is not f for f in found):
            found.append(obj)
    return found


def rng_snapshot(loader: LoaderSettings) -> dict[str, Any]:
    """The RNG states a pass starts from: torch's global one, the loader's and the samplers' generators."""
    generators = [getattr(s, "generator", None) for s in _samplers(loader)]
    return {
        "torch": torch.get_rng_state(),
        "loader": None if loader.generator is None else loader.generator.get_state(),
        "samplers": [g.get_state() if isinstance(g, torch.Generator) else None for g in generators],
    }


def restore_rng(loader: LoaderSettings, snapshot: dict[str, Any]) -> None:
    """Put back the states of `rng_snapshot` (generators that did not exist then are left alone)."""
    torch.set_rng_state(snapshot["torch"])
    if loader.generator is not None and snapshot["loader"] is not None:
        loader.generator.set_state(snapshot["loader"])
    # not strict: a snapshot from a loader with fewer samplers restores those it has; the others are left alone
    for sampler, state in zip(_samplers(loader), snapshot["samplers"], strict=False):
        generator = getattr(sampler, "generator", None)
        if isinstance(generator, torch.Generator) and state is not None:
            generator.set_state(state)


class Progress:
    """Where one pass stands, kept by the DataLoader (not the iterator, which may be dropped)."""

    __slots__ = ("batches", "busy_s", "snapshot", "timeline", "wait_s")

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot  # RNG states the pass started from
        self.batches = 0  # delivered so far
        self.wait_s = 0.0  # the consumer waiting for workers
        self.busy_s = 0.0  # workers (or the main process) loading
        self.timeline = StepTimeline()  # each batch's wait, for `DataLoader.report()`


class _BaseIter:
    """What both iterators share: the sampler walk, counting, the length warning, pinning."""

    def __init__(self, loader: LoaderSettings, progress: Progress) -> None:
        # No reference to the loader: dropping a loader and its iterator must stop the workers at once.
        self._index_sampler = loader._index_sampler
        self._uses_workers = loader.num_workers > 0
        self._progress = progress
        self._dataset = loader.dataset
        self._iterable = loader._dataset_kind_iterable
        self._auto_collation = loader._auto_collation
        self._pin = loader.pin_memory and _pin_available()
        self._pin_device = loader.pin_memory_device
        self._datapipe = isinstance(loader.dataset, torch.utils.data.IterDataPipe)

    def _start_pass(self, loader: LoaderSettings) -> None:
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called

    def __iter__(self) -> _BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _deliver(self, batch: Any) -> Any:
        self._num_yielded += 1
        self._progress.batches = self._num_yielded
        self._progress.timeline.delivered(self._progress.wait_s if self._uses_workers else self._progress.busy_s)
        if self._iterable and self._len_called is not None and self._num_yielded > self._len_called:
            warnings.warn(
                f"Length of IterableDataset {self._dataset} was reported to be {self._len_called} "
                f"(when accessing len(dataloader)), but {self._num_yielded} samples have been fetched. "
                + (
                    "For multiprocessing data-loading, this could be caused by not properly configuring the "
                    "IterableDataset replica at each worker (shard it with get_worker_info())."
                    if self._uses_workers
                    else ""
                ),
                stacklevel=3,
            )
        return pin(batch, self._pin_device) if self._pin else batch


class InProcessIter(_BaseIter):
    """num_workers=0: samples are loaded in the calling thread, when a batch is asked for."""

    def __init__(self, loader: LoaderSettings, progress: Progress, skip: int = 0) -> None:
        super().__init__(loader, progress)
        dataset = self._dataset
        if self._datapipe:
            rng = torch.Generator()
            rng.manual_seed(_draw_seed(loader.generator))
            dataset = torch.utils.data.graph_settings.apply_random_seed(dataset, rng)
            torch.utils.data.graph_settings.apply_sharding(dataset, 1, 0)
        self._base_seed = _draw_seed(loader.generator)  # drawn as torch does, so the RNG streams match
        self._start_pass(loader)
        default = torch.utils.data.default_collate
        self._fetch = Fetcher(_spec(loader, dataset), dataset, default_collate=default)
        for _ in range(skip):
            self._advance(fetch=self._iterable)
            self._num_yielded += 1

    def _advance(self, fetch: bool = True) -> Any:
        index = next(self._sampler_iter)
        return self._fetch(index) if fetch else None

    def __next__(self) -> Any:
        start = time.perf_counter()
        batch = self._advance()
        self._progress.busy_s += time.perf_counter() - start
        return self._deliver(batch)


class WorkerIter(_BaseIter):
    """num_workers>0: a pool of worker processes, started per iterator or kept (persistent_workers)."""

    _pool: WorkerPool | None = None  # None once shut down

    def __init__(self, loader: LoaderSettings, progress: Progress, skip: int = 0) -> None:
        super().__init__(loader, progress)
        self._num_workers = loader.num_workers
        self._prefetch = (loader.prefetch_factor or 2) * loader.num_workers
        self._in_order = loader.in_order
        self._timeout = loader.timeout
        self._persistent = loader.persistent_workers
        spec = _spec(loader, loader.dataset)
        self._default_collate = spec.collate_fn is None and self._auto_collation
        shared_seed = _draw_seed(loader.generator) if self._datapipe else None
        self._base_seed = _draw_seed(loader.generator)
        context = loader.multiprocessing_context or torch.multiprocessing.get_context()
        self._pool = WorkerPool(spec, context, self._base_seed, shared_seed)
        self._workers = self._pool.procs
        self._generation = 0
        self._reset(loader, progress, first=True, skip=skip)

    def _reset(self, loader: LoaderSettings, progress: Progress, first: bool = False, skip: int = 0) -> None:
        """Start a pass: a new sampler walk, and (persistent workers) fresh dataset iterators."""
        pool = self._live_pool()
        self._progress = progress
        self._start_pass(loader)
        self._generation += 1
        self._active = [True] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        self._waiting: dict[int, int] = {}  # task -> worker, no reply yet
        self._ready: dict[int, tuple[int, int, Any]] = {}  # task -> (worker, kind, payload)
        if not first:
            shared_seed = _draw_seed(loader.generator) if self._datapipe else None
            for w in range(self._num_workers):
                pool.send(w, "reset", self._generation, 0, shared_seed)
        if not self._iterable:  # skip delivered batches without loading them
            for _ in range(skip):
                next(self._sampler_iter, None)
                next(self._cycle)
        self._sent = self._received = skip if not self._iterable else 0
        for _ in range(self._prefetch):
            self._put_task()
        if self._iterable:
            for _ in range(skip):
                self._next_batch()
        self._num_yielded = skip

    def _put_task(self) -> None:
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            return
        for _ in range(self._num_workers):
            worker = next(self._cycle)
            if self._active[worker]:
                break
        else:
            return  # every worker is exhausted
        self._live_pool().send(worker, "task", self._generation, self._sent, index)
        self._waiting[self._sent] = worker
        self._sent += 1

    def _next_batch(self) -> Any:
        while True:
            if not self._in_order and self._ready:
                number = next(iter(self._ready))
                return self._take(number, *self._ready.pop(number))
            while self._received < self._sent:
                if self._received in self._ready:
                    break
                worker = self._waiting.get(self._received)
                if worker is not None and self._active[worker]:
                    break
                self._waiting.pop(self._received, None)  # its worker ran out of items: nothing will come
                self._received += 1
            else:
                if not self._persistent:
                    self._shutdown_workers()
                raise StopIteration
            if self._received in self._ready:
                number = self._received
                return self._take(number, *self._ready.pop(number))
            start = time.perf_counter()
            pool = self._live_pool()
            worker, (generation, number, kind, payload, busy) = pool.receive(self._timeout)
            self._progress.wait_s += time.perf_counter() - start
            if generation != self._generation:  # a reply to an earlier pass: drop it
                if kind == BATCH:
                    self._drop(worker, payload)
                continue
            self._progress.busy_s += busy
            self._waiting.pop(number, None)
            if kind == BATCH:  # map it now: once mapped, its worker may stop without taking it away
                payload = pool.reader.read(payload, pool.freed[worker].append)
            elif kind == INLINE:
                tree, data = payload
                payload = decode_tree(tree, np.frombuffer(data, np.uint8))
            elif kind == EXHAUSTED:
                self._active[worker] = False
                if not self._persistent:
                    pool.stop(worker)
                self._put_task()
                continue
            if number == self._received or not self._in_order:
                return self._take(number, worker, kind, payload)
            self._ready[number] = (worker, kind, payload)

    def _take(self, number: int, worker: int, kind: int, payload: Any) -> Any:
        if number == self._received:
            self._received += 1
        self._put_task()
        if kind == FAILED:
            exc, tb = payload
            if tb:
                exc.__cause__ = _RemoteTraceback(f"in DataLoader worker {worker}:\n{tb}")
            raise exc
        return as_torch_batch(payload) if self._default_collate else payload

    def _drop(self, worker: int, payload: Any) -> None:
        pool = self._live_pool()
        name = pool.reader.discard(payload)
        if name is not None:
            pool.freed[worker].append(name)

    def _live_pool(self) -> WorkerPool:
        if self._pool is None:
            raise StopIteration  # shut down: the pass is over
        return self._pool

    def __next__(self) -> Any:
        return self._deliver(self._next_batch())

    def _shutdown_workers(self) -> None:
        """Stop the workers now (also what `del` of the iterator does)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    close = _shutdown_workers

    def __del__(self) -> None:
        self._shutdown_workers()


class _RemoteTraceback(Exception):
    """Carries a worker's traceback text as the cause of the re-raised error."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _pin_available() -> bool:
    from globalloader.torch.tensors import accelerator_available

    return accelerator_available()


def _spec(loader: LoaderSettings, dataset: Any) -> WorkerSpec:
    """What workers need; `collate_fn` None means torch's default_collate, done the stacked way."""
    default = loader._auto_collation and loader.collate_fn is torch.utils.data.default_collate
    return WorkerSpec(
        dataset=dataset,
        iterable=loader._dataset_kind_iterable,
        auto_collation=loader._auto_collation,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        collate_fn=None if default else loader.collate_fn,
        worker_init_fn=loader.worker_init_fn,
        num_workers=loader.num_workers,
    )
